//! A stopped node leaves nothing behind (decision 0070): once it has
//! stopped, none of its database connections (pools, PostgreSQL listener)
//! is open any more, whether it was stopped through its [`Shutdown`] or,
//! in tests, by dropping the `TestApp` that runs it.
//!
//! [`Shutdown`]: orbit_events::node::Shutdown

use std::path::PathBuf;

use orbit_events::{config::Settings, startup, store::wakes::LISTENER_APPLICATION_NAME};
use sea_orm::{ConnectionTrait, DatabaseConnection, Statement};

use crate::{helpers::*, protocol_support::wait_until};

/// The PostgreSQL server of the run (not the test's database), from which
/// the connections to a test's database are counted.
async fn admin() -> DatabaseConnection {
    let server = std::env::var("ORBIT_TEST_DATABASE_URL").unwrap();
    sea_orm::Database::connect(&server).await.unwrap()
}

fn database_name(url: &str) -> &str {
    url.rsplit_once('/').map(|(_, name)| name).unwrap()
}

/// Open connections to `database`, all of them or (with `listener`) only
/// the nodes' LISTEN connections.
async fn connections(admin: &DatabaseConnection, database: &str, listener: bool) -> i64 {
    let filter = if listener {
        format!("AND application_name LIKE '{LISTENER_APPLICATION_NAME}%'")
    } else {
        String::new()
    };
    let sql =
        format!("SELECT COUNT(*) FROM pg_stat_activity WHERE datname = '{database}' {filter}");
    let row = admin
        .query_one_raw(Statement::from_string(admin.get_database_backend(), sql))
        .await
        .unwrap()
        .unwrap();
    row.try_get_by_index::<i64>(0).unwrap()
}

/// The SQLite database file and its write-ahead log.
fn sqlite_files(settings: &Settings) -> (PathBuf, PathBuf) {
    let url = settings.database.url.as_str();
    let path = url
        .trim_start_matches("sqlite://")
        .split('?')
        .next()
        .unwrap();
    (PathBuf::from(path), PathBuf::from(format!("{path}-wal")))
}

#[actix_web::test]
async fn a_stopped_node_releases_its_database_connections() {
    let dir = tempfile::tempdir().unwrap();
    let mut settings = Settings::defaults().unwrap();
    settings.server.listen = "127.0.0.1:0".to_owned();
    settings.database.url = fresh_database_url(&dir).await;
    let app = startup::Application::build(settings.clone()).await.unwrap();
    // Whoever still holds the node's state (its pools among it) after the
    // node has stopped holds no connection with it.
    let state = app.state().clone();
    let running = actix_web::rt::spawn(app.run_until_stopped());

    let admin = match backend_name() {
        "postgres" => {
            let admin = admin().await;
            let database = database_name(&settings.database.url).to_owned();
            let (admin_ref, db_ref) = (&admin, database.as_str());
            wait_until("the node's listener has connected", || async move {
                connections(admin_ref, db_ref, true).await == 1
            })
            .await;
            assert!(connections(&admin, &database, false).await >= 2);
            Some((admin, database))
        }
        _ => {
            // SQLite deletes a database's WAL file when its last
            // connection closes.
            assert!(sqlite_files(&settings).1.exists(), "the node has it open");
            None
        }
    };

    state.shutdown.begin();
    let stopped = tokio::time::timeout(DEADLINE, running)
        .await
        .expect("the node stops")
        .unwrap();
    assert!(stopped.is_ok(), "{stopped:?}");

    match &admin {
        Some((admin, database)) => {
            // A backend leaves pg_stat_activity a moment after its client
            // has gone.
            wait_until("no connection to the node's database is left", || async {
                connections(admin, database, false).await == 0
            })
            .await;
        }
        None => {
            let (file, wal) = sqlite_files(&settings);
            wait_until("the last connection has closed", || async { !wal.exists() }).await;
            // Nothing holds the file: it goes, and a new node starts afresh.
            std::fs::remove_file(file).unwrap();
            let next = startup::Application::build(settings.clone()).await.unwrap();
            next.state().shutdown.begin();
            next.run_until_stopped().await.unwrap();
        }
    }
    drop(state);
}

#[actix_web::test]
async fn a_test_node_releases_its_database_connections_when_its_test_app_is_dropped() {
    if skip_unless_postgres() {
        return;
    }
    let app = spawn_app().await;
    let cred = app.bootstrap().await;
    app.publish(&cred, vec![result(&cred.queue_id, "task.succeeded")])
        .await;
    let database = database_name(&app.settings.database.url).to_owned();
    let admin = admin().await;
    assert!(connections(&admin, &database, true).await <= 1);
    assert!(connections(&admin, &database, false).await >= 2);

    drop(app);
    let (admin_ref, db_ref) = (&admin, database.as_str());
    wait_until(
        "no connection to the test's database is left",
        || async move { connections(admin_ref, db_ref, false).await == 0 },
    )
    .await;
}
