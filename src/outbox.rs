//! The transactional outbox for Rust producers: append a task result to a
//! queue's log inside the producer's own database transaction, so the
//! result commits or rolls back with the producer's own rows (spec:
//! delivery-model.md §3; guide: docs/outbox.md; decision 0087).
//!
//! The producer's transaction must be on the node's database. The append
//! takes the queue's head row lock until the producer commits, so commit
//! order is sequence order, exactly as for `POST …/results`.

use sea_orm::{DatabaseTransaction, TransactionTrait};
use serde_json::{Value, json};

use crate::{
    domain::{CredentialId, QueueId, Timestamp, now},
    error::{Error, Result},
    http::results::{PublishedResult, validate_result},
    journal,
    store::idempotency::{self, Begin, IdempotencyKey, WriteIdentity},
    strict_json,
};

/// How long a key remembers its append: the node's default
/// `retention.idempotency_max_age_s` (7 days); the node's sweeper purges
/// the record after that.
const KEY_MAX_AGE_S: i64 = 604_800;

/// One appended result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Appended {
    /// The event's id (32 lowercase hex characters).
    pub event_id: String,
    /// Its position in the queue's log (1-based, dense).
    pub sequence: u64,
    /// `true` when the key had already appended this result in a committed
    /// transaction: nothing was appended now, and this is that append.
    pub deduplicated: bool,
}

/// Appends `result` (the JSON text of one result, as one element of the
/// `results` array of `POST /v1/queues/{queue_id}/results`) to `queue_id`'s
/// log inside `txn`, the caller's transaction on the node's database.
///
/// With `idempotency_key` (1–255 visible ASCII characters, scoped to the
/// queue), a transaction retried after its commit was lost appends once:
/// the retry gets the first append back with `deduplicated: true`; the same
/// key with another result is 409 `IDEMPOTENCY_CONFLICT`. Every node is
/// woken when the transaction commits (PostgreSQL `NOTIFY`, dropped on
/// rollback); on SQLite the node finds the entry within
/// `timing.scan_interval_ms`.
///
/// Errors, with the codes of result ingest (http-api.md §3): 400
/// `INVALID_ARGUMENT` naming the field (`result.snapshot.queue_id: …`),
/// 404 `NOT_FOUND` for an unknown queue, 409 `IDEMPOTENCY_CONFLICT`,
/// `UNAVAILABLE` when the database fails. After an error the transaction
/// holds no part of this append; the caller decides to roll back or not.
pub async fn append_result(
    txn: &DatabaseTransaction,
    queue_id: &str,
    result: &str,
    idempotency_key: Option<&str>,
) -> Result<Appended> {
    let queue = QueueId::parse(queue_id).ok_or_else(|| Error::not_found("queue not found"))?;
    let parsed: PublishedResult = strict_json::parse(result.as_bytes()).map_err(|e| {
        let field = if e.path == "." {
            "result".to_owned()
        } else {
            format!("result.{}", e.path)
        };
        Error::invalid_argument(format!("{field}: {}", e.message))
    })?;
    let (new_result, normalized) = validate_result(&queue, "result", parsed)?;
    let identity = idempotency_key
        .map(|key| {
            let key = IdempotencyKey::parse(key).ok_or_else(|| {
                Error::invalid_argument("idempotency_key: must be 1-255 visible ASCII characters")
            })?;
            // Outbox keys are scoped to the queue: its id stands where a
            // credential's would (ids are random 128-bit, never shared).
            WriteIdentity::new(
                &CredentialId::from_db(queue.as_str().to_owned()),
                key,
                "outbox.append",
                queue.as_str(),
                &normalized,
            )
        })
        .transpose()?;
    let at = now();
    // A savepoint: an append refused half-way leaves the caller's
    // transaction as it was.
    let inner = txn.begin().await.map_err(Error::from)?;
    if let Some(identity) = &identity
        && let Begin::Replay(data) = idempotency::begin(&inner, identity, at).await?
    {
        inner.commit().await.map_err(Error::from)?;
        return replayed(&data);
    }
    let appended = journal::append(&inner, &queue, std::slice::from_ref(&new_result), at)
        .await?
        .ok_or_else(|| Error::not_found("queue not found"))?;
    let (event_id, sequence) = appended
        .into_iter()
        .next()
        .ok_or_else(|| Error::internal("an append of one result appended none"))?;
    let sequence = u64::try_from(sequence).map_err(Error::internal)?;
    if let Some(identity) = &identity {
        let data = json!({ "event_id": event_id.as_str(), "sequence": sequence.to_string() });
        idempotency::finish(
            &inner,
            identity,
            201,
            &data,
            Timestamp(at.micros() + KEY_MAX_AGE_S * 1_000_000),
        )
        .await?;
    }
    journal::notify_appended(&inner, &queue).await?;
    inner.commit().await.map_err(Error::from)?;
    Ok(Appended {
        event_id: event_id.as_str().to_owned(),
        sequence,
        deduplicated: false,
    })
}

fn replayed(data: &Value) -> Result<Appended> {
    let event_id = data["event_id"]
        .as_str()
        .ok_or_else(|| Error::internal("outbox record without event_id"))?;
    let sequence = data["sequence"]
        .as_str()
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| Error::internal("outbox record without sequence"))?;
    Ok(Appended {
        event_id: event_id.to_owned(),
        sequence,
        deduplicated: true,
    })
}
