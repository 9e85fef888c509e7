//! ACK with a lease proof (spec: delivery-model.md §6), one ACK or a batch
//! of them in one transaction (group commit, decision 0060). The ACK is
//! recorded on the delivery row (`acknowledged_at`, `ack_epoch`,
//! `ack_session_id`; §2), with no audit record per ACK (decision 0079).

use crate::store::StoreError;
use std::collections::{BTreeMap, HashMap, HashSet};

use entity::{credential, delivery};
use sea_orm::{
    ColumnTrait, Condition, DatabaseTransaction, DbBackend, EntityTrait, ExprTrait, QueryFilter,
    QueryOrder, QuerySelect,
    sea_query::{CaseStatement, Expr, Func, Query},
};

use crate::{
    domain::{
        CredentialId, DeliveryId, DeliveryState, EventId, LeaseSecret, SessionId, SubscriptionId,
        Timestamp, now,
    },
    store::{Database, history, lock_for_update, state_is, tallies, writer::batch_or_each},
};

/// A lease proof as presented by a consumer.
#[derive(Debug, Clone)]
pub struct LeaseProof {
    pub delivery_id: DeliveryId,
    pub epoch: u64,
    pub secret: LeaseSecret,
}

/// The answer to an ACK.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AckOutcome {
    /// Now (or already, `deduplicated`) ACKED; `acknowledged_at` is the
    /// original time of the first valid ACK.
    Acked {
        event_id: EventId,
        epoch: u64,
        acknowledged_at: Timestamp,
        deduplicated: bool,
    },
    /// Older epoch, wrong secret, never leased: the connection stays open.
    LeaseLost,
    /// Not a delivery of this subscription (unknown or another's).
    NotFound,
    /// The session's credential was revoked: nothing was written
    /// (UNAUTHENTICATED, and the connection closes).
    Revoked,
}

/// One ACK: the proof, and the session it came on (its subscription, its
/// credential; the session is recorded on the ACKED row).
#[derive(Debug, Clone)]
pub struct AckRequest {
    pub subscription_id: SubscriptionId,
    pub session_id: SessionId,
    pub credential_id: CredentialId,
    pub proof: LeaseProof,
}

/// One outcome per request, in order: the ACKs share one transaction
/// ([`acknowledge_batch`]) under the writer's batch rule
/// ([`batch_or_each`]: a fault fails them all, an ACK the database refuses
/// runs again alone, so it never fails the others).
pub async fn acknowledge_each(
    db: &Database,
    requests: &[AckRequest],
) -> Vec<Result<AckOutcome, StoreError>> {
    batch_or_each("ACK batch", requests, async |batch| {
        acknowledge_batch(db, batch).await
    })
    .await
}

/// Acknowledges each request as if alone, in one write transaction for the
/// whole batch; returns one outcome per request, in order:
/// - the latest proof on a LEASED, PENDING or EXPIRED row → ACKED,
///   `acknowledged_at = now`, `ack_epoch` = the proof's epoch,
///   `ack_session_id` = the request's session, `revision += 1`, and
///   `pending_count -= n` once per subscription of the batch (on
///   PostgreSQL as a tally the next materialization folds in, so that no
///   ACK waits for the subscription row's lock; decision 0094);
/// - an ACKED row and the proof that acknowledged it → the original
///   `acknowledged_at`, `deduplicated`, nothing written;
/// - anything else → `LeaseLost`; a delivery of another subscription (or
///   none) → `NotFound`;
/// - an ACK whose credential is revoked when its transaction runs →
///   `Revoked`, nothing written (checked inside the batch's `UPDATE`, so a
///   revocation committed before it is never outrun; no read per ACK).
///
/// Proofs are compared by digest in constant time. Decisions are read
/// first outside the write transaction, in one query: a consumer only holds
/// a secret after its lease committed, and an ACKED row never changes, so
/// "lost" and "duplicate" are final; only matching proofs take the write
/// path, whose `UPDATE` re-checks the epoch and the state. The same proof
/// twice in one batch: the first ACKs, the second is answered from the row
/// after the commit (`deduplicated`). Nothing is answered before the
/// commit; `Err` means the whole batch failed and nothing was written.
pub async fn acknowledge_batch(
    db: &Database,
    requests: &[AckRequest],
) -> Result<Vec<AckOutcome>, StoreError> {
    let rows = read_rows(db, requests.iter().map(|r| r.proof.delivery_id.as_str())).await?;
    let mut outcomes: Vec<Option<AckOutcome>> = vec![None; requests.len()];
    let mut candidates = Vec::new();
    let mut later = Vec::new();
    let mut taken = HashSet::new();
    let mut refused: Vec<(usize, delivery::Model)> = Vec::new();
    for (i, request) in requests.iter().enumerate() {
        let id = request.proof.delivery_id.as_str();
        outcomes[i] = match rows.get(id) {
            None => Some(AckOutcome::NotFound),
            Some(row) if row.subscription_id != request.subscription_id.as_str() => {
                Some(AckOutcome::NotFound)
            }
            Some(row) if !proof_matches(row, &request.proof) => {
                refused.push((i, row.clone()));
                Some(AckOutcome::LeaseLost)
            }
            Some(row) => match already_acked(row) {
                Some(outcome) => Some(outcome),
                None => {
                    if taken.insert(id) {
                        candidates.push(i);
                    } else {
                        later.push(i);
                    }
                    None
                }
            },
        };
    }

    if !candidates.is_empty() {
        let at = now();
        let acked = write_acks(db, requests, &candidates, at).await?;
        for &i in &candidates {
            match acked.get(requests[i].proof.delivery_id.as_str()) {
                Some(event_id) => {
                    outcomes[i] = Some(AckOutcome::Acked {
                        event_id: EventId::from_db(event_id.clone()),
                        epoch: requests[i].proof.epoch,
                        acknowledged_at: at,
                        deduplicated: false,
                    });
                }
                // Revoked, or a concurrent ACK or a new lease won: the
                // credential, then the row tell which.
                None => later.push(i),
            }
        }
    }

    if !later.is_empty() {
        let revoked = revoked_credentials(
            db,
            later.iter().map(|&i| requests[i].credential_id.as_str()),
        )
        .await?;
        later.retain(|&i| {
            let gone = revoked.contains(requests[i].credential_id.as_str());
            if gone {
                outcomes[i] = Some(AckOutcome::Revoked);
            }
            !gone
        });
    }

    if !later.is_empty() {
        let rows = read_rows(
            db,
            later
                .iter()
                .map(|&i| requests[i].proof.delivery_id.as_str()),
        )
        .await?;
        for i in later {
            let request = &requests[i];
            let row = rows
                .get(request.proof.delivery_id.as_str())
                .ok_or_else(|| {
                    StoreError::invariant(format!(
                        "delivery {} vanished after its ACK was tried",
                        request.proof.delivery_id
                    ))
                })?;
            let outcome = match proof_matches(row, &request.proof) {
                true => already_acked(row).unwrap_or(AckOutcome::LeaseLost),
                false => AckOutcome::LeaseLost,
            };
            if outcome == AckOutcome::LeaseLost {
                refused.push((i, row.clone()));
            }
            outcomes[i] = Some(outcome);
        }
    }
    if !refused.is_empty() {
        record_refusals(db, requests, &refused).await;
    }
    outcomes
        .into_iter()
        .map(|o| o.ok_or_else(|| StoreError::invariant("an ACK of the batch was not decided")))
        .collect()
}

/// Records the refused ACKs in the deliveries' history. Best effort: the
/// refusal is the consumer's answer and is final whatever the history says,
/// so a database that cannot write now turns no `DELIVERY_LEASE_LOST` into
/// an error (decision 0081).
async fn record_refusals(
    db: &Database,
    requests: &[AckRequest],
    refused: &[(usize, delivery::Model)],
) {
    let refusals: Vec<history::Refusal<'_>> = refused
        .iter()
        .map(|(i, row)| history::Refusal {
            delivery: row,
            offered_epoch: requests[*i].proof.epoch,
            session_id: &requests[*i].session_id,
        })
        .collect();
    let at = now();
    if let Err(err) = db
        .write(async |txn| history::record_refusals(txn, &refusals, at).await)
        .await
    {
        crate::store::writer::log_failure(&err, "could not record a refused ACK in its history");
    }
}

/// The delivery rows with these ids (one `IN` query on the primary key).
async fn read_rows<'a>(
    db: &Database,
    ids: impl Iterator<Item = &'a str>,
) -> Result<HashMap<String, delivery::Model>, StoreError> {
    let ids: HashSet<&str> = ids.collect();
    let rows = delivery::Entity::find()
        .filter(delivery::Column::Id.is_in(ids))
        .all(db.reader())
        .await?;
    Ok(rows.into_iter().map(|r| (r.id.clone(), r)).collect())
}

/// Which of these credentials are revoked (read only when an ACK of the
/// batch was not written).
async fn revoked_credentials<'a>(
    db: &Database,
    ids: impl Iterator<Item = &'a str>,
) -> Result<HashSet<String>, StoreError> {
    let ids: HashSet<&str> = ids.collect();
    let revoked: Vec<String> = credential::Entity::find()
        .select_only()
        .column(credential::Column::Id)
        .filter(credential::Column::Id.is_in(ids))
        .filter(credential::Column::RevokedAt.is_not_null())
        .into_tuple()
        .all(db.reader())
        .await?;
    Ok(revoked.into_iter().collect())
}

/// One transaction: every candidate still at its proof's epoch and not
/// ACKED, and whose credential is not revoked, becomes ACKED;
/// `pending_count` drops once per subscription. Returns the event id of
/// each delivery it
/// ACKed. (PostgreSQL aborting it for a deadlock with another node's batch
/// runs it again: the writer's rule.)
async fn write_acks(
    db: &Database,
    requests: &[AckRequest],
    candidates: &[usize],
    at: Timestamp,
) -> Result<HashMap<String, String>, StoreError> {
    db.write(async |txn| write_acks_in(txn, db.backend(), requests, candidates, at).await)
        .await
}

/// The statements of [`write_acks`], inside `txn`.
async fn write_acks_in(
    txn: &DatabaseTransaction,
    backend: DbBackend,
    requests: &[AckRequest],
    candidates: &[usize],
    at: Timestamp,
) -> Result<HashMap<String, String>, StoreError> {
    let ids: Vec<&str> = candidates
        .iter()
        .map(|&i| requests[i].proof.delivery_id.as_str())
        .collect();
    if backend == DbBackend::Postgres {
        // Row locks in id order: batches of two nodes never wait on each
        // other in a cycle.
        let _: Vec<String> = lock_for_update(
            delivery::Entity::find()
                .select_only()
                .column(delivery::Column::Id)
                .filter(delivery::Column::Id.is_in(ids.iter().copied()))
                .order_by_asc(delivery::Column::Id),
            DbBackend::Postgres,
        )
        .into_tuple()
        .all(txn)
        .await?;
    }
    // Per credential of the batch: its ACKs at their proofs' epochs, while
    // the credential is not revoked (one lookup per credential, inside this
    // statement).
    let mut by_credential: BTreeMap<&str, Condition> = BTreeMap::new();
    let mut sessions: Option<CaseStatement> = None;
    for &i in candidates {
        let proof = &requests[i].proof;
        let epoch = i64::try_from(proof.epoch).unwrap_or(i64::MAX);
        let when = delivery::Column::Id.eq(proof.delivery_id.as_str());
        let session = requests[i].session_id.as_str();
        sessions = Some(match sessions {
            None => Expr::case(when, session),
            Some(case) => case.case(when, session),
        });
        let acks = by_credential
            .remove(requests[i].credential_id.as_str())
            .unwrap_or_else(Condition::any);
        by_credential.insert(
            requests[i].credential_id.as_str(),
            acks.add(
                Condition::all()
                    .add(delivery::Column::Id.eq(proof.delivery_id.as_str()))
                    .add(delivery::Column::LeaseEpoch.eq(epoch)),
            ),
        );
    }
    let mut at_epoch = Condition::any();
    for (credential_id, acks) in by_credential {
        let revoked = Query::select()
            .expr(Expr::val(1))
            .from(credential::Entity)
            .and_where(credential::Column::Id.eq(credential_id))
            .and_where(credential::Column::RevokedAt.is_not_null())
            .to_owned();
        at_epoch = at_epoch.add(Condition::all().add(acks).add(Expr::exists(revoked).not()));
    }
    let Some(sessions) = sessions else {
        return Ok(HashMap::new());
    };
    let acked = delivery::Entity::update_many()
        .col_expr(delivery::Column::State, Expr::value(DeliveryState::Acked))
        .col_expr(delivery::Column::AcknowledgedAt, Expr::value(at.micros()))
        .col_expr(
            delivery::Column::AckEpoch,
            Expr::col(delivery::Column::LeaseEpoch),
        )
        // Recorded only when it differs from the lease's session, which
        // stays on the row: the ACKED row, kept for days, does not carry
        // the same 32 characters twice (decision 0081).
        .col_expr(
            delivery::Column::AckSessionId,
            Func::cust("NULLIF")
                .arg(sessions)
                .arg(Expr::col(delivery::Column::LeaseSessionId))
                .into(),
        )
        .col_expr(
            delivery::Column::Revision,
            Expr::col(delivery::Column::Revision).add(1),
        )
        .filter(at_epoch)
        .filter(state_is(DeliveryState::Acked).not())
        .exec_with_returning(txn)
        .await?;
    if acked.is_empty() {
        return Ok(HashMap::new());
    }

    // Sorted: on SQLite, where the counter is updated in place, batches
    // meet the subscription rows in one order.
    let mut per_subscription: BTreeMap<&str, i64> = BTreeMap::new();
    for row in &acked {
        *per_subscription
            .entry(row.subscription_id.as_str())
            .or_default() += 1;
    }
    tallies::record(txn, &per_subscription).await?;
    Ok(acked.into_iter().map(|r| (r.id, r.event_id)).collect())
}

/// The proof is the row's latest: same epoch (≥ 1) and the secret's digest
/// equals the stored one (constant time).
fn proof_matches(row: &delivery::Model, proof: &LeaseProof) -> bool {
    let epoch_ok = u64::try_from(row.lease_epoch).is_ok_and(|e| e >= 1 && e == proof.epoch);
    let digest_ok = row
        .lease_digest
        .as_deref()
        .is_some_and(|d| proof.secret.matches_digest(d));
    epoch_ok & digest_ok
}

fn already_acked(row: &delivery::Model) -> Option<AckOutcome> {
    (row.state == DeliveryState::Acked).then(|| AckOutcome::Acked {
        event_id: EventId::from_db(row.event_id.clone()),
        epoch: u64::try_from(row.ack_epoch.unwrap_or(row.lease_epoch)).unwrap_or(0),
        acknowledged_at: Timestamp(row.acknowledged_at.unwrap_or(0)),
        deduplicated: true,
    })
}
