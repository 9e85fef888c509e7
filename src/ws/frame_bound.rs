//! The read path's byte bound (decision 0077): every WebSocket frame header
//! is checked as its bytes arrive, in front of actix-ws, whose
//! `MessageStream` buffers whatever the socket has before its codec looks at
//! a frame's length (stack-notes.md). A header announcing more than the
//! message limit (one frame, or the fragments of one message together) ends
//! the stream right after the bytes before it, so no connection buffers more
//! than one message's limit plus one read.

use std::{
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    task::{Context, Poll},
};

use actix_web::{error::PayloadError, web::Bytes};
use futures_util::Stream;

/// Where the parser is in the byte stream of client frames.
#[derive(Debug, Clone, Copy)]
enum Position {
    /// `have` bytes of a frame header read so far.
    Header { have: usize },
    /// Payload bytes of the current frame still to come.
    Payload { left: u64 },
}

/// Passes a WebSocket connection's incoming bytes through unchanged while
/// every frame keeps within `limit`; see the module documentation.
pub struct FrameBound<S> {
    inner: S,
    limit: u64,
    position: Position,
    header: [u8; 14],
    /// Payload bytes of the data message in progress (its fragments so far).
    message: u64,
    /// The frame being read ends a data message (FIN on a data frame).
    ends_message: bool,
    /// Set once a header announced too much; the stream then ends with an
    /// error (after the bytes before that header).
    oversized: Arc<AtomicBool>,
    failed: bool,
}

impl<S> FrameBound<S> {
    /// Bounds `inner` to messages of at most `limit` bytes; `oversized` is
    /// set when a header announced more (the reader closes 1009 then).
    pub fn new(inner: S, limit: usize, oversized: Arc<AtomicBool>) -> FrameBound<S> {
        FrameBound {
            inner,
            limit: limit as u64,
            position: Position::Header { have: 0 },
            header: [0; 14],
            message: 0,
            ends_message: false,
            oversized,
            failed: false,
        }
    }

    /// Reads `bytes` through the frame structure; `Err(k)`: the header that
    /// ends at `bytes[k - 1]` announced too much (`k` bytes are fine to pass).
    fn scan(&mut self, bytes: &[u8]) -> Result<(), usize> {
        let mut at = 0;
        while at < bytes.len() {
            match self.position {
                Position::Payload { left } => {
                    let take = left.min((bytes.len() - at) as u64);
                    at += take as usize;
                    self.advance_payload(left - take);
                }
                Position::Header { mut have } => {
                    self.header[have] = bytes[at];
                    have += 1;
                    at += 1;
                    match self.header_complete(have) {
                        None => self.position = Position::Header { have },
                        Some(len) => {
                            if !self.admit(len) {
                                return Err(at);
                            }
                            self.advance_payload(len);
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// The announced payload length once `have` header bytes complete it.
    fn header_complete(&self, have: usize) -> Option<u64> {
        if have < 2 {
            return None;
        }
        let masked = self.header[1] & 0x80 != 0;
        let (extended, len7) = match self.header[1] & 0x7f {
            126 => (2, None),
            127 => (8, None),
            n => (0, Some(u64::from(n))),
        };
        let total = 2 + extended + if masked { 4 } else { 0 };
        if have < total {
            return None;
        }
        Some(len7.unwrap_or_else(|| {
            self.header[2..2 + extended]
                .iter()
                .fold(0u64, |n, b| (n << 8) | u64::from(*b))
        }))
    }

    /// Counts a complete header announcing `len` payload bytes; false when
    /// the frame, or the message it belongs to, exceeds the limit.
    fn admit(&mut self, len: u64) -> bool {
        let fin = self.header[0] & 0x80 != 0;
        let opcode = self.header[0] & 0x0f;
        if len > self.limit {
            return false;
        }
        if opcode & 0x08 != 0 {
            // A control frame (close, ping, pong) may come between the
            // fragments of a message and belongs to none.
            self.ends_message = false;
            return true;
        }
        if opcode != 0 {
            // A text or binary frame starts a message.
            self.message = 0;
        }
        self.message = self.message.saturating_add(len);
        self.ends_message = fin;
        self.message <= self.limit
    }

    fn advance_payload(&mut self, left: u64) {
        if left > 0 {
            self.position = Position::Payload { left };
            return;
        }
        if self.ends_message {
            self.message = 0;
            self.ends_message = false;
        }
        self.position = Position::Header { have: 0 };
    }
}

impl<S> Stream for FrameBound<S>
where
    S: Stream<Item = Result<Bytes, PayloadError>> + Unpin,
{
    type Item = Result<Bytes, PayloadError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        if this.failed {
            return Poll::Ready(Some(Err(PayloadError::Overflow)));
        }
        match Pin::new(&mut this.inner).poll_next(cx) {
            Poll::Ready(Some(Ok(bytes))) => match this.scan(&bytes) {
                Ok(()) => Poll::Ready(Some(Ok(bytes))),
                Err(fine) => {
                    this.failed = true;
                    this.oversized.store(true, Ordering::Release);
                    // The frames before the header still reach the codec; the
                    // header itself is kept back, so its frame is never read.
                    let header_start = fine.saturating_sub(header_len(&this.header));
                    if header_start == 0 {
                        Poll::Ready(Some(Err(PayloadError::Overflow)))
                    } else {
                        Poll::Ready(Some(Ok(bytes.slice(..header_start))))
                    }
                }
            },
            other => other,
        }
    }
}

/// The length of the complete header in `header`.
fn header_len(header: &[u8; 14]) -> usize {
    let masked = header[1] & 0x80 != 0;
    let extended = match header[1] & 0x7f {
        126 => 2,
        127 => 8,
        _ => 0,
    };
    2 + extended + if masked { 4 } else { 0 }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_util::{StreamExt, stream};

    const LIMIT: usize = 524_288;

    /// A masked client frame header announcing `len` bytes.
    fn header(fin: bool, opcode: u8, len: u64) -> Vec<u8> {
        let mut h = vec![(if fin { 0x80 } else { 0 }) | opcode];
        match len {
            0..=125 => h.push(0x80 | len as u8),
            126..=0xffff => {
                h.push(0x80 | 126);
                h.extend_from_slice(&(len as u16).to_be_bytes());
            }
            _ => {
                h.push(0x80 | 127);
                h.extend_from_slice(&len.to_be_bytes());
            }
        }
        h.extend_from_slice(&[1, 2, 3, 4]);
        h
    }

    fn frame(fin: bool, opcode: u8, len: usize) -> Vec<u8> {
        let mut f = header(fin, opcode, len as u64);
        f.extend(std::iter::repeat_n(b'a', len));
        f
    }

    /// Feeds `bytes` in chunks of `chunk`; returns what passed and whether
    /// the stream ended with the overflow error.
    async fn run(bytes: Vec<u8>, chunk: usize) -> (Vec<u8>, bool) {
        let chunks: Vec<Result<Bytes, PayloadError>> = bytes
            .chunks(chunk)
            .map(|c| Ok(Bytes::copy_from_slice(c)))
            .collect();
        let flag = Arc::new(AtomicBool::new(false));
        let mut bound = FrameBound::new(stream::iter(chunks), LIMIT, flag.clone());
        let mut passed = Vec::new();
        let mut failed = false;
        while let Some(item) = bound.next().await {
            match item {
                Ok(b) => passed.extend_from_slice(&b),
                Err(_) => {
                    failed = true;
                    break;
                }
            }
        }
        assert_eq!(failed, flag.load(Ordering::Acquire));
        (passed, failed)
    }

    #[tokio::test]
    async fn frames_within_the_limit_pass_unchanged_whatever_the_chunking() {
        let mut bytes = frame(true, 1, 10);
        bytes.extend(frame(true, 1, LIMIT));
        bytes.extend(frame(false, 1, 1000));
        bytes.extend(frame(true, 9, 4)); // a ping between fragments
        bytes.extend(frame(true, 0, LIMIT - 1000));
        for chunk in [1, 7, 4096, 1 << 20] {
            let (passed, failed) = run(bytes.clone(), chunk).await;
            assert!(!failed, "chunk {chunk}");
            assert_eq!(passed, bytes, "chunk {chunk}");
        }
    }

    #[tokio::test]
    async fn a_header_announcing_4_gib_ends_the_stream_before_its_payload() {
        let mut bytes = frame(true, 1, 10);
        let big = header(true, 1, 4 << 30);
        // At most the header's bytes but its last pass (a header split over
        // reads passes in part; none of its payload does).
        let most = bytes.len() + big.len() - 1;
        bytes.extend(big);
        bytes.extend(std::iter::repeat_n(b'a', 1 << 16));
        for chunk in [1, 5, 4096, 1 << 20] {
            let (passed, failed) = run(bytes.clone(), chunk).await;
            assert!(failed, "chunk {chunk}");
            assert!(passed.len() <= most, "chunk {chunk}: {}", passed.len());
            assert_eq!(passed, bytes[..passed.len()], "chunk {chunk}");
        }
    }

    #[tokio::test]
    async fn fragments_that_together_exceed_the_limit_end_the_stream() {
        let mut bytes = frame(false, 1, LIMIT / 2);
        bytes.extend(frame(false, 0, LIMIT / 2));
        bytes.extend(header(true, 0, 1));
        let (_, failed) = run(bytes.clone(), 4096).await;
        assert!(failed);
        // Exactly the limit is accepted.
        let mut bytes = frame(false, 1, LIMIT / 2);
        bytes.extend(frame(true, 0, LIMIT / 2));
        let (passed, failed) = run(bytes.clone(), 4096).await;
        assert!(!failed);
        assert_eq!(passed, bytes);
    }

    #[tokio::test]
    async fn a_frame_one_byte_over_the_limit_ends_the_stream() {
        let (_, failed) = run(header(true, 1, LIMIT as u64 + 1), 3).await;
        assert!(failed);
    }
}
