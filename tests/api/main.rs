//! Integration tests: the real server (`Application::build` on port 0)
//! against a real database, over real HTTP and WebSocket frames.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod commit_order;
mod helpers;
mod multinode;
mod skeleton;
mod wakes;
