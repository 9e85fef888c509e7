//! A materialization's statements on SQLite (spec: delivery-model.md §5;
//! decision 0095). SQLite has one writer: the subscription row needs no
//! lock, and ACKs take `pending_count` off in place (no tallies).

use entity::delivery;
use rusqlite::{Connection, OptionalExtension, params};

use super::prepared;
use crate::{
    domain::EventId,
    journal::{JournalEntry, LogPosition},
    store::{
        StoreError,
        materialize::{Found, Materializing},
        writer::sqlite_error,
    },
};

/// A subscription as a materialization reads it, with its queue's position.
pub const FIND: &str = "SELECT s.queue_id, s.enabled, s.types, s.cursor_sequence, s.pending_count, \
         s.max_pending, s.max_attempts, q.head_sequence, q.retention_floor \
         FROM subscriptions s JOIN queues q ON q.id = s.queue_id WHERE s.id = ?1";

/// Journal entries after a position, up to the head, in order.
pub const READ_AFTER: &str = "SELECT id, sequence, type FROM result_events WHERE queue_id = ?1 \
             AND sequence > ?2 AND sequence <= ?3 ORDER BY sequence LIMIT ?4";

/// One delivery row.
pub const INSERT: &str = "INSERT OR FAIL INTO deliveries (id, subscription_id, event_id, sequence, revision, state, \
             available_at, lease_epoch, leased_at, lease_until, lease_digest, lease_session_id, \
             attempts, attempt_budget, acknowledged_at, ack_epoch, ack_session_id, created_at) \
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, NULL, NULL, \
             NULL, ?15)";

/// The subscription's cursor and backlog counter.
pub const ADVANCE: &str =
    "UPDATE OR FAIL subscriptions SET cursor_sequence = ?1, pending_count = ?2 WHERE id = ?3";

/// The subscription, its queue's position and up to `batch` entries after
/// its cursor up to the head (none when the cursor is below the floor).
pub(crate) fn find(
    conn: &Connection,
    subscription_id: &str,
    batch: u64,
) -> Result<Found, StoreError> {
    let row = prepared(conn, FIND)?
        .query_row([subscription_id], |r| {
            Ok((
                Materializing {
                    id: subscription_id.to_owned(),
                    queue_id: r.get(0)?,
                    enabled: r.get(1)?,
                    types: r.get(2)?,
                    cursor_sequence: r.get(3)?,
                    pending_count: r.get(4)?,
                    folded: 0,
                    max_pending: r.get(5)?,
                    max_attempts: r.get(6)?,
                },
                LogPosition {
                    head: r.get(7)?,
                    floor: r.get(8)?,
                },
            ))
        })
        .optional()
        .map_err(sqlite_error)?;
    let Some((sub, position)) = row.filter(|(sub, _)| sub.enabled) else {
        return Ok(Found::Idle);
    };
    let entries = if sub.cursor_sequence < position.floor || position.head <= sub.cursor_sequence {
        Vec::new()
    } else {
        prepared(conn, READ_AFTER)?
            .query_map(
                params![
                    sub.queue_id,
                    sub.cursor_sequence,
                    position.head,
                    i64::try_from(batch).unwrap_or(i64::MAX)
                ],
                |r| {
                    Ok(JournalEntry {
                        event_id: EventId::from_db(r.get(0)?),
                        sequence: r.get(1)?,
                        event_type: r.get(2)?,
                    })
                },
            )
            .map_err(sqlite_error)?
            .collect::<rusqlite::Result<_>>()
            .map_err(sqlite_error)?
    };
    Ok(Found::Entries {
        sub,
        position,
        entries,
    })
}

/// Inserts `rows` and sets the subscription's `(cursor, pending_count)`
/// when given.
pub(crate) fn store(
    conn: &Connection,
    rows: &[delivery::Model],
    subscription_id: &str,
    counter: Option<(i64, i64)>,
) -> Result<(), StoreError> {
    if !rows.is_empty() {
        let mut insert = prepared(conn, INSERT)?;
        for row in rows {
            insert
                .execute(params![
                    row.id,
                    row.subscription_id,
                    row.event_id,
                    row.sequence,
                    row.revision,
                    row.state.as_str(),
                    row.available_at,
                    row.lease_epoch,
                    row.leased_at,
                    row.lease_until,
                    row.lease_digest,
                    row.lease_session_id,
                    row.attempts,
                    row.attempt_budget,
                    row.created_at,
                ])
                .map_err(sqlite_error)?;
        }
    }
    if let Some((cursor, pending_count)) = counter {
        prepared(conn, ADVANCE)?
            .execute(params![cursor, pending_count, subscription_id])
            .map_err(sqlite_error)?;
    }
    Ok(())
}
