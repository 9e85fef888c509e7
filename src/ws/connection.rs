//! ConnectionActor: one per WebSocket (spec: architecture.md §1,
//! protocol.md §2–§4).
//!
//! States: AwaitingHello → (HelloPending) → Bound → Closing. The actor never
//! awaits the database inside a handler: hello, ACK and ping run as spawned
//! futures (at most `read_queue` at once) whose results come back to the
//! actor. A reader task pulls frames from the socket only while it holds one
//! of the `read_queue` permits (backpressure: further frames wait in the
//! socket, none are dropped). A writer task owns the socket's send half and
//! drains a bounded `write_queue`; each send is bounded by the write timeout,
//! so a consumer that stops reading is detected and its slot freed.
//! On node shutdown the connection drains: it takes no new frame, lets its
//! in-flight hello/ACK/ping finish and answer, then closes with 1001
//! (decision 0020).

use std::{
    collections::HashMap,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use actix::prelude::*;
use actix_web::web::Bytes;
use actix_ws::{
    CloseCode, CloseReason, Item, Message as WsMessage, MessageStream, ProtocolError, Session,
};
use bytestring::ByteString;
use futures_util::StreamExt;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};

use crate::{
    auth::Principal,
    delivery::{
        pool::ConnectionSlot,
        scanner::{Demand, SessionBound, SessionClosed, SubscriptionChanged},
    },
    domain::{DeliveryId, MessageId, Permission, QueueId, SessionId, SubscriptionId, U64Str, now},
    error::ErrorCode,
    metrics::{Operation, Outcome},
    state::AppState,
    store::{
        self, Waiter,
        ack::{AckOutcome, AckRequest, LeaseProof},
        audit::AuditActor,
        claim::ClaimOutcome,
        deliveries::DeliveryView,
        sessions::OpenSession,
    },
    ws::{
        MAX_FRAGMENTS, MAX_MESSAGE_BYTES,
        frames::{self, ClientEnvelope, ClientFrameType},
    },
};

/// The outcome of a claim for this connection, sent by the lease pool (or
/// by the scanner when materialization finds a history gap).
#[derive(Message)]
#[rtype(result = "()")]
pub struct ClaimResult {
    pub outcome: Result<ClaimOutcome, String>,
}

/// One text message from the reader task, holding a read-queue permit
/// until the request is answered.
#[derive(Message)]
#[rtype(result = "()")]
struct ClientText {
    text: ByteString,
    permit: OwnedSemaphorePermit,
}

/// The reader saw something that ends the connection.
#[derive(Message)]
#[rtype(result = "()")]
enum ReaderEvent {
    /// Binary frame, oversized or malformed message: close with this code.
    Violation(CloseCode, &'static str),
    /// The client sent a close frame.
    PeerClosed,
    /// The socket ended without a close frame.
    PeerGone,
}

/// The writer task stopped (timeout, socket gone, or after the close frame).
#[derive(Message)]
#[rtype(result = "()")]
struct WriterStopped {
    timed_out: bool,
}

/// The write queue became empty: there may be room for more deliveries.
#[derive(Message)]
#[rtype(result = "()")]
struct WriterDrained;

/// What the writer task sends.
enum Outbound {
    Text(String),
    Pong(Bytes),
    Close(CloseCode, String),
}

#[derive(Debug, Clone)]
struct Bound {
    session_id: SessionId,
    subscription_id: SubscriptionId,
    queue_id: QueueId,
    capacity: u32,
}

enum Phase {
    AwaitingHello,
    HelloPending,
    Bound(Bound),
    Closing,
}

/// The actor behind one WebSocket connection.
pub struct ConnectionActor {
    state: AppState,
    principal: Principal,
    phase: Phase,
    write_tx: mpsc::Sender<Outbound>,
    /// Taken by `started()`: the socket halves and the write queue's receiver.
    io: Option<(Session, MessageStream, mpsc::Receiver<Outbound>)>,
    /// Set by the read path's byte bound when a frame header announced more
    /// than [`MAX_MESSAGE_BYTES`] (decision 0077).
    oversized: Arc<AtomicBool>,
    read_permits: Arc<Semaphore>,
    last_valid_frame: Instant,
    /// Deliveries this connection holds, with their local lease deadline.
    held: HashMap<DeliveryId, Instant>,
    last_reported_room: Option<u32>,
    /// Hello, ACK and ping futures running (each holds a read permit).
    in_flight: usize,
    /// The node is stopping: no new frames are taken; once `in_flight` is
    /// 0 the connection closes with 1001.
    draining: bool,
    /// The scanner was told this session is gone (once per session).
    left_scanner: bool,
    /// Held while the session is this connection's: claims check it after
    /// taking the write lock (a claim of a closed session leases nothing).
    session_alive: Arc<()>,
    _slot: ConnectionSlot,
}

impl ConnectionActor {
    pub fn new(
        state: AppState,
        principal: Principal,
        session: Session,
        stream: MessageStream,
        oversized: Arc<AtomicBool>,
        slot: ConnectionSlot,
    ) -> ConnectionActor {
        let limits = &state.settings.limits;
        let (write_tx, write_rx) = mpsc::channel(limits.write_queue);
        let read_permits = Arc::new(Semaphore::new(limits.read_queue));
        ConnectionActor {
            principal,
            phase: Phase::AwaitingHello,
            write_tx,
            io: Some((session, stream, write_rx)),
            oversized,
            read_permits,
            last_valid_frame: Instant::now(),
            held: HashMap::new(),
            last_reported_room: None,
            in_flight: 0,
            draining: false,
            left_scanner: false,
            session_alive: Arc::new(()),
            _slot: slot,
            state,
        }
    }

    fn session_id(&self) -> Option<&SessionId> {
        match &self.phase {
            Phase::Bound(b) => Some(&b.session_id),
            _ => None,
        }
    }

    /// Queues a frame without waiting; a full queue means the consumer is
    /// not reading, which ends the connection.
    fn send_now(&mut self, ctx: &mut Context<Self>, text: String) {
        if self.write_tx.try_send(Outbound::Text(text)).is_err() {
            tracing::info!("write queue full; closing the connection");
            ctx.stop();
        }
    }

    /// An error frame, then close with `code`.
    fn fail(
        &mut self,
        ctx: &mut Context<Self>,
        reply_to: Option<&MessageId>,
        code: ErrorCode,
        message: &str,
        close: CloseCode,
    ) {
        let text = frames::error(self.session_id(), reply_to, code, message);
        self.send_now(ctx, text);
        self.close(ctx, close, message);
    }

    /// Sends a close frame after everything already queued, then stops.
    fn close(&mut self, ctx: &mut Context<Self>, code: CloseCode, reason: &str) {
        if matches!(self.phase, Phase::Closing) {
            return;
        }
        self.leave_scanner();
        self.phase = Phase::Closing;
        // Close reasons are at most 123 bytes.
        let mut reason = reason.to_owned();
        while reason.len() > 123 {
            reason.pop();
        }
        if self
            .write_tx
            .try_send(Outbound::Close(code, reason))
            .is_err()
        {
            ctx.stop();
            return;
        }
        let grace = self.state.settings.timing.write_timeout();
        ctx.run_later(grace, |_, ctx| ctx.stop());
    }

    fn leave_scanner(&mut self) {
        if let Phase::Bound(b) = &self.phase
            && !self.left_scanner
        {
            self.left_scanner = true;
            // Claims of this session still waiting for the database now
            // lease nothing.
            self.session_alive = Arc::new(());
            self.state.scanner.do_send(SessionClosed {
                session_id: b.session_id.clone(),
            });
            let db = self.state.db.clone();
            let session_id = b.session_id.clone();
            actix::spawn(async move {
                if let Err(err) = store::sessions::close_session(&db, &session_id).await {
                    store::writer::log_failure(&err, "could not record the session close");
                }
            });
        }
    }

    /// Node shutdown (protocol.md §3): take no more frames and no more
    /// deliveries; close with 1001 once in-flight database work is done.
    fn drain(&mut self, ctx: &mut Context<Self>) {
        if self.draining || matches!(self.phase, Phase::Closing) {
            return;
        }
        self.draining = true;
        self.leave_scanner();
        self.read_permits.close();
        self.finish_drain_if_idle(ctx);
    }

    fn finish_drain_if_idle(&mut self, ctx: &mut Context<Self>) {
        if self.draining && self.in_flight == 0 {
            self.close(ctx, CloseCode::Away, "the server is shutting down");
        }
    }

    /// Deliveries this connection can take now: capacity minus held leases,
    /// bounded by free write-queue slots.
    fn room(&self) -> u32 {
        let Phase::Bound(b) = &self.phase else {
            return 0;
        };
        let free_capacity = b.capacity.saturating_sub(self.held.len() as u32);
        free_capacity.min(self.write_tx.capacity() as u32)
    }

    fn report_demand(&mut self) {
        let room = self.room();
        if let Phase::Bound(b) = &self.phase
            && self.last_reported_room != Some(room)
        {
            self.last_reported_room = Some(room);
            self.state.scanner.do_send(Demand {
                session_id: b.session_id.clone(),
                room,
            });
        }
    }

    fn start_writer(
        &self,
        ctx: &mut Context<Self>,
        mut session: Session,
        mut rx: mpsc::Receiver<Outbound>,
    ) {
        let addr = ctx.address();
        let timeout = self.state.settings.timing.write_timeout();
        actix::spawn(async move {
            let mut timed_out = false;
            while let Some(out) = rx.recv().await {
                let result = match out {
                    Outbound::Text(text) => tokio::time::timeout(timeout, session.text(text)).await,
                    Outbound::Pong(bytes) => {
                        tokio::time::timeout(timeout, session.pong(&bytes)).await
                    }
                    Outbound::Close(code, reason) => {
                        let reason = CloseReason {
                            code,
                            description: (!reason.is_empty()).then_some(reason),
                        };
                        let _ = tokio::time::timeout(timeout, session.close(Some(reason))).await;
                        break;
                    }
                };
                match result {
                    Ok(Ok(())) => {}
                    Ok(Err(_closed)) => break,
                    Err(_elapsed) => {
                        timed_out = true;
                        break;
                    }
                }
                if rx.is_empty() {
                    addr.do_send(WriterDrained);
                }
            }
            addr.do_send(WriterStopped { timed_out });
        });
    }

    fn start_reader(&self, ctx: &mut Context<Self>, mut stream: MessageStream) {
        let addr = ctx.address();
        let permits = self.read_permits.clone();
        let pong_tx = self.write_tx.clone();
        let oversized = self.oversized.clone();
        actix::spawn(async move {
            let mut fragments = Fragments::default();
            loop {
                let Ok(permit) = permits.clone().acquire_owned().await else {
                    return;
                };
                let text = match stream.next().await {
                    None => {
                        addr.do_send(ReaderEvent::PeerGone);
                        return;
                    }
                    Some(Err(ProtocolError::Overflow)) => {
                        addr.do_send(ReaderEvent::Violation(CloseCode::Size, "message too large"));
                        return;
                    }
                    Some(Err(_)) if oversized.load(Ordering::Acquire) => {
                        addr.do_send(ReaderEvent::Violation(CloseCode::Size, "message too large"));
                        return;
                    }
                    Some(Err(_)) => {
                        addr.do_send(ReaderEvent::Violation(
                            CloseCode::Protocol,
                            "malformed WebSocket frame",
                        ));
                        return;
                    }
                    Some(Ok(msg)) => match msg {
                        WsMessage::Text(text) => {
                            if fragments.active() {
                                addr.do_send(ReaderEvent::Violation(
                                    CloseCode::Protocol,
                                    "unexpected text frame",
                                ));
                                return;
                            }
                            text
                        }
                        WsMessage::Binary(_) => {
                            addr.do_send(ReaderEvent::Violation(
                                CloseCode::Policy,
                                "binary frames are not accepted",
                            ));
                            return;
                        }
                        WsMessage::Continuation(item) => match fragments.push(item) {
                            Ok(Some(text)) => text,
                            Ok(None) => continue,
                            Err((code, why)) => {
                                addr.do_send(ReaderEvent::Violation(code, why));
                                return;
                            }
                        },
                        WsMessage::Ping(bytes) => {
                            // Control frames do not keep the session alive;
                            // a pong is dropped rather than queued when full.
                            let _ = pong_tx.try_send(Outbound::Pong(bytes));
                            continue;
                        }
                        WsMessage::Pong(_) | WsMessage::Nop => continue,
                        WsMessage::Close(_) => {
                            addr.do_send(ReaderEvent::PeerClosed);
                            return;
                        }
                    },
                };
                if addr.send(ClientText { text, permit }).await.is_err() {
                    return;
                }
            }
        });
    }

    fn handle_frame(&mut self, ctx: &mut Context<Self>, text: &str, permit: OwnedSemaphorePermit) {
        if self.draining {
            // Read before the drain began; the client resends it elsewhere.
            return;
        }
        let env = match frames::parse_envelope(text) {
            Ok(env) => env,
            Err(err) => return self.close(ctx, CloseCode::Policy, &err.0),
        };
        match (&self.phase, env.frame_type) {
            (Phase::Closing, _) => {}
            (Phase::AwaitingHello, ClientFrameType::Hello) => {
                if env.session_id.is_some() {
                    return self.close(
                        ctx,
                        CloseCode::Policy,
                        "events.hello must not carry session_id",
                    );
                }
                self.last_valid_frame = Instant::now();
                self.on_hello(ctx, env, permit);
            }
            (Phase::AwaitingHello | Phase::HelloPending, _) => {
                self.close(
                    ctx,
                    CloseCode::Policy,
                    "events.hello must come first and only once",
                );
            }
            (Phase::Bound(_), ClientFrameType::Hello) => {
                self.close(
                    ctx,
                    CloseCode::Policy,
                    "events.hello must come first and only once",
                );
            }
            (Phase::Bound(b), ClientFrameType::Ack | ClientFrameType::Ping) => {
                if env.session_id.as_deref() != Some(b.session_id.as_str()) {
                    return self.close(ctx, CloseCode::Policy, "session_id is missing or wrong");
                }
                let bound = b.clone();
                self.last_valid_frame = Instant::now();
                if env.frame_type == ClientFrameType::Ack {
                    self.on_ack(ctx, bound, env, permit);
                } else {
                    self.on_ping(ctx, bound, env, permit);
                }
            }
        }
    }

    fn on_hello(
        &mut self,
        ctx: &mut Context<Self>,
        env: ClientEnvelope,
        permit: OwnedSemaphorePermit,
    ) {
        let hello = match env.hello() {
            Ok(h) => h,
            Err(err) => {
                let text = frames::error(None, Some(&env.message_id), err.code(), err.message());
                return self.send_now(ctx, text);
            }
        };
        self.phase = Phase::HelloPending;
        let db = self.state.db.clone();
        let principal = self.principal.clone();
        let node_id = self.state.node_id.clone();
        let capacity = hello.capacity.get();
        let sub_id = hello.subscription_id.clone();
        let fut = async move {
            let result =
                store::sessions::open_session(&db, &principal, &sub_id, capacity, &node_id).await;
            drop(permit);
            result
        };
        let reply_to = env.message_id;
        self.in_flight += 1;
        ctx.spawn(fut.into_actor(self).map(move |result, act, ctx| {
            act.in_flight -= 1;
            act.after_hello(ctx, result, reply_to, hello, capacity);
            act.finish_drain_if_idle(ctx);
        }));
    }

    fn after_hello(
        &mut self,
        ctx: &mut Context<Self>,
        result: Result<OpenSession, sea_orm::DbErr>,
        reply_to: MessageId,
        hello: frames::Hello,
        capacity: u32,
    ) {
        if !matches!(self.phase, Phase::HelloPending) {
            return;
        }
        match result {
            Ok(OpenSession::Opened {
                session_id,
                subscription,
            }) => {
                let timing = &self.state.settings.timing;
                let welcome = frames::welcome(
                    &reply_to,
                    &frames::Welcome {
                        session_id: &session_id,
                        subscription_id: &hello.subscription_id,
                        capacity,
                        lease_duration_ms: timing.lease_ms,
                        heartbeat_interval_ms: timing.heartbeat_interval_ms,
                        server_time: now(),
                        enabled: subscription.enabled,
                    },
                );
                tracing::info!(session_id = %session_id, subscription_id = %hello.subscription_id, capacity, "session bound");
                let queue_id = QueueId::from_db(subscription.queue_id);
                self.phase = Phase::Bound(Bound {
                    session_id: session_id.clone(),
                    subscription_id: hello.subscription_id.clone(),
                    queue_id: queue_id.clone(),
                    capacity,
                });
                self.send_now(ctx, welcome);
                if self.draining {
                    return;
                }
                let room = self.room();
                self.last_reported_room = Some(room);
                self.state.scanner.do_send(SessionBound {
                    session_id,
                    subscription_id: hello.subscription_id,
                    queue_id,
                    application_id: self.principal.application_id.clone(),
                    credential_id: self.principal.credential_id.clone(),
                    capacity,
                    room,
                    connection: ctx.address().recipient(),
                    waiter: Waiter::while_alive(&self.session_alive),
                });
            }
            Ok(OpenSession::NotFound) => self.fail(
                ctx,
                Some(&reply_to),
                ErrorCode::NotFound,
                "subscription not found",
                CloseCode::Policy,
            ),
            Ok(OpenSession::HistoryExpired(earliest)) => self.fail(
                ctx,
                Some(&reply_to),
                ErrorCode::EventHistoryExpired,
                &history_message(earliest),
                CloseCode::Policy,
            ),
            Ok(OpenSession::Revoked) => self.fail(
                ctx,
                Some(&reply_to),
                ErrorCode::Unauthenticated,
                REVOKED,
                CloseCode::Policy,
            ),
            Err(err) => {
                self.state.metrics.database_error(Operation::Hello);
                store::writer::log_failure(&err, "hello failed on the database");
                self.fail(
                    ctx,
                    Some(&reply_to),
                    ErrorCode::Unavailable,
                    UNAVAILABLE,
                    CloseCode::Error,
                )
            }
        }
    }

    fn on_ack(
        &mut self,
        ctx: &mut Context<Self>,
        bound: Bound,
        env: ClientEnvelope,
        permit: OwnedSemaphorePermit,
    ) {
        let reply_to = env.message_id.clone();
        let ack = match env.ack() {
            Ok(a) => a,
            Err(err) => {
                let text = frames::error(
                    Some(&bound.session_id),
                    Some(&reply_to),
                    err.code(),
                    err.message(),
                );
                return self.send_now(ctx, text);
            }
        };
        let acks = self.state.acks.clone();
        let tx = self.write_tx.clone();
        let timeout = self.state.settings.timing.write_timeout();
        let actor = AuditActor {
            namespace_id: self.principal.namespace_id.clone(),
            credential_id: self.principal.credential_id.clone(),
        };
        let delivery_id = ack.delivery_id.clone();
        let session_id = bound.session_id.clone();
        let subscription_id = bound.subscription_id.clone();
        let queue_id = bound.queue_id.clone();
        let received = Instant::now();
        let fut = async move {
            let proof = LeaseProof {
                delivery_id: ack.delivery_id.clone(),
                epoch: ack.epoch,
                secret: ack.lease_secret,
            };
            let outcome = acks
                .acknowledge(AckRequest {
                    subscription_id: bound.subscription_id.clone(),
                    actor,
                    proof: proof.clone(),
                })
                .await;
            let text = match &outcome {
                Ok(AckOutcome::Acked {
                    event_id,
                    epoch,
                    acknowledged_at,
                    deduplicated,
                }) => frames::ack_reply(
                    &session_id,
                    &reply_to,
                    &frames::AckReply {
                        delivery_id: proof.delivery_id.to_string(),
                        event_id: event_id.to_string(),
                        epoch: U64Str(*epoch),
                        acknowledged_at: *acknowledged_at,
                        deduplicated: *deduplicated,
                    },
                ),
                Ok(AckOutcome::LeaseLost) => frames::error(
                    Some(&session_id),
                    Some(&reply_to),
                    ErrorCode::DeliveryLeaseLost,
                    "the lease proof is not the delivery's latest; wait for a new delivery",
                ),
                Ok(AckOutcome::NotFound) => frames::error(
                    Some(&session_id),
                    Some(&reply_to),
                    ErrorCode::NotFound,
                    "delivery not found in this subscription",
                ),
                Ok(AckOutcome::Revoked) => frames::error(
                    Some(&session_id),
                    Some(&reply_to),
                    ErrorCode::Unauthenticated,
                    REVOKED,
                ),
                Err(err) => {
                    store::writer::log_failure(err, "ACK failed on the database");
                    frames::error(
                        Some(&session_id),
                        Some(&reply_to),
                        ErrorCode::Unavailable,
                        UNAVAILABLE,
                    )
                }
            };
            // The reply leaves only after the commit; waiting for room here
            // holds the read permit, which is the backpressure.
            let queued = matches!(
                tokio::time::timeout(timeout, tx.send(Outbound::Text(text))).await,
                Ok(Ok(()))
            );
            drop(permit);
            (outcome, queued)
        };
        self.in_flight += 1;
        ctx.spawn(
            fut.into_actor(self)
                .map(move |(outcome, queued), act, ctx| {
                    act.in_flight -= 1;
                    let metrics = &act.state.metrics;
                    metrics.ack_finished(received.elapsed());
                    match &outcome {
                        Ok(AckOutcome::Acked {
                            deduplicated: false,
                            ..
                        }) => metrics.acked(&queue_id),
                        Ok(AckOutcome::Acked { .. }) => {
                            metrics.outcome(Outcome::AckDeduplicated, 1)
                        }
                        Ok(AckOutcome::LeaseLost) => metrics.outcome(Outcome::LeaseLost, 1),
                        Ok(AckOutcome::NotFound | AckOutcome::Revoked) => {}
                        Err(_) => metrics.database_error(Operation::Ack),
                    }
                    if !queued {
                        return ctx.stop();
                    }
                    match outcome {
                        Ok(AckOutcome::Acked { deduplicated, .. }) => {
                            if act.held.remove(&delivery_id).is_some() || !deduplicated {
                                act.report_demand();
                            }
                            if !deduplicated {
                                act.state.scanner.do_send(SubscriptionChanged {
                                    subscription_id,
                                    rows_available: false,
                                });
                            }
                        }
                        Ok(AckOutcome::LeaseLost) => {}
                        Ok(AckOutcome::NotFound) => {
                            act.close(ctx, CloseCode::Policy, "delivery not found")
                        }
                        Ok(AckOutcome::Revoked) => act.close(ctx, CloseCode::Policy, REVOKED),
                        Err(_) => act.close(ctx, CloseCode::Error, UNAVAILABLE),
                    }
                    act.finish_drain_if_idle(ctx);
                }),
        );
    }

    fn on_ping(
        &mut self,
        ctx: &mut Context<Self>,
        bound: Bound,
        env: ClientEnvelope,
        permit: OwnedSemaphorePermit,
    ) {
        let reply_to = env.message_id.clone();
        if let Err(err) = env.ping() {
            let text = frames::error(
                Some(&bound.session_id),
                Some(&reply_to),
                err.code(),
                err.message(),
            );
            return self.send_now(ctx, text);
        }
        let db = self.state.db.clone();
        let credential_id = self.principal.credential_id.clone();
        let tx = self.write_tx.clone();
        let timeout = self.state.settings.timing.write_timeout();
        let session_id = bound.session_id.clone();
        let reply = reply_to.clone();
        let fut = async move {
            let result = revalidate(&db, &credential_id, &bound.subscription_id).await;
            // Like an ACK reply, a ping reply waits for room in the write
            // queue while holding its read permit: a client that pings
            // without reading is slowed down (backpressure), never buffered.
            let mut queued = true;
            if let Ok(Revalidation::Ok { enabled }) = &result {
                let text = frames::ping_reply(
                    &session_id,
                    &reply,
                    &frames::PingReply {
                        server_time: now(),
                        enabled: *enabled,
                    },
                );
                queued = matches!(
                    tokio::time::timeout(timeout, tx.send(Outbound::Text(text))).await,
                    Ok(Ok(()))
                );
            }
            drop(permit);
            (result, queued)
        };
        self.in_flight += 1;
        ctx.spawn(fut.into_actor(self).map(move |(result, queued), act, ctx| {
            act.in_flight -= 1;
            match result {
                Ok(Revalidation::Ok { .. }) if !queued => ctx.stop(),
                Ok(Revalidation::Ok { .. }) => {}
                Ok(Revalidation::Revoked) => act.fail(
                    ctx,
                    Some(&reply_to),
                    ErrorCode::Unauthenticated,
                    REVOKED,
                    CloseCode::Policy,
                ),
                Ok(Revalidation::Denied) => act.fail(
                    ctx,
                    Some(&reply_to),
                    ErrorCode::PermissionDenied,
                    "the credential lacks the events:consume permission",
                    CloseCode::Policy,
                ),
                Ok(Revalidation::OutOfScope) => act.fail(
                    ctx,
                    Some(&reply_to),
                    ErrorCode::NotFound,
                    "subscription not found",
                    CloseCode::Policy,
                ),
                Err(err) => {
                    act.state.metrics.database_error(Operation::Ping);
                    store::writer::log_failure(&err, "ping re-validation failed on the database");
                    act.fail(
                        ctx,
                        Some(&reply_to),
                        ErrorCode::Unavailable,
                        UNAVAILABLE,
                        CloseCode::Error,
                    )
                }
            }
            act.finish_drain_if_idle(ctx);
        }));
    }

    fn on_leased(&mut self, ctx: &mut Context<Self>, outcome: Result<ClaimOutcome, String>) {
        let Phase::Bound(bound) = &self.phase else {
            // Closing: the leases expire and are redelivered.
            return;
        };
        let session_id = bound.session_id.clone();
        match outcome {
            Ok(ClaimOutcome::Leased { deliveries, .. }) => {
                if deliveries.is_empty() {
                    return self.report_demand();
                }
                let lease = self.state.settings.timing.lease();
                let deadline = Instant::now() + lease;
                let mut texts = Vec::with_capacity(deliveries.len());
                for leased in &deliveries {
                    self.held
                        .insert(DeliveryId::from_db(leased.delivery.id.clone()), deadline);
                    texts.push(frames::deliver(
                        &session_id,
                        &frames::Deliver {
                            delivery: DeliveryView::from(&leased.delivery),
                            event: &leased.event,
                            lease_secret: leased.secret.encode(),
                        },
                    ));
                }
                let tx = self.write_tx.clone();
                let timeout = self.state.settings.timing.write_timeout();
                let fut = async move {
                    for text in texts {
                        match tokio::time::timeout(timeout, tx.send(Outbound::Text(text))).await {
                            Ok(Ok(())) => {}
                            _ => return false,
                        }
                    }
                    true
                };
                ctx.spawn(fut.into_actor(self).map(|queued, act, ctx| {
                    if queued {
                        // The scanner set this session's room to 0 when the
                        // claim settled: always tell it the real room now.
                        act.last_reported_room = None;
                        act.report_demand();
                    } else {
                        ctx.stop();
                    }
                }));
                // Forget leases locally once they lapse, so room comes back.
                ctx.run_later(lease + Duration::from_millis(1), |act, _| {
                    let now = Instant::now();
                    act.held.retain(|_, deadline| *deadline > now);
                    act.report_demand();
                });
            }
            Ok(ClaimOutcome::Paused) => self.report_demand(),
            Ok(ClaimOutcome::HistoryExpired(earliest)) => self.fail(
                ctx,
                None,
                ErrorCode::EventHistoryExpired,
                &history_message(earliest),
                CloseCode::Policy,
            ),
            Ok(ClaimOutcome::Revoked) => self.fail(
                ctx,
                None,
                ErrorCode::Unauthenticated,
                "the credential was revoked",
                CloseCode::Policy,
            ),
            Ok(ClaimOutcome::Gone) => self.fail(
                ctx,
                None,
                ErrorCode::NotFound,
                "subscription not found",
                CloseCode::Policy,
            ),
            Err(_) => self.fail(
                ctx,
                None,
                ErrorCode::Unavailable,
                UNAVAILABLE,
                CloseCode::Error,
            ),
        }
    }
}

const UNAVAILABLE: &str = "the service is temporarily unavailable; reconnect later";
const REVOKED: &str = "the credential was revoked";

fn history_message(earliest: u64) -> String {
    format!("event history was purged; the earliest available sequence is {earliest}")
}

enum Revalidation {
    Ok {
        enabled: bool,
    },
    Revoked,
    /// The credential no longer holds `events:consume`.
    Denied,
    OutOfScope,
}

/// Re-checks the credential (revoked, `events:consume`) and the
/// subscription scope (on ping; protocol.md §3).
async fn revalidate(
    db: &store::Database,
    credential_id: &crate::domain::CredentialId,
    subscription_id: &SubscriptionId,
) -> Result<Revalidation, sea_orm::DbErr> {
    let Some(principal) = store::tenancy::principal_by_id(db.reader(), credential_id).await? else {
        return Ok(Revalidation::Revoked);
    };
    if !principal.permissions.contains(Permission::EventsConsume) {
        return Ok(Revalidation::Denied);
    }
    match store::subscriptions::get_owned(db.reader(), &principal, subscription_id.as_str()).await {
        Ok(sub) => Ok(Revalidation::Ok {
            enabled: sub.enabled,
        }),
        Err(err) if err.code() == ErrorCode::NotFound => Ok(Revalidation::OutOfScope),
        Err(err) => Err(sea_orm::DbErr::Custom(err.message().to_owned())),
    }
}

impl Actor for ConnectionActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        let Some((session, stream, rx)) = self.io.take() else {
            return ctx.stop();
        };
        self.start_writer(ctx, session, rx);
        self.start_reader(ctx, stream);

        let shutdown = self.state.shutdown.clone();
        ctx.spawn(
            async move { shutdown.begun().await }
                .into_actor(self)
                .map(|(), act, ctx| act.drain(ctx)),
        );

        let timing = self.state.settings.timing.clone();
        ctx.run_later(timing.hello_timeout(), |act, ctx| {
            if matches!(act.phase, Phase::AwaitingHello) {
                act.close(ctx, CloseCode::Policy, "no events.hello in time");
            }
        });
        let idle = timing.read_idle_timeout();
        let period = (idle / 4).clamp(Duration::from_millis(10), Duration::from_secs(1));
        ctx.run_interval(period, move |act, ctx| {
            if act.last_valid_frame.elapsed() >= idle {
                act.close(
                    ctx,
                    CloseCode::Away,
                    "no valid frame within the read idle timeout",
                );
            }
        });
    }

    fn stopping(&mut self, _: &mut Context<Self>) -> Running {
        self.leave_scanner();
        self.phase = Phase::Closing;
        self.read_permits.close();
        Running::Stop
    }
}

impl Handler<ClientText> for ConnectionActor {
    type Result = ();

    fn handle(&mut self, msg: ClientText, ctx: &mut Context<Self>) {
        self.handle_frame(ctx, &msg.text, msg.permit);
    }
}

impl Handler<ReaderEvent> for ConnectionActor {
    type Result = ();

    fn handle(&mut self, msg: ReaderEvent, ctx: &mut Context<Self>) {
        match msg {
            ReaderEvent::Violation(code, why) => self.close(ctx, code, why),
            ReaderEvent::PeerClosed => self.close(ctx, CloseCode::Normal, ""),
            ReaderEvent::PeerGone => ctx.stop(),
        }
    }
}

impl Handler<WriterStopped> for ConnectionActor {
    type Result = ();

    fn handle(&mut self, msg: WriterStopped, ctx: &mut Context<Self>) {
        if msg.timed_out {
            tracing::info!("write timed out; closing a consumer that stopped reading");
        }
        ctx.stop();
    }
}

impl Handler<WriterDrained> for ConnectionActor {
    type Result = ();

    fn handle(&mut self, _: WriterDrained, _: &mut Context<Self>) {
        self.report_demand();
    }
}

impl Handler<ClaimResult> for ConnectionActor {
    type Result = ();

    fn handle(&mut self, msg: ClaimResult, ctx: &mut Context<Self>) {
        self.on_leased(ctx, msg.outcome);
    }
}

/// Reassembles a fragmented text message, bounded in bytes and fragments.
#[derive(Default)]
struct Fragments {
    parts: Vec<Bytes>,
    size: usize,
    count: usize,
    active: bool,
}

impl Fragments {
    fn active(&self) -> bool {
        self.active
    }

    fn push(&mut self, item: Item) -> Result<Option<ByteString>, (CloseCode, &'static str)> {
        let (bytes, first, last) = match item {
            Item::FirstText(b) => (b, true, false),
            Item::FirstBinary(_) => {
                return Err((CloseCode::Policy, "binary frames are not accepted"));
            }
            Item::Continue(b) => (b, false, false),
            Item::Last(b) => (b, false, true),
        };
        if first == self.active {
            return Err((CloseCode::Protocol, "unexpected continuation frame"));
        }
        self.active = true;
        self.count += 1;
        self.size += bytes.len();
        if self.size > MAX_MESSAGE_BYTES {
            return Err((CloseCode::Size, "message too large"));
        }
        if self.count > MAX_FRAGMENTS {
            return Err((CloseCode::Policy, "too many fragments"));
        }
        if !bytes.is_empty() {
            self.parts.push(bytes);
        }
        if !last {
            return Ok(None);
        }
        let mut all = Vec::with_capacity(self.size);
        for part in self.parts.drain(..) {
            all.extend_from_slice(&part);
        }
        *self = Fragments::default();
        ByteString::try_from(all)
            .map(Some)
            .map_err(|_| (CloseCode::Invalid, "text is not UTF-8"))
    }
}
