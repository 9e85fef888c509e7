//! `idempotency_records` table. Spec: delivery-model.md §2. Spec: http-api.md §2.

use sea_orm::entity::prelude::*;

#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
#[sea_orm(table_name = "idempotency_records")]
pub struct Model {
    #[sea_orm(primary_key, auto_increment = false)]
    pub id: String,
    pub credential_id: String,
    pub key: String,
    pub operation: String,
    pub target: String,
    /// Lowercase hex SHA-256 of the normalized request.
    pub request_digest: String,
    pub status: i32,
    /// The response `data` as JSON text.
    #[sea_orm(column_type = "Text")]
    pub response: String,
    pub expires_at: i64,
    pub created_at: i64,
}

#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub enum Relation {}

impl ActiveModelBehavior for ActiveModel {}
