//! The wire types of the management API (spec: http-api.md §3,
//! `docs/openapi.json`) and the event shape shared with orbit.events.v1
//! (`docs/events.schema.json`).
//!
//! Field names and shapes are exactly the documents': uint64 values travel
//! as canonical decimal strings and are `u64` here; times are RFC 3339 and
//! are [`Time`] here; fields the API omits are `Option` and are omitted
//! again when serialized. `details` and `snapshot.result` stay raw JSON
//! text, so numbers keep the producer's precision byte for byte.

use chrono::{DateTime, Timelike, Utc};
use serde::{Deserialize, Deserializer, Serialize};
use serde_json::value::RawValue;

/// A time as the API writes it: RFC 3339 in UTC with `Z`, at most
/// microsecond precision.
pub type Time = DateTime<Utc>;

/// Parses a canonical uint64 decimal string (`0` or `[1-9][0-9]*`, at most
/// 18446744073709551615): what the API sends and accepts.
pub fn parse_u64(s: &str) -> Option<u64> {
    let canonical = !s.is_empty()
        && s.len() <= 20
        && s.bytes().all(|b| b.is_ascii_digit())
        && (s == "0" || !s.starts_with('0'));
    if canonical { s.parse().ok() } else { None }
}

/// serde for a `u64` carried as a canonical decimal string.
pub(crate) mod u64_string {
    use serde::{Deserialize, Deserializer, Serializer, de};

    pub fn serialize<S: Serializer>(v: &u64, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(v)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
        let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        super::parse_u64(&s).ok_or_else(|| {
            de::Error::invalid_value(de::Unexpected::Str(&s), &"a canonical uint64 string")
        })
    }

    /// Serializes an optional value (skip it when `None`).
    pub fn serialize_option<S: Serializer>(v: &Option<u64>, s: S) -> Result<S::Ok, S::Error> {
        match v {
            Some(v) => s.collect_str(v),
            None => s.serialize_none(),
        }
    }
}

pub use orbit_events_wire::{DeliveryState, ResultType, SnapshotState};

/// A subscription (spec: http-api.md §3, `Subscription` in openapi.json).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Subscription {
    pub id: String,
    pub queue_id: String,
    pub credential_id: String,
    pub name: String,
    /// Grows by 1 on every configure; `expected_revision` of the next one.
    #[serde(with = "u64_string")]
    pub revision: u64,
    /// False while paused: no new deliveries.
    pub enabled: bool,
    /// In canonical order.
    pub types: Vec<ResultType>,
    /// How far the log has been read into deliveries (not an ACK mark).
    #[serde(with = "u64_string")]
    pub cursor_sequence: u64,
    /// Deliveries not yet ACKED (PENDING, LEASED, EXPIRED).
    pub pending_count: u64,
    pub max_pending: u32,
    pub max_attempts: u32,
    pub created_at: Time,
    pub updated_at: Time,
}

/// `EventDelivery`: one event for one subscription. No lease secret ever
/// appears here.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EventDelivery {
    /// Stable across redeliveries of one event to one subscription.
    pub id: String,
    pub subscription_id: String,
    pub event_id: String,
    /// The event's position in its queue's log.
    #[serde(with = "u64_string")]
    pub sequence: u64,
    /// 1 when materialized; +1 on each lease, recovery, ACK and retry;
    /// `expected_revision` of a retry.
    #[serde(with = "u64_string")]
    pub revision: u64,
    pub state: DeliveryState,
    pub created_at: Time,
    /// Earliest time of the next offer.
    pub available_at: Time,
    /// 0 when never leased; +1 on each lease.
    #[serde(with = "u64_string")]
    pub lease_epoch: u64,
    /// Only in state LEASED.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_until: Option<Time>,
    /// Leases so far.
    pub attempts: u32,
    /// Cumulative budget of attempts.
    pub attempt_budget: u32,
    /// Only in state ACKED.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub acknowledged_at: Option<Time>,
    /// Only in state ACKED: the lease epoch the ACK proved (decimal string).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ack_epoch: Option<String>,
    /// Only in state ACKED, when recorded: the session the ACK came on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ack_session_id: Option<String>,
}

/// A result's task snapshot (schema_version 1).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Snapshot {
    /// Always 1.
    pub schema_version: u32,
    pub task_id: String,
    pub queue_id: String,
    pub state: SnapshotState,
    #[serde(with = "u64_string")]
    pub revision: u64,
    pub effect_uncertain: bool,
    /// The producer's JSON, byte-exact (a JSON `null` stays `null`).
    #[serde(
        default,
        deserialize_with = "raw_keeping_null",
        skip_serializing_if = "Option::is_none"
    )]
    pub result: Option<Box<RawValue>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub current_attempt_id: Option<String>,
}

/// `Option<Box<RawValue>>` where a present `null` is `Some("null")`: serde
/// would otherwise turn it into `None` and drop it.
fn raw_keeping_null<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Box<RawValue>>, D::Error> {
    Box::<RawValue>::deserialize(d).map(Some)
}

/// One entry of a queue's result log, as delivered (`event` of
/// `event.deliver` and of the delivery detail). Deduplicate by `id` (an
/// Inbox), never by `aggregate_id`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Event {
    pub id: String,
    #[serde(with = "u64_string")]
    pub sequence: u64,
    #[serde(rename = "type")]
    pub event_type: ResultType,
    /// Always `task`.
    pub aggregate_kind: String,
    /// The task id.
    pub aggregate_id: String,
    #[serde(with = "u64_string")]
    pub aggregate_revision: u64,
    pub occurred_at: Time,
    /// Any JSON object, byte-exact.
    pub details: Box<RawValue>,
    pub snapshot: Snapshot,
}

/// One result as a producer publishes it (spec: http-api.md §3 "Result
/// ingest"). [`NewResult::new`] fills the fields that must agree.
#[derive(Debug, Clone, Serialize)]
pub struct NewResult {
    #[serde(rename = "type")]
    pub result_type: ResultType,
    /// The task id; must equal `snapshot.task_id`.
    pub aggregate_id: String,
    /// Must equal `snapshot.revision`.
    #[serde(with = "u64_string")]
    pub aggregate_revision: u64,
    /// At most microsecond precision.
    pub occurred_at: Time,
    /// Any JSON object.
    pub details: Box<RawValue>,
    pub snapshot: Snapshot,
}

impl NewResult {
    /// A result of `result_type` for task `task_id` at `revision` on
    /// `queue_id`, occurred `occurred_at` (truncated to microseconds):
    /// `details` `{}`, no `result`, `effect_uncertain` false. The snapshot
    /// agrees with the type, task and revision, as ingest requires.
    pub fn new(
        result_type: ResultType,
        queue_id: &str,
        task_id: &str,
        revision: u64,
        occurred_at: Time,
    ) -> NewResult {
        let micros = occurred_at.nanosecond() / 1_000 * 1_000;
        NewResult {
            result_type,
            aggregate_id: task_id.to_owned(),
            aggregate_revision: revision,
            occurred_at: occurred_at.with_nanosecond(micros).unwrap_or(occurred_at),
            details: empty_object(),
            snapshot: Snapshot {
                schema_version: 1,
                task_id: task_id.to_owned(),
                queue_id: queue_id.to_owned(),
                state: result_type.snapshot_state(),
                revision,
                effect_uncertain: false,
                result: None,
                current_attempt_id: None,
            },
        }
    }

    /// Sets `snapshot.result` (any JSON text, kept byte-exact).
    pub fn with_result(mut self, result: Box<RawValue>) -> NewResult {
        self.snapshot.result = Some(result);
        self
    }

    /// Sets `details` (a JSON object, kept byte-exact).
    pub fn with_details(mut self, details: Box<RawValue>) -> NewResult {
        self.details = details;
        self
    }
}

fn empty_object() -> Box<RawValue> {
    // "{}" is valid JSON; the fallback is never taken.
    RawValue::from_string("{}".to_owned()).unwrap_or_else(|_| Box::<RawValue>::default())
}

/// Body of `POST /v1/subscriptions`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CreateSubscription {
    /// `^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$`, unique in the namespace.
    pub name: String,
    pub queue_id: String,
    /// Empty: all four types.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub types: Vec<ResultType>,
    /// `None`: start after the committed head (only new results);
    /// `Some(0)`: everything still retained; `Some(n)`: first delivered is
    /// n + 1.
    #[serde(
        skip_serializing_if = "Option::is_none",
        serialize_with = "u64_string::serialize_option"
    )]
    pub from_sequence: Option<u64>,
    /// `None`: 100; else 1–1000.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_pending: Option<u32>,
    /// `None`: 20; else 1–100.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_attempts: Option<u32>,
}

impl CreateSubscription {
    /// A subscription named `name` on `queue_id` with every default: all
    /// types, starting after the current head.
    pub fn new(name: &str, queue_id: &str) -> CreateSubscription {
        CreateSubscription {
            name: name.to_owned(),
            queue_id: queue_id.to_owned(),
            types: Vec::new(),
            from_sequence: None,
            max_pending: None,
            max_attempts: None,
        }
    }
}

/// Body of `POST /v1/subscriptions/{id}:configure` (pause or resume).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ConfigureSubscription {
    /// Must equal the subscription's current revision.
    #[serde(with = "u64_string")]
    pub expected_revision: u64,
    pub enabled: bool,
    /// Kept in the audit record; 1–1024 characters.
    pub reason: String,
}

/// Body of `POST .../deliveries/{delivery_id}:retry`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RetryDelivery {
    /// Must equal the delivery's current revision.
    #[serde(with = "u64_string")]
    pub expected_revision: u64,
    /// Kept in the audit record; 1–1024 characters.
    pub reason: String,
    /// 1–100, added to `attempt_budget`.
    pub additional_attempts: u32,
}

/// Body of `POST /v1/queues/{queue_id}/results`.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct PublishResults<'a> {
    pub results: &'a [NewResult],
}

/// `data` of a subscription write.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SubscriptionResult {
    pub subscription: Subscription,
    /// True when the answer replays an earlier request with the same key
    /// (the original snapshot, not the current state).
    pub deduplicated: bool,
}

/// `data` of a delivery retry.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeliveryResult {
    pub delivery: EventDelivery,
    pub deduplicated: bool,
}

/// `data` of the delivery detail.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DeliveryDetail {
    pub delivery: EventDelivery,
    pub event: Event,
}

/// One appended event.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AppendedEvent {
    pub id: String,
    #[serde(with = "u64_string")]
    pub sequence: u64,
}

/// `data` of a publish.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PublishResult {
    /// In request order.
    pub events: Vec<AppendedEvent>,
    pub deduplicated: bool,
}

/// A page of a list, newest first.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Page<T> {
    pub items: Vec<T>,
    /// Pass to the next call for the following page; absent on the last.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_cursor: Option<String>,
}

/// What one step of a delivery's history was (http-api.md "Delivery
/// history").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum StepKind {
    Materialized,
    Leased,
    LeaseLapsed,
    AckRefused,
    SessionClosed,
    Retried,
    Acked,
}

impl StepKind {
    /// The name as the API writes it (`LEASE_LAPSED`).
    pub fn as_str(self) -> &'static str {
        match self {
            StepKind::Materialized => "MATERIALIZED",
            StepKind::Leased => "LEASED",
            StepKind::LeaseLapsed => "LEASE_LAPSED",
            StepKind::AckRefused => "ACK_REFUSED",
            StepKind::SessionClosed => "SESSION_CLOSED",
            StepKind::Retried => "RETRIED",
            StepKind::Acked => "ACKED",
        }
    }
}

/// One step of a delivery's history; fields that do not apply to the step
/// are absent.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeliveryStep {
    pub step: StepKind,
    pub at: Time,
    /// The lease's epoch (ACK_REFUSED: the epoch offered), decimal string.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub epoch: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub leased_at: Option<Time>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_until: Option<Time>,
    /// LEASE_LAPSED: PENDING or EXPIRED; RETRIED: PENDING.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<DeliveryState>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempts: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempt_budget: Option<u32>,
    /// SESSION_CLOSED: the WebSocket close code.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub close_code: Option<u16>,
    /// SESSION_CLOSED: the close reason; RETRIED: the admin's reason.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// RETRIED: who retried.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credential_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub additional_attempts: Option<u32>,
}

/// `data` of a delivery's history: oldest first.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeliveryHistory {
    pub items: Vec<DeliveryStep>,
}

/// `data` of `GET /v1/subscriptions/{id}/status`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SubscriptionStatus {
    pub subscription_id: String,
    pub queue_id: String,
    #[serde(with = "u64_string")]
    pub head_sequence: u64,
    #[serde(with = "u64_string")]
    pub retention_floor: u64,
    #[serde(with = "u64_string")]
    pub cursor_sequence: u64,
    /// Results after the cursor.
    #[serde(with = "u64_string")]
    pub lag: u64,
    pub enabled: bool,
    pub pending: u64,
    pub leased: u64,
    pub expired: u64,
    pub pending_count: u64,
    pub max_pending: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oldest_unacked: Option<OldestUnacked>,
    pub sessions: Vec<BoundSession>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_configure: Option<LastConfigure>,
    /// Why nothing moves; empty when it moves.
    pub blocked: Vec<Blocked>,
}

/// The non-ACKED delivery with the lowest sequence.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OldestUnacked {
    pub delivery_id: String,
    #[serde(with = "u64_string")]
    pub sequence: u64,
    pub state: DeliveryState,
    pub created_at: Time,
    pub age_seconds: f64,
}

/// A session bound to the subscription.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BoundSession {
    pub session_id: String,
    pub node_id: String,
    pub capacity: u32,
    /// Live leases it holds.
    pub held: u64,
    pub opened_at: Time,
}

/// The latest pause or resume.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LastConfigure {
    #[serde(with = "u64_string")]
    pub revision: u64,
    pub enabled: bool,
    pub reason: String,
    pub credential_id: String,
    pub at: Time,
}

/// One reason a subscription does not move.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Blocked {
    /// `PAUSED`, `BACKLOG_FULL`, `HISTORY_EXPIRED`, `NO_CONSUMER` or
    /// `EXPIRED_DELIVERIES`.
    pub code: String,
    pub message: String,
    /// HISTORY_EXPIRED: the earliest sequence still in the log.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub earliest_sequence: Option<String>,
}

/// Body of `POST /v1/subscriptions/{id}/deliveries:retry`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RetryExpired {
    /// Kept in the audit record; 1–1024 characters.
    pub reason: String,
    /// 1–100, added to each delivery's budget.
    pub additional_attempts: u32,
    /// Inclusive sequence bounds.
    #[serde(
        skip_serializing_if = "Option::is_none",
        serialize_with = "u64_string::serialize_option"
    )]
    pub from_sequence: Option<u64>,
    #[serde(
        skip_serializing_if = "Option::is_none",
        serialize_with = "u64_string::serialize_option"
    )]
    pub to_sequence: Option<u64>,
    /// 1–10000 deliveries, lowest sequence first.
    pub limit: u32,
    /// Count only; change nothing.
    pub dry_run: bool,
    /// Spread the re-armed deliveries over this many ms.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub spread_ms: Option<u32>,
}

/// `data` of a bulk retry.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RetryReceipt {
    pub matched: u64,
    pub retried: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_sequence: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_sequence: Option<String>,
    pub dry_run: bool,
    pub deduplicated: bool,
}

/// A queue of the credential's scope.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Queue {
    pub id: String,
    pub name: String,
    #[serde(with = "u64_string")]
    pub head_sequence: u64,
    #[serde(with = "u64_string")]
    pub retention_floor: u64,
}

/// `data` of `GET /v1/queues`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct QueueList {
    pub items: Vec<Queue>,
}

/// `data` of `/healthz` and `/readyz`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Health {
    /// `ok` (healthz) or `ready` (readyz).
    pub status: String,
    /// The answering node (readyz only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_id: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uint64_strings_must_be_canonical() {
        assert_eq!(parse_u64("0"), Some(0));
        assert_eq!(parse_u64("18446744073709551615"), Some(u64::MAX));
        for bad in [
            "",
            "01",
            "+1",
            "-1",
            "1.0",
            "1e3",
            " 1",
            "18446744073709551616",
        ] {
            assert_eq!(parse_u64(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn result_types_parse_long_and_short_names() {
        assert_eq!("task.failed".parse(), Ok(ResultType::Failed));
        assert_eq!("needs_review".parse(), Ok(ResultType::NeedsReview));
        assert!("task.requeued".parse::<ResultType>().is_err());
        assert_eq!("expired".parse(), Ok(DeliveryState::Expired));
    }

    #[test]
    fn a_snapshot_keeps_its_result_byte_exact_including_null() {
        let text = r#"{"schema_version":1,"task_id":"t","queue_id":"q","state":"FAILED","revision":"2","effect_uncertain":true,"result":123456789012345678901234567890.5}"#;
        let snap: Snapshot = serde_json::from_str(text).unwrap();
        assert_eq!(serde_json::to_string(&snap).unwrap(), text);
        let null = text.replace("123456789012345678901234567890.5", "null");
        let snap: Snapshot = serde_json::from_str(&null).unwrap();
        assert_eq!(serde_json::to_string(&snap).unwrap(), null);
    }

    #[test]
    fn a_new_result_agrees_with_itself_and_has_microsecond_time() {
        let at = DateTime::parse_from_rfc3339("2026-09-17T10:00:00.123456789Z")
            .unwrap()
            .with_timezone(&Utc);
        let r = NewResult::new(ResultType::NeedsReview, "q", "t", 3, at);
        let json = serde_json::to_value(&r).unwrap();
        assert_eq!(json["occurred_at"], "2026-09-17T10:00:00.123456Z");
        assert_eq!(json["snapshot"]["state"], "NEEDS_REVIEW");
        assert_eq!(json["aggregate_revision"], "3");
        assert_eq!(json["snapshot"]["revision"], "3");
        assert_eq!(json["details"], serde_json::json!({}));
    }
}
