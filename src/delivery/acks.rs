//! The node's ACK batcher: group commit of ACKs (decision 0060).
//!
//! Connections hand each `event.ack` to one task per node. It takes every
//! ACK waiting, runs them as one transaction
//! ([`store::ack::acknowledge_batch`]) and answers each one after that
//! transaction committed; ACKs that arrive while every batch slot is busy
//! (two on SQLite, four on PostgreSQL) wait in the channel and form the
//! next batch. On SQLite a batch shares its transaction and commit with
//! the claims and materializations of the same write round (decision
//! 0068). Under load a commit (an fsync) serves many ACKs;
//! alone, an ACK goes through at once, as before. The reply to an ACK still
//! leaves only after its commit (delivery-model.md §6).

use sea_orm::{DbBackend, DbErr};

use crate::{
    delivery::group_commit::{BatchLimits, Batcher},
    store::{
        self, Database,
        ack::{AckOutcome, AckRequest},
    },
};

/// ACKs per transaction at most (a bound on the statement size: the batch
/// `UPDATE` carries two parameters per ACK, its audit insert ten).
pub const MAX_ACK_BATCH: usize = 512;

/// ACKs waiting for the batcher. Each connection has at most `read_queue`
/// ACKs in flight, so this is only reached with very many connections;
/// beyond it a connection waits (backpressure), nothing is dropped.
const CHANNEL: usize = 4096;

/// Handle of the node's ACK batcher (cheap to clone).
#[derive(Clone, Debug)]
pub struct AckBatcher {
    batcher: Batcher<AckRequest, Result<AckOutcome, DbErr>>,
}

impl AckBatcher {
    /// Starts the batcher as a task of the calling thread's actix/Tokio
    /// local task set; the node calls it on its delivery thread, so the
    /// batcher stops with the delivery actors.
    pub fn start(db: Database) -> AckBatcher {
        let limits = BatchLimits {
            slots: batches_in_flight(&db),
            max_batch: MAX_ACK_BATCH,
            channel: CHANNEL,
        };
        let batcher = Batcher::start(limits, move |requests: Vec<AckRequest>| {
            let db = db.clone();
            async move { acknowledge_each(&db, &requests).await }
        });
        AckBatcher { batcher }
    }

    /// Acknowledges one delivery; returns after the transaction holding
    /// this ACK committed (or failed: `Err`, nothing of it was written).
    pub async fn acknowledge(&self, request: AckRequest) -> Result<AckOutcome, DbErr> {
        self.batcher
            .submit(request)
            .await
            .unwrap_or_else(|| Err(DbErr::Custom("the ACK batcher has stopped".to_owned())))
    }
}

/// ACK batches in flight at once. SQLite: two; while one runs in a write
/// round, the ACKs that arrive meanwhile form the second, which joins the
/// same round if it is still open (decision 0068; four measured the same).
/// PostgreSQL: four batches commit side by side, so an ACK waits for a free
/// slot rather than for the batch ahead of it (rows are locked in id order:
/// batches never deadlock).
fn batches_in_flight(db: &Database) -> usize {
    match db.backend() {
        DbBackend::Postgres => 4,
        _ => 2,
    }
}

/// One outcome per request, in order. The batch runs as one transaction
/// ([`store::ack::acknowledge_batch`]); if that fails for a reason other
/// than the database being unreachable, each ACK is tried again alone, so
/// that one ACK the database rejects never fails the others that happened
/// to share its transaction (decision 0060). `Err` for a request: nothing
/// of it was written.
pub async fn acknowledge_each(
    db: &Database,
    requests: &[AckRequest],
) -> Vec<Result<AckOutcome, DbErr>> {
    let err = match store::ack::acknowledge_batch(db, requests).await {
        Ok(outcomes) => return outcomes.into_iter().map(Ok).collect(),
        Err(err) => err,
    };
    let unreachable = matches!(err, DbErr::ConnectionAcquire(_) | DbErr::Conn(_));
    if requests.len() == 1 || unreachable {
        store::writer::log_failure(
            &err,
            &format!("ACK batch of {} failed on the database", requests.len()),
        );
        let message = err.to_string();
        return requests
            .iter()
            .map(|_| Err(DbErr::Custom(message.clone())))
            .collect();
    }
    store::writer::log_failure(
        &err,
        &format!(
            "ACK batch of {} failed; acknowledging its ACKs one by one",
            requests.len()
        ),
    );
    let mut outcomes = Vec::with_capacity(requests.len());
    for request in requests {
        let outcome =
            store::ack::acknowledge(db, &request.subscription_id, &request.actor, &request.proof)
                .await;
        if let Err(err) = &outcome {
            store::writer::log_failure(err, "ACK failed on the database");
        }
        outcomes.push(outcome);
    }
    outcomes
}
