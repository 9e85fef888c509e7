//! A subscription's status: where it stands in its queue's log, what its
//! backlog holds, who consumes it, and why nothing moves (issue 19,
//! http-api.md "Subscription status"). Read-only and bounded: every query is
//! an index range scan over at most `max_pending` rows or the open
//! sessions; no ACKED row is counted.

use std::collections::HashMap;

use entity::{audit_record, delivery, event_session, result_event, subscription};
use sea_orm::{
    ColumnTrait, ConnectionTrait, EntityTrait, QueryFilter, QueryOrder, QuerySelect,
    sea_query::{Expr, Func},
};
use serde::Serialize;

use crate::{
    domain::schema::{Id, Time, Uint64String},
    domain::{DeliveryState, QueueId, Timestamp, TypeSet, now},
    journal,
    store::{StoreError, claim},
};

/// `data` of `GET /v1/subscriptions/{id}/status`.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
#[schema(as = SubscriptionStatus)]
pub struct Status {
    #[schema(value_type = Id)]
    pub subscription_id: String,
    #[schema(value_type = Id)]
    pub queue_id: String,
    /// The queue's committed head.
    #[schema(value_type = Uint64String)]
    pub head_sequence: String,
    /// Highest purged sequence of the queue's log.
    #[schema(value_type = Uint64String)]
    pub retention_floor: String,
    #[schema(value_type = Uint64String)]
    pub cursor_sequence: String,
    /// Results after the cursor: `head_sequence - cursor_sequence`.
    #[schema(value_type = Uint64String)]
    pub lag: String,
    pub enabled: bool,
    #[schema(minimum = 0)]
    pub pending: i64,
    #[schema(minimum = 0)]
    pub leased: i64,
    #[schema(minimum = 0)]
    pub expired: i64,
    /// Non-ACKED deliveries (`pending + leased + expired`).
    #[schema(minimum = 0)]
    pub pending_count: i64,
    pub max_pending: i32,
    /// The non-ACKED delivery with the lowest sequence; absent when every
    /// delivery is ACKED.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    pub oldest_unacked: Option<OldestUnacked>,
    /// Open sessions on every node, oldest first.
    pub sessions: Vec<BoundSession>,
    /// The latest pause or resume; absent when never configured.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    pub last_configure: Option<LastConfigure>,
    /// Why nothing moves; empty when the subscription moves.
    pub blocked: Vec<Blocked>,
}

#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct OldestUnacked {
    #[schema(value_type = Id)]
    pub delivery_id: String,
    #[schema(value_type = Uint64String)]
    pub sequence: String,
    #[schema(value_type = crate::domain::schema::DeliveryStateName)]
    pub state: DeliveryState,
    /// When it was materialized.
    #[schema(value_type = Time)]
    pub created_at: Timestamp,
    /// Seconds since `created_at`.
    pub age_seconds: f64,
}

#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct BoundSession {
    #[schema(value_type = Id)]
    pub session_id: String,
    #[schema(value_type = Id)]
    pub node_id: String,
    #[schema(minimum = 1, maximum = 32)]
    pub capacity: i32,
    /// Live leases the session holds.
    #[schema(minimum = 0)]
    pub held: i64,
    #[schema(value_type = Time)]
    pub opened_at: Timestamp,
}

#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct LastConfigure {
    #[schema(value_type = Uint64String)]
    pub revision: String,
    pub enabled: bool,
    pub reason: String,
    #[schema(value_type = Id)]
    pub credential_id: String,
    #[schema(value_type = Time)]
    pub at: Timestamp,
}

/// One reason nothing moves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum BlockedCode {
    /// Paused: nothing is materialized or leased.
    Paused,
    /// `pending_count` reached `max_pending` while results wait after the
    /// cursor.
    BacklogFull,
    /// The cursor is below the retention floor (`earliest_sequence`).
    HistoryExpired,
    /// Deliveries wait (or results of its types after the cursor) and no
    /// session is open.
    NoConsumer,
    /// Deliveries spent their attempts and wait for an admin's retry.
    ExpiredDeliveries,
}

#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct Blocked {
    pub code: BlockedCode,
    /// What to do about it, for people.
    pub message: String,
    /// HISTORY_EXPIRED: the earliest sequence still in the log.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Uint64String>, nullable = false)]
    pub earliest_sequence: Option<String>,
}

/// Entries after the cursor that [`takes_any_after_cursor`] looks at: past
/// them a lag counts as waiting (the read stays bounded).
const WAITING_SCAN: i64 = 1000;

/// Whether entries of the subscription's types follow its cursor (a lag of
/// other types only is nothing to wait for).
async fn takes_any_after_cursor<C: ConnectionTrait>(
    conn: &C,
    sub: &subscription::Model,
    head: i64,
) -> Result<bool, StoreError> {
    if head - sub.cursor_sequence > WAITING_SCAN {
        return Ok(true);
    }
    let types = TypeSet::from_db(&sub.types);
    if types == TypeSet::ALL {
        return Ok(true);
    }
    let first: Option<i64> = result_event::Entity::find()
        .select_only()
        .column(result_event::Column::Sequence)
        .filter(result_event::Column::QueueId.eq(sub.queue_id.as_str()))
        .filter(result_event::Column::Sequence.gt(sub.cursor_sequence))
        .filter(result_event::Column::Sequence.lte(head))
        .filter(
            result_event::Column::EventType.is_in(
                types
                    .to_vec()
                    .iter()
                    .map(|t| t.as_str())
                    .collect::<Vec<_>>(),
            ),
        )
        .limit(1)
        .into_tuple()
        .one(conn)
        .await?;
    Ok(first.is_some())
}

/// The states of a row that is not ACKED: named, so that each is a range
/// of the `(subscription_id, state, …)` index (`<> 'ACKED'` would walk the
/// ACKED rows too).
const UNACKED: [&str; 3] = ["PENDING", "LEASED", "EXPIRED"];

/// Reads the status of `sub` (already authorized).
pub async fn read<C: ConnectionTrait>(
    conn: &C,
    sub: &subscription::Model,
) -> Result<Status, StoreError> {
    let pos = journal::position(conn, &QueueId::from_db(sub.queue_id.clone())).await?;
    let (head, floor) = pos.map_or((0, 0), |p| (p.head, p.floor));
    let t = now();

    // Non-ACKED rows by state (each range of the (subscription, state, …)
    // index holds at most max_pending rows).
    let counts: Vec<(DeliveryState, i64)> = delivery::Entity::find()
        .select_only()
        .column(delivery::Column::State)
        .expr(Func::count(Expr::col(delivery::Column::Id)))
        .filter(delivery::Column::SubscriptionId.eq(sub.id.as_str()))
        .filter(delivery::Column::State.is_in(UNACKED))
        .group_by(delivery::Column::State)
        .into_tuple()
        .all(conn)
        .await?;
    let count = |s: DeliveryState| {
        counts
            .iter()
            .find(|(state, _)| *state == s)
            .map_or(0, |(_, n)| *n)
    };
    let (pending, leased, expired) = (
        count(DeliveryState::Pending),
        count(DeliveryState::Leased),
        count(DeliveryState::Expired),
    );
    let oldest: Option<(String, i64, DeliveryState, i64)> = delivery::Entity::find()
        .select_only()
        .column(delivery::Column::Id)
        .column(delivery::Column::Sequence)
        .column(delivery::Column::State)
        .column(delivery::Column::CreatedAt)
        .filter(delivery::Column::SubscriptionId.eq(sub.id.as_str()))
        .filter(delivery::Column::State.is_in(UNACKED))
        .order_by_asc(delivery::Column::Sequence)
        .limit(1)
        .into_tuple()
        .one(conn)
        .await?;

    let open: Vec<event_session::Model> = event_session::Entity::find()
        .filter(event_session::Column::SubscriptionId.eq(sub.id.as_str()))
        .filter(event_session::Column::ClosedAt.is_null())
        .order_by_asc(event_session::Column::OpenedAt)
        .all(conn)
        .await?;
    let held = if open.is_empty() {
        HashMap::new()
    } else {
        claim::live_leases(conn, open.iter().map(|s| s.id.as_str()), t).await?
    };
    let sessions: Vec<BoundSession> = open
        .into_iter()
        .map(|s| BoundSession {
            held: held
                .get(&s.id)
                .map_or(0, |&n| i64::try_from(n).unwrap_or(i64::MAX)),
            session_id: s.id,
            node_id: s.node_id,
            capacity: s.capacity,
            opened_at: Timestamp(s.opened_at),
        })
        .collect();

    let last_configure = audit_record::Entity::find()
        .filter(audit_record::Column::TargetId.eq(sub.id.as_str()))
        .filter(audit_record::Column::Action.is_in(["subscription.pause", "subscription.resume"]))
        .order_by_desc(audit_record::Column::At)
        .limit(1)
        .one(conn)
        .await?
        .map(|a| LastConfigure {
            revision: a.after_revision.unwrap_or(0).to_string(),
            enabled: a.action == "subscription.resume",
            reason: a.reason.unwrap_or_default(),
            credential_id: a.credential_id,
            at: Timestamp(a.at),
        });

    let lag = (head - sub.cursor_sequence).max(0);
    let mut blocked = Vec::new();
    let mut add = |code, message: &str, earliest: Option<i64>| {
        blocked.push(Blocked {
            code,
            message: message.to_owned(),
            earliest_sequence: earliest.map(|e| e.to_string()),
        })
    };
    if !sub.enabled {
        add(
            BlockedCode::Paused,
            "paused: resume it with POST /v1/subscriptions/{id}:configure",
            None,
        );
    }
    if sub.cursor_sequence < floor {
        add(
            BlockedCode::HistoryExpired,
            "the cursor is below the retention floor: results were purged before they were read",
            Some(floor + 1),
        );
    }
    if lag > 0 && sub.pending_count >= i64::from(sub.max_pending) {
        add(
            BlockedCode::BacklogFull,
            "max_pending deliveries are not ACKed: no more results are materialized until some are",
            None,
        );
    }
    if sessions.is_empty()
        && (pending > 0 || (lag > 0 && takes_any_after_cursor(conn, sub, head).await?))
    {
        add(
            BlockedCode::NoConsumer,
            "results wait and no consumer is connected",
            None,
        );
    }
    if expired > 0 {
        add(
            BlockedCode::ExpiredDeliveries,
            "deliveries spent their attempts: retry them with POST …/deliveries:retry",
            None,
        );
    }

    Ok(Status {
        subscription_id: sub.id.clone(),
        queue_id: sub.queue_id.clone(),
        head_sequence: head.to_string(),
        retention_floor: floor.to_string(),
        cursor_sequence: sub.cursor_sequence.to_string(),
        lag: lag.to_string(),
        enabled: sub.enabled,
        pending,
        leased,
        expired,
        pending_count: sub.pending_count,
        max_pending: sub.max_pending,
        oldest_unacked: oldest.map(|(id, sequence, state, created_at)| OldestUnacked {
            delivery_id: id,
            sequence: sequence.to_string(),
            state,
            created_at: Timestamp(created_at),
            age_seconds: ((t.micros() - created_at).max(0) as f64) / 1e6,
        }),
        sessions,
        last_configure,
        blocked,
    })
}
