//! Write rounds on SQLite (decision 0068): writes that share a round's
//! transaction never change each other's outcome. On PostgreSQL every
//! write has its own transaction, so the same scenarios hold trivially.

use crate::{helpers::*, protocol_support::*};

/// Makes every claim of `subscription_id` fail in the database: a row of it
/// cannot become LEASED (a rejection only that write meets).
async fn reject_leases_of(app: &TestApp, subscription_id: &str) {
    use orbit_events::store::execute_unprepared;
    let statements = if backend_name() == "postgres" {
        vec![
            "CREATE FUNCTION reject_lease() RETURNS trigger AS $$ BEGIN \
             RAISE EXCEPTION 'leases of this subscription are rejected'; END $$ \
             LANGUAGE plpgsql"
                .to_owned(),
            // A lease is an update of a PENDING row or, when a claim
            // materializes, the insert of a LEASED one.
            format!(
                "CREATE TRIGGER reject_leases BEFORE INSERT OR UPDATE ON deliveries \
                 FOR EACH ROW WHEN (NEW.subscription_id = '{subscription_id}' \
                 AND NEW.state = 'LEASED') EXECUTE FUNCTION reject_lease()"
            ),
        ]
    } else {
        ["INSERT", "UPDATE"]
            .iter()
            .map(|on| {
                format!(
                    "CREATE TRIGGER reject_leases_{on} BEFORE {on} ON deliveries FOR EACH ROW \
                     WHEN NEW.subscription_id = '{subscription_id}' AND NEW.state = 'LEASED' \
                     BEGIN SELECT RAISE(ABORT, 'leases of this subscription are rejected'); END"
                )
            })
            .collect()
    };
    let txn = app.db.begin_write().await.unwrap();
    for sql in statements {
        execute_unprepared(&*txn, &sql).await.unwrap();
    }
    txn.commit().await.unwrap();
}

#[cfg(feature = "test-hooks")]
#[actix_web::test]
async fn an_ack_that_shares_a_commit_with_a_claim_the_database_rejects_is_still_acknowledged() {
    use orbit_events::delivery::pool::{GetPoolStats, HoldClaims, HoldPoint};

    let app = spawn_app_with(|s| s.timing.scan_interval_ms = 600_000).await;
    let acker = app
        .bootstrap_with("demo", "acker", "acker-queue", true, true)
        .await;
    let rejected = app
        .bootstrap_with("demo", "rejected", "rejected-queue", true, true)
        .await;
    let acker_sub = subscription(&app, &acker).await;
    let rejected_sub = subscription(&app, &rejected).await;
    let mut ws = app.bind(&acker.token, &acker_sub, 2).await;
    let _rejected_ws = app.bind(&rejected.token, &rejected_sub, 1).await;
    publish_n(&app, &acker, 1, "task.succeeded").await;
    let d = ws.delivery().await;
    // The two bindings' claims; the result is leased by a claim of its own
    // or, when the publish commits while the acker's first claim is still
    // queued, by that one, so a third claim is not certain.
    claims_settled(&app, 2).await;

    // The next claim (the rejected subscription's) stops inside its
    // transaction: on SQLite it keeps its write round open.
    reject_leases_of(&app, &rejected_sub).await;
    app.state
        .pool
        .send(HoldClaims(Some(HoldPoint::InsideTransaction)))
        .await
        .unwrap();
    // On SQLite the publish shares its round with the claim it woke
    // (decision 0098), so it is answered once that claim ran on.
    let published = std::sync::atomic::AtomicBool::new(false);
    let publishing = async {
        publish_n(&app, &rejected, 1, "task.succeeded").await;
        published.store(true, std::sync::atomic::Ordering::SeqCst);
    };
    let ack = ws.envelope("event.ack", proof(&d));
    let ack_id = ack["message_id"].clone();
    let acking = async {
        let (pool, db, published) = (&app.state.pool, &app.state.db, &published);
        // Held with its seat taken: in the publish's round (2 seats, the
        // publish unanswered), or alone once the publish committed (1).
        wait_until("the rejected subscription's claim is held", || async move {
            let seated = db.write_round_seated();
            pool.send(GetPoolStats).await.unwrap().claims_in_flight == 1
                && (backend_name() != "sqlite"
                    || seated == 2
                    || (seated == 1 && published.load(std::sync::atomic::Ordering::SeqCst)))
        })
        .await;
        let seated = db.write_round_seated();
        ws.send_json(ack).await;
        if backend_name() == "sqlite" {
            wait_until("the ACK took a seat in the claim's round", || async move {
                db.write_round_seated() == seated + 1
            })
            .await;
        }
        // The claim runs on and the database rejects it.
        app.state.pool.send(HoldClaims(None)).await.unwrap();
    };
    tokio::join!(publishing, acking);

    let reply = ws.frame().await;
    assert_eq!(reply["type"], "ack", "{reply:#}");
    assert_eq!(reply["reply_to"], ack_id);
    assert_eq!(reply["body"]["deduplicated"], false, "{reply:#}");
    assert_eq!(
        app.scalar(&format!(
            "SELECT COUNT(*) FROM deliveries WHERE subscription_id = '{acker_sub}' AND state = 'ACKED'"
        ))
        .await,
        1
    );
    assert_eq!(
        app.scalar(&format!(
            "SELECT COUNT(*) FROM deliveries WHERE subscription_id = '{rejected_sub}' AND state = 'LEASED'"
        ))
        .await,
        0
    );
    // The connection stays open and usable.
    assert_eq!(ws.ping().await["type"], "ack");
    app.assert_invariants().await;
}
