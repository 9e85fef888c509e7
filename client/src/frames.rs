//! Frames of `orbit.events.v1` (spec: protocol.md §2,
//! `docs/events.schema.json`): the three a consumer sends and the five a
//! server sends.

use std::{fmt, time::Duration};

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

use crate::{
    credentials::random_hex,
    error::{ApiError, ErrorCode},
    types::{Event, EventDelivery, Time, u64_string},
};

/// The subprotocol offered on the upgrade.
pub const SUBPROTOCOL: &str = "orbit.events.v1";

/// The only protocol version.
pub const PROTOCOL_VERSION: &str = "1";

/// A lease secret: 43 characters of base64url, sent once in
/// `event.deliver`. Never shown by `Debug`.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct LeaseSecret(String);

impl LeaseSecret {
    /// Wraps a secret as received (or as stored by the caller).
    pub fn new(secret: impl Into<String>) -> LeaseSecret {
        LeaseSecret(secret.into())
    }

    /// The secret itself, e.g. to store an unconfirmed proof.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for LeaseSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("LeaseSecret(<redacted>)")
    }
}

/// A lease proof `(delivery_id, epoch, lease_secret)`: the body of
/// `event.ack`. Keep a proof whose ACK was not confirmed and send it again,
/// on a new connection if needed; never guess another epoch (spec:
/// protocol.md §5).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AckProof {
    pub delivery_id: String,
    #[serde(with = "u64_string")]
    pub epoch: u64,
    pub lease_secret: LeaseSecret,
}

/// `events.welcome`: the session is bound.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Welcome {
    pub session_id: String,
    pub subscription_id: String,
    pub capacity: u32,
    /// How long each lease lasts.
    pub lease_duration_ms: u64,
    /// How often the consumer should ping.
    pub heartbeat_interval_ms: u64,
    pub server_time: Time,
    /// False while the subscription is paused.
    pub enabled: bool,
}

impl Welcome {
    pub fn lease_duration(&self) -> Duration {
        Duration::from_millis(self.lease_duration_ms)
    }

    pub fn heartbeat_interval(&self) -> Duration {
        Duration::from_millis(self.heartbeat_interval_ms)
    }
}

/// `ack` answering an `event.ack`: the delivery is ACKED.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AckReceipt {
    pub delivery_id: String,
    pub event_id: String,
    #[serde(with = "u64_string")]
    pub epoch: u64,
    /// When the ACK committed (the original time for a replay).
    pub acknowledged_at: Time,
    /// True when this proof had already acknowledged the delivery.
    pub deduplicated: bool,
}

/// `ack` answering an `events.ping`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PingReply {
    pub server_time: Time,
    /// False while the subscription is paused.
    pub enabled: bool,
}

/// `body` of `event.deliver`, with the event kept as received.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DeliverBody {
    pub delivery: EventDelivery,
    pub event: Box<RawValue>,
    pub lease_secret: LeaseSecret,
}

/// `error` of an error frame.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FrameError {
    pub code: ErrorCode,
    pub message: String,
}

/// A frame from the server, parsed.
#[derive(Debug, Clone)]
pub enum ServerFrame {
    Welcome {
        reply_to: String,
        body: Welcome,
    },
    Deliver(Box<DeliverBody>),
    /// `ack` answering an `event.ack` (its `reply_to`).
    Ack {
        reply_to: String,
        body: AckReceipt,
    },
    /// `ack` answering an `events.ping`.
    Pong {
        reply_to: String,
        body: PingReply,
    },
    Error {
        reply_to: Option<String>,
        error: FrameError,
    },
}

/// The envelope of every frame, both directions (`body` raw).
#[derive(Debug, Serialize, Deserialize)]
pub struct Envelope {
    pub protocol_version: String,
    #[serde(rename = "type")]
    pub frame_type: String,
    pub message_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reply_to: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub body: Option<Box<RawValue>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<FrameError>,
}

/// A frame the client could not make sense of; the connection is dropped
/// and made again.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unexpected frame from the server: {0}")]
pub struct FrameParseError(pub String);

impl ServerFrame {
    /// Parses one text frame.
    pub fn parse(text: &str) -> Result<ServerFrame, FrameParseError> {
        let env: Envelope =
            serde_json::from_str(text).map_err(|e| FrameParseError(e.to_string()))?;
        if env.protocol_version != PROTOCOL_VERSION {
            return Err(FrameParseError("protocol_version is not \"1\"".to_owned()));
        }
        let kind = env.frame_type.as_str();
        match kind {
            "events.welcome" => Ok(ServerFrame::Welcome {
                reply_to: reply_to_of(&env)?,
                body: body_of(&env)?,
            }),
            "event.deliver" => Ok(ServerFrame::Deliver(Box::new(body_of(&env)?))),
            "ack" => {
                let reply_to = reply_to_of(&env)?;
                // The two replies share a type; their bodies differ.
                match body_of::<AckReceipt>(&env) {
                    Ok(body) => Ok(ServerFrame::Ack { reply_to, body }),
                    Err(_) => Ok(ServerFrame::Pong {
                        reply_to,
                        body: body_of(&env)?,
                    }),
                }
            }
            "error" => Ok(ServerFrame::Error {
                reply_to: env.reply_to.clone(),
                error: env
                    .error
                    .clone()
                    .ok_or_else(|| FrameParseError("error without error".to_owned()))?,
            }),
            other => Err(FrameParseError(format!("unknown frame type {other:?}"))),
        }
    }
}

fn reply_to_of(env: &Envelope) -> Result<String, FrameParseError> {
    env.reply_to
        .clone()
        .ok_or_else(|| FrameParseError(format!("{} without reply_to", env.frame_type)))
}

fn body_of<T: serde::de::DeserializeOwned>(env: &Envelope) -> Result<T, FrameParseError> {
    let body = env
        .body
        .as_deref()
        .ok_or_else(|| FrameParseError(format!("{} without a body", env.frame_type)))?;
    serde_json::from_str(body.get())
        .map_err(|e| FrameParseError(format!("{}: {e}", env.frame_type)))
}

impl FrameError {
    /// As an [`ApiError`] (no HTTP status).
    pub fn to_api_error(&self) -> ApiError {
        ApiError {
            status: None,
            code: self.code.clone(),
            message: self.message.clone(),
            details: None,
            request_id: None,
            retry_after: None,
        }
    }
}

/// A client frame as text, with a fresh `message_id`.
#[derive(Debug, Clone)]
pub struct ClientFrame {
    pub message_id: String,
    pub text: String,
}

#[derive(Serialize)]
struct Outgoing<'a, B: Serialize> {
    protocol_version: &'static str,
    #[serde(rename = "type")]
    frame_type: &'static str,
    message_id: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    session_id: Option<&'a str>,
    body: &'a B,
}

fn client_frame<B: Serialize>(
    frame_type: &'static str,
    session_id: Option<&str>,
    body: &B,
) -> ClientFrame {
    let message_id = random_hex();
    let text = serde_json::to_string(&Outgoing {
        protocol_version: PROTOCOL_VERSION,
        frame_type,
        message_id: &message_id,
        session_id,
        body,
    })
    // Plain structs of strings and integers always serialize.
    .unwrap_or_default();
    ClientFrame { message_id, text }
}

/// `events.hello {subscription_id, capacity}`.
pub fn hello(subscription_id: &str, capacity: u32) -> ClientFrame {
    #[derive(Serialize)]
    struct Body<'a> {
        subscription_id: &'a str,
        capacity: u32,
    }
    client_frame(
        "events.hello",
        None,
        &Body {
            subscription_id,
            capacity,
        },
    )
}

/// `event.ack` with a lease proof.
pub fn ack(session_id: &str, proof: &AckProof) -> ClientFrame {
    client_frame("event.ack", Some(session_id), proof)
}

/// `events.ping {}`.
pub fn ping(session_id: &str) -> ClientFrame {
    #[derive(Serialize)]
    struct Empty {}
    client_frame("events.ping", Some(session_id), &Empty {})
}

/// A delivery handed to a [`crate::Handler`]: the delivery row, the event,
/// and the event exactly as the server sent it (store that text in your
/// Inbox and nothing is lost or rounded).
#[derive(Debug, Clone)]
pub struct Delivery {
    pub delivery: EventDelivery,
    pub event: Event,
    event_json: Box<RawValue>,
    proof: AckProof,
}

impl Delivery {
    /// Parses `event.deliver`'s body.
    pub fn from_body(body: DeliverBody) -> Result<Delivery, FrameParseError> {
        let event: Event = serde_json::from_str(body.event.get())
            .map_err(|e| FrameParseError(format!("event.deliver: event: {e}")))?;
        let proof = AckProof {
            delivery_id: body.delivery.id.clone(),
            epoch: body.delivery.lease_epoch,
            lease_secret: body.lease_secret,
        };
        Ok(Delivery {
            delivery: body.delivery,
            event,
            event_json: body.event,
            proof,
        })
    }

    /// The event as JSON text, byte for byte as delivered.
    pub fn event_json(&self) -> &str {
        self.event_json.get()
    }

    /// The proof that ACKs this lease (the consumer sends it for you).
    pub fn proof(&self) -> &AckProof {
        &self.proof
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "0123456789abcdef0123456789abcdef";
    const SECRET: &str = "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA";

    #[test]
    fn client_frames_carry_a_fresh_message_id_and_the_session() {
        let proof = AckProof {
            delivery_id: ID.to_owned(),
            epoch: 3,
            lease_secret: LeaseSecret::new(SECRET),
        };
        let frame = ack("s", &proof);
        let v: serde_json::Value = serde_json::from_str(&frame.text).unwrap();
        assert_eq!(v["type"], "event.ack");
        assert_eq!(v["session_id"], "s");
        assert_eq!(v["message_id"], frame.message_id.as_str());
        assert_eq!(v["body"]["epoch"], "3");
        assert_ne!(ping("s").message_id, ping("s").message_id);
        let hello: serde_json::Value = serde_json::from_str(&hello(ID, 8).text).unwrap();
        assert!(hello.get("session_id").is_none());
        assert_eq!(hello["body"]["capacity"], 8);
    }

    #[test]
    fn the_two_ack_replies_are_told_apart_by_their_bodies() {
        let pong = format!(
            r#"{{"protocol_version":"1","type":"ack","message_id":"{ID}","session_id":"{ID}","reply_to":"{ID}","body":{{"server_time":"2026-09-17T10:00:00Z","enabled":false}}}}"#
        );
        assert!(matches!(
            ServerFrame::parse(&pong).unwrap(),
            ServerFrame::Pong {
                body: PingReply { enabled: false, .. },
                ..
            }
        ));
        let ack = format!(
            r#"{{"protocol_version":"1","type":"ack","message_id":"{ID}","session_id":"{ID}","reply_to":"{ID}","body":{{"delivery_id":"{ID}","event_id":"{ID}","epoch":"2","acknowledged_at":"2026-09-17T10:00:00.5Z","deduplicated":true}}}}"#
        );
        assert!(matches!(
            ServerFrame::parse(&ack).unwrap(),
            ServerFrame::Ack {
                body: AckReceipt {
                    epoch: 2,
                    deduplicated: true,
                    ..
                },
                ..
            }
        ));
    }

    #[test]
    fn an_error_frame_keeps_its_code_and_reply_to() {
        let text = format!(
            r#"{{"protocol_version":"1","type":"error","message_id":"{ID}","reply_to":"{ID}","error":{{"code":"DELIVERY_LEASE_LOST","message":"m"}}}}"#
        );
        match ServerFrame::parse(&text).unwrap() {
            ServerFrame::Error { reply_to, error } => {
                assert_eq!(reply_to.as_deref(), Some(ID));
                assert_eq!(error.code, ErrorCode::DeliveryLeaseLost);
            }
            other => panic!("{other:?}"),
        }
        assert!(ServerFrame::parse("{}").is_err());
        assert!(
            ServerFrame::parse(r#"{"protocol_version":"2","type":"ack","message_id":"x"}"#)
                .is_err()
        );
    }

    #[test]
    fn a_lease_secret_never_shows_in_debug_output() {
        let proof = AckProof {
            delivery_id: ID.to_owned(),
            epoch: 1,
            lease_secret: LeaseSecret::new(SECRET),
        };
        assert!(!format!("{proof:?}").contains(SECRET));
    }
}
