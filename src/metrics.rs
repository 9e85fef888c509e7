//! Prometheus metrics of one node, served at `GET /metrics` in the
//! Prometheus text format 0.0.4 (spec: architecture.md §6; every metric is
//! listed in `docs/operations.md`).
//!
//! The registry belongs to the node (one [`Metrics`] per
//! [`crate::startup::Application`]), not to the process, so several nodes in
//! one test process keep their numbers apart. Counters and histograms are
//! updated where things happen (pool, scanner, connections, append path,
//! sweeper); gauges about the pool are read from the pool actor and gauges
//! about subscriptions and queues from the database, both when scraped.

use std::{
    fmt::Write as _,
    sync::{Mutex, atomic::AtomicU64},
    time::Duration,
};

use prometheus_client::{
    encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder, prometheus_text},
    metrics::{counter::Counter, family::Family, gauge::Gauge, histogram::Histogram},
    registry::{Registry, Unit},
};

use crate::{
    domain::{ApplicationId, QueueId},
    store::{WriterStats, backlog::Backlog, writer::FaultCause},
};

/// The `Content-Type` of `GET /metrics`.
pub const CONTENT_TYPE: &str = prometheus_text::CONTENT_TYPE;

/// Latency buckets in seconds: 0.5 ms to 10 s.
const LATENCY_BUCKETS: [f64; 14] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// What happened to a delivery (label `outcome` of
/// `orbit_events_deliveries_total`).
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum Outcome {
    /// Leased to a session by a claim (an `event.deliver` follows).
    Leased,
    /// ACKed with its latest proof.
    Acked,
    /// An ACK repeated with the proof that had acknowledged it.
    AckDeduplicated,
    /// An ACK with a proof that was not the latest (`DELIVERY_LEASE_LOST`).
    LeaseLost,
    /// A lapsed lease recovered to PENDING (offered again).
    LeaseExpired,
    /// A lapsed lease at its attempt budget: EXPIRED (dead letter).
    Expired,
}

/// Where a database call failed (label `operation` of
/// `orbit_events_database_errors_total`).
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum Operation {
    Claim,
    Ack,
    Hello,
    Ping,
    Materialize,
    Sweep,
    Metrics,
    /// A management HTTP request answered `UNAVAILABLE`.
    Http,
}

/// What retention purged (label `kind` of `orbit_events_purged_total`).
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum Purged {
    Events,
    AckedDeliveries,
    IdempotencyRecords,
    Sessions,
}

/// The lease pool's gauges at scrape time (the pool reports them:
/// `delivery::pool::PoolStats::gauges`).
#[derive(Clone, Copy, Debug, Default)]
pub struct PoolGauges {
    pub connections: usize,
    pub claims_waiting: usize,
    pub claims_in_flight: usize,
    pub max_claims_waiting_seen: usize,
    pub max_claims_in_flight_seen: usize,
    pub max_claims_in_flight_per_application_seen: usize,
}

/// Label values are the snake_case names documented in `docs/operations.md`.
macro_rules! label_values {
    ($ty:ty { $($variant:ident => $name:literal),* $(,)? }) => {
        impl $ty {
            pub fn as_str(self) -> &'static str {
                match self {
                    $(Self::$variant => $name,)*
                }
            }
        }

        impl EncodeLabelValue for $ty {
            fn encode(&self, encoder: &mut LabelValueEncoder) -> Result<(), std::fmt::Error> {
                encoder.write_str(self.as_str())
            }
        }
    };
}

label_values!(Outcome {
    Leased => "leased",
    Acked => "acked",
    AckDeduplicated => "ack_deduplicated",
    LeaseLost => "lease_lost",
    LeaseExpired => "lease_expired",
    Expired => "expired",
});

label_values!(Operation {
    Claim => "claim",
    Ack => "ack",
    Hello => "hello",
    Ping => "ping",
    Materialize => "materialize",
    Sweep => "sweep",
    Metrics => "metrics",
    Http => "http",
});

label_values!(Purged {
    Events => "events",
    AckedDeliveries => "acked_deliveries",
    IdempotencyRecords => "idempotency_records",
    Sessions => "sessions",
});

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct QueueLabels {
    queue_id: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SubscriptionLabels {
    subscription_id: String,
    queue_id: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ApplicationLabels {
    application_id: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    outcome: Outcome,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OperationLabels {
    operation: Operation,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PurgedLabels {
    kind: Purged,
}

impl EncodeLabelValue for FaultCause {
    fn encode(&self, encoder: &mut LabelValueEncoder) -> Result<(), std::fmt::Error> {
        encoder.write_str(self.as_str())
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FaultLabels {
    cause: FaultCause,
}

/// An HTTP request's route template (`/v1/subscriptions/{id}`, or
/// `unmatched` for a path no route has: labels stay a fixed set), method
/// and status.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct HttpLabels {
    method: String,
    route: String,
    status: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct HttpRouteLabels {
    method: String,
    route: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BuildLabels {
    version: String,
    commit: String,
}

type FloatGauge = Gauge<f64, AtomicU64>;
type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

fn latency_histogram() -> Histogram {
    Histogram::new(LATENCY_BUCKETS)
}

/// The node's metrics. Cheap to share (`Arc<Metrics>`); every update is an
/// atomic operation, so actors call these methods on their own threads.
pub struct Metrics {
    registry: Registry,
    /// Serializes the refresh of the scrape-time gauges and the encoding.
    scrape: Mutex<()>,

    connections: Gauge,
    connections_refused: Counter,
    claims_waiting: Gauge,
    claims_in_flight: Gauge,
    claims_waiting_high_water: Gauge,
    claims_in_flight_high_water: Gauge,
    claims_in_flight_per_application_high_water: Gauge,
    claims_refused: Counter,
    claims: Family<ApplicationLabels, Counter>,
    claim_wait: Histogram,
    claim_duration: Histogram,
    ack_duration: Histogram,
    deliveries: Family<OutcomeLabels, Counter>,
    database_errors: Family<OperationLabels, Counter>,
    purged: Family<PurgedLabels, Counter>,
    write_faults: Family<FaultLabels, Counter>,
    write_connections_replaced: Counter,
    writes_refused: Gauge,

    appended: Family<QueueLabels, Counter>,
    materialized: Family<QueueLabels, Counter>,
    delivered: Family<QueueLabels, Counter>,
    acked: Family<QueueLabels, Counter>,

    queue_head: Family<QueueLabels, Gauge>,
    queue_floor: Family<QueueLabels, Gauge>,
    subscription_lag: Family<SubscriptionLabels, Gauge>,
    subscription_expired: Family<SubscriptionLabels, Gauge>,
    subscription_backlog: Family<SubscriptionLabels, Gauge>,
    subscription_max_pending: Family<SubscriptionLabels, Gauge>,
    subscription_oldest_unacked: Family<SubscriptionLabels, FloatGauge>,

    http_requests: Family<HttpLabels, Counter>,
    http_request_duration: HistogramFamily<HttpRouteLabels>,
    build_info: Family<BuildLabels, Gauge>,
}

impl Default for Metrics {
    fn default() -> Metrics {
        Metrics::new()
    }
}

impl Metrics {
    /// A fresh registry with every metric registered (all at zero).
    pub fn new() -> Metrics {
        let mut m = Metrics {
            registry: Registry::with_prefix("orbit_events"),
            scrape: Mutex::new(()),
            connections: Gauge::default(),
            connections_refused: Counter::default(),
            claims_waiting: Gauge::default(),
            claims_in_flight: Gauge::default(),
            claims_waiting_high_water: Gauge::default(),
            claims_in_flight_high_water: Gauge::default(),
            claims_in_flight_per_application_high_water: Gauge::default(),
            claims_refused: Counter::default(),
            claims: Family::default(),
            claim_wait: latency_histogram(),
            claim_duration: latency_histogram(),
            ack_duration: latency_histogram(),
            deliveries: Family::default(),
            database_errors: Family::default(),
            purged: Family::default(),
            write_faults: Family::default(),
            write_connections_replaced: Counter::default(),
            writes_refused: Gauge::default(),
            appended: Family::default(),
            materialized: Family::default(),
            delivered: Family::default(),
            acked: Family::default(),
            queue_head: Family::default(),
            queue_floor: Family::default(),
            subscription_lag: Family::default(),
            subscription_expired: Family::default(),
            subscription_backlog: Family::default(),
            subscription_max_pending: Family::default(),
            subscription_oldest_unacked: Family::default(),
            http_requests: Family::default(),
            http_request_duration: Family::new_with_constructor(latency_histogram),
            build_info: Family::default(),
        };
        m.build_info
            .get_or_create(&BuildLabels {
                version: crate::version::VERSION.to_owned(),
                commit: crate::version::COMMIT.to_owned(),
            })
            .set(1);
        m.register();
        m
    }

    fn register(&mut self) {
        let r = &mut self.registry;
        r.register(
            "connections",
            "WebSocket connections of this node, counted from the upgrade (before hello)",
            self.connections.clone(),
        );
        r.register(
            "connections_refused",
            "Upgrades refused at the node connection limit (429 CAPACITY_EXCEEDED)",
            self.connections_refused.clone(),
        );
        r.register(
            "claims_waiting",
            "Claim requests waiting in the lease pool",
            self.claims_waiting.clone(),
        );
        r.register(
            "claims_in_flight",
            "Claim transactions running",
            self.claims_in_flight.clone(),
        );
        r.register(
            "claims_waiting_high_water",
            "Most claim requests ever waiting at once since the node started",
            self.claims_waiting_high_water.clone(),
        );
        r.register(
            "claims_in_flight_high_water",
            "Most claim transactions ever running at once since the node started",
            self.claims_in_flight_high_water.clone(),
        );
        r.register(
            "claims_in_flight_per_application_high_water",
            "Most claim transactions of one application ever running at once since the node started",
            self.claims_in_flight_per_application_high_water.clone(),
        );
        r.register(
            "claims_refused",
            "Claim requests refused because the pool was full (retried on a later round)",
            self.claims_refused.clone(),
        );
        r.register(
            "claims",
            "Claims finished (one per session claim; several can share a transaction), by application",
            self.claims.clone(),
        );
        r.register_with_unit(
            "claim_wait",
            "Time a claim request waited in the pool before its transaction started",
            Unit::Seconds,
            self.claim_wait.clone(),
        );
        r.register_with_unit(
            "claim_duration",
            "Duration of claim transactions",
            Unit::Seconds,
            self.claim_duration.clone(),
        );
        r.register_with_unit(
            "ack_duration",
            "Duration of ACKs, from the frame's arrival to its answer (after the commit)",
            Unit::Seconds,
            self.ack_duration.clone(),
        );
        r.register(
            "deliveries",
            "Delivery state changes and ACK answers, by outcome",
            self.deliveries.clone(),
        );
        r.register(
            "database_errors",
            "Database calls that failed, by operation",
            self.database_errors.clone(),
        );
        r.register(
            "purged",
            "Rows removed by retention, by kind",
            self.purged.clone(),
        );
        r.register(
            "write_faults",
            "Write transactions that failed on a fault of the database (answered UNAVAILABLE), by cause",
            self.write_faults.clone(),
        );
        r.register(
            "write_connections_replaced",
            "SQLite write connections closed and replaced after a fault",
            self.write_connections_replaced.clone(),
        );
        r.register(
            "writes_refused",
            "1 while the database refuses writes (from a fault until a write commits again), else 0",
            self.writes_refused.clone(),
        );
        r.register(
            "appended",
            "Census: events appended to the queue's log by this node",
            self.appended.clone(),
        );
        r.register(
            "materialized",
            "Census: deliveries created (log entries read into deliveries) by this node",
            self.materialized.clone(),
        );
        r.register(
            "delivered",
            "Census: leases handed to consumers (first offers and redeliveries) by this node",
            self.delivered.clone(),
        );
        r.register(
            "acked",
            "Census: deliveries ACKed on this node",
            self.acked.clone(),
        );
        r.register(
            "queue_head_sequence",
            "Committed head of the queue's log (from the database)",
            self.queue_head.clone(),
        );
        r.register(
            "queue_retention_floor",
            "Highest purged sequence of the queue's log (from the database)",
            self.queue_floor.clone(),
        );
        r.register(
            "subscription_lag",
            "Entries of the log not yet read by the subscription: head - cursor (from the database)",
            self.subscription_lag.clone(),
        );
        r.register(
            "subscription_expired",
            "EXPIRED deliveries of the subscription, waiting for an admin's retry (from the database)",
            self.subscription_expired.clone(),
        );
        r.register(
            "subscription_backlog",
            "Deliveries of the subscription not yet ACKed (pending_count, from the database)",
            self.subscription_backlog.clone(),
        );
        r.register(
            "subscription_max_pending",
            "The subscription's backlog limit (from the database)",
            self.subscription_max_pending.clone(),
        );
        r.register_with_unit(
            "subscription_oldest_unacked_age",
            "Age of the subscription's oldest delivery not yet ACKed; 0 when none (from the database)",
            Unit::Seconds,
            self.subscription_oldest_unacked.clone(),
        );
        r.register(
            "http_requests",
            "HTTP requests answered, by method, route template and status",
            self.http_requests.clone(),
        );
        r.register_with_unit(
            "http_request_duration",
            "Time from an HTTP request's arrival to its answer, by method and route template",
            Unit::Seconds,
            self.http_request_duration.clone(),
        );
        r.register(
            "build_info",
            "1, labelled with the node's version and the commit it was built from (empty when unknown)",
            self.build_info.clone(),
        );
    }

    /// `n` events were appended to `queue_id`'s log (after the commit).
    pub fn appended(&self, queue_id: &QueueId, n: u64) {
        self.appended.get_or_create(&queue(queue_id)).inc_by(n);
    }

    /// `n` deliveries were materialized for a subscription of `queue_id`.
    pub fn materialized(&self, queue_id: &QueueId, n: u64) {
        if n > 0 {
            self.materialized.get_or_create(&queue(queue_id)).inc_by(n);
        }
    }

    /// A claim committed `n` leases for a subscription of `queue_id`.
    pub fn delivered(&self, queue_id: &QueueId, n: u64) {
        if n > 0 {
            self.delivered.get_or_create(&queue(queue_id)).inc_by(n);
            self.outcome(Outcome::Leased, n);
        }
    }

    /// A delivery of a subscription of `queue_id` was ACKed (not a repeat).
    pub fn acked(&self, queue_id: &QueueId) {
        self.acked.get_or_create(&queue(queue_id)).inc();
        self.outcome(Outcome::Acked, 1);
    }

    /// `n` deliveries had `outcome`.
    pub fn outcome(&self, outcome: Outcome, n: u64) {
        if n > 0 {
            self.deliveries
                .get_or_create(&OutcomeLabels { outcome })
                .inc_by(n);
        }
    }

    /// A claim of `application_id` finished (its transaction may have
    /// carried other claims of the same subscription) after waiting
    /// `waited` in the pool and running for `ran`.
    pub fn claim_finished(&self, application_id: &ApplicationId, waited: Duration, ran: Duration) {
        self.claims
            .get_or_create(&ApplicationLabels {
                application_id: application_id.to_string(),
            })
            .inc();
        self.claim_wait.observe(waited.as_secs_f64());
        self.claim_duration.observe(ran.as_secs_f64());
    }

    /// An HTTP request to `route` (a template, or `unmatched`) was answered
    /// `status` after `elapsed`.
    pub fn http_request(&self, method: &str, route: &str, status: u16, elapsed: Duration) {
        self.http_requests
            .get_or_create(&HttpLabels {
                method: method.to_owned(),
                route: route.to_owned(),
                status,
            })
            .inc();
        self.http_request_duration
            .get_or_create(&HttpRouteLabels {
                method: method.to_owned(),
                route: route.to_owned(),
            })
            .observe(elapsed.as_secs_f64());
    }

    /// The pool refused a claim request (it was full).
    pub fn claim_refused(&self) {
        self.claims_refused.inc();
    }

    /// An upgrade was refused at the node connection limit.
    pub fn connection_refused(&self) {
        self.connections_refused.inc();
    }

    /// An ACK took `elapsed` from its frame to its answer.
    pub fn ack_finished(&self, elapsed: Duration) {
        self.ack_duration.observe(elapsed.as_secs_f64());
    }

    /// A database call of `operation` failed.
    pub fn database_error(&self, operation: Operation) {
        self.database_errors
            .get_or_create(&OperationLabels { operation })
            .inc();
    }

    /// Retention removed `n` rows of `kind`.
    pub fn purged(&self, kind: Purged, n: u64) {
        if n > 0 {
            self.purged.get_or_create(&PurgedLabels { kind }).inc_by(n);
        }
    }

    /// The text exposition: the pool gauges from `pool`, the queue and
    /// subscription gauges from `backlog`, the writer's from `writer` (all
    /// read just before).
    pub fn encode(
        &self,
        pool: &PoolGauges,
        backlog: &Backlog,
        writer: &WriterStats,
    ) -> Result<String, std::fmt::Error> {
        let _guard = self.scrape.lock().unwrap_or_else(|e| e.into_inner());
        // The writer counts on its own (it has no metrics handle); counters
        // catch up with its totals here.
        let catch_up = |c: &Counter, total: u64| {
            c.inc_by(total.saturating_sub(c.get()));
        };
        for (cause, total) in &writer.faults {
            catch_up(
                &self
                    .write_faults
                    .get_or_create(&FaultLabels { cause: *cause }),
                *total,
            );
        }
        catch_up(
            &self.write_connections_replaced,
            writer.connections_replaced,
        );
        self.writes_refused.set(i64::from(writer.refusing));
        let gauge = |g: &Gauge, v: usize| {
            g.set(i64::try_from(v).unwrap_or(i64::MAX));
        };
        gauge(&self.connections, pool.connections);
        gauge(&self.claims_waiting, pool.claims_waiting);
        gauge(&self.claims_in_flight, pool.claims_in_flight);
        gauge(
            &self.claims_waiting_high_water,
            pool.max_claims_waiting_seen,
        );
        gauge(
            &self.claims_in_flight_high_water,
            pool.max_claims_in_flight_seen,
        );
        gauge(
            &self.claims_in_flight_per_application_high_water,
            pool.max_claims_in_flight_per_application_seen,
        );

        // Rebuilt on every scrape, so deleted queues and subscriptions
        // disappear instead of keeping their last value.
        self.queue_head.clear();
        self.queue_floor.clear();
        for q in &backlog.queues {
            let labels = QueueLabels {
                queue_id: q.queue_id.clone(),
            };
            self.queue_head.get_or_create(&labels).set(q.head);
            self.queue_floor.get_or_create(&labels).set(q.floor);
        }
        self.subscription_lag.clear();
        self.subscription_expired.clear();
        self.subscription_backlog.clear();
        self.subscription_max_pending.clear();
        self.subscription_oldest_unacked.clear();
        for s in &backlog.subscriptions {
            let labels = SubscriptionLabels {
                subscription_id: s.subscription_id.clone(),
                queue_id: s.queue_id.clone(),
            };
            self.subscription_lag
                .get_or_create(&labels)
                .set((s.head - s.cursor).max(0));
            self.subscription_expired
                .get_or_create(&labels)
                .set(s.expired);
            self.subscription_backlog
                .get_or_create(&labels)
                .set(s.pending_count);
            self.subscription_max_pending
                .get_or_create(&labels)
                .set(s.max_pending);
            self.subscription_oldest_unacked
                .get_or_create(&labels)
                .set(s.oldest_unacked_age.as_secs_f64());
        }

        let mut text = String::new();
        prometheus_text::encode(&mut text, &self.registry)?;
        Ok(text)
    }
}

fn queue(queue_id: &QueueId) -> QueueLabels {
    QueueLabels {
        queue_id: queue_id.to_string(),
    }
}
