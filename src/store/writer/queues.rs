//! The node's write queues for requests that come one at a time but commit
//! together: ACKs and publishes (decision 0078). Each is a [`GroupCommit`]
//! on the delivery thread whose batches run under [`batch_or_each`].

use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use sea_orm::DbBackend;

use super::batch::{BatchLimits, GroupCommit, Joined};
use crate::{
    domain::QueueId,
    error::{Error, Result},
    store::{
        Database, StoreError,
        ack::{self, AckOutcome, AckRequest},
        publish::{self, PublishRequest, Published},
    },
};

/// ACKs per transaction at most (a bound on the statement size: the batch
/// `UPDATE` carries two parameters per ACK).
pub const MAX_ACK_BATCH: usize = 512;

/// ACKs waiting for a batch. Each connection has at most its capacity of
/// ACKs waiting (protocol.md §3), so this is only reached with very many
/// connections; beyond it a connection waits (backpressure).
const ACK_CHANNEL: usize = 4096;

/// Publish requests per transaction at most.
const MAX_PUBLISH_BATCH: usize = 128;

/// Publish transactions at once, on both backends. Publishes to one queue
/// serialize on its counter row anyway: with several batches in flight on
/// PostgreSQL each paid its own commit behind that lock, while with one
/// every publish that waits joins the next batch (paced 1,000/s on
/// PostgreSQL: p99 1.9–2.3 s with four, 132–184 ms with one).
const PUBLISH_BATCHES_IN_FLIGHT: usize = 1;

/// Publish requests waiting beyond the running batch (backpressure past it).
const PUBLISH_CHANNEL: usize = 1024;

/// Told of every fresh publish: its queue, how many results it appended,
/// and whether that is [`AppendPhase::Written`] or
/// [`AppendPhase::Committed`] (the node wakes its scanner and counts them
/// here, so that a caller that stopped waiting loses neither).
pub type OnAppended = Arc<dyn Fn(&QueueId, u64, AppendPhase) + Send + Sync>;

/// When [`OnAppended`] hears of an append; `batch` numbers the publish
/// batch (per node, from 0), the same in both phases.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AppendPhase {
    /// Its statements ran in a transaction not yet committed (each time
    /// they run; the transaction may still roll back).
    Written { batch: u64 },
    /// Its transaction committed (once).
    Committed { batch: u64 },
}

/// The write queues of one node (cheap to clone).
#[derive(Clone, Debug)]
pub struct Queues {
    acks: GroupCommit<AckRequest, Result<AckOutcome, StoreError>>,
    publishes: GroupCommit<PublishRequest, Result<Published>>,
}

impl Queues {
    /// Starts both queues on the calling thread's local task set (the
    /// node's delivery thread, so they stop with the delivery actors).
    /// Idempotency records of fresh publishes expire after
    /// `idempotency_ttl`.
    pub fn start(db: Database, idempotency_ttl: Duration, on_appended: OnAppended) -> Queues {
        let acks = {
            let db = db.clone();
            GroupCommit::start(
                BatchLimits {
                    slots: ack_batches_in_flight(&db),
                    max_batch: MAX_ACK_BATCH,
                    channel: ACK_CHANNEL,
                },
                move |requests: Vec<AckRequest>| {
                    let db = db.clone();
                    async move { ack::acknowledge_each(&db, &requests).await }
                },
            )
        };
        let batches = Arc::new(AtomicU64::new(0));
        let publishes = GroupCommit::start(
            BatchLimits {
                slots: PUBLISH_BATCHES_IN_FLIGHT,
                max_batch: MAX_PUBLISH_BATCH,
                channel: PUBLISH_CHANNEL,
            },
            move |requests: Vec<PublishRequest>| {
                let (db, on_appended) = (db.clone(), on_appended.clone());
                let batch = batches.fetch_add(1, Ordering::Relaxed);
                async move {
                    let written = |queue_id: &QueueId, n: u64| {
                        on_appended(queue_id, n, AppendPhase::Written { batch });
                    };
                    let outcomes =
                        publish::publish_each(&db, &requests, idempotency_ttl, &written).await;
                    for (request, outcome) in requests.iter().zip(&outcomes) {
                        if let Ok(Published::Fresh(_)) = outcome {
                            let n = request.results.len() as u64;
                            on_appended(&request.queue_id, n, AppendPhase::Committed { batch });
                        }
                    }
                    outcomes
                }
            },
        );
        Queues { acks, publishes }
    }

    /// Hands one ACK to the group commit and returns once it has joined it
    /// (protocol.md §3: the read queue takes the next frame from then on);
    /// [`JoinedAck::outcome`] answers after the transaction holding it
    /// committed (or failed: nothing of it was written).
    pub async fn join_ack(&self, request: AckRequest) -> JoinedAck {
        JoinedAck(self.acks.join(request).await)
    }

    /// Publishes one request; answers after its commit.
    pub async fn publish(&self, request: PublishRequest) -> Result<Published> {
        self.publishes
            .submit(request)
            .await
            .unwrap_or_else(|| Err(Error::from(StoreError::Stopping)))
    }
}

/// An ACK in the group commit ([`Queues::join_ack`]).
pub struct JoinedAck(Option<Joined<Result<AckOutcome, StoreError>>>);

impl JoinedAck {
    /// The ACK's outcome, after its commit; `Stopping` when the node
    /// stopped first.
    pub async fn outcome(self) -> Result<AckOutcome, StoreError> {
        match self.0 {
            Some(joined) => joined.outcome().await.unwrap_or(Err(StoreError::Stopping)),
            None => Err(StoreError::Stopping),
        }
    }
}

/// ACK batches in flight at once. SQLite: two; while one runs in a write
/// round, the ACKs that arrive meanwhile form the second, which joins the
/// same round if it is still open (decision 0068). PostgreSQL: four commit
/// side by side (rows are locked in id order: batches never deadlock).
fn ack_batches_in_flight(db: &Database) -> usize {
    match db.backend() {
        DbBackend::Postgres => 4,
        _ => 2,
    }
}
