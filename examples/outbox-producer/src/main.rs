//! A producer that writes its task's row and the task's result in one
//! transaction on the node's database (the transactional outbox,
//! docs/outbox.md): both commit, or neither. SQLite or PostgreSQL.

use std::process::ExitCode;

use clap::Parser;
use orbit_events::outbox;
use sea_orm::{ConnectionTrait, Database, Statement, TransactionTrait};
use serde_json::json;

/// Record a finished task and append its result, in one transaction.
///
/// The task goes into the table `tasks (id, revision, state)` (created if
/// missing), its `task.succeeded` result into the queue's log, keyed by
/// the task and revision: run it again with the same arguments and nothing
/// new is appended. `--fail` fails after the append: neither is kept.
/// Prints one JSON line: the event's id, its sequence, and whether the key
/// had already appended it.
#[derive(Debug, Parser)]
#[command(name = "outbox_producer")]
struct Args {
    /// The node's database URL (`sqlite://…` or `postgres://…`).
    #[arg(long, value_name = "URL")]
    database: String,
    /// The queue id (32 hex characters).
    #[arg(long, value_name = "QUEUE_ID")]
    queue: String,
    /// The task id (32 hex characters).
    #[arg(long, value_name = "TASK_ID")]
    task: String,
    /// The task's revision.
    #[arg(long, default_value_t = 1)]
    revision: u64,
    /// When the task finished (RFC 3339); a retry must send the same.
    #[arg(long, value_name = "TIME")]
    occurred_at: String,
    /// Fail after the append, so the transaction rolls back.
    #[arg(long)]
    fail: bool,
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args).await {
        Ok(line) => {
            println!("{line}");
            ExitCode::SUCCESS
        }
        Err(message) => {
            eprintln!("outbox_producer: {message}");
            ExitCode::from(3)
        }
    }
}

async fn run(args: &Args) -> Result<String, String> {
    let db = Database::connect(&args.database)
        .await
        .map_err(|e| e.to_string())?;
    let backend = db.get_database_backend();
    db.execute_raw(Statement::from_string(
        backend,
        "CREATE TABLE IF NOT EXISTS tasks (id TEXT PRIMARY KEY, revision BIGINT NOT NULL, state TEXT NOT NULL)"
            .to_owned(),
    ))
    .await
    .map_err(|e| e.to_string())?;
    let result = json!({
        "type": "task.succeeded",
        "aggregate_id": args.task,
        "aggregate_revision": args.revision.to_string(),
        "occurred_at": args.occurred_at,
        "details": { "state": "SUCCEEDED" },
        "snapshot": {
            "schema_version": 1,
            "task_id": args.task,
            "queue_id": args.queue,
            "state": "SUCCEEDED",
            "revision": args.revision.to_string(),
            "effect_uncertain": false,
        },
    });
    // The key names the task's revision: a transaction run again after a
    // lost commit appends nothing new.
    let key = format!("task-{}-rev-{}", args.task, args.revision);
    let revision = i64::try_from(args.revision).map_err(|e| e.to_string())?;
    let placeholders = match backend {
        sea_orm::DbBackend::Postgres => "$1, $2",
        _ => "?, ?",
    };
    let txn = db.begin().await.map_err(|e| e.to_string())?;
    txn.execute_raw(Statement::from_sql_and_values(
        backend,
        format!(
            "INSERT INTO tasks (id, revision, state) VALUES ({placeholders}, 'SUCCEEDED') \
             ON CONFLICT (id) DO UPDATE SET revision = excluded.revision, state = excluded.state"
        ),
        [args.task.clone().into(), revision.into()],
    ))
    .await
    .map_err(|e| e.to_string())?;
    let appended = outbox::append_result(&txn, &args.queue, &result.to_string(), Some(&key))
        .await
        .map_err(|e| e.to_string())?;
    if args.fail {
        txn.rollback().await.map_err(|e| e.to_string())?;
        return Err("failed after the append, as asked: nothing is committed".to_owned());
    }
    txn.commit().await.map_err(|e| e.to_string())?;
    Ok(json!({
        "event_id": appended.event_id,
        "sequence": appended.sequence,
        "deduplicated": appended.deduplicated,
    })
    .to_string())
}
