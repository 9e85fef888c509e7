//! Claims: lease up to N deliveries to one session in one transaction
//! (spec: delivery-model.md §6).

use std::time::Duration;

use entity::{delivery, subscription};
use sea_orm::{
    ColumnTrait, ConnectionTrait, DbBackend, DbErr, EntityTrait, ExprTrait, PaginatorTrait,
    QueryFilter, QueryOrder, QuerySelect, QueryTrait,
    sea_query::{Expr, LockBehavior, LockType},
};

use crate::{
    domain::{
        CredentialId, DeliveryState, EventId, LeaseSecret, QueueId, SessionId, SubscriptionId,
        Timestamp, now,
    },
    journal::{self, RenderedEvent},
    store::{Database, tenancy},
};

/// The session a claim leases to.
#[derive(Debug, Clone)]
pub struct ClaimTarget {
    pub session_id: SessionId,
    pub subscription_id: SubscriptionId,
    pub credential_id: CredentialId,
    pub capacity: u32,
}

/// One delivery leased by a claim: the row after leasing, its event and the
/// secret (sent once in `event.deliver`, never stored).
#[derive(Debug)]
pub struct LeasedDelivery {
    pub delivery: delivery::Model,
    pub event: RenderedEvent,
    pub secret: LeaseSecret,
}

/// What a claim found.
#[derive(Debug)]
pub enum ClaimOutcome {
    /// Committed leases, in `(sequence, id)` order (possibly none).
    /// `exhausted`: fewer PENDING rows were available than the session had
    /// room for, so another claim right now would find nothing.
    Leased {
        deliveries: Vec<LeasedDelivery>,
        exhausted: bool,
        /// This subscription's lapsed leases recovered first.
        recovered: Recovered,
        /// The subscription's queue (for the census).
        queue_id: QueueId,
    },
    /// The subscription is paused: no new leases.
    Paused,
    /// `cursor_sequence < retention_floor`; carries the earliest sequence.
    HistoryExpired(u64),
    /// The credential was revoked.
    Revoked,
    /// The subscription no longer exists or its queue left the scope.
    Gone,
}

/// One transaction: check the credential and the subscription (enabled, no
/// history gap); recover this subscription's expired leases; count the
/// session's live leases (`held`); lease up to `min(want, capacity - held)`
/// available PENDING rows ordered by `(sequence, id)` (PostgreSQL: `FOR
/// UPDATE SKIP LOCKED`), each with `lease_epoch += 1, attempts += 1,
/// revision += 1`, `lease_until = now + lease` and a fresh secret whose
/// SHA-256 digest alone is stored. The caller writes `event.deliver` only
/// after this returns (the lease is committed first).
pub async fn claim(
    db: &Database,
    target: &ClaimTarget,
    want: u32,
    lease: Duration,
) -> Result<ClaimOutcome, DbErr> {
    claim_after(db, target, want, lease, std::future::ready(())).await
}

/// As [`claim`], awaiting `pause` right after the transaction began (on
/// SQLite: while holding the write lock). Test builds pass a hook here to
/// keep claims stuck inside their transaction.
pub async fn claim_after(
    db: &Database,
    target: &ClaimTarget,
    want: u32,
    lease: Duration,
    pause: impl Future<Output = ()>,
) -> Result<ClaimOutcome, DbErr> {
    let txn = db.begin_write().await?;
    pause.await;
    let outcome = claim_in(&txn, db.backend(), target, want, lease).await?;
    txn.commit().await?;
    Ok(outcome)
}

async fn claim_in<C: ConnectionTrait>(
    txn: &C,
    backend: DbBackend,
    target: &ClaimTarget,
    want: u32,
    lease: Duration,
) -> Result<ClaimOutcome, DbErr> {
    let Some(principal) = tenancy::principal_by_id(txn, &target.credential_id).await? else {
        return Ok(ClaimOutcome::Revoked);
    };
    let Some(sub) = subscription::Entity::find_by_id(target.subscription_id.as_str())
        .one(txn)
        .await?
    else {
        return Ok(ClaimOutcome::Gone);
    };
    let queue_id = QueueId::from_db(sub.queue_id.clone());
    if !principal.in_scope(&queue_id) {
        return Ok(ClaimOutcome::Gone);
    }
    if !sub.enabled {
        return Ok(ClaimOutcome::Paused);
    }
    if let Some(pos) = journal::position(txn, &queue_id).await?
        && sub.cursor_sequence < pos.floor
    {
        return Ok(ClaimOutcome::HistoryExpired(pos.earliest()));
    }

    let now = now();
    let recovered =
        recover_expired_leases(txn, Some(&target.subscription_id), now, u64::MAX).await?;

    let held = delivery::Entity::find()
        .filter(delivery::Column::LeaseSessionId.eq(target.session_id.as_str()))
        .filter(delivery::Column::State.eq(DeliveryState::Leased.as_str()))
        .filter(delivery::Column::LeaseUntil.gt(now.micros()))
        .count(txn)
        .await?;
    let room = u64::from(target.capacity).saturating_sub(held);
    let take = Ord::min(u64::from(want), room);
    if take == 0 {
        return Ok(ClaimOutcome::Leased {
            deliveries: Vec::new(),
            exhausted: false,
            recovered,
            queue_id,
        });
    }

    let mut candidates = delivery::Entity::find()
        .select_only()
        .column(delivery::Column::Id)
        .filter(delivery::Column::SubscriptionId.eq(target.subscription_id.as_str()))
        .filter(delivery::Column::State.eq(DeliveryState::Pending.as_str()))
        .filter(delivery::Column::AvailableAt.lte(now.micros()))
        .filter(
            Expr::col(delivery::Column::Attempts).lt(Expr::col(delivery::Column::AttemptBudget)),
        )
        .order_by_asc(delivery::Column::Sequence)
        .order_by_asc(delivery::Column::Id)
        .limit(take);
    if backend == DbBackend::Postgres {
        candidates = candidates.lock_with_behavior(LockType::Update, LockBehavior::SkipLocked);
    }
    let ids: Vec<String> = candidates.into_tuple().all(txn).await?;
    let exhausted = (ids.len() as u64) < take;

    let lease_until = now.plus(lease);
    let mut leased = Vec::with_capacity(ids.len());
    for id in ids {
        let secret = LeaseSecret::generate();
        let rows = delivery::Entity::update_many()
            .col_expr(
                delivery::Column::State,
                Expr::value(DeliveryState::Leased.as_str()),
            )
            .col_expr(
                delivery::Column::LeaseEpoch,
                Expr::col(delivery::Column::LeaseEpoch).add(1),
            )
            .col_expr(
                delivery::Column::Attempts,
                Expr::col(delivery::Column::Attempts).add(1),
            )
            .col_expr(
                delivery::Column::Revision,
                Expr::col(delivery::Column::Revision).add(1),
            )
            .col_expr(
                delivery::Column::LeaseUntil,
                Expr::value(lease_until.micros()),
            )
            .col_expr(
                delivery::Column::LeaseSessionId,
                Expr::value(target.session_id.as_str()),
            )
            .col_expr(
                delivery::Column::LeaseDigest,
                Expr::value(secret.digest_hex()),
            )
            .filter(delivery::Column::Id.eq(id.as_str()))
            .filter(delivery::Column::State.eq(DeliveryState::Pending.as_str()))
            .exec_with_returning(txn)
            .await?;
        if let Some(row) = rows.into_iter().next() {
            leased.push((row, secret));
        }
    }

    let event_ids: Vec<EventId> = leased
        .iter()
        .map(|(d, _)| EventId::from_db(d.event_id.clone()))
        .collect();
    let mut events = journal::render(txn, &event_ids).await?;
    let mut out = Vec::with_capacity(leased.len());
    for (delivery, secret) in leased {
        let event = events
            .remove(&EventId::from_db(delivery.event_id.clone()))
            .ok_or_else(|| {
                DbErr::Custom(format!(
                    "event {} of delivery {} is missing",
                    delivery.event_id, delivery.id
                ))
            })?;
        out.push(LeasedDelivery {
            delivery,
            event,
            secret,
        });
    }
    Ok(ClaimOutcome::Leased {
        deliveries: out,
        exhausted,
        recovered,
        queue_id,
    })
}

/// Lapsed leases recovered by [`recover_expired_leases`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Recovered {
    /// Back to PENDING (offered again).
    pub to_pending: u64,
    /// At their attempt budget: EXPIRED.
    pub expired: u64,
}

impl Recovered {
    pub fn total(self) -> u64 {
        self.to_pending + self.expired
    }
}

/// Recovers expired leases: LEASED rows with `lease_until <= now` become
/// PENDING (`available_at = lease_until`) while `attempts < attempt_budget`,
/// else EXPIRED; each recovery is `revision += 1`. Limited to one
/// subscription when given, and to at most `limit` rows per state change.
pub async fn recover_expired_leases<C: ConnectionTrait>(
    conn: &C,
    subscription_id: Option<&SubscriptionId>,
    now: Timestamp,
    limit: u64,
) -> Result<Recovered, DbErr> {
    let mut recovered = Recovered::default();
    for to_pending in [true, false] {
        // The same conditions guard the UPDATE itself: on PostgreSQL they are
        // re-checked after a concurrent writer's lock is released, so a lease
        // renewed meanwhile is never recovered.
        let is_due = || {
            let budget_left = Expr::col(delivery::Column::Attempts)
                .lt(Expr::col(delivery::Column::AttemptBudget));
            sea_orm::Condition::all()
                .add(delivery::Column::State.eq(DeliveryState::Leased.as_str()))
                .add(delivery::Column::LeaseUntil.lte(now.micros()))
                .add(if to_pending {
                    budget_left
                } else {
                    budget_left.not()
                })
        };
        let mut due = delivery::Entity::find()
            .select_only()
            .column(delivery::Column::Id)
            .filter(is_due());
        if let Some(sub) = subscription_id {
            due = due.filter(delivery::Column::SubscriptionId.eq(sub.as_str()));
        }
        if limit != u64::MAX {
            due = due.limit(limit);
        }
        let mut update = delivery::Entity::update_many()
            .col_expr(
                delivery::Column::Revision,
                Expr::col(delivery::Column::Revision).add(1),
            )
            .col_expr(
                delivery::Column::LeaseUntil,
                Expr::value(Option::<i64>::None),
            )
            .col_expr(
                delivery::Column::LeaseSessionId,
                Expr::value(Option::<String>::None),
            );
        update = if to_pending {
            update
                .col_expr(
                    delivery::Column::State,
                    Expr::value(DeliveryState::Pending.as_str()),
                )
                .col_expr(
                    delivery::Column::AvailableAt,
                    Expr::col(delivery::Column::LeaseUntil),
                )
        } else {
            update.col_expr(
                delivery::Column::State,
                Expr::value(DeliveryState::Expired.as_str()),
            )
        };
        let result = update
            .filter(delivery::Column::Id.in_subquery(due.into_query()))
            .filter(is_due())
            .exec(conn)
            .await?;
        if to_pending {
            recovered.to_pending = result.rows_affected;
        } else {
            recovered.expired = result.rows_affected;
        }
    }
    Ok(recovered)
}
