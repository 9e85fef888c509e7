//! The transactional outbox (`orbit_events::outbox`, docs/outbox.md): a
//! producer appends a result inside its own transaction on the node's
//! database, next to its own rows; both backends.

use std::{
    collections::HashSet,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use orbit_events::outbox::{self, Appended};
use sea_orm::{ConnectionTrait, Database, DatabaseConnection, Statement, TransactionTrait};
use serde_json::json;

use crate::helpers::*;

/// The producer's own connection to the node's database, with its own
/// table of tasks.
async fn producer(app: &TestApp) -> DatabaseConnection {
    let db = Database::connect(&app.settings.database.url).await.unwrap();
    let backend = db.get_database_backend();
    db.execute_raw(Statement::from_string(
        backend,
        "CREATE TABLE IF NOT EXISTS producer_tasks (id TEXT PRIMARY KEY)".to_owned(),
    ))
    .await
    .unwrap();
    db
}

/// Inserts the producer's own row in `txn`.
async fn insert_task<C: ConnectionTrait>(txn: &C, task_id: &str) {
    txn.execute_raw(Statement::from_string(
        txn.get_database_backend(),
        format!("INSERT INTO producer_tasks (id) VALUES ('{task_id}')"),
    ))
    .await
    .unwrap();
}

async fn tasks(app: &TestApp) -> i64 {
    app.column::<i64>("SELECT COUNT(*) FROM producer_tasks")
        .await
        .pop()
        .unwrap()
}

async fn head(app: &TestApp, cred: &Cred) -> String {
    let res = app.get("/v1/queues", &cred.token).await;
    res.data()["items"][0]["head_sequence"]
        .as_str()
        .unwrap()
        .to_owned()
}

/// A result of `cred`'s queue for a new task: (task id, JSON text).
fn task_result(cred: &Cred, result_type: &str) -> (String, String) {
    let r = result(&cred.queue_id, result_type);
    let task = r["aggregate_id"].as_str().unwrap().to_owned();
    (task, r.to_string())
}

#[actix_web::test]
async fn a_producer_transaction_that_rolls_back_leaves_no_event_and_consumes_no_sequence() {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let db = producer(&app).await;
    let (task, text) = task_result(&cred, "task.succeeded");
    let txn = db.begin().await.unwrap();
    insert_task(&txn, &task).await;
    let appended = outbox::append_result(&txn, &cred.queue_id, &text, None)
        .await
        .unwrap();
    assert_eq!(appended.sequence, 1);
    txn.rollback().await.unwrap();
    assert_eq!(tasks(&app).await, 0);
    assert_eq!(head(&app, &cred).await, "0", "no sequence consumed");
    assert_eq!(
        app.column::<i64>("SELECT COUNT(*) FROM result_events")
            .await
            .pop(),
        Some(0)
    );
    // The next append takes sequence 1: the log stays dense.
    let txn = db.begin().await.unwrap();
    let again = outbox::append_result(&txn, &cred.queue_id, &text, None)
        .await
        .unwrap();
    txn.commit().await.unwrap();
    assert_eq!(again.sequence, 1);
}

#[actix_web::test]
async fn a_committed_outbox_append_is_delivered_once_to_every_matching_subscription() {
    let app = spawn_app_with(|s| s.timing.scan_interval_ms = 50).await;
    let cred = app.bootstrap().await;
    let all = app.subscribe(&cred, json!({ "from_sequence": "0" })).await;
    let failed_only = app
        .subscribe(
            &cred,
            json!({ "from_sequence": "0", "types": ["task.failed"] }),
        )
        .await;
    let mut ws_all = app.bind(&cred.token, all["id"].as_str().unwrap(), 4).await;
    let mut ws_failed = app
        .bind(&cred.token, failed_only["id"].as_str().unwrap(), 4)
        .await;
    let db = producer(&app).await;
    let (task, text) = task_result(&cred, "task.succeeded");
    let txn = db.begin().await.unwrap();
    insert_task(&txn, &task).await;
    let appended = outbox::append_result(&txn, &cred.queue_id, &text, None)
        .await
        .unwrap();
    txn.commit().await.unwrap();
    assert_eq!(
        tasks(&app).await,
        1,
        "the producer's own row committed with it"
    );
    let d = ws_all.delivery().await;
    assert_eq!(d["body"]["event"]["id"], appended.event_id.as_str());
    assert_eq!(d["body"]["event"]["aggregate_id"], task.as_str());
    ws_all.ack(&d).await;
    assert!(
        ws_all
            .delivery_within(Duration::from_millis(500))
            .await
            .is_none(),
        "delivered once"
    );
    assert!(
        ws_failed
            .delivery_within(Duration::from_millis(300))
            .await
            .is_none(),
        "a subscription of other types gets nothing"
    );
}

/// One append in a transaction of its own, committed or rolled back.
async fn append_alone(
    db: &DatabaseConnection,
    queue_id: &str,
    text: &str,
    key: &str,
    commit: bool,
) -> Result<Appended, orbit_events::error::Error> {
    let txn = db.begin().await.unwrap();
    let appended = outbox::append_result(&txn, queue_id, text, Some(key)).await;
    if commit && appended.is_ok() {
        txn.commit().await.unwrap();
    } else {
        txn.rollback().await.unwrap();
    }
    appended
}

#[actix_web::test]
async fn a_retried_producer_transaction_with_the_same_key_appends_once() {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let db = producer(&app).await;
    let q = cred.queue_id.as_str();
    let (_, text) = task_result(&cred, "task.succeeded");
    let first = append_alone(&db, q, &text, "task-42", true).await.unwrap();
    // The producer lost the commit's answer and runs the transaction again.
    let retried = append_alone(&db, q, &text, "task-42", true).await.unwrap();
    assert_eq!(
        retried,
        Appended {
            deduplicated: true,
            ..first.clone()
        }
    );
    assert!(!first.deduplicated);
    assert_eq!(head(&app, &cred).await, "1");
    // The same key for another result is a conflict.
    let (_, other) = task_result(&cred, "task.failed");
    let err = append_alone(&db, q, &other, "task-42", true)
        .await
        .unwrap_err();
    assert_eq!(err.code().as_str(), "IDEMPOTENCY_CONFLICT", "{err}");
    // A key whose first transaction rolled back is free.
    append_alone(&db, q, &other, "task-43", false)
        .await
        .unwrap();
    let fresh = append_alone(&db, q, &other, "task-43", true).await.unwrap();
    assert!(!fresh.deduplicated);
    assert_eq!(fresh.sequence, 2);
}

#[actix_web::test]
async fn an_invalid_outbox_append_names_the_rule_and_leaves_the_producers_transaction_usable() {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let other_queue = app.bootstrap().await.queue_id;
    let db = producer(&app).await;
    let (task, text) = task_result(&cred, "task.succeeded");
    let txn = db.begin().await.unwrap();
    insert_task(&txn, &task).await;
    for (bad, code, names) in [
        (
            text.replace(&cred.queue_id, &other_queue),
            "INVALID_ARGUMENT",
            "result.snapshot.queue_id",
        ),
        (
            text.replace("task.succeeded", "task.done"),
            "INVALID_ARGUMENT",
            "result.type",
        ),
        ("{\"type\": 1".to_owned(), "INVALID_ARGUMENT", "result"),
        (
            format!("{{{}, \"extra\": 1}}", &text[1..text.len() - 1]),
            "INVALID_ARGUMENT",
            "extra",
        ),
    ] {
        let err = outbox::append_result(&txn, &cred.queue_id, &bad, None)
            .await
            .unwrap_err();
        assert_eq!(err.code().as_str(), code, "{bad}: {err}");
        assert!(err.to_string().contains(names), "{bad}: {err}");
    }
    let unknown = "0123456789abcdef0123456789abcdef";
    let err = outbox::append_result(&txn, unknown, &text.replace(&cred.queue_id, unknown), None)
        .await
        .unwrap_err();
    assert_eq!(err.code().as_str(), "NOT_FOUND");
    let err = outbox::append_result(&txn, &cred.queue_id, &text, Some("bad key"))
        .await
        .unwrap_err();
    assert_eq!(err.code().as_str(), "INVALID_ARGUMENT");
    // Nothing of the refused appends is left; the transaction goes on.
    txn.commit().await.unwrap();
    assert_eq!(tasks(&app).await, 1);
    assert_eq!(head(&app, &cred).await, "0");
}

#[actix_web::test]
async fn eight_concurrent_producers_leave_a_dense_log_in_commit_order_and_consumers_miss_nothing() {
    let app = spawn_app_with(|s| s.timing.scan_interval_ms = 50).await;
    let cred = app.bootstrap().await;
    let sub = app.subscribe(&cred, json!({ "from_sequence": "0" })).await;
    let sub_id = sub["id"].as_str().unwrap().to_owned();
    let db = producer(&app).await;
    // A consumer reads while the producers write.
    let recorder = crate::sdk_support::Recorder::default();
    let running = crate::sdk_support::Running::start(
        crate::sdk_support::consumer(&app.address, &cred, &sub_id, 32),
        recorder.clone(),
    );
    let committed: Arc<Mutex<Vec<u64>>> = Arc::default();
    let until = Instant::now() + Duration::from_secs(10);
    // Commit order is sequence order exactly when no reader ever sees a
    // sequence while a lower one is still invisible: a reader polls the
    // committed log throughout and must always see 1..=max.
    let watcher = {
        let (db, queue) = (db.clone(), cred.queue_id.clone());
        tokio::spawn(async move {
            let mut reads = 0u64;
            while Instant::now() < until {
                let row = db
                    .query_one_raw(Statement::from_string(
                        db.get_database_backend(),
                        format!(
                            "SELECT COUNT(*), COALESCE(MAX(sequence), 0) FROM result_events \
                             WHERE queue_id = '{queue}'"
                        ),
                    ))
                    .await
                    .unwrap()
                    .unwrap();
                let (count, max): (i64, i64) = (
                    row.try_get_by_index(0).unwrap(),
                    row.try_get_by_index(1).unwrap(),
                );
                assert_eq!(
                    count, max,
                    "a reader saw sequence {max} with a lower one missing"
                );
                reads += 1;
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            reads
        })
    };
    let producers: Vec<_> = (0..8)
        .map(|_| {
            let (db, cred, committed) = (db.clone(), cred.clone(), committed.clone());
            tokio::spawn(async move {
                while Instant::now() < until {
                    let (task, text) = task_result(&cred, "task.succeeded");
                    let txn = db.begin().await.unwrap();
                    insert_task(&txn, &task).await;
                    let a = outbox::append_result(&txn, &cred.queue_id, &text, None)
                        .await
                        .unwrap();
                    // Hold the transaction a random while: commits come in
                    // random order, and later appends wait for this one.
                    let hold = rand::random_range(0..5u64);
                    tokio::time::sleep(Duration::from_millis(hold)).await;
                    txn.commit().await.unwrap();
                    committed.lock().unwrap().push(a.sequence);
                }
            })
        })
        .collect();
    for p in producers {
        p.await.unwrap();
    }
    let reads = watcher.await.unwrap();
    assert!(reads > 100, "the reader looked {reads} times");
    let mut sequences = committed.lock().unwrap().clone();
    let n = sequences.len() as u64;
    assert!(n > 50, "{n} appends in 10 s");
    sequences.sort();
    assert_eq!(sequences, (1..=n).collect::<Vec<_>>(), "a dense log");
    assert_eq!(head(&app, &cred).await, n.to_string());
    assert_eq!(tasks(&app).await as u64, n);
    recorder
        .until("every append delivered", |r| {
            r.deliveries
                .iter()
                .map(|d| d.event.sequence)
                .collect::<HashSet<_>>()
                .len() as u64
                == n
        })
        .await;
    running.stop().await.unwrap();
}

#[actix_web::test]
async fn on_postgresql_an_outbox_append_reaches_a_connected_consumer_without_waiting_for_the_scan_interval()
 {
    if skip_unless_backend(
        "postgres",
        "SQLite has no NOTIFY: the node finds outbox appends within timing.scan_interval_ms",
    ) {
        return;
    }
    // The fallback poll is 10 minutes away: only the commit's NOTIFY can
    // wake the node.
    let app = spawn_app_with(|s| s.timing.scan_interval_ms = 600_000).await;
    let cred = app.bootstrap().await;
    let sub = app.subscribe(&cred, json!({ "from_sequence": "0" })).await;
    let mut ws = app.bind(&cred.token, sub["id"].as_str().unwrap(), 4).await;
    let db = producer(&app).await;
    let mut waits = Vec::new();
    for _ in 0..20 {
        let (_, text) = task_result(&cred, "task.succeeded");
        let txn = db.begin().await.unwrap();
        let appended = outbox::append_result(&txn, &cred.queue_id, &text, None)
            .await
            .unwrap();
        let committed = Instant::now();
        txn.commit().await.unwrap();
        let d = ws
            .delivery_within(Duration::from_secs(5))
            .await
            .expect("delivered long before the scan interval");
        waits.push(committed.elapsed());
        assert_eq!(d["body"]["event"]["id"], appended.event_id.as_str());
        ws.ack(&d).await;
    }
    waits.sort();
    report(&format!(
        "outbox commit → event.deliver on PostgreSQL (scan interval 600 s, NOTIFY only): 20 appends, p50 {:?}, max {:?}",
        waits[10], waits[19]
    ));
    assert!(waits[19] < Duration::from_secs(5));
}

/// A login role that may only call the outbox function (and write its own
/// table), and the node's database as that role.
async fn producer_role(app: &TestApp, db: &DatabaseConnection) -> (String, DatabaseConnection) {
    let role = format!("producer_{}", &crate::protocol_support::mid()[..12]);
    for sql in [
        format!("CREATE ROLE {role} LOGIN"),
        format!("GRANT USAGE ON SCHEMA orbit_events TO {role}"),
        format!("GRANT EXECUTE ON FUNCTION orbit_events.append_result(text, text, text) TO {role}"),
        format!("GRANT INSERT, SELECT ON producer_tasks TO {role}"),
    ] {
        db.execute_unprepared(&sql).await.unwrap();
    }
    let url = app
        .settings
        .database
        .url
        .replacen("://postgres@", &format!("://{role}@"), 1);
    assert_ne!(
        url, app.settings.database.url,
        "the test URL names its user"
    );
    (role, Database::connect(&url).await.unwrap())
}

/// `orbit_events.append_result(queue, result, key)` in `txn`.
async fn append_sql<C: ConnectionTrait>(
    txn: &C,
    queue_id: &str,
    result: &str,
    key: Option<&str>,
) -> Result<(String, i64, bool), sea_orm::DbErr> {
    let row = txn
        .query_one_raw(Statement::from_sql_and_values(
            sea_orm::DbBackend::Postgres,
            "SELECT event_id, sequence, deduplicated FROM orbit_events.append_result($1, $2, $3)",
            [
                queue_id.into(),
                result.into(),
                key.map(str::to_owned).into(),
            ],
        ))
        .await?
        .unwrap();
    Ok((
        row.try_get_by_index(0)?,
        row.try_get_by_index(1)?,
        row.try_get_by_index(2)?,
    ))
}

#[actix_web::test]
async fn a_producer_role_with_only_execute_appends_in_its_own_postgresql_transaction_and_reads_nothing()
 {
    if skip_unless_backend("postgres", "the outbox SQL function is PostgreSQL's") {
        return;
    }
    let app = spawn_app_with(|s| s.timing.scan_interval_ms = 50).await;
    let cred = app.bootstrap().await;
    let sub = app.subscribe(&cred, json!({ "from_sequence": "0" })).await;
    let mut ws = app.bind(&cred.token, sub["id"].as_str().unwrap(), 4).await;
    let owner = producer(&app).await;
    let (role, db) = producer_role(&app, &owner).await;

    // Rolled back: nothing, not even a sequence.
    let (task, text) = task_result(&cred, "task.succeeded");
    let txn = db.begin().await.unwrap();
    insert_task(&txn, &task).await;
    let (_, seq, _) = append_sql(&txn, &cred.queue_id, &text, None).await.unwrap();
    assert_eq!(seq, 1);
    txn.rollback().await.unwrap();
    assert_eq!(head(&app, &cred).await, "0");
    assert_eq!(tasks(&app).await, 0);

    // Committed with the producer's own row, numbers kept byte for byte.
    let exact = text.replace(
        "\"details\":{",
        "\"details\":{\"amount\": 0.10000000000000000000001, \"big\":123456789012345678901234567890,",
    );
    assert_ne!(exact, text, "{text}");
    let txn = db.begin().await.unwrap();
    insert_task(&txn, &task).await;
    let (event_id, seq, dedup) = append_sql(&txn, &cred.queue_id, &exact, Some("task-1"))
        .await
        .unwrap();
    txn.commit().await.unwrap();
    assert_eq!((seq, dedup), (1, false));
    assert_eq!(tasks(&app).await, 1);
    let d = ws.delivery().await;
    assert_eq!(d["body"]["event"]["id"], event_id.as_str());
    ws.ack(&d).await;
    let stored = app
        .column::<String>(&format!(
            "SELECT details FROM result_events WHERE id = '{event_id}'"
        ))
        .await
        .pop()
        .unwrap();
    assert!(
        stored.contains("\"amount\": 0.10000000000000000000001")
            && stored.contains("\"big\":123456789012345678901234567890"),
        "byte for byte: {stored}"
    );

    // A retried transaction with the same key appends once.
    let txn = db.begin().await.unwrap();
    let again = append_sql(&txn, &cred.queue_id, &exact, Some("task-1"))
        .await
        .unwrap();
    txn.commit().await.unwrap();
    assert_eq!(again, (event_id.clone(), 1, true));
    assert_eq!(head(&app, &cred).await, "1");

    // Refusals: the spec's code first in the message, the SQLSTATE class.
    let other = app.bootstrap().await.queue_id;
    for (bad, message) in [
        (
            text.replace(&cred.queue_id, &other),
            "INVALID_ARGUMENT: result.snapshot.queue_id",
        ),
        (
            text.replace("task.succeeded", "task.done"),
            "INVALID_ARGUMENT: result.type",
        ),
        ("{\"type\": 1".to_owned(), "INVALID_ARGUMENT: result"),
        (
            format!("{{{}, \"extra\": 1}}", &text[1..text.len() - 1]),
            "result.extra: unknown field",
        ),
        (
            exact.replace("\"big\"", "\"amount\""),
            "a key appears twice",
        ),
    ] {
        let txn = db.begin().await.unwrap();
        let err = append_sql(&txn, &cred.queue_id, &bad, None)
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains(message), "{bad}: {err}");
        txn.rollback().await.unwrap();
    }
    let txn = db.begin().await.unwrap();
    let err = append_sql(&txn, &cred.queue_id, &text, Some("task-1"))
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("IDEMPOTENCY_CONFLICT"), "{err}");
    txn.rollback().await.unwrap();
    let txn = db.begin().await.unwrap();
    let unknown = "0123456789abcdef0123456789abcdef";
    let err = append_sql(&txn, unknown, &text.replace(&cred.queue_id, unknown), None)
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("NOT_FOUND"), "{err}");
    txn.rollback().await.unwrap();

    // The role can append, and read nothing of the service.
    for table in ["deliveries", "result_events", "credentials", "queues"] {
        let err = db
            .query_one_raw(Statement::from_string(
                sea_orm::DbBackend::Postgres,
                format!("SELECT * FROM {table} LIMIT 1"),
            ))
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains("permission denied"), "{table}: {err}");
    }
    db.close().await.unwrap();
    owner
        .execute_unprepared(&format!(
            "REVOKE ALL ON producer_tasks FROM {role}; REVOKE ALL ON SCHEMA orbit_events FROM {role}; \
             REVOKE ALL ON FUNCTION orbit_events.append_result(text, text, text) FROM {role}; DROP ROLE {role}"
        ))
        .await
        .unwrap();
}

#[actix_web::test]
async fn the_python_producer_commits_its_task_and_result_together_and_a_retry_appends_once() {
    if skip_unless_backend("postgres", "the outbox SQL function is PostgreSQL's") {
        return;
    }
    let app = spawn_app_with(|s| s.timing.scan_interval_ms = 50).await;
    let cred = app.bootstrap().await;
    let sub = app.subscribe(&cred, json!({ "from_sequence": "0" })).await;
    let mut ws = app.bind(&cred.token, sub["id"].as_str().unwrap(), 4).await;
    let owner = producer(&app).await;
    owner
        .execute_unprepared(
            "CREATE TABLE tasks (id TEXT PRIMARY KEY, revision BIGINT NOT NULL, state TEXT NOT NULL)",
        )
        .await
        .unwrap();
    let (role, db) = producer_role(&app, &owner).await;
    db.close().await.unwrap();
    owner
        .execute_unprepared(&format!("GRANT SELECT, INSERT, UPDATE ON tasks TO {role}"))
        .await
        .unwrap();
    let url = app
        .settings
        .database
        .url
        .replacen("://postgres@", &format!("://{role}@"), 1);
    let script =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/python/outbox_producer.py");
    let python = crate::python_consumer::python();
    let program = [python.as_os_str(), script.as_os_str()];
    check_example_producer(&app, &cred, &mut ws, &program, &url, 4).await;
    owner
        .execute_unprepared(&format!(
            "REVOKE ALL ON tasks FROM {role}; REVOKE ALL ON producer_tasks FROM {role}; \
             REVOKE ALL ON SCHEMA orbit_events FROM {role}; \
             REVOKE ALL ON FUNCTION orbit_events.append_result(text, text, text) FROM {role}; DROP ROLE {role}"
        ))
        .await
        .unwrap();
}

#[actix_web::test]
async fn the_rust_example_producer_commits_its_task_and_result_together_and_a_retry_appends_once() {
    // Built (or found up to date) first: a connection idle that long closes.
    let exe = crate::sdk_crash::workspace_program("outbox_producer");
    let app = spawn_app_with(|s| s.timing.scan_interval_ms = 50).await;
    let cred = app.bootstrap().await;
    let sub = app.subscribe(&cred, json!({ "from_sequence": "0" })).await;
    let mut ws = app.bind(&cred.token, sub["id"].as_str().unwrap(), 4).await;
    let url = app.settings.database.url.clone();
    check_example_producer(&app, &cred, &mut ws, &[exe.as_os_str()], &url, 3).await;
}

/// Runs an example producer (`program`: the command and its first
/// arguments) as the docs say: its task and result commit together, a
/// second run for the same task and revision appends nothing new, and
/// `--fail` (exit `fail_code`) leaves neither.
async fn check_example_producer(
    app: &TestApp,
    cred: &Cred,
    ws: &mut WsClient,
    program: &[&std::ffi::OsStr],
    url: &str,
    fail_code: i32,
) {
    let run = |task: &str, fail: bool| {
        let mut cmd = std::process::Command::new(program[0]);
        cmd.args(&program[1..]).args([
            "--database",
            url,
            "--queue",
            &cred.queue_id,
            "--task",
            task,
            "--revision",
            "2",
            "--occurred-at",
            "2026-12-02T10:00:00.123456Z",
        ]);
        if fail {
            cmd.arg("--fail");
        }
        let out = cmd.output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        (
            out.status.code(),
            serde_json::from_slice::<serde_json::Value>(&out.stdout).ok(),
            stderr,
        )
    };
    let task = crate::protocol_support::mid();
    let (code, first, stderr) = run(&task, false);
    assert_eq!(code, Some(0), "{stderr}");
    let first = first.unwrap();
    assert_eq!(first["sequence"], 1);
    assert_eq!(first["deduplicated"], false);
    let d = ws.delivery().await;
    assert_eq!(d["body"]["event"]["id"], first["event_id"]);
    assert_eq!(d["body"]["event"]["aggregate_id"], task.as_str());
    ws.ack(&d).await;
    // The same task and revision again: the key appends nothing new.
    let (code, replay, stderr) = run(&task, false);
    assert_eq!(code, Some(0), "{stderr}");
    let replay = replay.unwrap();
    assert_eq!(replay["event_id"], first["event_id"]);
    assert_eq!(replay["deduplicated"], true);
    // A failure after the append: neither the task nor its result.
    let (code, _, stderr) = run(&crate::protocol_support::mid(), true);
    assert_eq!(code, Some(fail_code), "{stderr}");
    assert_eq!(head(app, cred).await, "1");
    assert_eq!(
        app.column::<i64>("SELECT COUNT(*) FROM tasks").await.pop(),
        Some(1),
        "the failed run left no task"
    );
}
