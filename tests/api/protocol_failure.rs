//! protocol.md §4 `UNAVAILABLE`: a database failure is reported and closes
//! the connection with 1011, never shown as "no events"; reconnecting
//! keeps every delivery and ACK identity (delivery-model.md §1 promise 3).

use std::collections::{BTreeSet, HashMap};

use serde_json::Value;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;

use crate::{helpers::*, protocol_support::*};

fn delivery_id(d: &Value) -> String {
    d["body"]["delivery"]["id"].as_str().unwrap().to_owned()
}

#[actix_web::test]
async fn a_database_failure_during_a_session_gives_unavailable_and_1011_and_a_reconnect_gets_every_unacked_delivery_with_the_same_ids()
 {
    let (app, cred, sub, mut ws) = bound_session(|s| s.timing.lease_ms = 1_500, 5).await;
    publish_n(&app, &cred, 5, "task.succeeded").await;
    let mut delivered = Vec::new();
    for _ in 0..5 {
        delivered.push(ws.delivery().await);
    }
    for d in &delivered[..2] {
        assert_eq!(ws.ack(d).await["body"]["deduplicated"], false);
    }

    let outage = database_outage(&app).await;
    let ack = ws.envelope("event.ack", proof(&delivered[2]));
    let ack_id = ack["message_id"].clone();
    ws.send_json(ack).await;
    // Whichever database call fails first says so: this ACK (with its
    // reply_to) or a background claim (without).
    let err = ws.frame().await;
    assert_error_frame(&err, "UNAVAILABLE");
    if let Some(reply_to) = err.get("reply_to") {
        assert_eq!(reply_to, &ack_id);
    }
    assert_eq!(err["session_id"], ws.session_id.as_deref().unwrap());
    assert_eq!(ws.closed().await, Some(CloseCode::Error));
    outage.end().await;

    // After recovery a new connection receives the three unacknowledged
    // deliveries again (once their leases lapse), under the same ids, each
    // with its second lease: a claim of the failed session that was still
    // waiting for the database leased nothing to that closed session.
    let mut again = app.bind(&cred.token, &sub, 5).await;
    let expected: BTreeSet<String> = delivered[2..].iter().map(delivery_id).collect();
    let mut redelivered: HashMap<String, Value> = HashMap::new();
    while redelivered.len() < 3 {
        let d = again.delivery().await;
        let id = delivery_id(&d);
        assert!(expected.contains(&id), "an ACKed delivery came back: {d:#}");
        assert_eq!(d["body"]["delivery"]["lease_epoch"], "2", "{d:#}");
        assert!(!redelivered.contains_key(&id), "ACKed twice: {d:#}");
        let ok = again.ack(&d).await;
        assert_eq!(ok["type"], "ack", "{ok:#}");
        assert_eq!(ok["body"]["deduplicated"], false);
        redelivered.insert(id, d);
    }
    // And the ACKs from before the failure kept their identity.
    let replay = again.ack(&delivered[0]).await;
    assert_eq!(replay["body"]["deduplicated"], true, "{replay:#}");
    assert_eq!(
        app.scalar(&format!(
            "SELECT COUNT(*) FROM deliveries WHERE subscription_id = '{sub}' AND state = 'ACKED'"
        ))
        .await,
        5
    );
    app.assert_invariants().await;
}

#[actix_web::test]
async fn a_hello_while_the_database_is_down_gets_unavailable_and_closes_with_1011() {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let sub = subscription(&app, &cred).await;
    let mut ws = app.connect(&cred.token).await;
    let outage = database_outage(&app).await;
    let hello = ws.envelope(
        "events.hello",
        serde_json::json!({"subscription_id": sub, "capacity": 1}),
    );
    let id = hello["message_id"].clone();
    ws.send_json(hello).await;
    let err = expect_error_then_close(&mut ws, "UNAVAILABLE", Some(&id), CloseCode::Error).await;
    assert!(err.get("session_id").is_none());
    outage.end().await;
    // The node serves again once the database is back.
    app.bind(&cred.token, &sub, 1).await;
    app.assert_invariants().await;
}
