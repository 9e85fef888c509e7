//! docs/events.schema.json itself (protocol.md §2): Draft 2020-12 with
//! `clientFrame` and `serverFrame`, accepting the spec's example frames and
//! refusing what the server refuses.

use serde_json::{Value, json};

const SCHEMA: &str = include_str!("../../docs/events.schema.json");

fn valid(definition: &str, frame: &Value) -> bool {
    let mut root: Value = serde_json::from_str(SCHEMA).unwrap();
    root["$ref"] = json!(format!("#/$defs/{definition}"));
    jsonschema::draft202012::new(&root).unwrap().is_valid(frame)
}

const S: &str = "44444444444444444444444444444444";
const SECRET: &str = "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA";

fn deliver() -> Value {
    json!({
      "protocol_version": "1", "type": "event.deliver",
      "message_id": "cccccccccccccccccccccccccccccccc", "session_id": S,
      "body": {
        "delivery": {
          "created_at": "2026-09-17T10:00:00Z", "id": "33333333333333333333333333333333",
          "subscription_id": "22222222222222222222222222222222",
          "event_id": "55555555555555555555555555555555", "sequence": "13", "revision": "2",
          "state": "LEASED", "available_at": "2026-09-17T10:00:00Z", "lease_epoch": "1",
          "lease_until": "2026-09-17T10:00:30Z", "attempts": 1, "attempt_budget": 20
        },
        "event": {
          "id": "55555555555555555555555555555555", "sequence": "13", "type": "task.cancelled",
          "aggregate_kind": "task", "aggregate_id": "66666666666666666666666666666666",
          "aggregate_revision": "2", "occurred_at": "2026-09-17T10:00:00Z",
          "details": {"state": "CANCELLED", "reason": "CANCEL_REQUESTED"},
          "snapshot": {
            "schema_version": 1, "task_id": "66666666666666666666666666666666",
            "queue_id": "11111111111111111111111111111111", "state": "CANCELLED",
            "revision": "2", "effect_uncertain": false
          }
        },
        "lease_secret": SECRET
      }
    })
}

#[test]
fn the_schema_is_draft_2020_12_with_client_frame_and_server_frame_definitions() {
    let root: Value = serde_json::from_str(SCHEMA).unwrap();
    assert_eq!(
        root["$schema"],
        "https://json-schema.org/draft/2020-12/schema"
    );
    assert!(root["$defs"]["clientFrame"].is_object());
    assert!(root["$defs"]["serverFrame"].is_object());
}

#[test]
fn the_example_frames_of_the_spec_are_valid() {
    let client = [
        json!({"protocol_version": "1", "type": "events.hello", "message_id": "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
               "body": {"subscription_id": "22222222222222222222222222222222", "capacity": 1}}),
        json!({"protocol_version": "1", "type": "event.ack", "message_id": "dddddddddddddddddddddddddddddddd", "session_id": S,
               "body": {"delivery_id": "33333333333333333333333333333333", "epoch": "1", "lease_secret": SECRET}}),
        json!({"protocol_version": "1", "type": "events.ping", "message_id": "ffffffffffffffffffffffffffffffff", "session_id": S, "body": {}}),
    ];
    for f in &client {
        assert!(valid("clientFrame", f), "{f:#}");
        assert!(
            !valid("serverFrame", f),
            "a client frame is no server frame: {f:#}"
        );
    }
    let server = [
        json!({"protocol_version": "1", "type": "events.welcome", "message_id": "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb",
               "reply_to": "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa", "session_id": S,
               "body": {"session_id": S, "subscription_id": "22222222222222222222222222222222", "capacity": 1,
                        "lease_duration_ms": 30000, "heartbeat_interval_ms": 15000,
                        "server_time": "2026-09-17T10:00:00Z", "enabled": true}}),
        deliver(),
        json!({"protocol_version": "1", "type": "ack", "message_id": "eeeeeeeeeeeeeeeeeeeeeeeeeeeeeeee",
               "reply_to": "dddddddddddddddddddddddddddddddd", "session_id": S,
               "body": {"delivery_id": "33333333333333333333333333333333", "event_id": "55555555555555555555555555555555",
                        "epoch": "1", "acknowledged_at": "2026-09-17T10:00:01Z", "deduplicated": false}}),
        json!({"protocol_version": "1", "type": "ack", "message_id": "eeeeeeeeeeeeeeeeeeeeeeeeeeeeeeee",
               "reply_to": "ffffffffffffffffffffffffffffffff", "session_id": S,
               "body": {"server_time": "2026-09-17T10:00:01.123456Z", "enabled": false}}),
        json!({"protocol_version": "1", "type": "error", "message_id": "eeeeeeeeeeeeeeeeeeeeeeeeeeeeeeee",
               "reply_to": "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
               "error": {"code": "NOT_FOUND", "message": "subscription not found"}}),
    ];
    for f in &server {
        assert!(valid("serverFrame", f), "{f:#}");
        assert!(
            !valid("clientFrame", f),
            "a server frame is no client frame: {f:#}"
        );
    }
}

#[test]
fn the_schema_refuses_what_the_server_refuses() {
    let hello = |body: Value| json!({"protocol_version": "1", "type": "events.hello", "message_id": "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa", "body": body});
    let ack = |epoch: Value, secret: &str| {
        json!({"protocol_version": "1", "type": "event.ack", "message_id": "dddddddddddddddddddddddddddddddd", "session_id": S,
               "body": {"delivery_id": "33333333333333333333333333333333", "epoch": epoch, "lease_secret": secret}})
    };
    let mut hello_with_session = hello(json!({"subscription_id": S, "capacity": 1}));
    hello_with_session["session_id"] = json!(S);
    let bad_client = [
        hello(json!({"subscription_id": S, "capacity": 0})),
        hello(json!({"subscription_id": S, "capacity": 33})),
        hello(json!({"subscription_id": S})),
        hello(json!({"subscription_id": S, "capacity": 1, "x": 1})),
        hello_with_session,
        ack(json!("01"), SECRET),
        ack(json!(1), SECRET),
        ack(json!("1"), &SECRET[..42]),
        ack(json!("1"), "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAB"),
        json!({"protocol_version": "1", "type": "events.ping", "message_id": "ffffffffffffffffffffffffffffffff", "body": {}}),
        json!({"protocol_version": "1", "type": "events.ping", "message_id": "ffffffffffffffffffffffffffffffff", "session_id": S, "body": {"a": 1}}),
        json!({"protocol_version": "2", "type": "events.ping", "message_id": "ffffffffffffffffffffffffffffffff", "session_id": S, "body": {}}),
        json!({"protocol_version": "1", "type": "events.ping", "message_id": "FFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFF", "session_id": S, "body": {}}),
    ];
    for f in &bad_client {
        assert!(!valid("clientFrame", f), "{f:#}");
    }
    let mut unleased = deliver();
    unleased["body"]["delivery"]["state"] = json!("PENDING");
    let mut no_lease_until = deliver();
    no_lease_until["body"]["delivery"]
        .as_object_mut()
        .unwrap()
        .remove("lease_until");
    let mut error_with_body = json!({"protocol_version": "1", "type": "error", "message_id": S,
        "error": {"code": "UNAVAILABLE", "message": "x"}});
    error_with_body["body"] = json!({});
    for f in [unleased, no_lease_until, error_with_body] {
        assert!(!valid("serverFrame", &f), "{f:#}");
    }
}
