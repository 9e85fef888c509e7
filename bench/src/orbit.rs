//! Target: an orbit-events node started by the benchmark (its release
//! binary, `serve`) on a fresh SQLite file or a fresh PostgreSQL database.
//! Consumers speak `orbit.events.v1` over real WebSockets; results are
//! published over HTTP with the `orbit-events-client` crate.

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    process::Stdio,
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, anyhow, bail};
use futures_util::{SinkExt, StreamExt};
use orbit_events_client::{
    AckProof, Client, CreateSubscription, IdempotencyKey, LeaseSecret, NewResult, ResultType,
    Token, frames,
};
use serde::Deserialize;
use serde_json::value::RawValue;
use sqlx::Connection;
use tokio::{net::TcpStream, process::Child};
use tokio_tungstenite::{
    MaybeTlsStream, WebSocketStream,
    tungstenite::{Message, client::IntoClientRequest, http::HeaderValue},
};

use crate::drive::{
    self, Publisher, Samples, Tracker, Workload, dir_bytes, free_port, now_us, random_suffix,
    rss_kib,
};
use crate::stats::RunResult;

/// Where the node keeps its data.
#[derive(Debug, Clone)]
pub enum Backend {
    /// A fresh file in a temporary folder.
    Sqlite,
    /// A fresh database on this PostgreSQL server (a URL naming any
    /// database the user may connect to, e.g. `postgres`).
    Postgres(String),
}

/// How to start nodes.
#[derive(Debug, Clone)]
pub struct NodeOptions {
    /// The `orbit-events` binary (a release build).
    pub bin: PathBuf,
    pub backend: Backend,
    /// Temporary folders go here.
    pub scratch: PathBuf,
    /// Entries written straight into the log (by SQL) before the node
    /// starts; subscriptions start after them.
    pub preload: u64,
    /// The prefilled database the runs copy (when `preload > 0`).
    pub template: TemplateSlot,
}

/// A running node with a credential.
pub struct Node {
    child: Child,
    pub pid: u32,
    pub base: String,
    pub token: Token,
    /// The token's text, for the WebSocket `Authorization` header.
    pub bearer: String,
    pub queue_id: String,
    /// The node's own folder (its log; on a fresh SQLite run also its
    /// database), removed with the node.
    _dir: tempfile::TempDir,
    /// The SQLite database's folder (for its size).
    sqlite_dir: Option<PathBuf>,
    /// A PostgreSQL database of this run only, dropped by [`Node::stop`].
    database: Option<(String, String)>,
    db_url: String,
}

impl Node {
    /// Creates the database and bootstraps a credential (with `preload`:
    /// uses the prefilled database of the target, see [`Template`]), and
    /// starts `serve`; returns once `/healthz` answers.
    pub async fn start(opts: &NodeOptions) -> Result<Node> {
        let dir = tempfile::Builder::new()
            .prefix("orbit-bench-")
            .tempdir_in(&opts.scratch)?;
        let template = if opts.preload > 0 {
            let mut slot = opts.template.lock().await;
            if slot.is_none() {
                *slot = Some(Template::create(opts).await?);
            }
            slot.as_ref().map(|t| (t.boot.clone(), t.source.clone()))
        } else {
            None
        };
        let (db_url, sqlite_dir, database) = match (&opts.backend, &template) {
            (Backend::Sqlite, Some((_, TemplateSource::Sqlite(folder)))) => {
                (sqlite_url(folder), Some(folder.clone()), None)
            }
            (Backend::Postgres(server), Some((_, TemplateSource::Postgres(name)))) => {
                (with_database(server, name)?, None, None)
            }
            (Backend::Sqlite, _) => (sqlite_url(dir.path()), Some(dir.path().to_owned()), None),
            (Backend::Postgres(server), _) => {
                let name = format!("orbit_bench_{}", random_suffix());
                let mut admin = sqlx::PgConnection::connect(server).await?;
                sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
                    .execute(&mut admin)
                    .await?;
                (
                    with_database(server, &name)?,
                    None,
                    Some((server.clone(), name)),
                )
            }
        };
        let port = free_port()?;
        let env = |cmd: &mut tokio::process::Command| {
            cmd.env("ORBIT_EVENTS__DATABASE__URL", &db_url)
                .env("ORBIT_EVENTS__SERVER__LISTEN", format!("127.0.0.1:{port}"))
                .env("RUST_LOG", "warn");
        };
        let boot = match template {
            Some((boot, _)) => boot,
            None => bootstrap(&opts.bin, &db_url).await?,
        };

        let log = std::fs::File::create(dir.path().join("server.log"))?;
        let mut serve = tokio::process::Command::new(&opts.bin);
        env(&mut serve);
        serve
            .arg("serve")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .kill_on_drop(true);
        let child = serve.spawn().context("starting orbit-events serve")?;
        let pid = child.id().context("the node has no pid")?;
        let base = format!("http://127.0.0.1:{port}");
        let bearer = format!("Bearer {}", boot.token.trim());
        let token = Token::new(boot.token)?;
        let client = Client::new(&base, token.clone())?;
        let deadline = Instant::now() + Duration::from_secs(30);
        while client.healthz().await.is_err() {
            if Instant::now() > deadline {
                bail!("the node did not answer /healthz within 30 s");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(Node {
            child,
            pid,
            base,
            token,
            bearer,
            queue_id: boot.queue_id,
            _dir: dir,
            sqlite_dir,
            database,
            db_url,
        })
    }

    pub fn client(&self) -> Result<Client> {
        Ok(Client::new(&self.base, self.token.clone())?)
    }

    /// Creates `n` subscriptions starting after the current head, with
    /// room for every consumer's capacity (`max_pending` 1000).
    pub async fn subscribe(&self, n: usize) -> Result<Vec<String>> {
        let client = self.client()?;
        let mut ids = Vec::with_capacity(n);
        for i in 0..n {
            // Runs on a prefilled log share its database: names are unique.
            let name = format!("bench-{}-{i}", random_suffix());
            let mut req = CreateSubscription::new(&name, &self.queue_id);
            req.max_pending = Some(1000);
            let created = client
                .create_subscription(&IdempotencyKey::random(), &req)
                .await?;
            ids.push(created.subscription.id);
        }
        Ok(ids)
    }

    /// Bytes on disk of the node's database.
    pub async fn database_bytes(&self) -> Result<u64> {
        match &self.sqlite_dir {
            Some(folder) => Ok(dir_bytes(folder).saturating_sub(log_bytes(folder))),
            None => {
                let mut conn = sqlx::PgConnection::connect(&self.db_url).await?;
                let (size,): (i64,) = sqlx::query_as("SELECT pg_database_size(current_database())")
                    .fetch_one(&mut conn)
                    .await?;
                Ok(size as u64)
            }
        }
    }

    /// SIGTERM (the node drains), then removes its database.
    pub async fn stop(mut self) -> Result<()> {
        let _ = std::process::Command::new("kill")
            .args(["-TERM", &self.pid.to_string()])
            .status();
        if tokio::time::timeout(Duration::from_secs(30), self.child.wait())
            .await
            .is_err()
        {
            let _ = self.child.kill().await;
        }
        if let Some((server, name)) = &self.database {
            let mut admin = sqlx::PgConnection::connect(server).await?;
            sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                "DROP DATABASE IF EXISTS {name} WITH (FORCE)"
            )))
            .execute(&mut admin)
            .await?;
        }
        Ok(())
    }
}

fn log_bytes(dir: &Path) -> u64 {
    std::fs::metadata(dir.join("server.log")).map_or(0, |m| m.len())
}

/// `server` with its database name replaced by `name`.
pub fn with_database(server: &str, name: &str) -> Result<String> {
    let (base, query) = match server.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (server, None),
    };
    let rest = base
        .strip_prefix("postgres://")
        .or_else(|| base.strip_prefix("postgresql://"))
        .ok_or_else(|| anyhow!("a PostgreSQL URL starts with postgres://"))?;
    let host = rest.split('/').next().unwrap_or(rest);
    let mut url = format!("postgres://{host}/{name}");
    if let Some(q) = query {
        url.push('?');
        url.push_str(q);
    }
    Ok(url)
}

/// The bootstrap's answer: a token and the queue it may publish to.
#[derive(Debug, Clone, Deserialize)]
pub struct Boot {
    token: String,
    queue_id: String,
}

fn sqlite_url(dir: &Path) -> String {
    format!("sqlite://{}/orbit.db?mode=rwc", dir.display())
}

/// Runs `orbit-events bootstrap` (which also applies the migrations)
/// against `db_url`.
async fn bootstrap(bin: &Path, db_url: &str) -> Result<Boot> {
    let out = tokio::process::Command::new(bin)
        .env("ORBIT_EVENTS__DATABASE__URL", db_url)
        .env("RUST_LOG", "warn")
        .args([
            "bootstrap",
            "--namespace",
            "bench",
            "--application",
            "bench",
            "--queue",
            "results",
            "--event-access",
            "--publish-access",
        ])
        .output()
        .await
        .context("running orbit-events bootstrap")?;
    if !out.status.success() {
        bail!("bootstrap failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    serde_json::from_slice(&out.stdout).context("bootstrap output")
}

/// Where a prefilled database lives.
#[derive(Debug, Clone)]
pub enum TemplateSource {
    /// The SQLite database's folder.
    Sqlite(PathBuf),
    /// The PostgreSQL database's name.
    Postgres(String),
}

/// A bootstrapped database whose log was prefilled once (`--preload`) and
/// which every run of the target uses in turn (a fresh node process and
/// fresh subscriptions from the head each time; each run adds its own N
/// entries to the log): a 10-million-entry log is written once, and no
/// copy of it needs the disk twice.
#[derive(Debug)]
pub struct Template {
    boot: Boot,
    source: TemplateSource,
    /// Keeps the SQLite template's folder until the template is dropped.
    _dir: Option<tempfile::TempDir>,
    server: Option<String>,
}

/// Shared by the runs of one target; filled by the first run.
pub type TemplateSlot = Arc<tokio::sync::Mutex<Option<Template>>>;

impl Template {
    async fn create(opts: &NodeOptions) -> Result<Template> {
        match &opts.backend {
            Backend::Sqlite => {
                let dir = tempfile::Builder::new()
                    .prefix("orbit-bench-template-")
                    .tempdir_in(&opts.scratch)?;
                let url = sqlite_url(dir.path());
                let boot = bootstrap(&opts.bin, &url).await?;
                preload(&url, &boot.queue_id, opts.preload).await?;
                Ok(Template {
                    boot,
                    source: TemplateSource::Sqlite(dir.path().to_owned()),
                    _dir: Some(dir),
                    server: None,
                })
            }
            Backend::Postgres(server) => {
                let name = format!("orbit_bench_template_{}", random_suffix());
                let mut admin = sqlx::PgConnection::connect(server).await?;
                sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
                    .execute(&mut admin)
                    .await?;
                let url = with_database(server, &name)?;
                let boot = bootstrap(&opts.bin, &url).await?;
                preload(&url, &boot.queue_id, opts.preload).await?;
                Ok(Template {
                    boot,
                    source: TemplateSource::Postgres(name),
                    _dir: None,
                    server: Some(server.clone()),
                })
            }
        }
    }

    /// Removes the template (its SQLite folder, or its PostgreSQL database).
    pub async fn remove(self) -> Result<()> {
        if let (Some(server), TemplateSource::Postgres(name)) = (&self.server, &self.source) {
            let mut admin = sqlx::PgConnection::connect(server).await?;
            sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                "DROP DATABASE IF EXISTS {name} WITH (FORCE)"
            )))
            .execute(&mut admin)
            .await?;
        }
        Ok(())
    }
}

/// Benchmark setup only, never a way to load data into a real node: writes
/// `n` entries with sequences 1..=n straight into the log's table, one
/// set-based INSERT per million (a recursive CTE on SQLite,
/// `generate_series` on PostgreSQL), then sets the queue's counter row
/// (`head_sequence`) to n, so the journal's invariants hold: sequences
/// 1..=head without gaps, commit order = sequence order (one writer, nothing
/// else running), `retention_floor` 0, no deliveries. Event and task ids
/// are random 32-hex ids like the node's own, so the primary-key index
/// grows as it does in production (sequential ids would all sort before the
/// node's random ones and leave the part of the index the node writes to
/// small). Entries are `task.succeeded` with a valid snapshot, appended
/// "now": retention leaves them alone during a run.
async fn preload(db_url: &str, queue_id: &str, n: u64) -> Result<()> {
    const CHUNK: u64 = 1_000_000;
    let t = now_us() as i64;
    let started = Instant::now();
    let progress = |last: u64| {
        eprintln!(
            "preload: {last} of {n} entries after {:.0} s",
            started.elapsed().as_secs_f64()
        );
    };
    if db_url.starts_with("sqlite:") {
        let mut conn = sqlx::SqliteConnection::connect(db_url).await?;
        // A large page cache for the random primary-key inserts.
        sqlx::raw_sql("PRAGMA cache_size = -1048576")
            .execute(&mut conn)
            .await?;
        let mut first = 1;
        while first <= n {
            let last = Ord::min(first + CHUNK - 1, n);
            sqlx::query(
                "WITH RECURSIVE s(n) AS (SELECT ?1 UNION ALL SELECT n + 1 FROM s WHERE n < ?2),
                 e AS MATERIALIZED (SELECT n, lower(hex(randomblob(16))) AS task FROM s)
                 INSERT INTO result_events (id, queue_id, sequence, type, aggregate_kind,
                   aggregate_id, aggregate_revision, occurred_at, details, snapshot,
                   appended_at, created_at)
                 SELECT lower(hex(randomblob(16))), ?3, n, 'task.succeeded', 'task', task,
                   '1', ?4, '{}',
                   '{\"schema_version\":1,\"task_id\":\"' || task ||
                   '\",\"queue_id\":\"' || ?3 || '\",\"state\":\"SUCCEEDED\",\"revision\":\"1\",\"effect_uncertain\":false}',
                   ?4, ?4 FROM e",
            )
            .bind(first as i64)
            .bind(last as i64)
            .bind(queue_id)
            .bind(t)
            .execute(&mut conn)
            .await?;
            progress(last);
            first = last + 1;
        }
        sqlx::query("UPDATE queues SET head_sequence = ?1 WHERE id = ?2")
            .bind(n as i64)
            .bind(queue_id)
            .execute(&mut conn)
            .await?;
        sqlx::raw_sql("PRAGMA wal_checkpoint(TRUNCATE)")
            .execute(&mut conn)
            .await?;
    } else {
        let mut conn = sqlx::PgConnection::connect(db_url).await?;
        let mut first = 1;
        while first <= n {
            let last = Ord::min(first + CHUNK - 1, n);
            // random() is volatile: the subquery yields one task id per row.
            sqlx::query(
                "INSERT INTO result_events (id, queue_id, sequence, type, aggregate_kind,
                   aggregate_id, aggregate_revision, occurred_at, details, snapshot,
                   appended_at, created_at)
                 SELECT md5(random()::text || n), $3, n, 'task.succeeded', 'task',
                   task, '1', $4, '{}',
                   '{\"schema_version\":1,\"task_id\":\"' || task ||
                   '\",\"queue_id\":\"' || $3 || '\",\"state\":\"SUCCEEDED\",\"revision\":\"1\",\"effect_uncertain\":false}',
                   $4, $4
                 FROM (SELECT n, md5(random()::text || n) AS task
                       FROM generate_series($1::bigint, $2::bigint) AS n) AS e",
            )
            .bind(first as i64)
            .bind(last as i64)
            .bind(queue_id)
            .bind(t)
            .execute(&mut conn)
            .await?;
            progress(last);
            first = last + 1;
        }
        sqlx::query("UPDATE queues SET head_sequence = $1 WHERE id = $2")
            .bind(n as i64)
            .bind(queue_id)
            .execute(&mut conn)
            .await?;
        sqlx::raw_sql("VACUUM ANALYZE result_events")
            .execute(&mut conn)
            .await?;
    }
    eprintln!(
        "preloaded {n} log entries in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

#[derive(Clone)]
struct OrbitPublisher {
    client: Client,
    queue_id: String,
    filler: Arc<str>,
}

impl Publisher for OrbitPublisher {
    async fn publish(&self, due_us: u64, count: usize) -> Result<()> {
        let now = chrono::Utc::now();
        let details =
            RawValue::from_string(format!("{{\"t\":{due_us},\"pad\":\"{}\"}}", self.filler))?;
        let results: Vec<NewResult> = (0..count)
            .map(|_| {
                let mut r = NewResult::new(
                    ResultType::Succeeded,
                    &self.queue_id,
                    &random_hex32(),
                    1,
                    now,
                );
                r.details = details.clone();
                r
            })
            .collect();
        // As the client documents: a request without an answer (e.g. a
        // pooled keep-alive connection the node closed as it was reused) is
        // sent again with the same key, which tells whether it was applied.
        let key = IdempotencyKey::random();
        let mut tries = 0;
        loop {
            match self
                .client
                .publish_results(&self.queue_id, &key, &results)
                .await
            {
                Err(orbit_events_client::Error::Transport(why)) if tries < 3 => {
                    tries += 1;
                    eprintln!("orbit-bench: publish without an answer ({why}); sent again");
                }
                other => {
                    other?;
                    return Ok(());
                }
            }
        }
    }
}

fn random_hex32() -> String {
    format!("{}{}", random_suffix(), random_suffix())
}

type Ws = WebSocketStream<MaybeTlsStream<TcpStream>>;

/// Connects and binds a session: returns the socket and the session id.
pub async fn connect(
    base: &str,
    bearer: &str,
    subscription_id: &str,
    capacity: u32,
) -> Result<(Ws, String)> {
    let url = format!("{}/v1/events/connect", base.replacen("http://", "ws://", 1));
    let mut request = url.into_client_request()?;
    let headers = request.headers_mut();
    headers.insert(
        "Sec-WebSocket-Protocol",
        HeaderValue::from_static(frames::SUBPROTOCOL),
    );
    headers.insert("Authorization", HeaderValue::from_str(bearer)?);
    // Without Nagle, as the consumers of every other target.
    let (mut ws, _) = tokio_tungstenite::connect_async_with_config(request, None, true).await?;
    let hello = frames::hello(subscription_id, capacity);
    ws.send(Message::text(hello.text)).await?;
    loop {
        let msg = ws
            .next()
            .await
            .ok_or_else(|| anyhow!("closed before the welcome"))??;
        if let Message::Text(text) = msg {
            let frame: Frame<'_> = serde_json::from_str(text.as_str())?;
            if frame.frame_type != "events.welcome" {
                bail!("expected events.welcome, got {}", text.as_str());
            }
            #[derive(Deserialize)]
            struct Welcome {
                session_id: String,
            }
            let body = frame.body.ok_or_else(|| anyhow!("welcome without body"))?;
            let w: Welcome = serde_json::from_str(body.get())?;
            return Ok((ws, w.session_id));
        }
    }
}

#[derive(Deserialize)]
struct Frame<'a> {
    #[serde(rename = "type", borrow)]
    frame_type: &'a str,
    #[serde(default, borrow)]
    reply_to: Option<&'a str>,
    #[serde(default, borrow)]
    body: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct DeliverBody<'a> {
    #[serde(borrow)]
    delivery: DeliveryPart<'a>,
    event: EventPart,
    #[serde(borrow)]
    lease_secret: &'a str,
}

#[derive(Deserialize)]
struct DeliveryPart<'a> {
    #[serde(borrow)]
    id: &'a str,
    #[serde(borrow)]
    lease_epoch: &'a str,
}

#[derive(Deserialize)]
struct EventPart {
    details: Stamp,
}

#[derive(Deserialize)]
struct Stamp {
    t: u64,
}

/// Receives deliveries and ACKs each at once, until the run is over.
async fn consume(mut ws: Ws, session_id: String, tracker: Arc<Tracker>) -> Result<Samples> {
    let mut samples = Samples::default();
    let mut sent: HashMap<String, Instant> = HashMap::new();
    let mut done = tracker.watch();
    loop {
        let msg = tokio::select! {
            msg = ws.next() => msg,
            _ = done.wait_for(|d| d.is_some()) => break,
        };
        let Some(msg) = msg else {
            bail!("the node closed the connection");
        };
        let text = match msg? {
            Message::Text(t) => t,
            Message::Close(c) => bail!("the node closed the connection: {c:?}"),
            _ => continue,
        };
        let frame: Frame<'_> = serde_json::from_str(text.as_str())?;
        match frame.frame_type {
            "event.deliver" => {
                let body = frame.body.ok_or_else(|| anyhow!("deliver without body"))?;
                let d: DeliverBody<'_> = serde_json::from_str(body.get())?;
                let received = now_us();
                samples
                    .latency_us
                    .push(received.saturating_sub(d.event.details.t));
                let proof = AckProof {
                    delivery_id: d.delivery.id.to_owned(),
                    epoch: d.delivery.lease_epoch.parse()?,
                    lease_secret: LeaseSecret::new(d.lease_secret),
                };
                let ack = frames::ack(&session_id, &proof);
                sent.insert(ack.message_id, Instant::now());
                ws.send(Message::text(ack.text)).await?;
            }
            "ack" => {
                if let Some(at) = frame.reply_to.and_then(|r| sent.remove(r)) {
                    samples.ack_rtt_us.push(at.elapsed().as_micros() as u64);
                    tracker.acked();
                }
            }
            _ => bail!("unexpected frame: {}", text.as_str()),
        }
    }
    let _ = ws.close(None).await;
    Ok(samples)
}

/// One run: a fresh node, S subscriptions, C consumers, N results.
pub async fn run_once(opts: &NodeOptions, w: &Workload, label: &str) -> Result<RunResult> {
    let node = Node::start(opts).await?;
    let result = run_on(&node, w, label).await;
    let db_bytes = node.database_bytes().await.ok();
    node.stop().await?;
    let mut result = result?;
    result.db_bytes = db_bytes;
    Ok(result)
}

async fn run_on(node: &Node, w: &Workload, label: &str) -> Result<RunResult> {
    let subs = node.subscribe(w.subscriptions).await?;
    // Let start-up allocations settle before the baseline.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let rss_before = rss_kib(node.pid, "VmRSS:");
    let mut sockets = Vec::with_capacity(w.consumers);
    for i in 0..w.consumers {
        sockets.push(connect(&node.base, &node.bearer, &subs[i % subs.len()], w.capacity).await?);
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let rss_connected = rss_kib(node.pid, "VmRSS:");
    let tracker = Tracker::new(w.deliveries(), label);
    let consumers: Vec<_> = sockets
        .into_iter()
        .map(|(ws, session)| drive::spawn_consumer(&tracker, consume(ws, session, tracker.clone())))
        .collect();
    let publisher = OrbitPublisher {
        client: node.client()?,
        queue_id: node.queue_id.clone(),
        filler: w.filler().into(),
    };
    let cpu_before = cpu_ms(node.pid);
    let started = drive::start_publishing(w, publisher, tracker.clone());
    let finished = tracker.finished(w.timeout).await;
    // The node's own CPU time per acknowledged delivery hardly depends on
    // what else runs on the machine (unlike deliveries/s); on SQLite it
    // includes the database work. On stderr, next to the run's line.
    if let (Some(a), Some(b)) = (cpu_before, cpu_ms(node.pid)) {
        let acked = tracker.count().max(1) as f64;
        eprintln!(
            "{label}: node CPU {:.0} ms for {} acked deliveries = {:.1} ms per 1000",
            b - a,
            tracker.count(),
            (b - a) / acked * 1000.0
        );
    }
    let samples = drive::collect_samples(consumers).await;
    let finished = finished?;
    Ok(RunResult {
        acked: tracker.count(),
        elapsed: finished - started,
        latency_us: samples.latency_us,
        ack_rtt_us: samples.ack_rtt_us,
        rss_kib: rss_kib(node.pid, "VmHWM:"),
        rss_per_connection_kib: match (rss_before, rss_connected) {
            (Some(a), Some(b)) => Some((b as f64 - a as f64) / w.consumers as f64),
            _ => None,
        },
        db_bytes: None,
    })
}

/// User + system CPU time of process `pid` so far, in milliseconds
/// (`/proc/PID/stat`, clock ticks of 10 ms as on every Linux this runs on).
pub(crate) fn cpu_ms(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may contain spaces) start at 3.
    let rest = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    Some((utime + stime) * 10.0)
}

/// RSS of a node with 0 and then `n` idle bound sessions (after a warm-up
/// connection), in KiB: `(rss_0, rss_n)`.
pub async fn idle_rss(opts: &NodeOptions, n: usize, capacity: u32) -> Result<(u64, u64)> {
    let node = Node::start(opts).await?;
    let measured = async {
        let subs = node.subscribe(1).await?;
        // Warm-up: the first connections on each worker allocate buffers
        // and thread-local state that later connections reuse.
        for _ in 0..4 {
            let (mut ws, _) = connect(&node.base, &node.bearer, &subs[0], capacity).await?;
            ws.close(None).await?;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
        let rss0 = rss_kib(node.pid, "VmRSS:").context("no RSS")?;
        let mut held = Vec::with_capacity(n);
        for _ in 0..n {
            held.push(connect(&node.base, &node.bearer, &subs[0], capacity).await?);
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
        let rss_n = rss_kib(node.pid, "VmRSS:").context("no RSS")?;
        for (mut ws, _) in held {
            let _ = ws.close(None).await;
        }
        Ok::<_, anyhow::Error>((rss0, rss_n))
    }
    .await;
    node.stop().await?;
    measured
}
