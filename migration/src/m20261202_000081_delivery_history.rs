//! Delivery history (issue 19, decision 0081): the steps of a delivery that
//! its row cannot show. A delivery leased once and ACKed writes nothing
//! here (its lease and its ACK are read off the row, which now keeps
//! `leased_at`); a row is written only when a lease ends without ACK, an
//! ACK is refused, or an admin retries. Sessions keep how they closed, so
//! a lease can say that its session went away while holding it.

use sea_orm_migration::{prelude::*, schema::*};

#[derive(DeriveMigrationName)]
pub struct Migration;

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        // One column per statement: SQLite's ALTER TABLE adds one at a time.
        add_column(
            manager,
            Deliveries::Table,
            big_integer_null(Deliveries::LeasedAt),
        )
        .await?;
        add_column(
            manager,
            EventSessions::Table,
            integer_null(EventSessions::CloseCode),
        )
        .await?;
        add_column(
            manager,
            EventSessions::Table,
            string_null(EventSessions::CloseReason),
        )
        .await?;
        manager
            .create_table(
                Table::create()
                    .table(DeliveryHistory::Table)
                    .col(
                        big_integer(DeliveryHistory::Id)
                            .auto_increment()
                            .primary_key(),
                    )
                    .col(string(DeliveryHistory::DeliveryId))
                    .col(string(DeliveryHistory::Step))
                    .col(big_integer(DeliveryHistory::At))
                    .col(big_integer(DeliveryHistory::LeaseEpoch))
                    .col(string_null(DeliveryHistory::SessionId))
                    .col(big_integer_null(DeliveryHistory::LeasedAt))
                    .col(big_integer_null(DeliveryHistory::LeaseUntil))
                    .col(string_null(DeliveryHistory::StateAfter))
                    .col(integer(DeliveryHistory::Attempts))
                    .col(integer(DeliveryHistory::AttemptBudget))
                    .col(string_null(DeliveryHistory::AuditId))
                    .col(integer_null(DeliveryHistory::AdditionalAttempts))
                    .to_owned(),
            )
            .await?;
        manager
            .create_index(
                Index::create()
                    .name("ix_delivery_history_delivery")
                    .table(DeliveryHistory::Table)
                    .col(DeliveryHistory::DeliveryId)
                    .col(DeliveryHistory::Id)
                    .to_owned(),
            )
            .await?;
        // The sessions bound to a subscription (its status).
        manager
            .create_index(
                Index::create()
                    .name("ix_event_sessions_subscription")
                    .table(EventSessions::Table)
                    .col(EventSessions::SubscriptionId)
                    .col(EventSessions::ClosedAt)
                    .to_owned(),
            )
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .drop_index(
                Index::drop()
                    .name("ix_event_sessions_subscription")
                    .table(EventSessions::Table)
                    .to_owned(),
            )
            .await?;
        manager
            .drop_table(Table::drop().table(DeliveryHistory::Table).to_owned())
            .await?;
        for (table, column) in [
            (EventSessions::Table, EventSessions::CloseReason),
            (EventSessions::Table, EventSessions::CloseCode),
        ] {
            drop_column(manager, table, column).await?;
        }
        drop_column(manager, Deliveries::Table, Deliveries::LeasedAt).await
    }
}

async fn add_column<T: IntoIden + 'static>(
    manager: &SchemaManager<'_>,
    table: T,
    mut column: ColumnDef,
) -> Result<(), DbErr> {
    manager
        .alter_table(
            Table::alter()
                .table(table)
                .add_column(&mut column)
                .to_owned(),
        )
        .await
}

async fn drop_column<T: IntoIden + 'static, C: IntoIden + 'static>(
    manager: &SchemaManager<'_>,
    table: T,
    column: C,
) -> Result<(), DbErr> {
    manager
        .alter_table(Table::alter().table(table).drop_column(column).to_owned())
        .await
}

#[derive(DeriveIden)]
enum Deliveries {
    Table,
    LeasedAt,
}

#[derive(DeriveIden)]
enum EventSessions {
    Table,
    SubscriptionId,
    ClosedAt,
    CloseCode,
    CloseReason,
}

#[derive(DeriveIden)]
enum DeliveryHistory {
    Table,
    Id,
    DeliveryId,
    Step,
    At,
    LeaseEpoch,
    SessionId,
    LeasedAt,
    LeaseUntil,
    StateAfter,
    Attempts,
    AttemptBudget,
    AuditId,
    AdditionalAttempts,
}
