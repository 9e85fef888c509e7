//! `write_probes`: the scratch rows of `/readyz`'s write probe (decision
//! 0076). While the database refuses writes, the probe inserts one row
//! that needs new pages and deletes it in the same transaction, so its
//! commit fails exactly when the file cannot grow or be written; the table
//! is empty outside that transaction.

use sea_orm_migration::prelude::*;

#[derive(DeriveMigrationName)]
pub struct Migration;

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .create_table(
                Table::create()
                    .table(WriteProbes::Table)
                    .col(
                        ColumnDef::new(WriteProbes::NodeId)
                            .string()
                            .not_null()
                            .primary_key(),
                    )
                    .col(ColumnDef::new(WriteProbes::Payload).blob().not_null())
                    .to_owned(),
            )
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .drop_table(Table::drop().table(WriteProbes::Table).to_owned())
            .await
    }
}

#[derive(DeriveIden)]
enum WriteProbes {
    Table,
    NodeId,
    Payload,
}
