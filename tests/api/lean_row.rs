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

    // Back to the schema before 0079 (its columns and indexes gone), then
    // forward again over the ACKED rows, each in its own transaction.
    let txn = app.db.begin_write().await.unwrap();
    migration::Migrator::down(&*txn, Some(1)).await.unwrap();
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
                 AND ack_epoch = 1 AND ack_session_id = '{}'",
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
