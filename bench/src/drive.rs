//! The workload shared by every target: publish N results (at full speed or
//! paced at R/s), count ACKs until every delivery of every subscription is
//! confirmed, and stamp each result with the time its publish was due so
//! that the consumer can measure publish → receive.

use std::{
    future::Future,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use anyhow::{Context, Result, bail};
use indicatif::{ProgressBar, ProgressStyle};
use tokio::{
    sync::{Semaphore, watch},
    task::JoinHandle,
};

/// What every target runs.
#[derive(Debug, Clone)]
pub struct Workload {
    /// Results published (N).
    pub events: u64,
    /// Consumer connections (C), spread round-robin over the subscriptions.
    pub consumers: usize,
    /// Deliveries a consumer holds at once (K): orbit-events capacity,
    /// Redis `COUNT`, SQL queue claim size.
    pub capacity: u32,
    /// Subscriptions (S): each receives every result.
    pub subscriptions: usize,
    /// Paced publishing at this many results per second, one result per
    /// request; `None`: full speed, `batch` results per request.
    pub rate: Option<f64>,
    /// Results per publish request at full speed.
    pub batch: usize,
    /// Concurrent publishers at full speed.
    pub publishers: usize,
    /// Bytes of filler in each result (on top of its timestamp).
    pub payload_bytes: usize,
    /// Give up on a run after this long.
    pub timeout: Duration,
}

impl Workload {
    /// Deliveries expected: every result to every subscription.
    pub fn deliveries(&self) -> u64 {
        self.events * self.subscriptions as u64
    }

    /// The filler carried by each result (the same for every target).
    pub fn filler(&self) -> String {
        "x".repeat(self.payload_bytes)
    }
}

/// Wall-clock microseconds (publisher and consumers share the clock).
pub fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// Counts confirmed ACKs; resolves [`Tracker::finished`] at the last one.
pub struct Tracker {
    total: u64,
    acked: AtomicU64,
    done: watch::Sender<Option<Instant>>,
    failure: Mutex<Option<String>>,
    bar: ProgressBar,
}

impl Tracker {
    pub fn new(total: u64, label: &str) -> Arc<Tracker> {
        let bar = ProgressBar::new(total);
        bar.set_style(
            ProgressStyle::with_template("{prefix:>16} {bar:30} {pos}/{len} acked {per_sec} {eta}")
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        bar.set_prefix(label.to_owned());
        Arc::new(Tracker {
            total,
            acked: AtomicU64::new(0),
            done: watch::Sender::new(None),
            failure: Mutex::new(None),
            bar,
        })
    }

    /// One more delivery confirmed.
    pub fn acked(&self) {
        let n = self.acked.fetch_add(1, Ordering::AcqRel) + 1;
        if n.is_multiple_of(256) || n == self.total {
            self.bar.set_position(n);
        }
        if n == self.total {
            self.done.send_replace(Some(Instant::now()));
        }
    }

    pub fn count(&self) -> u64 {
        self.acked.load(Ordering::Acquire)
    }

    /// A consumer or publisher failed: the run stops with this error.
    pub fn fail(&self, why: String) {
        if let Ok(mut f) = self.failure.lock() {
            f.get_or_insert(why);
        }
        self.done.send_replace(Some(Instant::now()));
    }

    /// True once every delivery is confirmed (or the run failed).
    pub fn is_done(&self) -> bool {
        self.done.borrow().is_some()
    }

    /// A receiver that changes once the run is over.
    pub fn watch(&self) -> watch::Receiver<Option<Instant>> {
        self.done.subscribe()
    }

    /// Waits for the last ACK; returns when it arrived.
    pub async fn finished(&self, timeout: Duration) -> Result<Instant> {
        let mut rx = self.done.subscribe();
        let waited = tokio::time::timeout(timeout, rx.wait_for(|d| d.is_some())).await;
        self.bar.finish_and_clear();
        let at = match waited {
            Ok(Ok(at)) => (*at).context("no finish time")?,
            Ok(Err(_)) => bail!("the tracker was dropped"),
            Err(_) => bail!(
                "timed out after {timeout:?} with {} of {} deliveries acked",
                self.count(),
                self.total
            ),
        };
        if let Some(why) = self.failure.lock().ok().and_then(|f| f.clone()) {
            bail!(why);
        }
        Ok(at)
    }
}

/// Something that appends results to the target's log.
pub trait Publisher: Clone + Send + Sync + 'static {
    /// Appends `count` results stamped with `due_us` (wall-clock µs) in one
    /// request.
    fn publish(&self, due_us: u64, count: usize) -> impl Future<Output = Result<()>> + Send;
}

/// Publishes the workload's N results; returns when the first publish
/// started. Failures are reported through `tracker`.
pub fn start_publishing<P: Publisher>(
    w: &Workload,
    publisher: P,
    tracker: Arc<Tracker>,
) -> Instant {
    let started = Instant::now();
    let events = w.events;
    match w.rate {
        None => {
            let next = Arc::new(AtomicU64::new(0));
            let batch = w.batch as u64;
            for _ in 0..w.publishers.max(1) {
                let next = next.clone();
                let publisher = publisher.clone();
                let tracker = tracker.clone();
                tokio::spawn(async move {
                    loop {
                        let first = next.fetch_add(batch, Ordering::AcqRel);
                        if first >= events || tracker.is_done() {
                            return;
                        }
                        let count = Ord::min(batch, events - first) as usize;
                        if let Err(e) = publisher.publish(now_us(), count).await {
                            tracker.fail(format!("publish failed: {e:#}"));
                            return;
                        }
                    }
                });
            }
        }
        Some(rate) => {
            let start_us = now_us();
            let start = Instant::now();
            // Bounded, so that a stalled target fails the run instead of
            // piling up requests.
            let in_flight = Arc::new(Semaphore::new(256));
            tokio::spawn(async move {
                for i in 0..events {
                    let offset = Duration::from_secs_f64(i as f64 / rate);
                    tokio::time::sleep_until((start + offset).into()).await;
                    if tracker.is_done() {
                        return;
                    }
                    let Ok(permit) = in_flight.clone().acquire_owned().await else {
                        return;
                    };
                    let due = start_us + offset.as_micros() as u64;
                    let publisher = publisher.clone();
                    let tracker = tracker.clone();
                    tokio::spawn(async move {
                        if let Err(e) = publisher.publish(due, 1).await {
                            tracker.fail(format!("publish failed: {e:#}"));
                        }
                        drop(permit);
                    });
                }
            });
        }
    }
    started
}

/// Samples one consumer collects.
#[derive(Debug, Default)]
pub struct Samples {
    pub latency_us: Vec<u64>,
    pub ack_rtt_us: Vec<u64>,
}

impl Samples {
    pub fn merge(all: Vec<Samples>) -> Samples {
        let mut out = Samples::default();
        for s in all {
            out.latency_us.extend(s.latency_us);
            out.ack_rtt_us.extend(s.ack_rtt_us);
        }
        out
    }

    /// Waits for one fetch's ACKs (each answers its round trip in µs once
    /// the server confirmed it): samples and counts each; the first failed
    /// ACK is the error.
    pub async fn confirm_acks<F>(&mut self, acks: Vec<F>, tracker: &Tracker) -> Result<()>
    where
        F: Future<Output = Result<u64>>,
    {
        for rtt in futures_util::future::join_all(acks).await {
            self.ack_rtt_us.push(rtt?);
            tracker.acked();
        }
        Ok(())
    }
}

/// Runs one consumer as a task; its error fails the run (with the reason).
pub fn spawn_consumer<F>(tracker: &Arc<Tracker>, consume: F) -> JoinHandle<Result<Samples>>
where
    F: Future<Output = Result<Samples>> + Send + 'static,
{
    let tracker = tracker.clone();
    tokio::spawn(async move {
        let r = consume.await;
        if let Err(e) = &r {
            tracker.fail(format!("consumer failed: {e:#}"));
        }
        r
    })
}

/// The merged samples of the consumers that ended well (one that failed
/// already failed the run).
pub async fn collect_samples(consumers: Vec<JoinHandle<Result<Samples>>>) -> Samples {
    let mut all = Vec::with_capacity(consumers.len());
    for c in consumers {
        if let Ok(Ok(s)) = c.await {
            all.push(s);
        }
    }
    Samples::merge(all)
}

/// Resident set size of process `pid` in KiB (`VmRSS`, or `VmHWM` for the
/// peak).
pub fn rss_kib(pid: u32, field: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find(|l| l.starts_with(field))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// Total size of the files under `dir`, in bytes.
pub fn dir_bytes(dir: &std::path::Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .filter_map(|e| e.ok())
        .map(|e| match e.metadata() {
            Ok(m) if m.is_dir() => dir_bytes(&e.path()),
            Ok(m) => m.len(),
            Err(_) => 0,
        })
        .sum()
}

/// A free TCP port on 127.0.0.1.
pub fn free_port() -> Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(l.local_addr()?.port())
}

/// A fresh random name suffix.
pub fn random_suffix() -> String {
    use rand::RngExt;
    let n: u64 = rand::rng().random();
    format!("{n:016x}")
}
