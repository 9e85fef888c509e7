//! The deliveries listing's two indexes in ascending order (decision 0100).
//!
//! `ix_deliveries_subscription_created` and
//! `ix_deliveries_subscription_state_created` were `created_at DESC, id
//! DESC`, so every new delivery went to the left end of its subscription's
//! range. SQLite's rebalancing packs cells into the left pages, so the page
//! that takes every new entry at its left end is full again right after a
//! split; at the right end the last page keeps the room (measured: 4.1 →
//! 2.25 of these indexes' pages per commit). The listing reads the same
//! indexes backwards for its newest-first order.
//!
//! One transaction on both backends: on SQLite, too, a node stopped half way
//! leaves both indexes as they were, and the next start runs it again.

use sea_orm_migration::prelude::*;

#[derive(DeriveMigrationName)]
pub struct Migration;

/// `(name, with state)` of the two indexes.
const INDEXES: [(&str, bool); 2] = [
    ("ix_deliveries_subscription_created", false),
    ("ix_deliveries_subscription_state_created", true),
];

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    fn use_transaction(&self) -> Option<bool> {
        Some(true)
    }

    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        for (name, state) in INDEXES {
            recreate(manager, name, state, IndexOrder::Asc).await?;
        }
        Ok(())
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        for (name, state) in INDEXES {
            recreate(manager, name, state, IndexOrder::Desc).await?;
        }
        Ok(())
    }
}

async fn recreate(
    manager: &SchemaManager<'_>,
    name: &str,
    state: bool,
    order: IndexOrder,
) -> Result<(), DbErr> {
    manager
        .drop_index(Index::drop().name(name).table(Deliveries::Table).to_owned())
        .await?;
    let mut index = Index::create();
    index
        .name(name)
        .table(Deliveries::Table)
        .col(Deliveries::SubscriptionId);
    if state {
        index.col(Deliveries::State);
    }
    index
        .col((Deliveries::CreatedAt, order.clone()))
        .col((Deliveries::Id, order));
    manager.create_index(index.to_owned()).await
}

#[derive(DeriveIden)]
enum Deliveries {
    Table,
    SubscriptionId,
    State,
    CreatedAt,
    Id,
}
