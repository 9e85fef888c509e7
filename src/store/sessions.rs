//! Event sessions: one row per WebSocket connection after a successful hello
//! (spec: protocol.md §3).

use crate::store::StoreError;
use entity::{event_session, subscription};
use sea_orm::{ColumnTrait, ConnectionTrait, EntityTrait, QueryFilter, Set, sea_query::Expr};

use crate::{
    domain::Principal,
    domain::{NodeId, QueueId, SessionId, SubscriptionId, now},
    journal,
    store::{Database, subscriptions::owned, tenancy},
};

/// The result of a hello.
#[derive(Debug)]
pub enum OpenSession {
    /// Recorded; carries the subscription as of the hello.
    Opened {
        session_id: SessionId,
        subscription: Box<subscription::Model>,
    },
    /// Not this credential's subscription, or its queue is out of scope.
    NotFound,
    /// The subscription's cursor is below the retention floor.
    HistoryExpired(u64),
    /// The credential was revoked since the upgrade.
    Revoked,
}

/// Checks that the credential is still valid, that the subscription belongs
/// to it and its queue is in scope, and records the session with its
/// capacity, in one transaction.
pub async fn open_session(
    db: &Database,
    principal: &Principal,
    subscription_id: &SubscriptionId,
    capacity: u32,
    node_id: &NodeId,
) -> Result<OpenSession, StoreError> {
    db.write_alone(async |txn| {
        if tenancy::principal_by_id(txn, &principal.credential_id)
            .await?
            .is_none()
        {
            return Ok(OpenSession::Revoked);
        }
        let Some(sub) = subscription::Entity::find_by_id(subscription_id.as_str())
            .one(txn)
            .await?
            .and_then(|m| owned(principal, m))
        else {
            return Ok(OpenSession::NotFound);
        };
        let queue_id = QueueId::from_db(sub.queue_id.clone());
        if let Some(pos) = journal::position(txn, &queue_id).await?
            && sub.cursor_sequence < pos.floor
        {
            return Ok(OpenSession::HistoryExpired(pos.earliest()));
        }
        let session_id = SessionId::generate();
        let t = now().micros();
        event_session::Entity::insert(event_session::ActiveModel {
            id: Set(session_id.as_str().to_owned()),
            subscription_id: Set(sub.id.clone()),
            credential_id: Set(principal.credential_id.as_str().to_owned()),
            application_id: Set(principal.application_id.as_str().to_owned()),
            node_id: Set(node_id.as_str().to_owned()),
            capacity: Set(capacity as i32),
            opened_at: Set(t),
            closed_at: Set(None),
            close_code: Set(None),
            close_reason: Set(None),
            created_at: Set(t),
        })
        .exec_without_returning(txn)
        .await?;
        Ok(OpenSession::Opened {
            session_id,
            subscription: Box::new(sub),
        })
    })
    .await
}

/// Marks a session closed with the WebSocket close `code` and `reason`
/// (idempotent: the first close is kept). The history of a delivery the
/// session held shows them (decision 0081).
pub async fn close_session(
    db: &Database,
    session_id: &SessionId,
    code: u16,
    reason: &str,
) -> Result<(), StoreError> {
    db.write_alone(async |txn| {
        event_session::Entity::update_many()
            .col_expr(event_session::Column::ClosedAt, Expr::value(now().micros()))
            .col_expr(
                event_session::Column::CloseCode,
                Expr::value(i32::from(code)),
            )
            .col_expr(event_session::Column::CloseReason, Expr::value(reason))
            .filter(event_session::Column::Id.eq(session_id.as_str()))
            .filter(event_session::Column::ClosedAt.is_null())
            .exec(txn)
            .await?;
        Ok(())
    })
    .await
}

/// Closes every session still open for `node_id` (a node that restarts gets
/// a new id; this runs on graceful shutdown).
pub async fn close_node_sessions<C: ConnectionTrait>(
    conn: &C,
    node_id: &NodeId,
) -> Result<u64, StoreError> {
    Ok(event_session::Entity::update_many()
        .col_expr(event_session::Column::ClosedAt, Expr::value(now().micros()))
        .col_expr(event_session::Column::CloseCode, Expr::value(1001))
        .col_expr(
            event_session::Column::CloseReason,
            Expr::value("the node shut down"),
        )
        .filter(event_session::Column::NodeId.eq(node_id.as_str()))
        .filter(event_session::Column::ClosedAt.is_null())
        .exec(conn)
        .await?
        .rows_affected)
}
