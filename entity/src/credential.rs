//! `credentials` table. Spec: delivery-model.md §2.

use sea_orm::entity::prelude::*;

#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
#[sea_orm(table_name = "credentials")]
pub struct Model {
    #[sea_orm(primary_key, auto_increment = false)]
    pub id: String,
    pub namespace_id: String,
    pub application_id: String,
    /// Lowercase hex SHA-256 of the bearer token; the token itself is never stored.
    #[sea_orm(unique)]
    pub token_digest: String,
    /// JSON array of permission names, e.g. `["events:read"]`.
    pub permissions: String,
    /// JSON array of queue ids the credential may touch.
    pub queue_scope: String,
    pub revoked_at: Option<i64>,
    pub created_at: i64,
}

#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub enum Relation {}

impl ActiveModelBehavior for ActiveModel {}
