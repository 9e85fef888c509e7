//! Indexes that keep the hot paths index range scans however long the
//! history grows (issue 8, decision 0065): each replaces a plan that walked
//! more rows than it returns.

use sea_orm_migration::prelude::*;

#[derive(DeriveMigrationName)]
pub struct Migration;

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        // Claims read a subscription's PENDING rows in (sequence, id) order
        // with a LIMIT: in index order the scan stops after the rows it
        // leases. `ix_deliveries_claim` ended in (available_at, sequence),
        // so every claim sorted all of the subscription's PENDING rows.
        // `available_at` is never later than now (materialization, lease
        // recovery and retry all set it to a past time), so leaving it to a
        // filter skips nothing.
        manager
            .create_index(
                Index::create()
                    .name("ix_deliveries_claim_order")
                    .table(Deliveries::Table)
                    .col(Deliveries::SubscriptionId)
                    .col(Deliveries::State)
                    .col(Deliveries::Sequence)
                    .col(Deliveries::Id)
                    .to_owned(),
            )
            .await?;
        drop_index(manager, "ix_deliveries_claim").await?;

        // A claim counts the session's live leases (lease_session_id, state
        // LEASED, lease_until > now): with lease_until in the index both
        // planners take it instead of walking every live lease of the node
        // through (state, lease_until).
        manager
            .create_index(
                Index::create()
                    .name("ix_deliveries_session_lease")
                    .table(Deliveries::Table)
                    .col(Deliveries::LeaseSessionId)
                    .col(Deliveries::State)
                    .col(Deliveries::LeaseUntil)
                    .to_owned(),
            )
            .await?;
        drop_index(manager, "ix_deliveries_session_state").await?;

        // The deliveries listing filtered by state, newest first: without
        // it the listing walks every ACKED delivery of the subscription to
        // find a page of PENDING ones.
        manager
            .create_index(
                Index::create()
                    .name("ix_deliveries_subscription_state_created")
                    .table(Deliveries::Table)
                    .col(Deliveries::SubscriptionId)
                    .col(Deliveries::State)
                    .col((Deliveries::CreatedAt, IndexOrder::Desc))
                    .col((Deliveries::Id, IndexOrder::Desc))
                    .to_owned(),
            )
            .await?;
        Ok(())
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        drop_index(manager, "ix_deliveries_subscription_state_created").await?;
        manager
            .create_index(
                Index::create()
                    .name("ix_deliveries_session_state")
                    .table(Deliveries::Table)
                    .col(Deliveries::LeaseSessionId)
                    .col(Deliveries::State)
                    .to_owned(),
            )
            .await?;
        drop_index(manager, "ix_deliveries_session_lease").await?;
        manager
            .create_index(
                Index::create()
                    .name("ix_deliveries_claim")
                    .table(Deliveries::Table)
                    .col(Deliveries::SubscriptionId)
                    .col(Deliveries::State)
                    .col(Deliveries::AvailableAt)
                    .col(Deliveries::Sequence)
                    .to_owned(),
            )
            .await?;
        drop_index(manager, "ix_deliveries_claim_order").await
    }
}

async fn drop_index(manager: &SchemaManager<'_>, name: &str) -> Result<(), DbErr> {
    manager
        .drop_index(Index::drop().name(name).table(Deliveries::Table).to_owned())
        .await
}

#[derive(DeriveIden, Clone, Copy)]
enum Deliveries {
    Table,
    SubscriptionId,
    State,
    Sequence,
    Id,
    LeaseSessionId,
    LeaseUntil,
    CreatedAt,
    AvailableAt,
}
