//! Idempotency of every write (http-api.md §2).

use serde_json::{Value, json};

use crate::{helpers::*, http_support::*};

fn configure_path(sub: &Value) -> String {
    format!(
        "/v1/subscriptions/{}:configure",
        sub["id"].as_str().unwrap()
    )
}

#[actix_web::test]
async fn a_post_without_a_valid_idempotency_key_gets_400() {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let sub = app.subscribe(&cred, json!({})).await;
    let auth = format!("Bearer {}", cred.token);
    let q = &cred.queue_id;
    let long = "k".repeat(256);
    let writes = [
        (
            "/v1/subscriptions".to_owned(),
            "/v1/subscriptions",
            json!({ "name": "n", "queue_id": q }),
        ),
        (
            configure_path(&sub),
            "/v1/subscriptions/{id}:configure",
            json!({ "expected_revision": "1", "enabled": false, "reason": "r" }),
        ),
        (
            format!("/v1/queues/{q}/results"),
            "/v1/queues/{queue_id}/results",
            json!({ "results": [result(q, "task.failed")] }),
        ),
    ];
    let before = fingerprint(&app).await;
    for (path, template, body) in &writes {
        for key in [None, Some(""), Some("a b"), Some("é"), Some(long.as_str())] {
            let mut headers = vec![
                ("Authorization", auth.as_str()),
                ("Content-Type", "application/json"),
            ];
            if let Some(k) = key {
                headers.push(("Idempotency-Key", k));
            }
            let res = raw(
                &app,
                "POST",
                path,
                &headers,
                Some(body.to_string().into_bytes()),
            )
            .await;
            res.assert_error(400, "INVALID_ARGUMENT");
            assert!(
                res.body["error"]["message"]
                    .as_str()
                    .unwrap()
                    .contains("Idempotency-Key"),
                "{:#}",
                res.body
            );
            assert_conforms("POST", template, &res);
        }
    }
    // The longest key is fine.
    let res = app
        .post(&writes[0].0, &cred.token, &"k".repeat(255), &writes[0].2)
        .await;
    assert_eq!(res.status, 201, "{:#}", res.body);
    let mut after = fingerprint(&app).await;
    // Only the last request wrote: one subscription and its record.
    for (name, n) in after.iter_mut() {
        if name == "subscriptions" || name == "idempotency_records" {
            *n -= 1;
        }
    }
    let strip = |v: Vec<(String, i64)>| {
        v.into_iter()
            .filter(|(n, _)| !n.starts_with("sum(subscriptions"))
            .collect::<Vec<_>>()
    };
    assert_eq!(strip(after), strip(before));
}

#[actix_web::test]
async fn same_key_and_same_body_replays_the_original_snapshot_with_200_even_after_a_later_configure()
 {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let body = json!({ "name": "replayed", "queue_id": cred.queue_id, "max_pending": 5 });
    let first = app
        .post("/v1/subscriptions", &cred.token, "create-1", &body)
        .await;
    assert_eq!(first.status, 201);
    assert_eq!(first.data()["deduplicated"], false);
    let sub = first.data()["subscription"].clone();
    let res = app
        .post(
            &configure_path(&sub),
            &cred.token,
            "pause-1",
            &json!({ "expected_revision": "1", "enabled": false, "reason": "maintenance" }),
        )
        .await;
    assert_eq!(res.status, 200);
    assert_eq!(res.data()["subscription"]["revision"], "2");

    let replay = app
        .post("/v1/subscriptions", &cred.token, "create-1", &body)
        .await;
    assert_eq!(replay.status, 200);
    assert_conforms("POST", "/v1/subscriptions", &replay);
    assert_eq!(replay.data()["deduplicated"], true);
    assert_eq!(replay.data()["subscription"], sub, "the original snapshot");
    assert_eq!(replay.data()["subscription"]["enabled"], true);
    assert_ne!(replay.body["request_id"], first.body["request_id"]);
    assert_eq!(app.scalar("SELECT COUNT(*) FROM subscriptions").await, 1);
    app.assert_invariants().await;
}

#[actix_web::test]
async fn key_order_spacing_types_order_and_defaults_do_not_make_a_request_different() {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let q = &cred.queue_id;
    let first = post_text(
        &app,
        "/v1/subscriptions",
        &cred.token,
        "norm",
        &format!(r#"{{"name":"norm","queue_id":"{q}"}}"#),
    )
    .await;
    assert_eq!(first.status, 201);
    for same in [
        format!(r#"  {{ "queue_id" : "{q}" ,"name":"norm" }} "#),
        format!(r#"{{"name":"norm","queue_id":"{q}","types":[]}}"#),
        format!(
            r#"{{"name":"norm","queue_id":"{q}","types":["task.succeeded","task.needs_review","task.failed","task.cancelled"]}}"#
        ),
        format!(r#"{{"name":"norm","queue_id":"{q}","max_pending":0,"max_attempts":0}}"#),
        format!(r#"{{"name":"norm","queue_id":"{q}","max_pending":100,"max_attempts":20}}"#),
        format!(r#"{{"name":"norm","queue_id":"{q}","from_sequence":null}}"#),
    ] {
        let res = post_text(&app, "/v1/subscriptions", &cred.token, "norm", &same).await;
        assert_eq!(res.status, 200, "{same}: {:#}", res.body);
        assert_eq!(res.data()["deduplicated"], true);
        assert_eq!(res.data()["subscription"], first.data()["subscription"]);
    }
    app.assert_invariants().await;
}

#[actix_web::test]
async fn same_key_with_another_body_operation_or_target_gets_409_idempotency_conflict() {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let q = &cred.queue_id;
    let a = app.subscribe(&cred, json!({})).await;
    let b = app.subscribe(&cred, json!({})).await;
    let body = json!({ "name": "first", "queue_id": q });
    assert_eq!(
        app.post("/v1/subscriptions", &cred.token, "k", &body)
            .await
            .status,
        201
    );
    let before = fingerprint(&app).await;
    let pause = json!({ "expected_revision": "1", "enabled": false, "reason": "r" });
    for (path, template, other) in [
        (
            "/v1/subscriptions".to_owned(),
            "/v1/subscriptions",
            json!({ "name": "second", "queue_id": q }),
        ),
        (
            "/v1/subscriptions".to_owned(),
            "/v1/subscriptions",
            json!({ "name": "first", "queue_id": q, "max_pending": 7 }),
        ),
        (
            configure_path(&a),
            "/v1/subscriptions/{id}:configure",
            pause.clone(),
        ),
        (
            format!("/v1/queues/{q}/results"),
            "/v1/queues/{queue_id}/results",
            json!({ "results": [result(q, "task.failed")] }),
        ),
    ] {
        let res = app.post(&path, &cred.token, "k", &other).await;
        res.assert_error(409, "IDEMPOTENCY_CONFLICT");
        assert_conforms("POST", template, &res);
    }
    // One key, two targets.
    assert_eq!(
        app.post(&configure_path(&a), &cred.token, "pause", &pause)
            .await
            .status,
        200
    );
    let before_b = fingerprint(&app).await;
    app.post(&configure_path(&b), &cred.token, "pause", &pause)
        .await
        .assert_error(409, "IDEMPOTENCY_CONFLICT");
    assert_eq!(fingerprint(&app).await, before_b);
    assert_ne!(before, before_b);
    app.assert_invariants().await;
}

#[actix_web::test]
async fn keys_are_scoped_to_the_credential() {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let other = sibling(&app, &cred, "app2", true, true).await;
    let q = &cred.queue_id;
    let res = app
        .post(
            "/v1/subscriptions",
            &cred.token,
            "shared",
            &json!({ "name": "a", "queue_id": q }),
        )
        .await;
    assert_eq!(res.status, 201);
    let res = app
        .post(
            "/v1/subscriptions",
            &other.token,
            "shared",
            &json!({ "name": "b", "queue_id": q }),
        )
        .await;
    assert_eq!(res.status, 201, "{:#}", res.body);
    assert_eq!(res.data()["deduplicated"], false);
    assert_eq!(app.scalar("SELECT COUNT(*) FROM subscriptions").await, 2);
}

#[actix_web::test]
async fn a_request_that_failed_can_be_sent_again_with_the_same_key() {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let sub = app.subscribe(&cred, json!({})).await;
    let path = configure_path(&sub);
    // A validation failure and a state conflict record nothing ...
    let res = app
        .post(
            &path,
            &cred.token,
            "again",
            &json!({ "expected_revision": "1", "enabled": false, "reason": "" }),
        )
        .await;
    res.assert_error(400, "INVALID_ARGUMENT");
    let res = app
        .post(
            &path,
            &cred.token,
            "again",
            &json!({ "expected_revision": "5", "enabled": false, "reason": "r" }),
        )
        .await;
    res.assert_error(409, "STATE_CONFLICT");
    assert_eq!(
        app.scalar("SELECT COUNT(*) FROM idempotency_records").await,
        1
    );
    // ... so the corrected request applies under the same key.
    let res = app
        .post(
            &path,
            &cred.token,
            "again",
            &json!({ "expected_revision": "1", "enabled": false, "reason": "r" }),
        )
        .await;
    assert_eq!(res.status, 200, "{:#}", res.body);
    assert_eq!(res.data()["deduplicated"], false);
    assert_eq!(res.data()["subscription"]["revision"], "2");
    app.assert_invariants().await;
}

#[actix_web::test]
async fn twenty_concurrent_creates_with_one_key_make_exactly_one_subscription() {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let body = json!({ "name": "raced", "queue_id": cred.queue_id });
    let requests = (0..20).map(|_| app.post("/v1/subscriptions", &cred.token, "race", &body));
    let responses = futures_util::future::join_all(requests).await;
    let created: Vec<&Resp> = responses.iter().filter(|r| r.status == 201).collect();
    let replayed: Vec<&Resp> = responses.iter().filter(|r| r.status == 200).collect();
    assert_eq!(created.len(), 1, "exactly one request applied the effect");
    assert_eq!(replayed.len(), 19, "the others replay it");
    let id = &created[0].data()["subscription"]["id"];
    for r in &replayed {
        assert_eq!(r.data()["deduplicated"], true);
        assert_eq!(&r.data()["subscription"]["id"], id);
        assert_conforms("POST", "/v1/subscriptions", r);
    }
    assert_eq!(app.scalar("SELECT COUNT(*) FROM subscriptions").await, 1);
    assert_eq!(
        app.scalar("SELECT COUNT(*) FROM idempotency_records").await,
        1
    );
    app.assert_invariants().await;
}

#[actix_web::test]
async fn twenty_concurrent_configures_with_one_key_bump_the_revision_once() {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let sub = app.subscribe(&cred, json!({})).await;
    let path = configure_path(&sub);
    let body = json!({ "expected_revision": "1", "enabled": false, "reason": "raced" });
    let requests = (0..20).map(|_| app.post(&path, &cred.token, "race", &body));
    let responses = futures_util::future::join_all(requests).await;
    let statuses: Vec<u16> = responses.iter().map(|r| r.status.as_u16()).collect();
    assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
    let fresh = responses
        .iter()
        .filter(|r| r.data()["deduplicated"] == false)
        .count();
    assert_eq!(fresh, 1);
    assert!(
        responses
            .iter()
            .all(|r| r.data()["subscription"]["revision"] == "2")
    );
    assert_eq!(app.scalar("SELECT COUNT(*) FROM audit_records").await, 1);
    app.assert_invariants().await;
}

#[actix_web::test]
async fn a_replayed_publish_appends_nothing_and_returns_the_original_events() {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let q = &cred.queue_id;
    let body = json!({ "results": [result(q, "task.failed"), result(q, "task.succeeded")] });
    let path = format!("/v1/queues/{q}/results");
    let first = app.post(&path, &cred.token, "pub", &body).await;
    assert_eq!(first.status, 201);
    assert_conforms("POST", "/v1/queues/{queue_id}/results", &first);
    let replay = app.post(&path, &cred.token, "pub", &body).await;
    assert_eq!(replay.status, 200);
    assert_conforms("POST", "/v1/queues/{queue_id}/results", &replay);
    assert_eq!(replay.data()["events"], first.data()["events"]);
    assert_eq!(replay.data()["deduplicated"], true);
    assert_eq!(app.scalar("SELECT COUNT(*) FROM result_events").await, 2);
}

#[actix_web::test]
async fn an_idempotency_record_binds_its_key_for_idempotency_max_age_only() {
    let app = spawn_app_with(|s| s.retention.idempotency_max_age_s = 1).await;
    let cred = app.bootstrap().await;
    let q = &cred.queue_id;
    let body = json!({ "results": [result(q, "task.failed")] });
    let path = format!("/v1/queues/{q}/results");
    assert_eq!(app.post(&path, &cred.token, "ttl", &body).await.status, 201);
    assert_eq!(app.post(&path, &cred.token, "ttl", &body).await.status, 200);
    let res = eventually("the record to expire", || async {
        let res = app.post(&path, &cred.token, "ttl", &body).await;
        (res.status == 201).then_some(res)
    })
    .await;
    assert_eq!(res.data()["deduplicated"], false);
    assert_eq!(res.data()["events"][0]["sequence"], "2");
    assert_eq!(
        app.scalar("SELECT COUNT(*) FROM idempotency_records").await,
        1
    );
}

/// http-api.md §2 on PostgreSQL (decision 0111): a publish whose key
/// another transaction records while the publish's statement waits for it
/// is decided against that record — here a different request, so 409 —
/// and appends nothing, although its statement had already appended
/// before it met the key (it fails as a serialization conflict and runs
/// again).
#[actix_web::test]
async fn a_publish_whose_key_another_transaction_records_meanwhile_is_decided_by_that_record() {
    if skip_unless_postgres() {
        return;
    }
    let app = spawn_app_with(|s| s.timing.scan_interval_ms = 600_000).await;
    let cred = app.bootstrap().await;
    let q = cred.queue_id.clone();
    let far = orbit_events::domain::now().plus(std::time::Duration::from_secs(3600));
    let record = format!(
        "INSERT INTO idempotency_records (id, credential_id, key, operation, target, \
         request_digest, status, response, expires_at, created_at) VALUES \
         ('{}', '{}', 'raced', 'results.publish', '{q}', 'another request', 201, \
         '{{\"events\":[],\"deduplicated\":false}}', {}, 0)",
        orbit_events::domain::ordered_hex_id(),
        cred.credential_id,
        far.micros()
    );
    let (blocker, txn) = hold_from_outside(&app, "SELECT 1", &record).await;
    let path = format!("/v1/queues/{q}/results");
    let body = json!({ "results": [result(&q, "task.succeeded")] });
    let release = async {
        eventually(
            "the publish waits for the other transaction's key",
            || async {
                let waiting = app
                    .scalar(
                        "SELECT COUNT(*) FROM pg_stat_activity \
                     WHERE datname = current_database() AND wait_event_type = 'Lock'",
                    )
                    .await;
                (waiting > 0).then_some(())
            },
        )
        .await;
        txn.commit().await.unwrap();
        blocker.close().await.unwrap();
    };
    let (res, ()) = tokio::join!(app.post(&path, &cred.token, "raced", &body), release);
    res.assert_error(409, "IDEMPOTENCY_CONFLICT");
    let events = app
        .scalar(&format!(
            "SELECT COUNT(*) FROM result_events WHERE queue_id = '{q}'"
        ))
        .await;
    assert_eq!(events, 0, "the conflicting publish appended");
    app.assert_invariants().await;
}
