//! Cross-node wakes on PostgreSQL (architecture.md §4, delivery-model.md
//! §3): what a node NOTIFYs, what wakes it, and its LISTEN connection
//! coming back after a cut. The nodes here run in-process with a fallback
//! poll of ten minutes, so whatever happens within a test was caused by a
//! notification. PostgreSQL only: on SQLite these tests print why they skip.

use std::time::{Duration, Instant};

use orbit_events::{
    domain::{QueueId, ResultType, SubscriptionId, Timestamp, now, random_hex_id},
    journal::{self, NewResult},
    store::wakes::{self, CHANNEL, Wake},
};
use sea_orm::sqlx::postgres::PgListener;
use serde_json::json;

use crate::helpers::*;

const NO_POLL: u64 = 600_000;

/// A node on the database of `first`.
async fn second_node(
    first: &TestApp,
    customize: impl FnOnce(&mut orbit_events::config::Settings),
) -> TestApp {
    let url = first.settings.database.url.clone();
    spawn_app_with(move |s| {
        s.database.url = url;
        customize(s);
    })
    .await
}

/// The payloads on [`CHANNEL`] that start with `prefix`, until one arrives.
async fn next_payload(listener: &mut PgListener, prefix: &str) -> String {
    let deadline = Instant::now() + DEADLINE;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let n = tokio::time::timeout(left, listener.recv())
            .await
            .unwrap_or_else(|_| panic!("no {prefix:?} notification within the deadline"))
            .unwrap();
        if n.payload().starts_with(prefix) {
            return n.payload().to_owned();
        }
    }
}

#[actix_web::test]
async fn a_node_announces_each_append_and_each_ack_on_the_orbit_events_channel_with_its_node_id() {
    if skip_unless_postgres() {
        return;
    }
    let app = spawn_app_with(|s| s.timing.scan_interval_ms = NO_POLL).await;
    let mut listener = PgListener::connect(&app.settings.database.url)
        .await
        .unwrap();
    listener.listen(CHANNEL).await.unwrap();
    let cred = app.bootstrap().await;
    let sub = app.subscribe(&cred, json!({})).await;
    let sub_id = sub["id"].as_str().unwrap();
    let node = app.state.node_id.as_str().to_owned();
    let mut ws = app.bind(&cred.token, sub_id, 1).await;

    app.publish(&cred, vec![result(&cred.queue_id, "task.failed")])
        .await;
    assert_eq!(
        next_payload(&mut listener, "journal ").await,
        format!("journal {} {node}", cred.queue_id)
    );
    let d = ws.delivery().await;
    assert_eq!(ws.ack(&d).await["type"], "ack");
    assert_eq!(
        next_payload(&mut listener, "subscription ").await,
        format!("subscription {sub_id} {node}")
    );
    app.assert_invariants().await;
}

#[actix_web::test]
async fn an_append_through_one_node_wakes_a_consumer_on_another_node_without_the_poll() {
    if skip_unless_postgres() {
        return;
    }
    let a = spawn_app_with(|s| s.timing.scan_interval_ms = NO_POLL).await;
    let b = second_node(&a, |s| s.timing.scan_interval_ms = NO_POLL).await;
    let cred = a.bootstrap().await;
    let sub = a.subscribe(&cred, json!({})).await;
    let mut ws = b.bind(&cred.token, sub["id"].as_str().unwrap(), 4).await;

    let published = a
        .publish(&cred, vec![result(&cred.queue_id, "task.succeeded")])
        .await;
    let d = ws.delivery().await;
    assert_eq!(d["body"]["event"]["id"], published[0].0.as_str());
    assert_eq!(ws.ack(&d).await["type"], "ack");
    a.assert_invariants().await;
}

#[actix_web::test]
async fn an_outbox_append_in_a_callers_own_transaction_reaches_consumers_after_notify_appended() {
    if skip_unless_postgres() {
        return;
    }
    let app = spawn_app_with(|s| s.timing.scan_interval_ms = NO_POLL).await;
    let cred = app.bootstrap().await;
    let sub = app.subscribe(&cred, json!({})).await;
    let mut ws = app.bind(&cred.token, sub["id"].as_str().unwrap(), 4).await;

    // A task system's own transaction, outside any node: no in-process wake.
    let queue_id = QueueId::parse(&cred.queue_id).unwrap();
    let task = random_hex_id();
    let txn = app.db.begin_write().await.unwrap();
    let appended = journal::append(
        &*txn,
        &queue_id,
        &[NewResult {
            result_type: ResultType::parse("task.cancelled").unwrap(),
            aggregate_id: task.clone(),
            aggregate_revision: "3".to_owned(),
            occurred_at: Timestamp(1_800_000_000_000_000),
            details: "{}".to_owned(),
            snapshot: format!(
                r#"{{"schema_version":1,"task_id":"{task}","queue_id":"{queue_id}","state":"CANCELLED","revision":"3","effect_uncertain":false}}"#
            ),
        }],
        now(),
    )
    .await
    .unwrap()
    .unwrap();
    txn.commit().await.unwrap();
    journal::notify_appended(app.db.reader(), &queue_id)
        .await
        .unwrap();

    let d = ws.delivery().await;
    assert_eq!(d["body"]["event"]["id"], appended[0].0.as_str());
    assert_eq!(d["body"]["event"]["type"], "task.cancelled");
    assert_eq!(ws.ack(&d).await["type"], "ack");
    app.assert_invariants().await;
}

#[actix_web::test]
async fn a_subscription_wake_from_another_node_makes_a_node_reclaim_a_lapsed_lease_without_the_poll()
 {
    if skip_unless_postgres() {
        return;
    }
    let app = spawn_app_with(|s| {
        s.timing.scan_interval_ms = NO_POLL;
        s.timing.lease_ms = 300;
    })
    .await;
    let cred = app.bootstrap().await;
    let sub = app.subscribe(&cred, json!({})).await;
    let sub_id = sub["id"].as_str().unwrap();
    // Published before the session binds, so one claim after one
    // materialization leases it; capacity 2 for one event: that claim finds
    // fewer rows than it wanted, so the node stops looking until a wake.
    app.publish(&cred, vec![result(&cred.queue_id, "task.succeeded")])
        .await;
    let mut ws = app.bind(&cred.token, sub_id, 2).await;
    let first = ws.delivery().await;
    assert_eq!(first["body"]["delivery"]["lease_epoch"], "1");

    // The lease lapses; nothing on this node looks at the subscription again.
    let delivery_id = first["body"]["delivery"]["id"].as_str().unwrap();
    let deadline = Instant::now() + DEADLINE;
    while app
        .scalar(&format!(
            "SELECT COUNT(*) FROM deliveries WHERE id = '{delivery_id}' AND lease_until < {}",
            now().micros()
        ))
        .await
        == 0
    {
        assert!(Instant::now() < deadline, "the lease never lapsed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        ws.delivery_within(Duration::from_millis(500))
            .await
            .is_none(),
        "redelivered without any wake"
    );

    // Another node announces a change of this subscription (as it does
    // after an ACK, a resume or a retry there).
    let subscription = SubscriptionId::parse(sub_id).unwrap();
    wakes::notify(app.db.reader(), &[Wake::Subscription(subscription)], None)
        .await
        .unwrap();
    let second = ws.delivery().await;
    assert_eq!(second["body"]["delivery"]["id"], delivery_id);
    assert_eq!(second["body"]["delivery"]["lease_epoch"], "2");
    assert_eq!(ws.ack(&second).await["type"], "ack");
    app.assert_invariants().await;
}

#[actix_web::test]
async fn a_node_whose_listen_connection_is_cut_listens_again_and_is_woken_by_the_next_append_elsewhere()
 {
    if skip_unless_postgres() {
        return;
    }
    let a = spawn_app_with(|s| s.timing.scan_interval_ms = NO_POLL).await;
    let b = second_node(&a, |s| s.timing.scan_interval_ms = NO_POLL).await;
    let cred = a.bootstrap().await;
    let sub = a.subscribe(&cred, json!({})).await;
    let mut ws = b.bind(&cred.token, sub["id"].as_str().unwrap(), 4).await;

    let listeners = "FROM pg_stat_activity WHERE datname = current_database() \
                     AND application_name LIKE 'orbit-events listener %'";
    let listening = |cut_before: i64| {
        format!(
            "SELECT COUNT(*) {listeners} AND state = 'idle' AND query LIKE 'LISTEN%' \
             AND backend_start > to_timestamp({cut_before} / 1e6)"
        )
    };
    let deadline = Instant::now() + DEADLINE;
    while a.scalar(&listening(0)).await < 2 {
        assert!(Instant::now() < deadline, "the nodes never listened");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let cut_at = now().micros();
    assert_eq!(
        a.scalar(&format!(
            "SELECT COUNT(*) FROM (SELECT pg_terminate_backend(pid) {listeners}) t"
        ))
        .await,
        2
    );
    // Both come back (new backends, started after the cut).
    let deadline = Instant::now() + DEADLINE;
    while a.scalar(&listening(cut_at)).await < 2 {
        assert!(Instant::now() < deadline, "the listeners did not come back");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let published = a
        .publish(&cred, vec![result(&cred.queue_id, "task.needs_review")])
        .await;
    let d = ws.delivery().await;
    assert_eq!(d["body"]["event"]["id"], published[0].0.as_str());
    assert_eq!(ws.ack(&d).await["type"], "ack");
    a.assert_invariants().await;
}
