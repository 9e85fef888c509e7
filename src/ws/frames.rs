//! Frames of `orbit.events.v1`: strict parsing of client frames through the
//! shared strict JSON path, and serialization of server frames
//! (spec: protocol.md §2).

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

use crate::{
    domain::{
        Capacity, DeliveryId, LeaseSecret, MessageId, SessionId, SubscriptionId, Timestamp, U64Str,
        random_hex_id,
    },
    error::{Error, ErrorCode},
    journal::RenderedEvent,
    store::deliveries::DeliveryView,
    strict_json::{self, non_null},
};

/// The only protocol version.
pub const PROTOCOL_VERSION: &str = "1";

/// A client frame type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientFrameType {
    Hello,
    Ack,
    Ping,
}

impl ClientFrameType {
    fn parse(s: &str) -> Option<ClientFrameType> {
        match s {
            "events.hello" => Some(ClientFrameType::Hello),
            "event.ack" => Some(ClientFrameType::Ack),
            "events.ping" => Some(ClientFrameType::Ping),
            _ => None,
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawEnvelope {
    protocol_version: String,
    #[serde(rename = "type")]
    frame_type: String,
    message_id: String,
    #[serde(default, deserialize_with = "non_null")]
    session_id: Option<String>,
    #[serde(default)]
    reply_to: Option<Box<RawValue>>,
    #[serde(default)]
    error: Option<Box<RawValue>>,
    #[serde(default)]
    body: Option<Box<RawValue>>,
}

/// A client frame whose envelope is valid; the body is parsed per type.
#[derive(Debug)]
pub struct ClientEnvelope {
    pub frame_type: ClientFrameType,
    pub message_id: MessageId,
    pub session_id: Option<String>,
    body: Option<Box<RawValue>>,
}

/// An envelope violation: the connection closes with 1008.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct EnvelopeError(pub String);

/// Parses and checks a client frame's envelope: strict JSON (no duplicate
/// key at any depth), known fields only, `protocol_version` "1", a known
/// client type, a 32-hex `message_id`, no `reply_to` or `error`. Whether
/// `session_id` must be present depends on the session's phase, which the
/// connection checks.
pub fn parse_envelope(text: &str) -> Result<ClientEnvelope, EnvelopeError> {
    if !is_object(text) {
        return Err(EnvelopeError(
            "invalid frame: a frame is one JSON object".to_owned(),
        ));
    }
    let raw: RawEnvelope = strict_json::parse(text.as_bytes())
        .map_err(|e| EnvelopeError(format!("invalid frame: {e}")))?;
    if raw.protocol_version != PROTOCOL_VERSION {
        return Err(EnvelopeError("protocol_version must be \"1\"".to_owned()));
    }
    let frame_type = ClientFrameType::parse(&raw.frame_type)
        .ok_or_else(|| EnvelopeError(format!("unknown client frame type {:?}", raw.frame_type)))?;
    let message_id = MessageId::parse(&raw.message_id).ok_or_else(|| {
        EnvelopeError("message_id must be 32 lowercase hex characters".to_owned())
    })?;
    if raw.reply_to.is_some() || raw.error.is_some() {
        return Err(EnvelopeError(
            "client frames carry neither reply_to nor error".to_owned(),
        ));
    }
    Ok(ClientEnvelope {
        frame_type,
        message_id,
        session_id: raw.session_id,
        body: raw.body,
    })
}

/// `events.hello` body.
#[derive(Debug, Clone)]
pub struct Hello {
    pub subscription_id: SubscriptionId,
    pub capacity: Capacity,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct HelloBody {
    subscription_id: SubscriptionId,
    capacity: u64,
}

/// `event.ack` body.
#[derive(Debug, Clone)]
pub struct Ack {
    pub delivery_id: DeliveryId,
    pub epoch: u64,
    pub lease_secret: LeaseSecret,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AckBody {
    delivery_id: DeliveryId,
    epoch: U64Str,
    lease_secret: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PingBody {}

impl ClientEnvelope {
    fn body_bytes(&self) -> Result<&[u8], Error> {
        let body = self
            .body
            .as_deref()
            .ok_or_else(|| Error::invalid_argument("body is required"))?;
        if !is_object(body.get()) {
            return Err(Error::invalid_argument("body must be a JSON object"));
        }
        Ok(body.get().as_bytes())
    }

    /// The hello body; an error here is an `INVALID_ARGUMENT` frame.
    pub fn hello(&self) -> Result<Hello, Error> {
        let body: HelloBody = strict_json::parse_checked(self.body_bytes()?).map_err(body_error)?;
        let capacity = Capacity::new(body.capacity).ok_or_else(|| {
            Error::invalid_argument("body.capacity: must be an integer from 1 to 32")
        })?;
        Ok(Hello {
            subscription_id: body.subscription_id,
            capacity,
        })
    }

    /// The ACK body; an error here is an `INVALID_ARGUMENT` frame.
    pub fn ack(&self) -> Result<Ack, Error> {
        let body: AckBody = strict_json::parse_checked(self.body_bytes()?).map_err(body_error)?;
        let lease_secret = LeaseSecret::parse(&body.lease_secret)
            .map_err(|e| Error::invalid_argument(format!("body.{e}")))?;
        Ok(Ack {
            delivery_id: body.delivery_id,
            epoch: body.epoch.0,
            lease_secret,
        })
    }

    /// The ping body must be `{}`.
    pub fn ping(&self) -> Result<(), Error> {
        let _: PingBody = strict_json::parse_checked(self.body_bytes()?).map_err(body_error)?;
        Ok(())
    }
}

/// serde accepts a JSON array for a struct (fields by position); a frame
/// and its body must be objects.
fn is_object(text: &str) -> bool {
    text.trim_start().starts_with('{')
}

fn body_error(e: strict_json::StrictJsonError) -> Error {
    if e.path == "." {
        Error::invalid_argument(format!("body: {}", e.message))
    } else {
        Error::invalid_argument(format!("body.{}: {}", e.path, e.message))
    }
}

#[derive(Serialize)]
struct ServerFrame<'a, B: Serialize> {
    protocol_version: &'static str,
    #[serde(rename = "type")]
    frame_type: &'static str,
    message_id: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    session_id: Option<&'a SessionId>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reply_to: Option<&'a MessageId>,
    #[serde(skip_serializing_if = "Option::is_none")]
    body: Option<B>,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<ErrorBody<'a>>,
}

#[derive(Serialize)]
struct ErrorBody<'a> {
    code: &'static str,
    message: &'a str,
}

fn frame<B: Serialize>(
    frame_type: &'static str,
    session_id: Option<&SessionId>,
    reply_to: Option<&MessageId>,
    body: B,
) -> String {
    let f = ServerFrame {
        protocol_version: PROTOCOL_VERSION,
        frame_type,
        message_id: random_hex_id(),
        session_id,
        reply_to,
        body: Some(body),
        error: None,
    };
    // Serializing these plain structs cannot fail; an empty string would
    // be refused by any client rather than crash the node.
    serde_json::to_string(&f).unwrap_or_default()
}

/// `events.welcome` body.
#[derive(Serialize)]
pub struct Welcome<'a> {
    pub session_id: &'a SessionId,
    pub subscription_id: &'a SubscriptionId,
    pub capacity: u32,
    pub lease_duration_ms: u64,
    pub heartbeat_interval_ms: u64,
    pub server_time: Timestamp,
    pub enabled: bool,
}

pub fn welcome(reply_to: &MessageId, body: &Welcome<'_>) -> String {
    frame(
        "events.welcome",
        Some(body.session_id),
        Some(reply_to),
        body,
    )
}

/// `event.deliver` body.
#[derive(Serialize)]
pub struct Deliver<'a> {
    pub delivery: DeliveryView,
    pub event: &'a RenderedEvent,
    pub lease_secret: String,
}

pub fn deliver(session_id: &SessionId, body: &Deliver<'_>) -> String {
    frame("event.deliver", Some(session_id), None, body)
}

/// `ack` body answering an `event.ack`.
#[derive(Serialize)]
pub struct AckReply {
    pub delivery_id: String,
    pub event_id: String,
    pub epoch: U64Str,
    pub acknowledged_at: Timestamp,
    pub deduplicated: bool,
}

pub fn ack_reply(session_id: &SessionId, reply_to: &MessageId, body: &AckReply) -> String {
    frame("ack", Some(session_id), Some(reply_to), body)
}

/// `ack` body answering an `events.ping`.
#[derive(Serialize)]
pub struct PingReply {
    pub server_time: Timestamp,
    pub enabled: bool,
}

pub fn ping_reply(session_id: &SessionId, reply_to: &MessageId, body: &PingReply) -> String {
    frame("ack", Some(session_id), Some(reply_to), body)
}

/// An `error` frame: no body; `reply_to` when it answers a request;
/// `session_id` once bound.
pub fn error(
    session_id: Option<&SessionId>,
    reply_to: Option<&MessageId>,
    code: ErrorCode,
    message: &str,
) -> String {
    let f: ServerFrame<'_, ()> = ServerFrame {
        protocol_version: PROTOCOL_VERSION,
        frame_type: "error",
        message_id: random_hex_id(),
        session_id,
        reply_to,
        body: None,
        error: Some(ErrorBody {
            code: code.as_str(),
            message,
        }),
    };
    serde_json::to_string(&f).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    const MID: &str = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";

    fn hello(body: &str) -> String {
        format!(
            r#"{{"protocol_version":"1","type":"events.hello","message_id":"{MID}","body":{body}}}"#
        )
    }

    #[test]
    fn a_valid_hello_parses() {
        let env = parse_envelope(&hello(&format!(
            r#"{{"subscription_id":"{MID}","capacity":8}}"#
        )))
        .unwrap();
        assert_eq!(env.frame_type, ClientFrameType::Hello);
        assert_eq!(env.hello().unwrap().capacity.get(), 8);
    }

    #[test]
    fn envelope_violations_are_envelope_errors() {
        for bad in [
            "not json".to_owned(),
            format!(r#"{{"protocol_version":"2","type":"events.ping","message_id":"{MID}"}}"#),
            format!(r#"{{"protocol_version":"1","type":"ack","message_id":"{MID}"}}"#),
            r#"{"protocol_version":"1","type":"events.ping","message_id":"X"}"#.to_owned(),
            format!(
                r#"{{"protocol_version":"1","type":"events.ping","message_id":"{MID}","extra":1}}"#
            ),
            format!(
                r#"{{"protocol_version":"1","type":"events.ping","message_id":"{MID}","reply_to":"{MID}"}}"#
            ),
            format!(
                r#"{{"protocol_version":"1","type":"events.ping","message_id":"{MID}","body":{{"a":1,"a":2}}}}"#
            ),
            format!(r#"["1","events.ping","{MID}",null,null,null,{{}}]"#),
        ] {
            assert!(parse_envelope(&bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn body_violations_are_invalid_argument() {
        for body in [
            format!(r#"{{"subscription_id":"{MID}","capacity":0}}"#),
            format!(r#"{{"subscription_id":"{MID}","capacity":33}}"#),
            format!(r#"{{"subscription_id":"{MID}","capacity":"1"}}"#),
            r#"{"capacity":1}"#.to_owned(),
            format!(r#"["{MID}",1]"#),
        ] {
            let env = parse_envelope(&hello(&body)).unwrap();
            assert_eq!(
                env.hello().unwrap_err().code(),
                ErrorCode::InvalidArgument,
                "{body}"
            );
        }
    }
}
