//! Target: NATS JetStream, one file-storage stream, a durable pull
//! consumer per subscription with explicit ACKs, one ACK per message that
//! waits for the server's confirmation (`double_ack`, as an orbit-events
//! ACK waits for its commit). The server is started by `scripts/bench`
//! with its most durable sync setting for the installed version (the
//! table says which; nats-server 2.9 has no `sync_interval` and fsyncs its
//! file store on its own two-minute timer).

use std::{path::PathBuf, sync::Arc, time::Duration, time::Instant};

use anyhow::{Context, Result, anyhow, bail};
use async_nats::jetstream::{
    self,
    consumer::{AckPolicy, PullConsumer, pull},
    stream::{self, StorageType},
};
use futures_util::StreamExt;

use crate::drive::{self, Publisher, Samples, Tracker, Workload, dir_bytes, now_us, rss_kib};
use crate::stats::RunResult;

const STREAM: &str = "results";
const SUBJECT: &str = "results.task";

/// Where nats-server runs.
#[derive(Debug, Clone)]
pub struct NatsOptions {
    /// `nats://127.0.0.1:PORT`.
    pub url: String,
    /// Its JetStream store folder (for the bytes a run writes), if known.
    pub dir: Option<PathBuf>,
    /// Its process id (for its RSS), if known.
    pub pid: Option<u32>,
}

#[derive(Clone)]
struct NatsPublisher {
    js: jetstream::Context,
    filler: Arc<str>,
}

impl Publisher for NatsPublisher {
    async fn publish(&self, due_us: u64, count: usize) -> Result<()> {
        // All of a request's messages in flight at once, then every
        // stored-acknowledgement awaited (as the other targets pipeline).
        let mut acks = Vec::with_capacity(count);
        for _ in 0..count {
            let payload = format!("{due_us}|{}", self.filler);
            acks.push(self.js.publish(SUBJECT, payload.into()).await?);
        }
        for ack in acks {
            ack.await?;
        }
        Ok(())
    }
}

async fn consume(consumer: PullConsumer, capacity: u32, tracker: Arc<Tracker>) -> Result<Samples> {
    let mut samples = Samples::default();
    let capacity = usize::try_from(capacity)?;
    while !tracker.is_done() {
        let mut batch = consumer
            .fetch()
            .max_messages(capacity)
            .expires(Duration::from_millis(100))
            .messages()
            .await
            .map_err(|e| anyhow!("fetch: {e}"))?;
        let mut messages = Vec::with_capacity(capacity);
        while let Some(message) = batch.next().await {
            messages.push(message.map_err(|e| anyhow!("message: {e}"))?);
        }
        let received = now_us();
        let mut acks = Vec::with_capacity(messages.len());
        for message in messages {
            let sent_at = std::str::from_utf8(&message.payload)
                .ok()
                .and_then(|p| p.split('|').next())
                .and_then(|t| t.parse::<u64>().ok())
                .context("a message without its publish time")?;
            samples.latency_us.push(received.saturating_sub(sent_at));
            acks.push(async move {
                let sent = Instant::now();
                message
                    .double_ack()
                    .await
                    .map_err(|e| anyhow!("ack: {e}"))?;
                Ok::<_, anyhow::Error>(sent.elapsed().as_micros() as u64)
            });
        }
        samples.confirm_acks(acks, &tracker).await?;
    }
    Ok(samples)
}

/// One run on an emptied JetStream (the stream is deleted and created).
pub async fn run_once(opts: &NatsOptions, w: &Workload, label: &str) -> Result<RunResult> {
    let admin = async_nats::connect(opts.url.as_str()).await?;
    if !admin.server_info().jetstream {
        bail!("nats-server must run with JetStream enabled (-js)");
    }
    let js = jetstream::new(admin.clone());
    // Absent on the first run.
    let _ = js.delete_stream(STREAM).await;
    let stream = js
        .create_stream(stream::Config {
            name: STREAM.to_owned(),
            subjects: vec![SUBJECT.to_owned()],
            storage: StorageType::File,
            ..Default::default()
        })
        .await
        .map_err(|e| anyhow!("create stream: {e}"))?;
    let in_flight = i64::try_from(w.consumers)? * i64::from(w.capacity);
    for s in 0..w.subscriptions {
        stream
            .create_consumer(pull::Config {
                durable_name: Some(format!("g{s}")),
                ack_policy: AckPolicy::Explicit,
                max_ack_pending: in_flight,
                ..Default::default()
            })
            .await
            .map_err(|e| anyhow!("create consumer: {e}"))?;
    }
    let store_before = opts.dir.as_deref().map(dir_bytes);
    let rss_before = opts.pid.and_then(|p| rss_kib(p, "VmRSS:"));
    let mut consumers = Vec::with_capacity(w.consumers);
    for i in 0..w.consumers {
        let client = async_nats::connect(opts.url.as_str()).await?;
        let stream = jetstream::new(client)
            .get_stream(STREAM)
            .await
            .map_err(|e| anyhow!("get stream: {e}"))?;
        let consumer: PullConsumer = stream
            .get_consumer(&format!("g{}", i % w.subscriptions))
            .await
            .map_err(|e| anyhow!("get consumer: {e}"))?;
        consumers.push(consumer);
    }
    let rss_connected = opts.pid.and_then(|p| rss_kib(p, "VmRSS:"));
    let tracker = Tracker::new(w.deliveries(), label);
    let tasks: Vec<_> = consumers
        .into_iter()
        .map(|consumer| {
            drive::spawn_consumer(&tracker, consume(consumer, w.capacity, tracker.clone()))
        })
        .collect();
    let publisher = NatsPublisher {
        js: jetstream::new(async_nats::connect(opts.url.as_str()).await?),
        filler: w.filler().into(),
    };
    let started = drive::start_publishing(w, publisher, tracker.clone());
    let finished = tracker.finished(w.timeout).await;
    let samples = drive::collect_samples(tasks).await;
    let finished = finished?;
    Ok(RunResult {
        acked: tracker.count(),
        elapsed: finished - started,
        latency_us: samples.latency_us,
        ack_rtt_us: samples.ack_rtt_us,
        rss_kib: opts.pid.and_then(|p| rss_kib(p, "VmRSS:")),
        rss_per_connection_kib: match (rss_before, rss_connected) {
            (Some(a), Some(b)) => Some((b as f64 - a as f64) / w.consumers as f64),
            _ => None,
        },
        db_bytes: opts
            .dir
            .as_deref()
            .map(dir_bytes)
            .zip(store_before)
            .map(|(after, before)| after.saturating_sub(before)),
    })
}
