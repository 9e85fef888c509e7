//! Deliveries over HTTP: list, detail, retry (http-api.md §3
//! "Deliveries", delivery-model.md §6 "Retry").

use std::collections::HashSet;

use serde_json::{Value, json};

use crate::{helpers::*, http_support::*};

fn retry_path(sub_id: &str, delivery_id: &str) -> String {
    format!("/v1/subscriptions/{sub_id}/deliveries/{delivery_id}:retry")
}

const RETRY: &str = "/v1/subscriptions/{id}/deliveries/{delivery_id}:retry";
const LIST: &str = "/v1/subscriptions/{id}/deliveries";
const DETAIL: &str = "/v1/subscriptions/{id}/deliveries/{delivery_id}";

/// `GET` of one delivery's detail, checked against the OpenAPI document.
async fn get_detail(app: &TestApp, token: &str, sub_id: &str, id: &str) -> Resp {
    let res = app
        .get(
            &format!("/v1/subscriptions/{sub_id}/deliveries/{id}"),
            token,
        )
        .await;
    assert_conforms("GET", DETAIL, &res);
    res
}

/// A subscription with four deliveries: 1 ACKED, 1 LEASED (held by the
/// returned session, capacity 1) and 2 PENDING. Returns the subscription
/// id, the session and the `event.deliver` frame of the LEASED one.
async fn deliveries_in_three_states(app: &TestApp, cred: &Cred) -> (String, WsClient, Value) {
    let sub = app.subscribe(cred, json!({ "from_sequence": "0" })).await;
    let sub_id = sub["id"].as_str().unwrap().to_owned();
    let q = &cred.queue_id;
    app.publish(cred, (0..4).map(|_| result(q, "task.succeeded")).collect())
        .await;
    let mut ws = app.bind(&cred.token, &sub_id, 1).await;
    let first = ws.delivery().await;
    let reply = ws.ack(&first).await;
    assert_eq!(reply["type"], "ack", "{reply:#}");
    let second = ws.delivery().await;
    // Now: 1 ACKED, 1 LEASED, 2 PENDING.
    let list = format!("/v1/subscriptions/{sub_id}/deliveries?state=PENDING");
    eventually("two PENDING deliveries", || async {
        let res = app.get(&list, &cred.token).await;
        (res.data()["items"].as_array().map(Vec::len) == Some(2)).then_some(())
    })
    .await;
    (sub_id, ws, second)
}

#[actix_web::test]
async fn the_delivery_list_filters_by_state_pages_newest_first_and_omits_absent_fields() {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let (sub_id, _ws, leased) = deliveries_in_three_states(&app, &cred).await;
    let base = format!("/v1/subscriptions/{sub_id}/deliveries");
    let res = app.get(&base, &cred.token).await;
    assert_eq!(res.status, 200);
    assert_conforms("GET", LIST, &res);
    let items = res.data()["items"].as_array().unwrap().clone();
    assert_eq!(items.len(), 4);
    let mut states: Vec<&str> = items.iter().map(|d| d["state"].as_str().unwrap()).collect();
    states.sort();
    assert_eq!(states, ["ACKED", "LEASED", "PENDING", "PENDING"]);
    for d in &items {
        assert_eq!(d["subscription_id"], json!(sub_id));
        let state = d["state"].as_str().unwrap();
        assert_eq!(d.get("lease_until").is_some(), state == "LEASED", "{d:#}");
        for only_acked in ["acknowledged_at", "ack_epoch", "ack_session_id"] {
            assert_eq!(d.get(only_acked).is_some(), state == "ACKED", "{d:#}");
        }
        if state == "PENDING" {
            assert_eq!(d["lease_epoch"], "0");
            assert_eq!(d["attempts"], 0);
            assert_eq!(d["revision"], "1");
        }
    }
    for state in ["PENDING", "LEASED", "ACKED", "EXPIRED"] {
        let res = app.get(&format!("{base}?state={state}"), &cred.token).await;
        assert_eq!(res.status, 200);
        assert_conforms("GET", LIST, &res);
        let got: Vec<&Value> = res.data()["items"].as_array().unwrap().iter().collect();
        assert!(got.iter().all(|d| d["state"] == state), "{state}");
        assert_eq!(
            got.len(),
            items.iter().filter(|d| d["state"] == state).count()
        );
    }
    let leased_id = &leased["body"]["delivery"]["id"];
    assert!(
        items
            .iter()
            .any(|d| &d["id"] == leased_id && d["state"] == "LEASED")
    );
    // Pages of one, newest first, no gap or repeat.
    let mut seen = Vec::new();
    let mut path = format!("{base}?limit=1");
    loop {
        let res = app.get(&path, &cred.token).await;
        assert_conforms("GET", LIST, &res);
        let page = res.data()["items"].as_array().unwrap();
        assert_eq!(page.len(), 1);
        seen.push(page[0].clone());
        match res.data()["next_cursor"].as_str() {
            Some(c) => path = format!("{base}?limit=1&cursor={c}"),
            None => break,
        }
    }
    assert_eq!(seen.len(), 4);
    let ids: HashSet<&str> = seen.iter().map(|d| d["id"].as_str().unwrap()).collect();
    assert_eq!(ids.len(), 4);
    assert!(
        seen.windows(2)
            .all(|w| (w[0]["created_at"].as_str(), w[0]["id"].as_str())
                >= (w[1]["created_at"].as_str(), w[1]["id"].as_str())),
        "created_at DESC, id DESC"
    );
    app.assert_invariants().await;
}

/// delivery-model.md §2: the ACK is recorded on the delivery row — when,
/// with which lease epoch, on which session — and read back by an admin.
#[actix_web::test]
async fn an_acked_delivery_shows_when_with_which_epoch_and_on_which_session_it_was_acked() {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let sub = app.subscribe(&cred, json!({ "from_sequence": "0" })).await;
    let sub_id = sub["id"].as_str().unwrap();
    app.publish(&cred, vec![result(&cred.queue_id, "task.succeeded")])
        .await;
    let mut ws = app.bind(&cred.token, sub_id, 1).await;
    let d = ws.delivery().await;
    let reply = ws.ack(&d).await;
    assert_eq!(reply["type"], "ack", "{reply:#}");
    let id = d["body"]["delivery"]["id"].as_str().unwrap();
    let res = get_detail(&app, &cred.token, sub_id, id).await;
    assert_eq!(res.status, 200);
    let delivery = &res.data()["delivery"];
    assert_eq!(delivery["state"], "ACKED");
    assert_eq!(
        delivery["acknowledged_at"],
        reply["body"]["acknowledged_at"]
    );
    assert_eq!(delivery["ack_epoch"], "1");
    assert_eq!(delivery["ack_session_id"], d["session_id"]);
    assert_eq!(
        app.scalar("SELECT COUNT(*) FROM audit_records").await,
        0,
        "no audit record per ACK"
    );
}

#[actix_web::test]
async fn a_delivery_list_cursor_is_bound_to_the_state_filter_and_the_subscription() {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let (sub_id, _ws, _) = deliveries_in_three_states(&app, &cred).await;
    let base = format!("/v1/subscriptions/{sub_id}/deliveries");
    let res = app
        .get(&format!("{base}?state=PENDING&limit=1"), &cred.token)
        .await;
    let cursor = res.data()["next_cursor"].as_str().unwrap().to_owned();
    let ok = app
        .get(
            &format!("{base}?state=PENDING&limit=1&cursor={cursor}"),
            &cred.token,
        )
        .await;
    assert_eq!(ok.status, 200);
    assert_eq!(ok.data()["items"].as_array().unwrap().len(), 1);
    for other in [
        format!("{base}?cursor={cursor}"),
        format!("{base}?state=ACKED&cursor={cursor}"),
    ] {
        let res = app.get(&other, &cred.token).await;
        res.assert_error(400, "INVALID_ARGUMENT");
        assert_conforms("GET", LIST, &res);
    }
    let sub2 = app.subscribe(&cred, json!({})).await;
    let res = app
        .get(
            &format!(
                "/v1/subscriptions/{}/deliveries?state=PENDING&cursor={cursor}",
                sub2["id"].as_str().unwrap()
            ),
            &cred.token,
        )
        .await;
    res.assert_error(400, "INVALID_ARGUMENT");
}

#[actix_web::test]
async fn the_delivery_detail_has_the_delivery_and_its_event_and_never_a_lease_secret() {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let (sub_id, _ws, leased) = deliveries_in_three_states(&app, &cred).await;
    let delivery = &leased["body"]["delivery"];
    let secret = leased["body"]["lease_secret"].as_str().unwrap();
    let id = delivery["id"].as_str().unwrap();
    let res = get_detail(&app, &cred.token, &sub_id, id).await;
    assert_eq!(res.status, 200);
    assert_eq!(&res.data()["delivery"], delivery);
    assert_eq!(res.data()["event"], leased["body"]["event"]);
    // Neither the secret nor its digest appear in any HTTP answer.
    let digest = orbit_events::domain::sha256_hex(secret.as_bytes());
    let list = app
        .get(
            &format!("/v1/subscriptions/{sub_id}/deliveries"),
            &cred.token,
        )
        .await;
    for text in [res.body.to_string(), list.body.to_string()] {
        assert!(!text.contains(secret));
        assert!(!text.contains(&digest));
        assert!(!text.contains("lease_secret") && !text.contains("lease_digest"));
    }
    app.assert_invariants().await;
}

#[actix_web::test]
async fn a_delivery_of_another_subscription_is_404_even_though_it_exists() {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let (_, _ws, leased) = deliveries_in_three_states(&app, &cred).await;
    let id = leased["body"]["delivery"]["id"].as_str().unwrap();
    let mine_too = app.subscribe(&cred, json!({})).await;
    let other = mine_too["id"].as_str().unwrap();
    let res = get_detail(&app, &cred.token, other, id).await;
    res.assert_error(404, "NOT_FOUND");
    let res = app
        .post(
            &retry_path(other, id),
            &cred.token,
            "r",
            &json!({ "expected_revision": "1", "reason": "r", "additional_attempts": 1 }),
        )
        .await;
    res.assert_error(404, "NOT_FOUND");
    assert_conforms("POST", RETRY, &res);
    for bad in ["nope", "0123456789ABCDEF0123456789ABCDEF"] {
        app.get(
            &format!("/v1/subscriptions/{other}/deliveries/{bad}"),
            &cred.token,
        )
        .await
        .assert_error(404, "NOT_FOUND");
        app.get(&format!("/v1/subscriptions/{bad}/deliveries"), &cred.token)
            .await
            .assert_error(404, "NOT_FOUND");
    }
}

#[actix_web::test]
async fn a_retry_rearms_an_expired_delivery_with_more_attempts_and_it_is_delivered_again() {
    let app = spawn_fast_app().await;
    let cred = app.bootstrap().await;
    let (sub_id, expired, mut ws) = expired_delivery(&app, &cred).await;
    let id = expired["id"].as_str().unwrap();
    assert_eq!(expired["attempts"], 1);
    assert_eq!(expired["attempt_budget"], 1);
    assert!(expired.get("lease_until").is_none());
    let pending_before = app
        .get(&format!("/v1/subscriptions/{sub_id}"), &cred.token)
        .await
        .data()["pending_count"]
        .clone();
    assert_eq!(pending_before, 1, "EXPIRED keeps its backlog slot");
    let body = json!({
        "expected_revision": expired["revision"],
        "reason": "receiver persistence failure repaired",
        "additional_attempts": 2
    });
    let res = app
        .post(&retry_path(&sub_id, id), &cred.token, "retry-1", &body)
        .await;
    assert_eq!(res.status, 200, "{:#}", res.body);
    assert_conforms("POST", RETRY, &res);
    let d = &res.data()["delivery"];
    assert_eq!(res.data()["deduplicated"], false);
    assert_eq!(d["state"], "PENDING");
    assert_eq!(d["attempts"], 1, "attempts are kept");
    assert_eq!(
        d["lease_epoch"], expired["lease_epoch"],
        "the epoch is kept"
    );
    assert_eq!(d["attempt_budget"], 3);
    let rev: u64 = expired["revision"].as_str().unwrap().parse().unwrap();
    assert_eq!(d["revision"], (rev + 1).to_string());
    assert_eq!(d["event_id"], expired["event_id"]);
    let audit = app
        .scalar(&format!(
            "SELECT COUNT(*) FROM audit_records WHERE action = 'delivery.retry' AND target_id = '{id}' \
             AND reason = 'receiver persistence failure repaired'"
        ))
        .await;
    assert_eq!(audit, 1);
    // The scanner is woken: the same delivery comes back with epoch + 1.
    let again = ws.delivery().await;
    assert_eq!(again["body"]["delivery"]["id"], json!(id));
    assert_eq!(again["body"]["delivery"]["attempts"], 2);
    // A replay re-arms nothing and returns the original snapshot.
    let replay = app
        .post(&retry_path(&sub_id, id), &cred.token, "retry-1", &body)
        .await;
    assert_eq!(replay.status, 200);
    assert_eq!(replay.data()["deduplicated"], true);
    assert_eq!(&replay.data()["delivery"], d);
    let reply = ws.ack(&again).await;
    assert_eq!(reply["type"], "ack", "{reply:#}");
    app.assert_invariants().await;
}

#[actix_web::test]
async fn a_retry_is_409_unless_the_delivery_is_expired_and_at_the_expected_revision() {
    let app = spawn_fast_app().await;
    let cred = app.bootstrap().await;
    let (sub_id, expired, _ws) = expired_delivery(&app, &cred).await;
    let id = expired["id"].as_str().unwrap();
    let stale = json!({ "expected_revision": "1", "reason": "r", "additional_attempts": 1 });
    let res = app
        .post(&retry_path(&sub_id, id), &cred.token, "stale", &stale)
        .await;
    res.assert_error(409, "STATE_CONFLICT");
    assert!(
        res.body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("expected_revision")
    );
    // The cumulative budget stops at 1,000,000.
    execute(
        &app,
        &format!("UPDATE deliveries SET attempt_budget = 999999 WHERE id = '{id}'"),
    )
    .await;
    let over = json!({ "expected_revision": expired["revision"], "reason": "r", "additional_attempts": 2 });
    let res = app
        .post(&retry_path(&sub_id, id), &cred.token, "over", &over)
        .await;
    res.assert_error(409, "STATE_CONFLICT");
    assert_conforms("POST", RETRY, &res);
    let exact = json!({ "expected_revision": expired["revision"], "reason": "r", "additional_attempts": 1 });
    let res = app
        .post(&retry_path(&sub_id, id), &cred.token, "exact", &exact)
        .await;
    assert_eq!(res.status, 200, "{:#}", res.body);
    assert_eq!(res.data()["delivery"]["attempt_budget"], 1_000_000);
    app.assert_invariants().await;

    // Not EXPIRED (ACKED, LEASED or PENDING) → 409.
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let (sub_id, _ws, leased) = deliveries_in_three_states(&app, &cred).await;
    let list = app
        .get(
            &format!("/v1/subscriptions/{sub_id}/deliveries"),
            &cred.token,
        )
        .await;
    let before = fingerprint(&app).await;
    for d in list.data()["items"].as_array().unwrap() {
        let body =
            json!({ "expected_revision": d["revision"], "reason": "r", "additional_attempts": 1 });
        let res = app
            .post(
                &retry_path(&sub_id, d["id"].as_str().unwrap()),
                &cred.token,
                "not-expired",
                &body,
            )
            .await;
        res.assert_error(409, "STATE_CONFLICT");
        assert!(
            res.body["error"]["message"]
                .as_str()
                .unwrap()
                .contains("EXPIRED")
        );
    }
    assert_eq!(fingerprint(&app).await, before);
    assert_eq!(leased["body"]["delivery"]["state"], "LEASED");
}

#[actix_web::test]
async fn a_retry_needs_additional_attempts_1_to_100_and_a_reason() {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let sub = app.subscribe(&cred, json!({})).await;
    let path = retry_path(
        sub["id"].as_str().unwrap(),
        "0123456789abcdef0123456789abcdef",
    );
    for (body, field) in [
        (
            json!({ "expected_revision": "1", "reason": "r", "additional_attempts": 0 }),
            "additional_attempts",
        ),
        (
            json!({ "expected_revision": "1", "reason": "r", "additional_attempts": 101 }),
            "additional_attempts",
        ),
        (
            json!({ "expected_revision": "1", "reason": "r", "additional_attempts": "1" }),
            "additional_attempts",
        ),
        (
            json!({ "expected_revision": "1", "reason": "r" }),
            "additional_attempts",
        ),
        (
            json!({ "expected_revision": "1", "reason": "", "additional_attempts": 1 }),
            "reason",
        ),
        (
            json!({ "expected_revision": 1, "reason": "r", "additional_attempts": 1 }),
            "expected_revision",
        ),
        (
            json!({ "expected_revision": "1", "reason": "r", "additional_attempts": 1, "force": true }),
            "force",
        ),
    ] {
        let res = app.post(&path, &cred.token, "bad", &body).await;
        res.assert_error(400, "INVALID_ARGUMENT");
        assert_conforms("POST", RETRY, &res);
        assert!(
            res.body["error"]["message"]
                .as_str()
                .unwrap()
                .contains(field),
            "{:#}",
            res.body
        );
    }
    // A well-formed retry of an unknown delivery is 404.
    app.post(
        &path,
        &cred.token,
        "bad",
        &json!({ "expected_revision": "1", "reason": "r", "additional_attempts": 100 }),
    )
    .await
    .assert_error(404, "NOT_FOUND");
}
