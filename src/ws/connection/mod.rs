//! ConnectionActor: one per WebSocket (spec: architecture.md §1,
//! protocol.md §2–§4), in three rooms: this file holds the actor and its
//! protocol state machine (AwaitingHello → HelloPending → Bound → Closing),
//! `socket.rs` the reader and writer tasks that own the socket's halves,
//! `requests.rs` the hello, ACK and ping requests, `deliveries.rs` the
//! leases a claim brings.
//! The actor never awaits the database inside a handler: requests run as
//! spawned futures (each holding a read-queue permit, an ACK only until
//! it has joined the group commit) whose results come back to it. Every log line of a connection carries its `session_id`
//! (a span per connection; architecture.md §6).

use std::{
    collections::HashMap,
    sync::{Arc, atomic::AtomicBool},
    time::{Duration, Instant},
};

use actix::prelude::*;
use actix_ws::{CloseCode, MessageStream, Session};
use bytestring::ByteString;
use orbit_events_wire::{LIFETIME_CLOSE_REASON, SHUTDOWN_CLOSE_REASON};
use rand::RngExt;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};

use crate::{
    delivery::{
        pool::{ClaimResult, ConnectionSlot},
        scanner::{Demand, SessionClosed},
    },
    domain::Principal,
    domain::{DeliveryId, MessageId, QueueId, SessionId, SubscriptionId},
    error::ErrorCode,
    state::AppState,
    store::{self},
    ws::frames::{self, ClientFrameType},
};

mod deliveries;
mod requests;
mod socket;

use socket::Outbound;

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

/// Close reasons kept in a session's record (a close frame carries at most
/// 123 bytes).
const MAX_CLOSE_REASON_CHARS: usize = 123;
const SHUTTING_DOWN: &str = SHUTDOWN_CLOSE_REASON;

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

#[derive(Debug, Clone)]
struct Bound {
    session_id: SessionId,
    subscription_id: SubscriptionId,
    queue_id: QueueId,
    capacity: u32,
    /// One permit per ACK waiting for its commit, `capacity` in all
    /// (protocol.md §3: those ACKs no longer hold the read queue).
    acks_waiting: Arc<Semaphore>,
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
    /// The one timer that forgets lapsed leases (at the earliest deadline
    /// in `held`); one per connection, not one per claim, because actix
    /// polls every pending timer of a context on each of its wakes.
    lapse_timer: Option<SpawnHandle>,
    last_reported_room: Option<u32>,
    /// Hello, ACK and ping futures running (each holds a read permit, an
    /// ACK only until it has joined the group commit).
    in_flight: usize,
    /// The node is stopping: no new frames are taken; once `in_flight` is
    /// 0 the connection closes with 1001.
    draining: bool,
    /// Why it drains: the close reason sent with 1001 once idle.
    drain_reason: &'static str,
    /// The scanner was told this session is gone (once per session).
    left_scanner: bool,
    /// The close has its log line (one per connection).
    close_logged: bool,
    /// Held while the session is this connection's: claims check it after
    /// taking the write lock (a claim of a closed session leases nothing).
    session_alive: Arc<()>,
    _slot: ConnectionSlot,
    /// The connection's span: every log line of it carries `session_id`
    /// once the hello bound one.
    span: tracing::Span,
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
            lapse_timer: None,
            last_reported_room: None,
            in_flight: 0,
            draining: false,
            drain_reason: SHUTTING_DOWN,
            left_scanner: false,
            close_logged: false,
            session_alive: Arc::new(()),
            _slot: slot,
            span: tracing::info_span!("session", session_id = tracing::field::Empty),
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
        self.log_close(u16::from(code), reason);
        self.leave_scanner(u16::from(code), reason);
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

    /// The connection's one close line: who closed, the code and reason
    /// (in the `session` span, so with the session id once bound).
    fn log_close(&mut self, code: u16, reason: &str) {
        if std::mem::replace(&mut self.close_logged, true) {
            return;
        }
        let (session_id, subscription_id) = match &self.phase {
            Phase::Bound(b) => (
                Some(b.session_id.to_string()),
                Some(b.subscription_id.to_string()),
            ),
            _ => (None, None),
        };
        // The reason may quote the client's frame: masked like a path.
        tracing::info!(
            close_code = code,
            close_reason = %crate::domain::mask_tokens(reason),
            session_id = session_id.as_deref(),
            subscription_id = subscription_id.as_deref(),
            bound = subscription_id.is_some(),
            "connection closed ({code})"
        );
    }

    /// Leaves the scanner and records the session's close (`code`,
    /// `reason`: what the node sends, or 1006 when the socket just ended).
    fn leave_scanner(&mut self, code: u16, reason: &str) {
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
            let span = self.span.clone();
            let reason = reason
                .chars()
                .take(MAX_CLOSE_REASON_CHARS)
                .collect::<String>();
            actix::spawn(tracing::Instrument::instrument(
                async move {
                    if let Err(err) =
                        store::sessions::close_session(&db, &session_id, code, &reason).await
                    {
                        store::writer::log_failure(&err, "could not record the session close");
                    }
                },
                span,
            ));
        }
    }

    /// Node shutdown (protocol.md §3) or the end of the connection's
    /// lifetime: take no more frames and no more deliveries; close with
    /// 1001 and `reason` once in-flight database work is done, or after the
    /// write timeout at the latest.
    fn drain(&mut self, ctx: &mut Context<Self>, reason: &'static str) {
        if self.draining || matches!(self.phase, Phase::Closing) {
            return;
        }
        self.draining = true;
        self.drain_reason = reason;
        self.leave_scanner(u16::from(CloseCode::Away), reason);
        self.read_permits.close();
        self.finish_drain_if_idle(ctx);
    }

    /// The connection's lifetime ran out (decision 0086): drain as for a
    /// shutdown, but close after the write timeout even if an ACK commit
    /// is still running (its proof stays valid for the next connection).
    fn retire(&mut self, ctx: &mut Context<Self>) {
        self.drain(ctx, LIFETIME_CLOSE_REASON);
        let bound = self.state.settings.timing.write_timeout();
        ctx.run_later(bound, |act, ctx| {
            act.close(ctx, CloseCode::Away, LIFETIME_CLOSE_REASON);
        });
    }

    fn finish_drain_if_idle(&mut self, ctx: &mut Context<Self>) {
        if self.draining && self.in_flight == 0 {
            self.close(ctx, CloseCode::Away, self.drain_reason);
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
}

impl Actor for ConnectionActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        let _span = self.span.clone().entered();
        let Some((session, stream, rx)) = self.io.take() else {
            return ctx.stop();
        };
        self.start_writer(ctx, session, rx);
        self.start_reader(ctx, stream);

        let shutdown = self.state.shutdown.clone();
        ctx.spawn(
            async move { shutdown.begun().await }
                .into_actor(self)
                .map(|(), act, ctx| act.drain(ctx, SHUTTING_DOWN)),
        );

        let timing = self.state.settings.timing.clone();
        if let Some(lifetime) = timing.connection_lifetime() {
            // ±10 %: connections opened together (a restart) end spread out.
            let budget = lifetime.mul_f64(rand::rng().random_range(0.9..=1.1));
            ctx.run_later(budget, |act, ctx| act.retire(ctx));
        }
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
        let _span = self.span.clone().entered();
        self.log_close(1006, "the connection ended without a close frame");
        self.leave_scanner(1006, "the connection ended without a close frame");
        self.phase = Phase::Closing;
        self.read_permits.close();
        Running::Stop
    }
}

impl Handler<ClientText> for ConnectionActor {
    type Result = ();

    fn handle(&mut self, msg: ClientText, ctx: &mut Context<Self>) {
        let _span = self.span.clone().entered();
        self.handle_frame(ctx, &msg.text, msg.permit);
    }
}

impl Handler<ReaderEvent> for ConnectionActor {
    type Result = ();

    fn handle(&mut self, msg: ReaderEvent, ctx: &mut Context<Self>) {
        let _span = self.span.clone().entered();
        match msg {
            ReaderEvent::Violation(code, why) => self.close(ctx, code, why),
            ReaderEvent::PeerClosed => {
                self.log_close(
                    u16::from(CloseCode::Normal),
                    "the client closed the connection",
                );
                self.leave_scanner(
                    u16::from(CloseCode::Normal),
                    "the client closed the connection",
                );
                self.close(ctx, CloseCode::Normal, "")
            }
            ReaderEvent::PeerGone => ctx.stop(),
        }
    }
}

impl Handler<WriterStopped> for ConnectionActor {
    type Result = ();

    fn handle(&mut self, msg: WriterStopped, ctx: &mut Context<Self>) {
        let _span = self.span.clone().entered();
        if msg.timed_out {
            tracing::info!("write timed out; closing a consumer that stopped reading");
        }
        ctx.stop();
    }
}

impl Handler<WriterDrained> for ConnectionActor {
    type Result = ();

    fn handle(&mut self, _: WriterDrained, _: &mut Context<Self>) {
        let _span = self.span.clone().entered();
        self.report_demand();
    }
}

impl Handler<ClaimResult> for ConnectionActor {
    type Result = ();

    fn handle(&mut self, msg: ClaimResult, ctx: &mut Context<Self>) {
        let _span = self.span.clone().entered();
        self.on_leased(ctx, msg.outcome);
    }
}
