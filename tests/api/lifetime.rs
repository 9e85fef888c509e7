//! A connection's lifetime budget (`timing.connection_lifetime_ms`,
//! decision 0086): the node closes a connection cleanly with 1001 when its
//! budget runs out, even one that pings but never reads, budgets are
//! jittered so connections opened together end apart, and the SDK consumer
//! reconnects at once and loses nothing.

use std::{
    collections::HashMap,
    time::{Duration, Instant},
};

use futures_util::SinkExt;
use serde_json::json;
use tokio_tungstenite::tungstenite::Message;

use crate::{
    helpers::*,
    http_support::eventually,
    sdk_support::{Recorder, Running, consumer, subscription_from_start},
};

/// A node whose connections live `lifetime_ms` (±10 %), with a 1 s lease:
/// a claim that commits in the instant its connection closes leaves its
/// leases to lapse, as any close does, and they come again a lease later.
async fn node_with_lifetime(lifetime_ms: u64) -> TestApp {
    spawn_app_with(|s| {
        s.timing.connection_lifetime_ms = lifetime_ms;
        s.timing.scan_interval_ms = 50;
        s.timing.lease_ms = 1_000;
        s.timing.sweep_interval_ms = 200;
    })
    .await
}

/// The close reasons of the node's closed sessions.
async fn close_reasons(app: &TestApp) -> Vec<String> {
    app.column::<String>("SELECT close_reason FROM event_sessions WHERE closed_at IS NOT NULL")
        .await
}

#[actix_web::test]
async fn a_consumer_closed_at_its_lifetime_reconnects_at_once_and_every_result_is_delivered_and_acked()
 {
    let app = node_with_lifetime(2_000).await;
    let cred = app.bootstrap().await;
    let sub_id = subscription_from_start(&app, &cred, json!({})).await;
    let recorder = Recorder::default();
    let running = Running::start(consumer(&app.address, &cred, &sub_id, 8), recorder.clone());
    // Results keep arriving for 12 s, through every lifetime close.
    let started = Instant::now();
    let mut published = 0;
    while started.elapsed() < Duration::from_secs(12) {
        app.publish(&cred, vec![result(&cred.queue_id, "task.succeeded")])
            .await;
        published += 1;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    recorder
        .until("every result handled", |r| {
            r.deliveries
                .iter()
                .map(|d| d.event.id.clone())
                .collect::<std::collections::HashSet<_>>()
                .len()
                == published
        })
        .await;
    eventually("every delivery ACKed", || async {
        let res = app
            .get(&format!("/v1/subscriptions/{sub_id}/status"), &cred.token)
            .await;
        (res.data()["pending_count"] == 0 && res.data()["lag"] == "0").then_some(())
    })
    .await;
    let stopped = running.stop().await.unwrap();
    assert!(stopped.unconfirmed.is_empty(), "{:?}", stopped.unconfirmed);
    let reasons = close_reasons(&app).await;
    assert!(
        reasons
            .iter()
            .filter(|r| *r == orbit_events_wire::LIFETIME_CLOSE_REASON)
            .count()
            >= 4,
        "{reasons:?}"
    );

    let seen = recorder.seen.lock().unwrap();
    let lifetime_closes = seen
        .disconnects()
        .iter()
        .filter(|r| r.contains(orbit_events_wire::LIFETIME_CLOSE_REASON))
        .count();
    assert!(
        lifetime_closes >= 4,
        "closed at its lifetime at least 4 times in 12 s: {:?}",
        seen.disconnects()
    );
    assert_eq!(
        seen.disconnects().len(),
        lifetime_closes,
        "no other disconnect: {:?}",
        seen.disconnects()
    );
    // Reconnected at once: no backoff step after a lifetime close.
    for o in &seen.outcomes {
        if let orbit_events_client::Outcome::Disconnected { retry_in, .. } = o {
            assert_eq!(*retry_in, Duration::ZERO);
        }
    }
    // The first connection and one after each close but the last, which
    // can land just before the consumer stops (seen once in the suite).
    assert!(
        seen.connections() >= lifetime_closes,
        "{} connections, {lifetime_closes} lifetime closes",
        seen.connections()
    );
    // At least once: a duplicate is only an event whose ACK the close cut.
    let mut counts: HashMap<String, usize> = HashMap::new();
    for d in &seen.deliveries {
        *counts.entry(d.event.id.clone()).or_default() += 1;
    }
    let duplicates: usize = counts.values().map(|n| n - 1).sum();
    assert!(
        duplicates <= 8 * lifetime_closes,
        "at most one capacity of redeliveries per close: {duplicates}"
    );
}

#[actix_web::test]
async fn a_client_that_pings_but_never_reads_is_closed_at_its_lifetime() {
    let app = node_with_lifetime(1_500).await;
    let cred = app.bootstrap().await;
    let sub_id = subscription_from_start(&app, &cred, json!({})).await;
    // Measured from before the upgrade: the budget runs from there.
    let started = Instant::now();
    let ws = app.bind(&cred.token, &sub_id, 1).await;
    let session_id = ws.session_id.clone().unwrap();
    let (mut sink, _unread) = futures_util::StreamExt::split(ws.stream);
    // Pings keep the read-idle timeout away; nothing is ever read and
    // nothing is sent to it (no results).
    let closed = loop {
        let ping = json!({ "protocol_version": "1", "type": "events.ping",
            "message_id": format!("{:032x}", started.elapsed().as_nanos()),
            "session_id": session_id, "body": {} });
        let _ = sink.send(Message::text(ping.to_string())).await;
        let open = app
            .column::<i64>(&format!(
                "SELECT COUNT(*) FROM event_sessions WHERE id = '{session_id}' AND closed_at IS NULL"
            ))
            .await
            .pop();
        if open == Some(0) {
            break started.elapsed();
        }
        assert!(
            started.elapsed() < DEADLINE,
            "the session was not closed at its lifetime"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(
        closed >= Duration::from_millis(1_350),
        "not before its budget (1.5 s - 10 %): {closed:?}"
    );
    let reason = app
        .column::<String>(&format!(
            "SELECT close_reason FROM event_sessions WHERE id = '{session_id}'"
        ))
        .await
        .pop()
        .unwrap();
    assert_eq!(reason, orbit_events_wire::LIFETIME_CLOSE_REASON);
}

#[actix_web::test]
async fn lifetimes_of_connections_opened_together_end_spread_over_time() {
    let app = node_with_lifetime(2_000).await;
    let cred = app.bootstrap().await;
    let sub_id = subscription_from_start(&app, &cred, json!({})).await;
    let mut clients = Vec::new();
    let binding = Instant::now();
    for _ in 0..20 {
        clients.push(app.bind(&cred.token, &sub_id, 1).await);
    }
    // The lifetimes start at the binds, which take their own time.
    let binds_spread = binding.elapsed();
    // Each reads until its close, and notes when it came.
    let started = Instant::now();
    let ends = futures_util::future::join_all(clients.into_iter().map(|mut ws| async move {
        let code = tokio::time::timeout(DEADLINE, ws.closed()).await.unwrap();
        (code.map(u16::from), started.elapsed())
    }))
    .await;
    assert!(ends.iter().all(|(code, _)| *code == Some(1001)), "{ends:?}");
    let first = ends.iter().map(|(_, t)| *t).min().unwrap();
    let last = ends.iter().map(|(_, t)| *t).max().unwrap();
    assert!(
        last - first > Duration::from_millis(100),
        "20 lifetimes ended within 100 ms of each other: {first:?}..{last:?}"
    );
    assert!(
        last - first <= Duration::from_millis(400) + binds_spread + Duration::from_millis(100),
        "within the ±10 % window (plus the binds' own spread, {binds_spread:?}): {first:?}..{last:?}"
    );
}

/// A lease a consumer got: (delivery id, epoch, lease_until, when it
/// arrived).
type Lease = (
    String,
    u64,
    chrono::DateTime<chrono::Utc>,
    chrono::DateTime<chrono::Utc>,
);

/// Every lease any consumer got, and the waits after its 429s.
#[derive(Clone, Default)]
struct Leases {
    seen: std::sync::Arc<std::sync::Mutex<Vec<Lease>>>,
    refusals: std::sync::Arc<std::sync::Mutex<Vec<Duration>>>,
}

impl orbit_events_client::Handler for Leases {
    async fn handle(
        &self,
        delivery: orbit_events_client::Delivery,
    ) -> Result<(), orbit_events_client::HandlerError> {
        let d = &delivery.delivery;
        let until = d.lease_until.expect("a delivered lease has its end");
        self.seen
            .lock()
            .unwrap()
            .push((d.id.clone(), d.lease_epoch, until, chrono::Utc::now()));
        Ok(())
    }

    fn on_outcome(&self, outcome: &orbit_events_client::Outcome) {
        if let orbit_events_client::Outcome::Disconnected { reason, retry_in } = outcome
            && reason.contains("CAPACITY_EXCEEDED")
        {
            self.refusals.lock().unwrap().push(*retry_in);
        }
    }
}

/// Open sessions opened at or after `since` (microseconds).
async fn sessions_opened_since(app: &TestApp, since: i64) -> i64 {
    app.column::<i64>(&format!(
        "SELECT COUNT(*) FROM event_sessions WHERE closed_at IS NULL AND opened_at >= {since}"
    ))
    .await
    .pop()
    .unwrap_or(0)
}

#[actix_web::test]
async fn a_node_restarted_under_160_consumers_rebinds_its_128_refuses_the_rest_with_429_and_loses_nothing()
 {
    // The in-process node only stages data; the process serves.
    let mut app = spawn_app_with(|s| s.timing.sweep_interval_ms = 3_600_000).await;
    let env = [
        ("ORBIT_EVENTS__LIMITS__MAX_CONNECTIONS", "128"),
        ("ORBIT_EVENTS__TIMING__LEASE_MS", "2000"),
        ("ORBIT_EVENTS__TIMING__SCAN_INTERVAL_MS", "100"),
    ];
    let mut node = crate::protocol_support::NodeProcess::serve_for(&mut app, &env).await;
    let port = node.port;
    let cred = app.bootstrap().await;
    let mut subs = Vec::new();
    for _ in 0..4 {
        subs.push(subscription_from_start(&app, &cred, json!({})).await);
    }
    let handler = Leases::default();
    let consumers: Vec<Running> = (0..160)
        .map(|i| {
            Running::start(
                consumer(&app.address, &cred, &subs[i % 4], 1),
                handler.clone(),
            )
        })
        .collect();
    eventually("128 consumers bound", || async {
        (sessions_opened_since(&app, 0).await == 128).then_some(())
    })
    .await;
    for _ in 0..10 {
        crate::protocol_support::publish_n(&app, &cred, 10, "task.succeeded").await;
    }

    // The restart: a clean stop, then a new process on the same port.
    node.signal("TERM");
    node.exited().await;
    let restarted = chrono::Utc::now().timestamp_micros();
    let since_restart = Instant::now();
    let node = crate::protocol_support::NodeProcess::serve_on(&mut app, port, &env).await;
    eventually("128 consumers bound again", || async {
        (sessions_opened_since(&app, restarted).await == 128).then_some(())
    })
    .await;
    let rebound = since_restart.elapsed();
    assert!(
        rebound <= Duration::from_secs(15),
        "every admitted consumer bound again within 15 s: {rebound:?}"
    );
    for _ in 0..10 {
        crate::protocol_support::publish_n(&app, &cred, 10, "task.succeeded").await;
    }
    for sub in &subs {
        eventually("every result of the subscription ACKed", || async {
            let res = app
                .get(&format!("/v1/subscriptions/{sub}/status"), &cred.token)
                .await;
            (res.data()["pending_count"] == 0
                && res.data()["lag"] == "0"
                && res.data()["cursor_sequence"] == "200")
                .then_some(())
        })
        .await;
    }
    let acked = app
        .column::<i64>("SELECT COUNT(*) FROM deliveries WHERE state = 'ACKED'")
        .await
        .pop();
    assert_eq!(acked, Some(800), "200 results × 4 subscriptions");

    // The extra 32 (and more, while the admitted ones rebound) were refused
    // with 429 and came back after Retry-After plus jitter, not in step.
    let refusals = handler.refusals.lock().unwrap().clone();
    assert!(refusals.len() >= 32, "{} refusals", refusals.len());
    assert!(
        refusals.iter().all(|d| *d >= Duration::from_secs(1)),
        "{refusals:?}"
    );
    let distinct: std::collections::HashSet<_> = refusals.iter().collect();
    assert!(
        distinct.len() > refusals.len() / 2,
        "jittered: {refusals:?}"
    );

    // No delivery was leased twice at once: a later lease of a delivery
    // arrived only after the earlier one's end, and no lease came twice.
    let mut leases = handler.seen.lock().unwrap().clone();
    leases.sort_by(|a, b| (&a.0, a.1).cmp(&(&b.0, b.1)));
    for pair in leases.windows(2) {
        let (earlier, later) = (&pair[0], &pair[1]);
        if earlier.0 == later.0 {
            assert!(
                later.1 > earlier.1,
                "the same lease twice: {earlier:?} {later:?}"
            );
            assert!(
                later.3 >= earlier.2,
                "leased again before the earlier lease ended: {earlier:?} {later:?}"
            );
        }
    }

    // The claim queue stayed within its limits while everyone rebound.
    let m = crate::metrics::scrape(&app).await;
    let settings = orbit_events::config::Settings::defaults().unwrap();
    assert!(
        m.value("orbit_events_claims_waiting_high_water", &[])
            <= settings.limits.claims_queued as f64
    );
    assert!(
        m.value("orbit_events_claims_in_flight_high_water", &[])
            <= settings.limits.claims_in_flight as f64
    );
    for c in consumers {
        let _ = c.stop().await;
    }
    drop(node);
}
