//! When a write connection is trusted: the faults that end its trust, the
//! SQLite hooks that confirm a commit, and the episode of refused writes
//! (decision 0076).

use std::{
    sync::{
        Arc, Mutex, PoisonError,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use sea_orm::{DbBackend, DbErr, RuntimeErr, sqlx};

use crate::store::StoreError;

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
            if db.try_downcast_ref::<sqlx::sqlite::SqliteError>().is_some()
                || db
                    .try_downcast_ref::<super::direct::DirectError>()
                    .is_some()
            {
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
    /// SQLite: what the hooks of the sqlx write connection counted, and
    /// those of the write rounds' own connection (decision 0090); each
    /// transaction is confirmed against its own connection's counts only,
    /// since the other's hooks may still run for a transaction it ended.
    pub(super) pool: Hooks,
    pub(super) rounds: Hooks,
    /// SQLite: checkpoint the WAL before the next write (after a full disk).
    pub(super) checkpoint_wanted: AtomicBool,
    /// When the WAL's headroom was last checked (µs since `born`).
    pub(super) headroom_checked: AtomicU64,
    /// SQLite: close the write connection when it is next released or
    /// acquired, and open a new one.
    pub(super) replace: AtomicBool,
    pub(super) replaced: AtomicU64,
    pub(super) faults: [AtomicU64; FaultCause::ALL.len()],
    episode: Mutex<Option<Episode>>,
    /// When `/readyz` last tried a write during an episode.
    last_probe: Mutex<Option<Instant>>,
    /// SQLite: `PRAGMA max_page_count` for new write connections (0: none;
    /// a test hook that makes the database full).
    pub(super) max_page_count: AtomicU64,
    /// SQLite: counts the faults (and test hooks) after which no write
    /// connection opened before is trusted; the rounds' connection
    /// remembers the generation it was opened in (decision 0090).
    generation: AtomicU64,
}

/// SQLite: transactions one write connection committed, and rolled back
/// (its commit and rollback hooks), and rows it changed (its update hook).
#[derive(Debug, Default)]
pub(super) struct Hooks {
    pub(super) commits: AtomicU64,
    pub(super) rollbacks: AtomicU64,
    pub(super) changes: AtomicU64,
}

impl Hooks {
    pub(super) fn commits(&self) -> u64 {
        self.commits.load(Ordering::Acquire)
    }

    pub(super) fn rollbacks(&self) -> u64 {
        self.rollbacks.load(Ordering::Acquire)
    }

    pub(super) fn changes(&self) -> u64 {
        self.changes.load(Ordering::Acquire)
    }
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
    /// The hook counts of the rounds' connection (`rounds`) or of sqlx's.
    pub(super) fn hooks(&self, rounds: bool) -> &Hooks {
        if rounds { &self.rounds } else { &self.pool }
    }

    pub(super) fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// Records a fault: the connection is replaced (SQLite), the episode
    /// opens (logged once) or counts one more.
    pub(crate) fn fault(&self, cause: FaultCause, err: &StoreError, backend: DbBackend) {
        if backend == DbBackend::Sqlite {
            self.replace.store(true, Ordering::Release);
            self.generation.fetch_add(1, Ordering::AcqRel);
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
    pub(super) fn committed(&self) {
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
    pub(crate) fn probe_due(&self, every: Duration) -> bool {
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

    #[cfg(any(test, feature = "test-hooks"))]
    /// Test hook: new write connections get `PRAGMA max_page_count = n`
    /// (`None`: no limit), and the current one is replaced.
    pub(crate) fn set_max_page_count(&self, n: Option<u64>) {
        self.max_page_count.store(n.unwrap_or(0), Ordering::Release);
        self.replace.store(true, Ordering::Release);
        self.generation.fetch_add(1, Ordering::AcqRel);
    }

    /// The pool callbacks of SQLite's write connection: hooks on every new
    /// connection; a connection to be replaced, or one the driver still
    /// counts inside a transaction, is closed instead of handed out again.
    pub(crate) fn sqlite_pool(
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
                        commits.pool.commits.fetch_add(1, Ordering::AcqRel);
                        true
                    });
                    let rollbacks = health.clone();
                    handle.set_rollback_hook(move || {
                        rollbacks.pool.rollbacks.fetch_add(1, Ordering::AcqRel);
                    });
                    let changes = health.clone();
                    handle.set_update_hook(move |_| {
                        changes.pool.changes.fetch_add(1, Ordering::AcqRel);
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
    pub(super) fn take_replace(&self) -> bool {
        let replace = self.replace.swap(false, Ordering::AcqRel);
        if replace {
            self.replaced.fetch_add(1, Ordering::Relaxed);
        }
        replace
    }
}
