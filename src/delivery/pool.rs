//! LeasePoolActor: admits WebSocket connections and runs claim transactions
//! under the node limits (spec: architecture.md §1, delivery-model.md §7).
//!
//! At most `claims_in_flight` claims run at once, at most
//! `claims_in_flight_per_application` per application, and at most
//! `claims_queued` wait or run; beyond that a request is refused and the
//! scanner retries it on a later round. Waiting requests are served
//! round-robin over applications, then over each application's
//! subscriptions, so one noisy application cannot starve the others.
//! Claims run as futures on the pool's arbiter: the connection actors that
//! read frames and answer pings never wait for one.
//!
//! When a subscription's turn comes, every request of it that waits (up to
//! [`MAX_CLAIM_BATCH`]) runs as one claim batch through the writer's batch
//! rule (decision 0078), so one commit serves several of its sessions. The
//! limits count transactions; fairness is one transaction per turn.

use std::{
    collections::{HashMap, VecDeque},
    sync::Arc,
    time::{Duration, Instant},
};

use actix::prelude::*;

use crate::{
    delivery::scanner::ClaimSettled,
    domain::{ApplicationId, SubscriptionId},
    metrics::{Metrics, Operation, Outcome, PoolGauges},
    store::{
        Database, StoreError,
        claim::{self, ClaimOutcome, ClaimTarget},
    },
};

/// Limits the pool enforces (from `[limits]`).
#[derive(Debug, Clone, Copy)]
pub struct PoolLimits {
    pub max_connections: usize,
    pub claims_in_flight: usize,
    pub claims_in_flight_per_application: usize,
    pub claims_queued: usize,
}

/// Claim requests of one subscription that share a transaction at most.
pub const MAX_CLAIM_BATCH: usize = 32;

/// Counters and high-water marks (since the node started), for metrics and
/// tests. `claims_in_flight` counts claim transactions (the limits);
/// `claims_running` the claim requests inside them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolStats {
    pub connections: usize,
    pub claims_waiting: usize,
    pub claims_in_flight: usize,
    pub claims_running: usize,
    pub max_claims_waiting_seen: usize,
    pub max_claims_in_flight_seen: usize,
    pub max_claims_in_flight_per_application_seen: usize,
    /// Most claims that ever shared one transaction.
    pub max_claims_per_transaction_seen: usize,
    pub claims_refused: u64,
    pub claims_completed: u64,
}

/// The outcome of a claim for a connection, sent by the pool (or by the
/// scanner when materialization finds a history gap).
#[derive(Message)]
#[rtype(result = "()")]
pub struct ClaimResult {
    pub outcome: Result<ClaimOutcome, StoreError>,
}

impl PoolStats {
    /// What `/metrics` shows of these.
    pub fn gauges(&self) -> PoolGauges {
        PoolGauges {
            connections: self.connections,
            claims_waiting: self.claims_waiting,
            claims_in_flight: self.claims_in_flight,
            max_claims_waiting_seen: self.max_claims_waiting_seen,
            max_claims_in_flight_seen: self.max_claims_in_flight_seen,
            max_claims_in_flight_per_application_seen: self
                .max_claims_in_flight_per_application_seen,
        }
    }
}

/// A request to lease up to `want` deliveries to one session.
#[derive(Message)]
#[rtype(result = "()")]
pub struct ClaimRequest {
    pub target: ClaimTarget,
    pub application_id: ApplicationId,
    pub want: u32,
    /// When the scanner asked (for the wait-time histogram).
    pub enqueued_at: Instant,
    /// The connection that receives the leases (or the failure).
    pub reply: Recipient<ClaimResult>,
    /// The scanner, told when the claim finished or was refused.
    pub settled: Recipient<ClaimSettled>,
}

/// Admits one more WebSocket connection, or refuses at the node limit.
#[derive(Message)]
#[rtype(result = "Result<ConnectionSlot, AtCapacity>")]
pub struct AdmitConnection;

/// The node is at its connection limit.
#[derive(Debug, Clone, Copy)]
pub struct AtCapacity;

/// A slot of the node's connection limit; released when dropped.
pub struct ConnectionSlot {
    pool: Addr<LeasePoolActor>,
}

impl Drop for ConnectionSlot {
    fn drop(&mut self) {
        self.pool.do_send(ReleaseConnection);
    }
}

/// Frees a connection slot (sent by [`ConnectionSlot`]'s drop).
#[derive(Message)]
#[rtype(result = "()")]
struct ReleaseConnection;

/// Returns the current [`PoolStats`].
#[derive(Message)]
#[rtype(result = "PoolStats")]
pub struct GetPoolStats;

/// Test builds only: delay every claim transaction by this long (before it
/// begins).
#[cfg(feature = "test-hooks")]
#[derive(Message)]
#[rtype(result = "()")]
pub struct SetClaimDelay(pub Duration);

/// Test builds only: hold every claim that starts from now on at `point`
/// until the hold is lifted with `HoldClaims(None)` (claims already held
/// then go on).
#[cfg(feature = "test-hooks")]
#[derive(Message)]
#[rtype(result = "()")]
pub struct HoldClaims(pub Option<HoldPoint>);

/// Where [`HoldClaims`] stops a claim.
#[cfg(feature = "test-hooks")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HoldPoint {
    /// Before the transaction begins (no database resource held).
    BeforeTransaction,
    /// Right after `BEGIN` (on SQLite: holding the write lock); on
    /// PostgreSQL, whose claim is one statement without `BEGIN` (decision
    /// 0109), right before that statement.
    InsideTransaction,
}

/// Test hooks of the claim path; inert in other builds.
#[derive(Clone, Default)]
struct ClaimHooks {
    delay: Duration,
    #[cfg(feature = "test-hooks")]
    hold: Option<(HoldPoint, tokio::sync::watch::Receiver<bool>)>,
}

impl ClaimHooks {
    async fn before_transaction(&self) {
        if !self.delay.is_zero() {
            tokio::time::sleep(self.delay).await;
        }
        #[cfg(feature = "test-hooks")]
        self.wait_at(HoldPoint::BeforeTransaction).await;
    }

    async fn inside_transaction(self) {
        #[cfg(feature = "test-hooks")]
        self.wait_at(HoldPoint::InsideTransaction).await;
    }

    #[cfg(feature = "test-hooks")]
    async fn wait_at(&self, point: HoldPoint) {
        if let Some((at, rx)) = &self.hold
            && *at == point
        {
            let mut rx = rx.clone();
            // A dropped sender (the pool is gone) also releases the claim.
            let _ = rx.wait_for(|held| !*held).await;
        }
    }
}

#[derive(Default)]
struct AppQueue {
    by_subscription: HashMap<SubscriptionId, VecDeque<ClaimRequest>>,
    ring: VecDeque<SubscriptionId>,
}

impl AppQueue {
    fn push(&mut self, req: ClaimRequest) {
        let sub = req.target.subscription_id.clone();
        let queue = self.by_subscription.entry(sub.clone()).or_default();
        if queue.is_empty() {
            self.ring.push_back(sub);
        }
        queue.push_back(req);
    }

    /// The waiting requests of the next subscription (at most `max`),
    /// rotating over subscriptions.
    fn pop_batch(&mut self, max: usize) -> Vec<ClaimRequest> {
        let Some(sub) = self.ring.pop_front() else {
            return Vec::new();
        };
        let Some(queue) = self.by_subscription.get_mut(&sub) else {
            return Vec::new();
        };
        let take = queue.len().min(max);
        let batch: Vec<ClaimRequest> = queue.drain(..take).collect();
        if queue.is_empty() {
            self.by_subscription.remove(&sub);
        } else {
            self.ring.push_back(sub);
        }
        batch
    }

    fn is_empty(&self) -> bool {
        self.ring.is_empty()
    }
}

/// The pool actor (one per node).
pub struct LeasePoolActor {
    db: Database,
    limits: PoolLimits,
    lease: Duration,
    apps: HashMap<ApplicationId, AppQueue>,
    app_ring: VecDeque<ApplicationId>,
    in_flight_by_app: HashMap<ApplicationId, usize>,
    stats: PoolStats,
    metrics: Arc<Metrics>,
    hooks: ClaimHooks,
    /// Lifts the current [`HoldClaims`] hold when set to `false`.
    #[cfg(feature = "test-hooks")]
    hold_release: Option<tokio::sync::watch::Sender<bool>>,
}

impl LeasePoolActor {
    pub fn new(
        db: Database,
        limits: PoolLimits,
        lease: Duration,
        metrics: Arc<Metrics>,
    ) -> LeasePoolActor {
        LeasePoolActor {
            db,
            limits,
            lease,
            apps: HashMap::new(),
            app_ring: VecDeque::new(),
            in_flight_by_app: HashMap::new(),
            stats: PoolStats::default(),
            metrics,
            hooks: ClaimHooks::default(),
            #[cfg(feature = "test-hooks")]
            hold_release: None,
        }
    }

    /// Starts claims while slots are free, round-robin over applications
    /// that are below their own limit.
    fn dispatch(&mut self, ctx: &mut Context<Self>) {
        while self.stats.claims_in_flight < self.limits.claims_in_flight {
            let Some(app) = self.next_application() else {
                return;
            };
            let Some(queue) = self.apps.get_mut(&app) else {
                continue;
            };
            let batch = queue.pop_batch(MAX_CLAIM_BATCH);
            if queue.is_empty() {
                self.apps.remove(&app);
                self.app_ring.retain(|a| a != &app);
            }
            if batch.is_empty() {
                continue;
            }
            self.run(app, batch, ctx);
        }
    }

    /// The first application in ring order with work and a free per-app
    /// slot; it moves to the back of the ring.
    fn next_application(&mut self) -> Option<ApplicationId> {
        for _ in 0..self.app_ring.len() {
            let app = self.app_ring.pop_front()?;
            self.app_ring.push_back(app.clone());
            let busy = self.in_flight_by_app.get(&app).copied().unwrap_or(0);
            if busy < self.limits.claims_in_flight_per_application && self.apps.contains_key(&app) {
                return Some(app);
            }
        }
        None
    }

    /// Runs `batch` (requests of one subscription of `app`) as one claim
    /// transaction.
    fn run(&mut self, app: ApplicationId, batch: Vec<ClaimRequest>, ctx: &mut Context<Self>) {
        let n = batch.len();
        self.stats.claims_waiting -= n;
        self.stats.claims_running += n;
        self.stats.claims_in_flight += 1;
        self.stats.max_claims_per_transaction_seen =
            self.stats.max_claims_per_transaction_seen.max(n);
        let per_app = self.in_flight_by_app.entry(app.clone()).or_insert(0);
        *per_app += 1;
        self.stats.max_claims_in_flight_seen = self
            .stats
            .max_claims_in_flight_seen
            .max(self.stats.claims_in_flight);
        self.stats.max_claims_in_flight_per_application_seen = self
            .stats
            .max_claims_in_flight_per_application_seen
            .max(*per_app);

        let db = self.db.clone();
        let lease = self.lease;
        let hooks = self.hooks.clone();
        let waited: Vec<Duration> = batch.iter().map(|r| r.enqueued_at.elapsed()).collect();
        let claims: Vec<(ClaimTarget, u32)> = batch
            .iter()
            .map(|req| (req.target.clone(), req.want))
            .collect();
        let fut = async move {
            hooks.before_transaction().await;
            let started = Instant::now();
            let pause = hooks.inside_transaction();
            let results = claim::claim_each(&db, &claims, lease, pause).await;
            (results, started.elapsed())
        };
        ctx.spawn(fut.into_actor(self).map(move |(results, ran), act, ctx| {
            act.stats.claims_in_flight -= 1;
            act.stats.claims_running -= n;
            act.stats.claims_completed += n as u64;
            if let Some(busy) = act.in_flight_by_app.get_mut(&app) {
                *busy -= 1;
                if *busy == 0 {
                    act.in_flight_by_app.remove(&app);
                }
            }
            for ((req, result), waited) in batch.into_iter().zip(results).zip(waited) {
                act.settle(req, result, waited, ran);
            }
            act.dispatch(ctx);
        }));
    }

    /// Tells the scanner and the connection how one claim ended.
    fn settle(
        &mut self,
        req: ClaimRequest,
        result: Result<ClaimOutcome, StoreError>,
        waited: Duration,
        ran: Duration,
    ) {
        self.metrics
            .claim_finished(&req.application_id, waited, ran);
        let (leased, exhausted, materialized, behind_head) = match &result {
            Ok(ClaimOutcome::Leased {
                deliveries,
                exhausted,
                recovered,
                queue_id,
                materialized,
                behind_head,
            }) => {
                if let Some(m) = materialized.filter(|m| m.inserted > 0) {
                    self.metrics.materialized(queue_id, m.inserted);
                }
                self.metrics.delivered(queue_id, deliveries.len() as u64);
                self.metrics
                    .outcome(Outcome::LeaseExpired, recovered.to_pending);
                self.metrics.outcome(Outcome::Expired, recovered.expired);
                recovered.log_exhausted();
                (
                    deliveries.len() as u32,
                    *exhausted,
                    *materialized,
                    *behind_head,
                )
            }
            _ => (0, true, None, false),
        };
        let failed = result.is_err();
        if result.is_err() {
            // Logged once per batch, where it failed (`batch_or_each`).
            self.metrics.database_error(Operation::Claim);
        }
        tracing::trace!(elapsed_ms = ran.as_millis() as u64, leased, "claim done");
        // The scanner hears of the claim before the connection does, so
        // the room the connection reports after taking the leases always
        // reaches the scanner after this (its mailbox is FIFO).
        req.settled.do_send(ClaimSettled {
            session_id: req.target.session_id.clone(),
            subscription_id: req.target.subscription_id.clone(),
            requested: req.want,
            leased,
            exhausted,
            refused: false,
            failed,
            materialized,
            behind_head,
        });
        req.reply.do_send(ClaimResult { outcome: result });
    }
}

impl Actor for LeasePoolActor {
    type Context = Context<Self>;
}

impl Handler<ClaimRequest> for LeasePoolActor {
    type Result = ();

    fn handle(&mut self, req: ClaimRequest, ctx: &mut Context<Self>) {
        if self.stats.claims_waiting + self.stats.claims_running >= self.limits.claims_queued {
            self.stats.claims_refused += 1;
            self.metrics.claim_refused();
            req.settled.do_send(ClaimSettled {
                session_id: req.target.session_id.clone(),
                subscription_id: req.target.subscription_id.clone(),
                requested: req.want,
                leased: 0,
                exhausted: false,
                refused: true,
                failed: false,
                materialized: None,
                behind_head: false,
            });
            return;
        }
        self.stats.claims_waiting += 1;
        self.stats.max_claims_waiting_seen = self
            .stats
            .max_claims_waiting_seen
            .max(self.stats.claims_waiting);
        let app = req.application_id.clone();
        let queue = self.apps.entry(app.clone()).or_default();
        queue.push(req);
        if !self.app_ring.contains(&app) {
            self.app_ring.push_back(app);
        }
        self.dispatch(ctx);
    }
}

impl Handler<AdmitConnection> for LeasePoolActor {
    type Result = Result<ConnectionSlot, AtCapacity>;

    fn handle(&mut self, _: AdmitConnection, ctx: &mut Context<Self>) -> Self::Result {
        if self.stats.connections >= self.limits.max_connections {
            return Err(AtCapacity);
        }
        self.stats.connections += 1;
        Ok(ConnectionSlot {
            pool: ctx.address(),
        })
    }
}

impl Handler<ReleaseConnection> for LeasePoolActor {
    type Result = ();

    fn handle(&mut self, _: ReleaseConnection, _: &mut Context<Self>) {
        self.stats.connections = self.stats.connections.saturating_sub(1);
    }
}

impl Handler<GetPoolStats> for LeasePoolActor {
    type Result = MessageResult<GetPoolStats>;

    fn handle(&mut self, _: GetPoolStats, _: &mut Context<Self>) -> Self::Result {
        MessageResult(self.stats)
    }
}

#[cfg(feature = "test-hooks")]
impl Handler<SetClaimDelay> for LeasePoolActor {
    type Result = ();

    fn handle(&mut self, msg: SetClaimDelay, _: &mut Context<Self>) {
        self.hooks.delay = msg.0;
    }
}

#[cfg(feature = "test-hooks")]
impl Handler<HoldClaims> for LeasePoolActor {
    type Result = ();

    fn handle(&mut self, msg: HoldClaims, _: &mut Context<Self>) {
        if let Some(release) = self.hold_release.take() {
            release.send_replace(false);
        }
        self.hooks.hold = msg.0.map(|point| {
            let (tx, rx) = tokio::sync::watch::channel(true);
            self.hold_release = Some(tx);
            (point, rx)
        });
    }
}
