//! Request parsing shared by the handlers: query-string rules, the
//! `Idempotency-Key` header and strict JSON bodies (spec: http-api.md §1–§2).

use std::collections::HashMap;

use actix_web::{HttpMessage, HttpRequest, web};
use futures_util::StreamExt;
use serde::de::DeserializeOwned;

use crate::{
    domain::parse_canonical_u64,
    error::{Error, Result},
    store::idempotency::IdempotencyKey,
    strict_json,
};

/// Largest accepted JSON body: 512 KiB.
pub const MAX_BODY_BYTES: usize = 524_288;

/// The part of the request deadline a body may take to arrive: 5 s of the
/// default 8 s, so a body that stops arriving is answered 400 before the
/// deadline's 503.
fn body_timeout(req: &HttpRequest) -> std::time::Duration {
    let deadline = req
        .app_data::<actix_web::web::Data<crate::state::AppState>>()
        .map_or(std::time::Duration::from_secs(8), |s| {
            s.settings.timing.http_request_timeout()
        });
    deadline * 5 / 8
}

/// Endpoints other than the two lists take no query string at all.
pub fn no_query(req: &HttpRequest) -> Result<()> {
    if req.query_string().is_empty() {
        Ok(())
    } else {
        Err(Error::invalid_argument(
            "this endpoint takes no query parameters",
        ))
    }
}

/// The `Idempotency-Key` header: required on every POST; 1–255 visible
/// ASCII characters.
pub fn idempotency_key(req: &HttpRequest) -> Result<IdempotencyKey> {
    let mut values = req.headers().get_all("idempotency-key");
    let value = values
        .next()
        .ok_or_else(|| Error::invalid_argument("the Idempotency-Key header is required"))?;
    if values.next().is_some() {
        return Err(Error::invalid_argument("Idempotency-Key must be sent once"));
    }
    value
        .to_str()
        .ok()
        .and_then(IdempotencyKey::parse)
        .ok_or_else(|| {
            Error::invalid_argument("Idempotency-Key must be 1-255 visible ASCII characters")
        })
}

/// Reads a strict JSON body: `Content-Type: application/json` (parameters
/// allowed), at most 512 KiB (else 413), then the strict parser.
pub async fn json_body<T: DeserializeOwned>(
    req: &HttpRequest,
    mut payload: web::Payload,
) -> Result<T> {
    let is_json = matches!(req.mime_type(), Ok(Some(m)) if m.essence_str() == "application/json");
    if !is_json {
        return Err(Error::invalid_argument(
            "Content-Type must be application/json",
        ));
    }
    let read = async {
        let mut body = web::BytesMut::new();
        while let Some(chunk) = payload.next().await {
            let chunk = chunk
                .map_err(|e| Error::invalid_argument(format!("could not read the body: {e}")))?;
            if body.len() + chunk.len() > MAX_BODY_BYTES {
                return Err(Error::payload_too_large(MAX_BODY_BYTES));
            }
            body.extend_from_slice(&chunk);
        }
        Ok(body)
    };
    // A body that stops arriving is the client's mistake (400), not a
    // database too slow for the request deadline (503).
    let limit = body_timeout(req);
    let body = tokio::time::timeout(limit, read).await.map_err(|_| {
        Error::invalid_argument(format!(
            "the request body did not arrive within {} ms",
            limit.as_millis()
        ))
    })??;
    Ok(strict_json::parse(&body)?)
}

/// The query string of a list endpoint (spec: http-api.md §1): only the
/// names in `allowed`, each at most once; anything else is 400
/// `INVALID_ARGUMENT` naming the parameter. Values are percent-decoded.
pub fn query_params(
    req: &HttpRequest,
    allowed: &[&'static str],
) -> Result<HashMap<&'static str, String>> {
    let mut out = HashMap::new();
    for (name, value) in form_urlencoded::parse(req.query_string().as_bytes()) {
        let Some(known) = allowed.iter().find(|a| **a == name) else {
            return Err(Error::invalid_argument(format!(
                "{name}: unknown query parameter; this endpoint takes {}",
                allowed.join(", ")
            )));
        };
        if out.insert(*known, value.into_owned()).is_some() {
            return Err(Error::invalid_argument(format!(
                "{name}: query parameter given more than once"
            )));
        }
    }
    Ok(out)
}

/// The `limit` query parameter of a list: a canonical decimal 1–100,
/// default 20.
pub fn list_limit(value: Option<&str>) -> Result<u64> {
    const DEFAULT: u64 = 20;
    const MAX: u64 = 100;
    match value {
        None => Ok(DEFAULT),
        Some(v) => parse_canonical_u64(v)
            .filter(|n| (1..=MAX).contains(n))
            .ok_or_else(|| Error::invalid_argument("limit: must be an integer from 1 to 100")),
    }
}
