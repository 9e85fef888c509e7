//! What every handler and connection shares on one node.

use std::sync::Arc;

use actix::Addr;

use crate::{
    config::Settings,
    delivery::{
        acks::AckBatcher, pool::LeasePoolActor, scanner::ScannerActor, sweeper::SweeperActor,
    },
    domain::NodeId,
    http::results::PublishBatcher,
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
    /// Group commit of ACKs (one batch transaction at a time).
    pub acks: AckBatcher,
    pub publishes: PublishBatcher,
    /// This node's metrics (its own registry, not a process-global one).
    pub metrics: Arc<Metrics>,
    pub node_id: NodeId,
    /// Tells connections to drain and close (1001) when the node stops.
    pub shutdown: Shutdown,
    /// The bound address of `server.metrics_listen`, when set.
    pub metrics_addr: Option<std::net::SocketAddr>,
}
