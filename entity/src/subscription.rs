//! `subscriptions` table. Spec: delivery-model.md §2.

use sea_orm::entity::prelude::*;

#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
#[sea_orm(table_name = "subscriptions")]
pub struct Model {
    #[sea_orm(primary_key, auto_increment = false)]
    pub id: String,
    pub namespace_id: String,
    pub application_id: String,
    pub credential_id: String,
    pub queue_id: String,
    pub name: String,
    pub revision: i64,
    pub enabled: bool,
    /// Canonical comma-separated list of subscribed result types.
    pub types: String,
    pub cursor_sequence: i64,
    /// Deliveries in PENDING, LEASED or EXPIRED; bounded by `max_pending`.
    pub pending_count: i64,
    pub max_pending: i32,
    pub max_attempts: i32,
    pub created_at: i64,
    pub updated_at: i64,
}

#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub enum Relation {}

impl ActiveModelBehavior for ActiveModel {}
