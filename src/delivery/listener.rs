//! Cross-node wakes on PostgreSQL (spec: architecture.md §4,
//! delivery-model.md §3): after a local commit the node `NOTIFY`s the other
//! nodes sharing the database, and every node `LISTEN`s and wakes its own
//! [`ScannerActor`]. Decision record: docs/decisions/0030-cross-node-wakes.md.
//!
//! Wakes are hints, never the source of truth: a lost notification (the
//! listener reconnecting, the database restarting) only costs latency,
//! because the scanner's fallback poll (`timing.scan_interval_ms`) still
//! runs, and the listener wakes every subscription after each reconnect.
//!
//! On the wire: channel [`CHANNEL`], payload `"<kind> <id> <origin>"` where
//! kind is `journal` (id = queue id) or `subscription` (id = subscription
//! id) and origin is the sending node's id (`-` when sent from outside a
//! node, e.g. by a transactional-outbox appender).

use std::{
    collections::HashSet,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use actix::Addr;
use sea_orm::sqlx::postgres::{PgConnectOptions, PgListener, PgNotification, PgPoolOptions};
use tokio::sync::Notify;

use crate::{
    delivery::scanner::{RemoteWake, ScannerActor, WakeAll},
    domain::NodeId,
    store::{
        Database,
        wakes::{CHANNEL, LISTENER_APPLICATION_NAME, Wake, notify},
    },
};

/// With no notification for this long, the listener checks its connection
/// (a silently dropped TCP path would otherwise block it forever).
const LIVENESS_INTERVAL: Duration = Duration::from_secs(15);
/// How long that check, and a connection attempt, may take.
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);
const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(5);

/// Coalescing sender of this node's wakes. [`Announcer::announce`] never
/// blocks and never awaits the database: it adds the wake to a set that
/// one background task drains, one `pg_notify` statement at a time. Wakes
/// that arrive while a statement runs are merged, so a burst of N appends
/// to one queue costs one or two notifications, not N; memory is bounded by
/// the number of distinct queues and subscriptions.
///
/// Journal wakes leave at once (they carry the publish→deliver latency).
/// Subscription wakes (every ACK sends one) leave at most once per
/// [`SUBSCRIPTION_WAKE_INTERVAL`], so a busy subscription does not make
/// every other node run a scan round per ACK.
#[derive(Clone)]
pub struct Announcer {
    shared: Arc<Shared>,
}

/// The shortest gap between two NOTIFYs carrying subscription wakes.
pub const SUBSCRIPTION_WAKE_INTERVAL: Duration = Duration::from_millis(100);

struct Shared {
    pending: Mutex<HashSet<Wake>>,
    ready: Notify,
}

impl Shared {
    /// Takes the journal wakes, and the subscription wakes too when
    /// `subscriptions_due`; also says whether subscription wakes remain.
    fn take(&self, subscriptions_due: bool) -> Option<(Vec<Wake>, bool)> {
        let mut pending = self.pending.lock().ok()?;
        let mut batch = Vec::new();
        pending.retain(|w| {
            let due = subscriptions_due || matches!(w, Wake::Journal(_));
            if due {
                batch.push(w.clone());
            }
            !due
        });
        Some((batch, !pending.is_empty()))
    }
}

impl Announcer {
    /// Starts the sending task on the current thread's local task set (the
    /// node's delivery thread), sending as `node_id`.
    pub fn start(db: Database, node_id: NodeId) -> Announcer {
        let shared = Arc::new(Shared {
            pending: Mutex::new(HashSet::new()),
            ready: Notify::new(),
        });
        actix::spawn(send_forever(db, node_id, shared.clone()));
        Announcer { shared }
    }

    /// Queues `wake` for the other nodes.
    pub fn announce(&self, wake: Wake) {
        if let Ok(mut pending) = self.shared.pending.lock() {
            pending.insert(wake);
        }
        self.shared.ready.notify_one();
    }
}

async fn send_forever(db: Database, node_id: NodeId, shared: Arc<Shared>) {
    let mut subscriptions_after = Instant::now();
    loop {
        let Some((batch, held_back)) = shared.take(Instant::now() >= subscriptions_after) else {
            return;
        };
        if batch.is_empty() {
            if held_back {
                tokio::select! {
                    _ = shared.ready.notified() => {}
                    _ = tokio::time::sleep_until(subscriptions_after.into()) => {}
                }
            } else {
                shared.ready.notified().await;
            }
            continue;
        }
        if batch.iter().any(|w| matches!(w, Wake::Subscription(_))) {
            subscriptions_after = Instant::now() + SUBSCRIPTION_WAKE_INTERVAL;
        }
        // A reader connection in autocommit: the statement is its own
        // transaction, independent of any append.
        if let Err(err) = notify(db.reader(), &batch, Some(&node_id)).await {
            // Other nodes fall back to their poll; do not hammer a
            // database that is down.
            tracing::warn!(error = %err, wakes = batch.len(), "NOTIFY failed");
            tokio::time::sleep(BACKOFF_MIN).await;
        }
    }
}

/// Starts this node's listener on the current thread's local task set (the
/// node's delivery thread, which drops it inside its live runtime when the
/// node stops: sqlx's listener spawns its `UNLISTEN` when dropped, and
/// panics outside a runtime): `LISTEN` on [`CHANNEL`] over a
/// dedicated connection (outside the pool, so `database.max_connections`
/// stays what it says), reconnecting with a capped backoff. Every wake from
/// another node becomes a [`RemoteWake`] for `scanner`; after every
/// (re)connection the scanner gets a [`WakeAll`], since notifications sent
/// while nobody listened are gone.
pub fn start_listener(url: String, node_id: NodeId, scanner: Addr<ScannerActor>) {
    actix::spawn(listen_forever(url, node_id, scanner));
}

async fn listen_forever(url: String, node_id: NodeId, scanner: Addr<ScannerActor>) {
    let mut backoff = BACKOFF_MIN;
    // Set after a failure, so that the operator who read "retrying" also
    // reads that it worked.
    let mut failed = false;
    loop {
        match connect(&url, &node_id).await {
            Ok(mut listener) => {
                backoff = BACKOFF_MIN;
                scanner.do_send(WakeAll);
                if std::mem::take(&mut failed) {
                    tracing::info!("listening for wakes from other nodes again");
                } else {
                    tracing::debug!("listening for wakes from other nodes");
                }
                let err = receive(&mut listener, &node_id, &scanner).await;
                tracing::warn!(error = %err, "listener connection lost; reconnecting");
                failed = true;
            }
            Err(err) => {
                tracing::warn!(error = %err, "cannot LISTEN for wakes; retrying");
                failed = true;
            }
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(BACKOFF_MAX);
    }
}

async fn connect(url: &str, node_id: &NodeId) -> Result<PgListener, sea_orm::sqlx::Error> {
    let options: PgConnectOptions = url.parse()?;
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .min_connections(0)
        .acquire_timeout(PROBE_TIMEOUT)
        .idle_timeout(None)
        .max_lifetime(None)
        .connect_with(options.application_name(&format!("{LISTENER_APPLICATION_NAME} {node_id}")))
        .await?;
    let mut listener = PgListener::connect_with(&pool).await?;
    listener.listen(CHANNEL).await?;
    Ok(listener)
}

/// Receives until the connection fails; returns why.
async fn receive(
    listener: &mut PgListener,
    node_id: &NodeId,
    scanner: &Addr<ScannerActor>,
) -> sea_orm::sqlx::Error {
    loop {
        // `try_recv` is cancel-safe (it consumes only whole messages).
        match tokio::time::timeout(LIVENESS_INTERVAL, listener.try_recv()).await {
            Ok(Ok(Some(notification))) => dispatch(&notification, node_id, scanner),
            // The connection dropped and PgListener reconnected and
            // re-LISTENed before returning: whatever was sent in between
            // is lost, so look at everything.
            Ok(Ok(None)) => {
                tracing::warn!("listener reconnected after a lost connection");
                scanner.do_send(WakeAll);
            }
            Ok(Err(err)) => return err,
            Err(_) => {
                let probe = sea_orm::sqlx::query("SELECT 1").execute(&mut *listener);
                match tokio::time::timeout(PROBE_TIMEOUT, probe).await {
                    Ok(Ok(_)) => {}
                    Ok(Err(err)) => return err,
                    Err(_) => {
                        return sea_orm::sqlx::Error::Io(std::io::Error::new(
                            std::io::ErrorKind::TimedOut,
                            "liveness probe timed out",
                        ));
                    }
                }
            }
        }
    }
}

fn dispatch(notification: &PgNotification, node_id: &NodeId, scanner: &Addr<ScannerActor>) {
    match Wake::parse(notification.payload()) {
        // Our own echo: the local scanner was woken in-process already.
        Some((_, origin)) if origin == node_id.as_str() => {}
        Some((wake, _)) => scanner.do_send(RemoteWake(wake)),
        None => tracing::debug!("ignored a malformed notification"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::{QueueId, SubscriptionId};

    #[test]
    fn subscription_wakes_wait_for_their_turn_while_journal_wakes_leave_at_once() {
        let shared = Shared {
            pending: Mutex::new(HashSet::new()),
            ready: Notify::new(),
        };
        let (q, s) = (QueueId::generate(), SubscriptionId::generate());
        shared
            .pending
            .lock()
            .unwrap()
            .extend([Wake::Journal(q.clone()), Wake::Subscription(s.clone())]);
        assert_eq!(shared.take(false), Some((vec![Wake::Journal(q)], true)));
        assert_eq!(shared.take(false), Some((vec![], true)));
        assert_eq!(
            shared.take(true),
            Some((vec![Wake::Subscription(s)], false))
        );
        assert_eq!(shared.take(true), Some((vec![], false)));
    }
}
