//! Retention's "still referenced" rule across queues, applications and
//! subscription states (delivery-model.md §8), and the backlog window's
//! refill with small `max_pending` values (§5, decisions 0062 and 0067).

use std::{
    cell::Cell,
    rc::Rc,
    time::{Duration, Instant},
};

use orbit_events::{
    domain::{QueueId, now, random_hex_id},
    journal,
};
use sea_orm::{ConnectionTrait, Statement};
use serde_json::json;

use crate::{
    helpers::*,
    protocol_support::wait_until,
    retention::{create_sub, sweep},
};

/// An interval no test reaches (fallback poll, background sweep).
const NEVER: u64 = 600_000;

/// A node where only wakes drive the scanner (no fallback poll) and only
/// the sweeps a test asks for run.
async fn spawn_wake_driven_app() -> TestApp {
    spawn_app_with(|s| {
        s.timing.scan_interval_ms = NEVER;
        s.timing.sweep_interval_ms = NEVER;
    })
    .await
}

/// Waits until `sql` (one integer) equals `want`.
async fn wait_scalar(app: &TestApp, sql: &str, want: i64, what: &str) {
    wait_until(what, || async { app.scalar(sql).await == want }).await;
}

fn sequences(q: &str) -> String {
    format!("SELECT sequence FROM result_events WHERE queue_id = '{q}' ORDER BY sequence")
}

fn floor(q: &str) -> String {
    format!("SELECT retention_floor FROM queues WHERE id = '{q}'")
}

fn deliveries_of(sub: &str) -> String {
    format!("SELECT COUNT(*) FROM deliveries WHERE subscription_id = '{sub}'")
}

fn cursor_of(sub: &str) -> String {
    format!("SELECT cursor_sequence FROM subscriptions WHERE id = '{sub}'")
}

/// Runs one retention batch of `queue` with every entry due, inside one
/// write transaction, and returns (purged, floor) together with the
/// non-ACKED delivery states per sequence seen in that same transaction.
async fn purge_all_due(app: &TestApp, queue: &str) -> (u64, i64, Vec<(i64, String)>) {
    let txn = app.db.begin_write().await.unwrap();
    let backend = txn.get_database_backend();
    let rows = txn
        .query_all_raw(Statement::from_string(
            backend,
            format!(
                "SELECT r.sequence, d.state FROM deliveries d \
                 JOIN result_events r ON r.id = d.event_id \
                 WHERE r.queue_id = '{queue}' AND d.state <> 'ACKED' \
                 ORDER BY r.sequence, d.state"
            ),
        ))
        .await
        .unwrap();
    let states = rows
        .iter()
        .map(|r| {
            (
                r.try_get_by_index::<i64>(0).unwrap(),
                r.try_get_by_index::<String>(1).unwrap(),
            )
        })
        .collect();
    let queue_id = QueueId::parse(queue).unwrap();
    let batch = journal::purge(
        &*txn,
        &queue_id,
        0,
        now().plus(Duration::from_secs(3600)),
        500,
    )
    .await
    .unwrap();
    txn.commit().await.unwrap();
    (batch.purged, batch.floor, states)
}

#[actix_web::test]
async fn retention_keeps_every_entry_a_pending_leased_or_expired_delivery_of_any_subscription_of_its_queue_references_and_acked_deliveries_keep_nothing()
 {
    // Leases long enough to outlast the purges below on a loaded machine:
    // 2 and 5 stay LEASED from their delivery to their ACK, across both
    // purges and the other queue's setup (over 1 s in a CI run on
    // PostgreSQL, where 5 lapsed and was offered again).
    let app = spawn_app_with(|s| {
        s.timing.lease_ms = 3_000;
        s.timing.sweep_interval_ms = NEVER;
        s.retention.events_max_age_s = 1;
    })
    .await;
    let name = format!("q{}", &random_hex_id()[..8]);
    // Two applications of one namespace on one queue, and a queue of the
    // same name in another namespace.
    let a = app.bootstrap_with("demo", "app", &name, true, true).await;
    let a2 = app.bootstrap_with("demo", "other", &name, true, true).await;
    let b = app
        .bootstrap_with("elsewhere", "app", &name, true, true)
        .await;
    assert_eq!(a.queue_id, a2.queue_id);
    assert_ne!(a.queue_id, b.queue_id);
    let q = a.queue_id.clone();

    let acks_all = create_sub(&app, &a, json!({ "from_sequence": "0" })).await;
    let pending = create_sub(
        &app,
        &a2,
        json!({ "from_sequence": "0", "types": ["task.cancelled"] }),
    )
    .await;
    let expired = create_sub(
        &app,
        &a,
        json!({ "from_sequence": "0", "types": ["task.needs_review"], "max_attempts": 1 }),
    )
    .await;
    let leased = create_sub(
        &app,
        &a2,
        json!({ "from_sequence": "0", "types": ["task.failed"] }),
    )
    .await;
    let mut ws_all = app.bind(&a.token, &acks_all, 8).await;
    let mut ws_pending = app.bind(&a2.token, &pending, 1).await;
    let mut ws_expired = app.bind(&a.token, &expired, 1).await;
    // 1 cancelled, 2 failed, 3 needs_review, 4..6 succeeded.
    app.publish(
        &a,
        [
            "task.cancelled",
            "task.failed",
            "task.needs_review",
            "task.succeeded",
            "task.succeeded",
            "task.succeeded",
        ]
        .iter()
        .map(|t| result(&q, t))
        .collect(),
    )
    .await;
    for _ in 0..6 {
        let d = ws_all.delivery().await;
        ws_all.ack(&d).await;
    }
    assert_eq!(
        ws_pending.delivery().await["body"]["event"]["sequence"],
        "1"
    );
    assert_eq!(
        ws_expired.delivery().await["body"]["event"]["sequence"],
        "3"
    );
    drop(ws_pending);
    drop(ws_expired);
    // The two leases lapse; a recovery makes one PENDING and one EXPIRED
    // (recovery alone: a whole sweep could already purge entry 2, which no
    // delivery references before `leased` is bound, if this runs slowly).
    let deadline = Instant::now() + DEADLINE;
    let (mut to_pending, mut to_expired) = (0, 0);
    while to_pending < 1 || to_expired < 1 {
        assert!(Instant::now() < deadline, "leases were never recovered");
        tokio::time::sleep(Duration::from_millis(50)).await;
        let r = orbit_events::store::retention::recover_leases(&app.db, now(), 500)
            .await
            .unwrap();
        to_pending += r.to_pending;
        to_expired += r.expired;
    }
    // The application owning `pending` pauses it: its PENDING row stays.
    let res = app
        .post(
            &format!("/v1/subscriptions/{pending}:configure"),
            &a2.token,
            "pause",
            &json!({ "expected_revision": "1", "enabled": false, "reason": "review" }),
        )
        .await;
    assert_eq!(res.status, 200, "{:#}", res.body);

    // Created from sequence 4: its deliveries start at 5.
    let from4 = create_sub(
        &app,
        &a,
        json!({ "from_sequence": "4", "types": ["task.succeeded"] }),
    )
    .await;
    let mut ws_leased = app.bind(&a2.token, &leased, 1).await;
    let mut ws_from4 = app.bind(&a.token, &from4, 1).await;
    let held_2 = ws_leased.delivery().await;
    assert_eq!(held_2["body"]["event"]["sequence"], "2");
    let held_5 = ws_from4.delivery().await;
    assert_eq!(held_5["body"]["event"]["sequence"], "5");
    wait_scalar(&app, &deliveries_of(&from4), 2, "entry 6 materialized").await;

    // 7 (cancelled) reaches only `acks_all`: `pending` is paused.
    app.publish(&a, vec![result(&q, "task.cancelled")]).await;
    let d = ws_all.delivery().await;
    assert_eq!(d["body"]["event"]["sequence"], "7");
    ws_all.ack(&d).await;
    for s in [&leased, &from4] {
        wait_scalar(&app, &cursor_of(s), 7, "cursor past 7").await;
    }

    // The other queue: one LEASED and one PENDING delivery.
    let in_b = create_sub(&app, &b, json!({ "from_sequence": "0" })).await;
    let mut ws_b = app.bind(&b.token, &in_b, 1).await;
    app.publish(
        &b,
        vec![
            result(&b.queue_id, "task.succeeded"),
            result(&b.queue_id, "task.failed"),
        ],
    )
    .await;
    let _held_b = ws_b.delivery().await;
    wait_scalar(&app, &deliveries_of(&in_b), 2, "both entries of b").await;

    let (purged, floor_a, states) = purge_all_due(&app, &q).await;
    let s = |n: i64, st: &str| (n, st.to_owned());
    assert_eq!(
        states,
        vec![
            s(1, "PENDING"),
            s(2, "LEASED"),
            s(3, "EXPIRED"),
            s(5, "LEASED"),
            s(6, "PENDING"),
        ],
        "the non-ACKED deliveries at purge time"
    );
    assert_eq!(purged, 2, "only 4 and 7 are referenced by ACKED rows alone");
    assert_eq!(floor_a, 7);
    assert_eq!(app.column::<i64>(&sequences(&q)).await, vec![1, 2, 3, 5, 6]);
    assert_eq!(app.scalar(&floor(&q)).await, 7);

    let (purged_b, floor_b, states_b) = purge_all_due(&app, &b.queue_id).await;
    assert_eq!(
        states_b,
        vec![s(1, "LEASED"), s(2, "PENDING")],
        "the other queue"
    );
    assert_eq!(purged_b, 0);
    assert_eq!(floor_b, 0);
    assert_eq!(app.column::<i64>(&sequences(&b.queue_id)).await, vec![1, 2]);

    // Once ACKED, 2, 5 and 6 go through the sweeper; 1 and 3 stay and the
    // floor stays at the highest purged sequence.
    assert_eq!(ws_leased.ack(&held_2).await["type"], "ack");
    assert_eq!(ws_from4.ack(&held_5).await["type"], "ack");
    let held_6 = ws_from4.delivery().await;
    assert_eq!(held_6["body"]["event"]["sequence"], "6");
    assert_eq!(ws_from4.ack(&held_6).await["type"], "ack");
    let deadline = Instant::now() + DEADLINE;
    let mut swept = 0;
    while swept < 3 {
        assert!(Instant::now() < deadline, "2, 5 and 6 were never purged");
        tokio::time::sleep(Duration::from_millis(100)).await;
        swept += sweep(&app).await.events;
    }
    assert_eq!(swept, 3);
    assert_eq!(app.column::<i64>(&sequences(&q)).await, vec![1, 3]);
    assert_eq!(app.scalar(&floor(&q)).await, 7);
    assert_eq!(app.column::<i64>(&sequences(&b.queue_id)).await, vec![1, 2]);
    app.assert_invariants().await;
}

/// Consumes `n` deliveries of `sub` over `sessions` connections of
/// `capacity`, ACKing each; fails when no ACK lands for [`DEADLINE`].
async fn consume_all(
    app: &TestApp,
    cred: &Cred,
    sub: &str,
    sessions: usize,
    capacity: u32,
    n: i64,
    label: &str,
) {
    let stop = Rc::new(Cell::new(false));
    let mut tasks = Vec::new();
    for _ in 0..sessions {
        let mut ws = app.bind(&cred.token, sub, capacity).await;
        let stop = stop.clone();
        tasks.push(tokio::task::spawn_local(async move {
            while !stop.get() {
                if let Some(d) = ws.delivery_within(Duration::from_millis(100)).await {
                    let reply = ws.ack(&d).await;
                    assert_eq!(reply["type"], "ack", "{reply:#}");
                }
            }
        }));
    }
    let acked = format!(
        "SELECT COUNT(*) FROM deliveries WHERE subscription_id = '{sub}' AND state = 'ACKED'"
    );
    let mut last = -1;
    let mut progress_at = Instant::now();
    loop {
        let got = app.scalar(&acked).await;
        if got == n {
            break;
        }
        if got != last {
            last = got;
            progress_at = Instant::now();
        }
        assert!(
            progress_at.elapsed() < DEADLINE,
            "{label}: stalled at {got} of {n} ACKED"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    stop.set(true);
    for t in tasks {
        t.await.unwrap();
    }
    // Each entry delivered to this subscription once.
    let distinct = app
        .scalar(&format!(
            "SELECT COUNT(DISTINCT event_id) FROM deliveries WHERE subscription_id = '{sub}'"
        ))
        .await;
    assert_eq!(distinct, n, "{label}");
}

#[actix_web::test]
async fn every_result_is_delivered_and_acked_without_a_stall_when_the_backlog_is_larger_than_a_small_max_pending_window()
 {
    let app = spawn_wake_driven_app().await;
    let cred = app.bootstrap().await;
    let q = cred.queue_id.clone();
    // (max_pending, sessions, capacity)
    let configs: &[(u32, usize, u32)] = &[
        (1, 1, 1),
        (1, 2, 4),
        (2, 1, 1),
        (2, 1, 8),
        (3, 1, 2),
        (3, 2, 1),
        (5, 1, 1),
        (5, 1, 16),
        (8, 1, 3),
        (8, 2, 8),
    ];
    let mut subs = Vec::new();
    for (max_pending, _, _) in configs {
        subs.push(
            create_sub(
                &app,
                &cred,
                json!({ "from_sequence": "0", "max_pending": max_pending }),
            )
            .await,
        );
    }
    let first = 25;
    let second = 15;
    app.publish(
        &cred,
        (0..first).map(|_| result(&q, "task.succeeded")).collect(),
    )
    .await;
    for (i, (max_pending, sessions, capacity)) in configs.iter().enumerate() {
        let label = format!("max_pending {max_pending}, {sessions} x capacity {capacity}");
        if i == 0 {
            // Appends arriving while a window is full.
            app.publish(
                &cred,
                (0..second).map(|_| result(&q, "task.failed")).collect(),
            )
            .await;
        }
        consume_all(
            &app,
            &cred,
            &subs[i],
            *sessions,
            *capacity,
            first + second,
            &label,
        )
        .await;
        let pending = app
            .scalar(&format!(
                "SELECT pending_count - (SELECT CAST(COALESCE(SUM(acked), 0) AS BIGINT) \
                 FROM subscription_ack_tallies WHERE subscription_id = '{0}') \
                 FROM subscriptions WHERE id = '{0}'",
                subs[i]
            ))
            .await;
        assert_eq!(pending, 0, "{label}");
    }
    app.assert_invariants().await;
}

#[actix_web::test]
async fn a_full_window_larger_than_a_quarter_batch_is_refilled_and_every_result_is_acked_without_a_stall()
 {
    let app = spawn_wake_driven_app().await;
    let cred = app.bootstrap().await;
    let q = cred.queue_id.clone();
    // refill_after = 300 / 4 = 75, above the former cap of 64.
    let s = create_sub(
        &app,
        &cred,
        json!({ "from_sequence": "0", "max_pending": 300 }),
    )
    .await;
    let n = 360;
    for _ in 0..(n / 60) {
        app.publish(
            &cred,
            (0..60).map(|_| result(&q, "task.succeeded")).collect(),
        )
        .await;
    }
    consume_all(&app, &cred, &s, 1, 8, n, "max_pending 300").await;
    app.assert_invariants().await;
}

fn index_count(app: &TestApp) -> String {
    match app.db.backend() {
        sea_orm::DbBackend::Postgres => {
            "SELECT COUNT(*) FROM pg_indexes WHERE indexname = 'ix_deliveries_event'".to_owned()
        }
        _ => "SELECT COUNT(*) FROM sqlite_master WHERE type = 'index' \
              AND name = 'ix_deliveries_event'"
            .to_owned(),
    }
}

#[actix_web::test]
async fn the_migration_dropping_the_event_index_applies_on_a_database_holding_deliveries_and_keeps_every_row()
 {
    use migration::MigratorTrait;
    let app = spawn_app_with(|s| s.timing.sweep_interval_ms = NEVER).await;
    let cred = app.bootstrap().await;
    let q = cred.queue_id.clone();
    let s = create_sub(&app, &cred, json!({ "from_sequence": "0" })).await;
    // Capacity 3: once the last three are leased the session has no room,
    // so no claim of it runs while the schema is taken back below (a
    // session with room is left to its claims, decisions 0103 and 0105).
    let mut ws = app.bind(&cred.token, &s, 3).await;
    app.publish(
        &cred,
        (0..6).map(|_| result(&q, "task.succeeded")).collect(),
    )
    .await;
    for _ in 0..3 {
        let d = ws.delivery().await;
        ws.ack(&d).await;
    }
    wait_scalar(&app, &deliveries_of(&s), 6, "six deliveries").await;
    // A claim asked for before the last lease still runs (leasing nothing):
    // it must not meet the schema taken back.
    crate::protocol_support::settled_claims(&app, &cred).await;
    assert_eq!(app.scalar(&index_count(&app)).await, 0);

    // Back to the schema before 0066 (the index is built over the rows),
    // then forward again, each in its own write transaction.
    let txn = app.db.begin_write().await.unwrap();
    // 0066 and every migration after it.
    let steps = steps_back_to("m20261130_000066_event_index_without_state");
    migration::Migrator::down(&*txn, Some(steps)).await.unwrap();
    txn.commit().await.unwrap();
    assert_eq!(app.scalar(&index_count(&app)).await, 1);
    let before = (
        app.scalar("SELECT COUNT(*) FROM deliveries").await,
        app.scalar("SELECT COUNT(*) FROM deliveries WHERE state = 'ACKED'")
            .await,
        app.scalar("SELECT COUNT(*) FROM result_events").await,
    );
    let txn = app.db.begin_write().await.unwrap();
    migration::Migrator::up(&*txn, None).await.unwrap();
    txn.commit().await.unwrap();
    assert_eq!(app.scalar(&index_count(&app)).await, 0);
    let after = (
        app.scalar("SELECT COUNT(*) FROM deliveries").await,
        app.scalar("SELECT COUNT(*) FROM deliveries WHERE state = 'ACKED'")
            .await,
        app.scalar("SELECT COUNT(*) FROM result_events").await,
    );
    assert_eq!(before, after);
    assert_eq!(before, (6, 3, 6));

    // The node goes on: the rest is delivered and ACKED, and retention
    // then purges every entry.
    for _ in 0..3 {
        let d = ws.delivery().await;
        ws.ack(&d).await;
    }
    wait_scalar(
        &app,
        &format!(
            "SELECT COUNT(*) FROM deliveries WHERE subscription_id = '{s}' AND state = 'ACKED'"
        ),
        6,
        "six ACKED",
    )
    .await;
    let (purged, floor_q, states) = purge_all_due(&app, &q).await;
    assert_eq!(states, Vec::<(i64, String)>::new());
    assert_eq!((purged, floor_q), (6, 6));
    app.assert_invariants().await;
}
