//! `result_events` table. Spec: delivery-model.md §2. The result log (journal), §3.

use sea_orm::entity::prelude::*;

#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
#[sea_orm(table_name = "result_events")]
pub struct Model {
    #[sea_orm(primary_key, auto_increment = false)]
    pub id: String,
    pub queue_id: String,
    pub sequence: i64,
    #[sea_orm(column_name = "type")]
    pub event_type: String,
    pub aggregate_kind: String,
    pub aggregate_id: String,
    /// Canonical uint64 decimal string, carried as given by the producer.
    pub aggregate_revision: String,
    pub occurred_at: i64,
    /// JSON object text.
    #[sea_orm(column_type = "Text")]
    pub details: String,
    /// JSON object text, byte-exact as appended.
    #[sea_orm(column_type = "Text")]
    pub snapshot: String,
    pub appended_at: i64,
    pub created_at: i64,
}

#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub enum Relation {}

impl ActiveModelBehavior for ActiveModel {}
