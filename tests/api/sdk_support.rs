//! Shared by the `sdk_*` tests: the client crate pointed at a test node, a
//! handler that records what the consumer did, and a consumer run that the
//! test can stop.

use std::{
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use orbit_events_client::{
    Backoff, Client, Consumer, ConsumerError, Delivery, Handler, HandlerError, Outcome, Stopped,
    Token,
};
use serde_json::{Value, json};
use tokio::sync::{Notify, oneshot};

use crate::helpers::*;

/// The management client of `app` with `cred`'s token.
pub fn sdk(app: &TestApp, cred: &Cred) -> Client {
    Client::new(&app.address, Token::new(cred.token.clone()).unwrap()).unwrap()
}

/// A consumer of `subscription_id` on the node at `address` with a quick
/// backoff.
pub fn consumer(address: &str, cred: &Cred, subscription_id: &str, capacity: u32) -> Consumer {
    Consumer::new(
        address,
        Token::new(cred.token.clone()).unwrap(),
        subscription_id,
    )
    .unwrap()
    .capacity(capacity)
    .backoff(Backoff {
        initial: Duration::from_millis(50),
        max: Duration::from_millis(500),
    })
}

/// What a [`Recorder`] saw.
#[derive(Default)]
pub struct Recorded {
    pub deliveries: Vec<Delivery>,
    pub outcomes: Vec<Outcome>,
}

impl Recorded {
    pub fn acked(&self) -> Vec<&orbit_events_client::AckReceipt> {
        self.outcomes
            .iter()
            .filter_map(|o| match o {
                Outcome::Acked(r) => Some(r),
                _ => None,
            })
            .collect()
    }

    pub fn connections(&self) -> usize {
        self.outcomes
            .iter()
            .filter(|o| matches!(o, Outcome::Connected(_)))
            .count()
    }

    pub fn disconnects(&self) -> Vec<String> {
        self.outcomes
            .iter()
            .filter_map(|o| match o {
                Outcome::Disconnected { reason, .. } => Some(reason.clone()),
                _ => None,
            })
            .collect()
    }
}

/// A handler that records every delivery and outcome and stores nothing
/// (every delivery is ACKed).
#[derive(Clone, Default)]
pub struct Recorder {
    pub seen: Arc<Mutex<Recorded>>,
    changed: Arc<Notify>,
}

impl Handler for Recorder {
    async fn handle(&self, delivery: Delivery) -> Result<(), HandlerError> {
        self.seen.lock().unwrap().deliveries.push(delivery);
        self.changed.notify_waiters();
        Ok(())
    }

    fn on_outcome(&self, outcome: &Outcome) {
        self.seen.lock().unwrap().outcomes.push(outcome.clone());
        self.changed.notify_waiters();
    }
}

impl Recorder {
    /// Waits until `check` holds for what was recorded (fails after
    /// [`DEADLINE`]).
    pub async fn until(&self, what: &str, check: impl Fn(&Recorded) -> bool) {
        let deadline = Instant::now() + DEADLINE;
        loop {
            let changed = self.changed.notified();
            if check(&self.seen.lock().unwrap()) {
                return;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(!left.is_zero(), "timed out waiting until {what}");
            let _ = tokio::time::timeout(left.min(Duration::from_millis(100)), changed).await;
        }
    }
}

/// A consumer running on its own task until [`Running::stop`].
pub struct Running {
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<Result<Stopped, ConsumerError>>,
}

impl Running {
    pub fn start<H: Handler>(consumer: Consumer, handler: H) -> Running {
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(consumer.run(handler, async move {
            let _ = stopped.await;
        }));
        Running {
            stop: Some(stop),
            task,
        }
    }

    /// Signals shutdown and waits for the run to end.
    pub async fn stop(mut self) -> Result<Stopped, ConsumerError> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        self.ended().await
    }

    /// Waits for the run to end by itself.
    pub async fn ended(self) -> Result<Stopped, ConsumerError> {
        tokio::time::timeout(DEADLINE, self.task)
            .await
            .expect("the consumer did not stop within the deadline")
            .expect("the consumer task panicked")
    }
}

/// A subscription from the start of the log with `extra` fields; its id.
pub async fn subscription_from_start(app: &TestApp, cred: &Cred, extra: Value) -> String {
    let mut body = json!({ "from_sequence": "0" });
    if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
        b.extend(e.clone());
    }
    app.subscribe(cred, body).await["id"]
        .as_str()
        .unwrap()
        .to_owned()
}

/// The state of one delivery, read from the database.
pub async fn delivery_state(app: &TestApp, delivery_id: &str) -> (String, i64) {
    let state = crate::http_support::scalar_text(
        app,
        &format!("SELECT state FROM deliveries WHERE id = '{delivery_id}'"),
    )
    .await;
    let epoch = app
        .scalar(&format!(
            "SELECT lease_epoch FROM deliveries WHERE id = '{delivery_id}'"
        ))
        .await;
    (state, epoch)
}

/// A [`Recorder`] whose first `gated` calls wait, after recording the
/// delivery, for a permit from [`Gated::release`].
#[derive(Clone)]
pub struct Gated {
    pub recorder: Recorder,
    permits: Arc<tokio::sync::Semaphore>,
    gated: Arc<std::sync::atomic::AtomicUsize>,
}

impl Gated {
    pub fn new(gated: usize) -> Gated {
        Gated {
            recorder: Recorder::default(),
            permits: Arc::new(tokio::sync::Semaphore::new(0)),
            gated: Arc::new(std::sync::atomic::AtomicUsize::new(gated)),
        }
    }

    /// Lets one waiting call return.
    pub fn release(&self) {
        self.permits.add_permits(1);
    }
}

impl Handler for Gated {
    async fn handle(&self, delivery: Delivery) -> Result<(), HandlerError> {
        use std::sync::atomic::Ordering;
        self.recorder.handle(delivery).await?;
        let wait = self
            .gated
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if wait {
            self.permits.acquire().await?.forget();
        }
        Ok(())
    }

    fn on_outcome(&self, outcome: &Outcome) {
        self.recorder.on_outcome(outcome);
    }
}

/// A real `orbit-events serve` process on a fixed port, so that it can be
/// SIGKILLed and started again where its clients expect it. Its stderr
/// collects in one log across restarts. Killed when dropped.
pub struct ServerProcess {
    pub port: u16,
    database_url: String,
    env: Vec<(String, String)>,
    log: std::path::PathBuf,
    child: Option<std::process::Child>,
}

impl ServerProcess {
    /// Starts a node on `database_url` (migrated by the node itself) with
    /// the `ORBIT_EVENTS__…` overrides `env`; returns once it answers
    /// `/readyz`.
    pub async fn start(
        database_url: &str,
        env: &[(&str, String)],
        log: &std::path::Path,
    ) -> ServerProcess {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let mut server = ServerProcess {
            port,
            database_url: database_url.to_owned(),
            env: env
                .iter()
                .map(|(k, v)| (k.to_string(), v.clone()))
                .collect(),
            log: log.to_owned(),
            child: None,
        };
        server.restart().await;
        server
    }

    /// The base URL of its HTTP API.
    pub fn address(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// SIGKILL: no shutdown code runs.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            child.kill().unwrap();
            child.wait().unwrap();
        }
    }

    /// Starts the process (again) on the same port and waits until ready.
    pub async fn restart(&mut self) {
        use std::io::Write;
        let mut log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap();
        writeln!(log, "--- orbit-events serve on port {}", self.port).unwrap();
        let child = std::process::Command::new(env!("CARGO_BIN_EXE_orbit-events"))
            .arg("serve")
            .env(
                "ORBIT_EVENTS__SERVER__LISTEN",
                format!("127.0.0.1:{}", self.port),
            )
            .env("ORBIT_EVENTS__DATABASE__URL", &self.database_url)
            .env("RUST_LOG", "warn")
            .env("NO_COLOR", "1")
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        self.child = Some(child);
        let http = crate::helpers::test_http_client();
        let deadline = Instant::now() + DEADLINE;
        loop {
            if let Ok(res) = http.get(format!("{}/readyz", self.address())).send().await
                && res.status() == 200
            {
                return;
            }
            if let Some(Ok(Some(status))) = self.child.as_mut().map(|c| c.try_wait()) {
                panic!(
                    "orbit-events serve exited with {status}: {}",
                    std::fs::read_to_string(&self.log).unwrap_or_default()
                );
            }
            assert!(
                Instant::now() < deadline,
                "orbit-events serve did not become ready: {}",
                std::fs::read_to_string(&self.log).unwrap_or_default()
            );
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Recorder {
    /// Runs `f` on what was recorded (the lock is not held afterwards).
    pub fn check<T>(&self, f: impl FnOnce(&Recorded) -> T) -> T {
        f(&self.seen.lock().unwrap())
    }
}
