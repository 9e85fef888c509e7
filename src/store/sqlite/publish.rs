//! A publish batch's statements on SQLite (spec: delivery-model.md §3,
//! http-api.md §2; decision 0095): the idempotency records under the
//! batch's keys, the append (counter row, then the events), the records
//! of the fresh writes. The rules live in `store/publish.rs` and
//! `journal.rs`.

use std::collections::HashMap;

use entity::idempotency_record;
use rusqlite::{Connection, OptionalExtension, params};
use serde_json::Value;

use super::prepared;
use crate::{
    domain::{EventId, QueueId, Timestamp, ordered_hex_id},
    journal::{Appended, NewResult},
    store::{StoreError, idempotency::WriteIdentity, writer::sqlite_error},
};

/// An expired idempotency record under a key.
pub const EXPIRE_RECORD: &str = "DELETE FROM idempotency_records WHERE key = ?1 AND credential_id = ?2 \
         AND expires_at <= ?3";

/// The idempotency record under a key.
pub const READ_RECORD: &str = "SELECT id, operation, target, request_digest, status, response, expires_at, \
         created_at FROM idempotency_records WHERE key = ?1 AND credential_id = ?2";

/// A queue's counter row: its head moves by the entries appended.
pub const ADVANCE_HEAD: &str = "UPDATE OR FAIL queues SET head_sequence = head_sequence + ?1 WHERE id = ?2 \
             RETURNING head_sequence";

/// One journal entry.
pub const APPEND: &str = "INSERT OR FAIL INTO result_events (id, queue_id, sequence, type, aggregate_kind, aggregate_id, \
         aggregate_revision, occurred_at, details, snapshot, appended_at, created_at) \
         VALUES (?1, ?2, ?3, ?4, 'task', ?5, ?6, ?7, ?8, ?9, ?10, ?10)";

/// A finished write's idempotency record.
pub const RECORD: &str = "INSERT OR FAIL INTO idempotency_records (id, credential_id, key, operation, target, \
         request_digest, status, response, expires_at, created_at) \
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10) \
         ON CONFLICT (key, credential_id) DO NOTHING";

/// The live records under the keys of `ids`, after deleting those of them
/// that expired at `now`; keyed by `(credential id, key)`.
pub(crate) fn live_records(
    conn: &Connection,
    ids: &[&WriteIdentity],
    now: Timestamp,
) -> Result<HashMap<(String, String), idempotency_record::Model>, StoreError> {
    let mut expire = prepared(conn, EXPIRE_RECORD)?;
    let mut read = prepared(conn, READ_RECORD)?;
    let mut live = HashMap::new();
    for id in ids {
        let (credential_id, key) = (id.credential_id.as_str(), id.key.as_str());
        expire
            .execute(params![key, credential_id, now.micros()])
            .map_err(sqlite_error)?;
        let record = read
            .query_row(params![key, credential_id], |r| {
                Ok(idempotency_record::Model {
                    id: r.get(0)?,
                    credential_id: credential_id.to_owned(),
                    key: key.to_owned(),
                    operation: r.get(1)?,
                    target: r.get(2)?,
                    request_digest: r.get(3)?,
                    status: r.get(4)?,
                    response: r.get(5)?,
                    expires_at: r.get(6)?,
                    created_at: r.get(7)?,
                })
            })
            .optional()
            .map_err(sqlite_error)?;
        if let Some(record) = record {
            live.insert((credential_id.to_owned(), key.to_owned()), record);
        }
    }
    Ok(live)
}

/// `journal::append_many` on SQLite: one counter-row update per queue,
/// then the events in the order of `appends`.
pub(crate) fn append_many(
    conn: &Connection,
    appends: &[(&QueueId, &[NewResult])],
    now: Timestamp,
) -> Result<Vec<Appended>, StoreError> {
    let mut next: HashMap<&str, Option<i64>> = HashMap::new();
    {
        let mut totals: Vec<(&str, i64)> = Vec::new();
        for (queue_id, results) in appends {
            let n = results.len() as i64;
            match totals.iter_mut().find(|(q, _)| *q == queue_id.as_str()) {
                Some((_, total)) => *total += n,
                None => totals.push((queue_id.as_str(), n)),
            }
        }
        let mut head = prepared(conn, ADVANCE_HEAD)?;
        for (queue_id, total) in totals {
            if total == 0 {
                continue;
            }
            let first = head
                .query_row(params![total, queue_id], |r| r.get::<_, i64>(0))
                .optional()
                .map_err(sqlite_error)?
                .map(|head| head - total + 1);
            next.insert(queue_id, first);
        }
    }
    let mut insert = prepared(conn, APPEND)?;
    let mut out = Vec::with_capacity(appends.len());
    for (queue_id, results) in appends {
        if results.is_empty() {
            out.push(Some(Vec::new()));
            continue;
        }
        let Some(Some(sequence)) = next.get_mut(queue_id.as_str()) else {
            out.push(None);
            continue;
        };
        let mut events = Vec::with_capacity(results.len());
        for r in results.iter() {
            let id = EventId::generate();
            insert
                .execute(params![
                    id.as_str(),
                    queue_id.as_str(),
                    *sequence,
                    r.result_type.as_str(),
                    r.aggregate_id,
                    r.aggregate_revision,
                    r.occurred_at.micros(),
                    r.details,
                    r.snapshot,
                    now.micros(),
                ])
                .map_err(sqlite_error)?;
            events.push((id, *sequence));
            *sequence += 1;
        }
        out.push(Some(events));
    }
    Ok(out)
}

/// Records finished writes `(identity, HTTP status, response data)`,
/// created at `now`, expiring at `expires_at`; returns how many were
/// inserted (a key already recorded inserts nothing).
pub(crate) fn insert_finished(
    conn: &Connection,
    finished: &[(&WriteIdentity, u16, &Value)],
    now: Timestamp,
    expires_at: Timestamp,
) -> Result<u64, StoreError> {
    let mut insert = prepared(conn, RECORD)?;
    let mut inserted = 0;
    for (id, status, data) in finished {
        inserted += insert
            .execute(params![
                ordered_hex_id(),
                id.credential_id.as_str(),
                id.key.as_str(),
                id.operation,
                id.target,
                id.request_digest,
                i32::from(*status),
                data.to_string(),
                expires_at.micros(),
                now.micros(),
            ])
            .map_err(sqlite_error)? as u64;
    }
    Ok(inserted)
}
