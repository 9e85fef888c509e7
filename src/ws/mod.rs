//! The `orbit.events.v1` WebSocket endpoint: upgrade checks, frames, and
//! one [`connection::ConnectionActor`] per socket (spec: protocol.md).

pub mod connection;
pub mod frame_bound;
pub mod frames;
pub mod upgrade;

/// The subprotocol a client must offer.
pub const SUBPROTOCOL: &str = "orbit.events.v1";

/// Largest accepted message, counting all fragments (512 KiB).
pub const MAX_MESSAGE_BYTES: usize = 524_288;

/// Most fragments one message may arrive in.
pub const MAX_FRAGMENTS: usize = 1024;
