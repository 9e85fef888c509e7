//! Integration tests: the real server (`Application::build` on port 0)
//! against a real database, over real HTTP and WebSocket frames.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod architecture;
mod commit_order;
mod disk_full;
mod group_commit;
mod helpers;
mod history;
mod http_common;
mod http_deliveries;
mod http_guide;
mod http_idempotency;
mod http_no_change;
mod http_openapi;
mod http_subscriptions;
mod http_support;
mod metrics;
mod multinode;
#[cfg(feature = "test-hooks")]
mod pool;
mod protocol_bounds;
mod protocol_envelope;
mod protocol_failure;
mod protocol_leases;
mod protocol_schema;
mod protocol_session;
mod protocol_shutdown;
mod protocol_stall;
mod protocol_support;
mod protocol_transcript;
mod protocol_upgrade;
mod publish_deadline;
mod publish_rounds;
mod retention;
mod retention_scope;
mod sdk_cli;
mod sdk_consumer;
mod sdk_crash;
mod sdk_guide;
mod sdk_management;
mod sdk_support;
mod skeleton;
mod teardown;
mod trial;
mod wakes;
mod write_rounds;
