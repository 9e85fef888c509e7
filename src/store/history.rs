//! Delivery history (issue 19, decision 0081): every step of one delivery,
//! oldest first. The row itself tells when it was materialized, its latest
//! lease and its ACK; `delivery_history` holds only what the row forgets —
//! a lease that ended without ACK, a refused ACK, an admin's retry — so a
//! delivery leased once and ACKed writes nothing here. Sessions tell the
//! node of each lease and how a session closed while it held one.

use std::collections::{HashMap, HashSet};

use entity::{audit_record, delivery, delivery_history, event_session};
use sea_orm::{
    ColumnTrait, ConnectionTrait, EntityTrait, QueryFilter, QueryOrder, Set,
    sea_query::{Expr, ExprTrait, Query},
};
use serde::Serialize;

use crate::{
    domain::schema::{Id, Time, Uint64String},
    domain::{DeliveryState, SessionId, Timestamp, now},
    store::StoreError,
};

/// What a step of the history was.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
#[schema(as = DeliveryStepKind)]
pub enum StepKind {
    // Declared in the order steps take at the same microsecond: a row
    // materialized and leased in one claim, a lapse recovered by the claim
    // that leases the row again.
    Materialized,
    LeaseLapsed,
    Retried,
    Leased,
    AckRefused,
    SessionClosed,
    Acked,
}

impl StepKind {
    fn stored(self) -> &'static str {
        match self {
            StepKind::LeaseLapsed => "LEASE_LAPSED",
            StepKind::AckRefused => "ACK_REFUSED",
            StepKind::Retried => "RETRIED",
            _ => "",
        }
    }
}

/// One step of a delivery's history (`GET …/deliveries/{id}/history`).
/// Fields that do not apply to the step are omitted, never null.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
#[schema(as = DeliveryStep)]
pub struct Step {
    pub step: StepKind,
    /// When it happened.
    #[schema(value_type = Time)]
    pub at: Timestamp,
    /// LEASED, LEASE_LAPSED, SESSION_CLOSED, ACKED: the lease's epoch;
    /// ACK_REFUSED: the epoch the ACK offered.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Uint64String>, nullable = false)]
    pub epoch: Option<String>,
    /// The lease's session; ACKED: the session the ACK came on;
    /// ACK_REFUSED: the session that sent it.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Id>, nullable = false)]
    pub session_id: Option<String>,
    /// The node of `session_id` (omitted once that session's record was
    /// purged, `retention.acked_deliveries_max_age_s` after it closed).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Id>, nullable = false)]
    pub node_id: Option<String>,
    /// LEASED: when the lease began.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Time>, nullable = false)]
    pub leased_at: Option<Timestamp>,
    /// LEASED: when the lease lapses (or lapsed).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Time>, nullable = false)]
    pub lease_until: Option<Timestamp>,
    /// LEASE_LAPSED: PENDING (offered again) or EXPIRED (budget spent);
    /// RETRIED: PENDING.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<crate::domain::schema::DeliveryStateName>, nullable = false)]
    pub state: Option<DeliveryState>,
    /// LEASE_LAPSED, RETRIED: the delivery's attempts after the step.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    pub attempts: Option<i32>,
    /// LEASE_LAPSED, RETRIED: the attempt budget after the step.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    pub attempt_budget: Option<i32>,
    /// SESSION_CLOSED: the WebSocket close code (1006: the connection
    /// ended without a close frame).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    pub close_code: Option<i32>,
    /// SESSION_CLOSED: the close reason; RETRIED: the admin's reason.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    pub reason: Option<String>,
    /// RETRIED: the credential that retried.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Id>, nullable = false)]
    pub credential_id: Option<String>,
    /// RETRIED: attempts added to the budget.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    pub additional_attempts: Option<i32>,
}

impl Step {
    fn new(step: StepKind, at: i64) -> Step {
        Step {
            step,
            at: Timestamp(at),
            epoch: None,
            session_id: None,
            node_id: None,
            leased_at: None,
            lease_until: None,
            state: None,
            attempts: None,
            attempt_budget: None,
            close_code: None,
            reason: None,
            credential_id: None,
            additional_attempts: None,
        }
    }
}

/// Refused ACKs recorded per delivery: a consumer sending a wrong proof in a
/// loop cannot grow the table without bound.
pub const MAX_REFUSALS_RECORDED: i64 = 32;

/// Records the leases that `recovered` (rows as returned by the recovery's
/// `UPDATE`, which keeps the lease's session and times) ended without ACK.
pub async fn record_lapses<C: ConnectionTrait>(
    conn: &C,
    recovered: &[delivery::Model],
    at: Timestamp,
) -> Result<(), StoreError> {
    let rows = recovered.iter().map(|d| delivery_history::ActiveModel {
        delivery_id: Set(d.id.clone()),
        step: Set(StepKind::LeaseLapsed.stored().to_owned()),
        at: Set(at.micros()),
        lease_epoch: Set(d.lease_epoch),
        session_id: Set(d.lease_session_id.clone()),
        leased_at: Set(d.leased_at),
        lease_until: Set(d.lease_until),
        state_after: Set(Some(d.state.as_str().to_owned())),
        attempts: Set(d.attempts),
        attempt_budget: Set(d.attempt_budget),
        ..Default::default()
    });
    insert(conn, rows).await
}

/// Records admin retries of `retried` (rows after the retry), all under
/// the audit record `audit_id`.
pub async fn record_retries<C: ConnectionTrait>(
    conn: &C,
    retried: &[delivery::Model],
    audit_id: &str,
    additional_attempts: u32,
    at: Timestamp,
) -> Result<(), StoreError> {
    let rows = retried.iter().map(|d| delivery_history::ActiveModel {
        delivery_id: Set(d.id.clone()),
        step: Set(StepKind::Retried.stored().to_owned()),
        at: Set(at.micros()),
        lease_epoch: Set(d.lease_epoch),
        state_after: Set(Some(d.state.as_str().to_owned())),
        attempts: Set(d.attempts),
        attempt_budget: Set(d.attempt_budget),
        audit_id: Set(Some(audit_id.to_owned())),
        additional_attempts: Set(i32::try_from(additional_attempts).ok()),
        ..Default::default()
    });
    insert(conn, rows).await
}

/// A refused ACK (`DELIVERY_LEASE_LOST`) of a delivery of the session's
/// own subscription.
#[derive(Debug, Clone)]
pub struct Refusal<'a> {
    pub delivery_id: &'a str,
    pub attempts: i32,
    pub attempt_budget: i32,
    pub offered_epoch: u64,
    pub session_id: &'a SessionId,
}

/// Records refused ACKs, at most [`MAX_REFUSALS_RECORDED`] per delivery
/// (the count is checked inside each `INSERT … SELECT`).
pub async fn record_refusals<C: ConnectionTrait>(
    conn: &C,
    refusals: &[Refusal<'_>],
    at: Timestamp,
) -> Result<(), StoreError> {
    use delivery_history::Column as H;
    for r in refusals {
        let recorded = Query::select()
            .expr(Expr::col(H::Id).count())
            .from(delivery_history::Entity)
            .and_where(H::DeliveryId.eq(r.delivery_id))
            .and_where(H::Step.eq(StepKind::AckRefused.stored()))
            .to_owned();
        let values = Query::select()
            .exprs([
                Expr::val(r.delivery_id),
                Expr::val(StepKind::AckRefused.stored()),
                Expr::val(at.micros()),
                Expr::val(i64::try_from(r.offered_epoch).unwrap_or(i64::MAX)),
                Expr::val(r.session_id.as_str()),
                Expr::val(r.attempts),
                Expr::val(r.attempt_budget),
            ])
            .and_where(
                Expr::expr(Expr::SubQuery(None, Box::new(recorded.into())))
                    .lt(MAX_REFUSALS_RECORDED),
            )
            .to_owned();
        let statement = Query::insert()
            .into_table(delivery_history::Entity)
            .columns([
                H::DeliveryId,
                H::Step,
                H::At,
                H::LeaseEpoch,
                H::SessionId,
                H::Attempts,
                H::AttemptBudget,
            ])
            .select_from(values)
            .map_err(|e| StoreError::invariant(format!("refusal insert: {e}")))?
            .to_owned();
        conn.execute(&statement).await?;
    }
    Ok(())
}

async fn insert<C: ConnectionTrait>(
    conn: &C,
    rows: impl Iterator<Item = delivery_history::ActiveModel>,
) -> Result<(), StoreError> {
    let rows: Vec<_> = rows.collect();
    if rows.is_empty() {
        return Ok(());
    }
    delivery_history::Entity::insert_many(rows)
        .exec_without_returning(conn)
        .await?;
    Ok(())
}

/// Deletes the history of these deliveries (retention purges it with them).
pub async fn delete_of<C: ConnectionTrait>(
    conn: &C,
    delivery_ids: &[String],
) -> Result<(), StoreError> {
    if delivery_ids.is_empty() {
        return Ok(());
    }
    delivery_history::Entity::delete_many()
        .filter(delivery_history::Column::DeliveryId.is_in(delivery_ids.iter().map(String::as_str)))
        .exec(conn)
        .await?;
    Ok(())
}

/// The steps of `d`, oldest first: its row, its history rows, the sessions
/// of its leases and the audit records of its retries (four index lookups).
pub async fn steps_of<C: ConnectionTrait>(
    conn: &C,
    d: &delivery::Model,
) -> Result<Vec<Step>, StoreError> {
    let rows = delivery_history::Entity::find()
        .filter(delivery_history::Column::DeliveryId.eq(d.id.as_str()))
        .order_by_asc(delivery_history::Column::Id)
        .all(conn)
        .await?;
    let mut session_ids: HashSet<&str> = rows
        .iter()
        .filter_map(|r| r.session_id.as_deref())
        .collect();
    session_ids.extend(d.lease_session_id.as_deref());
    session_ids.extend(d.ack_session_id.as_deref());
    let sessions: HashMap<String, event_session::Model> = event_session::Entity::find()
        .filter(event_session::Column::Id.is_in(session_ids))
        .all(conn)
        .await?
        .into_iter()
        .map(|s| (s.id.clone(), s))
        .collect();
    let audit_ids: HashSet<&str> = rows.iter().filter_map(|r| r.audit_id.as_deref()).collect();
    let audits: HashMap<String, audit_record::Model> = if audit_ids.is_empty() {
        HashMap::new()
    } else {
        audit_record::Entity::find()
            .filter(audit_record::Column::Id.is_in(audit_ids))
            .all(conn)
            .await?
            .into_iter()
            .map(|a| (a.id.clone(), a))
            .collect()
    };
    Ok(compose(d, &rows, &sessions, &audits, now()))
}

/// A lease as the history shows it, and when it ended (`None`: still held).
struct Lease<'a> {
    epoch: i64,
    session_id: Option<&'a str>,
    leased_at: Option<i64>,
    lease_until: Option<i64>,
    ended_at: Option<i64>,
}

fn compose(
    d: &delivery::Model,
    rows: &[delivery_history::Model],
    sessions: &HashMap<String, event_session::Model>,
    audits: &HashMap<String, audit_record::Model>,
    now: Timestamp,
) -> Vec<Step> {
    let node_of = |session: Option<&str>| {
        session
            .and_then(|s| sessions.get(s))
            .map(|s| s.node_id.clone())
    };
    let mut steps = vec![Step::new(StepKind::Materialized, d.created_at)];
    let mut leases: Vec<Lease<'_>> = Vec::new();
    for r in rows {
        let mut step = Step::new(StepKind::Materialized, r.at);
        step.attempts = Some(r.attempts);
        step.attempt_budget = Some(r.attempt_budget);
        step.state = r.state_after.as_deref().and_then(DeliveryState::parse);
        match r.step.as_str() {
            "LEASE_LAPSED" => {
                step.step = StepKind::LeaseLapsed;
                step.epoch = Some(r.lease_epoch.to_string());
                step.session_id = r.session_id.clone();
                leases.push(Lease {
                    epoch: r.lease_epoch,
                    session_id: r.session_id.as_deref(),
                    leased_at: r.leased_at,
                    lease_until: r.lease_until,
                    ended_at: Some(r.at),
                });
            }
            "ACK_REFUSED" => {
                step.step = StepKind::AckRefused;
                step.epoch = Some(r.lease_epoch.to_string());
                step.session_id = r.session_id.clone();
                step.node_id = node_of(r.session_id.as_deref());
                step.state = None;
                step.attempts = None;
                step.attempt_budget = None;
            }
            "RETRIED" => {
                step.step = StepKind::Retried;
                step.additional_attempts = r.additional_attempts;
                if let Some(audit) = r.audit_id.as_deref().and_then(|a| audits.get(a)) {
                    step.credential_id = Some(audit.credential_id.clone());
                    step.reason = audit.reason.clone();
                }
            }
            _ => continue,
        }
        steps.push(step);
    }
    // The latest lease, unless a lapse row already tells it.
    if d.lease_epoch >= 1 && !leases.iter().any(|l| l.epoch == d.lease_epoch) {
        let acked_here = d.state == DeliveryState::Acked && d.ack_epoch == Some(d.lease_epoch);
        leases.push(Lease {
            epoch: d.lease_epoch,
            session_id: d.lease_session_id.as_deref(),
            leased_at: d.leased_at,
            lease_until: d.lease_until,
            ended_at: if acked_here { d.acknowledged_at } else { None },
        });
    }
    for lease in &leases {
        let mut step = Step::new(StepKind::Leased, lease.leased_at.unwrap_or(d.created_at));
        step.epoch = Some(lease.epoch.to_string());
        step.session_id = lease.session_id.map(str::to_owned);
        step.node_id = node_of(lease.session_id);
        step.leased_at = lease.leased_at.map(Timestamp);
        step.lease_until = lease.lease_until.map(Timestamp);
        steps.push(step);
        // The session went away while it held this lease.
        let Some(session) = lease.session_id.and_then(|s| sessions.get(s)) else {
            continue;
        };
        let Some(closed_at) = session.closed_at else {
            continue;
        };
        let began = lease.leased_at.unwrap_or(i64::MIN);
        let ended = lease.ended_at.unwrap_or(now.micros());
        if closed_at >= began && closed_at <= ended {
            let mut step = Step::new(StepKind::SessionClosed, closed_at);
            step.epoch = Some(lease.epoch.to_string());
            step.session_id = Some(session.id.clone());
            step.node_id = Some(session.node_id.clone());
            step.close_code = session.close_code;
            step.reason = session.close_reason.clone();
            steps.push(step);
        }
    }
    if d.state == DeliveryState::Acked
        && let Some(at) = d.acknowledged_at
    {
        let mut step = Step::new(StepKind::Acked, at);
        let session = crate::store::deliveries::ack_session_of(d);
        step.epoch = d.ack_epoch.map(|e| e.to_string());
        step.node_id = node_of(session);
        step.session_id = session.map(str::to_owned);
        steps.push(step);
    }
    // By time; at the same microsecond, in the order the state machine
    // takes them (a row materialized and leased in one claim).
    steps.sort_by_key(|s| (s.at.micros(), s.step));
    steps
}
