//! protocol.md §3: the session lifecycle — hello, welcome, pause, ping
//! re-validation, the read-idle timer and the read queue.

use std::time::{Duration, Instant};

use orbit_events::{domain::CredentialId, store::tenancy};
use serde_json::json;
use tokio_tungstenite::tungstenite::{Message, protocol::frame::coding::CloseCode};

use crate::{helpers::*, protocol_support::*};

#[actix_web::test]
async fn no_hello_within_the_hello_deadline_closes_the_connection_with_1008() {
    let app = spawn_app_with(|s| s.timing.hello_timeout_ms = 300).await;
    let cred = app.bootstrap().await;
    let started = Instant::now();
    let mut ws = app.connect(&cred.token).await;
    expect_close_only(&mut ws, CloseCode::Policy).await;
    assert!(started.elapsed() >= Duration::from_millis(300));
    assert_eq!(app.scalar("SELECT COUNT(*) FROM event_sessions").await, 0);
}

#[actix_web::test]
async fn a_hello_for_a_subscription_that_is_not_this_credentials_gets_not_found_and_closes_with_1008()
 {
    let app = spawn_app().await;
    let owner = app.bootstrap().await;
    let sub = subscription(&app, &owner).await;
    // Same namespace and application, another credential.
    let other = app
        .bootstrap_with("demo", "app", "another-queue", true, true)
        .await;
    for (cred, subscription_id) in [(&other, sub.clone()), (&owner, mid())] {
        let mut ws = app.connect(&cred.token).await;
        let hello = ws.envelope(
            "events.hello",
            json!({"subscription_id": subscription_id, "capacity": 1}),
        );
        let id = hello["message_id"].clone();
        ws.send_json(hello).await;
        let err = expect_error_then_close(&mut ws, "NOT_FOUND", Some(&id), CloseCode::Policy).await;
        assert!(err.get("session_id").is_none(), "not bound: {err:#}");
    }
    assert_eq!(app.scalar("SELECT COUNT(*) FROM event_sessions").await, 0);
}

#[actix_web::test]
async fn a_hello_for_a_subscription_whose_queue_left_the_scope_gets_not_found_and_closes_with_1008()
{
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let sub = subscription(&app, &cred).await;
    update_credential(&app, &cred, "queue_scope = '[]'").await;
    let mut ws = app.connect(&cred.token).await;
    let hello = ws.envelope(
        "events.hello",
        json!({"subscription_id": sub, "capacity": 1}),
    );
    let id = hello["message_id"].clone();
    ws.send_json(hello).await;
    expect_error_then_close(&mut ws, "NOT_FOUND", Some(&id), CloseCode::Policy).await;
}

#[actix_web::test]
async fn hello_records_the_session_with_its_capacity_and_every_connection_gets_a_fresh_session_id()
{
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let sub = subscription(&app, &cred).await;
    let a = app.bind(&cred.token, &sub, 3).await;
    let b = app.bind(&cred.token, &sub, 32).await;
    let (sa, sb) = (a.session_id.clone().unwrap(), b.session_id.clone().unwrap());
    assert_ne!(sa, sb);
    for (session, capacity) in [(&sa, 3), (&sb, 32)] {
        let row = app
            .scalar(&format!(
                "SELECT CAST(capacity AS BIGINT) FROM event_sessions WHERE id = '{session}' \
                 AND subscription_id = '{sub}' AND credential_id = '{}' AND closed_at IS NULL",
                cred.credential_id
            ))
            .await;
        assert_eq!(row, capacity);
    }
    // A closed connection's session is marked closed; nothing is resumed.
    drop(a);
    let app_ref = &app;
    let sa_ref = sa.as_str();
    wait_until("the closed session is recorded", || async move {
        app_ref
            .scalar(&format!(
                "SELECT COUNT(*) FROM event_sessions WHERE id = '{sa_ref}' AND closed_at IS NOT NULL"
            ))
            .await
            == 1
    })
    .await;
    let again = app.bind(&cred.token, &sub, 3).await;
    assert_ne!(again.session_id.as_deref(), Some(sa.as_str()));
}

#[actix_web::test]
async fn the_welcome_carries_the_session_the_capacity_and_the_configured_lease_and_heartbeat() {
    let app = spawn_app_with(|s| {
        s.timing.lease_ms = 1234;
        s.timing.heartbeat_interval_ms = 4321;
    })
    .await;
    let cred = app.bootstrap().await;
    let sub = subscription(&app, &cred).await;
    let mut ws = app.connect(&cred.token).await;
    let welcome = ws.hello(&sub, 5).await;
    let body = &welcome["body"];
    assert_eq!(welcome["type"], "events.welcome");
    assert_eq!(body["session_id"], welcome["session_id"]);
    assert_eq!(body["subscription_id"], sub.as_str());
    assert_eq!(body["capacity"], 5);
    assert_eq!(body["lease_duration_ms"], 1234);
    assert_eq!(body["heartbeat_interval_ms"], 4321);
    assert_eq!(body["enabled"], true);
    let server_time =
        chrono::DateTime::parse_from_rfc3339(body["server_time"].as_str().unwrap()).unwrap();
    let skew = (chrono::Utc::now() - server_time.with_timezone(&chrono::Utc)).abs();
    assert!(skew < chrono::Duration::seconds(60), "server_time is now");
}

#[actix_web::test]
async fn the_defaults_advertise_a_30_s_lease_and_a_15_s_heartbeat() {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let sub = subscription(&app, &cred).await;
    let mut ws = app.connect(&cred.token).await;
    let welcome = ws.hello(&sub, 1).await;
    assert_eq!(welcome["body"]["lease_duration_ms"], 30000);
    assert_eq!(welcome["body"]["heartbeat_interval_ms"], 15000);
}

#[actix_web::test]
async fn a_paused_subscription_connects_pings_and_acks_but_gets_no_new_deliveries_until_resumed() {
    let (app, cred, sub, mut first) = bound_session(|s| s.timing.scan_interval_ms = 100, 4).await;
    publish_one(&app, &cred, "task.succeeded").await;
    let d1 = first.delivery().await;

    set_enabled(&app, &sub, false).await;
    let mut ws = app.connect(&cred.token).await;
    let welcome = ws.hello(&sub, 4).await;
    assert_eq!(welcome["body"]["enabled"], false);
    assert_eq!(ping_expect_ack(&mut ws).await["body"]["enabled"], false);
    let e2 = publish_one(&app, &cred, "task.failed").await;
    // The ACK of a delivery leased before the pause still works, from the
    // new connection with the old proof.
    let ok = ws.ack(&d1).await;
    assert_eq!(ok["type"], "ack", "{ok:#}");
    assert_eq!(ok["body"]["deduplicated"], false);
    // Several scan intervals pass without a new delivery on either connection.
    assert!(
        ws.delivery_within(Duration::from_millis(600))
            .await
            .is_none()
    );
    assert!(
        first
            .delivery_within(Duration::from_millis(1))
            .await
            .is_none()
    );
    assert_eq!(
        app.scalar(&format!(
            "SELECT COUNT(*) FROM deliveries WHERE subscription_id = '{sub}' AND state <> 'ACKED'"
        ))
        .await,
        0,
        "nothing is materialized while paused"
    );

    set_enabled(&app, &sub, true).await;
    let (d, on) = tokio::select! {
        d = ws.delivery() => (d, "new"),
        d = first.delivery() => (d, "first"),
    };
    assert_eq!(d["body"]["event"]["id"], e2.as_str(), "delivered on {on}");
    assert_eq!(ping_expect_ack(&mut ws).await["body"]["enabled"], true);
    app.assert_invariants().await;
}

/// A bound session whose first claim has settled, on a node whose timer
/// makes no further claim: the next ping is the first to notice a change
/// (a claim would report it without `reply_to`; see the test below).
async fn quiet_session() -> (TestApp, Cred, WsClient) {
    let (app, cred, _, mut ws) = bound_session(|s| s.timing.scan_interval_ms = 60_000, 1).await;
    claims_settled(&app, 1).await;
    ping_expect_ack(&mut ws).await;
    (app, cred, ws)
}

/// Sends a ping; expects an error `code` answering it, then close 1008.
async fn ping_is_refused(ws: &mut WsClient, code: &str) {
    let ping = ws.envelope("events.ping", json!({}));
    let id = ping["message_id"].clone();
    ws.send_json(ping).await;
    let err = expect_error_then_close(ws, code, Some(&id), CloseCode::Policy).await;
    assert_eq!(err["session_id"], ws.session_id.as_deref().unwrap());
}

#[actix_web::test]
async fn a_ping_after_the_credential_was_revoked_gets_unauthenticated_and_closes_with_1008() {
    let (app, cred, mut ws) = quiet_session().await;
    tenancy::revoke_credential(&app.db, &CredentialId::parse(&cred.credential_id).unwrap())
        .await
        .unwrap();
    ping_is_refused(&mut ws, "UNAUTHENTICATED").await;
}

#[actix_web::test]
async fn a_ping_after_events_consume_was_withdrawn_gets_permission_denied_and_closes_with_1008() {
    let (app, cred, mut ws) = quiet_session().await;
    let set = r#"permissions = '["events:read","events:manage"]'"#;
    update_credential(&app, &cred, set).await;
    ping_is_refused(&mut ws, "PERMISSION_DENIED").await;
}

#[actix_web::test]
async fn a_ping_after_the_queue_left_the_scope_gets_not_found_and_closes_with_1008() {
    let (app, cred, mut ws) = quiet_session().await;
    update_credential(&app, &cred, "queue_scope = '[]'").await;
    ping_is_refused(&mut ws, "NOT_FOUND").await;
}

async fn update_credential(app: &TestApp, cred: &Cred, set: &str) {
    let sql = format!(
        "UPDATE credentials SET {set} WHERE id = '{}'",
        cred.credential_id
    );
    execute(app, &sql).await;
}

#[actix_web::test]
async fn a_revoked_credential_found_by_a_claim_is_reported_without_reply_to_and_closes_with_1008() {
    let (app, cred, _, mut ws) = bound_session(|_| {}, 1).await;
    tenancy::revoke_credential(&app.db, &CredentialId::parse(&cred.credential_id).unwrap())
        .await
        .unwrap();
    // Another credential of the same queue publishes; the claim notices.
    let publisher = app
        .bootstrap_with("demo", "app", &queue_name(&app, &cred).await, false, true)
        .await;
    assert_eq!(publisher.queue_id, cred.queue_id);
    publish_one(&app, &publisher, "task.succeeded").await;
    expect_error_then_close(&mut ws, "UNAUTHENTICATED", None, CloseCode::Policy).await;
    app.assert_invariants().await;
}

#[actix_web::test]
async fn an_ack_after_the_credential_was_revoked_gets_unauthenticated_is_not_applied_and_closes_with_1008()
 {
    let (app, cred, sub, mut ws) = bound_session(|_| {}, 1).await;
    publish_one(&app, &cred, "task.succeeded").await;
    let deliver = ws.delivery().await;
    tenancy::revoke_credential(&app.db, &CredentialId::parse(&cred.credential_id).unwrap())
        .await
        .unwrap();
    let ack = ws.envelope("event.ack", proof(&deliver));
    let id = ack["message_id"].clone();
    ws.send_json(ack).await;
    let err =
        expect_error_then_close(&mut ws, "UNAUTHENTICATED", Some(&id), CloseCode::Policy).await;
    assert_eq!(err["session_id"], ws.session_id.as_deref().unwrap());
    let delivery_id = deliver["body"]["delivery"]["id"].as_str().unwrap();
    let state: Vec<String> = app
        .column(&format!(
            "SELECT state FROM deliveries WHERE id = '{delivery_id}' AND subscription_id = '{sub}'"
        ))
        .await;
    assert_eq!(
        state,
        ["LEASED"],
        "the revoked credential's ACK was applied"
    );
    app.assert_invariants().await;
}

#[actix_web::test]
async fn a_hello_after_the_credential_was_revoked_since_the_upgrade_gets_unauthenticated_and_closes_with_1008()
 {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let sub = subscription(&app, &cred).await;
    let mut ws = app.connect(&cred.token).await;
    tenancy::revoke_credential(&app.db, &CredentialId::parse(&cred.credential_id).unwrap())
        .await
        .unwrap();
    let hello = ws.envelope(
        "events.hello",
        json!({ "subscription_id": sub, "capacity": 1 }),
    );
    let id = hello["message_id"].clone();
    ws.send_json(hello).await;
    expect_error_then_close(&mut ws, "UNAUTHENTICATED", Some(&id), CloseCode::Policy).await;
    assert_eq!(app.scalar("SELECT COUNT(*) FROM event_sessions").await, 0);
}

async fn queue_name(app: &TestApp, cred: &Cred) -> String {
    use sea_orm::{ConnectionTrait, Statement};
    let backend = app.db.reader().get_database_backend();
    let row = app
        .db
        .reader()
        .query_one_raw(Statement::from_string(
            backend,
            format!("SELECT name FROM queues WHERE id = '{}'", cred.queue_id),
        ))
        .await
        .unwrap()
        .unwrap();
    row.try_get_by_index::<String>(0).unwrap()
}

#[actix_web::test]
async fn no_valid_frame_within_the_read_idle_timeout_closes_with_1001_and_websocket_pings_do_not_count()
 {
    let app = spawn_app_with(|s| s.timing.read_idle_timeout_ms = 1_000).await;
    let cred = app.bootstrap().await;
    let sub = subscription(&app, &cred).await;
    let started = Instant::now();
    let mut idle = app.bind(&cred.token, &sub, 1).await;
    let mut alive = app.bind(&cred.token, &sub, 1).await;
    // `idle` sends only WebSocket-level pings; `alive` sends events.ping.
    let code = loop {
        assert!(started.elapsed() < DEADLINE, "idle connection never closed");
        send_raw(&mut idle, Message::Ping(vec![1, 2, 3].into())).await;
        if let Some(Received::Closed(c)) = idle.recv_within(Duration::from_millis(100)).await {
            break c.map(|c| c.code);
        }
        ping_expect_ack(&mut alive).await;
    };
    assert_eq!(code, Some(CloseCode::Away));
    assert!(started.elapsed() >= Duration::from_millis(1_000));
    // `alive` outlives the idle timeout several times over.
    while started.elapsed() < Duration::from_millis(3_000) {
        ping_expect_ack(&mut alive).await;
        assert!(
            alive
                .recv_within(Duration::from_millis(100))
                .await
                .is_none()
        );
    }
}

/// protocol.md §3: an ACK leaves the read queue once it has joined the
/// group commit; ACKs waiting for their commit are bounded by the
/// capacity; past that an ACK holds its read permit, and once four frames
/// are held further frames wait unread, never dropped.
#[actix_web::test]
async fn acks_waiting_for_their_commit_leave_the_read_queue_up_to_the_capacity_and_further_frames_wait_unread_but_are_never_dropped()
 {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let sub = subscription(&app, &cred).await;
    publish_n(&app, &cred, 6, "task.succeeded").await;
    let mut ws = app.bind(&cred.token, &sub, 6).await;
    let mut deliveries = Vec::new();
    for _ in 0..6 {
        deliveries.push(ws.delivery().await);
    }

    let block = block_writes(&app, &sub).await;
    let mut sent = Vec::new();
    let mut send_ack = |ws: &mut WsClient, d: &serde_json::Value| {
        let f = ws.envelope("event.ack", proof(d));
        sent.push(f["message_id"].clone());
        f
    };
    // Six ACKs wait on the database, more than the read queue holds: a
    // ping is still read and answered.
    for d in &deliveries {
        let f = send_ack(&mut ws, d);
        ws.send_json(f).await;
    }
    ping_expect_ack(&mut ws).await;
    // The capacity (6) is taken: four more ACKs (the first one again) each
    // wait for a place holding a read permit, and the next ping stays unread.
    for _ in 0..4 {
        let f = send_ack(&mut ws, &deliveries[0]);
        ws.send_json(f).await;
    }
    let ping = ws.envelope("events.ping", json!({}));
    let ping_id = ping["message_id"].clone();
    ws.send_json(ping).await;
    assert!(
        ws.recv_within(Duration::from_millis(700)).await.is_none(),
        "a frame was read while four ACKs waited for a place among the capacity"
    );

    block.release().await;
    let mut replies = std::collections::HashMap::new();
    while replies.len() < 11 {
        let f = ws.frame().await;
        replies.insert(f["reply_to"].as_str().unwrap().to_owned(), f);
    }
    for (n, id) in sent.iter().enumerate() {
        let reply = &replies[id.as_str().unwrap()];
        assert_eq!(reply["type"], "ack", "{reply:#}");
        assert_eq!(reply["body"]["deduplicated"], n >= 6, "{reply:#}");
    }
    assert_eq!(replies[ping_id.as_str().unwrap()]["type"], "ack");
    app.assert_invariants().await;
}

#[actix_web::test]
async fn the_lease_is_committed_before_event_deliver_is_written() {
    let (app, cred, _, mut ws) = bound_session(|_| {}, 8).await;
    publish_n(&app, &cred, 8, "task.needs_review").await;
    let session = ws.session_id.clone().unwrap();
    for _ in 0..8 {
        let d = ws.delivery().await;
        let delivery = &d["body"]["delivery"];
        // Read the moment the frame arrived: the lease is already there.
        let committed = app
            .scalar(&format!(
                "SELECT COUNT(*) FROM deliveries WHERE id = '{}' AND state = 'LEASED' \
                 AND lease_epoch = {} AND revision = {} AND lease_session_id = '{session}'",
                delivery["id"].as_str().unwrap(),
                delivery["lease_epoch"].as_str().unwrap(),
                delivery["revision"].as_str().unwrap(),
            ))
            .await;
        assert_eq!(committed, 1, "{d:#}");
    }
    app.assert_invariants().await;
}

#[actix_web::test]
async fn a_connection_asks_for_no_more_deliveries_than_its_write_queue_has_room_for() {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let sub = subscription(&app, &cred).await;
    publish_n(&app, &cred, 32, "task.succeeded").await;
    // Capacity 32 and 32 available deliveries, but a write queue of 8:
    // every claim for this connection leases at most 8 (one claim = one
    // transaction = one lease_until).
    let mut ws = app.bind(&cred.token, &sub, 32).await;
    let mut per_claim: std::collections::BTreeMap<String, usize> = Default::default();
    for _ in 0..32 {
        let d = ws.delivery().await;
        *per_claim
            .entry(
                d["body"]["delivery"]["lease_until"]
                    .as_str()
                    .unwrap()
                    .to_owned(),
            )
            .or_default() += 1;
    }
    assert!(
        per_claim.values().all(|n| *n <= 8),
        "a claim leased more than the write queue holds: {per_claim:?}"
    );
    assert!(per_claim.len() >= 4, "{per_claim:?}");
    app.assert_invariants().await;
}
