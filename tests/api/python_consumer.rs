//! The Python example consumer (`examples/python/inbox_consumer.py`) as an
//! OS process against a real node (protocol.md §3–6, consumer-guide.md):
//! every result lands in its SQLite Inbox exactly once, processed once, and
//! is ACKed, also across a SIGKILL in the middle of the stream; ACK proofs
//! left unconfirmed by a SIGKILL are sent again by the next run; an event
//! the Inbox already holds is ACKed with its new proof and not processed
//! again; its pings keep an idle session open; SIGTERM stops it cleanly and
//! its log never shows the token. Runs on SQLite and on PostgreSQL.
//!
//! The interpreter is a virtual environment under cargo's target folder,
//! made from `examples/python/requirements.txt` by the first test that
//! needs it (`ORBIT_TEST_PYTHON` names a prepared interpreter instead).

use std::{
    collections::HashSet,
    path::{Path, PathBuf},
    process::{Child, Command, ExitStatus, Stdio},
    sync::OnceLock,
    time::{Duration, Instant},
};

use orbit_events::domain::random_hex_id;
use sea_orm::{ConnectionTrait, DatabaseConnection, Statement};
use serde_json::{Value, json};

use crate::helpers::*;

/// How long a whole consumer run may take before the test fails.
const RUN_DEADLINE: Duration = Duration::from_secs(60);

/// A result's numbers that no double holds: they must reach the Inbox whole.
const EXACT_NUMBERS: &str =
    r#"{"amount":0.1000000000000000000000001,"count":123456789012345678901234567890}"#;

/// A Python interpreter with the example's one dependency installed: the
/// virtual environment `python-venv` under cargo's target folder, made once
/// and reused while `requirements.txt` is unchanged. A lock file keeps two
/// test processes from making it at once; the marker naming what it was
/// made from is written last, by a rename, so a half-made one is made again.
pub(crate) fn python() -> PathBuf {
    static PYTHON: OnceLock<PathBuf> = OnceLock::new();
    PYTHON
        .get_or_init(|| {
            if let Some(prepared) = std::env::var_os("ORBIT_TEST_PYTHON") {
                return PathBuf::from(prepared);
            }
            let requirements = Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("examples")
                .join("python")
                .join("requirements.txt");
            let wanted = std::fs::read_to_string(&requirements).expect("read requirements.txt");
            let target = Path::new(env!("CARGO_TARGET_TMPDIR"));
            std::fs::create_dir_all(target).unwrap();
            let venv = target.join("python-venv");
            let python = venv.join("bin").join("python");
            let marker = venv.join("orbit-requirements.txt");
            let lock = std::fs::File::create(target.join("python-venv.lock")).unwrap();
            lock.lock().expect("lock the Python venv");
            if python.exists() && std::fs::read_to_string(&marker).ok() == Some(wanted.clone()) {
                return python;
            }
            let _ = std::fs::remove_dir_all(&venv);
            let made = Command::new("python3")
                .args(["-m", "venv"])
                .arg(&venv)
                .output()
                .unwrap_or_else(|e| {
                    panic!(
                        "cannot run python3 ({e}): the Python consumer test needs Python 3.11+ \
                         with its venv module (Debian/Ubuntu: apt-get install python3 python3-venv)"
                    )
                });
            assert!(
                made.status.success(),
                "`python3 -m venv` failed: install the venv module (Debian/Ubuntu: apt-get \
                 install python3-venv):\n{}",
                String::from_utf8_lossy(&made.stderr)
            );
            let installed = Command::new(&python)
                .args(["-m", "pip", "install", "--quiet", "-r"])
                .arg(&requirements)
                .output()
                .expect("run pip");
            assert!(
                installed.status.success(),
                "pip install -r examples/python/requirements.txt failed:\n{}",
                String::from_utf8_lossy(&installed.stderr)
            );
            let written = venv.join("orbit-requirements.txt.part");
            std::fs::write(&written, &wanted).unwrap();
            std::fs::rename(&written, &marker).unwrap();
            python
        })
        .clone()
}

/// The Python consumer as an OS process; its stderr collects in one log
/// across restarts. Killed when dropped.
struct PythonConsumer {
    args: Vec<String>,
    address: String,
    token: String,
    log: PathBuf,
    child: Option<Child>,
}

impl PythonConsumer {
    fn start(
        app: &TestApp,
        cred: &Cred,
        subscription: &str,
        inbox: &Path,
        capacity: u32,
    ) -> PythonConsumer {
        let script = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("examples")
            .join("python")
            .join("inbox_consumer.py");
        let mut consumer = PythonConsumer {
            args: vec![
                script.display().to_string(),
                "--subscription".to_owned(),
                subscription.to_owned(),
                "--inbox".to_owned(),
                inbox.display().to_string(),
            ],
            address: app.address.clone(),
            token: cred.token.clone(),
            log: inbox.with_extension(format!("{subscription}.log")),
            child: None,
        };
        consumer.restart(capacity);
        consumer
    }

    fn restart(&mut self, capacity: u32) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap();
        let child = Command::new(python())
            .arg("-u")
            .args(&self.args)
            .args(["--capacity", &capacity.to_string()])
            .env("ORBIT_EVENTS_URL", &self.address)
            .env("ORBIT_EVENTS_TOKEN", &self.token)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start the Python consumer");
        self.child = Some(child);
    }

    /// SIGKILL: no code of the consumer runs.
    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            child.kill().unwrap();
            child.wait().unwrap();
        }
    }

    /// Sends `signal` (`STOP`, `CONT`) with `kill`.
    fn signal(&self, signal: &str) {
        let child = self.child.as_ref().expect("the consumer is running");
        let sent = Command::new("kill")
            .args([format!("-{signal}"), child.id().to_string()])
            .status()
            .unwrap();
        assert!(sent.success(), "kill -{signal} failed");
    }

    /// SIGTERM; returns the exit status once it has stopped.
    async fn terminate(&mut self) -> ExitStatus {
        self.signal("TERM");
        let mut child = self.child.take().expect("the consumer is running");
        let deadline = Instant::now() + DEADLINE;
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "the Python consumer did not stop on SIGTERM:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The exit status if the process has ended by itself.
    fn exited(&mut self) -> Option<ExitStatus> {
        self.child.as_mut().and_then(|c| c.try_wait().unwrap())
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for PythonConsumer {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// The consumer's SQLite Inbox, read-only, opened once the consumer has
/// made the file.
struct Inbox {
    path: PathBuf,
    db: Option<DatabaseConnection>,
}

impl Inbox {
    fn new(dir: &tempfile::TempDir, name: &str) -> Inbox {
        Inbox {
            path: dir.path().join(name),
            db: None,
        }
    }

    async fn db(&mut self) -> Option<&DatabaseConnection> {
        if self.db.is_none() && self.path.exists() {
            let url = format!("sqlite://{}?mode=ro", self.path.display());
            self.db = sea_orm::Database::connect(url.as_str()).await.ok();
        }
        self.db.as_ref()
    }

    /// One integer; 0 while the file or its tables do not exist yet.
    async fn count(&mut self, sql: &str) -> i64 {
        let Some(db) = self.db().await else { return 0 };
        let statement = Statement::from_string(db.get_database_backend(), sql.to_owned());
        match db.query_one_raw(statement).await {
            Ok(Some(row)) => row.try_get_by_index::<i64>(0).unwrap_or(0),
            _ => 0,
        }
    }

    /// The first column of every row, as text.
    async fn texts(&mut self, sql: &str) -> Vec<String> {
        let db = self.db().await.expect("the Inbox exists");
        let statement = Statement::from_string(db.get_database_backend(), sql.to_owned());
        db.query_all_raw(statement)
            .await
            .unwrap()
            .iter()
            .map(|row| row.try_get_by_index::<String>(0).unwrap())
            .collect()
    }
}

/// Polls `done` every 10 ms until it holds; fails after [`RUN_DEADLINE`],
/// or as soon as the consumer has exited, with the consumer's log.
async fn wait_for(what: &str, consumer: &mut PythonConsumer, mut done: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + RUN_DEADLINE;
    while !done().await {
        if let Some(status) = consumer.exited() {
            panic!(
                "the Python consumer exited ({status}) before {what}:\n{}",
                consumer.log()
            );
        }
        assert!(
            Instant::now() < deadline,
            "timed out waiting until {what}; the Python consumer's log:\n{}",
            consumer.log()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A subscription from the start of the queue's log; its id.
async fn subscription(app: &TestApp, cred: &Cred) -> String {
    app.subscribe(cred, json!({ "from_sequence": "0" })).await["id"]
        .as_str()
        .unwrap()
        .to_owned()
}

/// Publishes `n` results of the four types; returns their event ids.
async fn publish(app: &TestApp, cred: &Cred, n: usize) -> Vec<String> {
    let results = (0..n)
        .map(|i| result(&cred.queue_id, TYPES[i % 4]))
        .collect();
    app.publish(cred, results)
        .await
        .into_iter()
        .map(|(id, _)| id)
        .collect()
}

/// Publishes one result whose `snapshot.result` is [`EXACT_NUMBERS`], sent
/// as raw text (a `Value` would round it); returns its event id.
async fn publish_exact_numbers(app: &TestApp, cred: &Cred) -> String {
    let mut one = result(&cred.queue_id, "task.succeeded");
    one["snapshot"]["result"] = json!("EXACT");
    let body = json!({ "results": [one] })
        .to_string()
        .replace(r#""EXACT""#, EXACT_NUMBERS);
    let res = app
        .http
        .post(format!(
            "{}/v1/queues/{}/results",
            app.address, cred.queue_id
        ))
        .bearer_auth(&cred.token)
        .header("Idempotency-Key", random_hex_id())
        .header("Content-Type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 201, "publish the exact numbers");
    let published: Value = res.json().await.unwrap();
    published["data"]["events"][0]["id"]
        .as_str()
        .unwrap()
        .to_owned()
}

/// How many of the subscription's deliveries are ACKED.
async fn acked(app: &TestApp, sub: &str) -> i64 {
    app.scalar(&format!(
        "SELECT COUNT(*) FROM deliveries WHERE subscription_id = '{sub}' AND state = 'ACKED'"
    ))
    .await
}

/// The subscription's status shows nothing waiting: no lag, no PENDING,
/// LEASED or EXPIRED delivery.
async fn assert_no_backlog(app: &TestApp, cred: &Cred, sub: &str) {
    let status = app
        .get(&format!("/v1/subscriptions/{sub}/status"), &cred.token)
        .await;
    assert_eq!(status.status, 200, "{:#}", status.body);
    let d = status.data();
    assert_eq!(
        (
            &d["lag"],
            &d["pending"],
            &d["leased"],
            &d["expired"],
            &d["pending_count"]
        ),
        (&json!("0"), &json!(0), &json!(0), &json!(0), &json!(0)),
        "the subscription still has a backlog: {d:#}"
    );
    assert!(d["oldest_unacked"].is_null(), "{d:#}");
}

/// The Inbox holds exactly `published`, each event once and processed once,
/// and no ACK proof is left unconfirmed.
async fn assert_stored_once(inbox: &mut Inbox, published: &HashSet<String>) {
    let stored = inbox.texts("SELECT event_id FROM inbox").await;
    assert_eq!(stored.len(), published.len(), "one Inbox row per event");
    assert_eq!(
        &stored.into_iter().collect::<HashSet<_>>(),
        published,
        "the Inbox holds exactly the published events"
    );
    let processed_once = inbox
        .count("SELECT COUNT(*) FROM task_results WHERE results_seen = 1")
        .await;
    assert_eq!(
        processed_once,
        published.len() as i64,
        "every event was processed exactly once (one task each)"
    );
    assert_eq!(
        inbox.count("SELECT COUNT(*) FROM unconfirmed_acks").await,
        0,
        "every ACK was confirmed before the consumer stopped"
    );
}

/// A clean stop, and a log without the token.
async fn assert_stops_cleanly(consumer: &mut PythonConsumer, cred: &Cred) {
    let status = consumer.terminate().await;
    let log = consumer.log();
    assert!(status.success(), "exit on SIGTERM: {status}\n{log}");
    assert!(log.contains("inbox_consumer: stopped"), "{log}");
    assert!(
        !log.contains(&cred.token),
        "the token appears in the consumer's log"
    );
}

#[actix_web::test]
async fn the_python_consumer_stores_every_result_once_and_acks_it() {
    let python = python();
    assert!(python.exists(), "no interpreter at {}", python.display());
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let sub = subscription(&app, &cred).await;
    let mut published: HashSet<String> = publish(&app, &cred, 49).await.into_iter().collect();
    let exact = publish_exact_numbers(&app, &cred).await;
    published.insert(exact.clone());
    let dir = tempfile::tempdir().unwrap();
    let mut inbox = Inbox::new(&dir, "inbox.db");

    let mut consumer = PythonConsumer::start(&app, &cred, &sub, &inbox.path, 8);
    wait_for(
        "50 events are stored and ACKed",
        &mut consumer,
        async || {
            inbox.count("SELECT COUNT(*) FROM inbox").await == 50 && acked(&app, &sub).await == 50
        },
    )
    .await;
    assert_stops_cleanly(&mut consumer, &cred).await;

    assert_stored_once(&mut inbox, &published).await;
    assert_eq!(
        inbox
            .count("SELECT COALESCE(SUM(redeliveries), 0) FROM inbox")
            .await,
        0,
        "nothing came twice in an undisturbed run"
    );
    let stored = inbox
        .texts(&format!(
            "SELECT event FROM inbox WHERE event_id = '{exact}'"
        ))
        .await;
    for number in [
        "0.1000000000000000000000001",
        "123456789012345678901234567890",
    ] {
        assert!(
            stored[0].contains(number),
            "the Inbox rounded {number}: {}",
            stored[0]
        );
    }
    assert_no_backlog(&app, &cred, &sub).await;
    app.assert_invariants().await;
}

#[actix_web::test]
async fn a_python_consumer_sigkilled_mid_stream_and_started_again_still_stores_every_result_once() {
    let python = python();
    assert!(python.exists(), "no interpreter at {}", python.display());
    // A short lease: what the killed process held and had not stored comes
    // back soon.
    let app = spawn_app_with(|s| {
        s.timing.lease_ms = 1500;
        s.timing.scan_interval_ms = 100;
        s.timing.sweep_interval_ms = 200;
    })
    .await;
    let cred = app.bootstrap().await;
    let sub = subscription(&app, &cred).await;
    let mut published: HashSet<String> = publish(&app, &cred, 50).await.into_iter().collect();
    let dir = tempfile::tempdir().unwrap();
    let mut inbox = Inbox::new(&dir, "inbox.db");

    // Capacity 1 (a round trip per event), so that the kill lands while
    // the first 50 are still arriving.
    let mut consumer = PythonConsumer::start(&app, &cred, &sub, &inbox.path, 1);
    wait_for("5 events are stored", &mut consumer, async || {
        inbox.count("SELECT COUNT(*) FROM inbox").await >= 5
    })
    .await;
    consumer.kill();
    let stored_at_kill = inbox.count("SELECT COUNT(*) FROM inbox").await;
    let unconfirmed_at_kill = inbox.count("SELECT COUNT(*) FROM unconfirmed_acks").await;

    // More results while it is down, then the same Inbox again.
    published.extend(publish(&app, &cred, 50).await);
    consumer.restart(8);
    wait_for(
        "100 events are stored and ACKed",
        &mut consumer,
        async || {
            inbox.count("SELECT COUNT(*) FROM inbox").await == 100 && acked(&app, &sub).await == 100
        },
    )
    .await;
    assert_stops_cleanly(&mut consumer, &cred).await;

    assert_stored_once(&mut inbox, &published).await;
    assert_no_backlog(&app, &cred, &sub).await;
    let duplicates = inbox
        .count("SELECT COALESCE(SUM(redeliveries), 0) FROM inbox")
        .await;
    report(&format!(
        "python consumer SIGKILLed ({}) with {stored_at_kill} of 50 events stored and \
         {unconfirmed_at_kill} ACKs unconfirmed; after the restart all 100 stored once, \
         {duplicates} redeliveries absorbed by the Inbox",
        backend_name()
    ));
    app.assert_invariants().await;
}

#[actix_web::test]
async fn acks_left_unconfirmed_by_a_sigkilled_python_consumer_are_sent_again_by_its_next_run() {
    let python = python();
    assert!(python.exists(), "no interpreter at {}", python.display());
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let sub = subscription(&app, &cred).await;
    let dir = tempfile::tempdir().unwrap();
    let mut inbox = Inbox::new(&dir, "inbox.db");
    let mut consumer = PythonConsumer::start(&app, &cred, &sub, &inbox.path, 8);
    wait_for("a session is bound", &mut consumer, async || {
        sessions(&app, &cred, &sub).await.len() == 1
    })
    .await;

    // Stopped, the consumer leaves its 8 deliveries unread in the socket;
    // meanwhile the node's writes are held, so that none of its ACKs can
    // commit (and none is answered) once it reads and stores them.
    consumer.signal("STOP");
    let published: HashSet<String> = publish(&app, &cred, 8).await.into_iter().collect();
    crate::protocol_support::wait_until("8 deliveries are leased", || async {
        app.scalar(&format!(
            "SELECT COUNT(*) FROM deliveries WHERE subscription_id = '{sub}' AND state = 'LEASED'"
        ))
        .await
            == 8
    })
    .await;
    let block = crate::protocol_support::block_writes(&app, &sub).await;
    consumer.signal("CONT");
    wait_for("8 events are stored", &mut consumer, async || {
        inbox.count("SELECT COUNT(*) FROM inbox").await == 8
    })
    .await;
    consumer.kill();
    block.release().await;
    assert_eq!(
        inbox.count("SELECT COUNT(*) FROM unconfirmed_acks").await,
        8,
        "the Inbox kept the proof of every ACK that got no reply"
    );

    // The next run sends the kept proofs first: the deliveries are ACKED
    // with their first lease (30 s, far from lapsing), never delivered again.
    consumer.restart(8);
    wait_for("the kept proofs are confirmed", &mut consumer, async || {
        inbox.count("SELECT COUNT(*) FROM unconfirmed_acks").await == 0
            && acked(&app, &sub).await == 8
    })
    .await;
    assert_stops_cleanly(&mut consumer, &cred).await;
    assert_stored_once(&mut inbox, &published).await;
    assert_eq!(
        app.scalar(&format!(
            "SELECT COUNT(*) FROM deliveries WHERE subscription_id = '{sub}' AND lease_epoch = 1"
        ))
        .await,
        8,
        "no delivery was leased again"
    );
    assert_eq!(
        inbox
            .count("SELECT COALESCE(SUM(redeliveries), 0) FROM inbox")
            .await,
        0
    );
    assert_no_backlog(&app, &cred, &sub).await;
    app.assert_invariants().await;
}

/// A second subscription of the same queue delivers the same events (the
/// same event ids) with proofs of its own: to the consumer, exactly a
/// redelivery of what its Inbox holds, brought about on demand.
#[actix_web::test]
async fn an_event_the_python_inbox_already_holds_is_acked_with_its_new_proof_and_not_processed_again()
 {
    let python = python();
    assert!(python.exists(), "no interpreter at {}", python.display());
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let first = subscription(&app, &cred).await;
    let second = subscription(&app, &cred).await;
    let published: HashSet<String> = publish(&app, &cred, 20).await.into_iter().collect();
    let dir = tempfile::tempdir().unwrap();
    let mut inbox = Inbox::new(&dir, "inbox.db");

    let mut consumer = PythonConsumer::start(&app, &cred, &first, &inbox.path, 8);
    wait_for(
        "20 events are stored and ACKed",
        &mut consumer,
        async || {
            inbox.count("SELECT COUNT(*) FROM inbox").await == 20 && acked(&app, &first).await == 20
        },
    )
    .await;
    assert_stops_cleanly(&mut consumer, &cred).await;

    let mut again = PythonConsumer::start(&app, &cred, &second, &inbox.path, 8);
    wait_for(
        "the second subscription's 20 deliveries are ACKed",
        &mut again,
        async || acked(&app, &second).await == 20,
    )
    .await;
    assert_stops_cleanly(&mut again, &cred).await;

    assert_stored_once(&mut inbox, &published).await;
    assert_eq!(
        inbox
            .count("SELECT COUNT(*) FROM inbox WHERE redeliveries = 1")
            .await,
        20,
        "each event came once more and was recognized in the Inbox"
    );
    for sub in [&first, &second] {
        assert_no_backlog(&app, &cred, sub).await;
    }
    app.assert_invariants().await;
}

/// The ids of the sessions bound to the subscription, from its status.
async fn sessions(app: &TestApp, cred: &Cred, sub: &str) -> Vec<String> {
    let status = app
        .get(&format!("/v1/subscriptions/{sub}/status"), &cred.token)
        .await;
    assert_eq!(status.status, 200, "{:#}", status.body);
    status.data()["sessions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["session_id"].as_str().unwrap().to_owned())
        .collect()
}

#[actix_web::test]
async fn the_python_consumer_keeps_an_idle_session_alive_with_pings() {
    let python = python();
    assert!(python.exists(), "no interpreter at {}", python.display());
    // Without a valid frame from the consumer for 600 ms the node closes
    // the connection; deliveries would not count, only its pings.
    let app = spawn_app_with(|s| {
        s.timing.heartbeat_interval_ms = 200;
        s.timing.read_idle_timeout_ms = 600;
    })
    .await;
    let cred = app.bootstrap().await;
    let sub = subscription(&app, &cred).await;
    let dir = tempfile::tempdir().unwrap();
    let inbox = Inbox::new(&dir, "inbox.db");
    let mut consumer = PythonConsumer::start(&app, &cred, &sub, &inbox.path, 8);
    let mut bound = Vec::new();
    wait_for("a session is bound", &mut consumer, async || {
        bound = sessions(&app, &cred, &sub).await;
        bound.len() == 1
    })
    .await;

    // Four read-idle timeouts with nothing to deliver: the same session
    // stays bound all along.
    let watched = Instant::now();
    while watched.elapsed() < Duration::from_millis(2400) {
        assert_eq!(
            sessions(&app, &cred, &sub).await,
            bound,
            "the idle session was closed; the Python consumer's log:\n{}",
            consumer.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let published = publish(&app, &cred, 1).await;
    wait_for("the result is ACKed", &mut consumer, async || {
        acked(&app, &sub).await == 1
    })
    .await;
    assert_eq!(sessions(&app, &cred, &sub).await, bound);
    let log = consumer.log();
    assert_eq!(
        log.matches("inbox_consumer: connected").count(),
        1,
        "one connection for the whole run:\n{log}"
    );
    assert_stops_cleanly(&mut consumer, &cred).await;
    let mut inbox = inbox;
    assert_stored_once(&mut inbox, &published.into_iter().collect()).await;
    app.assert_invariants().await;
}
