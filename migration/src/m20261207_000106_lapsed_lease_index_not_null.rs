//! `ix_deliveries_leased_until` over LEASED rows whose `lease_until` is set
//! (decision 0106).
//!
//! Every LEASED row has a `lease_until`, so the index holds the same rows.
//! What changes is which statements may read it: the lapse scans (`lease_until
//! <= now`) still imply the new predicate on both backends, but the count of
//! a session's live leases, written as the row comparison
//! `(lease_session_id, lease_until) > (session, now)`, does not. On
//! PostgreSQL that count had used this index's range above now, which also
//! holds the old version of every row ACKED since the last VACUUM (4.3 ms,
//! 2,008 heap pages at 36,334 entries in a benchmark run).
//!
//! One transaction on both backends, as in 0100.

use sea_orm_migration::prelude::*;

#[derive(DeriveMigrationName)]
pub struct Migration;

const NAME: &str = "ix_deliveries_leased_until";

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    fn use_transaction(&self) -> Option<bool> {
        Some(true)
    }

    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        recreate(manager, " AND lease_until IS NOT NULL").await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        recreate(manager, "").await
    }
}

async fn recreate(manager: &SchemaManager<'_>, predicate: &str) -> Result<(), DbErr> {
    let db = manager.get_connection();
    db.execute_unprepared(&format!("DROP INDEX {NAME}")).await?;
    db.execute_unprepared(&format!(
        "CREATE INDEX {NAME} ON deliveries (lease_until) WHERE state = 'LEASED'{predicate}"
    ))
    .await?;
    Ok(())
}
