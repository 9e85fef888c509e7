//! The sweeper: background lease recovery (delivery-model.md §6) and
//! retention (§8), observed over HTTP, WebSocket and the database.

use std::time::{Duration, Instant};

use orbit_events::delivery::sweeper::{SweepError, SweepNow, SweepReport};
use serde_json::{Value, json};
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;

use crate::{helpers::*, metrics::scrape, protocol_support::*};

/// Runs one sweep now (after one already running); returns its report.
pub(crate) async fn sweep(app: &TestApp) -> SweepReport {
    let deadline = Instant::now() + DEADLINE;
    loop {
        match app.state.sweeper.send(SweepNow).await.unwrap() {
            Ok(report) => return report,
            Err(SweepError::Running) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => panic!("sweep failed: {e}"),
        }
    }
}

/// Sweeps until `done(report)`; retention ages are whole seconds, so this
/// waits for entries to age past them.
async fn sweep_until(
    app: &TestApp,
    what: &str,
    done: impl Fn(&SweepReport) -> bool,
) -> SweepReport {
    let deadline = Instant::now() + DEADLINE;
    loop {
        let report = sweep(app).await;
        if done(&report) {
            return report;
        }
        assert!(Instant::now() < deadline, "timed out sweeping until {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn delivery(app: &TestApp, cred: &Cred, sub: &str, delivery_id: &str) -> Value {
    let res = app
        .get(
            &format!("/v1/subscriptions/{sub}/deliveries/{delivery_id}"),
            &cred.token,
        )
        .await;
    assert_eq!(res.status, 200, "{:#}", res.body);
    res.data()["delivery"].clone()
}

/// A subscription from sequence 0 (unless `extra` says otherwise) with
/// the fields of `extra`; returns its id.
pub(crate) async fn create_sub(app: &TestApp, cred: &Cred, extra: Value) -> String {
    let mut body = json!({ "from_sequence": "0" });
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    app.subscribe(cred, body).await["id"]
        .as_str()
        .unwrap()
        .to_owned()
}

#[actix_web::test]
async fn a_lapsed_lease_of_a_subscription_without_a_consumer_becomes_pending_or_expired_within_one_sweep_interval_over_http()
 {
    let sweep_interval = Duration::from_millis(500);
    let app = spawn_app_with(|s| {
        s.timing.lease_ms = 300;
        s.timing.sweep_interval_ms = sweep_interval.as_millis() as u64;
    })
    .await;
    let cred = app.bootstrap().await;
    let retried = create_sub(&app, &cred, json!({})).await;
    let dead = create_sub(&app, &cred, json!({ "max_attempts": 1 })).await;
    let mut ws_retried = app.bind(&cred.token, &retried, 1).await;
    let mut ws_dead = app.bind(&cred.token, &dead, 1).await;
    publish_n(&app, &cred, 1, "task.failed").await;
    let d_retried = ws_retried.delivery().await;
    let d_dead = ws_dead.delivery().await;
    let leased_at = Instant::now();
    // Nobody consumes any more: only the sweeper can recover the leases.
    drop(ws_retried);
    drop(ws_dead);

    let id_retried = d_retried["body"]["delivery"]["id"].as_str().unwrap();
    let id_dead = d_dead["body"]["delivery"]["id"].as_str().unwrap();
    let mut seen = Vec::new();
    for (sub, id, expected) in [
        (&retried, id_retried, "PENDING"),
        (&dead, id_dead, "EXPIRED"),
    ] {
        let deadline = Instant::now() + DEADLINE;
        let row = loop {
            let row = delivery(&app, &cred, sub, id).await;
            if row["state"] != "LEASED" {
                break row;
            }
            assert!(Instant::now() < deadline, "{id} stayed LEASED");
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        seen.push(leased_at.elapsed());
        assert_eq!(row["state"], expected, "{row:#}");
        // 1 materialized, 2 leased, 3 recovered.
        assert_eq!(row["revision"], "3", "{row:#}");
        assert!(row.get("lease_until").is_none(), "{row:#}");
    }
    report(&format!(
        "lease 300 ms, sweep interval 500 ms: recovered after {:?} (from the lease)",
        seen
    ));
    // Due at lease end + one interval; the rest is slack for a loaded machine.
    let bound = Duration::from_millis(300) + sweep_interval + Duration::from_millis(1500);
    assert!(seen.iter().all(|d| *d < bound), "{seen:?}");
    app.assert_invariants().await;
}

#[actix_web::test]
async fn events_past_their_age_are_purged_except_those_still_referenced_and_the_floor_advances_to_the_highest_purged()
 {
    let app = spawn_app_with(|s| {
        s.retention.events_max_age_s = 1;
        // Only the sweeps this test asks for.
        s.timing.sweep_interval_ms = 3_600_000;
    })
    .await;
    let cred = app.bootstrap().await;
    let q = cred.queue_id.clone();
    // Holds a lease on the failed entry (sequence 2) and does not ACK yet.
    let hold = create_sub(&app, &cred, json!({ "types": ["task.failed"] })).await;
    // max_pending 1: reads entry 1 only, its cursor stays at 1.
    let behind = create_sub(&app, &cred, json!({ "max_pending": 1 })).await;
    // Reads and ACKs everything.
    let done = create_sub(&app, &cred, json!({})).await;
    let mut ws_hold = app.bind(&cred.token, &hold, 1).await;
    let mut ws_behind = app.bind(&cred.token, &behind, 1).await;
    let mut ws_done = app.bind(&cred.token, &done, 4).await;
    app.publish(
        &cred,
        [
            "task.succeeded",
            "task.failed",
            "task.succeeded",
            "task.succeeded",
        ]
        .iter()
        .map(|t| result(&q, t))
        .collect(),
    )
    .await;
    let held = ws_hold.delivery().await;
    assert_eq!(held["body"]["event"]["sequence"], "2");
    let first = ws_behind.delivery().await;
    assert_eq!(first["body"]["event"]["sequence"], "1");
    for _ in 0..4 {
        let d = ws_done.delivery().await;
        ws_done.ack(&d).await;
    }

    let swept = sweep_until(&app, "entries were purged", |r| r.events > 0).await;
    // 3 and 4 are purged; 1 and 2 stay for their non-ACKED deliveries (the
    // ACKED ones of `done` do not keep anything).
    assert_eq!(swept.events, 2);
    let sequences =
        format!("SELECT sequence FROM result_events WHERE queue_id = '{q}' ORDER BY sequence");
    assert_eq!(app.column::<i64>(&sequences).await, vec![1, 2]);
    let floor = || format!("SELECT retention_floor FROM queues WHERE id = '{q}'");
    assert_eq!(app.scalar(&floor()).await, 4);

    // `behind` (cursor 1 < floor 4) is told and closed, never advanced.
    let err = expect_error_then_close(
        &mut ws_behind,
        "EVENT_HISTORY_EXPIRED",
        None,
        CloseCode::Policy,
    )
    .await;
    assert!(
        err["error"]["message"]
            .as_str()
            .unwrap()
            .contains("earliest available sequence is 5"),
        "{err:#}"
    );
    let res = app
        .get(&format!("/v1/subscriptions/{behind}"), &cred.token)
        .await;
    assert_eq!(
        res.data()["cursor_sequence"],
        "1",
        "never silently advanced"
    );
    // Its new hellos are refused the same way.
    let mut again = app.connect(&cred.token).await;
    let reply = again.hello(&behind, 1).await;
    assert_error_frame(&reply, "EVENT_HISTORY_EXPIRED");

    // `hold` and `done` are at or past the floor and go on.
    ping_expect_ack(&mut ws_hold).await;
    ping_expect_ack(&mut ws_done).await;
    // Once its delivery is ACKED, entry 2 goes too; the floor stays 4.
    ws_hold.ack(&held).await;
    let swept = sweep_until(&app, "entry 2 was purged", |r| r.events > 0).await;
    assert_eq!(swept.events, 1);
    assert_eq!(app.column::<i64>(&sequences).await, vec![1]);
    assert_eq!(app.scalar(&floor()).await, 4);

    // Creating below the floor: 410 naming the earliest sequence.
    let res = app
        .post(
            "/v1/subscriptions",
            &cred.token,
            "below-floor",
            &json!({ "name": "late", "queue_id": q, "from_sequence": "3" }),
        )
        .await;
    res.assert_error(410, "EVENT_HISTORY_EXPIRED");
    assert_eq!(
        res.body["error"]["details"],
        json!({ "earliest_sequence": "5" })
    );
    let res = app
        .post(
            "/v1/subscriptions",
            &cred.token,
            "at-floor",
            &json!({ "name": "late", "queue_id": q, "from_sequence": "4" }),
        )
        .await;
    assert_eq!(res.status, 201, "{:#}", res.body);

    let m = scrape(&app).await;
    assert_eq!(
        m.value("orbit_events_purged_total", &[("kind", "events")]),
        3.0
    );
    assert_eq!(
        m.value("orbit_events_queue_retention_floor", &[("queue_id", &q)]),
        4.0
    );
    app.assert_invariants().await;
}

#[actix_web::test]
async fn acked_deliveries_expired_idempotency_records_and_closed_sessions_are_purged_after_their_retention()
 {
    let app = spawn_app_with(|s| {
        s.retention.acked_deliveries_max_age_s = 1;
        s.retention.idempotency_max_age_s = 1;
        s.timing.sweep_interval_ms = 3_600_000;
    })
    .await;
    let cred = app.bootstrap().await;
    let consumed = create_sub(&app, &cred, json!({})).await;
    let waiting = create_sub(&app, &cred, json!({})).await;
    let mut ws = app.bind(&cred.token, &consumed, 3).await;
    let mut open = app.bind(&cred.token, &waiting, 1).await;
    publish_n(&app, &cred, 3, "task.succeeded").await;
    for _ in 0..3 {
        let d = ws.delivery().await;
        ws.ack(&d).await;
    }
    let _leased = open.delivery().await;
    drop(ws);
    let app_ref = &app;
    wait_until("the closed session is recorded", || async move {
        app_ref
            .scalar("SELECT COUNT(*) FROM event_sessions WHERE closed_at IS NOT NULL")
            .await
            == 1
    })
    .await;
    let records = app.scalar("SELECT COUNT(*) FROM idempotency_records").await;
    assert_eq!(records, 3, "two subscriptions and one publish");

    // Each kind ages past its retention at its own moment: add up sweeps.
    let mut total = SweepReport::default();
    let deadline = Instant::now() + DEADLINE;
    while total.acked_deliveries < 3 || total.idempotency_records < 3 || total.sessions < 1 {
        assert!(
            Instant::now() < deadline,
            "timed out; purged so far {total:?}"
        );
        let r = sweep(&app).await;
        total.acked_deliveries += r.acked_deliveries;
        total.idempotency_records += r.idempotency_records;
        total.sessions += r.sessions;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        (
            total.acked_deliveries,
            total.idempotency_records,
            total.sessions
        ),
        (3, 3, 1)
    );
    assert_eq!(
        app.scalar("SELECT COUNT(*) FROM deliveries WHERE state = 'ACKED'")
            .await,
        0
    );
    // Non-ACKED deliveries, open sessions and the log are kept.
    assert_eq!(
        app.scalar("SELECT COUNT(*) FROM deliveries WHERE state <> 'ACKED'")
            .await,
        3
    );
    assert_eq!(app.scalar("SELECT COUNT(*) FROM event_sessions").await, 1);
    assert_eq!(app.scalar("SELECT COUNT(*) FROM result_events").await, 3);
    assert_eq!(
        app.scalar("SELECT COUNT(*) FROM idempotency_records").await,
        0
    );
    ping_expect_ack(&mut open).await;

    let res = app
        .get(
            &format!("/v1/subscriptions/{consumed}/deliveries"),
            &cred.token,
        )
        .await;
    assert_eq!(res.data()["items"], json!([]));
    app.assert_invariants().await;
}

#[actix_web::test]
async fn sessions_left_open_by_a_node_that_died_are_closed_and_a_live_nodes_are_not() {
    use orbit_events::{
        domain::{now, random_hex_id},
        startup::Application,
    };
    let app = spawn_app_with(|s| s.timing.sweep_interval_ms = 3_600_000).await;
    let cred = app.bootstrap().await;
    let sub = subscription(&app, &cred).await;
    let mut live = app.bind(&cred.token, &sub, 1).await;
    // The row a node killed with SIGKILL leaves: open, two minutes old.
    let opened = now().micros() - 120_000_000;
    execute(
        &app,
        &format!(
            "INSERT INTO event_sessions (id, subscription_id, credential_id, application_id, \
             node_id, capacity, opened_at, closed_at, created_at) VALUES ('{}', '{sub}', '{}', \
             '{}', '{}', 1, {opened}, NULL, {opened})",
            random_hex_id(),
            cred.credential_id,
            cred.application_id,
            random_hex_id()
        ),
    )
    .await;
    let open = "SELECT COUNT(*) FROM event_sessions WHERE closed_at IS NULL";
    assert_eq!(app.scalar(open).await, 2);
    if backend_name() == "postgres" {
        // A live node keeps its listener connection; the dead one has none.
        let report = sweep(&app).await;
        assert_eq!(report.dead_node_sessions, 1);
        assert_eq!(
            app.scalar(open).await,
            1,
            "the live node's session stays open"
        );
    } else {
        // One node owns a SQLite database: the next node to start on it
        // closes every session it did not open.
        let next = Application::build(app.settings.clone()).await.unwrap();
        assert_eq!(app.scalar(open).await, 0);
        drop(next);
    }
    ping_expect_ack(&mut live).await;
    app.assert_invariants().await;
}
