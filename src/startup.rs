//! Building and running one node: `Application::build(settings)` binds the
//! listener (port 0 picks a free one, for tests) and starts the actors.

use std::{
    net::TcpListener,
    sync::Arc,
    time::{Duration, Instant},
};

use actix::{Actor, Addr, Arbiter};
use actix_web::{
    App, HttpServer,
    dev::{Server, ServerHandle},
    middleware::from_fn,
    web,
};
use sea_orm::DbBackend;
use tokio::sync::watch;

use crate::{
    config::Settings,
    delivery::{
        acks::AckBatcher,
        listener::{self, Announcer},
        pool::{GetPoolStats, LeasePoolActor, PoolLimits},
        scanner::ScannerActor,
        sweeper::SweeperActor,
    },
    domain::{NodeId, now},
    http,
    metrics::Metrics,
    state::AppState,
    store::{Database, retention, sessions},
};

/// How long a stopping node waits for its connections to finish their
/// in-flight database work and close (1001) before it stops regardless.
/// Bounded by the slowest database call (a pool acquire, 10 s, plus a
/// SQLite busy wait, 5 s) with room to spare.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(25);

/// Why a node could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartupError {
    #[error("database: {0}")]
    Database(#[from] sea_orm::DbErr),
    #[error("cannot listen on {address}: {source}")]
    Listen {
        address: String,
        source: std::io::Error,
    },
}

/// A built node, listening, not yet running.
pub struct Application {
    port: u16,
    server: Server,
    state: AppState,
    _delivery: Arbiter,
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
        let delivery = Arbiter::new();
        let limits = &settings.limits;
        let pool_limits = PoolLimits {
            max_connections: limits.max_connections,
            claims_in_flight: limits.claims_in_flight,
            claims_in_flight_per_application: limits.claims_in_flight_per_application,
            claims_queued: limits.claims_queued,
        };
        let lease = settings.timing.lease();
        let pool_db = db.clone();
        let pool_metrics = metrics.clone();
        let pool: Addr<LeasePoolActor> =
            LeasePoolActor::start_in_arbiter(&delivery.handle(), move |_| {
                LeasePoolActor::new(pool_db, pool_limits, lease, pool_metrics)
            });
        // Several nodes share one database only on PostgreSQL: there, local
        // wakes are NOTIFYed to the other nodes and theirs are LISTENed for.
        let shared = db.backend() == DbBackend::Postgres;
        let announcer =
            shared.then(|| Announcer::start(db.clone(), node_id.clone(), &delivery.handle()));
        let scanner_db = db.clone();
        let scanner_pool = pool.clone();
        let per_round = limits.claims_per_scan_round;
        let scan_interval = settings.timing.scan_interval();
        let scanner_metrics = metrics.clone();
        let scanner: Addr<ScannerActor> =
            ScannerActor::start_in_arbiter(&delivery.handle(), move |_| {
                ScannerActor::new(
                    scanner_db,
                    scanner_pool,
                    per_round,
                    scan_interval,
                    announcer,
                    scanner_metrics,
                )
            });
        let sweeper_db = db.clone();
        let sweeper_node = node_id.clone();
        let sweeper_scanner = scanner.clone();
        let sweeper_metrics = metrics.clone();
        let sweep_interval = settings.timing.sweep_interval();
        let retention_settings = settings.retention.clone();
        let sweeper: Addr<SweeperActor> =
            SweeperActor::start_in_arbiter(&delivery.handle(), move |_| {
                SweeperActor::new(
                    sweeper_db,
                    sweeper_node,
                    sweeper_scanner,
                    sweeper_metrics,
                    sweep_interval,
                    retention_settings,
                )
            });
        if shared {
            listener::start_listener(
                settings.database.url.clone(),
                node_id.clone(),
                scanner.clone(),
                &delivery.handle(),
            );
        }

        let acks = AckBatcher::start(db.clone(), &delivery.handle());
        let state = AppState {
            db,
            settings: settings.clone(),
            scanner,
            pool,
            sweeper,
            acks,
            metrics,
            node_id,
            shutdown: Shutdown::new(),
        };

        let listener =
            TcpListener::bind(&settings.server.listen).map_err(|source| StartupError::Listen {
                address: settings.server.listen.clone(),
                source,
            })?;
        let port = listener
            .local_addr()
            .map_err(|source| StartupError::Listen {
                address: settings.server.listen.clone(),
                source,
            })?
            .port();

        let user_timeout = settings.timing.write_timeout();
        let data = web::Data::new(state.clone());
        let server = HttpServer::new(move || {
            App::new()
                .app_data(data.clone())
                .wrap(from_fn(http::envelope::envelope))
                .configure(http::routes)
        })
        .on_connect(move |conn, _| set_tcp_user_timeout(conn, user_timeout))
        // Signals are ours (`run_until_signal`): WebSocket connections must
        // drain and close with 1001 before the server stops.
        .disable_signals()
        .shutdown_timeout(5)
        .listen(listener)
        .map_err(|source| StartupError::Listen {
            address: settings.server.listen.clone(),
            source,
        })?
        .run();

        Ok(Application {
            port,
            server,
            state,
            _delivery: delivery,
        })
    }

    /// The bound port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The shared state (database, actors), for tests and tools.
    pub fn state(&self) -> &AppState {
        &self.state
    }

    /// Serves until the server stops. When [`Shutdown::begin`] is called
    /// (by `run_until_signal`, or a test), the node drains: see [`drain`].
    pub async fn run_until_stopped(self) -> std::io::Result<()> {
        let handle = self.server.handle();
        let state = self.state.clone();
        let drainer = actix_web::rt::spawn(async move {
            state.shutdown.begun().await;
            drain(&state, handle).await;
        });
        let result = self.server.await;
        drainer.abort();
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

/// The node-wide stop signal. Connections watch it: on [`Shutdown::begin`]
/// each one stops taking frames, lets its in-flight hello/ACK/ping finish
/// (their replies are written), then closes with 1001.
#[derive(Clone, Debug)]
pub struct Shutdown(Arc<watch::Sender<bool>>);

impl Shutdown {
    pub fn new() -> Shutdown {
        Shutdown(Arc::new(watch::Sender::new(false)))
    }

    /// Starts the drain (idempotent).
    pub fn begin(&self) {
        self.0.send_replace(true);
    }

    pub fn is_begun(&self) -> bool {
        *self.0.borrow()
    }

    /// Resolves once [`Shutdown::begin`] has been called.
    pub async fn begun(&self) {
        let mut rx = self.0.subscribe();
        // The sender lives in `self`, so `wait_for` cannot see it dropped.
        let _ = rx.wait_for(|begun| *begun).await;
    }
}

impl Default for Shutdown {
    fn default() -> Shutdown {
        Shutdown::new()
    }
}

/// Drains a node: stop accepting, wait (at most [`SHUTDOWN_GRACE`]) until
/// every WebSocket connection has finished its in-flight database work and
/// closed with 1001, mark this node's sessions closed, then stop the HTTP
/// server gracefully. Leases already committed stay in the database and are
/// recovered after they lapse.
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
    let closed = async {
        let txn = state.db.begin_write().await?;
        let n = sessions::close_node_sessions(&txn, &state.node_id).await?;
        txn.commit().await.map(|()| n)
    };
    match closed.await {
        Ok(n) if n > 0 => tracing::info!(sessions = n, "closed this node's remaining sessions"),
        Ok(_) => {}
        Err(err) => tracing::warn!(error = %err, "could not close this node's sessions"),
    }
    handle.stop(true).await;
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

/// A socket whose peer stops reading is dropped by the kernel after
/// `timeout` of unacknowledged data (stack-notes.md: actix-http itself never
/// frees it).
fn set_tcp_user_timeout(conn: &dyn std::any::Any, timeout: Duration) {
    if let Some(stream) = conn.downcast_ref::<actix_web::rt::net::TcpStream>() {
        let sock = socket2::SockRef::from(stream);
        if let Err(err) = sock.set_tcp_user_timeout(Some(timeout)) {
            tracing::warn!(error = %err, "could not set TCP_USER_TIMEOUT");
        }
    }
}
