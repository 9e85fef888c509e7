//! Subscriptions: create, get, list, configure (http-api.md §3,
//! delivery-model.md §4).

use std::{collections::HashSet, time::Duration};

use serde_json::{Value, json};

use crate::{helpers::*, http_support::*};

async fn create(app: &TestApp, cred: &Cred, body: Value) -> Resp {
    let res = app
        .post(
            "/v1/subscriptions",
            &cred.token,
            &orbit_events::domain::random_hex_id(),
            &body,
        )
        .await;
    assert_conforms("POST", "/v1/subscriptions", &res);
    res
}

#[actix_web::test]
async fn a_new_subscription_is_201_with_defaults_canonical_types_and_revision_1() {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    app.publish(&cred, vec![result(&cred.queue_id, "task.failed")])
        .await;
    let res = create(
        &app,
        &cred,
        json!({ "name": "object-results", "queue_id": cred.queue_id,
                "types": ["task.succeeded", "task.cancelled"] }),
    )
    .await;
    assert_eq!(res.status, 201);
    assert_eq!(res.data()["deduplicated"], false);
    let sub = &res.data()["subscription"];
    assert_eq!(sub["name"], "object-results");
    assert_eq!(sub["queue_id"], json!(cred.queue_id));
    assert_eq!(sub["credential_id"], json!(cred.credential_id));
    assert_eq!(sub["revision"], "1");
    assert_eq!(sub["enabled"], true);
    assert_eq!(sub["types"], json!(["task.cancelled", "task.succeeded"]));
    assert_eq!(
        sub["cursor_sequence"], "1",
        "omitted from_sequence = the head"
    );
    assert_eq!(sub["pending_count"], 0);
    assert_eq!(sub["max_pending"], 100);
    assert_eq!(sub["max_attempts"], 20);
    assert_eq!(sub["created_at"], sub["updated_at"]);
    let all = create(
        &app,
        &cred,
        json!({ "name": "all", "queue_id": cred.queue_id, "types": [] }),
    )
    .await;
    assert_eq!(
        all.data()["subscription"]["types"],
        json!([
            "task.cancelled",
            "task.failed",
            "task.needs_review",
            "task.succeeded"
        ])
    );
    // GET answers the same object.
    let id = sub["id"].as_str().unwrap();
    let got = app
        .get(&format!("/v1/subscriptions/{id}"), &cred.token)
        .await;
    assert_eq!(got.status, 200);
    assert_conforms("GET", "/v1/subscriptions/{id}", &got);
    assert_eq!(got.data(), sub);
    app.assert_invariants().await;
}

#[actix_web::test]
async fn names_must_match_the_pattern_and_be_unique_in_the_namespace() {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let q = &cred.queue_id;
    for bad in [
        "",
        "-a",
        ".a",
        "_a",
        "a b",
        "a/b",
        "é",
        "a:b",
        &"a".repeat(129),
    ] {
        let res = create(&app, &cred, json!({ "name": bad, "queue_id": q })).await;
        res.assert_error(400, "INVALID_ARGUMENT");
        assert!(
            res.body["error"]["message"]
                .as_str()
                .unwrap()
                .contains("name")
        );
    }
    for good in ["a", "A.b_c-9", &"a".repeat(128)] {
        let res = create(&app, &cred, json!({ "name": good, "queue_id": q })).await;
        assert_eq!(res.status, 201, "{good}: {:#}", res.body);
    }
    let res = create(&app, &cred, json!({ "name": "a", "queue_id": q })).await;
    res.assert_error(409, "STATE_CONFLICT");
    // Also for another credential of the namespace, and names are case-sensitive.
    let other = sibling(&app, &cred, "app2", true, true).await;
    create(&app, &other, json!({ "name": "a", "queue_id": q }))
        .await
        .assert_error(409, "STATE_CONFLICT");
    assert_eq!(
        create(&app, &other, json!({ "name": "A", "queue_id": q }))
            .await
            .status,
        201
    );
    app.assert_invariants().await;
}

#[actix_web::test]
async fn types_must_be_a_non_repeating_subset_of_the_four_result_types() {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let q = &cred.queue_id;
    for bad in [
        json!(["task.requeued"]),
        json!(["task.failed", "task.failed"]),
        json!(["TASK.FAILED"]),
        json!([1]),
        json!([null]),
    ] {
        create(
            &app,
            &cred,
            json!({ "name": "t", "queue_id": q, "types": bad }),
        )
        .await
        .assert_error(400, "INVALID_ARGUMENT");
    }
}

#[actix_web::test]
async fn max_pending_and_max_attempts_default_on_0_and_have_ranges() {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let q = &cred.queue_id;
    for (field, value, expected) in [
        ("max_pending", 0, 100),
        ("max_pending", 1, 1),
        ("max_pending", 1000, 1000),
        ("max_attempts", 0, 20),
        ("max_attempts", 1, 1),
        ("max_attempts", 100, 100),
    ] {
        let name = format!("{field}-{value}");
        let res = create(
            &app,
            &cred,
            json!({ "name": name, "queue_id": q, field: value }),
        )
        .await;
        assert_eq!(res.status, 201, "{field}={value}: {:#}", res.body);
        assert_eq!(res.data()["subscription"][field], expected);
    }
    for (field, value) in [
        ("max_pending", 1001),
        ("max_attempts", 101),
        ("max_pending", 4294967296_u64),
    ] {
        let res = create(
            &app,
            &cred,
            json!({ "name": "r", "queue_id": q, field: value }),
        )
        .await;
        res.assert_error(400, "INVALID_ARGUMENT");
        assert!(
            res.body["error"]["message"]
                .as_str()
                .unwrap()
                .contains(field)
        );
    }
}

#[actix_web::test]
async fn from_sequence_starts_at_the_head_at_0_or_at_n_and_above_the_head_is_400() {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let q = &cred.queue_id;
    let three = (0..3).map(|_| result(q, "task.failed")).collect();
    app.publish(&cred, three).await;
    for (from, cursor) in [
        (Value::Null, "3"),
        (json!("0"), "0"),
        (json!("2"), "2"),
        (json!("3"), "3"),
    ] {
        let name = format!("from-{}", from.as_str().unwrap_or("null"));
        let res = create(
            &app,
            &cred,
            json!({ "name": name, "queue_id": q, "from_sequence": from }),
        )
        .await;
        assert_eq!(res.status, 201, "{:#}", res.body);
        assert_eq!(res.data()["subscription"]["cursor_sequence"], cursor);
    }
    let res = create(
        &app,
        &cred,
        json!({ "name": "x", "queue_id": q, "from_sequence": "4" }),
    )
    .await;
    res.assert_error(400, "INVALID_ARGUMENT");
    assert!(
        res.body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("from_sequence")
    );
    app.assert_invariants().await;
}

#[actix_web::test]
async fn from_sequence_below_the_retention_floor_is_410_with_the_earliest_sequence() {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let q = &cred.queue_id;
    app.publish(&cred, (0..5).map(|_| result(q, "task.failed")).collect())
        .await;
    // Retention purged sequences 1..=3 (staged: the purge itself is the
    // retention sweeper's job).
    execute(
        &app,
        &format!("DELETE FROM result_events WHERE queue_id = '{q}' AND sequence <= 3"),
    )
    .await;
    execute(
        &app,
        &format!("UPDATE queues SET retention_floor = 3 WHERE id = '{q}'"),
    )
    .await;
    for from in ["0", "2"] {
        let res = create(
            &app,
            &cred,
            json!({ "name": "old", "queue_id": q, "from_sequence": from }),
        )
        .await;
        res.assert_error(410, "EVENT_HISTORY_EXPIRED");
        assert_eq!(
            res.body["error"]["details"],
            json!({ "earliest_sequence": "4" })
        );
    }
    // The smallest accepted from_sequence is the floor itself.
    let res = create(
        &app,
        &cred,
        json!({ "name": "floor", "queue_id": q, "from_sequence": "3" }),
    )
    .await;
    assert_eq!(res.status, 201, "{:#}", res.body);
    assert_eq!(res.data()["subscription"]["cursor_sequence"], "3");
    app.assert_invariants().await;
}

#[actix_web::test]
async fn a_namespace_holds_at_most_64_subscriptions() {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let other = sibling(&app, &cred, "app2", true, true).await;
    let q = &cred.queue_id;
    for i in 0..64 {
        let owner = if i % 2 == 0 { &cred } else { &other };
        let res = app
            .post(
                "/v1/subscriptions",
                &owner.token,
                &format!("k{i}"),
                &json!({ "name": format!("s{i}"), "queue_id": q }),
            )
            .await;
        assert_eq!(res.status, 201, "{i}: {:#}", res.body);
    }
    let before = fingerprint(&app).await;
    let res = create(&app, &cred, json!({ "name": "s64", "queue_id": q })).await;
    res.assert_error(409, "SUBSCRIPTION_LIMIT");
    assert_eq!(fingerprint(&app).await, before);
    // Another namespace is not affected.
    let elsewhere = app.bootstrap_with("ns2", "app", "q", true, true).await;
    let res = create(
        &app,
        &elsewhere,
        json!({ "name": "s64", "queue_id": elsewhere.queue_id }),
    )
    .await;
    assert_eq!(res.status, 201);
}

/// Every page of a list, following `next_cursor`.
async fn all_pages(app: &TestApp, token: &str, first: &str, template: &str) -> Vec<Vec<String>> {
    let mut pages = Vec::new();
    let mut path = first.to_owned();
    loop {
        let res = app.get(&path, token).await;
        assert_eq!(res.status, 200, "{path}: {:#}", res.body);
        assert_conforms("GET", template, &res);
        let ids: Vec<String> = res.data()["items"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["id"].as_str().unwrap().to_owned())
            .collect();
        pages.push(ids);
        match res.data()["next_cursor"].as_str() {
            Some(c) => path = format!("{first}&cursor={c}"),
            None => return pages,
        }
    }
}

#[actix_web::test]
async fn the_list_is_ordered_created_at_desc_id_desc_over_pages_without_gap_or_repeat() {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let q = &cred.queue_id;
    let mut ids = Vec::new();
    for _ in 0..7 {
        ids.push(
            app.subscribe(&cred, json!({})).await["id"]
                .as_str()
                .unwrap()
                .to_owned(),
        );
    }
    // Three share one created_at: id DESC breaks the tie.
    let tied = &ids[2..5];
    execute(
        &app,
        &format!(
            "UPDATE subscriptions SET created_at = (SELECT created_at FROM subscriptions WHERE id = '{}') WHERE id IN ('{}', '{}', '{}')",
            ids[2], tied[0], tied[1], tied[2]
        ),
    )
    .await;
    let list = format!("/v1/subscriptions?queue_id={q}&limit=3");
    let pages = all_pages(&app, &cred.token, &list, "/v1/subscriptions").await;
    assert_eq!(pages.iter().map(Vec::len).collect::<Vec<_>>(), [3, 3, 1]);
    let flat: Vec<String> = pages.concat();
    let mut expected = ids.clone();
    let created = |id: &str| {
        let id = id.to_owned();
        let app = &app;
        async move {
            app.scalar(&format!(
                "SELECT created_at FROM subscriptions WHERE id = '{id}'"
            ))
            .await
        }
    };
    let mut keyed = Vec::new();
    for id in &expected {
        keyed.push((created(id).await, id.clone()));
    }
    keyed.sort_by(|a, b| b.cmp(a));
    expected = keyed.into_iter().map(|(_, id)| id).collect();
    assert_eq!(
        flat, expected,
        "created_at DESC, id DESC, no gap, no repeat"
    );
    assert_eq!(flat.iter().collect::<HashSet<_>>().len(), 7);
    // The default page size is 20 and a full last page has no next_cursor.
    let res = app
        .get(&format!("/v1/subscriptions?queue_id={q}"), &cred.token)
        .await;
    assert_eq!(res.data()["items"].as_array().unwrap().len(), 7);
    assert!(res.data().get("next_cursor").is_none());
    let res = app
        .get(
            &format!("/v1/subscriptions?queue_id={q}&limit=7"),
            &cred.token,
        )
        .await;
    assert!(res.data().get("next_cursor").is_none(), "{:#}", res.body);
}

#[actix_web::test]
async fn the_list_holds_only_this_credentials_subscriptions_on_that_queue() {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let other = sibling(&app, &cred, "app2", true, true).await;
    let mine = app.subscribe(&cred, json!({})).await;
    app.subscribe(&other, json!({})).await;
    let res = app
        .get(
            &format!("/v1/subscriptions?queue_id={}", cred.queue_id),
            &cred.token,
        )
        .await;
    assert_eq!(res.data()["items"], json!([mine]));
}

#[actix_web::test]
async fn a_cursor_used_with_another_queue_credential_or_altered_is_400() {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let other = sibling(&app, &cred, "app2", true, true).await;
    for _ in 0..3 {
        app.subscribe(&cred, json!({})).await;
        app.subscribe(&other, json!({})).await;
    }
    let q = &cred.queue_id;
    let res = app
        .get(
            &format!("/v1/subscriptions?queue_id={q}&limit=1"),
            &cred.token,
        )
        .await;
    let cursor = res.data()["next_cursor"].as_str().unwrap().to_owned();
    // It works where it was issued (also with another page size).
    let ok = app
        .get(
            &format!("/v1/subscriptions?queue_id={q}&limit=2&cursor={cursor}"),
            &cred.token,
        )
        .await;
    assert_eq!(ok.status, 200);
    // Another credential of the same namespace and queue.
    let res = app
        .get(
            &format!("/v1/subscriptions?queue_id={q}&cursor={cursor}"),
            &other.token,
        )
        .await;
    res.assert_error(400, "INVALID_ARGUMENT");
    assert_conforms("GET", "/v1/subscriptions", &res);
    // Another queue in the same credential's scope (bootstrap scopes one
    // queue per credential; widen this one's scope to two).
    let second = app
        .bootstrap_with("demo", "app", "second-queue", true, true)
        .await;
    execute(
        &app,
        &format!(
            "UPDATE credentials SET queue_scope = '[\"{q}\",\"{}\"]' WHERE id = '{}'",
            second.queue_id, cred.credential_id
        ),
    )
    .await;
    let res = app
        .get(
            &format!("/v1/subscriptions?queue_id={}", second.queue_id),
            &cred.token,
        )
        .await;
    assert_eq!(res.status, 200, "{:#}", res.body);
    let res = app
        .get(
            &format!(
                "/v1/subscriptions?queue_id={}&cursor={cursor}",
                second.queue_id
            ),
            &cred.token,
        )
        .await;
    res.assert_error(400, "INVALID_ARGUMENT");
    // Another endpoint: a subscription-list cursor on a delivery list.
    let sub = app.subscribe(&cred, json!({})).await;
    let res = app
        .get(
            &format!(
                "/v1/subscriptions/{}/deliveries?cursor={cursor}",
                sub["id"].as_str().unwrap()
            ),
            &cred.token,
        )
        .await;
    res.assert_error(400, "INVALID_ARGUMENT");
    // Altered: every position flipped in turn.
    for i in 0..cursor.len() {
        let mut bytes = cursor.clone().into_bytes();
        bytes[i] = if bytes[i] == b'x' { b'y' } else { b'x' };
        let altered = String::from_utf8(bytes).unwrap();
        let res = app
            .get(
                &format!("/v1/subscriptions?queue_id={q}&cursor={altered}"),
                &cred.token,
            )
            .await;
        res.assert_error(400, "INVALID_ARGUMENT");
    }
}

#[actix_web::test]
async fn configure_needs_the_current_revision_bumps_it_every_time_and_writes_an_audit_record() {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let sub = app.subscribe(&cred, json!({})).await;
    let id = sub["id"].as_str().unwrap();
    let path = format!("/v1/subscriptions/{id}:configure");
    let mut revision = 1;
    for (enabled, reason) in [
        (false, "receiver maintenance"),
        (false, "still down"),
        (true, "back"),
    ] {
        let body = json!({ "expected_revision": revision.to_string(), "enabled": enabled, "reason": reason });
        let res = app
            .post(&path, &cred.token, &format!("cfg-{revision}"), &body)
            .await;
        assert_eq!(res.status, 200, "{:#}", res.body);
        assert_conforms("POST", "/v1/subscriptions/{id}:configure", &res);
        revision += 1;
        let s = &res.data()["subscription"];
        assert_eq!(s["revision"], revision.to_string());
        assert_eq!(s["enabled"], enabled);
        assert_eq!(res.data()["deduplicated"], false);
        let got = app
            .get(&format!("/v1/subscriptions/{id}"), &cred.token)
            .await;
        assert_eq!(got.data(), s);
    }
    let audit = app
        .scalar(&format!(
            "SELECT COUNT(*) FROM audit_records WHERE target_id = '{id}' AND credential_id = '{}' \
             AND reason = 'still down' AND before_revision = 2 AND after_revision = 3 \
             AND action = 'subscription.pause'",
            cred.credential_id
        ))
        .await;
    assert_eq!(audit, 1);
    assert_eq!(app.scalar("SELECT COUNT(*) FROM audit_records").await, 3);
    // A stale revision is a state conflict and changes nothing.
    let before = fingerprint(&app).await;
    let res = app
        .post(
            &path,
            &cred.token,
            "stale",
            &json!({ "expected_revision": "1", "enabled": false, "reason": "r" }),
        )
        .await;
    res.assert_error(409, "STATE_CONFLICT");
    assert_eq!(fingerprint(&app).await, before);
    app.assert_invariants().await;
}

#[actix_web::test]
async fn configure_needs_all_three_fields_and_a_reason_of_1_to_1024_characters() {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let sub = app.subscribe(&cred, json!({})).await;
    let path = format!(
        "/v1/subscriptions/{}:configure",
        sub["id"].as_str().unwrap()
    );
    for (body, field) in [
        (
            json!({ "enabled": false, "reason": "r" }),
            "expected_revision",
        ),
        (
            json!({ "expected_revision": "1", "reason": "r" }),
            "enabled",
        ),
        (
            json!({ "expected_revision": "1", "enabled": false }),
            "reason",
        ),
        (
            json!({ "expected_revision": "1", "enabled": "false", "reason": "r" }),
            "enabled",
        ),
        (
            json!({ "expected_revision": "1", "enabled": false, "reason": "" }),
            "reason",
        ),
        (
            json!({ "expected_revision": "1", "enabled": false, "reason": "x".repeat(1025) }),
            "reason",
        ),
        (
            json!({ "expected_revision": "1", "enabled": false, "reason": "a\u{0}b" }),
            "reason",
        ),
        (
            json!({ "expected_revision": "1", "enabled": false, "reason": null }),
            "reason",
        ),
    ] {
        let res = app.post(&path, &cred.token, "cfg", &body).await;
        res.assert_error(400, "INVALID_ARGUMENT");
        assert!(
            res.body["error"]["message"]
                .as_str()
                .unwrap()
                .contains(field),
            "{field}: {:#}",
            res.body
        );
    }
    // 1024 Unicode scalar values, whatever their UTF-8 length.
    let res = app
        .post(
            &path,
            &cred.token,
            "cfg",
            &json!({ "expected_revision": "1", "enabled": false, "reason": "é".repeat(1024) }),
        )
        .await;
    assert_eq!(res.status, 200, "{:#}", res.body);
}

#[actix_web::test]
async fn a_paused_subscription_gets_no_deliveries_and_a_resume_wakes_the_scanner() {
    // A one-minute fallback poll: only the wake can explain a prompt delivery.
    let app = spawn_app_with(|s| s.timing.scan_interval_ms = 60_000).await;
    let cred = app.bootstrap().await;
    let sub = app.subscribe(&cred, json!({ "from_sequence": "0" })).await;
    let id = sub["id"].as_str().unwrap();
    let path = format!("/v1/subscriptions/{id}:configure");
    let res = app
        .post(
            &path,
            &cred.token,
            "pause",
            &json!({ "expected_revision": "1", "enabled": false, "reason": "pause" }),
        )
        .await;
    assert_eq!(res.status, 200);
    let mut ws = app.bind(&cred.token, id, 1).await;
    app.publish(&cred, vec![result(&cred.queue_id, "task.succeeded")])
        .await;
    assert!(
        ws.delivery_within(Duration::from_millis(500))
            .await
            .is_none(),
        "a paused subscription delivered"
    );
    let res = app
        .post(
            &path,
            &cred.token,
            "resume",
            &json!({ "expected_revision": "2", "enabled": true, "reason": "resume" }),
        )
        .await;
    assert_eq!(res.status, 200);
    let delivered = ws
        .delivery_within(Duration::from_secs(10))
        .await
        .expect("the resume wakes the scanner");
    assert_eq!(delivered["body"]["event"]["sequence"], "1");
    let reply = ws.ack(&delivered).await;
    assert_eq!(reply["type"], "ack", "{reply:#}");
    app.assert_invariants().await;
}

#[actix_web::test]
async fn a_cursor_issued_by_one_node_is_accepted_by_another_on_the_same_database() {
    let first = spawn_app().await;
    let url = first.settings.database.url.clone();
    let second = spawn_app_with(|s| s.database.url = url).await;
    let cred = first.bootstrap().await;
    for _ in 0..4 {
        first.subscribe(&cred, json!({})).await;
    }
    let q = &cred.queue_id;
    // Both nodes issue their first cursor at once: one key results.
    let page = format!("/v1/subscriptions?queue_id={q}&limit=1");
    let (a, b) = futures_util::join!(
        first.get(&page, &cred.token),
        second.get(&page, &cred.token)
    );
    assert_eq!((a.status.as_u16(), b.status.as_u16()), (200, 200));
    assert_eq!(first.scalar("SELECT COUNT(*) FROM signing_keys").await, 1);
    assert_eq!(a.data()["next_cursor"], b.data()["next_cursor"]);
    // Page through, alternating nodes.
    let mut seen = vec![a.data()["items"][0]["id"].clone()];
    let mut cursor = a.data()["next_cursor"].as_str().map(str::to_owned);
    let mut turn = 0;
    while let Some(c) = cursor {
        let node = if turn % 2 == 0 { &second } else { &first };
        turn += 1;
        let res = node.get(&format!("{page}&cursor={c}"), &cred.token).await;
        assert_eq!(res.status, 200, "{:#}", res.body);
        seen.push(res.data()["items"][0]["id"].clone());
        cursor = res.data()["next_cursor"].as_str().map(str::to_owned);
    }
    assert_eq!(seen.len(), 4);
    assert_eq!(seen.iter().collect::<HashSet<_>>().len(), 4);
}
