//! An orbit.events.v1 consumer that keeps going: it connects, says hello,
//! pings at the advertised interval, runs a [`Handler`] per delivery and
//! ACKs what the handler stored, reconnects, and sends unconfirmed ACK
//! proofs again on the new connection (spec: protocol.md §3–5). After the
//! node's lifetime close it reconnects at once (logged at INFO); after a
//! 429 it waits `Retry-After` plus up to as much again; after any other
//! drop it backs off with full jitter ([`Backoff`]).

use std::{
    collections::HashMap, future::Future, panic::AssertUnwindSafe, pin::Pin, sync::Arc,
    time::Duration,
};

use futures_util::{FutureExt, SinkExt, StreamExt, stream::SplitSink, stream::SplitStream};
use rand::RngExt;
use reqwest::{StatusCode, Url};
use tokio::{net::TcpStream, task::JoinSet, time::Instant};
use tokio_tungstenite::{
    MaybeTlsStream, WebSocketStream,
    tungstenite::{
        self, Message,
        client::IntoClientRequest,
        http::HeaderValue,
        protocol::{CloseFrame, frame::coding::CloseCode},
    },
};

use crate::{
    credentials::Token,
    error::{ApiError, ErrorCode},
    frames::{self, AckProof, AckReceipt, Delivery, ServerFrame, Welcome},
    management::{api_error, server_url},
};

/// What a handler returns when it could not store a delivery. The delivery
/// is not ACKed; it comes again after its lease.
pub type HandlerError = Box<dyn std::error::Error + Send + Sync>;

/// The application's side of a [`Consumer`].
///
/// `handle` runs once per delivery (several at once, up to the
/// connection's capacity). Store the event durably, keyed by
/// `delivery.event.id` (an Inbox), and return `Ok(())`: the consumer then
/// ACKs with the delivery's proof. A delivery whose event is already in
/// the Inbox is a redelivery: return `Ok(())` without processing it again,
/// so that it is ACKed with its new proof. Return `Err` when the event
/// could not be stored; it is not ACKed and will be delivered again.
pub trait Handler: Send + Sync + 'static {
    /// Stores one delivery; `Ok(())` means "ACK it".
    fn handle(&self, delivery: Delivery) -> impl Future<Output = Result<(), HandlerError>> + Send;

    /// Everything else that happens, for logs and metrics. Called on the
    /// consumer's task: keep it quick.
    fn on_outcome(&self, outcome: &Outcome) {
        let _ = outcome;
    }
}

/// What happened on the way, as reported to [`Handler::on_outcome`].
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum Outcome {
    /// A session is bound (after every (re)connection).
    Connected(Welcome),
    /// An ACK was confirmed (`deduplicated` when this proof had already
    /// acknowledged it, e.g. an ACK sent again after a lost reply).
    Acked(AckReceipt),
    /// `DELIVERY_LEASE_LOST`: the proof is no longer the delivery's latest
    /// (its lease lapsed and it was leased again). Keep the stored event:
    /// the next delivery of it carries a new proof and is ACKed after the
    /// Inbox check.
    LeaseLost {
        delivery_id: String,
        epoch: u64,
        message: String,
    },
    /// The handler failed (or panicked): not ACKed, delivered again after
    /// its lease.
    HandlerFailed {
        delivery_id: String,
        event_id: String,
        error: String,
    },
    /// The server refused a proof outright (`NOT_FOUND`: not a delivery of
    /// this subscription; `INVALID_ARGUMENT`: malformed). It is dropped.
    AckRejected {
        delivery_id: String,
        error: ApiError,
    },
    /// A delivery arrived while stopping; it was not handled and comes
    /// again after its lease.
    NotHandled { delivery_id: String },
    /// The connection ended or could not be made; the next attempt starts
    /// after `retry_in`.
    Disconnected { reason: String, retry_in: Duration },
}

/// How a [`Consumer::run`] ended.
#[derive(Debug, Clone, Default)]
pub struct Stopped {
    /// Proofs of stored deliveries whose ACK was not confirmed. Keep them
    /// (e.g. in the Inbox database) and pass them to
    /// [`Consumer::resend_proofs`] of the next run.
    pub unconfirmed: Vec<AckProof>,
}

/// Why a [`Consumer::run`] gave up. Reconnecting cannot fix these.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConsumerError {
    /// `EVENT_HISTORY_EXPIRED`: the log was purged past this subscription's
    /// position; the service never skips silently. `earliest_sequence` is
    /// the first sequence still available.
    #[error(
        "event history expired for this subscription (earliest available sequence: {})",
        earliest_sequence.map_or("unknown".to_owned(), |s| s.to_string())
    )]
    HistoryExpired {
        earliest_sequence: Option<u64>,
        error: ApiError,
        stopped: Stopped,
    },
    /// The service refused the consumer: `UNAUTHENTICATED`,
    /// `PERMISSION_DENIED` (no events:consume), `NOT_FOUND` (no such
    /// subscription for this credential), `INVALID_ARGUMENT`.
    #[error("refused by the server: {error}")]
    Refused { error: ApiError, stopped: Stopped },
    /// The configuration is unusable.
    #[error("{0}")]
    Config(String),
}

/// Reconnection delays: the n-th consecutive failure waits a random time
/// between half and all of `min(max, initial × 2ⁿ)` (jitter spreads
/// consumers that lost the same node).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    pub initial: Duration,
    pub max: Duration,
}

impl Default for Backoff {
    /// 100 ms doubling to 10 s.
    fn default() -> Backoff {
        Backoff {
            initial: Duration::from_millis(100),
            max: Duration::from_secs(10),
        }
    }
}

impl Backoff {
    /// The delay before attempt `failures` (0 = after the first failure):
    /// full jitter, uniform in `0..=min(initial × 2^failures, max)`, so that
    /// consumers dropped together (a node restart) come back spread over
    /// the whole window, not in a wave at its upper half.
    pub fn delay(&self, failures: u32) -> Duration {
        let cap = self
            .initial
            .saturating_mul(2u32.saturating_pow(failures.min(31)))
            .min(self.max);
        jitter(cap)
    }
}

/// Uniform in `0..=span`.
fn jitter(span: Duration) -> Duration {
    let nanos = u64::try_from(span.as_nanos()).unwrap_or(u64::MAX);
    Duration::from_nanos(rand::rng().random_range(0..=nanos))
}

/// A consumer of one subscription. Build it, then [`Consumer::run`] it.
///
/// ```no_run
/// # async fn example(handler: impl orbit_events_client::Handler) -> Result<(), Box<dyn std::error::Error>> {
/// use orbit_events_client::{Consumer, Token};
///
/// let token = Token::from_env("ORBIT_EVENTS_TOKEN")?;
/// let stopped = Consumer::new("http://127.0.0.1:8080", token, "0123456789abcdef0123456789abcdef")?
///     .capacity(8)
///     .run(handler, async { let _ = tokio::signal::ctrl_c().await; })
///     .await?;
/// println!("{} ACKs unconfirmed at exit", stopped.unconfirmed.len());
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Consumer {
    url: Url,
    token: Token,
    subscription_id: String,
    capacity: u32,
    backoff: Backoff,
    connect_timeout: Duration,
    write_timeout: Duration,
    shutdown_grace: Duration,
    resend: Vec<AckProof>,
}

impl Consumer {
    /// A consumer of `subscription_id` on the node at `server` (its base
    /// URL, e.g. `http://127.0.0.1:8080`; the WebSocket is
    /// `/v1/events/connect` there), capacity 1.
    pub fn new(
        server: &str,
        token: Token,
        subscription_id: &str,
    ) -> Result<Consumer, crate::Error> {
        let mut url = server_url(server)?;
        if let Ok(mut segments) = url.path_segments_mut() {
            segments.pop_if_empty().extend(["v1", "events", "connect"]);
        }
        url.set_scheme("ws")
            .map_err(|()| crate::Error::InvalidInput(format!("{server:?}: not a server URL")))?;
        Ok(Consumer {
            url,
            token,
            subscription_id: subscription_id.to_owned(),
            capacity: 1,
            backoff: Backoff::default(),
            connect_timeout: Duration::from_secs(10),
            write_timeout: Duration::from_secs(5),
            shutdown_grace: Duration::from_secs(5),
            resend: Vec::new(),
        })
    }

    /// How many deliveries the connection may hold at once (1–32), which
    /// is also how many handlers may run at once.
    pub fn capacity(mut self, capacity: u32) -> Consumer {
        self.capacity = capacity;
        self
    }

    /// Reconnection delays (default 100 ms doubling to 10 s, jittered).
    pub fn backoff(mut self, backoff: Backoff) -> Consumer {
        self.backoff = backoff;
        self
    }

    /// How long connecting plus the hello may take (default 10 s).
    pub fn connect_timeout(mut self, timeout: Duration) -> Consumer {
        self.connect_timeout = timeout;
        self
    }

    /// After the shutdown signal and the last handler, how long to wait for
    /// the replies to the last ACKs (default 5 s). Proofs still unconfirmed
    /// then are returned in [`Stopped::unconfirmed`].
    pub fn shutdown_grace(mut self, grace: Duration) -> Consumer {
        self.shutdown_grace = grace;
        self
    }

    /// Proofs kept from an earlier run ([`Stopped::unconfirmed`]): sent on
    /// the first connection.
    pub fn resend_proofs(mut self, proofs: Vec<AckProof>) -> Consumer {
        self.resend = proofs;
        self
    }

    /// Runs until `shutdown` completes or the service refuses the consumer.
    ///
    /// On `shutdown`: no new delivery is handled, running handlers finish,
    /// their ACKs are sent and their replies awaited for at most the
    /// shutdown grace, then the connection closes (1000). Disconnects,
    /// `UNAVAILABLE`, a node at capacity (429) or shutting down (503, 1001)
    /// are retried with backoff; only the refusals of [`ConsumerError`]
    /// end the run.
    pub async fn run<H: Handler>(
        self,
        handler: H,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<Stopped, ConsumerError> {
        if !(1..=32).contains(&self.capacity) {
            return Err(ConsumerError::Config(format!(
                "capacity must be 1-32, not {}",
                self.capacity
            )));
        }
        let unconfirmed = self
            .resend
            .iter()
            .map(|p| (p.delivery_id.clone(), p.clone()))
            .collect();
        let mut run = Run {
            config: self,
            handler: Arc::new(handler),
            tasks: JoinSet::new(),
            unconfirmed,
            shutdown: Box::pin(shutdown),
            stopping: false,
            failures: 0,
        };
        let end = run.drive().await;
        // Whatever ended the run, the handlers finish their persistence and
        // their proofs are kept.
        while let Some(done) = run.tasks.join_next().await {
            if let Some(proof) = run.finished(done) {
                run.unconfirmed.insert(proof.delivery_id.clone(), proof);
            }
        }
        let stopped = Stopped {
            unconfirmed: run.unconfirmed.into_values().collect(),
        };
        match end {
            None => Ok(stopped),
            Some(error) if error.code == ErrorCode::EventHistoryExpired => {
                Err(ConsumerError::HistoryExpired {
                    earliest_sequence: error.earliest_sequence(),
                    error,
                    stopped,
                })
            }
            Some(error) => Err(ConsumerError::Refused { error, stopped }),
        }
    }
}

type Sink = SplitSink<WebSocketStream<MaybeTlsStream<TcpStream>>, Message>;
type Source = SplitStream<WebSocketStream<MaybeTlsStream<TcpStream>>>;

/// The outcome of one handler task: its proof, event id and result.
type Done = (AckProof, String, Result<(), String>);

struct Run<H> {
    config: Consumer,
    handler: Arc<H>,
    tasks: JoinSet<Done>,
    /// Stored deliveries whose ACK is not confirmed, by delivery id.
    unconfirmed: HashMap<String, AckProof>,
    shutdown: Pin<Box<dyn Future<Output = ()> + Send>>,
    stopping: bool,
    /// Consecutive failed connections (for the backoff).
    failures: u32,
}

/// Why a connection attempt or a session ended.
enum End {
    /// Stopping, and every ACK was answered (or the grace ran out).
    Stopped,
    /// Try again after the backoff, or after `retry_after` plus jitter
    /// when the server said how long (a 429).
    Retry {
        reason: String,
        retry_after: Option<Duration>,
    },
    /// A routine end (the connection's lifetime): reconnect at once.
    Reconnect { reason: String },
    /// Reconnecting cannot help.
    Fatal(ApiError),
}

/// A bound session.
struct Session {
    sink: Sink,
    source: Source,
    welcome: Welcome,
    /// ACKs sent on this connection, by message id.
    sent: HashMap<String, AckProof>,
    /// The ping awaiting its reply.
    ping: Option<String>,
    last_frame: Instant,
    /// A frame after the welcome arrived: the session works.
    healthy: bool,
}

impl<H: Handler> Run<H> {
    /// Connects and serves sessions until stopped; `Some` for a refusal.
    async fn drive(&mut self) -> Option<ApiError> {
        loop {
            if self.stopping {
                return None;
            }
            let attempt = tokio::select! {
                _ = &mut self.shutdown, if !self.stopping => {
                    self.stopping = true;
                    continue;
                }
                connected = connect(&self.config) => connected,
            };
            let end = match attempt {
                Ok(session) => {
                    self.handler
                        .on_outcome(&Outcome::Connected(session.welcome.clone()));
                    self.serve(session).await
                }
                Err(end) => end,
            };
            match end {
                End::Stopped => return None,
                End::Fatal(error) => return Some(error),
                // Stopping: no new connection; the proofs are returned.
                End::Retry { .. } | End::Reconnect { .. } if self.stopping => return None,
                End::Reconnect { reason } => {
                    tracing::info!(%reason, "orbit-events consumer: reconnecting at once");
                    self.failures = 0;
                    self.handler.on_outcome(&Outcome::Disconnected {
                        reason,
                        retry_in: Duration::ZERO,
                    });
                }
                End::Retry {
                    reason,
                    retry_after,
                } => {
                    let delay = match retry_after {
                        // The server's own wait, plus up to as much again:
                        // refused consumers do not all return in one wave.
                        Some(wait) => wait + jitter(wait),
                        None => self.config.backoff.delay(self.failures),
                    };
                    self.failures = self.failures.saturating_add(1);
                    tracing::debug!(%reason, ?delay, "orbit-events consumer: reconnecting");
                    self.handler.on_outcome(&Outcome::Disconnected {
                        reason,
                        retry_in: delay,
                    });
                    self.wait(delay).await;
                }
            }
        }
    }

    /// Waits `delay` while handlers finish (their proofs are kept for the
    /// next connection); returns early on shutdown.
    async fn wait(&mut self, delay: Duration) {
        let until = tokio::time::sleep(delay);
        tokio::pin!(until);
        loop {
            tokio::select! {
                _ = &mut until => return,
                _ = &mut self.shutdown, if !self.stopping => {
                    self.stopping = true;
                    return;
                }
                Some(done) = self.tasks.join_next() => {
                    if let Some(proof) = self.finished(done) {
                        self.unconfirmed.insert(proof.delivery_id.clone(), proof);
                    }
                }
            }
        }
    }

    /// A handler task ended: its proof when the delivery is to be ACKed.
    fn finished(&self, done: Result<Done, tokio::task::JoinError>) -> Option<AckProof> {
        match done {
            Ok((proof, _, Ok(()))) => Some(proof),
            Ok((proof, event_id, Err(error))) => {
                self.handler.on_outcome(&Outcome::HandlerFailed {
                    delivery_id: proof.delivery_id,
                    event_id,
                    error,
                });
                None
            }
            // Tasks are never aborted and panics are caught inside them.
            Err(_) => None,
        }
    }

    /// Serves one session until it ends.
    async fn serve(&mut self, mut session: Session) -> End {
        // Proofs kept from earlier connections go first.
        let pending: Vec<AckProof> = self.unconfirmed.values().cloned().collect();
        for proof in pending {
            if let Err(end) = self.send_ack(&mut session, proof).await {
                return end;
            }
        }
        let heartbeat = session
            .welcome
            .heartbeat_interval()
            .max(Duration::from_millis(10));
        let mut ticks = tokio::time::interval_at(Instant::now() + heartbeat, heartbeat);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut grace: Option<Instant> = None;
        loop {
            if self.stopping && self.tasks.is_empty() {
                let until = *grace.get_or_insert(Instant::now() + self.config.shutdown_grace);
                if self.unconfirmed.is_empty() || Instant::now() >= until {
                    close(&mut session.sink, "the consumer is stopping").await;
                    return End::Stopped;
                }
            }
            let grace_sleep = tokio::time::sleep_until(grace.unwrap_or_else(Instant::now));
            tokio::select! {
                _ = &mut self.shutdown, if !self.stopping => {
                    self.stopping = true;
                }
                Some(done) = self.tasks.join_next() => {
                    if let Some(proof) = self.finished(done)
                        && let Err(end) = self.send_ack(&mut session, proof).await
                    {
                        return end;
                    }
                }
                frame = session.source.next() => {
                    let text = match frame {
                        Some(Ok(Message::Text(text))) => text,
                        Some(Ok(Message::Close(close))) => {
                            let reason = match &close {
                                Some(c) => format!("closed by the server ({}: {})", u16::from(c.code), c.reason),
                                None => "closed by the server".to_owned(),
                            };
                            return match close {
                                Some(c) if u16::from(c.code) == 1001
                                    && c.reason.as_str() == orbit_events_wire::LIFETIME_CLOSE_REASON =>
                                {
                                    End::Reconnect { reason }
                                }
                                _ => End::Retry { reason, retry_after: None },
                            };
                        }
                        Some(Ok(Message::Binary(_))) => return End::Retry {
                            reason: "the server sent a binary frame".to_owned(),
                            retry_after: None,
                        },
                        Some(Ok(_)) => continue,
                        Some(Err(e)) => return End::Retry { reason: format!("connection lost: {e}"), retry_after: None },
                        None => return End::Retry { reason: "connection lost".to_owned(), retry_after: None },
                    };
                    session.last_frame = Instant::now();
                    let frame = match ServerFrame::parse(&text) {
                        Ok(frame) => frame,
                        Err(e) => return End::Retry { reason: e.to_string(), retry_after: None },
                    };
                    if let Some(end) = self.on_frame(&mut session, frame).await {
                        return end;
                    }
                }
                _ = ticks.tick() => {
                    // Any frame proves the connection alive; a ping that has
                    // gone unanswered with nothing else arriving for two
                    // intervals means it is not.
                    if session.ping.is_some() && session.last_frame.elapsed() > heartbeat * 2 {
                        return End::Retry {
                            reason: "no reply to a ping within two heartbeat intervals".to_owned(),
                            retry_after: None,
                        };
                    }
                    if session.ping.is_none() {
                        let ping = frames::ping(&session.welcome.session_id);
                        if let Err(end) = send(&mut session.sink, ping.text, self.config.write_timeout).await {
                            return end;
                        }
                        session.ping = Some(ping.message_id);
                    }
                }
                _ = grace_sleep, if grace.is_some() => {}
            }
        }
    }

    /// Acts on one frame; `Some` ends the session.
    async fn on_frame(&mut self, session: &mut Session, frame: ServerFrame) -> Option<End> {
        if !session.healthy {
            session.healthy = true;
            self.failures = 0;
        }
        match frame {
            ServerFrame::Deliver(body) => {
                let delivery = match Delivery::from_body(*body) {
                    Ok(d) => d,
                    Err(e) => {
                        return Some(End::Retry {
                            reason: e.to_string(),
                            retry_after: None,
                        });
                    }
                };
                let proof = delivery.proof().clone();
                // A newer lease of the same delivery makes an older proof
                // useless (it could only get DELIVERY_LEASE_LOST).
                if self
                    .unconfirmed
                    .get(&proof.delivery_id)
                    .is_some_and(|old| old.epoch < proof.epoch)
                {
                    self.unconfirmed.remove(&proof.delivery_id);
                }
                if self.stopping {
                    self.handler.on_outcome(&Outcome::NotHandled {
                        delivery_id: proof.delivery_id,
                    });
                    return None;
                }
                let handler = self.handler.clone();
                let event_id = delivery.event.id.clone();
                self.tasks.spawn(async move {
                    let result = AssertUnwindSafe(handler.handle(delivery))
                        .catch_unwind()
                        .await;
                    let result = match result {
                        Ok(Ok(())) => Ok(()),
                        Ok(Err(e)) => Err(e.to_string()),
                        Err(_) => Err("the handler panicked".to_owned()),
                    };
                    (proof, event_id, result)
                });
                None
            }
            ServerFrame::Ack { reply_to, body } => {
                session.sent.remove(&reply_to);
                if self
                    .unconfirmed
                    .get(&body.delivery_id)
                    .is_some_and(|p| p.epoch == body.epoch)
                {
                    self.unconfirmed.remove(&body.delivery_id);
                }
                self.handler.on_outcome(&Outcome::Acked(body));
                None
            }
            ServerFrame::Pong { reply_to, .. } => {
                if session.ping.as_deref() == Some(reply_to.as_str()) {
                    session.ping = None;
                }
                None
            }
            ServerFrame::Welcome { .. } => Some(End::Retry {
                reason: "a second welcome".to_owned(),
                retry_after: None,
            }),
            ServerFrame::Error { reply_to, error } => {
                let error = error.to_api_error();
                let proof = reply_to.as_ref().and_then(|r| session.sent.remove(r));
                match (proof, &error.code) {
                    (Some(proof), ErrorCode::DeliveryLeaseLost) => {
                        self.forget(&proof);
                        self.handler.on_outcome(&Outcome::LeaseLost {
                            delivery_id: proof.delivery_id,
                            epoch: proof.epoch,
                            message: error.message,
                        });
                        None
                    }
                    // A proof the server refuses outright is dropped; a
                    // NOT_FOUND also closes the connection, and the
                    // reconnection goes on without it.
                    (Some(proof), ErrorCode::NotFound | ErrorCode::InvalidArgument) => {
                        self.forget(&proof);
                        self.handler.on_outcome(&Outcome::AckRejected {
                            delivery_id: proof.delivery_id,
                            error,
                        });
                        None
                    }
                    (_, ErrorCode::DeliveryLeaseLost | ErrorCode::InvalidArgument) => None,
                    (_, ErrorCode::Unavailable) => Some(End::Retry {
                        reason: error.to_string(),
                        retry_after: None,
                    }),
                    _ => Some(End::Fatal(error)),
                }
            }
        }
    }

    /// Drops `proof` from the unconfirmed set unless a newer one replaced it.
    fn forget(&mut self, proof: &AckProof) {
        if self
            .unconfirmed
            .get(&proof.delivery_id)
            .is_some_and(|p| p.epoch == proof.epoch)
        {
            self.unconfirmed.remove(&proof.delivery_id);
        }
    }

    /// Sends `event.ack`; the proof stays unconfirmed until its reply.
    async fn send_ack(&mut self, session: &mut Session, proof: AckProof) -> Result<(), End> {
        let frame = frames::ack(&session.welcome.session_id, &proof);
        self.unconfirmed
            .insert(proof.delivery_id.clone(), proof.clone());
        send(&mut session.sink, frame.text, self.config.write_timeout).await?;
        session.sent.insert(frame.message_id, proof);
        Ok(())
    }
}

/// Sends one text frame within `timeout`.
async fn send(sink: &mut Sink, text: String, timeout: Duration) -> Result<(), End> {
    match tokio::time::timeout(timeout, sink.send(Message::text(text))).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(End::Retry {
            reason: format!("connection lost: {e}"),
            retry_after: None,
        }),
        Err(_) => Err(End::Retry {
            reason: "the server did not take a frame within the write timeout".to_owned(),
            retry_after: None,
        }),
    }
}

/// Closes with 1000, without waiting long for the server's answer.
async fn close(sink: &mut Sink, reason: &'static str) {
    let frame = CloseFrame {
        code: CloseCode::Normal,
        reason: reason.into(),
    };
    let _ = tokio::time::timeout(
        Duration::from_secs(1),
        sink.send(Message::Close(Some(frame))),
    )
    .await;
}

/// Upgrades, says hello and waits for the welcome.
async fn connect(config: &Consumer) -> Result<Session, End> {
    let retry = |reason: String| End::Retry {
        reason,
        retry_after: None,
    };
    let mut request = config
        .url
        .as_str()
        .into_client_request()
        .map_err(|e| retry(e.to_string()))?;
    let headers = request.headers_mut();
    headers.insert(
        "Sec-WebSocket-Protocol",
        HeaderValue::from_static(frames::SUBPROTOCOL),
    );
    let bearer =
        HeaderValue::from_str(&config.token.bearer()).map_err(|_| End::Fatal(bad_token()))?;
    headers.insert("Authorization", bearer);
    let deadline = Instant::now() + config.connect_timeout;
    // Nagle off: an ACK is a small frame that must leave when it is sent.
    let upgraded = tokio::time::timeout_at(
        deadline,
        tokio_tungstenite::connect_async_with_config(request, None, true),
    )
    .await
    .map_err(|_| retry("connecting timed out".to_owned()))?;
    let (stream, response) = match upgraded {
        Ok(ok) => ok,
        Err(tungstenite::Error::Http(response)) => return Err(refused_upgrade(&response)),
        Err(e) => return Err(retry(format!("cannot connect: {e}"))),
    };
    if response
        .headers()
        .get("sec-websocket-protocol")
        .is_none_or(|p| p != frames::SUBPROTOCOL)
    {
        return Err(retry(
            "the server did not select orbit.events.v1".to_owned(),
        ));
    }
    let (mut sink, mut source) = stream.split();
    let hello = frames::hello(&config.subscription_id, config.capacity);
    send(&mut sink, hello.text, config.write_timeout).await?;
    loop {
        let next = tokio::time::timeout_at(deadline, source.next())
            .await
            .map_err(|_| retry("no welcome within the connect timeout".to_owned()))?;
        let text = match next {
            Some(Ok(Message::Text(text))) => text,
            Some(Ok(Message::Close(_))) | None => {
                return Err(retry("closed during the hello".to_owned()));
            }
            Some(Ok(Message::Binary(_))) => {
                return Err(retry("the server sent a binary frame".to_owned()));
            }
            Some(Ok(_)) => continue,
            Some(Err(e)) => return Err(retry(format!("connection lost: {e}"))),
        };
        return match ServerFrame::parse(&text) {
            Ok(ServerFrame::Welcome { reply_to, body }) if reply_to == hello.message_id => {
                Ok(Session {
                    sink,
                    source,
                    welcome: body,
                    sent: HashMap::new(),
                    ping: None,
                    last_frame: Instant::now(),
                    healthy: false,
                })
            }
            Ok(ServerFrame::Error { error, .. }) => {
                let error = error.to_api_error();
                if error.code == ErrorCode::Unavailable {
                    Err(retry(error.to_string()))
                } else {
                    Err(End::Fatal(error))
                }
            }
            Ok(other) => Err(retry(format!("expected events.welcome, got {other:?}"))),
            Err(e) => Err(retry(e.to_string())),
        };
    }
}

/// An upgrade answered with an HTTP error: 429 and 5xx are retried
/// (`Retry-After` respected), the rest is a refusal.
fn refused_upgrade(response: &tungstenite::handshake::client::Response) -> End {
    let status = StatusCode::from_u16(response.status().as_u16())
        .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let retry_after = response
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        .map(Duration::from_secs);
    let body = response
        .body()
        .as_deref()
        .map(String::from_utf8_lossy)
        .unwrap_or_default();
    let error = api_error(status, &body, retry_after);
    if status == StatusCode::TOO_MANY_REQUESTS || status.is_server_error() {
        End::Retry {
            reason: format!("upgrade refused: {error}"),
            retry_after,
        }
    } else {
        End::Fatal(error)
    }
}

fn bad_token() -> ApiError {
    ApiError {
        status: None,
        code: ErrorCode::Unauthenticated,
        message: "the token cannot be sent in an Authorization header".to_owned(),
        details: None,
        request_id: None,
        retry_after: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_its_maximum_with_full_jitter() {
        let backoff = Backoff {
            initial: Duration::from_millis(100),
            max: Duration::from_secs(1),
        };
        let (mut low, mut high) = (false, false);
        for _ in 0..200 {
            let first = backoff.delay(0);
            assert!(first <= Duration::from_millis(100));
            let third = backoff.delay(2);
            assert!(third <= Duration::from_millis(400));
            let capped = backoff.delay(30);
            assert!(capped <= Duration::from_secs(1));
            low |= capped < Duration::from_millis(250);
            high |= capped > Duration::from_millis(750);
        }
        assert!(low && high, "the whole window is used");
        assert_ne!(
            (0..20).map(|_| backoff.delay(3)).collect::<Vec<_>>(),
            vec![backoff.delay(3); 20],
            "jittered"
        );
    }

    #[test]
    fn the_websocket_url_is_the_connect_endpoint_of_the_server() {
        let token = Token::new("t").unwrap();
        let c = Consumer::new("http://127.0.0.1:8080", token.clone(), "s").unwrap();
        assert_eq!(c.url.as_str(), "ws://127.0.0.1:8080/v1/events/connect");
        let c = Consumer::new("http://h:1/prefix/", token, "s").unwrap();
        assert_eq!(c.url.as_str(), "ws://h:1/prefix/v1/events/connect");
    }

    #[tokio::test]
    async fn a_capacity_outside_1_to_32_is_refused_before_connecting() {
        struct Nothing;
        impl Handler for Nothing {
            async fn handle(&self, _: Delivery) -> Result<(), HandlerError> {
                Ok(())
            }
        }
        let c = Consumer::new("http://127.0.0.1:1", Token::new("t").unwrap(), "s")
            .unwrap()
            .capacity(33);
        assert!(matches!(
            c.run(Nothing, async {}).await,
            Err(ConsumerError::Config(_))
        ));
    }
}
