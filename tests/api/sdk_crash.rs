//! Crash verification with real OS processes (quality-bar.md
//! "Reliability", delivery-model.md §1 promise 3, protocol.md §5): an
//! `orbit-events serve` process and the `inbox_consumer` process
//! (`examples/inbox-consumer/`), each SIGKILLed five times at random
//! moments and started again, while 10,000 results are published through
//! the node. At the end the Inbox holds every event exactly once, each was
//! processed once, every delivery is ACKED, and the duplicates the Inbox
//! absorbed are reported.
//! Runs on SQLite and on PostgreSQL.

use std::{
    collections::HashSet,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::OnceLock,
    time::{Duration, Instant},
};

use orbit_events_client::{
    Client, CreateSubscription, IdempotencyKey, NewResult, ResultType, Token,
};
use rand::{RngExt, SeedableRng, rngs::StdRng, seq::SliceRandom};
use sea_orm::{ConnectionTrait, DatabaseConnection, Statement};
use serde_json::Value;

use crate::{helpers::*, sdk_support::ServerProcess};

const RESULTS: usize = 10_000;
const BATCH: usize = 100;
const KILLS_EACH: usize = 5;
/// How long the whole run may take before the test fails.
const RUN_DEADLINE: Duration = Duration::from_secs(300);

/// The inbox consumer (the `inbox_consumer` program of the workspace
/// package `examples/inbox-consumer/`, decision 0083), built (or found up
/// to date) by cargo with this test binary's profile and features: `cargo
/// test` builds no program of another package for a test. Returns its
/// path.
pub fn inbox_consumer_exe() -> PathBuf {
    workspace_program("inbox_consumer")
}

/// A program of the workspace's example packages (`inbox_consumer`,
/// `outbox_producer`), built as [`inbox_consumer_exe`] says.
pub fn workspace_program(name: &str) -> PathBuf {
    static BUILT: OnceLock<Vec<(String, PathBuf)>> = OnceLock::new();
    let built = BUILT.get_or_init(|| {
        // The same selection as `scripts/test`, so that nothing but the
        // consumer itself is built (another selection would unify features
        // differently and rebuild the dependencies).
        let mut cargo = Command::new(env!("CARGO"));
        cargo
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .args(["build", "--workspace", "--all-targets"])
            .arg("--message-format=json-render-diagnostics")
            .stderr(Stdio::inherit());
        // Cargo gives a test the variables of its package; build scripts
        // that read them (ring's) would see a change and be rebuilt.
        for (name, _) in std::env::vars_os() {
            let name = name.to_string_lossy();
            if ["CARGO_PKG_", "CARGO_BIN_", "CARGO_MANIFEST_"]
                .iter()
                .any(|p| name.starts_with(p))
                || [
                    "CARGO_CRATE_NAME",
                    "CARGO_PRIMARY_PACKAGE",
                    "CARGO_TARGET_TMPDIR",
                ]
                .contains(&name.as_ref())
            {
                cargo.env_remove(name.as_ref());
            }
        }
        if cfg!(feature = "test-hooks") {
            cargo.args(["--features", "test-hooks"]);
        }
        if !cfg!(debug_assertions) {
            cargo.arg("--release");
        }
        let out = cargo.output().expect("run cargo build");
        assert!(
            out.status.success(),
            "cargo build of the workspace's programs failed"
        );
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter(|m| {
                m["reason"] == "compiler-artifact"
                    && m["target"]["kind"] == serde_json::json!(["bin"])
                    && m["profile"]["test"] == false
            })
            .filter_map(|m| {
                let exe = m["executable"].as_str()?;
                Some((m["target"]["name"].as_str()?.to_owned(), PathBuf::from(exe)))
            })
            .collect()
    });
    built
        .iter()
        .find(|(program, _)| program == name)
        .map(|(_, exe)| exe.clone())
        .unwrap_or_else(|| panic!("cargo named no {name} executable"))
}

/// A credential made by the real `orbit-events bootstrap` command.
fn bootstrap_process(database_url: &str) -> (String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_orbit-events"))
        .args([
            "bootstrap",
            "--namespace",
            "crash",
            "--application",
            "inbox",
            "--queue",
            "results",
        ])
        .args(["--event-access", "--publish-access"])
        .env("ORBIT_EVENTS__DATABASE__URL", database_url)
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "bootstrap: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let printed: Value = serde_json::from_slice(&out.stdout).unwrap();
    (
        printed["token"].as_str().unwrap().to_owned(),
        printed["queue_id"].as_str().unwrap().to_owned(),
    )
}

/// The inbox consumer as an OS process; its stderr collects in one log.
struct ConsumerProcess {
    command: Vec<String>,
    token: String,
    log: PathBuf,
    child: Option<Child>,
}

impl ConsumerProcess {
    fn start(
        server: &str,
        token: &str,
        subscription: &str,
        inbox: &Path,
        log: &Path,
    ) -> ConsumerProcess {
        let mut consumer = ConsumerProcess {
            command: vec![
                inbox_consumer_exe().display().to_string(),
                "--server".to_owned(),
                server.to_owned(),
                "--subscription".to_owned(),
                subscription.to_owned(),
                "--inbox".to_owned(),
                inbox.display().to_string(),
                "--capacity".to_owned(),
                "16".to_owned(),
            ],
            token: token.to_owned(),
            log: log.to_owned(),
            child: None,
        };
        consumer.restart();
        consumer
    }

    fn restart(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap();
        let child = Command::new(&self.command[0])
            .args(&self.command[1..])
            .env("ORBIT_EVENTS_TOKEN", &self.token)
            .env_remove("ORBIT_EVENTS_URL")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        self.child = Some(child);
    }

    /// SIGKILL.
    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            child.kill().unwrap();
            child.wait().unwrap();
        }
    }

    /// SIGTERM, then waits for the exit; returns whether it succeeded.
    async fn terminate(&mut self) -> bool {
        let Some(mut child) = self.child.take() else {
            return false;
        };
        let status = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
        let deadline = Instant::now() + DEADLINE;
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                return status.success();
            }
            assert!(
                Instant::now() < deadline,
                "the consumer did not stop on SIGTERM: {}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for ConsumerProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

async fn count(db: &DatabaseConnection, sql: &str) -> i64 {
    let backend = db.get_database_backend();
    let row = db
        .query_one_raw(Statement::from_string(backend, sql.to_owned()))
        .await
        .unwrap()
        .unwrap();
    row.try_get_by_index::<i64>(0).unwrap()
}

async fn texts(db: &DatabaseConnection, sql: &str) -> Vec<String> {
    let backend = db.get_database_backend();
    db.query_all_raw(Statement::from_string(backend, sql.to_owned()))
        .await
        .unwrap()
        .iter()
        .map(|row| row.try_get_by_index::<String>(0).unwrap())
        .collect()
}

/// Publishes every result in batches of 100 through `client`, resending a
/// batch with the same idempotency key until the node (killed now and
/// then) answers. Returns the event ids.
async fn publish_all(client: Client, queue_id: String, started: Instant) -> HashSet<String> {
    let mut ids = HashSet::new();
    for _ in 0..RESULTS / BATCH {
        let now = chrono::Utc::now();
        let batch: Vec<NewResult> = (0..BATCH)
            .map(|i| {
                let task = orbit_events::domain::random_hex_id();
                NewResult::new(ResultType::ALL[i % 4], &queue_id, &task, 1, now)
            })
            .collect();
        let key = IdempotencyKey::random();
        let published = loop {
            match client.publish_results(&queue_id, &key, &batch).await {
                Ok(published) => break published,
                Err(e) if e.is_retryable() => {
                    assert!(started.elapsed() < RUN_DEADLINE, "publishing: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => panic!("publish: {e}"),
            }
        };
        ids.extend(published.events.into_iter().map(|e| e.id));
    }
    assert_eq!(ids.len(), RESULTS, "every published event id is distinct");
    ids
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Victim {
    Server,
    Consumer,
}

#[actix_web::test]
async fn server_and_inbox_consumer_each_sigkilled_five_times_leave_every_event_in_the_inbox_exactly_once_and_every_delivery_acked()
 {
    let seed: u64 = std::env::var("ORBIT_CRASH_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| rand::rng().random());
    let mut rng = StdRng::seed_from_u64(seed);
    // Not beside the three-node runs: together they would starve each other.
    let _heavy = crate::multinode::CLUSTER.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let database_url = fresh_database_url(&dir).await;
    let server_log = dir.path().join("server.log");
    let consumer_log = dir.path().join("consumer.log");
    let inbox = dir.path().join("inbox.db");
    let exe = inbox_consumer_exe();
    assert!(exe.exists());

    // Short leases, so that what a killed process held comes back soon.
    let timing = [
        ("ORBIT_EVENTS__TIMING__LEASE_MS", "1500"),
        ("ORBIT_EVENTS__TIMING__SCAN_INTERVAL_MS", "100"),
        ("ORBIT_EVENTS__TIMING__SWEEP_INTERVAL_MS", "500"),
    ];
    let env: Vec<(&str, String)> = timing.iter().map(|(k, v)| (*k, v.to_string())).collect();
    let mut server = ServerProcess::start(&database_url, &env, &server_log).await;
    let (token, queue_id) = bootstrap_process(&database_url);
    let client = Client::new(&server.address(), Token::new(token.clone()).unwrap()).unwrap();
    let create = CreateSubscription {
        from_sequence: Some(0),
        max_pending: Some(1000),
        ..CreateSubscription::new("crash-inbox", &queue_id)
    };
    let sub = client
        .create_subscription(&IdempotencyKey::random(), &create)
        .await
        .unwrap()
        .subscription
        .id;
    let mut consumer =
        ConsumerProcess::start(&server.address(), &token, &sub, &inbox, &consumer_log);

    // Ten kills at random points of the run, in random order.
    let mut victims = [[Victim::Server; KILLS_EACH], [Victim::Consumer; KILLS_EACH]].concat();
    victims.shuffle(&mut rng);
    let mut thresholds: Vec<i64> = (0..victims.len())
        .map(|_| rng.random_range(RESULTS as i64 / 20..RESULTS as i64 * 9 / 10))
        .collect();
    thresholds.sort();
    let mut plan: Vec<(i64, Victim, Duration)> = thresholds
        .into_iter()
        .zip(victims)
        .map(|(at, victim)| (at, victim, Duration::from_millis(rng.random_range(0..200))))
        .collect();
    plan.reverse();

    let started = Instant::now();
    let publishing = tokio::spawn(publish_all(client, queue_id.clone(), started));
    let server_db = sea_orm::Database::connect(database_url.as_str())
        .await
        .unwrap();
    let acked_sql = format!(
        "SELECT COUNT(*) FROM deliveries WHERE subscription_id = '{sub}' AND state = 'ACKED'"
    );
    let mut inbox_db: Option<DatabaseConnection> = None;
    let mut kills = Vec::new();
    loop {
        assert!(
            started.elapsed() < RUN_DEADLINE,
            "not done after {RUN_DEADLINE:?} (seed {seed}); consumer log:\n{}",
            consumer.log()
        );
        if inbox_db.is_none() && inbox.exists() {
            let url = format!("sqlite://{}?mode=ro", inbox.display());
            inbox_db = sea_orm::Database::connect(url.as_str()).await.ok();
        }
        // 0 until the consumer has created the file and its tables.
        let stored = match &inbox_db {
            Some(db) => {
                let backend = db.get_database_backend();
                let sql = Statement::from_string(backend, "SELECT COUNT(*) FROM inbox".to_owned());
                match db.query_one_raw(sql).await {
                    Ok(Some(row)) => row.try_get_by_index::<i64>(0).unwrap(),
                    _ => 0,
                }
            }
            None => 0,
        };
        if let Some(&(at, victim, delay)) = plan.last()
            && stored >= at
        {
            plan.pop();
            tokio::time::sleep(delay).await;
            let moment = started.elapsed();
            match victim {
                Victim::Server => {
                    server.kill();
                    server.restart().await;
                }
                Victim::Consumer => {
                    consumer.kill();
                    consumer.restart();
                }
            }
            kills.push((victim, stored, moment));
        }
        if plan.is_empty()
            && stored == RESULTS as i64
            && count(&server_db, &acked_sql).await == RESULTS as i64
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let elapsed = started.elapsed();
    let published = publishing.await.unwrap();
    assert!(
        consumer.terminate().await,
        "the consumer's clean stop failed:\n{}",
        consumer.log()
    );

    // The Inbox: each event exactly once, processed once.
    let inbox_db = inbox_db.unwrap();
    let stored: HashSet<String> = texts(&inbox_db, "SELECT event_id FROM inbox")
        .await
        .into_iter()
        .collect();
    assert_eq!(
        count(&inbox_db, "SELECT COUNT(*) FROM inbox").await,
        RESULTS as i64
    );
    assert_eq!(
        stored, published,
        "the Inbox holds exactly the published events"
    );
    assert_eq!(
        count(
            &inbox_db,
            "SELECT COUNT(*) FROM task_results WHERE results_seen = 1"
        )
        .await,
        RESULTS as i64,
        "every event was processed exactly once"
    );
    let duplicates = count(
        &inbox_db,
        "SELECT COALESCE(SUM(redeliveries), 0) FROM inbox",
    )
    .await;

    // The node: every delivery ACKED.
    assert_eq!(
        count(
            &server_db,
            &format!("SELECT COUNT(*) FROM deliveries WHERE subscription_id = '{sub}'")
        )
        .await,
        RESULTS as i64
    );
    assert_eq!(
        count(&server_db, &acked_sql).await,
        RESULTS as i64,
        "every delivery ACKED"
    );
    let acked_ids: HashSet<String> = texts(
        &server_db,
        &format!(
            "SELECT event_id FROM deliveries WHERE subscription_id = '{sub}' AND state = 'ACKED'"
        ),
    )
    .await
    .into_iter()
    .collect();
    assert_eq!(acked_ids, published);
    let releases = count(
        &server_db,
        &format!("SELECT CAST(COALESCE(SUM(lease_epoch - 1), 0) AS BIGINT) FROM deliveries WHERE subscription_id = '{sub}'"),
    )
    .await;

    let server_kills = kills.iter().filter(|k| k.0 == Victim::Server).count();
    let consumer_kills = kills.iter().filter(|k| k.0 == Victim::Consumer).count();
    assert_eq!((server_kills, consumer_kills), (KILLS_EACH, KILLS_EACH));

    report(&format!(
        "crash run ({}): {RESULTS} results published and ACKed in {elapsed:.1?}; server SIGKILLed \
         {server_kills}× and inbox consumer {consumer_kills}× at Inbox counts {:?}; duplicates \
         absorbed by the Inbox: {duplicates}; leases granted again: {releases} (seed {seed})",
        backend_name(),
        kills
            .iter()
            .map(|k| format!("{}:{}", if k.0 == Victim::Server { "S" } else { "C" }, k.1))
            .collect::<Vec<_>>(),
    ));

    // The storage invariants, checked by a node on the same database.
    drop(server);
    let url = database_url.clone();
    let app = spawn_app_with(move |s| s.database.url = url).await;
    app.assert_invariants().await;
}
