//! Publishing results (spec: http-api.md §2 and §4 `POST .../results`),
//! several publish requests per transaction (group commit, decision 0063).

use crate::store::StoreError;
use std::{
    collections::{HashMap, HashSet},
    time::Duration,
};

use entity::idempotency_record;
use sea_orm::{DbBackend, DbErr};
use serde::Serialize;
use serde_json::Value;
use utoipa::ToSchema;

use crate::{
    domain::{
        EventId, QueueId, Timestamp, now,
        schema::{Id, Uint64String},
    },
    error::{Error, Result},
    journal::{self, NewResult},
    store::{
        Commitment, Database, WriteError, WriteTxn,
        idempotency::{self, WriteIdentity},
        postgres, sqlite,
        writer::batch_or_each,
    },
};

/// One validated `POST /v1/queues/{queue_id}/results`, inside the
/// credential's scope.
#[derive(Debug, Clone)]
pub struct PublishRequest {
    pub identity: WriteIdentity,
    pub queue_id: QueueId,
    pub results: Vec<NewResult>,
    /// Shared with the request's HTTP deadline: the batch commits to the
    /// request once its statements ran, just before the `COMMIT`, or
    /// leaves it out when the deadline won (decision 0014).
    pub commitment: Commitment,
}

/// How a publish request ended.
#[derive(Debug, Clone)]
pub enum Published {
    /// Appended now: the response `data` rendered from its events' ids and
    /// sequences (in request order), as stored in its idempotency record.
    Fresh(Value),
    /// A repeat of an earlier request with the same key: that request's
    /// stored response `data` (with `deduplicated: true`).
    Replay(Value),
}

/// One appended event: its id and sequence.
#[derive(Debug, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AppendedEvent {
    #[schema(value_type = Id)]
    pub id: String,
    #[schema(value_type = Uint64String)]
    pub sequence: String,
}

/// `data` of a publish.
// Stored in the publish's idempotency record and replayed from there.
#[derive(Debug, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PublishResult {
    /// In request order.
    pub events: Vec<AppendedEvent>,
    /// True when this answer replays an earlier request with the same key.
    pub deduplicated: bool,
}

impl PublishResult {
    /// The answer of a fresh publish of `events` (ids and sequences).
    pub(crate) fn fresh(events: &[(EventId, i64)]) -> Result<Value, StoreError> {
        let events = events
            .iter()
            .map(|(id, seq)| AppendedEvent {
                id: id.to_string(),
                sequence: seq.to_string(),
            })
            .collect();
        serde_json::to_value(PublishResult {
            events,
            deduplicated: false,
        })
        .map_err(|e| StoreError::invariant(format!("rendering a publish answer: {e}")))
    }
}

/// Publishes each request as if alone, all in one write transaction;
/// returns one outcome per request, in order, after the commit:
/// - a key with a live record → its replay, or 409 `IDEMPOTENCY_CONFLICT`
///   for a different request (nothing written for it);
/// - an unknown queue → 404 `NOT_FOUND` (nothing written for it);
/// - otherwise its results are appended ([`journal::append_many`]: in
///   request order, one counter-row update per queue and one insert for
///   all events) and its idempotency record (HTTP 201, its [`PublishResult`],
///   expiring after `ttl`) is written with the others in one insert.
///
/// A key that appears twice in the batch: the first request is decided
/// here, the later ones (`None`) by [`publish_each`], after the commit, as a
/// repeat of it. `Err` means the whole batch failed and nothing was written.
///
/// The body runs again (the writer's rule, [`WriteError::again`]) when a
/// concurrent transaction recorded one of the keys meanwhile (the insert
/// waited for it; the next run decides against that record), or when the
/// deadline of a request passed while its statements ran (decision 0014):
/// a request whose deadline won is left out (503); the others are
/// committed to ([`Commitment::commit`]) only after their statements ran,
/// just before the `COMMIT`, because a statement can wait for a lock for any
/// time and the deadline must still answer 503 then. PostgreSQL runs the
/// batch as one statement instead ([`publish_alone`], decision 0111).
async fn publish_batch(
    db: &Database,
    requests: &[PublishRequest],
    ttl: Duration,
    written: &Written<'_>,
) -> Result<Vec<Option<Result<Published>>>, StoreError> {
    let t = now();
    if db.backend() == DbBackend::Postgres {
        return publish_alone(db, requests, ttl, t, written).await;
    }
    db.write(async |txn| publish_in(txn, requests, ttl, t, written).await)
        .await
        .map_err(|undone| match undone {
            Undone::Failed(err) => err,
            // Still racing after every attempt of the writer.
            _ => StoreError::invariant("the publish batch met concurrent writes on every attempt"),
        })
}

/// [`publish_batch`] on PostgreSQL: one call of `orbit_publish_alone`,
/// committed as the statement ends (decision 0111). The call's connection
/// is taken first, while the requests are still their deadlines' to
/// decide; then each request is committed to ([`Commitment::commit`]) and
/// the call's lock waits together last until the earliest of their
/// deadlines at most. When a deadline comes first (waiting for the
/// connection or for a lock), nothing was written: the requests past their
/// deadline are answered 503 (a committed one's caller waits for this
/// answer) and the call runs again with the others. A key recorded by
/// another transaction meanwhile fails the call as a serialization
/// failure, which the writer runs again, with what is left of the bound.
async fn publish_alone(
    db: &Database,
    requests: &[PublishRequest],
    ttl: Duration,
    t: Timestamp,
    written: &Written<'_>,
) -> Result<Vec<Option<Result<Published>>>, StoreError> {
    let expires_at = t.plus(ttl);
    let mut outcomes: Vec<Option<Result<Published>>> = vec![None; requests.len()];
    let mut left: Vec<usize> = (0..requests.len()).collect();
    loop {
        let at = tokio::time::Instant::now();
        left.retain(|&i| {
            let commitment = &requests[i].commitment;
            let past = commitment.deadline().is_some_and(|d| d <= at);
            if past || commitment.abandoned() {
                outcomes[i] = Some(Err(past_deadline()));
                return false;
            }
            true
        });
        if left.is_empty() {
            return Ok(outcomes);
        }
        let firsts = firsts_of_keys(requests, &left);
        // Every request of `left` is committed to, repeats of a key too.
        let earliest = left
            .iter()
            .filter_map(|&i| requests[i].commitment.deadline())
            .min();
        let outcome = db
            .write_statement(async |conn| {
                let acquire = postgres::acquire(conn);
                let mut pg = match earliest {
                    Some(deadline) => tokio::time::timeout_at(deadline, acquire)
                        .await
                        .map_err(|_| StoreError::PastDeadline)??,
                    None => acquire.await?,
                };
                if !left.iter().all(|&i| requests[i].commitment.commit()) {
                    return Err(StoreError::PastDeadline);
                }
                // Whole milliseconds, rounded up, from now (a run again
                // after a serialization failure gets what is left): the
                // bound never ends before the deadline, so a lock timeout
                // means at least one request is past it.
                let lock_timeout_ms = match earliest {
                    None => 0,
                    Some(deadline) => {
                        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
                        if left.is_zero() {
                            return Err(StoreError::PastDeadline);
                        }
                        i32::try_from(left.as_micros().div_ceil(1000)).unwrap_or(i32::MAX)
                    }
                };
                postgres::publish_batch(&mut pg, requests, &firsts, t, expires_at, lock_timeout_ms)
                    .await
            })
            .await;
        let batch = match outcome {
            Ok(batch) => batch,
            // A deadline came first: nothing written.
            Err(StoreError::PastDeadline) => continue,
            Err(err) if earliest.is_some() && postgres::is_lock_timeout(&err) => continue,
            Err(err) => return Err(err),
        };
        for i in answer(requests, &mut outcomes, batch) {
            written(&requests[i].queue_id, requests[i].results.len() as u64);
        }
        return Ok(outcomes);
    }
}

/// 503 for a request whose deadline won (http-api.md §1).
fn past_deadline() -> Error {
    Error::unavailable("the request passed its deadline")
}

/// The first request of each key among `candidates` (indexes into
/// `requests`), in order; a later one is a repeat of it, decided after the
/// commit ([`publish_each`]).
fn firsts_of_keys(requests: &[PublishRequest], candidates: &[usize]) -> Vec<usize> {
    let mut seen = HashSet::new();
    candidates
        .iter()
        .copied()
        .filter(|&i| seen.insert(key_of(&requests[i].identity)))
        .collect()
}

/// Fills `outcomes` from what the batch's statements did: each request
/// under a live record is answered from it (a replay or 409), each other
/// one appended or 404. Returns the appended requests, in order.
fn answer(
    requests: &[PublishRequest],
    outcomes: &mut [Option<Result<Published>>],
    batch: BatchWritten,
) -> Vec<usize> {
    for (i, request) in requests.iter().enumerate() {
        if outcomes[i].is_none()
            && let Some(record) = batch.live.get(&key_of(&request.identity))
        {
            outcomes[i] =
                Some(idempotency::stored_answer(record, &request.identity).map(Published::Replay));
        }
    }
    let mut finished = Vec::with_capacity(batch.appended.len());
    for (i, data) in batch.appended {
        outcomes[i] = Some(match data {
            Some(data) => {
                finished.push(i);
                Ok(Published::Fresh(data))
            }
            None => Err(Error::not_found("queue not found")),
        });
    }
    finished
}

/// Why [`publish_in`] wrote nothing.
enum Undone {
    /// A concurrent transaction recorded one of the keys.
    KeyRecordedMeanwhile,
    /// The deadline of a request of the batch passed while its statements
    /// ran (its caller was answered 503): roll back, run again without it.
    AbandonedMeanwhile,
    Failed(StoreError),
}

impl From<StoreError> for Undone {
    fn from(err: StoreError) -> Self {
        Undone::Failed(err)
    }
}

impl From<DbErr> for Undone {
    fn from(err: DbErr) -> Self {
        Undone::Failed(err.into())
    }
}

impl WriteError for Undone {
    fn store_error(&self) -> Option<&StoreError> {
        match self {
            Undone::Failed(err) => Some(err),
            _ => None,
        }
    }

    /// Both are decided by running the batch again: a key recorded
    /// meanwhile is answered from its record, an abandoned request is left
    /// out.
    fn again(&self) -> bool {
        matches!(
            self,
            Undone::KeyRecordedMeanwhile | Undone::AbandonedMeanwhile
        )
    }
}

/// The statements of [`publish_batch`], inside `txn` (SQLite, or through
/// sea-orm).
async fn publish_in(
    txn: &WriteTxn,
    requests: &[PublishRequest],
    ttl: Duration,
    t: Timestamp,
    written: &Written<'_>,
) -> std::result::Result<Vec<Option<Result<Published>>>, Undone> {
    let mut outcomes: Vec<Option<Result<Published>>> = vec![None; requests.len()];
    let mut candidates = Vec::with_capacity(requests.len());
    for (i, request) in requests.iter().enumerate() {
        if request.commitment.abandoned() {
            // Its deadline passed (and answered 503) before the batch got
            // to it: nothing of it is written (http-api.md §1).
            outcomes[i] = Some(Err(past_deadline()));
        } else {
            candidates.push(i);
        }
    }
    let firsts = firsts_of_keys(requests, &candidates);
    let batch = write_statements(txn, requests, &firsts, t, t.plus(ttl)).await?;
    let inserted = batch.inserted;
    let finished = answer(requests, &mut outcomes, batch);
    if inserted != finished.len() as u64 {
        return Err(Undone::KeyRecordedMeanwhile);
    }
    // Only the `COMMIT` is left (on SQLite: the rest of this write round,
    // then its `COMMIT`): from here on, a request written here waits
    // for this batch's outcome, deadline or not. Every one is asked, so
    // that a new attempt finds all of them decided.
    let mut abandoned = false;
    for &i in &finished {
        abandoned |= !requests[i].commitment.commit();
    }
    if abandoned {
        return Err(Undone::AbandonedMeanwhile);
    }
    for &i in &finished {
        written(&requests[i].queue_id, requests[i].results.len() as u64);
    }
    Ok(outcomes)
}

/// `(credential id, key)` of a write, as records are keyed.
fn key_of(identity: &WriteIdentity) -> (String, String) {
    (
        identity.credential_id.as_str().to_owned(),
        identity.key.as_str().to_owned(),
    )
}

/// What the statements of a publish batch did.
pub(crate) struct BatchWritten {
    /// The live records under the batch's keys (each request they hold is
    /// answered from its record, nothing of it written).
    pub live: HashMap<(String, String), idempotency_record::Model>,
    /// Each other request of `firsts`, in order: its answer `data` (its
    /// results appended, its record inserted with the others), or `None`
    /// when its queue does not exist (nothing written).
    pub appended: Vec<(usize, Option<Value>)>,
    /// Records inserted: fewer than requests appended means another
    /// transaction recorded one of the keys meanwhile (PostgreSQL).
    pub inserted: u64,
}

/// The batch's statements one by one (SQLite in place, or through
/// sea-orm): the live records under the keys of `firsts` (requests of
/// `requests`), after deleting the expired ones; the appends of the other
/// requests ([`journal::append_many`]: in request order, one counter-row
/// update per queue and one insert for all events); their records (HTTP
/// 201, the [`PublishResult`], expiring at `expires_at`) in one insert.
async fn write_statements(
    txn: &WriteTxn,
    requests: &[PublishRequest],
    firsts: &[usize],
    t: Timestamp,
    expires_at: Timestamp,
) -> Result<BatchWritten, StoreError> {
    let identities: Vec<&WriteIdentity> = firsts.iter().map(|&i| &requests[i].identity).collect();
    let live = match txn.sqlite(|conn| sqlite::publish::live_records(conn, &identities, t)) {
        Some(live) => live?,
        None => idempotency::live_records(&**txn, &identities, t).await?,
    };
    let fresh: Vec<usize> = firsts
        .iter()
        .copied()
        .filter(|&i| !live.contains_key(&key_of(&requests[i].identity)))
        .collect();
    let appends: Vec<(&QueueId, &[NewResult])> = fresh
        .iter()
        .map(|&i| (&requests[i].queue_id, requests[i].results.as_slice()))
        .collect();
    let appended_events = match txn.sqlite(|conn| sqlite::publish::append_many(conn, &appends, t)) {
        Some(appended) => appended?,
        None => journal::append_many(&**txn, &appends, t).await?,
    };
    let mut appended = Vec::with_capacity(fresh.len());
    for (&i, events) in fresh.iter().zip(appended_events) {
        // Rendering strings cannot fail in practice; if it did, the events
        // of this request would lack their response: the whole batch fails
        // instead.
        appended.push((i, events.as_deref().map(PublishResult::fresh).transpose()?));
    }
    let records: Vec<(&WriteIdentity, u16, &Value)> = appended
        .iter()
        .filter_map(|(i, data)| Some((&requests[*i].identity, 201, data.as_ref()?)))
        .collect();
    let inserted =
        match txn.sqlite(|conn| sqlite::publish::insert_finished(conn, &records, t, expires_at)) {
            Some(inserted) => inserted?,
            None => idempotency::insert_finished(&**txn, &records, t, expires_at).await?,
        };
    Ok(BatchWritten {
        live,
        appended,
        inserted,
    })
}

/// Told of each fresh request's queue and result count once its statements
/// ran, before the `COMMIT` (each time they run: a batch can run again).
pub type Written<'a> = dyn Fn(&QueueId, u64) + Sync + 'a;

/// One outcome per request, in order: the requests share one transaction
/// ([`publish_batch`]) under the writer's batch rule ([`batch_or_each`]: a
/// fault fails them all, a request the database refuses runs again alone);
/// then the repeats of a key within the batch, each alone after the commit,
/// as a repeat of the first. `written` hears of the appends before their
/// commit (decision 0098); nothing it is told is durable yet.
pub async fn publish_each(
    db: &Database,
    requests: &[PublishRequest],
    ttl: Duration,
    written: &Written<'_>,
) -> Vec<Result<Published>> {
    let outcomes = batch_or_each("publish batch", requests, async |batch| {
        publish_batch(db, batch, ttl, written).await
    })
    .await;
    let mut out = Vec::with_capacity(requests.len());
    for (request, outcome) in requests.iter().zip(outcomes) {
        out.push(match outcome {
            Ok(Some(outcome)) => outcome,
            Ok(None) => publish_batch(db, std::slice::from_ref(request), ttl, written)
                .await
                .map_err(Error::from)
                .and_then(|mut o| {
                    o.pop().flatten().unwrap_or_else(|| {
                        Err(StoreError::invariant("a repeat answered nothing").into())
                    })
                }),
            Err(err) => Err(Error::from(err)),
        });
    }
    out
}
