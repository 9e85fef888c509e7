//! `orbit-bench handoff`: what the node's statements per delivery cost
//! without the node (issue 18, decision 0088).
//!
//! It runs the statements the node runs per delivery (the publish and its
//! materialization, claims of `claim` rows with their reads, the ACK with
//! its read of the rows) in the node's transactions, with its SQL, bound
//! parameters and every returned row decoded into owned values, two ways
//! on fresh databases, alternated:
//!
//! - SQLite: through sqlx, one `await` per statement (one request to its
//!   worker thread, each row a message back), as the node does; and
//!   through `rusqlite` on a thread that owns the connection and runs each
//!   transaction whole (statements prepared once, rows read in place).
//! - PostgreSQL: the claim in the node's 9 statements, and in 2 (one read;
//!   one CTE that recovers, counts, picks and leases, returning the
//!   events). The publish and the ACK are the same on both sides.
//!
//! Commits stay durable (WAL `synchronous=FULL`, `synchronous_commit=on`).
//! Each ratio is what that design could buy the node at most.

use std::{path::Path, str::FromStr, sync::mpsc, time::Instant};

use anyhow::{Context, Result, bail};
use sqlx::{
    Connection, PgConnection, Row, SqliteConnection, TypeInfo, ValueRef,
    postgres::PgRow,
    sqlite::{SqliteConnectOptions, SqliteJournalMode, SqliteRow, SqliteSynchronous},
};

use crate::drive::now_us;
use crate::floor::{Floor, FloorBackend, id};

/// One measurement's shape.
#[derive(Debug, Clone, Copy)]
pub struct HandoffShape {
    /// Deliveries in all.
    pub deliveries: u64,
    /// Deliveries per publish and per ACK transaction.
    pub batch: u64,
    /// Rows per claim (the node's claims lease at most the write queue, 8).
    pub claim: u64,
}

/// The driver a measurement runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Driver {
    Sqlx,
    Rusqlite,
    /// PostgreSQL, the claim as the node runs it (9 statements).
    PgStatements,
    /// PostgreSQL, the claim as one read and one statement (a CTE that
    /// recovers, counts, picks and leases, returning the events).
    PgClaimStatement,
}

impl Driver {
    pub fn name(self) -> &'static str {
        match self {
            Driver::Sqlx => "SQLite, sqlx (one hand-off per statement)",
            Driver::Rusqlite => "SQLite, rusqlite (one hand-off per transaction)",
            Driver::PgStatements => "PostgreSQL, the claim in 9 statements (as the node)",
            Driver::PgClaimStatement => "PostgreSQL, the claim in 2 statements (one CTE)",
        }
    }

    fn pg(self) -> bool {
        matches!(self, Driver::PgStatements | Driver::PgClaimStatement)
    }
}

/// A column value, owned (both drivers decode every column into this).
#[derive(Debug, Clone)]
enum Value {
    Null,
    Int(i64),
    Text(String),
}

impl Value {
    fn text(&self) -> Option<&str> {
        match self {
            Value::Text(s) => Some(s),
            _ => None,
        }
    }
}

/// A bound parameter.
#[derive(Debug, Clone)]
enum Param {
    Int(i64),
    Text(String),
    /// PostgreSQL only (`text[]`).
    Texts(Vec<String>),
}

/// One statement: SQL and its parameters.
struct Stmt {
    sql: String,
    params: Vec<Param>,
}

fn stmt(sql: impl Into<String>, params: Vec<Param>) -> Stmt {
    Stmt {
        sql: sql.into(),
        params,
    }
}

fn t(s: &str) -> Param {
    Param::Text(s.to_owned())
}

fn placeholders(n: usize) -> String {
    vec!["?"; n].join(", ")
}

/// The writer's own queue, subscription, credential and session.
#[derive(Clone)]
struct Ids {
    queue: String,
    sub: String,
    cred: String,
    session: String,
}

/// The statements of each step, as the node's store issues them (the same
/// tables, predicates, orders and limits; see tests/api/history.rs).
struct Mix<'a> {
    ids: &'a Ids,
    filler: &'a str,
    /// PostgreSQL: the node's row locks.
    pg: bool,
}

impl Mix<'_> {
    /// The publish: the events, the queue's head.
    fn publish(&self, rows: &[(String, i64)], now: i64) -> Vec<Stmt> {
        let i = self.ids;
        let mut params = Vec::new();
        for (event, seq) in rows {
            params.extend([
                t(event),
                t(&i.queue),
                Param::Int(*seq),
                t("task.succeeded"),
                t("task"),
                Param::Text(id()),
                t("1"),
                Param::Int(now),
                Param::Text(format!("{{\"filler\":\"{}\"}}", self.filler)),
                t("{}"),
                Param::Int(now),
                Param::Int(now),
            ]);
        }
        let values = vec![format!("({})", placeholders(12)); rows.len()].join(", ");
        vec![
            stmt(
                format!(
                    "INSERT INTO result_events (id, queue_id, sequence, type, aggregate_kind, \
                     aggregate_id, aggregate_revision, occurred_at, details, snapshot, \
                     appended_at, created_at) VALUES {values}"
                ),
                params,
            ),
            stmt(
                "UPDATE queues SET head_sequence = head_sequence + ? WHERE id = ?",
                vec![Param::Int(rows.len() as i64), t(&i.queue)],
            ),
        ]
    }

    /// The materialization's reads: the subscription, the position, the
    /// entries after the cursor.
    fn materialize_reads(&self, after: i64, up_to: i64, limit: u64) -> Vec<Stmt> {
        let i = self.ids;
        vec![
            stmt(
                format!(
                    "SELECT * FROM subscriptions WHERE id = ? LIMIT 1{}",
                    if self.pg { " FOR UPDATE" } else { "" }
                ),
                vec![t(&i.sub)],
            ),
            stmt(
                format!(
                    "SELECT head_sequence, retention_floor FROM queues WHERE id = ? LIMIT 1{}",
                    if self.pg { " FOR KEY SHARE" } else { "" }
                ),
                vec![t(&i.queue)],
            ),
            stmt(
                "SELECT id, sequence, type FROM result_events WHERE queue_id = ? AND \
                 sequence > ? AND sequence <= ? ORDER BY sequence ASC LIMIT ?",
                vec![
                    t(&i.queue),
                    Param::Int(after),
                    Param::Int(up_to),
                    Param::Int(limit as i64),
                ],
            ),
        ]
    }

    /// The materialization's writes: the deliveries, the cursor.
    fn materialize_writes(&self, rows: &[(String, String, i64)], now: i64) -> Vec<Stmt> {
        let i = self.ids;
        let mut params = Vec::new();
        for (event, delivery, seq) in rows {
            params.extend([
                t(delivery),
                t(&i.sub),
                t(event),
                Param::Int(*seq),
                Param::Int(1),
                t("PENDING"),
                Param::Int(now),
                Param::Int(0),
                Param::Int(0),
                Param::Int(5),
                Param::Int(now),
            ]);
        }
        // The lease and ACK columns start NULL (literals: a NULL parameter
        // would need a type on PostgreSQL).
        let values = vec![
            "(?, ?, ?, ?, ?, ?, ?, ?, NULL, NULL, NULL, NULL, ?, ?, NULL, NULL, NULL, ?)";
            rows.len()
        ]
        .join(", ");
        let last = rows.last().map_or(0, |r| r.2);
        vec![
            stmt(
                format!(
                    "INSERT INTO deliveries (id, subscription_id, event_id, sequence, revision, \
                     state, available_at, lease_epoch, leased_at, lease_until, lease_digest, \
                     lease_session_id, attempts, attempt_budget, acknowledged_at, ack_epoch, \
                     ack_session_id, created_at) VALUES {values}"
                ),
                params,
            ),
            stmt(
                "UPDATE subscriptions SET cursor_sequence = ?, pending_count = pending_count + ? \
                 WHERE id = ?",
                vec![Param::Int(last), Param::Int(rows.len() as i64), t(&i.sub)],
            ),
        ]
    }

    /// A claim's statements before its lease: the credential, the
    /// subscription, the position, the recovery of lapsed leases, the
    /// session's live leases, the candidates.
    fn claim_reads(&self, now: i64, want: u64) -> Vec<Stmt> {
        let i = self.ids;
        vec![
            stmt(
                "SELECT * FROM credentials WHERE id = ? LIMIT 1",
                vec![t(&i.cred)],
            ),
            stmt(
                "SELECT * FROM subscriptions WHERE id = ? LIMIT 1",
                vec![t(&i.sub)],
            ),
            stmt(
                "SELECT head_sequence, retention_floor FROM queues WHERE id = ? LIMIT 1",
                vec![t(&i.queue)],
            ),
            stmt(
                "UPDATE deliveries SET revision = revision + 1, state = 'PENDING', \
                 available_at = lease_until WHERE id IN (SELECT id FROM deliveries WHERE \
                 state = 'LEASED' AND lease_until <= ? AND attempts < attempt_budget AND \
                 subscription_id = ?) AND state = 'LEASED' AND lease_until <= ? AND \
                 attempts < attempt_budget RETURNING *",
                vec![Param::Int(now), t(&i.sub), Param::Int(now)],
            ),
            stmt(
                "UPDATE deliveries SET revision = revision + 1, state = 'EXPIRED' WHERE id IN \
                 (SELECT id FROM deliveries WHERE state = 'LEASED' AND lease_until <= ? AND \
                 NOT (attempts < attempt_budget) AND subscription_id = ?) AND \
                 state = 'LEASED' AND lease_until <= ? AND NOT (attempts < attempt_budget) \
                 RETURNING *",
                vec![Param::Int(now), t(&i.sub), Param::Int(now)],
            ),
            stmt(
                "SELECT lease_session_id, COUNT(id) AS n FROM deliveries WHERE \
                 lease_session_id IN (?) AND state = 'LEASED' AND lease_until > ? \
                 GROUP BY lease_session_id",
                vec![t(&i.session), Param::Int(now)],
            ),
            stmt(
                format!(
                    "SELECT id FROM deliveries WHERE subscription_id = ? AND state = 'PENDING' \
                     AND available_at <= ? AND attempts < attempt_budget \
                     ORDER BY sequence ASC, id ASC LIMIT ?{}",
                    if self.pg {
                        " FOR UPDATE SKIP LOCKED"
                    } else {
                        ""
                    }
                ),
                vec![t(&i.sub), Param::Int(now), Param::Int(want as i64)],
            ),
        ]
    }

    /// The lease of `ids` (a digest each) and the read of their events.
    fn lease(&self, ids: &[String], now: i64) -> Stmt {
        let i = self.ids;
        let mut params = vec![Param::Int(now), Param::Int(now + 30_000_000)];
        let mut case = String::from("CASE");
        for id in ids {
            case.push_str(" WHEN id = ? THEN ?");
            params.push(Param::Text(id.clone()));
            params.push(Param::Text(format!("{id:0>64}")));
        }
        case.push_str(" ELSE lease_digest END");
        params.push(t(&i.session));
        params.extend(ids.iter().map(|id| Param::Text(id.clone())));
        stmt(
            format!(
                "UPDATE deliveries SET state = 'LEASED', lease_epoch = lease_epoch + 1, \
                 attempts = attempts + 1, revision = revision + 1, leased_at = ?, \
                 lease_until = ?, lease_digest = {case}, lease_session_id = ? \
                 WHERE id IN ({}) AND state = 'PENDING' RETURNING *",
                placeholders(ids.len())
            ),
            params,
        )
    }

    fn render(&self, events: &[String]) -> Stmt {
        stmt(
            format!(
                "SELECT * FROM result_events WHERE id IN ({})",
                placeholders(events.len())
            ),
            events.iter().map(|e| Param::Text(e.clone())).collect(),
        )
    }

    /// The ACK's read of the rows (the node reads them before its write).
    fn ack_read(&self, ids: &[String]) -> Stmt {
        stmt(
            format!(
                "SELECT * FROM deliveries WHERE id IN ({})",
                placeholders(ids.len())
            ),
            ids.iter().map(|e| Param::Text(e.clone())).collect(),
        )
    }

    /// The ACK's writes: every row at its epoch, `pending_count`.
    fn ack(&self, ids: &[String], now: i64) -> Vec<Stmt> {
        let i = self.ids;
        let mut params = vec![Param::Int(now), t(&i.session)];
        params.extend(ids.iter().map(|e| Param::Text(e.clone())));
        let mut out = Vec::new();
        if self.pg {
            // Row locks in id order first, as the node takes them.
            out.push(stmt(
                format!(
                    "SELECT id FROM deliveries WHERE id IN ({}) ORDER BY id ASC FOR UPDATE",
                    placeholders(ids.len())
                ),
                ids.iter().map(|e| Param::Text(e.clone())).collect(),
            ));
        }
        out.extend([
            stmt(
                format!(
                    "UPDATE deliveries SET state = 'ACKED', acknowledged_at = ?, \
                     ack_epoch = lease_epoch, ack_session_id = ?, revision = revision + 1 \
                     WHERE id IN ({}) AND lease_epoch = 1 AND state <> 'ACKED' \
                     RETURNING id, event_id",
                    placeholders(ids.len())
                ),
                params,
            ),
            stmt(
                "UPDATE subscriptions SET pending_count = pending_count - ? WHERE id = ?",
                vec![Param::Int(ids.len() as i64), t(&i.sub)],
            ),
        ]);
        out
    }

    /// PostgreSQL: a claim's checks in one read (the subscription, its
    /// queue's position, the credential).
    fn claim_check(&self) -> Stmt {
        let i = self.ids;
        stmt(
            "SELECT s.*, q.head_sequence, q.retention_floor, c.revoked_at FROM subscriptions s \
             JOIN queues q ON q.id = s.queue_id LEFT JOIN credentials c ON c.id = ? \
             WHERE s.id = ?",
            vec![t(&i.cred), t(&i.sub)],
        )
    }

    /// PostgreSQL: the rest of a claim in one statement, with fixed text:
    /// recover this subscription's lapsed leases, count the session's live
    /// ones, pick up to `min(want, capacity - held)` rows (`SKIP LOCKED`)
    /// and lease them, each with the digest at its rank, returning each
    /// leased row with its event.
    fn claim_statement(&self, now: i64, want: u64, capacity: u64) -> Stmt {
        let i = self.ids;
        let digests: Vec<String> = (0..want).map(|_| format!("{:0>64}", id())).collect();
        stmt(
            "WITH recovered AS (UPDATE deliveries SET revision = revision + 1, \
               state = CASE WHEN attempts < attempt_budget THEN 'PENDING' ELSE 'EXPIRED' END, \
               available_at = CASE WHEN attempts < attempt_budget THEN lease_until \
                 ELSE available_at END \
               WHERE subscription_id = ? AND state = 'LEASED' AND lease_until <= ? \
               RETURNING id), \
             held AS (SELECT COUNT(*) AS n FROM deliveries WHERE lease_session_id = ? \
               AND state = 'LEASED' AND lease_until > ?), \
             picked AS (SELECT id, sequence FROM deliveries WHERE subscription_id = ? \
               AND state = 'PENDING' AND available_at <= ? AND attempts < attempt_budget \
               ORDER BY sequence ASC, id ASC \
               LIMIT (SELECT GREATEST(0, LEAST(?, ? - n)) FROM held) FOR UPDATE SKIP LOCKED), \
             numbered AS (SELECT id, row_number() OVER (ORDER BY sequence, id) AS rank \
               FROM picked), \
             leased AS (UPDATE deliveries d SET state = 'LEASED', \
               lease_epoch = d.lease_epoch + 1, attempts = d.attempts + 1, \
               revision = d.revision + 1, leased_at = ?, lease_until = ?, \
               lease_session_id = ?, lease_digest = (?::text[])[numbered.rank] \
               FROM numbered WHERE d.id = numbered.id AND d.state = 'PENDING' RETURNING d.*) \
             SELECT leased.*, e.* FROM leased JOIN result_events e ON e.id = leased.event_id",
            vec![
                t(&i.sub),
                Param::Int(now),
                t(&i.session),
                Param::Int(now),
                t(&i.sub),
                Param::Int(now),
                Param::Int(want as i64),
                Param::Int(capacity as i64),
                Param::Int(now),
                Param::Int(now + 30_000_000),
                t(&i.session),
                Param::Texts(digests),
            ],
        )
    }
}

/// A connection of either driver. `rusqlite` runs on its own thread.
enum Conn {
    Sqlx(SqliteConnection),
    Rusqlite(mpsc::Sender<Job>),
    Pg(PgConnection),
}

type Job = Box<dyn FnOnce(&mut rusqlite::Connection) + Send>;

fn sqlx_value(row: &SqliteRow, i: usize) -> Result<Value> {
    let raw = row.try_get_raw(i)?;
    if raw.is_null() {
        return Ok(Value::Null);
    }
    let kind = raw.type_info().name().to_owned();
    Ok(match kind.as_str() {
        "INTEGER" | "BOOLEAN" => Value::Int(row.try_get::<i64, _>(i)?),
        "REAL" => Value::Text(row.try_get::<f64, _>(i)?.to_string()),
        _ => Value::Text(row.try_get::<String, _>(i)?),
    })
}

fn rusqlite_value(v: rusqlite::types::ValueRef<'_>) -> Value {
    use rusqlite::types::ValueRef as V;
    match v {
        V::Null => Value::Null,
        V::Integer(n) => Value::Int(n),
        V::Real(f) => Value::Text(f.to_string()),
        V::Text(s) | V::Blob(s) => Value::Text(String::from_utf8_lossy(s).into_owned()),
    }
}

fn pg_value(row: &PgRow, i: usize) -> Result<Value> {
    let raw = row.try_get_raw(i)?;
    if raw.is_null() {
        return Ok(Value::Null);
    }
    let kind = raw.type_info().name().to_owned();
    Ok(match kind.as_str() {
        "INT2" => Value::Int(row.try_get::<i16, _>(i)?.into()),
        "INT4" => Value::Int(row.try_get::<i32, _>(i)?.into()),
        "INT8" => Value::Int(row.try_get::<i64, _>(i)?),
        "BOOL" => Value::Int(row.try_get::<bool, _>(i)?.into()),
        _ => Value::Text(row.try_get::<String, _>(i)?),
    })
}

impl rusqlite::ToSql for Param {
    fn to_sql(&self) -> rusqlite::Result<rusqlite::types::ToSqlOutput<'_>> {
        use rusqlite::types::{ToSqlOutput, ValueRef};
        Ok(match self {
            Param::Int(n) => ToSqlOutput::Borrowed(ValueRef::Integer(*n)),
            Param::Text(s) => ToSqlOutput::Borrowed(ValueRef::Text(s.as_bytes())),
            Param::Texts(_) => {
                return Err(rusqlite::Error::ToSqlConversionFailure(
                    "SQLite has no arrays".into(),
                ));
            }
        })
    }
}

/// `?` placeholders as PostgreSQL's `$1`, `$2`, … (no `?` appears in the
/// mix's literals).
fn numbered(sql: &str) -> String {
    let mut out = String::with_capacity(sql.len() + 16);
    let mut k = 0;
    for ch in sql.chars() {
        if ch == '?' {
            k += 1;
            out.push('$');
            out.push_str(&k.to_string());
        } else {
            out.push(ch);
        }
    }
    out
}

/// Runs `stmt` on PostgreSQL: one round trip, every row decoded.
async fn run_pg(c: &mut PgConnection, s: &Stmt) -> Result<Vec<Vec<Value>>> {
    let sql = numbered(&s.sql);
    let mut q = sqlx::query(sqlx::AssertSqlSafe(sql));
    for p in &s.params {
        q = match p {
            Param::Int(n) => q.bind(*n),
            Param::Text(t) => q.bind(t.clone()),
            Param::Texts(v) => q.bind(v.clone()),
        };
    }
    let rows = q.fetch_all(&mut *c).await?;
    rows.iter()
        .map(|row| (0..row.len()).map(|i| pg_value(row, i)).collect())
        .collect()
}

/// Runs `stmt` on a rusqlite connection: every row, every column, owned.
fn run_rusqlite(c: &rusqlite::Connection, s: &Stmt) -> Result<Vec<Vec<Value>>> {
    let mut prepared = c.prepare_cached(&s.sql)?;
    let columns = prepared.column_count();
    let mut rows = prepared.query(rusqlite::params_from_iter(s.params.iter()))?;
    let mut out = Vec::new();
    while let Some(row) = rows.next()? {
        let mut values = Vec::with_capacity(columns);
        for i in 0..columns {
            values.push(rusqlite_value(row.get_ref(i)?));
        }
        out.push(values);
    }
    Ok(out)
}

/// Runs `stmt` on sqlx: one request to its worker, rows as messages.
async fn run_sqlx(c: &mut SqliteConnection, s: &Stmt) -> Result<Vec<Vec<Value>>> {
    let mut q = sqlx::query(sqlx::AssertSqlSafe(s.sql.clone()));
    for p in &s.params {
        q = match p {
            Param::Int(n) => q.bind(*n),
            Param::Text(t) => q.bind(t.clone()),
            Param::Texts(_) => bail!("SQLite has no arrays"),
        };
    }
    let rows = q.fetch_all(&mut *c).await?;
    rows.iter()
        .map(|row| (0..row.len()).map(|i| sqlx_value(row, i)).collect())
        .collect()
}

/// What a transaction needs from the rows its statements returned, decided
/// between statements (as the node's claim decides its lease from its
/// candidates).
type Plan = Box<dyn FnMut(usize, &[Vec<Value>]) -> Vec<Stmt> + Send>;

/// The statements of one transaction, in turn: `first`, then what the
/// plan asks for after each one returned its rows.
struct Steps {
    queue: std::collections::VecDeque<Stmt>,
    plan: Plan,
    done: usize,
    rows_seen: usize,
}

impl Steps {
    fn new(first: Vec<Stmt>, plan: Plan) -> Steps {
        Steps {
            queue: first.into(),
            plan,
            done: 0,
            rows_seen: 0,
        }
    }

    fn next(&mut self) -> Option<Stmt> {
        self.queue.pop_front()
    }

    /// The rows the statement from [`Steps::next`] returned.
    fn returned(&mut self, rows: &[Vec<Value>]) {
        let rows = std::hint::black_box(rows);
        self.rows_seen += rows.len();
        let more = (self.plan)(self.done, rows);
        self.queue.extend(more);
        self.done += 1;
    }
}

impl Conn {
    /// One transaction: `first`, then what `plan` asks for after each
    /// statement, committed. Returns every statement's rows.
    async fn transaction(&mut self, first: Vec<Stmt>, plan: Plan) -> Result<usize> {
        match self {
            Conn::Sqlx(c) => {
                sqlx::query("BEGIN IMMEDIATE").execute(&mut *c).await?;
                let mut steps = Steps::new(first, plan);
                while let Some(s) = steps.next() {
                    steps.returned(&run_sqlx(c, &s).await?);
                }
                sqlx::query("COMMIT").execute(&mut *c).await?;
                Ok(steps.rows_seen)
            }
            Conn::Pg(c) => {
                sqlx::query("BEGIN").execute(&mut *c).await?;
                let mut steps = Steps::new(first, plan);
                while let Some(s) = steps.next() {
                    steps.returned(&run_pg(c, &s).await?);
                }
                sqlx::query("COMMIT").execute(&mut *c).await?;
                Ok(steps.rows_seen)
            }
            Conn::Rusqlite(jobs) => {
                let (tx, rx) = tokio::sync::oneshot::channel();
                let job: Job = Box::new(move |c: &mut rusqlite::Connection| {
                    let run = || -> Result<usize> {
                        let txn =
                            c.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
                        let mut steps = Steps::new(first, plan);
                        while let Some(s) = steps.next() {
                            steps.returned(&run_rusqlite(&txn, &s)?);
                        }
                        txn.commit()?;
                        Ok(steps.rows_seen)
                    };
                    let _ = tx.send(run());
                });
                jobs.send(job).ok().context("the rusqlite thread stopped")?;
                rx.await.context("the rusqlite thread dropped a job")?
            }
        }
    }

    /// One statement outside a transaction (the ACK's read).
    async fn read(&mut self, s: Stmt) -> Result<Vec<Vec<Value>>> {
        match self {
            Conn::Sqlx(c) => run_sqlx(c, &s).await,
            Conn::Pg(c) => run_pg(c, &s).await,
            Conn::Rusqlite(jobs) => {
                let (tx, rx) = tokio::sync::oneshot::channel();
                let job: Job = Box::new(move |c: &mut rusqlite::Connection| {
                    let _ = tx.send(run_rusqlite(c, &s));
                });
                jobs.send(job).ok().context("the rusqlite thread stopped")?;
                rx.await.context("the rusqlite thread dropped a job")?
            }
        }
    }
}

async fn connect(url: &str, driver: Driver) -> Result<Conn> {
    match driver {
        Driver::PgStatements | Driver::PgClaimStatement => {
            Ok(Conn::Pg(PgConnection::connect(url).await?))
        }
        Driver::Sqlx => {
            let opts = SqliteConnectOptions::from_str(url)?
                .journal_mode(SqliteJournalMode::Wal)
                .synchronous(SqliteSynchronous::Full)
                .pragma("wal_autocheckpoint", "8192")
                .pragma("temp_store", "memory")
                .busy_timeout(std::time::Duration::from_secs(30));
            Ok(Conn::Sqlx(SqliteConnection::connect_with(&opts).await?))
        }
        Driver::Rusqlite => {
            let path = url
                .strip_prefix("sqlite://")
                .and_then(|p| p.split('?').next())
                .context("not an sqlite:// URL")?
                .to_owned();
            let c = rusqlite::Connection::open(path)?;
            c.execute_batch(
                "PRAGMA journal_mode = WAL; PRAGMA synchronous = FULL; \
                 PRAGMA wal_autocheckpoint = 8192; PRAGMA temp_store = memory; \
                 PRAGMA busy_timeout = 30000; PRAGMA foreign_keys = ON;",
            )?;
            c.set_prepared_statement_cache_capacity(256);
            let (tx, rx) = mpsc::channel::<Job>();
            std::thread::spawn(move || {
                let mut c = c;
                while let Ok(job) = rx.recv() {
                    job(&mut c);
                }
            });
            Ok(Conn::Rusqlite(tx))
        }
    }
}

/// One measurement through `driver`: deliveries per second, and this
/// process's CPU time per 1,000 deliveries in ms (both drivers run in it).
pub async fn run_once(
    bin: &Path,
    backend: &FloorBackend,
    driver: Driver,
    shape: HandoffShape,
) -> Result<(f64, f64)> {
    if shape.batch == 0 || shape.claim == 0 {
        bail!("batch and claim must be at least 1");
    }
    if driver.pg() != matches!(backend, FloorBackend::Postgres(_)) {
        bail!("{} needs the other backend", driver.name());
    }
    let floor = Floor::create(backend, bin).await?;
    let mut conn = connect(floor.url(), driver).await?;
    let ids = Ids {
        queue: id(),
        sub: id(),
        cred: id(),
        session: id(),
    };
    let ns = id();
    let setup = vec![
        stmt(
            "INSERT INTO queues (id, namespace_id, name, head_sequence, retention_floor, \
             created_at) VALUES (?, ?, ?, 0, 0, 0)",
            vec![
                t(&ids.queue),
                t(&ns),
                Param::Text(format!("q-{}", ids.queue)),
            ],
        ),
        stmt(
            "INSERT INTO subscriptions (id, namespace_id, application_id, credential_id, \
             queue_id, name, revision, enabled, types, cursor_sequence, pending_count, \
             max_pending, max_attempts, created_at, updated_at) \
             VALUES (?, ?, ?, ?, ?, ?, 1, TRUE, '', 0, 0, 1000000000, 5, 0, 0)",
            vec![
                t(&ids.sub),
                t(&ns),
                Param::Text(id()),
                t(&ids.cred),
                t(&ids.queue),
                Param::Text(format!("s-{}", ids.sub)),
            ],
        ),
        stmt(
            "INSERT INTO credentials (id, namespace_id, application_id, token_digest, \
             permissions, queue_scope, revoked_at, created_at) \
             VALUES (?, ?, ?, ?, '[]', '[]', NULL, 0)",
            vec![t(&ids.cred), t(&ns), Param::Text(id()), Param::Text(id())],
        ),
    ];
    conn.transaction(setup, Box::new(|_, _| Vec::new())).await?;
    let filler = "x".repeat(200);
    let pg = driver.pg();
    let mix = Mix {
        ids: &ids,
        filler: &filler,
        pg,
    };
    let cpu_before = crate::orbit::cpu_ms(std::process::id()).unwrap_or(f64::NAN);
    let started = Instant::now();
    let mut sequence = 0i64;
    let mut done = 0u64;
    let mut returned = 0usize;
    while done < shape.deliveries {
        let n = shape.batch.min(shape.deliveries - done);
        let now = now_us() as i64;
        let events: Vec<(String, i64)> = (1..=n as i64).map(|k| (id(), sequence + k)).collect();
        let after = sequence;
        sequence += n as i64;

        // 1. The publish and its materialization, one transaction (the node
        //    commits a publish and materializes in the claim's or the
        //    scanner's transaction; one commit here, as at best).
        let mut first = mix.publish(&events, now);
        first.extend(mix.materialize_reads(after, sequence, 256));
        let materialize = {
            let filler = filler.clone();
            let mut done_writes = false;
            let mix_ids = ids.clone();
            Box::new(move |k: usize, rows: &[Vec<Value>]| {
                // The entries read (statement 4) become deliveries.
                if k != 4 || done_writes {
                    return Vec::new();
                }
                done_writes = true;
                let mix = Mix {
                    ids: &mix_ids,
                    filler: &filler,
                    pg,
                };
                let rows: Vec<(String, String, i64)> = rows
                    .iter()
                    .filter_map(|r| {
                        let event = r.first()?.text()?.to_owned();
                        let seq = match r.get(1)? {
                            Value::Int(s) => *s,
                            _ => return None,
                        };
                        Some((event, id(), seq))
                    })
                    .collect();
                mix.materialize_writes(&rows, now)
            }) as Plan
        };
        returned += conn.transaction(first, materialize).await?;

        // 2. The claims of the batch, `claim` rows each, in one round.
        let claims = n.div_ceil(shape.claim);
        let want = shape.claim;
        let now = now_us() as i64;
        let mix_ids = ids.clone();
        let filler_c = filler.clone();
        let in_one = driver == Driver::PgClaimStatement;
        let claim = move |mix: &Mix<'_>| -> Vec<Stmt> {
            if in_one {
                // No capacity bound: one session takes every claim here.
                vec![
                    mix.claim_check(),
                    mix.claim_statement(now, want, u32::MAX.into()),
                ]
            } else {
                mix.claim_reads(now, want)
            }
        };
        let first = claim(&mix);
        let mut claims_left = claims.saturating_sub(1);
        let leased = std::sync::Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
        let leased_in = leased.clone();
        let keep_leased = move |rows: &[Vec<Value>]| {
            if let Ok(mut leased) = leased_in.lock() {
                leased.extend(
                    rows.iter()
                        .filter_map(|r| r.first()?.text().map(str::to_owned)),
                );
            }
        };
        let plan = Box::new(move |k: usize, rows: &[Vec<Value>]| {
            let mix = Mix {
                ids: &mix_ids,
                filler: &filler_c,
                pg,
            };
            // Per claim: 7 reads, the lease, the render (9 statements); or
            // the check and the claim statement (2).
            let (per_claim, step) = if in_one { (2, k % 2) } else { (9, k % 9) };
            let next = match (in_one, step) {
                (false, 6) => {
                    let ids: Vec<String> = rows
                        .iter()
                        .filter_map(|r| r.first()?.text().map(str::to_owned))
                        .collect();
                    return vec![mix.lease(&ids, now)];
                }
                (false, 7) => {
                    keep_leased(rows);
                    // RETURNING *: the event id is the third column.
                    let events: Vec<String> = rows
                        .iter()
                        .filter_map(|r| r.get(2)?.text().map(str::to_owned))
                        .collect();
                    return vec![mix.render(&events)];
                }
                (true, 1) => {
                    keep_leased(rows);
                    true
                }
                _ => step == per_claim - 1,
            };
            if next && claims_left > 0 {
                claims_left -= 1;
                return claim(&mix);
            }
            Vec::new()
        }) as Plan;
        returned += conn.transaction(first, plan).await?;

        // 3. The ACKs of the batch: the read, then one transaction.
        let delivery_ids: Vec<String> = leased
            .lock()
            .map(|mut l| std::mem::take(&mut *l))
            .unwrap_or_default();
        if delivery_ids.len() as u64 != n {
            bail!("leased {} of {n} deliveries", delivery_ids.len());
        }
        let rows = conn.read(mix.ack_read(&delivery_ids)).await?;
        returned += rows.len();
        let now = now_us() as i64;
        returned += conn
            .transaction(mix.ack(&delivery_ids, now), Box::new(|_, _| Vec::new()))
            .await?;
        done += n;
    }
    let rate = done as f64 / started.elapsed().as_secs_f64();
    let cpu = crate::orbit::cpu_ms(std::process::id()).unwrap_or(f64::NAN) - cpu_before;
    if returned == 0 {
        bail!("no statement returned a row");
    }
    Ok((rate, cpu * 1000.0 / done as f64))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::floor::{self, FloorShape};

    /// The orbit-events binary the workspace's test build made beside this
    /// test (`cargo test --workspace --all-targets` builds it).
    fn node_binary() -> Option<std::path::PathBuf> {
        let exe = std::env::current_exe().ok()?;
        let bin = exe.parent()?.parent()?.join("orbit-events");
        bin.exists().then_some(bin)
    }

    /// Both benchmarks write the node's own schema, so a migration that
    /// changes a hot table breaks them here rather than in a bench run.
    #[tokio::test]
    async fn the_floor_and_the_handoff_mix_run_on_the_migrated_schema() {
        let Some(bin) = node_binary() else {
            eprintln!("skipped: no orbit-events binary beside the test (build the workspace)");
            return;
        };
        let scratch = tempfile::tempdir().unwrap();
        let shape = FloorShape {
            deliveries: 64,
            batch: 32,
            commits_per_batch: 3,
            writers: 1,
        };
        let backend = floor::FloorBackend::Sqlite(scratch.path().to_path_buf());
        assert!(floor::run_once(&backend, &bin, shape, 10).await.unwrap() > 0.0);
        let shape = HandoffShape {
            deliveries: 64,
            batch: 32,
            claim: 8,
        };
        for driver in [Driver::Sqlx, Driver::Rusqlite] {
            let (rate, _) = run_once(&bin, &backend, driver, shape).await.unwrap();
            assert!(rate > 0.0, "{}", driver.name());
        }
    }
}
