//! The idempotent write path shared by every POST (spec: http-api.md §2):
//! claim the key, apply the effect and store its response in one
//! transaction; replay the original response on a repeat.

use std::{future::Future, pin::Pin};

use actix_web::{HttpRequest, HttpResponse, http::StatusCode};
use sea_orm::DatabaseTransaction;
use serde_json::Value;

use crate::{
    domain::now,
    error::{Error, Result},
    http::envelope::{request_commitment, respond},
    state::AppState,
    store::idempotency::{self, Begin, WriteIdentity},
};

/// The effect of a write, run inside its transaction; returns the response
/// `data` (with `deduplicated: false`).
pub type Effect<'t> = Pin<Box<dyn Future<Output = Result<Value>> + 't>>;

/// How an idempotent write ended.
pub struct Written {
    pub response: HttpResponse,
    /// False when the response is a replay (no effect applied now).
    pub applied: bool,
}

/// Runs `effect` once per idempotency key (see [`idempotency`]).
pub async fn idempotent_write<F>(
    req: &HttpRequest,
    state: &AppState,
    identity: WriteIdentity,
    fresh_status: StatusCode,
    effect: F,
) -> Result<Written>
where
    F: for<'t> FnOnce(&'t DatabaseTransaction) -> Effect<'t>,
{
    let t = now();
    let ttl = std::time::Duration::from_secs(state.settings.retention.idempotency_max_age_s);
    let written = state
        .db
        .write_alone(async |txn| {
            if let Begin::Replay(data) = idempotency::begin(txn, &identity, t).await? {
                // Nothing was written: the commit is empty.
                return Ok(Written {
                    response: respond(req, StatusCode::OK, data),
                    applied: false,
                });
            }
            let data = effect(txn).await?;
            idempotency::finish(txn, &identity, fresh_status.as_u16(), &data, t.plus(ttl)).await?;
            // From here the caller waits for the commit's outcome even past
            // its deadline: a 503 while the commit is in flight could be a
            // lie (decision 0014). The deadline cannot have won yet — it
            // drops this future when it does — but a lost race is still
            // answered honestly.
            if !request_commitment(req).commit() {
                return Err(Error::unavailable("the request passed its deadline"));
            }
            Ok(Written {
                response: respond(req, fresh_status, data),
                applied: true,
            })
        })
        .await?;
    Ok(written)
}

/// The response `data` of a write as stored in its idempotency record.
pub fn to_data(data: &impl serde::Serialize) -> Result<Value> {
    serde_json::to_value(data).map_err(Error::internal)
}
