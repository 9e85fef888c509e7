//! Errors: the service's codes as a type (spec: http-api.md §4, protocol.md
//! §4), and what else can go wrong on the client's side.

use std::{fmt, time::Duration};

use serde::{Deserialize, Deserializer};
use serde_json::Value;

/// A machine-readable error code of the service. The spec's codes are
/// variants; a code this version does not know is kept in `Other`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorCode {
    /// 400 (413 for an oversized body, 405 for a wrong method); on the
    /// connection, an error frame for a bad body.
    InvalidArgument,
    /// 401: missing, malformed, unknown or revoked token.
    Unauthenticated,
    /// 403: the credential lacks the permission.
    PermissionDenied,
    /// 404: unknown, or belongs to another credential, or outside the scope.
    NotFound,
    /// 409: a name taken, a revision that moved on, a delivery not EXPIRED.
    StateConflict,
    /// 409: the idempotency key was used for a different request.
    IdempotencyConflict,
    /// 409: the namespace has its 64 subscriptions.
    SubscriptionLimit,
    /// 410 / error frame: history below the position was purged;
    /// [`ApiError::earliest_sequence`] names the first one still there.
    EventHistoryExpired,
    /// Error frame answering an ACK whose proof is no longer the latest.
    DeliveryLeaseLost,
    /// 426: the upgrade did not offer `orbit.events.v1`.
    ProtocolRequired,
    /// 429 with `Retry-After`: the node has all its connections.
    CapacityExceeded,
    /// 503 / error frame + close 1011: database down or deadline passed.
    Unavailable,
    /// A code this client version does not know.
    Other(String),
}

impl ErrorCode {
    /// Parses a code as the service writes it.
    pub fn parse(code: &str) -> ErrorCode {
        match code {
            "INVALID_ARGUMENT" => ErrorCode::InvalidArgument,
            "UNAUTHENTICATED" => ErrorCode::Unauthenticated,
            "PERMISSION_DENIED" => ErrorCode::PermissionDenied,
            "NOT_FOUND" => ErrorCode::NotFound,
            "STATE_CONFLICT" => ErrorCode::StateConflict,
            "IDEMPOTENCY_CONFLICT" => ErrorCode::IdempotencyConflict,
            "SUBSCRIPTION_LIMIT" => ErrorCode::SubscriptionLimit,
            "EVENT_HISTORY_EXPIRED" => ErrorCode::EventHistoryExpired,
            "DELIVERY_LEASE_LOST" => ErrorCode::DeliveryLeaseLost,
            "PROTOCOL_REQUIRED" => ErrorCode::ProtocolRequired,
            "CAPACITY_EXCEEDED" => ErrorCode::CapacityExceeded,
            "UNAVAILABLE" => ErrorCode::Unavailable,
            other => ErrorCode::Other(other.to_owned()),
        }
    }

    /// The code as the service writes it.
    pub fn as_str(&self) -> &str {
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
            ErrorCode::Other(code) => code,
        }
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for ErrorCode {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(ErrorCode::parse(&String::deserialize(d)?))
    }
}

impl serde::Serialize for ErrorCode {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

/// An error the service answered: an HTTP error envelope (`status` set) or
/// an `error` frame on the connection (`status` unset).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{code}: {message}")]
pub struct ApiError {
    /// The HTTP status; `None` for an error frame.
    pub status: Option<u16>,
    pub code: ErrorCode,
    /// Human-readable; names the offending field where there is one.
    pub message: String,
    /// `error.details` (e.g. `{"earliest_sequence": "4"}`).
    pub details: Option<Value>,
    /// `request_id` of the envelope (quote it when reporting a problem).
    pub request_id: Option<String>,
    /// `Retry-After` of a 429, in whole seconds.
    pub retry_after: Option<Duration>,
}

impl ApiError {
    /// For `EVENT_HISTORY_EXPIRED`: the first sequence still in the log
    /// (retention floor + 1), from `details.earliest_sequence` (HTTP) or
    /// from the message ("… earliest available sequence is N", frames).
    pub fn earliest_sequence(&self) -> Option<u64> {
        if let Some(s) = self
            .details
            .as_ref()
            .and_then(|d| d.get("earliest_sequence"))
            .and_then(Value::as_str)
        {
            return crate::types::parse_u64(s);
        }
        const MARK: &str = "earliest available sequence is ";
        let start = self.message.find(MARK)? + MARK.len();
        let digits: String = self.message[start..]
            .chars()
            .take_while(char::is_ascii_digit)
            .collect();
        crate::types::parse_u64(&digits)
    }
}

/// Anything a management call can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The service answered with an error envelope.
    #[error(transparent)]
    Api(Box<ApiError>),
    /// The request did not get an answer (connection refused or reset,
    /// timeout). A write may or may not have been applied: resend it with
    /// the same idempotency key to find out.
    #[error("no answer from the server: {0}")]
    Transport(String),
    /// The answer was not what the API documents.
    #[error("unexpected answer from the server: {0}")]
    Protocol(String),
    /// An argument was refused before anything was sent.
    #[error("{0}")]
    InvalidInput(String),
}

impl From<ApiError> for Error {
    fn from(e: ApiError) -> Error {
        Error::Api(Box::new(e))
    }
}

impl Error {
    /// The service's code, when the service answered.
    pub fn code(&self) -> Option<&ErrorCode> {
        match self {
            Error::Api(e) => Some(&e.code),
            _ => None,
        }
    }

    /// True when sending the same request again (same idempotency key) may
    /// succeed: no answer, `UNAVAILABLE`, or `CAPACITY_EXCEEDED`.
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::Transport(_) => true,
            Error::Api(e) => matches!(e.code, ErrorCode::Unavailable | ErrorCode::CapacityExceeded),
            Error::Protocol(_) | Error::InvalidInput(_) => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame_error(message: &str) -> ApiError {
        ApiError {
            status: None,
            code: ErrorCode::EventHistoryExpired,
            message: message.to_owned(),
            details: None,
            request_id: None,
            retry_after: None,
        }
    }

    #[test]
    fn every_code_round_trips_and_unknown_codes_are_kept() {
        for code in [
            "INVALID_ARGUMENT",
            "UNAUTHENTICATED",
            "PERMISSION_DENIED",
            "NOT_FOUND",
            "STATE_CONFLICT",
            "IDEMPOTENCY_CONFLICT",
            "SUBSCRIPTION_LIMIT",
            "EVENT_HISTORY_EXPIRED",
            "DELIVERY_LEASE_LOST",
            "PROTOCOL_REQUIRED",
            "CAPACITY_EXCEEDED",
            "UNAVAILABLE",
        ] {
            let parsed = ErrorCode::parse(code);
            assert!(!matches!(parsed, ErrorCode::Other(_)), "{code}");
            assert_eq!(parsed.as_str(), code);
        }
        assert_eq!(
            ErrorCode::parse("SOMETHING_NEW"),
            ErrorCode::Other("SOMETHING_NEW".to_owned())
        );
    }

    #[test]
    fn earliest_sequence_comes_from_details_or_from_the_frame_message() {
        let mut http = frame_error("from_sequence is below the retention floor");
        http.details = Some(serde_json::json!({ "earliest_sequence": "4" }));
        assert_eq!(http.earliest_sequence(), Some(4));
        assert_eq!(
            frame_error("history purged: the earliest available sequence is 17")
                .earliest_sequence(),
            Some(17)
        );
        assert_eq!(frame_error("no number here").earliest_sequence(), None);
    }
}
