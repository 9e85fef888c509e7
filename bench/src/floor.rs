//! `orbit-bench floor`: the fastest any implementation of orbit-events'
//! data model could go on this machine and database, measured without the
//! service.
//!
//! Every delivery is a row that is written three times (materialized,
//! leased, acknowledged; delivery-model.md §5–6) besides its event in the
//! log; the ACK is recorded on the row (§2, no audit record per ACK), and
//! ids are insert-ordered as the node's are (decision 0079). This command
//! writes exactly those
//! rows into a database migrated by `orbit-events migrate` (the real
//! schema and indexes), `batch` deliveries per transaction, with
//! everything else left out: no reads (the claim's candidate query, the
//! ACK's proof check), no idempotency record, no network, no JSON; one
//! statement per table and step, with bound parameters, each statement
//! carrying the whole batch (multi-row `INSERT`, `UPDATE … WHERE id IN`).
//! Commits stay durable (SQLite WAL with
//! `synchronous=FULL`, PostgreSQL `synchronous_commit=on`). The figure is
//! an upper bound for the service: what orbit-events would reach if
//! everything but these writes cost nothing.

use std::{path::Path, str::FromStr, time::Instant};

use anyhow::{Context, Result, bail};
use sqlx::{
    Connection, Executor, PgConnection, SqliteConnection,
    sqlite::{SqliteConnectOptions, SqliteJournalMode, SqliteSynchronous},
};

use crate::drive::{now_us, random_suffix};

/// One floor measurement's shape.
#[derive(Debug, Clone, Copy)]
pub struct FloorShape {
    /// Deliveries in all.
    pub deliveries: u64,
    /// Deliveries per transaction.
    pub batch: u64,
    /// 1: publish, materialize, lease and ACK a batch in one transaction;
    /// 3: publish and materialize, then lease, then ACK, each committed
    /// (the fewest commits the service could use, since a lease must be
    /// durable before its delivery is sent and an ACK arrives after that).
    pub commits_per_batch: u8,
    /// Writers at once, each on its own connection, queue and
    /// subscription (SQLite serializes them on its one writer).
    pub writers: usize,
}

/// Where the floor runs.
#[derive(Debug, Clone)]
pub enum FloorBackend {
    /// A fresh SQLite file in this folder.
    Sqlite(std::path::PathBuf),
    /// A fresh database on this PostgreSQL server.
    Postgres(String),
}

enum Conn {
    Lite(SqliteConnection),
    Pg(PgConnection),
}

impl Conn {
    async fn run(&mut self, sql: String) -> Result<()> {
        let sql = sqlx::AssertSqlSafe(sql);
        match self {
            Conn::Lite(c) => c.execute(sqlx::raw_sql(sql)).await.map(|_| ())?,
            Conn::Pg(c) => c.execute(sqlx::raw_sql(sql)).await.map(|_| ())?,
        }
        Ok(())
    }
}

/// A fresh, migrated database; dropped (PostgreSQL) by [`Floor::finish`].
pub(crate) struct Floor {
    url: String,
    backend: FloorBackend,
    name: Option<String>,
    _dir: Option<tempfile::TempDir>,
}

impl Floor {
    pub(crate) async fn create(backend: &FloorBackend, bin: &Path) -> Result<Floor> {
        let floor = match backend {
            FloorBackend::Sqlite(scratch) => {
                let dir = tempfile::Builder::new()
                    .prefix("floor-bench-")
                    .tempdir_in(scratch)?;
                Floor {
                    url: format!("sqlite://{}/floor.db?mode=rwc", dir.path().display()),
                    backend: backend.clone(),
                    name: None,
                    _dir: Some(dir),
                }
            }
            FloorBackend::Postgres(server) => {
                let name = format!("floor_bench_{}", random_suffix());
                let mut admin = PgConnection::connect(server).await?;
                admin
                    .execute(sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                        "CREATE DATABASE {name}"
                    ))))
                    .await?;
                Floor {
                    url: crate::orbit::with_database(server, &name)?,
                    backend: backend.clone(),
                    name: Some(name),
                    _dir: None,
                }
            }
        };
        let out = tokio::process::Command::new(bin)
            .env("ORBIT_EVENTS__DATABASE__URL", &floor.url)
            .env("RUST_LOG", "warn")
            .arg("migrate")
            .output()
            .await
            .context("running orbit-events migrate")?;
        if !out.status.success() {
            bail!("migrate failed: {}", String::from_utf8_lossy(&out.stderr));
        }
        Ok(floor)
    }

    pub(crate) fn url(&self) -> &str {
        &self.url
    }

    async fn connect(&self) -> Result<Conn> {
        Ok(match &self.backend {
            FloorBackend::Sqlite(_) => {
                let opts = SqliteConnectOptions::from_str(&self.url)?
                    .journal_mode(SqliteJournalMode::Wal)
                    .synchronous(SqliteSynchronous::Full)
                    // As the node sets it (store::Database).
                    .pragma("wal_autocheckpoint", "8192")
                    .pragma("temp_store", "memory")
                    .busy_timeout(std::time::Duration::from_secs(30));
                Conn::Lite(SqliteConnection::connect_with(&opts).await?)
            }
            FloorBackend::Postgres(_) => Conn::Pg(PgConnection::connect(&self.url).await?),
        })
    }

    async fn finish(self) -> Result<()> {
        if let (FloorBackend::Postgres(server), Some(name)) = (&self.backend, &self.name) {
            let mut admin = PgConnection::connect(server).await?;
            admin
                .execute(sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                    "DROP DATABASE IF EXISTS {name} WITH (FORCE)"
                ))))
                .await?;
        }
        Ok(())
    }
}

/// A 32-hex-digit insert-ordered id, like the service's (decision 0079):
/// the time in milliseconds first, then random digits.
pub(crate) fn id() -> String {
    let ms = now_us() / 1000;
    let random = format!("{}{}", random_suffix(), random_suffix());
    format!("{ms:012x}{}", &random[..20])
}

/// One batch: `(event id, delivery id, sequence)` per delivery.
struct Batch<'a> {
    rows: Vec<(String, String, i64)>,
    now: i64,
    /// The subscription's cursor after the batch.
    sequence: i64,
    ids: &'a Ids,
    filler: &'a str,
}

/// The writer's own queue, subscription and session.
struct Ids {
    ns: String,
    queue: String,
    sub: String,
    cred: String,
    session: String,
    digest: String,
}

/// The parts of a batch: each is what one of the service's steps writes.
#[derive(Clone, Copy)]
enum Part {
    /// The events appended, the queue's head, the deliveries inserted, the
    /// subscription's cursor and `pending_count`.
    PublishAndMaterialize,
    /// Every delivery leased (one `UPDATE`).
    Lease,
    /// Every delivery ACKed (recorded on its row), `pending_count`.
    Ack,
}

/// The statements of `parts` in one transaction on one backend, with bound
/// parameters (prepared once, like the service's).
macro_rules! write_parts {
    ($name:ident, $db:ty, $conn:ty, $begin:literal) => {
        async fn $name(c: &mut $conn, b: &Batch<'_>, parts: &[Part]) -> Result<()> {
            use sqlx::QueryBuilder;
            let n = b.rows.len() as i64;
            let i = b.ids;
            sqlx::raw_sql($begin).execute(&mut *c).await?;
            for part in parts {
                match part {
                    Part::PublishAndMaterialize => {
                        let mut q: QueryBuilder<$db> =
                            QueryBuilder::new("INSERT INTO result_events ");
                        q.push_values(&b.rows, |mut r, (event, _, seq)| {
                            r.push_bind(event.clone())
                                .push_bind(i.queue.clone())
                                .push_bind(*seq)
                                .push_bind("task.succeeded")
                                .push_bind("task")
                                .push_bind(id())
                                .push_bind("1")
                                .push_bind(b.now)
                                .push_bind(format!("{{\"filler\":\"{}\"}}", b.filler))
                                .push_bind("{}")
                                .push_bind(b.now)
                                .push_bind(b.now);
                        });
                        q.build().execute(&mut *c).await?;
                        let mut q: QueryBuilder<$db> =
                            QueryBuilder::new("UPDATE queues SET head_sequence = head_sequence + ");
                        q.push_bind(n).push(" WHERE id = ").push_bind(i.queue.clone());
                        q.build().execute(&mut *c).await?;
                        let mut q: QueryBuilder<$db> = QueryBuilder::new(
                            "INSERT INTO deliveries (id, subscription_id, event_id, sequence, \
                             revision, state, available_at, lease_epoch, lease_until, \
                             lease_digest, lease_session_id, attempts, attempt_budget, \
                             acknowledged_at, created_at, ack_epoch, ack_session_id, \
                             leased_at) ",
                        );
                        q.push_values(&b.rows, |mut r, (event, delivery, seq)| {
                            r.push_bind(delivery.clone())
                                .push_bind(i.sub.clone())
                                .push_bind(event.clone())
                                .push_bind(*seq)
                                .push_bind(1_i64)
                                .push_bind("PENDING")
                                .push_bind(b.now)
                                .push_bind(0_i64)
                                .push_bind(None::<i64>)
                                .push_bind(None::<String>)
                                .push_bind(None::<String>)
                                .push_bind(0_i64)
                                .push_bind(5_i64)
                                .push_bind(None::<i64>)
                                .push_bind(b.now)
                                .push_bind(None::<i64>)
                                .push_bind(None::<String>)
                                .push_bind(None::<i64>);
                        });
                        q.build().execute(&mut *c).await?;
                        let mut q: QueryBuilder<$db> =
                            QueryBuilder::new("UPDATE subscriptions SET cursor_sequence = ");
                        q.push_bind(b.sequence)
                            .push(", pending_count = pending_count + ")
                            .push_bind(n)
                            .push(" WHERE id = ")
                            .push_bind(i.sub.clone());
                        q.build().execute(&mut *c).await?;
                    }
                    Part::Lease => {
                        let mut q: QueryBuilder<$db> = QueryBuilder::new(
                            "UPDATE deliveries SET state = 'LEASED', lease_epoch = lease_epoch + 1, \
                             attempts = attempts + 1, revision = revision + 1, leased_at = ",
                        );
                        q.push_bind(b.now)
                            .push(", lease_until = ")
                            .push_bind(b.now + 30_000_000)
                            .push(", lease_session_id = ")
                            .push_bind(i.session.clone())
                            .push(", lease_digest = ")
                            .push_bind(i.digest.clone())
                            .push(" WHERE id IN (");
                        let mut ids = q.separated(", ");
                        for (_, delivery, _) in &b.rows {
                            ids.push_bind(delivery.clone());
                        }
                        q.push(") AND state = 'PENDING'");
                        q.build().execute(&mut *c).await?;
                    }
                    Part::Ack => {
                        let mut q: QueryBuilder<$db> = QueryBuilder::new(
                            "UPDATE deliveries SET state = 'ACKED', acknowledged_at = ",
                        );
                        q.push_bind(b.now)
                            .push(", ack_epoch = lease_epoch, ack_session_id = ")
                            .push_bind(i.session.clone())
                            .push(
                                ", revision = revision + 1, lease_until = NULL, \
                                 lease_session_id = NULL WHERE id IN (",
                            );
                        let mut ids = q.separated(", ");
                        for (_, delivery, _) in &b.rows {
                            ids.push_bind(delivery.clone());
                        }
                        q.push(") AND state <> 'ACKED'");
                        q.build().execute(&mut *c).await?;
                        let mut q: QueryBuilder<$db> = QueryBuilder::new(
                            "UPDATE subscriptions SET pending_count = pending_count - ",
                        );
                        q.push_bind(n).push(" WHERE id = ").push_bind(i.sub.clone());
                        q.build().execute(&mut *c).await?;
                    }
                }
            }
            sqlx::raw_sql("COMMIT").execute(&mut *c).await?;
            Ok(())
        }
    };
}

write_parts!(
    write_sqlite,
    sqlx::Sqlite,
    SqliteConnection,
    "BEGIN IMMEDIATE"
);
write_parts!(write_postgres, sqlx::Postgres, PgConnection, "BEGIN");

impl Conn {
    async fn write(&mut self, batch: &Batch<'_>, parts: &[Part]) -> Result<()> {
        match self {
            Conn::Lite(c) => write_sqlite(c, batch, parts).await,
            Conn::Pg(c) => write_postgres(c, batch, parts).await,
        }
    }
}

/// Writes `deliveries` deliveries in transactions of `batch` on one
/// connection: its own queue and subscription.
async fn writer(mut conn: Conn, shape: FloorShape, deliveries: u64, filler: &str) -> Result<()> {
    let ids = Ids {
        ns: id(),
        queue: id(),
        sub: id(),
        cred: id(),
        session: id(),
        digest: "d".repeat(64),
    };
    conn.run(format!(
        "INSERT INTO queues VALUES ('{q}', '{ns}', 'floor-{q}', 0, 0, 0);
         INSERT INTO subscriptions VALUES ('{s}', '{ns}', '{app}', '{cred}', '{q}',
           'floor-{s}', 1, TRUE, '', 0, 0, 1000000000, 5, 0, 0);",
        q = ids.queue,
        s = ids.sub,
        ns = ids.ns,
        cred = ids.cred,
        app = id()
    ))
    .await?;
    let mut sequence = 0i64;
    let mut done = 0u64;
    while done < deliveries {
        let n = shape.batch.min(deliveries - done);
        let rows: Vec<(String, String, i64)> =
            (1..=n as i64).map(|k| (id(), id(), sequence + k)).collect();
        sequence += n as i64;
        let batch = Batch {
            rows,
            now: now_us() as i64,
            sequence,
            ids: &ids,
            filler,
        };
        if shape.commits_per_batch >= 3 {
            for part in [Part::PublishAndMaterialize, Part::Lease, Part::Ack] {
                conn.write(&batch, &[part]).await?;
            }
        } else {
            let all = [Part::PublishAndMaterialize, Part::Lease, Part::Ack];
            conn.write(&batch, &all).await?;
        }
        done += n;
    }
    Ok(())
}

/// One measurement: deliveries per second over all writers.
pub async fn run_once(
    backend: &FloorBackend,
    bin: &Path,
    shape: FloorShape,
    payload: usize,
) -> Result<f64> {
    if shape.batch == 0 || shape.writers == 0 || !matches!(shape.commits_per_batch, 1 | 3) {
        bail!("batch and writers must be at least 1, commits per batch 1 or 3");
    }
    let floor = Floor::create(backend, bin).await?;
    let mut conns = Vec::with_capacity(shape.writers);
    for _ in 0..shape.writers {
        conns.push(floor.connect().await?);
    }
    let filler = "x".repeat(payload);
    let per_writer = shape.deliveries.div_ceil(shape.writers as u64);
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for conn in conns {
        let filler = filler.clone();
        tasks.spawn(async move { writer(conn, shape, per_writer, &filler).await });
    }
    while let Some(done) = tasks.join_next().await {
        done??;
    }
    let rate = (per_writer * shape.writers as u64) as f64 / started.elapsed().as_secs_f64();
    floor.finish().await?;
    Ok(rate)
}
