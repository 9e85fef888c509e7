//! What every handler and connection shares on one node.

use std::sync::Arc;

use actix::Addr;

use crate::{
    config::Settings,
    delivery::{pool::LeasePoolActor, scanner::ScannerActor, sweeper::SweeperActor},
    domain::NodeId,
    metrics::Metrics,
    startup::Shutdown,
    store::Database,
};

/// Shared node state (cheap to clone).
#[derive(Clone)]
pub struct AppState {
    pub db: Database,
    pub settings: Arc<Settings>,
    pub scanner: Addr<ScannerActor>,
    pub pool: Addr<LeasePoolActor>,
    pub sweeper: Addr<SweeperActor>,
    /// This node's metrics (its own registry, not a process-global one).
    pub metrics: Arc<Metrics>,
    pub node_id: NodeId,
    /// Tells connections to drain and close (1001) when the node stops.
    pub shutdown: Shutdown,
}
