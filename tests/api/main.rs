//! Integration tests: the real server (`Application::build` on port 0)
//! against a real database, over real HTTP and WebSocket frames.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod helpers;
mod http_common;
mod http_deliveries;
mod http_guide;
mod http_idempotency;
mod http_no_change;
mod http_openapi;
mod http_subscriptions;
mod http_support;
mod skeleton;
