//! What one connection may cost the node (protocol.md §1, §3; decision
//! 0077): a frame header announcing more than 512 KiB closes 1009 before
//! its payload is read, a clean close is answered at once, and a peer that
//! vanishes frees its slot at once.

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use futures_util::StreamExt;
use orbit_events::delivery::pool::GetPoolStats;
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
};
use tokio_tungstenite::tungstenite::{Message, protocol::frame::coding::CloseCode};

use crate::{
    helpers::*,
    protocol_support::{NodeProcess, subscription},
};

/// A WebSocket handshake over a plain TCP stream (to send frames no client
/// library would send).
async fn raw_upgrade(port: u16, token: &str) -> TcpStream {
    let mut tcp = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    let request = format!(
        "GET /v1/events/connect HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n\
         Connection: Upgrade\r\nSec-WebSocket-Version: 13\r\n\
         Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\
         Sec-WebSocket-Protocol: orbit.events.v1\r\nAuthorization: Bearer {token}\r\n\r\n"
    );
    tcp.write_all(request.as_bytes()).await.unwrap();
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        tcp.read_exact(&mut byte).await.unwrap();
        head.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&head);
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    tcp
}

/// A masked text frame header announcing 4 GiB of payload.
fn header_of_4_gib() -> Vec<u8> {
    let mut h = vec![0x81, 0x80 | 127];
    h.extend_from_slice(&(4u64 << 30).to_be_bytes());
    h.extend_from_slice(&[0x11, 0x22, 0x33, 0x44]);
    h
}

/// Reads server frames until a close frame; returns its code.
async fn close_code(read: &mut tokio::net::tcp::OwnedReadHalf) -> Option<u16> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        // Server frames are unmasked and small here (length < 126).
        while buf.len() >= 2 {
            let len = usize::from(buf[1] & 0x7f);
            if buf.len() < 2 + len {
                break;
            }
            if buf[0] & 0x0f == 0x8 {
                return (len >= 2).then(|| u16::from_be_bytes([buf[2], buf[3]]));
            }
            buf.drain(..2 + len);
        }
        match read.read(&mut chunk).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
}

/// Sends the 4 GiB header, then streams up to 200 MiB after it until the
/// node closes; returns the close code and how long after the header it
/// came.
async fn announce_4_gib(port: u16, token: String) -> (Option<u16>, Duration) {
    let tcp = raw_upgrade(port, &token).await;
    let (mut read, mut write) = tcp.into_split();
    write.write_all(&header_of_4_gib()).await.unwrap();
    let sent = Instant::now();
    let closed = Arc::new(AtomicBool::new(false));
    let streaming = {
        let closed = closed.clone();
        tokio::spawn(async move {
            let chunk = vec![0x5a; 1 << 16];
            let mut streamed = 0u64;
            while streamed < 200 << 20 && !closed.load(Ordering::SeqCst) {
                match tokio::time::timeout(Duration::from_millis(100), write.write_all(&chunk))
                    .await
                {
                    Ok(Ok(())) => streamed += chunk.len() as u64,
                    Ok(Err(_)) => break,
                    // The node stopped reading: nothing more goes in.
                    Err(_) => continue,
                }
            }
            // Kept open: the node must not be told the frame ended.
            write
        })
    };
    let code = tokio::time::timeout(DEADLINE, close_code(&mut read))
        .await
        .expect("the node never closed");
    let after = sent.elapsed();
    closed.store(true, Ordering::SeqCst);
    drop(streaming.await.unwrap());
    (code, after)
}

/// `connections` connections announce 4 GiB at once: each is closed 1009
/// within 1 s of its header, and the node's RSS never grows by more than
/// 64 MiB.
async fn assert_4_gib_headers_cost_nothing(connections: usize) {
    let mut app = spawn_app().await;
    let cred = app.bootstrap().await;
    let node = NodeProcess::serve_for(&mut app, &[]).await;
    let node = Arc::new(node);
    let start_kib = node.rss_kib();
    let max_kib = Arc::new(AtomicU64::new(start_kib));
    let sampling = Arc::new(AtomicBool::new(true));
    let sampler = {
        let (node, max_kib, sampling) = (node.clone(), max_kib.clone(), sampling.clone());
        tokio::spawn(async move {
            while sampling.load(Ordering::SeqCst) {
                max_kib.fetch_max(node.rss_kib(), Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
    };
    let mut tasks = Vec::new();
    for _ in 0..connections {
        tasks.push(tokio::spawn(announce_4_gib(node.port, cred.token.clone())));
    }
    for task in tasks {
        let (code, after) = task.await.unwrap();
        assert_eq!(code, Some(1009), "closed with {code:?}");
        assert!(
            after < Duration::from_secs(1),
            "closed {after:?} after the header"
        );
    }
    sampling.store(false, Ordering::SeqCst);
    sampler.await.unwrap();
    let grown_mib = (max_kib.load(Ordering::SeqCst) - start_kib) / 1024;
    report(&format!(
        "{connections} connections announcing 4 GiB: node RSS {} MiB at start, at most {grown_mib} MiB more",
        start_kib / 1024
    ));
    assert!(grown_mib <= 64, "the node grew by {grown_mib} MiB");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_header_announcing_4_gib_is_closed_1009_within_a_second_with_none_of_its_payload_buffered()
 {
    assert_4_gib_headers_cost_nothing(1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn thirty_two_connections_announcing_4_gib_at_once_cost_the_node_at_most_64_mib() {
    assert_4_gib_headers_cost_nothing(32).await;
}

#[tokio::test]
async fn a_clean_close_after_hello_completes_its_handshake_within_200_ms() {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let sub = subscription(&app, &cred).await;
    for round in 0..10 {
        let mut ws = app.bind(&cred.token, &sub, 1).await;
        let sent = Instant::now();
        ws.stream.close(None).await.unwrap();
        let answer = loop {
            match tokio::time::timeout(DEADLINE, ws.stream.next()).await {
                Ok(Some(Ok(Message::Close(frame)))) => break frame,
                Ok(Some(Ok(_))) => continue,
                other => panic!("round {round}: no close frame came back: {other:?}"),
            }
        };
        let answered = sent.elapsed();
        assert_eq!(answer.map(|f| f.code), Some(CloseCode::Normal));
        // The handshake completes when the server closes the TCP connection
        // (RFC 6455 §7.1.1: the server closes first).
        let ended = tokio::time::timeout(DEADLINE, async {
            while let Some(Ok(_)) = ws.stream.next().await {}
        })
        .await;
        assert!(
            ended.is_ok(),
            "round {round}: the TCP connection stayed open"
        );
        let took = sent.elapsed();
        report(&format!(
            "close round {round}: answered after {answered:?}, TCP closed after {took:?}"
        ));
        assert!(
            took < Duration::from_millis(200),
            "round {round}: the close handshake took {took:?} (answered after {answered:?})"
        );
    }
}

#[tokio::test]
async fn a_connection_aborted_before_hello_frees_its_slot_within_500_ms() {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let connections = async || app.state.pool.send(GetPoolStats).await.unwrap().connections;
    let tcp = raw_upgrade(app.port, &cred.token).await;
    assert_eq!(connections().await, 1);
    // SO_LINGER 0: closing sends a reset, as a crashed peer's kernel does.
    socket2::SockRef::from(&tcp)
        .set_linger(Some(Duration::ZERO))
        .unwrap();
    drop(tcp);
    let aborted = Instant::now();
    while connections().await != 0 {
        assert!(
            aborted.elapsed() < Duration::from_millis(500),
            "the slot was still taken {:?} after the abort",
            aborted.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}
