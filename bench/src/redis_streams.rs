//! Target: Redis Streams with a consumer group per subscription, one XACK
//! per message, `appendfsync always` (every write is fsynced to the
//! append-only file before Redis answers). The server is started by
//! `scripts/bench`; this module checks its durability setting first.

use std::{path::PathBuf, sync::Arc, time::Instant};

use anyhow::{Context, Result, bail};
use redis::{AsyncConnectionConfig, aio::MultiplexedConnection, streams::StreamReadReply};

use crate::drive::{self, Publisher, Samples, Tracker, Workload, dir_bytes, now_us};
use crate::stats::RunResult;

const STREAM: &str = "results";

/// Where Redis runs.
#[derive(Debug, Clone)]
pub struct RedisOptions {
    /// `redis://127.0.0.1:PORT/`.
    pub url: String,
    /// Its data folder (for the size of the append-only file), if known.
    pub dir: Option<PathBuf>,
}

async fn connection(client: &redis::Client) -> Result<MultiplexedConnection> {
    // XREADGROUP BLOCK must not be cut short by a response timeout.
    let config = AsyncConnectionConfig::new().set_response_timeout(None);
    Ok(client
        .get_multiplexed_async_connection_with_config(&config)
        .await?)
}

async fn used_memory_rss_kib(con: &mut MultiplexedConnection) -> Option<u64> {
    let info: String = redis::cmd("INFO")
        .arg("memory")
        .query_async(con)
        .await
        .ok()?;
    info.lines()
        .find_map(|l| l.strip_prefix("used_memory_rss:"))
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map(|b| b / 1024)
}

#[derive(Clone)]
struct RedisPublisher {
    con: MultiplexedConnection,
    filler: Arc<str>,
}

impl Publisher for RedisPublisher {
    async fn publish(&self, due_us: u64, count: usize) -> Result<()> {
        let mut pipe = redis::pipe();
        for _ in 0..count {
            pipe.cmd("XADD")
                .arg(STREAM)
                .arg("*")
                .arg("t")
                .arg(due_us)
                .arg("pad")
                .arg(&*self.filler)
                .ignore();
        }
        let mut con = self.con.clone();
        pipe.query_async::<()>(&mut con).await?;
        Ok(())
    }
}

async fn consume(
    mut con: MultiplexedConnection,
    group: String,
    name: String,
    capacity: u32,
    tracker: Arc<Tracker>,
) -> Result<Samples> {
    let mut samples = Samples::default();
    while !tracker.is_done() {
        let reply: Option<StreamReadReply> = redis::cmd("XREADGROUP")
            .arg("GROUP")
            .arg(&group)
            .arg(&name)
            .arg("COUNT")
            .arg(capacity)
            .arg("BLOCK")
            .arg(100)
            .arg("STREAMS")
            .arg(STREAM)
            .arg(">")
            .query_async(&mut con)
            .await?;
        let Some(reply) = reply else { continue };
        let received = now_us();
        let mut acks = Vec::new();
        for key in reply.keys {
            for entry in key.ids {
                let t: u64 = entry.get("t").context("an entry without t")?;
                samples.latency_us.push(received.saturating_sub(t));
                let mut con = con.clone();
                let group = group.clone();
                // One XACK per message, all of them in flight at once (as
                // orbit-events consumers send their ACKs).
                acks.push(async move {
                    let sent = Instant::now();
                    let n: u64 = redis::cmd("XACK")
                        .arg(STREAM)
                        .arg(&group)
                        .arg(&entry.id)
                        .query_async(&mut con)
                        .await?;
                    if n != 1 {
                        bail!("XACK {} acknowledged {n} entries", entry.id);
                    }
                    Ok::<_, anyhow::Error>(sent.elapsed().as_micros() as u64)
                });
            }
        }
        samples.confirm_acks(acks, &tracker).await?;
    }
    Ok(samples)
}

/// One run on an emptied Redis.
pub async fn run_once(opts: &RedisOptions, w: &Workload, label: &str) -> Result<RunResult> {
    let client = redis::Client::open(opts.url.as_str())?;
    let mut admin = connection(&client).await?;
    let fsync: Vec<String> = redis::cmd("CONFIG")
        .arg("GET")
        .arg("appendfsync")
        .query_async(&mut admin)
        .await?;
    if fsync.get(1).map(String::as_str) != Some("always") {
        bail!("Redis must run with appendonly yes and appendfsync always (got {fsync:?})");
    }
    redis::cmd("FLUSHALL").query_async::<()>(&mut admin).await?;
    for s in 0..w.subscriptions {
        redis::cmd("XGROUP")
            .arg("CREATE")
            .arg(STREAM)
            .arg(format!("g{s}"))
            .arg("$")
            .arg("MKSTREAM")
            .query_async::<()>(&mut admin)
            .await?;
    }
    let aof_before = opts.dir.as_deref().map(dir_bytes);
    let rss_before = used_memory_rss_kib(&mut admin).await;
    let mut cons = Vec::with_capacity(w.consumers);
    for _ in 0..w.consumers {
        cons.push(connection(&client).await?);
    }
    let rss_connected = used_memory_rss_kib(&mut admin).await;
    let tracker = Tracker::new(w.deliveries(), label);
    let consumers: Vec<_> = cons
        .into_iter()
        .enumerate()
        .map(|(i, con)| {
            let group = format!("g{}", i % w.subscriptions);
            let consumer = consume(con, group, format!("c{i}"), w.capacity, tracker.clone());
            drive::spawn_consumer(&tracker, consumer)
        })
        .collect();
    let publisher = RedisPublisher {
        con: connection(&client).await?,
        filler: w.filler().into(),
    };
    let started = drive::start_publishing(w, publisher, tracker.clone());
    let finished = tracker.finished(w.timeout).await;
    let samples = drive::collect_samples(consumers).await;
    let finished = finished?;
    let rss_kib = used_memory_rss_kib(&mut admin).await;
    Ok(RunResult {
        acked: tracker.count(),
        elapsed: finished - started,
        latency_us: samples.latency_us,
        ack_rtt_us: samples.ack_rtt_us,
        rss_kib,
        rss_per_connection_kib: match (rss_before, rss_connected) {
            (Some(a), Some(b)) => Some((b as f64 - a as f64) / w.consumers as f64),
            _ => None,
        },
        // The append-only file written by this run.
        db_bytes: opts
            .dir
            .as_deref()
            .map(dir_bytes)
            .zip(aof_before)
            .map(|(after, before)| after.saturating_sub(before)),
    })
}
