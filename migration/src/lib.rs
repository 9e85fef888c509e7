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
