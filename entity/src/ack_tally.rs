//! `subscription_ack_tallies` table: ACKs of a subscription not yet folded
//! into its `pending_count` (decision 0094). PostgreSQL only writes them:
//! an ACK batch inserts one row per subscription instead of updating the
//! subscription row, whose lock a claim holds through its commit.

use sea_orm::entity::prelude::*;

#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
#[sea_orm(table_name = "subscription_ack_tallies")]
pub struct Model {
    /// Insert order.
    #[sea_orm(primary_key)]
    pub id: i64,
    pub subscription_id: String,
    /// Deliveries of the subscription one ACK batch moved to ACKED (≥ 1).
    pub acked: i64,
}

#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub enum Relation {}

impl ActiveModelBehavior for ActiveModel {}
