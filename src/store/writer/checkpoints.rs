//! Background checkpoints of an SQLite WAL (decision 0096). SQLite's own
//! checkpoint runs inside the `COMMIT` that crosses `wal_autocheckpoint`:
//! that commit, and every write queued behind it, waits while the WAL's
//! pages are copied into the database and the database is synced. Here a
//! connection of its own copies them in the background (`PASSIVE`: it
//! takes no lock a writer needs), on a blocking thread, whenever the WAL
//! has grown past [`BACKGROUND_AT`]; the autocheckpoint inside `COMMIT`
//! then finds little left to copy, and resets the WAL as before.

use std::sync::{
    Mutex, PoisonError,
    atomic::{AtomicBool, AtomicU64, Ordering},
};

use super::{RoundSettings, WalFiles};

/// WAL bytes after which a background checkpoint starts (a quarter of
/// the autocheckpoint's 32 MiB, decision 0067).
const BACKGROUND_AT: u64 = 8 << 20;
/// The WAL's size is looked at most this often (µs; one `stat`).
const LOOK_EVERY_US: u64 = 10_000;

/// The background checkpoints of one SQLite file.
#[derive(Debug)]
pub(super) struct Checkpoints {
    settings: RoundSettings,
    conn: Mutex<Option<Connection>>,
    running: AtomicBool,
    looked: AtomicU64,
}

/// A rusqlite connection is not `Debug`.
struct Connection(rusqlite::Connection);

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Connection")
    }
}

impl Checkpoints {
    pub(super) fn new(settings: RoundSettings) -> Checkpoints {
        Checkpoints {
            settings,
            conn: Mutex::new(None),
            running: AtomicBool::new(false),
            looked: AtomicU64::new(0),
        }
    }

    /// After a commit: starts a checkpoint on a blocking thread when the
    /// WAL has grown past [`BACKGROUND_AT`] and none runs. Never waits.
    pub(super) fn after_commit(self: &std::sync::Arc<Self>, files: &WalFiles) {
        let now = files.born.elapsed().as_micros() as u64;
        if now.saturating_sub(self.looked.load(Ordering::Relaxed)) < LOOK_EVERY_US
            || self.running.load(Ordering::Acquire)
        {
            return;
        }
        self.looked.store(now, Ordering::Relaxed);
        let wal = std::fs::metadata(&files.wal).map_or(0, |m| m.len());
        if wal < BACKGROUND_AT || self.running.swap(true, Ordering::AcqRel) {
            return;
        }
        let this = self.clone();
        tokio::task::spawn_blocking(move || {
            this.checkpoint();
            this.running.store(false, Ordering::Release);
        });
    }

    /// One `PASSIVE` checkpoint; a failure drops the connection (the next
    /// opens another) and is left to SQLite's own checkpoints.
    fn checkpoint(&self) {
        let mut conn = self.conn.lock().unwrap_or_else(PoisonError::into_inner);
        if conn.is_none() {
            match self.open() {
                Ok(opened) => *conn = Some(Connection(opened)),
                Err(err) => {
                    tracing::debug!(error = %err, "cannot open the checkpoint connection");
                    return;
                }
            }
        }
        let Some(Connection(c)) = conn.as_ref() else {
            return;
        };
        if let Err(err) = c.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(())) {
            tracing::debug!(error = %err, "background WAL checkpoint failed");
            *conn = None;
        }
    }

    /// A connection that syncs as the writer's do: with `synchronous=FULL`
    /// a checkpoint syncs the WAL before it copies and the database after.
    fn open(&self) -> rusqlite::Result<rusqlite::Connection> {
        use rusqlite::OpenFlags;
        let conn = rusqlite::Connection::open_with_flags(
            &self.settings.path,
            OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )?;
        conn.execute_batch(&format!(
            "PRAGMA synchronous = {}; PRAGMA wal_autocheckpoint = 0;",
            self.settings.synchronous
        ))?;
        Ok(conn)
    }
}
