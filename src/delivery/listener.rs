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
use sea_orm::{
    ConnectionTrait, DbBackend, DbErr, Statement, Value,
    sqlx::postgres::{PgConnectOptions, PgListener, PgNotification, PgPoolOptions},
};
use tokio::sync::Notify;

use crate::{
    delivery::scanner::{RemoteWake, ScannerActor, WakeAll},
    domain::{NodeId, QueueId, SubscriptionId},
    store::Database,
};

/// The PostgreSQL notification channel every node listens on.
pub const CHANNEL: &str = "orbit_events";

/// Payloads per `SELECT pg_notify(..)` statement.
const PAYLOADS_PER_STATEMENT: usize = 64;
/// Origin written by appenders outside a node.
const NO_NODE: &str = "-";
/// With no notification for this long, the listener checks its connection
/// (a silently dropped TCP path would otherwise block it forever).
const LIVENESS_INTERVAL: Duration = Duration::from_secs(15);
/// How long that check, and a connection attempt, may take.
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);
const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(5);

/// Something other nodes' scanners should look at.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Wake {
    /// Entries were appended to this queue's log.
    Journal(QueueId),
    /// A subscription changed (resumed, a delivery re-armed, room freed).
    Subscription(SubscriptionId),
}

impl Wake {
    fn payload(&self, origin: &str) -> String {
        match self {
            Wake::Journal(q) => format!("journal {} {origin}", q.as_str()),
            Wake::Subscription(s) => format!("subscription {} {origin}", s.as_str()),
        }
    }

    /// `(wake, origin)` of a payload; `None` for anything malformed (the
    /// channel is open to every role that can connect: never trust it).
    fn parse(payload: &str) -> Option<(Wake, &str)> {
        let mut parts = payload.split(' ');
        let (kind, id, origin) = (parts.next()?, parts.next()?, parts.next()?);
        if parts.next().is_some() {
            return None;
        }
        let wake = match kind {
            "journal" => Wake::Journal(QueueId::parse(id)?),
            "subscription" => Wake::Subscription(SubscriptionId::parse(id)?),
            _ => return None,
        };
        Some((wake, origin))
    }
}

/// Sends `wakes` to every listening node: `SELECT pg_notify(..)` on
/// PostgreSQL, nothing on SQLite (one node only). `origin` is the sending
/// node (its own listener ignores the echo), `None` outside a node.
///
/// Run on a connection in autocommit mode, the notification leaves at once
/// in its own transaction, committed without waiting for the WAL flush
/// (`synchronous_commit` off for that transaction only: a notification is
/// not durable anyway). Run inside a caller's transaction, PostgreSQL
/// delivers it at that transaction's commit and drops it on rollback.
pub async fn notify<C: ConnectionTrait>(
    conn: &C,
    wakes: &[Wake],
    origin: Option<&NodeId>,
) -> Result<(), DbErr> {
    if conn.get_database_backend() != DbBackend::Postgres || wakes.is_empty() {
        return Ok(());
    }
    let origin = origin.map_or(NO_NODE, NodeId::as_str);
    for chunk in wakes.chunks(PAYLOADS_PER_STATEMENT) {
        // $1 is the channel; one pg_notify per payload in one statement.
        let calls: Vec<String> = (0..chunk.len())
            .map(|i| format!("pg_notify($1, ${})", i + 2))
            .collect();
        let sql = format!(
            "SELECT set_config('synchronous_commit', 'off', true), {}",
            calls.join(", ")
        );
        let mut values: Vec<Value> = vec![CHANNEL.into()];
        values.extend(chunk.iter().map(|w| Value::from(w.payload(origin))));
        conn.execute_raw(Statement::from_sql_and_values(
            DbBackend::Postgres,
            sql,
            values,
        ))
        .await?;
    }
    Ok(())
}

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

/// The `application_name` of a node's listener connection is this prefix,
/// a space and the node id: other nodes read `pg_stat_activity` to tell
/// which nodes are alive (decision 0041).
pub const LISTENER_APPLICATION_NAME: &str = "orbit-events listener";

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

    #[test]
    fn payloads_round_trip_and_malformed_ones_are_refused() {
        let q = QueueId::generate();
        let s = SubscriptionId::generate();
        let node = NodeId::generate();
        let p = Wake::Journal(q.clone()).payload(node.as_str());
        assert_eq!(Wake::parse(&p), Some((Wake::Journal(q), node.as_str())));
        let p = Wake::Subscription(s.clone()).payload(NO_NODE);
        assert_eq!(Wake::parse(&p), Some((Wake::Subscription(s), NO_NODE)));
        for bad in [
            "",
            "journal",
            "journal abc -",
            "journal 0123456789abcdef0123456789abcdef",
            "journal 0123456789abcdef0123456789abcdef - extra",
            "queue 0123456789abcdef0123456789abcdef -",
        ] {
            assert_eq!(Wake::parse(bad), None, "{bad:?}");
        }
    }
}
