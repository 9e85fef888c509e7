//! `audit_records` table. Spec: delivery-model.md §2.

use sea_orm::entity::prelude::*;

#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
#[sea_orm(table_name = "audit_records")]
pub struct Model {
    #[sea_orm(primary_key, auto_increment = false)]
    pub id: String,
    pub namespace_id: String,
    pub credential_id: String,
    pub action: String,
    pub target_id: String,
    pub reason: Option<String>,
    pub before_revision: Option<i64>,
    pub after_revision: Option<i64>,
    pub at: i64,
    pub created_at: i64,
}

#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub enum Relation {}

impl ActiveModelBehavior for ActiveModel {}
