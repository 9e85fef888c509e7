//! An ACK batch on SQLite (spec: delivery-model.md §6; decision 0095):
//! each delivery is read and decided inside the write transaction, so
//! what the batch writes is decided on what it sees; `pending_count`
//! drops once per subscription.

use std::collections::{BTreeMap, HashMap};

use rusqlite::{Connection, OptionalExtension, params};

use super::prepared;
use crate::{
    domain::{DeliveryState, EventId, Timestamp},
    store::{
        StoreError,
        ack::{AckOutcome, AckRequest, Refused, proof_matches},
        writer::sqlite_error,
    },
};

/// What an ACK reads of its delivery.
pub const READ: &str = "SELECT subscription_id, event_id, state, lease_epoch, lease_digest, \
     ack_epoch, acknowledged_at, attempts, attempt_budget FROM deliveries WHERE id = ?1";
/// Whether a credential is revoked.
pub const REVOKED: &str = "SELECT revoked_at IS NOT NULL FROM credentials WHERE id = ?1";
/// The ACK, on the row (delivery-model.md §2). The lease's session stays
/// on the row; the ACK's is recorded only when it differs (decision 0081).
pub const ACK: &str = "UPDATE OR FAIL deliveries SET state = 'ACKED', acknowledged_at = ?1, \
     ack_epoch = lease_epoch, ack_session_id = NULLIF(?2, lease_session_id), \
     revision = revision + 1 WHERE id = ?3";
/// A subscription's backlog counter after its ACKs.
pub const PENDING_COUNT: &str =
    "UPDATE OR FAIL subscriptions SET pending_count = pending_count - ?1 WHERE id = ?2";

/// Decides and writes each request of the batch in order, at `at`: one
/// outcome per request, and the refused ones for the history. Two requests
/// with the same proof: the second reads the row the first ACKed
/// (`deduplicated`).
pub(crate) fn acknowledge(
    conn: &Connection,
    requests: &[AckRequest],
    at: Timestamp,
) -> Result<(Vec<AckOutcome>, Vec<Refused>), StoreError> {
    let mut read = prepared(conn, READ)?;
    let mut revoked_query = prepared(conn, REVOKED)?;
    let mut ack = prepared(conn, ACK)?;
    let mut revoked: HashMap<&str, bool> = HashMap::new();
    let mut per_subscription: BTreeMap<String, i64> = BTreeMap::new();
    let mut outcomes = Vec::with_capacity(requests.len());
    let mut refused = Vec::new();
    for (i, request) in requests.iter().enumerate() {
        let proof = &request.proof;
        let row = read
            .query_row([proof.delivery_id.as_str()], |r| {
                Ok(Row {
                    subscription_id: r.get(0)?,
                    event_id: r.get(1)?,
                    acked: super::claim::state_of(r, 2)? == DeliveryState::Acked,
                    lease_epoch: r.get(3)?,
                    lease_digest: r.get(4)?,
                    ack_epoch: r.get(5)?,
                    acknowledged_at: r.get(6)?,
                    attempts: r.get(7)?,
                    attempt_budget: r.get(8)?,
                })
            })
            .optional()
            .map_err(sqlite_error)?;
        let outcome = match row {
            None => AckOutcome::NotFound,
            Some(row) if row.subscription_id != request.subscription_id.as_str() => {
                AckOutcome::NotFound
            }
            Some(row) if !proof_matches(row.lease_epoch, row.lease_digest.as_deref(), proof) => {
                refused.push(Refused {
                    request: i,
                    delivery_id: proof.delivery_id.as_str().to_owned(),
                    attempts: row.attempts,
                    attempt_budget: row.attempt_budget,
                });
                AckOutcome::LeaseLost
            }
            Some(row) if row.acked => AckOutcome::Acked {
                event_id: EventId::from_db(row.event_id),
                epoch: u64::try_from(row.ack_epoch.unwrap_or(row.lease_epoch)).unwrap_or(0),
                acknowledged_at: Timestamp(row.acknowledged_at.unwrap_or(0)),
                deduplicated: true,
            },
            Some(row) => {
                let credential = request.credential_id.as_str();
                let is_revoked = match revoked.get(credential) {
                    Some(&known) => known,
                    None => {
                        let known = revoked_query
                            .query_row([credential], |r| r.get::<_, bool>(0))
                            .optional()
                            .map_err(sqlite_error)?
                            .unwrap_or(false);
                        revoked.insert(credential, known);
                        known
                    }
                };
                if is_revoked {
                    AckOutcome::Revoked
                } else {
                    ack.execute(params![
                        at.micros(),
                        request.session_id.as_str(),
                        proof.delivery_id.as_str()
                    ])
                    .map_err(sqlite_error)?;
                    *per_subscription.entry(row.subscription_id).or_default() += 1;
                    AckOutcome::Acked {
                        event_id: EventId::from_db(row.event_id),
                        epoch: proof.epoch,
                        acknowledged_at: at,
                        deduplicated: false,
                    }
                }
            }
        };
        outcomes.push(outcome);
    }
    if !per_subscription.is_empty() {
        let mut pending_count = prepared(conn, PENDING_COUNT)?;
        for (subscription_id, n) in &per_subscription {
            pending_count
                .execute(params![n, subscription_id])
                .map_err(sqlite_error)?;
        }
    }
    Ok((outcomes, refused))
}

/// What an ACK reads of its delivery.
struct Row {
    subscription_id: String,
    event_id: String,
    acked: bool,
    lease_epoch: i64,
    lease_digest: Option<String>,
    ack_epoch: Option<i64>,
    acknowledged_at: Option<i64>,
    attempts: i32,
    attempt_budget: i32,
}
