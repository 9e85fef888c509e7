//! Reading the rest of a request body a handler did not read, before the
//! answer leaves (decision 0077).
//!
//! The node closes a connection as soon as a response is sent whose request
//! body was not read to its end (`client_disconnect_timeout` 0: actix-http's
//! linger would otherwise hold every clean WebSocket close for a second).
//! Closing with unread bytes in the socket makes the kernel send a reset,
//! and a client may then lose the answer (a 401 or 413 to a large body). So
//! the envelope middleware keeps the body: whatever the handler leaves
//! unread is read and discarded here first, up to [`DRAIN_BYTES`] and
//! [`DRAIN_TIME`] (a client that sends more or slower is cut off).

use std::{
    cell::RefCell,
    pin::Pin,
    rc::Rc,
    task::{Context, Poll},
    time::Duration,
};

use actix_web::{dev, error::PayloadError, web::Bytes};
use futures_util::{Stream, StreamExt};

/// Bytes of an unread body read at most before answering.
pub const DRAIN_BYTES: usize = 4 << 20;
/// Time spent at most reading an unread body before answering.
pub const DRAIN_TIME: Duration = Duration::from_secs(1);

/// The request body, shared between the handler (through [`KeptBody`])
/// and the middleware, which reads what is left after the handler.
pub struct UnreadBody(Rc<RefCell<dev::Payload>>);

/// The handler's view of the body: reads from the shared payload; dropping
/// it leaves the rest to [`UnreadBody::drain`].
struct KeptBody(Rc<RefCell<dev::Payload>>);

impl Stream for KeptBody {
    type Item = Result<Bytes, PayloadError>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        Pin::new(&mut *self.0.borrow_mut()).poll_next(cx)
    }
}

impl UnreadBody {
    /// Takes `payload` and returns the one for the handler.
    pub fn keep(payload: dev::Payload) -> (UnreadBody, dev::Payload) {
        let shared = Rc::new(RefCell::new(payload));
        let body: Pin<Box<dyn Stream<Item = Result<Bytes, PayloadError>>>> =
            Box::pin(KeptBody(shared.clone()));
        let handler = dev::Payload::Stream { payload: body };
        (UnreadBody(shared), handler)
    }

    /// Reads and discards what is left of the body, within the bounds.
    pub async fn drain(self) {
        let mut read = 0usize;
        let _ = tokio::time::timeout(DRAIN_TIME, async {
            while read <= DRAIN_BYTES {
                // Borrowed per chunk: the handler has finished with it.
                let next =
                    futures_util::future::poll_fn(|cx| self.0.borrow_mut().poll_next_unpin(cx))
                        .await;
                match next {
                    Some(Ok(chunk)) => read += chunk.len(),
                    _ => return,
                }
            }
        })
        .await;
    }
}
