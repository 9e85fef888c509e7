//! Delivery states (spec: delivery-model.md §6).

/// `PENDING | LEASED | ACKED | EXPIRED`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DeliveryState {
    Pending,
    Leased,
    Acked,
    Expired,
}

impl DeliveryState {
    pub const ALL: [DeliveryState; 4] = [
        DeliveryState::Pending,
        DeliveryState::Leased,
        DeliveryState::Acked,
        DeliveryState::Expired,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            DeliveryState::Pending => "PENDING",
            DeliveryState::Leased => "LEASED",
            DeliveryState::Acked => "ACKED",
            DeliveryState::Expired => "EXPIRED",
        }
    }

    pub fn parse(s: &str) -> Option<DeliveryState> {
        DeliveryState::ALL.into_iter().find(|st| st.as_str() == s)
    }
}
