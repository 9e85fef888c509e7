//! The walking skeleton end to end: publish → subscribe → connect → deliver
//! → ACK, leases and redelivery (delivery-model.md §3–§6).

use std::{
    collections::{HashMap, HashSet},
    time::Duration,
};

use serde_json::json;

use crate::helpers::*;

#[actix_web::test]
async fn a_thousand_results_reach_four_connections_and_each_matching_one_is_acked_once() {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    // Three of the four types: task.cancelled results must be skipped.
    let sub = app
        .subscribe(
            &cred,
            json!({ "from_sequence": "0", "types": ["task.succeeded", "task.failed", "task.needs_review"] }),
        )
        .await;
    let sub_id = sub["id"].as_str().unwrap().to_owned();

    let mut expected = HashSet::new();
    for batch in 0..10 {
        let results = (0..100)
            .map(|i| result(&cred.queue_id, TYPES[(batch + i) % 4]))
            .collect();
        let types: Vec<&str> = (0..100).map(|i| TYPES[(batch + i) % 4]).collect();
        for ((id, _), t) in app.publish(&cred, results).await.into_iter().zip(types) {
            if t != "task.cancelled" {
                expected.insert(id);
            }
        }
    }
    assert_eq!(expected.len(), 750);

    let mut tasks = Vec::new();
    for _ in 0..4 {
        let mut ws = app.bind(&cred.token, &sub_id, 8).await;
        tasks.push(actix_web::rt::spawn(async move {
            let mut seen: Vec<(String, u64)> = Vec::new();
            let mut acked = Vec::new();
            while let Some(d) = ws.delivery_within(Duration::from_secs(3)).await {
                let event = &d["body"]["event"];
                assert_ne!(event["type"], "task.cancelled");
                seen.push((
                    event["id"].as_str().unwrap().to_owned(),
                    event["sequence"].as_str().unwrap().parse().unwrap(),
                ));
                let reply = ws.ack(&d).await;
                assert_eq!(reply["type"], "ack", "{reply:#}");
                assert_eq!(reply["body"]["deduplicated"], false);
                acked.push(reply["body"]["event_id"].as_str().unwrap().to_owned());
            }
            (seen, acked)
        }));
    }

    let mut acked_count: HashMap<String, usize> = HashMap::new();
    for task in tasks {
        let (seen, acked) = task.await.unwrap();
        // First deliveries on one connection come in non-decreasing sequence order.
        assert!(
            seen.windows(2).all(|w| w[0].1 <= w[1].1),
            "out of order on one connection"
        );
        for id in acked {
            *acked_count.entry(id).or_default() += 1;
        }
    }
    let acked: HashSet<String> = acked_count.keys().cloned().collect();
    assert_eq!(acked, expected, "every matching event delivered and ACKed");
    assert!(
        acked_count.values().all(|n| *n == 1),
        "an event was ACKed twice"
    );

    let not_acked = app
        .scalar(&format!(
            "SELECT COUNT(*) FROM deliveries WHERE subscription_id = '{sub_id}' AND state <> 'ACKED'"
        ))
        .await;
    assert_eq!(not_acked, 0);
    let rows = app
        .scalar(&format!(
            "SELECT COUNT(*) FROM deliveries WHERE subscription_id = '{sub_id}'"
        ))
        .await;
    assert_eq!(rows, 750);
    let res = app
        .get(&format!("/v1/subscriptions/{sub_id}"), &cred.token)
        .await;
    assert_eq!(res.data()["pending_count"], 0);
    assert_eq!(res.data()["cursor_sequence"], "1000");
    app.assert_invariants().await;
}

#[actix_web::test]
async fn an_unacked_delivery_is_offered_again_with_epoch_2_and_the_epoch_1_proof_loses_its_lease() {
    let app = spawn_app_with(|s| s.timing.lease_ms = 300).await;
    let cred = app.bootstrap().await;
    let sub = app.subscribe(&cred, json!({})).await;
    let mut ws = app.bind(&cred.token, sub["id"].as_str().unwrap(), 1).await;
    app.publish(&cred, vec![result(&cred.queue_id, "task.succeeded")])
        .await;

    let first = ws.delivery().await;
    assert_eq!(first["body"]["delivery"]["lease_epoch"], "1");
    assert_eq!(first["body"]["delivery"]["state"], "LEASED");
    // No ACK: after the lease the same delivery comes back with epoch 2.
    let second = ws.delivery().await;
    assert_eq!(
        second["body"]["delivery"]["id"],
        first["body"]["delivery"]["id"]
    );
    assert_eq!(second["body"]["delivery"]["lease_epoch"], "2");
    assert_eq!(second["body"]["delivery"]["attempts"], 2);
    assert_eq!(second["body"]["event"]["id"], first["body"]["event"]["id"]);

    let lost = ws.ack(&first).await;
    assert_eq!(lost["type"], "error");
    assert_eq!(lost["error"]["code"], "DELIVERY_LEASE_LOST");
    // The connection stays open.
    assert_eq!(ws.ping().await["type"], "ack");

    let ok = ws.ack(&second).await;
    assert_eq!(ok["type"], "ack", "{ok:#}");
    assert_eq!(ok["body"]["epoch"], "2");
    assert_eq!(ok["body"]["deduplicated"], false);
    app.assert_invariants().await;
}

#[actix_web::test]
async fn the_same_ack_sent_twice_answers_deduplicated_with_the_original_acknowledged_at() {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let sub = app.subscribe(&cred, json!({})).await;
    let mut ws = app.bind(&cred.token, sub["id"].as_str().unwrap(), 4).await;
    app.publish(&cred, vec![result(&cred.queue_id, "task.failed")])
        .await;
    let d = ws.delivery().await;

    let first = ws.ack(&d).await;
    assert_eq!(first["type"], "ack");
    assert_eq!(first["body"]["deduplicated"], false);
    let again = ws.ack(&d).await;
    assert_eq!(again["type"], "ack");
    assert_eq!(again["body"]["deduplicated"], true);
    assert_eq!(
        again["body"]["acknowledged_at"],
        first["body"]["acknowledged_at"]
    );
    assert_eq!(again["body"]["event_id"], first["body"]["event_id"]);

    // A new connection with the same proof gets the same answer.
    let mut other = app.bind(&cred.token, sub["id"].as_str().unwrap(), 1).await;
    let third = other.ack(&d).await;
    assert_eq!(third["body"]["deduplicated"], true);
    assert_eq!(
        third["body"]["acknowledged_at"],
        first["body"]["acknowledged_at"]
    );

    // The row keeps the first ACK: its epoch and the session it came on.
    let recorded = app
        .scalar(&format!(
            "SELECT COUNT(*) FROM deliveries WHERE id = '{}' AND ack_epoch = 1 \
             AND COALESCE(ack_session_id, lease_session_id) = '{}'",
            d["body"]["delivery"]["id"].as_str().unwrap(),
            d["session_id"].as_str().unwrap()
        ))
        .await;
    assert_eq!(recorded, 1, "a deduplicated ACK writes nothing");
    app.assert_invariants().await;
}

#[actix_web::test]
async fn bootstrap_prints_one_json_object_and_grants_events_access_only_when_asked() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}/cli.db?mode=rwc", dir.path().display());
    let run = |extra: &[&str]| {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_orbit-events"));
        cmd.args([
            "bootstrap",
            "--namespace",
            "demo",
            "--application",
            "app",
            "--queue",
            "results",
        ])
        .args(extra)
        .env("ORBIT_EVENTS__DATABASE__URL", &url);
        cmd.output().unwrap()
    };
    let out = run(&["--event-access", "--publish-access"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert_eq!(stdout.lines().count(), 1);
    let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    let keys: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
    assert_eq!(
        keys,
        [
            "namespace_id",
            "application_id",
            "queue_id",
            "credential_id",
            "token",
            "permissions"
        ]
    );
    assert_eq!(
        v["permissions"],
        json!([
            "events:manage",
            "events:read",
            "events:consume",
            "results:publish"
        ])
    );

    let plain = run(&["--publish-access"]);
    let v2: serde_json::Value = serde_json::from_slice(&plain.stdout).unwrap();
    assert_eq!(v2["permissions"], json!(["results:publish"]));
    // Reused by name, new credential.
    assert_eq!(v2["queue_id"], v["queue_id"]);
    assert_ne!(v2["credential_id"], v["credential_id"]);
}

#[actix_web::test]
async fn an_unknown_configuration_key_stops_start_up_with_its_name() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_orbit-events"))
        .args(["migrate"])
        .env("ORBIT_EVENTS__LIMITS__MAX_CONECTIONS", "5")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("max_conections"), "{stderr}");
}
