//! orbit-events: reliable delivery of task results to applications over
//! the `orbit.events.v1` WebSocket protocol.
//!
//! The spec lives in the shared spec folder; modules map to its rooms:
//! [`http`] (management API), [`ws`] (connections and frames),
//! [`delivery`] (scanner, lease pool, sweeper), [`store`] (one function per
//! transaction), [`journal`] (the result log), [`domain`] (validated types),
//! [`metrics`] (Prometheus); [`startup`] builds a node, [`node`] runs and
//! stops it.

pub mod auth;
pub mod cli;
pub mod config;
pub mod delivery;
pub mod domain;
pub mod error;
pub mod http;
pub mod journal;
pub mod metrics;
pub mod node;
pub mod outbox;
pub mod startup;
pub mod state;
pub mod store;
pub mod strict_json;
pub mod telemetry;
pub mod version;
pub mod ws;
