//! The 8 s deadline of a publish (http-api.md §1: on expiry 503
//! `UNAVAILABLE`, and the transaction is rolled back) against its batch
//! (decisions 0014, 0111): the deadline gives way only to a publish whose
//! batch is committing it, never to one whose batch still waits for a lock.

use std::time::Duration;

use orbit_events::{
    domain::{CredentialId, QueueId, ResultType, now},
    error::ErrorCode,
    journal::NewResult,
    store::{
        Commitment,
        idempotency::{IdempotencyKey, WriteIdentity},
        publish::{PublishRequest, Published, publish_each},
    },
};
use sea_orm::{DatabaseConnection, DatabaseTransaction};
use serde_json::json;

use crate::{
    helpers::*,
    http_support::{assert_publish_key_applies_afresh, eventually, hold_from_outside},
};

/// Holds, from outside the node, what an append of `queue_id` writes first:
/// PostgreSQL, its queue row (`FOR NO KEY UPDATE`: the publish's counter
/// update waits, nothing else of the node does); SQLite, the write lock (a
/// second connection's write transaction). Roll the transaction back and
/// close the connection to release.
async fn hold_appends(app: &TestApp, queue_id: &str) -> (DatabaseConnection, DatabaseTransaction) {
    let pg = format!("SELECT id FROM queues WHERE id = '{queue_id}' FOR NO KEY UPDATE");
    hold_from_outside(app, "DELETE FROM queues WHERE 1 = 0", &pg).await
}

/// http-api.md §1, decisions 0014 and 0111: a publish whose batch has
/// taken it but waits for a lock before writing it answers 503 at its
/// deadline, and nothing of it is written once the lock is released (the
/// key then applies afresh). It never waits on the lock's holder past its
/// deadline.
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
    assert_publish_key_applies_afresh(&app, &cred, "held", &body, 1).await;
    app.assert_invariants().await;
}

/// One publish request of one result, as the HTTP handler builds it, with
/// its deadline `deadline` from now.
fn request(cred: &Cred, key: &str, deadline: Duration) -> PublishRequest {
    let result = NewResult {
        result_type: ResultType::Succeeded,
        aggregate_id: format!("task-{key}"),
        aggregate_revision: "1".to_owned(),
        occurred_at: now(),
        details: r#"{"state":"SUCCEEDED"}"#.to_owned(),
        snapshot: r#"{"state":"SUCCEEDED"}"#.to_owned(),
    };
    PublishRequest {
        identity: WriteIdentity::new(
            &CredentialId::parse(&cred.credential_id).unwrap(),
            IdempotencyKey::parse(key).unwrap(),
            "results.publish",
            &cred.queue_id,
            &json!({ "key": key }),
        )
        .unwrap(),
        queue_id: QueueId::parse(&cred.queue_id).unwrap(),
        results: vec![result],
        commitment: Commitment::until(tokio::time::Instant::now() + deadline),
    }
}

/// When the batch's statement (PostgreSQL) last began waiting for a lock,
/// in µs since the epoch; 0 while none waits.
async fn lock_wait_started(app: &TestApp) -> i64 {
    app.scalar(
        "SELECT COALESCE(MAX((EXTRACT(EPOCH FROM query_start) * 1000000)::bigint), 0) \
         FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'",
    )
    .await
}

/// Decision 0111, on PostgreSQL (a batch is one statement, committed as it
/// ends, so its requests are committed to before it runs): each lock wait
/// of the batch lasts until the earliest deadline among its requests at
/// most. A request whose deadline passes while the batch waits is then
/// answered 503 with nothing of it written, and the batch runs again with
/// the others, which are written once the lock is free.
#[actix_web::test]
async fn a_request_whose_deadline_passes_while_its_batch_waits_for_a_lock_is_left_out_and_the_others_are_written()
 {
    if skip_unless_postgres() {
        return;
    }
    let app = spawn_app_with(|s| s.timing.scan_interval_ms = 600_000).await;
    let cred = app.bootstrap().await;
    let late = request(&cred, "late", Duration::from_millis(300));
    let kept = request(&cred, "kept", Duration::from_secs(60));
    let kept_deadline = kept.commitment.clone();

    let (blocker, txn) = hold_appends(&app, &cred.queue_id).await;
    let db = app.db.clone();
    let batch = actix_web::rt::spawn(async move {
        publish_each(&db, &[late, kept], Duration::from_secs(3600), &|_, _| {}).await
    });
    let first = eventually("the batch waits for the queue row", || async {
        let started = lock_wait_started(&app).await;
        (started > 0).then_some(started)
    })
    .await;
    // The wait ends at the late request's deadline; the batch waits again
    // without it.
    eventually(
        "the batch waits again, without the late request",
        || async { (lock_wait_started(&app).await > first).then_some(()) },
    )
    .await;
    txn.rollback().await.unwrap();
    blocker.close().await.unwrap();

    let outcomes = batch.await.unwrap();
    match &outcomes[0] {
        Err(err) => assert_eq!(err.code(), ErrorCode::Unavailable, "{err:?}"),
        Ok(other) => panic!("the request past its deadline was answered {other:?}"),
    }
    match &outcomes[1] {
        Ok(Published::Fresh(data)) => assert_eq!(data["events"][0]["sequence"], json!("1")),
        other => panic!("the other request was answered {other:?}"),
    }
    assert!(
        !kept_deadline.abandon(),
        "the written request was committed to"
    );
    let q = &cred.queue_id;
    let events: Vec<String> = app
        .column(&format!(
            "SELECT aggregate_id FROM result_events WHERE queue_id = '{q}'"
        ))
        .await;
    assert_eq!(events, vec!["task-kept".to_owned()]);
    let keys: Vec<String> = app
        .column("SELECT key FROM idempotency_records ORDER BY key")
        .await;
    assert_eq!(keys, vec!["kept".to_owned()]);
    app.assert_invariants().await;
}
