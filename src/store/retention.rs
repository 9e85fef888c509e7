//! Retention and background lease recovery, one short transaction per
//! batch so that no purge holds the write lock for long
//! (spec: delivery-model.md §6 "Lease recovery also runs from a background
//! sweeper", §8).

use crate::store::StoreError;
use entity::{delivery, event_session, idempotency_record, queue};
use sea_orm::{
    ColumnTrait, ConnectionTrait, DbBackend, EntityTrait, QueryFilter, QuerySelect, QueryTrait,
    Statement, sea_query::Expr,
};

use crate::{
    domain::{DeliveryState, NodeId, QueueId, Timestamp},
    journal::{self, PurgeBatch},
    store::wakes::LISTENER_APPLICATION_NAME,
    store::{
        Database,
        claim::{self, Recovered},
        history, state_is,
    },
};

/// Rows one retention or recovery transaction touches at most.
pub const BATCH: u64 = 500;

/// One transaction recovering at most `limit` lapsed leases across all
/// subscriptions (see [`claim::recover_expired_leases`]).
pub async fn recover_leases(
    db: &Database,
    now: Timestamp,
    limit: u64,
) -> Result<Recovered, StoreError> {
    db.write_alone(async |txn| claim::recover_expired_leases(txn, None, now, limit).await)
        .await
}

/// Every queue id (retention walks them one by one).
pub async fn queue_ids(db: &Database) -> Result<Vec<QueueId>, StoreError> {
    let ids: Vec<String> = queue::Entity::find()
        .select_only()
        .column(queue::Column::Id)
        .into_tuple()
        .all(db.reader())
        .await?;
    Ok(ids.into_iter().map(QueueId::from_db).collect())
}

/// One transaction of [`journal::purge`]: entries of `queue_id` appended
/// before `cutoff`, examined after sequence `after`.
pub async fn purge_events(
    db: &Database,
    queue_id: &QueueId,
    after: i64,
    cutoff: Timestamp,
) -> Result<PurgeBatch, StoreError> {
    db.write_alone(async |txn| journal::purge(txn, queue_id, after, cutoff, BATCH).await)
        .await
}

/// One transaction deleting at most [`BATCH`] ACKED deliveries acknowledged
/// before `cutoff`. Returns how many.
///
/// The delete names its rows by id only: ACKED is final, so the subquery's
/// rows cannot leave that state before the delete reaches them, and a
/// repeated `state = 'ACKED'` on the outer statement made SQLite's planner
/// walk every ACKED row through `(state, acknowledged_at)` instead of
/// looking the batch up by primary key (decision 0065).
///
/// Their history rows go with them (decision 0081), in the same
/// transaction: the ids are read first, so both deletes name the same rows.
pub async fn purge_acked_deliveries(db: &Database, cutoff: Timestamp) -> Result<u64, StoreError> {
    let due = delivery::Entity::find()
        .select_only()
        .column(delivery::Column::Id)
        .filter(state_is(DeliveryState::Acked))
        .filter(delivery::Column::AcknowledgedAt.lt(cutoff.micros()))
        .limit(BATCH);
    db.write_alone(async |txn| {
        let ids: Vec<String> = due.clone().into_tuple().all(txn).await?;
        if ids.is_empty() {
            return Ok(0);
        }
        history::delete_of(txn, &ids).await?;
        let deleted = delivery::Entity::delete_many()
            .filter(delivery::Column::Id.is_in(ids.iter().map(String::as_str)))
            .exec(txn)
            .await?;
        Ok(deleted.rows_affected)
    })
    .await
}

/// One transaction deleting at most [`BATCH`] idempotency records that
/// expired at or before `now` (an unfinished record never expires).
pub async fn purge_idempotency_records(db: &Database, now: Timestamp) -> Result<u64, StoreError> {
    let due = idempotency_record::Entity::find()
        .select_only()
        .column(idempotency_record::Column::Id)
        .filter(idempotency_record::Column::ExpiresAt.lte(now.micros()))
        .limit(BATCH);
    db.write_alone(async |txn| {
        let deleted = idempotency_record::Entity::delete_many()
            .filter(idempotency_record::Column::Id.in_subquery(due.clone().into_query()))
            .filter(idempotency_record::Column::ExpiresAt.lte(now.micros()))
            .exec(txn)
            .await?;
        Ok(deleted.rows_affected)
    })
    .await
}

/// One transaction deleting at most [`BATCH`] sessions closed before
/// `cutoff`. Returns how many.
pub async fn purge_closed_sessions(db: &Database, cutoff: Timestamp) -> Result<u64, StoreError> {
    let due = event_session::Entity::find()
        .select_only()
        .column(event_session::Column::Id)
        .filter(event_session::Column::ClosedAt.lt(cutoff.micros()))
        .limit(BATCH);
    db.write_alone(async |txn| {
        let deleted = event_session::Entity::delete_many()
            .filter(event_session::Column::Id.in_subquery(due.clone().into_query()))
            .filter(event_session::Column::ClosedAt.lt(cutoff.micros()))
            .exec(txn)
            .await?;
        Ok(deleted.rows_affected)
    })
    .await
}

/// Closes the sessions left open by other nodes (decision 0041): on SQLite
/// one node owns the database, so at its start every session not its own
/// was left by a stopped (or killed) node. Returns how many.
pub async fn close_foreign_sessions(
    db: &Database,
    node_id: &NodeId,
    now: Timestamp,
) -> Result<u64, StoreError> {
    db.write_alone(async |txn| {
        let closed = event_session::Entity::update_many()
            .col_expr(event_session::Column::ClosedAt, Expr::value(now.micros()))
            .filter(event_session::Column::NodeId.ne(node_id.as_str()))
            .filter(event_session::Column::ClosedAt.is_null())
            .exec(txn)
            .await?;
        Ok(closed.rows_affected)
    })
    .await
}

/// A node's listener may be reconnecting (backoff up to 5 s) or, just
/// started, not yet connected: sessions younger than this are left alone.
pub const DEAD_NODE_GRACE_MICROS: i64 = 60_000_000;

/// PostgreSQL only: closes the sessions of nodes that are gone (decision
/// 0041). A live node keeps a listener connection whose `application_name`
/// names it; open sessions opened more than a minute ago by any other node
/// (not `node_id`, the caller) are closed. On SQLite this does nothing
/// (see [`close_foreign_sessions`]). Returns how many were closed.
pub async fn close_dead_node_sessions(
    db: &Database,
    node_id: &NodeId,
    now: Timestamp,
) -> Result<u64, StoreError> {
    if db.backend() != DbBackend::Postgres {
        return Ok(0);
    }
    let prefix = format!("{LISTENER_APPLICATION_NAME} ");
    db.write_alone(async |txn| {
        let closed = txn
            .execute_raw(Statement::from_sql_and_values(
                DbBackend::Postgres,
                "UPDATE event_sessions SET closed_at = $1 \
             WHERE closed_at IS NULL AND node_id <> $2 AND opened_at < $3 \
             AND node_id NOT IN (SELECT substr(application_name, length($4) + 1) \
                 FROM pg_stat_activity WHERE starts_with(application_name, $4))",
                [
                    now.micros().into(),
                    node_id.as_str().into(),
                    now.micros().saturating_sub(DEAD_NODE_GRACE_MICROS).into(),
                    prefix.clone().into(),
                ],
            ))
            .await?;
        Ok(closed.rows_affected())
    })
    .await
}
