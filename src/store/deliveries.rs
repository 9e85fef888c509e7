//! Deliveries as the API shows them (spec: http-api.md §3 "Deliveries").

use entity::delivery;
use sea_orm::{
    ColumnTrait, ConnectionTrait, DatabaseTransaction, EntityTrait, QueryFilter, QueryOrder,
    QuerySelect,
    sea_query::{Expr, ExprTrait},
};
use serde::Serialize;

use crate::{
    domain::Principal,
    domain::schema::{DeliveryStateName, Id, Time, Uint64String},
    domain::{DeliveryId, DeliveryState, SubscriptionId, Timestamp, now},
    error::{Error, Result},
    store::{
        audit::{self, AuditActor, AuditEntry},
        history,
        list_cursor::ListPosition,
        lock_for_update, state_is,
        subscriptions::{self, Page, after_position},
    },
};

/// `EventDelivery`: absent fields are omitted, never null; no lease secret
/// or digest ever appears here.
#[derive(Debug, Clone, Serialize, PartialEq, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(as = EventDelivery)]
pub struct DeliveryView {
    /// Stable across redeliveries of one event to one subscription.
    #[schema(value_type = Id)]
    pub id: String,
    #[schema(value_type = Id)]
    pub subscription_id: String,
    #[schema(value_type = Id)]
    pub event_id: String,
    /// The event's sequence in its queue's log.
    #[schema(value_type = Uint64String)]
    pub sequence: String,
    /// 1 when materialized; +1 on each lease, recovery, ACK and retry.
    #[schema(value_type = Uint64String)]
    pub revision: String,
    #[schema(value_type = DeliveryStateName)]
    pub state: DeliveryState,
    #[schema(value_type = Time)]
    pub created_at: Timestamp,
    /// Earliest time of the next offer.
    #[schema(value_type = Time)]
    pub available_at: Timestamp,
    /// "0" when never leased; +1 on each lease.
    #[schema(value_type = Uint64String)]
    pub lease_epoch: String,
    /// Only in state LEASED.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Time>, nullable = false)]
    pub lease_until: Option<Timestamp>,
    /// Leases so far; a retry does not reset it.
    #[schema(minimum = 0)]
    pub attempts: i32,
    /// Cumulative budget of attempts (at most 1,000,000).
    #[schema(minimum = 1, maximum = 1000000)]
    pub attempt_budget: i32,
    /// Only in state ACKED.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Time>, nullable = false)]
    pub acknowledged_at: Option<Timestamp>,
    /// Only in state ACKED: the lease epoch the ACK proved.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Uint64String>, nullable = false)]
    pub ack_epoch: Option<String>,
    /// Only in state ACKED, when recorded: the session the ACK came on
    /// (rows ACKED before migration 0079 have none).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    pub ack_session_id: Option<String>,
}

impl From<&delivery::Model> for DeliveryView {
    fn from(m: &delivery::Model) -> DeliveryView {
        let state = m.state;
        DeliveryView {
            id: m.id.clone(),
            subscription_id: m.subscription_id.clone(),
            event_id: m.event_id.clone(),
            sequence: m.sequence.to_string(),
            revision: m.revision.to_string(),
            state: m.state,
            created_at: Timestamp(m.created_at),
            available_at: Timestamp(m.available_at),
            lease_epoch: m.lease_epoch.to_string(),
            lease_until: m
                .lease_until
                .filter(|_| state == DeliveryState::Leased)
                .map(Timestamp),
            attempts: m.attempts,
            attempt_budget: m.attempt_budget,
            acknowledged_at: m
                .acknowledged_at
                .filter(|_| state == DeliveryState::Acked)
                .map(Timestamp),
            ack_epoch: m
                .ack_epoch
                .filter(|_| state == DeliveryState::Acked)
                .map(|e| e.to_string()),
            ack_session_id: ack_session_of(m).map(str::to_owned),
        }
    }
}

/// The session an ACKED row's ACK came on: `ack_session_id`, recorded only
/// when it differs from the lease's session, else `lease_session_id`
/// (decision 0081); `None` for rows ACKED before migration 0079 and for
/// rows not ACKED.
pub fn ack_session_of(m: &delivery::Model) -> Option<&str> {
    if m.state != DeliveryState::Acked {
        return None;
    }
    m.ack_session_id
        .as_deref()
        .or(m.lease_session_id.as_deref())
}

/// The cumulative `attempt_budget` a retry may reach (spec:
/// delivery-model.md §6).
pub const MAX_ATTEMPT_BUDGET: i64 = 1_000_000;

/// `subscription`'s deliveries, newest first, optionally in one state, at
/// most `limit`, after `after` (spec: http-api.md §3 "Deliveries").
pub async fn list_page<C: ConnectionTrait>(
    conn: &C,
    subscription_id: &SubscriptionId,
    state: Option<DeliveryState>,
    after: Option<&ListPosition>,
    limit: u64,
) -> Result<Page<delivery::Model>> {
    let mut query = delivery::Entity::find()
        .filter(delivery::Column::SubscriptionId.eq(subscription_id.as_str()));
    if let Some(state) = state {
        query = query.filter(delivery::Column::State.eq(state.as_str()));
    }
    if let Some(after) = after {
        query = query.filter(after_position(
            delivery::Column::CreatedAt,
            delivery::Column::Id,
            after,
        ));
    }
    let mut items = query
        .order_by_desc(delivery::Column::CreatedAt)
        .order_by_desc(delivery::Column::Id)
        .limit(limit + 1)
        .all(conn)
        .await?;
    let more = items.len() as u64 > limit;
    items.truncate(limit as usize);
    Ok(Page { items, more })
}

/// The delivery `id` of `subscription_id`; 404 for an unknown id and for a
/// delivery of another subscription (never a hint that it exists).
pub async fn get_of_subscription<C: ConnectionTrait>(
    conn: &C,
    subscription_id: &SubscriptionId,
    id: &str,
) -> Result<delivery::Model> {
    let not_found = || Error::not_found("delivery not found");
    let id = DeliveryId::parse(id).ok_or_else(not_found)?;
    delivery::Entity::find_by_id(id.as_str())
        .one(conn)
        .await?
        .filter(|d| d.subscription_id == subscription_id.as_str())
        .ok_or_else(not_found)
}

/// A validated retry request (spec: http-api.md §3, delivery-model.md §6).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Retry {
    pub expected_revision: u64,
    /// 1–1024 Unicode scalar values.
    pub reason: String,
    /// 1–100.
    pub additional_attempts: u32,
}

/// Re-arms an EXPIRED delivery inside the caller's transaction: 404 unless
/// the subscription is owned and the delivery is its own; 409
/// `STATE_CONFLICT` unless the state is EXPIRED, `expected_revision` is the
/// current revision and `attempt_budget + additional_attempts` stays within
/// 1,000,000. Sets PENDING, `available_at = now`, `revision += 1`,
/// `attempt_budget += additional_attempts`; `attempts`, `lease_epoch`, the
/// latest lease proof (a late ACK still counts) and the backlog slot
/// (`pending_count`) are kept. Writes an audit record. The caller wakes the
/// scanner after commit.
pub async fn retry_delivery(
    txn: &DatabaseTransaction,
    principal: &Principal,
    subscription_id: &SubscriptionId,
    delivery_id: &str,
    retry: &Retry,
) -> Result<delivery::Model> {
    let sub = subscriptions::get_owned(txn, principal, subscription_id.as_str()).await?;
    let not_found = || Error::not_found("delivery not found");
    let id = DeliveryId::parse(delivery_id).ok_or_else(not_found)?;
    let backend = txn.get_database_backend();
    let current = lock_for_update(delivery::Entity::find_by_id(id.as_str()), backend)
        .one(txn)
        .await?
        .filter(|d| d.subscription_id == sub.id)
        .ok_or_else(not_found)?;
    if current.state != DeliveryState::Expired {
        return Err(Error::state_conflict(format!(
            "only an EXPIRED delivery can be retried; this one is {}",
            current.state
        )));
    }
    if u64::try_from(current.revision).ok() != Some(retry.expected_revision) {
        return Err(Error::state_conflict(format!(
            "expected_revision: the delivery is at revision {}, not {}",
            current.revision, retry.expected_revision
        )));
    }
    let budget = i64::from(current.attempt_budget) + i64::from(retry.additional_attempts);
    if budget > MAX_ATTEMPT_BUDGET {
        return Err(Error::state_conflict(format!(
            "additional_attempts: the attempt budget would reach {budget}, above {MAX_ATTEMPT_BUDGET}"
        )));
    }
    let t = now();
    let after = current.revision + 1;
    delivery::Entity::update_many()
        .col_expr(delivery::Column::State, Expr::value(DeliveryState::Pending))
        .col_expr(delivery::Column::AvailableAt, Expr::value(t.micros()))
        .col_expr(delivery::Column::Revision, Expr::value(after))
        .col_expr(delivery::Column::AttemptBudget, Expr::value(budget as i32))
        .filter(delivery::Column::Id.eq(id.as_str()))
        .exec(txn)
        .await?;
    let audit_id = audit::record(
        txn,
        &AuditActor {
            namespace_id: principal.namespace_id.clone(),
            credential_id: principal.credential_id.clone(),
        },
        AuditEntry {
            action: "delivery.retry",
            target_id: id.as_str(),
            reason: Some(&retry.reason),
            before_revision: Some(current.revision),
            after_revision: Some(after),
            at: t,
        },
    )
    .await?;
    let retried = delivery::Entity::find_by_id(id.as_str())
        .one(txn)
        .await?
        .ok_or_else(|| Error::internal("a retried delivery vanished"))?;
    history::record_retries(
        txn,
        std::slice::from_ref(&retried),
        &audit_id,
        retry.additional_attempts,
        t,
    )
    .await?;
    Ok(retried)
}

/// A validated bulk retry (`POST …/deliveries:retry`, http-api.md "Bulk
/// retry").
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct BulkRetry {
    /// 1–1024 Unicode scalar values.
    pub reason: String,
    /// 1–100.
    pub additional_attempts: u32,
    /// Inclusive bounds on the deliveries' sequences.
    pub from_sequence: Option<u64>,
    pub to_sequence: Option<u64>,
    /// 1–10,000 deliveries at most, oldest (lowest sequence) first.
    pub limit: u32,
    pub dry_run: bool,
    /// Re-armed deliveries become available evenly over this many ms.
    pub spread_ms: Option<u32>,
}

/// `data` of a bulk retry.
#[derive(Debug, Clone, Serialize, PartialEq, Eq, utoipa::ToSchema)]
#[schema(as = BulkRetryReceipt)]
pub struct BulkReceipt {
    /// EXPIRED deliveries in the range (at most `limit`).
    #[schema(minimum = 0)]
    pub matched: u64,
    /// Re-armed (0 for a dry run; fewer than `matched` when a delivery's
    /// budget would pass 1,000,000 or it left EXPIRED meanwhile).
    #[schema(minimum = 0)]
    pub retried: u64,
    /// Lowest and highest sequence re-armed (matched, for a dry run);
    /// absent when none.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Uint64String>, nullable = false)]
    pub first_sequence: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Uint64String>, nullable = false)]
    pub last_sequence: Option<String>,
    pub dry_run: bool,
    /// True on a replay of the same request under the same key.
    pub deduplicated: bool,
}

/// Deliveries one bulk-retry transaction re-arms at most: the write lock
/// is never held for the whole operation.
pub const BULK_RETRY_BATCH: u64 = 500;

/// The next EXPIRED deliveries of `subscription_id` after sequence `after`
/// within `bulk`'s range, lowest sequence first, at most `n`:
/// `(id, sequence)`.
pub async fn expired_in_range<C: ConnectionTrait>(
    conn: &C,
    subscription_id: &SubscriptionId,
    bulk: &BulkRetry,
    after: Option<i64>,
    n: u64,
) -> Result<Vec<(String, i64)>> {
    let mut query = delivery::Entity::find()
        .select_only()
        .column(delivery::Column::Id)
        .column(delivery::Column::Sequence)
        .filter(delivery::Column::SubscriptionId.eq(subscription_id.as_str()))
        .filter(state_is(DeliveryState::Expired));
    if let Some(from) = bulk.from_sequence {
        query = query.filter(delivery::Column::Sequence.gte(clamp(from)));
    }
    if let Some(to) = bulk.to_sequence {
        query = query.filter(delivery::Column::Sequence.lte(clamp(to)));
    }
    if let Some(after) = after {
        query = query.filter(delivery::Column::Sequence.gt(after));
    }
    Ok(query
        .order_by_asc(delivery::Column::Sequence)
        .order_by_asc(delivery::Column::Id)
        .limit(n)
        .into_tuple()
        .all(conn)
        .await?)
}

fn clamp(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// Re-arms `ids` (EXPIRED deliveries of one subscription) inside `txn`, as
/// [`retry_delivery`] does one: PENDING, `revision += 1`, the budget raised
/// by `additional_attempts` unless it would pass 1,000,000; `available_at`
/// is `now + offset` per row. Writes each a RETRIED history step under
/// `audit_id`. Returns the sequences re-armed.
pub async fn rearm_expired(
    txn: &DatabaseTransaction,
    ids: &[(String, i64)],
    available_at: &dyn Fn(usize) -> Timestamp,
    additional_attempts: u32,
    audit_id: &str,
    t: Timestamp,
) -> Result<Vec<i64>> {
    if ids.is_empty() {
        return Ok(Vec::new());
    }
    let k = i64::from(additional_attempts);
    let mut when: Option<sea_orm::sea_query::CaseStatement> = None;
    for (i, (id, _)) in ids.iter().enumerate() {
        let at = available_at(i).micros();
        let cond = delivery::Column::Id.eq(id.as_str());
        when = Some(match when {
            None => Expr::case(cond, at),
            Some(c) => c.case(cond, at),
        });
    }
    let Some(when) = when else {
        return Ok(Vec::new());
    };
    let rows = delivery::Entity::update_many()
        .col_expr(delivery::Column::State, Expr::value(DeliveryState::Pending))
        .col_expr(
            delivery::Column::AvailableAt,
            when.finally(t.micros()).into(),
        )
        .col_expr(
            delivery::Column::Revision,
            Expr::col(delivery::Column::Revision).add(1),
        )
        .col_expr(
            delivery::Column::AttemptBudget,
            Expr::col(delivery::Column::AttemptBudget).add(k),
        )
        .filter(delivery::Column::Id.is_in(ids.iter().map(|(id, _)| id.as_str())))
        .filter(state_is(DeliveryState::Expired))
        .filter(
            Expr::col(delivery::Column::AttemptBudget)
                .add(k)
                .lte(MAX_ATTEMPT_BUDGET),
        )
        .exec_with_returning(txn)
        .await?;
    history::record_retries(txn, &rows, audit_id, additional_attempts, t).await?;
    Ok(rows.iter().map(|r| r.sequence).collect())
}
