//! Building, running and stopping one node: `Application::build(settings)`
//! binds the listener (port 0 picks a free one, for tests) and starts the
//! actors; a node stops completely (HTTP server, delivery thread, pools)
//! when its server stops. [`NodeThread`] runs one on a thread of its own.

use std::{
    net::TcpListener,
    sync::Arc,
    time::{Duration, Instant},
};

use actix::Actor;
use actix_web::{
    dev::{Server, ServerHandle},
    web,
};
use sea_orm::DbBackend;

use crate::{
    config::Settings,
    delivery::{
        listener::{self, Announcer},
        pool::{GetPoolStats, LeasePoolActor, PoolLimits},
        scanner::{JournalAppended, JournalCommitted, ScannerActor},
        sweeper::SweeperActor,
    },
    domain::{NodeId, now},
    http,
    metrics::Metrics,
    node::{DeliveryThread, Shutdown},
    state::AppState,
    store::{
        Database, retention, sessions,
        writer::queues::{AppendPhase, Queues},
    },
};

/// How long a stopping node waits for its connections to finish their
/// in-flight database work and close (1001) before it stops regardless.
/// Bounded by the slowest database call (a pool acquire, 10 s, plus a
/// SQLite busy wait, 5 s) with room to spare.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(25);

/// How long a stopped node waits for its pools to close: every connection
/// is back by then unless something outside the node still holds one.
const POOL_CLOSE_TIMEOUT: Duration = Duration::from_secs(5);

/// Why a node could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartupError {
    #[error("database: {0}")]
    Database(#[from] crate::store::StoreError),
    #[error("cannot listen on {address}: {source}{hint}", hint = listen_hint(.source))]
    Listen {
        address: String,
        source: std::io::Error,
    },
    #[error("cannot start a thread: {0}")]
    Thread(std::io::Error),
}

/// A built node, listening, not yet running. Dropped without being run,
/// it stops its delivery thread (and its HTTP workers) at once.
///
/// Stopping a running node (decision 0070): call [`Shutdown::begin`] on
/// [`Application::shutdown`] (what SIGTERM does: WebSocket connections
/// drain and close with 1001, then in-flight HTTP requests get 5 s) or
/// [`Shutdown::begin_prompt`] (the same drain, then open HTTP connections
/// close at once), and await [`Application::run_until_stopped`]: it returns
/// once the HTTP server, the delivery actors, the PostgreSQL listener and
/// the database pools have all stopped, so the node holds no thread, task
/// or database connection any more. [`NodeThread`] does the same for a
/// node running on a thread of its own.
pub struct Application {
    port: u16,
    server: Server,
    state: AppState,
    delivery: DeliveryThread,
}

impl Application {
    /// Connects and migrates the database, starts the lease pool, the
    /// scanner and the sweeper on their own arbiter (on PostgreSQL also the
    /// cross-node NOTIFY sender and LISTENer), and binds `server.listen`.
    pub async fn build(settings: Settings) -> Result<Application, StartupError> {
        let db = Database::connect(&settings.database).await?;
        db.migrate().await?;
        Self::build_with_database(settings, db).await
    }

    /// As [`Application::build`], on an already connected and migrated database.
    pub async fn build_with_database(
        settings: Settings,
        db: Database,
    ) -> Result<Application, StartupError> {
        let settings = Arc::new(settings);
        let node_id = NodeId::generate();
        let metrics = Arc::new(Metrics::new());
        if db.backend() == DbBackend::Sqlite {
            // One node owns a SQLite database: sessions still open are
            // those of a node that stopped without closing them (killed);
            // decision 0041.
            let closed = retention::close_foreign_sessions(&db, &node_id, now()).await?;
            if closed > 0 {
                tracing::info!(
                    sessions = closed,
                    "closed sessions left open by a previous run"
                );
            }
        }

        // The delivery actors get their own thread so that claim and
        // materialization futures never share a thread with HTTP workers.
        let limits = &settings.limits;
        let pool_limits = PoolLimits {
            max_connections: limits.max_connections,
            claims_in_flight: limits.claims_in_flight,
            claims_in_flight_per_application: limits.claims_in_flight_per_application,
            claims_queued: limits.claims_queued,
        };
        let lease = settings.timing.lease();
        let per_round = limits.claims_per_scan_round;
        let scan_interval = settings.timing.scan_interval();
        let sweep_interval = settings.timing.sweep_interval();
        let retention_settings = settings.retention.clone();
        let listen_url = settings.database.url.clone();
        let delivery_db = db.clone();
        let queues_db = db.clone();
        let metrics_for_publishes = metrics.clone();
        let idempotency_ttl =
            std::time::Duration::from_secs(settings.retention.idempotency_max_age_s);
        let delivery_node = node_id.clone();
        let delivery_metrics = metrics.clone();
        let (delivery, (pool, scanner, sweeper, writes)) = DeliveryThread::start(move || {
            let (db, node_id, metrics) = (delivery_db, delivery_node, delivery_metrics);
            let pool = LeasePoolActor::new(db.clone(), pool_limits, lease, metrics.clone()).start();
            // Several nodes share one database only on PostgreSQL: there,
            // local wakes are NOTIFYed to the other nodes and theirs are
            // LISTENed for.
            let shared = db.backend() == DbBackend::Postgres;
            let announcer = shared.then(|| Announcer::start(db.clone(), node_id.clone()));
            let scanner = ScannerActor::new(
                db.clone(),
                pool.clone(),
                per_round,
                scan_interval,
                announcer,
                metrics.clone(),
            )
            .start();
            let sweeper = SweeperActor::new(
                db,
                node_id.clone(),
                scanner.clone(),
                metrics,
                sweep_interval,
                retention_settings,
            )
            .start();
            if shared {
                listener::start_listener(listen_url, node_id, scanner.clone());
            }
            // Every fresh publish wakes the scanner and is counted, whether
            // or not its caller still waits. On SQLite the wake comes once
            // its statements ran, so that the claim it starts can share its
            // commit (decision 0098), and the commit marks the queue's
            // subscriptions for materialization; on PostgreSQL a claim sees
            // only committed rows, so the wake follows the commit.
            let appended = scanner.clone();
            let wake_before_commit = !shared;
            let writes = Queues::start(
                queues_db,
                idempotency_ttl,
                Arc::new(
                    move |queue_id, n, phase| match (phase, wake_before_commit) {
                        (AppendPhase::Written { batch }, true) => {
                            appended.do_send(JournalAppended {
                                queue_id: queue_id.clone(),
                                entries: n,
                                batch: Some(batch),
                            });
                        }
                        (AppendPhase::Written { .. }, false) => {}
                        (AppendPhase::Committed { batch }, before) => {
                            metrics_for_publishes.appended(queue_id, n);
                            if before {
                                appended.do_send(JournalCommitted {
                                    queue_id: queue_id.clone(),
                                    batch,
                                });
                            } else {
                                appended.do_send(JournalAppended {
                                    queue_id: queue_id.clone(),
                                    entries: n,
                                    batch: None,
                                });
                            }
                        }
                    },
                ),
            );
            (pool, scanner, sweeper, writes)
        })
        .map_err(StartupError::Thread)?;

        let metrics_listener = match &settings.server.metrics_listen {
            Some(address) => Some(bind(address)?),
            None => None,
        };
        let state = AppState {
            metrics_addr: metrics_listener.as_ref().map(|(_, addr)| *addr),
            db,
            settings: settings.clone(),
            scanner,
            pool,
            sweeper,
            writes,
            metrics,
            node_id,
            shutdown: Shutdown::new(),
        };

        let (listener, addr) = bind(&settings.server.listen)?;
        let port = addr.port();

        let user_timeout = settings.timing.write_timeout();
        let data = web::Data::new(state.clone());
        let mut listeners = vec![listener];
        listeners.extend(metrics_listener.map(|(listener, _)| listener));
        // The metrics listener serves the same app; the envelope middleware
        // keeps each route to its listener.
        let server = http::server::serve(listeners, data, user_timeout).map_err(|source| {
            StartupError::Listen {
                address: settings.server.listen.clone(),
                source,
            }
        })?;

        Ok(Application {
            port,
            server,
            state,
            delivery,
        })
    }

    /// The bound port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The bound port of `server.metrics_listen`, when set.
    pub fn metrics_port(&self) -> Option<u16> {
        self.state.metrics_addr.map(|a| a.port())
    }

    /// The shared state (database, actors), for tests and tools.
    pub fn state(&self) -> &AppState {
        &self.state
    }

    /// The node's stop handle (the one in its state): see [`Application`]
    /// for what stopping does.
    pub fn shutdown(&self) -> Shutdown {
        self.state.shutdown.clone()
    }

    /// Serves until the server stops, then stops the rest of the node: the
    /// delivery thread (its actors and the PostgreSQL listener are dropped
    /// inside its live runtime) and the database pools, so nothing of the
    /// node keeps running or holds a connection afterwards. When
    /// [`Shutdown::begin`] (or [`Shutdown::begin_prompt`]) is called, by
    /// `run_until_signal`, [`NodeThread`] or a test, the node drains first:
    /// see [`drain`].
    pub async fn run_until_stopped(self) -> std::io::Result<()> {
        let Application {
            server,
            state,
            delivery,
            ..
        } = self;
        let handle = server.handle();
        let drained = state.clone();
        let drainer = actix_web::rt::spawn(async move {
            drained.shutdown.begun().await;
            drain(&drained, handle).await;
        });
        let result = server.await;
        drainer.abort();
        delivery.stop().await;
        match tokio::time::timeout(POOL_CLOSE_TIMEOUT, state.db.close()).await {
            Ok(Ok(())) => {}
            Ok(Err(err)) => tracing::warn!(error = %err, "could not close the database pools"),
            Err(_) => tracing::warn!("database connections still in use after the node stopped"),
        }
        result
    }

    /// As [`Application::run_until_stopped`], draining on the first SIGTERM
    /// or SIGINT; a second signal stops at once (protocol.md §3).
    pub async fn run_until_signal(self) -> std::io::Result<()> {
        let shutdown = self.state.shutdown.clone();
        let handle = self.server.handle();
        actix_web::rt::spawn(async move {
            if let Err(err) = next_signal().await {
                tracing::error!(error = %err, "cannot listen for SIGTERM/SIGINT");
                return;
            }
            tracing::info!("shutting down: closing connections after in-flight work");
            shutdown.begin();
            if next_signal().await.is_ok() {
                tracing::warn!("second signal: stopping now");
                handle.stop(false).await;
            }
        });
        self.run_until_stopped().await
    }

    /// A handle that can stop the server.
    pub fn server_handle(&self) -> actix_web::dev::ServerHandle {
        self.server.handle()
    }
}

/// Drains a node: stop accepting, wait (at most [`SHUTDOWN_GRACE`]) until
/// every WebSocket connection has finished its in-flight database work and
/// closed with 1001, mark this node's sessions closed, then stop the HTTP
/// server: gracefully, or at once after [`Shutdown::begin_prompt`]. Leases
/// already committed stay in the database and are recovered after they
/// lapse.
async fn drain(state: &AppState, handle: ServerHandle) {
    handle.pause().await;
    let deadline = Instant::now() + SHUTDOWN_GRACE;
    loop {
        match state.pool.send(GetPoolStats).await {
            Ok(stats) if stats.connections > 0 && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Ok(stats) if stats.connections > 0 => {
                tracing::warn!(
                    connections = stats.connections,
                    "connections still open after the shutdown grace"
                );
                break;
            }
            _ => break,
        }
    }
    let closed = state
        .db
        .write_alone(async |txn| sessions::close_node_sessions(txn, &state.node_id).await);
    match closed.await {
        Ok(n) if n > 0 => tracing::info!(sessions = n, "closed this node's remaining sessions"),
        Ok(_) => {}
        Err(err) => tracing::warn!(error = %err, "could not close this node's sessions"),
    }
    handle.stop(!state.shutdown.is_prompt()).await;
}

/// What to do about a listen error, when there is something to say.
fn listen_hint(source: &std::io::Error) -> &'static str {
    match source.kind() {
        std::io::ErrorKind::AddrInUse => {
            "; another process serves there: choose another address (ORBIT_EVENTS__SERVER__LISTEN \
             for server.listen, ORBIT_EVENTS__SERVER__METRICS_LISTEN for server.metrics_listen); \
             a second node on SQLite also needs its own database file"
        }
        _ => "",
    }
}

/// Binds `address` (`host:port`); the error names it.
fn bind(address: &str) -> Result<(TcpListener, std::net::SocketAddr), StartupError> {
    let failed = |source| StartupError::Listen {
        address: address.to_owned(),
        source,
    };
    let listener = TcpListener::bind(address).map_err(failed)?;
    let addr = listener.local_addr().map_err(failed)?;
    Ok((listener, addr))
}

/// The next SIGTERM or SIGINT.
async fn next_signal() -> std::io::Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    tokio::select! {
        _ = term.recv() => Ok(()),
        _ = int.recv() => Ok(()),
    }
}
