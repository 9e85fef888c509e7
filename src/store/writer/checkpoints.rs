//! Background checkpoints of an SQLite WAL (decision 0096). SQLite's own
//! checkpoint runs inside the `COMMIT` that crosses `wal_autocheckpoint`:
//! that commit, and every write queued behind it, waits while the WAL's
//! pages are copied into the database and the database is synced. Here a
//! connection of its own copies them in the background (`PASSIVE`: it
//! takes no lock a writer needs), on a blocking thread, whenever the
//! rounds have committed [`BACKGROUND_FRAMES`] frames since the last one;
//! the autocheckpoint after `COMMIT` then finds little left to copy. The
//! frames are counted, not read off the WAL file's size: a WAL restarted
//! from its first frame keeps its size, and a checkpoint per commit would
//! double the fsyncs (decision 0107).

use std::sync::{
    Mutex, PoisonError,
    atomic::{AtomicBool, AtomicU64, Ordering},
};

use super::RoundSettings;

/// WAL frames committed since the last background checkpoint after which
/// another starts: 1 MiB of 4 KiB pages, about a dozen results paced one
/// per commit. Each checkpoint's fsync of the database flushes at most
/// that much beside the commits' fsyncs; 2,048 frames measured a worse
/// paced p99 and no better throughput (decision 0107).
pub(super) const BACKGROUND_FRAMES: u64 = 256;

/// One `PASSIVE` checkpoint on `conn`: the frames the WAL held (`None`
/// when SQLite answered -1: another connection was checkpointing).
pub(super) fn passive(conn: &rusqlite::Connection) -> rusqlite::Result<Option<u64>> {
    // (busy, frames in the WAL, frames copied)
    conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |row| {
        row.get::<_, i64>(1)
    })
    .map(|frames| u64::try_from(frames).ok())
}

/// The background checkpoints of one SQLite file.
#[derive(Debug)]
pub(super) struct Checkpoints {
    settings: RoundSettings,
    conn: Mutex<Option<Connection>>,
    running: AtomicBool,
    /// The frames the WAL held when the last background checkpoint ran
    /// (0 before the first, and once the WAL restarted).
    copied: AtomicU64,
    /// Background checkpoints started.
    started: AtomicU64,
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
            copied: AtomicU64::new(0),
            started: AtomicU64::new(0),
        }
    }

    /// After a commit that left `frames` in the WAL: starts a checkpoint on
    /// a blocking thread when [`BACKGROUND_FRAMES`] were committed since
    /// the last one and none runs. Never waits.
    pub(super) fn after_commit(self: &std::sync::Arc<Self>, frames: u64) {
        let mut copied = self.copied.load(Ordering::Acquire);
        if frames < copied {
            // The WAL restarted from its first frame since.
            copied = 0;
            self.copied.store(0, Ordering::Release);
        }
        if frames.saturating_sub(copied) < BACKGROUND_FRAMES
            || self.running.swap(true, Ordering::AcqRel)
        {
            return;
        }
        self.started.fetch_add(1, Ordering::Relaxed);
        let this = self.clone();
        tokio::task::spawn_blocking(move || {
            // One that failed or found the checkpoint lock taken counts as
            // having copied what it saw, so the next waits as long as after
            // a success instead of coming with every commit.
            let copied = this.checkpoint().unwrap_or(frames);
            this.copied.store(copied, Ordering::Release);
            this.running.store(false, Ordering::Release);
        });
    }

    /// Background checkpoints started so far.
    #[cfg(test)]
    pub(super) fn started(&self) -> u64 {
        self.started.load(Ordering::Relaxed)
    }

    /// One `PASSIVE` checkpoint: the frames the WAL held (`None` when it
    /// failed, or found another connection checkpointing and SQLite
    /// answered -1). A failure drops the connection (the next opens
    /// another) and is left to the autocheckpoint.
    fn checkpoint(&self) -> Option<u64> {
        let mut conn = self.conn.lock().unwrap_or_else(PoisonError::into_inner);
        if conn.is_none() {
            match self.open() {
                Ok(opened) => *conn = Some(Connection(opened)),
                Err(err) => {
                    tracing::debug!(error = %err, "cannot open the checkpoint connection");
                    return None;
                }
            }
        }
        let Connection(c) = conn.as_ref()?;
        match passive(c) {
            Ok(frames) => frames,
            Err(err) => {
                tracing::debug!(error = %err, "background WAL checkpoint failed");
                *conn = None;
                None
            }
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
