//! Shared pieces of the `protocol_*` tests (orbit.events.v1, protocol.md).

use std::time::{Duration, Instant};

use futures_util::SinkExt;
use orbit_events::domain::random_hex_id;
use serde_json::{Value, json};
use tokio_tungstenite::tungstenite::{Message, protocol::frame::coding::CloseCode};

use crate::helpers::*;

/// A subscription from the start of the log; returns its id.
pub async fn subscription(app: &TestApp, cred: &Cred) -> String {
    app.subscribe(cred, json!({ "from_sequence": "0" })).await["id"]
        .as_str()
        .unwrap()
        .to_owned()
}

/// A node (defaults changed by `customize`), a credential, a subscription
/// from the start of the log, and a session bound to it with `capacity`.
pub async fn bound_session(
    customize: impl FnOnce(&mut orbit_events::config::Settings),
    capacity: u32,
) -> (TestApp, Cred, String, WsClient) {
    let app = spawn_app_with(customize).await;
    let cred = app.bootstrap().await;
    let sub = subscription(&app, &cred).await;
    let ws = app.bind(&cred.token, &sub, capacity).await;
    (app, cred, sub, ws)
}

/// Pauses or resumes a subscription in the database (the scanner's timer
/// notices within `timing.scan_interval_ms`).
pub async fn set_enabled(app: &TestApp, subscription_id: &str, enabled: bool) {
    execute(
        app,
        &format!("UPDATE subscriptions SET enabled = {enabled} WHERE id = '{subscription_id}'"),
    )
    .await;
}

/// Runs one SQL statement in a write transaction of the node's database.
pub async fn execute(app: &TestApp, sql: &str) {
    use sea_orm::ConnectionTrait;
    let txn = app.db.begin_write().await.unwrap();
    txn.execute_unprepared(sql).await.unwrap();
    txn.commit().await.unwrap();
}

/// Sends a frame that is deliberately invalid (bypassing schema validation).
pub async fn send_invalid(ws: &mut WsClient, text: &str) {
    ws.send_text_unchecked(text).await;
}

/// Sends a raw WebSocket message (binary, fragments, control frames):
/// these are not JSON frames, so schema validation does not apply.
pub async fn send_raw(ws: &mut WsClient, msg: Message) {
    ws.stream.send(msg).await.unwrap();
}

/// The next frame must be an error with `code`; returns it.
#[track_caller]
pub fn assert_error_frame(frame: &Value, code: &str) {
    assert_eq!(frame["type"], "error", "expected an error frame: {frame:#}");
    assert_eq!(frame["error"]["code"], code, "{frame:#}");
    assert!(frame.get("body").is_none(), "an error frame has no body");
}

/// Expects an error frame with `code` (and `reply_to` when given), then the
/// close with `close`.
pub async fn expect_error_then_close(
    ws: &mut WsClient,
    code: &str,
    reply_to: Option<&Value>,
    close: CloseCode,
) -> Value {
    let frame = ws.frame().await;
    assert_error_frame(&frame, code);
    match reply_to {
        Some(id) => assert_eq!(&frame["reply_to"], id, "{frame:#}"),
        None => assert!(frame.get("reply_to").is_none(), "{frame:#}"),
    }
    assert_eq!(ws.closed().await, Some(close));
    frame
}

/// Expects the close with `close` and no frame before it.
pub async fn expect_close_only(ws: &mut WsClient, close: CloseCode) {
    match ws.recv().await {
        Received::Closed(c) => assert_eq!(c.map(|c| c.code), Some(close)),
        Received::Frame(f) => panic!("expected the close {close:?}, got {f:#}"),
    }
}

/// Sends `events.ping` and returns (reply, its message id).
pub async fn ping_expect_ack(ws: &mut WsClient) -> Value {
    let reply = ws.ping().await;
    assert_eq!(reply["type"], "ack", "{reply:#}");
    reply
}

/// A client frame with an explicit body, as JSON text (for tests that send
/// it unchecked).
pub fn frame_text(ws: &WsClient, frame_type: &str, body: Value) -> (String, Value) {
    let f = ws.envelope(frame_type, body);
    let id = f["message_id"].clone();
    (f.to_string(), id)
}

/// A fresh message id.
pub fn mid() -> String {
    random_hex_id()
}

/// Polls `check` until it is true or the deadline passes.
pub async fn wait_until<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + DEADLINE;
    while !check().await {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until no claim waits or runs; the claims counted for `cred`'s
/// application then.
pub async fn settled_claims(app: &TestApp, cred: &Cred) -> f64 {
    let total = std::cell::Cell::new(None);
    wait_until("no claim waits or runs", || async {
        let m = crate::metrics::scrape(app).await;
        let settled = m.value("orbit_events_claims_in_flight", &[]) == 0.0
            && m.value("orbit_events_claims_waiting", &[]) == 0.0;
        total.set(settled.then(|| {
            m.value(
                "orbit_events_claims_total",
                &[("application_id", cred.application_id.as_str())],
            )
        }));
        total.get().is_some()
    })
    .await;
    total.get().unwrap_or_default()
}

/// Publishes `n` results of `result_type` in one request.
pub async fn publish_n(app: &TestApp, cred: &Cred, n: usize, result_type: &str) {
    app.publish(
        cred,
        (0..n)
            .map(|_| result(&cred.queue_id, result_type))
            .collect(),
    )
    .await;
}

/// The lease proof of an `event.deliver` frame, as an `event.ack` body.
pub fn proof(deliver: &Value) -> Value {
    json!({
        "delivery_id": deliver["body"]["delivery"]["id"],
        "epoch": deliver["body"]["delivery"]["lease_epoch"],
        "lease_secret": deliver["body"]["lease_secret"],
    })
}

/// Publishes one result of `result_type` and returns its event id.
pub async fn publish_one(app: &TestApp, cred: &Cred, result_type: &str) -> String {
    app.publish(cred, vec![result(&cred.queue_id, result_type)])
        .await
        .remove(0)
        .0
}

/// Holds the node's write path so that ACK transactions wait: on SQLite
/// another connection's `BEGIN IMMEDIATE` (writers wait up to the node's
/// 5 s busy timeout, so release well before that); on PostgreSQL row locks
/// on the subscription's deliveries. Reads are not blocked on either.
pub struct WriteBlock {
    _conn: sea_orm::DatabaseConnection,
    txn: sea_orm::DatabaseTransaction,
}

pub async fn block_writes(app: &TestApp, subscription_id: &str) -> WriteBlock {
    use sea_orm::{ConnectionTrait, SqliteTransactionMode, TransactionOptions, TransactionTrait};
    let conn = sea_orm::Database::connect(app.settings.database.url.as_str())
        .await
        .unwrap();
    let txn = conn
        .begin_with_options(TransactionOptions {
            sqlite_transaction_mode: Some(SqliteTransactionMode::Immediate),
            ..Default::default()
        })
        .await
        .unwrap();
    if backend_name() == "postgres" {
        txn.execute_unprepared(&format!(
            "SELECT id FROM deliveries WHERE subscription_id = '{subscription_id}' FOR UPDATE"
        ))
        .await
        .unwrap();
    }
    WriteBlock { _conn: conn, txn }
}

impl WriteBlock {
    pub async fn release(self) {
        self.txn.rollback().await.unwrap();
    }
}

/// A real database failure for the node under test. SQLite: another
/// connection holds the write lock, so every write fails once the node's
/// busy timeout (5 s) runs out ("database is locked"). PostgreSQL: the
/// node's database refuses new connections and its sessions are
/// terminated, so every query fails at once.
pub enum Outage {
    Sqlite(WriteBlock),
    Postgres {
        admin: sea_orm::DatabaseConnection,
        database: String,
    },
}

pub async fn database_outage(app: &TestApp) -> Outage {
    use sea_orm::ConnectionTrait;
    if backend_name() != "postgres" {
        return Outage::Sqlite(block_writes(app, "").await);
    }
    let server = std::env::var("ORBIT_TEST_DATABASE_URL").unwrap();
    let admin = sea_orm::Database::connect(server.as_str()).await.unwrap();
    let database = app
        .settings
        .database
        .url
        .rsplit('/')
        .next()
        .unwrap()
        .to_owned();
    admin
        .execute_unprepared(&format!(
            "ALTER DATABASE {database} WITH ALLOW_CONNECTIONS false"
        ))
        .await
        .unwrap();
    admin
        .execute_unprepared(&format!(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
             WHERE datname = '{database}' AND pid <> pg_backend_pid()"
        ))
        .await
        .unwrap();
    Outage::Postgres { admin, database }
}

impl Outage {
    /// The database recovers.
    pub async fn end(self) {
        use sea_orm::ConnectionTrait;
        match self {
            Outage::Sqlite(block) => block.release().await,
            Outage::Postgres { admin, database } => {
                admin
                    .execute_unprepared(&format!(
                        "ALTER DATABASE {database} WITH ALLOW_CONNECTIONS true"
                    ))
                    .await
                    .unwrap();
            }
        }
    }
}

/// Waits until the lease pool has completed `n` claims and none is waiting
/// or running (e.g. the first claim of a freshly bound session).
pub async fn claims_settled(app: &TestApp, n: u64) {
    use orbit_events::delivery::pool::GetPoolStats;
    let pool = &app.state.pool;
    wait_until("the claims settled", || async move {
        let stats = pool.send(GetPoolStats).await.unwrap();
        stats.claims_completed >= n && stats.claims_in_flight == 0 && stats.claims_waiting == 0
    })
    .await;
}

/// The real `orbit-events serve` binary as a separate process on the test
/// node's database (so `TestApp`'s HTTP and WebSocket helpers can be pointed
/// at it with [`NodeProcess::serve_for`]), configured with
/// `ORBIT_EVENTS__*` environment variables. Killed when dropped.
pub struct NodeProcess {
    pub child: std::process::Child,
    pub port: u16,
    log: tempfile::NamedTempFile,
}

impl NodeProcess {
    /// Starts a node on `app`'s database and a free port, waits until it
    /// answers `/healthz`, and points `app`'s helpers at it.
    pub async fn serve_for(app: &mut TestApp, env: &[(&str, &str)]) -> NodeProcess {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        Self::serve_on(app, port, env).await
    }

    /// As [`NodeProcess::serve_for`], on `port` (a restart on the port the
    /// clients know).
    pub async fn serve_on(app: &mut TestApp, port: u16, env: &[(&str, &str)]) -> NodeProcess {
        let log = tempfile::NamedTempFile::new().unwrap();
        let child = std::process::Command::new(env!("CARGO_BIN_EXE_orbit-events"))
            .arg("serve")
            .env("ORBIT_EVENTS__SERVER__LISTEN", format!("127.0.0.1:{port}"))
            .env("ORBIT_EVENTS__DATABASE__URL", &app.settings.database.url)
            .envs(env.iter().copied())
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(log.reopen().unwrap())
            .spawn()
            .unwrap();
        let mut node = NodeProcess { child, port, log };
        app.port = port;
        app.address = format!("http://127.0.0.1:{port}");
        let deadline = Instant::now() + DEADLINE;
        loop {
            if let Ok(res) = app
                .http
                .get(format!("{}/healthz", app.address))
                .send()
                .await
                && res.status() == 200
            {
                break;
            }
            if let Ok(Some(status)) = node.child.try_wait() {
                panic!("the node exited with {status}: {}", node.log());
            }
            assert!(
                Instant::now() < deadline,
                "the node did not start: {}",
                node.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        node
    }

    /// What the node wrote to stderr.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log.path()).unwrap_or_default()
    }

    /// Sends a signal (`TERM`, `INT`) to the node.
    pub fn signal(&self, name: &str) {
        let status = std::process::Command::new("kill")
            .arg(format!("-{name}"))
            .arg(self.child.id().to_string())
            .status()
            .unwrap();
        assert!(status.success());
    }

    /// Waits for the node to exit; returns its exit status.
    pub async fn exited(&mut self) -> std::process::ExitStatus {
        let deadline = Instant::now() + DEADLINE;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "the node did not exit: {}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The node's resident set size in KiB (from /proc).
    pub fn rss_kib(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap()
    }
}

impl Drop for NodeProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
