//! Persistence: one async function per transaction, named after what it does
//! (spec: style.md, delivery-model.md).
//!
//! [`Database`] owns the connection pools. On SQLite every write runs on a
//! single writer connection with `BEGIN IMMEDIATE` (stack-notes.md: pooled
//! writers fight over the file lock and a deferred read→write upgrade fails
//! with "database is locked"); reads use the rest of the pool, except the
//! credential lookup of each request, which runs in place (decision 0099).
//! On PostgreSQL one pool serves both and the transaction mode is ignored.
//! Every write transaction begins and ends in [`writer`], which trusts a
//! write connection only as far as the database confirms it (decision
//! 0076).

pub mod ack;
pub mod audit;
pub mod backlog;
pub mod claim;
pub mod deliveries;
pub mod error;
pub mod file_lock;
pub mod history;
pub mod idempotency;
pub mod list_cursor;
pub mod materialize;
pub(crate) mod postgres;
pub mod publish;
pub mod retention;
pub mod sessions;
pub mod sqlite;
pub mod status;
pub mod subscriptions;
pub(crate) mod tallies;
pub mod tenancy;
pub mod wakes;
pub mod writer;

use std::sync::{
    Arc, Weak,
    atomic::{AtomicU8, Ordering},
};
use std::{path::Path, time::Duration};

use sea_orm::sqlx::sqlite::{SqliteJournalMode, SqliteSynchronous};
use sea_orm::{
    ConnectOptions, ConnectionTrait, DatabaseConnection, DatabaseTransaction, DbBackend, DbErr,
    SqlErr, TransactionTrait,
};

use crate::config::{DatabaseSettings, redact_url};
pub use error::{StoreError, WriteError};
pub use writer::{WriteTxn, WriterStats};
use writer::{Writer, WriterHealth};

/// Connection pools of one node.
#[derive(Clone, Debug)]
pub struct Database {
    writer: Writer,
    read: DatabaseConnection,
    backend: DbBackend,
    /// SQLite: the write rounds of [`Database::write`] (decision 0068).
    rounds: Option<Arc<writer::round::Rounds>>,
    /// SQLite: connections for [`Database::read_in_place`] (decision 0099).
    readers: Option<Arc<sqlite::reads::Readers>>,
}

/// SQLite waits this long for a lock held by another process (e.g. the
/// `bootstrap` command next to a running node).
const SQLITE_BUSY_TIMEOUT: Duration = Duration::from_secs(5);
const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(10);
/// WAL pages after which a commit checkpoints (SQLite's default is 1,000).
/// A checkpoint copies each page once however often the WAL rewrote it, so
/// fewer, larger checkpoints copy the hot pages (index tails, the
/// subscription and queue rows) fewer times; the WAL then grows to about
/// 32 MiB (decision 0067). Statement journals and sorts stay in memory
/// (`temp_store`): they never outlive a transaction, so files only cost
/// an open, writes and an unlink each time.
const SQLITE_WAL_AUTOCHECKPOINT: u64 = 8192;
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// PostgreSQL advisory lock key serializing migrations ("orbitev1").
const MIGRATION_LOCK: i64 = 0x6F72_6269_7465_7631;

impl Database {
    /// Opens the pools for `settings.url`, creating the SQLite file and its
    /// folder when needed.
    pub async fn connect(settings: &DatabaseSettings) -> Result<Database, StoreError> {
        let url = settings.url.as_str();
        if url.starts_with("sqlite:") {
            Self::connect_sqlite(url, settings.max_connections).await
        } else if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            let mut opts = ConnectOptions::new(url.to_owned());
            opts.max_connections(settings.max_connections)
                .min_connections(1)
                .acquire_timeout(ACQUIRE_TIMEOUT)
                .connect_timeout(CONNECT_TIMEOUT)
                .sqlx_logging(false);
            let conn = match sea_orm::Database::connect(opts).await {
                Ok(conn) => conn,
                Err(err) => return Err(postgres_connect_failure(url, err).await),
            };
            Ok(Database {
                read: conn.clone(),
                writer: Writer::new(conn, DbBackend::Postgres, Arc::default(), None, None),
                backend: DbBackend::Postgres,
                rounds: None,
                readers: None,
            })
        } else {
            Err(StoreError::Config(format!(
                "database.url must start with sqlite:, postgres:// or postgresql:// (got {})",
                redact_url(url)
            )))
        }
    }

    async fn connect_sqlite(url: &str, max_connections: u32) -> Result<Database, StoreError> {
        let (url, synchronous) = split_sqlite_synchronous(url)?;
        // The hot writes run on a connection of the writer's own to the
        // same file (decision 0095): a database it could not open as the
        // pool sees it would only fail at the first delivery.
        let Some(round_file) = round_path(&url) else {
            return Err(StoreError::Config(format!(
                "database.url must name an SQLite file, not an in-memory, immutable or \
                 other-VFS database (got {})",
                redact_url(&url)
            )));
        };
        if let Some(parent) = sqlite_path(&url).and_then(|p| Path::new(p).parent())
            && !parent.as_os_str().is_empty()
        {
            std::fs::create_dir_all(parent).map_err(|e| {
                StoreError::Config(format!("cannot create {}: {e}", parent.display()))
            })?;
        }
        let health = Arc::new(WriterHealth::default());
        let pool = |size: u32| {
            let mut opts = ConnectOptions::new(url.clone());
            opts.max_connections(size)
                .min_connections(1)
                .acquire_timeout(ACQUIRE_TIMEOUT)
                .test_before_acquire(false)
                .sqlx_logging(false)
                .map_sqlx_sqlite_opts(move |o| {
                    o.journal_mode(SqliteJournalMode::Wal)
                        .busy_timeout(SQLITE_BUSY_TIMEOUT)
                        .synchronous(synchronous)
                        .pragma("temp_store", "memory")
                        .pragma("wal_autocheckpoint", SQLITE_WAL_AUTOCHECKPOINT.to_string())
                });
            opts
        };
        let mut write = pool(1);
        let callbacks = health.clone();
        write.map_sqlx_sqlite_pool_opts(move |o| callbacks.sqlite_pool(o));
        let write = sea_orm::Database::connect(write).await?;
        let read =
            sea_orm::Database::connect(pool(max_connections.saturating_sub(1).max(1))).await?;
        let files = sqlite_path(&url).map(writer::WalFiles::of);
        let readers = Some(Arc::new(sqlite::reads::Readers::new(round_file.clone())));
        let rounds = Some(writer::RoundSettings {
            path: round_file,
            synchronous: match synchronous {
                SqliteSynchronous::Off => "OFF",
                SqliteSynchronous::Normal => "NORMAL",
                SqliteSynchronous::Full => "FULL",
                SqliteSynchronous::Extra => "EXTRA",
            },
            busy_timeout: SQLITE_BUSY_TIMEOUT,
            wal_autocheckpoint: SQLITE_WAL_AUTOCHECKPOINT,
        });
        let writer = Writer::new(write, DbBackend::Sqlite, health, files, rounds);
        // A WAL left too big for the disk's free space is checkpointed
        // before anything else is written (decision 0076).
        writer.keep_headroom().await;
        Ok(Database {
            writer,
            read,
            backend: DbBackend::Sqlite,
            rounds: Some(Arc::default()),
            readers,
        })
    }

    /// Applies pending migrations. On PostgreSQL they run in one transaction
    /// holding an advisory lock, so nodes started at once on a fresh
    /// database take turns (without it all but one failed on a duplicate
    /// catalog entry) and the later ones find nothing left to do.
    pub async fn migrate(&self) -> Result<(), StoreError> {
        use migration::MigratorTrait;
        if self.backend != DbBackend::Postgres {
            return Ok(migration::Migrator::up(self.writer.connection(), None).await?);
        }
        let txn = self.writer.connection().begin().await?;
        execute_unprepared(
            &txn,
            &format!("SELECT pg_advisory_xact_lock({MIGRATION_LOCK})"),
        )
        .await?;
        migration::Migrator::up(&txn, None).await?;
        Ok(txn.commit().await?)
    }

    /// Begins a write transaction (`BEGIN IMMEDIATE` on SQLite) of its own,
    /// under the writer's rule (decision 0076): commit it with
    /// [`WriteTxn::commit`], which answers `Ok` only for a confirmed commit.
    pub async fn begin_write(&self) -> Result<WriteTxn, StoreError> {
        self.writer.begin().await
    }

    /// Runs `body` in a write transaction of its own and returns its answer
    /// once that transaction committed; `Err`: nothing of `body` was written
    /// (its own error `E`, or the fault of `BEGIN`/`COMMIT`). For writes
    /// that are not on the hot path (management, sessions, the sweeper);
    /// `body` runs once.
    pub async fn write_alone<T, E, F>(&self, body: F) -> Result<T, E>
    where
        E: WriteError,
        F: for<'t> AsyncFnOnce(&'t DatabaseTransaction) -> Result<T, E>,
    {
        self.writer.write_alone(async |txn| body(txn).await).await
    }

    /// Runs `body` in a write transaction and returns its answer once that
    /// transaction committed; `Err`: nothing of `body` was written (its own
    /// error `E`, or the failed `BEGIN`/`COMMIT`). A body that returns
    /// `Err` has its statements rolled back, so `E` can also carry "undo
    /// this" answers that are not database errors. On SQLite `body` may share
    /// the transaction and its commit with other writes that come at the
    /// same time (a write round, decision 0068): `body` must not wait for
    /// another write, and should keep to its own rows and statements; if
    /// another write of its round fails on its own rules, `body` runs a
    /// second time, alone in a transaction of its own (so it must be safe to
    /// run again); if the round fails on the database (a fault, decision
    /// 0076), every member gets that fault. On PostgreSQL it is a
    /// transaction of its own. The hot paths (ACK batches, claims,
    /// materialization, publishes) write through here; on SQLite their
    /// statements run in place on the round's connection
    /// ([`WriteTxn::sqlite`], decision 0095).
    pub async fn write<T, E, F>(&self, body: F) -> Result<T, E>
    where
        E: WriteError,
        F: for<'t> AsyncFnMut(&'t WriteTxn) -> Result<T, E>,
    {
        match &self.rounds {
            Some(rounds) => rounds.run(self, body).await,
            None => self.writer.write_again(body).await,
        }
    }

    /// PostgreSQL: `body`'s one statement in a transaction of its own, its
    /// answer after its commit ([`writer::Writer::write_statement`],
    /// decision 0109): the claim batch, the ACK batch and the publish batch
    /// (decision 0111), each a single statement there.
    pub async fn write_statement<T, F>(&self, body: F) -> Result<T, StoreError>
    where
        F: for<'c> AsyncFnMut(&'c DatabaseConnection) -> Result<T, StoreError>,
    {
        self.writer.write_statement(body).await
    }

    /// True while the database refuses writes: the last write transaction
    /// failed on a fault and none has committed since (decision 0076).
    pub fn refusing_writes(&self) -> bool {
        self.writer.health().refusing()
    }

    /// Whether writes are accepted, for `/readyz`: during an episode of
    /// refused writes, one small write transaction at most every
    /// `every` finds out whether it has ended; otherwise no write at all.
    /// `node` names the asking node (its probe row).
    pub async fn writes_accepted(&self, node: &str, every: std::time::Duration) -> bool {
        let health = self.writer.health();
        if !health.refusing() {
            return true;
        }
        if health.probe_due(every) {
            return self.write_probe(node).await.is_ok();
        }
        false
    }

    /// One row that needs new pages (16 KiB), inserted into `write_probes`
    /// and deleted again in one transaction: its commit fails exactly when
    /// the file cannot grow or be written.
    async fn write_probe(&self, node: &str) -> Result<(), StoreError> {
        let backend = self.backend;
        let (insert, delete) = match backend {
            DbBackend::Postgres => (
                "INSERT INTO write_probes (node_id, payload) VALUES ($1, decode(repeat('00', 16384), 'hex'))",
                "DELETE FROM write_probes WHERE node_id = $1",
            ),
            _ => (
                "INSERT INTO write_probes (node_id, payload) VALUES (?, zeroblob(16384))",
                "DELETE FROM write_probes WHERE node_id = ?",
            ),
        };
        self.write_alone(async |txn| {
            for sql in [insert, delete] {
                txn.execute_raw(sea_orm::Statement::from_sql_and_values(
                    backend,
                    sql,
                    [node.into()],
                ))
                .await?;
            }
            Ok(())
        })
        .await
    }

    /// The writer's faults and replaced connections (for `/metrics`).
    pub fn writer_stats(&self) -> WriterStats {
        self.writer.health().stats()
    }

    /// Test hook: SQLite write connections get `PRAGMA max_page_count = n`
    /// from now on (`None`: no limit), which makes writes fail with FULL
    /// once the file has `n` pages.
    #[cfg(feature = "test-hooks")]
    pub fn set_max_page_count(&self, n: Option<u64>) {
        self.writer.health().set_max_page_count(n);
    }

    /// Write rounds started so far on SQLite (0 on PostgreSQL).
    pub fn write_rounds_started(&self) -> u64 {
        self.rounds.as_ref().map_or(0, |r| r.started())
    }

    /// SQLite: members seated in the write round that still admits
    /// newcomers, 0 when none does (always 0 on PostgreSQL). For tests that
    /// need writes to meet in one round.
    pub fn write_round_seated(&self) -> usize {
        self.rounds.as_ref().map_or(0, |r| r.seated())
    }

    /// The connection for reads outside a transaction.
    /// SQLite: runs `read` on the calling thread, on a connection of its
    /// own (decision 0099), for a read of a row or two that a request
    /// needs before anything else; it takes no lock a writer needs and
    /// never waits for one (no busy timeout; a cold page is still read
    /// from the file). `None` on PostgreSQL, or when the read failed
    /// (logged at debug): the caller then reads through
    /// [`Database::reader`].
    pub(crate) fn read_in_place<T>(
        &self,
        read: impl FnOnce(&rusqlite::Connection) -> Result<T, StoreError>,
    ) -> Option<T> {
        let readers = self.readers.as_ref()?;
        match readers.run(read) {
            Ok(answer) => Some(answer),
            Err(err) => {
                tracing::debug!(error = %err, "an in-place read failed; reading through the pool");
                None
            }
        }
    }

    /// The read pool (SQLite: every connection but the writer's;
    /// PostgreSQL: the one pool), for reads that may scan.
    pub fn reader(&self) -> &DatabaseConnection {
        &self.read
    }

    pub fn backend(&self) -> DbBackend {
        self.backend
    }

    /// A trivial query on both pools; `Err` when the database is unreachable.
    pub async fn ping(&self) -> Result<(), StoreError> {
        self.read.ping().await?;
        Ok(self.writer.connection().ping().await?)
    }

    /// Closes the pools (used by tests that simulate a database outage).
    pub async fn close(&self) -> Result<(), StoreError> {
        self.read.close_by_ref().await?;
        Ok(self.writer.connection().close_by_ref().await?)
    }
}

/// Whether the caller of a request still waits for its answer, checked by
/// a batch once it holds the write lock, before writing anything of the
/// request: a closed connection no longer waits for its session's claim.
/// (A publish past its HTTP deadline is decided by a [`Commitment`].)
#[derive(Debug, Clone, Default)]
pub struct Waiter(Option<Weak<()>>);

impl Waiter {
    /// Waits while `alive` (held by the caller) exists.
    pub fn while_alive(alive: &Arc<()>) -> Waiter {
        Waiter(Some(Arc::downgrade(alive)))
    }

    /// The caller stopped waiting.
    pub fn gone(&self) -> bool {
        self.0.as_ref().is_some_and(|w| w.strong_count() == 0)
    }
}

/// Who decides a request whose deadline passes while it is being written
/// (http-api.md §1: on expiry 503 `UNAVAILABLE`, "and the transaction is
/// rolled back"; decision 0014). Shared by the HTTP deadline
/// (`http::envelope`) and the code that writes the request; exactly one of
/// them wins:
/// - the writer calls [`Commitment::commit`] once the request's statements
///   have run, just before the `COMMIT` that makes them final (a publish
///   batch, an idempotent write); from then on the caller waits for the
///   real outcome, whatever the deadline. Not before the statements: a
///   statement can wait for a lock held by anyone, for any time, and the
///   deadline must still answer such a request (it is queuing behind the
///   database, not committing). The exception is PostgreSQL's publish
///   batch, one statement committed as it ends (decision 0111): it commits
///   to its requests first and bounds the statement's lock waits by the
///   earliest of their deadlines, then answers 503 to those past it;
/// - the deadline calls [`Commitment::abandon`]; when it wins, the caller
///   is answered 503 and the writer leaves the request out.
///
/// Cheap to clone; clones share the decision.
#[derive(Debug, Clone, Default)]
pub struct Commitment {
    state: Arc<AtomicU8>,
    /// When the deadline answers 503, if the request has one: a writer
    /// that commits to the request before its statement ran (PostgreSQL's
    /// one-statement publish, decision 0111) bounds that statement's lock
    /// waits by it.
    deadline: Option<tokio::time::Instant>,
}

/// [`Commitment`] states.
const UNDECIDED: u8 = 0;
const COMMITTING: u8 = 1;
const ABANDONED: u8 = 2;

impl Commitment {
    /// An undecided request (no deadline decides it unless it is shared
    /// with one).
    pub fn new() -> Commitment {
        Commitment::default()
    }

    /// An undecided request whose deadline answers 503 at `deadline`.
    pub fn until(deadline: tokio::time::Instant) -> Commitment {
        Commitment {
            state: Arc::default(),
            deadline: Some(deadline),
        }
    }

    /// The request's deadline, if it has one.
    pub fn deadline(&self) -> Option<tokio::time::Instant> {
        self.deadline
    }

    /// The writer's side: true when the request may be written (now, or
    /// already, committing); false when its deadline won — write nothing
    /// of it.
    pub fn commit(&self) -> bool {
        match self.state.compare_exchange(
            UNDECIDED,
            COMMITTING,
            Ordering::AcqRel,
            Ordering::Acquire,
        ) {
            Ok(_) => true,
            Err(state) => state == COMMITTING,
        }
    }

    /// True once the deadline won: the request's caller was answered 503
    /// and no writer may write it. Decides nothing (a writer checks it
    /// before doing work it would throw away, and still calls
    /// [`Commitment::commit`] before its commit).
    pub fn abandoned(&self) -> bool {
        self.state.load(Ordering::Acquire) == ABANDONED
    }

    /// The deadline's side: true when nothing of the request is or will be
    /// written, so 503 is the truth; false when its writer began committing
    /// it first and the caller must wait for that outcome.
    pub fn abandon(&self) -> bool {
        match self
            .state
            .compare_exchange(UNDECIDED, ABANDONED, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => true,
            Err(state) => state == ABANDONED,
        }
    }
}

/// True when `err` is a unique-constraint violation.
pub fn is_unique_violation(err: &DbErr) -> bool {
    use sea_orm::{RuntimeErr, sqlx};
    if matches!(err.sql_err(), Some(SqlErr::UniqueConstraintViolation(_))) {
        return true;
    }
    // sea-orm knows only sqlx's own error types; the write rounds' is ours.
    matches!(err, DbErr::Exec(RuntimeErr::SqlxError(e)) | DbErr::Query(RuntimeErr::SqlxError(e))
        if matches!(&**e, sqlx::Error::Database(db) if db.is_unique_violation()))
}

/// `SELECT ... FOR UPDATE` on PostgreSQL; nothing on SQLite, where the
/// `IMMEDIATE` transaction already holds the write lock.
pub fn lock_for_update<Q: sea_orm::QuerySelect>(query: Q, backend: DbBackend) -> Q {
    if backend == DbBackend::Postgres {
        query.lock_exclusive()
    } else {
        query
    }
}

/// `deliveries.state = '<STATE>'` with the state as a literal, not a bound
/// parameter: the partial indexes of migration 0079 (`WHERE state =
/// 'PENDING'`, …) serve only statements whose condition implies theirs,
/// which a parameter never does for either planner (decision 0079).
pub fn state_is(state: entity::delivery::DeliveryState) -> sea_orm::sea_query::SimpleExpr {
    use sea_orm::sea_query::{Expr, ExprTrait};
    Expr::col((entity::delivery::Entity, entity::delivery::Column::State))
        .eq(Expr::cust(format!("'{}'", state.as_str())))
}

/// Runs `sql` (no parameters) — used for backend-specific statements.
pub async fn execute_unprepared<C: ConnectionTrait>(conn: &C, sql: &str) -> Result<(), StoreError> {
    Ok(conn.execute_unprepared(sql).await.map(|_| ())?)
}

/// Removes our own `synchronous=` parameter (sqlx does not know it) and
/// returns the setting: FULL unless configured otherwise.
fn split_sqlite_synchronous(url: &str) -> Result<(String, SqliteSynchronous), StoreError> {
    let Some((base, query)) = url.split_once('?') else {
        return Ok((url.to_owned(), SqliteSynchronous::Full));
    };
    let mut synchronous = SqliteSynchronous::Full;
    let mut kept = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        match pair.split_once('=') {
            Some(("synchronous", value)) => {
                synchronous = match value.to_ascii_lowercase().as_str() {
                    "full" => SqliteSynchronous::Full,
                    "normal" => SqliteSynchronous::Normal,
                    "extra" => SqliteSynchronous::Extra,
                    other => {
                        return Err(StoreError::Config(format!(
                            "database.url: synchronous={other} is not supported (full, normal, extra)"
                        )));
                    }
                }
            }
            _ => kept.push(pair),
        }
    }
    let url = if kept.is_empty() {
        base.to_owned()
    } else {
        format!("{base}?{}", kept.join("&"))
    };
    Ok((url, synchronous))
}

/// The file path of a `sqlite:` URL, if it names a file (as written: a
/// relative path is relative to the working directory).
pub fn sqlite_path(url: &str) -> Option<&str> {
    let rest = url
        .strip_prefix("sqlite://")
        .or_else(|| url.strip_prefix("sqlite:"))?;
    let path = rest.split('?').next()?;
    (!path.is_empty() && path != ":memory:").then_some(path)
}

/// The file write rounds open their own connection on (decision 0090): the
/// path as sqlx decodes it. `None` (rounds run through sqlx) for an
/// in-memory database or one opened through another VFS or as immutable,
/// which a second connection would not see the same way.
fn round_path(url: &str) -> Option<std::path::PathBuf> {
    use std::str::FromStr;
    sqlite_path(url)?;
    let query = url.split_once('?').map_or("", |(_, q)| q);
    let special = query
        .split('&')
        .any(|kv| kv == "mode=memory" || matches!(kv.split('=').next(), Some("vfs" | "immutable")));
    if special {
        return None;
    }
    let options = sea_orm::sqlx::sqlite::SqliteConnectOptions::from_str(url).ok()?;
    Some(options.get_filename().to_path_buf())
}

/// The pool reports only "pool timed out" when PostgreSQL cannot be
/// reached; one direct connection attempt names the cause (refused, unknown
/// host, authentication failed). sqlx's messages carry no password.
async fn postgres_connect_failure(url: &str, err: DbErr) -> StoreError {
    use sea_orm::sqlx::{Connection, postgres::PgConnection};
    let Ok(options) = url.parse::<sea_orm::sqlx::postgres::PgConnectOptions>() else {
        return err.into();
    };
    match tokio::time::timeout(CONNECT_TIMEOUT, PgConnection::connect_with(&options)).await {
        Ok(Err(cause)) => StoreError::Config(format!("{err} (cause: {cause})")),
        Ok(Ok(conn)) => {
            let _ = conn.close().await;
            err.into()
        }
        Err(_) => StoreError::Config(format!(
            "{err} (cause: no answer within {CONNECT_TIMEOUT:?})"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn synchronous_defaults_to_full_and_is_stripped() {
        let (url, sync) = split_sqlite_synchronous("sqlite://var/x.db?mode=rwc").unwrap();
        assert_eq!(url, "sqlite://var/x.db?mode=rwc");
        assert!(matches!(sync, SqliteSynchronous::Full));
        let (url, sync) =
            split_sqlite_synchronous("sqlite://var/x.db?synchronous=normal&mode=rwc").unwrap();
        assert_eq!(url, "sqlite://var/x.db?mode=rwc");
        assert!(matches!(sync, SqliteSynchronous::Normal));
        assert!(split_sqlite_synchronous("sqlite://x.db?synchronous=off").is_err());
    }

    #[test]
    fn a_commitment_is_decided_once_by_whichever_side_comes_first() {
        let committed = Commitment::new();
        let deadline = committed.clone();
        assert!(committed.commit());
        assert!(committed.commit(), "committing again stays committed");
        assert!(!committed.abandoned());
        assert!(
            !deadline.abandon(),
            "the deadline lost: wait for the outcome"
        );

        let abandoned = Commitment::new();
        let writer = abandoned.clone();
        assert!(!writer.abandoned(), "undecided");
        assert!(abandoned.abandon());
        assert!(writer.abandoned());
        assert!(abandoned.abandon());
        assert!(!writer.commit(), "the writer lost: write nothing of it");
    }

    /// `PRAGMA compile_options` of each pool of a fresh SQLite node.
    async fn sqlite_compile_options() -> Vec<Vec<String>> {
        use sea_orm::{ConnectionTrait, Statement};
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}?mode=rwc", dir.path().join("p.db").display());
        let db = Database::connect(&DatabaseSettings {
            url,
            max_connections: 2,
        })
        .await
        .unwrap();
        let mut out = Vec::new();
        for conn in [db.writer.connection(), &db.read] {
            out.push(
                conn.query_all_raw(Statement::from_string(
                    DbBackend::Sqlite,
                    "PRAGMA compile_options",
                ))
                .await
                .unwrap()
                .iter()
                .map(|r| r.try_get_by_index::<String>(0).unwrap())
                .collect(),
            );
        }
        out
    }

    /// Decision 0080: without the planner stability guarantee SQLite parses
    /// and plans a statement again each time a new value is bound to its
    /// `LIMIT ?`, which sea-orm binds in every `one()` and `limit(n)`.
    #[tokio::test]
    async fn sqlite_is_built_with_the_planner_stability_guarantee() {
        for options in sqlite_compile_options().await {
            assert!(
                options.iter().any(|o| o == "ENABLE_QPSG"),
                "SQLite was built without SQLITE_ENABLE_QPSG (.cargo/config.toml): {options:?}"
            );
        }
    }

    /// Decision 0102: SQLite's allocations and page-cache fetches take no
    /// process-wide lock (no memory statistics, one page-cache group per
    /// connection).
    #[tokio::test]
    async fn sqlite_allocations_take_no_process_wide_lock() {
        for options in sqlite_compile_options().await {
            assert!(
                options.iter().any(|o| o == "DEFAULT_MEMSTATUS=0"),
                "SQLite keeps memory statistics (.cargo/config.toml): {options:?}"
            );
            assert!(
                !options.iter().any(|o| o == "ENABLE_MEMORY_MANAGEMENT"),
                "SQLite shares one page-cache group (.cargo/config.toml): {options:?}"
            );
        }
    }

    #[test]
    fn round_paths_are_the_files_sqlx_opens() {
        assert_eq!(
            round_path("sqlite:///data/my%20db.db?mode=rwc"),
            Some(std::path::PathBuf::from("/data/my db.db"))
        );
        assert_eq!(
            round_path("sqlite://var/o.db"),
            Some(std::path::PathBuf::from("var/o.db"))
        );
        assert_eq!(round_path("sqlite::memory:"), None);
        assert_eq!(round_path("sqlite:x.db?mode=memory"), None);
        assert_eq!(round_path("sqlite:x.db?immutable=true"), None);
    }

    #[tokio::test]
    async fn an_sqlite_database_that_is_not_a_file_is_refused_at_start_naming_the_key() {
        for url in [
            "sqlite::memory:",
            "sqlite:x.db?mode=memory",
            "sqlite:x.db?immutable=true",
        ] {
            let err = Database::connect(&DatabaseSettings {
                url: url.to_owned(),
                max_connections: 2,
            })
            .await
            .unwrap_err();
            assert!(
                matches!(&err, StoreError::Config(m) if m.contains("database.url")),
                "{url}: {err}"
            );
        }
    }

    #[test]
    fn sqlite_paths() {
        assert_eq!(
            sqlite_path("sqlite://var/orbit-events.db?mode=rwc"),
            Some("var/orbit-events.db")
        );
        assert_eq!(sqlite_path("sqlite:///tmp/a.db"), Some("/tmp/a.db"));
        assert_eq!(sqlite_path("sqlite::memory:"), None);
    }
}
