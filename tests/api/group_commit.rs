//! Group commit of ACKs (decision 0060): a batch of ACKs in one transaction
//! answers each ACK exactly as if it had come alone (delivery-model.md §6).

use orbit_events::{
    domain::{CredentialId, DeliveryId, LeaseSecret, SessionId, SubscriptionId},
    store::ack::{AckOutcome, AckRequest, LeaseProof, acknowledge_batch, acknowledge_each},
};
use serde_json::Value;

use crate::{helpers::*, protocol_support::*};

fn request(cred: &Cred, subscription_id: &str, deliver: &Value) -> AckRequest {
    let body = &deliver["body"];
    AckRequest {
        subscription_id: SubscriptionId::parse(subscription_id).unwrap(),
        session_id: SessionId::parse(deliver["session_id"].as_str().unwrap()).unwrap(),
        credential_id: CredentialId::parse(&cred.credential_id).unwrap(),
        proof: LeaseProof {
            delivery_id: DeliveryId::parse(body["delivery"]["id"].as_str().unwrap()).unwrap(),
            epoch: body["delivery"]["lease_epoch"]
                .as_str()
                .unwrap()
                .parse()
                .unwrap(),
            secret: LeaseSecret::parse(body["lease_secret"].as_str().unwrap()).unwrap(),
        },
    }
}

fn acked(outcome: &AckOutcome) -> (bool, i64) {
    match outcome {
        AckOutcome::Acked {
            deduplicated,
            acknowledged_at,
            ..
        } => (*deduplicated, acknowledged_at.micros()),
        other => panic!("expected an ACK, got {other:?}"),
    }
}

async fn acknowledged_at(app: &TestApp, r: &AckRequest) -> i64 {
    app.scalar(&format!(
        "SELECT acknowledged_at FROM deliveries WHERE id = '{}' AND state = 'ACKED'",
        r.proof.delivery_id
    ))
    .await
}

/// 1 when `r`'s ACK is the one recorded on its row (ACKED, at its proof's
/// epoch, from its session), else 0; asserts that no ACK ever wrote an
/// audit record (delivery-model.md §2).
async fn ack_recorded(app: &TestApp, r: &AckRequest) -> i64 {
    assert_eq!(
        app.scalar("SELECT COUNT(*) FROM audit_records WHERE action = 'delivery.ack'")
            .await,
        0,
        "the ACK is recorded on the delivery row, not as an audit record"
    );
    app.scalar(&format!(
        "SELECT COUNT(*) FROM deliveries WHERE id = '{}' AND state = 'ACKED' \
         AND ack_epoch = {} AND COALESCE(ack_session_id, lease_session_id) = '{}'",
        r.proof.delivery_id, r.proof.epoch, r.session_id
    ))
    .await
}

#[actix_web::test]
async fn an_ack_batch_answers_every_ack_as_if_it_came_alone() {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let sub = subscription(&app, &cred).await;
    let other = subscription(&app, &cred).await;
    let mut ws = app.bind(&cred.token, &sub, 4).await;
    let mut ws_other = app.bind(&cred.token, &other, 1).await;
    publish_n(&app, &cred, 4, "task.succeeded").await;
    let mut d = Vec::new();
    for _ in 0..4 {
        d.push(ws.delivery().await);
    }
    let foreign = ws_other.delivery().await;
    // d[3] was acknowledged earlier, on the wire.
    assert_eq!(ws.ack(&d[3]).await["type"], "ack");

    let valid: Vec<AckRequest> = d.iter().map(|f| request(&cred, &sub, f)).collect();
    let mut wrong_secret = valid[1].clone();
    wrong_secret.proof.secret = LeaseSecret::generate();
    let mut older_epoch = valid[2].clone();
    older_epoch.proof.epoch = 0;
    let mut newer_epoch = valid[2].clone();
    newer_epoch.proof.epoch += 1;
    // A delivery of another subscription, on a session of this one.
    let mut foreign = request(&cred, &other, &foreign);
    foreign.subscription_id = valid[0].subscription_id.clone();
    let before_at = acknowledged_at(&app, &valid[3]).await;

    let batch = vec![
        valid[0].clone(),
        valid[0].clone(),
        wrong_secret,
        older_epoch,
        newer_epoch,
        valid[3].clone(),
        foreign,
        valid[2].clone(),
    ];
    let out = acknowledge_batch(&app.db, &batch).await.unwrap();
    assert_eq!(out.len(), batch.len());

    let first_at = acknowledged_at(&app, &valid[0]).await;
    assert_eq!(acked(&out[0]), (false, first_at));
    // The same proof twice in one batch: the second is the duplicate, with
    // the first one's acknowledged_at.
    assert_eq!(acked(&out[1]), (true, first_at));
    assert_eq!(out[2], AckOutcome::LeaseLost, "wrong secret");
    assert_eq!(out[3], AckOutcome::LeaseLost, "older epoch");
    assert_eq!(out[4], AckOutcome::LeaseLost, "newer epoch");
    // Acknowledged before the batch: the original acknowledged_at.
    assert_eq!(acked(&out[5]), (true, before_at));
    assert_eq!(out[6], AckOutcome::NotFound);
    assert_eq!(
        acked(&out[7]),
        (false, acknowledged_at(&app, &valid[2]).await)
    );

    // Each row records the ACK that changed it (the first of a duplicated
    // pair; none while still LEASED).
    for (r, audits) in [
        (&valid[0], 1),
        (&valid[1], 0),
        (&valid[2], 1),
        (&valid[3], 1),
    ] {
        assert_eq!(
            ack_recorded(&app, r).await,
            audits,
            "{}",
            r.proof.delivery_id
        );
    }
    assert_eq!(
        app.scalar(&format!(
            "SELECT revision FROM deliveries WHERE id = '{}'",
            valid[0].proof.delivery_id
        ))
        .await,
        3,
        "materialized, leased, acknowledged"
    );
    assert_eq!(
        app.scalar(&format!(
            "SELECT COUNT(*) FROM deliveries WHERE id = '{}' AND state = 'LEASED'",
            valid[1].proof.delivery_id
        ))
        .await,
        1
    );
    app.assert_invariants().await;
}

#[actix_web::test]
async fn an_ack_the_database_rejects_does_not_fail_the_other_acks_of_its_batch() {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let sub = subscription(&app, &cred).await;
    let mut ws = app.bind(&cred.token, &sub, 3).await;
    publish_n(&app, &cred, 3, "task.succeeded").await;
    let mut batch = Vec::new();
    for _ in 0..3 {
        batch.push(request(&cred, &sub, &ws.delivery().await));
    }
    let rejected = batch[1].proof.delivery_id.to_string();
    match backend_name() {
        "postgres" => {
            execute(
                &app,
                "CREATE FUNCTION reject_update() RETURNS trigger AS $$ \
                 BEGIN RAISE EXCEPTION 'rejected by the test'; END $$ LANGUAGE plpgsql",
            )
            .await;
            execute(
                &app,
                &format!(
                    "CREATE TRIGGER reject_one BEFORE UPDATE ON deliveries FOR EACH ROW \
                     WHEN (OLD.id = '{rejected}') EXECUTE FUNCTION reject_update()"
                ),
            )
            .await;
        }
        _ => {
            execute(
                &app,
                &format!(
                    "CREATE TRIGGER reject_one BEFORE UPDATE ON deliveries \
                     WHEN OLD.id = '{rejected}' BEGIN SELECT RAISE(ABORT, 'rejected by the test'); END"
                ),
            )
            .await;
        }
    }

    let out = acknowledge_each(&app.db, &batch).await;
    assert!(!acked(out[0].as_ref().unwrap()).0, "not deduplicated");
    assert!(out[1].is_err(), "{:?}", out[1]);
    assert!(!acked(out[2].as_ref().unwrap()).0, "not deduplicated");
    assert_eq!(ack_recorded(&app, &batch[0]).await, 1);
    assert_eq!(ack_recorded(&app, &batch[1]).await, 0);
    assert_eq!(ack_recorded(&app, &batch[2]).await, 1);
    assert_eq!(
        app.scalar(&format!(
            "SELECT COUNT(*) FROM deliveries WHERE id = '{rejected}' AND state = 'LEASED'"
        ))
        .await,
        1,
        "nothing of the rejected ACK was written"
    );
    let drop = match backend_name() {
        "postgres" => "DROP TRIGGER reject_one ON deliveries",
        _ => "DROP TRIGGER reject_one",
    };
    execute(&app, drop).await;
    app.assert_invariants().await;
}

#[cfg(feature = "test-hooks")]
#[actix_web::test]
async fn claims_of_sessions_of_one_subscription_waiting_together_share_one_transaction() {
    use orbit_events::delivery::pool::{GetPoolStats, HoldClaims, HoldPoint};
    use std::collections::HashSet;

    // No fallback poll, and one session more than the claims the test
    // needs: a claim that started just before the hold was set (a poll's,
    // or one the scanner enqueued for a late wake) does not stop at the
    // hold point; if it then runs after the publish it leases one
    // session's share while the others queue, and those then start
    // together and hold the slot. Four sessions leave at least three
    // claims to queue then.
    let app = spawn_app_with(|s| s.timing.scan_interval_ms = 600_000).await;
    let cred = app.bootstrap().await;
    let sub = subscription(&app, &cred).await;
    let mut sessions = Vec::new();
    for _ in 0..4 {
        sessions.push(app.bind(&cred.token, &sub, 2).await);
    }
    claims_settled(&app, 4).await;
    // The next claim holds the application's only claim slot (before its
    // transaction begins); the other sessions' claims wait behind it.
    app.state
        .pool
        .send(HoldClaims(Some(HoldPoint::BeforeTransaction)))
        .await
        .unwrap();
    // The sessions wait, so their claims materialize the 8 results
    // themselves, inside the claim transaction (delivery-model.md §5).
    publish_n(&app, &cred, 8, "task.succeeded").await;
    let pool = &app.state.pool;
    // One transaction holds the slot and at least two claims wait behind
    // it — or, when a claim that started before the hold ran first, the
    // claims that waited behind it already hold the slot together.
    wait_until(
        "one transaction holds the slot, with or before at least two claims",
        || async move {
            let s = pool.send(GetPoolStats).await.unwrap();
            s.claims_in_flight == 1 && (s.claims_waiting >= 2 || s.claims_running >= 2)
        },
    )
    .await;
    app.state.pool.send(HoldClaims(None)).await.unwrap();

    // Capacity 2 each: every session receives exactly 2 before any ACK.
    let mut received = Vec::new();
    let mut ids = HashSet::new();
    for ws in &mut sessions {
        let mut mine = Vec::new();
        for _ in 0..2 {
            let d = ws.delivery().await;
            assert!(ids.insert(d["body"]["delivery"]["id"].as_str().unwrap().to_owned()));
            mine.push(d);
        }
        received.push(mine);
    }
    assert_eq!(ids.len(), 8);
    for (ws, mine) in sessions.iter_mut().zip(&received) {
        for d in mine {
            assert_eq!(ws.ack(d).await["type"], "ack");
        }
    }
    let s = app.state.pool.send(GetPoolStats).await.unwrap();
    assert!(s.max_claims_per_transaction_seen >= 2, "{s:?}");
    assert_eq!(s.max_claims_in_flight_per_application_seen, 1, "{s:?}");
    assert_eq!(
        app.scalar("SELECT COUNT(*) FROM deliveries WHERE state = 'ACKED' AND revision = 3")
            .await,
        8
    );
    app.assert_invariants().await;
}

/// One claim batch may span subscriptions (decision 0089): each claim is
/// decided as if alone, in batch order within its subscription, and two
/// subscriptions of one queue each lease their own row of the same event.
#[actix_web::test]
async fn a_claim_batch_over_two_subscriptions_of_one_queue_leases_each_its_own_rows_in_order() {
    use orbit_events::store::{
        Waiter,
        claim::{ClaimOutcome, ClaimTarget, claim_each},
    };
    use std::{sync::Arc, time::Duration};

    let app = spawn_app_with(|s| s.timing.scan_interval_ms = 600_000).await;
    let cred = app.bootstrap().await;
    let a = subscription(&app, &cred).await;
    let b = subscription(&app, &cred).await;
    let events = app
        .publish(
            &cred,
            (0..2)
                .map(|_| result(&cred.queue_id, "task.succeeded"))
                .collect(),
        )
        .await;
    let alive = Arc::new(());
    let target = |sub: &str| ClaimTarget {
        session_id: SessionId::generate(),
        subscription_id: SubscriptionId::parse(sub).unwrap(),
        credential_id: CredentialId::parse(&cred.credential_id).unwrap(),
        capacity: 8,
        waiter: Waiter::while_alive(&alive),
    };
    // A, B, A: the second claim of A comes after B's in the batch.
    let claims = [(target(&a), 2), (target(&b), 2), (target(&a), 2)];
    let outcomes = claim_each(
        &app.db,
        &claims,
        Duration::from_secs(30),
        std::future::ready(()),
    )
    .await;
    /// A delivery leased: its subscription, event and sequence.
    type Lease = (String, String, i64);
    let leased: Vec<(Vec<Lease>, bool)> = outcomes
        .into_iter()
        .map(|o| match o.unwrap() {
            ClaimOutcome::Leased {
                deliveries,
                exhausted,
                ..
            } => (
                deliveries
                    .iter()
                    .map(|d| {
                        assert_eq!(d.event.id, d.delivery.event_id);
                        (
                            d.delivery.subscription_id.clone(),
                            d.delivery.event_id.clone(),
                            d.delivery.sequence,
                        )
                    })
                    .collect(),
                exhausted,
            ),
            other => panic!("expected leases, got {other:?}"),
        })
        .collect();
    let both: Vec<String> = events.iter().map(|(id, _)| id.clone()).collect();
    let of = |claim: usize| -> Vec<String> {
        leased[claim].0.iter().map(|(_, e, _)| e.clone()).collect()
    };
    // The first claim of A takes A's two rows, in sequence order; B's
    // claim takes B's rows of the same two events; A's second finds none.
    assert_eq!(of(0), both);
    assert!(leased[0].0.iter().all(|(s, _, _)| s == &a));
    assert_eq!(of(1), both);
    assert!(leased[1].0.iter().all(|(s, _, _)| s == &b));
    assert!(of(2).is_empty() && leased[2].1, "{leased:?}");
    assert_eq!(
        app.scalar("SELECT COUNT(*) FROM deliveries WHERE state = 'LEASED'")
            .await,
        4
    );
    app.assert_invariants().await;
}

mod publishes {
    //! Group commit of publishes (decision 0063): publish requests in one
    //! transaction answer each request exactly as if it had come alone
    //! (http-api.md §2 idempotency, §4 result ingest).

    use std::time::Duration;

    use orbit_events::{
        domain::{CredentialId, QueueId, ResultType, now, random_hex_id},
        journal::NewResult,
        store::{
            Commitment,
            idempotency::{IdempotencyKey, WriteIdentity},
            publish::{PublishRequest, Published, publish_each},
        },
    };
    use serde_json::{Value, json};

    use crate::helpers::*;

    /// The sequences of a publish answer's events.
    fn of(data: &Value) -> Vec<i64> {
        data["events"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["sequence"].as_str().unwrap().parse().unwrap())
            .collect()
    }

    fn request(cred: &Cred, key: &str, queue_id: &str, body: &str, n: usize) -> PublishRequest {
        let results = (0..n)
            .map(|i| NewResult {
                result_type: ResultType::Succeeded,
                aggregate_id: format!("task-{body}-{i}"),
                aggregate_revision: "1".to_owned(),
                occurred_at: now(),
                details: r#"{"state":"SUCCEEDED"}"#.to_owned(),
                snapshot: r#"{"state":"SUCCEEDED"}"#.to_owned(),
            })
            .collect();
        PublishRequest {
            identity: WriteIdentity::new(
                &CredentialId::parse(&cred.credential_id).unwrap(),
                IdempotencyKey::parse(key).unwrap(),
                "results.publish",
                queue_id,
                &json!({ "body": body, "n": n }),
            )
            .unwrap(),
            queue_id: QueueId::parse(queue_id).unwrap(),
            results,
            commitment: Commitment::new(),
        }
    }

    fn sequences(outcome: &Published) -> Vec<i64> {
        match outcome {
            Published::Fresh(data) => of(data),
            other => panic!("expected a fresh publish, got {other:?}"),
        }
    }

    fn replayed(outcome: &Published) -> Value {
        match outcome {
            Published::Replay(data) => data.clone(),
            other => panic!("expected a replay, got {other:?}"),
        }
    }

    const TTL: Duration = Duration::from_secs(3600);

    #[actix_web::test]
    async fn a_publish_batch_answers_every_request_as_if_it_came_alone() {
        let app = spawn_app().await;
        let cred = app.bootstrap().await;
        let q = cred.queue_id.clone();
        let unknown_queue = "0".repeat(32);

        let earlier = publish_each(
            &app.db,
            &[request(&cred, "k0", &q, "a", 1)],
            TTL,
            &|_, _| {},
        )
        .await;
        assert_eq!(sequences(earlier[0].as_ref().unwrap()), vec![1]);

        let batch = vec![
            request(&cred, "k1", &q, "b", 2),             // fresh
            request(&cred, "k0", &q, "a", 1),             // replay of the earlier request
            request(&cred, "k0", &q, "other", 1),         // the key, another request
            request(&cred, "k2", &unknown_queue, "c", 1), // unknown queue
            request(&cred, "k1", &q, "b", 2),             // repeat of the first, same batch
            request(&cred, "k1", &q, "other", 1),         // its key, another request
            request(&cred, "k3", &q, "d", 1),             // fresh, after the first
        ];
        let out = publish_each(&app.db, &batch, TTL, &|_, _| {}).await;
        assert_eq!(out.len(), batch.len());

        assert_eq!(sequences(out[0].as_ref().unwrap()), vec![2, 3]);
        let replay = replayed(out[1].as_ref().unwrap());
        assert_eq!(
            (of(&replay), &replay["deduplicated"]),
            (vec![1], &json!(true))
        );
        assert_eq!(
            out[2].as_ref().unwrap_err().code().as_str(),
            "IDEMPOTENCY_CONFLICT"
        );
        assert_eq!(out[3].as_ref().unwrap_err().code().as_str(), "NOT_FOUND");
        let replay = replayed(out[4].as_ref().unwrap());
        assert_eq!(
            (of(&replay), &replay["deduplicated"]),
            (vec![2, 3], &json!(true))
        );
        assert_eq!(
            out[5].as_ref().unwrap_err().code().as_str(),
            "IDEMPOTENCY_CONFLICT"
        );
        assert_eq!(sequences(out[6].as_ref().unwrap()), vec![4]);

        // Nothing was written for the refused requests: four events in the
        // log, the head at 4, no record under k2.
        let events = app
            .scalar(&format!(
                "SELECT COUNT(*) FROM result_events WHERE queue_id = '{q}'"
            ))
            .await;
        assert_eq!(events, 4);
        let head = app
            .scalar(&format!(
                "SELECT head_sequence FROM queues WHERE id = '{q}'"
            ))
            .await;
        assert_eq!(head, 4);
        let k2 = app
            .scalar("SELECT COUNT(*) FROM idempotency_records WHERE key = 'k2'")
            .await;
        assert_eq!(k2, 0);
        app.assert_invariants().await;
    }

    #[actix_web::test]
    async fn a_publish_past_its_deadline_while_waiting_for_its_batch_gets_503_and_writes_nothing() {
        let app = spawn_app_with(|s| s.timing.http_request_timeout_ms = 300).await;
        let cred = app.bootstrap().await;
        let (blocker, txn) = crate::http_support::hold_idempotency_writes(&app).await;
        let path = format!("/v1/queues/{}/results", cred.queue_id);
        let body = json!({ "results": [result(&cred.queue_id, "task.succeeded")] });
        let res = app.post(&path, &cred.token, "slow", &body).await;
        res.assert_error(503, "UNAVAILABLE");
        txn.rollback().await.unwrap();
        blocker.close().await.unwrap();
        // Nothing of it was written, not even once the batch got the lock:
        // the same key applies afresh (201, not a 200 replay).
        crate::http_support::assert_publish_key_applies_afresh(&app, &cred, "slow", &body, 1).await;
        app.assert_invariants().await;
    }

    #[actix_web::test]
    async fn concurrent_publishes_with_one_key_append_once_and_replay_for_the_others() {
        let app = spawn_app().await;
        let cred = app.bootstrap().await;
        let path = format!("/v1/queues/{}/results", cred.queue_id);
        let body = json!({ "results": [result(&cred.queue_id, "task.succeeded")] });
        let key = random_hex_id();
        let answers = futures_util::future::join_all(
            (0..20).map(|_| app.post(&path, &cred.token, &key, &body)),
        )
        .await;
        let fresh: Vec<_> = answers.iter().filter(|r| r.status == 201).collect();
        assert_eq!(fresh.len(), 1, "{answers:#?}");
        let events = &fresh[0].data()["events"];
        for answer in &answers {
            if answer.status != 201 {
                assert_eq!(answer.status, 200, "{:#}", answer.body);
                assert_eq!(answer.data()["deduplicated"], true);
                assert_eq!(&answer.data()["events"], events);
            }
        }
        let appended = app
            .scalar(&format!(
                "SELECT COUNT(*) FROM result_events WHERE queue_id = '{}'",
                cred.queue_id
            ))
            .await;
        assert_eq!(appended, 1);
        app.assert_invariants().await;
    }

    #[actix_web::test]
    async fn concurrent_publishes_get_consecutive_sequences_in_their_batches() {
        let app = spawn_app().await;
        let cred = app.bootstrap().await;
        let path = format!("/v1/queues/{}/results", cred.queue_id);
        let answers = futures_util::future::join_all((0..40).map(|i| {
            let n = 1 + i % 3;
            let results: Vec<Value> = (0..n)
                .map(|_| result(&cred.queue_id, "task.failed"))
                .collect();
            let body = json!({ "results": results });
            let path = path.clone();
            let app = &app;
            let token = cred.token.clone();
            async move { app.post(&path, &token, &random_hex_id(), &body).await }
        }))
        .await;
        let mut all = Vec::new();
        for answer in &answers {
            assert_eq!(answer.status, 201, "{:#}", answer.body);
            let seqs: Vec<u64> = answer.data()["events"]
                .as_array()
                .unwrap()
                .iter()
                .map(|e| e["sequence"].as_str().unwrap().parse().unwrap())
                .collect();
            // A request's results are appended together, in its order.
            assert!(seqs.windows(2).all(|w| w[1] == w[0] + 1), "{seqs:?}");
            all.extend(seqs);
        }
        all.sort_unstable();
        let expected: Vec<u64> = (1..=all.len() as u64).collect();
        assert_eq!(all, expected, "no gap and no sequence twice");
        app.assert_invariants().await;
    }
}

mod claims_for_known_rows {
    //! Decision 0064: one new row wakes one claim, not one per session with
    //! room, and an ACK (which makes no row claimable) wakes none.

    use serde_json::json;

    use crate::{helpers::*, metrics::scrape, protocol_support::*};

    async fn settled(app: &TestApp) -> bool {
        let m = scrape(app).await;
        m.value("orbit_events_claims_in_flight", &[]) == 0.0
            && m.value("orbit_events_claims_waiting", &[]) == 0.0
    }

    async fn claims(app: &TestApp, cred: &Cred) -> f64 {
        scrape(app).await.value(
            "orbit_events_claims_total",
            &[("application_id", cred.application_id.as_str())],
        )
    }

    /// Publishes one result, receives it on whichever session gets it and
    /// ACKs it; returns when no claim is waiting or running.
    async fn one_result_round_trip(app: &TestApp, cred: &Cred, sessions: &mut [WsClient]) {
        app.publish(cred, vec![result(&cred.queue_id, "task.succeeded")])
            .await;
        let (delivery, index, _) =
            futures_util::future::select_all(sessions.iter_mut().map(|ws| Box::pin(ws.delivery())))
                .await;
        let ack = sessions[index].ack(&delivery).await;
        assert_eq!(ack["type"], "ack", "{ack:#}");
        wait_until("no claim waits or runs", || settled(app)).await;
    }

    #[actix_web::test]
    async fn one_new_row_wakes_one_claim_and_its_ack_wakes_none() {
        // No fallback poll during the test: every claim was caused by the
        // publish or the ACK.
        let app = spawn_app_with(|s| s.timing.scan_interval_ms = 600_000).await;
        let cred = app.bootstrap().await;
        let sub = app.subscribe(&cred, json!({})).await;
        let sub_id = sub["id"].as_str().unwrap().to_owned();
        let mut sessions = Vec::new();
        for _ in 0..4 {
            sessions.push(app.bind(&cred.token, &sub_id, 8).await);
        }
        // The claims of the new sessions, and a first row, before counting.
        one_result_round_trip(&app, &cred, &mut sessions).await;

        let before = claims(&app, &cred).await;
        one_result_round_trip(&app, &cred, &mut sessions).await;
        let after = claims(&app, &cred).await;
        assert_eq!(
            after - before,
            1.0,
            "claims for one new row and its ACK, with 4 sessions with room"
        );
        app.assert_invariants().await;
    }
}
