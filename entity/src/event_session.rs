//! `event_sessions` table. Spec: delivery-model.md §2.

use sea_orm::entity::prelude::*;

#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
#[sea_orm(table_name = "event_sessions")]
pub struct Model {
    #[sea_orm(primary_key, auto_increment = false)]
    pub id: String,
    pub subscription_id: String,
    pub credential_id: String,
    pub application_id: String,
    pub node_id: String,
    pub capacity: i32,
    pub opened_at: i64,
    pub closed_at: Option<i64>,
    /// The WebSocket close code the node sent or saw (1006: the peer went
    /// away without a close frame).
    pub close_code: Option<i32>,
    pub close_reason: Option<String>,
    pub created_at: i64,
}

#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub enum Relation {}

impl ActiveModelBehavior for ActiveModel {}
