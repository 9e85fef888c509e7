//! Group commit (decision 0078): requests that come while a write of their
//! kind commits gather and share the next transaction ([`GroupCommit`]),
//! and the one rule for a batch that fails ([`batch_or_each`]).

use std::{future::Future, sync::Arc};

use tokio::sync::{Semaphore, mpsc, oneshot};

use super::{StoreError, WriteError, log_failure};

/// Runs `requests` as one batch (`run` on all of them) and answers one
/// outcome per request, in order:
/// - the batch wrote: its outcomes;
/// - it failed on a fault of the database: every request gets the fault
///   (alone it would only meet it again);
/// - it failed on the data's rules: each request runs again alone, so that
///   one request the database refuses never fails the others that shared
///   its transaction.
pub async fn batch_or_each<R, O, E, F>(what: &str, requests: &[R], mut run: F) -> Vec<Result<O, E>>
where
    E: WriteError + Clone,
    F: AsyncFnMut(&[R]) -> Result<Vec<O>, E>,
{
    let err = match one_per_request(run(requests).await, requests.len()) {
        Ok(outcomes) => return outcomes.into_iter().map(Ok).collect(),
        Err(err) => err,
    };
    let fault = err.store_error().is_some_and(|e| e.fault().is_some());
    if requests.len() == 1 || fault {
        if let Some(store) = err.store_error() {
            log_failure(store, &format!("{what} failed"));
        }
        return requests.iter().map(|_| Err(err.clone())).collect();
    }
    if let Some(store) = err.store_error() {
        log_failure(
            store,
            &format!("{what} of {} failed; running each alone", requests.len()),
        );
    }
    let mut outcomes = Vec::with_capacity(requests.len());
    for request in requests {
        let alone = one_per_request(run(std::slice::from_ref(request)).await, 1);
        outcomes.push(alone.map(|mut o| o.remove(0)));
    }
    outcomes
}

/// `Ok` only with exactly `n` outcomes.
fn one_per_request<O, E: WriteError>(outcomes: Result<Vec<O>, E>, n: usize) -> Result<Vec<O>, E> {
    match outcomes {
        Ok(outcomes) if outcomes.len() == n => Ok(outcomes),
        Ok(outcomes) => Err(E::from(StoreError::invariant(format!(
            "a batch of {n} answered {} outcomes",
            outcomes.len()
        )))),
        Err(err) => Err(err),
    }
}

struct Waiting<R, O> {
    request: R,
    reply: oneshot::Sender<O>,
}

/// A group-commit queue: one task that takes every request waiting (at most
/// `max_batch`), hands them to its work function as one batch and answers
/// each caller with its own outcome once that returns (after the batch's
/// commit). At most `slots` batches run at once; while every slot is busy,
/// new requests gather and form the next batch. Alone, a request goes
/// through at once: batching costs no waiting. Cheap to clone.
pub struct GroupCommit<R, O> {
    tx: mpsc::Sender<Waiting<R, O>>,
}

impl<R, O> Clone for GroupCommit<R, O> {
    fn clone(&self) -> Self {
        GroupCommit {
            tx: self.tx.clone(),
        }
    }
}

impl<R, O> std::fmt::Debug for GroupCommit<R, O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GroupCommit").finish_non_exhaustive()
    }
}

/// The sizes of a [`GroupCommit`].
#[derive(Clone, Copy, Debug)]
pub struct BatchLimits {
    /// Batches in flight at once.
    pub slots: usize,
    /// Requests per batch at most.
    pub max_batch: usize,
    /// Requests waiting beyond the running batches; a caller past it waits
    /// for room (backpressure), nothing is dropped.
    pub channel: usize,
}

impl<R: 'static, O: 'static> GroupCommit<R, O> {
    /// Starts the task on the calling thread's local task set (the node's
    /// delivery thread, so it stops with the delivery actors). `work` gets
    /// each batch in arrival order and answers one outcome per request.
    pub fn start<F, Fut>(limits: BatchLimits, work: F) -> GroupCommit<R, O>
    where
        F: Fn(Vec<R>) -> Fut + 'static,
        Fut: Future<Output = Vec<O>> + 'static,
    {
        let (tx, rx) = mpsc::channel(limits.channel.max(1));
        tokio::task::spawn_local(run(limits, rx, work));
        GroupCommit { tx }
    }

    /// Hands `request` to the task and waits for its outcome; `None` when
    /// the task has stopped (the node is stopping) before answering.
    pub async fn submit(&self, request: R) -> Option<O> {
        self.join(request).await?.outcome().await
    }

    /// Hands `request` to the task and returns once it has joined the
    /// queue (waiting for room past `channel`), before its batch runs;
    /// `None` when the task has stopped.
    pub async fn join(&self, request: R) -> Option<Joined<O>> {
        let (reply, answer) = oneshot::channel();
        self.tx.send(Waiting { request, reply }).await.ok()?;
        Some(Joined(answer))
    }
}

/// A request that has joined a [`GroupCommit`]: its outcome comes after
/// its batch's commit.
pub struct Joined<O>(oneshot::Receiver<O>);

impl<O> Joined<O> {
    /// The outcome; `None` when the task stopped before answering.
    pub async fn outcome(self) -> Option<O> {
        self.0.await.ok()
    }
}

async fn run<R: 'static, O: 'static, F, Fut>(
    limits: BatchLimits,
    mut rx: mpsc::Receiver<Waiting<R, O>>,
    work: F,
) where
    F: Fn(Vec<R>) -> Fut + 'static,
    Fut: Future<Output = Vec<O>> + 'static,
{
    let slots = Arc::new(Semaphore::new(limits.slots.max(1)));
    let max_batch = limits.max_batch.max(1);
    loop {
        // A slot first: while every slot commits, requests gather in the
        // channel and become the next batch.
        let Ok(slot) = slots.clone().acquire_owned().await else {
            return;
        };
        let mut batch = Vec::with_capacity(max_batch);
        if rx.recv_many(&mut batch, max_batch).await == 0 {
            return;
        }
        let (requests, replies): (Vec<R>, Vec<_>) =
            batch.into_iter().map(|w| (w.request, w.reply)).unzip();
        let done = work(requests);
        tokio::task::spawn_local(async move {
            let outcomes = done.await;
            for (reply, outcome) in replies.into_iter().zip(outcomes) {
                // A caller that went away meanwhile no longer waits.
                let _ = reply.send(outcome);
            }
            drop(slot);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sea_orm::DbErr;

    #[tokio::test]
    async fn a_batch_refused_on_the_datas_rules_runs_each_alone_and_a_fault_fails_every_request() {
        // The batch of three fails on a rule; alone, only `2` fails.
        let refused = async |r: &[u32]| -> Result<Vec<u32>, StoreError> {
            if r.contains(&2) {
                Err(StoreError::invariant("two is refused"))
            } else {
                Ok(r.iter().map(|x| x * 10).collect())
            }
        };
        let outcomes = batch_or_each("test", &[1, 2, 3], refused).await;
        assert_eq!(outcomes[0].as_ref().ok(), Some(&10));
        assert!(outcomes[1].is_err());
        assert_eq!(outcomes[2].as_ref().ok(), Some(&30));

        let mut calls = 0;
        let faulty = async |_: &[u32]| -> Result<Vec<u32>, StoreError> {
            calls += 1;
            Err(StoreError::Database(DbErr::Conn(
                sea_orm::RuntimeErr::Internal("gone".to_owned()),
            )))
        };
        let outcomes = batch_or_each("test", &[1, 2, 3], faulty).await;
        assert!(outcomes.iter().all(Result::is_err));
        assert_eq!(calls, 1, "a fault is not retried request by request");
    }

    #[tokio::test]
    async fn a_batch_that_answers_the_wrong_number_of_outcomes_is_an_invariant_failure() {
        let short = async |_: &[u32]| -> Result<Vec<u32>, StoreError> { Ok(vec![]) };
        let outcomes = batch_or_each("test", &[1], short).await;
        assert!(matches!(outcomes[0], Err(StoreError::Invariant(_))));
    }
}
