//! Target: a hand-written job queue in one SQL table, the way many teams
//! build one: a consumer claims up to K ready rows in one statement
//! (PostgreSQL: `FOR UPDATE SKIP LOCKED`), then acknowledges each row with
//! its own `UPDATE` (one commit per ACK). Each subscription has its own
//! copy of every result (fan-out at publish). PostgreSQL runs with
//! `synchronous_commit=on`, SQLite with WAL and `synchronous=FULL`, one
//! connection per consumer.
//!
//! Consumers wait for new rows on an in-process signal from the publisher
//! (with a 20 ms poll as fallback): the best case for this queue, which
//! would otherwise poll or LISTEN.

use std::{str::FromStr, sync::Arc, time::Instant};

use anyhow::{Result, bail};
use sqlx::{
    Connection, PgConnection, QueryBuilder, SqliteConnection,
    sqlite::{SqliteConnectOptions, SqliteJournalMode, SqliteSynchronous},
};
use tokio::sync::Notify;

use crate::drive::{self, Publisher, Samples, Tracker, Workload, now_us, random_suffix};
use crate::stats::RunResult;

/// Which database holds the queue.
#[derive(Debug, Clone)]
pub enum QueueBackend {
    /// A fresh database on this server.
    Postgres(String),
    /// A fresh file under this folder.
    Sqlite(std::path::PathBuf),
}

const LEASE_US: i64 = 30_000_000;

enum Conn {
    Pg(PgConnection),
    Lite(SqliteConnection),
}

type Claimed = Vec<(i64, i64, String)>;

impl Conn {
    async fn claim(&mut self, sub: i32, k: u32) -> Result<Claimed> {
        let lease_until = now_us() as i64 + LEASE_US;
        Ok(match self {
            Conn::Pg(c) => {
                sqlx::query_as(
                    "UPDATE jobs SET state = 1, lease_until = $3 WHERE id IN (
                       SELECT id FROM jobs WHERE sub = $1 AND state = 0
                       ORDER BY id LIMIT $2 FOR UPDATE SKIP LOCKED)
                     RETURNING id, published_at, payload",
                )
                .bind(sub)
                .bind(i64::from(k))
                .bind(lease_until)
                .fetch_all(c)
                .await?
            }
            Conn::Lite(c) => {
                sqlx::query_as(
                    "UPDATE jobs SET state = 1, lease_until = ?3 WHERE id IN (
                       SELECT id FROM jobs WHERE sub = ?1 AND state = 0
                       ORDER BY id LIMIT ?2)
                     RETURNING id, published_at, payload",
                )
                .bind(sub)
                .bind(i64::from(k))
                .bind(lease_until)
                .fetch_all(c)
                .await?
            }
        })
    }

    async fn ack(&mut self, id: i64) -> Result<()> {
        let at = now_us() as i64;
        let n = match self {
            Conn::Pg(c) => {
                sqlx::query("UPDATE jobs SET state = 2, acked_at = $2 WHERE id = $1 AND state = 1")
                    .bind(id)
                    .bind(at)
                    .execute(c)
                    .await?
                    .rows_affected()
            }
            Conn::Lite(c) => {
                sqlx::query("UPDATE jobs SET state = 2, acked_at = ?2 WHERE id = ?1 AND state = 1")
                    .bind(id)
                    .bind(at)
                    .execute(c)
                    .await?
                    .rows_affected()
            }
        };
        if n != 1 {
            bail!("ACK of job {id} changed {n} rows");
        }
        Ok(())
    }

    async fn publish(&mut self, subs: usize, due_us: u64, count: usize, pad: &str) -> Result<()> {
        let rows = (0..count).flat_map(|_| 0..subs as i32);
        match self {
            Conn::Pg(c) => {
                let mut q: QueryBuilder<sqlx::Postgres> =
                    QueryBuilder::new("INSERT INTO jobs (sub, state, published_at, payload) ");
                q.push_values(rows, |mut b, sub| {
                    b.push_bind(sub)
                        .push_bind(0_i16)
                        .push_bind(due_us as i64)
                        .push_bind(pad.to_owned());
                });
                q.build().execute(c).await?;
            }
            Conn::Lite(c) => {
                let mut q: QueryBuilder<sqlx::Sqlite> =
                    QueryBuilder::new("INSERT INTO jobs (sub, state, published_at, payload) ");
                q.push_values(rows, |mut b, sub| {
                    b.push_bind(sub)
                        .push_bind(0_i16)
                        .push_bind(due_us as i64)
                        .push_bind(pad.to_owned());
                });
                q.build().execute(c).await?;
            }
        }
        Ok(())
    }
}

struct Database {
    backend: QueueBackend,
    url: String,
    name: Option<String>,
    _dir: Option<tempfile::TempDir>,
}

impl Database {
    async fn create(backend: &QueueBackend) -> Result<Database> {
        match backend {
            QueueBackend::Postgres(server) => {
                let name = format!("queue_bench_{}", random_suffix());
                let mut admin = PgConnection::connect(server).await?;
                sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
                    .execute(&mut admin)
                    .await?;
                let url = crate::orbit::with_database(server, &name)?;
                let mut c = PgConnection::connect(&url).await?;
                sqlx::raw_sql(
                    "CREATE TABLE jobs (id BIGSERIAL PRIMARY KEY, sub INT NOT NULL,
                       state SMALLINT NOT NULL, lease_until BIGINT, acked_at BIGINT,
                       published_at BIGINT NOT NULL, payload TEXT NOT NULL);
                     CREATE INDEX jobs_ready ON jobs (sub, state, id);",
                )
                .execute(&mut c)
                .await?;
                Ok(Database {
                    backend: backend.clone(),
                    url,
                    name: Some(name),
                    _dir: None,
                })
            }
            QueueBackend::Sqlite(scratch) => {
                let dir = tempfile::Builder::new()
                    .prefix("queue-bench-")
                    .tempdir_in(scratch)?;
                let url = format!("sqlite://{}/queue.db", dir.path().display());
                let db = Database {
                    backend: backend.clone(),
                    url,
                    name: None,
                    _dir: Some(dir),
                };
                let mut c = db.connect().await?;
                if let Conn::Lite(c) = &mut c {
                    sqlx::raw_sql(
                        "CREATE TABLE jobs (id INTEGER PRIMARY KEY AUTOINCREMENT,
                           sub INT NOT NULL, state SMALLINT NOT NULL, lease_until BIGINT,
                           acked_at BIGINT, published_at BIGINT NOT NULL, payload TEXT NOT NULL);
                         CREATE INDEX jobs_ready ON jobs (sub, state, id);",
                    )
                    .execute(c)
                    .await?;
                }
                Ok(db)
            }
        }
    }

    async fn connect(&self) -> Result<Conn> {
        Ok(match &self.backend {
            QueueBackend::Postgres(_) => Conn::Pg(PgConnection::connect(&self.url).await?),
            QueueBackend::Sqlite(_) => {
                let opts = SqliteConnectOptions::from_str(&self.url)?
                    .create_if_missing(true)
                    .journal_mode(SqliteJournalMode::Wal)
                    .synchronous(SqliteSynchronous::Full)
                    // SQLite's busy handler is not fair: paced at 1,000
                    // single-row publishes/s on a slow disk a writer
                    // waited past 5 s and the run ended with "database is
                    // locked" and no figure. The wait counts in its latency.
                    .busy_timeout(std::time::Duration::from_secs(60));
                Conn::Lite(SqliteConnection::connect_with(&opts).await?)
            }
        })
    }

    async fn bytes(&self) -> Result<u64> {
        match (&self.backend, &self._dir) {
            (QueueBackend::Sqlite(_), Some(dir)) => Ok(crate::drive::dir_bytes(dir.path())),
            _ => {
                let mut c = PgConnection::connect(&self.url).await?;
                let (size,): (i64,) = sqlx::query_as("SELECT pg_database_size(current_database())")
                    .fetch_one(&mut c)
                    .await?;
                Ok(size as u64)
            }
        }
    }

    async fn drop_database(&self) -> Result<()> {
        if let (QueueBackend::Postgres(server), Some(name)) = (&self.backend, &self.name) {
            let mut admin = PgConnection::connect(server).await?;
            sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                "DROP DATABASE IF EXISTS {name} WITH (FORCE)"
            )))
            .execute(&mut admin)
            .await?;
        }
        Ok(())
    }
}

#[derive(Clone)]
struct QueuePublisher {
    conns: Arc<tokio::sync::Mutex<Vec<Conn>>>,
    db: Arc<Database>,
    subs: usize,
    filler: Arc<str>,
    wake: Arc<Notify>,
}

impl Publisher for QueuePublisher {
    async fn publish(&self, due_us: u64, count: usize) -> Result<()> {
        let conn = self.conns.lock().await.pop();
        let mut conn = match conn {
            Some(c) => c,
            None => self.db.connect().await?,
        };
        conn.publish(self.subs, due_us, count, &self.filler).await?;
        self.conns.lock().await.push(conn);
        self.wake.notify_waiters();
        Ok(())
    }
}

async fn consume(
    mut conn: Conn,
    sub: i32,
    capacity: u32,
    wake: Arc<Notify>,
    tracker: Arc<Tracker>,
) -> Result<Samples> {
    let mut samples = Samples::default();
    let mut done = tracker.watch();
    while !tracker.is_done() {
        let woken = wake.notified();
        let rows = conn.claim(sub, capacity).await?;
        if rows.is_empty() {
            tokio::select! {
                _ = woken => {}
                _ = tokio::time::sleep(std::time::Duration::from_millis(20)) => {}
                _ = done.wait_for(|d| d.is_some()) => {}
            }
            continue;
        }
        let received = now_us();
        for (_, published_at, _) in &rows {
            samples
                .latency_us
                .push(received.saturating_sub(*published_at as u64));
        }
        for (id, _, _) in rows {
            let sent = Instant::now();
            conn.ack(id).await?;
            samples.ack_rtt_us.push(sent.elapsed().as_micros() as u64);
            tracker.acked();
        }
    }
    Ok(samples)
}

/// One run on a fresh queue table.
pub async fn run_once(backend: &QueueBackend, w: &Workload, label: &str) -> Result<RunResult> {
    let db = Arc::new(Database::create(backend).await?);
    let result = run_on(&db, w, label).await;
    let bytes = db.bytes().await.ok();
    db.drop_database().await?;
    let mut result = result?;
    result.db_bytes = bytes;
    Ok(result)
}

async fn run_on(db: &Arc<Database>, w: &Workload, label: &str) -> Result<RunResult> {
    let wake = Arc::new(Notify::new());
    let tracker = Tracker::new(w.deliveries(), label);
    let mut consumers = Vec::with_capacity(w.consumers);
    for i in 0..w.consumers {
        let conn = db.connect().await?;
        let sub = (i % w.subscriptions) as i32;
        let consumer = consume(conn, sub, w.capacity, wake.clone(), tracker.clone());
        consumers.push(drive::spawn_consumer(&tracker, consumer));
    }
    let publisher = QueuePublisher {
        conns: Arc::new(tokio::sync::Mutex::new(Vec::new())),
        db: db.clone(),
        subs: w.subscriptions,
        filler: w.filler().into(),
        wake,
    };
    let started = drive::start_publishing(w, publisher, tracker.clone());
    let finished = tracker.finished(w.timeout).await;
    let samples = drive::collect_samples(consumers).await;
    let finished = finished?;
    Ok(RunResult {
        acked: tracker.count(),
        elapsed: finished - started,
        latency_us: samples.latency_us,
        ack_rtt_us: samples.ack_rtt_us,
        rss_kib: None,
        rss_per_connection_kib: None,
        db_bytes: None,
    })
}
