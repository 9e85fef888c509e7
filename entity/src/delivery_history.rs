//! `delivery_history` table: the steps a delivery row cannot show (issue
//! 19, decision 0081). Spec: http-api.md "Delivery history".

use sea_orm::entity::prelude::*;

#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
#[sea_orm(table_name = "delivery_history")]
pub struct Model {
    /// Insert order; the public history is ordered by time.
    #[sea_orm(primary_key)]
    pub id: i64,
    pub delivery_id: String,
    /// `LEASE_LAPSED | ACK_REFUSED | RETRIED`.
    pub step: String,
    /// When the step happened (µs since the Unix epoch).
    pub at: i64,
    /// The lapsed lease's epoch, the epoch a refused ACK offered, or the
    /// delivery's epoch at a retry.
    pub lease_epoch: i64,
    /// The lapsed lease's session, or the session of a refused ACK.
    pub session_id: Option<String>,
    pub leased_at: Option<i64>,
    pub lease_until: Option<i64>,
    /// `PENDING | EXPIRED` after a lapse, `PENDING` after a retry.
    pub state_after: Option<String>,
    /// The delivery's attempts and budget after the step.
    pub attempts: i32,
    pub attempt_budget: i32,
    /// The audit record of an admin's retry (credential, reason).
    pub audit_id: Option<String>,
    pub additional_attempts: Option<i32>,
}

#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub enum Relation {}

impl ActiveModelBehavior for ActiveModel {}
