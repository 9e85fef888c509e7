//! The client crate's consumer against a real node (protocol.md §3–5):
//! hello, ACK, heartbeats, reconnection, unconfirmed proofs sent again,
//! `DELIVERY_LEASE_LOST` and `EVENT_HISTORY_EXPIRED` as typed outcomes,
//! bounded shutdown; and its frames against docs/events.schema.json.

use std::time::{Duration, Instant};

use orbit_events_client::{
    ConsumerError, ErrorCode, Outcome,
    frames::{self, AckProof, DeliverBody, ServerFrame},
};
use serde::Serialize;
use serde_json::{Value, json};

use crate::{
    helpers::*,
    protocol_support::{block_writes, database_outage, execute, publish_n},
    sdk_support::*,
};

/// All deliveries of a subscription are ACKED.
async fn all_acked(app: &TestApp, sub: &str, n: i64) {
    crate::protocol_support::wait_until("every delivery is ACKED", || async {
        app.scalar(&format!(
            "SELECT COUNT(*) FROM deliveries WHERE subscription_id = '{sub}' AND state = 'ACKED'"
        ))
        .await
            == n
    })
    .await;
}

#[actix_web::test]
async fn a_consumer_acks_every_delivery_its_handler_stored_and_reports_each_ack() {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let sub = subscription_from_start(&app, &cred, json!({})).await;
    publish_n(&app, &cred, 20, "task.succeeded").await;
    let recorder = Recorder::default();
    let running = Running::start(consumer(&app.address, &cred, &sub, 4), recorder.clone());
    recorder
        .until("20 ACKs confirmed", |r| r.acked().len() == 20)
        .await;
    all_acked(&app, &sub, 20).await;
    let stopped = running.stop().await.unwrap();
    assert!(stopped.unconfirmed.is_empty());

    recorder.check(|seen| {
        assert_eq!(seen.connections(), 1);
        assert_eq!(seen.deliveries.len(), 20);
        for (d, ack) in seen.deliveries.iter().zip(seen.acked()) {
            assert_eq!(d.delivery.subscription_id, sub);
            assert_eq!(d.event.id, d.delivery.event_id);
            assert!(!ack.deduplicated);
        }
        let mut sequences: Vec<u64> = seen.deliveries.iter().map(|d| d.event.sequence).collect();
        sequences.sort();
        assert_eq!(sequences, (1..=20).collect::<Vec<_>>());
    });
    app.assert_invariants().await;
}

/// `body` as the SDK re-serializes it equals the frame's `body`.
#[track_caller]
fn same_body(frame: &Value, body: &impl Serialize) {
    assert_eq!(
        &serde_json::to_value(body).unwrap(),
        &frame["body"],
        "{} differs from the SDK's type",
        frame["type"]
    );
}

#[actix_web::test]
async fn the_frames_the_sdk_sends_and_reads_match_docs_events_schema_json_field_for_field() {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let sub = subscription_from_start(&app, &cred, json!({})).await;
    app.publish(
        &cred,
        vec![{
            let mut r = result(&cred.queue_id, "task.failed");
            r["snapshot"]["result"] = json!({ "big": 1.5e300, "list": [1, "two"] });
            r["snapshot"]["current_attempt_id"] = json!(orbit_events::domain::random_hex_id());
            r
        }],
    )
    .await;

    // What the SDK sends passes `clientFrame`; the server answers each.
    let mut ws = app.connect(&cred.token).await;
    let hello = frames::hello(&sub, 2);
    ws.send_text(&hello.text).await;
    let welcome = ws.frame().await;
    let session = welcome["session_id"].as_str().unwrap().to_owned();
    ws.session_id = Some(session.clone());
    match ServerFrame::parse(&welcome.to_string()).unwrap() {
        ServerFrame::Welcome { reply_to, body } => {
            assert_eq!(reply_to, hello.message_id);
            same_body(&welcome, &body);
        }
        other => panic!("{other:?}"),
    }

    let deliver = ws.delivery().await;
    let text = deliver.to_string();
    let ServerFrame::Deliver(body) = ServerFrame::parse(&text).unwrap() else {
        panic!("not a delivery: {deliver:#}");
    };
    let body: DeliverBody = *body;
    same_body(&deliver, &body);
    let delivery = orbit_events_client::Delivery::from_body(body).unwrap();
    assert_eq!(
        serde_json::from_str::<Value>(delivery.event_json()).unwrap(),
        deliver["body"]["event"]
    );
    same_body(
        &json!({ "type": "event", "body": deliver["body"]["event"] }),
        &delivery.event,
    );

    let ack = frames::ack(&session, delivery.proof());
    ws.send_text(&ack.text).await;
    let reply = ws.frame().await;
    match ServerFrame::parse(&reply.to_string()).unwrap() {
        ServerFrame::Ack { reply_to, body } => {
            assert_eq!(reply_to, ack.message_id);
            same_body(&reply, &body);
        }
        other => panic!("{other:?}"),
    }

    let ping = frames::ping(&session);
    ws.send_text(&ping.text).await;
    let pong = ws.frame().await;
    match ServerFrame::parse(&pong.to_string()).unwrap() {
        ServerFrame::Pong { reply_to, body } => {
            assert_eq!(reply_to, ping.message_id);
            same_body(&pong, &body);
        }
        other => panic!("{other:?}"),
    }

    // An error frame: the same proof with another epoch.
    let wrong = AckProof {
        epoch: 9,
        ..delivery.proof().clone()
    };
    let lost = frames::ack(&session, &wrong);
    ws.send_text(&lost.text).await;
    let error = ws.frame().await;
    match ServerFrame::parse(&error.to_string()).unwrap() {
        ServerFrame::Error { reply_to, error: e } => {
            assert_eq!(reply_to.as_deref(), Some(lost.message_id.as_str()));
            assert_eq!(e.code, ErrorCode::DeliveryLeaseLost);
            assert_eq!(serde_json::to_value(&e).unwrap(), error["error"]);
        }
        other => panic!("{other:?}"),
    }
    app.assert_invariants().await;
}

#[actix_web::test]
async fn delivery_lease_lost_is_an_outcome_and_the_next_delivery_of_the_event_is_acked_with_its_new_proof()
 {
    // Lease 2 must be ACKed within its lease once released: 300 ms was
    // once too short on a loaded CI machine (epochs 1 to 5).
    let app = spawn_app_with(|s| {
        s.timing.lease_ms = 1_000;
        s.timing.scan_interval_ms = 50;
    })
    .await;
    let cred = app.bootstrap().await;
    let sub = subscription_from_start(&app, &cred, json!({})).await;
    publish_n(&app, &cred, 1, "task.cancelled").await;
    // The first call holds its delivery past the lease; the redelivery
    // (epoch 2) comes to the same connection meanwhile.
    let handler = Gated::new(1);
    let running = Running::start(consumer(&app.address, &cred, &sub, 2), handler.clone());
    handler
        .recorder
        .until("the redelivery", |r| r.deliveries.len() == 2)
        .await;
    handler.release();
    handler
        .recorder
        .until("the lease lost and the new proof ACKed", |r| {
            r.acked().len() == 1
                && r.outcomes
                    .iter()
                    .any(|o| matches!(o, Outcome::LeaseLost { .. }))
        })
        .await;
    running.stop().await.unwrap();

    let delivery_id = handler.recorder.check(|seen| {
        let epochs: Vec<u64> = seen
            .deliveries
            .iter()
            .map(|d| d.delivery.lease_epoch)
            .collect();
        assert_eq!(epochs, [1, 2]);
        assert_eq!(seen.deliveries[0].event.id, seen.deliveries[1].event.id);
        let lost: Vec<(String, u64)> = seen
            .outcomes
            .iter()
            .filter_map(|o| match o {
                Outcome::LeaseLost {
                    delivery_id, epoch, ..
                } => Some((delivery_id.clone(), *epoch)),
                _ => None,
            })
            .collect();
        let delivery_id = seen.deliveries[0].delivery.id.clone();
        assert_eq!(lost, [(delivery_id.clone(), 1)]);
        assert_eq!(seen.acked()[0].epoch, 2);
        delivery_id
    });
    assert_eq!(
        delivery_state(&app, &delivery_id).await,
        ("ACKED".to_owned(), 2)
    );
    app.assert_invariants().await;
}

#[actix_web::test]
async fn event_history_expired_ends_the_run_with_the_earliest_available_sequence() {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let sub = subscription_from_start(&app, &cred, json!({})).await;
    publish_n(&app, &cred, 3, "task.succeeded").await;
    let q = &cred.queue_id;
    execute(
        &app,
        &format!("DELETE FROM result_events WHERE queue_id = '{q}' AND sequence <= 2"),
    )
    .await;
    execute(
        &app,
        &format!("UPDATE queues SET retention_floor = 2 WHERE id = '{q}'"),
    )
    .await;
    let recorder = Recorder::default();
    let run = Running::start(consumer(&app.address, &cred, &sub, 1), recorder.clone());
    match run.ended().await {
        Err(ConsumerError::HistoryExpired {
            earliest_sequence,
            error,
            stopped,
        }) => {
            assert_eq!(earliest_sequence, Some(3));
            assert_eq!(error.code, ErrorCode::EventHistoryExpired);
            assert!(stopped.unconfirmed.is_empty());
        }
        other => panic!("expected HistoryExpired, got {other:?}"),
    }
    assert!(recorder.check(|r| r.deliveries.is_empty()));
}

#[actix_web::test]
async fn a_consumer_the_service_refuses_stops_with_the_services_code_instead_of_retrying() {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let unknown = orbit_events::domain::random_hex_id();
    let refused = |run: Result<_, ConsumerError>| match run {
        Err(ConsumerError::Refused { error, .. }) => (error.status, error.code),
        other => panic!("expected a refusal, got {other:?}"),
    };
    let run = Running::start(
        consumer(&app.address, &cred, &unknown, 1),
        Recorder::default(),
    );
    assert_eq!(refused(run.ended().await), (None, ErrorCode::NotFound));

    let publisher = crate::http_support::sibling(&app, &cred, "publisher", false, true).await;
    let sub = subscription_from_start(&app, &cred, json!({})).await;
    let run = Running::start(
        consumer(&app.address, &publisher, &sub, 1),
        Recorder::default(),
    );
    assert_eq!(
        refused(run.ended().await),
        (Some(403), ErrorCode::PermissionDenied)
    );

    let mut stranger = cred.clone();
    stranger.token = "oe_unknown".to_owned();
    let run = Running::start(
        consumer(&app.address, &stranger, &sub, 1),
        Recorder::default(),
    );
    assert_eq!(
        refused(run.ended().await),
        (Some(401), ErrorCode::Unauthenticated)
    );
}

#[actix_web::test]
async fn after_unavailable_the_consumer_reconnects_and_sends_the_unconfirmed_ack_proof_again_on_the_new_connection()
 {
    // The default 30 s lease: the delivery cannot come again within the
    // test, so only the proof sent again can ACK it.
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let sub = subscription_from_start(&app, &cred, json!({})).await;
    publish_n(&app, &cred, 1, "task.succeeded").await;
    let handler = Gated::new(1);
    let running = Running::start(consumer(&app.address, &cred, &sub, 1), handler.clone());
    handler
        .recorder
        .until("the delivery", |r| r.deliveries.len() == 1)
        .await;

    // The database fails while the handler finishes: its ACK gets
    // UNAVAILABLE (or a claim does) and the connection closes with 1011.
    let outage = database_outage(&app).await;
    handler.release();
    handler
        .recorder
        .until("a disconnect", |r| !r.disconnects().is_empty())
        .await;
    outage.end().await;
    handler
        .recorder
        .until("the ACK confirmed", |r| r.acked().len() == 1)
        .await;
    running.stop().await.unwrap();

    let id = handler.recorder.check(|seen| {
        assert_eq!(seen.deliveries.len(), 1, "never delivered again");
        let sessions: Vec<String> = seen
            .outcomes
            .iter()
            .filter_map(|o| match o {
                Outcome::Connected(w) => Some(w.session_id.clone()),
                _ => None,
            })
            .collect();
        assert!(sessions.len() >= 2, "{:?}", seen.outcomes);
        let ack = seen.acked()[0].clone();
        assert_eq!(ack.epoch, 1);
        seen.deliveries[0].delivery.id.clone()
    });
    assert_eq!(delivery_state(&app, &id).await, ("ACKED".to_owned(), 1));
    app.assert_invariants().await;
}

#[actix_web::test]
async fn the_consumer_pings_at_the_advertised_interval_so_an_idle_connection_outlives_the_read_idle_timeout()
 {
    let app = spawn_app_with(|s| {
        s.timing.heartbeat_interval_ms = 100;
        s.timing.read_idle_timeout_ms = 500;
    })
    .await;
    let cred = app.bootstrap().await;
    let sub = subscription_from_start(&app, &cred, json!({})).await;
    let recorder = Recorder::default();
    let running = Running::start(consumer(&app.address, &cred, &sub, 1), recorder.clone());
    recorder.until("connected", |r| r.connections() == 1).await;
    // Five read-idle timeouts without a delivery or an ACK: only the pings
    // keep the session.
    let idle_until = Instant::now() + Duration::from_millis(2_500);
    while Instant::now() < idle_until {
        assert!(
            recorder.check(|r| r.disconnects().is_empty()),
            "the idle connection was closed"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    publish_n(&app, &cred, 1, "task.succeeded").await;
    recorder.until("the ACK", |r| r.acked().len() == 1).await;
    running.stop().await.unwrap();
    let seen = recorder.seen.lock().unwrap();
    assert_eq!(seen.connections(), 1, "{:?}", seen.outcomes);
    assert!(seen.disconnects().is_empty(), "{:?}", seen.disconnects());
}

#[actix_web::test]
async fn on_shutdown_the_running_handler_finishes_its_ack_is_confirmed_and_the_run_ends_in_bounded_time()
 {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let sub = subscription_from_start(&app, &cred, json!({})).await;
    publish_n(&app, &cred, 1, "task.failed").await;
    let handler = Gated::new(1);
    let running = Running::start(consumer(&app.address, &cred, &sub, 1), handler.clone());
    handler
        .recorder
        .until("the delivery", |r| r.deliveries.len() == 1)
        .await;
    // Stop while the handler is still storing; the run waits for it.
    let stopping = tokio::spawn(running.stop());
    // A while later the run still waits for the handler.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!stopping.is_finished(), "the run ended before its handler");
    let released = Instant::now();
    handler.release();
    let stopped = stopping.await.unwrap().unwrap();
    let took = released.elapsed();
    assert!(stopped.unconfirmed.is_empty());
    assert!(took < Duration::from_secs(5), "took {took:?}");
    assert_eq!(handler.recorder.check(|r| r.acked().len()), 1);
    all_acked(&app, &sub, 1).await;
    app.assert_invariants().await;
}

#[actix_web::test]
async fn an_ack_unanswered_at_shutdown_is_returned_unconfirmed_and_the_next_run_sends_it_again() {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let sub = subscription_from_start(&app, &cred, json!({})).await;
    publish_n(&app, &cred, 1, "task.succeeded").await;
    let handler = Gated::new(1);
    let first = consumer(&app.address, &cred, &sub, 1).shutdown_grace(Duration::from_millis(300));
    let running = Running::start(first, handler.clone());
    handler
        .recorder
        .until("the delivery", |r| r.deliveries.len() == 1)
        .await;
    // The ACK cannot commit: its reply does not come within the grace.
    let block = block_writes(&app, &sub).await;
    handler.release();
    let stopped = running.stop().await.unwrap();
    block.release().await;
    let delivered = handler.recorder.check(|r| r.deliveries[0].clone());
    assert_eq!(stopped.unconfirmed, [delivered.proof().clone()]);

    // The next run sends the kept proof first.
    let recorder = Recorder::default();
    let second = consumer(&app.address, &cred, &sub, 1).resend_proofs(stopped.unconfirmed);
    let running = Running::start(second, recorder.clone());
    recorder.until("the ACK", |r| r.acked().len() == 1).await;
    let stopped = running.stop().await.unwrap();
    assert!(stopped.unconfirmed.is_empty());
    recorder.check(|seen| {
        assert!(seen.deliveries.is_empty(), "never delivered again");
        assert_eq!(seen.acked()[0].delivery_id, delivered.delivery.id);
        assert_eq!(seen.acked()[0].epoch, 1);
    });
    all_acked(&app, &sub, 1).await;
    app.assert_invariants().await;
}

#[actix_web::test]
async fn a_consumer_reconnects_to_a_node_killed_and_restarted_and_gets_what_was_published_meanwhile()
 {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let sub = subscription_from_start(&app, &cred, json!({})).await;
    let log = tempfile::NamedTempFile::new().unwrap();
    let mut node = ServerProcess::start(&app.settings.database.url, &[], log.path()).await;
    let recorder = Recorder::default();
    let running = Running::start(consumer(&node.address(), &cred, &sub, 2), recorder.clone());
    recorder.until("connected", |r| r.connections() == 1).await;

    node.kill();
    recorder
        .until("the disconnect", |r| !r.disconnects().is_empty())
        .await;
    publish_n(&app, &cred, 3, "task.needs_review").await;
    node.restart().await;
    recorder
        .until("three ACKs after the restart", |r| r.acked().len() == 3)
        .await;
    running.stop().await.unwrap();
    assert_eq!(recorder.check(|r| r.connections()), 2);
    all_acked(&app, &sub, 3).await;
    app.assert_invariants().await;
}
