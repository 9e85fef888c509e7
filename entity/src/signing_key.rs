//! `signing_keys` table. Spec: delivery-model.md §2. Not in §2: list cursors are HMAC-signed with a key all nodes share (http-api.md §3).

use sea_orm::entity::prelude::*;

#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
#[sea_orm(table_name = "signing_keys")]
pub struct Model {
    #[sea_orm(primary_key, auto_increment = false)]
    pub id: String,
    /// What the key signs, e.g. `list-cursor`.
    #[sea_orm(unique)]
    pub purpose: String,
    /// base64url key material; shared by every node through the database.
    pub secret: String,
    pub created_at: i64,
}

#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub enum Relation {}

impl ActiveModelBehavior for ActiveModel {}
