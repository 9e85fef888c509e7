//! A write transaction begun by the writer, and how it ends.

use std::{
    ops::Deref,
    sync::{Arc, atomic::Ordering},
};

use sea_orm::{DatabaseConnection, DatabaseTransaction, DbBackend, DbErr};

use super::{Writer, direct::Direct, health::WriterHealth};
use crate::store::StoreError;

pub(super) async fn execute_checkpoint(conn: &DatabaseConnection) -> Result<(), DbErr> {
    use sea_orm::ConnectionTrait;
    conn.execute_unprepared("PRAGMA wal_checkpoint(TRUNCATE)")
        .await
        .map(drop)
}

/// A write transaction begun by the [`Writer`]; derefs to the sea-orm
/// transaction its statements run on. Finish it with [`WriteTxn::commit`]
/// or [`WriteTxn::rollback`]; dropped unfinished it is rolled back.
#[derive(Debug)]
pub struct WriteTxn {
    pub(super) txn: DatabaseTransaction,
    pub(super) writer: Writer,
    /// The commit and update hooks' counts when it began.
    pub(super) commits: u64,
    pub(super) changes: u64,
    pub(super) unfinished: Unfinished,
    /// A write round's statement runner (SQLite), which keeps the failures
    /// of its `BEGIN`, `COMMIT` and `ROLLBACK`.
    pub(super) direct: Option<Direct>,
    /// SQLite: the writer's turn, held until the transaction ends.
    pub(super) _turn: Option<tokio::sync::OwnedMutexGuard<()>>,
}

/// Watches a [`WriteTxn`] dropped unfinished (a cancelled future).
#[derive(Debug)]
pub(super) struct Unfinished {
    pub(super) health: Arc<WriterHealth>,
    /// The rollback hook's count when the transaction began.
    pub(super) rollbacks: u64,
    /// On the rounds' connection: its hooks' counts, not sqlx's.
    pub(super) rounds: bool,
    pub(super) armed: bool,
}

impl Unfinished {
    fn intact(&self) -> bool {
        self.health.hooks(self.rounds).rollbacks() == self.rollbacks
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
    /// SQLite: runs `f` in place on the write round's connection, inside
    /// this transaction (decision 0095); `None` on PostgreSQL. Statements
    /// of `f` and those run through the sea-orm transaction interleave on
    /// one connection.
    pub fn sqlite<T>(
        &self,
        f: impl FnOnce(&rusqlite::Connection) -> Result<T, StoreError>,
    ) -> Option<Result<T, StoreError>> {
        self.direct.as_ref().map(|direct| direct.with_conn(f))
    }

    /// False once SQLite rolled the transaction back by itself (always true
    /// on PostgreSQL, which says so at the next statement or `COMMIT`).
    pub fn intact(&self) -> bool {
        self.unfinished.intact()
    }

    /// Commits; `Ok` only when the database confirmed this transaction's
    /// commit (SQLite: the commit hook ran once and no rollback since
    /// `BEGIN`). `Err` is a fault: a transaction found rolled back is not
    /// written; a failed `COMMIT` may have committed (unknown outcome).
    pub async fn commit(self) -> Result<(), StoreError> {
        let writer = self.writer.clone();
        // The turn is held until after the checkpoint below.
        let (txn, direct, _turn, confirming) = self.ready_to_commit()?.split();
        let (done, wal_frames) = match &direct {
            // A round's: `COMMIT` in place on the round's connection; its
            // mock transaction then ends with nothing left to do.
            Some(direct) => {
                let done = direct.commit();
                drop(txn);
                let frames = done.as_ref().ok().copied().flatten();
                (done.map(drop), frames)
            }
            None => (txn.commit().await, None),
        };
        confirming.confirm(done)?;
        if let Some(frames) = wal_frames {
            writer.checkpoint_in_background(frames);
        }
        // A round checks the headroom before its next `BEGIN` (`drive`), so
        // that its members are answered first.
        if direct.is_none() {
            writer.keep_headroom().await;
        }
        Ok(())
    }

    /// Its transaction, runner and turn, and what confirms its commit.
    fn split(
        self,
    ) -> (
        DatabaseTransaction,
        Option<Direct>,
        Option<tokio::sync::OwnedMutexGuard<()>>,
        Confirming,
    ) {
        let WriteTxn {
            txn,
            writer,
            commits,
            changes,
            unfinished,
            direct,
            _turn,
        } = self;
        let confirming = Confirming {
            writer,
            commits,
            changes,
            unfinished,
        };
        (txn, direct, _turn, confirming)
    }

    /// Before its `COMMIT`: `Err` (a fault) when SQLite already rolled it
    /// back by itself.
    fn ready_to_commit(mut self) -> Result<WriteTxn, StoreError> {
        if self.unfinished.intact() {
            return Ok(self);
        }
        self.unfinished.armed = false;
        self.writer.health.replace.store(true, Ordering::Release);
        let writer = self.writer.clone();
        drop(self);
        Err(writer.rolled_back("found before its COMMIT"))
    }

    /// Rolls back; a failed `ROLLBACK` is a fault.
    pub async fn rollback(self) -> Result<(), StoreError> {
        self.abort(None).await;
        Ok(())
    }

    /// Rolls back after its body failed with `cause` (a fault, if it is
    /// one, replaces the connection); a failed `ROLLBACK` is a fault too.
    pub(crate) async fn abort(self, cause: Option<&StoreError>) {
        let WriteTxn {
            txn,
            writer,
            mut unfinished,
            direct,
            ..
        } = self;
        unfinished.armed = false;
        if let Some(cause) = cause {
            writer.record(cause);
        }
        if !unfinished.intact() {
            // Nothing to roll back: SQLite did. The driver still counts the
            // transaction open, so this connection goes.
            writer.health.replace.store(true, Ordering::Release);
            drop(txn);
            return;
        }
        let failed = match txn.rollback().await {
            Err(err) => Some(err),
            Ok(()) => direct.as_ref().and_then(Direct::take_failure),
        };
        if let Some(err) = failed {
            writer.health.replace.store(true, Ordering::Release);
            writer.fault(err);
        }
    }
}

/// What confirms a commit once its `COMMIT` ran.
struct Confirming {
    writer: Writer,
    commits: u64,
    changes: u64,
    unfinished: Unfinished,
}

impl Confirming {
    fn confirm(mut self, done: Result<(), DbErr>) -> Result<(), StoreError> {
        let writer = &self.writer;
        self.unfinished.armed = false;
        if let Err(err) = done {
            return Err(writer.fault(err));
        }
        if writer.backend == DbBackend::Sqlite
            && (writer.health.hooks(self.unfinished.rounds).commits() != self.commits + 1
                || !self.unfinished.intact())
        {
            return Err(writer.rolled_back("its COMMIT committed nothing"));
        }
        if writer.backend != DbBackend::Sqlite
            || writer.health.hooks(self.unfinished.rounds).changes() != self.changes
        {
            writer.health.committed();
        }
        Ok(())
    }
}
