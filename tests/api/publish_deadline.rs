//! The 8 s deadline of a publish (http-api.md §1: on expiry 503
//! `UNAVAILABLE`, and the transaction is rolled back) against its batch
//! (decision 0014): the deadline gives way only to a publish whose batch
//! is about to commit it, never to one whose batch still waits for the
//! database.

use std::time::Duration;

use sea_orm::{ConnectionTrait, DatabaseConnection, DatabaseTransaction, Statement};
use serde_json::json;

use crate::{helpers::*, http_support::eventually};

/// Holds, from outside the node, what an append of `queue_id` writes first:
/// PostgreSQL, its queue row (`FOR NO KEY UPDATE`: the publish's counter
/// update waits, nothing else of the node does); SQLite, the write lock (a
/// second connection's write transaction). Roll the transaction back and
/// close the connection to release.
async fn hold_appends(app: &TestApp, queue_id: &str) -> (DatabaseConnection, DatabaseTransaction) {
    use sea_orm::TransactionTrait;
    let blocker = sea_orm::Database::connect(app.settings.database.url.as_str())
        .await
        .unwrap();
    let backend = blocker.get_database_backend();
    let txn = blocker.begin().await.unwrap();
    let lock = match backend {
        sea_orm::DbBackend::Sqlite => "DELETE FROM queues WHERE 1 = 0".to_owned(),
        _ => format!("SELECT id FROM queues WHERE id = '{queue_id}' FOR NO KEY UPDATE"),
    };
    txn.execute_raw(Statement::from_string(backend, lock))
        .await
        .unwrap();
    (blocker, txn)
}

/// http-api.md §1, decision 0014: a publish whose batch has taken it but
/// waits for a lock before writing it is not committing yet: at its
/// deadline it answers 503, and nothing of it is written once the lock is
/// released (the key then applies afresh). It never waits on the lock's
/// holder past its deadline.
#[actix_web::test]
async fn a_publish_whose_batch_waits_for_a_lock_past_its_deadline_answers_503_and_writes_nothing() {
    let deadline = Duration::from_millis(500);
    let app = spawn_app_with(|s| {
        s.timing.http_request_timeout_ms = deadline.as_millis() as u64;
        s.timing.scan_interval_ms = 600_000;
    })
    .await;
    let cred = app.bootstrap().await;
    let q = cred.queue_id.clone();
    let path = format!("/v1/queues/{q}/results");
    let body = json!({ "results": [result(&q, "task.succeeded")] });

    let (blocker, txn) = hold_appends(&app, &q).await;
    // Generous: the rule is 503 at the deadline, not "some time after".
    let answered =
        tokio::time::timeout(deadline * 8, app.post(&path, &cred.token, "held", &body)).await;
    txn.rollback().await.unwrap();
    blocker.close().await.unwrap();
    let res = answered.expect("the publish waited for the lock's holder past its deadline");
    res.assert_error(503, "UNAVAILABLE");

    // Nothing of it was written, not even once its batch got the lock:
    // the same key applies afresh (201, not a 200 replay), one event.
    let res = eventually("a publish after the lock is released", || async {
        let res = app.post(&path, &cred.token, "held", &body).await;
        (res.status != 503).then_some(res)
    })
    .await;
    assert_eq!(res.status, 201, "{:#}", res.body);
    assert_eq!(res.data()["deduplicated"], false);
    let events = app
        .scalar(&format!(
            "SELECT COUNT(*) FROM result_events WHERE queue_id = '{q}'"
        ))
        .await;
    assert_eq!(events, 1);
    app.assert_invariants().await;
}
