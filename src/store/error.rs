//! The store's error: a database error that keeps its cause, or one of the
//! store's own conditions. It reaches the edge once, where `crate::error`
//! maps it to `UNAVAILABLE` (decision 0076 for which database errors are
//! faults).

use std::borrow::Cow;

use sea_orm::DbErr;

use super::writer::{FaultCause, fault_cause};

/// Why a store call failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    /// A database call failed; the cause is the driver's.
    #[error("database: {0}")]
    Database(#[from] DbErr),
    /// SQLite rolled the write back by itself, or its `COMMIT` committed
    /// nothing: nothing of it was written (a fault, decision 0076).
    #[error("the database rolled the write back by itself ({0}); nothing of it was written")]
    RolledBack(&'static str),
    /// Another member of the write round failed on its own rules; nothing
    /// of this one was written (it runs again alone).
    #[error("another write of the same transaction failed; nothing of this one was written")]
    Spoiled,
    /// The write round's driver stopped before its commit (its runtime went
    /// away: the node is stopping).
    #[error("the write round was abandoned before its commit")]
    Abandoned,
    /// The node is stopping: the write queues no longer take requests.
    #[error("the node is stopping")]
    Stopping,
    /// A request's deadline passed before its statement was sent (waiting
    /// for a connection): nothing was written (decision 0111).
    #[error("a request passed its deadline before its statement ran; nothing was written")]
    PastDeadline,
    /// The store found the database in a state its own rules exclude.
    #[error("{0}")]
    Invariant(Cow<'static, str>),
    /// The database URL, or its folder, cannot be used.
    #[error("{0}")]
    Config(String),
}

impl StoreError {
    /// A broken invariant of the store, named by `what`.
    pub fn invariant(what: impl Into<Cow<'static, str>>) -> StoreError {
        StoreError::Invariant(what.into())
    }

    /// The fault of the database this error is, if it is one: the write
    /// connection is not to be trusted after it, and every request of its
    /// transaction answers `UNAVAILABLE` (decision 0076).
    pub fn fault(&self) -> Option<FaultCause> {
        match self {
            StoreError::Database(err) => fault_cause(err),
            StoreError::RolledBack(_) => Some(FaultCause::RolledBack),
            StoreError::Abandoned => Some(FaultCause::Connection),
            _ => None,
        }
    }

    /// The database error inside, if any.
    pub fn database(&self) -> Option<&DbErr> {
        match self {
            StoreError::Database(err) => Some(err),
            _ => None,
        }
    }
}

/// A write body's error as the writer sees it (`E` of `Database::write`).
pub trait WriteError: From<StoreError> {
    /// The store error that made the body fail, if one did: a fault among
    /// them ends the write connection's trust.
    fn store_error(&self) -> Option<&StoreError>;

    /// True when the body's statements are to be rolled back and the body
    /// run again: what it read was changed meanwhile by someone else
    /// (bounded by the writer).
    fn again(&self) -> bool {
        false
    }
}

impl WriteError for StoreError {
    fn store_error(&self) -> Option<&StoreError> {
        Some(self)
    }
}

/// Logs a failed store call at `WARN`, or at `DEBUG` when it is a fault:
/// the writer reports those once per episode (decision 0076).
pub fn log_failure(err: &StoreError, what: &str) {
    if err.fault().is_some() {
        tracing::debug!(error = %err, "{what}");
    } else {
        tracing::warn!(error = %err, "{what}");
    }
}
