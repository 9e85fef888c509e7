//! Claims: lease up to N deliveries to one session in one transaction
//! (spec: delivery-model.md §6).

use crate::store::StoreError;
use std::{collections::HashMap, time::Duration};

use entity::{delivery, subscription};
use sea_orm::{
    ColumnTrait, ConnectionTrait, DbBackend, EntityTrait, ExprTrait, QueryFilter, QueryOrder,
    QuerySelect, QueryTrait,
    sea_query::{CaseStatement, Expr, LockBehavior, LockType},
};

use crate::{
    domain::Principal,
    domain::{
        CredentialId, DeliveryState, EventId, LeaseSecret, QueueId, SessionId, SubscriptionId,
        Timestamp, now,
    },
    journal::{self, RenderedEvent},
    store::{
        Database, Waiter, history,
        materialize::{MATERIALIZE_BATCH, Materialized, materialize_in},
        state_is, tenancy,
        writer::batch_or_each,
    },
};

/// The session a claim leases to.
#[derive(Debug, Clone)]
pub struct ClaimTarget {
    pub session_id: SessionId,
    pub subscription_id: SubscriptionId,
    pub credential_id: CredentialId,
    pub capacity: u32,
    /// The session's connection: once it has closed, the claim leases
    /// nothing (checked inside the transaction, after the write lock).
    pub waiter: Waiter,
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
        /// When the PENDING rows fell short and the cursor was behind the
        /// head, this transaction materialized first (delivery-model.md
        /// §5): what it did. Counted once, with the first claim.
        materialized: Option<Materialized>,
        /// The subscription's cursor is still behind its queue's head
        /// after this transaction: entries wait to be materialized.
        behind_head: bool,
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

/// One transaction per call: check the credential and the subscription
/// (enabled, no history gap); recover this subscription's expired leases;
/// count the session's live leases (`held`); lease up to `min(want,
/// capacity - held)` available PENDING rows ordered by `(sequence, id)`
/// (PostgreSQL: `FOR UPDATE SKIP LOCKED`), each with `lease_epoch += 1,
/// attempts += 1, revision += 1`, `lease_until = now + lease` and a fresh
/// secret whose SHA-256 digest alone is stored. The caller writes
/// `event.deliver` only after this returns (the lease is committed first).
///
/// One outcome per claim, in order. The claims share one transaction
/// ([`claim_batch_after`]) under the writer's batch rule
/// ([`batch_or_each`]: a fault fails them all, a claim the database refuses
/// runs again alone). `pause` is awaited once, right after the first
/// transaction began (on SQLite: while holding the write lock); test builds
/// pass a hook there to keep claims stuck inside their transaction.
pub async fn claim_each(
    db: &Database,
    claims: &[(ClaimTarget, u32)],
    lease: Duration,
    pause: impl Future<Output = ()>,
) -> Vec<Result<ClaimOutcome, StoreError>> {
    let mut pause = Some(pause);
    batch_or_each("claim batch", claims, async |batch| {
        claim_batch_after(db, batch, lease, pause.take()).await
    })
    .await
}

/// One claim alone ([`claim_each`] of one, no pause).
pub async fn claim(
    db: &Database,
    target: &ClaimTarget,
    want: u32,
    lease: Duration,
) -> Result<ClaimOutcome, StoreError> {
    claim_each(db, &[(target.clone(), want)], lease, std::future::ready(()))
        .await
        .pop()
        .unwrap_or_else(|| Err(StoreError::invariant("a claim of one answered nothing")))
}

/// Group commit of claims (decision 0061): each `(target, want)` is decided
/// exactly as [`claim`] would decide it alone, all in one write
/// transaction, so that one commit (one fsync) serves several sessions.
/// Consecutive claims of one subscription share the reads and the writes:
/// the subscription checks, the recovery of its lapsed leases, one query for
/// the sessions' live leases, one for the candidates (split in
/// `(sequence, id)` order, the first claim first), one `UPDATE` leasing them
/// all, one read of their events. Returns one outcome per claim, in order,
/// only after the commit: no `event.deliver` can be written before its
/// lease is durable. `Err`: the transaction failed and nothing of any claim
/// was written. `pause`, if any, as in [`claim_each`].
async fn claim_batch_after(
    db: &Database,
    claims: &[(ClaimTarget, u32)],
    lease: Duration,
    pause: Option<impl Future<Output = ()>>,
) -> Result<Vec<ClaimOutcome>, StoreError> {
    // Only the first run pauses (a member spoiled by another runs again).
    let mut pause = pause;
    db.write(async |txn| {
        if let Some(pause) = pause.take() {
            pause.await;
        }
        let mut outcomes = Vec::with_capacity(claims.len());
        for group in claims.chunk_by(|a, b| a.0.subscription_id == b.0.subscription_id) {
            outcomes.extend(claim_in(txn, db.backend(), group, lease).await?);
        }
        Ok(outcomes)
    })
    .await
}

/// The claims `claims`, all of one subscription, inside `txn`.
async fn claim_in<C: ConnectionTrait + sea_orm::TransactionTrait>(
    txn: &C,
    backend: DbBackend,
    claims: &[(ClaimTarget, u32)],
    lease: Duration,
) -> Result<Vec<ClaimOutcome>, StoreError> {
    let Some((first, _)) = claims.first() else {
        return Ok(Vec::new());
    };
    let subscription_id = &first.subscription_id;
    let mut principals: HashMap<&str, Option<Principal>> = HashMap::new();
    for (target, _) in claims {
        let id = target.credential_id.as_str();
        if !principals.contains_key(id) {
            let principal = tenancy::principal_by_id(txn, &target.credential_id).await?;
            principals.insert(id, principal);
        }
    }
    let sub = subscription::Entity::find_by_id(subscription_id.as_str())
        .one(txn)
        .await?;
    let pos = match &sub {
        Some(sub) if sub.enabled => {
            journal::position(txn, &QueueId::from_db(sub.queue_id.clone())).await?
        }
        _ => None,
    };
    let gap = match (&sub, &pos) {
        (Some(sub), Some(pos)) if sub.cursor_sequence < pos.floor => Some(pos.earliest()),
        _ => None,
    };
    // Each claim is checked as if alone: its credential, then the
    // subscription (enabled, no history gap).
    let mut outcomes: Vec<Option<ClaimOutcome>> = claims
        .iter()
        .map(|(target, _)| {
            let Some(Some(principal)) = principals.get(target.credential_id.as_str()) else {
                return Some(ClaimOutcome::Revoked);
            };
            let Some(sub) = &sub else {
                return Some(ClaimOutcome::Gone);
            };
            if !principal.in_scope(&QueueId::from_db(sub.queue_id.clone())) {
                return Some(ClaimOutcome::Gone);
            }
            if !sub.enabled {
                return Some(ClaimOutcome::Paused);
            }
            gap.map(ClaimOutcome::HistoryExpired)
        })
        .collect();
    let open: Vec<usize> = (0..claims.len())
        .filter(|&i| outcomes[i].is_none())
        .collect();
    let Some(sub) = sub.filter(|_| !open.is_empty()) else {
        return Ok(outcomes.into_iter().flatten().collect());
    };
    let queue_id = QueueId::from_db(sub.queue_id);

    let now = now();
    let mut recovered = recover_expired_leases(txn, Some(subscription_id), now, u64::MAX).await?;
    let held = live_leases(txn, open.iter().map(|&i| &claims[i].0.session_id), now).await?;
    // `min(want, capacity - held)` per claim; a session twice in one batch
    // also counts what its earlier claim takes.
    let mut taken: HashMap<&str, u64> = HashMap::new();
    let takes: Vec<u64> = open
        .iter()
        .map(|&i| {
            let (target, want) = &claims[i];
            let session = target.session_id.as_str();
            let busy =
                held.get(session).copied().unwrap_or(0) + taken.get(session).copied().unwrap_or(0);
            // A session whose connection closed while its claim waited
            // for the write lock (e.g. during a database outage) takes
            // nothing: its rows would only come back one lease later.
            let want = if target.waiter.gone() { 0 } else { *want };
            let take = Ord::min(
                u64::from(want),
                u64::from(target.capacity).saturating_sub(busy),
            );
            *taken.entry(session).or_default() += take;
            take
        })
        .collect();
    let total: u64 = takes.iter().sum();

    let mut ids = candidates(txn, backend, subscription_id, now, total).await?;
    // Short of PENDING rows while entries wait below the head: materialize
    // in this transaction and lease what it inserted with the rest, one
    // commit instead of two (delivery-model.md §5). The subscription row
    // is locked after the candidates, which are SKIP LOCKED: this claim
    // waits on no row lock while it holds the subscription's.
    let head = pos.map_or(0, |p| p.head);
    let mut materialized = None;
    let mut behind_head = sub.cursor_sequence < head;
    if (ids.len() as u64) < total && behind_head {
        let m = materialize_in(txn, subscription_id, MATERIALIZE_BATCH).await?;
        behind_head = !m.caught_up;
        if m.inserted > 0 {
            ids = candidates(txn, backend, subscription_id, crate::domain::now(), total).await?;
        }
        materialized = Some(m);
    }

    // The candidates in order: the first claim takes the first rows.
    let mut rest = ids.into_iter();
    let shares: Vec<Vec<String>> = takes
        .iter()
        .map(|&take| {
            rest.by_ref()
                .take(usize::try_from(take).unwrap_or(usize::MAX))
                .collect()
        })
        .collect();
    let assignment: Vec<(&str, &SessionId)> = open
        .iter()
        .zip(&shares)
        .flat_map(|(&i, share)| {
            share
                .iter()
                .map(move |id| (id.as_str(), &claims[i].0.session_id))
        })
        .collect();
    // `leased_at` after this claim's own materialization (its rows'
    // `created_at`), so a history never shows a lease before its row.
    let leased_at = if materialized.is_some() {
        crate::domain::now()
    } else {
        now
    };
    let mut leased = lease_rows(txn, &assignment, leased_at, now.plus(lease)).await?;
    let event_ids: Vec<EventId> = leased
        .values()
        .map(|(d, _)| EventId::from_db(d.event_id.clone()))
        .collect();
    let mut events = journal::render(txn, &event_ids).await?;

    for (k, (&i, share)) in open.iter().zip(&shares).enumerate() {
        let mut deliveries = Vec::with_capacity(share.len());
        // A row no longer PENDING was not leased (it cannot happen while
        // this transaction holds the write lock or the row locks).
        for (delivery, secret) in share.iter().filter_map(|id| leased.remove(id.as_str())) {
            let event = events
                .remove(&EventId::from_db(delivery.event_id.clone()))
                .ok_or_else(|| {
                    StoreError::invariant(format!(
                        "event {} of delivery {} is missing",
                        delivery.event_id, delivery.id
                    ))
                })?;
            deliveries.push(LeasedDelivery {
                delivery,
                event,
                secret,
            });
        }
        outcomes[i] = Some(ClaimOutcome::Leased {
            deliveries,
            exhausted: (share.len() as u64) < takes[k],
            // Counted once, with the first claim.
            recovered: if k == 0 {
                std::mem::take(&mut recovered)
            } else {
                Recovered::default()
            },
            materialized: if k == 0 { materialized } else { None },
            behind_head,
            queue_id: queue_id.clone(),
        });
    }
    Ok(outcomes.into_iter().flatten().collect())
}

/// Up to `limit` claimable rows of the subscription: PENDING, available
/// at `now`, attempts left, in `(sequence, id)` order (PostgreSQL: `FOR
/// UPDATE SKIP LOCKED`).
async fn candidates<C: ConnectionTrait>(
    txn: &C,
    backend: DbBackend,
    subscription_id: &SubscriptionId,
    now: Timestamp,
    limit: u64,
) -> Result<Vec<String>, StoreError> {
    if limit == 0 {
        return Ok(Vec::new());
    }
    let mut query = delivery::Entity::find()
        .select_only()
        .column(delivery::Column::Id)
        .filter(delivery::Column::SubscriptionId.eq(subscription_id.as_str()))
        .filter(state_is(DeliveryState::Pending))
        .filter(delivery::Column::AvailableAt.lte(now.micros()))
        .filter(
            Expr::col(delivery::Column::Attempts).lt(Expr::col(delivery::Column::AttemptBudget)),
        )
        .order_by_asc(delivery::Column::Sequence)
        .order_by_asc(delivery::Column::Id)
        .limit(limit);
    if backend == DbBackend::Postgres {
        query = query.lock_with_behavior(LockType::Update, LockBehavior::SkipLocked);
    }
    Ok(query.into_tuple().all(txn).await?)
}

/// LEASED rows with `lease_until > now` of each of `sessions`.
async fn live_leases<'a, C: ConnectionTrait>(
    txn: &C,
    sessions: impl Iterator<Item = &'a SessionId>,
    now: Timestamp,
) -> Result<HashMap<String, u64>, StoreError> {
    let sessions: Vec<&str> = sessions.map(SessionId::as_str).collect();
    let rows: Vec<(Option<String>, i64)> = delivery::Entity::find()
        .select_only()
        .column(delivery::Column::LeaseSessionId)
        .column_as(Expr::col(delivery::Column::Id).count(), "n")
        .filter(delivery::Column::LeaseSessionId.is_in(sessions))
        .filter(state_is(DeliveryState::Leased))
        .filter(delivery::Column::LeaseUntil.gt(now.micros()))
        .group_by(delivery::Column::LeaseSessionId)
        .into_tuple()
        .all(txn)
        .await?;
    Ok(rows
        .into_iter()
        .filter_map(|(session, n)| Some((session?, u64::try_from(n).unwrap_or(0))))
        .collect())
}

/// Leases each PENDING row of `assignment` to its session in one
/// statement: `lease_epoch += 1, attempts += 1, revision += 1`,
/// `lease_until`, the session and the digest of the row's own fresh secret
/// (`CASE` on the id). Returns the rows after leasing with their secrets,
/// by id; a row no longer PENDING is not leased.
async fn lease_rows<C: ConnectionTrait>(
    txn: &C,
    assignment: &[(&str, &SessionId)],
    leased_at: Timestamp,
    lease_until: Timestamp,
) -> Result<HashMap<String, (delivery::Model, LeaseSecret)>, StoreError> {
    let mut secrets: HashMap<&str, LeaseSecret> = HashMap::with_capacity(assignment.len());
    let mut cases: Option<(CaseStatement, CaseStatement)> = None;
    for &(id, session) in assignment {
        let secret = LeaseSecret::generate();
        let when = || delivery::Column::Id.eq(id);
        cases = Some(match cases {
            None => (
                Expr::case(when(), secret.digest_hex()),
                Expr::case(when(), session.as_str()),
            ),
            Some((digest, session_case)) => (
                digest.case(when(), secret.digest_hex()),
                session_case.case(when(), session.as_str()),
            ),
        });
        secrets.insert(id, secret);
    }
    let Some((digest, session)) = cases else {
        return Ok(HashMap::new());
    };
    let rows = delivery::Entity::update_many()
        .col_expr(delivery::Column::State, Expr::value(DeliveryState::Leased))
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
        .col_expr(delivery::Column::LeasedAt, Expr::value(leased_at.micros()))
        .col_expr(
            delivery::Column::LeaseUntil,
            Expr::value(lease_until.micros()),
        )
        .col_expr(
            delivery::Column::LeaseSessionId,
            session
                .finally(Expr::col(delivery::Column::LeaseSessionId))
                .into(),
        )
        .col_expr(
            delivery::Column::LeaseDigest,
            digest
                .finally(Expr::col(delivery::Column::LeaseDigest))
                .into(),
        )
        .filter(delivery::Column::Id.is_in(assignment.iter().map(|(id, _)| *id)))
        .filter(state_is(DeliveryState::Pending))
        .exec_with_returning(txn)
        .await?;
    rows.into_iter()
        .map(|row| {
            let secret = secrets.remove(row.id.as_str()).ok_or_else(|| {
                StoreError::invariant(format!("delivery {} was leased but not asked for", row.id))
            })?;
            Ok((row.id.clone(), (row, secret)))
        })
        .collect()
}

/// Lapsed leases recovered by [`recover_expired_leases`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Recovered {
    /// Back to PENDING (offered again).
    pub to_pending: u64,
    /// At their attempt budget: EXPIRED.
    pub expired: u64,
    /// The deliveries that became EXPIRED, for the log line each gets once
    /// its transaction committed ([`Recovered::log_exhausted`]).
    pub exhausted: Vec<Exhausted>,
}

/// A delivery whose last lease lapsed at its attempt budget (now EXPIRED).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Exhausted {
    pub delivery_id: String,
    pub subscription_id: String,
    pub event_id: String,
    pub attempts: i32,
}

impl Recovered {
    pub fn total(&self) -> u64 {
        self.to_pending + self.expired
    }

    /// Logs each delivery that became EXPIRED, once: call after the
    /// recovery's transaction committed. An admin's retry re-arms it
    /// (http-api.md, deliveries).
    pub fn log_exhausted(&self) {
        for e in &self.exhausted {
            tracing::info!(
                delivery_id = %e.delivery_id,
                subscription_id = %e.subscription_id,
                event_id = %e.event_id,
                attempts = e.attempts,
                "delivery EXPIRED: its lease lapsed at the attempt budget; a retry re-arms it"
            );
        }
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
) -> Result<Recovered, StoreError> {
    let mut recovered = Recovered::default();
    for to_pending in [true, false] {
        // The same conditions guard the UPDATE itself: on PostgreSQL they are
        // re-checked after a concurrent writer's lock is released, so a lease
        // renewed meanwhile is never recovered.
        let is_due = || {
            let budget_left = Expr::col(delivery::Column::Attempts)
                .lt(Expr::col(delivery::Column::AttemptBudget));
            sea_orm::Condition::all()
                .add(state_is(DeliveryState::Leased))
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
        // The lease's session and times stay on the row: they are its
        // history until the next lease (decision 0081).
        let mut update = delivery::Entity::update_many().col_expr(
            delivery::Column::Revision,
            Expr::col(delivery::Column::Revision).add(1),
        );
        update = if to_pending {
            update
                .col_expr(delivery::Column::State, Expr::value(DeliveryState::Pending))
                .col_expr(
                    delivery::Column::AvailableAt,
                    Expr::col(delivery::Column::LeaseUntil),
                )
        } else {
            update.col_expr(delivery::Column::State, Expr::value(DeliveryState::Expired))
        };
        let rows = update
            .filter(delivery::Column::Id.in_subquery(due.into_query()))
            .filter(is_due())
            .exec_with_returning(conn)
            .await?;
        history::record_lapses(conn, &rows, now).await?;
        if to_pending {
            recovered.to_pending = rows.len() as u64;
        } else {
            recovered.expired = rows.len() as u64;
            recovered.exhausted = rows
                .iter()
                .map(|d| Exhausted {
                    delivery_id: d.id.clone(),
                    subscription_id: d.subscription_id.clone(),
                    event_id: d.event_id.clone(),
                    attempts: d.attempts,
                })
                .collect();
        }
    }
    Ok(recovered)
}
