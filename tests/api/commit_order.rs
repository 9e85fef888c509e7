//! The result log's commit order equals its sequence order
//! (delivery-model.md §3): the per-queue counter row is locked from the
//! sequence allocation to the commit, so no reader ever sees a sequence
//! while a lower one is still invisible. Runs on both backends.

use std::{
    collections::HashSet,
    sync::atomic::{AtomicBool, Ordering},
    time::Duration,
};

use orbit_events::{
    domain::{QueueId, ResultType, Timestamp, now, random_hex_id},
    journal::{self, NewResult},
};
use rand::RngExt;
use sea_orm::{ConnectionTrait, Statement};
use serde_json::json;

use crate::helpers::*;

const APPENDERS: usize = 8;
const TRANSACTIONS_PER_APPENDER: usize = 40;

fn new_result(queue_id: &QueueId) -> NewResult {
    let task = random_hex_id();
    NewResult {
        result_type: ResultType::parse("task.succeeded").unwrap(),
        aggregate_id: task.clone(),
        aggregate_revision: "1".to_owned(),
        occurred_at: Timestamp(1_800_000_000_000_000),
        details: r#"{"state":"SUCCEEDED"}"#.to_owned(),
        snapshot: format!(
            r#"{{"schema_version":1,"task_id":"{task}","queue_id":"{}","state":"SUCCEEDED","revision":"1","effect_uncertain":false}}"#,
            queue_id.as_str()
        ),
    }
}

/// `(head, visible count, highest visible sequence)` in one statement, so
/// one snapshot on both backends.
async fn observe(app: &TestApp, queue_id: &QueueId) -> (i64, i64, i64) {
    let q = queue_id.as_str();
    let sql = format!(
        "SELECT (SELECT head_sequence FROM queues WHERE id = '{q}'), \
                (SELECT COUNT(*) FROM result_events WHERE queue_id = '{q}'), \
                (SELECT COALESCE(MAX(sequence), 0) FROM result_events WHERE queue_id = '{q}')"
    );
    let backend = app.db.reader().get_database_backend();
    let row = app
        .db
        .reader()
        .query_one_raw(Statement::from_string(backend, sql))
        .await
        .unwrap()
        .unwrap();
    (
        row.try_get_by_index::<i64>(0).unwrap(),
        row.try_get_by_index::<i64>(1).unwrap(),
        row.try_get_by_index::<i64>(2).unwrap(),
    )
}

#[actix_web::test]
async fn eight_concurrent_appenders_on_one_queue_commit_in_sequence_order_so_no_reader_sees_a_gap()
{
    // 8 appender transactions and the reader at once, beside the node's own.
    let app = spawn_app_with(|s| s.database.max_connections = 16).await;
    let cred = app.bootstrap().await;
    let queue_id = QueueId::parse(&cred.queue_id).unwrap();
    let done = AtomicBool::new(false);

    let mut appenders = Vec::new();
    for _ in 0..APPENDERS {
        let db = app.db.clone();
        let queue_id = queue_id.clone();
        appenders.push(actix_web::rt::spawn(async move {
            let mut appended = 0;
            for _ in 0..TRANSACTIONS_PER_APPENDER {
                let (n, work) = {
                    let mut rng = rand::rng();
                    (rng.random_range(1..=5), rng.random_range(0..1500))
                };
                let results: Vec<_> = (0..n).map(|_| new_result(&queue_id)).collect();
                // The transactional-outbox use: the append runs inside the
                // caller's own transaction, which then does its own work
                // (stood in for by a short random pause) before committing.
                // An append that did not hold the counter row until commit
                // would let a later sequence commit first in this window.
                let txn = db.begin_write().await.unwrap();
                let out = journal::append(&*txn, &queue_id, &results, now())
                    .await
                    .unwrap()
                    .unwrap();
                assert_eq!(out.len(), n);
                assert!(out.windows(2).all(|w| w[1].1 == w[0].1 + 1));
                tokio::time::sleep(Duration::from_micros(work)).await;
                txn.commit().await.unwrap();
                appended += n;
            }
            appended
        }));
    }

    let reader = {
        async {
            let mut snapshots = 0u64;
            let mut heads = HashSet::new();
            while !done.load(Ordering::Relaxed) {
                let (head, visible, highest) = observe(&app, &queue_id).await;
                assert_eq!(
                    visible,
                    highest,
                    "sequence {highest} is visible while {} lower one(s) are not: \
                     commit order differs from sequence order",
                    highest - visible
                );
                assert_eq!(
                    head, highest,
                    "the head ({head}) differs from the highest visible sequence ({highest})"
                );
                snapshots += 1;
                heads.insert(head);
            }
            (snapshots, heads.len())
        }
    };
    let appending = async {
        let mut total = 0;
        for a in appenders {
            total += a.await.unwrap();
        }
        done.store(true, Ordering::Relaxed);
        total
    };
    let ((snapshots, distinct_heads), total) = tokio::join!(reader, appending);

    let (head, visible, highest) = observe(&app, &queue_id).await;
    let total = total as i64;
    assert_eq!((head, visible, highest), (total, total, total));
    // The reader really ran between the commits, not only before or after.
    assert!(
        distinct_heads >= 10,
        "the reader saw only {distinct_heads} distinct heads in {snapshots} snapshots"
    );
    report(&format!(
        "{} appends of {total} results by {APPENDERS} appenders; {snapshots} snapshots, \
         {distinct_heads} distinct heads, no gap seen ({})",
        APPENDERS * TRANSACTIONS_PER_APPENDER,
        backend_name()
    ));
    app.assert_invariants().await;
}

/// A lease and an ACK are announced only once committed (delivery-model.md
/// §5; on PostgreSQL each is one statement without `BEGIN`, decision
/// 0109): with a deferred trigger that fails the commit after the
/// statement returned its rows, no `event.deliver` and no `ack` is sent and
/// nothing is written; once the trigger is gone both go through.
#[actix_web::test]
async fn a_lease_or_an_ack_whose_commit_fails_after_its_statement_ran_is_never_announced() {
    if skip_unless_backend("postgres", "deferred constraint triggers are PostgreSQL's") {
        return;
    }
    let app = spawn_app_with(|s| s.timing.lease_ms = 1_000).await;
    let cred = app.bootstrap().await;
    let sub = app.subscribe(&cred, json!({})).await;
    let sub_id = sub["id"].as_str().unwrap().to_owned();
    let mut ws = app.bind(&cred.token, &sub_id, 1).await;
    let fail_at_commit = |state: &str| {
        format!(
            "CREATE CONSTRAINT TRIGGER fail_{state} AFTER INSERT OR UPDATE ON deliveries \
             DEFERRABLE INITIALLY DEFERRED FOR EACH ROW WHEN (NEW.state = '{state}') \
             EXECUTE FUNCTION fail_at_commit()"
        )
    };
    crate::http_support::execute(
        &app,
        "CREATE FUNCTION fail_at_commit() RETURNS trigger AS $$ BEGIN \
         RAISE EXCEPTION 'this commit fails'; END $$ LANGUAGE plpgsql",
    )
    .await;
    crate::http_support::execute(&app, &fail_at_commit("LEASED")).await;

    app.publish(&cred, vec![result(&cred.queue_id, "task.succeeded")])
        .await;
    crate::protocol_support::wait_until("a claim failed at its commit", || async {
        crate::metrics::scrape(&app).await.value(
            "orbit_events_database_errors_total",
            &[("operation", "claim")],
        ) >= 1.0
    })
    .await;
    // The session hears that its claim failed, never of the lease.
    unavailable_then_closed(&mut ws, "a lease whose commit failed").await;
    assert_eq!(
        app.scalar("SELECT count(*) FROM deliveries WHERE state = 'LEASED'")
            .await,
        0,
        "a failed commit left a lease"
    );

    crate::http_support::execute(&app, "DROP TRIGGER fail_LEASED ON deliveries").await;
    let mut ws = app.bind(&cred.token, &sub_id, 1).await;
    let deliver = ws.delivery().await;
    crate::http_support::execute(&app, &fail_at_commit("ACKED")).await;
    let body = &deliver["body"];
    let ack = ws.envelope(
        "event.ack",
        json!({
            "delivery_id": body["delivery"]["id"],
            "epoch": body["delivery"]["lease_epoch"],
            "lease_secret": body["lease_secret"],
        }),
    );
    ws.send_json(ack).await;
    // Answered `UNAVAILABLE`, never `ack`.
    unavailable_then_closed(&mut ws, "an ACK whose commit failed").await;
    assert_eq!(
        app.scalar("SELECT count(*) FROM deliveries WHERE state = 'ACKED'")
            .await,
        0,
        "a failed commit left an ACK"
    );
    crate::http_support::execute(&app, "DROP TRIGGER fail_ACKED ON deliveries").await;
    // The lease lapses (1 s) and the delivery is offered again.
    let mut ws = app.bind(&cred.token, &sub_id, 1).await;
    let deliver = ws.delivery().await;
    assert_eq!(
        deliver["body"]["delivery"]["lease_epoch"], "2",
        "{deliver:#}"
    );
    let acked = ws.ack(&deliver).await;
    assert_eq!(acked["type"], "ack", "{acked:#}");
    assert_eq!(
        app.scalar("SELECT count(*) FROM deliveries WHERE state = 'ACKED'")
            .await,
        1
    );
}

/// Reads `ws` until it closes or stays quiet: every frame must be an
/// `UNAVAILABLE` error (`what` names the write whose commit failed).
async fn unavailable_then_closed(ws: &mut WsClient, what: &str) {
    while let Some(Received::Frame(frame)) = ws.recv_within(Duration::from_millis(200)).await {
        assert_eq!(frame["type"], "error", "{what}: {frame:#}");
        assert_eq!(frame["error"]["code"], "UNAVAILABLE", "{what}: {frame:#}");
    }
}
