//! Validated domain types. Wire input becomes one of these once, at the edge;
//! the core takes only these.

mod ids;
mod lease;
mod names;
mod permission;
mod principal;
mod result_type;
pub mod schema;
mod state;
mod time;
mod uint64;

pub use ids::*;
pub use lease::{LeaseSecret, LeaseSecretError, sha256_hex};
pub use names::{Capacity, SubscriptionName};
pub use permission::{Permission, PermissionSet};
pub use principal::{Principal, TOKEN_PREFIX, generate_token, mask_tokens, token_digest};
pub use result_type::{ResultType, TypeSet};
pub use state::DeliveryState;
pub use time::{Timestamp, now};
pub use uint64::{U64Str, parse_canonical_u64};
