//! The lease pool and the scanner under the node limits of
//! delivery-model.md §7 (architecture.md §1), with the claim path slowed or
//! held by the `test-hooks` feature.

use std::time::{Duration, Instant};

use futures_util::{SinkExt, future::join_all};
use orbit_events::delivery::pool::{GetPoolStats, HoldClaims, HoldPoint, PoolStats, SetClaimDelay};
use serde_json::json;
use tokio_tungstenite::{MaybeTlsStream, tungstenite::Message};

use crate::{
    helpers::*,
    metrics::{Scraped, scrape},
    protocol_support::*,
};

async fn stats(app: &TestApp) -> PoolStats {
    app.state.pool.send(GetPoolStats).await.unwrap()
}

/// Receives and ACKs `n` deliveries (or fewer, if the connection closes).
async fn consume(mut ws: WsClient, n: usize) -> WsClient {
    for _ in 0..n {
        let d = ws.delivery().await;
        let reply = ws.ack(&d).await;
        assert_eq!(reply["type"], "ack", "{reply:#}");
    }
    ws
}

/// A subscription from the start of the log with `extra` fields.
async fn subscription_with(app: &TestApp, cred: &Cred, extra: serde_json::Value) -> String {
    let mut body = json!({ "from_sequence": "0" });
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    app.subscribe(cred, body).await["id"]
        .as_str()
        .unwrap()
        .to_owned()
}

#[actix_web::test]
async fn never_more_than_4_claims_run_at_once_and_never_more_than_1_per_application() {
    let app = spawn_app().await;
    let mut consumers = Vec::new();
    let mut creds = Vec::new();
    for i in 0..6 {
        let cred = app
            .bootstrap_with("demo", &format!("app{i}"), &format!("q{i}"), true, true)
            .await;
        let sub = subscription(&app, &cred).await;
        consumers.push(app.bind(&cred.token, &sub, 1).await);
        creds.push(cred);
    }
    claims_settled(&app, 6).await;
    app.state
        .pool
        .send(SetClaimDelay(Duration::from_millis(30)))
        .await
        .unwrap();
    for cred in &creds {
        publish_n(&app, cred, 8, "task.succeeded").await;
    }
    join_all(consumers.into_iter().map(|ws| consume(ws, 8))).await;

    let s = stats(&app).await;
    report(&format!(
        "pool high-water marks: {} in flight, {} per application, {} waiting",
        s.max_claims_in_flight_seen,
        s.max_claims_in_flight_per_application_seen,
        s.max_claims_waiting_seen
    ));
    // Six backlogged applications keep the pool full: the limit is reached,
    // and never passed.
    assert_eq!(s.max_claims_in_flight_seen, 4);
    assert_eq!(s.max_claims_in_flight_per_application_seen, 1);
    let scraped = scrape(&app).await;
    assert_eq!(
        scraped.value("orbit_events_claims_in_flight_high_water", &[]),
        4.0
    );
    assert_eq!(
        scraped.value(
            "orbit_events_claims_in_flight_per_application_high_water",
            &[]
        ),
        1.0
    );
    app.assert_invariants().await;
}

#[actix_web::test]
async fn an_application_with_1_subscription_gets_at_least_a_third_of_the_claims_next_to_one_with_50()
 {
    let app = spawn_app().await;
    let a = app.bootstrap_with("ns-a", "noisy", "qa", true, true).await;
    let b = app.bootstrap_with("ns-b", "quiet", "qb", true, true).await;
    let mut a_consumers = Vec::new();
    for _ in 0..50 {
        let sub = subscription(&app, &a).await;
        a_consumers.push(app.bind(&a.token, &sub, 1).await);
    }
    let b_sub = subscription(&app, &b).await;
    // B's one consumer has room for 4, so it can ask for more while it
    // ACKs: it stays backlogged at the pool, as A's 50 consumers do.
    let mut b_consumer = app.bind(&b.token, &b_sub, 4).await;
    claims_settled(&app, 51).await;
    let before = scrape(&app).await;
    app.state
        .pool
        .send(SetClaimDelay(Duration::from_millis(120)))
        .await
        .unwrap();

    // Both applications backlogged: every one of A's 50 subscriptions has
    // 20 deliveries waiting, B's one has 90.
    for _ in 0..3 {
        publish_n(&app, &b, 30, "task.succeeded").await;
    }
    publish_n(&app, &a, 20, "task.succeeded").await;
    let a_tasks: Vec<_> = a_consumers
        .into_iter()
        .map(|ws| actix_web::rt::spawn(consume(ws, 20)))
        .collect();
    // After 40 deliveries B is still backlogged, and so is A.
    for _ in 0..40 {
        let d = b_consumer.delivery().await;
        b_consumer.ack(&d).await;
    }
    let after = scrape(&app).await;
    for task in a_tasks {
        task.abort();
    }

    let claims = |s: &Scraped, cred: &Cred| {
        s.value(
            "orbit_events_claims_total",
            &[("application_id", &cred.application_id)],
        )
    };
    let a_claims = claims(&after, &a) - claims(&before, &a);
    let b_claims = claims(&after, &b) - claims(&before, &b);
    report(&format!(
        "claims while both were backlogged: A (50 subscriptions) {a_claims}, B (1 subscription) {b_claims}"
    ));
    assert!(
        b_claims >= 15.0,
        "B had {b_claims} claims for 60 deliveries"
    );
    assert!(
        b_claims * 3.0 >= a_claims + b_claims,
        "B got {b_claims} of {} claims: less than a third",
        a_claims + b_claims
    );
    let backlog_a = app
        .scalar(&format!(
            "SELECT COUNT(*) FROM deliveries d JOIN subscriptions s ON s.id = d.subscription_id \
             WHERE s.queue_id = '{}' AND d.state <> 'ACKED'",
            a.queue_id
        ))
        .await;
    assert!(backlog_a > 0, "A was still backlogged at the end");
    app.assert_invariants().await;
}

#[actix_web::test]
async fn the_129th_claim_request_is_refused_and_served_on_a_later_round() {
    let app = spawn_app_with(|s| {
        // The default connection limit equals the claim queue: one more
        // connection than claim slots is needed to overflow the queue.
        s.limits.max_connections = 140;
        s.timing.scan_interval_ms = 200;
    })
    .await;
    assert_eq!(app.settings.limits.claims_queued, 128);
    let cred = app.bootstrap().await;
    let sub = subscription_with(&app, &cred, json!({ "max_pending": 200 })).await;
    app.state
        .pool
        .send(HoldClaims(Some(HoldPoint::BeforeTransaction)))
        .await
        .unwrap();
    // Each bound session asks for a claim; the claims are held, so they
    // pile up in the pool: 128 are queued, the 129th is refused.
    let mut sessions = Vec::new();
    for _ in 0..129 {
        sessions.push(app.bind(&cred.token, &sub, 1).await);
    }
    let pool = &app.state.pool;
    wait_until("a claim request was refused", || async move {
        pool.send(GetPoolStats).await.unwrap().claims_refused >= 1
    })
    .await;
    let s = stats(&app).await;
    assert_eq!(s.claims_waiting + s.claims_in_flight, 128, "{s:?}");
    assert!(
        s.max_claims_waiting_seen + s.max_claims_in_flight_seen <= 129,
        "{s:?}"
    );

    publish_n(&app, &cred, 100, "task.succeeded").await;
    publish_n(&app, &cred, 29, "task.succeeded").await;
    app.state.pool.send(HoldClaims(None)).await.unwrap();
    // Every session, the refused one included, gets its delivery.
    for ws in &mut sessions {
        let d = ws.delivery().await;
        ws.ack(&d).await;
    }
    let s = stats(&app).await;
    assert!(s.claims_waiting + s.claims_in_flight <= 128, "{s:?}");
    assert_eq!(
        app.scalar("SELECT COUNT(*) FROM deliveries WHERE state = 'ACKED'")
            .await,
        129
    );
    let scraped = scrape(&app).await;
    assert!(scraped.value("orbit_events_claims_refused_total", &[]) >= 1.0);
    app.assert_invariants().await;
}

/// A WebSocket upgrade request sent with reqwest, so that a refusal's status,
/// headers and body can be read.
async fn upgrade(app: &TestApp, token: &str) -> Resp {
    let res = app
        .http
        .get(format!("{}/v1/events/connect", app.address))
        .header("Connection", "Upgrade")
        .header("Upgrade", "websocket")
        .header("Sec-WebSocket-Version", "13")
        .header("Sec-WebSocket-Key", "dGhlIHNhbXBsZSBub25jZQ==")
        .header("Sec-WebSocket-Protocol", "orbit.events.v1")
        .bearer_auth(token)
        .send()
        .await
        .unwrap();
    let status = res.status();
    let headers = res.headers().clone();
    let body = res.json().await.unwrap_or(serde_json::Value::Null);
    Resp {
        status,
        headers,
        body,
    }
}

#[actix_web::test]
async fn the_129th_connection_gets_429_with_retry_after_1_and_is_admitted_once_one_closes() {
    let app = spawn_app_with(|s| s.timing.hello_timeout_ms = 60_000).await;
    assert_eq!(app.settings.limits.max_connections, 128);
    let cred = app.bootstrap().await;
    let mut open = Vec::new();
    for _ in 0..128 {
        open.push(app.connect(&cred.token).await);
    }
    assert_eq!(stats(&app).await.connections, 128);
    let res = upgrade(&app, &cred.token).await;
    res.assert_error(429, "CAPACITY_EXCEEDED");
    assert_eq!(res.headers["retry-after"], "1");
    let scraped = scrape(&app).await;
    assert_eq!(scraped.value("orbit_events_connections", &[]), 128.0);
    assert_eq!(
        scraped.value("orbit_events_connections_refused_total", &[]),
        1.0
    );

    let mut one = open.pop().unwrap();
    one.stream.close(None).await.unwrap();
    let pool = &app.state.pool;
    wait_until("a slot is free", || async move {
        pool.send(GetPoolStats).await.unwrap().connections == 127
    })
    .await;
    // Admitted: the handshake completes (app.connect asserts 101).
    open.push(app.connect(&cred.token).await);
    assert_eq!(stats(&app).await.connections, 128);
}

/// Closes the client side of `ws` abruptly: SO_LINGER 0 makes the kernel
/// answer with a TCP reset instead of a FIN.
pub fn reset(ws: WsClient) {
    if let MaybeTlsStream::Plain(tcp) = ws.stream.get_ref() {
        socket2::SockRef::from(tcp)
            .set_linger(Some(Duration::ZERO))
            .unwrap();
    }
    drop(ws);
}

#[actix_web::test]
async fn after_500_connect_disconnect_cycles_of_every_kind_the_connection_count_is_back_to_0() {
    let app = spawn_app_with(|s| s.timing.hello_timeout_ms = 200).await;
    let cred = app.bootstrap().await;
    let sub = subscription(&app, &cred).await;
    let (app_ref, token, sub_id) = (&app, cred.token.as_str(), sub.as_str());
    let cycle = |i: usize| async move {
        match i % 4 {
            // A clean close after the hello.
            0 => {
                let mut ws = app_ref.bind(token, sub_id, 1).await;
                ws.stream.send(Message::Close(None)).await.unwrap();
                ws.closed().await;
            }
            // An abrupt TCP reset after the hello.
            1 => reset(app_ref.bind(token, sub_id, 1).await),
            // An abrupt TCP reset before any hello.
            2 => reset(app_ref.connect(token).await),
            // The hello never sent: the server closes at its deadline.
            _ => {
                let mut ws = app_ref.connect(token).await;
                ws.closed().await;
            }
        }
    };
    let started = Instant::now();
    for batch in (0..500).collect::<Vec<_>>().chunks(25) {
        join_all(batch.iter().map(|i| cycle(*i))).await;
    }
    report(&format!(
        "500 connect/disconnect cycles took {} ms",
        started.elapsed().as_millis()
    ));
    let pool = &app.state.pool;
    wait_until("every connection slot is free", || async move {
        pool.send(GetPoolStats).await.unwrap().connections == 0
    })
    .await;
    let app_ref = &app;
    wait_until("every session row is closed", || async move {
        app_ref
            .scalar("SELECT COUNT(*) FROM event_sessions WHERE closed_at IS NULL")
            .await
            == 0
    })
    .await;
    assert_eq!(
        app.scalar("SELECT COUNT(*) FROM event_sessions").await,
        250,
        "one session per cycle with a hello"
    );
    assert_eq!(
        scrape(&app).await.value("orbit_events_connections", &[]),
        0.0
    );
    // The node still serves a new connection normally.
    let mut ws = app.bind(&cred.token, &sub, 1).await;
    ping_expect_ack(&mut ws).await;
}

#[actix_web::test]
async fn while_all_4_claim_slots_are_stuck_in_a_slow_claim_a_ping_on_another_connection_is_answered_within_50_ms()
 {
    let app = spawn_app().await;
    // Four applications on one queue, so that one append gives each of them
    // a claim in the same scan round; a fifth application only pings.
    let mut creds = Vec::new();
    let mut consumers = Vec::new();
    for i in 0..4 {
        let cred = app
            .bootstrap_with("demo", &format!("consumer{i}"), "shared", true, true)
            .await;
        let sub = subscription(&app, &cred).await;
        consumers.push(app.bind(&cred.token, &sub, 1).await);
        creds.push(cred);
    }
    let pinger_cred = app
        .bootstrap_with("demo", "pinger", "quiet", true, true)
        .await;
    let pinger_sub = subscription(&app, &pinger_cred).await;
    let mut pinger = app.bind(&pinger_cred.token, &pinger_sub, 1).await;
    claims_settled(&app, 5).await;

    // Held right after BEGIN: on SQLite the first claim holds the write
    // lock and the other three wait for it; on PostgreSQL each is held
    // right before its one statement (decision 0109).
    app.state
        .pool
        .send(HoldClaims(Some(HoldPoint::InsideTransaction)))
        .await
        .unwrap();
    // On SQLite the publish shares its round with the claims it woke
    // (decision 0098), so it is answered once they are released.
    let publishing = publish_n(&app, &creds[0], 1, "task.succeeded");
    let stuck = async {
        let pool = &app.state.pool;
        wait_until("4 claims are in flight", || async move {
            pool.send(GetPoolStats).await.unwrap().claims_in_flight == 4
        })
        .await;

        let mut rtts = Vec::new();
        for _ in 0..11 {
            let sent = Instant::now();
            let reply = pinger.ping().await;
            rtts.push(sent.elapsed());
            assert_eq!(reply["type"], "ack", "{reply:#}");
        }
        assert_eq!(stats(&app).await.claims_in_flight, 4, "still stuck");
        rtts.sort();
        let median = rtts[rtts.len() / 2];
        report(&format!(
            "ping round trips with 4 claims stuck (ms): {:?}",
            rtts.iter()
                .map(|d| d.as_secs_f64() * 1000.0)
                .collect::<Vec<_>>()
        ));
        // The median of 11 keeps one scheduling hiccup of a loaded machine from
        // failing the test; pings queued behind the claims would all wait.
        assert!(
            median < Duration::from_millis(50),
            "median ping round trip {median:?} with all claim slots stuck"
        );
        app.state.pool.send(HoldClaims(None)).await.unwrap();
    };
    tokio::join!(publishing, stuck);
    for ws in &mut consumers {
        let d = ws.delivery().await;
        ws.ack(&d).await;
    }
    app.assert_invariants().await;
}
