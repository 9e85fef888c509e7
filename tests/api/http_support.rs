//! Shared by the management-API tests (`http_*.rs`): raw requests, a check
//! that every response conforms to `docs/openapi.json`, a fingerprint of
//! every table, and a way to make an EXPIRED delivery.

use std::{
    sync::OnceLock,
    time::{Duration, Instant},
};

use sea_orm::{ConnectionTrait, Statement};
use serde_json::{Value, json};

use crate::helpers::*;

/// Every table of the schema, for the "nothing changed" fingerprint.
pub const TABLES: [&str; 12] = [
    "namespaces",
    "applications",
    "credentials",
    "queues",
    "result_events",
    "subscriptions",
    "deliveries",
    "delivery_history",
    "event_sessions",
    "idempotency_records",
    "audit_records",
    "signing_keys",
];

/// One raw request: any method, path, headers and body bytes.
pub async fn raw(
    app: &TestApp,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<Vec<u8>>,
) -> Resp {
    let method = reqwest::Method::from_bytes(method.as_bytes()).unwrap();
    let mut req = app.http.request(method, format!("{}{}", app.address, path));
    for (name, value) in headers {
        req = req.header(*name, *value);
    }
    if let Some(body) = body {
        req = req.body(body);
    }
    let res = req.send().await.expect("request");
    let status = res.status();
    let headers = res.headers().clone();
    let text = res.text().await.unwrap();
    let body = serde_json::from_str(&text).unwrap_or(Value::String(text));
    Resp {
        status,
        headers,
        body,
    }
}

/// A POST with a token, a key and a JSON text body (sent exactly as given).
pub async fn post_text(app: &TestApp, path: &str, token: &str, key: &str, body: &str) -> Resp {
    let auth = format!("Bearer {token}");
    raw(
        app,
        "POST",
        path,
        &[
            ("Authorization", &auth),
            ("Idempotency-Key", key),
            ("Content-Type", "application/json"),
        ],
        Some(body.as_bytes().to_vec()),
    )
    .await
}

fn doc() -> &'static Value {
    static DOC: OnceLock<Value> = OnceLock::new();
    DOC.get_or_init(openapi)
}

/// Asserts that `res` is what `docs/openapi.json` promises for `method
/// template`: the status is documented, the body validates against its
/// schema, and the common headers are there (`X-Request-ID` = `request_id`,
/// `Cache-Control: no-store`, `Content-Type: application/json`).
#[track_caller]
pub fn assert_conforms(method: &str, template: &str, res: &Resp) {
    let doc = doc();
    let op = &doc["paths"][template][method.to_lowercase()];
    assert!(
        op.is_object(),
        "{method} {template} is not in docs/openapi.json"
    );
    let status = res.status.as_u16().to_string();
    let response = &op["responses"][&status];
    assert!(
        response.is_object(),
        "{method} {template} answered {status}, which docs/openapi.json does not document: {:#}",
        res.body
    );
    let schema = &response["content"]["application/json"]["schema"];
    let root = json!({ "$ref": schema["$ref"], "components": doc["components"] });
    let validator = jsonschema::options()
        .with_draft(jsonschema::Draft::Draft202012)
        .build(&root)
        .expect("the response schema compiles");
    let errors: Vec<String> = validator
        .iter_errors(&res.body)
        .map(|e| format!("{} at {}", e, e.instance_path()))
        .collect();
    assert!(
        errors.is_empty(),
        "{method} {template} {status}: the body contradicts docs/openapi.json: {errors:#?}\n{:#}",
        res.body
    );
    assert_eq!(
        res.headers.get("x-request-id").map(|v| v.to_str().unwrap()),
        res.body["request_id"].as_str(),
        "X-Request-ID equals request_id"
    );
    assert_eq!(res.headers["cache-control"], "no-store");
    assert_eq!(res.headers["content-type"], "application/json");
}

/// Row count of every table plus the sum of every revision, so an update
/// shows as well as an insert or delete, and the subscriptions'
/// `pending_count` net of unfolded ACK tallies (decision 0094: a fold by
/// the scanner moves a count between the two, not the sum).
pub async fn fingerprint(app: &TestApp) -> Vec<(String, i64)> {
    let mut out = Vec::new();
    for table in TABLES {
        out.push((
            table.to_owned(),
            app.scalar(&format!("SELECT COUNT(*) FROM {table}")).await,
        ));
    }
    for (table, column) in [
        ("subscriptions", "revision"),
        ("subscriptions", "cursor_sequence"),
        ("subscriptions", "updated_at"),
        ("deliveries", "revision"),
        ("deliveries", "attempt_budget"),
        ("queues", "head_sequence"),
    ] {
        out.push((
            format!("sum({table}.{column})"),
            app.scalar(&format!(
                "SELECT CAST(COALESCE(SUM({column}), 0) AS BIGINT) FROM {table}"
            ))
            .await,
        ));
    }
    out.push((
        "pending_count net of tallies".to_owned(),
        app.scalar(
            "SELECT CAST((SELECT COALESCE(SUM(pending_count), 0) FROM subscriptions) \
             - (SELECT COALESCE(SUM(acked), 0) FROM subscription_ack_tallies) AS BIGINT)",
        )
        .await,
    ));
    out
}

/// Polls `check` until it returns `Some`, failing after [`DEADLINE`].
pub async fn eventually<T, F, Fut>(what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + DEADLINE;
    loop {
        if let Some(v) = check().await {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A node with a 300 ms lease and a 50 ms scan interval, for scenarios
/// that need leases to run out.
pub async fn spawn_fast_app() -> TestApp {
    spawn_app_with(|s| {
        s.timing.lease_ms = 300;
        s.timing.scan_interval_ms = 50;
    })
    .await
}

/// An EXPIRED delivery, made the way production makes one: a subscription
/// with `max_attempts = 1`, one result, a session (capacity 2) that takes
/// the lease and never ACKs; once the lease runs out the next claim
/// recovers it to EXPIRED. Returns (subscription id, delivery, the
/// session, which must stay open while the caller uses the delivery).
pub async fn expired_delivery(app: &TestApp, cred: &Cred) -> (String, Value, WsClient) {
    let sub = app
        .subscribe(cred, json!({ "from_sequence": "0", "max_attempts": 1 }))
        .await;
    let sub_id = sub["id"].as_str().unwrap().to_owned();
    app.publish(cred, vec![result(&cred.queue_id, "task.succeeded")])
        .await;
    let mut ws = app.bind(&cred.token, &sub_id, 2).await;
    let deliver = ws.delivery().await;
    let delivery_id = deliver["body"]["delivery"]["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let path = format!("/v1/subscriptions/{sub_id}/deliveries/{delivery_id}");
    let delivery = eventually("the delivery to become EXPIRED", || async {
        let res = app.get(&path, &cred.token).await;
        (res.data()["delivery"]["state"] == "EXPIRED").then(|| res.data()["delivery"].clone())
    })
    .await;
    (sub_id, delivery, ws)
}

/// One text value of a query.
pub async fn scalar_text(app: &TestApp, sql: &str) -> String {
    let backend = app.db.reader().get_database_backend();
    let row = app
        .db
        .reader()
        .query_one_raw(Statement::from_string(backend, sql.to_owned()))
        .await
        .unwrap()
        .unwrap();
    row.try_get_by_index::<String>(0).unwrap()
}

/// Runs one statement in a write transaction of the node's database (to
/// stage states the API cannot reach quickly, e.g. a retention floor).
pub async fn execute(app: &TestApp, sql: &str) {
    let txn = app.db.begin_write().await.unwrap();
    let backend = txn.get_database_backend();
    txn.execute_raw(Statement::from_string(backend, sql.to_owned()))
        .await
        .unwrap();
    txn.commit().await.unwrap();
}

/// Another credential of `cred`'s namespace and queue, under application
/// `application`, with the given access.
pub async fn sibling(
    app: &TestApp,
    cred: &Cred,
    application: &str,
    events: bool,
    publish: bool,
) -> Cred {
    let queue = scalar_text(
        app,
        &format!("SELECT name FROM queues WHERE id = '{}'", cred.queue_id),
    )
    .await;
    let namespace = scalar_text(
        app,
        &format!(
            "SELECT name FROM namespaces WHERE id = '{}'",
            cred.namespace_id
        ),
    )
    .await;
    let other = app
        .bootstrap_with(&namespace, application, &queue, events, publish)
        .await;
    assert_eq!(other.queue_id, cred.queue_id);
    other
}

/// Holds the write lock from outside the node, so its write transactions
/// (idempotent writes, publish batches) cannot start: SQLite, a second
/// connection's write transaction; PostgreSQL, a lock on the idempotency
/// table. Roll the transaction back and close the connection to release.
pub async fn hold_idempotency_writes(
    app: &TestApp,
) -> (sea_orm::DatabaseConnection, sea_orm::DatabaseTransaction) {
    hold_from_outside(
        app,
        "DELETE FROM idempotency_records WHERE 1 = 0",
        "LOCK TABLE idempotency_records IN ACCESS EXCLUSIVE MODE",
    )
    .await
}

/// Runs `sqlite` or `postgres` (by the node's backend) in a transaction
/// of a connection of the test's own, and keeps that transaction open:
/// whatever it locks stays locked until the test rolls the transaction
/// back and closes the connection.
pub async fn hold_from_outside(
    app: &TestApp,
    sqlite: &str,
    postgres: &str,
) -> (sea_orm::DatabaseConnection, sea_orm::DatabaseTransaction) {
    use sea_orm::{ConnectionTrait, Statement, TransactionTrait};
    let blocker = sea_orm::Database::connect(app.settings.database.url.as_str())
        .await
        .unwrap();
    let backend = blocker.get_database_backend();
    let txn = blocker.begin().await.unwrap();
    let lock = match backend {
        sea_orm::DbBackend::Sqlite => sqlite,
        _ => postgres,
    };
    txn.execute_raw(Statement::from_string(backend, lock.to_owned()))
        .await
        .unwrap();
    (blocker, txn)
}

/// After a publish answered 503 at its deadline: once writes go through
/// again, the same key applies afresh (201, not a 200 replay), and the
/// queue holds exactly `events` events — nothing of the abandoned request
/// was written.
pub async fn assert_publish_key_applies_afresh(
    app: &TestApp,
    cred: &Cred,
    key: &str,
    body: &serde_json::Value,
    events: i64,
) {
    let path = format!("/v1/queues/{}/results", cred.queue_id);
    let res = eventually("a publish after the deadline", || async {
        let res = app.post(&path, &cred.token, key, body).await;
        (res.status != 503).then_some(res)
    })
    .await;
    assert_eq!(res.status, 201, "{:#}", res.body);
    assert_eq!(res.data()["deduplicated"], false);
    let appended = app
        .scalar(&format!(
            "SELECT COUNT(*) FROM result_events WHERE queue_id = '{}'",
            cred.queue_id
        ))
        .await;
    assert_eq!(appended, events);
}
