//! ACK with a lease proof (spec: delivery-model.md §6), one ACK or a batch
//! of them in one transaction (group commit, decision 0060). The ACK is
//! recorded on the delivery row (`acknowledged_at`, `ack_epoch`,
//! `ack_session_id`; §2), with no audit record per ACK (decision 0079).

use crate::store::StoreError;
use std::collections::{HashMap, HashSet};

use entity::{credential, delivery};
use sea_orm::{
    ColumnTrait, ConnectionTrait, DbBackend, EntityTrait, QueryFilter, QuerySelect, Statement,
};

use crate::{
    domain::{
        CredentialId, DeliveryId, DeliveryState, EventId, LeaseSecret, SessionId, SubscriptionId,
        Timestamp, now,
    },
    store::{Database, history, sqlite, writer::batch_or_each},
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
    if db.backend() == DbBackend::Sqlite {
        // One writer: the rows are read and decided inside the write
        // round, in place (decision 0095).
        let at = now();
        let (outcomes, refused) = db
            .write(async |txn| sqlite::on(txn, |conn| sqlite::ack::acknowledge(conn, requests, at)))
            .await?;
        if !refused.is_empty() {
            record_refusals(db, requests, &refused).await;
        }
        return Ok(outcomes);
    }
    let rows = read_rows(db, requests.iter().map(|r| r.proof.delivery_id.as_str())).await?;
    let mut outcomes: Vec<Option<AckOutcome>> = vec![None; requests.len()];
    let mut candidates = Vec::new();
    let mut later = Vec::new();
    let mut taken = HashSet::new();
    let mut refused: Vec<Refused> = Vec::new();
    for (i, request) in requests.iter().enumerate() {
        let id = request.proof.delivery_id.as_str();
        outcomes[i] = match rows.get(id) {
            None => Some(AckOutcome::NotFound),
            Some(row) if row.subscription_id != request.subscription_id.as_str() => {
                Some(AckOutcome::NotFound)
            }
            Some(row) if !row_proof_matches(row, &request.proof) => {
                refused.push(Refused::of(i, row));
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
            let outcome = match row_proof_matches(row, &request.proof) {
                true => already_acked(row).unwrap_or(AckOutcome::LeaseLost),
                false => AckOutcome::LeaseLost,
            };
            if outcome == AckOutcome::LeaseLost {
                refused.push(Refused::of(i, row));
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

/// An ACK refused with `DELIVERY_LEASE_LOST`: the request's index in its
/// batch and what the history records of its delivery.
#[derive(Debug)]
pub(crate) struct Refused {
    pub request: usize,
    pub delivery_id: String,
    pub attempts: i32,
    pub attempt_budget: i32,
}

impl Refused {
    fn of(request: usize, row: &delivery::Model) -> Refused {
        Refused {
            request,
            delivery_id: row.id.clone(),
            attempts: row.attempts,
            attempt_budget: row.attempt_budget,
        }
    }
}

/// Records the refused ACKs in the deliveries' history. Best effort: the
/// refusal is the consumer's answer and is final whatever the history says,
/// so a database that cannot write now turns no `DELIVERY_LEASE_LOST` into
/// an error (decision 0081).
async fn record_refusals(db: &Database, requests: &[AckRequest], refused: &[Refused]) {
    let refusals: Vec<history::Refusal<'_>> = refused
        .iter()
        .map(|r| history::Refusal {
            delivery_id: &r.delivery_id,
            attempts: r.attempts,
            attempt_budget: r.attempt_budget,
            offered_epoch: requests[r.request].proof.epoch,
            session_id: &requests[r.request].session_id,
        })
        .collect();
    let at = now();
    if let Err(err) = db
        .write(async |txn| history::record_refusals(&**txn, &refusals, at).await)
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
    db.write_statement(async |conn| write_acks_in(conn, requests, candidates, at).await)
        .await
}

/// [`write_acks`] as one statement on PostgreSQL (decision 0095): lock the
/// rows in id order (batches of two nodes never wait on each other in a
/// cycle), ACK each candidate still at its proof's epoch, not ACKED, and
/// whose credential is not revoked (checked inside the statement, so a
/// revocation committed before it is never outrun), and record one tally
/// per subscription for its `pending_count` (decision 0094). The lists
/// travel as comma-separated text (ids are hex): one text, planned once.
/// Each row is locked by its own primary-key lookup, in the order of the
/// sorted ids: a lateral subquery with `FOR UPDATE` is never turned into a
/// join, so the generic plan PostgreSQL keeps from when the table was tiny
/// stays an index lookup (as a semi join it was a scan of the whole table,
/// 9.4 ms at 7,000 rows; decision 0104). Parameters: `$1` delivery ids,
/// `$2` epochs, `$3` session ids, `$4` credential ids (each a
/// comma-separated text, one entry per ACK), `$5` the time in µs.
pub const WRITE_ACKS: &str = "WITH a AS (SELECT * FROM unnest(string_to_array($1, ','), \
     string_to_array($2, ',')::bigint[], string_to_array($3, ','), string_to_array($4, ',')) \
     AS a(id, epoch, session, credential)), \
     locked AS (SELECT l.id FROM (SELECT id FROM a ORDER BY id) s CROSS JOIN LATERAL \
     (SELECT d.id FROM deliveries d WHERE d.id = s.id FOR UPDATE) l), \
     acked AS (UPDATE deliveries d SET state = 'ACKED', acknowledged_at = $5, \
     ack_epoch = d.lease_epoch, ack_session_id = NULLIF(a.session, d.lease_session_id), \
     revision = d.revision + 1 FROM a WHERE d.id = a.id AND d.id IN (SELECT id FROM locked) \
     AND d.lease_epoch = a.epoch AND d.state <> 'ACKED' AND NOT EXISTS (SELECT 1 FROM \
     credentials c WHERE c.id = a.credential AND c.revoked_at IS NOT NULL) \
     RETURNING d.id, d.event_id, d.subscription_id), \
     tallied AS (INSERT INTO subscription_ack_tallies (subscription_id, acked) \
     SELECT subscription_id, count(*) FROM acked GROUP BY subscription_id) \
     SELECT id, event_id FROM acked";

/// The statement of [`write_acks`], in a transaction of its own
/// (PostgreSQL, decision 0109).
async fn write_acks_in(
    conn: &impl ConnectionTrait,
    requests: &[AckRequest],
    candidates: &[usize],
    at: Timestamp,
) -> Result<HashMap<String, String>, StoreError> {
    let list = |f: &dyn Fn(&AckRequest) -> String| {
        candidates
            .iter()
            .map(|&i| f(&requests[i]))
            .collect::<Vec<_>>()
            .join(",")
    };
    let values: [sea_orm::Value; 5] = [
        list(&|r| r.proof.delivery_id.as_str().to_owned()).into(),
        list(&|r| Ord::min(r.proof.epoch, i64::MAX as u64).to_string()).into(),
        list(&|r| r.session_id.as_str().to_owned()).into(),
        list(&|r| r.credential_id.as_str().to_owned()).into(),
        at.micros().into(),
    ];
    let rows = conn
        .query_all_raw(Statement::from_sql_and_values(
            DbBackend::Postgres,
            WRITE_ACKS,
            values,
        ))
        .await?;
    rows.iter()
        .map(|row| {
            Ok((
                row.try_get::<String>("", "id")?,
                row.try_get::<String>("", "event_id")?,
            ))
        })
        .collect()
}

/// The proof is the row's latest: same epoch (≥ 1) and the secret's digest
/// equals the stored one (constant time).
pub(crate) fn proof_matches(
    lease_epoch: i64,
    lease_digest: Option<&str>,
    proof: &LeaseProof,
) -> bool {
    let epoch_ok = u64::try_from(lease_epoch).is_ok_and(|e| e >= 1 && e == proof.epoch);
    let digest_ok = lease_digest.is_some_and(|d| proof.secret.matches_digest(d));
    epoch_ok & digest_ok
}

fn row_proof_matches(row: &delivery::Model, proof: &LeaseProof) -> bool {
    proof_matches(row.lease_epoch, row.lease_digest.as_deref(), proof)
}

fn already_acked(row: &delivery::Model) -> Option<AckOutcome> {
    (row.state == DeliveryState::Acked).then(|| AckOutcome::Acked {
        event_id: EventId::from_db(row.event_id.clone()),
        epoch: u64::try_from(row.ack_epoch.unwrap_or(row.lease_epoch)).unwrap_or(0),
        acknowledged_at: Timestamp(row.acknowledged_at.unwrap_or(0)),
        deduplicated: true,
    })
}
