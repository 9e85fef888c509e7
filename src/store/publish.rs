//! Publishing results (spec: http-api.md §2 and §4 `POST .../results`),
//! several publish requests per transaction (group commit, decision 0063).

use std::{collections::HashSet, time::Duration};

use sea_orm::{DatabaseTransaction, DbErr};
use serde_json::Value;

use crate::{
    domain::{EventId, QueueId, Timestamp, now},
    error::{Error, Result},
    journal::{self, NewResult},
    store::{
        Commitment, Database, WriteError,
        idempotency::{self, WriteIdentity},
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

/// Renders the response `data` of a fresh publish (stored in its
/// idempotency record and sent to the client).
pub type RenderPublished = fn(&[(EventId, i64)]) -> Result<Value>;

/// Publishes each request as if alone, all in one write transaction;
/// returns one outcome per request, in order, after the commit:
/// - a key with a live record → its replay, or 409 `IDEMPOTENCY_CONFLICT`
///   for a different request (nothing written for it);
/// - an unknown queue → 404 `NOT_FOUND` (nothing written for it);
/// - otherwise its results are appended ([`journal::append_many`]: in
///   request order, one counter-row update per queue and one insert for
///   all events) and its idempotency record (HTTP 201, `render`ed data,
///   expiring after `ttl`) is written with the others in one insert.
///
/// A key that appears twice in the batch: the first request is decided
/// here, the later ones by [`publish_each`], after the commit, as a repeat
/// of it. `Ok(None)`: a concurrent transaction recorded one of the keys
/// meanwhile (PostgreSQL: the insert waited for it), nothing was written,
/// and a new attempt decides against that record. `Err` means the whole
/// batch failed and nothing was written.
///
/// The deadline (decision 0014): a request whose deadline won is left out
/// (503); the others are committed to ([`Commitment::commit`]) only after
/// their statements ran, just before the `COMMIT`, because a statement can
/// wait for a lock for any time and the deadline must still answer 503
/// then. A request whose deadline passed while its statements ran is not
/// written: the transaction is rolled back and the batch runs again
/// without it.
pub async fn publish_batch(
    db: &Database,
    requests: &[PublishRequest],
    ttl: Duration,
    render: RenderPublished,
) -> Result<Option<Vec<Option<Result<Published>>>>, DbErr> {
    let t = now();
    loop {
        let written = db
            .write(async |txn| publish_in(txn, requests, ttl, render, t).await)
            .await;
        match written {
            Ok(outcomes) => return Ok(Some(outcomes)),
            // Ends: each such attempt found a request abandoned that was
            // not at its start, and the next attempt leaves it out.
            Err(Undone::AbandonedMeanwhile) => {}
            Err(Undone::KeyRecordedMeanwhile) => return Ok(None),
            Err(Undone::Failed(err)) => return Err(err),
        }
    }
}

/// Why [`publish_in`] wrote nothing.
enum Undone {
    /// A concurrent transaction recorded one of the keys (PostgreSQL).
    KeyRecordedMeanwhile,
    /// The deadline of a request of the batch passed while its statements
    /// ran (its caller was answered 503): roll back, run again without it.
    AbandonedMeanwhile,
    Failed(DbErr),
}

impl From<DbErr> for Undone {
    fn from(err: DbErr) -> Self {
        Undone::Failed(err)
    }
}

impl WriteError for Undone {
    fn database_error(&self) -> Option<&DbErr> {
        match self {
            Undone::Failed(err) => Some(err),
            _ => None,
        }
    }
}

/// The statements of [`publish_batch`], inside `txn`.
async fn publish_in(
    txn: &DatabaseTransaction,
    requests: &[PublishRequest],
    ttl: Duration,
    render: RenderPublished,
    t: Timestamp,
) -> std::result::Result<Vec<Option<Result<Published>>>, Undone> {
    let identities: Vec<&WriteIdentity> = requests.iter().map(|r| &r.identity).collect();
    let live = idempotency::live_records(txn, &identities, t).await?;
    let mut outcomes: Vec<Option<Result<Published>>> = vec![None; requests.len()];
    let mut seen = HashSet::new();
    let mut fresh = Vec::new();
    for (i, request) in requests.iter().enumerate() {
        if request.commitment.abandoned() {
            // Its deadline passed (and answered 503) before the batch got
            // to it: nothing of it is written (http-api.md §1).
            outcomes[i] = Some(Err(Error::unavailable("the request passed its deadline")));
            continue;
        }
        let id = &request.identity;
        let key = (
            id.credential_id.as_str().to_owned(),
            id.key.as_str().to_owned(),
        );
        if let Some(record) = live.get(&key) {
            outcomes[i] = Some(idempotency::stored_answer(record, id).map(Published::Replay));
        } else if seen.insert(key) {
            fresh.push(i);
        }
        // else: a repeat of an earlier request of this batch, left `None`.
    }

    let appends: Vec<(&QueueId, &[NewResult])> = fresh
        .iter()
        .map(|&i| (&requests[i].queue_id, requests[i].results.as_slice()))
        .collect();
    let appended = journal::append_many(txn, &appends, t).await?;
    let mut finished = Vec::with_capacity(fresh.len());
    for (&i, events) in fresh.iter().zip(appended) {
        match events {
            Some(events) => {
                // Rendering strings cannot fail in practice; if it did, the
                // events of this request would lack their response: the
                // whole batch fails instead.
                let data = render(&events).map_err(|e| DbErr::Custom(e.message().to_owned()))?;
                outcomes[i] = Some(Ok(Published::Fresh(data.clone())));
                finished.push((i, data));
            }
            None => outcomes[i] = Some(Err(Error::not_found("queue not found"))),
        }
    }
    let records: Vec<(&WriteIdentity, u16, &Value)> = finished
        .iter()
        .map(|(i, data)| (&requests[*i].identity, 201, data))
        .collect();
    let inserted = idempotency::insert_finished(txn, &records, t, t.plus(ttl)).await?;
    if inserted != records.len() as u64 {
        return Err(Undone::KeyRecordedMeanwhile);
    }
    // Only the `COMMIT` is left (on SQLite: the rest of this write round,
    // then its `COMMIT`): from here on, a request written here waits
    // for this batch's outcome, deadline or not. Every one is asked, so
    // that a new attempt finds all of them decided.
    let mut abandoned = false;
    for (i, _) in &finished {
        abandoned |= !requests[*i].commitment.commit();
    }
    if abandoned {
        return Err(Undone::AbandonedMeanwhile);
    }
    Ok(outcomes)
}

/// One outcome per request, in order ([`publish_batch`], then the repeats
/// of a key within the batch, each alone after the commit). If the batch
/// fails or meets a key recorded concurrently, each request is tried again
/// alone, so that one request the database rejects never fails the others
/// that shared its transaction.
pub async fn publish_each(
    db: &Database,
    requests: &[PublishRequest],
    ttl: Duration,
    render: RenderPublished,
) -> Vec<Result<Published>> {
    if let [request] = requests {
        return vec![publish_alone(db, request, ttl, render).await];
    }
    let outcomes = match publish_batch(db, requests, ttl, render).await {
        Ok(Some(outcomes)) => outcomes,
        Ok(None) => vec![None; requests.len()],
        Err(err) if matches!(err, DbErr::ConnectionAcquire(_) | DbErr::Conn(_)) => {
            // Unreachable: one by one would only fail again, each after
            // the acquire timeout, while later publishes wait behind them.
            let err = Error::from(err);
            return requests.iter().map(|_| Err(err.clone())).collect();
        }
        Err(err) => {
            super::writer::log_failure(
                &err,
                &format!(
                    "publish batch of {} failed; publishing its requests one by one",
                    requests.len()
                ),
            );
            vec![None; requests.len()]
        }
    };
    let mut out = Vec::with_capacity(requests.len());
    for (request, outcome) in requests.iter().zip(outcomes) {
        let outcome = match outcome {
            Some(outcome) => outcome,
            None => publish_alone(db, request, ttl, render).await,
        };
        out.push(outcome);
    }
    out
}

/// Attempts of a request alone: a key recorded concurrently is decided
/// against that record on the next attempt, so a second race needs the
/// record to expire in between.
const ATTEMPTS_ALONE: usize = 3;

async fn publish_alone(
    db: &Database,
    request: &PublishRequest,
    ttl: Duration,
    render: RenderPublished,
) -> Result<Published> {
    for _ in 0..ATTEMPTS_ALONE {
        if let Some(mut outcomes) =
            publish_batch(db, std::slice::from_ref(request), ttl, render).await?
        {
            return outcomes.pop().flatten().unwrap_or_else(|| {
                Err(Error::internal("a publish batch of one answered nothing"))
            });
        }
    }
    Err(Error::internal(
        "the Idempotency-Key was recorded concurrently on every attempt",
    ))
}
