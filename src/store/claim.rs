//! Claims: lease up to N deliveries to one session in one transaction
//! (spec: delivery-model.md §6).

use crate::store::StoreError;
use std::{collections::HashMap, time::Duration};

use entity::{delivery, queue, subscription};
use sea_orm::{
    ColumnTrait, ConnectionTrait, DbBackend, EntityTrait, ExprTrait, FromQueryResult, IdenStatic,
    Iterable, JoinType, QueryFilter, QuerySelect, QueryTrait,
    sea_query::{Expr, Func},
};

use crate::{
    domain::{
        CredentialId, DeliveryState, EventId, LeaseSecret, QueueId, SessionId, SubscriptionId,
        Timestamp, now,
    },
    journal::{self, LogPosition, RenderedEvent},
    store::{
        Database, Waiter, WriteTxn, history,
        materialize::{LeaseOnInsert, MATERIALIZE_BATCH, Materialized, materialize_and_lease_in},
        postgres, sqlite, state_is, tenancy,
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
/// runs again alone); on PostgreSQL that transaction is the one statement
/// of [`postgres::claim_batch`] (decision 0109). `pause` is awaited once,
/// right after the first transaction began (on SQLite: while holding the
/// write lock; on PostgreSQL: before the statement); test builds pass a
/// hook there to keep claims stuck inside their transaction.
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
    if db.backend() == DbBackend::Postgres {
        if let Some(pause) = pause.take() {
            pause.await;
        }
        if claims.is_empty() {
            return Ok(Vec::new());
        }
        return db
            .write_statement(async |conn| postgres::claim_batch(conn, claims, lease).await)
            .await;
    }
    db.write(async |txn| {
        if let Some(pause) = pause.take() {
            pause.await;
        }
        claim_batch_in(txn, claims, lease).await
    })
    .await
}

/// One subscription as a claim checks it, read with its queue's head and
/// retention floor in one statement.
pub(crate) struct ClaimedSubscription {
    pub queue_id: QueueId,
    pub enabled: bool,
    pub cursor_sequence: i64,
    /// `None` when the queue row is missing.
    pub position: Option<LogPosition>,
}

/// The claims of one batch inside `txn`, in as few statements as the
/// batch allows (decision 0089): the credentials, the subscriptions with
/// their queues' positions, the recovery of their lapsed leases and the
/// sessions' live leases are each read or written once per batch; the
/// candidates and the lease once per subscription; the events once. On
/// PostgreSQL the same steps are one call of a server-side function
/// (decision 0108, `store::postgres`).
async fn claim_batch_in(
    txn: &WriteTxn,
    claims: &[(ClaimTarget, u32)],
    lease: Duration,
) -> Result<Vec<ClaimOutcome>, StoreError> {
    if claims.is_empty() {
        return Ok(Vec::new());
    }
    let credentials = claims.iter().map(|(t, _)| t.credential_id.as_str());
    let subscription_ids = claims.iter().map(|(t, _)| t.subscription_id.as_str());
    let read = txn.sqlite(|conn| {
        Ok((
            sqlite::claim::scopes(conn, credentials.clone())?,
            sqlite::claim::subscriptions_with_positions(conn, subscription_ids.clone())?,
        ))
    });
    let (scopes, subscriptions) = match read {
        Some(read) => read?,
        None => (
            scopes(&**txn, credentials).await?,
            subscriptions_with_positions(&**txn, subscription_ids).await?,
        ),
    };

    // Each claim is checked as if alone: its credential, then the
    // subscription (enabled, no history gap).
    let mut outcomes: Vec<Option<ClaimOutcome>> = claims
        .iter()
        .map(|(target, _)| {
            let Some(scope) = scopes.get(target.credential_id.as_str()) else {
                return Some(ClaimOutcome::Revoked);
            };
            let Some(sub) = subscriptions.get(target.subscription_id.as_str()) else {
                return Some(ClaimOutcome::Gone);
            };
            if !scope.contains(&sub.queue_id) {
                return Some(ClaimOutcome::Gone);
            }
            if !sub.enabled {
                return Some(ClaimOutcome::Paused);
            }
            match sub.position {
                Some(pos) if sub.cursor_sequence < pos.floor => {
                    Some(ClaimOutcome::HistoryExpired(pos.earliest()))
                }
                _ => None,
            }
        })
        .collect();
    let open: Vec<usize> = (0..claims.len())
        .filter(|&i| outcomes[i].is_none())
        .collect();
    if open.is_empty() {
        return Ok(outcomes.into_iter().flatten().collect());
    }

    let now = now();
    let mut open_subscriptions: Vec<&SubscriptionId> = Vec::new();
    for &i in &open {
        let id = &claims[i].0.subscription_id;
        if !open_subscriptions.contains(&id) {
            open_subscriptions.push(id);
        }
    }
    // On SQLite one look at the lapsed range tells that nothing lapsed
    // (almost always): then no recovery statement runs.
    let lapsed = match txn.sqlite(|conn| sqlite::claim::any_lapsed(conn, now)) {
        Some(Ok(false)) => Vec::new(),
        Some(Err(err)) => return Err(err),
        _ => recover_rows(&**txn, Some(&open_subscriptions), now, u64::MAX).await?,
    };
    let mut recovered: HashMap<&str, Recovered> = open_subscriptions
        .iter()
        .map(|id| {
            let rows = lapsed.iter().filter(|d| d.subscription_id == id.as_str());
            (id.as_str(), Recovered::of(rows))
        })
        .collect();
    let sessions = open.iter().map(|&i| &claims[i].0.session_id);
    let held = match txn.sqlite(|conn| sqlite::claim::live_leases(conn, sessions.clone(), now)) {
        Some(held) => held?,
        None => live_leases(&**txn, sessions.map(SessionId::as_str), now).await?,
    };
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

    // Per run of open claims of one subscription: one statement picking
    // and leasing their rows (after a materialization when short).
    let mut shares: Vec<Vec<(delivery::Model, LeaseSecret)>> =
        std::iter::repeat_with(Vec::new).take(open.len()).collect();
    let mut materialized: HashMap<usize, Materialized> = HashMap::new();
    let mut behind: HashMap<&str, bool> = HashMap::new();
    let lease_until = now.plus(lease);
    // One run per subscription (a stable sort keeps the batch's order
    // within it), so a session's claims, its subscription's cursor and its
    // row lock (taken in id order) are each met in one run only.
    let mut positions: Vec<usize> = (0..open.len()).collect();
    positions.sort_by_key(|&k| claims[open[k]].0.subscription_id.as_str());
    for run in positions
        .chunk_by(|&a, &b| claims[open[a]].0.subscription_id == claims[open[b]].0.subscription_id)
    {
        let subscription_id = &claims[open[run[0]]].0.subscription_id;
        let Some(sub) = subscriptions.get(subscription_id.as_str()) else {
            return Err(StoreError::invariant(
                "an open claim without its subscription",
            ));
        };
        // One slot per row to lease, in `(sequence, id)` order: the first
        // claim takes the first rows.
        let mut slots: Vec<(usize, &SessionId)> = run
            .iter()
            .flat_map(|&k| {
                let take = usize::try_from(takes[k]).unwrap_or(usize::MAX);
                std::iter::repeat_n((k, &claims[open[k]].0.session_id), take)
            })
            .collect();
        // Leases what the subscription's PENDING rows give to `slots`.
        lease_slots(
            txn,
            subscription_id,
            &mut slots,
            now,
            lease_until,
            &mut shares,
        )
        .await?;
        // Short of PENDING rows while entries wait below the head:
        // materialize in this transaction and lease what it inserted, one
        // commit instead of two (delivery-model.md §5).
        let head = sub.position.map_or(0, |p| p.head);
        let mut behind_head = sub.cursor_sequence < head;
        if !slots.is_empty() && behind_head {
            // The rows it inserts for the open slots are inserted LEASED
            // (one write each), and it stops there (decision 0103).
            let sessions: Vec<&SessionId> = slots.iter().map(|&(_, s)| s).collect();
            let lease = LeaseOnInsert {
                sessions: &sessions,
                lease_until,
            };
            let (m, leased) =
                materialize_and_lease_in(txn, subscription_id, MATERIALIZE_BATCH, Some(&lease))
                    .await?;
            behind_head = !m.caught_up;
            let filled = leased.len();
            for ((k, _), row) in slots.drain(..filled).zip(leased) {
                shares[k].push(row);
            }
            materialized.insert(run[0], m);
        }
        behind.insert(subscription_id.as_str(), behind_head);
    }
    // Each event read once; two subscriptions of one queue may lease the
    // same event.
    let mut uses: HashMap<String, usize> = HashMap::new();
    for (d, _) in shares.iter().flatten() {
        *uses.entry(d.event_id.clone()).or_default() += 1;
    }
    let mut events =
        match txn.sqlite(|conn| sqlite::claim::render(conn, uses.keys().map(String::as_str))) {
            Some(events) => events?,
            None => {
                let ids: Vec<EventId> = uses.keys().cloned().map(EventId::from_db).collect();
                journal::render(&**txn, &ids)
                    .await?
                    .into_iter()
                    .map(|(id, event)| (id.into_string(), event))
                    .collect()
            }
        };
    let mut event_of = |id: &str| match uses.get_mut(id) {
        Some(n) if *n > 1 => {
            *n -= 1;
            events.get(id).cloned()
        }
        _ => events.remove(id),
    };

    for (k, (&i, share)) in open.iter().zip(shares).enumerate() {
        let subscription_id = claims[i].0.subscription_id.as_str();
        let Some(sub) = subscriptions.get(subscription_id) else {
            return Err(StoreError::invariant(
                "an open claim without its subscription",
            ));
        };
        let exhausted = (share.len() as u64) < takes[k];
        let deliveries = in_order(share, &mut event_of)?;
        outcomes[i] = Some(ClaimOutcome::Leased {
            deliveries,
            exhausted,
            // Counted once, with the subscription's first claim.
            recovered: recovered.remove(subscription_id).unwrap_or_default(),
            materialized: materialized.remove(&k),
            behind_head: behind.get(subscription_id).copied().unwrap_or(false),
            queue_id: sub.queue_id.clone(),
        });
    }
    Ok(outcomes.into_iter().flatten().collect())
}

/// A claim's leased rows with their events, in `(sequence, id)` order;
/// `event_of` gives the event of an id (a missing one is an invariant
/// broken).
pub(crate) fn in_order(
    share: Vec<(delivery::Model, LeaseSecret)>,
    mut event_of: impl FnMut(&str) -> Option<RenderedEvent>,
) -> Result<Vec<LeasedDelivery>, StoreError> {
    let mut deliveries = Vec::with_capacity(share.len());
    for (delivery, secret) in share {
        let event = event_of(&delivery.event_id).ok_or_else(|| {
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
    deliveries.sort_by(|a, b| {
        (a.delivery.sequence, &a.delivery.id).cmp(&(b.delivery.sequence, &b.delivery.id))
    });
    Ok(deliveries)
}

/// `subscriptions` by id, each with its queue's head and floor, in one
/// statement (a join); an unknown id is absent.
async fn subscriptions_with_positions<'a, C: ConnectionTrait>(
    txn: &C,
    ids: impl Iterator<Item = &'a str>,
) -> Result<HashMap<String, ClaimedSubscription>, StoreError> {
    let mut ids: Vec<&str> = ids.collect();
    ids.sort_unstable();
    ids.dedup();
    #[derive(FromQueryResult)]
    struct Row {
        id: String,
        queue_id: String,
        enabled: bool,
        cursor_sequence: i64,
        head: Option<i64>,
        floor: Option<i64>,
    }
    let rows: Vec<Row> = subscription::Entity::find()
        .select_only()
        .column(subscription::Column::Id)
        .column(subscription::Column::QueueId)
        .column(subscription::Column::Enabled)
        .column(subscription::Column::CursorSequence)
        .column_as(
            Expr::col((queue::Entity, queue::Column::HeadSequence)),
            "head",
        )
        .column_as(
            Expr::col((queue::Entity, queue::Column::RetentionFloor)),
            "floor",
        )
        .join(
            JoinType::LeftJoin,
            subscription::Entity::belongs_to(queue::Entity)
                .from(subscription::Column::QueueId)
                .to(queue::Column::Id)
                .into(),
        )
        .filter(subscription::Column::Id.is_in(ids))
        .into_model()
        .all(txn)
        .await?;
    Ok(rows
        .into_iter()
        .map(|row| {
            let position = row
                .head
                .zip(row.floor)
                .map(|(head, floor)| LogPosition { head, floor });
            let sub = ClaimedSubscription {
                queue_id: QueueId::from_db(row.queue_id),
                enabled: row.enabled,
                cursor_sequence: row.cursor_sequence,
                position,
            };
            (row.id, sub)
        })
        .collect())
}

/// The queue scope of each unrevoked credential of `ids` (a revoked or
/// unknown one is absent).
async fn scopes<'a, C: ConnectionTrait>(
    txn: &C,
    ids: impl Iterator<Item = &'a str>,
) -> Result<HashMap<String, Vec<QueueId>>, StoreError> {
    let ids: Vec<CredentialId> = ids.map(|id| CredentialId::from_db(id.to_owned())).collect();
    Ok(tenancy::principals_by_id(txn, ids.iter())
        .await?
        .into_iter()
        .map(|(id, principal)| (id, principal.queue_scope))
        .collect())
}

/// The sessions' live leases on PostgreSQL: `$1` the session ids joined by
/// commas, `$2` now (µs); one row `(session_id, n)` per listed session.
/// Each count reads `ix_deliveries_leased_session` from `(session, now)`
/// on. The lapse test is a row comparison, which the planner does not take
/// as proof of `lease_until IS NOT NULL`, the predicate of
/// `ix_deliveries_leased_until`: no plan, not even a generic one made on an
/// empty table, walks that index, whose range above now also holds every
/// ACKED row's old version until VACUUM (decision 0106).
pub const LIVE_LEASES: &str = "SELECT s.id AS session_id, (SELECT count(*) FROM deliveries d \
     WHERE d.lease_session_id = s.id AND d.state = 'LEASED' \
     AND (d.lease_session_id, d.lease_until) > (s.id, $2)) AS n \
     FROM unnest(string_to_array($1, ',')) AS s(id)";

/// LEASED rows with `lease_until > now` of each of `sessions` (a session
/// without any may be absent). PostgreSQL: [`LIVE_LEASES`]; SQLite, where
/// an ACK leaves no index entry behind: one grouped query. The claim runs
/// SQLite's own statement in its round instead (`sqlite::claim`).
pub(crate) async fn live_leases<'a, C: ConnectionTrait>(
    conn: &C,
    sessions: impl Iterator<Item = &'a str>,
    now: Timestamp,
) -> Result<HashMap<String, u64>, StoreError> {
    let sessions: Vec<&str> = sessions.collect();
    let rows: Vec<(String, i64)> = if conn.get_database_backend() == DbBackend::Postgres {
        conn.query_all_raw(sea_orm::Statement::from_sql_and_values(
            DbBackend::Postgres,
            LIVE_LEASES,
            [sessions.join(",").into(), now.micros().into()],
        ))
        .await?
        .iter()
        .map(|row| Ok((row.try_get("", "session_id")?, row.try_get("", "n")?)))
        .collect::<Result<_, StoreError>>()?
    } else {
        delivery::Entity::find()
            .select_only()
            .column(delivery::Column::LeaseSessionId)
            .column_as(Expr::col(delivery::Column::Id).count(), "n")
            .filter(delivery::Column::LeaseSessionId.is_in(sessions))
            .filter(state_is(DeliveryState::Leased))
            .filter(delivery::Column::LeaseUntil.gt(now.micros()))
            .group_by(delivery::Column::LeaseSessionId)
            .into_tuple()
            .all(conn)
            .await?
    };
    Ok(rows
        .into_iter()
        .map(|(session, n)| (session, u64::try_from(n).unwrap_or(0)))
        .collect())
}

/// [`pick_and_lease`] for `slots` (each the index of its claim's share
/// and its session) at `at`: pushes each leased row to its claim's share
/// and keeps in `slots` only those left unfilled, in order.
async fn lease_slots(
    txn: &WriteTxn,
    subscription_id: &SubscriptionId,
    slots: &mut Vec<(usize, &SessionId)>,
    at: Timestamp,
    lease_until: Timestamp,
    shares: &mut [Vec<(delivery::Model, LeaseSecret)>],
) -> Result<(), StoreError> {
    let sessions: Vec<&SessionId> = slots.iter().map(|&(_, s)| s).collect();
    let leased = match txn.sqlite(|conn| {
        sqlite::claim::pick_and_lease(conn, subscription_id.as_str(), &sessions, at, lease_until)
    }) {
        Some(leased) => leased?,
        None => pick_and_lease(&**txn, subscription_id, &sessions, at, lease_until).await?,
    };
    let mut filled = vec![false; slots.len()];
    for (n, row, secret) in leased {
        filled[n] = true;
        shares[slots[n].0].push((row, secret));
    }
    let mut n = 0;
    slots.retain(|_| {
        n += 1;
        !filled[n - 1]
    });
    Ok(())
}

/// Picks up to `slots.len()` claimable rows of the subscription (PENDING,
/// available at `at`, attempts left) in `(sequence, id)` order
/// and leases the n-th of them to the session `slots[n]`, in one
/// statement (decision 0089): `lease_epoch += 1, attempts += 1, revision
/// += 1`, `leased_at = at`, `lease_until`, the session and the digest of the
/// row's own fresh secret. SQLite through sqlx (an in-memory database);
/// PostgreSQL runs the same statement as `orbit_claim_pick` (0108).
/// Returns the leased rows, each with its slot's index and its secret.
async fn pick_and_lease<C: ConnectionTrait>(
    txn: &C,
    subscription_id: &SubscriptionId,
    slots: &[&SessionId],
    at: Timestamp,
    lease_until: Timestamp,
) -> Result<Vec<(usize, delivery::Model, LeaseSecret)>, StoreError> {
    if slots.is_empty() {
        return Ok(Vec::new());
    }
    let mut values: Vec<sea_orm::Value> = Vec::with_capacity(4 + 2 * slots.len());
    let mut bind = |value: sea_orm::Value| {
        values.push(value);
        "?"
    };
    // Bound in the order they appear in the text (SQLite's `?`).
    let sub = bind(subscription_id.as_str().into());
    let available = bind(at.micros().into());
    let set_leased_at = bind(at.micros().into());
    let set_lease_until = bind(lease_until.micros().into());
    // The n-th picked row's session and digest, by rank (1-based).
    let mut by_digest: HashMap<String, (usize, LeaseSecret)> = HashMap::new();
    let mut assignment = String::new();
    for (n, session) in slots.iter().enumerate() {
        let secret = LeaseSecret::generate();
        let digest = secret.digest_hex();
        if n > 0 {
            assignment.push_str(", ");
        }
        let session = bind(session.as_str().into());
        let digest_param = bind(digest.clone().into());
        assignment.push_str(&format!("({}, {session}, {digest_param})", n + 1));
        by_digest.insert(digest, (n, secret));
    }
    let returning = delivery::Column::iter()
        .map(|c| c.as_str())
        .collect::<Vec<_>>()
        .join(", ");
    let sql = format!(
        "WITH picked AS MATERIALIZED (SELECT picked_id, row_number() OVER \
         (ORDER BY picked_sequence, picked_id) AS picked_rank \
         FROM (SELECT id AS picked_id, sequence AS picked_sequence FROM deliveries \
         WHERE subscription_id = {sub} AND state = 'PENDING' AND available_at <= {available} \
         AND attempts < attempt_budget ORDER BY sequence, id LIMIT {limit}) \
         AS candidates) \
         UPDATE deliveries SET state = 'LEASED', lease_epoch = lease_epoch + 1, \
         attempts = attempts + 1, revision = revision + 1, leased_at = {set_leased_at}, \
         lease_until = {set_lease_until}, lease_session_id = a.column2, \
         lease_digest = a.column3 \
         FROM picked JOIN (VALUES {assignment}) AS a ON a.column1 = picked.picked_rank \
         WHERE deliveries.id = picked.picked_id AND deliveries.state = 'PENDING' \
         RETURNING {returning}",
        limit = slots.len(),
    );
    let rows = txn
        .query_all_raw(sea_orm::Statement::from_sql_and_values(
            DbBackend::Sqlite,
            sql,
            values,
        ))
        .await?;
    let mut leased = Vec::with_capacity(rows.len());
    for row in rows {
        let row = delivery::Model::from_query_result(&row, "")?;
        let (slot, secret) = row
            .lease_digest
            .as_deref()
            .and_then(|d| by_digest.remove(d))
            .ok_or_else(|| {
                StoreError::invariant(format!("delivery {} was leased but not asked for", row.id))
            })?;
        leased.push((slot, row, secret));
    }
    Ok(leased)
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
    /// What a recovery did, from its rows after recovery.
    pub(crate) fn of<'a>(rows: impl Iterator<Item = &'a delivery::Model>) -> Self {
        let mut recovered = Recovered::default();
        for d in rows {
            if d.state == DeliveryState::Expired {
                recovered.expired += 1;
                recovered.exhausted.push(Exhausted {
                    delivery_id: d.id.clone(),
                    subscription_id: d.subscription_id.clone(),
                    event_id: d.event_id.clone(),
                    attempts: d.attempts,
                });
            } else {
                recovered.to_pending += 1;
            }
        }
        recovered
    }

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

/// Recovers expired leases in one statement: LEASED rows with `lease_until
/// <= now` become PENDING (`available_at = lease_until`) while `attempts <
/// attempt_budget`, else EXPIRED; each recovery is `revision += 1`.
/// Limited to `subscription_ids` when given, and to at most `limit` rows.
pub async fn recover_expired_leases<C: ConnectionTrait>(
    conn: &C,
    subscription_ids: Option<&[&SubscriptionId]>,
    now: Timestamp,
    limit: u64,
) -> Result<Recovered, StoreError> {
    let rows = recover_rows(conn, subscription_ids, now, limit).await?;
    Ok(Recovered::of(rows.iter()))
}

/// [`recover_expired_leases`]: the rows after recovery, their lapses
/// recorded in the history.
async fn recover_rows<C: ConnectionTrait>(
    conn: &C,
    subscription_ids: Option<&[&SubscriptionId]>,
    now: Timestamp,
    limit: u64,
) -> Result<Vec<delivery::Model>, StoreError> {
    // The same conditions guard the UPDATE itself: on PostgreSQL they are
    // re-checked after a concurrent writer's lock is released, so a lease
    // renewed meanwhile is never recovered.
    let is_due = || {
        let mut due = sea_orm::Condition::all()
            .add(state_is(DeliveryState::Leased))
            .add(delivery::Column::LeaseUntil.lte(now.micros()));
        if let Some(ids) = subscription_ids {
            // An expression, not the column: no index on `subscription_id`
            // serves it, so both planners take the lapsed range of
            // `ix_deliveries_leased_until` (empty while no lease lapsed)
            // instead of walking every live lease of the subscription
            // (decision 0093).
            let subscription =
                Func::coalesce([Expr::col(delivery::Column::SubscriptionId), Expr::val("")]);
            due = due.add(subscription.is_in(ids.iter().map(|id| id.as_str())));
        }
        due
    };
    let budget_left =
        || Expr::col(delivery::Column::Attempts).lt(Expr::col(delivery::Column::AttemptBudget));
    // The lease's session and times stay on the row: they are its history
    // until the next lease (decision 0081).
    let mut update = delivery::Entity::update_many()
        .col_expr(
            delivery::Column::Revision,
            Expr::col(delivery::Column::Revision).add(1),
        )
        .col_expr(
            delivery::Column::State,
            Expr::case(budget_left(), Expr::value(DeliveryState::Pending))
                .finally(Expr::value(DeliveryState::Expired))
                .into(),
        )
        .col_expr(
            delivery::Column::AvailableAt,
            Expr::case(budget_left(), Expr::col(delivery::Column::LeaseUntil))
                .finally(Expr::col(delivery::Column::AvailableAt))
                .into(),
        )
        .filter(is_due());
    if limit != u64::MAX {
        let due = delivery::Entity::find()
            .select_only()
            .column(delivery::Column::Id)
            .filter(is_due())
            .limit(limit);
        update = update.filter(delivery::Column::Id.in_subquery(due.into_query()));
    }
    let rows = update.exec_with_returning(conn).await?;
    history::record_lapses(conn, &rows, now).await?;
    Ok(rows)
}
