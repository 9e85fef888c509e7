//! Several nodes on one PostgreSQL database (architecture.md §4,
//! delivery-model.md §3 and §6): real `orbit-events serve` processes share
//! one database with consumers of one subscription on every node; appends
//! wake the other nodes through NOTIFY; a node killed with SIGKILL loses
//! nothing. PostgreSQL only: on SQLite these tests print why they skip.
//!
//! Each test also runs one in-process node (`spawn_app_with`) on the same
//! database: it creates and migrates the database before the processes
//! start, and gives the harness its helpers (bootstrap, SQL, invariants).
//! No consumer connects to it.

use std::{
    collections::{HashMap, HashSet},
    io::{BufRead, BufReader},
    process::{Child, Command, Stdio},
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use orbit_events::{
    delivery::listener::SUBSCRIPTION_WAKE_INTERVAL,
    domain::{Timestamp, random_hex_id},
    store::wakes::CHANNEL,
};
use sea_orm::sqlx::postgres::PgListener;
use serde_json::{Value, json};
use tokio::sync::Mutex;

use crate::helpers::*;

/// One multi-node test at a time: each runs three server processes, and
/// the machine is small. The crash test (`sdk_crash`) takes it too.
pub static CLUSTER: Mutex<()> = Mutex::const_new(());

/// How long a whole multi-node run may take before the test fails.
const RUN_DEADLINE: Duration = Duration::from_secs(240);

/// An `orbit-events serve` process.
struct Node {
    port: u16,
    child: std::sync::Mutex<Child>,
}

impl Node {
    /// Starts `orbit-events serve` on `database_url` with port 0 and the
    /// given `ORBIT_EVENTS__…` overrides; returns once it listens (the bound
    /// port is read from its log line).
    async fn start(index: usize, database_url: &str, env: &[(&str, String)]) -> Node {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_orbit-events"));
        cmd.arg("serve")
            .env("ORBIT_EVENTS__DATABASE__URL", database_url)
            .env("ORBIT_EVENTS__SERVER__LISTEN", "127.0.0.1:0")
            .env("RUST_LOG", "info,sqlx=warn,sea_orm=warn,actix_server=warn")
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        for (key, value) in env {
            cmd.env(key, value);
        }
        let mut child = cmd.spawn().expect("start orbit-events serve");
        let stderr = child.stderr.take().unwrap();
        // Owned by a Node at once, so that a panic below kills the process.
        let mut node = Node {
            port: 0,
            child: std::sync::Mutex::new(child),
        };
        let (tx, rx) = tokio::sync::oneshot::channel();
        // Drains the log for the life of the process (a full pipe would
        // block it); warnings, errors and the exit message are shown with
        // the node's number.
        std::thread::spawn(move || {
            let mut tx = Some(tx);
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(rest) = line.split("listening on http://").nth(1) {
                    let port = rest
                        .split_whitespace()
                        .next()
                        .and_then(|a| a.rsplit(':').next())
                        .and_then(|p| p.parse::<u16>().ok());
                    if let (Some(tx), Some(port)) = (tx.take(), port) {
                        let _ = tx.send(port);
                    }
                } else if line.contains("WARN")
                    || line.contains("ERROR")
                    || line.starts_with("orbit-events:")
                {
                    eprintln!("[node {}] {line}", index + 1);
                }
            }
        });
        node.port = tokio::time::timeout(DEADLINE, rx)
            .await
            .expect("node did not start listening within the deadline")
            .expect("node exited before listening");
        node
    }

    /// SIGKILL (`Child::kill`): no shutdown code runs.
    fn kill(&self) {
        let mut child = self.child.lock().unwrap();
        child.kill().expect("SIGKILL the node");
        child.wait().expect("reap the node");
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        if let Ok(child) = self.child.get_mut() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Three nodes on the database of an in-process node.
struct Cluster {
    app: TestApp,
    nodes: Vec<Node>,
}

impl Cluster {
    /// `timing` are `(key, value)` pairs of `[timing]` for all nodes.
    async fn start(timing: &[(&str, u64)]) -> Cluster {
        let app = spawn_app().await;
        let env: Vec<(String, String)> = timing
            .iter()
            .map(|(k, v)| {
                (
                    format!("ORBIT_EVENTS__TIMING__{}", k.to_uppercase()),
                    v.to_string(),
                )
            })
            .collect();
        let env: Vec<(&str, String)> = env.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
        let url = app.settings.database.url.clone();
        let mut nodes = Vec::new();
        for i in 0..3 {
            nodes.push(Node::start(i, &url, &env).await);
        }
        Cluster { app, nodes }
    }
}

/// One `event.deliver` as a consumer saw it.
#[derive(Debug, Clone)]
struct Delivered {
    at: Instant,
    node: usize,
    session_id: String,
    delivery_id: String,
    epoch: u64,
    /// Microseconds since the epoch.
    lease_until: i64,
    event_id: String,
    /// Received while holding: never ACKed by this consumer.
    held: bool,
}

/// One `ack` reply to an `event.ack`.
#[derive(Debug, Clone)]
struct Acked {
    event_id: String,
    deduplicated: bool,
}

#[derive(Debug, Default)]
struct ConsumerLog {
    delivered: Vec<Delivered>,
    acked: Vec<Acked>,
    /// Error codes answering an ACK (e.g. `DELIVERY_LEASE_LOST`).
    ack_errors: Vec<String>,
    /// The connection ended (its node died).
    closed: bool,
}

/// What a consumer does with its deliveries.
#[derive(Clone)]
struct Behaviour {
    /// While set, deliveries are held (no ACK) and counted in `held`.
    hold: Arc<AtomicBool>,
    held: Arc<AtomicUsize>,
    /// Set by the test to end the consumer.
    stop: Arc<AtomicBool>,
}

impl Behaviour {
    fn new(stop: &Arc<AtomicBool>) -> Behaviour {
        Behaviour {
            hold: Arc::new(AtomicBool::new(false)),
            held: Arc::new(AtomicUsize::new(0)),
            stop: stop.clone(),
        }
    }
}

/// Receives deliveries and ACKs each at once (unless holding), recording
/// every frame, until stopped and quiet, or the connection ends. Quiet: the
/// replies to ACKs that committed just before the stop are still on their
/// way (a node answers after the commit), so a stopped consumer reads on
/// until no frame came for 500 ms.
async fn consume(mut ws: WsClient, node: usize, behaviour: Behaviour) -> ConsumerLog {
    let mut log = ConsumerLog::default();
    loop {
        let stopped = behaviour.stop.load(Ordering::Relaxed);
        let wait = Duration::from_millis(if stopped { 500 } else { 100 });
        let frame = match ws.recv_within(wait).await {
            None if stopped => break,
            None => continue,
            Some(Received::Closed(_)) => {
                log.closed = true;
                break;
            }
            Some(Received::Frame(f)) => f,
        };
        let at = Instant::now();
        match frame["type"].as_str() {
            Some("event.deliver") => {
                let body = &frame["body"];
                let d = &body["delivery"];
                let delivered = Delivered {
                    at,
                    node,
                    session_id: frame["session_id"].as_str().unwrap().to_owned(),
                    delivery_id: d["id"].as_str().unwrap().to_owned(),
                    epoch: d["lease_epoch"].as_str().unwrap().parse().unwrap(),
                    lease_until: Timestamp::parse_rfc3339(d["lease_until"].as_str().unwrap())
                        .unwrap()
                        .micros(),
                    event_id: body["event"]["id"].as_str().unwrap().to_owned(),
                    held: behaviour.hold.load(Ordering::Relaxed),
                };
                let held = delivered.held;
                log.delivered.push(delivered);
                if held {
                    behaviour.held.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
                let ack = ws.envelope(
                    "event.ack",
                    json!({
                        "delivery_id": d["id"],
                        "epoch": d["lease_epoch"],
                        "lease_secret": body["lease_secret"],
                    }),
                );
                // A send to a killed node fails; the next read sees the end.
                if futures_util::SinkExt::send(
                    &mut ws.stream,
                    tokio_tungstenite::tungstenite::Message::text(ack.to_string()),
                )
                .await
                .is_err()
                {
                    log.closed = true;
                    break;
                }
            }
            Some("ack") => log.acked.push(Acked {
                event_id: frame["body"]["event_id"].as_str().unwrap().to_owned(),
                deduplicated: frame["body"]["deduplicated"].as_bool().unwrap(),
            }),
            Some("error") => log
                .ack_errors
                .push(frame["error"]["code"].as_str().unwrap_or("").to_owned()),
            other => panic!("unexpected frame type {other:?}: {frame:#}"),
        }
    }
    log
}

/// Publishes `results` through the node on `ports[first]`; when that node
/// does not answer (it was killed), resends the same request (same
/// idempotency key) to the next nodes. Returns the events' ids.
async fn publish_anywhere(
    http: &reqwest::Client,
    ports: &[u16],
    first: usize,
    cred: &Cred,
    results: Vec<Value>,
) -> Vec<String> {
    let key = random_hex_id();
    let body = json!({ "results": results });
    for attempt in 0..ports.len() * 3 {
        let port = ports[(first + attempt) % ports.len()];
        let sent = http
            .post(format!(
                "http://127.0.0.1:{port}/v1/queues/{}/results",
                cred.queue_id
            ))
            .bearer_auth(&cred.token)
            .header("Idempotency-Key", &key)
            .json(&body)
            .send()
            .await;
        let Ok(res) = sent else { continue };
        let status = res.status().as_u16();
        let body: Value = res.json().await.unwrap();
        // 201 when applied now, 200 when a resend found it applied already.
        assert!(status == 201 || status == 200, "publish: {status} {body:#}");
        return body["data"]["events"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["id"].as_str().unwrap().to_owned())
            .collect();
    }
    panic!("no node accepted the publish");
}

/// 5,000 results in batches of 10, through the three nodes at once; each
/// publisher starts on its own node. `on_batch` sees each batch number once
/// it is published. Returns every event id.
async fn publish_5000(
    cluster: &Cluster,
    cred: &Cred,
    on_batch: impl Fn(usize) + Clone,
) -> HashSet<String> {
    const BATCHES: usize = 500;
    const BATCH: usize = 10;
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(20))
        .build()
        .unwrap();
    let ports: Vec<u16> = cluster.nodes.iter().map(|n| n.port).collect();
    let publishers = (0..3).map(|node| {
        let (http, ports, on_batch) = (http.clone(), ports.clone(), on_batch.clone());
        async move {
            let mut published = Vec::new();
            for batch in (node..BATCHES).step_by(3) {
                let results = (0..BATCH)
                    .map(|i| result(&cred.queue_id, TYPES[(batch + i) % 4]))
                    .collect();
                let ids = publish_anywhere(&http, &ports, node, cred, results).await;
                assert_eq!(ids.len(), BATCH);
                published.extend(ids);
                on_batch(batch);
            }
            published
        }
    });
    let all: HashSet<String> = futures_util::future::join_all(publishers)
        .await
        .into_iter()
        .flatten()
        .collect();
    assert_eq!(
        all.len(),
        BATCHES * BATCH,
        "every published event id is distinct"
    );
    all
}

/// Waits until `n` deliveries of the subscription are ACKED.
async fn wait_all_acked(app: &TestApp, sub_id: &str, n: i64, started: Instant) {
    loop {
        let acked = app
            .scalar(&format!(
                "SELECT COUNT(*) FROM deliveries WHERE subscription_id = '{sub_id}' AND state = 'ACKED'"
            ))
            .await;
        if acked == n {
            return;
        }
        assert!(
            started.elapsed() < RUN_DEADLINE,
            "only {acked} of {n} deliveries ACKED after {:?}",
            started.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// No (delivery, epoch) was leased twice, and a delivery's next lease was
/// granted only after its previous lease had ended: never two sessions at
/// once. Returns the number of redeliveries (epochs above 1).
fn assert_leases_never_overlap(delivered: &[Delivered], lease: Duration) -> usize {
    let mut by_delivery: HashMap<&str, Vec<&Delivered>> = HashMap::new();
    let mut pairs = HashSet::new();
    for d in delivered {
        assert!(
            pairs.insert((d.delivery_id.as_str(), d.epoch)),
            "delivery {} was leased twice with epoch {}",
            d.delivery_id,
            d.epoch
        );
        by_delivery.entry(&d.delivery_id).or_default().push(d);
    }
    let lease = lease.as_micros() as i64;
    let mut redeliveries = 0;
    for leases in by_delivery.values_mut() {
        leases.sort_by_key(|d| d.epoch);
        for w in leases.windows(2) {
            let granted = w[1].lease_until - lease;
            assert!(
                granted >= w[0].lease_until,
                "delivery {} leased to session {} (epoch {}) before the lease of session {} \
                 (epoch {}) ended",
                w[1].delivery_id,
                w[1].session_id,
                w[1].epoch,
                w[0].session_id,
                w[0].epoch
            );
            redeliveries += 1;
        }
    }
    redeliveries
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let rank = ((sorted.len() as f64) * p).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Binds `per_node` consumers of capacity 8 on every node in `nodes`.
async fn start_consumers(
    cluster: &Cluster,
    nodes: &[usize],
    per_node: usize,
    cred: &Cred,
    sub_id: &str,
    stop: &Arc<AtomicBool>,
) -> Vec<(usize, Behaviour, tokio::task::JoinHandle<ConsumerLog>)> {
    let mut consumers = Vec::new();
    for &node in nodes {
        for _ in 0..per_node {
            let ws = ws_bind(cluster.nodes[node].port, &cred.token, sub_id, 8).await;
            let behaviour = Behaviour::new(stop);
            let task = tokio::spawn(consume(ws, node, behaviour.clone()));
            consumers.push((node, behaviour, task));
        }
    }
    consumers
}

#[actix_web::test]
async fn three_nodes_on_one_database_deliver_and_ack_all_5000_results_published_through_all_of_them_leasing_each_once()
 {
    if skip_unless_postgres() {
        return;
    }
    let _one_at_a_time = CLUSTER.lock().await;
    // A scan interval far above the run: appends on one node reach the
    // consumers on the others through NOTIFY (or their own activity).
    let cluster = Cluster::start(&[("scan_interval_ms", 60_000)]).await;
    let app = &cluster.app;
    let cred = app.bootstrap().await;
    // The largest backlog allowed keeps all consumers busy while publishing.
    let sub = app
        .subscribe(&cred, json!({ "from_sequence": "0", "max_pending": 1000 }))
        .await;
    let sub_id = sub["id"].as_str().unwrap().to_owned();
    let stop = Arc::new(AtomicBool::new(false));
    let consumers = start_consumers(&cluster, &[0, 1, 2], 2, &cred, &sub_id, &stop).await;

    // Counts the wakes the nodes send each other during the run.
    let mut listener = PgListener::connect(&app.settings.database.url)
        .await
        .unwrap();
    listener.listen(CHANNEL).await.unwrap();
    let counts = Arc::new(std::sync::Mutex::new(HashMap::<String, usize>::new()));
    let counting = {
        let counts = counts.clone();
        tokio::spawn(async move {
            while let Ok(n) = listener.recv().await {
                let kind = n.payload().split(' ').next().unwrap_or("").to_owned();
                *counts.lock().unwrap().entry(kind).or_default() += 1;
            }
        })
    };

    let started = Instant::now();
    let published = publish_5000(&cluster, &cred, |_| {}).await;
    let published_in = started.elapsed();
    wait_all_acked(app, &sub_id, 5000, started).await;
    let elapsed = started.elapsed();
    stop.store(true, Ordering::Relaxed);

    let mut delivered = Vec::new();
    let mut acked: HashMap<String, usize> = HashMap::new();
    let mut per_node = [0usize; 3];
    for (node, _, task) in consumers {
        let log = task.await.unwrap();
        assert!(
            !log.closed,
            "a consumer of node {} was disconnected",
            node + 1
        );
        assert!(
            log.ack_errors.is_empty(),
            "ACK errors: {:?}",
            log.ack_errors
        );
        per_node[node] += log.delivered.len();
        delivered.extend(log.delivered);
        for a in log.acked {
            assert!(!a.deduplicated);
            *acked.entry(a.event_id).or_default() += 1;
        }
    }

    // Every result delivered and ACKed, each exactly once.
    let published_ids: HashSet<&String> = published.iter().collect();
    let delivered_ids: HashSet<&String> = delivered.iter().map(|d| &d.event_id).collect();
    assert_eq!(
        delivered_ids, published_ids,
        "every published result delivered"
    );
    let acked_ids: HashSet<&String> = acked.keys().collect();
    assert_eq!(acked_ids, published_ids, "every published result ACKed");
    assert!(acked.values().all(|n| *n == 1), "a result ACKed twice");
    assert_eq!(
        app.scalar(&format!(
            "SELECT COUNT(*) FROM deliveries WHERE subscription_id = '{sub_id}'"
        ))
        .await,
        5000
    );
    // No consumer went away and every ACK came within the 30 s lease: each
    // delivery was leased exactly once.
    let redeliveries = assert_leases_never_overlap(&delivered, app.settings.timing.lease());
    assert_eq!(redeliveries, 0);
    assert_eq!(delivered.len(), 5000);
    for (node, n) in per_node.iter().enumerate() {
        assert!(*n > 0, "node {} delivered nothing", node + 1);
    }

    counting.abort();
    let counts = counts.lock().unwrap().clone();
    // At most one journal wake per append; subscription wakes (one per ACK
    // before coalescing) at most one per node per 100 ms.
    let count = |kind: &str| counts.get(kind).copied().unwrap_or(0);
    let (journal, subscription) = (count("journal"), count("subscription"));
    let ticks = (elapsed.as_millis() / SUBSCRIPTION_WAKE_INTERVAL.as_millis()) as usize;
    assert!(journal <= 500, "{counts:?}");
    assert!(
        subscription <= 3 * (ticks + 10),
        "{counts:?} in {elapsed:?}"
    );
    report(&format!(
        "3 nodes, 6 consumers of capacity 8: 5000 results published in {published_in:?}, \
         all ACKed after {elapsed:?}; deliveries per node {per_node:?}; notifications: \
         {journal} journal (500 appends), {subscription} subscription (5000 ACKs)"
    ));
    app.assert_invariants().await;
}

#[actix_web::test]
async fn an_append_on_node_1_reaches_a_consumer_on_node_3_through_notify_long_before_the_fallback_poll()
 {
    if skip_unless_postgres() {
        return;
    }
    let _one_at_a_time = CLUSTER.lock().await;
    // The fallback poll cannot help within the test: only NOTIFY wakes node 3.
    let cluster = Cluster::start(&[("scan_interval_ms", 600_000)]).await;
    let app = &cluster.app;
    let cred = app.bootstrap().await;
    // Room for every probe in the backlog, since none is ACKed until the end.
    let sub = app.subscribe(&cred, json!({ "max_pending": 1000 })).await;
    let sub_id = sub["id"].as_str().unwrap();

    // Consumers only on node 3, and no ACK until the end: an ACK would wake
    // node 3's scanner by itself. 8 × 32 slots hold every probe. Each
    // connection is read by its own task, which stamps frames on arrival.
    const PROBES: usize = 200;
    let stop = Arc::new(AtomicBool::new(false));
    let (tx, mut arrivals) = tokio::sync::mpsc::unbounded_channel::<(Instant, Value)>();
    let mut readers = Vec::new();
    for _ in 0..8 {
        let mut ws = ws_bind(cluster.nodes[2].port, &cred.token, sub_id, 32).await;
        let (tx, stop) = (tx.clone(), stop.clone());
        readers.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                if let Some(Received::Frame(f)) = ws.recv_within(Duration::from_millis(50)).await {
                    tx.send((Instant::now(), f)).unwrap();
                }
            }
            ws
        }));
    }
    let http = crate::helpers::test_http_client();
    let ports = [cluster.nodes[0].port];
    let mut latencies = Vec::with_capacity(PROBES);
    let mut deliveries = Vec::new();
    for probe in 0..PROBES {
        let sent = Instant::now();
        let ids = publish_anywhere(
            &http,
            &ports,
            0,
            &cred,
            vec![result(&cred.queue_id, "task.succeeded")],
        )
        .await;
        let (at, frame) = tokio::time::timeout(DEADLINE, arrivals.recv())
            .await
            .unwrap_or_else(|_| panic!("probe {probe}, published on node 1, never reached node 3"))
            .unwrap();
        latencies.push(at.duration_since(sent));
        assert_eq!(frame["type"], "event.deliver", "{frame:#}");
        assert_eq!(frame["body"]["event"]["id"], ids[0].as_str());
        deliveries.push(frame);
    }
    latencies.sort();
    let (p50, p99) = (percentile(&latencies, 0.5), percentile(&latencies, 0.99));
    report(&format!(
        "publish on node 1 → event.deliver on node 3 (scan interval 600 s, NOTIFY only): \
         {PROBES} probes, p50 {p50:?}, p99 {p99:?}, max {:?}",
        latencies[PROBES - 1]
    ));
    // A generous bound: the fallback poll would take ten minutes.
    assert!(p99 < Duration::from_secs(2), "p99 {p99:?}");

    // ACK them all, each on the connection that received it.
    stop.store(true, Ordering::Relaxed);
    let mut by_session: HashMap<String, Vec<Value>> = HashMap::new();
    for d in deliveries {
        by_session
            .entry(d["session_id"].as_str().unwrap().to_owned())
            .or_default()
            .push(d);
    }
    for reader in readers {
        let mut ws = reader.await.unwrap();
        for d in by_session
            .remove(ws.session_id.as_deref().unwrap())
            .unwrap_or_default()
        {
            assert_eq!(ws.ack(&d).await["type"], "ack");
        }
    }
    assert_eq!(
        app.scalar(&format!(
            "SELECT COUNT(*) FROM deliveries WHERE subscription_id = '{sub_id}' AND state = 'ACKED'"
        ))
        .await,
        PROBES as i64
    );
    app.assert_invariants().await;
}

#[actix_web::test]
async fn a_node_killed_with_sigkill_mid_run_loses_nothing_its_leases_are_redelivered_by_the_others_after_the_lease()
 {
    if skip_unless_postgres() {
        return;
    }
    let _one_at_a_time = CLUSTER.lock().await;
    const LEASE_MS: u64 = 2_000;
    // A short lease so the dead node's leases lapse within the test, and a
    // short poll: once the run is over, only the poll looks at lapsed leases.
    let cluster = Cluster::start(&[("lease_ms", LEASE_MS), ("scan_interval_ms", 200)]).await;
    let app = &cluster.app;
    let cred = app.bootstrap().await;
    let sub = app
        .subscribe(&cred, json!({ "from_sequence": "0", "max_pending": 1000 }))
        .await;
    let sub_id = sub["id"].as_str().unwrap().to_owned();
    let stop = Arc::new(AtomicBool::new(false));
    let consumers = start_consumers(&cluster, &[0, 1, 2], 2, &cred, &sub_id, &stop).await;

    // Node 2 dies about a third of the way through publishing, while each
    // of its consumers holds deliveries it has not ACKed.
    let kill_now = tokio::sync::Notify::new();
    let started = Instant::now();
    let publishing = publish_5000(&cluster, &cred, |batch| {
        if batch == 150 {
            kill_now.notify_one();
        }
    });
    let killing = async {
        kill_now.notified().await;
        let node_2 = consumers.iter().filter(|(node, _, _)| *node == 1);
        for (_, b, _) in node_2.clone() {
            b.hold.store(true, Ordering::Relaxed);
        }
        while node_2
            .clone()
            .any(|(_, b, _)| b.held.load(Ordering::Relaxed) == 0)
        {
            assert!(
                started.elapsed() < RUN_DEADLINE,
                "node 2's consumers got nothing to hold"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        cluster.nodes[1].kill();
        Instant::now()
    };
    let (published, killed_at) = tokio::join!(publishing, killing);
    wait_all_acked(app, &sub_id, 5000, started).await;
    let elapsed = started.elapsed();
    stop.store(true, Ordering::Relaxed);

    let mut delivered = Vec::new();
    let mut held_on_node_2 = HashSet::new();
    let mut acked: HashMap<String, usize> = HashMap::new();
    for (node, _, task) in consumers {
        let log = task.await.unwrap();
        assert_eq!(
            log.closed,
            node == 1,
            "only node 2's consumers lose their connection"
        );
        assert!(
            log.ack_errors.iter().all(|c| c == "DELIVERY_LEASE_LOST"),
            "ACK errors: {:?}",
            log.ack_errors
        );
        held_on_node_2.extend(
            log.delivered
                .iter()
                .filter(|d| d.held)
                .map(|d| d.delivery_id.clone()),
        );
        delivered.extend(log.delivered);
        for a in log.acked {
            assert!(!a.deduplicated);
            *acked.entry(a.event_id).or_default() += 1;
        }
    }
    assert!(acked.values().all(|n| *n == 1), "a result ACKed twice");

    // Nothing lost: every published result has its delivery, ACKED.
    let in_database: HashSet<String> = app
        .column::<String>(&format!(
            "SELECT event_id FROM deliveries WHERE subscription_id = '{sub_id}' AND state = 'ACKED'"
        ))
        .await
        .into_iter()
        .collect();
    assert_eq!(in_database, published, "every published result ACKED");

    // Every lease held by the dead node came back on another node, only
    // after that lease had ended (checked for all leases here).
    let lease = Duration::from_millis(LEASE_MS);
    let redeliveries = assert_leases_never_overlap(&delivered, lease);
    let mut last_redelivery = killed_at;
    for id in &held_on_node_2 {
        let later: Vec<&Delivered> = delivered
            .iter()
            .filter(|d| &d.delivery_id == id && d.node != 1)
            .collect();
        assert!(
            !later.is_empty(),
            "delivery {id}, held by node 2 when it was killed, was never redelivered"
        );
        last_redelivery = later
            .iter()
            .map(|d| d.at)
            .fold(last_redelivery, Instant::max);
    }
    report(&format!(
        "node 2 SIGKILLed {:?} into the run holding {} leases; all redelivered by nodes 1 and 3 \
         within {:?} of the kill (lease {lease:?}); {redeliveries} redeliveries in all; \
         5000 results ACKed after {elapsed:?}",
        killed_at.duration_since(started),
        held_on_node_2.len(),
        last_redelivery.duration_since(killed_at),
    ));
    app.assert_invariants().await;
}

#[actix_web::test]
async fn three_nodes_started_at_once_on_a_fresh_database_all_migrate_it_and_serve() {
    if skip_unless_postgres() {
        return;
    }
    let _one_at_a_time = CLUSTER.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let url = fresh_database_url(&dir).await;
    let nodes = futures_util::future::join_all((0..3).map(|i| Node::start(i, &url, &[]))).await;
    let http = crate::helpers::test_http_client();
    for node in &nodes {
        let res = http
            .get(format!("http://127.0.0.1:{}/readyz", node.port))
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 200);
    }
}
