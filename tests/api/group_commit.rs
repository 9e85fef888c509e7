//! Group commit of ACKs (decision 0060): a batch of ACKs in one transaction
//! answers each ACK exactly as if it had come alone (delivery-model.md §6).

use orbit_events::{
    delivery::acks,
    domain::{CredentialId, DeliveryId, LeaseSecret, NamespaceId, SubscriptionId},
    store::{
        ack::{AckOutcome, AckRequest, LeaseProof, acknowledge_batch},
        audit::AuditActor,
    },
};
use serde_json::Value;

use crate::{helpers::*, protocol_support::*};

fn request(cred: &Cred, subscription_id: &str, deliver: &Value) -> AckRequest {
    let body = &deliver["body"];
    AckRequest {
        subscription_id: SubscriptionId::parse(subscription_id).unwrap(),
        actor: AuditActor {
            namespace_id: NamespaceId::parse(&cred.namespace_id).unwrap(),
            credential_id: CredentialId::parse(&cred.credential_id).unwrap(),
        },
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

async fn ack_audits(app: &TestApp, r: &AckRequest) -> i64 {
    app.scalar(&format!(
        "SELECT COUNT(*) FROM audit_records WHERE action = 'delivery.ack' AND target_id = '{}'",
        r.proof.delivery_id
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

    // One audit record per ACK that changed a row, none for the others.
    for (r, audits) in [
        (&valid[0], 1),
        (&valid[1], 0),
        (&valid[2], 1),
        (&valid[3], 1),
    ] {
        assert_eq!(ack_audits(&app, r).await, audits, "{}", r.proof.delivery_id);
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

    let out = acks::acknowledge_each(&app.db, &batch).await;
    assert!(!acked(out[0].as_ref().unwrap()).0, "not deduplicated");
    assert!(out[1].is_err(), "{:?}", out[1]);
    assert!(!acked(out[2].as_ref().unwrap()).0, "not deduplicated");
    assert_eq!(ack_audits(&app, &batch[0]).await, 1);
    assert_eq!(ack_audits(&app, &batch[1]).await, 0);
    assert_eq!(ack_audits(&app, &batch[2]).await, 1);
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

    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let sub = subscription(&app, &cred).await;
    let mut sessions = Vec::new();
    for _ in 0..3 {
        sessions.push(app.bind(&cred.token, &sub, 2).await);
    }
    claims_settled(&app, 3).await;
    // The next claim holds the application's only claim slot (before its
    // transaction begins); the other two sessions' claims wait behind it.
    app.state
        .pool
        .send(HoldClaims(Some(HoldPoint::BeforeTransaction)))
        .await
        .unwrap();
    publish_n(&app, &cred, 6, "task.succeeded").await;
    wait_until("6 deliveries materialized", || async {
        app.scalar("SELECT COUNT(*) FROM deliveries").await == 6
    })
    .await;
    let pool = &app.state.pool;
    wait_until("one claim holds the slot and two wait", || async move {
        let s = pool.send(GetPoolStats).await.unwrap();
        s.claims_in_flight == 1 && s.claims_waiting == 2
    })
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
    assert_eq!(ids.len(), 6);
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
        6
    );
    app.assert_invariants().await;
}
