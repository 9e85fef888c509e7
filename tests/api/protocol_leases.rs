//! protocol.md §4 and delivery-model.md §6 on the wire: lease proofs, late
//! ACKs, recovery at claim, the attempt budget, history gaps, and the order
//! of first deliveries (delivery-model.md §1.2).

use std::time::Duration;

use serde_json::{Value, json};
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;

use crate::{helpers::*, protocol_support::*, retention::create_sub};

fn delivery_id(d: &Value) -> &str {
    d["body"]["delivery"]["id"].as_str().unwrap()
}

async fn state_of(app: &TestApp, id: &str, state: &str) -> bool {
    app.scalar(&format!(
        "SELECT COUNT(*) FROM deliveries WHERE id = '{id}' AND state = '{state}'"
    ))
    .await
        == 1
}

/// Waits until the delivery's lease has lapsed by the database clock's
/// measure (the row keeps saying LEASED: reads never change state).
async fn wait_for_lapse(app: &TestApp, id: &str) {
    let now = || orbit_events::domain::now().micros();
    wait_until("the lease lapsed", || async move {
        app.scalar(&format!(
            "SELECT COUNT(*) FROM deliveries WHERE id = '{id}' AND state = 'LEASED' AND lease_until < {}",
            now()
        ))
        .await
            == 1
    })
    .await;
}

#[actix_web::test]
async fn a_late_ack_after_the_lease_lapsed_is_accepted_while_no_newer_epoch_exists() {
    let (app, cred, sub, mut ws) = bound_session(|s| s.timing.lease_ms = 300, 1).await;
    publish_one(&app, &cred, "task.succeeded").await;
    let d = ws.delivery().await;
    // Paused: no claim can lease it again (and so no newer epoch appears).
    set_enabled(&app, &sub, false).await;
    wait_for_lapse(&app, delivery_id(&d)).await;

    let ok = ws.ack(&d).await;
    assert_eq!(ok["type"], "ack", "{ok:#}");
    assert_eq!(ok["body"]["epoch"], "1");
    assert_eq!(ok["body"]["deduplicated"], false);
    assert!(state_of(&app, delivery_id(&d), "ACKED").await);
    app.assert_invariants().await;
}

#[actix_web::test]
async fn an_ack_from_a_new_connection_with_the_proof_of_a_closed_one_is_accepted() {
    let (app, cred, sub, mut old) = bound_session(|_| {}, 1).await;
    publish_one(&app, &cred, "task.cancelled").await;
    let d = old.delivery().await;
    drop(old);

    let mut new = app.bind(&cred.token, &sub, 1).await;
    assert_ne!(new.session_id, None);
    let ok = new.ack(&d).await;
    assert_eq!(ok["type"], "ack", "{ok:#}");
    assert_eq!(ok["body"]["deduplicated"], false);
    assert_eq!(ok["body"]["delivery_id"], delivery_id(&d));
    assert_eq!(ok["body"]["event_id"], d["body"]["event"]["id"]);
    app.assert_invariants().await;
}

#[actix_web::test]
async fn a_wrong_secret_or_a_never_leased_epoch_gets_delivery_lease_lost_and_the_connection_stays()
{
    let (app, cred, _, mut ws) = bound_session(|_| {}, 1).await;
    publish_one(&app, &cred, "task.failed").await;
    let d = ws.delivery().await;
    let secret = d["body"]["lease_secret"].as_str().unwrap();
    // A well-formed secret that is not this lease's.
    let mut chars = secret.chars();
    let first = chars.next().unwrap();
    let other = format!("{}{}", if first == 'A' { 'B' } else { 'A' }, chars.as_str());
    for (epoch, secret) in [("1", other.as_str()), ("2", secret), ("0", secret)] {
        let reply = ws.ack_proof(delivery_id(&d), epoch, secret).await;
        assert_error_frame(&reply, "DELIVERY_LEASE_LOST");
        assert!(reply["reply_to"].is_string());
        assert_eq!(reply["session_id"], ws.session_id.as_deref().unwrap());
    }
    ping_expect_ack(&mut ws).await;
    assert!(state_of(&app, delivery_id(&d), "LEASED").await);
    let ok = ws.ack(&d).await;
    assert_eq!(ok["body"]["deduplicated"], false, "{ok:#}");
    app.assert_invariants().await;
}

#[actix_web::test]
async fn an_expired_lease_is_recovered_by_the_next_claim_and_offered_again_with_revision_4_and_epoch_2()
 {
    let (app, cred, _, mut ws) = bound_session(|s| s.timing.lease_ms = 1_000, 1).await;
    publish_one(&app, &cred, "task.succeeded").await;
    let first = ws.delivery().await;
    let f = &first["body"]["delivery"];
    assert_eq!(
        (&f["revision"], &f["lease_epoch"], &f["attempts"]),
        (&json!("2"), &json!("1"), &json!(1))
    );
    let again = ws.delivery().await;
    let a = &again["body"]["delivery"];
    assert_eq!(a["id"], f["id"]);
    // materialized 1, leased 2, recovered to PENDING 3, leased again 4
    assert_eq!(a["revision"], "4");
    assert_eq!(a["lease_epoch"], "2");
    assert_eq!(a["attempts"], 2);
    assert_eq!(a["state"], "LEASED");
    // A recovered delivery becomes available when its lease ended.
    assert_eq!(a["available_at"], f["lease_until"]);
    assert_ne!(again["body"]["lease_secret"], first["body"]["lease_secret"]);
    let ok = ws.ack(&again).await;
    assert_eq!(ok["body"]["epoch"], "2", "{ok:#}");
    app.assert_invariants().await;
}

/// `lease_until` of a delivery frame, in µs.
fn lease_until(d: &Value) -> i64 {
    orbit_events::domain::Timestamp::parse_rfc3339(
        d["body"]["delivery"]["lease_until"].as_str().unwrap(),
    )
    .unwrap()
    .micros()
}

/// Waits until the clock is `before` µs short of `until`.
async fn wait_until_short_of(until: i64, before: i64) {
    wait_until("the lease is partly spent", || async move {
        orbit_events::domain::now().micros() >= until - before
    })
    .await;
}

/// The connection forgets each lapsed lease at its own deadline (one timer
/// at the earliest, set again for the next), so each gives its room back
/// then. Three leases two seconds apart fill the capacity and none is
/// ACKed: each comes back before the next one lapsed. (Seconds apart, so
/// that a loaded machine's stall does not lapse two at once.)
#[actix_web::test]
async fn each_lapsed_lease_of_a_connection_gives_its_room_back_at_its_own_deadline() {
    let (app, cred, _, mut ws) = bound_session(|s| s.timing.lease_ms = 6_000, 3).await;
    let mut held = Vec::new();
    for _ in 0..3 {
        if let Some(last) = held.last() {
            wait_until_short_of(lease_until(last), 4_000_000).await;
        }
        publish_one(&app, &cred, "task.succeeded").await;
        held.push(ws.delivery().await);
    }
    // Nothing is ACKed until all came back: each one's room comes back
    // only when the connection forgets its lapsed lease.
    let mut again = Vec::new();
    for (i, d) in held.iter().enumerate() {
        let back = ws.delivery().await;
        let came_back_at = orbit_events::domain::now().micros();
        assert_eq!(delivery_id(&back), delivery_id(d), "lease {i}");
        assert_eq!(back["body"]["delivery"]["lease_epoch"], "2", "{back:#}");
        if let Some(next) = held.get(i + 1) {
            assert!(
                came_back_at < lease_until(next),
                "lease {i} came back only after lease {} lapsed",
                i + 1
            );
        }
        again.push(back);
    }
    for d in &again {
        let ok = ws.ack(d).await;
        assert_eq!(ok["body"]["epoch"], "2", "{ok:#}");
    }
    app.assert_invariants().await;
}

/// When the earliest lease was ACKed, the timer set for it finds nothing
/// lapsed and is set again for the next one: with the capacity full again
/// (a third delivery), the second lease still gives its room back when it
/// lapses, and comes back.
#[actix_web::test]
async fn a_connection_whose_earliest_lease_was_acked_still_forgets_its_later_lease_when_it_lapses()
{
    let (app, cred, _, mut ws) = bound_session(|s| s.timing.lease_ms = 2_000, 2).await;
    publish_one(&app, &cred, "task.succeeded").await;
    let a = ws.delivery().await;
    // a's ACK must arrive before it lapses: a second to spare.
    wait_until_short_of(lease_until(&a), 1_000_000).await;
    publish_one(&app, &cred, "task.succeeded").await;
    let b = ws.delivery().await;
    let ok = ws.ack(&a).await;
    assert_eq!(ok["body"]["epoch"], "1", "{ok:#}");
    publish_one(&app, &cred, "task.succeeded").await;
    let c = ws.delivery().await;
    // Held: b and c, the capacity. b's room comes back only when the
    // connection forgets it.
    let again = ws.delivery().await;
    assert_eq!(delivery_id(&again), delivery_id(&b));
    assert_eq!(again["body"]["delivery"]["lease_epoch"], "2");
    for d in [&again, &c] {
        ws.ack(d).await;
    }
    app.assert_invariants().await;
}

#[actix_web::test]
async fn a_delivery_that_used_its_attempt_budget_becomes_expired_and_a_late_ack_still_acknowledges_it()
 {
    let app = spawn_app_with(|s| s.timing.lease_ms = 300).await;
    let cred = app.bootstrap().await;
    let sub = app
        .subscribe(&cred, json!({ "from_sequence": "0", "max_attempts": 1 }))
        .await["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let mut ws = app.bind(&cred.token, &sub, 1).await;
    publish_one(&app, &cred, "task.needs_review").await;
    let d = ws.delivery().await;
    assert_eq!(d["body"]["delivery"]["attempt_budget"], 1);
    // The next claim (the session has room again once the lease lapses)
    // recovers the lease to EXPIRED instead of offering it again.
    let id = delivery_id(&d).to_owned();
    let app_ref = &app;
    let id_ref = id.as_str();
    wait_until("the delivery is EXPIRED", || async move {
        state_of(app_ref, id_ref, "EXPIRED").await
    })
    .await;
    assert!(
        ws.delivery_within(Duration::from_millis(500))
            .await
            .is_none()
    );
    assert_eq!(
        app.scalar(&format!(
            "SELECT revision FROM deliveries WHERE id = '{id}'"
        ))
        .await,
        3
    );

    let ok = ws.ack(&d).await;
    assert_eq!(ok["type"], "ack", "{ok:#}");
    assert_eq!(ok["body"]["deduplicated"], false);
    assert!(state_of(&app, &id, "ACKED").await);
    app.assert_invariants().await;
}

#[actix_web::test]
async fn a_hello_behind_the_retention_floor_gets_event_history_expired_naming_the_earliest_sequence_and_closes_with_1008()
 {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let sub = subscription(&app, &cred).await;
    publish_n(&app, &cred, 3, "task.succeeded").await;
    purge_through(&app, &cred, 2).await;

    let mut ws = app.connect(&cred.token).await;
    let hello = ws.envelope(
        "events.hello",
        json!({"subscription_id": sub, "capacity": 1}),
    );
    let id = hello["message_id"].clone();
    ws.send_json(hello).await;
    let err = expect_error_then_close(
        &mut ws,
        "EVENT_HISTORY_EXPIRED",
        Some(&id),
        CloseCode::Policy,
    )
    .await;
    assert!(
        err["error"]["message"]
            .as_str()
            .unwrap()
            .contains("earliest available sequence is 3"),
        "{err:#}"
    );
    assert_eq!(app.scalar("SELECT COUNT(*) FROM event_sessions").await, 0);
}

#[actix_web::test]
async fn a_history_gap_found_by_a_claim_is_reported_without_reply_to_and_closes_with_1008_never_jumping_to_the_head()
 {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    // max_pending 1: the cursor stops behind the first unacknowledged event.
    let sub = app
        .subscribe(&cred, json!({ "from_sequence": "0", "max_pending": 1 }))
        .await["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let mut ws = app.bind(&cred.token, &sub, 1).await;
    publish_n(&app, &cred, 4, "task.failed").await;
    let d = ws.delivery().await;
    assert_eq!(d["body"]["event"]["sequence"], "1");
    purge_through(&app, &cred, 3).await;

    // The ACK frees room; materialization finds the gap: the claim the
    // ACK's room wakes, or the scanner's round that the first claim left
    // behind the head, whichever runs first, so the error may come before
    // the ACK's reply (the reply, when it comes, is a plain `ack`).
    let ack = ws.envelope("event.ack", proof(&d));
    let ack_id = ack["message_id"].clone();
    ws.send_json(ack).await;
    let err = loop {
        let frame = ws.frame().await;
        if frame["reply_to"] == ack_id {
            assert_eq!(frame["type"], "ack", "{frame:#}");
            continue;
        }
        break frame;
    };
    assert_error_frame(&err, "EVENT_HISTORY_EXPIRED");
    assert!(err.get("reply_to").is_none(), "{err:#}");
    assert_eq!(ws.closed().await, Some(CloseCode::Policy));
    assert!(
        err["error"]["message"]
            .as_str()
            .unwrap()
            .contains("earliest available sequence is 4"),
        "{err:#}"
    );
    assert_eq!(err["session_id"], ws.session_id.as_deref().unwrap());
    let res = app
        .get(&format!("/v1/subscriptions/{sub}"), &cred.token)
        .await;
    assert_eq!(
        res.data()["cursor_sequence"],
        "1",
        "never silently advanced"
    );
    app.assert_invariants().await;
}

/// Purges the queue's log through `floor` as retention would: the events
/// go and the retention floor rises.
async fn purge_through(app: &TestApp, cred: &Cred, floor: u64) {
    execute(
        app,
        &format!(
            "DELETE FROM result_events WHERE queue_id = '{}' AND sequence <= {floor}",
            cred.queue_id
        ),
    )
    .await;
    execute(
        app,
        &format!(
            "UPDATE queues SET retention_floor = {floor} WHERE id = '{}'",
            cred.queue_id
        ),
    )
    .await;
}

/// delivery-model.md §1.2: first deliveries of a subscription are offered
/// in sequence order, through a full window (`max_pending` 5, capacity 3)
/// refilled by claims and by the scanner as ACKs come.
#[actix_web::test]
async fn first_deliveries_are_offered_in_sequence_order_through_a_full_window_and_its_refills() {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let s = create_sub(&app, &cred, json!({ "max_pending": 5 })).await;
    let mut ws = app.bind(&cred.token, &s, 3).await;
    let results = (0..12)
        .map(|_| result(&cred.queue_id, "task.succeeded"))
        .collect();
    let published = app.publish(&cred, results).await;
    let mut offered = Vec::new();
    while offered.len() < published.len() {
        // Take what the session holds, then ACK it all: the next claim
        // wants 3 while fewer PENDING rows are left.
        let mut held = vec![ws.delivery().await];
        while held.len() < 3
            && let Some(d) = ws
                .delivery_within(std::time::Duration::from_millis(300))
                .await
        {
            held.push(d);
        }
        for d in &held {
            offered.push(
                d["body"]["event"]["sequence"]
                    .as_str()
                    .unwrap()
                    .parse::<u64>()
                    .unwrap(),
            );
            ws.ack(d).await;
        }
    }
    let sequences: Vec<u64> = published.iter().map(|(_, seq)| *seq).collect();
    assert_eq!(offered, sequences);
    app.assert_invariants().await;
}
