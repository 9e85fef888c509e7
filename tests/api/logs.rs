//! What the node's log says: an internal failure names its cause and the
//! request or session it failed; lines are matched against the real
//! `orbit-events serve` process's stderr.

use serde_json::{Value, json};

use crate::helpers::*;
use crate::http_support::{eventually, expired_delivery};
use crate::protocol_support::{NodeProcess, execute};

/// A node process with its log as JSON lines, plus a credential, a
/// subscription and one delivery of it leased to `ws`.
async fn node_with_a_leased_delivery() -> (TestApp, NodeProcess, Cred, String, WsClient, Value) {
    node_logging_with_a_leased_delivery(&[("ORBIT_EVENTS_LOG_JSON", "true")]).await
}

/// As [`node_with_a_leased_delivery`], the node started with `env`.
async fn node_logging_with_a_leased_delivery(
    env: &[(&str, &str)],
) -> (TestApp, NodeProcess, Cred, String, WsClient, Value) {
    let mut app = spawn_app().await;
    let node = NodeProcess::serve_for(&mut app, env).await;
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

/// The access log lines (target `orbit_events::access`) of `node`.
fn access_lines(node: &NodeProcess) -> Vec<Value> {
    json_lines(node)
        .into_iter()
        .filter(|l| l["target"] == "orbit_events::access")
        .collect()
}

/// Polls the node's JSON log until a line satisfies `found`.
async fn logged(node: &NodeProcess, what: &str, found: impl Fn(&Value) -> bool) -> Value {
    eventually(what, || async {
        json_lines(node).into_iter().find(|l| found(l))
    })
    .await
}

#[actix_web::test]
async fn the_access_log_line_of_a_request_carries_the_request_id_the_client_got_with_route_status_and_credential()
 {
    let (app, node, cred, sub_id, _ws, _) = node_with_a_leased_delivery().await;
    let res = app
        .get(&format!("/v1/subscriptions/{sub_id}"), &cred.token)
        .await;
    assert_eq!(res.status, 200);
    let request_id = res.headers["x-request-id"].to_str().unwrap().to_owned();
    let line = logged(&node, "the request's access log line", |l| {
        l["target"] == "orbit_events::access" && l["fields"]["request_id"] == request_id.as_str()
    })
    .await;
    let fields = &line["fields"];
    assert_eq!(line["level"], "INFO", "{line:#}");
    assert_eq!(fields["method"], "GET", "{line:#}");
    assert_eq!(fields["route"], "/v1/subscriptions/{id}", "{line:#}");
    assert_eq!(fields["status"], 200, "{line:#}");
    assert_eq!(fields["subscription_id"], sub_id.as_str(), "{line:#}");
    assert_eq!(
        fields["credential_id"],
        cred.credential_id.as_str(),
        "{line:#}"
    );
    assert!(fields["duration_ms"].as_f64().is_some(), "{line:#}");

    // A refusal is logged the same way: an unauthenticated request (no
    // credential id) and a path no route has (its path, the route label
    // `unmatched`).
    let res = app
        .get(&format!("/v1/subscriptions/{sub_id}"), "oe_not-a-token")
        .await;
    let refused = res.headers["x-request-id"].to_str().unwrap().to_owned();
    let line = logged(&node, "the refusal's line", |l| {
        l["fields"]["request_id"] == refused.as_str()
    })
    .await;
    assert_eq!(line["fields"]["status"], 401, "{line:#}");
    assert_eq!(line["fields"]["code"], "UNAUTHENTICATED", "{line:#}");
    assert!(line["fields"].get("credential_id").is_none(), "{line:#}");
    let res = app.get("/v2/nowhere", &cred.token).await;
    let lost = res.headers["x-request-id"].to_str().unwrap().to_owned();
    let line = logged(&node, "the 404's line", |l| {
        l["fields"]["request_id"] == lost.as_str()
    })
    .await;
    assert_eq!(line["fields"]["route"], "unmatched", "{line:#}");
    assert_eq!(line["fields"]["path"], "/v2/nowhere", "{line:#}");
    assert_eq!(line["fields"]["status"], 404, "{line:#}");
}

#[actix_web::test]
async fn a_refused_upgrade_and_a_session_close_are_logged_with_status_code_and_reason() {
    let (app, node, cred, sub_id, ws, _) = node_with_a_leased_delivery().await;
    // The upgrade that opened the session: 101 on the connect route.
    let opened = access_lines(&node);
    assert!(
        opened
            .iter()
            .any(|l| l["fields"]["route"] == "/v1/events/connect"
                && l["fields"]["status"] == 101
                && l["fields"]["credential_id"] == cred.credential_id.as_str()),
        "{opened:#?}"
    );
    // A plain GET of the connect route is refused 426 and logged.
    let res = app.get("/v1/events/connect", &cred.token).await;
    let refused = res.headers["x-request-id"].to_str().unwrap().to_owned();
    let line = logged(&node, "the refused upgrade's line", |l| {
        l["fields"]["request_id"] == refused.as_str()
    })
    .await;
    assert_eq!(line["fields"]["status"], res.status.as_u16(), "{line:#}");
    assert!(res.status.is_client_error(), "{:?}", res.status);

    let session_id = node_session_id(&app).await;
    let mut ws = ws;
    ws.stream.close(None).await.unwrap();
    let line = logged(&node, "the session's close line", |l| {
        field(l, "session_id").and_then(Value::as_str) == Some(&session_id)
            && l["fields"].get("close_code").is_some()
    })
    .await;
    assert_eq!(line["level"], "INFO", "{line:#}");
    assert_eq!(line["fields"]["close_code"], 1000, "{line:#}");
    assert_eq!(
        line["fields"]["subscription_id"],
        sub_id.as_str(),
        "{line:#}"
    );
    assert!(
        line["fields"]["close_reason"]
            .as_str()
            .is_some_and(|r| r.contains("client")),
        "{line:#}"
    );
    // Once per connection.
    tokio::time::timeout(std::time::Duration::from_secs(5), async {
        while app
            .column::<i64>("SELECT COUNT(*) FROM event_sessions WHERE closed_at IS NULL")
            .await
            .pop()
            != Some(0)
        {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    })
    .await
    .unwrap();
    let closes = json_lines(&node)
        .into_iter()
        .filter(|l| field(l, "session_id").and_then(Value::as_str) == Some(&session_id))
        .filter(|l| l["fields"].get("close_code").is_some())
        .count();
    assert_eq!(closes, 1);
}

#[actix_web::test]
async fn a_delivery_exhausted_to_expired_and_each_management_write_are_logged_once() {
    // The in-process node sweeps rarely: the process under test is the one
    // that recovers the lapsed lease (and logs it).
    let mut app = spawn_app_with(|s| s.timing.sweep_interval_ms = 3_600_000).await;
    let node = NodeProcess::serve_for(
        &mut app,
        &[
            ("ORBIT_EVENTS_LOG_JSON", "true"),
            ("ORBIT_EVENTS__TIMING__LEASE_MS", "300"),
            ("ORBIT_EVENTS__TIMING__SCAN_INTERVAL_MS", "50"),
            ("ORBIT_EVENTS__TIMING__SWEEP_INTERVAL_MS", "100"),
        ],
    )
    .await;
    let cred = app.bootstrap().await;
    let (sub_id, expired, _ws) = expired_delivery(&app, &cred).await;
    let delivery_id = expired["id"].as_str().unwrap().to_owned();
    let line = logged(&node, "the EXPIRED line", |l| {
        l["fields"]["delivery_id"] == delivery_id.as_str()
            && l["fields"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("EXPIRED"))
    })
    .await;
    assert_eq!(
        line["fields"]["subscription_id"],
        sub_id.as_str(),
        "{line:#}"
    );
    assert_eq!(line["fields"]["attempts"], 1, "{line:#}");

    let res = app
        .post(
            &format!("/v1/subscriptions/{sub_id}/deliveries/{delivery_id}:retry"),
            &cred.token,
            "retry-1",
            &json!({ "expected_revision": expired["revision"], "reason": "fixed", "additional_attempts": 1 }),
        )
        .await;
    assert_eq!(res.status, 200, "{:#}", res.body);
    let sub = app
        .get(&format!("/v1/subscriptions/{sub_id}"), &cred.token)
        .await;
    let res = app
        .post(
            &format!("/v1/subscriptions/{sub_id}:configure"),
            &cred.token,
            "pause-1",
            &json!({ "expected_revision": sub.data()["revision"], "enabled": false, "reason": "maintenance" }),
        )
        .await;
    assert_eq!(res.status, 200, "{:#}", res.body);
    for what in ["re-armed by a retry", "subscription paused"] {
        logged(&node, what, |l| {
            l["fields"]["message"]
                .as_str()
                .is_some_and(|m| m.contains(what))
                && l["fields"]["subscription_id"] == sub_id.as_str()
                && l["fields"]["credential_id"] == cred.credential_id.as_str()
        })
        .await;
    }
    let lines = json_lines(&node);
    let count = |what: &str| {
        lines
            .iter()
            .filter(|l| {
                l["fields"]["message"]
                    .as_str()
                    .is_some_and(|m| m.contains(what))
                    && l["target"] != "orbit_events::access"
            })
            .filter(|l| {
                l["fields"]["delivery_id"] == delivery_id.as_str()
                    || l["fields"]["subscription_id"] == sub_id.as_str()
            })
            .count()
    };
    assert_eq!(count("EXPIRED"), 1, "{lines:#?}");
    assert_eq!(count("re-armed by a retry"), 1, "{lines:#?}");
    assert_eq!(count("subscription paused"), 1, "{lines:#?}");
}

#[actix_web::test]
async fn no_log_line_at_any_level_contains_a_token_or_a_lease_secret() {
    let (app, node, cred, sub_id, mut ws, deliver) =
        node_logging_with_a_leased_delivery(&[("RUST_LOG", "trace")]).await;
    let ack = ack_frame(&ws, &deliver);
    ws.send_json(ack).await;
    let _ = ws.recv_within(std::time::Duration::from_secs(5)).await;
    app.get(
        &format!("/v1/subscriptions/{sub_id}/deliveries"),
        &cred.token,
    )
    .await;
    // A token pasted where the client's text is logged: in a path (as an
    // id, inside a segment, percent-encoded) and in a frame the node quotes
    // in its close reason.
    let encoded = cred.token.replacen("oe_", "%6Fe_", 1);
    for path in [
        format!("/v1/subscriptions/{}", cred.token),
        format!("/v1/subscriptions/{sub_id}/deliveries/{}", cred.token),
        format!("/v1/x{}/y", cred.token),
        format!("/v1/{encoded}"),
    ] {
        app.get(&path, &cred.token).await;
    }
    let mut quoting = app.connect(&cred.token).await;
    quoting
        .send_text_unchecked(
            &json!({ "protocol_version": "1", "type": cred.token, "message_id": "a1", "body": {} })
                .to_string(),
        )
        .await;
    let _ = quoting.closed().await;
    let secret = deliver["body"]["lease_secret"].as_str().unwrap().to_owned();
    let log = node.log();
    assert!(log.lines().count() > 20, "a trace log was written: {log}");
    for (what, value) in [("token", cred.token.as_str()), ("lease secret", &secret)] {
        let leaked: Vec<&str> = log.lines().filter(|l| l.contains(value)).collect();
        assert!(leaked.is_empty(), "the {what} is in the log: {leaked:#?}");
    }
}
