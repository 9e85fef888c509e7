//! Rules common to every request (http-api.md §1): auth, permissions,
//! scope and ownership, the envelope, limits, order of checks, strict JSON,
//! uint64 strings, query parameters, unknown routes and wrong methods.

use orbit_events::{domain::CredentialId, store::tenancy};
use serde_json::{Value, json};

use crate::{helpers::*, http_support::*};

fn create_body(cred: &Cred, name: &str) -> Value {
    json!({ "name": name, "queue_id": cred.queue_id })
}

fn bearer(token: &str) -> String {
    format!("Bearer {token}")
}

// --- Auth -----------------------------------------------------------------

#[actix_web::test]
async fn a_missing_malformed_unknown_or_revoked_token_gets_401_with_www_authenticate() {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let path = format!("/v1/subscriptions?queue_id={}", cred.queue_id);
    let unknown = bearer("oe_AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA");
    let basic = format!("Basic {}", cred.token);
    let cases: Vec<Vec<(&str, &str)>> = vec![
        vec![],
        vec![("Authorization", "Bearer")],
        vec![("Authorization", "Bearer ")],
        vec![("Authorization", &basic)],
        vec![("Authorization", &unknown)],
    ];
    for headers in cases {
        let res = raw(&app, "GET", &path, &headers, None).await;
        res.assert_error(401, "UNAUTHENTICATED");
        assert_eq!(res.headers["www-authenticate"], "Bearer");
        assert_conforms("GET", "/v1/subscriptions", &res);
    }
    tenancy::revoke_credential(&app.db, &CredentialId::parse(&cred.credential_id).unwrap())
        .await
        .unwrap();
    let res = app.get(&path, &cred.token).await;
    res.assert_error(401, "UNAUTHENTICATED");
    assert_eq!(res.headers["www-authenticate"], "Bearer");
    app.assert_invariants().await;
}

/// The node reads the credential for each request (on SQLite in place,
/// decision 0099) and keeps nothing of it: a revocation written by another
/// connection, as `orbit-events credential revoke` writes it beside a
/// running node, refuses the very next publish, which appends nothing.
#[actix_web::test]
async fn a_publish_after_its_credential_was_revoked_beside_the_node_gets_401_and_appends_nothing() {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let path = format!("/v1/queues/{}/results", cred.queue_id);
    let body = json!({ "results": [result(&cred.queue_id, "task.succeeded")] });
    let res = app.post(&path, &cred.token, "k-before", &body).await;
    assert_eq!(res.status, 201, "{:#}", res.body);
    tenancy::revoke_credential(&app.db, &CredentialId::parse(&cred.credential_id).unwrap())
        .await
        .unwrap();
    let before = fingerprint(&app).await;
    let res = app.post(&path, &cred.token, "k-after", &body).await;
    res.assert_error(401, "UNAUTHENTICATED");
    assert_eq!(res.headers["www-authenticate"], "Bearer");
    assert_eq!(fingerprint(&app).await, before, "a refused publish wrote");
    app.assert_invariants().await;
}

#[actix_web::test]
async fn a_token_is_never_accepted_in_the_url() {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let sub = app.subscribe(&cred, json!({})).await;
    let id = sub["id"].as_str().unwrap();
    let path = format!(
        "/v1/subscriptions?queue_id={}&access_token={}",
        cred.queue_id, cred.token
    );
    let res = raw(&app, "GET", &path, &[], None).await;
    res.assert_error(400, "INVALID_ARGUMENT");
    assert!(
        !res.body.to_string().contains(&cred.token),
        "the token is echoed"
    );
    let path = format!("/v1/subscriptions/{id}?token={}", cred.token);
    let res = raw(&app, "GET", &path, &[], None).await;
    res.assert_error(400, "INVALID_ARGUMENT");
    assert!(
        !res.body.to_string().contains(&cred.token),
        "the token is echoed"
    );
}

#[actix_web::test]
async fn the_bearer_scheme_is_case_insensitive() {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let path = format!("/v1/subscriptions?queue_id={}", cred.queue_id);
    for scheme in ["Bearer", "bearer", "BEARER"] {
        let auth = format!("{scheme} {}", cred.token);
        let res = raw(
            &app,
            "GET",
            &path,
            &[("Authorization", auth.as_str())],
            None,
        )
        .await;
        assert_eq!(res.status, 200, "{scheme}: {:#}", res.body);
    }
}

#[actix_web::test]
async fn a_body_that_stops_arriving_gets_400_before_the_deadline_not_503() {
    let app = spawn_app_with(|s| s.timing.http_request_timeout_ms = 800).await;
    let cred = app.bootstrap().await;
    let request = format!(
        "POST /v1/subscriptions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\n\
         Idempotency-Key: slow\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{{}}",
        cred.token
    );
    let answer = raw_bytes(app.port, request.as_bytes()).await;
    assert!(answer.starts_with("HTTP/1.1 400 "), "{answer}");
    assert!(answer.contains("did not arrive within 500 ms"), "{answer}");
    app.assert_invariants().await;
}

#[actix_web::test]
async fn two_authorization_headers_get_401_even_when_one_is_valid() {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let path = format!("/v1/subscriptions?queue_id={}", cred.queue_id);
    let good = bearer(&cred.token);
    let unknown = bearer("oe_AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA");
    for pair in [[&good, &unknown], [&unknown, &good], [&good, &good]] {
        let headers = [
            ("Authorization", pair[0].as_str()),
            ("Authorization", pair[1].as_str()),
        ];
        let res = raw(&app, "GET", &path, &headers, None).await;
        res.assert_error(401, "UNAUTHENTICATED");
        assert_eq!(res.headers["www-authenticate"], "Bearer");
        assert!(
            res.body["error"]["message"]
                .as_str()
                .unwrap()
                .contains("more than one Authorization header"),
            "{:#}",
            res.body
        );
    }
}

// --- Permissions ------------------------------------------------------------

#[actix_web::test]
async fn each_endpoint_requires_its_permission_and_answers_403_permission_denied() {
    let app = spawn_app().await;
    let owner = app.bootstrap().await;
    let sub = app.subscribe(&owner, json!({})).await;
    let id = sub["id"].as_str().unwrap();
    // Same namespace and queue: only the permissions differ.
    let publisher = sibling(&app, &owner, "app", false, true).await;
    let reader = sibling(&app, &owner, "app", true, false).await;
    let d = "0123456789abcdef0123456789abcdef";
    let q = &owner.queue_id;
    for (method, template, path) in [
        (
            "GET",
            "/v1/subscriptions",
            format!("/v1/subscriptions?queue_id={q}"),
        ),
        (
            "GET",
            "/v1/subscriptions/{id}",
            format!("/v1/subscriptions/{id}"),
        ),
        (
            "GET",
            "/v1/subscriptions/{id}/deliveries",
            format!("/v1/subscriptions/{id}/deliveries"),
        ),
        (
            "GET",
            "/v1/subscriptions/{id}/deliveries/{delivery_id}",
            format!("/v1/subscriptions/{id}/deliveries/{d}"),
        ),
    ] {
        let res = app.get(&path, &publisher.token).await;
        res.assert_error(403, "PERMISSION_DENIED");
        assert_conforms(method, template, &res);
    }
    let configure = json!({ "expected_revision": "1", "enabled": false, "reason": "r" });
    let retry = json!({ "expected_revision": "1", "reason": "r", "additional_attempts": 1 });
    for (template, path, body) in [
        (
            "/v1/subscriptions",
            "/v1/subscriptions".to_owned(),
            create_body(&owner, "x"),
        ),
        (
            "/v1/subscriptions/{id}:configure",
            format!("/v1/subscriptions/{id}:configure"),
            configure,
        ),
        (
            "/v1/subscriptions/{id}/deliveries/{delivery_id}:retry",
            format!("/v1/subscriptions/{id}/deliveries/{d}:retry"),
            retry,
        ),
    ] {
        let res = app.post(&path, &publisher.token, "k-403", &body).await;
        res.assert_error(403, "PERMISSION_DENIED");
        assert_conforms("POST", template, &res);
    }
    // events:* does not include results:publish.
    let res = app
        .post(
            &format!("/v1/queues/{q}/results"),
            &reader.token,
            "k-403",
            &json!({ "results": [result(q, "task.succeeded")] }),
        )
        .await;
    res.assert_error(403, "PERMISSION_DENIED");
    assert_conforms("POST", "/v1/queues/{queue_id}/results", &res);
    app.assert_invariants().await;
}

// --- Scope and ownership -------------------------------------------------------

#[actix_web::test]
async fn another_credential_of_the_same_namespace_gets_404_on_get_configure_deliveries_and_retry() {
    let app = spawn_app().await;
    let owner = app.bootstrap().await;
    let (sub_id, delivery, _ws) = {
        let fast = &app;
        // An EXPIRED delivery is not needed here; a PENDING one is enough.
        let sub = fast
            .subscribe(&owner, json!({ "from_sequence": "0" }))
            .await;
        let sub_id = sub["id"].as_str().unwrap().to_owned();
        fast.publish(&owner, vec![result(&owner.queue_id, "task.failed")])
            .await;
        let ws = fast.bind(&owner.token, &sub_id, 1).await;
        let list_path = format!("/v1/subscriptions/{sub_id}/deliveries");
        let delivery = eventually("a delivery row", || async {
            let res = fast.get(&list_path, &owner.token).await;
            res.data()["items"].get(0).cloned()
        })
        .await;
        (sub_id, delivery, ws)
    };
    let d = delivery["id"].as_str().unwrap();
    let other = sibling(&app, &owner, "other-app", true, true).await;
    assert_eq!(other.namespace_id, owner.namespace_id);
    assert_eq!(other.queue_id, owner.queue_id);

    let before = fingerprint(&app).await;
    let res = app
        .get(&format!("/v1/subscriptions/{sub_id}"), &other.token)
        .await;
    res.assert_error(404, "NOT_FOUND");
    assert_conforms("GET", "/v1/subscriptions/{id}", &res);
    let res = app
        .get(
            &format!("/v1/subscriptions/{sub_id}/deliveries"),
            &other.token,
        )
        .await;
    res.assert_error(404, "NOT_FOUND");
    let res = app
        .get(
            &format!("/v1/subscriptions/{sub_id}/deliveries/{d}"),
            &other.token,
        )
        .await;
    res.assert_error(404, "NOT_FOUND");
    let res = app
        .post(
            &format!("/v1/subscriptions/{sub_id}:configure"),
            &other.token,
            "k1",
            &json!({ "expected_revision": "1", "enabled": false, "reason": "not mine" }),
        )
        .await;
    res.assert_error(404, "NOT_FOUND");
    assert_conforms("POST", "/v1/subscriptions/{id}:configure", &res);
    let res = app
        .post(
            &format!("/v1/subscriptions/{sub_id}/deliveries/{d}:retry"),
            &other.token,
            "k2",
            &json!({ "expected_revision": "1", "reason": "not mine", "additional_attempts": 1 }),
        )
        .await;
    res.assert_error(404, "NOT_FOUND");
    // The list shows none of the owner's subscriptions.
    let res = app
        .get(
            &format!("/v1/subscriptions?queue_id={}", owner.queue_id),
            &other.token,
        )
        .await;
    assert_eq!(res.status, 200);
    assert_eq!(res.data()["items"], json!([]));
    assert_eq!(
        fingerprint(&app).await,
        before,
        "a 404 changed the database"
    );
    app.assert_invariants().await;
}

#[actix_web::test]
async fn a_queue_outside_the_credentials_scope_gets_404_on_create_list_and_publish() {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let foreign = app.bootstrap_with("other-ns", "app", "q", true, true).await;
    let q = &foreign.queue_id;
    let res = app
        .post(
            "/v1/subscriptions",
            &cred.token,
            "k",
            &create_body(&foreign, "s"),
        )
        .await;
    res.assert_error(404, "NOT_FOUND");
    assert_conforms("POST", "/v1/subscriptions", &res);
    let res = app
        .get(&format!("/v1/subscriptions?queue_id={q}"), &cred.token)
        .await;
    res.assert_error(404, "NOT_FOUND");
    assert_conforms("GET", "/v1/subscriptions", &res);
    let res = app
        .post(
            &format!("/v1/queues/{q}/results"),
            &cred.token,
            "k",
            &json!({ "results": [result(q, "task.succeeded")] }),
        )
        .await;
    res.assert_error(404, "NOT_FOUND");
    assert_conforms("POST", "/v1/queues/{queue_id}/results", &res);
    app.assert_invariants().await;
}

// --- Envelope -----------------------------------------------------------------

#[actix_web::test]
async fn every_response_is_an_envelope_with_x_request_id_cache_control_and_content_type() {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let res = app
        .post(
            "/v1/subscriptions",
            &cred.token,
            "k",
            &create_body(&cred, "env"),
        )
        .await;
    assert_eq!(res.status, 201);
    assert_conforms("POST", "/v1/subscriptions", &res);
    let request_id = res.body["request_id"].as_str().unwrap();
    assert!(orbit_events::domain::is_id(request_id));
    for (method, path) in [
        ("GET", "/no/such/route"),
        ("DELETE", "/v1/subscriptions"),
        ("GET", "/healthz"),
        ("GET", "/readyz"),
    ] {
        let res = raw(&app, method, path, &[], None).await;
        let id = res.body["request_id"].as_str().unwrap();
        assert!(orbit_events::domain::is_id(id), "{method} {path}");
        assert_eq!(res.headers["x-request-id"], id, "{method} {path}");
        assert_eq!(res.headers["cache-control"], "no-store", "{method} {path}");
        assert_eq!(
            res.headers["content-type"], "application/json",
            "{method} {path}"
        );
        assert!(
            res.body.get("data").is_some() != res.body.get("error").is_some(),
            "{method} {path}: exactly one of data and error"
        );
    }
    assert_conforms(
        "GET",
        "/healthz",
        &raw(&app, "GET", "/healthz", &[], None).await,
    );
    assert_conforms(
        "GET",
        "/readyz",
        &raw(&app, "GET", "/readyz", &[], None).await,
    );
}

// --- Limits -------------------------------------------------------------------

#[actix_web::test]
async fn a_body_of_512_kib_is_read_and_one_byte_more_gets_413_invalid_argument() {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let text = create_body(&cred, "big").to_string();
    // Whitespace is insignificant: pad the document to exactly the limit.
    let at_limit = format!("{text}{}", " ".repeat(524_288 - text.len()));
    assert_eq!(at_limit.len(), 524_288);
    let res = post_text(&app, "/v1/subscriptions", &cred.token, "big", &at_limit).await;
    assert_eq!(res.status, 201, "{:#}", res.body);
    let over = format!("{at_limit} ");
    let res = post_text(&app, "/v1/subscriptions", &cred.token, "big2", &over).await;
    res.assert_error(413, "INVALID_ARGUMENT");
    assert_conforms("POST", "/v1/subscriptions", &res);
    app.assert_invariants().await;
}

#[actix_web::test]
async fn a_refused_request_with_a_large_body_gets_its_answer_not_a_reset() {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    // 3 MiB: far more than the socket buffers hold, so the node must read
    // the rest before it answers and closes (decision 0077).
    let big = vec![b' '; 3 << 20];
    for _ in 0..5 {
        let res = post_text(
            &app,
            "/v1/subscriptions",
            &cred.token,
            "big",
            &String::from_utf8(big.clone()).unwrap(),
        )
        .await;
        res.assert_error(413, "INVALID_ARGUMENT");
        let res = raw(
            &app,
            "POST",
            "/v1/subscriptions",
            &[
                ("Authorization", "Bearer oe_unknown"),
                ("Content-Type", "application/json"),
            ],
            Some(big.clone()),
        )
        .await;
        res.assert_error(401, "UNAUTHENTICATED");
    }
}

#[actix_web::test]
async fn a_body_needs_content_type_application_json_and_parameters_are_allowed() {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let auth = bearer(&cred.token);
    let body = create_body(&cred, "ct").to_string().into_bytes();
    for content_type in [
        None,
        Some("text/plain"),
        Some("application/jsonx"),
        Some(""),
    ] {
        let mut headers = vec![("Authorization", auth.as_str()), ("Idempotency-Key", "ct")];
        if let Some(ct) = content_type {
            headers.push(("Content-Type", ct));
        }
        let res = raw(
            &app,
            "POST",
            "/v1/subscriptions",
            &headers,
            Some(body.clone()),
        )
        .await;
        res.assert_error(400, "INVALID_ARGUMENT");
        assert!(
            res.body["error"]["message"]
                .as_str()
                .unwrap()
                .contains("Content-Type"),
            "{:#}",
            res.body
        );
    }
    let headers = [
        ("Authorization", auth.as_str()),
        ("Idempotency-Key", "ct"),
        ("Content-Type", "application/json; charset=utf-8"),
    ];
    let res = raw(&app, "POST", "/v1/subscriptions", &headers, Some(body)).await;
    assert_eq!(res.status, 201, "{:#}", res.body);
}

#[actix_web::test]
async fn a_request_past_its_deadline_gets_503_unavailable_and_is_rolled_back() {
    let app = spawn_app_with(|s| s.timing.http_request_timeout_ms = 300).await;
    let cred = app.bootstrap().await;
    let (blocker, txn) = hold_idempotency_writes(&app).await;
    let started = std::time::Instant::now();
    let res = app
        .post(
            "/v1/subscriptions",
            &cred.token,
            "slow",
            &create_body(&cred, "slow"),
        )
        .await;
    res.assert_error(503, "UNAVAILABLE");
    assert_conforms("POST", "/v1/subscriptions", &res);
    assert!(started.elapsed() < std::time::Duration::from_secs(5));
    txn.rollback().await.unwrap();
    blocker.close().await.unwrap();
    // Nothing of the abandoned request was committed: the same key applies
    // afresh (201, not a 200 replay) once writes go through again.
    let res = eventually("a write to go through after the deadline", || async {
        let res = app
            .post(
                "/v1/subscriptions",
                &cred.token,
                "slow",
                &create_body(&cred, "slow"),
            )
            .await;
        (res.status != 503).then_some(res)
    })
    .await;
    assert_eq!(res.status, 201, "{:#}", res.body);
    assert_eq!(res.data()["deduplicated"], false);
    assert_eq!(app.scalar("SELECT COUNT(*) FROM subscriptions").await, 1);
    assert_eq!(
        app.scalar("SELECT COUNT(*) FROM idempotency_records").await,
        1
    );
    app.assert_invariants().await;
}

// --- Order of checks ----------------------------------------------------------------

#[actix_web::test]
async fn checks_run_in_order_route_method_query_auth_permission_body_ownership_state() {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let sub = app.subscribe(&cred, json!({})).await;
    let id = sub["id"].as_str().unwrap();
    let reader = sibling(&app, &cred, "app", false, true).await;
    let other = sibling(&app, &cred, "app2", true, true).await;
    // Unknown route and wrong method come before auth.
    raw(&app, "GET", "/v1/nothing", &[], None)
        .await
        .assert_error(404, "NOT_FOUND");
    let res = raw(&app, "PUT", &format!("/v1/subscriptions/{id}"), &[], None).await;
    res.assert_error(405, "INVALID_ARGUMENT");
    assert_eq!(res.headers["allow"], "GET");
    // Query-string rules before auth.
    raw(
        &app,
        "GET",
        &format!("/v1/subscriptions/{id}?x=1"),
        &[],
        None,
    )
    .await
    .assert_error(400, "INVALID_ARGUMENT");
    raw(&app, "GET", "/v1/subscriptions?queue_id=nope", &[], None)
        .await
        .assert_error(400, "INVALID_ARGUMENT");
    // Auth before permission.
    let configure = format!("/v1/subscriptions/{id}:configure");
    let bad_body = "{\"enabled\": 1}";
    post_text(&app, &configure, "oe_nope", "k", bad_body)
        .await
        .assert_error(401, "UNAUTHENTICATED");
    // Permission before the body.
    post_text(&app, &configure, &reader.token, "k", bad_body)
        .await
        .assert_error(403, "PERMISSION_DENIED");
    // The body before ownership.
    post_text(&app, &configure, &other.token, "k", bad_body)
        .await
        .assert_error(400, "INVALID_ARGUMENT");
    // Ownership before state: a stale revision on a foreign subscription is 404.
    let stale = json!({ "expected_revision": "9", "enabled": false, "reason": "r" });
    app.post(&configure, &other.token, "k", &stale)
        .await
        .assert_error(404, "NOT_FOUND");
    app.post(&configure, &cred.token, "k", &stale)
        .await
        .assert_error(409, "STATE_CONFLICT");
    app.assert_invariants().await;
}

// --- Strict JSON -------------------------------------------------------------------

async fn assert_rejected(app: &TestApp, path: &str, cred: &Cred, body: &str, field: &str) {
    let res = post_text(app, path, &cred.token, "strict", body).await;
    res.assert_error(400, "INVALID_ARGUMENT");
    let message = res.body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains(field),
        "the message {message:?} does not name {field:?} (body {body})"
    );
}

#[actix_web::test]
async fn unknown_fields_case_variants_duplicates_trailing_data_wrong_types_and_null_are_400_naming_the_field()
 {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let q = &cred.queue_id;
    let subs = "/v1/subscriptions";
    for (body, field) in [
        (
            format!(r#"{{"name":"a","queue_id":"{q}","colour":"red"}}"#),
            "colour",
        ),
        (format!(r#"{{"Name":"a","queue_id":"{q}"}}"#), "Name"),
        (
            format!(r#"{{"name":"a","NAME":"b","queue_id":"{q}"}}"#),
            "NAME",
        ),
        (
            format!(r#"{{"name":"a","name":"b","queue_id":"{q}"}}"#),
            "name",
        ),
        (
            format!(r#"{{"name":"a","n\u0061me":"b","queue_id":"{q}"}}"#),
            "name",
        ),
        (
            format!(r#"{{"name":"a","queue_id":"{q}"}} {{}}"#),
            "trailing",
        ),
        (format!(r#"{{"name":"a","queue_id":"{q}"}}x"#), "JSON"),
        (
            format!(r#"{{"name":"a","queue_id":"{q}","from_sequence":7}}"#),
            "from_sequence",
        ),
        (
            format!(r#"{{"name":"a","queue_id":"{q}","max_pending":"100"}}"#),
            "max_pending",
        ),
        (
            format!(r#"{{"name":"a","queue_id":"{q}","max_pending":1.5}}"#),
            "max_pending",
        ),
        (
            format!(r#"{{"name":"a","queue_id":"{q}","max_attempts":-1}}"#),
            "max_attempts",
        ),
        (
            format!(r#"{{"name":"a","queue_id":"{q}","types":null}}"#),
            "types",
        ),
        (
            format!(r#"{{"name":"a","queue_id":"{q}","max_pending":null}}"#),
            "max_pending",
        ),
        (format!(r#"{{"name":null,"queue_id":"{q}"}}"#), "name"),
        (
            format!(r#"{{"name":"a","queue_id":"{q}","types":"task.failed"}}"#),
            "types",
        ),
        (
            format!(r#"["a","{q}",null,null,null,null]"#),
            "a JSON object",
        ),
        ("".to_owned(), "JSON"),
    ] {
        assert_rejected(&app, subs, &cred, &body, field).await;
    }
    // Duplicates at depth, also hidden by an escape, in an ingest body.
    let mut r = result(q, "task.succeeded");
    r["details"] = json!({ "capacity": 1 });
    let text = json!({ "results": [r] }).to_string();
    let nested = text.replacen(r#""capacity":1"#, r#""capacity":1,"capacity":2"#, 1);
    assert_rejected(
        &app,
        &format!("/v1/queues/{q}/results"),
        &cred,
        &nested,
        "capacity",
    )
    .await;
    let escaped = text.replacen(r#""capacity":1"#, r#""capacity":1,"capac\u0069ty":2"#, 1);
    assert_rejected(
        &app,
        &format!("/v1/queues/{q}/results"),
        &cred,
        &escaped,
        "capacity",
    )
    .await;
    let in_snapshot = text.replacen(
        r#""effect_uncertain":false"#,
        r#""effect_uncertain":false,"effect_uncertain":true"#,
        1,
    );
    assert_rejected(
        &app,
        &format!("/v1/queues/{q}/results"),
        &cred,
        &in_snapshot,
        "effect_uncertain",
    )
    .await;
    // from_sequence may be null (= start at the head).
    let res = post_text(
        &app,
        subs,
        &cred.token,
        "null-ok",
        &format!(r#"{{"name":"a","queue_id":"{q}","from_sequence":null}}"#),
    )
    .await;
    assert_eq!(res.status, 201, "{:#}", res.body);
    assert_eq!(app.scalar("SELECT COUNT(*) FROM subscriptions").await, 1);
    app.assert_invariants().await;
}

#[actix_web::test]
async fn uint64_strings_are_canonical_decimal_up_to_18446744073709551615() {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let q = &cred.queue_id;
    let sub = app.subscribe(&cred, json!({})).await;
    let configure = format!(
        "/v1/subscriptions/{}:configure",
        sub["id"].as_str().unwrap()
    );
    for bad in [
        "007",
        "+7",
        "-7",
        "7e0",
        "7.0",
        " 7",
        "",
        "0x7",
        "18446744073709551616",
    ] {
        let body = json!({ "expected_revision": bad, "enabled": true, "reason": "r" });
        let res = app.post(&configure, &cred.token, "u64", &body).await;
        res.assert_error(400, "INVALID_ARGUMENT");
        assert!(
            res.body["error"]["message"]
                .as_str()
                .unwrap()
                .contains("expected_revision"),
            "{bad}: {:#}",
            res.body
        );
        let body = json!({ "name": "a", "queue_id": q, "from_sequence": bad });
        app.post("/v1/subscriptions", &cred.token, "u64", &body)
            .await
            .assert_error(400, "INVALID_ARGUMENT");
    }
    // The largest value parses: here it is a well-formed but stale revision.
    let body =
        json!({ "expected_revision": "18446744073709551615", "enabled": true, "reason": "r" });
    app.post(&configure, &cred.token, "u64-max", &body)
        .await
        .assert_error(409, "STATE_CONFLICT");
    // ... and a producer's revision is carried as given.
    let mut r = result(q, "task.succeeded");
    r["aggregate_revision"] = json!("18446744073709551615");
    r["snapshot"]["revision"] = json!("18446744073709551615");
    let res = app
        .post(
            &format!("/v1/queues/{q}/results"),
            &cred.token,
            "u64-max",
            &json!({ "results": [r] }),
        )
        .await;
    assert_eq!(res.status, 201, "{:#}", res.body);
    assert_conforms("POST", "/v1/queues/{queue_id}/results", &res);
    app.assert_invariants().await;
}

#[actix_web::test]
async fn a_result_with_numbers_beyond_f64_is_accepted_and_delivered_byte_exact() {
    use futures_util::StreamExt;
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let sub = app.subscribe(&cred, json!({ "from_sequence": "0" })).await;
    let numbers = r#"{"huge":1E400,"tiny":-1e-400,"long":123456789012345678901234567890.000000000000000000001}"#;
    let mut r = result(&cred.queue_id, "task.succeeded");
    r["snapshot"]["result"] = json!("RESULT");
    r["details"]["n"] = json!("DETAILS");
    let body = json!({ "results": [r] })
        .to_string()
        .replace(r#""RESULT""#, numbers)
        .replace(r#""DETAILS""#, numbers);
    let res = post_text(
        &app,
        &format!("/v1/queues/{}/results", cred.queue_id),
        &cred.token,
        "huge",
        &body,
    )
    .await;
    assert_eq!(res.status, 201, "{:#}", res.body);
    let mut ws = app.bind(&cred.token, sub["id"].as_str().unwrap(), 1).await;
    // The frame is read as text: a test client's own parser would turn
    // 1E400 into an error, which is exactly what the node must not do.
    let text = loop {
        match ws.stream.next().await.unwrap().unwrap() {
            tokio_tungstenite::tungstenite::Message::Text(t) => break t.to_string(),
            _ => continue,
        }
    };
    assert!(text.contains(r#""type":"event.deliver""#), "{text}");
    assert_eq!(text.matches(numbers).count(), 2, "not byte-exact: {text}");
}

// --- Query parameters -------------------------------------------------------------------

#[actix_web::test]
async fn unknown_and_repeated_query_parameters_are_400_and_only_the_two_lists_take_any() {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let sub = app.subscribe(&cred, json!({})).await;
    let id = sub["id"].as_str().unwrap();
    let q = &cred.queue_id;
    let list = format!("/v1/subscriptions?queue_id={q}");
    for (path, template) in [
        (format!("{list}&colour=red"), "/v1/subscriptions"),
        (format!("{list}&queue_id={q}"), "/v1/subscriptions"),
        (format!("{list}&limit=5&limit=5"), "/v1/subscriptions"),
        (format!("{list}&Limit=5"), "/v1/subscriptions"),
        ("/v1/subscriptions".to_owned(), "/v1/subscriptions"),
        (format!("{list}&limit=0"), "/v1/subscriptions"),
        (format!("{list}&limit=101"), "/v1/subscriptions"),
        (format!("{list}&limit=007"), "/v1/subscriptions"),
        (format!("{list}&limit="), "/v1/subscriptions"),
        (format!("{list}&cursor="), "/v1/subscriptions"),
        (format!("{list}&cursor=%00"), "/v1/subscriptions"),
        (
            format!("/v1/subscriptions/{id}/deliveries?state=DONE"),
            "/v1/subscriptions/{id}/deliveries",
        ),
        (
            format!("/v1/subscriptions/{id}/deliveries?state=ACKED&state=ACKED"),
            "/v1/subscriptions/{id}/deliveries",
        ),
        (
            format!("/v1/subscriptions/{id}/deliveries?queue_id={q}"),
            "/v1/subscriptions/{id}/deliveries",
        ),
        (
            format!("/v1/subscriptions/{id}?limit=1"),
            "/v1/subscriptions/{id}",
        ),
        ("/healthz?verbose=1".to_owned(), "/healthz"),
    ] {
        let res = app.get(&path, &cred.token).await;
        res.assert_error(400, "INVALID_ARGUMENT");
        assert_conforms("GET", template, &res);
    }
    // A query string on a POST.
    let res = app
        .post(
            "/v1/subscriptions?dry_run=1",
            &cred.token,
            "k",
            &create_body(&cred, "q"),
        )
        .await;
    res.assert_error(400, "INVALID_ARGUMENT");
    for limit in ["1", "100"] {
        let res = app.get(&format!("{list}&limit={limit}"), &cred.token).await;
        assert_eq!(res.status, 200, "limit={limit}: {:#}", res.body);
        assert_conforms("GET", "/v1/subscriptions", &res);
    }
    app.assert_invariants().await;
}

// --- Unknown route, wrong method -------------------------------------------------------

#[actix_web::test]
async fn a_percent_encoded_colon_does_not_name_a_custom_method_and_changes_nothing() {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let sub = app.subscribe(&cred, json!({})).await;
    let id = sub["id"].as_str().unwrap();
    let body = json!({ "expected_revision": "1", "enabled": false, "reason": "encoded" });
    for path in [
        format!("/v1/subscriptions/{id}%3Aconfigure"),
        format!("/v1/subscriptions/{id}%3aconfigure"),
        // The verb after a literal segment too: not the bulk retry.
        format!("/v1/subscriptions/{id}/deliveries%3Aretry"),
    ] {
        let res = app.post(&path, &cred.token, &path, &body).await;
        res.assert_error(404, "NOT_FOUND");
    }
    let got = app
        .get(&format!("/v1/subscriptions/{id}"), &cred.token)
        .await;
    assert_eq!(got.data()["revision"], "1");
    assert_eq!(got.data()["enabled"], true);
}

#[actix_web::test]
async fn an_unknown_route_is_404_and_a_wrong_method_is_405_with_allow() {
    let app = spawn_app().await;
    let id = "0123456789abcdef0123456789abcdef";
    for path in [
        "/v1".to_owned(),
        "/v1/subscriptions/".to_owned(),
        format!("/v1/subscriptions/{id}:delete"),
        format!("/v1/subscriptions/{id}/deliveries/{id}/event"),
        "/v2/subscriptions".to_owned(),
    ] {
        let res = raw(&app, "GET", &path, &[], None).await;
        res.assert_error(404, "NOT_FOUND");
    }
    for (method, path, allow) in [
        ("DELETE", "/v1/subscriptions".to_owned(), "GET, POST"),
        ("POST", format!("/v1/subscriptions/{id}"), "GET"),
        ("GET", format!("/v1/subscriptions/{id}:configure"), "POST"),
        ("PUT", format!("/v1/subscriptions/{id}/deliveries"), "GET"),
        (
            "POST",
            format!("/v1/subscriptions/{id}/deliveries/{id}"),
            "GET",
        ),
        (
            "GET",
            format!("/v1/subscriptions/{id}/deliveries/{id}:retry"),
            "POST",
        ),
        ("GET", format!("/v1/queues/{id}/results"), "POST"),
    ] {
        let res = raw(&app, method, &path, &[], None).await;
        res.assert_error(405, "INVALID_ARGUMENT");
        assert_eq!(res.headers["allow"], allow, "{method} {path}");
    }
}

/// One request written as raw bytes; the whole answer as text.
async fn raw_bytes(port: u16, request: &[u8]) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    // The node may answer and close before it has read all of a long head.
    let _ = tcp.write_all(request).await;
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(DEADLINE, tcp.read_to_end(&mut answer)).await;
    String::from_utf8_lossy(&answer).into_owned()
}

#[actix_web::test]
async fn a_request_that_is_not_valid_http_gets_the_envelope_and_is_not_logged_as_an_error() {
    use crate::protocol_support::NodeProcess;
    let mut app = spawn_app().await;
    let node = NodeProcess::serve_for(&mut app, &[]).await;
    let many_headers: String = (0..200).map(|i| format!("X-H{i}: v\r\n")).collect();
    let cases: Vec<(&str, Vec<u8>, u16)> = vec![
        (
            "a header value holding 0x7f",
            b"GET /healthz HTTP/1.1\r\nHost: x\r\nIdempotency-Key: a\x7fb\r\n\r\n".to_vec(),
            400,
        ),
        (
            "Transfer-Encoding with Content-Length",
            b"POST /v1/subscriptions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n0\r\n\r\n".to_vec(),
            400,
        ),
        (
            "a 100 KB URI",
            format!("GET /{} HTTP/1.1\r\nHost: x\r\n\r\n", "a".repeat(100_000)).into_bytes(),
            400,
        ),
        (
            "200 headers",
            format!("GET /healthz HTTP/1.1\r\nHost: x\r\n{many_headers}\r\n").into_bytes(),
            431,
        ),
    ];
    for (what, request, status) in cases {
        let answer = raw_bytes(node.port, &request).await;
        assert_enveloped(what, &answer, status);
        // The same request after a good one on a kept-alive connection.
        let mut pipelined = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n".to_vec();
        pipelined.extend_from_slice(&request);
        let answer = raw_bytes(node.port, &pipelined).await;
        assert!(answer.starts_with("HTTP/1.1 200 OK"), "{what}: {answer}");
        let second = answer[1..].find("HTTP/1.1 ").map(|i| &answer[i + 1..]);
        assert_enveloped(
            what,
            second.unwrap_or_else(|| panic!("{what}: {answer}")),
            status,
        );
    }
    // The node still serves, and wrote no ERROR line for any of it.
    let healthz = app
        .http
        .get(format!("{}/healthz", app.address))
        .send()
        .await;
    assert_eq!(healthz.unwrap().status(), 200);
    let log = node.log();
    assert!(!log.contains("ERROR"), "{log}");
}

/// `answer` (one response) is `status` with the envelope and its headers.
fn assert_enveloped(what: &str, answer: &str, status: u16) {
    let (head, body) = answer.split_once("\r\n\r\n").unwrap_or((answer, ""));
    let head = head.to_ascii_lowercase();
    assert!(
        head.starts_with(&format!("http/1.1 {status} ")),
        "{what}: {answer}"
    );
    assert!(
        head.contains("\r\ncache-control: no-store"),
        "{what}: {head}"
    );
    assert!(
        head.contains("\r\ncontent-type: application/json"),
        "{what}: {head}"
    );
    let body: Value = serde_json::from_str(body).unwrap_or_else(|e| panic!("{what}: {e}: {body}"));
    assert_eq!(body["error"]["code"], "INVALID_ARGUMENT", "{what}");
    let id = body["request_id"].as_str().unwrap();
    assert!(
        head.contains(&format!("\r\nx-request-id: {id}")),
        "{what}: {head}"
    );
}
