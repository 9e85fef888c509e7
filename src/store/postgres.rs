//! The claim and the publish batch on PostgreSQL, each one call of a
//! server-side function instead of a statement per step, each a round
//! trip. The claim: `orbit_claim_batch` (migration and decision 0108), run
//! alone in a transaction of its own (decision 0109). The publish:
//! `orbit_publish_batch` (migration and decision 0110) through
//! `orbit_publish_alone` (0111), also alone. The rules are the ones
//! `claim.rs`, `materialize.rs` and `publish.rs` carry out on SQLite; the
//! node gives the functions the ids (and lease digests) they may use, keeps
//! the secrets, and turns the rows they return into one outcome per claim
//! or request.

use std::collections::HashMap;

use entity::{delivery, idempotency_record};
use sea_orm::{
    ConnectionTrait, DbBackend, DbErr, FromQueryResult, QueryResult, RuntimeErr, Statement, sqlx,
};

use crate::{
    domain::{DeliveryId, EventId, LeaseSecret, QueueId, Timestamp, now, ordered_hex_id},
    journal::RenderedEvent,
    store::{
        StoreError,
        claim::{self, ClaimOutcome, ClaimTarget, Recovered},
        materialize::{MATERIALIZE_BATCH, Materialized},
        publish::{BatchWritten, PublishRequest, PublishResult},
    },
};

/// Claims of one batch (as [`crate::store::claim`]'s `claim_batch_in` on
/// SQLite) in one statement on `conn`, outside any explicit transaction
/// (decision 0109); one outcome per claim, in order. `Err`: the statement
/// failed and wrote nothing.
pub(crate) async fn claim_batch(
    conn: &impl ConnectionTrait,
    claims: &[(ClaimTarget, u32)],
    lease: std::time::Duration,
) -> Result<Vec<ClaimOutcome>, StoreError> {
    let now = now();
    let lease_until = now.plus(lease);
    // A session whose connection closed while its claim waited for the
    // transaction takes nothing: its rows would only come back one lease
    // later.
    let wants: Vec<u32> = claims
        .iter()
        .map(|(target, want)| {
            if target.waiter.gone() {
                0
            } else {
                Ord::min(*want, target.capacity)
            }
        })
        .collect();
    let rows_at_most = wants.iter().map(|&w| w as usize).sum();
    let mut secrets: HashMap<String, LeaseSecret> = HashMap::with_capacity(rows_at_most);
    let mut digests = Vec::with_capacity(rows_at_most);
    let mut ids = Vec::with_capacity(rows_at_most);
    for _ in 0..rows_at_most {
        let secret = LeaseSecret::generate();
        let digest = secret.digest_hex();
        digests.push(digest.clone());
        secrets.insert(digest, secret);
        ids.push(DeliveryId::generate().into_string());
    }
    let targets = || claims.iter().map(|(t, _)| t);
    let values: Vec<sea_orm::Value> = vec![
        comma(targets().map(|t| t.credential_id.as_str())).into(),
        comma(targets().map(|t| t.subscription_id.as_str())).into(),
        comma(targets().map(|t| t.session_id.as_str())).into(),
        comma(wants.iter()).into(),
        comma(targets().map(|t| t.capacity)).into(),
        digests.join(",").into(),
        ids.join(",").into(),
        now.micros().into(),
        lease_until.micros().into(),
        i32::try_from(MATERIALIZE_BATCH).unwrap_or(i32::MAX).into(),
    ];
    let rows = conn
        .query_all_raw(Statement::from_sql_and_values(
            DbBackend::Postgres,
            CLAIM_BATCH,
            values,
        ))
        .await?;
    outcomes(claims, rows, secrets)
}

/// `items` joined by commas, as the function's lists travel (ids are hex).
fn comma<T: std::fmt::Display>(items: impl Iterator<Item = T>) -> String {
    let mut out = String::new();
    for (n, item) in items.enumerate() {
        if n > 0 {
            out.push(',');
        }
        out.push_str(&item.to_string());
    }
    out
}

/// The `o_flags` bits of a `subscription` row (migration 0108).
const BEHIND_HEAD: i32 = 1;
const MATERIALIZED: i32 = 2;
const MORE: i32 = 4;
const IDLE: i32 = 8;
const CAUGHT_UP: i32 = 16;
const WINDOW_FULL: i32 = 32;

/// The call; its rows are described in migration 0108 (`o_n2` of a
/// `subscription` row, the cursor found under the lock, is the function's
/// own: it decides the second pick there).
const CLAIM_BATCH: &str =
    "SELECT * FROM orbit_claim_batch($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)";

/// What the function said about one subscription.
struct Run {
    queue_id: String,
    behind_head: bool,
    materialized: Option<Materialized>,
}

/// The rows of one call as one outcome per claim, in order.
fn outcomes(
    claims: &[(ClaimTarget, u32)],
    rows: Vec<QueryResult>,
    mut secrets: HashMap<String, LeaseSecret>,
) -> Result<Vec<ClaimOutcome>, StoreError> {
    let mut codes: Vec<Option<(String, Option<i64>)>> = (0..claims.len()).map(|_| None).collect();
    let mut runs: HashMap<String, Run> = HashMap::new();
    let mut lapsed: Vec<delivery::Model> = Vec::new();
    let mut shares: Vec<Vec<(delivery::Model, LeaseSecret)>> = std::iter::repeat_with(Vec::new)
        .take(claims.len())
        .collect();
    let mut events: HashMap<String, RenderedEvent> = HashMap::new();
    let claim_index = |row: &QueryResult| -> Result<usize, StoreError> {
        let k: i32 = row.try_get("", "o_k")?;
        usize::try_from(k)
            .ok()
            .and_then(|k| k.checked_sub(1))
            .filter(|&k| k < claims.len())
            .ok_or_else(|| StoreError::invariant(format!("a claim row for claim {k}")))
    };
    for row in &rows {
        let kind: String = row.try_get("", "o_kind")?;
        match kind.as_str() {
            "claim" => {
                let k = claim_index(row)?;
                codes[k] = Some((row.try_get("", "o_code")?, row.try_get("", "o_n1")?));
            }
            "subscription" => {
                let flags: i32 = row.try_get("", "o_flags")?;
                let materialized = (flags & MATERIALIZED != 0)
                    .then(|| -> Result<Materialized, StoreError> {
                        let count = |column: &str| -> Result<u64, StoreError> {
                            let n: i64 = row.try_get("", column)?;
                            Ok(u64::try_from(n).unwrap_or(0))
                        };
                        let gap: Option<i64> = row.try_get("", "o_n4")?;
                        Ok(Materialized {
                            inserted: count("o_n1")?,
                            more: flags & MORE != 0,
                            history_gap: gap.map(|g| u64::try_from(g).unwrap_or(0)),
                            idle: flags & IDLE != 0,
                            caught_up: flags & CAUGHT_UP != 0,
                            window_full: flags & WINDOW_FULL != 0,
                            refill_after: count("o_n3")?,
                        })
                    })
                    .transpose()?;
                let run = Run {
                    queue_id: row.try_get("", "o_code")?,
                    behind_head: flags & BEHIND_HEAD != 0,
                    materialized,
                };
                runs.insert(row.try_get("", "o_sub")?, run);
            }
            "lapsed" => lapsed.push(delivery::Model::from_query_result(row, "d_")?),
            "leased" => {
                let k = claim_index(row)?;
                let d = delivery::Model::from_query_result(row, "d_")?;
                let secret = d
                    .lease_digest
                    .as_deref()
                    .and_then(|digest| secrets.remove(digest))
                    .ok_or_else(|| {
                        StoreError::invariant(format!(
                            "delivery {} was leased but not asked for",
                            d.id
                        ))
                    })?;
                shares[k].push((d, secret));
            }
            "event" => {
                let event = event_of(row)?;
                events.insert(event.id.clone(), event);
            }
            other => {
                return Err(StoreError::invariant(format!(
                    "orbit_claim_batch returned a row of kind {other}"
                )));
            }
        }
    }

    let mut recovered: HashMap<String, Vec<delivery::Model>> = HashMap::new();
    for d in lapsed {
        recovered
            .entry(d.subscription_id.clone())
            .or_default()
            .push(d);
    }
    let mut out = Vec::with_capacity(claims.len());
    for (k, ((target, _), share)) in claims.iter().zip(shares).enumerate() {
        let Some((code, number)) = codes[k].take() else {
            return Err(StoreError::invariant(format!(
                "orbit_claim_batch said nothing of claim {}",
                k + 1
            )));
        };
        let number = number.and_then(|n| u64::try_from(n).ok()).unwrap_or(0);
        let outcome = match code.as_str() {
            "revoked" => ClaimOutcome::Revoked,
            "gone" => ClaimOutcome::Gone,
            "paused" => ClaimOutcome::Paused,
            "history_expired" => ClaimOutcome::HistoryExpired(number),
            "open" => {
                let subscription_id = target.subscription_id.as_str();
                let run = runs.get_mut(subscription_id).ok_or_else(|| {
                    StoreError::invariant(format!(
                        "orbit_claim_batch said nothing of subscription {subscription_id}"
                    ))
                })?;
                let exhausted = (share.len() as u64) < number;
                let deliveries = claim::in_order(share, |id| events.get(id).cloned())?;
                ClaimOutcome::Leased {
                    deliveries,
                    exhausted,
                    // Counted once, with the subscription's first claim.
                    recovered: recovered
                        .remove(subscription_id)
                        .map(|rows| Recovered::of(rows.iter()))
                        .unwrap_or_default(),
                    materialized: run.materialized.take(),
                    behind_head: run.behind_head,
                    queue_id: QueueId::from_db(run.queue_id.clone()),
                }
            }
            other => {
                return Err(StoreError::invariant(format!(
                    "orbit_claim_batch answered claim {} with {other}",
                    k + 1
                )));
            }
        };
        out.push(outcome);
    }
    Ok(out)
}

/// An `event` row as delivered.
fn event_of(row: &QueryResult) -> Result<RenderedEvent, StoreError> {
    let raw = |column: &str| -> Result<Box<serde_json::value::RawValue>, StoreError> {
        let text: String = row.try_get("", column)?;
        serde_json::value::RawValue::from_string(text)
            .map_err(|e| StoreError::invariant(format!("stored JSON: {e}")))
    };
    Ok(RenderedEvent {
        id: row.try_get("", "e_id")?,
        sequence: row.try_get("", "e_sequence")?,
        event_type: row.try_get("", "e_type")?,
        aggregate_kind: row.try_get("", "e_aggregate_kind")?,
        aggregate_id: row.try_get("", "e_aggregate_id")?,
        aggregate_revision: row.try_get("", "e_aggregate_revision")?,
        occurred_at: Timestamp(row.try_get("", "e_occurred_at")?),
        details: raw("e_details")?,
        snapshot: raw("e_snapshot")?,
    })
}

/// The call of a publish batch; its rows are described in migrations 0110
/// and 0111.
const PUBLISH_BATCH: &str = "SELECT * FROM orbit_publish_alone($1::jsonb, $2::jsonb, $3, $4, $5)";

/// A publish batch's statements (`publish.rs`'s `write_statements` on
/// SQLite) in one call of `orbit_publish_alone` on `conn`, outside any
/// explicit transaction (decisions 0110, 0111): the live records under the
/// keys of `firsts` (requests of `requests`), the appends of the others in
/// request order and their records. The node gives the event and record
/// ids and renders each answer from the sequences the call returns, as the
/// call rendered the record it stored. The call's lock waits together last
/// at most about `lock_timeout_ms` (0: no bound). `Err`: nothing was
/// written; SQLSTATE 55P03 ([`is_lock_timeout`]) when the lock waits
/// reached the bound, 40001 (run again) when another transaction recorded
/// one of the keys meanwhile.
pub(crate) async fn publish_batch(
    conn: &mut sqlx::PgConnection,
    requests: &[PublishRequest],
    firsts: &[usize],
    now: Timestamp,
    expires_at: Timestamp,
    lock_timeout_ms: i32,
) -> Result<BatchWritten, StoreError> {
    let mut listed = Vec::with_capacity(firsts.len());
    let mut ids: Vec<Vec<EventId>> = Vec::with_capacity(firsts.len());
    let mut events = Vec::new();
    for (k, &i) in firsts.iter().enumerate() {
        let request = &requests[i];
        let id = &request.identity;
        listed.push((
            id.credential_id.as_str(),
            id.key.as_str(),
            id.operation,
            id.target.as_str(),
            id.request_digest.as_str(),
            ordered_hex_id(),
            request.queue_id.as_str(),
            request.results.len(),
        ));
        let mut of_request = Vec::with_capacity(request.results.len());
        for (offset, r) in request.results.iter().enumerate() {
            let event_id = EventId::generate();
            events.push((
                k + 1,
                offset,
                event_id.as_str().to_owned(),
                r.result_type.as_str(),
                r.aggregate_id.as_str(),
                r.aggregate_revision.as_str(),
                r.occurred_at.micros(),
                r.details.as_str(),
                r.snapshot.as_str(),
            ));
            of_request.push(event_id);
        }
        ids.push(of_request);
    }
    let rows: Vec<QueryResult> = sqlx::query(PUBLISH_BATCH)
        .bind(json_text(&listed)?)
        .bind(json_text(&events)?)
        .bind(now.micros())
        .bind(expires_at.micros())
        .bind(lock_timeout_ms)
        .fetch_all(conn)
        .await
        .map_err(|e| DbErr::Query(RuntimeErr::SqlxError(e.into())))?
        .into_iter()
        .map(QueryResult::from)
        .collect();
    let mut written = BatchWritten {
        live: HashMap::new(),
        appended: Vec::new(),
        inserted: 0,
    };
    // The request of a row, as an index into `firsts`.
    let request = |row: &QueryResult| -> Result<usize, StoreError> {
        let k: i32 = row.try_get("", "o_i")?;
        usize::try_from(k - 1)
            .ok()
            .filter(|&k| k < firsts.len())
            .ok_or_else(|| StoreError::invariant(format!("the publish call named request {k}")))
    };
    for row in rows {
        let kind: String = row.try_get("", "o_kind")?;
        match kind.as_str() {
            "record" => {
                let record = idempotency_record::Model {
                    id: row.try_get("", "r_id")?,
                    credential_id: row.try_get("", "r_credential_id")?,
                    key: row.try_get("", "r_key")?,
                    operation: row.try_get("", "r_operation")?,
                    target: row.try_get("", "r_target")?,
                    request_digest: row.try_get("", "r_request_digest")?,
                    status: row.try_get("", "r_status")?,
                    response: row.try_get("", "r_response")?,
                    expires_at: row.try_get("", "r_expires_at")?,
                    created_at: row.try_get("", "r_created_at")?,
                };
                written
                    .live
                    .insert((record.credential_id.clone(), record.key.clone()), record);
            }
            "appended" => {
                let k = request(&row)?;
                let first: Option<i64> = row.try_get("", "o_sequence")?;
                let events: Vec<(EventId, i64)> = ids[k]
                    .iter()
                    .zip(first.unwrap_or(0)..)
                    .map(|(id, sequence)| (id.clone(), sequence))
                    .collect();
                written
                    .appended
                    .push((firsts[k], Some(PublishResult::fresh(&events)?)));
            }
            "missing" => {
                let k = request(&row)?;
                written.appended.push((firsts[k], None));
            }
            "records" => {
                let inserted: Option<i64> = row.try_get("", "o_sequence")?;
                written.inserted = inserted.and_then(|n| u64::try_from(n).ok()).unwrap_or(0);
            }
            other => {
                return Err(StoreError::invariant(format!(
                    "the publish call returned a row of kind {other}"
                )));
            }
        }
    }
    Ok(written)
}

/// A connection of `conn`'s pool for one statement, or the pool's error
/// as sea-orm reports it.
pub(crate) async fn acquire(
    conn: &sea_orm::DatabaseConnection,
) -> Result<sqlx::pool::PoolConnection<sqlx::Postgres>, StoreError> {
    conn.get_postgres_connection_pool()
        .acquire()
        .await
        .map_err(|e| {
            StoreError::from(match e {
                sqlx::Error::PoolTimedOut => {
                    DbErr::ConnectionAcquire(sea_orm::error::ConnAcquireErr::Timeout)
                }
                sqlx::Error::PoolClosed => {
                    DbErr::ConnectionAcquire(sea_orm::error::ConnAcquireErr::ConnectionClosed)
                }
                e => DbErr::Conn(RuntimeErr::SqlxError(e.into())),
            })
        })
}

/// True when `err` is PostgreSQL's `lock_not_available` (55P03): a lock
/// wait reached `lock_timeout`, and the statement wrote nothing.
pub(crate) fn is_lock_timeout(err: &StoreError) -> bool {
    matches!(err.database(),
        Some(DbErr::Exec(RuntimeErr::SqlxError(e)) | DbErr::Query(RuntimeErr::SqlxError(e)))
        if matches!(&**e, sqlx::Error::Database(db) if db.code().as_deref() == Some("55P03")))
}

/// `value` as JSON text, a parameter of a call.
fn json_text(value: &impl serde::Serialize) -> Result<String, StoreError> {
    serde_json::to_string(value)
        .map_err(|e| StoreError::invariant(format!("rendering a call's parameter: {e}")))
}
