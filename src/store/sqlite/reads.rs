//! Reads on the calling thread (decision 0099). A read through the sqlx
//! pool hands its statement to a worker thread of the pool and waits to
//! be woken with the answer: at 1,000 publishes/s, the bearer token's
//! lookup that way cost about 0.1 ms of CPU per publish and two thread
//! switches on its path. A read that needs one indexed row runs here
//! instead, in place, on a connection of a small set kept for it; in WAL
//! mode it takes no lock a writer needs and waits for none, so it cannot
//! block the thread behind a write.
//!
//! Each statement reads the last committed state: no cache, so a
//! credential revoked by another process (`orbit-events credential
//! revoke`) is refused at its next request, as before.

use std::{
    path::PathBuf,
    sync::{Mutex, PoisonError},
};

use rusqlite::{Connection, OpenFlags, OptionalExtension};

use crate::store::{StoreError, writer::sqlite_error};

/// The credential whose token has the digest `?1` (revoked or not: the
/// caller decides).
pub const PRINCIPAL: &str = "SELECT id, namespace_id, application_id, token_digest, permissions, \
     queue_scope, revoked_at, created_at FROM credentials WHERE token_digest = ?1";

/// Idle connections kept; more callers at once open more and close the
/// surplus when they finish.
const KEPT: usize = 4;

/// The in-place read connections of one SQLite file.
#[derive(Debug)]
pub(crate) struct Readers {
    path: PathBuf,
    idle: Mutex<Vec<Reader>>,
}

/// A rusqlite connection is not `Debug`.
struct Reader(Connection);

impl std::fmt::Debug for Reader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Reader")
    }
}

impl Readers {
    pub(crate) fn new(path: PathBuf) -> Readers {
        Readers {
            path,
            idle: Mutex::new(Vec::new()),
        }
    }

    /// Runs `read` on an idle connection (or a new one). `Err` when the
    /// file could not be opened or the read failed, for instance `BUSY`
    /// while a writer resets the WAL: the caller then reads through the
    /// pool, which waits as long as it must. A connection whose read failed
    /// is dropped.
    pub(crate) fn run<T>(
        &self,
        read: impl FnOnce(&Connection) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let idle = self.take();
        let conn = match idle {
            Some(conn) => conn,
            None => Reader(self.open().map_err(sqlite_error)?),
        };
        let answer = read(&conn.0)?;
        let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        if idle.len() < KEPT {
            idle.push(conn);
        }
        Ok(answer)
    }

    fn take(&self) -> Option<Reader> {
        self.idle
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pop()
    }

    /// `query_only`: these connections never write. No busy timeout: a
    /// read that would wait is read through the pool instead of holding
    /// the caller's thread.
    fn open(&self) -> rusqlite::Result<Connection> {
        let conn = Connection::open_with_flags(
            &self.path,
            OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )?;
        conn.busy_timeout(std::time::Duration::ZERO)?;
        conn.execute_batch("PRAGMA query_only = 1")?;
        Ok(conn)
    }
}

/// The credential of [`PRINCIPAL`], as the entity the pool would read.
pub(crate) fn credential_by_token_digest(
    conn: &Connection,
    digest: &str,
) -> Result<Option<entity::credential::Model>, StoreError> {
    let mut stmt = super::prepared(conn, PRINCIPAL)?;
    stmt.query_row([digest], |row| {
        Ok(entity::credential::Model {
            id: row.get(0)?,
            namespace_id: row.get(1)?,
            application_id: row.get(2)?,
            token_digest: row.get(3)?,
            permissions: row.get(4)?,
            queue_scope: row.get(5)?,
            revoked_at: row.get(6)?,
            created_at: row.get(7)?,
        })
    })
    .optional()
    .map_err(sqlite_error)
}
