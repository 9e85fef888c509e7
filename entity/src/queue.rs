//! `queues` table. Spec: delivery-model.md §2.

use sea_orm::entity::prelude::*;

#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
#[sea_orm(table_name = "queues")]
pub struct Model {
    #[sea_orm(primary_key, auto_increment = false)]
    pub id: String,
    pub namespace_id: String,
    pub name: String,
    /// Committed head of the result log: the highest sequence appended.
    pub head_sequence: i64,
    /// Highest purged sequence (0 when nothing was purged).
    pub retention_floor: i64,
    pub created_at: i64,
}

#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub enum Relation {}

impl ActiveModelBehavior for ActiveModel {}
