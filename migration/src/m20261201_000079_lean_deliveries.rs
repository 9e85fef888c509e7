//! The lean delivery row (issue 18, decision 0079): the ACK recorded on the
//! row (`ack_epoch`, `ack_session_id`), and partial indexes over the rows
//! each hot query reads, so that a row leaves the claim and lease indexes
//! once it is ACKED instead of moving inside full `(state, …)` indexes.
//!
//! The hot statements name their states as literals (`state = 'PENDING'`):
//! a partial index serves only a query whose `WHERE` implies its own, and a
//! bound parameter implies nothing to either planner.

use sea_orm_migration::prelude::*;

#[derive(DeriveMigrationName)]
pub struct Migration;

/// `(name, CREATE INDEX …)` of the partial indexes, the same text on both
/// backends.
const PARTIAL: [(&str, &str); 5] = [
    // A subscription's claimable rows in claim order.
    (
        "ix_deliveries_pending_claim",
        "CREATE INDEX ix_deliveries_pending_claim ON deliveries \
         (subscription_id, sequence, id) WHERE state = 'PENDING'",
    ),
    // A session's live leases.
    (
        "ix_deliveries_leased_session",
        "CREATE INDEX ix_deliveries_leased_session ON deliveries \
         (lease_session_id, lease_until) WHERE state = 'LEASED'",
    ),
    // Lapsed leases, oldest first (the sweeper and each claim's recovery).
    (
        "ix_deliveries_leased_until",
        "CREATE INDEX ix_deliveries_leased_until ON deliveries \
         (lease_until) WHERE state = 'LEASED'",
    ),
    // Retention: ACKED rows by the time of their ACK.
    (
        "ix_deliveries_acked_at",
        "CREATE INDEX ix_deliveries_acked_at ON deliveries \
         (acknowledged_at) WHERE state = 'ACKED'",
    ),
    // The backlog's oldest EXPIRED row per subscription (rare rows: only
    // deliveries that exhausted their attempts).
    (
        "ix_deliveries_expired_created",
        "CREATE INDEX ix_deliveries_expired_created ON deliveries \
         (subscription_id, created_at) WHERE state = 'EXPIRED'",
    ),
];

/// The full indexes the partial ones replace: `(name, columns)`.
const REPLACED: [(&str, &[Deliveries]); 4] = [
    (
        "ix_deliveries_claim_order",
        &[
            Deliveries::SubscriptionId,
            Deliveries::State,
            Deliveries::Sequence,
            Deliveries::Id,
        ],
    ),
    (
        "ix_deliveries_session_lease",
        &[
            Deliveries::LeaseSessionId,
            Deliveries::State,
            Deliveries::LeaseUntil,
        ],
    ),
    (
        "ix_deliveries_state_lease_until",
        &[Deliveries::State, Deliveries::LeaseUntil],
    ),
    (
        "ix_deliveries_state_acknowledged",
        &[Deliveries::State, Deliveries::AcknowledgedAt],
    ),
];

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        // One column per statement: SQLite's ALTER TABLE adds one at a time.
        for column in [Deliveries::AckEpoch, Deliveries::AckSessionId] {
            let mut def = ColumnDef::new(column.clone());
            match column {
                Deliveries::AckEpoch => def.big_integer().null(),
                _ => def.string().null(),
            };
            manager
                .alter_table(
                    Table::alter()
                        .table(Deliveries::Table)
                        .add_column(&mut def)
                        .to_owned(),
                )
                .await?;
        }
        // Rows ACKED before this migration were acknowledged at their last
        // lease's epoch; the session that sent the ACK was not recorded.
        manager
            .get_connection()
            .execute_unprepared(
                "UPDATE deliveries SET ack_epoch = lease_epoch WHERE state = 'ACKED'",
            )
            .await?;
        let db = manager.get_connection();
        for (_, create) in PARTIAL {
            db.execute_unprepared(create).await?;
        }
        for (name, _) in REPLACED {
            drop_index(manager, name).await?;
        }
        Ok(())
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        for (name, columns) in REPLACED {
            let mut index = Index::create();
            index.name(name).table(Deliveries::Table);
            for column in columns {
                index.col(column.clone());
            }
            manager.create_index(index.to_owned()).await?;
        }
        for (name, _) in PARTIAL {
            drop_index(manager, name).await?;
        }
        for column in [Deliveries::AckSessionId, Deliveries::AckEpoch] {
            manager
                .alter_table(
                    Table::alter()
                        .table(Deliveries::Table)
                        .drop_column(column)
                        .to_owned(),
                )
                .await?;
        }
        Ok(())
    }
}

async fn drop_index(manager: &SchemaManager<'_>, name: &str) -> Result<(), DbErr> {
    manager
        .drop_index(Index::drop().name(name).table(Deliveries::Table).to_owned())
        .await
}

#[derive(DeriveIden, Clone)]
enum Deliveries {
    Table,
    Id,
    SubscriptionId,
    State,
    Sequence,
    LeaseSessionId,
    LeaseUntil,
    AcknowledgedAt,
    AckEpoch,
    AckSessionId,
}
