//! The idempotency records' unique index leads with `key` (decision 0091).
//!
//! Under `(credential_id, key)` PostgreSQL, with statistics taken while a
//! credential had few records, looked a publish batch's keys up by the
//! credential alone and filtered every record it held: 1–9 ms per batch
//! after a few thousand publishes, growing with the records. With `key`
//! first, every plan that uses the index looks each key up.

use sea_orm_migration::prelude::*;

#[derive(DeriveMigrationName)]
pub struct Migration;

const OLD: &str = "ux_idempotency_records_credential_key";
const NEW: &str = "ux_idempotency_records_key_credential";

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        // The new index first: uniqueness holds at every step.
        replace(
            manager,
            OLD,
            NEW,
            &[IdempotencyRecords::Key, IdempotencyRecords::CredentialId],
        )
        .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        replace(
            manager,
            NEW,
            OLD,
            &[IdempotencyRecords::CredentialId, IdempotencyRecords::Key],
        )
        .await
    }
}

async fn replace(
    manager: &SchemaManager<'_>,
    old: &str,
    new: &str,
    cols: &[IdempotencyRecords],
) -> Result<(), DbErr> {
    let mut create = Index::create();
    create.name(new).table(IdempotencyRecords::Table).unique();
    for col in cols {
        create.col(*col);
    }
    manager.create_index(create.to_owned()).await?;
    manager
        .drop_index(
            Index::drop()
                .name(old)
                .table(IdempotencyRecords::Table)
                .to_owned(),
        )
        .await
}

#[derive(DeriveIden, Clone, Copy)]
enum IdempotencyRecords {
    Table,
    CredentialId,
    Key,
}
