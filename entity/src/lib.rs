//! sea-orm entities of orbit-events, one module per table (spec: delivery-model.md §2).
//!
//! Conventions: ids are 32 lowercase hex characters; times are `i64`
//! microseconds since the Unix epoch (UTC); sequences and revisions are
//! `BIGINT`; JSON documents are stored as text.

pub mod ack_tally;
pub mod application;
pub mod audit_record;
pub mod credential;
pub mod delivery;
pub mod delivery_history;
pub mod event_session;
pub mod idempotency_record;
pub mod namespace;
pub mod queue;
pub mod result_event;
pub mod signing_key;
pub mod subscription;
