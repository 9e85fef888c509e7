//! The writer: where every write transaction of a node begins and ends, and
//! when a write connection is trusted (decision 0076).
//!
//! A write is answered as committed only when the database said so for the
//! transaction that made it durable: its `COMMIT` succeeded and, on SQLite,
//! the connection's commit hook ran for that transaction and its rollback
//! hook did not. SQLite rolls a transaction back by itself after some errors
//! (a full disk, an I/O error) while the driver still counts it open
//! (stack-notes.md), so after any fault on a write connection (a failed
//! `BEGIN`, statement, `COMMIT` or `ROLLBACK`, or a transaction rolled back
//! behind the driver's back) that connection is closed and replaced before
//! the next write, and every request of the transaction gets the fault. A
//! connection is handed out only while the driver counts no transaction
//! open on it, so the `BEGIN IMMEDIATE` that starts each transaction is
//! SQLite's own check that the connection is in autocommit mode (it fails
//! inside a transaction). The first fault opens an episode of refused
//! writes (one log line, `/readyz` 503, metrics); the next commit ends it.

use std::{
    ops::Deref,
    sync::{
        Arc, Mutex, PoisonError,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use sea_orm::{
    DatabaseConnection, DatabaseTransaction, DbBackend, DbErr, RuntimeErr, SqliteTransactionMode,
    TransactionOptions, TransactionTrait, sqlx,
};

/// A write body's error as the writer sees it: the database error that made
/// the body fail, if one did (a fault replaces the connection).
pub trait WriteError: From<DbErr> {
    fn database_error(&self) -> Option<&DbErr>;
}

impl WriteError for DbErr {
    fn database_error(&self) -> Option<&DbErr> {
        Some(self)
    }
}

/// Why a write transaction failed on the database rather than on its own
/// rules (label `cause` of `orbit_events_write_faults_total`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FaultCause {
    /// No space left (SQLite `FULL`, PostgreSQL class 53).
    DiskFull,
    /// An I/O error, a corrupt file or a read-only database.
    Io,
    /// The database stayed locked beyond the busy timeout.
    Busy,
    /// The connection broke, could not be had, or the server ended it.
    Connection,
    /// SQLite rolled the transaction back by itself, or its `COMMIT` did not
    /// commit it (the commit hook did not run).
    RolledBack,
    /// Any other database failure of a statement.
    Other,
}

impl FaultCause {
    pub const ALL: [FaultCause; 6] = [
        FaultCause::DiskFull,
        FaultCause::Io,
        FaultCause::Busy,
        FaultCause::Connection,
        FaultCause::RolledBack,
        FaultCause::Other,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            FaultCause::DiskFull => "disk_full",
            FaultCause::Io => "io",
            FaultCause::Busy => "busy",
            FaultCause::Connection => "connection",
            FaultCause::RolledBack => "rolled_back",
            FaultCause::Other => "other",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// The fault in `err`, or `None` when `err` is a rule of the data (a
/// constraint, a deadlock or serialization failure PostgreSQL resolved by
/// aborting the transaction, a row not found, a decode error) and the
/// connection is as trustworthy as before.
pub fn fault_cause(err: &DbErr) -> Option<FaultCause> {
    match err {
        DbErr::Conn(_) | DbErr::ConnectionAcquire(_) => Some(FaultCause::Connection),
        DbErr::Exec(RuntimeErr::SqlxError(e)) | DbErr::Query(RuntimeErr::SqlxError(e)) => {
            sqlx_fault(e)
        }
        DbErr::Exec(RuntimeErr::Internal(_)) | DbErr::Query(RuntimeErr::Internal(_)) => {
            Some(FaultCause::Other)
        }
        _ => None,
    }
}

fn sqlx_fault(err: &sqlx::Error) -> Option<FaultCause> {
    match err {
        sqlx::Error::Database(db) => {
            let code = db.code().unwrap_or_default();
            if db.try_downcast_ref::<sqlx::sqlite::SqliteError>().is_some() {
                sqlite_fault(code.parse().unwrap_or(1))
            } else {
                postgres_fault(&code)
            }
        }
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::Protocol(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed
        | sqlx::Error::BeginFailed => Some(FaultCause::Connection),
        _ => None,
    }
}

/// SQLite result codes (the primary code is the low byte of the extended).
fn sqlite_fault(code: i32) -> Option<FaultCause> {
    match code & 0xff {
        13 => Some(FaultCause::DiskFull),
        // IOERR, CORRUPT, NOTADB, READONLY, CANTOPEN
        10 | 11 | 26 | 8 | 14 => Some(FaultCause::Io),
        // BUSY, LOCKED
        5 | 6 => Some(FaultCause::Busy),
        // CONSTRAINT, MISMATCH, RANGE, TOOBIG: the statement failed, the
        // transaction stands.
        19 | 20 | 25 | 18 => None,
        _ => Some(FaultCause::Other),
    }
}

/// PostgreSQL SQLSTATE classes.
fn postgres_fault(code: &str) -> Option<FaultCause> {
    match code.get(..2).unwrap_or_default() {
        "53" => Some(FaultCause::DiskFull),
        "58" | "XX" => Some(FaultCause::Io),
        "08" | "57" => Some(FaultCause::Connection),
        // 23 integrity, 40 rollback (deadlock, serialization), 22 data,
        // 25 transaction state, 42 syntax or access: the data's rules.
        _ => None,
    }
}

/// The health of a node's write connection: what SQLite's hooks reported
/// and the episode of refused writes. Shared by the pool's connection
/// callbacks and every [`WriteTxn`].
#[derive(Debug, Default)]
pub struct WriterHealth {
    /// SQLite: transactions the write connection committed, and rolled back
    /// (its commit and rollback hooks), and rows it changed (its update
    /// hook).
    commits: AtomicU64,
    rollbacks: AtomicU64,
    changes: AtomicU64,
    /// SQLite: checkpoint the WAL before the next write (after a full disk).
    checkpoint_wanted: AtomicBool,
    /// When the WAL's headroom was last checked (µs since `born`).
    headroom_checked: AtomicU64,
    /// SQLite: close the write connection when it is next released or
    /// acquired, and open a new one.
    replace: AtomicBool,
    replaced: AtomicU64,
    faults: [AtomicU64; FaultCause::ALL.len()],
    episode: Mutex<Option<Episode>>,
    /// When `/readyz` last tried a write during an episode.
    last_probe: Mutex<Option<Instant>>,
    /// SQLite: `PRAGMA max_page_count` for new write connections (0: none;
    /// a test hook that makes the database full).
    max_page_count: AtomicU64,
}

#[derive(Debug)]
struct Episode {
    since: Instant,
    faults: u64,
}

/// What the writer reports to `/metrics` (read when scraped).
#[derive(Clone, Debug, Default)]
pub struct WriterStats {
    /// Write transactions that failed on a fault, by cause.
    pub faults: Vec<(FaultCause, u64)>,
    /// SQLite write connections closed and replaced after a fault.
    pub connections_replaced: u64,
    /// True while writes are refused (an episode is open).
    pub refusing: bool,
}

impl WriterHealth {
    fn commits(&self) -> u64 {
        self.commits.load(Ordering::Acquire)
    }

    fn rollbacks(&self) -> u64 {
        self.rollbacks.load(Ordering::Acquire)
    }

    fn changes(&self) -> u64 {
        self.changes.load(Ordering::Acquire)
    }

    /// Records a fault: the connection is replaced (SQLite), the episode
    /// opens (logged once) or counts one more.
    pub(super) fn fault(&self, cause: FaultCause, err: &DbErr, backend: DbBackend) {
        if backend == DbBackend::Sqlite {
            self.replace.store(true, Ordering::Release);
            if cause == FaultCause::DiskFull {
                self.checkpoint_wanted.store(true, Ordering::Release);
            }
        }
        self.faults[cause.index()].fetch_add(1, Ordering::Relaxed);
        let mut episode = self.episode.lock().unwrap_or_else(PoisonError::into_inner);
        match episode.as_mut() {
            Some(episode) => episode.faults += 1,
            None => {
                tracing::error!(
                    cause = cause.as_str(),
                    error = %err,
                    "the database refuses writes: every write is answered UNAVAILABLE until one commits again"
                );
                *episode = Some(Episode {
                    since: Instant::now(),
                    faults: 1,
                });
            }
        }
    }

    /// A write transaction that changed rows committed: an open episode
    /// ends (logged once). One that changed nothing may commit without
    /// touching the disk, so it proves nothing.
    fn committed(&self) {
        let mut episode = self.episode.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(ended) = episode.take() {
            tracing::warn!(
                failed_writes = ended.faults,
                after_ms = ended.since.elapsed().as_millis() as u64,
                "the database accepts writes again"
            );
        }
    }

    /// True while an episode of refused writes is open.
    pub fn refusing(&self) -> bool {
        self.episode
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_some()
    }

    /// True when `/readyz` should try a write now: during an episode, at
    /// most once per `every`.
    pub(super) fn probe_due(&self, every: Duration) -> bool {
        let mut last = self
            .last_probe
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let due = last.is_none_or(|at| at.elapsed() >= every);
        if due {
            *last = Some(Instant::now());
        }
        due
    }

    pub fn stats(&self) -> WriterStats {
        WriterStats {
            faults: FaultCause::ALL
                .iter()
                .map(|&c| (c, self.faults[c.index()].load(Ordering::Relaxed)))
                .collect(),
            connections_replaced: self.replaced.load(Ordering::Relaxed),
            refusing: self.refusing(),
        }
    }

    /// Test hook: new write connections get `PRAGMA max_page_count = n`
    /// (`None`: no limit), and the current one is replaced.
    pub(super) fn set_max_page_count(&self, n: Option<u64>) {
        self.max_page_count.store(n.unwrap_or(0), Ordering::Release);
        self.replace.store(true, Ordering::Release);
    }

    /// The pool callbacks of SQLite's write connection: hooks on every new
    /// connection; a connection to be replaced, or one the driver still
    /// counts inside a transaction, is closed instead of handed out again.
    pub(super) fn sqlite_pool(
        self: &Arc<Self>,
        options: sqlx::sqlite::SqlitePoolOptions,
    ) -> sqlx::sqlite::SqlitePoolOptions {
        let on_connect = self.clone();
        let on_release = self.clone();
        let on_acquire = self.clone();
        options
            .after_connect(move |conn, _| {
                let health = on_connect.clone();
                Box::pin(async move {
                    let pages = health.max_page_count.load(Ordering::Acquire);
                    if pages > 0 {
                        sqlx::query(sqlx::AssertSqlSafe(format!(
                            "PRAGMA max_page_count = {pages}"
                        )))
                        .execute(&mut *conn)
                        .await?;
                    }
                    let mut handle = conn.lock_handle().await?;
                    let commits = health.clone();
                    handle.set_commit_hook(move || {
                        commits.commits.fetch_add(1, Ordering::AcqRel);
                        true
                    });
                    let rollbacks = health.clone();
                    handle.set_rollback_hook(move || {
                        rollbacks.rollbacks.fetch_add(1, Ordering::AcqRel);
                    });
                    let changes = health.clone();
                    handle.set_update_hook(move |_| {
                        changes.changes.fetch_add(1, Ordering::AcqRel);
                    });
                    Ok(())
                })
            })
            .after_release(move |_, _| {
                let keep = !on_release.take_replace();
                Box::pin(async move { Ok(keep) })
            })
            .before_acquire(move |conn, _| {
                use sqlx_core::transaction::TransactionManager as _;
                let open =
                    <sqlx::Sqlite as sqlx::Database>::TransactionManager::get_transaction_depth(
                        conn,
                    );
                let replace = on_acquire.take_replace();
                if open != 0 && !replace {
                    on_acquire.replaced.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(
                        "closed a write connection the driver counted inside a transaction"
                    );
                }
                let keep = !replace && open == 0;
                Box::pin(async move { Ok(keep) })
            })
    }

    /// True (once) when the connection is to be replaced.
    fn take_replace(&self) -> bool {
        let replace = self.replace.swap(false, Ordering::AcqRel);
        if replace {
            self.replaced.fetch_add(1, Ordering::Relaxed);
        }
        replace
    }
}

/// The write connection(s) of a node: SQLite's single writer connection, or
/// PostgreSQL's pool; every write transaction begins here.
#[derive(Clone, Debug)]
pub struct Writer {
    conn: DatabaseConnection,
    backend: DbBackend,
    health: Arc<WriterHealth>,
    /// SQLite on a file: its WAL and folder.
    files: Option<Arc<WalFiles>>,
}

/// Where an SQLite database's WAL lives, for its headroom.
#[derive(Debug)]
pub(super) struct WalFiles {
    wal: std::path::PathBuf,
    dir: std::path::PathBuf,
    born: Instant,
}

impl WalFiles {
    /// The files of the SQLite database at `path`.
    pub(super) fn of(path: &str) -> WalFiles {
        let path = std::path::Path::new(path);
        let dir = match path.parent() {
            Some(dir) if !dir.as_os_str().is_empty() => dir.to_path_buf(),
            _ => std::path::PathBuf::from("."),
        };
        let mut wal = path.as_os_str().to_owned();
        wal.push("-wal");
        WalFiles {
            wal: wal.into(),
            dir,
            born: Instant::now(),
        }
    }
}

/// The WAL is checkpointed (and truncated) early when the filesystem's free
/// space falls below its size plus this: a checkpoint needs room for the
/// pages it copies, and SQLite's own checkpoint comes only after 32 MiB of
/// WAL (decision 0067), more than a small volume holds (decision 0076).
const WAL_HEADROOM: u64 = 4 << 20;
/// A WAL smaller than this is left to SQLite's own checkpoints.
const WAL_WORTH_CHECKPOINTING: u64 = 1 << 20;
/// The headroom is looked at most this often (µs; two syscalls).
const HEADROOM_CHECK_EVERY_US: u64 = 10_000;

impl Writer {
    pub(super) fn new(
        conn: DatabaseConnection,
        backend: DbBackend,
        health: Arc<WriterHealth>,
        files: Option<WalFiles>,
    ) -> Writer {
        Writer {
            conn,
            backend,
            health,
            files: files.map(Arc::new),
        }
    }

    /// SQLite: checkpoints the WAL into the database file and truncates it
    /// when a disk-full fault asked for it, or when the free space left
    /// could not take the WAL's pages (see [`WAL_HEADROOM`]). Best effort:
    /// a checkpoint that fails is tried again before a later write.
    pub(super) async fn keep_headroom(&self) {
        let Some(files) = &self.files else {
            return;
        };
        let wanted = self.health.checkpoint_wanted.swap(false, Ordering::AcqRel);
        if !wanted && !self.headroom_low(files) {
            return;
        }
        match execute_checkpoint(&self.conn).await {
            Ok(()) => tracing::info!("checkpointed and truncated the WAL to keep room on the disk"),
            Err(err) => {
                self.health.checkpoint_wanted.store(true, Ordering::Release);
                tracing::debug!(error = %err, "WAL checkpoint failed");
            }
        }
    }

    fn headroom_low(&self, files: &WalFiles) -> bool {
        let now = files.born.elapsed().as_micros() as u64;
        let last = self.health.headroom_checked.load(Ordering::Acquire);
        if now.saturating_sub(last) < HEADROOM_CHECK_EVERY_US {
            return false;
        }
        self.health.headroom_checked.store(now, Ordering::Release);
        let wal = std::fs::metadata(&files.wal).map_or(0, |m| m.len());
        if wal < WAL_WORTH_CHECKPOINTING {
            return false;
        }
        let free = rustix::fs::statvfs(&files.dir)
            .map_or(u64::MAX, |s| s.f_bavail.saturating_mul(s.f_frsize));
        free < wal.saturating_add(WAL_HEADROOM)
    }

    pub(super) fn connection(&self) -> &DatabaseConnection {
        &self.conn
    }

    pub fn health(&self) -> &WriterHealth {
        &self.health
    }

    /// Begins a write transaction (`BEGIN IMMEDIATE` on SQLite). A failed
    /// `BEGIN` is a fault.
    pub async fn begin(&self) -> Result<WriteTxn, DbErr> {
        if self.health.checkpoint_wanted.load(Ordering::Acquire) {
            self.keep_headroom().await;
        }
        let begun = self
            .conn
            .begin_with_options(TransactionOptions {
                sqlite_transaction_mode: Some(SqliteTransactionMode::Immediate),
                ..Default::default()
            })
            .await;
        match begun {
            // The counts are read once the transaction holds the
            // connection: no other transaction's hooks run until it ends.
            Ok(txn) => Ok(WriteTxn {
                txn,
                commits: self.health.commits(),
                changes: self.health.changes(),
                unfinished: Unfinished {
                    health: self.health.clone(),
                    rollbacks: self.health.rollbacks(),
                    armed: true,
                },
                writer: self.clone(),
            }),
            Err(err) => Err(self.fault(err)),
        }
    }

    /// Runs `body` in a write transaction of its own and returns its answer
    /// once that transaction committed; `Err`: nothing of `body` was written
    /// (its own error, or the fault of `BEGIN`/`COMMIT`; a failed `COMMIT`
    /// may still have committed, as when the process dies there).
    pub async fn write_alone<T, E, F>(&self, body: F) -> Result<T, E>
    where
        E: WriteError,
        F: for<'t> AsyncFnOnce(&'t DatabaseTransaction) -> Result<T, E>,
    {
        let txn = self.begin().await?;
        match body(&txn).await {
            Ok(answer) => {
                txn.commit().await?;
                Ok(answer)
            }
            Err(err) => {
                txn.abort(err.database_error()).await;
                Err(err)
            }
        }
    }

    /// Records `err` as a fault if it is one; returns it.
    pub(super) fn fault(&self, err: DbErr) -> DbErr {
        if let Some(cause) = fault_cause(&err) {
            self.health.fault(cause, &err, self.backend);
        }
        err
    }

    fn rolled_back(&self, what: &str) -> DbErr {
        let err = DbErr::Conn(RuntimeErr::Internal(format!(
            "the database rolled the write transaction back by itself ({what}); nothing of it was written"
        )));
        self.health
            .fault(FaultCause::RolledBack, &err, self.backend);
        err
    }
}

async fn execute_checkpoint(conn: &DatabaseConnection) -> Result<(), DbErr> {
    use sea_orm::ConnectionTrait;
    conn.execute_unprepared("PRAGMA wal_checkpoint(TRUNCATE)")
        .await
        .map(drop)
}

/// Logs a failed database call at `WARN`, or at `DEBUG` when it is a fault:
/// the writer reports those once per episode (decision 0076).
pub fn log_failure(err: &DbErr, what: &str) {
    if fault_cause(err).is_some() {
        tracing::debug!(error = %err, "{what}");
    } else {
        tracing::warn!(error = %err, "{what}");
    }
}

/// A write transaction begun by the [`Writer`]; derefs to the sea-orm
/// transaction its statements run on. Finish it with [`WriteTxn::commit`]
/// or [`WriteTxn::rollback`]; dropped unfinished it is rolled back.
#[derive(Debug)]
pub struct WriteTxn {
    txn: DatabaseTransaction,
    writer: Writer,
    /// The commit and update hooks' counts when it began.
    commits: u64,
    changes: u64,
    unfinished: Unfinished,
}

/// Watches a [`WriteTxn`] dropped unfinished (a cancelled future).
#[derive(Debug)]
struct Unfinished {
    health: Arc<WriterHealth>,
    /// The rollback hook's count when the transaction began.
    rollbacks: u64,
    armed: bool,
}

impl Unfinished {
    fn intact(&self) -> bool {
        self.health.rollbacks() == self.rollbacks
    }
}

impl Drop for Unfinished {
    /// sea-orm queues the `ROLLBACK` of a dropped transaction; if SQLite
    /// already rolled it back, that fails, so the connection is replaced.
    fn drop(&mut self) {
        if self.armed && !self.intact() {
            self.health.replace.store(true, Ordering::Release);
        }
    }
}

impl Deref for WriteTxn {
    type Target = DatabaseTransaction;

    fn deref(&self) -> &DatabaseTransaction {
        &self.txn
    }
}

impl WriteTxn {
    /// False once SQLite rolled the transaction back by itself (always true
    /// on PostgreSQL, which says so at the next statement or `COMMIT`).
    pub fn intact(&self) -> bool {
        self.unfinished.intact()
    }

    /// Commits; `Ok` only when the database confirmed this transaction's
    /// commit (SQLite: the commit hook ran once and no rollback since
    /// `BEGIN`). `Err` is a fault: a transaction found rolled back is not
    /// written; a failed `COMMIT` may have committed (unknown outcome).
    pub async fn commit(self) -> Result<(), DbErr> {
        let WriteTxn {
            txn,
            writer,
            commits,
            changes,
            mut unfinished,
        } = self;
        unfinished.armed = false;
        if !unfinished.intact() {
            writer.health.replace.store(true, Ordering::Release);
            drop(txn);
            return Err(writer.rolled_back("found before its COMMIT"));
        }
        if let Err(err) = txn.commit().await {
            return Err(writer.fault(err));
        }
        if writer.backend == DbBackend::Sqlite
            && (writer.health.commits() != commits + 1 || !unfinished.intact())
        {
            return Err(writer.rolled_back("its COMMIT committed nothing"));
        }
        if writer.backend != DbBackend::Sqlite || writer.health.changes() != changes {
            writer.health.committed();
        }
        writer.keep_headroom().await;
        Ok(())
    }

    /// Rolls back; a failed `ROLLBACK` is a fault.
    pub async fn rollback(self) -> Result<(), DbErr> {
        self.abort(None).await;
        Ok(())
    }

    /// Rolls back after its body failed with `cause` (a fault, if it is
    /// one, replaces the connection); a failed `ROLLBACK` is a fault too.
    pub(super) async fn abort(self, cause: Option<&DbErr>) {
        let WriteTxn {
            txn,
            writer,
            mut unfinished,
            ..
        } = self;
        unfinished.armed = false;
        if let Some(cause) = cause
            && let Some(kind) = fault_cause(cause)
        {
            writer.health.fault(kind, cause, writer.backend);
        }
        if !unfinished.intact() {
            // Nothing to roll back: SQLite did. The driver still counts the
            // transaction open, so this connection goes.
            writer.health.replace.store(true, Ordering::Release);
            drop(txn);
            return;
        }
        if let Err(err) = txn.rollback().await {
            writer.health.replace.store(true, Ordering::Release);
            writer.fault(err);
        }
    }
}

#[cfg(test)]
mod tests {
    use sea_orm::{ConnectionTrait, Statement};

    use crate::config::DatabaseSettings;
    use crate::store::{Database, execute_unprepared};

    use super::*;

    async fn database(dir: &tempfile::TempDir) -> Database {
        let url = format!("sqlite://{}?mode=rwc", dir.path().join("w.db").display());
        let db = Database::connect(&DatabaseSettings {
            url,
            max_connections: 2,
        })
        .await
        .unwrap();
        db.write_alone::<_, DbErr, _>(async |txn| {
            execute_unprepared(txn, "CREATE TABLE t (v TEXT NOT NULL UNIQUE)").await
        })
        .await
        .unwrap();
        db
    }

    async fn count(db: &Database) -> i64 {
        db.reader()
            .query_one_raw(Statement::from_string(
                DbBackend::Sqlite,
                "SELECT COUNT(*) FROM t",
            ))
            .await
            .unwrap()
            .unwrap()
            .try_get_by_index(0)
            .unwrap()
    }

    /// A row of `n` KiB (enough to need new pages).
    fn insert(n: usize) -> String {
        format!(
            "INSERT INTO t (v) VALUES ('{}{}')",
            crate::domain::random_hex_id(),
            "x".repeat(n << 10)
        )
    }

    #[tokio::test]
    async fn a_transaction_that_writes_nothing_still_counts_as_committed() {
        let dir = tempfile::tempdir().unwrap();
        let db = database(&dir).await;
        for _ in 0..3 {
            db.write_alone::<_, DbErr, _>(async |_| Ok(()))
                .await
                .unwrap();
        }
        assert!(!db.refusing_writes());
    }

    #[tokio::test]
    async fn a_constraint_violation_is_the_datas_rule_and_leaves_the_connection_trusted() {
        let dir = tempfile::tempdir().unwrap();
        let db = database(&dir).await;
        execute_unprepared(db.writer.connection(), "INSERT INTO t (v) VALUES ('a')")
            .await
            .unwrap();
        let err = db
            .write_alone::<(), DbErr, _>(async |txn| {
                execute_unprepared(txn, "INSERT INTO t (v) VALUES ('a')").await
            })
            .await
            .unwrap_err();
        assert_eq!(fault_cause(&err), None, "{err}");
        assert!(!db.refusing_writes());
        assert_eq!(db.writer_stats().connections_replaced, 0);
    }

    #[tokio::test]
    async fn a_full_database_fails_the_write_replaces_the_connection_and_the_next_commit_ends_the_episode()
     {
        let dir = tempfile::tempdir().unwrap();
        let db = database(&dir).await;
        let pages: i64 = db
            .reader()
            .query_one_raw(Statement::from_string(
                DbBackend::Sqlite,
                "SELECT page_count FROM pragma_page_count()",
            ))
            .await
            .unwrap()
            .unwrap()
            .try_get_by_index(0)
            .unwrap();
        db.writer
            .health()
            .set_max_page_count(Some(pages as u64 + 2));
        let full = db
            .write_alone::<(), DbErr, _>(async |txn| {
                for _ in 0..8 {
                    execute_unprepared(txn, &insert(8)).await?;
                }
                Ok(())
            })
            .await
            .unwrap_err();
        assert_eq!(fault_cause(&full), Some(FaultCause::DiskFull), "{full}");
        assert!(db.refusing_writes());
        assert_eq!(count(&db).await, 0, "nothing of the failed write");
        // A commit that changed nothing may not have touched the disk: it
        // does not end the episode.
        db.write_alone::<_, DbErr, _>(async |_| Ok(()))
            .await
            .unwrap();
        assert!(db.refusing_writes(), "an empty commit ended the episode");
        // Still full: a small write that needs no new page may commit, one
        // that needs pages fails again, on a new connection each time.
        assert!(
            db.write_alone::<(), DbErr, _>(async |txn| execute_unprepared(txn, &insert(64)).await)
                .await
                .is_err()
        );
        db.writer.health().set_max_page_count(None);
        db.write_alone::<(), DbErr, _>(async |txn| execute_unprepared(txn, &insert(64)).await)
            .await
            .unwrap();
        assert!(!db.refusing_writes(), "the commit ended the episode");
        assert_eq!(count(&db).await, 1);
        let stats = db.writer_stats();
        assert!(stats.connections_replaced >= 2, "{stats:?}");
        let full = stats
            .faults
            .iter()
            .find(|(c, _)| *c == FaultCause::DiskFull)
            .map(|(_, n)| *n);
        assert_eq!(full, Some(2), "{stats:?}");
    }
}
