//! The HTTP listener: actix-web's app on actix-http's HTTP/1 service, put
//! together here (rather than by `HttpServer`) so that every accepted
//! connection goes through [`EnvelopedIo`] (decision 0077).
//!
//! actix-http answers a request it cannot parse (a header byte that is not
//! allowed, `Transfer-Encoding` with `Content-Length`, a URI or head above
//! its limits) itself, before any service runs: a bare 400 or 431 without
//! the envelope, `X-Request-ID` or `Cache-Control`, then it closes the
//! connection. [`EnvelopedIo`] recognizes those exact bytes on their way out
//! and writes the enveloped answer instead; such a request is logged at
//! `DEBUG` (it is unauthenticated input, never the node's fault).

use std::{
    io,
    net::{SocketAddr, TcpListener},
    pin::Pin,
    task::{Context, Poll},
    time::Duration,
};

use actix_http::HttpService;
use actix_service::{IntoServiceFactory, ServiceFactoryExt, fn_service, map_config};
use actix_web::{
    App, Error as WebError,
    dev::{AppConfig, Server},
    middleware::from_fn,
    rt::net::TcpStream,
    web,
};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::{domain::MessageId, http, state::AppState};

/// Grace for in-flight HTTP requests when the server stops (seconds).
const SHUTDOWN_TIMEOUT_S: u64 = 5;

/// Serves the node's app on `listeners` (already bound). `user_timeout`
/// bounds unacknowledged writes on every accepted socket (TCP_USER_TIMEOUT,
/// stack-notes.md). Signals are the caller's (`disable_signals`).
pub fn serve(
    listeners: Vec<TcpListener>,
    data: web::Data<AppState>,
    user_timeout: Duration,
) -> io::Result<Server> {
    let mut builder = Server::build()
        .disable_signals()
        .shutdown_timeout(SHUTDOWN_TIMEOUT_S);
    let shutdown = builder.graceful_shutdown_signal();
    for listener in listeners {
        let addr = listener.local_addr()?;
        let data = data.clone();
        let shutdown = shutdown.clone();
        builder = builder.listen(format!("orbit-events-{addr}"), listener, move || {
            let data = data.clone();
            let shutdown = shutdown.clone();
            let app = App::new()
                .app_data(data)
                .wrap(from_fn(http::envelope::envelope))
                .configure(http::routes)
                .into_factory()
                .map_err(|err: WebError| err.error_response());
            let service = HttpService::<EnvelopedIo, _, _, _, _>::build()
                // No linger (decision 0077): the envelope middleware reads
                // what a handler left of a body before answering instead.
                .client_disconnect_timeout(Duration::ZERO)
                .local_addr(addr)
                .graceful_shutdown_signal(move || {
                    let shutdown = shutdown.clone();
                    async move { shutdown.notified().await }
                })
                .on_connect_ext(move |io: &EnvelopedIo, _| {
                    set_tcp_user_timeout(&io.tcp, user_timeout)
                })
                .h1(map_config(app, move |()| config(addr)));
            fn_service(|tcp: TcpStream| async move {
                set_nodelay(&tcp);
                let peer = tcp.peer_addr().ok();
                Ok((EnvelopedIo::new(tcp), peer))
            })
            .and_then(service)
        })?;
    }
    Ok(builder.run())
}

/// The app's view of the listener (its address and host name).
fn config(addr: SocketAddr) -> AppConfig {
    AppConfig::__priv_test_new(false, addr.to_string(), addr)
}

/// A socket whose peer stops reading is dropped by the kernel after
/// `timeout` of unacknowledged data (stack-notes.md: actix-http itself never
/// frees it).
fn set_tcp_user_timeout(tcp: &TcpStream, timeout: Duration) {
    if let Err(err) = socket2::SockRef::from(tcp).set_tcp_user_timeout(Some(timeout)) {
        tracing::warn!(error = %err, "cannot set TCP_USER_TIMEOUT on a connection");
    }
}

/// Frames and answers leave as soon as they are written: with Nagle's
/// algorithm a small `event.deliver` or `ack` written while the peer's
/// delayed ACK is pending waits up to 40 ms for it (decision 0091).
/// `HttpServer` sets this itself; this listener is put together by hand.
fn set_nodelay(tcp: &TcpStream) {
    if let Err(err) = tcp.set_nodelay(true) {
        tracing::warn!(error = %err, "cannot set TCP_NODELAY on a connection");
    }
}

/// The status lines of the bare answers actix-http writes itself (for a
/// request it cannot parse, or whose head does not arrive in time), with the
/// message the enveloped answer carries.
const BARE: [(&[u8], &str); 3] = [
    (
        b"HTTP/1.1 400 Bad Request\r\n",
        "the request is not valid HTTP/1.1 (a header that is not allowed, Transfer-Encoding with Content-Length, or a malformed URI)",
    ),
    (
        b"HTTP/1.1 431 Request Header Fields Too Large\r\n",
        "the request head is too large (its URI, or too many or too long headers)",
    ),
    (
        b"HTTP/1.1 408 Request Timeout\r\n",
        "the request head did not arrive within 5 s",
    ),
];

/// The headers of a bare answer, and no others: ours always carry
/// `x-request-id`, so a head made of these alone is actix-http's.
fn bare_header(line: &[u8]) -> Option<Option<&[u8]>> {
    match line {
        b"content-length: 0" | b"connection: close" => Some(None),
        _ => line
            .strip_prefix(b"date: ")
            .filter(|d| d.len() == 29)
            .map(Some),
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// A bare answer found in a write: where it starts, its length, its status
/// line, its `date` (if any) and the message for the enveloped one.
struct Bare<'a> {
    at: usize,
    len: usize,
    status: &'a [u8],
    date: Option<&'a [u8]>,
    message: &'static str,
}

/// Bytes at the end of a write that can hold a bare answer.
const BARE_TAIL: usize = 256;

/// A bare answer at the very end of `buf` (where actix-http puts it: it is
/// the last thing written on its connection). Only the last
/// [`BARE_TAIL`] bytes are looked at, so a large write costs nothing more
/// than the check of its last four bytes.
fn find_bare(buf: &[u8]) -> Option<Bare<'_>> {
    if !buf.ends_with(b"\r\n\r\n") {
        return None;
    }
    let tail = buf.len().saturating_sub(BARE_TAIL);
    let found = find_bare_from(&buf[tail..])?;
    (found.at + found.len == buf.len() - tail).then_some(Bare {
        at: found.at + tail,
        ..found
    })
}

fn find_bare_from(buf: &[u8]) -> Option<Bare<'_>> {
    for (status, message) in BARE {
        let mut from = 0;
        while let Some(i) = find(&buf[from..], status) {
            let at = from + i;
            let mut pos = at + status.len();
            let mut date = None;
            let mut sized = false;
            let len = loop {
                let Some(end) = find(&buf[pos..], b"\r\n") else {
                    break None;
                };
                let line = &buf[pos..pos + end];
                pos += end + 2;
                if line.is_empty() {
                    break sized.then_some(pos - at);
                }
                match bare_header(line) {
                    Some(Some(d)) => date = Some(d),
                    Some(None) => sized |= line == b"content-length: 0",
                    None => break None,
                }
            };
            if let Some(len) = len {
                let status = &status[..status.len() - 2];
                return Some(Bare {
                    at,
                    len,
                    status,
                    date,
                    message,
                });
            }
            from = at + 1;
        }
    }
    None
}

/// The enveloped answer for a bare one.
fn enveloped(bare: &Bare<'_>) -> Vec<u8> {
    let request_id = MessageId::generate();
    tracing::debug!(%request_id, status = %String::from_utf8_lossy(bare.status), "refused a request that is not valid HTTP");
    let body = serde_json::json!({
        "request_id": request_id.as_str(),
        "error": { "code": "INVALID_ARGUMENT", "message": bare.message },
    })
    .to_string();
    let mut out = Vec::with_capacity(256 + body.len());
    out.extend_from_slice(bare.status);
    out.extend_from_slice(
        b"\r\ncontent-type: application/json\r\ncache-control: no-store\r\nx-request-id: ",
    );
    out.extend_from_slice(request_id.as_str().as_bytes());
    // actix-http closes the connection after such an answer.
    out.extend_from_slice(
        format!("\r\ncontent-length: {}\r\nconnection: close", body.len()).as_bytes(),
    );
    if let Some(date) = bare.date {
        out.extend_from_slice(b"\r\ndate: ");
        out.extend_from_slice(date);
    }
    out.extend_from_slice(b"\r\n\r\n");
    out.extend_from_slice(body.as_bytes());
    out
}

/// An accepted connection: reads pass through; writes pass through except
/// a bare parse-error answer of actix-http, which becomes an enveloped one.
/// Raw CR LF only ever appears in response heads (JSON and the metrics text
/// escape or never hold it), so the bytes cannot be mistaken for a body.
pub struct EnvelopedIo {
    tcp: TcpStream,
    /// The enveloped answer still to be written (before anything else).
    pending: Vec<u8>,
    written: usize,
}

impl EnvelopedIo {
    fn new(tcp: TcpStream) -> EnvelopedIo {
        EnvelopedIo {
            tcp,
            pending: Vec::new(),
            written: 0,
        }
    }

    /// Writes what is pending; `Ready(Ok)` once nothing is.
    fn poll_pending(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.written < self.pending.len() {
            match Pin::new(&mut self.tcp).poll_write(cx, &self.pending[self.written..]) {
                Poll::Ready(Ok(0)) => return Poll::Ready(Err(io::ErrorKind::WriteZero.into())),
                Poll::Ready(Ok(n)) => self.written += n,
                Poll::Ready(Err(err)) => return Poll::Ready(Err(err)),
                Poll::Pending => return Poll::Pending,
            }
        }
        self.pending.clear();
        self.written = 0;
        Poll::Ready(Ok(()))
    }
}

impl AsyncRead for EnvelopedIo {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.tcp).poll_read(cx, buf)
    }
}

impl AsyncWrite for EnvelopedIo {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        if let Poll::Ready(Err(err)) = this.poll_pending(cx) {
            return Poll::Ready(Err(err));
        }
        if !this.pending.is_empty() {
            return Poll::Pending;
        }
        match find_bare(buf) {
            // The bare answer is next: taken whole, the enveloped one goes
            // out instead (from `pending`).
            Some(bare) if bare.at == 0 => {
                let len = bare.len;
                this.pending = enveloped(&bare);
                if let Poll::Ready(Err(err)) = this.poll_pending(cx) {
                    return Poll::Ready(Err(err));
                }
                Poll::Ready(Ok(len))
            }
            // What comes before it first.
            Some(bare) => Pin::new(&mut this.tcp).poll_write(cx, &buf[..bare.at]),
            None => Pin::new(&mut this.tcp).poll_write(cx, buf),
        }
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        match this.poll_pending(cx) {
            Poll::Ready(Ok(())) => Pin::new(&mut this.tcp).poll_flush(cx),
            other => other,
        }
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        match this.poll_pending(cx) {
            Poll::Ready(Ok(())) => Pin::new(&mut this.tcp).poll_shutdown(cx),
            other => other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DATE: &str = "Tue, 01 Dec 2026 20:42:35 GMT";

    fn bare(status: &str, close: bool) -> Vec<u8> {
        let close = if close { "connection: close\r\n" } else { "" };
        format!("HTTP/1.1 {status}\r\ncontent-length: 0\r\n{close}date: {DATE}\r\n\r\n")
            .into_bytes()
    }

    #[test]
    fn a_bare_answer_is_found_whole_with_or_without_connection_close_and_nothing_else_is() {
        for close in [true, false] {
            let b = bare("400 Bad Request", close);
            let found = find_bare(&b).unwrap();
            assert_eq!((found.at, found.len), (0, b.len()));
            assert_eq!(found.date, Some(DATE.as_bytes()));
            assert!(find_bare(&b[..b.len() - 1]).is_none(), "incomplete");
        }
        let mut after =
            b"HTTP/1.1 200 OK\r\nx-request-id: 1\r\ncontent-length: 2\r\n\r\n{}".to_vec();
        let at = after.len();
        after.extend_from_slice(&bare("431 Request Header Fields Too Large", true));
        let found = find_bare(&after).unwrap();
        assert_eq!(found.at, at);
        assert_eq!(
            found.status,
            b"HTTP/1.1 431 Request Header Fields Too Large"
        );
        // One of ours: it has x-request-id.
        assert!(
            find_bare(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\nx-request-id: a\r\n\r\n")
                .is_none()
        );
        assert!(find_bare(br#"{"x":"HTTP/1.1 400 Bad Request\r\ncontent-length: 0"}"#).is_none());
    }

    #[test]
    fn the_enveloped_answer_keeps_the_status_and_date_and_carries_the_envelope() {
        let b = bare("408 Request Timeout", false);
        let text = String::from_utf8(enveloped(&find_bare(&b).unwrap())).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        assert!(
            head.starts_with("HTTP/1.1 408 Request Timeout\r\n"),
            "{head}"
        );
        assert!(head.contains("\r\ncache-control: no-store\r\n"), "{head}");
        assert!(
            head.contains("\r\ncontent-type: application/json\r\n"),
            "{head}"
        );
        assert!(
            head.contains(&format!("\r\ncontent-length: {}\r\n", body.len())),
            "{head}"
        );
        assert!(head.ends_with(&format!("date: {DATE}")), "{head}");
        let body: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(body["error"]["code"], "INVALID_ARGUMENT");
        let id = body["request_id"].as_str().unwrap();
        assert!(head.contains(&format!("x-request-id: {id}")), "{head}");
    }
}
