//! Rust client for orbit-events.
//!
//! - [`Client`]: the management HTTP API as typed calls: subscriptions
//!   (create, list, get, pause/resume), deliveries (list, get, retry),
//!   result ingest, health. Writes take a caller-supplied
//!   [`IdempotencyKey`]; errors carry the service's [`ErrorCode`].
//! - [`Consumer`]: an `orbit.events.v1` consumer that connects, says hello,
//!   pings, runs your [`Handler`] for each delivery and ACKs what it stored,
//!   reconnects with backoff and jitter, and sends unconfirmed ACK proofs
//!   again after a reconnect. `DELIVERY_LEASE_LOST` is an [`Outcome`];
//!   `EVENT_HISTORY_EXPIRED` ends the run with
//!   [`ConsumerError::HistoryExpired`].
//! - `cli` (feature `cli`): the admin commands `orbit-events subscriptions …`
//!   and `orbit-events deliveries …` as a library.
//!
//! The Inbox pattern (store by `event.id`, then ACK) is shown in
//! `docs/consumer-guide.md` and `examples/inbox-consumer/` of the
//! repository. Wire types follow `docs/openapi.json` and
//! `docs/events.schema.json` field for field.

mod consumer;
mod credentials;
mod error;
pub mod frames;
mod management;
pub mod types;

#[cfg(feature = "cli")]
pub mod cli;

pub use consumer::{Backoff, Consumer, ConsumerError, Handler, HandlerError, Outcome, Stopped};
pub use credentials::{IdempotencyKey, Token};
pub use error::{ApiError, Error, ErrorCode};
pub use frames::{AckProof, AckReceipt, Delivery, LeaseSecret, Welcome};
pub use management::{Client, DeliveryFilter, REQUEST_TIMEOUT};
pub use types::{
    AppendedEvent, Blocked, BoundSession, ConfigureSubscription, CreateSubscription,
    DeliveryDetail, DeliveryHistory, DeliveryResult, DeliveryState, DeliveryStep, Event,
    EventDelivery, Health, LastConfigure, NewResult, OldestUnacked, Page, PublishResult, Queue,
    QueueList, ResultType, RetryDelivery, RetryExpired, RetryReceipt, Snapshot, SnapshotState,
    StepKind, Subscription, SubscriptionResult, SubscriptionStatus, Time,
};
