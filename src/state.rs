//! What every handler and connection shares on one node.

use std::sync::Arc;

use actix::Addr;

use crate::{
    config::Settings,
    delivery::{pool::LeasePoolActor, scanner::ScannerActor, sweeper::SweeperActor},
    domain::NodeId,
    metrics::Metrics,
    node::Shutdown,
    store::{Database, writer::queues::Queues},
};

/// Shared node state (cheap to clone).
#[derive(Clone)]
pub struct AppState {
    pub db: Database,
    pub settings: Arc<Settings>,
    pub scanner: Addr<ScannerActor>,
    pub pool: Addr<LeasePoolActor>,
    pub sweeper: Addr<SweeperActor>,
    /// Group commit of ACKs and publishes (decision 0078).
    pub writes: Queues,
    /// This node's metrics (its own registry, not a process-global one).
    pub metrics: Arc<Metrics>,
    pub node_id: NodeId,
    /// Tells connections to drain and close (1001) when the node stops.
    pub shutdown: Shutdown,
    /// The bound address of `server.metrics_listen`, when set.
    pub metrics_addr: Option<std::net::SocketAddr>,
}
