//! Materialization: turn journal entries into PENDING deliveries
//! (spec: delivery-model.md §5).

use crate::store::StoreError;
use entity::{delivery, subscription};
use sea_orm::{
    ActiveModelTrait, ColumnTrait, ConnectionTrait, DatabaseTransaction, EntityTrait,
    IntoActiveModel, QueryFilter, sea_query::Expr,
};

use crate::{
    domain::{
        DeliveryId, DeliveryState, LeaseSecret, QueueId, ResultType, SessionId, SubscriptionId,
        Timestamp, TypeSet, now,
    },
    journal::{self, JournalEntry, LogPosition},
    store::{Database, WriteTxn, lock_for_update, sqlite, tallies},
};

/// Entries read from the log per materialization transaction.
pub const MATERIALIZE_BATCH: u64 = 256;

/// What one materialization transaction did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Materialized {
    /// Deliveries inserted.
    pub inserted: u64,
    /// The batch was full: more entries may be waiting below the head.
    pub more: bool,
    /// `cursor_sequence < retention_floor`: the subscription has a history
    /// gap and was not advanced; carries the earliest available sequence.
    pub history_gap: Option<u64>,
    /// Paused (or gone): nothing was read.
    pub idle: bool,
    /// Every entry up to the head was consumed: the cursor is at the head
    /// this transaction saw.
    pub caught_up: bool,
    /// Stopped before a matching entry because the backlog window
    /// (`max_pending`) is full: nothing more can be inserted until about
    /// `refill_after` deliveries were acknowledged (decision 0062).
    pub window_full: bool,
    /// ACKs after which a materialization of a full window is worth its
    /// transaction: a quarter of `max_pending`, at most one batch
    /// ([`MATERIALIZE_BATCH`]), at least 1 (decisions 0062, 0067).
    pub refill_after: u64,
}

/// One transaction holding the subscription row lock: the ACK tallies are
/// folded into `pending_count` (decision 0094); `room = max_pending -
/// pending_count`; read entries with `cursor < sequence <= head` in order; for
/// each matching entry insert a PENDING delivery while room lasts (stopping
/// *before* a matching entry when room is 0); advance the cursor past every
/// entry consumed, matching or not; `pending_count += inserted`.
///
/// A subscription whose cursor is already at its queue's head (as the last
/// commit left them) is answered from two reads, without taking the write
/// transaction: the scanner is woken after every append commits, so there
/// is nothing to materialize until the next wake (on SQLite a publish also
/// wakes it before its commit, when this may still answer "caught up"; the
/// wake after the commit then marks the subscription again, decision 0098).
pub async fn materialize(
    db: &Database,
    subscription_id: &SubscriptionId,
) -> Result<Materialized, StoreError> {
    if let Some(outcome) = caught_up(db, subscription_id).await? {
        return Ok(outcome);
    }
    db.write(async |txn| materialize_in(txn, subscription_id, MATERIALIZE_BATCH).await)
        .await
}

/// `Some` when a write transaction would find nothing to read: the
/// subscription is enabled, has no history gap and its cursor is at the
/// head. Its answer is the one [`materialize_in`] gives then.
async fn caught_up(
    db: &Database,
    subscription_id: &SubscriptionId,
) -> Result<Option<Materialized>, StoreError> {
    let Some(sub) = subscription::Entity::find_by_id(subscription_id.as_str())
        .one(db.reader())
        .await?
    else {
        return Ok(None);
    };
    if !sub.enabled {
        return Ok(None);
    }
    let queue_id = QueueId::from_db(sub.queue_id.clone());
    let Some(pos) = journal::position(db.reader(), &queue_id).await? else {
        return Ok(None);
    };
    if sub.cursor_sequence < pos.floor || sub.cursor_sequence < pos.head {
        return Ok(None);
    }
    Ok(Some(Materialized {
        caught_up: true,
        refill_after: refill_after(sub.max_pending, MATERIALIZE_BATCH),
        ..Default::default()
    }))
}

/// See [`Materialized::refill_after`].
fn refill_after(max_pending: i32, batch: u64) -> u64 {
    (u64::try_from(max_pending).unwrap_or(0) / 4).clamp(1, batch.max(1))
}

/// The materialization transaction's statements, inside `txn` (the
/// scanner's own transaction): every row inserted PENDING.
pub(crate) async fn materialize_in(
    txn: &WriteTxn,
    subscription_id: &SubscriptionId,
    batch: u64,
) -> Result<Materialized, StoreError> {
    let (m, _) = materialize_and_lease_in(txn, subscription_id, batch, None).await?;
    Ok(m)
}

/// Sessions waiting in a claim that materializes: the first matching
/// entries are inserted already LEASED, the n-th to `sessions[n]`
/// (delivery-model.md §5 "Materialize and lease in one step": one write
/// per delivery instead of an insert and a lease).
pub(crate) struct LeaseOnInsert<'a> {
    /// One per row to lease, in slot order.
    pub sessions: &'a [&'a SessionId],
    pub lease_until: Timestamp,
}

/// A row [`materialize_and_lease_in`] inserted LEASED and the secret whose
/// digest it stores; the n-th went to [`LeaseOnInsert::sessions`]`[n]`.
pub(crate) type LeasedOnInsert = (delivery::Model, LeaseSecret);

/// What a materialization reads of its subscription, under its row lock.
#[derive(Debug, Clone)]
pub(crate) struct Materializing {
    pub id: String,
    pub queue_id: String,
    pub enabled: bool,
    pub types: String,
    pub cursor_sequence: i64,
    /// With the ACK tallies folded in (decision 0094).
    pub pending_count: i64,
    /// The ACKs those tallies took off (PostgreSQL; 0 on SQLite).
    pub folded: i64,
    pub max_pending: i32,
    pub max_attempts: i32,
}

/// What a materialization found before it decides anything.
pub(crate) enum Found {
    /// Paused, gone, or its queue gone: nothing to read.
    Idle,
    /// The subscription, its queue's position and the entries after its
    /// cursor (up to the head, at most one batch), in sequence order.
    Entries {
        sub: Materializing,
        position: LogPosition,
        entries: Vec<JournalEntry>,
    },
}

/// [`materialize_in`] in a claim's transaction: one row per open slot of
/// `lease` is inserted as if materialized (`revision 1`) and leased
/// (`revision 2, lease_epoch 1, attempts 1`) in the same insert, with
/// `leased_at = created_at`; the read then stops before the next matching
/// entry (`more` false, not `caught_up`: the cursor stays below the head;
/// decision 0103). Without `lease` every row is inserted PENDING.
pub(crate) async fn materialize_and_lease_in(
    txn: &WriteTxn,
    subscription_id: &SubscriptionId,
    batch: u64,
    lease: Option<&LeaseOnInsert<'_>>,
) -> Result<(Materialized, Vec<LeasedOnInsert>), StoreError> {
    let found =
        match txn.sqlite(|conn| sqlite::materialize::find(conn, subscription_id.as_str(), batch)) {
            Some(found) => found?,
            None => find(txn, subscription_id, batch).await?,
        };
    let Found::Entries {
        sub,
        position: pos,
        entries,
    } = found
    else {
        return Ok((IDLE, Vec::new()));
    };
    if sub.cursor_sequence < pos.floor {
        let gap = Materialized {
            history_gap: Some(pos.earliest()),
            ..Default::default()
        };
        return Ok((gap, Vec::new()));
    }
    let max_pending = sub.max_pending;
    let mut room = i64::from(max_pending) - sub.pending_count;
    let types = TypeSet::from_db(&sub.types);
    let t = now().micros();
    let mut cursor = sub.cursor_sequence;
    let mut rows = Vec::new();
    let mut leased = Vec::new();
    let mut stopped_for_room = false;
    let mut stopped_for_slots = false;
    for entry in &entries {
        let matches = ResultType::parse(&entry.event_type).is_some_and(|rt| types.contains(rt));
        if matches {
            // A claim inserts only the rows it leases: the rest stay
            // entries, inserted LEASED by the next claim rather than
            // PENDING now and leased by a second write (decision 0103).
            if lease.is_some_and(|l| leased.len() >= l.sessions.len()) {
                stopped_for_slots = true;
                break;
            }
            if room <= 0 {
                stopped_for_room = true;
                break;
            }
            room -= 1;
            let mut row = delivery::Model {
                id: DeliveryId::generate().into_string(),
                subscription_id: sub.id.clone(),
                event_id: entry.event_id.as_str().to_owned(),
                sequence: entry.sequence,
                revision: 1,
                state: DeliveryState::Pending,
                available_at: t,
                lease_epoch: 0,
                leased_at: None,
                lease_until: None,
                lease_digest: None,
                lease_session_id: None,
                attempts: 0,
                attempt_budget: sub.max_attempts,
                acknowledged_at: None,
                ack_epoch: None,
                ack_session_id: None,
                created_at: t,
            };
            let slot = lease.and_then(|l| Some((l.sessions.get(leased.len())?, l.lease_until)));
            if let Some((session, lease_until)) = slot {
                let secret = LeaseSecret::generate();
                row.state = DeliveryState::Leased;
                row.revision = 2;
                row.lease_epoch = 1;
                row.attempts = 1;
                row.leased_at = Some(t);
                row.lease_until = Some(lease_until.micros());
                row.lease_digest = Some(secret.digest_hex());
                row.lease_session_id = Some(session.as_str().to_owned());
                rows.push(row.clone());
                leased.push((row, secret));
            } else {
                rows.push(row);
            }
        }
        cursor = entry.sequence;
    }
    let inserted = rows.len() as u64;
    // The counter row is written when the cursor moved or tallies were
    // folded into `pending_count` (PostgreSQL, decision 0094).
    let counter = (cursor != sub.cursor_sequence || sub.folded != 0)
        .then_some((cursor, sub.pending_count + inserted as i64));
    match txn.sqlite(|conn| sqlite::materialize::store(conn, &rows, &sub.id, counter)) {
        Some(stored) => stored?,
        None => store(txn, rows, &sub.id, counter).await?,
    }
    let m = Materialized {
        inserted,
        more: !stopped_for_room && !stopped_for_slots && entries.len() as u64 == batch,
        history_gap: None,
        idle: false,
        caught_up: cursor == pos.head,
        window_full: stopped_for_room,
        refill_after: refill_after(max_pending, batch),
    };
    Ok((m, leased))
}

/// [`Found`] on PostgreSQL: the subscription row locked `FOR UPDATE`, its
/// queue's position `FOR KEY SHARE` (no purge meanwhile), the ACK tallies
/// folded in under that lock (decision 0094), the entries after the cursor.
async fn find(
    txn: &WriteTxn,
    subscription_id: &SubscriptionId,
    batch: u64,
) -> Result<Found, StoreError> {
    let txn: &DatabaseTransaction = txn;
    let Some(sub) = lock_for_update(
        subscription::Entity::find_by_id(subscription_id.as_str()),
        txn.get_database_backend(),
    )
    .one(txn)
    .await?
    else {
        return Ok(Found::Idle);
    };
    if !sub.enabled {
        return Ok(Found::Idle);
    }
    let queue_id = QueueId::from_db(sub.queue_id.clone());
    let Some(position) = journal::position_for_materialize(txn, &queue_id).await? else {
        return Ok(Found::Idle);
    };
    // A history gap writes nothing, so it folds nothing either: a fold
    // deletes the tallies, and only the counter row written by `store`
    // takes them off `pending_count`.
    let (folded, entries) = if sub.cursor_sequence < position.floor {
        (0, Vec::new())
    } else {
        (
            tallies::fold(txn, &sub.id).await?,
            journal::read_after(txn, &queue_id, sub.cursor_sequence, position.head, batch).await?,
        )
    };
    let sub = Materializing {
        id: sub.id,
        queue_id: sub.queue_id,
        enabled: sub.enabled,
        types: sub.types,
        cursor_sequence: sub.cursor_sequence,
        pending_count: sub.pending_count - folded,
        folded,
        max_pending: sub.max_pending,
        max_attempts: sub.max_attempts,
    };
    Ok(Found::Entries {
        sub,
        position,
        entries,
    })
}

/// Inserts `rows` and sets the subscription's `(cursor, pending_count)`
/// when given, on PostgreSQL.
async fn store(
    txn: &WriteTxn,
    rows: Vec<delivery::Model>,
    subscription_id: &str,
    counter: Option<(i64, i64)>,
) -> Result<(), StoreError> {
    let txn: &DatabaseTransaction = txn;
    if !rows.is_empty() {
        delivery::Entity::insert_many(rows.into_iter().map(|r| r.into_active_model().reset_all()))
            .exec_without_returning(txn)
            .await?;
    }
    if let Some((cursor, pending_count)) = counter {
        subscription::Entity::update_many()
            .col_expr(subscription::Column::CursorSequence, Expr::value(cursor))
            .col_expr(
                subscription::Column::PendingCount,
                Expr::value(pending_count),
            )
            .filter(subscription::Column::Id.eq(subscription_id))
            .exec(txn)
            .await?;
    }
    Ok(())
}

const IDLE: Materialized = Materialized {
    inserted: 0,
    more: false,
    history_gap: None,
    idle: true,
    caught_up: false,
    window_full: false,
    refill_after: 0,
};
