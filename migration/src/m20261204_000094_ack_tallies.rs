//! ACK tallies: what an ACK batch subtracts from `pending_count`, kept
//! beside the subscription row until the next materialization folds it in
//! (decision 0094). A tally is read and deleted by the subscription id.

use sea_orm_migration::{prelude::*, schema::*};

#[derive(DeriveMigrationName)]
pub struct Migration;

const INDEX: &str = "ix_subscription_ack_tallies_subscription";

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .create_table(
                Table::create()
                    .table(SubscriptionAckTallies::Table)
                    .col(
                        big_integer(SubscriptionAckTallies::Id)
                            .auto_increment()
                            .primary_key(),
                    )
                    .col(string(SubscriptionAckTallies::SubscriptionId))
                    .col(big_integer(SubscriptionAckTallies::Acked))
                    .to_owned(),
            )
            .await?;
        manager
            .create_index(
                Index::create()
                    .name(INDEX)
                    .table(SubscriptionAckTallies::Table)
                    .col(SubscriptionAckTallies::SubscriptionId)
                    .to_owned(),
            )
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        // Folded first: the tallies are part of `pending_count`.
        let db = manager.get_connection();
        db.execute_unprepared(
            "UPDATE subscriptions SET pending_count = pending_count - \
             (SELECT COALESCE(SUM(t.acked), 0) FROM subscription_ack_tallies t \
             WHERE t.subscription_id = subscriptions.id)",
        )
        .await?;
        manager
            .drop_table(
                Table::drop()
                    .table(SubscriptionAckTallies::Table)
                    .to_owned(),
            )
            .await
    }
}

#[derive(DeriveIden)]
enum SubscriptionAckTallies {
    Table,
    Id,
    SubscriptionId,
    Acked,
}
