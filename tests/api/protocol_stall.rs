//! protocol.md §3 timers and queues against misbehaving consumers, on the
//! real binary in its own process (so its sockets and memory can be read
//! from /proc): a consumer that stops reading is closed and its socket
//! freed at the OS level, and neither it nor a client flooding pings costs
//! any other connection anything (delivery-model.md §1 promise 4).
//!
//! Bounds here are deliberately generous (shared 2-core machines); the
//! measured figures are printed (`--nocapture`) for the notes.

use std::{
    collections::HashSet,
    time::{Duration, Instant},
};

use futures_util::{SinkExt, StreamExt};
use serde_json::{Value, json};
use tokio_tungstenite::tungstenite::{Message, client::IntoClientRequest, http::HeaderValue};

use crate::{helpers::*, protocol_support::*};

/// One server-side TCP socket as /proc/net/tcp shows it.
#[derive(Debug, Clone, Copy)]
struct ProcSocket {
    state: u8,
    tx_queue: u64,
    inode: u64,
}

/// The node's socket of the connection from `client_port`, if the kernel
/// still has it.
fn server_socket(server_port: u16, client_port: u16) -> Option<ProcSocket> {
    let table = std::fs::read_to_string("/proc/net/tcp").unwrap();
    let port_of = |addr: &str| u16::from_str_radix(addr.rsplit(':').next().unwrap(), 16).unwrap();
    table.lines().skip(1).find_map(|line| {
        let f: Vec<&str> = line.split_whitespace().collect();
        (port_of(f[1]) == server_port && port_of(f[2]) == client_port).then(|| ProcSocket {
            state: u8::from_str_radix(f[3], 16).unwrap(),
            tx_queue: u64::from_str_radix(f[4].split(':').next().unwrap(), 16).unwrap(),
            inode: f[9].parse().unwrap(),
        })
    })
}

/// Whether process `pid` still has a file descriptor on socket `inode`.
fn holds_socket(pid: u32, inode: u64) -> bool {
    let wanted = format!("socket:[{inode}]");
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|dir| {
            dir.flatten()
                .any(|e| std::fs::read_link(e.path()).is_ok_and(|l| l.to_string_lossy() == wanted))
        })
        .unwrap_or(false)
}

/// Publishes one small result and measures how long until `ws` receives
/// it; ACKs it.
async fn receive_latency(app: &TestApp, cred: &Cred, ws: &mut WsClient) -> Duration {
    let started = Instant::now();
    let event_id = publish_one(app, cred, "task.succeeded").await;
    let d = ws.delivery().await;
    let latency = started.elapsed();
    assert_eq!(d["body"]["event"]["id"], event_id.as_str());
    assert_eq!(ws.ack(&d).await["type"], "ack");
    latency
}

/// Binds a session and sends `pings` pings without reading; then reads
/// every reply it can. Returns (sent, answered, the close if the node
/// closed the connection).
async fn flood_pings(
    url: &str,
    token: &str,
    subscription_id: &str,
    pings: usize,
    local_port: &std::sync::atomic::AtomicU16,
) -> (usize, usize, Option<String>) {
    let mut req = url.into_client_request().unwrap();
    req.headers_mut().insert(
        "Sec-WebSocket-Protocol",
        HeaderValue::from_static("orbit.events.v1"),
    );
    req.headers_mut().insert(
        "Authorization",
        HeaderValue::from_str(&format!("Bearer {token}")).unwrap(),
    );
    let (stream, _) = tokio_tungstenite::connect_async(req).await.unwrap();
    if let tokio_tungstenite::MaybeTlsStream::Plain(tcp) = stream.get_ref() {
        local_port.store(
            tcp.local_addr().unwrap().port(),
            std::sync::atomic::Ordering::Relaxed,
        );
    }
    let mut ws = WsClient {
        stream,
        session_id: None,
        pending: Default::default(),
    };
    assert_eq!(ws.hello(subscription_id, 1).await["type"], "events.welcome");
    let mut sent = 0;
    for _ in 0..pings {
        let ping = ws.envelope("events.ping", json!({}));
        assert_frame_valid("clientFrame", &ping);
        // A send error (the node gave up on this client) ends the flood.
        let send = ws.stream.send(Message::text(ping.to_string()));
        match tokio::time::timeout(Duration::from_secs(10), send).await {
            Ok(Ok(())) => sent += 1,
            _ => break,
        }
    }
    // Now it reads: every ping that got through is answered, none dropped
    // (or, had the node given up on it, the connection is closed).
    let mut answered = 0;
    while answered < sent {
        match ws.recv().await {
            Received::Frame(f) => {
                assert_eq!(f["type"], "ack", "{f:#}");
                answered += 1;
            }
            Received::Closed(c) => return (sent, answered, Some(format!("{c:?}"))),
        }
    }
    (sent, answered, None)
}

/// Round trip of one `events.ping`.
async fn ping_rtt(ws: &mut WsClient) -> Duration {
    let started = Instant::now();
    let f = ws.envelope("events.ping", json!({}));
    let id = f["message_id"].clone();
    ws.send_json(f).await;
    let reply = ws.frame().await;
    assert_eq!(reply["reply_to"], id);
    started.elapsed()
}

/// The 99th percentile (nearest rank).
fn p99(samples: &mut [Duration]) -> Duration {
    samples.sort();
    let rank = (samples.len() * 99).div_ceil(100).max(1);
    samples[rank - 1]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// A result whose snapshot carries `bytes` of payload.
fn big_result(queue_id: &str, bytes: usize) -> Value {
    let mut r = result(queue_id, "task.succeeded");
    r["snapshot"]["result"] = json!({ "blob": "x".repeat(bytes) });
    r
}

#[actix_web::test]
async fn a_stalled_consumer_is_closed_its_socket_freed_its_leases_go_to_a_healthy_consumer_and_other_subscriptions_see_no_delay()
 {
    const WRITE_TIMEOUT_MS: u64 = 1_000;
    const LEASE_MS: u64 = 1_500;
    const EVENTS: usize = 32;
    let mut app = spawn_app().await;
    let stalled_cred = app
        .bootstrap_with("stall", "slow-app", "big-results", true, true)
        .await;
    let other_cred = app
        .bootstrap_with("other", "fast-app", "small-results", true, true)
        .await;
    let node = NodeProcess::serve_for(
        &mut app,
        &[
            ("ORBIT_EVENTS__TIMING__WRITE_TIMEOUT_MS", "1000"),
            ("ORBIT_EVENTS__TIMING__LEASE_MS", "1500"),
            ("ORBIT_EVENTS__TIMING__SCAN_INTERVAL_MS", "100"),
        ],
    )
    .await;
    let stalled_sub = subscription(&app, &stalled_cred).await;
    let other_sub = subscription(&app, &other_cred).await;
    for _ in 0..EVENTS / 2 {
        app.publish(
            &stalled_cred,
            vec![
                big_result(&stalled_cred.queue_id, 200_000),
                big_result(&stalled_cred.queue_id, 200_000),
            ],
        )
        .await;
    }

    // Receive latency of another subscription's consumer, before the stall.
    let mut other = app.bind(&other_cred.token, &other_sub, 1).await;
    let mut before: Vec<Duration> = Vec::new();
    for _ in 0..40 {
        before.push(receive_latency(&app, &other_cred, &mut other).await);
    }

    // The stalled consumer: a tiny receive buffer, a hello, then it never
    // reads again.
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let tcp = socket
        .connect(format!("127.0.0.1:{}", node.port).parse().unwrap())
        .await
        .unwrap();
    let client_port = tcp.local_addr().unwrap().port();
    let mut req = app.ws_url().into_client_request().unwrap();
    req.headers_mut().insert(
        "Sec-WebSocket-Protocol",
        HeaderValue::from_static("orbit.events.v1"),
    );
    req.headers_mut().insert(
        "Authorization",
        HeaderValue::from_str(&format!("Bearer {}", stalled_cred.token)).unwrap(),
    );
    let (mut stalled, _) = tokio_tungstenite::client_async(req, tcp).await.unwrap();
    let hello = json!({
        "protocol_version": "1", "type": "events.hello", "message_id": mid(),
        "body": {"subscription_id": stalled_sub, "capacity": 32},
    });
    assert_frame_valid("clientFrame", &hello);
    stalled
        .send(Message::text(hello.to_string()))
        .await
        .unwrap();
    let Some(Ok(Message::Text(welcome))) = stalled.next().await else {
        panic!("no welcome");
    };
    let welcome: Value = serde_json::from_str(&welcome).unwrap();
    assert_frame_valid("serverFrame", &welcome);
    assert_eq!(welcome["type"], "events.welcome");
    let bound_at = Instant::now();
    let established = server_socket(node.port, client_port).expect("the node's socket");
    assert_eq!(established.state, 1, "ESTABLISHED");

    // While the node fills the socket, then times out, then the kernel
    // drops it: keep measuring the other consumer.
    let mut during: Vec<Duration> = Vec::new();
    let mut max_tx_queue = 0;
    let gone_after = loop {
        assert!(
            bound_at.elapsed() < Duration::from_secs(30),
            "the stalled socket was never freed: {:?}\n{}",
            server_socket(node.port, client_port),
            node.log()
        );
        during.push(receive_latency(&app, &other_cred, &mut other).await);
        match server_socket(node.port, client_port) {
            Some(s) => max_tx_queue = max_tx_queue.max(s.tx_queue),
            None if !holds_socket(node.child.id(), established.inode) => {
                break bound_at.elapsed();
            }
            None => {}
        }
    };
    while during.len() < 40 {
        during.push(receive_latency(&app, &other_cred, &mut other).await);
    }
    drop(stalled);

    // Its leases stay in the database until they lapse, then go to a
    // healthy consumer of the same subscription.
    let mut healthy = app.bind(&stalled_cred.token, &stalled_sub, 32).await;
    let mut acked = HashSet::new();
    while acked.len() < EVENTS {
        let d = healthy.delivery().await;
        let delivery = &d["body"]["delivery"];
        assert_ne!(
            delivery["lease_epoch"], "1",
            "a lease of the stalled session was taken early"
        );
        assert_ne!(
            delivery["available_at"], delivery["created_at"],
            "offered again only after a lease ended"
        );
        let reply = healthy.ack(&d).await;
        if reply["type"] == "ack" {
            acked.insert(delivery["id"].as_str().unwrap().to_owned());
        } else {
            // Big frames on a loaded machine: this lease (1.5 s) lapsed
            // before its turn and the delivery was leased again; as a
            // consumer does (protocol.md §5), ACK its next delivery.
            assert_error_frame(&reply, "DELIVERY_LEASE_LOST");
        }
    }
    assert_eq!(
        app.scalar(&format!(
            "SELECT COUNT(*) FROM deliveries WHERE subscription_id = '{stalled_sub}' AND state = 'ACKED'"
        ))
        .await,
        EVENTS as i64
    );

    let (p_before, p_during) = (p99(&mut before), p99(&mut during));
    println!(
        "stalled consumer ({}): node socket gone {:.0} ms after the hello \
         (write timeout {WRITE_TIMEOUT_MS} ms + TCP_USER_TIMEOUT {WRITE_TIMEOUT_MS} ms, \
         lease {LEASE_MS} ms); largest unsent tx_queue {} KiB; other subscription receive \
         latency p99 {:.1} ms before ({} samples) vs {:.1} ms during ({} samples)",
        backend_name(),
        ms(gone_after),
        max_tx_queue / 1024,
        ms(p_before),
        before.len(),
        ms(p_during),
        during.len()
    );
    assert!(max_tx_queue > 0, "the node's writes really were stuck");
    // Writing starts at the hello; the queue overflows at the latest when
    // the first leases lapse and are offered again.
    let bound = Duration::from_millis(LEASE_MS + 2 * WRITE_TIMEOUT_MS) + Duration::from_secs(3);
    assert!(gone_after < bound, "freed after {gone_after:?}");
    assert!(
        p_during <= p_before * 2 + Duration::from_millis(150),
        "another subscription was delayed: p99 {p_before:?} before vs {p_during:?} during"
    );
    app.assert_invariants().await;
    drop(node);
}

#[actix_web::test]
async fn ten_thousand_pings_sent_without_reading_keep_the_nodes_memory_bounded_and_delay_no_other_connection()
 {
    const PINGS: usize = 10_000;
    let mut app = spawn_app().await;
    let cred = app.bootstrap().await;
    let node = NodeProcess::serve_for(
        &mut app,
        &[("ORBIT_EVENTS__TIMING__WRITE_TIMEOUT_MS", "1000")],
    )
    .await;
    let sub = subscription(&app, &cred).await;
    let mut other = app.bind(&cred.token, &sub, 1).await;

    let mut before = Vec::new();
    for _ in 0..100 {
        before.push(ping_rtt(&mut other).await);
    }
    let rss_before = node.rss_kib();

    // The flooder runs on its own thread and runtime, so that its sending
    // never delays this thread's measurements of the other connection.
    let flooder_port = std::sync::Arc::new(std::sync::atomic::AtomicU16::new(0));
    let flood = {
        let (url, token, sub, port) = (
            app.ws_url(),
            cred.token.clone(),
            sub.clone(),
            flooder_port.clone(),
        );
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(flood_pings(&url, &token, &sub, PINGS, &port))
        })
    };
    let mut during = Vec::new();
    let mut rss_max = rss_before;
    let mut max_tx_queue = 0;
    while !flood.is_finished() {
        during.push(ping_rtt(&mut other).await);
        rss_max = rss_max.max(node.rss_kib());
        let port = flooder_port.load(std::sync::atomic::Ordering::Relaxed);
        if let Some(s) = server_socket(node.port, port) {
            max_tx_queue = max_tx_queue.max(s.tx_queue);
        }
    }
    let (sent, answered, closed) = flood.join().unwrap();
    while during.len() < 100 {
        during.push(ping_rtt(&mut other).await);
        rss_max = rss_max.max(node.rss_kib());
    }

    let (p_before, p_during) = (p99(&mut before), p99(&mut during));
    println!(
        "ping flood ({}): {sent} of {PINGS} pings sent without reading, {answered} answered{}; \
         unread replies in the node's socket up to {} KiB; \
         node RSS {} KiB before, at most {} KiB during (+{} KiB); other connection ping p99 \
         {:.1} ms before vs {:.1} ms during ({} samples)",
        backend_name(),
        closed
            .as_ref()
            .map(|c| format!(", then closed ({c})"))
            .unwrap_or_default(),
        max_tx_queue / 1024,
        rss_before,
        rss_max,
        rss_max - rss_before,
        ms(p_before),
        ms(p_during),
        during.len()
    );
    assert!(
        closed.is_some() || answered == sent,
        "a ping reply was dropped"
    );
    assert!(
        rss_max - rss_before < 64 * 1024,
        "node memory grew by {} KiB",
        rss_max - rss_before
    );
    assert!(
        p_during <= p_before * 2 + Duration::from_millis(150),
        "the other connection was delayed: p99 {p_before:?} before vs {p_during:?} during"
    );
    // The other connection is still served.
    ping_expect_ack(&mut other).await;
}
