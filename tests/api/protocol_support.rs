//! Shared pieces of the `protocol_*` tests (orbit.events.v1, protocol.md).

use std::time::{Duration, Instant};

use futures_util::SinkExt;
use orbit_events::domain::random_hex_id;
use serde_json::{Value, json};
use tokio_tungstenite::tungstenite::{Message, protocol::frame::coding::CloseCode};

use crate::helpers::*;

/// A subscription from the start of the log; returns its id.
pub async fn subscription(app: &TestApp, cred: &Cred) -> String {
    app.subscribe(cred, json!({ "from_sequence": "0" })).await["id"]
        .as_str()
        .unwrap()
        .to_owned()
}

/// Pauses or resumes a subscription in the database (the scanner's timer
/// notices within `timing.scan_interval_ms`).
pub async fn set_enabled(app: &TestApp, subscription_id: &str, enabled: bool) {
    execute(
        app,
        &format!("UPDATE subscriptions SET enabled = {enabled} WHERE id = '{subscription_id}'"),
    )
    .await;
}

/// Runs one SQL statement in a write transaction of the node's database.
pub async fn execute(app: &TestApp, sql: &str) {
    use sea_orm::ConnectionTrait;
    let txn = app.db.begin_write().await.unwrap();
    txn.execute_unprepared(sql).await.unwrap();
    txn.commit().await.unwrap();
}

/// Sends a frame that is deliberately invalid (bypassing schema validation).
pub async fn send_invalid(ws: &mut WsClient, text: &str) {
    ws.send_text_unchecked(text).await;
}

/// Sends a raw WebSocket message (binary, fragments, control frames):
/// these are not JSON frames, so schema validation does not apply.
pub async fn send_raw(ws: &mut WsClient, msg: Message) {
    ws.stream.send(msg).await.unwrap();
}

/// The next frame must be an error with `code`; returns it.
#[track_caller]
pub fn assert_error_frame(frame: &Value, code: &str) {
    assert_eq!(frame["type"], "error", "expected an error frame: {frame:#}");
    assert_eq!(frame["error"]["code"], code, "{frame:#}");
    assert!(frame.get("body").is_none(), "an error frame has no body");
}

/// Expects an error frame with `code` (and `reply_to` when given), then the
/// close with `close`.
pub async fn expect_error_then_close(
    ws: &mut WsClient,
    code: &str,
    reply_to: Option<&Value>,
    close: CloseCode,
) -> Value {
    let frame = ws.frame().await;
    assert_error_frame(&frame, code);
    match reply_to {
        Some(id) => assert_eq!(&frame["reply_to"], id, "{frame:#}"),
        None => assert!(frame.get("reply_to").is_none(), "{frame:#}"),
    }
    assert_eq!(ws.closed().await, Some(close));
    frame
}

/// Expects the close with `close` and no frame before it.
pub async fn expect_close_only(ws: &mut WsClient, close: CloseCode) {
    match ws.recv().await {
        Received::Closed(c) => assert_eq!(c.map(|c| c.code), Some(close)),
        Received::Frame(f) => panic!("expected the close {close:?}, got {f:#}"),
    }
}

/// Sends `events.ping` and returns (reply, its message id).
pub async fn ping_expect_ack(ws: &mut WsClient) -> Value {
    let reply = ws.ping().await;
    assert_eq!(reply["type"], "ack", "{reply:#}");
    reply
}

/// A client frame with an explicit body, as JSON text (for tests that send
/// it unchecked).
pub fn frame_text(ws: &WsClient, frame_type: &str, body: Value) -> (String, Value) {
    let f = ws.envelope(frame_type, body);
    let id = f["message_id"].clone();
    (f.to_string(), id)
}

/// A fresh message id.
pub fn mid() -> String {
    random_hex_id()
}

/// Polls `check` until it is true or the deadline passes.
pub async fn wait_until<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + DEADLINE;
    while !check().await {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Publishes one result of `result_type` and returns its event id.
pub async fn publish_one(app: &TestApp, cred: &Cred, result_type: &str) -> String {
    app.publish(cred, vec![result(&cred.queue_id, result_type)])
        .await
        .remove(0)
        .0
}
