//! The delivery engine: the scanner materializes and asks for claims, the
//! lease pool runs claims under node limits, the sweeper recovers leases
//! and applies retention; on PostgreSQL the listener carries wakes between
//! nodes (spec: architecture.md §1, delivery-model.md §5–§8).

pub mod listener;
pub mod pool;
pub mod scanner;
pub mod sweeper;
