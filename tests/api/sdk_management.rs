//! The client crate's management client against a real node: every
//! endpoint, its wire types against docs/openapi.json, idempotency keys,
//! and errors typed by the service's codes (http-api.md).

use orbit_events_client::{
    Client, ConfigureSubscription, CreateSubscription, DeliveryFilter, DeliveryState, Error,
    ErrorCode, IdempotencyKey, NewResult, ResultType, RetryDelivery, RetryExpired, Token,
};
use serde::Serialize;
use serde_json::{Value, json, value::RawValue};

use crate::{helpers::*, http_support::*, sdk_support::*};

/// The SDK's value serializes to exactly the JSON the server sent: no
/// field lost, renamed or reshaped.
#[track_caller]
fn assert_same_json(what: &str, sdk: &impl Serialize, server: &Value) {
    assert_eq!(
        &serde_json::to_value(sdk).unwrap(),
        server,
        "{what}: the SDK's type differs from the server's JSON"
    );
}

/// The same request sent raw with the same key replays the original
/// answer: its `data` (but `deduplicated`) equals the SDK's.
async fn replayed(
    app: &TestApp,
    cred: &Cred,
    path: &str,
    key: &IdempotencyKey,
    body: &impl Serialize,
) -> Value {
    // As text: a `Value` would round big numbers and change the request.
    let body = serde_json::to_string(body).unwrap();
    let res = post_text(app, path, &cred.token, key.as_str(), &body).await;
    assert_eq!(res.status, 200, "replay of {path}: {:#}", res.body);
    assert_eq!(res.data()["deduplicated"], true);
    let mut data = res.data().clone();
    data["deduplicated"] = json!(false);
    data
}

/// Reads the same thing through the SDK and raw until both agree (the
/// node's background work may change it between two reads), asserting
/// that the SDK's value serializes to the server's JSON; returns it.
async fn agree<T: Serialize>(
    what: &str,
    app: &TestApp,
    cred: &Cred,
    path: &str,
    read: impl AsyncFn() -> T,
) -> T {
    let mut last = None;
    for _ in 0..20 {
        let sdk = read().await;
        let server = app.get(path, &cred.token).await.data().clone();
        if serde_json::to_value(&sdk).unwrap() == server {
            return sdk;
        }
        last = Some((serde_json::to_value(&sdk).unwrap(), server));
    }
    let (sdk, server) = last.unwrap();
    panic!("{what}: the SDK's type differs from the server's JSON:\n{sdk:#}\n{server:#}");
}

/// The publish body, serialized without going through a `Value`.
#[derive(Serialize)]
struct Publish<'a> {
    results: &'a [NewResult],
}

fn raw(text: &str) -> Box<RawValue> {
    RawValue::from_string(text.to_owned()).unwrap()
}

#[actix_web::test]
async fn every_management_answer_reads_into_the_sdk_types_and_serializes_back_to_the_same_json() {
    // Leases lapse within the test (to reach EXPIRED), but not while the
    // LEASED deliveries are read.
    let app = spawn_app_with(|s| {
        s.timing.lease_ms = 2_000;
        s.timing.scan_interval_ms = 50;
    })
    .await;
    let cred = app.bootstrap().await;
    let client = sdk(&app, &cred);
    let q = cred.queue_id.as_str();

    // Create, with every option.
    let create = CreateSubscription {
        types: vec![
            ResultType::Succeeded,
            ResultType::Failed,
            ResultType::NeedsReview,
        ],
        from_sequence: Some(0),
        max_pending: Some(50),
        max_attempts: Some(1),
        ..CreateSubscription::new("sdk-wire", q)
    };
    let key = IdempotencyKey::random();
    let created = client.create_subscription(&key, &create).await.unwrap();
    assert!(!created.deduplicated);
    assert_eq!(
        created.subscription.types,
        [
            ResultType::Failed,
            ResultType::NeedsReview,
            ResultType::Succeeded
        ]
    );
    assert_same_json(
        "create",
        &created,
        &replayed(&app, &cred, "/v1/subscriptions", &key, &create).await,
    );
    let sub = created.subscription.id.clone();

    // Publish, with a result of full precision, an attempt id and details.
    let now = chrono::Utc::now();
    let task = || orbit_events::domain::random_hex_id();
    let results = vec![
        NewResult::new(ResultType::Succeeded, q, &task(), 2, now)
            .with_result(raw(r#"{"amount":12345678901234567890.125,"ok":true}"#))
            .with_details(raw(r#"{"state":"SUCCEEDED","note":"é"}"#)),
        {
            let mut r = NewResult::new(ResultType::Failed, q, &task(), 7, now);
            r.snapshot.current_attempt_id = Some(task());
            r.snapshot.effect_uncertain = true;
            r
        },
        NewResult::new(ResultType::NeedsReview, q, &task(), 1, now).with_result(raw("null")),
    ];
    let key = IdempotencyKey::random();
    let published = client.publish_results(q, &key, &results).await.unwrap();
    assert_eq!(published.events.len(), 3);
    let path = format!("/v1/queues/{q}/results");
    assert_same_json(
        "publish",
        &published,
        &replayed(&app, &cred, &path, &key, &Publish { results: &results }).await,
    );

    // Get and list the subscription.
    let got = agree(
        "get subscription",
        &app,
        &cred,
        &format!("/v1/subscriptions/{sub}"),
        async || client.get_subscription(&sub).await.unwrap(),
    )
    .await;
    app.subscribe(&cred, json!({})).await;
    let page = agree(
        "list subscriptions",
        &app,
        &cred,
        &format!("/v1/subscriptions?queue_id={q}&limit=1"),
        async || client.list_subscriptions(q, Some(1), None).await.unwrap(),
    )
    .await;
    assert_eq!(page.items.len(), 1);
    let cursor = page.next_cursor.clone().expect("a second page");
    let second = client
        .list_subscriptions(q, Some(1), Some(&cursor))
        .await
        .unwrap();
    assert_eq!(second.items[0].id, sub);
    assert!(second.next_cursor.is_none());

    // Deliveries while LEASED, with their event.
    let mut ws = app.bind(&cred.token, &sub, 3).await;
    let mut delivered = Vec::new();
    for _ in 0..3 {
        delivered.push(ws.delivery().await);
    }
    let deliveries_path = format!("/v1/subscriptions/{sub}/deliveries");
    let leased = agree(
        "list deliveries",
        &app,
        &cred,
        &deliveries_path,
        async || {
            client
                .list_deliveries(&sub, &DeliveryFilter::default())
                .await
                .unwrap()
        },
    )
    .await;
    assert!(
        leased
            .items
            .iter()
            .all(|d| d.state == DeliveryState::Leased && d.lease_until.is_some())
    );
    for d in &delivered {
        let id = d["body"]["delivery"]["id"].as_str().unwrap();
        let detail = agree(
            "delivery detail",
            &app,
            &cred,
            &format!("{deliveries_path}/{id}"),
            async || client.get_delivery(&sub, id).await.unwrap(),
        )
        .await;
        // The event of event.deliver has the same shape.
        assert_same_json("event of event.deliver", &detail.event, &d["body"]["event"]);
    }
    let with_result = client
        .get_delivery(
            &sub,
            delivered[0]["body"]["delivery"]["id"].as_str().unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(
        with_result.event.snapshot.result.as_ref().map(|r| r.get()),
        Some(r#"{"amount":12345678901234567890.125,"ok":true}"#),
        "the result is byte-exact"
    );

    // ACKED, then EXPIRED (max_attempts 1), then retried.
    assert_eq!(ws.ack(&delivered[0]).await["type"], "ack");
    let expired_filter = DeliveryFilter {
        state: Some(DeliveryState::Expired),
        ..Default::default()
    };
    eventually("two deliveries EXPIRED", || async {
        let page = client.list_deliveries(&sub, &expired_filter).await.unwrap();
        (page.items.len() == 2).then_some(())
    })
    .await;
    let expired = agree(
        "list EXPIRED deliveries",
        &app,
        &cred,
        &format!("{deliveries_path}?state=EXPIRED"),
        async || client.list_deliveries(&sub, &expired_filter).await.unwrap(),
    )
    .await;
    let all = agree(
        "list all deliveries",
        &app,
        &cred,
        &deliveries_path,
        async || {
            client
                .list_deliveries(&sub, &DeliveryFilter::default())
                .await
                .unwrap()
        },
    )
    .await;
    assert!(
        all.items
            .iter()
            .any(|d| d.state == DeliveryState::Acked && d.acknowledged_at.is_some())
    );

    let target = &expired.items[0];
    let retry = RetryDelivery {
        expected_revision: target.revision,
        reason: "sdk test".to_owned(),
        additional_attempts: 2,
    };
    let key = IdempotencyKey::random();
    let retried = client
        .retry_delivery(&sub, &target.id, &key, &retry)
        .await
        .unwrap();
    assert_eq!(retried.delivery.attempt_budget, 3);
    assert_same_json(
        "retry",
        &retried,
        &replayed(
            &app,
            &cred,
            &format!("{deliveries_path}/{}:retry", target.id),
            &key,
            &retry,
        )
        .await,
    );

    // The history of the retried delivery, the status, the queues, a bulk
    // retry of the other EXPIRED one.
    agree(
        "delivery history",
        &app,
        &cred,
        &format!("{deliveries_path}/{}/history", target.id),
        async || client.delivery_history(&sub, &target.id).await.unwrap(),
    )
    .await;
    let status = client.subscription_status(&sub).await.unwrap();
    assert_eq!(status.expired, 1);
    let mut server = app
        .get(&format!("/v1/subscriptions/{sub}/status"), &cred.token)
        .await
        .data()
        .clone();
    // The age grows between the two reads.
    server["oldest_unacked"]["age_seconds"] =
        json!(status.oldest_unacked.as_ref().unwrap().age_seconds);
    assert_same_json("status", &status, &server);
    agree("queues", &app, &cred, "/v1/queues", async || {
        client.list_queues().await.unwrap()
    })
    .await;
    let bulk = RetryExpired {
        reason: "sdk bulk".to_owned(),
        additional_attempts: 1,
        from_sequence: Some(1),
        to_sequence: None,
        limit: 10,
        dry_run: false,
        spread_ms: Some(10),
    };
    let key = IdempotencyKey::random();
    let receipt = client.retry_expired(&sub, &key, &bulk).await.unwrap();
    assert_eq!((receipt.matched, receipt.retried), (1, 1));
    assert_same_json(
        "bulk retry",
        &receipt,
        &replayed(
            &app,
            &cred,
            &format!("{deliveries_path}:retry"),
            &key,
            &bulk,
        )
        .await,
    );

    // Pause.
    let configure = ConfigureSubscription {
        expected_revision: got.revision,
        enabled: false,
        reason: "sdk test".to_owned(),
    };
    let key = IdempotencyKey::random();
    let paused = client
        .configure_subscription(&sub, &key, &configure)
        .await
        .unwrap();
    assert!(!paused.subscription.enabled);
    assert_same_json(
        "configure",
        &paused,
        &replayed(
            &app,
            &cred,
            &format!("/v1/subscriptions/{sub}:configure"),
            &key,
            &configure,
        )
        .await,
    );

    // Health.
    agree("healthz", &app, &cred, "/healthz", async || {
        client.healthz().await.unwrap()
    })
    .await;
    let ready = client.readyz().await.unwrap();
    assert!(ready.node_id.is_some());
    drop(ws);
    app.assert_invariants().await;
}

#[actix_web::test]
async fn every_request_body_the_sdk_sends_is_valid_against_docs_openapi_json() {
    let doc = openapi();
    let validate = |path: &str, body: Value| {
        let schema =
            &doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"];
        let root = json!({ "$ref": schema["$ref"], "components": doc["components"] });
        let validator = jsonschema::options()
            .with_draft(jsonschema::Draft::Draft202012)
            .build(&root)
            .unwrap();
        let errors: Vec<String> = validator
            .iter_errors(&body)
            .map(|e| format!("{e} at {}", e.instance_path()))
            .collect();
        assert!(errors.is_empty(), "{path}: {errors:?}\n{body:#}");
    };
    let id = "0123456789abcdef0123456789abcdef";
    validate(
        "/v1/subscriptions",
        serde_json::to_value(CreateSubscription::new("n", id)).unwrap(),
    );
    validate(
        "/v1/subscriptions",
        serde_json::to_value(CreateSubscription {
            types: ResultType::ALL.to_vec(),
            from_sequence: Some(u64::MAX),
            max_pending: Some(1000),
            max_attempts: Some(100),
            ..CreateSubscription::new("n.1_x-y", id)
        })
        .unwrap(),
    );
    validate(
        "/v1/subscriptions/{id}:configure",
        serde_json::to_value(ConfigureSubscription {
            expected_revision: 1,
            enabled: true,
            reason: "r".to_owned(),
        })
        .unwrap(),
    );
    validate(
        "/v1/subscriptions/{id}/deliveries/{delivery_id}:retry",
        serde_json::to_value(RetryDelivery {
            expected_revision: 9,
            reason: "r".to_owned(),
            additional_attempts: 100,
        })
        .unwrap(),
    );
    for bulk in [
        RetryExpired {
            reason: "r".to_owned(),
            additional_attempts: 1,
            from_sequence: None,
            to_sequence: None,
            limit: 1,
            dry_run: true,
            spread_ms: None,
        },
        RetryExpired {
            reason: "r".to_owned(),
            additional_attempts: 100,
            from_sequence: Some(0),
            to_sequence: Some(u64::MAX),
            limit: 10_000,
            dry_run: false,
            spread_ms: Some(3_600_000),
        },
    ] {
        validate(
            "/v1/subscriptions/{id}/deliveries:retry",
            serde_json::to_value(bulk).unwrap(),
        );
    }
    let at = chrono::Utc::now();
    let mut full =
        NewResult::new(ResultType::Failed, id, id, 18, at).with_result(raw("[1,2.5,\"x\"]"));
    full.snapshot.current_attempt_id = Some(id.to_owned());
    validate(
        "/v1/queues/{queue_id}/results",
        json!({ "results": [NewResult::new(ResultType::Cancelled, id, id, 0, at), full] }),
    );
}

#[actix_web::test]
async fn errors_are_typed_by_the_services_codes_with_status_message_and_request_id() {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let client = sdk(&app, &cred);
    let q = cred.queue_id.as_str();
    let api = |e: Error| match e {
        Error::Api(api) => api,
        other => panic!("expected an API error, got {other:?}"),
    };

    let missing = api(client
        .get_subscription("0123456789abcdef0123456789abcdef")
        .await
        .unwrap_err());
    assert_eq!(
        (missing.status, &missing.code),
        (Some(404), &ErrorCode::NotFound)
    );
    assert_eq!(missing.request_id.as_ref().map(String::len), Some(32));

    let stranger = Client::new(&app.address, Token::new("oe_not-a-token").unwrap()).unwrap();
    let e = api(stranger
        .list_subscriptions(q, None, None)
        .await
        .unwrap_err());
    assert_eq!(
        (e.status, &e.code),
        (Some(401), &ErrorCode::Unauthenticated)
    );

    let publisher = app
        .bootstrap_with("demo", "publisher", &format!("p{}", &q[..8]), false, true)
        .await;
    let e = api(sdk(&app, &publisher)
        .list_subscriptions(&publisher.queue_id, None, None)
        .await
        .unwrap_err());
    assert_eq!(
        (e.status, &e.code),
        (Some(403), &ErrorCode::PermissionDenied)
    );

    let e = api(client
        .create_subscription(
            &IdempotencyKey::random(),
            &CreateSubscription::new("-bad", q),
        )
        .await
        .unwrap_err());
    assert_eq!(
        (e.status, &e.code),
        (Some(400), &ErrorCode::InvalidArgument)
    );
    assert!(e.message.contains("name"), "{e}");

    let sub = client
        .create_subscription(
            &IdempotencyKey::random(),
            &CreateSubscription::new("taken", q),
        )
        .await
        .unwrap()
        .subscription;
    let e = api(client
        .create_subscription(
            &IdempotencyKey::random(),
            &CreateSubscription::new("taken", q),
        )
        .await
        .unwrap_err());
    assert_eq!((e.status, &e.code), (Some(409), &ErrorCode::StateConflict));
    let stale = ConfigureSubscription {
        expected_revision: sub.revision + 1,
        enabled: false,
        reason: "r".to_owned(),
    };
    let e = api(client
        .configure_subscription(&sub.id, &IdempotencyKey::random(), &stale)
        .await
        .unwrap_err());
    assert_eq!((e.status, &e.code), (Some(409), &ErrorCode::StateConflict));

    // EVENT_HISTORY_EXPIRED names the earliest sequence.
    app.publish(&cred, (0..3).map(|_| result(q, "task.failed")).collect())
        .await;
    execute(
        &app,
        &format!("UPDATE queues SET retention_floor = 2 WHERE id = '{q}'"),
    )
    .await;
    let from_one = CreateSubscription {
        from_sequence: Some(1),
        ..CreateSubscription::new("old", q)
    };
    let e = api(client
        .create_subscription(&IdempotencyKey::random(), &from_one)
        .await
        .unwrap_err());
    assert_eq!(
        (e.status, &e.code),
        (Some(410), &ErrorCode::EventHistoryExpired)
    );
    assert_eq!(e.earliest_sequence(), Some(3));
    assert!(!Error::Api(e).is_retryable());
    app.assert_invariants().await;
}

#[actix_web::test]
async fn a_write_sent_again_with_its_key_answers_deduplicated_and_the_key_with_another_request_is_an_idempotency_conflict()
 {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let client = sdk(&app, &cred);
    let key = IdempotencyKey::new("create-orders-1").unwrap();
    let request = CreateSubscription::new("orders", &cred.queue_id);
    let first = client.create_subscription(&key, &request).await.unwrap();
    let again = client.create_subscription(&key, &request).await.unwrap();
    assert!(!first.deduplicated);
    assert!(again.deduplicated);
    assert_eq!(first.subscription, again.subscription);
    let other = CreateSubscription::new("other", &cred.queue_id);
    let e = client.create_subscription(&key, &other).await.unwrap_err();
    assert_eq!(e.code(), Some(&ErrorCode::IdempotencyConflict));
    assert_eq!(app.scalar("SELECT COUNT(*) FROM subscriptions").await, 1);
    app.assert_invariants().await;
}

#[actix_web::test]
async fn a_node_that_does_not_answer_is_a_retryable_transport_error() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let client = Client::new(
        &format!("http://127.0.0.1:{port}"),
        Token::new("t").unwrap(),
    )
    .unwrap();
    let e = client.healthz().await.unwrap_err();
    assert!(matches!(e, Error::Transport(_)), "{e:?}");
    assert!(e.is_retryable());
    assert!(!e.to_string().contains("Bearer"));
}
