//! A complete consumer of one orbit-events subscription with a durable
//! Inbox (spec: protocol.md §5; guide: docs/consumer-guide.md).
//!
//! Each delivered event is stored in a SQLite Inbox keyed by `event.id`,
//! and processed, in one local transaction; only then is it ACKed. A
//! redelivery of an event already in the Inbox is ACKed with its new proof
//! without being processed again (and counted in `inbox.redeliveries`).
//! Kill it at any moment: nothing stored is lost and nothing is processed
//! twice (`tests/api/sdk_crash.rs` does, ten times per run).
//!
//! The parts between `ANCHOR` comments are shown in docs/consumer-guide.md;
//! `tests/api/sdk_guide.rs` keeps the two equal.

use std::{
    path::{Path, PathBuf},
    process::ExitCode,
    str::FromStr,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
};

use clap::Parser;
use orbit_events_client::{
    AckProof, Consumer, ConsumerError, Delivery, Event, Handler, HandlerError, LeaseSecret,
    Outcome, Token,
};
use sqlx::{
    Sqlite, SqlitePool, Transaction,
    sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous},
};

/// Consume one orbit-events subscription into a SQLite Inbox.
///
/// Every event delivered to SUBSCRIPTION_ID is stored in the Inbox file,
/// keyed by its event id, and processed (here: the latest result of each
/// task is kept in the table `task_results`) in the same local transaction.
/// Only after that commit is the event acknowledged (ACK). If the event
/// arrives again (at-least-once delivery: after a crash, a lost ACK reply
/// or a lapsed lease), the Inbox already has it: it is acknowledged again
/// without being processed twice.
#[derive(Debug, Parser)]
#[command(
    name = "inbox_consumer",
    after_help = "\
The token is read from ORBIT_EVENTS_TOKEN (a credential with events:consume,
e.g. from `orbit-events bootstrap ... --event-access`). Create the
subscription first, e.g. `orbit-events subscriptions create --name inbox
--queue QUEUE_ID --from start`, and pass the id it prints.

Ctrl-C (or SIGTERM) stops cleanly: events being stored are finished and
acknowledged; ACKs the server has not confirmed yet are kept in the Inbox
and sent again at the next start. Killed at any other moment, the consumer
loses nothing either: the server delivers again whatever was not
acknowledged, and the Inbox absorbs the duplicates.

Inspect the Inbox with sqlite3: tables inbox (one row per event, with its
JSON and how many redeliveries it absorbed), task_results (the processing)
and unconfirmed_acks.

Example:
  export ORBIT_EVENTS_TOKEN=oe_...
  cargo run --release -p inbox-consumer -- --subscription 0123456789abcdef0123456789abcdef"
)]
struct Args {
    /// The subscription to consume: its id (32 hex characters).
    #[arg(long, value_name = "SUBSCRIPTION_ID")]
    subscription: String,
    /// Base URL of the orbit-events node.
    #[arg(
        long,
        env = "ORBIT_EVENTS_URL",
        hide_env_values = true,
        default_value = "http://127.0.0.1:8080",
        value_name = "URL"
    )]
    server: String,
    /// The Inbox: a SQLite file, created if missing.
    #[arg(long, value_name = "FILE", default_value = "inbox.db")]
    inbox: PathBuf,
    /// How many deliveries to hold and store at once (1-32).
    #[arg(long, value_name = "N", default_value_t = 8)]
    capacity: u32,
    /// Print one line per event to stdout (stored or already there).
    #[arg(long)]
    verbose: bool,
}

/// The Inbox database.
#[derive(Clone)]
struct Inbox {
    pool: SqlitePool,
}

impl Inbox {
    /// Opens (or creates) the Inbox. One connection: SQLite writes are
    /// serialized anyway, and WAL with synchronous=FULL makes each commit
    /// durable before the ACK is sent.
    async fn open(path: &Path) -> Result<Inbox, sqlx::Error> {
        let options = SqliteConnectOptions::from_str("sqlite://")?
            .filename(path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Full);
        let pool = SqlitePoolOptions::new()
            .max_connections(1)
            .connect_with(options)
            .await?;
        // ANCHOR: schema
        for statement in [
            "CREATE TABLE IF NOT EXISTS inbox (
                event_id     TEXT PRIMARY KEY,
                sequence     INTEGER NOT NULL,
                type         TEXT NOT NULL,
                task_id      TEXT NOT NULL,
                event        TEXT NOT NULL,
                stored_at    TEXT NOT NULL,
                redeliveries INTEGER NOT NULL DEFAULT 0
            )",
            "CREATE TABLE IF NOT EXISTS task_results (
                task_id       TEXT PRIMARY KEY,
                task_revision INTEGER NOT NULL,
                type          TEXT NOT NULL,
                event_id      TEXT NOT NULL,
                results_seen  INTEGER NOT NULL
            )",
            "CREATE TABLE IF NOT EXISTS unconfirmed_acks (
                delivery_id  TEXT PRIMARY KEY,
                epoch        INTEGER NOT NULL,
                lease_secret TEXT NOT NULL
            )",
        ] {
            sqlx::query(statement).execute(&pool).await?;
        }
        // ANCHOR_END: schema
        Ok(Inbox { pool })
    }

    // ANCHOR: store
    /// Stores and processes the event in one transaction, unless the Inbox
    /// has it already. True when it was new.
    async fn store(&self, delivery: &Delivery) -> Result<bool, sqlx::Error> {
        let event = &delivery.event;
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        let inserted = sqlx::query(
            "INSERT INTO inbox (event_id, sequence, type, task_id, event, stored_at)
             VALUES (?, ?, ?, ?, ?, strftime('%Y-%m-%dT%H:%M:%fZ'))
             ON CONFLICT (event_id) DO NOTHING",
        )
        .bind(&event.id)
        .bind(i64::try_from(event.sequence).unwrap_or(i64::MAX))
        .bind(event.event_type.as_str())
        .bind(&event.aggregate_id)
        .bind(delivery.event_json())
        .execute(&mut *tx)
        .await?
        .rows_affected()
            == 1;
        if inserted {
            process(&mut tx, event).await?;
        } else {
            sqlx::query("UPDATE inbox SET redeliveries = redeliveries + 1 WHERE event_id = ?")
                .bind(&event.id)
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        Ok(inserted)
    }
    // ANCHOR_END: store

    /// Takes the proofs a previous run could not get confirmed.
    async fn take_unconfirmed(&self) -> Result<Vec<AckProof>, sqlx::Error> {
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        let rows: Vec<(String, i64, String)> =
            sqlx::query_as("SELECT delivery_id, epoch, lease_secret FROM unconfirmed_acks")
                .fetch_all(&mut *tx)
                .await?;
        sqlx::query("DELETE FROM unconfirmed_acks")
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(rows
            .into_iter()
            .map(|(delivery_id, epoch, secret)| AckProof {
                delivery_id,
                epoch: u64::try_from(epoch).unwrap_or_default(),
                lease_secret: LeaseSecret::new(secret),
            })
            .collect())
    }

    /// Keeps proofs whose ACK was not confirmed, for the next start.
    async fn keep_unconfirmed(&self, proofs: &[AckProof]) -> Result<(), sqlx::Error> {
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        for proof in proofs {
            sqlx::query("INSERT OR REPLACE INTO unconfirmed_acks VALUES (?, ?, ?)")
                .bind(&proof.delivery_id)
                .bind(i64::try_from(proof.epoch).unwrap_or(i64::MAX))
                .bind(proof.lease_secret.expose())
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await
    }
}

// ANCHOR: process
/// The application's processing of a new event, in the Inbox transaction:
/// the latest result of each task. Redeliveries can arrive after later
/// results, so a result only replaces one of a lower task revision.
async fn process(tx: &mut Transaction<'_, Sqlite>, event: &Event) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO task_results (task_id, task_revision, type, event_id, results_seen)
         VALUES (?, ?, ?, ?, 1)
         ON CONFLICT (task_id) DO UPDATE SET
             results_seen  = results_seen + 1,
             task_revision = CASE WHEN excluded.task_revision >= task_revision
                             THEN excluded.task_revision ELSE task_revision END,
             type          = CASE WHEN excluded.task_revision >= task_revision
                             THEN excluded.type ELSE type END,
             event_id      = CASE WHEN excluded.task_revision >= task_revision
                             THEN excluded.event_id ELSE event_id END",
    )
    .bind(&event.aggregate_id)
    .bind(i64::try_from(event.aggregate_revision).unwrap_or(i64::MAX))
    .bind(event.event_type.as_str())
    .bind(&event.id)
    .execute(&mut **tx)
    .await?;
    Ok(())
}
// ANCHOR_END: process

/// Stores each delivery; the consumer ACKs it when `handle` returns Ok.
struct InboxHandler {
    inbox: Inbox,
    verbose: bool,
    counts: Arc<Counts>,
}

/// Events stored and duplicates absorbed by this run.
#[derive(Default)]
struct Counts {
    stored: AtomicU64,
    duplicates: AtomicU64,
}

// ANCHOR: handler
impl Handler for InboxHandler {
    async fn handle(&self, delivery: Delivery) -> Result<(), HandlerError> {
        let new = self.inbox.store(&delivery).await?;
        let counter = if new {
            &self.counts.stored
        } else {
            &self.counts.duplicates
        };
        counter.fetch_add(1, Ordering::Relaxed);
        if self.verbose {
            let e = &delivery.event;
            println!(
                "{} {} sequence {} task {} ({})",
                if new { "stored" } else { "already stored" },
                e.id,
                e.sequence,
                e.aggregate_id,
                e.event_type
            );
        }
        Ok(())
    }

    fn on_outcome(&self, outcome: &Outcome) {
        match outcome {
            Outcome::Connected(w) => eprintln!(
                "inbox_consumer: connected (session {}, capacity {}{})",
                w.session_id,
                w.capacity,
                if w.enabled {
                    ""
                } else {
                    ", subscription paused"
                }
            ),
            Outcome::Disconnected { reason, retry_in } => {
                eprintln!("inbox_consumer: {reason}; reconnecting in {retry_in:?}")
            }
            Outcome::LeaseLost { delivery_id, .. } => eprintln!(
                "inbox_consumer: the lease of delivery {delivery_id} lapsed before its ACK; \
                 it comes again and is ACKed then"
            ),
            Outcome::HandlerFailed {
                event_id, error, ..
            } => eprintln!(
                "inbox_consumer: could not store event {event_id}: {error}; it comes again"
            ),
            Outcome::AckRejected { delivery_id, error } => {
                eprintln!("inbox_consumer: ACK of {delivery_id} refused: {error}")
            }
            _ => {}
        }
    }
}
// ANCHOR_END: handler

/// Completes on Ctrl-C or SIGTERM.
async fn stop_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        if let Ok(mut term) = signal(SignalKind::terminate()) {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
            return;
        }
    }
    let _ = tokio::signal::ctrl_c().await;
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    match run(args).await {
        Ok(code) => code,
        Err(message) => {
            eprintln!("inbox_consumer: {message}");
            ExitCode::from(2)
        }
    }
}

async fn run(args: Args) -> Result<ExitCode, String> {
    let token = Token::from_env("ORBIT_EVENTS_TOKEN").map_err(|e| e.to_string())?;
    let inbox = Inbox::open(&args.inbox)
        .await
        .map_err(|e| format!("cannot open the Inbox {}: {e}", args.inbox.display()))?;
    // ANCHOR: run
    let proofs = inbox
        .take_unconfirmed()
        .await
        .map_err(|e| format!("Inbox: {e}"))?;
    let consumer = Consumer::new(&args.server, token, &args.subscription)
        .map_err(|e| format!("--server: {e}"))?
        .capacity(args.capacity)
        .resend_proofs(proofs);
    eprintln!(
        "inbox_consumer: subscription {} on {} into {} (Ctrl-C stops)",
        args.subscription,
        args.server,
        args.inbox.display()
    );
    let counts = Arc::new(Counts::default());
    let handler = InboxHandler {
        inbox: inbox.clone(),
        verbose: args.verbose,
        counts: counts.clone(),
    };
    let (stopped, code) = match consumer.run(handler, stop_signal()).await {
        Ok(stopped) => (stopped, ExitCode::SUCCESS),
        Err(ConsumerError::HistoryExpired {
            earliest_sequence,
            stopped,
            ..
        }) => {
            eprintln!(
                "inbox_consumer: the queue's history was purged past this subscription's \
                 position (earliest available sequence: {}). Nothing was skipped silently: \
                 decide what to do about the gap, then create a new subscription (e.g. \
                 `orbit-events subscriptions create --from start ...`).",
                earliest_sequence.map_or("unknown".to_owned(), |s| s.to_string())
            );
            (stopped, ExitCode::from(3))
        }
        Err(ConsumerError::Refused { error, stopped }) => {
            eprintln!("inbox_consumer: the server refused this consumer: {error}");
            (stopped, ExitCode::from(3))
        }
        Err(e) => return Err(e.to_string()),
    };
    inbox
        .keep_unconfirmed(&stopped.unconfirmed)
        .await
        .map_err(|e| format!("Inbox: {e}"))?;
    // ANCHOR_END: run
    eprintln!(
        "inbox_consumer: stopped; this run stored {} new events and absorbed {} duplicates; \
         {} unconfirmed ACKs kept for the next start",
        counts.stored.load(Ordering::Relaxed),
        counts.duplicates.load(Ordering::Relaxed),
        stopped.unconfirmed.len()
    );
    Ok(code)
}
