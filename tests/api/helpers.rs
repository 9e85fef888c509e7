#![allow(dead_code)]
//! Test harness: a real node on port 0 with a fresh database, a reqwest
//! client, a tokio-tungstenite WebSocket client, and the storage invariants
//! of delivery-model.md §6.

use std::time::{Duration, Instant};

use futures_util::{SinkExt, StreamExt};
use orbit_events::{
    config::Settings,
    domain::{Permission, random_hex_id},
    node::NodeThread,
    state::AppState,
    store::{Database, tenancy},
};
use reqwest::StatusCode;
use sea_orm::{ConnectionTrait, Statement};
use serde_json::{Value, json};
use tokio::net::TcpStream;
use tokio_tungstenite::{
    MaybeTlsStream, WebSocketStream,
    tungstenite::{
        Message,
        client::IntoClientRequest,
        http::HeaderValue,
        protocol::{CloseFrame, frame::coding::CloseCode},
    },
};

/// How long any wait in a test may take before it fails.
pub const DEADLINE: Duration = Duration::from_secs(15);

pub struct TestApp {
    pub address: String,
    pub port: u16,
    /// The test's own pools on the node's database (the node's are closed
    /// when it stops, and stopping it must not wait on the test's runtime).
    pub db: Database,
    pub state: AppState,
    pub http: reqwest::Client,
    pub settings: Settings,
    /// Dropping it stops the node and waits until it has stopped (before
    /// `_dir`, the SQLite file's folder, goes).
    _node: NodeThread,
    _dir: tempfile::TempDir,
}

/// A credential made by bootstrap.
#[derive(Clone, Debug)]
pub struct Cred {
    pub namespace_id: String,
    pub application_id: String,
    pub queue_id: String,
    pub credential_id: String,
    pub token: String,
}

/// A decoded HTTP response.
#[derive(Debug)]
pub struct Resp {
    pub status: StatusCode,
    pub headers: reqwest::header::HeaderMap,
    pub body: Value,
}

impl Resp {
    pub fn data(&self) -> &Value {
        &self.body["data"]
    }
    pub fn code(&self) -> &str {
        self.body["error"]["code"].as_str().unwrap_or("")
    }
    #[track_caller]
    pub fn assert_error(&self, status: u16, code: &str) {
        assert_eq!(
            (self.status.as_u16(), self.code()),
            (status, code),
            "unexpected response: {:#}",
            self.body
        );
    }
}

pub async fn spawn_app() -> TestApp {
    spawn_app_with(|_| {}).await
}

/// Starts a node with the defaults, a fresh SQLite file and `customize`
/// applied (short timings for timed rules). The node runs on a thread of
/// its own and stops completely when the `TestApp` is dropped.
pub async fn spawn_app_with(customize: impl FnOnce(&mut Settings)) -> TestApp {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut settings = Settings::defaults().expect("defaults");
    settings.server.listen = "127.0.0.1:0".to_owned();
    settings.database.url = fresh_database_url(&dir).await;
    customize(&mut settings);
    let node = NodeThread::start(settings.clone())
        .await
        .expect("build app");
    let port = node.port();
    let state = node.state().clone();
    let db = Database::connect(&settings.database)
        .await
        .expect("connect to the node's database");
    TestApp {
        address: format!("http://127.0.0.1:{port}"),
        port,
        db,
        state,
        http: test_http_client(),
        settings,
        _node: node,
        _dir: dir,
    }
}

/// The backend under test: PostgreSQL when `ORBIT_TEST_DATABASE_URL` names
/// a server (each test gets its own new database there), else SQLite.
/// How many `Migrator::down` steps undo the migration named `name` (its
/// module name, e.g. `m20261201_000079_lean_deliveries`) and every one
/// after it, so a test that goes back to a schema keeps meaning the same
/// schema when later migrations land.
pub fn steps_back_to(name: &str) -> u32 {
    use migration::MigratorTrait;
    let names: Vec<String> = migration::Migrator::migrations()
        .iter()
        .map(|m| m.name().to_owned())
        .collect();
    let at = names
        .iter()
        .position(|n| n == name)
        .unwrap_or_else(|| panic!("no migration named {name} in {names:?}"));
    u32::try_from(names.len() - at).unwrap()
}

pub fn backend_name() -> &'static str {
    if std::env::var("ORBIT_TEST_DATABASE_URL").is_ok() {
        "postgres"
    } else {
        "sqlite"
    }
}

/// A URL of a new, empty database for one test.
pub async fn fresh_database_url(dir: &tempfile::TempDir) -> String {
    let Ok(server) = std::env::var("ORBIT_TEST_DATABASE_URL") else {
        return format!("sqlite://{}/orbit-events.db?mode=rwc", dir.path().display());
    };
    let name = format!("orbit_test_{}", &random_hex_id()[..16]);
    let admin = sea_orm::Database::connect(&server)
        .await
        .expect("connect to the test PostgreSQL server");
    admin
        .execute_unprepared(&format!("CREATE DATABASE {name}"))
        .await
        .expect("create the test database");
    admin.close().await.ok();
    let base = server.rsplit_once('/').map(|(b, _)| b).unwrap_or(&server);
    format!("{base}/{name}")
}

impl TestApp {
    /// A credential with event access and publish access on a new queue.
    pub async fn bootstrap(&self) -> Cred {
        self.bootstrap_with(
            "demo",
            "app",
            &format!("q{}", &random_hex_id()[..8]),
            true,
            true,
        )
        .await
    }

    pub async fn bootstrap_with(
        &self,
        ns: &str,
        app: &str,
        queue: &str,
        events: bool,
        publish: bool,
    ) -> Cred {
        let mut perms = Vec::new();
        if events {
            perms.extend(Permission::EVENT_ACCESS);
        }
        if publish {
            perms.push(Permission::ResultsPublish);
        }
        let out = tenancy::bootstrap(&self.db, ns, app, queue, &perms)
            .await
            .expect("bootstrap");
        Cred {
            namespace_id: out.namespace_id,
            application_id: out.application_id,
            queue_id: out.queue_id,
            credential_id: out.credential_id,
            token: out.token,
        }
    }

    pub async fn request(
        &self,
        method: reqwest::Method,
        path: &str,
        token: Option<&str>,
        key: Option<&str>,
        body: Option<&Value>,
    ) -> Resp {
        let mut req = self
            .http
            .request(method, format!("{}{}", self.address, path));
        if let Some(t) = token {
            req = req.bearer_auth(t);
        }
        if let Some(k) = key {
            req = req.header("Idempotency-Key", k);
        }
        if let Some(b) = body {
            req = req
                .header("Content-Type", "application/json")
                .body(b.to_string());
        }
        let res = req.send().await.expect("request");
        decode(res).await
    }

    pub async fn get(&self, path: &str, token: &str) -> Resp {
        self.request(reqwest::Method::GET, path, Some(token), None, None)
            .await
    }

    pub async fn post(&self, path: &str, token: &str, key: &str, body: &Value) -> Resp {
        self.request(
            reqwest::Method::POST,
            path,
            Some(token),
            Some(key),
            Some(body),
        )
        .await
    }

    /// Publishes results; asserts 201 and returns the `(id, sequence)` pairs.
    pub async fn publish(&self, cred: &Cred, results: Vec<Value>) -> Vec<(String, u64)> {
        let res = self
            .post(
                &format!("/v1/queues/{}/results", cred.queue_id),
                &cred.token,
                &random_hex_id(),
                &json!({ "results": results }),
            )
            .await;
        assert_eq!(res.status, 201, "publish: {:#}", res.body);
        res.data()["events"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| {
                (
                    e["id"].as_str().unwrap().to_owned(),
                    e["sequence"].as_str().unwrap().parse().unwrap(),
                )
            })
            .collect()
    }

    /// Creates a subscription; asserts 201 and returns the subscription object.
    pub async fn subscribe(&self, cred: &Cred, extra: Value) -> Value {
        let mut body =
            json!({ "name": format!("s-{}", &random_hex_id()[..12]), "queue_id": cred.queue_id });
        if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
            for (k, v) in e {
                b.insert(k.clone(), v.clone());
            }
        }
        let res = self
            .post("/v1/subscriptions", &cred.token, &random_hex_id(), &body)
            .await;
        assert_eq!(res.status, 201, "create subscription: {:#}", res.body);
        res.data()["subscription"].clone()
    }

    pub fn ws_url(&self) -> String {
        format!("ws://127.0.0.1:{}/v1/events/connect", self.port)
    }

    /// Opens a WebSocket with the subprotocol and the token.
    pub async fn connect(&self, token: &str) -> WsClient {
        let mut req = self.ws_url().into_client_request().unwrap();
        req.headers_mut().insert(
            "Sec-WebSocket-Protocol",
            HeaderValue::from_static("orbit.events.v1"),
        );
        req.headers_mut().insert(
            "Authorization",
            HeaderValue::from_str(&format!("Bearer {token}")).unwrap(),
        );
        let (stream, response) = tokio_tungstenite::connect_async(req)
            .await
            .expect("ws connect");
        assert_eq!(
            response.headers().get("sec-websocket-protocol").unwrap(),
            "orbit.events.v1"
        );
        WsClient {
            stream,
            session_id: None,
            pending: Default::default(),
        }
    }

    /// Connects and binds a session to `subscription_id`.
    pub async fn bind(&self, token: &str, subscription_id: &str, capacity: u32) -> WsClient {
        let mut ws = self.connect(token).await;
        let welcome = ws.hello(subscription_id, capacity).await;
        assert_eq!(welcome["type"], "events.welcome", "{welcome:#}");
        ws
    }

    /// Runs a query returning one integer.
    pub async fn scalar(&self, sql: &str) -> i64 {
        let backend = self.db.reader().get_database_backend();
        let row = self
            .db
            .reader()
            .query_one_raw(Statement::from_string(backend, sql.to_owned()))
            .await
            .unwrap()
            .unwrap();
        row.try_get_by_index::<i64>(0).unwrap()
    }

    /// The first column of every row of a query.
    pub async fn column<T: sea_orm::TryGetable>(&self, sql: &str) -> Vec<T> {
        let backend = self.db.reader().get_database_backend();
        self.db
            .reader()
            .query_all_raw(Statement::from_string(backend, sql.to_owned()))
            .await
            .unwrap()
            .iter()
            .map(|row| row.try_get_by_index::<T>(0).unwrap())
            .collect()
    }

    /// The storage invariants of delivery-model.md §6.
    pub async fn assert_invariants(&self) {
        let bad_pending = self
            .scalar(
                "SELECT COUNT(*) FROM subscriptions s WHERE s.pending_count - \
                 (SELECT COALESCE(SUM(t.acked), 0) FROM subscription_ack_tallies t \
                 WHERE t.subscription_id = s.id) <> \
                 (SELECT COUNT(*) FROM deliveries d WHERE d.subscription_id = s.id AND d.state <> 'ACKED')",
            )
            .await;
        assert_eq!(
            bad_pending, 0,
            "pending_count differs from the non-ACKED deliveries"
        );
        let over_budget = self
            .scalar("SELECT COUNT(*) FROM deliveries WHERE attempts > attempt_budget")
            .await;
        assert_eq!(over_budget, 0, "attempts above attempt_budget");
        let bad_leased = self
            .scalar(
                "SELECT COUNT(*) FROM deliveries WHERE state = 'LEASED' AND \
                 (lease_until IS NULL OR lease_session_id IS NULL)",
            )
            .await;
        assert_eq!(bad_leased, 0, "a LEASED row without lease_until or session");
        let bad_acked = self
            .scalar(
                "SELECT COUNT(*) FROM deliveries WHERE state = 'ACKED' AND acknowledged_at IS NULL",
            )
            .await;
        assert_eq!(bad_acked, 0, "an ACKED row without acknowledged_at");
    }
}

async fn decode(res: reqwest::Response) -> Resp {
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

/// One task result of `result_type` for `queue_id`.
pub fn result(queue_id: &str, result_type: &str) -> Value {
    let task = random_hex_id();
    let state = match result_type {
        "task.succeeded" => "SUCCEEDED",
        "task.failed" => "FAILED",
        "task.cancelled" => "CANCELLED",
        _ => "NEEDS_REVIEW",
    };
    json!({
        "type": result_type,
        "aggregate_id": task,
        "aggregate_revision": "2",
        "occurred_at": "2026-09-17T10:00:00Z",
        "details": { "state": state },
        "snapshot": {
            "schema_version": 1,
            "task_id": task,
            "queue_id": queue_id,
            "state": state,
            "revision": "2",
            "effect_uncertain": false
        }
    })
}

pub const TYPES: [&str; 4] = [
    "task.succeeded",
    "task.failed",
    "task.cancelled",
    "task.needs_review",
];

/// What a WebSocket read produced.
#[derive(Debug)]
pub enum Received {
    Frame(Value),
    Closed(Option<CloseFrame>),
}

pub struct WsClient {
    pub stream: WebSocketStream<MaybeTlsStream<TcpStream>>,
    pub session_id: Option<String>,
    /// Deliveries that arrived while waiting for a reply.
    pub pending: std::collections::VecDeque<Value>,
}

impl WsClient {
    /// Sends a client frame after validating it against `clientFrame` of
    /// docs/events.schema.json.
    pub async fn send_json(&mut self, frame: Value) {
        self.send_text(&frame.to_string()).await;
    }

    /// Sends a text frame that must be a schema-valid client frame.
    pub async fn send_text(&mut self, text: &str) {
        let frame: Value = serde_json::from_str(text).expect("a client frame is JSON");
        assert_frame_valid("clientFrame", &frame);
        self.send_text_unchecked(text).await;
    }

    /// Sends a text frame WITHOUT schema validation: only for tests that
    /// deliberately send invalid frames.
    pub async fn send_text_unchecked(&mut self, text: &str) {
        self.stream
            .send(Message::text(text))
            .await
            .expect("ws send");
    }

    /// A client frame envelope with a fresh message id (and the session id
    /// once bound).
    pub fn envelope(&self, frame_type: &str, body: Value) -> Value {
        let mut f = json!({
            "protocol_version": "1",
            "type": frame_type,
            "message_id": random_hex_id(),
            "body": body,
        });
        if let Some(s) = &self.session_id {
            f["session_id"] = json!(s);
        }
        f
    }

    /// The next frame or the close, within [`DEADLINE`].
    pub async fn recv(&mut self) -> Received {
        self.recv_within(DEADLINE)
            .await
            .expect("nothing received within the deadline")
    }

    pub async fn recv_within(&mut self, limit: Duration) -> Option<Received> {
        let deadline = Instant::now() + limit;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let msg = match tokio::time::timeout(left, self.stream.next()).await {
                Err(_) => return None,
                Ok(None) => return Some(Received::Closed(None)),
                Ok(Some(Err(_))) => return Some(Received::Closed(None)),
                Ok(Some(Ok(m))) => m,
            };
            match msg {
                Message::Text(t) => {
                    let frame = serde_json::from_str(&t).expect("server frame is JSON");
                    assert_frame_valid("serverFrame", &frame);
                    return Some(Received::Frame(frame));
                }
                Message::Close(c) => return Some(Received::Closed(c)),
                _ => continue,
            }
        }
    }

    /// The next frame; fails on close.
    pub async fn frame(&mut self) -> Value {
        match self.recv().await {
            Received::Frame(f) => f,
            Received::Closed(c) => panic!("connection closed: {c:?}"),
        }
    }

    /// Waits for the close and returns its code.
    pub async fn closed(&mut self) -> Option<CloseCode> {
        loop {
            match self.recv().await {
                Received::Frame(_) => continue,
                Received::Closed(c) => return c.map(|c| c.code),
            }
        }
    }

    pub async fn hello(&mut self, subscription_id: &str, capacity: u32) -> Value {
        let f = self.envelope(
            "events.hello",
            json!({ "subscription_id": subscription_id, "capacity": capacity }),
        );
        self.send_json(f).await;
        let reply = self.frame().await;
        if reply["type"] == "events.welcome" {
            self.session_id = reply["session_id"].as_str().map(str::to_owned);
        }
        reply
    }

    /// Sends `event.ack` for a delivered frame's proof; returns the reply.
    pub async fn ack_proof(&mut self, delivery_id: &str, epoch: &str, secret: &str) -> Value {
        let f = self.envelope(
            "event.ack",
            json!({ "delivery_id": delivery_id, "epoch": epoch, "lease_secret": secret }),
        );
        let message_id = f["message_id"].clone();
        self.send_json(f).await;
        loop {
            let reply = self.frame().await;
            if reply["reply_to"] == message_id {
                return reply;
            }
            assert_eq!(reply["type"], "event.deliver", "unexpected frame {reply:#}");
            self.pending.push_back(reply);
        }
    }
}

impl WsClient {
    /// The next `event.deliver` (buffered ones first).
    pub async fn delivery(&mut self) -> Value {
        if let Some(f) = self.pending.pop_front() {
            return f;
        }
        let f = self.frame().await;
        assert_eq!(f["type"], "event.deliver", "expected a delivery, got {f:#}");
        f
    }

    /// The next delivery if one arrives within `limit`.
    pub async fn delivery_within(&mut self, limit: Duration) -> Option<Value> {
        if let Some(f) = self.pending.pop_front() {
            return Some(f);
        }
        match self.recv_within(limit).await? {
            Received::Frame(f) => {
                assert_eq!(f["type"], "event.deliver", "expected a delivery, got {f:#}");
                Some(f)
            }
            Received::Closed(c) => panic!("connection closed: {c:?}"),
        }
    }

    /// ACKs a delivered frame with its proof; returns the reply frame.
    pub async fn ack(&mut self, deliver: &Value) -> Value {
        let body = &deliver["body"];
        let id = body["delivery"]["id"].as_str().unwrap().to_owned();
        let epoch = body["delivery"]["lease_epoch"].as_str().unwrap().to_owned();
        let secret = body["lease_secret"].as_str().unwrap().to_owned();
        self.ack_proof(&id, &epoch, &secret).await
    }

    /// Sends `events.ping`; returns the reply frame.
    pub async fn ping(&mut self) -> Value {
        let f = self.envelope("events.ping", json!({}));
        let message_id = f["message_id"].clone();
        self.send_json(f).await;
        loop {
            let reply = self.frame().await;
            if reply["reply_to"] == message_id {
                return reply;
            }
            assert_eq!(reply["type"], "event.deliver", "unexpected frame {reply:#}");
            self.pending.push_back(reply);
        }
    }
}

/// The committed OpenAPI document (`docs/openapi.json`).
pub fn openapi() -> Value {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/openapi.json");
    serde_json::from_str(&std::fs::read_to_string(path).expect("docs/openapi.json"))
        .expect("docs/openapi.json is JSON")
}

/// Asserts that `frame` is valid against `#/$defs/{definition}` of
/// docs/events.schema.json (`clientFrame` or `serverFrame`); every frame the
/// suite sends or receives passes through here.
#[track_caller]
pub fn assert_frame_valid(definition: &str, frame: &Value) {
    use std::{collections::HashMap, sync::OnceLock};
    static VALIDATORS: OnceLock<HashMap<&'static str, jsonschema::Validator>> = OnceLock::new();
    let validators = VALIDATORS.get_or_init(|| {
        let schema: Value =
            serde_json::from_str(include_str!("../../docs/events.schema.json")).unwrap();
        ["clientFrame", "serverFrame"]
            .into_iter()
            .map(|def| {
                let mut root = schema.clone();
                root["$ref"] = json!(format!("#/$defs/{def}"));
                (def, jsonschema::validator_for(&root).unwrap())
            })
            .collect()
    });
    let validator = &validators[definition];
    let errors: Vec<String> = validator
        .iter_errors(frame)
        .map(|e| format!("{}: {e}", e.instance_path()))
        .collect();
    assert!(
        errors.is_empty(),
        "frame does not match {definition} of docs/events.schema.json: {errors:?}\n{frame:#}"
    );
}

/// Opens a WebSocket with the subprotocol and the token to the node
/// listening on `port` (an in-process node or a server process).
pub async fn ws_connect(port: u16, token: &str) -> WsClient {
    let mut req = format!("ws://127.0.0.1:{port}/v1/events/connect")
        .into_client_request()
        .unwrap();
    req.headers_mut().insert(
        "Sec-WebSocket-Protocol",
        HeaderValue::from_static("orbit.events.v1"),
    );
    req.headers_mut().insert(
        "Authorization",
        HeaderValue::from_str(&format!("Bearer {token}")).unwrap(),
    );
    let (stream, _) = tokio_tungstenite::connect_async(req)
        .await
        .expect("ws connect");
    WsClient {
        stream,
        session_id: None,
        pending: Default::default(),
    }
}

/// Connects to the node on `port` and binds a session to `subscription_id`.
pub async fn ws_bind(port: u16, token: &str, subscription_id: &str, capacity: u32) -> WsClient {
    let mut ws = ws_connect(port, token).await;
    let welcome = ws.hello(subscription_id, capacity).await;
    assert_eq!(welcome["type"], "events.welcome", "{welcome:#}");
    ws
}

/// True (after printing which test skips and why) when the test needs
/// PostgreSQL and this run is on SQLite. The line goes straight to stderr, past the test harness's
/// capture, so every run shows what it skipped (`scripts/test` counts them).
pub fn skip_unless_postgres() -> bool {
    skip_unless_backend(
        "postgres",
        "needs PostgreSQL (set ORBIT_TEST_DATABASE_URL or run ./scripts/test)",
    )
}

/// True (after printing which test skips and `why`, as
/// [`skip_unless_postgres`] does) when this run is not on `backend`.
pub fn skip_unless_backend(backend: &str, why: &str) -> bool {
    if backend_name() == backend {
        return false;
    }
    // The test harness names each test's thread after the test.
    let thread = std::thread::current();
    report(&format!(
        "skipped {}: {why}",
        thread.name().unwrap_or("a test")
    ));
    true
}

/// Writes one line straight to stderr, past the test harness's capture, so
/// that a figure a test measured shows in every run's log.
pub fn report(line: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "{line}");
}

/// The tests' HTTP client. Its idle connections are dropped after 2 s,
/// before the node's keep-alive (actix-web's 5 s) closes them: a request
/// sent on a connection the node is closing at that instant fails with a
/// connection reset (seen once in a browser test that idles between
/// requests).
pub fn test_http_client() -> reqwest::Client {
    reqwest::Client::builder()
        .pool_idle_timeout(Duration::from_secs(2))
        .build()
        .expect("build the tests' HTTP client")
}

/// The last lines the nodes of this test process logged (every node's, at
/// `warn` and above, and the store's at `debug`), once [`capture_logs`]
/// ran: what a test that failed on what a node did prints.
static LOG_TAIL: std::sync::Mutex<std::collections::VecDeque<String>> =
    std::sync::Mutex::new(std::collections::VecDeque::new());
const LOG_TAIL_LINES: usize = 2_000;

struct LogTail;

impl std::io::Write for LogTail {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let mut tail = LOG_TAIL.lock().unwrap_or_else(|e| e.into_inner());
        for line in String::from_utf8_lossy(buf).lines() {
            if tail.len() == LOG_TAIL_LINES {
                tail.pop_front();
            }
            tail.push_back(line.to_owned());
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Keeps the nodes' log lines in memory from now on (see [`LOG_TAIL`]);
/// later calls do nothing.
pub fn capture_logs() {
    use tracing_subscriber::{EnvFilter, fmt};
    let _ = fmt()
        .with_env_filter(EnvFilter::new("warn,orbit_events::store=debug"))
        .with_ansi(false)
        .with_writer(|| LogTail)
        .try_init();
}

/// The captured log lines (see [`capture_logs`]), oldest first.
pub fn captured_logs() -> String {
    let tail = LOG_TAIL.lock().unwrap_or_else(|e| e.into_inner());
    tail.iter().fold(String::new(), |mut all, line| {
        all.push_str(line);
        all.push('\n');
        all
    })
}
