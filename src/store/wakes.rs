//! The wire form of cross-node wakes on PostgreSQL (decision 0030): the
//! `NOTIFY` channel, its payloads and the statement that sends them. The
//! listener that receives them is `delivery::listener`; appenders (the
//! journal, the outbox) only need this.

use crate::store::StoreError;
use sea_orm::{ConnectionTrait, DbBackend, Statement, Value};

use crate::domain::{NodeId, QueueId, SubscriptionId};

/// The PostgreSQL notification channel every node listens on.
pub const CHANNEL: &str = "orbit_events";

/// Payloads per `SELECT pg_notify(..)` statement.
const PAYLOADS_PER_STATEMENT: usize = 64;
/// Origin written by appenders outside a node.
const NO_NODE: &str = "-";
/// Something other nodes' scanners should look at.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Wake {
    /// Entries were appended to this queue's log.
    Journal(QueueId),
    /// A subscription changed (resumed, a delivery re-armed, room freed).
    Subscription(SubscriptionId),
}

impl Wake {
    pub(crate) fn payload(&self, origin: &str) -> String {
        match self {
            Wake::Journal(q) => format!("journal {} {origin}", q.as_str()),
            Wake::Subscription(s) => format!("subscription {} {origin}", s.as_str()),
        }
    }

    /// `(wake, origin)` of a payload; `None` for anything malformed (the
    /// channel is open to every role that can connect: never trust it).
    pub(crate) fn parse(payload: &str) -> Option<(Wake, &str)> {
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
) -> Result<(), StoreError> {
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

/// The `application_name` of a node's listener connection is this prefix,
/// a space and the node id: other nodes read `pg_stat_activity` to tell
/// which nodes are alive (decision 0041).
pub const LISTENER_APPLICATION_NAME: &str = "orbit-events listener";

#[cfg(test)]
mod tests {
    use super::*;

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
