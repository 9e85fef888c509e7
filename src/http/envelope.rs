//! The response envelope on every HTTP response (spec: http-api.md §1):
//! `{"request_id", "data"}` or `{"request_id", "error"}`, with
//! `X-Request-ID`, `Cache-Control: no-store` and `Content-Type:
//! application/json`; plus the management request deadline.

use actix_web::{
    HttpMessage, HttpRequest, HttpResponse,
    body::{BoxBody, MessageBody},
    dev::{ServiceRequest, ServiceResponse},
    http::{
        StatusCode,
        header::{self, HeaderValue},
    },
    middleware::Next,
    web,
};
use serde::Serialize;
use serde_json::json;
use tracing::Instrument;

use crate::{
    domain::MessageId,
    error::{Error, ErrorCode},
    http::{access_log::Access, unread_body::UnreadBody},
    metrics::Operation,
    state::AppState,
    store::Commitment,
};

/// The request id of the current request (also in `X-Request-ID`).
#[derive(Clone, Debug)]
pub struct RequestId(pub MessageId);

/// The request id the envelope middleware assigned to `req`.
pub fn request_id(req: &HttpRequest) -> MessageId {
    req.extensions()
        .get::<RequestId>()
        .map(|r| r.0.clone())
        .unwrap_or_else(MessageId::generate)
}

/// Marks a response whose body is already an envelope.
#[derive(Clone, Copy)]
struct Enveloped;

/// A success envelope with `status` and `data`.
pub fn respond(req: &HttpRequest, status: StatusCode, data: impl Serialize) -> HttpResponse {
    #[derive(Serialize)]
    struct Envelope<'a, T> {
        request_id: &'a str,
        data: T,
    }
    let id = request_id(req);
    let body = serde_json::to_string(&Envelope {
        request_id: id.as_str(),
        data,
    })
    .unwrap_or_default();
    let mut res = HttpResponse::build(status)
        .content_type("application/json")
        .body(body);
    res.extensions_mut().insert(Enveloped);
    res
}

/// With `server.metrics_listen` set, `/metrics` is served only there, and
/// that listener serves only `/metrics`, `/healthz` and `/readyz`.
fn on_its_listener(req: &ServiceRequest) -> bool {
    let Some(metrics) = req
        .app_data::<web::Data<AppState>>()
        .and_then(|s| s.metrics_addr)
    else {
        return true;
    };
    // The path as the router matches it (percent-decoded: `/%6detrics`
    // is `/metrics`).
    let path = req.match_info().as_str();
    if req.app_config().local_addr() == metrics {
        matches!(path, "/metrics" | "/healthz" | "/readyz")
    } else {
        path != "/metrics"
    }
}

/// Paths whose responses are not JSON envelopes on success (the API
/// reference page and its redirects among them).
fn is_raw_path(path: &str) -> bool {
    matches!(
        path,
        "/" | "/console" | "/docs" | "/metrics" | "/openapi.json" | "/v1/events/connect"
    ) || path.starts_with("/docs/")
        || path.starts_with("/console/")
}

/// The [`Commitment`] the middleware shares with the handler of `req`: a
/// writer commits to it before making the request's write final, so the
/// deadline answers 503 only when nothing of it is written (decision 0014).
/// Outside the middleware (no deadline) a fresh, undecided one.
pub fn request_commitment(req: &HttpRequest) -> Commitment {
    req.extensions()
        .get::<Commitment>()
        .cloned()
        .unwrap_or_default()
}

/// Middleware: assigns the request id, writes the access log line
/// ([`Access`]), applies the management deadline,
/// renders errors (ours and the framework's) as envelopes, sets the
/// common headers, and reads what the handler left of the request body
/// before the answer leaves ([`UnreadBody`]; not for an upgrade request).
///
/// At the deadline the request is answered 503 `UNAVAILABLE` and its
/// handler dropped (rolling back its transaction), unless its write
/// already began committing ([`request_commitment`]): then the answer is
/// that write's outcome, whenever it comes (decision 0014).
pub async fn envelope(
    mut req: ServiceRequest,
    next: Next<impl MessageBody + 'static>,
) -> Result<ServiceResponse<BoxBody>, actix_web::Error> {
    // An upgrade request's body is the connection itself, read by the
    // WebSocket (or never, when refused): only a sized or chunked body of a
    // plain request is read to its end.
    let request_id = MessageId::generate();
    let access = Access::begin(&req, &request_id);
    let unread = if req.head().upgrade() {
        None
    } else {
        let (unread, payload) = UnreadBody::keep(req.take_payload());
        req.set_payload(payload);
        Some(unread)
    };
    let answer = answer(req, next, request_id).await;
    if let Some(unread) = unread {
        unread.drain().await;
    }
    access.finish(&answer);
    answer
}

async fn answer(
    req: ServiceRequest,
    next: Next<impl MessageBody + 'static>,
    request_id: MessageId,
) -> Result<ServiceResponse<BoxBody>, actix_web::Error> {
    req.extensions_mut().insert(RequestId(request_id.clone()));
    if !on_its_listener(&req) {
        let err = Error::not_found("no such route").with_request_id(request_id.as_str());
        return Err(err.into());
    }
    // The path as the router matches it (percent-decoded: `/%64ocs/` is
    // `/docs/`).
    let raw = is_raw_path(req.match_info().as_str());
    let state = req.app_data::<web::Data<AppState>>().cloned();
    let deadline = state
        .as_ref()
        .map(|s| s.settings.timing.http_request_timeout());
    let commitment = match deadline {
        Some(deadline) if !raw => Commitment::until(tokio::time::Instant::now() + deadline),
        _ => Commitment::new(),
    };
    req.extensions_mut().insert(commitment.clone());
    // Answers of UNAVAILABLE are the database failing (or too slow for the
    // deadline): counted in `orbit_events_database_errors_total{operation="http"}`.
    let count_unavailable = |err: &Error| {
        if err.code() == ErrorCode::Unavailable
            && let Some(state) = &state
        {
            state.metrics.database_error(Operation::Http);
        }
    };
    let span = tracing::info_span!(
        "http",
        request_id = %request_id,
        method = %req.method(),
        path = %crate::http::access_log::logged_path(req.match_info().as_str())
    );
    // No clone of the request may be held here: routing needs it unshared.
    let call = next.call(req).instrument(span);
    let mut call = std::pin::pin!(call);
    let result = match (raw, deadline) {
        (false, Some(deadline)) => match tokio::time::timeout(deadline, &mut call).await {
            Ok(result) => result,
            Err(_) if !commitment.abandon() => {
                // Its write is committing: a 503 now could be a lie.
                tracing::info!(request_id = %request_id, "request deadline passed while its write commits; answering its outcome");
                call.await
            }
            Err(_) => {
                // The handler future (and its transaction) is dropped here,
                // which rolls the transaction back.
                tracing::warn!(request_id = %request_id, "request deadline passed");
                let err = Error::unavailable("the request did not finish within its deadline")
                    .with_request_id(request_id.as_str());
                count_unavailable(&err);
                return Err(err.into());
            }
        },
        _ => call.await,
    };
    let res = match result {
        Ok(res) => res.map_into_boxed_body(),
        Err(err) => {
            let ours = match err.as_error::<Error>() {
                Some(e) => e.clone(),
                None => framework_error(err.as_response_error().status_code(), Some(&err)),
            };
            count_unavailable(&ours);
            return Err(ours.with_request_id(request_id.as_str()).into());
        }
    };
    let status = res.status();
    let ours = res
        .response()
        .error()
        .and_then(|e| e.as_error::<Error>())
        .cloned();
    let mut res = match ours {
        Some(err) => {
            count_unavailable(&err);
            let headers = res.headers().clone();
            let (req, _) = res.into_parts();
            error_envelope(req, &request_id, &err, Some(&headers))
        }
        None if status.is_client_error() || status.is_server_error() => {
            if res.response().extensions().get::<Enveloped>().is_some() {
                res
            } else {
                let err = framework_error(status, res.response().error());
                let headers = res.headers().clone();
                let (req, _) = res.into_parts();
                error_envelope(req, &request_id, &err, Some(&headers))
            }
        }
        None => res,
    };
    set_common_headers(
        &mut res,
        &request_id,
        raw && (status.is_success() || status.is_redirection())
            || status == StatusCode::SWITCHING_PROTOCOLS,
    );
    Ok(res)
}

/// Maps an error the framework produced (not ours) to a spec code.
fn framework_error(status: StatusCode, cause: Option<&actix_web::Error>) -> Error {
    if let Some(cause) = cause {
        tracing::debug!(error = %cause, %status, "framework error");
    }
    match status {
        StatusCode::NOT_FOUND => Error::not_found("no such route"),
        StatusCode::METHOD_NOT_ALLOWED => Error::method_not_allowed(""),
        StatusCode::PAYLOAD_TOO_LARGE => {
            Error::payload_too_large(crate::http::request::MAX_BODY_BYTES)
        }
        s if s.is_server_error() => Error::internal(format_args!("framework error {s}")),
        _ => Error::invalid_argument("the request is malformed"),
    }
}

fn error_envelope(
    req: HttpRequest,
    request_id: &MessageId,
    err: &Error,
    headers: Option<&actix_web::http::header::HeaderMap>,
) -> ServiceResponse<BoxBody> {
    let body = json!({ "request_id": request_id.as_str(), "error": err.body() });
    let mut res = HttpResponse::build(err.status());
    if let Some(headers) = headers {
        for name in [header::ALLOW, header::WWW_AUTHENTICATE, header::RETRY_AFTER] {
            if let Some(v) = headers.get(&name) {
                res.insert_header((name, v.clone()));
            }
        }
    }
    if err.code() == ErrorCode::Unauthenticated {
        res.insert_header((header::WWW_AUTHENTICATE, "Bearer"));
    }
    if err.code() == ErrorCode::CapacityExceeded {
        res.insert_header((header::RETRY_AFTER, "1"));
    }
    let mut res = res.content_type("application/json").body(body.to_string());
    // For the access log line.
    res.extensions_mut().insert(err.code());
    ServiceResponse::new(req, res)
}

fn set_common_headers(res: &mut ServiceResponse<BoxBody>, request_id: &MessageId, raw: bool) {
    let headers = res.headers_mut();
    if let Ok(v) = HeaderValue::from_str(request_id.as_str()) {
        headers.insert(header::HeaderName::from_static("x-request-id"), v);
    }
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    if !raw {
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
    }
}
