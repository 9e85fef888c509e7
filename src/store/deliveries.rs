//! Deliveries as the API shows them (spec: http-api.md §3 "Deliveries").

use entity::delivery;
use serde::Serialize;

use crate::domain::{DeliveryState, Timestamp};

/// `EventDelivery`: absent fields are omitted, never null; no lease secret
/// or digest ever appears here.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct DeliveryView {
    pub id: String,
    pub subscription_id: String,
    pub event_id: String,
    /// uint64 string.
    pub sequence: String,
    /// uint64 string.
    pub revision: String,
    pub state: String,
    pub created_at: Timestamp,
    pub available_at: Timestamp,
    /// uint64 string; "0" when never leased.
    pub lease_epoch: String,
    /// Only in state LEASED.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lease_until: Option<Timestamp>,
    pub attempts: i32,
    pub attempt_budget: i32,
    /// Only in state ACKED.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub acknowledged_at: Option<Timestamp>,
}

impl From<&delivery::Model> for DeliveryView {
    fn from(m: &delivery::Model) -> DeliveryView {
        let state = DeliveryState::parse(&m.state);
        DeliveryView {
            id: m.id.clone(),
            subscription_id: m.subscription_id.clone(),
            event_id: m.event_id.clone(),
            sequence: m.sequence.to_string(),
            revision: m.revision.to_string(),
            state: m.state.clone(),
            created_at: Timestamp(m.created_at),
            available_at: Timestamp(m.available_at),
            lease_epoch: m.lease_epoch.to_string(),
            lease_until: m
                .lease_until
                .filter(|_| state == Some(DeliveryState::Leased))
                .map(Timestamp),
            attempts: m.attempts,
            attempt_budget: m.attempt_budget,
            acknowledged_at: m
                .acknowledged_at
                .filter(|_| state == Some(DeliveryState::Acked))
                .map(Timestamp),
        }
    }
}
