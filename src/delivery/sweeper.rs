//! SweeperActor (one per node): every `timing.sweep_interval_ms` it
//! recovers lapsed leases (to PENDING, or EXPIRED at their budget, also for
//! subscriptions nobody consumes), applies retention (log entries no
//! non-ACKED delivery references, ACKED deliveries, idempotency records and
//! closed sessions past their ages) and closes the sessions of dead nodes,
//! in bounded batches of short transactions, as one future that never
//! overlaps itself (spec: architecture.md §1, delivery-model.md §6, §8;
//! decisions 0040, 0041).

use std::{collections::HashMap, sync::Arc, time::Duration};

use actix::prelude::*;

use crate::{
    config::RetentionSettings,
    delivery::scanner::{ScannerActor, WakeAll},
    domain::{NodeId, QueueId, Timestamp, now},
    metrics::{Metrics, Operation, Outcome, Purged},
    store::{Database, retention},
};

/// Transactions of one kind per sweep at most; what is left waits for the
/// next sweep, so one sweep never runs for long.
const MAX_BATCHES: usize = 20;

/// What one sweep did (for logs, tests and the metrics).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SweepReport {
    /// Open sessions of nodes that are gone, now closed (PostgreSQL).
    pub dead_node_sessions: u64,
    pub leases_to_pending: u64,
    pub leases_expired: u64,
    pub events: u64,
    pub acked_deliveries: u64,
    pub idempotency_records: u64,
    pub sessions: u64,
}

/// Why a sweep did not run to its end.
#[derive(Debug, Clone, thiserror::Error)]
pub enum SweepError {
    /// The answer to [`SweepNow`] while another sweep runs.
    #[error("a sweep is already running")]
    Running,
    #[error("{0}")]
    Database(#[from] crate::store::StoreError),
}

/// Runs one sweep now and answers with what it did, or
/// `Err(SweepError::Running)` when one is already running. Used by tests.
#[derive(Message)]
#[rtype(result = "Result<SweepReport, SweepError>")]
pub struct SweepNow;

/// The sweeper actor.
pub struct SweeperActor {
    db: Database,
    node_id: NodeId,
    scanner: Addr<ScannerActor>,
    metrics: Arc<Metrics>,
    interval: Duration,
    retention: RetentionSettings,
    /// Per queue, the sequence after which the next event scan starts
    /// (0 = from the start of the log). Lost on restart: a scan from 0
    /// only re-reads the entries kept for their deliveries.
    positions: Option<HashMap<QueueId, i64>>,
}

impl SweeperActor {
    pub fn new(
        db: Database,
        node_id: NodeId,
        scanner: Addr<ScannerActor>,
        metrics: Arc<Metrics>,
        interval: Duration,
        retention: RetentionSettings,
    ) -> SweeperActor {
        SweeperActor {
            db,
            node_id,
            scanner,
            metrics,
            interval,
            retention,
            positions: Some(HashMap::new()),
        }
    }

    /// The sweep as a future, or `None` while one runs.
    fn sweep(
        &mut self,
    ) -> Option<impl ActorFuture<Self, Output = Result<SweepReport, SweepError>> + use<>> {
        let positions = self.positions.take()?;
        let db = self.db.clone();
        let node_id = self.node_id.clone();
        let retention = self.retention.clone();
        let fut = async move { sweep(&db, &node_id, &retention, positions).await };
        Some(fut.into_actor(self).map(|(result, positions), act, _| {
            act.positions = Some(positions);
            match &result {
                Ok(report) => {
                    let m = &act.metrics;
                    m.outcome(Outcome::LeaseExpired, report.leases_to_pending);
                    m.outcome(Outcome::Expired, report.leases_expired);
                    m.purged(Purged::Events, report.events);
                    m.purged(Purged::AckedDeliveries, report.acked_deliveries);
                    m.purged(Purged::IdempotencyRecords, report.idempotency_records);
                    m.purged(Purged::Sessions, report.sessions);
                    // Recovered rows are claimable; a raised floor may have
                    // left a subscription with a history gap to report.
                    if report.leases_to_pending > 0 || report.events > 0 {
                        act.scanner.do_send(WakeAll);
                    }
                    if *report != SweepReport::default() {
                        tracing::debug!(?report, "sweep");
                    }
                }
                Err(err) => {
                    act.metrics.database_error(Operation::Sweep);
                    if let SweepError::Database(err) = err {
                        crate::store::writer::log_failure(
                            err,
                            "sweep failed; retried at the next interval",
                        );
                    }
                }
            }
            result
        }))
    }
}

impl Actor for SweeperActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        ctx.run_interval(self.interval, |act, ctx| {
            if let Some(fut) = act.sweep() {
                ctx.spawn(fut.map(|_, _, _| ()));
            }
        });
    }
}

impl Handler<SweepNow> for SweeperActor {
    type Result = ResponseActFuture<Self, Result<SweepReport, SweepError>>;

    fn handle(&mut self, _: SweepNow, _: &mut Context<Self>) -> Self::Result {
        match self.sweep() {
            Some(fut) => Box::pin(fut),
            None => Box::pin(fut::ready(Err(SweepError::Running))),
        }
    }
}

/// One sweep: recovery, then each kind of retention, each in batches of at
/// most [`retention::BATCH`] rows and [`MAX_BATCHES`] transactions.
async fn sweep(
    db: &Database,
    node_id: &NodeId,
    settings: &RetentionSettings,
    mut positions: HashMap<QueueId, i64>,
) -> (Result<SweepReport, SweepError>, HashMap<QueueId, i64>) {
    let result = sweep_in(db, node_id, settings, &mut positions).await;
    (result, positions)
}

async fn sweep_in(
    db: &Database,
    node_id: &NodeId,
    settings: &RetentionSettings,
    positions: &mut HashMap<QueueId, i64>,
) -> Result<SweepReport, SweepError> {
    let mut report = SweepReport::default();
    let t = now();
    report.dead_node_sessions = retention::close_dead_node_sessions(db, node_id, t).await?;

    for _ in 0..MAX_BATCHES {
        let r = retention::recover_leases(db, t, retention::BATCH).await?;
        report.leases_to_pending += r.to_pending;
        report.leases_expired += r.expired;
        r.log_exhausted();
        if r.total() < retention::BATCH {
            break;
        }
    }

    let cutoff = before(t, settings.events_max_age_s);
    let queues = retention::queue_ids(db).await?;
    let known: std::collections::HashSet<&QueueId> = queues.iter().collect();
    positions.retain(|q, _| known.contains(q));
    for queue_id in queues {
        let position = positions.entry(queue_id.clone()).or_insert(0);
        for _ in 0..MAX_BATCHES {
            let batch = retention::purge_events(db, &queue_id, *position, cutoff).await?;
            report.events += batch.purged;
            if batch.reached_end {
                *position = 0;
                break;
            }
            *position = batch.examined_to;
        }
    }

    let acked_cutoff = before(t, settings.acked_deliveries_max_age_s);
    report.acked_deliveries =
        repeat(|| retention::purge_acked_deliveries(db, acked_cutoff)).await?;
    report.idempotency_records = repeat(|| retention::purge_idempotency_records(db, t)).await?;
    report.sessions = repeat(|| retention::purge_closed_sessions(db, acked_cutoff)).await?;
    Ok(report)
}

/// Runs `batch` until it touches fewer than a full batch of rows (or
/// [`MAX_BATCHES`] times); returns the rows touched.
async fn repeat<F, Fut>(mut batch: F) -> Result<u64, crate::store::StoreError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<u64, crate::store::StoreError>>,
{
    let mut total = 0;
    for _ in 0..MAX_BATCHES {
        let n = batch().await?;
        total += n;
        if n < retention::BATCH {
            break;
        }
    }
    Ok(total)
}

/// `t` minus `seconds` (saturating: a huge age means "never").
fn before(t: Timestamp, seconds: u64) -> Timestamp {
    let micros = i64::try_from(seconds.saturating_mul(1_000_000)).unwrap_or(i64::MAX);
    Timestamp(t.micros().saturating_sub(micros))
}
