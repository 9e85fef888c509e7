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
