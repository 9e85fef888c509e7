//! Drops `ix_deliveries_event (event_id, state)` (issue 8, decision 0067).
//!
//! Its only reader was retention's "is this entry still referenced by a
//! non-ACKED delivery", which now looks the entries up through
//! `ux_deliveries_subscription_event` for the queue's subscriptions. Event
//! ids are random, so every claim and every ACK moved one entry of this
//! index to a random leaf page: a WAL profile of a full-speed run counted
//! 27 % of all written pages here.

use sea_orm_migration::prelude::*;

#[derive(DeriveMigrationName)]
pub struct Migration;

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .drop_index(
                Index::drop()
                    .name("ix_deliveries_event")
                    .table(Deliveries::Table)
                    .to_owned(),
            )
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .create_index(
                Index::create()
                    .name("ix_deliveries_event")
                    .table(Deliveries::Table)
                    .col(Deliveries::EventId)
                    .col(Deliveries::State)
                    .to_owned(),
            )
            .await
    }
}

#[derive(DeriveIden)]
enum Deliveries {
    Table,
    EventId,
    State,
}
