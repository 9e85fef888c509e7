//! The socket's two halves: a reader task that takes frames only while it
//! holds a read-queue permit (backpressure: further frames wait in the
//! socket), and a writer task that drains the bounded write queue, each
//! send bounded by the write timeout (a consumer that stops reading is
//! found this way and its slot freed).

use std::sync::atomic::Ordering;

use actix::prelude::*;
use actix_web::web::Bytes;
use actix_ws::{
    CloseCode, CloseReason, Item, Message as WsMessage, MessageStream, ProtocolError, Session,
};
use bytestring::ByteString;
use futures_util::StreamExt;
use tokio::sync::mpsc;

use crate::ws::{MAX_FRAGMENTS, MAX_MESSAGE_BYTES};

use super::*;

/// What the writer task sends.
pub(super) enum Outbound {
    Text(String),
    Pong(Bytes),
    Close(CloseCode, String),
}

/// Queues `text` for the writer task, waiting at most `timeout` for room
/// (the backpressure of a reply or a delivery). False: the queue stayed
/// full that long or the writer task is gone; the connection should close.
pub(super) async fn queue_text(
    tx: &mpsc::Sender<Outbound>,
    text: String,
    timeout: std::time::Duration,
) -> bool {
    matches!(
        tokio::time::timeout(timeout, tx.send(Outbound::Text(text))).await,
        Ok(Ok(()))
    )
}

impl ConnectionActor {
    pub(super) fn start_writer(
        &self,
        ctx: &mut Context<Self>,
        mut session: Session,
        mut rx: mpsc::Receiver<Outbound>,
    ) {
        let addr = ctx.address();
        let timeout = self.state.settings.timing.write_timeout();
        let span = self.span.clone();
        actix::spawn(tracing::Instrument::instrument(
            async move {
                let mut timed_out = false;
                while let Some(out) = rx.recv().await {
                    let result = match out {
                        Outbound::Text(text) => {
                            tokio::time::timeout(timeout, session.text(text)).await
                        }
                        Outbound::Pong(bytes) => {
                            tokio::time::timeout(timeout, session.pong(&bytes)).await
                        }
                        Outbound::Close(code, reason) => {
                            let reason = CloseReason {
                                code,
                                description: (!reason.is_empty()).then_some(reason),
                            };
                            let _ =
                                tokio::time::timeout(timeout, session.close(Some(reason))).await;
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
            },
            span,
        ));
    }

    pub(super) fn start_reader(&self, ctx: &mut Context<Self>, mut stream: MessageStream) {
        let addr = ctx.address();
        let permits = self.read_permits.clone();
        let pong_tx = self.write_tx.clone();
        let oversized = self.oversized.clone();
        let span = self.span.clone();
        actix::spawn(tracing::Instrument::instrument(
            async move {
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
                            addr.do_send(ReaderEvent::Violation(
                                CloseCode::Size,
                                "message too large",
                            ));
                            return;
                        }
                        Some(Err(_)) if oversized.load(Ordering::Acquire) => {
                            addr.do_send(ReaderEvent::Violation(
                                CloseCode::Size,
                                "message too large",
                            ));
                            return;
                        }
                        // The connection broke (reset, EOF inside a frame):
                        // the peer went away, it sent nothing malformed.
                        Some(Err(ProtocolError::Io(_))) => {
                            addr.do_send(ReaderEvent::PeerGone);
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
            },
            span,
        ));
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
