//! Group commit (decisions 0060, 0063): requests that arrive while a
//! commit is in flight wait together and share the next transaction.
//!
//! A [`Batcher`] is one task on the node's delivery thread. Callers on any
//! thread hand it a request and await the answer; the task takes every
//! request waiting (at most `max_batch`), hands them to its `work` function
//! as one batch and answers each caller with its own outcome once `work`
//! returns, that is after the batch's commit. At most `slots` batches run at
//! once; while every slot is busy, new requests gather in the channel and
//! form the next batch. Alone, a request goes through at once: batching
//! costs no waiting, it only happens when the database is the bottleneck.

use std::{future::Future, sync::Arc};

use tokio::sync::{Semaphore, mpsc, oneshot};

struct Waiting<R, O> {
    request: R,
    reply: oneshot::Sender<O>,
}

/// Handle of a group-commit task (cheap to clone; `R` a request, `O` its
/// outcome).
pub struct Batcher<R, O> {
    tx: mpsc::Sender<Waiting<R, O>>,
}

impl<R, O> Clone for Batcher<R, O> {
    fn clone(&self) -> Self {
        Batcher {
            tx: self.tx.clone(),
        }
    }
}

impl<R, O> std::fmt::Debug for Batcher<R, O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Batcher").finish_non_exhaustive()
    }
}

/// The sizes of a [`Batcher`].
#[derive(Clone, Copy, Debug)]
pub struct BatchLimits {
    /// Batches in flight at once (1 on SQLite: one writer).
    pub slots: usize,
    /// Requests per batch at most.
    pub max_batch: usize,
    /// Requests waiting beyond the running batches; a caller past it waits
    /// for room (backpressure), nothing is dropped.
    pub channel: usize,
}

impl<R: 'static, O: 'static> Batcher<R, O> {
    /// Starts the task on the calling thread's actix/Tokio local task set
    /// (the node calls it on its delivery thread, so it stops with the
    /// delivery actors). `work` gets each batch in arrival order and returns
    /// one outcome per request, in the same order.
    pub fn start<F, Fut>(limits: BatchLimits, work: F) -> Batcher<R, O>
    where
        F: Fn(Vec<R>) -> Fut + 'static,
        Fut: Future<Output = Vec<O>> + 'static,
    {
        let (tx, rx) = mpsc::channel(limits.channel.max(1));
        actix::spawn(run(limits, rx, work));
        Batcher { tx }
    }

    /// Hands `request` to the task and waits for its outcome; `None` when
    /// the task has stopped (the node is shutting down) before answering.
    pub async fn submit(&self, request: R) -> Option<O> {
        let (reply, answer) = oneshot::channel();
        self.tx.send(Waiting { request, reply }).await.ok()?;
        answer.await.ok()
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
        actix::spawn(async move {
            let outcomes = done.await;
            for (reply, outcome) in replies.into_iter().zip(outcomes) {
                // A caller that went away meanwhile no longer waits.
                let _ = reply.send(outcome);
            }
            drop(slot);
        });
    }
}
