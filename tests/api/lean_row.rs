//! Migration 0079, the lean delivery row (decision 0079): an existing
//! database upgrades in place, keeps every row, records the ACK on the row
//! (delivery-model.md §2) and serves the hot queries from partial indexes.

use migration::MigratorTrait;
use serde_json::json;

use crate::{helpers::*, retention::create_sub};

/// The partial indexes of 0079 that exist now.
async fn lean_indexes(app: &TestApp) -> i64 {
    let names = "('ix_deliveries_pending_claim', 'ix_deliveries_leased_session', \
                 'ix_deliveries_leased_until', 'ix_deliveries_acked_at', \
                 'ix_deliveries_expired_created')";
    let sql = match backend_name() {
        "postgres" => format!("SELECT COUNT(*) FROM pg_indexes WHERE indexname IN {names}"),
        _ => format!("SELECT COUNT(*) FROM sqlite_master WHERE type = 'index' AND name IN {names}"),
    };
    app.scalar(&sql).await
}

/// Deliveries of subscription `s` in `state`.
async fn in_state(app: &TestApp, s: &str, state: &str) -> i64 {
    app.scalar(&format!(
        "SELECT COUNT(*) FROM deliveries WHERE subscription_id = '{s}' AND state = '{state}'"
    ))
    .await
}

#[actix_web::test]
async fn the_lean_row_migration_upgrades_a_database_with_acked_rows_in_place_and_records_later_acks_on_the_row()
 {
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let q = cred.queue_id.clone();
    let s = create_sub(&app, &cred, json!({ "from_sequence": "0" })).await;
    let mut ws = app.bind(&cred.token, &s, 4).await;
    app.publish(
        &cred,
        (0..4).map(|_| result(&q, "task.succeeded")).collect(),
    )
    .await;
    for _ in 0..2 {
        let d = ws.delivery().await;
        assert_eq!(ws.ack(&d).await["type"], "ack");
    }
    assert_eq!(lean_indexes(&app).await, 5);

    // Back to the schema before 0079 (its columns and indexes gone, and
    // every migration after it), then forward again over the ACKED rows,
    // each in its own transaction.
    let txn = app.db.begin_write().await.unwrap();
    let steps = steps_back_to("m20261201_000079_lean_deliveries");
    migration::Migrator::down(&*txn, Some(steps)).await.unwrap();
    txn.commit().await.unwrap();
    assert_eq!(lean_indexes(&app).await, 0);
    let txn = app.db.begin_write().await.unwrap();
    migration::Migrator::up(&*txn, None).await.unwrap();
    txn.commit().await.unwrap();
    assert_eq!(lean_indexes(&app).await, 5);
    assert_eq!(
        app.scalar(&format!(
            "SELECT COUNT(*) FROM deliveries WHERE subscription_id = '{s}' AND state = 'ACKED' \
             AND ack_epoch = lease_epoch AND ack_session_id IS NULL"
        ))
        .await,
        2,
        "rows ACKED before the migration: the epoch they proved, no session (never recorded)"
    );

    // The node goes on: the rest are delivered, and their ACKs are recorded
    // on their rows with the session they came on.
    for _ in 0..2 {
        let d = ws.delivery().await;
        assert_eq!(ws.ack(&d).await["type"], "ack");
        assert_eq!(
            app.scalar(&format!(
                "SELECT COUNT(*) FROM deliveries WHERE id = '{}' AND state = 'ACKED' \
                 AND ack_epoch = 1 AND COALESCE(ack_session_id, lease_session_id) = '{}'",
                d["body"]["delivery"]["id"].as_str().unwrap(),
                d["session_id"].as_str().unwrap()
            ))
            .await,
            1
        );
    }
    assert_eq!(
        app.scalar(&format!(
            "SELECT COUNT(*) FROM deliveries WHERE subscription_id = '{s}' AND state = 'ACKED'"
        ))
        .await,
        4
    );
    app.assert_invariants().await;
}

/// delivery-model.md §5 "Materialize and lease in one step": a result for
/// a subscription whose session waits is inserted and leased by one claim
/// transaction (PostgreSQL: both row versions carry one transaction id),
/// and what the consumer sees is what materialize-then-claim gives
/// (revision 2, epoch 1, attempt 1).
#[actix_web::test]
async fn a_waiting_sessions_claim_inserts_a_new_result_already_leased_in_one_write() {
    let app = spawn_app_with(|s| s.timing.scan_interval_ms = 600_000).await;
    let cred = app.bootstrap().await;
    let s = create_sub(&app, &cred, json!({})).await;
    // Every write to a delivery row, with its transaction where the
    // backend tells it (SQLite's single writer: one transaction at a time).
    let log_writes: &[&str] = match app.db.backend() {
        sea_orm::DbBackend::Postgres => &[
            "CREATE TABLE delivery_writes (id TEXT, state TEXT, xid BIGINT)",
            "CREATE FUNCTION log_delivery_write() RETURNS trigger AS $$ BEGIN \
             INSERT INTO delivery_writes VALUES (NEW.id, NEW.state, txid_current()); \
             RETURN NEW; END $$ LANGUAGE plpgsql",
            "CREATE TRIGGER log_delivery_writes AFTER INSERT OR UPDATE ON deliveries \
             FOR EACH ROW EXECUTE FUNCTION log_delivery_write()",
        ],
        _ => &[
            "CREATE TABLE delivery_writes (id TEXT, state TEXT, xid BIGINT)",
            "CREATE TRIGGER log_delivery_inserts AFTER INSERT ON deliveries \
             BEGIN INSERT INTO delivery_writes VALUES (NEW.id, NEW.state, 0); END",
            "CREATE TRIGGER log_delivery_updates AFTER UPDATE ON deliveries \
             BEGIN INSERT INTO delivery_writes VALUES (NEW.id, NEW.state, 0); END",
        ],
    };
    for sql in log_writes {
        crate::protocol_support::execute(&app, sql).await;
    }
    let mut ws = app.bind(&cred.token, &s, 4).await;
    // The session's first claim (it found nothing) has settled: the
    // session waits when the result is appended.
    crate::protocol_support::claims_settled(&app, 1).await;
    app.publish(&cred, vec![result(&cred.queue_id, "task.succeeded")])
        .await;
    let d = ws.delivery().await;
    let delivery = &d["body"]["delivery"];
    assert_eq!(delivery["state"], "LEASED");
    assert_eq!(delivery["revision"], "2");
    assert_eq!(delivery["lease_epoch"], "1");
    assert_eq!(delivery["attempts"], 1);
    let id = delivery["id"].as_str().unwrap();
    assert_eq!(
        app.scalar(&format!(
            "SELECT COUNT(DISTINCT xid) FROM delivery_writes WHERE id = '{id}' \
             AND state IN ('PENDING', 'LEASED')"
        ))
        .await,
        1,
        "materialized and leased by one transaction"
    );
    assert_eq!(
        app.column::<String>(&format!(
            "SELECT state FROM delivery_writes WHERE id = '{id}' AND state IN ('PENDING', 'LEASED')"
        ))
        .await,
        vec!["LEASED".to_owned()],
        "inserted LEASED: one write, never a PENDING row first"
    );
    assert_eq!(ws.ack(&d).await["type"], "ack");
    app.assert_invariants().await;
}

/// Decision 0098 (SQLite): a result published while a session waits is
/// leased in its publish's own write round, so one commit lies between the
/// publish and its `event.deliver` (the claim woken by the publish takes a
/// seat before the round closes), and the deliver still follows it.
#[actix_web::test]
async fn a_result_published_while_a_session_waits_is_leased_by_its_publishs_own_commit() {
    if skip_unless_backend("sqlite", "write rounds exist on SQLite only") {
        return;
    }
    let app = spawn_app_with(|s| s.timing.scan_interval_ms = 600_000).await;
    let cred = app.bootstrap().await;
    let s = create_sub(&app, &cred, json!({})).await;
    // Capacity 1: once leased, the session asks for nothing more.
    let mut ws = app.bind(&cred.token, &s, 1).await;
    crate::protocol_support::claims_settled(&app, 1).await;
    let before = app.state.db.write_rounds_started();
    app.publish(&cred, vec![result(&cred.queue_id, "task.succeeded")])
        .await;
    let d = ws.delivery().await;
    assert_eq!(d["body"]["delivery"]["state"], "LEASED");
    assert_eq!(
        app.state.db.write_rounds_started() - before,
        1,
        "the publish and the claim it woke share one round (one commit)"
    );
    // The lease is in the database.
    let id = d["body"]["delivery"]["id"].as_str().unwrap();
    assert_eq!(
        app.column::<String>(&format!("SELECT state FROM deliveries WHERE id = '{id}'"))
            .await,
        vec!["LEASED".to_owned()]
    );
    assert_eq!(ws.ack(&d).await["type"], "ack");
    app.assert_invariants().await;
}

/// Decision 0094 (stack-notes "Hot row"): on PostgreSQL an ACK does not
/// write the subscription row, so it never waits for that row's lock,
/// which a claim that materializes holds through its commit. What it takes
/// off `pending_count` is a tally: readers see it at once, the next
/// materialization folds it in, and the backlog window refills from it.
#[actix_web::test]
async fn an_ack_never_waits_for_the_subscription_row_lock_and_the_window_refills_from_its_tally() {
    use sea_orm::{ConnectionTrait, TransactionTrait};
    if skip_unless_postgres() {
        return;
    }
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    let q = cred.queue_id.clone();
    let s = create_sub(&app, &cred, json!({ "max_pending": 2 })).await;
    let mut ws = app.bind(&cred.token, &s, 4).await;
    app.publish(
        &cred,
        (0..4).map(|_| result(&q, "task.succeeded")).collect(),
    )
    .await;
    // The window (2) is full: two delivered, two wait in the log.
    let first = ws.delivery().await;
    let second = ws.delivery().await;

    let conn = sea_orm::Database::connect(app.settings.database.url.as_str())
        .await
        .unwrap();
    let lock = conn.begin().await.unwrap();
    lock.execute_unprepared(&format!(
        "SELECT id FROM subscriptions WHERE id = '{s}' FOR UPDATE"
    ))
    .await
    .unwrap();
    for d in [&first, &second] {
        let reply = tokio::time::timeout(std::time::Duration::from_secs(5), ws.ack(d))
            .await
            .expect("the ACK waited for the subscription row lock");
        assert_eq!(reply["type"], "ack", "{reply}");
    }
    let view = app
        .get(&format!("/v1/subscriptions/{s}"), &cred.token)
        .await;
    assert_eq!(view.data()["pending_count"], 0, "the tallies count at once");
    app.assert_invariants().await;
    lock.rollback().await.unwrap();

    // The next materialization folds the tallies in: the window has room
    // for the two results left, and they are delivered.
    for _ in 0..2 {
        let d = ws.delivery().await;
        assert_eq!(ws.ack(&d).await["type"], "ack");
    }
    assert_eq!(
        app.scalar(&format!(
            "SELECT COUNT(*) FROM deliveries WHERE subscription_id = '{s}' AND state = 'ACKED'"
        ))
        .await,
        4
    );
    app.assert_invariants().await;
}

/// Decisions 0103 and 0105 (delivery-model.md §5), both backends: a claim
/// that materializes inserts one LEASED row per slot it fills and stops
/// before the next matching entry, so the rest of the log stays below the
/// subscription's cursor for the next claim (one write per row) or for the
/// scanner, which inserts it PENDING.
#[actix_web::test]
async fn a_claim_inserts_only_the_rows_it_leases_and_leaves_the_rest_below_the_cursor() {
    use orbit_events::{
        domain::{CredentialId, SessionId, SubscriptionId},
        store::{
            Waiter,
            claim::{ClaimOutcome, ClaimTarget, claim},
            materialize::materialize,
        },
    };
    use std::{sync::Arc, time::Duration};

    let app = spawn_app_with(|s| s.timing.scan_interval_ms = 600_000).await;
    let cred = app.bootstrap().await;
    let s = create_sub(&app, &cred, json!({ "from_sequence": "0" })).await;
    let events = app
        .publish(
            &cred,
            (0..10)
                .map(|_| result(&cred.queue_id, "task.succeeded"))
                .collect(),
        )
        .await;
    let alive = Arc::new(());
    let target = ClaimTarget {
        session_id: SessionId::generate(),
        subscription_id: SubscriptionId::parse(&s).unwrap(),
        credential_id: CredentialId::parse(&cred.credential_id).unwrap(),
        capacity: 8,
        waiter: Waiter::while_alive(&alive),
    };
    let cursor = || async {
        app.scalar(&format!(
            "SELECT cursor_sequence FROM subscriptions WHERE id = '{s}'"
        ))
        .await
    };
    let mut leased = Vec::new();
    for want in [3, 2] {
        let outcome = claim(&app.db, &target, want, Duration::from_secs(30))
            .await
            .unwrap();
        let ClaimOutcome::Leased {
            deliveries,
            exhausted,
            behind_head,
            ..
        } = outcome
        else {
            panic!("expected leases, got {outcome:?}");
        };
        assert_eq!(deliveries.len(), want as usize);
        assert!(!exhausted && behind_head);
        leased.extend(deliveries.iter().map(|d| d.delivery.event_id.clone()));
        assert_eq!(in_state(&app, &s, "LEASED").await, leased.len() as i64);
        assert_eq!(
            in_state(&app, &s, "PENDING").await,
            0,
            "no row inserted beyond the slots"
        );
        assert_eq!(cursor().await, events[leased.len() - 1].1 as i64);
    }
    let first_five: Vec<String> = events[..5].iter().map(|(id, _)| id.clone()).collect();
    assert_eq!(leased, first_five, "in log order");

    // The scanner inserts the rest PENDING, as for a session without room.
    let m = materialize(&app.db, &target.subscription_id).await.unwrap();
    assert_eq!((m.inserted, m.caught_up), (5, true));
    assert_eq!(in_state(&app, &s, "PENDING").await, 5);
    assert_eq!(cursor().await, events[9].1 as i64);
    app.assert_invariants().await;
}

/// delivery-model.md §5: "The scanner still materializes PENDING rows for
/// subscriptions with no session waiting, so a backlog is visible and
/// bounded by `max_pending`." The results beyond the session's claim, left
/// to its next claim while it had room, are materialized once the session
/// reports that it has none (decision 0103).
#[actix_web::test]
async fn a_backlog_behind_a_session_without_room_is_materialized_pending_up_to_max_pending() {
    let app = spawn_app_with(|s| s.timing.scan_interval_ms = 600_000).await;
    let cred = app.bootstrap().await;
    let s = create_sub(&app, &cred, json!({ "max_pending": 6 })).await;
    let mut ws = app.bind(&cred.token, &s, 2).await;
    crate::protocol_support::claims_settled(&app, 1).await;
    crate::protocol_support::publish_n(&app, &cred, 10, "task.succeeded").await;
    for _ in 0..2 {
        ws.delivery().await;
    }
    crate::protocol_support::wait_until("the backlog is materialized", || async {
        in_state(&app, &s, "PENDING").await == 4
    })
    .await;
    assert_eq!(in_state(&app, &s, "LEASED").await, 2);
    app.assert_invariants().await;
}

/// Decisions 0062 and 0103: a session with room below a full backlog window
/// is not left to claims that would find the window full again; the
/// window is refilled by the scanner once an ACK frees a slot, and no claim
/// runs meanwhile.
#[actix_web::test]
async fn below_a_full_window_a_session_with_room_claims_nothing_until_an_ack_frees_a_slot() {
    let app = spawn_app_with(|s| s.timing.scan_interval_ms = 600_000).await;
    let cred = app.bootstrap().await;
    let s = create_sub(&app, &cred, json!({ "max_pending": 2 })).await;
    let mut ws = app.bind(&cred.token, &s, 8).await;
    crate::protocol_support::publish_n(&app, &cred, 10, "task.succeeded").await;
    let first = ws.delivery().await;
    ws.delivery().await;
    let before = crate::protocol_support::settled_claims(&app, &cred).await;
    // A round trip through the connection and the scanner's mailbox later,
    // the count has not moved.
    assert_eq!(ws.ping().await["type"], "ack");
    let after = crate::protocol_support::settled_claims(&app, &cred).await;
    assert_eq!(before, after, "claims ran below a full window");

    assert_eq!(ws.ack(&first).await["type"], "ack");
    let next = ws.delivery().await;
    assert_eq!(next["body"]["event"]["sequence"], "3", "{next:#}");
    app.assert_invariants().await;
}

/// Decision 0105, PostgreSQL: a claim that materializes and waits for the
/// subscription row while another node's scanner inserts the entries
/// PENDING (this test's transaction plays that node) leases those rows once
/// the row is its own. Its first pick ran before they were committed;
/// without a second one it leased nothing, reported the subscription
/// exhausted, and the rows waited for the poll (ten minutes here).
#[actix_web::test]
async fn a_claim_that_waited_for_another_nodes_materialization_leases_the_rows_it_inserted() {
    if skip_unless_backend("postgres", "only PostgreSQL runs several nodes") {
        return;
    }
    use sea_orm::{ConnectionTrait, TransactionTrait};
    let app = spawn_app_with(|s| {
        s.timing.scan_interval_ms = 600_000;
        s.timing.sweep_interval_ms = 600_000;
    })
    .await;
    let cred = app.bootstrap().await;
    let q = cred.queue_id.clone();
    let s = create_sub(&app, &cred, json!({ "from_sequence": "0" })).await;
    let mut ws = app.bind(&cred.token, &s, 4).await;

    let node = app.db.reader().begin().await.unwrap();
    node.execute_unprepared(&format!(
        "SELECT id FROM subscriptions WHERE id = '{s}' FOR UPDATE"
    ))
    .await
    .unwrap();
    crate::protocol_support::publish_n(&app, &cred, 2, "task.succeeded").await;
    crate::protocol_support::wait_until("the claim waits for the subscription row", || async {
        app.scalar(
            // The claim batch is one call (decision 0108); the only lock
            // it can wait for here is the subscription row's.
            "SELECT COUNT(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' \
             AND query LIKE '%orbit_claim_batch%'",
        )
        .await
            == 1
    })
    .await;
    node.execute_unprepared(&format!(
        "INSERT INTO deliveries (id, subscription_id, event_id, sequence, revision, state, \
         available_at, lease_epoch, attempts, attempt_budget, created_at) \
         SELECT md5(e.id), '{s}', e.id, e.sequence, 1, 'PENDING', 0, 0, 0, s.max_attempts, \
         (extract(epoch FROM clock_timestamp()) * 1000000)::bigint \
         FROM result_events e JOIN subscriptions s ON s.id = '{s}' WHERE e.queue_id = '{q}'; \
         UPDATE subscriptions SET cursor_sequence = 2, pending_count = pending_count + 2 \
         WHERE id = '{s}'"
    ))
    .await
    .unwrap();
    node.commit().await.unwrap();

    for _ in 0..2 {
        let d = ws.delivery().await;
        ws.ack(&d).await;
    }
    assert_eq!(
        app.scalar(&format!(
            "SELECT COUNT(*) FROM deliveries WHERE subscription_id = '{s}' AND state = 'ACKED'"
        ))
        .await,
        2
    );
    app.assert_invariants().await;
}
