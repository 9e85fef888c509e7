//! Schema migrations of orbit-events (sea-orm-migration).
//!
//! One file per migration; a migration is never edited after it has landed:
//! changes go into a new file appended to [`Migrator::migrations`].

pub use sea_orm_migration::prelude::*;

mod m20261130_000001_initial;
mod m20261130_000065_hot_path_indexes;
mod m20261130_000066_event_index_without_state;
mod m20261201_000076_write_probes;
mod m20261201_000079_lean_deliveries;
mod m20261202_000081_delivery_history;
mod m20261202_000087_outbox_function;
mod m20261203_000091_idempotency_key_first;
mod m20261204_000094_ack_tallies;
mod m20261206_000100_listing_indexes_in_insert_order;
mod m20261207_000106_lapsed_lease_index_not_null;
mod m20261207_000108_claim_function;
mod m20261207_000110_publish_function;
mod m20261207_000111_publish_alone;
mod m20261207_000112_lean_claim_function;
mod m20261207_000113_claim_reads_a_fresh_head;

/// Applies the migrations in order; used by `orbit-events migrate` and on `serve`.
pub struct Migrator;

#[async_trait::async_trait]
impl MigratorTrait for Migrator {
    fn migrations() -> Vec<Box<dyn MigrationTrait>> {
        vec![
            Box::new(m20261130_000001_initial::Migration),
            Box::new(m20261130_000065_hot_path_indexes::Migration),
            Box::new(m20261130_000066_event_index_without_state::Migration),
            Box::new(m20261201_000076_write_probes::Migration),
            Box::new(m20261201_000079_lean_deliveries::Migration),
            Box::new(m20261202_000081_delivery_history::Migration),
            Box::new(m20261202_000087_outbox_function::Migration),
            Box::new(m20261203_000091_idempotency_key_first::Migration),
            Box::new(m20261204_000094_ack_tallies::Migration),
            Box::new(m20261206_000100_listing_indexes_in_insert_order::Migration),
            Box::new(m20261207_000106_lapsed_lease_index_not_null::Migration),
            Box::new(m20261207_000108_claim_function::Migration),
            Box::new(m20261207_000110_publish_function::Migration),
            Box::new(m20261207_000111_publish_alone::Migration),
            Box::new(m20261207_000112_lean_claim_function::Migration),
            Box::new(m20261207_000113_claim_reads_a_fresh_head::Migration),
        ]
    }
}

/// Runs `sql` on PostgreSQL and nothing on SQLite: the server-side
/// functions of the hot path (migrations 0108 on) exist on PostgreSQL only.
async fn on_postgres(manager: &SchemaManager<'_>, sql: &str) -> Result<(), DbErr> {
    use sea_orm_migration::sea_orm::{ConnectionTrait, DbBackend};
    let db = manager.get_connection();
    if db.get_database_backend() == DbBackend::Postgres {
        db.execute_unprepared(sql).await?;
    }
    Ok(())
}

/// `base` (an earlier migration's function text) with each `(from, to)`
/// of `edits` applied, in order; `Err` naming `migration` when a `from` is
/// not in the text exactly once, so that a function built from another
/// never differs from it silently.
fn edited<'a>(
    migration: &str,
    base: &str,
    edits: impl IntoIterator<Item = (&'a str, String)>,
) -> Result<String, DbErr> {
    let mut text = base.to_owned();
    for (from, to) in edits {
        if text.matches(from).count() != 1 {
            return Err(DbErr::Migration(format!(
                "migration {migration}: the text it edits does not hold {from:?} once"
            )));
        }
        text = text.replacen(from, &to, 1);
    }
    Ok(text)
}
