//! ACK tallies (decision 0094): on PostgreSQL an ACK batch records what it
//! takes off each subscription's `pending_count` as a row of its own (in
//! its one statement, `ack::write_acks`), and
//! the next materialization, which holds the subscription row lock anyway,
//! folds those rows in. An ACK then never waits for that lock, which a
//! claim holds through its commit's WAL flush (stack-notes "Hot row").
//! SQLite has one writer and updates the counter in place. Readers of
//! `pending_count` subtract what is not folded yet ([`settle`]).

use crate::store::StoreError;
use std::collections::HashMap;

use entity::{ack_tally, subscription};
use sea_orm::{
    ColumnTrait, ConnectionTrait, DbBackend, EntityTrait, QueryFilter, QuerySelect,
    sea_query::{Expr, Func},
};

/// Deletes the subscription's tallies and returns their sum: the ACKs to
/// take off its `pending_count` in the same transaction. Call only while
/// holding the subscription row lock, after it was taken (a tally summed
/// from a snapshot older than the lock could have been folded already).
/// SQLite keeps no tallies: 0 without a statement.
pub(crate) async fn fold<C: ConnectionTrait>(
    txn: &C,
    subscription_id: &str,
) -> Result<i64, StoreError> {
    if txn.get_database_backend() != DbBackend::Postgres {
        return Ok(0);
    }
    let folded = ack_tally::Entity::delete_many()
        .filter(ack_tally::Column::SubscriptionId.eq(subscription_id))
        .exec_with_returning(txn)
        .await?;
    Ok(folded.iter().map(|t| t.acked).sum())
}

/// The tallies not folded yet, summed per subscription of `ids` (absent:
/// none); `None` reads every subscription's.
pub(crate) async fn unfolded<C: ConnectionTrait>(
    conn: &C,
    ids: Option<&[&str]>,
) -> Result<HashMap<String, i64>, StoreError> {
    let mut query = ack_tally::Entity::find()
        .select_only()
        .column(ack_tally::Column::SubscriptionId)
        .expr(Func::cast_as(
            Func::sum(Expr::col(ack_tally::Column::Acked)),
            "BIGINT",
        ))
        .group_by(ack_tally::Column::SubscriptionId);
    if let Some(ids) = ids {
        if ids.is_empty() {
            return Ok(HashMap::new());
        }
        query = query.filter(ack_tally::Column::SubscriptionId.is_in(ids.iter().copied()));
    }
    let rows: Vec<(String, i64)> = query.into_tuple().all(conn).await?;
    Ok(rows.into_iter().collect())
}

/// Takes the unfolded tallies off the `pending_count` of subscription rows
/// read before this call (read in that order, a fold committed between the
/// two reads leaves a count too high for a moment, never too low).
pub(crate) async fn settle<C: ConnectionTrait>(
    conn: &C,
    subscriptions: &mut [subscription::Model],
) -> Result<(), StoreError> {
    if subscriptions.is_empty() {
        return Ok(());
    }
    let ids: Vec<&str> = subscriptions.iter().map(|s| s.id.as_str()).collect();
    let unfolded = unfolded(conn, Some(&ids)).await?;
    for sub in subscriptions {
        sub.pending_count -= unfolded.get(&sub.id).copied().unwrap_or(0);
    }
    Ok(())
}
