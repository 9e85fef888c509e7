//! The node's threads and its stop signal: [`Shutdown`] (what SIGTERM
//! starts), the delivery thread the actors run on, and [`NodeThread`], a
//! node serving on a thread of its own (decision 0070).

use std::sync::Arc;
use std::time::Duration;

use tokio::{
    sync::{oneshot, watch},
    task::LocalSet,
};

use crate::{
    config::Settings,
    startup::{Application, StartupError},
    state::AppState,
};

/// How long the delivery thread, once its actors and tasks are dropped,
/// keeps running what those drops started (sqlx returning connections to
/// their pools, the listener's `UNLISTEN`) before its runtime goes away.
const DELIVERY_SETTLE: Duration = Duration::from_secs(1);

/// The node-wide stop signal. Connections watch it: on [`Shutdown::begin`]
/// each one stops taking frames, lets its in-flight hello/ACK/ping finish
/// (their replies are written), then closes with 1001.
#[derive(Clone, Debug)]
pub struct Shutdown(Arc<watch::Sender<Option<StopMode>>>);

/// How the HTTP server stops once the connections have drained.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum StopMode {
    /// In-flight HTTP requests get the server's shutdown timeout.
    Graceful,
    /// Open HTTP connections are closed at once.
    Prompt,
}

impl Shutdown {
    pub fn new() -> Shutdown {
        Shutdown(Arc::new(watch::Sender::new(None)))
    }

    /// Starts the drain (idempotent): what SIGTERM does.
    pub fn begin(&self) {
        self.0.send_if_modified(|mode| {
            let begins = mode.is_none();
            if begins {
                *mode = Some(StopMode::Graceful);
            }
            begins
        });
    }

    /// As [`Shutdown::begin`] (WebSocket connections drain and close with
    /// 1001 all the same), but once they have, the HTTP server closes its
    /// open HTTP connections at once instead of giving them its shutdown
    /// timeout (5 s): for stopping a node nobody uses any more, e.g. at
    /// the end of a test, where idle keep-alive connections would hold the
    /// stop for the whole timeout. Also shortens a drain already begun.
    pub fn begin_prompt(&self) {
        self.0.send_if_modified(|mode| {
            let changes = *mode != Some(StopMode::Prompt);
            *mode = Some(StopMode::Prompt);
            changes
        });
    }

    pub fn is_begun(&self) -> bool {
        self.0.borrow().is_some()
    }

    pub(crate) fn is_prompt(&self) -> bool {
        *self.0.borrow() == Some(StopMode::Prompt)
    }

    /// Resolves once [`Shutdown::begin`] has been called.
    pub async fn begun(&self) {
        let mut rx = self.0.subscribe();
        // The sender lives in `self`, so `wait_for` cannot see it dropped.
        let _ = rx.wait_for(Option::is_some).await;
    }
}

impl Default for Shutdown {
    fn default() -> Shutdown {
        Shutdown::new()
    }
}

/// The thread the delivery actors run on: a current-thread Tokio runtime
/// with a local task set, as an actix `Arbiter` is, but one that drops its
/// tasks inside its live runtime when it stops. An `Arbiter` drops its task
/// set after its runtime has left the thread's context, and sqlx then
/// panics ("requires a Tokio context") where a dropped connection spawns
/// its return to the pool, or the LISTEN connection its `UNLISTEN`.
pub(crate) struct DeliveryThread {
    stop: Option<oneshot::Sender<()>>,
    stopped: Option<oneshot::Receiver<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl DeliveryThread {
    /// Starts the thread and runs `start` on it (actors started there with
    /// `Actor::start`, tasks with `actix::spawn`, live on that thread);
    /// returns what `start` returned.
    pub(crate) fn start<T: Send + 'static>(
        start: impl FnOnce() -> T + Send + 'static,
    ) -> std::io::Result<(DeliveryThread, T)> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let (stop_tx, stop_rx) = oneshot::channel::<()>();
        let (stopped_tx, stopped_rx) = oneshot::channel::<()>();
        let (started_tx, started_rx) = std::sync::mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("orbit-delivery".to_owned())
            .spawn(move || {
                let tasks = LocalSet::new();
                tasks.block_on(&runtime, async move {
                    let _ = started_tx.send(start());
                    // Stops on `stop`, or when the handle is gone.
                    let _ = stop_rx.await;
                });
                {
                    let _context = runtime.enter();
                    drop(tasks);
                }
                runtime.block_on(async {
                    let deadline = tokio::time::Instant::now() + DELIVERY_SETTLE;
                    let metrics = tokio::runtime::Handle::current().metrics();
                    while metrics.num_alive_tasks() > 0 && tokio::time::Instant::now() < deadline {
                        tokio::time::sleep(Duration::from_millis(2)).await;
                    }
                });
                // Whatever is still left is dropped inside the runtime too.
                drop(runtime);
                let _ = stopped_tx.send(());
            })?;
        let started = started_rx.recv().map_err(|_| {
            std::io::Error::other("the delivery thread stopped while starting its actors")
        })?;
        let delivery = DeliveryThread {
            stop: Some(stop_tx),
            stopped: Some(stopped_rx),
            thread: Some(thread),
        };
        Ok((delivery, started))
    }

    /// Stops the thread and waits for it without blocking the caller's
    /// runtime.
    pub(crate) async fn stop(mut self) {
        self.stop.take();
        if let Some(stopped) = self.stopped.take() {
            let _ = stopped.await;
        }
        self.join();
    }

    fn join(&mut self) {
        if let Some(thread) = self.thread.take()
            && thread.join().is_err()
        {
            tracing::error!("the delivery thread panicked");
        }
    }
}

impl Drop for DeliveryThread {
    /// Stops the thread and waits for it (at most about [`DELIVERY_SETTLE`]).
    fn drop(&mut self) {
        self.stop.take();
        self.join();
    }
}

/// A node serving on a thread of its own (its own actix System), for tests
/// and for embedding a node in a program: whatever the caller's runtime
/// does, or when it goes away, the node keeps running until stopped, and
/// stops inside its own runtime. [`NodeThread::stop`], or dropping it,
/// stops the node promptly ([`Shutdown::begin_prompt`]: WebSocket
/// connections drain and close with 1001, the HTTP server stops, then the
/// delivery thread and the pools) and waits until it has stopped.
///
/// The wait needs nothing from the caller's runtime as long as the node's
/// pools are used by the node alone: a caller that queries the database
/// should open its own [`Database`] (a connection opened by a task of the
/// caller's runtime is driven by that runtime).
pub struct NodeThread {
    port: u16,
    state: AppState,
    thread: Option<std::thread::JoinHandle<std::io::Result<()>>>,
}

impl NodeThread {
    /// Builds the node ([`Application::build`]) on a new thread and starts
    /// serving; resolves once it listens.
    pub async fn start(settings: Settings) -> Result<NodeThread, StartupError> {
        let (started_tx, started_rx) = oneshot::channel();
        let thread = std::thread::Builder::new()
            .name("orbit-node".to_owned())
            .spawn(move || {
                actix_web::rt::System::new().block_on(async move {
                    match Application::build(settings).await {
                        Ok(app) => {
                            let _ = started_tx.send(Ok((app.port(), app.state().clone())));
                            app.run_until_stopped().await
                        }
                        Err(err) => {
                            let _ = started_tx.send(Err(err));
                            Ok(())
                        }
                    }
                })
            })
            .map_err(StartupError::Thread)?;
        match started_rx.await {
            Ok(Ok((port, state))) => Ok(NodeThread {
                port,
                state,
                thread: Some(thread),
            }),
            Ok(Err(err)) => {
                let _ = thread.join();
                Err(err)
            }
            Err(_) => {
                let _ = thread.join();
                Err(StartupError::Thread(std::io::Error::other(
                    "the node's thread stopped while starting",
                )))
            }
        }
    }

    /// The bound port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The bound port of `server.metrics_listen`, when set.
    pub fn metrics_port(&self) -> Option<u16> {
        self.state.metrics_addr.map(|a| a.port())
    }

    /// The node's shared state (its actors, its [`Shutdown`]).
    pub fn state(&self) -> &AppState {
        &self.state
    }

    /// Stops the node promptly and waits until it has stopped; returns how
    /// its HTTP server ended.
    pub fn stop(mut self) -> std::io::Result<()> {
        self.stop_and_wait()
    }

    fn stop_and_wait(&mut self) -> std::io::Result<()> {
        let Some(thread) = self.thread.take() else {
            return Ok(());
        };
        self.state.shutdown.begin_prompt();
        thread
            .join()
            .unwrap_or_else(|_| Err(std::io::Error::other("the node's thread panicked")))
    }
}

impl Drop for NodeThread {
    fn drop(&mut self) {
        if let Err(err) = self.stop_and_wait() {
            tracing::warn!(error = %err, "the node stopped with an error");
        }
    }
}
