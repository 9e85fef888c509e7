//! ACK with a lease proof (spec: delivery-model.md §6).

use entity::{delivery, subscription};
use sea_orm::{ColumnTrait, DbErr, EntityTrait, ExprTrait, QueryFilter, sea_query::Expr};

use crate::{
    domain::{DeliveryId, DeliveryState, EventId, LeaseSecret, SubscriptionId, Timestamp, now},
    store::{
        Database,
        audit::{self, AuditActor, AuditEntry},
    },
};

/// A lease proof as presented by a consumer.
#[derive(Debug, Clone)]
pub struct LeaseProof {
    pub delivery_id: DeliveryId,
    pub epoch: u64,
    pub secret: LeaseSecret,
}

/// The answer to an ACK.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AckOutcome {
    /// Now (or already, `deduplicated`) ACKED; `acknowledged_at` is the
    /// original time of the first valid ACK.
    Acked {
        event_id: EventId,
        epoch: u64,
        acknowledged_at: Timestamp,
        deduplicated: bool,
    },
    /// Older epoch, wrong secret, never leased: the connection stays open.
    LeaseLost,
    /// Not a delivery of this subscription (unknown or another's).
    NotFound,
}

/// Acknowledges a delivery of `subscription_id` with `proof`:
/// - the latest proof on a LEASED, PENDING or EXPIRED row → ACKED,
///   `acknowledged_at = now`, `revision += 1`, `pending_count -= 1`, one
///   audit record;
/// - an ACKED row and the proof that acknowledged it → the original
///   `acknowledged_at`, `deduplicated`, nothing written;
/// - anything else → `LeaseLost`.
///
/// Proofs are compared by digest in constant time. The decision is read
/// first outside a write transaction: a consumer only holds a secret after
/// its lease committed, and an ACKED row never changes, so "lost" and
/// "duplicate" are final; only a matching proof takes the write path.
pub async fn acknowledge(
    db: &Database,
    subscription_id: &SubscriptionId,
    actor: &AuditActor,
    proof: &LeaseProof,
) -> Result<AckOutcome, DbErr> {
    let Some(row) = delivery::Entity::find_by_id(proof.delivery_id.as_str())
        .one(db.reader())
        .await?
    else {
        return Ok(AckOutcome::NotFound);
    };
    if row.subscription_id != subscription_id.as_str() {
        return Ok(AckOutcome::NotFound);
    }
    if !proof_matches(&row, proof) {
        return Ok(AckOutcome::LeaseLost);
    }
    if let Some(outcome) = already_acked(&row) {
        return Ok(outcome);
    }

    let txn = db.begin_write().await?;
    let at = now();
    let epoch = i64::try_from(proof.epoch).unwrap_or(i64::MAX);
    let updated = delivery::Entity::update_many()
        .col_expr(
            delivery::Column::State,
            Expr::value(DeliveryState::Acked.as_str()),
        )
        .col_expr(delivery::Column::AcknowledgedAt, Expr::value(at.micros()))
        .col_expr(
            delivery::Column::Revision,
            Expr::col(delivery::Column::Revision).add(1),
        )
        .col_expr(
            delivery::Column::LeaseUntil,
            Expr::value(Option::<i64>::None),
        )
        .col_expr(
            delivery::Column::LeaseSessionId,
            Expr::value(Option::<String>::None),
        )
        .filter(delivery::Column::Id.eq(row.id.as_str()))
        .filter(delivery::Column::LeaseEpoch.eq(epoch))
        .filter(delivery::Column::State.ne(DeliveryState::Acked.as_str()))
        .exec_with_returning(&txn)
        .await?;
    let Some(acked) = updated.into_iter().next() else {
        // A concurrent ACK or a new lease won; the row now tells which.
        drop(txn);
        let row = delivery::Entity::find_by_id(proof.delivery_id.as_str())
            .one(db.reader())
            .await?
            .ok_or_else(|| DbErr::RecordNotFound(proof.delivery_id.to_string()))?;
        return Ok(match proof_matches(&row, proof) {
            true => already_acked(&row).unwrap_or(AckOutcome::LeaseLost),
            false => AckOutcome::LeaseLost,
        });
    };
    subscription::Entity::update_many()
        .col_expr(
            subscription::Column::PendingCount,
            Expr::col(subscription::Column::PendingCount).sub(1),
        )
        .filter(subscription::Column::Id.eq(subscription_id.as_str()))
        .exec(&txn)
        .await?;
    audit::record(
        &txn,
        actor,
        AuditEntry {
            action: "delivery.ack",
            target_id: &acked.id,
            reason: None,
            before_revision: Some(acked.revision - 1),
            after_revision: Some(acked.revision),
            at,
        },
    )
    .await?;
    txn.commit().await?;
    Ok(AckOutcome::Acked {
        event_id: EventId::from_db(acked.event_id),
        epoch: proof.epoch,
        acknowledged_at: at,
        deduplicated: false,
    })
}

/// The proof is the row's latest: same epoch (≥ 1) and the secret's digest
/// equals the stored one (constant time).
fn proof_matches(row: &delivery::Model, proof: &LeaseProof) -> bool {
    let epoch_ok = u64::try_from(row.lease_epoch).is_ok_and(|e| e >= 1 && e == proof.epoch);
    let digest_ok = row
        .lease_digest
        .as_deref()
        .is_some_and(|d| proof.secret.matches_digest(d));
    epoch_ok & digest_ok
}

fn already_acked(row: &delivery::Model) -> Option<AckOutcome> {
    (row.state == DeliveryState::Acked.as_str()).then(|| AckOutcome::Acked {
        event_id: EventId::from_db(row.event_id.clone()),
        epoch: u64::try_from(row.lease_epoch).unwrap_or(0),
        acknowledged_at: Timestamp(row.acknowledged_at.unwrap_or(0)),
        deduplicated: true,
    })
}
