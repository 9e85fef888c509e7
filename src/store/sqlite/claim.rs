//! A claim batch's statements on SQLite (spec: delivery-model.md §6;
//! decision 0095). The claim's rules live in `store/claim.rs`.

use std::collections::HashMap;

use entity::delivery;
use rusqlite::{Connection, OptionalExtension, Row, params};
use serde_json::value::RawValue;

use super::prepared;
use crate::{
    domain::{DeliveryState, LeaseSecret, QueueId, SessionId, Timestamp},
    journal::{LogPosition, RenderedEvent},
    store::{StoreError, claim::ClaimedSubscription, writer::sqlite_error},
};

/// A credential's queue scope, unless revoked.
pub const SCOPE: &str = "SELECT queue_scope FROM credentials WHERE id = ?1 AND revoked_at IS NULL";

/// A subscription with its queue's head and floor.
pub const SUBSCRIPTION_POSITION: &str = "SELECT s.queue_id, s.enabled, s.cursor_sequence, q.head_sequence, q.retention_floor \
         FROM subscriptions s LEFT JOIN queues q ON q.id = s.queue_id WHERE s.id = ?1";

/// Whether any lease has lapsed (the start of the lapsed range).
pub const ANY_LAPSED: &str =
    "SELECT EXISTS (SELECT 1 FROM deliveries WHERE state = 'LEASED' AND lease_until <= ?1)";

/// A session's live leases.
pub const HELD: &str = "SELECT count(*) FROM deliveries WHERE lease_session_id = ?1 AND state = 'LEASED' \
         AND lease_until > ?2";

/// A subscription's claimable rows in `(sequence, id)` order.
pub const PICK: &str = "SELECT id FROM deliveries WHERE subscription_id = ?1 AND state = 'PENDING' \
         AND available_at <= ?2 AND attempts < attempt_budget ORDER BY sequence, id LIMIT ?3";

/// An event as delivered.
pub const RENDER: &str = "SELECT sequence, type, aggregate_kind, aggregate_id, aggregate_revision, occurred_at, \
         details, snapshot FROM result_events WHERE id = ?1";

/// The columns of a delivery row, in [`delivery_of`]'s order.
macro_rules! delivery_columns {
    () => {
        "id, subscription_id, event_id, sequence, revision, state, available_at, lease_epoch, \
         leased_at, lease_until, lease_digest, lease_session_id, attempts, attempt_budget, \
         acknowledged_at, ack_epoch, ack_session_id, created_at"
    };
}

/// Leases one picked row to a session; returns the row.
pub const LEASE: &str = concat!(
    "UPDATE OR FAIL deliveries SET state = 'LEASED', lease_epoch = lease_epoch + 1, \
     attempts = attempts + 1, revision = revision + 1, leased_at = ?1, lease_until = ?2, \
     lease_session_id = ?3, lease_digest = ?4 WHERE id = ?5 RETURNING ",
    delivery_columns!()
);

/// A delivery row read in `delivery_columns!`' order.
pub(crate) fn delivery_of(r: &Row<'_>) -> rusqlite::Result<delivery::Model> {
    let state = state_of(r, 5)?;
    Ok(delivery::Model {
        id: r.get(0)?,
        subscription_id: r.get(1)?,
        event_id: r.get(2)?,
        sequence: r.get(3)?,
        revision: r.get(4)?,
        state,
        available_at: r.get(6)?,
        lease_epoch: r.get(7)?,
        leased_at: r.get(8)?,
        lease_until: r.get(9)?,
        lease_digest: r.get(10)?,
        lease_session_id: r.get(11)?,
        attempts: r.get(12)?,
        attempt_budget: r.get(13)?,
        acknowledged_at: r.get(14)?,
        ack_epoch: r.get(15)?,
        ack_session_id: r.get(16)?,
        created_at: r.get(17)?,
    })
}

/// A delivery's state in column `i`; a text that is none is an error.
pub(crate) fn state_of(r: &Row<'_>, i: usize) -> rusqlite::Result<DeliveryState> {
    let state = r.get_ref(i)?.as_str()?;
    DeliveryState::parse(state).ok_or_else(|| {
        rusqlite::Error::FromSqlConversionFailure(
            i,
            rusqlite::types::Type::Text,
            format!("unknown delivery state {state:?}").into(),
        )
    })
}

/// The queue scope of each unrevoked credential of `ids` (a revoked or
/// unknown one is absent).
pub(crate) fn scopes<'a>(
    conn: &Connection,
    ids: impl Iterator<Item = &'a str>,
) -> Result<HashMap<String, Vec<QueueId>>, StoreError> {
    let mut query = prepared(conn, SCOPE)?;
    let mut scopes = HashMap::new();
    for id in ids {
        if scopes.contains_key(id) {
            continue;
        }
        let scope: Option<String> = query
            .query_row([id], |r| r.get(0))
            .optional()
            .map_err(sqlite_error)?;
        if let Some(scope) = scope {
            let scope = serde_json::from_str::<Vec<String>>(&scope)
                .unwrap_or_default()
                .iter()
                .filter_map(|q| QueueId::parse(q))
                .collect();
            scopes.insert(id.to_owned(), scope);
        }
    }
    Ok(scopes)
}

/// Each subscription of `ids` with its queue's head and floor.
pub(crate) fn subscriptions_with_positions<'a>(
    conn: &Connection,
    ids: impl Iterator<Item = &'a str>,
) -> Result<HashMap<String, ClaimedSubscription>, StoreError> {
    let mut query = prepared(conn, SUBSCRIPTION_POSITION)?;
    let mut found = HashMap::new();
    for id in ids {
        if found.contains_key(id) {
            continue;
        }
        let sub = query
            .query_row([id], |r| {
                let head: Option<i64> = r.get(3)?;
                let floor: Option<i64> = r.get(4)?;
                Ok(ClaimedSubscription {
                    queue_id: QueueId::from_db(r.get(0)?),
                    enabled: r.get(1)?,
                    cursor_sequence: r.get(2)?,
                    position: head
                        .zip(floor)
                        .map(|(head, floor)| LogPosition { head, floor }),
                })
            })
            .optional()
            .map_err(sqlite_error)?;
        if let Some(sub) = sub {
            found.insert(id.to_owned(), sub);
        }
    }
    Ok(found)
}

/// Whether any lease of any subscription has lapsed at `now` (the start
/// of `ix_deliveries_leased_until`; almost always false, and then a claim
/// recovers nothing without touching a row).
pub(crate) fn any_lapsed(conn: &Connection, now: Timestamp) -> Result<bool, StoreError> {
    prepared(conn, ANY_LAPSED)?
        .query_row([now.micros()], |r| r.get(0))
        .map_err(sqlite_error)
}

/// LEASED rows with `lease_until > now` of each of `sessions`.
pub(crate) fn live_leases<'a>(
    conn: &Connection,
    sessions: impl Iterator<Item = &'a SessionId>,
    now: Timestamp,
) -> Result<HashMap<String, u64>, StoreError> {
    let mut query = prepared(conn, HELD)?;
    let mut held = HashMap::new();
    for session in sessions {
        if held.contains_key(session.as_str()) {
            continue;
        }
        let n: i64 = query
            .query_row(params![session.as_str(), now.micros()], |r| r.get(0))
            .map_err(sqlite_error)?;
        held.insert(session.as_str().to_owned(), u64::try_from(n).unwrap_or(0));
    }
    Ok(held)
}

/// Picks up to `slots.len()` claimable rows of the subscription (PENDING,
/// available at `at`, attempts left) in `(sequence, id)` order and leases
/// the n-th to `slots[n]`: `lease_epoch += 1, attempts += 1, revision +=
/// 1`, `leased_at = at`, `lease_until`, the session and the digest of a
/// fresh secret. Returns each leased row with its slot and secret.
pub(crate) fn pick_and_lease(
    conn: &Connection,
    subscription_id: &str,
    slots: &[&SessionId],
    at: Timestamp,
    lease_until: Timestamp,
) -> Result<Vec<(usize, delivery::Model, LeaseSecret)>, StoreError> {
    if slots.is_empty() {
        return Ok(Vec::new());
    }
    let mut pick = prepared(conn, PICK)?;
    let picked: Vec<String> = pick
        .query_map(
            params![subscription_id, at.micros(), slots.len() as i64],
            |r| r.get(0),
        )
        .map_err(sqlite_error)?
        .collect::<rusqlite::Result<_>>()
        .map_err(sqlite_error)?;
    let mut lease = prepared(conn, LEASE)?;
    let mut leased = Vec::with_capacity(picked.len());
    for (n, (id, session)) in picked.iter().zip(slots).enumerate() {
        let secret = LeaseSecret::generate();
        let row = lease
            .query_row(
                params![
                    at.micros(),
                    lease_until.micros(),
                    session.as_str(),
                    secret.digest_hex(),
                    id
                ],
                delivery_of,
            )
            .map_err(sqlite_error)?;
        leased.push((n, row, secret));
    }
    Ok(leased)
}

/// The events with these ids, rendered as delivered (an unknown id is
/// absent).
pub(crate) fn render<'a>(
    conn: &Connection,
    ids: impl Iterator<Item = &'a str>,
) -> Result<HashMap<String, RenderedEvent>, StoreError> {
    let mut query = prepared(conn, RENDER)?;
    let mut events = HashMap::new();
    for id in ids {
        let event = query
            .query_row([id], |r| {
                Ok(RenderedEvent {
                    id: id.to_owned(),
                    sequence: r.get(0)?,
                    event_type: r.get(1)?,
                    aggregate_kind: r.get(2)?,
                    aggregate_id: r.get(3)?,
                    aggregate_revision: r.get(4)?,
                    occurred_at: Timestamp(r.get(5)?),
                    details: stored_json(r, 6)?,
                    snapshot: stored_json(r, 7)?,
                })
            })
            .optional()
            .map_err(sqlite_error)?;
        if let Some(event) = event {
            events.insert(id.to_owned(), event);
        }
    }
    Ok(events)
}

/// A stored JSON text column as the raw value it is delivered as.
fn stored_json(r: &Row<'_>, i: usize) -> rusqlite::Result<Box<RawValue>> {
    RawValue::from_string(r.get(i)?).map_err(|e| {
        rusqlite::Error::FromSqlConversionFailure(i, rusqlite::types::Type::Text, e.into())
    })
}
