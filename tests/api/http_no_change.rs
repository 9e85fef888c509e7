//! Bad input never changes state (quality-bar.md "Reliability",
//! http-api.md §2 "Only successful outcomes are recorded").

use serde_json::json;

use crate::{helpers::*, http_support::*};

#[actix_web::test]
async fn requests_ending_in_4xx_change_nothing_in_the_database() {
    let app = spawn_fast_app().await;
    let cred = app.bootstrap().await;
    let q = cred.queue_id.clone();
    let reader = sibling(&app, &cred, "reader", false, true).await;
    let other = sibling(&app, &cred, "other", true, true).await;
    // Rows in every table: an EXPIRED delivery (events, deliveries, a
    // session), a configure (audit), a list cursor (signing key), records.
    let (sub_id, expired, _ws) = expired_delivery(&app, &cred).await;
    let d = expired["id"].as_str().unwrap().to_owned();
    let rev = expired["revision"].as_str().unwrap().to_owned();
    app.subscribe(&cred, json!({})).await;
    let res = app
        .post(
            &format!("/v1/subscriptions/{sub_id}:configure"),
            &cred.token,
            "used-key",
            &json!({ "expected_revision": "1", "enabled": true, "reason": "setup" }),
        )
        .await;
    assert_eq!(res.status, 200);
    let page = app
        .get(
            &format!("/v1/subscriptions?queue_id={q}&limit=1"),
            &cred.token,
        )
        .await;
    assert!(page.data()["next_cursor"].is_string());
    let before = fingerprint(&app).await;
    for (table, n) in &before {
        assert!(*n > 0, "{table} is empty: the check would prove little");
    }

    let configure = format!("/v1/subscriptions/{sub_id}:configure");
    let retry = format!("/v1/subscriptions/{sub_id}/deliveries/{d}:retry");
    let create = "/v1/subscriptions".to_owned();
    let publish = format!("/v1/queues/{q}/results");
    let good_create = json!({ "name": "fresh", "queue_id": q });
    let good_retry = json!({ "expected_revision": rev, "reason": "r", "additional_attempts": 1 });
    let good_configure = json!({ "expected_revision": "2", "enabled": false, "reason": "r" });
    let mut r = result(&q, "task.succeeded");
    r["snapshot"]["queue_id"] = json!("0123456789abcdef0123456789abcdef");
    let bad_publish = json!({ "results": [result(&q, "task.failed"), r] });
    let too_big = format!("{}{}", good_create, " ".repeat(524_288));
    let mut statuses = Vec::new();
    let mut send = |res: Resp| {
        assert!(
            res.status.is_client_error(),
            "{} {:#}",
            res.status,
            res.body
        );
        statuses.push(res.status.as_u16());
    };
    // Auth, permission, query string.
    send(post_text(&app, &create, "oe_unknown", "k", &good_create.to_string()).await);
    send(app.post(&create, &reader.token, "k", &good_create).await);
    send(app.post(&retry, &reader.token, "k", &good_retry).await);
    send(
        app.post(&format!("{create}?x=1"), &cred.token, "k", &good_create)
            .await,
    );
    // Missing or bad key, content type, size, strictness.
    send(
        app.request(
            reqwest::Method::POST,
            &create,
            Some(&cred.token),
            None,
            Some(&good_create),
        )
        .await,
    );
    send(
        raw(
            &app,
            "POST",
            &create,
            &[
                ("Authorization", &format!("Bearer {}", cred.token)),
                ("Idempotency-Key", "k"),
            ],
            Some(good_create.to_string().into_bytes()),
        )
        .await,
    );
    send(post_text(&app, &create, &cred.token, "k", &too_big).await);
    send(
        post_text(
            &app,
            &create,
            &cred.token,
            "k",
            &format!(r#"{{"name":"a","name":"b","queue_id":"{q}"}}"#),
        )
        .await,
    );
    send(
        post_text(
            &app,
            &create,
            &cred.token,
            "k",
            &format!(r#"["fresh","{q}",null,null,null,null]"#),
        )
        .await,
    );
    send(
        app.post(
            &create,
            &cred.token,
            "k",
            &json!({ "name": "fresh", "queue_id": q, "max_pending": 1001 }),
        )
        .await,
    );
    send(
        app.post(
            &create,
            &cred.token,
            "k",
            &json!({ "name": "fresh", "queue_id": q, "from_sequence": "99" }),
        )
        .await,
    );
    send(
        app.post(
            &create,
            &cred.token,
            "k",
            &json!({ "name": "fresh", "queue_id": q, "types": ["task.requeued"] }),
        )
        .await,
    );
    send(app.post(&publish, &cred.token, "k", &bad_publish).await);
    send(
        app.post(&publish, &cred.token, "k", &json!({ "results": [] }))
            .await,
    );
    // Ownership, state, conflicts.
    send(
        app.post(&configure, &other.token, "k", &good_configure)
            .await,
    );
    send(app.post(&retry, &other.token, "k", &good_retry).await);
    send(
        app.post(
            &configure,
            &cred.token,
            "k",
            &json!({ "expected_revision": "1", "enabled": false, "reason": "stale" }),
        )
        .await,
    );
    send(
        app.post(
            &retry,
            &cred.token,
            "k",
            &json!({ "expected_revision": "1", "reason": "stale", "additional_attempts": 1 }),
        )
        .await,
    );
    send(
        app.post(&configure, &cred.token, "used-key", &good_configure)
            .await,
    );
    send(
        app.post(
            &create,
            &cred.token,
            "k",
            &json!({ "name": app_sub_name(&app, &sub_id).await, "queue_id": q }),
        )
        .await,
    );
    // Reads with bad cursors, filters and ids.
    send(
        app.get(
            &format!("/v1/subscriptions?queue_id={q}&cursor=abc.def"),
            &cred.token,
        )
        .await,
    );
    send(
        app.get(
            &format!("/v1/subscriptions/{sub_id}/deliveries?state=NOPE"),
            &cred.token,
        )
        .await,
    );
    send(
        app.get(
            &format!("/v1/subscriptions/{sub_id}/deliveries/{}", "f".repeat(32)),
            &cred.token,
        )
        .await,
    );
    send(raw(&app, "PATCH", &configure, &[], None).await);
    send(raw(&app, "GET", "/v1/nothing", &[], None).await);
    assert_eq!(statuses.len(), 25);
    for status in [400, 401, 403, 404, 405, 409, 413] {
        assert!(statuses.contains(&status), "the batch has no {status}");
    }
    assert_eq!(
        fingerprint(&app).await,
        before,
        "a 4xx request changed the database"
    );
    app.assert_invariants().await;
}

async fn app_sub_name(app: &TestApp, sub_id: &str) -> String {
    scalar_text(
        app,
        &format!("SELECT name FROM subscriptions WHERE id = '{sub_id}'"),
    )
    .await
}
