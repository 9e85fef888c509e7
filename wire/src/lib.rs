//! The vocabulary of orbit-events, defined once for the server, its
//! entities (feature `sea-orm`: the stored text of a delivery's state) and
//! the client (spec: delivery-model.md §3, §6).

use std::{fmt, str::FromStr};

use serde::{Deserialize, Serialize};

/// The reason of the 1001 close that ends a connection at its lifetime
/// budget (`timing.connection_lifetime_ms`, protocol.md §5): a routine
/// end, after which a client reconnects at once.
pub const LIFETIME_CLOSE_REASON: &str = "connection lifetime reached; reconnect";

/// The reason of the 1001 close of a node that is shutting down.
pub const SHUTDOWN_CLOSE_REASON: &str = "the server is shutting down";

/// The state of a delivery (delivery-model.md §6), stored and sent as
/// `PENDING`, `LEASED`, `ACKED` or `EXPIRED`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "UPPERCASE")]
#[cfg_attr(
    feature = "sea-orm",
    derive(sea_orm::EnumIter, sea_orm::DeriveActiveEnum)
)]
#[cfg_attr(feature = "sea-orm", sea_orm(rs_type = "String", db_type = "Text"))]
pub enum DeliveryState {
    /// Waiting to be leased (again) from `available_at` on.
    #[cfg_attr(feature = "sea-orm", sea_orm(string_value = "PENDING"))]
    Pending,
    /// Leased to a session until `lease_until`.
    #[cfg_attr(feature = "sea-orm", sea_orm(string_value = "LEASED"))]
    Leased,
    /// Acknowledged; final.
    #[cfg_attr(feature = "sea-orm", sea_orm(string_value = "ACKED"))]
    Acked,
    /// Out of attempts: a dead letter until retried.
    #[cfg_attr(feature = "sea-orm", sea_orm(string_value = "EXPIRED"))]
    Expired,
}

impl DeliveryState {
    pub const ALL: [DeliveryState; 4] = [
        DeliveryState::Pending,
        DeliveryState::Leased,
        DeliveryState::Acked,
        DeliveryState::Expired,
    ];

    /// `PENDING`, …
    pub fn as_str(self) -> &'static str {
        match self {
            DeliveryState::Pending => "PENDING",
            DeliveryState::Leased => "LEASED",
            DeliveryState::Acked => "ACKED",
            DeliveryState::Expired => "EXPIRED",
        }
    }

    /// Exactly the wire text (`EXPIRED`); `None` otherwise.
    pub fn parse(s: &str) -> Option<DeliveryState> {
        DeliveryState::ALL.into_iter().find(|st| st.as_str() == s)
    }
}

impl fmt::Display for DeliveryState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for DeliveryState {
    type Err = String;

    /// Case-insensitive (`expired` or `EXPIRED`), for people typing it.
    fn from_str(s: &str) -> Result<DeliveryState, String> {
        DeliveryState::ALL
            .into_iter()
            .find(|st| st.as_str().eq_ignore_ascii_case(s))
            .ok_or_else(|| {
                format!("unknown delivery state {s:?}: expected PENDING, LEASED, ACKED or EXPIRED")
            })
    }
}

/// A result type: the four terminal outcomes of a task (`task.requeued` is
/// not a result).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum ResultType {
    #[serde(rename = "task.cancelled")]
    Cancelled,
    #[serde(rename = "task.failed")]
    Failed,
    #[serde(rename = "task.needs_review")]
    NeedsReview,
    #[serde(rename = "task.succeeded")]
    Succeeded,
}

impl ResultType {
    /// All four, in the API's canonical (alphabetical) order.
    pub const ALL: [ResultType; 4] = [
        ResultType::Cancelled,
        ResultType::Failed,
        ResultType::NeedsReview,
        ResultType::Succeeded,
    ];

    /// `task.succeeded`, …
    pub fn as_str(self) -> &'static str {
        match self {
            ResultType::Cancelled => "task.cancelled",
            ResultType::Failed => "task.failed",
            ResultType::NeedsReview => "task.needs_review",
            ResultType::Succeeded => "task.succeeded",
        }
    }

    /// Exactly the wire text (`task.succeeded`); `None` otherwise.
    pub fn parse(s: &str) -> Option<ResultType> {
        ResultType::ALL.into_iter().find(|t| t.as_str() == s)
    }

    /// The snapshot state a result of this type carries.
    pub fn snapshot_state(self) -> SnapshotState {
        match self {
            ResultType::Cancelled => SnapshotState::Cancelled,
            ResultType::Failed => SnapshotState::Failed,
            ResultType::NeedsReview => SnapshotState::NeedsReview,
            ResultType::Succeeded => SnapshotState::Succeeded,
        }
    }
}

impl fmt::Display for ResultType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for ResultType {
    type Err = String;

    /// `task.succeeded` or the short `succeeded` (and so on), for people
    /// typing it; the API takes only the full form ([`ResultType::parse`]).
    fn from_str(s: &str) -> Result<ResultType, String> {
        ResultType::ALL
            .into_iter()
            .find(|t| t.as_str() == s || t.as_str().strip_prefix("task.") == Some(s))
            .ok_or_else(|| {
                format!(
                    "unknown result type {s:?}: expected one of succeeded, failed, cancelled, \
                     needs_review (or with the task. prefix)"
                )
            })
    }
}

/// The task state inside a result's snapshot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum SnapshotState {
    Succeeded,
    Failed,
    Cancelled,
    NeedsReview,
}

impl SnapshotState {
    /// `SUCCEEDED`, …
    pub fn as_str(self) -> &'static str {
        match self {
            SnapshotState::Succeeded => "SUCCEEDED",
            SnapshotState::Failed => "FAILED",
            SnapshotState::Cancelled => "CANCELLED",
            SnapshotState::NeedsReview => "NEEDS_REVIEW",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_word_round_trips_through_its_text_and_serde() {
        for st in DeliveryState::ALL {
            assert_eq!(DeliveryState::parse(st.as_str()), Some(st));
            assert_eq!(serde_json::to_string(&st).ok(), Some(format!("\"{st}\"")));
        }
        for t in ResultType::ALL {
            assert_eq!(ResultType::parse(t.as_str()), Some(t));
            assert_eq!(serde_json::to_string(&t).ok(), Some(format!("\"{t}\"")));
            let state = t.snapshot_state();
            assert_eq!(
                serde_json::to_string(&state).ok(),
                Some(format!("\"{}\"", state.as_str()))
            );
        }
        assert_eq!(ResultType::parse("succeeded"), None, "the API is strict");
        assert_eq!(
            "succeeded".parse::<ResultType>().ok(),
            Some(ResultType::Succeeded)
        );
        assert_eq!(
            "expired".parse::<DeliveryState>().ok(),
            Some(DeliveryState::Expired)
        );
    }
}
