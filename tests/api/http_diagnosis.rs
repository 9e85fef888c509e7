//! Why a result was not delivered, and the fix in bulk (issue 19, decision
//! 0081): a delivery's history, a subscription's status, the bulk retry,
//! the queue list.

use serde_json::{Value, json};
use tokio_tungstenite::tungstenite::Message;

use crate::{
    helpers::*,
    http_support::*,
    protocol_support::{proof, send_raw, subscription},
};

const HISTORY: &str = "/v1/subscriptions/{id}/deliveries/{delivery_id}/history";
const STATUS: &str = "/v1/subscriptions/{id}/status";
const BULK: &str = "/v1/subscriptions/{id}/deliveries:retry";

/// Leases of 300 ms, recovered by a sweep every 100 ms (also without a
/// claim, for subscriptions nobody consumes).
async fn spawn_sweeping_app() -> TestApp {
    spawn_app_with(|s| {
        s.timing.lease_ms = 300;
        s.timing.scan_interval_ms = 50;
        s.timing.sweep_interval_ms = 100;
    })
    .await
}

async fn history_of(app: &TestApp, token: &str, sub_id: &str, delivery_id: &str) -> Vec<Value> {
    let res = app
        .get(
            &format!("/v1/subscriptions/{sub_id}/deliveries/{delivery_id}/history"),
            token,
        )
        .await;
    assert_eq!(res.status, 200, "{:#}", res.body);
    assert_conforms("GET", HISTORY, &res);
    res.data()["items"].as_array().unwrap().clone()
}

async fn status_of(app: &TestApp, token: &str, sub_id: &str) -> Value {
    let res = app
        .get(&format!("/v1/subscriptions/{sub_id}/status"), token)
        .await;
    assert_eq!(res.status, 200, "{:#}", res.body);
    assert_conforms("GET", STATUS, &res);
    res.data().clone()
}

fn blocked_codes(status: &Value) -> Vec<String> {
    status["blocked"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["code"].as_str().unwrap().to_owned())
        .collect()
}

fn steps(items: &[Value]) -> Vec<(String, String)> {
    items
        .iter()
        .map(|s| {
            (
                s["step"].as_str().unwrap().to_owned(),
                s["epoch"].as_str().unwrap_or("").to_owned(),
            )
        })
        .collect()
}

async fn delivery_state(app: &TestApp, token: &str, sub_id: &str, id: &str) -> Value {
    app.get(
        &format!("/v1/subscriptions/{sub_id}/deliveries/{id}"),
        token,
    )
    .await
    .data()["delivery"]
        .clone()
}

#[actix_web::test]
async fn a_delivery_history_shows_every_lease_how_it_ended_a_refused_ack_the_retry_and_the_ack_in_order()
 {
    // Session A must close while lease 2 is live (between the delivery, a
    // refused ACK and the close): 300 ms was once too short on a loaded CI
    // machine, and the history rightly showed no SESSION_CLOSED.
    let app = spawn_app_with(|s| {
        s.timing.lease_ms = 1_000;
        s.timing.scan_interval_ms = 50;
        s.timing.sweep_interval_ms = 100;
    })
    .await;
    let cred = app.bootstrap().await;
    let sub = app
        .subscribe(&cred, json!({ "from_sequence": "0", "max_attempts": 2 }))
        .await;
    let sub_id = sub["id"].as_str().unwrap().to_owned();
    app.publish(&cred, vec![result(&cred.queue_id, "task.succeeded")])
        .await;

    // Session A: lease 1 lapses back to PENDING, lease 2 comes.
    let mut a = app.bind(&cred.token, &sub_id, 1).await;
    let first = a.delivery().await;
    let id = first["body"]["delivery"]["id"].as_str().unwrap().to_owned();
    let second = a.delivery().await;
    assert_eq!(second["body"]["delivery"]["lease_epoch"], "2");
    // The old proof is refused.
    let body = proof(&first);
    let refused = a
        .ack_proof(
            body["delivery_id"].as_str().unwrap(),
            body["epoch"].as_str().unwrap(),
            body["lease_secret"].as_str().unwrap(),
        )
        .await;
    assert_eq!(
        refused["error"]["code"], "DELIVERY_LEASE_LOST",
        "{refused:#}"
    );
    let session_a = a.session_id.clone().unwrap();
    // A closes while it holds lease 2, which then lapses: EXPIRED.
    send_raw(&mut a, Message::Close(None)).await;
    eventually("the delivery to become EXPIRED", || async {
        let d = delivery_state(&app, &cred.token, &sub_id, &id).await;
        (d["state"] == "EXPIRED").then_some(())
    })
    .await;
    let expired = delivery_state(&app, &cred.token, &sub_id, &id).await;
    let retry = app
        .post(
            &format!("/v1/subscriptions/{sub_id}/deliveries/{id}:retry"),
            &cred.token,
            "retry-1",
            &json!({
                "expected_revision": expired["revision"],
                "reason": "receiver repaired",
                "additional_attempts": 1
            }),
        )
        .await;
    assert_eq!(retry.status, 200, "{:#}", retry.body);
    // Session B takes lease 3 and ACKs it.
    let mut b = app.bind(&cred.token, &sub_id, 1).await;
    let third = b.delivery().await;
    assert_eq!(third["body"]["delivery"]["lease_epoch"], "3");
    assert_eq!(b.ack(&third).await["type"], "ack");
    let session_b = b.session_id.clone().unwrap();

    let items = history_of(&app, &cred.token, &sub_id, &id).await;
    let expected: Vec<(String, String)> = [
        ("MATERIALIZED", ""),
        ("LEASED", "1"),
        ("LEASE_LAPSED", "1"),
        ("LEASED", "2"),
        ("ACK_REFUSED", "1"),
        ("SESSION_CLOSED", "2"),
        ("LEASE_LAPSED", "2"),
        ("RETRIED", ""),
        ("LEASED", "3"),
        ("ACKED", "3"),
    ]
    .iter()
    .map(|(s, e)| (s.to_string(), e.to_string()))
    .collect();
    assert_eq!(steps(&items), expected, "{items:#?}");
    let node = app.state.node_id.as_str();
    for (i, session) in [(1, &session_a), (3, &session_a), (8, &session_b)] {
        assert_eq!(items[i]["session_id"], json!(session), "{:#}", items[i]);
        assert_eq!(items[i]["node_id"], json!(node), "{:#}", items[i]);
        assert!(items[i]["leased_at"].is_string() && items[i]["lease_until"].is_string());
    }
    assert_eq!(items[2]["state"], "PENDING");
    assert_eq!(
        (
            items[2]["attempts"].clone(),
            items[2]["attempt_budget"].clone()
        ),
        (json!(1), json!(2))
    );
    assert_eq!(items[4]["session_id"], json!(session_a));
    assert_eq!(items[5]["close_code"], 1000);
    assert_eq!(items[5]["session_id"], json!(session_a));
    assert_eq!(items[6]["state"], "EXPIRED");
    assert_eq!(
        (
            items[6]["attempts"].clone(),
            items[6]["attempt_budget"].clone()
        ),
        (json!(2), json!(2))
    );
    assert_eq!(items[7]["reason"], "receiver repaired");
    assert_eq!(items[7]["credential_id"], json!(cred.credential_id));
    assert_eq!(items[7]["additional_attempts"], 1);
    assert_eq!(items[7]["attempt_budget"], 3);
    assert_eq!(items[9]["session_id"], json!(session_b));
    let times: Vec<&str> = items.iter().map(|s| s["at"].as_str().unwrap()).collect();
    let mut sorted = times.clone();
    sorted.sort();
    assert_eq!(times, sorted, "oldest first");
    app.assert_invariants().await;
}

#[actix_web::test]
async fn a_delivery_leased_once_and_acked_writes_no_history_row() {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let sub_id = subscription(&app, &cred).await;
    app.publish(&cred, vec![result(&cred.queue_id, "task.failed")])
        .await;
    let mut ws = app.bind(&cred.token, &sub_id, 1).await;
    let deliver = ws.delivery().await;
    assert_eq!(ws.ack(&deliver).await["type"], "ack");
    assert_eq!(app.scalar("SELECT COUNT(*) FROM delivery_history").await, 0);
    let id = deliver["body"]["delivery"]["id"].as_str().unwrap();
    let items = history_of(&app, &cred.token, &sub_id, id).await;
    let kinds: Vec<String> = steps(&items).into_iter().map(|(s, _)| s).collect();
    assert_eq!(kinds, ["MATERIALIZED", "LEASED", "ACKED"], "{items:#?}");
    let session = json!(ws.session_id.clone().unwrap());
    assert_eq!(items[1]["session_id"], session, "the lease's session");
    assert_eq!(items[1]["node_id"], json!(app.state.node_id.as_str()));
    assert_eq!(items[2]["session_id"], session, "the ACK's session");
    // Stored once: an ACK on the leasing session records no second copy.
    let copies = app
        .scalar("SELECT COUNT(*) FROM deliveries WHERE ack_session_id IS NOT NULL")
        .await;
    assert_eq!(copies, 0);
}

#[actix_web::test]
async fn status_names_each_reason_nothing_moves_and_none_while_it_moves() {
    let app = spawn_fast_app().await;
    let cred = app.bootstrap().await;
    let sub = app
        .subscribe(&cred, json!({ "from_sequence": "0", "max_pending": 1 }))
        .await;
    let sub_id = sub["id"].as_str().unwrap().to_owned();

    // Moving: a consumer is bound and nothing waits.
    let mut ws = app.bind(&cred.token, &sub_id, 2).await;
    let status = status_of(&app, &cred.token, &sub_id).await;
    assert_eq!(blocked_codes(&status), Vec::<String>::new(), "{status:#}");
    assert!(status.get("oldest_unacked").is_none());
    assert_eq!(
        status["sessions"][0]["session_id"],
        json!(ws.session_id.clone().unwrap())
    );
    assert_eq!(status["sessions"][0]["capacity"], 2);
    app.publish(&cred, vec![result(&cred.queue_id, "task.succeeded")])
        .await;
    ws.delivery().await;
    let status = status_of(&app, &cred.token, &sub_id).await;
    assert_eq!(status["sessions"][0]["held"], 1);
    assert_eq!(status["leased"], 1);
    assert_eq!(status["oldest_unacked"]["sequence"], "1");
    assert_eq!(status["oldest_unacked"]["state"], "LEASED");
    assert_eq!(blocked_codes(&status), Vec::<String>::new(), "{status:#}");

    // The consumer does not ACK: its one delivery fills the backlog
    // (max_pending 1) and new results wait behind it.
    app.publish(
        &cred,
        (0..2)
            .map(|_| result(&cred.queue_id, "task.failed"))
            .collect(),
    )
    .await;
    let status = status_of(&app, &cred.token, &sub_id).await;
    assert_eq!(status["lag"], "2", "{status:#}");
    assert_eq!(status["head_sequence"], "3");
    assert_eq!(blocked_codes(&status), ["BACKLOG_FULL"], "{status:#}");

    // The consumer goes away.
    send_raw(&mut ws, Message::Close(None)).await;
    let status = eventually("the session to close", || async {
        let s = status_of(&app, &cred.token, &sub_id).await;
        s["sessions"].as_array().unwrap().is_empty().then_some(s)
    })
    .await;
    assert_eq!(
        blocked_codes(&status),
        ["BACKLOG_FULL", "NO_CONSUMER"],
        "{status:#}"
    );

    // Paused, with the pause's reason readable.
    let paused = app
        .post(
            &format!("/v1/subscriptions/{sub_id}:configure"),
            &cred.token,
            "pause-1",
            &json!({ "expected_revision": "1", "enabled": false, "reason": "incident 42" }),
        )
        .await;
    assert_eq!(paused.status, 200, "{:#}", paused.body);
    let status = status_of(&app, &cred.token, &sub_id).await;
    assert_eq!(
        blocked_codes(&status),
        ["PAUSED", "BACKLOG_FULL", "NO_CONSUMER"]
    );
    assert_eq!(status["last_configure"]["reason"], "incident 42");
    assert_eq!(status["last_configure"]["enabled"], false);
    assert_eq!(status["last_configure"]["revision"], "2");
    assert_eq!(
        status["last_configure"]["credential_id"],
        json!(cred.credential_id)
    );

    // History purged below the cursor.
    execute(
        &app,
        &format!(
            "UPDATE queues SET retention_floor = 2 WHERE id = '{}'",
            cred.queue_id
        ),
    )
    .await;
    let status = status_of(&app, &cred.token, &sub_id).await;
    let gap = status["blocked"]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["code"] == "HISTORY_EXPIRED")
        .cloned()
        .unwrap_or_else(|| panic!("{status:#}"));
    assert_eq!(gap["earliest_sequence"], "3");

    // EXPIRED deliveries (another queue: this one's history is gone).
    let cred = app.bootstrap().await;
    let (other, _, _session) = expired_delivery(&app, &cred).await;
    let status = status_of(&app, &cred.token, &other).await;
    assert!(
        blocked_codes(&status).contains(&"EXPIRED_DELIVERIES".to_owned()),
        "{status:#}"
    );
    assert_eq!(status["expired"], 1);
}

/// `n` EXPIRED deliveries (sequences 1..=n) of a new subscription, their
/// session closed so that a retry leaves them PENDING.
async fn expired_deliveries(app: &TestApp, cred: &Cred, n: usize) -> String {
    let sub = app
        .subscribe(cred, json!({ "from_sequence": "0", "max_attempts": 1 }))
        .await;
    let sub_id = sub["id"].as_str().unwrap().to_owned();
    app.publish(
        cred,
        (0..n)
            .map(|_| result(&cred.queue_id, "task.failed"))
            .collect(),
    )
    .await;
    let mut ws = app.bind(&cred.token, &sub_id, n as u32).await;
    for _ in 0..n {
        ws.delivery().await;
    }
    send_raw(&mut ws, Message::Close(None)).await;
    eventually("every delivery EXPIRED", || async {
        let s = status_of(app, &cred.token, &sub_id).await;
        (s["expired"] == n).then_some(())
    })
    .await;
    sub_id
}

#[actix_web::test]
async fn a_bulk_retry_rearms_exactly_its_range_once_per_key_and_a_dry_run_writes_nothing() {
    let app = spawn_sweeping_app().await;
    let cred = app.bootstrap().await;
    let sub_id = expired_deliveries(&app, &cred, 5).await;
    let path = format!("/v1/subscriptions/{sub_id}/deliveries:retry");
    let range = json!({
        "reason": "downstream fixed",
        "additional_attempts": 2,
        "from_sequence": "2",
        "to_sequence": "4",
        "limit": 10000,
    });

    let mut dry = range.clone();
    dry["dry_run"] = json!(true);
    let before = fingerprint(&app).await;
    let res = app.post(&path, &cred.token, "dry-1", &dry).await;
    assert_eq!(res.status, 200, "{:#}", res.body);
    assert_conforms("POST", BULK, &res);
    assert_eq!(
        res.data(),
        &json!({"matched": 3, "retried": 0, "first_sequence": "2", "last_sequence": "4",
                "dry_run": true, "deduplicated": false})
    );
    assert_eq!(fingerprint(&app).await, before, "a dry run writes nothing");

    let res = app.post(&path, &cred.token, "bulk-1", &range).await;
    assert_eq!(res.status, 200, "{:#}", res.body);
    assert_conforms("POST", BULK, &res);
    let receipt = json!({"matched": 3, "retried": 3, "first_sequence": "2", "last_sequence": "4",
                         "dry_run": false, "deduplicated": false});
    assert_eq!(res.data(), &receipt);
    let pending: Vec<i64> = app
        .column(&format!(
            "SELECT sequence FROM deliveries WHERE subscription_id = '{sub_id}' \
             AND state = 'PENDING' ORDER BY sequence"
        ))
        .await;
    assert_eq!(pending, [2, 3, 4]);
    let budgets: Vec<i64> = app
        .column(&format!(
            "SELECT CAST(attempt_budget AS BIGINT) FROM deliveries WHERE subscription_id = '{sub_id}' \
             ORDER BY sequence"
        ))
        .await;
    assert_eq!(budgets, [1, 3, 3, 3, 1]);
    let audits = "SELECT COUNT(*) FROM audit_records WHERE action = 'deliveries.bulk_retry'";
    assert_eq!(app.scalar(audits).await, 1, "one audit record");

    // The same key answers the original receipt and changes nothing.
    let before = fingerprint(&app).await;
    let replay = app.post(&path, &cred.token, "bulk-1", &range).await;
    assert_eq!(replay.status, 200, "{:#}", replay.body);
    let mut replayed = receipt.clone();
    replayed["deduplicated"] = json!(true);
    assert_eq!(replay.data(), &replayed);
    assert_eq!(fingerprint(&app).await, before);

    // The retried delivery's history names the operation.
    let id = app
        .column::<String>(&format!(
            "SELECT id FROM deliveries WHERE subscription_id = '{sub_id}' AND sequence = 3"
        ))
        .await
        .remove(0);
    let items = history_of(&app, &cred.token, &sub_id, &id).await;
    let retried = items.iter().find(|s| s["step"] == "RETRIED").unwrap();
    assert_eq!(retried["reason"], "downstream fixed");
    assert_eq!(retried["additional_attempts"], 2);

    // A dry run under a key already used for another request is 409.
    app.post(&path, &cred.token, "bulk-1", &dry)
        .await
        .assert_error(409, "IDEMPOTENCY_CONFLICT");

    // Above 10,000 is refused with the field named; nothing changes.
    let mut big = range.clone();
    big["limit"] = json!(10001);
    let res = app.post(&path, &cred.token, "bulk-2", &big).await;
    res.assert_error(400, "INVALID_ARGUMENT");
    assert!(
        res.body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("limit")
    );
    assert_eq!(fingerprint(&app).await, before);
    app.assert_invariants().await;
}

#[actix_web::test]
async fn a_bulk_retry_with_a_spread_makes_the_deliveries_available_over_it() {
    let app = spawn_sweeping_app().await;
    let cred = app.bootstrap().await;
    let sub_id = expired_deliveries(&app, &cred, 4).await;
    let res = app
        .post(
            &format!("/v1/subscriptions/{sub_id}/deliveries:retry"),
            &cred.token,
            "spread-1",
            &json!({"reason": "slowly", "additional_attempts": 1, "limit": 100, "spread_ms": 60000}),
        )
        .await;
    assert_eq!(res.status, 200, "{:#}", res.body);
    let available: Vec<i64> = app
        .column(&format!(
            "SELECT available_at FROM deliveries WHERE subscription_id = '{sub_id}' ORDER BY sequence"
        ))
        .await;
    let gaps: Vec<i64> = available.windows(2).map(|w| w[1] - w[0]).collect();
    for gap in gaps {
        assert!((14_000_000..=16_000_000).contains(&gap), "{available:?}");
    }
    // A consumer gets the first at once and not the others yet.
    let mut ws = app.bind(&cred.token, &sub_id, 4).await;
    let first = ws.delivery().await;
    assert_eq!(first["body"]["delivery"]["sequence"], "1");
    assert!(
        ws.delivery_within(std::time::Duration::from_millis(500))
            .await
            .is_none()
    );
}

#[actix_web::test]
async fn the_new_endpoints_answer_404_to_another_credential_and_queues_list_only_the_scope() {
    let app = spawn_fast_app().await;
    let cred = app.bootstrap().await;
    let (sub_id, delivery, _ws) = expired_delivery(&app, &cred).await;
    let id = delivery["id"].as_str().unwrap();
    let other = sibling(&app, &cred, "other-app", true, true).await;
    for path in [
        format!("/v1/subscriptions/{sub_id}/status"),
        format!("/v1/subscriptions/{sub_id}/deliveries/{id}/history"),
    ] {
        app.get(&path, &other.token)
            .await
            .assert_error(404, "NOT_FOUND");
    }
    let before = fingerprint(&app).await;
    app.post(
        &format!("/v1/subscriptions/{sub_id}/deliveries:retry"),
        &other.token,
        "x-1",
        &json!({"reason": "not mine", "additional_attempts": 1, "limit": 10}),
    )
    .await
    .assert_error(404, "NOT_FOUND");
    assert_eq!(fingerprint(&app).await, before);

    let res = app.get("/v1/queues", &cred.token).await;
    assert_eq!(res.status, 200, "{:#}", res.body);
    assert_conforms("GET", "/v1/queues", &res);
    let items = res.data()["items"].as_array().unwrap();
    assert_eq!(items.len(), 1);
    assert_eq!(items[0]["id"], json!(cred.queue_id));
    assert_eq!(items[0]["head_sequence"], "1");
    assert_eq!(items[0]["retention_floor"], "0");
    let stranger = app
        .bootstrap_with("elsewhere", "app", "other-queue", true, true)
        .await;
    let res = app.get("/v1/queues", &stranger.token).await;
    let ids: Vec<&Value> = res.data()["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|q| &q["id"])
        .collect();
    assert_eq!(ids, [&json!(stranger.queue_id)]);
}

#[actix_web::test]
async fn metrics_show_each_subscriptions_expired_deliveries_and_oldest_unacked_age() {
    let app = spawn_fast_app().await;
    let cred = app.bootstrap().await;
    let (sub_id, _, _ws) = expired_delivery(&app, &cred).await;
    let labels = [("subscription_id", sub_id.as_str())];
    let m = crate::metrics::scrape(&app).await;
    assert_eq!(
        m.value("orbit_events_subscription_expired", &labels),
        1.0,
        "{}",
        m.text
    );
    assert!(
        m.value(
            "orbit_events_subscription_oldest_unacked_age_seconds",
            &labels
        ) > 0.0
    );
}

#[actix_web::test]
async fn a_connection_reset_while_holding_a_lease_is_recorded_as_1006_not_as_a_malformed_frame() {
    let app = spawn_sweeping_app().await;
    let cred = app.bootstrap().await;
    let sub_id = subscription(&app, &cred).await;
    app.publish(&cred, vec![result(&cred.queue_id, "task.failed")])
        .await;
    let mut ws = app.bind(&cred.token, &sub_id, 1).await;
    let deliver = ws.delivery().await;
    let id = deliver["body"]["delivery"]["id"]
        .as_str()
        .unwrap()
        .to_owned();
    // A reset, not a close.
    crate::pool::reset(ws);
    let closed = eventually("the session's close in the history", || async {
        let items = history_of(&app, &cred.token, &sub_id, &id).await;
        items.into_iter().find(|s| s["step"] == "SESSION_CLOSED")
    })
    .await;
    assert_eq!(closed["close_code"], 1006, "{closed:#}");
}

#[actix_web::test]
async fn status_counts_no_missing_consumer_for_results_of_types_the_subscription_does_not_take() {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let sub = app
        .subscribe(
            &cred,
            json!({ "from_sequence": "0", "types": ["task.cancelled"] }),
        )
        .await;
    let sub_id = sub["id"].as_str().unwrap();
    app.publish(&cred, vec![result(&cred.queue_id, "task.failed")])
        .await;
    let status = status_of(&app, &cred.token, sub_id).await;
    assert_eq!(status["lag"], "1");
    assert_eq!(blocked_codes(&status), Vec::<String>::new(), "{status:#}");
    app.publish(&cred, vec![result(&cred.queue_id, "task.cancelled")])
        .await;
    let status = status_of(&app, &cred.token, sub_id).await;
    assert_eq!(blocked_codes(&status), ["NO_CONSUMER"], "{status:#}");
}

#[actix_web::test]
async fn an_ack_sent_on_another_session_is_told_apart_from_the_lease_it_proves() {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let sub_id = subscription(&app, &cred).await;
    app.publish(&cred, vec![result(&cred.queue_id, "task.failed")])
        .await;
    let mut a = app.bind(&cred.token, &sub_id, 1).await;
    let deliver = a.delivery().await;
    let mut b = app.bind(&cred.token, &sub_id, 1).await;
    assert_eq!(b.ack(&deliver).await["type"], "ack");
    let id = deliver["body"]["delivery"]["id"].as_str().unwrap();
    let items = history_of(&app, &cred.token, &sub_id, id).await;
    assert_eq!(items[1]["step"], "LEASED");
    assert_eq!(items[1]["session_id"], json!(a.session_id.clone().unwrap()));
    assert_eq!(items[2]["step"], "ACKED");
    assert_eq!(items[2]["session_id"], json!(b.session_id.clone().unwrap()));
    let view = delivery_state(&app, &cred.token, &sub_id, id).await;
    assert_eq!(view["ack_session_id"], json!(b.session_id.clone().unwrap()));
}
