//! The result log (journal): the one narrow interface through which the
//! delivery engine reaches task results (spec: delivery-model.md §3).
//!
//! Append, read after a position up to the head, head, retention floor, and
//! render. The scanner, pool and connections never look at the task-result
//! shape; another journal could implement these same functions.

use crate::store::StoreError;
use std::collections::{HashMap, HashSet};

use entity::{delivery, queue, result_event, subscription};
use sea_orm::{
    ColumnTrait, ConnectionTrait, DbBackend, EntityTrait, ExprTrait, QueryFilter, QueryOrder,
    QuerySelect, QueryTrait,
    sea_query::{Expr, LockType},
};
use serde::Serialize;
use serde_json::value::RawValue;

use crate::{
    domain::{DeliveryState, EventId, QueueId, ResultType, Timestamp},
    store::wakes::Wake,
};

/// One result to append, already validated at the edge.
#[derive(Debug, Clone)]
pub struct NewResult {
    pub result_type: ResultType,
    /// The task id (`snapshot.task_id`).
    pub aggregate_id: String,
    /// Canonical uint64 decimal string.
    pub aggregate_revision: String,
    pub occurred_at: Timestamp,
    /// JSON object text.
    pub details: String,
    /// JSON object text, stored byte-exact.
    pub snapshot: String,
}

/// What the delivery engine needs of an entry: identity, position, type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JournalEntry {
    pub event_id: EventId,
    pub sequence: i64,
    pub event_type: String,
}

/// Head and retention floor of one queue's log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogPosition {
    /// Committed head: the highest appended sequence (0 when empty).
    pub head: i64,
    /// Highest purged sequence (0 when nothing was purged).
    pub floor: i64,
}

impl LogPosition {
    /// The first sequence still in the log: floor + 1.
    pub fn earliest(self) -> u64 {
        u64::try_from(self.floor).unwrap_or(0) + 1
    }
}

/// Appends `results` to `queue_id`'s log inside the caller's transaction:
/// lock the queue's counter row (`head += n`), then insert the events with
/// sequences `old_head+1 ..= old_head+n`. The row lock, held until the
/// caller commits, makes commit order equal sequence order: a reader never
/// sees a sequence while a lower one is still invisible.
///
/// Usable inside any caller's transaction (the transactional-outbox case).
/// It sends no wake itself, so the transaction takes no lock beyond the
/// counter row; after commit the caller wakes the scanner: inside a node
/// with [`crate::delivery::scanner::JournalAppended`] (which the scanner
/// also announces to the other nodes; on SQLite the node's own publishes
/// send it before their commit and `JournalCommitted` after, decision
/// 0098), outside a node with [`notify_appended`]. Without a wake the
/// fallback poll still finds the entries.
///
/// Returns the new events' ids and sequences in order, or `Ok(None)` when
/// the queue does not exist.
pub async fn append<C: ConnectionTrait>(
    conn: &C,
    queue_id: &QueueId,
    results: &[NewResult],
    now: Timestamp,
) -> Result<Option<Vec<(EventId, i64)>>, StoreError> {
    let mut appended = append_many(conn, &[(queue_id, results)], now).await?;
    Ok(appended.pop().flatten())
}

/// What one append of [`append_many`] did: its events' ids and sequences,
/// in order, or `None` when its queue does not exist.
pub type Appended = Option<Vec<(EventId, i64)>>;

/// Rows per `INSERT` of [`append_many`]: 12 parameters each, well under
/// SQLite's 32,766 and PostgreSQL's 65,535 parameters per statement.
const INSERT_CHUNK: usize = 1_000;

/// [`append`] for several appends at once, inside the caller's transaction
/// (group commit of publishes, decision 0063): one counter-row `UPDATE`
/// per distinct queue, taken in queue-id order (two transactions appending
/// to the same queues lock them in the same order, so they never
/// deadlock), and one multi-row `INSERT` for all entries. Sequences follow
/// the order of `appends`: an earlier append to a queue gets the lower
/// sequences. Returns one item per append, in order: its events' ids and
/// sequences, or `None` when its queue does not exist (nothing appended
/// for it).
pub async fn append_many<C: ConnectionTrait>(
    conn: &C,
    appends: &[(&QueueId, &[NewResult])],
    now: Timestamp,
) -> Result<Vec<Appended>, StoreError> {
    let mut totals: Vec<(&str, i64)> = Vec::new();
    for (queue_id, results) in appends {
        let n = i64::try_from(results.len())
            .map_err(|_| StoreError::invariant("more results than a sequence can count"))?;
        match totals.iter_mut().find(|(q, _)| *q == queue_id.as_str()) {
            Some((_, total)) => *total += n,
            None => totals.push((queue_id.as_str(), n)),
        }
    }
    totals.sort_unstable();
    // The next free sequence of each existing queue.
    let mut next: HashMap<&str, i64> = HashMap::with_capacity(totals.len());
    for (queue_id, total) in totals {
        if total == 0 {
            continue;
        }
        let updated = queue::Entity::update_many()
            .col_expr(
                queue::Column::HeadSequence,
                Expr::col(queue::Column::HeadSequence).add(total),
            )
            .filter(queue::Column::Id.eq(queue_id))
            .exec_with_returning(conn)
            .await?;
        if let Some(row) = updated.into_iter().next() {
            next.insert(queue_id, row.head_sequence - total + 1);
        }
    }
    let mut out = Vec::with_capacity(appends.len());
    let mut models = Vec::new();
    for (queue_id, results) in appends {
        if results.is_empty() {
            out.push(Some(Vec::new()));
            continue;
        }
        let Some(sequence) = next.get_mut(queue_id.as_str()) else {
            out.push(None);
            continue;
        };
        let mut events = Vec::with_capacity(results.len());
        for r in results.iter() {
            let id = EventId::generate();
            events.push((id.clone(), *sequence));
            models.push(result_event::ActiveModel {
                id: sea_orm::Set(id.into_string()),
                queue_id: sea_orm::Set(queue_id.as_str().to_owned()),
                sequence: sea_orm::Set(*sequence),
                event_type: sea_orm::Set(r.result_type.as_str().to_owned()),
                aggregate_kind: sea_orm::Set("task".to_owned()),
                aggregate_id: sea_orm::Set(r.aggregate_id.clone()),
                aggregate_revision: sea_orm::Set(r.aggregate_revision.clone()),
                occurred_at: sea_orm::Set(r.occurred_at.micros()),
                details: sea_orm::Set(r.details.clone()),
                snapshot: sea_orm::Set(r.snapshot.clone()),
                appended_at: sea_orm::Set(now.micros()),
                created_at: sea_orm::Set(now.micros()),
            });
            *sequence += 1;
        }
        out.push(Some(events));
    }
    let mut models = models.into_iter().peekable();
    while models.peek().is_some() {
        let chunk: Vec<_> = models.by_ref().take(INSERT_CHUNK).collect();
        result_event::Entity::insert_many(chunk)
            .exec_without_returning(conn)
            .await?;
    }
    Ok(out)
}

/// Wakes the scanners of every node for `queue_id` (PostgreSQL `NOTIFY`;
/// nothing on SQLite, which runs one node), for appenders outside a node,
/// e.g. a task system using [`append`] in its own transaction. Call it
/// after the commit on any connection; called inside the transaction
/// instead, PostgreSQL sends it at commit and drops it on rollback, at the
/// price of its notification lock (one for the whole server: every
/// notifying commit waits for the others) held through that commit.
pub async fn notify_appended<C: ConnectionTrait>(
    conn: &C,
    queue_id: &QueueId,
) -> Result<(), StoreError> {
    crate::store::wakes::notify(conn, &[Wake::Journal(queue_id.clone())], None).await
}

/// Head and floor of a queue's log, as this connection sees them.
pub async fn position<C: ConnectionTrait>(
    conn: &C,
    queue_id: &QueueId,
) -> Result<Option<LogPosition>, StoreError> {
    let row: Option<(i64, i64)> = queue::Entity::find_by_id(queue_id.as_str())
        .select_only()
        .column(queue::Column::HeadSequence)
        .column(queue::Column::RetentionFloor)
        .into_tuple()
        .one(conn)
        .await?;
    Ok(row.map(|(head, floor)| LogPosition { head, floor }))
}

/// As [`position`], for materialization: on PostgreSQL it also takes a
/// `FOR KEY SHARE` lock on the queue row until the caller commits. Appends
/// (which update the row without touching its key) are not blocked by it;
/// retention's `FOR UPDATE` ([`purge`]) is, so entries cannot be purged
/// between reading them and creating their deliveries.
pub async fn position_for_materialize<C: ConnectionTrait>(
    conn: &C,
    queue_id: &QueueId,
) -> Result<Option<LogPosition>, StoreError> {
    let mut query = queue::Entity::find_by_id(queue_id.as_str())
        .select_only()
        .column(queue::Column::HeadSequence)
        .column(queue::Column::RetentionFloor);
    if conn.get_database_backend() == DbBackend::Postgres {
        query = query.lock(LockType::KeyShare);
    }
    let row: Option<(i64, i64)> = query.into_tuple().one(conn).await?;
    Ok(row.map(|(head, floor)| LogPosition { head, floor }))
}

/// What one [`purge`] batch did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PurgeBatch {
    /// Entries deleted.
    pub purged: u64,
    /// The highest sequence examined (the next batch starts after it).
    pub examined_to: i64,
    /// No entry past `examined_to` is due: the next scan starts from 0.
    pub reached_end: bool,
    /// The retention floor after this batch.
    pub floor: i64,
}

/// One retention batch of `queue_id`'s log, inside the caller's write
/// transaction (spec: delivery-model.md §8): examines at most `limit`
/// entries with `sequence > after` in order, up to the first one appended
/// at or after `cutoff`; deletes those no non-ACKED delivery references and
/// keeps the others; raises `retention_floor` to the highest purged
/// sequence. Entries below the floor that are still present are the kept
/// ones: a later scan from 0 purges them once their deliveries are ACKED.
/// Locks the queue row (PostgreSQL `FOR UPDATE`), so no materialization of
/// the queue runs meanwhile (see [`position_for_materialize`]).
pub async fn purge<C: ConnectionTrait>(
    conn: &C,
    queue_id: &QueueId,
    after: i64,
    cutoff: Timestamp,
    limit: u64,
) -> Result<PurgeBatch, StoreError> {
    let mut query = queue::Entity::find_by_id(queue_id.as_str())
        .select_only()
        .column(queue::Column::RetentionFloor);
    if conn.get_database_backend() == DbBackend::Postgres {
        query = query.lock(LockType::Update);
    }
    let Some(floor) = query.into_tuple::<i64>().one(conn).await? else {
        return Ok(PurgeBatch {
            reached_end: true,
            ..Default::default()
        });
    };
    let rows: Vec<(String, i64, i64)> = result_event::Entity::find()
        .select_only()
        .column(result_event::Column::Id)
        .column(result_event::Column::Sequence)
        .column(result_event::Column::AppendedAt)
        .filter(result_event::Column::QueueId.eq(queue_id.as_str()))
        .filter(result_event::Column::Sequence.gt(after))
        .order_by_asc(result_event::Column::Sequence)
        .limit(limit)
        .into_tuple()
        .all(conn)
        .await?;
    let full = rows.len() as u64 == limit;
    // Sequence order is commit order, so append times grow with it: the
    // first young entry ends the scan.
    let due: Vec<(String, i64)> = rows
        .iter()
        .take_while(|(_, _, appended_at)| *appended_at < cutoff.micros())
        .map(|(id, seq, _)| (id.clone(), *seq))
        .collect();
    let reached_end = !full || due.len() < rows.len();
    let examined_to = due.last().map_or(after, |(_, seq)| *seq);
    if due.is_empty() {
        return Ok(PurgeBatch {
            purged: 0,
            examined_to,
            reached_end,
            floor,
        });
    }
    let ids: Vec<&str> = due.iter().map(|(id, _)| id.as_str()).collect();
    // Only subscriptions of this queue can reference its entries
    // (subscriptions are never deleted nor moved): the lookup goes through
    // `(subscription_id, event_id)`, so no index keyed by the event alone
    // has to follow every state change of a delivery (decision 0067).
    let subscriptions = subscription::Entity::find()
        .select_only()
        .column(subscription::Column::Id)
        .filter(subscription::Column::QueueId.eq(queue_id.as_str()))
        .into_query();
    let referenced: Vec<String> = delivery::Entity::find()
        .select_only()
        .column(delivery::Column::EventId)
        .distinct()
        .filter(delivery::Column::SubscriptionId.in_subquery(subscriptions))
        .filter(delivery::Column::EventId.is_in(ids.iter().copied()))
        .filter(delivery::Column::State.ne(DeliveryState::Acked))
        .into_tuple()
        .all(conn)
        .await?;
    let referenced: HashSet<&str> = referenced.iter().map(String::as_str).collect();
    let purge: Vec<(&str, i64)> = due
        .iter()
        .filter(|(id, _)| !referenced.contains(id.as_str()))
        .map(|(id, seq)| (id.as_str(), *seq))
        .collect();
    let Some(highest) = purge.iter().map(|(_, seq)| *seq).max() else {
        return Ok(PurgeBatch {
            purged: 0,
            examined_to,
            reached_end,
            floor,
        });
    };
    let deleted = result_event::Entity::delete_many()
        .filter(result_event::Column::Id.is_in(purge.iter().map(|(id, _)| *id)))
        .exec(conn)
        .await?
        .rows_affected;
    let floor = Ord::max(floor, highest);
    queue::Entity::update_many()
        .col_expr(queue::Column::RetentionFloor, Expr::value(floor))
        .filter(queue::Column::Id.eq(queue_id.as_str()))
        .exec(conn)
        .await?;
    Ok(PurgeBatch {
        purged: deleted,
        examined_to,
        reached_end,
        floor,
    })
}

/// Entries with `after < sequence <= up_to`, in sequence order, at most
/// `limit` (an index range scan on `(queue_id, sequence)`).
pub async fn read_after<C: ConnectionTrait>(
    conn: &C,
    queue_id: &QueueId,
    after: i64,
    up_to: i64,
    limit: u64,
) -> Result<Vec<JournalEntry>, StoreError> {
    if up_to <= after {
        return Ok(Vec::new());
    }
    let rows: Vec<(String, i64, String)> = result_event::Entity::find()
        .select_only()
        .column(result_event::Column::Id)
        .column(result_event::Column::Sequence)
        .column(result_event::Column::EventType)
        .filter(result_event::Column::QueueId.eq(queue_id.as_str()))
        .filter(result_event::Column::Sequence.gt(after))
        .filter(result_event::Column::Sequence.lte(up_to))
        .order_by_asc(result_event::Column::Sequence)
        .limit(limit)
        .into_tuple()
        .all(conn)
        .await?;
    Ok(rows
        .into_iter()
        .map(|(id, sequence, event_type)| JournalEntry {
            event_id: EventId::from_db(id),
            sequence,
            event_type,
        })
        .collect())
}

/// The event as delivered (`event` of `event.deliver`, and of the delivery
/// detail endpoint). `details` and `snapshot` are the stored text, byte-exact.
#[derive(Debug, Clone, Serialize)]
pub struct RenderedEvent {
    pub id: String,
    #[serde(serialize_with = "ser_i64_string")]
    pub sequence: i64,
    #[serde(rename = "type")]
    pub event_type: String,
    pub aggregate_kind: String,
    pub aggregate_id: String,
    pub aggregate_revision: String,
    pub occurred_at: Timestamp,
    pub details: Box<RawValue>,
    pub snapshot: Box<RawValue>,
}

fn ser_i64_string<S: serde::Serializer>(v: &i64, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(v)
}

impl RenderedEvent {
    fn from_model(m: result_event::Model) -> Result<RenderedEvent, StoreError> {
        let raw = |text: String| {
            RawValue::from_string(text)
                .map_err(|e| StoreError::invariant(format!("stored JSON: {e}")))
        };
        Ok(RenderedEvent {
            id: m.id,
            sequence: m.sequence,
            event_type: m.event_type,
            aggregate_kind: m.aggregate_kind,
            aggregate_id: m.aggregate_id,
            aggregate_revision: m.aggregate_revision,
            occurred_at: Timestamp(m.occurred_at),
            details: raw(m.details)?,
            snapshot: raw(m.snapshot)?,
        })
    }
}

/// Renders the events with the given ids (missing ids are absent from the map).
pub async fn render<C: ConnectionTrait>(
    conn: &C,
    ids: &[EventId],
) -> Result<HashMap<EventId, RenderedEvent>, StoreError> {
    if ids.is_empty() {
        return Ok(HashMap::new());
    }
    let rows = result_event::Entity::find()
        .filter(result_event::Column::Id.is_in(ids.iter().map(|i| i.as_str().to_owned())))
        .all(conn)
        .await?;
    rows.into_iter()
        .map(|m| {
            let id = EventId::from_db(m.id.clone());
            RenderedEvent::from_model(m).map(|e| (id, e))
        })
        .collect()
}
