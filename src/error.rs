//! The one error type at the edge, with the spec's stable codes and one
//! status table (spec: http-api.md §4, protocol.md §4).
//!
//! Internal failures keep their cause for the log and show the client only
//! `UNAVAILABLE` with a generic message; secrets never enter a message.

use std::fmt;

use actix_web::{
    HttpResponse, ResponseError,
    http::{
        StatusCode,
        header::{HeaderName, HeaderValue},
    },
};
use sea_orm::DbErr;

use crate::store::{StoreError, WriteError};
use serde_json::Value;

use crate::strict_json::StrictJsonError;

/// The machine-readable error codes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorCode {
    InvalidArgument,
    Unauthenticated,
    PermissionDenied,
    NotFound,
    StateConflict,
    IdempotencyConflict,
    SubscriptionLimit,
    EventHistoryExpired,
    DeliveryLeaseLost,
    ProtocolRequired,
    CapacityExceeded,
    Unavailable,
}

impl ErrorCode {
    /// Every code (the client crate parses each of them: a test checks it).
    pub const ALL: [ErrorCode; 12] = [
        ErrorCode::InvalidArgument,
        ErrorCode::Unauthenticated,
        ErrorCode::PermissionDenied,
        ErrorCode::NotFound,
        ErrorCode::StateConflict,
        ErrorCode::IdempotencyConflict,
        ErrorCode::SubscriptionLimit,
        ErrorCode::EventHistoryExpired,
        ErrorCode::DeliveryLeaseLost,
        ErrorCode::ProtocolRequired,
        ErrorCode::CapacityExceeded,
        ErrorCode::Unavailable,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::InvalidArgument => "INVALID_ARGUMENT",
            ErrorCode::Unauthenticated => "UNAUTHENTICATED",
            ErrorCode::PermissionDenied => "PERMISSION_DENIED",
            ErrorCode::NotFound => "NOT_FOUND",
            ErrorCode::StateConflict => "STATE_CONFLICT",
            ErrorCode::IdempotencyConflict => "IDEMPOTENCY_CONFLICT",
            ErrorCode::SubscriptionLimit => "SUBSCRIPTION_LIMIT",
            ErrorCode::EventHistoryExpired => "EVENT_HISTORY_EXPIRED",
            ErrorCode::DeliveryLeaseLost => "DELIVERY_LEASE_LOST",
            ErrorCode::ProtocolRequired => "PROTOCOL_REQUIRED",
            ErrorCode::CapacityExceeded => "CAPACITY_EXCEEDED",
            ErrorCode::Unavailable => "UNAVAILABLE",
        }
    }

    /// The status table: the HTTP status of each code.
    pub fn http_status(self) -> StatusCode {
        match self {
            ErrorCode::InvalidArgument => StatusCode::BAD_REQUEST,
            ErrorCode::Unauthenticated => StatusCode::UNAUTHORIZED,
            ErrorCode::PermissionDenied => StatusCode::FORBIDDEN,
            ErrorCode::NotFound => StatusCode::NOT_FOUND,
            ErrorCode::StateConflict
            | ErrorCode::IdempotencyConflict
            | ErrorCode::SubscriptionLimit
            | ErrorCode::DeliveryLeaseLost => StatusCode::CONFLICT,
            ErrorCode::EventHistoryExpired => StatusCode::GONE,
            ErrorCode::ProtocolRequired => StatusCode::UPGRADE_REQUIRED,
            ErrorCode::CapacityExceeded => StatusCode::TOO_MANY_REQUESTS,
            ErrorCode::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
        }
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An error answered to a client: code, message, optional details, and
/// (for a few cases) a status other than the code's or extra headers.
/// Boxed so that `Result<T, Error>` stays small.
#[derive(Debug, Clone)]
pub struct Error(Box<Inner>);

#[derive(Debug, Clone)]
struct Inner {
    code: ErrorCode,
    message: String,
    details: Option<Value>,
    status: Option<StatusCode>,
    headers: Vec<(HeaderName, HeaderValue)>,
    /// Set when the error leaves the envelope middleware as an `Err` (the
    /// deadline); `error_response` then renders the whole envelope itself.
    request_id: Option<String>,
    /// The database error an `UNAVAILABLE` came from (for the writer, which
    /// replaces a write connection after a fault; decision 0076).
    cause: Option<StoreError>,
}

/// Result alias for the service.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Error {
        Error(Box::new(Inner {
            code,
            message: message.into(),
            details: None,
            status: None,
            headers: Vec::new(),
            request_id: None,
            cause: None,
        }))
    }

    /// The machine-readable code.
    pub fn code(&self) -> ErrorCode {
        self.0.code
    }

    /// The client-facing message.
    pub fn message(&self) -> &str {
        &self.0.message
    }

    /// Carries the request id so [`ResponseError::error_response`] can render
    /// the full envelope.
    pub fn with_request_id(mut self, request_id: &str) -> Error {
        self.0.request_id = Some(request_id.to_owned());
        self
    }

    /// Extra headers of this error (`Allow`, `WWW-Authenticate`, `Retry-After`).
    pub fn headers(&self) -> &[(HeaderName, HeaderValue)] {
        &self.0.headers
    }

    pub fn invalid_argument(message: impl Into<String>) -> Error {
        Error::new(ErrorCode::InvalidArgument, message)
    }

    /// 413 with code `INVALID_ARGUMENT`.
    pub fn payload_too_large(limit: usize) -> Error {
        let mut e = Error::invalid_argument(format!("request body exceeds {limit} bytes"));
        e.0.status = Some(StatusCode::PAYLOAD_TOO_LARGE);
        e
    }

    /// 405 with code `INVALID_ARGUMENT` and an `Allow` header.
    pub fn method_not_allowed(allow: &str) -> Error {
        let mut e = Error::invalid_argument("method not allowed on this route");
        e.0.status = Some(StatusCode::METHOD_NOT_ALLOWED);
        e.push_header("allow", allow);
        e
    }

    /// 401 with `WWW-Authenticate: Bearer`.
    pub fn unauthenticated(message: impl Into<String>) -> Error {
        let mut e = Error::new(ErrorCode::Unauthenticated, message);
        e.push_header("www-authenticate", "Bearer");
        e
    }

    pub fn permission_denied(message: impl Into<String>) -> Error {
        Error::new(ErrorCode::PermissionDenied, message)
    }

    pub fn not_found(message: impl Into<String>) -> Error {
        Error::new(ErrorCode::NotFound, message)
    }

    pub fn state_conflict(message: impl Into<String>) -> Error {
        Error::new(ErrorCode::StateConflict, message)
    }

    /// `EVENT_HISTORY_EXPIRED`; `earliest` is the first sequence still in
    /// the log (retention floor + 1).
    pub fn history_expired(earliest: u64) -> Error {
        let mut e = Error::new(
            ErrorCode::EventHistoryExpired,
            format!("event history was purged; the earliest available sequence is {earliest}"),
        );
        e.0.details = Some(serde_json::json!({ "earliest_sequence": earliest.to_string() }));
        e
    }

    /// 429 `CAPACITY_EXCEEDED` with `Retry-After: 1`.
    pub fn capacity_exceeded(message: impl Into<String>) -> Error {
        let mut e = Error::new(ErrorCode::CapacityExceeded, message);
        e.push_header("retry-after", "1");
        e
    }

    pub fn unavailable(message: impl Into<String>) -> Error {
        Error::new(ErrorCode::Unavailable, message)
    }

    /// An internal failure: the cause is logged here, the client sees only
    /// `UNAVAILABLE`. Never pass a secret in `cause`.
    pub fn internal(cause: impl fmt::Display) -> Error {
        tracing::error!(error = %cause, "internal failure answered as UNAVAILABLE");
        Error::unavailable("the service is temporarily unavailable; retry later")
    }

    pub fn with_details(mut self, details: Value) -> Error {
        self.0.details = Some(details);
        self
    }

    fn push_header(&mut self, name: &'static str, value: &str) {
        if let Ok(v) = HeaderValue::from_str(value) {
            self.0.headers.push((HeaderName::from_static(name), v));
        }
    }

    /// The HTTP status this error is answered with.
    pub fn status(&self) -> StatusCode {
        self.0.status.unwrap_or_else(|| self.0.code.http_status())
    }

    /// The `error` member of the envelope.
    pub fn body(&self) -> Value {
        let mut obj =
            serde_json::json!({ "code": self.0.code.as_str(), "message": self.0.message });
        if let (Some(details), Some(map)) = (&self.0.details, obj.as_object_mut()) {
            map.insert("details".to_owned(), details.clone());
        }
        obj
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.0.code, self.0.message)
    }
}

impl std::error::Error for Error {}

impl From<StoreError> for Error {
    /// `UNAVAILABLE`, keeping the cause. A fault of the database (a full
    /// disk, a lost connection) is logged once per episode by the writer,
    /// not per request; anything else is logged here with its cause.
    fn from(err: StoreError) -> Error {
        let mut e = match &err {
            err if err.fault().is_some() => {
                tracing::debug!(error = %err, "database fault answered as UNAVAILABLE");
                Error::unavailable("the database is unavailable; retry later")
            }
            StoreError::Stopping => {
                Error::unavailable("the node is stopping; retry on another node")
            }
            StoreError::PastDeadline => Error::unavailable("the request passed its deadline"),
            err => Error::internal(format_args!("store: {err}")),
        };
        e.0.cause = Some(err);
        e
    }
}

impl From<DbErr> for Error {
    fn from(err: DbErr) -> Error {
        Error::from(StoreError::from(err))
    }
}

impl WriteError for Error {
    fn store_error(&self) -> Option<&StoreError> {
        self.0.cause.as_ref()
    }
}

impl From<StrictJsonError> for Error {
    fn from(err: StrictJsonError) -> Error {
        Error::invalid_argument(err.to_string())
    }
}

impl ResponseError for Error {
    fn status_code(&self) -> StatusCode {
        self.status()
    }

    /// Normally the envelope middleware finds this error on the response and
    /// writes the envelope; an error carrying its request id renders the
    /// whole envelope here.
    fn error_response(&self) -> HttpResponse {
        let mut res = HttpResponse::build(self.status());
        for (name, value) in &self.0.headers {
            res.insert_header((name.clone(), value.clone()));
        }
        match &self.0.request_id {
            Some(id) => res
                .insert_header(("x-request-id", id.as_str()))
                .insert_header(("cache-control", "no-store"))
                .content_type("application/json")
                .body(serde_json::json!({ "request_id": id, "error": self.body() }).to_string()),
            None => res.finish(),
        }
    }
}
