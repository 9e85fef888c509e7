//! Nothing confirmed is lost when the database refuses writes (decision
//! 0076): a filesystem that fills up (a small tmpfs, as root), a page limit
//! reached (`PRAGMA max_page_count`, without root), PostgreSQL connections
//! killed mid-run. Publishers and a consumer run through the fault; every
//! `201` and every confirmed ACK must be in the database after a restart,
//! no sequence may be confirmed to two events, and the node writes again
//! once the fault is gone, without a restart.

use std::{
    collections::{HashMap, HashSet},
    path::{Path, PathBuf},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use futures_util::SinkExt;
use orbit_events::{config::Settings, domain::random_hex_id};
use serde_json::{Value, json};
use tokio_tungstenite::tungstenite::Message;

use crate::{helpers::*, protocol_support::subscription};

/// How long the run may take to reach the fault, and to recover from it.
const PHASE: Duration = Duration::from_secs(60);

/// What every participant confirmed, as told by the node.
#[derive(Default)]
struct Confirmed {
    /// `(event id, sequence)` of every event a `201` named.
    events: Mutex<Vec<(String, u64)>>,
    /// Delivery ids of every ACK answered with `ack`.
    acks: Mutex<HashSet<String>>,
    /// Publishes answered 503 `UNAVAILABLE`.
    refused: AtomicU64,
    /// `/readyz` answers 503 seen.
    not_ready: AtomicU64,
    /// ACKs confirmed after the fault ended.
    acks_after: AtomicU64,
    /// Publishes answered 201 after the fault ended.
    published_after: AtomicU64,
    recovered: AtomicBool,
    stop: AtomicBool,
}

/// One `POST …/results` of 10 results with ~2 KB of result each; answers
/// `201` (recorded) or 503 `UNAVAILABLE`, nothing else.
async fn publish_once(app: &TestApp, cred: &Cred, seen: &Confirmed) {
    let blob = "x".repeat(2_000);
    let results: Vec<Value> = (0..10)
        .map(|_| {
            let mut r = result(&cred.queue_id, "task.succeeded");
            r["snapshot"]["result"] = json!({ "blob": blob });
            r
        })
        .collect();
    let res = app
        .request(
            reqwest::Method::POST,
            &format!("/v1/queues/{}/results", cred.queue_id),
            Some(&cred.token),
            Some(&random_hex_id()),
            Some(&json!({ "results": results })),
        )
        .await;
    match res.status.as_u16() {
        201 => {
            let events: Vec<(String, u64)> = res.data()["events"]
                .as_array()
                .unwrap()
                .iter()
                .map(|e| {
                    (
                        e["id"].as_str().unwrap().to_owned(),
                        e["sequence"].as_str().unwrap().parse().unwrap(),
                    )
                })
                .collect();
            seen.events.lock().unwrap().extend(events);
            if seen.recovered.load(Ordering::SeqCst) {
                seen.published_after.fetch_add(1, Ordering::SeqCst);
            }
        }
        503 => {
            res.assert_error(503, "UNAVAILABLE");
            seen.refused.fetch_add(1, Ordering::SeqCst);
        }
        _ => panic!("a publish answered {}: {:#}", res.status, res.body),
    }
}

async fn publisher(app: Arc<TestApp>, cred: Cred, seen: Arc<Confirmed>) {
    while !seen.stop.load(Ordering::SeqCst) {
        publish_once(&app, &cred, &seen).await;
    }
}

/// Binds a session, or `None` when the node refuses (its upgrade or hello
/// fails while the database refuses writes).
async fn try_bind(port: u16, token: &str, subscription_id: &str) -> Option<WsClient> {
    use tokio_tungstenite::tungstenite::{client::IntoClientRequest, http::HeaderValue};
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
    let (stream, _) = tokio_tungstenite::connect_async(req).await.ok()?;
    let mut ws = WsClient {
        stream,
        session_id: None,
        pending: Default::default(),
    };
    match ws.recv_hello(subscription_id).await? {
        welcome if welcome["type"] == "events.welcome" => Some(ws),
        _ => None,
    }
}

impl WsClient {
    /// Sends hello; the reply, or `None` when the connection closed.
    async fn recv_hello(&mut self, subscription_id: &str) -> Option<Value> {
        let hello = self.envelope(
            "events.hello",
            json!({ "subscription_id": subscription_id, "capacity": 32 }),
        );
        self.stream
            .send(Message::text(hello.to_string()))
            .await
            .ok()?;
        match self.recv_within(DEADLINE).await? {
            Received::Frame(reply) => {
                self.session_id = reply["session_id"].as_str().map(str::to_owned);
                Some(reply)
            }
            Received::Closed(_) => None,
        }
    }
}

/// ACKs every delivery at once (without waiting for the reply) and records
/// each ACK the node confirms; reconnects whenever the node closes.
async fn consumer(port: u16, token: String, subscription_id: String, seen: Arc<Confirmed>) {
    while !seen.stop.load(Ordering::SeqCst) {
        let Some(mut ws) = try_bind(port, &token, &subscription_id).await else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let mut asked: HashMap<String, String> = HashMap::new();
        loop {
            if seen.stop.load(Ordering::SeqCst) {
                return;
            }
            let frame = match ws.recv_within(Duration::from_millis(200)).await {
                None => continue,
                Some(Received::Closed(_)) => break,
                Some(Received::Frame(frame)) => frame,
            };
            match frame["type"].as_str().unwrap() {
                "event.deliver" => {
                    let body = &frame["body"];
                    let delivery_id = body["delivery"]["id"].as_str().unwrap().to_owned();
                    let ack = ws.envelope(
                        "event.ack",
                        json!({
                            "delivery_id": delivery_id,
                            "epoch": body["delivery"]["lease_epoch"],
                            "lease_secret": body["lease_secret"],
                        }),
                    );
                    asked.insert(ack["message_id"].as_str().unwrap().to_owned(), delivery_id);
                    if ws
                        .stream
                        .send(Message::text(ack.to_string()))
                        .await
                        .is_err()
                    {
                        break;
                    }
                }
                "ack" => {
                    let delivery_id = asked
                        .remove(frame["reply_to"].as_str().unwrap())
                        .expect("an ack replies to an event.ack of this session");
                    assert_eq!(frame["body"]["delivery_id"], delivery_id.as_str());
                    seen.acks.lock().unwrap().insert(delivery_id);
                    if seen.recovered.load(Ordering::SeqCst) {
                        seen.acks_after.fetch_add(1, Ordering::SeqCst);
                    }
                }
                "error" => {
                    let code = frame["error"]["code"].as_str().unwrap();
                    assert!(
                        ["UNAVAILABLE", "DELIVERY_LEASE_LOST"].contains(&code),
                        "unexpected error frame {frame:#}"
                    );
                }
                other => panic!("unexpected frame type {other}: {frame:#}"),
            }
        }
    }
}

async fn readiness(app: Arc<TestApp>, seen: Arc<Confirmed>) {
    while !seen.stop.load(Ordering::SeqCst) {
        let res = app.http.get(format!("{}/readyz", app.address)).send().await;
        if res.is_ok_and(|r| r.status() == 503) && !seen.recovered.load(Ordering::SeqCst) {
            seen.not_ready.fetch_add(1, Ordering::SeqCst);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until `done` holds, failing after [`PHASE`] with `what`.
async fn phase(what: &str, done: impl Fn() -> bool) {
    let deadline = Instant::now() + PHASE;
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `/readyz` and the writer's and database's lines of `/metrics`: what a
/// failed recovery leaves to read.
async fn node_state(app: &TestApp) -> String {
    let mut state = String::new();
    for path in ["/readyz", "/metrics"] {
        let body = match app.http.get(format!("{}{path}", app.address)).send().await {
            Ok(res) => format!("{} {}", res.status(), res.text().await.unwrap_or_default()),
            Err(err) => format!("{err}"),
        };
        let keep = |l: &&str| {
            path == "/readyz"
                || (!l.starts_with('#')
                    && ["writer", "database", "fault", "checkpoint", "wal"]
                        .iter()
                        .any(|k| l.contains(k)))
        };
        state.push_str(&format!("{path}:\n"));
        for line in body.lines().filter(keep) {
            state.push_str(line);
            state.push('\n');
        }
    }
    state
}

/// The fault a run goes through.
trait Fault {
    /// Starts it once traffic flows (the database stops accepting writes).
    async fn start(&mut self, app: &TestApp);
    /// True once the node was seen refusing writes enough to stop.
    fn reached(&self, seen: &Confirmed) -> bool;
    /// Ends it (space freed, limit lifted, killing stopped).
    async fn end(&mut self, app: &TestApp);
}

/// Runs publishers, a consumer and a readiness probe through `fault`,
/// restarts the node and checks what was confirmed.
async fn run_through(
    customize: impl Fn(&mut Settings) + Clone,
    mut fault: impl Fault,
    expect_not_ready: bool,
) {
    capture_logs();
    let app = Arc::new(
        spawn_app_with({
            let customize = customize.clone();
            move |s| {
                s.timing.lease_ms = 1_000;
                customize(s)
            }
        })
        .await,
    );
    let settings = app.settings.clone();
    let cred = app.bootstrap().await;
    let sub = subscription(&app, &cred).await;
    let seen = Arc::new(Confirmed::default());
    let mut tasks = Vec::new();
    for _ in 0..3 {
        tasks.push(tokio::spawn(publisher(
            app.clone(),
            cred.clone(),
            seen.clone(),
        )));
    }
    tasks.push(tokio::spawn(consumer(
        app.port,
        cred.token.clone(),
        sub.clone(),
        seen.clone(),
    )));
    tasks.push(tokio::spawn(readiness(app.clone(), seen.clone())));

    phase("traffic flows", || seen.acks.lock().unwrap().len() >= 10).await;
    fault.start(&app).await;
    // Through the fault and beyond: until the node has refused enough, or
    // for a while (a node that never refuses fails below, on what it lost
    // or on not refusing).
    let through = Instant::now() + Duration::from_secs(10);
    while !fault.reached(&seen) && Instant::now() < through {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let refused = seen.refused.load(Ordering::SeqCst);
    fault.end(&app).await;
    seen.recovered.store(true, Ordering::SeqCst);
    let refused_before = seen.refused.load(Ordering::SeqCst);
    let deadline = Instant::now() + PHASE;
    while seen.published_after.load(Ordering::SeqCst) < 3
        || seen.acks_after.load(Ordering::SeqCst) < 3
    {
        if Instant::now() >= deadline {
            panic!(
                "timed out waiting until publishes and ACKs commit again: {} publishes and {} ACKs confirmed since the fault ended, {} refused since; the node said:\n{}\nthe nodes of this process logged:\n{}",
                seen.published_after.load(Ordering::SeqCst),
                seen.acks_after.load(Ordering::SeqCst),
                seen.refused.load(Ordering::SeqCst) - refused_before,
                node_state(&app).await,
                captured_logs()
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    seen.stop.store(true, Ordering::SeqCst);
    for task in tasks {
        task.await.unwrap();
    }
    let not_ready = seen.not_ready.load(Ordering::SeqCst);
    let app = Arc::into_inner(app).expect("every task has ended");
    drop(app);

    // A new node on the same database.
    let app = spawn_app_with(|s| {
        *s = settings.clone();
        s.server.listen = "127.0.0.1:0".to_owned();
    })
    .await;
    let events = seen.events.lock().unwrap().clone();
    let acks = seen.acks.lock().unwrap().clone();
    let mut sequences = HashSet::new();
    for (_, sequence) in &events {
        assert!(
            sequences.insert(*sequence),
            "sequence {sequence} was confirmed to two events"
        );
    }
    let stored: HashMap<String, i64> = app
        .db_rows("SELECT id, sequence FROM result_events")
        .await
        .into_iter()
        .collect();
    let lost: Vec<&(String, u64)> = events
        .iter()
        .filter(|(id, sequence)| stored.get(id) != Some(&(*sequence as i64)))
        .collect();
    assert!(
        lost.is_empty(),
        "{} of {} confirmed events are not in the database as confirmed, e.g. {:?}",
        lost.len(),
        events.len(),
        lost.first()
    );
    let acked: HashSet<String> = app
        .column::<String>("SELECT id FROM deliveries WHERE state = 'ACKED'")
        .await
        .into_iter()
        .collect();
    let reverted: Vec<&String> = acks.iter().filter(|id| !acked.contains(*id)).collect();
    assert!(
        reverted.is_empty(),
        "{} of {} confirmed ACKs are not ACKED after the restart",
        reverted.len(),
        acks.len()
    );
    app.assert_invariants().await;
    assert!(refused > 0, "no publish was refused while the fault lasted");
    if expect_not_ready {
        assert!(
            not_ready > 0,
            "/readyz never answered 503 while writes were refused"
        );
    }
    report(&format!(
        "{}: {} events and {} ACKs confirmed, {refused} publishes refused while the fault lasted, /readyz 503 {not_ready} times",
        std::thread::current().name().unwrap_or("disk_full"),
        events.len(),
        acks.len(),
    ));
}

/// A tmpfs (24 MiB unless told), mounted for the test and unmounted when
/// dropped; a filler file leaves the node a little room.
struct Tmpfs {
    dir: tempfile::TempDir,
    filler: PathBuf,
}

impl Tmpfs {
    fn mount() -> Tmpfs {
        Tmpfs::mount_of("24m")
    }

    fn mount_of(size: &str) -> Tmpfs {
        let dir = tempfile::tempdir().unwrap();
        let status = std::process::Command::new("mount")
            .args([
                "-t",
                "tmpfs",
                "-o",
                &format!("size={size}"),
                "orbit-disk-full",
            ])
            .arg(dir.path())
            .status()
            .unwrap();
        assert!(status.success(), "mount tmpfs");
        let filler = dir.path().join("filler");
        Tmpfs { dir, filler }
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Fills the filesystem up to `free` bytes left.
    fn fill_leaving(&self, free: u64) {
        let available = available_bytes(self.path());
        let size = available.saturating_sub(free);
        let file = std::fs::File::create(&self.filler).unwrap();
        // Real blocks, not a sparse file: tmpfs counts only written pages.
        use std::io::Write;
        let mut file = std::io::BufWriter::new(file);
        let chunk = vec![0u8; 1 << 16];
        let mut left = size;
        while left > 0 {
            let n = left.min(chunk.len() as u64) as usize;
            if file.write_all(&chunk[..n]).is_err() {
                break;
            }
            left -= n as u64;
        }
        let _ = file.flush();
    }

    fn free_space(&self) {
        std::fs::remove_file(&self.filler).unwrap();
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(self.dir.path())
            .status();
    }
}

fn available_bytes(path: &Path) -> u64 {
    let out = std::process::Command::new("df")
        .args(["--output=avail", "-B1"])
        .arg(path)
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .nth(1)
        .and_then(|l| l.trim().parse().ok())
        .unwrap()
}

struct FillingDisk(Tmpfs);

impl Fault for FillingDisk {
    async fn start(&mut self, _: &TestApp) {
        self.0.fill_leaving(1 << 20);
    }
    fn reached(&self, seen: &Confirmed) -> bool {
        seen.refused.load(Ordering::SeqCst) >= 50 && seen.not_ready.load(Ordering::SeqCst) > 0
    }
    async fn end(&mut self, _: &TestApp) {
        self.0.free_space();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_filling_disk_loses_no_confirmed_publish_or_ack_and_the_node_writes_again_once_space_is_freed()
 {
    if skip_unless_backend(
        "sqlite",
        "a full disk is a SQLite fault (PostgreSQL: see the killed-connections test)",
    ) {
        return;
    }
    // SAFETY of the check: geteuid has no preconditions.
    if !running_as_root() {
        report(
            "skipped a_filling_disk_loses_no_confirmed_publish_or_ack_and_the_node_writes_again_once_space_is_freed: mounting a tmpfs needs root (the page-limit test covers the rule)",
        );
        return;
    }
    let disk = Tmpfs::mount();
    let url = format!(
        "sqlite://{}/orbit-events.db?mode=rwc",
        disk.path().display()
    );
    run_through(
        move |s| s.database.url = url.clone(),
        FillingDisk(disk),
        true,
    )
    .await;
}

fn running_as_root() -> bool {
    std::process::Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

#[cfg(feature = "test-hooks")]
struct PageLimit;

#[cfg(feature = "test-hooks")]
impl Fault for PageLimit {
    async fn start(&mut self, app: &TestApp) {
        let pages = app
            .scalar("SELECT page_count FROM pragma_page_count()")
            .await as u64;
        // A few pages more than the file has: the next writes reach it.
        app.state.db.set_max_page_count(Some(pages + 8));
    }
    fn reached(&self, seen: &Confirmed) -> bool {
        seen.refused.load(Ordering::SeqCst) >= 50 && seen.not_ready.load(Ordering::SeqCst) > 0
    }
    async fn end(&mut self, app: &TestApp) {
        app.state.db.set_max_page_count(None);
    }
}

#[cfg(feature = "test-hooks")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_page_limit_reached_loses_no_confirmed_publish_or_ack_and_the_node_writes_again_once_it_is_lifted()
 {
    if skip_unless_backend("sqlite", "max_page_count is SQLite's") {
        return;
    }
    let dir = Arc::new(tempfile::tempdir().unwrap());
    let url = format!("sqlite://{}/orbit-events.db?mode=rwc", dir.path().display());
    run_through(move |s| s.database.url = url.clone(), PageLimit, true).await;
    drop(dir);
}

/// Terminates the node's PostgreSQL connections every 50 ms.
struct KilledConnections {
    killer: Option<(Arc<AtomicBool>, tokio::task::JoinHandle<u64>)>,
}

impl Fault for KilledConnections {
    async fn start(&mut self, app: &TestApp) {
        use sea_orm::ConnectionTrait;
        let server = std::env::var("ORBIT_TEST_DATABASE_URL").unwrap();
        let database = app
            .settings
            .database
            .url
            .rsplit('/')
            .next()
            .unwrap()
            .to_owned();
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let killer = tokio::spawn(async move {
            let admin = sea_orm::Database::connect(server.as_str()).await.unwrap();
            let mut killed = 0;
            while !stopped.load(Ordering::SeqCst) {
                let rows = admin
                    .query_all_raw(sea_orm::Statement::from_string(
                        sea_orm::DbBackend::Postgres,
                        format!(
                            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                             WHERE datname = '{database}' AND pid <> pg_backend_pid() \
                             AND backend_type = 'client backend'"
                        ),
                    ))
                    .await
                    .unwrap();
                killed += rows.len() as u64;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            let _ = admin.execute_unprepared("SELECT 1").await;
            killed
        });
        self.killer = Some((stop, killer));
    }
    fn reached(&self, seen: &Confirmed) -> bool {
        seen.refused.load(Ordering::SeqCst) >= 20
    }
    async fn end(&mut self, _: &TestApp) {
        if let Some((stop, killer)) = self.killer.take() {
            stop.store(true, Ordering::SeqCst);
            let killed = killer.await.unwrap();
            assert!(killed > 0, "no connection was killed");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn killed_database_connections_lose_no_confirmed_publish_or_ack() {
    if skip_unless_postgres() {
        return;
    }
    run_through(|_| {}, KilledConnections { killer: None }, false).await;
}

impl TestApp {
    /// `(id, sequence)` rows of a query.
    async fn db_rows(&self, sql: &str) -> Vec<(String, i64)> {
        use sea_orm::ConnectionTrait;
        let backend = self.db.reader().get_database_backend();
        self.db
            .reader()
            .query_all_raw(sea_orm::Statement::from_string(backend, sql.to_owned()))
            .await
            .unwrap()
            .iter()
            .map(|row| {
                (
                    row.try_get_by_index::<String>(0).unwrap(),
                    row.try_get_by_index::<i64>(1).unwrap(),
                )
            })
            .collect()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_wal_that_would_outgrow_a_small_volume_is_checkpointed_before_it_fills_it() {
    if skip_unless_backend("sqlite", "the WAL is SQLite's") {
        return;
    }
    if !running_as_root() {
        report(
            "skipped a_wal_that_would_outgrow_a_small_volume_is_checkpointed_before_it_fills_it: mounting a tmpfs needs root",
        );
        return;
    }
    // 16 MiB hold the data of this run many times over, but not the WAL
    // SQLite keeps before its own checkpoint (32 MiB, decision 0067).
    let disk = Tmpfs::mount_of("16m");
    let url = format!(
        "sqlite://{}/orbit-events.db?mode=rwc",
        disk.path().display()
    );
    let app = spawn_app_with(move |s| s.database.url = url.clone()).await;
    let cred = app.bootstrap().await;
    let wal = disk.path().join("orbit-events.db-wal");
    let mut largest = 0;
    let started = Instant::now();
    let mut published = 0;
    // Until the WAL has been written well past the volume's size.
    while published < 4_000 && started.elapsed() < PHASE {
        app.publish(&cred, vec![result(&cred.queue_id, "task.succeeded")])
            .await;
        published += 1;
        largest = largest.max(std::fs::metadata(&wal).map_or(0, |m| m.len()));
    }
    let db = std::fs::metadata(disk.path().join("orbit-events.db"))
        .unwrap()
        .len();
    report(&format!(
        "{published} publishes on a 16 MiB volume: WAL at most {} KiB, database {} KiB",
        largest >> 10,
        db >> 10
    ));
    assert!(largest < 16 << 20, "the WAL reached {largest} bytes");
    assert!(!app.state.db.refusing_writes());
}
