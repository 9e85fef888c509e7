//! What the metrics show about queues and subscriptions, read from the
//! database when `/metrics` is scraped (spec: architecture.md §6).
//! Read-only: index scans, no lock.

use crate::store::{StoreError, state_is, tallies};
use std::{collections::HashMap, time::Duration};

use entity::{delivery, queue, subscription};
use sea_orm::{
    ConnectionTrait, EntityTrait, QueryFilter, QuerySelect,
    sea_query::{Expr, Func},
};

use crate::domain::{DeliveryState, now};

/// Head and retention floor of one queue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueBacklog {
    pub queue_id: String,
    pub head: i64,
    pub floor: i64,
}

/// How far one subscription is behind.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubscriptionBacklog {
    pub subscription_id: String,
    pub queue_id: String,
    /// The queue's committed head.
    pub head: i64,
    pub cursor: i64,
    /// Non-ACKED deliveries.
    pub pending_count: i64,
    pub max_pending: i64,
    /// Age of the oldest non-ACKED delivery (zero when there is none).
    pub oldest_unacked_age: Duration,
    /// EXPIRED deliveries (attempts spent; waiting for an admin's retry).
    pub expired: i64,
}

/// Every queue and subscription of the database.
#[derive(Debug, Clone, Default)]
pub struct Backlog {
    pub queues: Vec<QueueBacklog>,
    pub subscriptions: Vec<SubscriptionBacklog>,
}

/// Reads [`Backlog`]: the queues, the subscriptions, and the creation time
/// of each subscription's oldest non-ACKED delivery (at most `max_pending`
/// rows per subscription, found through the partial indexes by state).
pub async fn read<C: ConnectionTrait>(conn: &C) -> Result<Backlog, StoreError> {
    let queues: Vec<(String, i64, i64)> = queue::Entity::find()
        .select_only()
        .column(queue::Column::Id)
        .column(queue::Column::HeadSequence)
        .column(queue::Column::RetentionFloor)
        .into_tuple()
        .all(conn)
        .await?;
    let heads: HashMap<&str, i64> = queues.iter().map(|(id, h, _)| (id.as_str(), *h)).collect();

    // One query per state, each served by that state's partial index
    // (decision 0079): PENDING and LEASED rows are bounded by
    // `max_pending`, EXPIRED rows are the exhausted ones only.
    let mut oldest: HashMap<String, i64> = HashMap::new();
    let mut expired: HashMap<String, i64> = HashMap::new();
    for state in [
        DeliveryState::Pending,
        DeliveryState::Leased,
        DeliveryState::Expired,
    ] {
        let rows: Vec<(String, Option<i64>, i64)> = delivery::Entity::find()
            .select_only()
            .column(delivery::Column::SubscriptionId)
            .expr(Func::min(Expr::col(delivery::Column::CreatedAt)))
            .expr(Func::count(Expr::col(delivery::Column::Id)))
            .filter(state_is(state))
            .group_by(delivery::Column::SubscriptionId)
            .into_tuple()
            .all(conn)
            .await?;
        for (id, at, n) in rows {
            if state == DeliveryState::Expired {
                expired.insert(id.clone(), n);
            }
            if let Some(at) = at {
                let first = oldest.entry(id).or_insert(at);
                *first = (*first).min(at);
            }
        }
    }

    let subs: Vec<(String, String, i64, i64, i32)> = subscription::Entity::find()
        .select_only()
        .column(subscription::Column::Id)
        .column(subscription::Column::QueueId)
        .column(subscription::Column::CursorSequence)
        .column(subscription::Column::PendingCount)
        .column(subscription::Column::MaxPending)
        .into_tuple()
        .all(conn)
        .await?;
    // Read after the subscriptions (see `tallies::settle`).
    let unfolded = tallies::unfolded(conn, None).await?;
    let t = now().micros();
    let subscriptions = subs
        .into_iter()
        .map(|(id, queue_id, cursor, pending_count, max_pending)| {
            let age_micros = oldest.get(&id).map_or(0, |at| (t - at).max(0));
            let expired = expired.get(&id).copied().unwrap_or(0);
            let pending_count = pending_count - unfolded.get(&id).copied().unwrap_or(0);
            SubscriptionBacklog {
                head: heads.get(queue_id.as_str()).copied().unwrap_or(0),
                subscription_id: id,
                queue_id,
                cursor,
                pending_count,
                max_pending: i64::from(max_pending),
                oldest_unacked_age: Duration::from_micros(age_micros.unsigned_abs()),
                expired,
            }
        })
        .collect();
    Ok(Backlog {
        queues: queues
            .into_iter()
            .map(|(queue_id, head, floor)| QueueBacklog {
                queue_id,
                head,
                floor,
            })
            .collect(),
        subscriptions,
    })
}
