//! The writer: every write transaction of a node begins and ends here
//! (decision 0078 says how a hot write is committed, step by step). It
//! gathers requests into batches ([`GroupCommit`], [`batch_or_each`]),
//! shares SQLite's one writer among the writes that come together
//! (`round.rs`), runs a body again when it asks to, and answers only after
//! the database confirmed the commit; after a fault it stops trusting the
//! write connection and replaces it (decision 0076, `health.rs`).

use std::{
    sync::{Arc, PoisonError, atomic::Ordering},
    time::Instant,
};

use sea_orm::{
    DatabaseConnection, DbBackend, DbErr, RuntimeErr, SqliteTransactionMode, TransactionOptions,
    TransactionTrait,
};

mod batch;
mod checkpoints;
mod direct;
mod health;
pub mod queues;
pub(super) mod round;
mod txn;

pub use super::error::{StoreError, WriteError, log_failure};
pub use batch::{BatchLimits, GroupCommit, batch_or_each};
use direct::Direct;
pub(super) use direct::RoundSettings;
pub(crate) use direct::sqlite_error;
pub use health::{FaultCause, WriterHealth, WriterStats, fault_cause};
pub use txn::WriteTxn;
use txn::{Unfinished, execute_checkpoint};

/// The write connection(s) of a node: SQLite's single writer connection, or
/// PostgreSQL's pool; every write transaction begins here.
#[derive(Clone, Debug)]
pub struct Writer {
    conn: DatabaseConnection,
    backend: DbBackend,
    health: Arc<WriterHealth>,
    /// SQLite on a file: its WAL and folder.
    files: Option<Arc<WalFiles>>,
    /// SQLite on a file: the connection write rounds run on (decision
    /// 0090).
    rounds: Option<Arc<RoundConnection>>,
    /// SQLite on a file: its WAL's background checkpoints (decision 0096).
    checkpoints: Option<Arc<checkpoints::Checkpoints>>,
    /// SQLite: held by a write transaction from its `BEGIN` to its end, a
    /// round's or one through sqlx, so the two connections never contend
    /// for SQLite's one writer.
    turn: Arc<tokio::sync::Mutex<()>>,
}

/// The write rounds' own connection while no round uses it, with the
/// [`WriterHealth::generation`] it was opened in.
#[derive(Debug)]
pub(super) struct RoundConnection {
    settings: RoundSettings,
    idle: std::sync::Mutex<Option<(u64, IdleConnection)>>,
}

/// A rusqlite connection is not `Debug`.
pub(super) struct IdleConnection(rusqlite::Connection);

impl std::fmt::Debug for IdleConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("IdleConnection")
    }
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
        rounds: Option<RoundSettings>,
    ) -> Writer {
        Writer {
            conn,
            backend,
            health,
            files: files.map(Arc::new),
            checkpoints: rounds
                .clone()
                .map(|settings| Arc::new(checkpoints::Checkpoints::new(settings))),
            rounds: rounds.map(|settings| {
                Arc::new(RoundConnection {
                    settings,
                    idle: std::sync::Mutex::new(None),
                })
            }),
            turn: Arc::default(),
        }
    }

    /// SQLite: waits for the writer's turn (see [`Writer::turn`]).
    pub(super) async fn take_turn(&self) -> tokio::sync::OwnedMutexGuard<()> {
        self.turn.clone().lock_owned().await
    }

    /// SQLite on a file: the rounds' connection and the generation it
    /// belongs to; a new one when there is none, or when a fault since it
    /// was opened ended its trust (decision 0076). `None`: rounds run
    /// through sqlx (an in-memory database). Failing to open is a fault.
    pub(super) async fn round_connection(&self) -> Option<Result<(u64, Direct), StoreError>> {
        let rounds = self.rounds.as_ref()?;
        let generation = self.health.generation();
        let idle = rounds
            .idle
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        match idle {
            Some((opened, conn)) if opened == generation => {
                return Some(Ok((generation, Direct::new(conn.0, &rounds.settings))));
            }
            Some(_) => self.round_connection_lost(),
            None => {}
        }
        // Opening may wait for a lock (the busy timeout): not on this thread.
        let (settings, health) = (rounds.settings.clone(), self.health.clone());
        let opened = tokio::task::spawn_blocking(move || direct::open(&settings, &health))
            .await
            .unwrap_or_else(|err| {
                Err(DbErr::Conn(RuntimeErr::Internal(format!(
                    "the thread opening the rounds' connection failed: {err}"
                ))))
            });
        Some(
            opened
                .map(|conn| (generation, Direct::new(conn, &rounds.settings)))
                .map_err(|err| self.fault(err)),
        )
    }

    /// Keeps a round's connection for the next round, unless a fault
    /// since `generation` ended its trust (it is dropped: closed).
    pub(super) fn keep_round_connection(&self, generation: u64, conn: rusqlite::Connection) {
        match &self.rounds {
            Some(rounds) if generation == self.health.generation() => {
                *rounds.idle.lock().unwrap_or_else(PoisonError::into_inner) =
                    Some((generation, IdleConnection(conn)));
            }
            _ => self.round_connection_lost(),
        }
    }

    /// A round's connection was dropped (a fault, or it could not be left
    /// outside a transaction): the next round opens another.
    pub(super) fn round_connection_lost(&self) {
        self.health.replaced.fetch_add(1, Ordering::Relaxed);
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

    /// SQLite on a file, after a round committed and left `frames` in the
    /// WAL: a checkpoint in the background when the WAL has grown
    /// (decisions 0096, 0107).
    pub(super) fn checkpoint_in_background(&self, frames: u64) {
        if let Some(checkpoints) = &self.checkpoints {
            checkpoints.after_commit(frames);
        }
    }

    /// Background checkpoints started so far.
    #[cfg(test)]
    pub(super) fn background_checkpoints(&self) -> u64 {
        self.checkpoints
            .as_ref()
            .map_or(0, |checkpoints| checkpoints.started())
    }

    pub(super) fn connection(&self) -> &DatabaseConnection {
        &self.conn
    }

    pub fn health(&self) -> &WriterHealth {
        &self.health
    }

    /// Begins a write transaction (`BEGIN IMMEDIATE` on SQLite). A failed
    /// `BEGIN` is a fault.
    pub async fn begin(&self) -> Result<WriteTxn, StoreError> {
        let turn = match self.backend {
            DbBackend::Sqlite => Some(self.take_turn().await),
            _ => None,
        };
        if self.health.checkpoint_wanted.load(Ordering::Acquire) {
            self.keep_headroom().await;
        }
        self.begin_on(&self.conn, None, turn).await
    }

    /// [`Writer::begin`] for a round that holds the turn already.
    pub(super) async fn begin_in_turn(&self) -> Result<WriteTxn, StoreError> {
        self.begin_on(&self.conn, None, None).await
    }

    /// Begins a write round's transaction (`BEGIN IMMEDIATE`) on `direct`,
    /// the runner over the rounds' connection; its statements run in place.
    /// A failed `BEGIN` is a fault.
    pub(super) async fn begin_direct(&self, direct: &Direct) -> Result<WriteTxn, StoreError> {
        direct.begin().await.map_err(|err| self.fault(err))?;
        let conn: DatabaseConnection = sea_orm::DatabaseConnectionType::MockDatabaseConnection(
            Arc::new(sea_orm::MockDatabaseConnection::new(direct.clone())),
        )
        .into();
        let txn = self.begin_on(&conn, Some(direct.clone()), None).await?;
        match direct.take_failure() {
            Some(err) => Err(self.fault(err)),
            None => Ok(txn),
        }
    }

    async fn begin_on(
        &self,
        conn: &DatabaseConnection,
        direct: Option<Direct>,
        turn: Option<tokio::sync::OwnedMutexGuard<()>>,
    ) -> Result<WriteTxn, StoreError> {
        let rounds = direct.is_some();
        let begun = conn
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
                commits: self.health.hooks(rounds).commits(),
                changes: self.health.hooks(rounds).changes(),
                unfinished: Unfinished {
                    health: self.health.clone(),
                    rollbacks: self.health.hooks(rounds).rollbacks(),
                    rounds,
                    armed: true,
                },
                writer: self.clone(),
                direct,
                _turn: turn,
            }),
            Err(err) => Err(self.fault(err)),
        }
    }

    /// Runs `body` in a write transaction of its own and returns its answer
    /// once that transaction committed; `Err`: nothing of `body` was written
    /// (its own error, or the fault of `BEGIN`/`COMMIT`; a failed `COMMIT`
    /// may still have committed, as when the process dies there). `body`
    /// runs once.
    pub async fn write_alone<T, E, F>(&self, body: F) -> Result<T, E>
    where
        E: WriteError,
        F: for<'t> AsyncFnOnce(&'t WriteTxn) -> Result<T, E>,
    {
        let txn = self.begin().await?;
        match body(&txn).await {
            Ok(answer) => {
                txn.commit().await?;
                Ok(answer)
            }
            Err(err) => {
                txn.abort(err.store_error()).await;
                Err(err)
            }
        }
    }

    /// As [`Writer::write_alone`], but `body` runs again, in a new
    /// transaction, when it asks to ([`WriteError::again`]) or PostgreSQL
    /// aborted it to resolve a deadlock or serialization conflict, at most
    /// [`ATTEMPTS`] times.
    pub async fn write_again<T, E, F>(&self, mut body: F) -> Result<T, E>
    where
        E: WriteError,
        F: for<'t> AsyncFnMut(&'t WriteTxn) -> Result<T, E>,
    {
        let mut attempt = 1;
        loop {
            match self.write_alone(async |txn| body(txn).await).await {
                Err(err) if attempt < ATTEMPTS && runs_again(&err) => attempt += 1,
                done => return done,
            }
        }
    }

    /// PostgreSQL: runs `body`, which sends exactly one statement, outside
    /// any explicit transaction, so that the server runs it in a
    /// transaction of its own and commits it when it ends: one round trip
    /// instead of `BEGIN`, the statement and `COMMIT` (decision 0109). Its
    /// answer is returned only after that commit: the server sends
    /// `ReadyForQuery` after committing (after the WAL flush, with
    /// `synchronous_commit = on`), an error of the commit after the rows,
    /// and the driver ends the statement's rows only there. A fault is
    /// recorded as a transaction's is; `body` runs again when PostgreSQL
    /// aborted it for a deadlock or a serialization conflict, at most
    /// [`ATTEMPTS`] times. `Err`: nothing was written, or (a connection lost
    /// at the end) as for a `COMMIT` whose answer was lost.
    pub async fn write_statement<T, F>(&self, mut body: F) -> Result<T, StoreError>
    where
        F: for<'c> AsyncFnMut(&'c DatabaseConnection) -> Result<T, StoreError>,
    {
        let mut attempt = 1;
        loop {
            match body(&self.conn).await {
                Ok(answer) => {
                    self.health.committed();
                    return Ok(answer);
                }
                Err(err) if attempt < ATTEMPTS && is_transient(&err) => attempt += 1,
                Err(err) => {
                    self.record(&err);
                    return Err(err);
                }
            }
        }
    }

    /// Records `err` (a failed `BEGIN`, `COMMIT` or `ROLLBACK`) as a fault
    /// if it is one; returns it.
    pub(super) fn fault(&self, err: DbErr) -> StoreError {
        let err = StoreError::from(err);
        self.record(&err);
        err
    }

    /// Records `err` as a fault if it is one.
    pub(super) fn record(&self, err: &StoreError) {
        if let Some(cause) = err.fault() {
            self.health.fault(cause, err, self.backend);
        }
    }

    fn rolled_back(&self, what: &'static str) -> StoreError {
        let err = StoreError::RolledBack(what);
        self.record(&err);
        err
    }
}

/// Attempts of one write at most (see [`Writer::write_alone`]).
pub const ATTEMPTS: usize = 8;

/// Whether a failed write runs again: its body asked to, or PostgreSQL
/// aborted it to resolve a deadlock or a serialization conflict (class 40;
/// rows are locked in id order, so this is rare).
pub(crate) fn runs_again<E: WriteError>(err: &E) -> bool {
    err.again() || err.store_error().is_some_and(is_transient)
}

fn is_transient(err: &StoreError) -> bool {
    use sea_orm::sqlx;
    let Some(DbErr::Exec(RuntimeErr::SqlxError(e)) | DbErr::Query(RuntimeErr::SqlxError(e))) =
        err.database()
    else {
        return false;
    };
    matches!(&**e, sqlx::Error::Database(db)
        if db.try_downcast_ref::<sqlx::postgres::PgDatabaseError>().is_some()
            && db.code().is_some_and(|c| c.starts_with("40")))
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
        db.write_alone::<_, StoreError, _>(async |txn| {
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
            db.write_alone::<_, StoreError, _>(async |_| Ok(()))
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
            .write_alone::<(), StoreError, _>(async |txn| {
                execute_unprepared(txn, "INSERT INTO t (v) VALUES ('a')").await
            })
            .await
            .unwrap_err();
        assert_eq!(err.fault(), None, "{err}");
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
            .write_alone::<(), StoreError, _>(async |txn| {
                for _ in 0..8 {
                    execute_unprepared(txn, &insert(8)).await?;
                }
                Ok(())
            })
            .await
            .unwrap_err();
        assert_eq!(full.fault(), Some(FaultCause::DiskFull), "{full}");
        assert!(db.refusing_writes());
        assert_eq!(count(&db).await, 0, "nothing of the failed write");
        // A commit that changed nothing may not have touched the disk: it
        // does not end the episode.
        db.write_alone::<_, StoreError, _>(async |_| Ok(()))
            .await
            .unwrap();
        assert!(db.refusing_writes(), "an empty commit ended the episode");
        // Still full: a small write that needs no new page may commit, one
        // that needs pages fails again, on a new connection each time.
        assert!(
            db.write_alone::<(), StoreError, _>(
                async |txn| execute_unprepared(txn, &insert(64)).await
            )
            .await
            .is_err()
        );
        db.writer.health().set_max_page_count(None);
        db.write_alone::<(), StoreError, _>(async |txn| execute_unprepared(txn, &insert(64)).await)
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
