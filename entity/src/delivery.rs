//! `deliveries` table. Spec: delivery-model.md §2. State machine: §6.

use sea_orm::entity::prelude::*;

pub use orbit_events_wire::DeliveryState;

#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
#[sea_orm(table_name = "deliveries")]
pub struct Model {
    #[sea_orm(primary_key, auto_increment = false)]
    pub id: String,
    pub subscription_id: String,
    pub event_id: String,
    pub sequence: i64,
    pub revision: i64,
    /// `PENDING | LEASED | ACKED | EXPIRED`, stored as that text.
    pub state: DeliveryState,
    pub available_at: i64,
    pub lease_epoch: i64,
    /// When the latest lease began; kept after it ends (its history).
    pub leased_at: Option<i64>,
    pub lease_until: Option<i64>,
    /// Lowercase hex SHA-256 of the latest lease secret; never returned or logged.
    pub lease_digest: Option<String>,
    pub lease_session_id: Option<String>,
    pub attempts: i32,
    pub attempt_budget: i32,
    /// Set once, by the first valid ACK (the row is immutable once ACKED).
    pub acknowledged_at: Option<i64>,
    /// The lease epoch the ACK proved (delivery-model.md §2).
    pub ack_epoch: Option<i64>,
    /// The session the ACK came on when it is not `lease_session_id` (an
    /// ACK on the leasing session leaves it NULL, decision 0081); absent
    /// too for rows ACKED before migration 0079, which recorded neither.
    pub ack_session_id: Option<String>,
    pub created_at: i64,
}

#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub enum Relation {}

impl ActiveModelBehavior for ActiveModel {}
