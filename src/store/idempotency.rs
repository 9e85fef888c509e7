//! Idempotency records (spec: http-api.md §2).
//!
//! A write begins by inserting a placeholder record for `(credential, key)`
//! inside its own transaction (`ON CONFLICT DO NOTHING`). If another request
//! holds the key, the insert waits for it (PostgreSQL blocks on the
//! uncommitted unique entry; SQLite's single writer serializes), then the
//! stored record decides: the same operation, target and normalized request
//! → replay; anything else → 409 `IDEMPOTENCY_CONFLICT`. The effect and the
//! final record commit together; a failed request rolls its placeholder
//! back, so only successes are recorded.

use crate::store::StoreError;
use std::collections::{BTreeMap, HashMap};

use entity::idempotency_record;

use sea_orm::{
    ColumnTrait, Condition, ConnectionTrait, DatabaseTransaction, EntityTrait, QueryFilter, Set,
    sea_query::{Expr, OnConflict},
};
use serde_json::Value;

use crate::{
    domain::{CredentialId, Timestamp, ordered_hex_id, sha256_hex},
    error::{Error, ErrorCode, Result},
};

/// A parsed `Idempotency-Key` header: 1–255 visible ASCII characters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdempotencyKey(String);

impl IdempotencyKey {
    pub fn parse(s: &str) -> Option<IdempotencyKey> {
        let ok = (1..=255).contains(&s.len()) && s.bytes().all(|b| (0x21..=0x7e).contains(&b));
        ok.then(|| IdempotencyKey(s.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// What a write is, for the record: operation name, target id and the
/// digest of the normalized request.
#[derive(Debug, Clone)]
pub struct WriteIdentity {
    pub credential_id: CredentialId,
    pub key: IdempotencyKey,
    pub operation: &'static str,
    pub target: String,
    pub request_digest: String,
}

impl WriteIdentity {
    /// `normalized` is the request after parsing with defaults applied; its
    /// serialization is canonical (fixed field order), so key order, spacing
    /// and omitted-vs-default do not change the digest.
    pub fn new(
        credential_id: &CredentialId,
        key: IdempotencyKey,
        operation: &'static str,
        target: impl Into<String>,
        normalized: &impl serde::Serialize,
    ) -> Result<WriteIdentity> {
        let text = serde_json::to_string(normalized).map_err(Error::internal)?;
        Ok(WriteIdentity {
            credential_id: credential_id.clone(),
            key,
            operation,
            target: target.into(),
            request_digest: sha256_hex(text.as_bytes()),
        })
    }
}

/// How a write proceeds after [`begin`].
#[derive(Debug)]
pub enum Begin {
    /// First use of the key: apply the effect, then [`finish`].
    Fresh,
    /// The same request was already applied: answer 200 with this `data`
    /// (already marked `deduplicated: true`).
    Replay(Value),
}

/// Claims the key inside `txn` or finds its record (see the module doc).
pub async fn begin(txn: &DatabaseTransaction, id: &WriteIdentity, now: Timestamp) -> Result<Begin> {
    begin_held(txn, id, now, Timestamp(i64::MAX)).await
}

/// [`begin`] for a write that commits in several transactions (a bulk
/// retry): the placeholder is committed on its own and binds the key until
/// [`finish`] or until `held_until`, so a write cut short by a crash does
/// not hold its key for ever. Meanwhile the same key gets 409
/// `IDEMPOTENCY_CONFLICT`.
pub async fn begin_held(
    txn: &DatabaseTransaction,
    id: &WriteIdentity,
    now: Timestamp,
    held_until: Timestamp,
) -> Result<Begin> {
    // An expired record no longer binds its key.
    idempotency_record::Entity::delete_many()
        .filter(idempotency_record::Column::CredentialId.eq(id.credential_id.as_str()))
        .filter(idempotency_record::Column::Key.eq(id.key.as_str()))
        .filter(idempotency_record::Column::ExpiresAt.lte(now.micros()))
        .exec(txn)
        .await?;
    let placeholder = record(id, 0, String::new(), held_until.micros(), now);
    let inserted = idempotency_record::Entity::insert(placeholder)
        .on_conflict(key_taken())
        .exec_without_returning(txn)
        .await?;
    if inserted == 1 {
        return Ok(Begin::Fresh);
    }
    let record = idempotency_record::Entity::find()
        .filter(idempotency_record::Column::CredentialId.eq(id.credential_id.as_str()))
        .filter(idempotency_record::Column::Key.eq(id.key.as_str()))
        .one(txn)
        .await?
        .ok_or_else(|| Error::internal("idempotency record vanished under its key"))?;
    stored_answer(&record, id).map(Begin::Replay)
}

/// What a stored record answers to a request with its key (http-api.md
/// §2): the same operation, target and normalized request → the stored
/// response `data` with `deduplicated: true`; anything else, or a record
/// whose write has not finished, → 409 `IDEMPOTENCY_CONFLICT`.
pub fn stored_answer(record: &idempotency_record::Model, id: &WriteIdentity) -> Result<Value> {
    let same = record.operation == id.operation
        && record.target == id.target
        && record.request_digest == id.request_digest;
    if same && record.status == 0 {
        return Err(Error::new(
            ErrorCode::IdempotencyConflict,
            "a request with this Idempotency-Key is still in progress",
        ));
    }
    if !same {
        return Err(Error::new(
            ErrorCode::IdempotencyConflict,
            "this Idempotency-Key was already used for a different request",
        ));
    }
    let mut data: Value = serde_json::from_str(&record.response).map_err(Error::internal)?;
    if let Some(obj) = data.as_object_mut() {
        obj.insert("deduplicated".to_owned(), Value::Bool(true));
    }
    Ok(data)
}

/// `ids` as one condition: per credential, `credential_id = c AND key IN
/// (..)`. The same credential in every arm of an `OR` made PostgreSQL's
/// planner factor it out and scan every live record of the credential,
/// filtering the keys (4–9 ms per publish batch after a few thousand
/// publishes, growing with the records; decision 0091); this form is an
/// index lookup per key on both backends.
fn under_keys<'a>(ids: impl IntoIterator<Item = &'a WriteIdentity>) -> Condition {
    let mut by_credential: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for id in ids {
        by_credential
            .entry(id.credential_id.as_str())
            .or_default()
            .push(id.key.as_str());
    }
    by_credential
        .into_iter()
        .fold(Condition::any(), |any, (credential_id, keys)| {
            any.add(
                Condition::all()
                    .add(idempotency_record::Column::CredentialId.eq(credential_id))
                    .add(idempotency_record::Column::Key.is_in(keys)),
            )
        })
}

/// The live records under the keys of `ids` (one statement; a batch of
/// writes, decision 0063), after deleting those of them that expired at
/// `now`. Keyed by `(credential id, key)`.
pub async fn live_records<C: ConnectionTrait>(
    conn: &C,
    ids: &[&WriteIdentity],
    now: Timestamp,
) -> Result<HashMap<(String, String), idempotency_record::Model>, StoreError> {
    if ids.is_empty() {
        return Ok(HashMap::new());
    }
    idempotency_record::Entity::delete_many()
        .filter(under_keys(ids.iter().copied()))
        .filter(idempotency_record::Column::ExpiresAt.lte(now.micros()))
        .exec(conn)
        .await?;
    let records = idempotency_record::Entity::find()
        .filter(under_keys(ids.iter().copied()))
        .all(conn)
        .await?;
    Ok(records
        .into_iter()
        .map(|r| ((r.credential_id.clone(), r.key.clone()), r))
        .collect())
}

/// Records finished writes in one statement: `(identity, HTTP status,
/// response data)` each, created at `now`, expiring at `expires_at`, in
/// `(credential, key)` order (two transactions inserting the same keys
/// wait for each other in the same order: no deadlock on PostgreSQL).
/// Returns how many were inserted: fewer than given means another
/// transaction took one of the keys meanwhile (PostgreSQL), and the caller
/// must not commit.
pub async fn insert_finished<C: ConnectionTrait>(
    conn: &C,
    finished: &[(&WriteIdentity, u16, &Value)],
    now: Timestamp,
    expires_at: Timestamp,
) -> Result<u64, StoreError> {
    if finished.is_empty() {
        return Ok(0);
    }
    let mut ordered: Vec<_> = finished.iter().collect();
    ordered.sort_by(|a, b| {
        (a.0.credential_id.as_str(), a.0.key.as_str())
            .cmp(&(b.0.credential_id.as_str(), b.0.key.as_str()))
    });
    let models: Vec<_> = ordered
        .into_iter()
        .map(|(id, status, data)| {
            record(
                id,
                i32::from(*status),
                data.to_string(),
                expires_at.micros(),
                now,
            )
        })
        .collect();
    let inserted = idempotency_record::Entity::insert_many(models)
        .on_conflict(key_taken())
        .exec_without_returning(conn)
        .await?;
    Ok(inserted)
}

/// A new record under `id`'s key (status 0 and no response: a placeholder
/// of a write in progress).
fn record(
    id: &WriteIdentity,
    status: i32,
    response: String,
    expires_at: i64,
    now: Timestamp,
) -> idempotency_record::ActiveModel {
    idempotency_record::ActiveModel {
        id: Set(ordered_hex_id()),
        credential_id: Set(id.credential_id.as_str().to_owned()),
        key: Set(id.key.as_str().to_owned()),
        operation: Set(id.operation.to_owned()),
        target: Set(id.target.clone()),
        request_digest: Set(id.request_digest.clone()),
        status: Set(status),
        response: Set(response),
        expires_at: Set(expires_at),
        created_at: Set(now.micros()),
    }
}

/// A key already recorded: insert nothing (the caller reads the record).
fn key_taken() -> OnConflict {
    OnConflict::columns([
        idempotency_record::Column::CredentialId,
        idempotency_record::Column::Key,
    ])
    .do_nothing()
    .to_owned()
}

/// Stores the outcome of a fresh write (status and response `data`) in the
/// same transaction as its effect.
pub async fn finish(
    txn: &DatabaseTransaction,
    id: &WriteIdentity,
    status: u16,
    data: &Value,
    expires_at: Timestamp,
) -> Result<()> {
    idempotency_record::Entity::update_many()
        .col_expr(
            idempotency_record::Column::Status,
            Expr::value(i32::from(status)),
        )
        .col_expr(
            idempotency_record::Column::Response,
            Expr::value(data.to_string()),
        )
        .col_expr(
            idempotency_record::Column::ExpiresAt,
            Expr::value(expires_at.micros()),
        )
        .filter(idempotency_record::Column::CredentialId.eq(id.credential_id.as_str()))
        .filter(idempotency_record::Column::Key.eq(id.key.as_str()))
        .exec(txn)
        .await?;
    Ok(())
}

/// What the key of `id` answers without writing (a bulk retry's dry run,
/// which records nothing): `None` while the key is free, else the stored
/// record's answer ([`stored_answer`]: the replay, or 409).
pub async fn peek<C: ConnectionTrait>(
    conn: &C,
    id: &WriteIdentity,
    now: Timestamp,
) -> Result<Option<Value>> {
    let record = idempotency_record::Entity::find()
        .filter(idempotency_record::Column::CredentialId.eq(id.credential_id.as_str()))
        .filter(idempotency_record::Column::Key.eq(id.key.as_str()))
        .filter(idempotency_record::Column::ExpiresAt.gt(now.micros()))
        .one(conn)
        .await?;
    record.map(|r| stored_answer(&r, id)).transpose()
}

/// Releases the key of a write that failed after [`begin_held`] committed
/// its placeholder (a finished record is kept).
pub async fn abandon<C: ConnectionTrait>(conn: &C, id: &WriteIdentity) -> Result<(), StoreError> {
    idempotency_record::Entity::delete_many()
        .filter(idempotency_record::Column::CredentialId.eq(id.credential_id.as_str()))
        .filter(idempotency_record::Column::Key.eq(id.key.as_str()))
        .filter(idempotency_record::Column::Status.eq(0))
        .exec(conn)
        .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_1_to_255_visible_ascii() {
        assert!(IdempotencyKey::parse("a").is_some());
        assert!(IdempotencyKey::parse(&"k".repeat(255)).is_some());
        assert!(IdempotencyKey::parse(&"k".repeat(256)).is_none());
        assert!(IdempotencyKey::parse("").is_none());
        assert!(IdempotencyKey::parse("a b").is_none());
        assert!(IdempotencyKey::parse("é").is_none());
    }
}
