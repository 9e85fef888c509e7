//! What the node's log says: an internal failure names its cause and the
//! request or session it failed; lines are matched against the real
//! `orbit-events serve` process's stderr.

use serde_json::{Value, json};

use crate::helpers::*;
use crate::protocol_support::{NodeProcess, execute};

/// A node process with its log as JSON lines, plus a credential, a
/// subscription and one delivery of it leased to `ws`.
async fn node_with_a_leased_delivery() -> (TestApp, NodeProcess, Cred, String, WsClient, Value) {
    let mut app = spawn_app().await;
    let node = NodeProcess::serve_for(&mut app, &[("ORBIT_EVENTS_LOG_JSON", "true")]).await;
    let cred = app.bootstrap().await;
    let sub = app.subscribe(&cred, json!({})).await;
    let sub_id = sub["id"].as_str().unwrap().to_owned();
    app.publish(&cred, vec![result(&cred.queue_id, "task.succeeded")])
        .await;
    let mut ws = app.bind(&cred.token, &sub_id, 1).await;
    let deliver = ws.delivery().await;
    (app, node, cred, sub_id, ws, deliver)
}

/// The node's JSON log lines, each parsed.
fn json_lines(node: &NodeProcess) -> Vec<Value> {
    node.log()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// A field of a JSON log line, wherever tracing put it: the event's own
/// fields or one of its spans'.
fn field<'a>(line: &'a Value, name: &str) -> Option<&'a Value> {
    line["fields"].get(name).or_else(|| {
        line["spans"]
            .as_array()
            .and_then(|spans| spans.iter().find_map(|s| s.get(name)))
            .or_else(|| line["span"].get(name))
    })
}

#[actix_web::test]
async fn an_internal_failure_is_logged_once_with_its_cause_and_the_request_id_the_client_got() {
    let (app, node, cred, sub_id, _ws, _) = node_with_a_leased_delivery().await;
    // A row the store's rules exclude: a delivery state no version writes.
    execute(&app, "UPDATE deliveries SET state = 'MISLAID'").await;
    let res = app
        .get(
            &format!("/v1/subscriptions/{sub_id}/deliveries"),
            &cred.token,
        )
        .await;
    res.assert_error(503, "UNAVAILABLE");
    let request_id = res.body["request_id"].as_str().unwrap().to_owned();
    assert!(
        !res.body.to_string().contains("MISLAID"),
        "the client does not see the cause: {}",
        res.body
    );
    let lines = json_lines(&node);
    let failures: Vec<&Value> = lines
        .iter()
        .filter(|l| l["level"] == "ERROR")
        .filter(|l| field(l, "request_id").and_then(Value::as_str) == Some(&request_id))
        .collect();
    assert_eq!(
        failures.len(),
        1,
        "one ERROR line for the request: {lines:#?}"
    );
    let cause = field(failures[0], "error")
        .map(Value::to_string)
        .unwrap_or_default();
    assert!(
        cause.contains("MISLAID"),
        "the line names the cause: {:#}",
        failures[0]
    );
}

#[actix_web::test]
async fn an_internal_failure_on_a_session_is_logged_with_its_cause_and_the_session_id() {
    let (app, node, cred, _sub_id, mut ws, deliver) = node_with_a_leased_delivery().await;
    let session_id = node_session_id(&app).await;
    execute(&app, "UPDATE deliveries SET state = 'MISLAID'").await;
    // Whatever the ACK is answered with, the node must say why, on the line
    // of its session.
    let ack = ack_frame(&ws, &deliver);
    ws.send_json(ack).await;
    let _ = ws.recv_within(std::time::Duration::from_secs(5)).await;
    let lines = json_lines(&node);
    let named: Vec<&Value> = lines
        .iter()
        .filter(|l| l["level"] == "ERROR" || l["level"] == "WARN")
        .filter(|l| field(l, "session_id").and_then(Value::as_str) == Some(&session_id))
        .filter(|l| l.to_string().contains("MISLAID"))
        .collect();
    assert!(
        !named.is_empty(),
        "a line with the session id names the cause: {lines:#?}"
    );
    let log = node.log();
    let secret = deliver["body"]["lease_secret"].as_str().unwrap();
    assert!(!log.contains(&cred.token) && !log.contains(secret), "{log}");
}

/// The one open session's id.
async fn node_session_id(app: &TestApp) -> String {
    app.column::<String>("SELECT id FROM event_sessions WHERE closed_at IS NULL")
        .await
        .pop()
        .unwrap()
}

/// The `event.ack` frame for `deliver`.
fn ack_frame(ws: &WsClient, deliver: &Value) -> Value {
    let body = &deliver["body"];
    ws.envelope(
        "event.ack",
        json!({
            "delivery_id": body["delivery"]["id"],
            "epoch": body["delivery"]["lease_epoch"],
            "lease_secret": body["lease_secret"],
        }),
    )
}
