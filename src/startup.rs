//! Building and running one node: `Application::build(settings)` binds the
//! listener (port 0 picks a free one, for tests) and starts the actors.

use std::{net::TcpListener, sync::Arc, time::Duration};

use actix::{Actor, Addr, Arbiter};
use actix_web::{App, HttpServer, dev::Server, middleware::from_fn, web};
use sea_orm::DbBackend;

use crate::{
    config::Settings,
    delivery::{
        listener::{self, Announcer},
        pool::{LeasePoolActor, PoolLimits},
        scanner::ScannerActor,
    },
    domain::NodeId,
    http,
    state::AppState,
    store::Database,
};

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
    /// Connects and migrates the database, starts the lease pool and the
    /// scanner on their own arbiter (on PostgreSQL also the cross-node
    /// NOTIFY sender and LISTENer), and binds `server.listen`.
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
        let pool: Addr<LeasePoolActor> =
            LeasePoolActor::start_in_arbiter(&delivery.handle(), move |_| {
                LeasePoolActor::new(pool_db, pool_limits, lease)
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
        let scanner: Addr<ScannerActor> =
            ScannerActor::start_in_arbiter(&delivery.handle(), move |_| {
                ScannerActor::new(
                    scanner_db,
                    scanner_pool,
                    per_round,
                    scan_interval,
                    announcer,
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

        let state = AppState {
            db,
            settings: settings.clone(),
            scanner,
            pool,
            node_id,
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

    /// Serves until the server stops (SIGINT/SIGTERM or a stop handle).
    pub async fn run_until_stopped(self) -> std::io::Result<()> {
        self.server.await
    }

    /// A handle that can stop the server.
    pub fn server_handle(&self) -> actix_web::dev::ServerHandle {
        self.server.handle()
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
