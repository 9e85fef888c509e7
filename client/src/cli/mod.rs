//! The admin command line: `orbit-events subscriptions list|get|status|
//! create|pause|resume`, `orbit-events deliveries list|get|history|retry`,
//! `orbit-events queues list` and `orbit-events publish`, as clap arguments
//! and async functions the `orbit-events` binary dispatches to (decisions
//! 0051, 0081). Tables for people, `--json` for scripts (always the `data`
//! of the endpoint's answer); the token only from the `ORBIT_EVENTS_TOKEN`
//! environment variable.

mod output;

pub use output::plain_table;

use std::{fmt, io::Write, str::FromStr};

use clap::{Args, Subcommand};

use crate::{
    Client, ConfigureSubscription, CreateSubscription, DeliveryFilter, DeliveryState, Error,
    ErrorCode, IdempotencyKey, NewResult, ResultType, RetryDelivery, RetryExpired, Token,
    types::Page,
};

/// The environment variable holding the token of the admin commands.
pub const TOKEN_ENV: &str = "ORBIT_EVENTS_TOKEN";

/// The environment variable that may hold the server URL.
pub const SERVER_ENV: &str = "ORBIT_EVENTS_URL";

const TOKEN_HELP: &str = "\
Authentication: the token is read from the ORBIT_EVENTS_TOKEN environment
variable (never from a flag, so it stays out of shell history). Create one
with `orbit-events bootstrap … --event-access` on the node's machine:
  export ORBIT_EVENTS_TOKEN=oe_…
Reading needs events:read, writing (create, pause, resume, retry) needs
events:manage. A credential sees only its own subscriptions.";

/// Where the node is and how to print; accepted after any admin command.
#[derive(Debug, Clone, Args)]
pub struct Remote {
    /// Base URL of the node's HTTP API.
    #[arg(
        long,
        global = true,
        env = SERVER_ENV,
        hide_env_values = true,
        help_heading = "Server and output",
        default_value = "http://127.0.0.1:8080",
        value_name = "URL"
    )]
    pub server: String,
    /// Print the API's JSON (the `data` of its answer) instead of a table,
    /// for scripts.
    #[arg(long, global = true, help_heading = "Server and output")]
    pub json: bool,
}

/// `orbit-events subscriptions …`
#[derive(Debug, Args)]
#[command(after_help = TOKEN_HELP)]
pub struct SubscriptionsArgs {
    #[command(flatten)]
    pub remote: Remote,
    #[command(subcommand)]
    pub command: SubscriptionsCommand,
}

/// The subscription commands.
#[derive(Debug, Subcommand)]
pub enum SubscriptionsCommand {
    /// List your subscriptions on a queue, newest first (one page unless
    /// --all).
    #[command(after_help = TOKEN_HELP)]
    List(ListSubscriptionsArgs),
    /// Show one subscription: state, position in the log, backlog, limits.
    #[command(after_help = TOKEN_HELP)]
    Get {
        /// The subscription's id (32 hex characters).
        #[arg(value_name = "SUBSCRIPTION_ID")]
        id: String,
    },
    /// Why a subscription is (not) moving: its position in the log, its
    /// backlog by state, the consumers bound to it and what blocks it.
    #[command(after_help = TOKEN_HELP)]
    Status {
        /// The subscription's id (32 hex characters).
        #[arg(value_name = "SUBSCRIPTION_ID")]
        id: String,
    },
    /// Create a subscription: which queue, which result types, and where
    /// in the queue's result log to start.
    #[command(after_help = TOKEN_HELP)]
    Create(CreateArgs),
    /// Pause a subscription: it gets no new deliveries until resumed.
    /// Consumers stay connected and can still ACK what they hold.
    #[command(after_help = TOKEN_HELP)]
    Pause(ConfigureArgs),
    /// Resume a paused subscription: deliveries start again where they
    /// stopped; nothing was skipped.
    #[command(after_help = TOKEN_HELP)]
    Resume(ConfigureArgs),
}

/// `subscriptions list`.
#[derive(Debug, Args)]
pub struct ListSubscriptionsArgs {
    /// The queue's id (the `queue_id` printed by `orbit-events bootstrap`).
    #[arg(long = "queue", value_name = "QUEUE_ID")]
    pub queue_id: String,
    #[command(flatten)]
    pub page: PageArgs,
}

/// Paging of the list commands.
#[derive(Debug, Args)]
pub struct PageArgs {
    /// Items per page, 1-100 (default 20).
    #[arg(long, value_name = "N")]
    pub limit: Option<u32>,
    /// Continue after a previous page (the cursor it printed).
    #[arg(long, value_name = "CURSOR", conflicts_with = "all")]
    pub cursor: Option<String>,
    /// Fetch every page.
    #[arg(long)]
    pub all: bool,
}

/// `subscriptions create`.
#[derive(Debug, Args)]
pub struct CreateArgs {
    /// A name unique in your namespace: a letter or digit, then up to 127
    /// letters, digits, '.', '_' or '-'.
    #[arg(long, value_name = "NAME")]
    pub name: String,
    /// The queue to follow (the `queue_id` printed by `orbit-events
    /// bootstrap`).
    #[arg(long = "queue", value_name = "QUEUE_ID")]
    pub queue_id: String,
    /// Result types to receive, comma-separated: succeeded, failed,
    /// cancelled, needs_review [default: all four].
    #[arg(long, value_name = "TYPES", value_delimiter = ',')]
    pub types: Vec<ResultType>,
    /// Where to start: `new` (only results published from now on),
    /// `start` (everything the queue still retains), or a sequence N (the
    /// first result delivered is N+1).
    #[arg(long, value_name = "POSITION", default_value = "new")]
    pub from: StartPosition,
    /// How many deliveries may wait unacknowledged, 1-1000 [default: 100].
    #[arg(long, value_name = "N")]
    pub max_pending: Option<u32>,
    /// Attempts per delivery before it is set aside as EXPIRED, 1-100
    /// [default: 20].
    #[arg(long, value_name = "N")]
    pub max_attempts: Option<u32>,
    #[command(flatten)]
    pub key: KeyArg,
}

/// `subscriptions pause|resume`.
#[derive(Debug, Args)]
pub struct ConfigureArgs {
    /// The subscription's id (32 hex characters).
    #[arg(value_name = "SUBSCRIPTION_ID")]
    pub id: String,
    /// Why; kept in the audit record (1-1024 characters).
    #[arg(long, value_name = "TEXT")]
    pub reason: String,
    /// Act only if the subscription is still at this revision (else
    /// STATE_CONFLICT) [default: its current revision, read just before].
    #[arg(long, value_name = "N")]
    pub expected_revision: Option<u64>,
    #[command(flatten)]
    pub key: KeyArg,
}

/// The idempotency key of a write.
#[derive(Debug, Args)]
pub struct KeyArg {
    /// Idempotency key of this write [default: a new random key]. Run the
    /// same command again with the same key and the original answer comes
    /// back (marked as replayed) instead of a second effect.
    #[arg(long, value_name = "KEY")]
    pub idempotency_key: Option<String>,
}

/// `orbit-events deliveries …`
#[derive(Debug, Args)]
#[command(after_help = TOKEN_HELP)]
pub struct DeliveriesArgs {
    #[command(flatten)]
    pub remote: Remote,
    #[command(subcommand)]
    pub command: DeliveriesCommand,
}

/// The delivery commands.
#[derive(Debug, Subcommand)]
pub enum DeliveriesCommand {
    /// List a subscription's deliveries (its backlog and history), newest
    /// first.
    #[command(after_help = TOKEN_HELP)]
    List {
        /// The subscription's id.
        #[arg(value_name = "SUBSCRIPTION_ID")]
        subscription_id: String,
        /// Only deliveries in this state: PENDING (waiting), LEASED (held
        /// by a consumer), ACKED (done) or EXPIRED (out of attempts).
        #[arg(long, value_name = "STATE")]
        state: Option<DeliveryState>,
        #[command(flatten)]
        page: PageArgs,
    },
    /// Show one delivery with its event.
    #[command(after_help = TOKEN_HELP)]
    Get {
        /// The subscription's id.
        #[arg(value_name = "SUBSCRIPTION_ID")]
        subscription_id: String,
        /// The delivery's id.
        #[arg(value_name = "DELIVERY_ID")]
        delivery_id: String,
    },
    /// Every step of one delivery, oldest first: each lease and how it
    /// ended, refused ACKs, sessions that closed, retries, the ACK.
    #[command(after_help = TOKEN_HELP)]
    History {
        /// The subscription's id.
        #[arg(value_name = "SUBSCRIPTION_ID")]
        subscription_id: String,
        /// The delivery's id.
        #[arg(value_name = "DELIVERY_ID")]
        delivery_id: String,
    },
    /// Give an EXPIRED delivery (out of attempts) more attempts, or with
    /// --expired every EXPIRED delivery of a sequence range: they are
    /// offered to consumers again.
    #[command(after_help = TOKEN_HELP)]
    Retry(RetryArgs),
}

/// `deliveries retry`.
#[derive(Debug, Args)]
pub struct RetryArgs {
    /// The subscription's id.
    #[arg(value_name = "SUBSCRIPTION_ID")]
    pub subscription_id: String,
    /// The delivery's id (state EXPIRED); not with --expired.
    #[arg(
        value_name = "DELIVERY_ID",
        required_unless_present = "expired",
        conflicts_with = "expired"
    )]
    pub delivery_id: Option<String>,
    /// Re-arm every EXPIRED delivery of the subscription (within --from,
    /// --to and --limit), lowest sequence first, in one operation.
    #[arg(long)]
    pub expired: bool,
    /// With --expired: the lowest sequence to re-arm.
    #[arg(long = "from", value_name = "SEQUENCE", requires = "expired")]
    pub from_sequence: Option<u64>,
    /// With --expired: the highest sequence to re-arm.
    #[arg(long = "to", value_name = "SEQUENCE", requires = "expired")]
    pub to_sequence: Option<u64>,
    /// With --expired: at most this many deliveries, 1-10000 [default:
    /// 1000].
    #[arg(long, value_name = "N", requires = "expired")]
    pub limit: Option<u32>,
    /// With --expired: count what would be re-armed; change nothing.
    #[arg(long, requires = "expired")]
    pub dry_run: bool,
    /// With --expired: offer the re-armed deliveries evenly over this many
    /// milliseconds instead of all at once (0-3600000).
    #[arg(long, value_name = "MS", requires = "expired")]
    pub spread_ms: Option<u32>,
    /// Why; kept in the audit record (1-1024 characters).
    #[arg(long, value_name = "TEXT")]
    pub reason: String,
    /// Attempts to add to the delivery's budget, 1-100.
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub additional_attempts: u32,
    /// Act only if the delivery is still at this revision (else
    /// STATE_CONFLICT) [default: its current revision, read just before].
    #[arg(long, value_name = "N")]
    pub expected_revision: Option<u64>,
    #[command(flatten)]
    pub key: KeyArg,
}

/// `orbit-events queues …`
#[derive(Debug, Args)]
#[command(after_help = TOKEN_HELP)]
pub struct QueuesArgs {
    #[command(flatten)]
    pub remote: Remote,
    #[command(subcommand)]
    pub command: QueuesCommand,
}

/// The queue commands.
#[derive(Debug, Subcommand)]
pub enum QueuesCommand {
    /// List the queues of your credential's scope: ids, names, heads and
    /// retention floors.
    #[command(after_help = TOKEN_HELP)]
    List,
}

/// `orbit-events publish`: one result, with the snapshot fields that must
/// repeat the task id, type and revision filled in.
#[derive(Debug, Args)]
#[command(after_help = TOKEN_HELP)]
pub struct PublishArgs {
    #[command(flatten)]
    pub remote: Remote,
    /// The queue's id (`orbit-events queues list`).
    #[arg(value_name = "QUEUE_ID")]
    pub queue_id: String,
    /// The result type: succeeded, failed, cancelled or needs_review.
    #[arg(long = "type", value_name = "TYPE")]
    pub result_type: ResultType,
    /// The task's id (32 lowercase hex characters).
    #[arg(long, value_name = "TASK_ID")]
    pub task: String,
    /// The task's revision.
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub revision: u64,
    /// When the result occurred (RFC 3339) [default: now]. To repeat a
    /// publish with the same --idempotency-key, give the same time.
    #[arg(long, value_name = "TIME")]
    pub occurred_at: Option<crate::Time>,
    /// The task's result: any JSON, kept byte for byte.
    #[arg(long, value_name = "JSON", conflicts_with = "result_file")]
    pub result: Option<String>,
    /// Read the task's result (any JSON) from this file ('-': stdin).
    #[arg(long, value_name = "FILE")]
    pub result_file: Option<std::path::PathBuf>,
    /// Details of the result: a JSON object [default: {}].
    #[arg(long, value_name = "JSON")]
    pub details: Option<String>,
    /// The effect of the task may or may not have happened.
    #[arg(long)]
    pub effect_uncertain: bool,
    #[command(flatten)]
    pub key: KeyArg,
}

/// `--from` of `subscriptions create`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StartPosition {
    /// After the committed head: only new results.
    New,
    /// After sequence N (`start` is 0).
    After(u64),
}

impl FromStr for StartPosition {
    type Err = String;

    fn from_str(s: &str) -> Result<StartPosition, String> {
        match s {
            "new" => Ok(StartPosition::New),
            "start" => Ok(StartPosition::After(0)),
            n => crate::types::parse_u64(n)
                .map(StartPosition::After)
                .ok_or_else(|| format!("{n:?}: expected new, start or a sequence number")),
        }
    }
}

/// A failed admin command: the message to print (exit status 1).
#[derive(Debug)]
pub struct CliError(pub String);

impl fmt::Display for CliError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for CliError {}

/// Runs `orbit-events subscriptions …`, printing to stdout.
pub async fn run_subscriptions(args: SubscriptionsArgs) -> Result<(), CliError> {
    let remote = &args.remote;
    let client = client(remote)?;
    let fail = |e| explain(e, remote);
    let mut out = Output::new(remote.json);
    match args.command {
        SubscriptionsCommand::List(list) => {
            let page = collect(&list.page, |cursor| {
                let client = &client;
                let queue_id = &list.queue_id;
                async move {
                    client
                        .list_subscriptions(queue_id, list.page.limit, cursor.as_deref())
                        .await
                }
            })
            .await
            .map_err(fail)?;
            out.page(&page, output::subscriptions_table(&page.items))?;
        }
        SubscriptionsCommand::Get { id } => {
            let subscription = client.get_subscription(&id).await.map_err(fail)?;
            if remote.json {
                out.value(&subscription, String::new)?;
            } else {
                // People also want to know whether it moves.
                let status = client.subscription_status(&id).await.map_err(fail)?;
                out.value(&subscription, || {
                    format!(
                        "{}\n\n{}",
                        output::subscription_detail(&subscription),
                        output::status_detail(&status)
                    )
                })?;
            }
        }
        SubscriptionsCommand::Status { id } => {
            let status = client.subscription_status(&id).await.map_err(fail)?;
            out.value(&status, || output::status_detail(&status))?;
        }
        SubscriptionsCommand::Create(create) => {
            let request = CreateSubscription {
                name: create.name,
                queue_id: create.queue_id,
                types: create.types,
                from_sequence: match create.from {
                    StartPosition::New => None,
                    StartPosition::After(n) => Some(n),
                },
                max_pending: create.max_pending,
                max_attempts: create.max_attempts,
            };
            let key = key(&create.key)?;
            let result = client
                .create_subscription(&key, &request)
                .await
                .map_err(fail)?;
            out.value(&result, || {
                format!(
                    "{}{}",
                    written("Created", result.deduplicated, &result.subscription.id),
                    output::subscription_detail(&result.subscription)
                )
            })?;
        }
        SubscriptionsCommand::Pause(args) => {
            configure(&client, &mut out, remote, args, false).await?;
        }
        SubscriptionsCommand::Resume(args) => {
            configure(&client, &mut out, remote, args, true).await?;
        }
    }
    Ok(())
}

/// Runs `orbit-events deliveries …`, printing to stdout.
pub async fn run_deliveries(args: DeliveriesArgs) -> Result<(), CliError> {
    let remote = &args.remote;
    let client = client(remote)?;
    let fail = |e| explain(e, remote);
    let mut out = Output::new(remote.json);
    match args.command {
        DeliveriesCommand::List {
            subscription_id,
            state,
            page: paging,
        } => {
            let page = collect(&paging, |cursor| {
                let client = &client;
                let filter = DeliveryFilter {
                    state,
                    limit: paging.limit,
                    cursor,
                };
                let subscription_id = &subscription_id;
                async move { client.list_deliveries(subscription_id, &filter).await }
            })
            .await
            .map_err(fail)?;
            out.page(&page, output::deliveries_table(&page.items))?;
        }
        DeliveriesCommand::Get {
            subscription_id,
            delivery_id,
        } => {
            let detail = client
                .get_delivery(&subscription_id, &delivery_id)
                .await
                .map_err(fail)?;
            out.value(&detail, || output::delivery_detail(&detail))?;
        }
        DeliveriesCommand::History {
            subscription_id,
            delivery_id,
        } => {
            let history = client
                .delivery_history(&subscription_id, &delivery_id)
                .await
                .map_err(fail)?;
            out.value(&history, || output::history_table(&history.items))?;
        }
        DeliveriesCommand::Retry(retry) if retry.expired => {
            let key = key(&retry.key)?;
            let request = RetryExpired {
                reason: retry.reason,
                additional_attempts: retry.additional_attempts,
                from_sequence: retry.from_sequence,
                to_sequence: retry.to_sequence,
                limit: retry.limit.unwrap_or(1000),
                dry_run: retry.dry_run,
                spread_ms: retry.spread_ms,
            };
            let receipt = client
                .retry_expired(&retry.subscription_id, &key, &request)
                .await
                .map_err(fail)?;
            out.value(&receipt, || output::retry_receipt(&receipt))?;
        }
        DeliveriesCommand::Retry(retry) => {
            // clap's `requires` counts a flag left false as given: the
            // options of --expired are checked here.
            let range_only = [
                ("--from", retry.from_sequence.is_some()),
                ("--to", retry.to_sequence.is_some()),
                ("--limit", retry.limit.is_some()),
                ("--dry-run", retry.dry_run),
                ("--spread-ms", retry.spread_ms.is_some()),
            ];
            if let Some((flag, _)) = range_only.iter().find(|(_, given)| *given) {
                return Err(CliError(format!(
                    "{flag} applies to a retry of every EXPIRED delivery: add --expired \
                     (and leave out DELIVERY_ID)"
                )));
            }
            let Some(delivery_id) = retry.delivery_id.clone() else {
                return Err(CliError(
                    "name a DELIVERY_ID, or pass --expired for every EXPIRED delivery".to_owned(),
                ));
            };
            let expected_revision = match retry.expected_revision {
                Some(r) => r,
                None => {
                    client
                        .get_delivery(&retry.subscription_id, &delivery_id)
                        .await
                        .map_err(fail)?
                        .delivery
                        .revision
                }
            };
            let key = key(&retry.key)?;
            let request = RetryDelivery {
                expected_revision,
                reason: retry.reason,
                additional_attempts: retry.additional_attempts,
            };
            let result = client
                .retry_delivery(&retry.subscription_id, &delivery_id, &key, &request)
                .await
                .map_err(fail)?;
            out.value(&result, || {
                format!(
                    "{}{}",
                    written(
                        "Re-armed delivery",
                        result.deduplicated,
                        &result.delivery.id
                    ),
                    output::delivery_fields(&result.delivery)
                )
            })?;
        }
    }
    Ok(())
}

/// Runs `orbit-events queues …`, printing to stdout.
pub async fn run_queues(args: QueuesArgs) -> Result<(), CliError> {
    let remote = &args.remote;
    let client = client(remote)?;
    let mut out = Output::new(remote.json);
    match args.command {
        QueuesCommand::List => {
            let queues = client.list_queues().await.map_err(|e| explain(e, remote))?;
            out.value(&queues, || output::queues_table(&queues.items))
        }
    }
}

/// Runs `orbit-events publish`: one result, then prints its event id and
/// sequence.
pub async fn run_publish(args: PublishArgs) -> Result<(), CliError> {
    let remote = &args.remote;
    let client = client(remote)?;
    let mut out = Output::new(remote.json);
    let json = |what: &str, text: String| {
        serde_json::value::RawValue::from_string(text)
            .map_err(|e| CliError(format!("{what}: not JSON ({e})")))
    };
    let mut result = NewResult::new(
        args.result_type,
        &args.queue_id,
        &args.task,
        args.revision,
        args.occurred_at.unwrap_or_else(chrono::Utc::now),
    );
    result.snapshot.effect_uncertain = args.effect_uncertain;
    let text = match (&args.result, &args.result_file) {
        (Some(text), _) => Some(text.clone()),
        (None, Some(path)) if path.as_os_str() == "-" => {
            let mut text = String::new();
            std::io::Read::read_to_string(&mut std::io::stdin(), &mut text)
                .map_err(|e| CliError(format!("--result-file -: cannot read stdin: {e}")))?;
            Some(text)
        }
        (None, Some(path)) => Some(std::fs::read_to_string(path).map_err(|e| {
            CliError(format!(
                "--result-file {}: cannot read it: {e}",
                path.display()
            ))
        })?),
        (None, None) => None,
    };
    if let Some(text) = text {
        result = result.with_result(json("--result", text.trim().to_owned())?);
    }
    if let Some(details) = args.details {
        result = result.with_details(json("--details", details)?);
    }
    let key = key(&args.key)?;
    let published = client
        .publish_results(&args.queue_id, &key, std::slice::from_ref(&result))
        .await
        .map_err(|e| {
            let repeat =
                e.code() == Some(&ErrorCode::IdempotencyConflict) && args.occurred_at.is_none();
            let mut e = explain(e, remote);
            if repeat {
                e.0.push_str(&format!(
                    "\nhint: a repeated publish must be the same request: pass the first \
                     run's time with --occurred-at (this run used {})",
                    result
                        .occurred_at
                        .to_rfc3339_opts(chrono::SecondsFormat::Micros, true)
                ));
            }
            e
        })?;
    out.value(&published, || {
        let lines: Vec<String> = published
            .events
            .iter()
            .map(|e| format!("Published event {} at sequence {}.", e.id, e.sequence))
            .collect();
        let mut text = lines.join("\n");
        if published.deduplicated {
            text.push_str(
                "\n(published earlier with this idempotency key: nothing was appended now)",
            );
        }
        text
    })
}

async fn configure(
    client: &Client,
    out: &mut Output,
    remote: &Remote,
    args: ConfigureArgs,
    enabled: bool,
) -> Result<(), CliError> {
    let fail = |e| explain(e, remote);
    let expected_revision = match args.expected_revision {
        Some(r) => r,
        None => {
            client
                .get_subscription(&args.id)
                .await
                .map_err(fail)?
                .revision
        }
    };
    let key = key(&args.key)?;
    let request = ConfigureSubscription {
        expected_revision,
        enabled,
        reason: args.reason,
    };
    let result = client
        .configure_subscription(&args.id, &key, &request)
        .await
        .map_err(fail)?;
    let verb = if enabled { "Resumed" } else { "Paused" };
    out.value(&result, || {
        format!(
            "{}{}",
            written(verb, result.deduplicated, &result.subscription.id),
            output::subscription_detail(&result.subscription)
        )
    })
}

/// The first line after a write.
fn written(verb: &str, deduplicated: bool, id: &str) -> String {
    if deduplicated {
        format!(
            "{verb} {id} earlier with this idempotency key: nothing was done now; the \
             original answer follows.\n\n"
        )
    } else {
        format!("{verb} {id}.\n\n")
    }
}

fn client(remote: &Remote) -> Result<Client, CliError> {
    let token = Token::from_env(TOKEN_ENV).map_err(|e| CliError(e.to_string()))?;
    Client::new(&remote.server, token).map_err(|e| CliError(format!("--server: {e}")))
}

fn key(arg: &KeyArg) -> Result<IdempotencyKey, CliError> {
    match &arg.idempotency_key {
        Some(k) => {
            IdempotencyKey::new(k.clone()).map_err(|e| CliError(format!("--idempotency-key: {e}")))
        }
        None => Ok(IdempotencyKey::random()),
    }
}

/// Fetches one page (`--cursor`) or every page (`--all`).
async fn collect<T, F, Fut>(paging: &PageArgs, mut fetch: F) -> Result<Page<T>, Error>
where
    F: FnMut(Option<String>) -> Fut,
    Fut: Future<Output = Result<Page<T>, Error>>,
{
    let mut page = fetch(paging.cursor.clone()).await?;
    if paging.all {
        while let Some(cursor) = page.next_cursor.take() {
            let next = fetch(Some(cursor)).await?;
            page.items.extend(next.items);
            page.next_cursor = next.next_cursor;
        }
    }
    Ok(page)
}

/// An error as one message, with a hint where one helps.
fn explain(error: Error, remote: &Remote) -> CliError {
    let hint = match error.code() {
        Some(ErrorCode::Unauthenticated) => format!(
            "\nhint: {TOKEN_ENV} holds a token this node does not accept (unknown or revoked; \
             `bootstrap` names the database it created the credential in: it must be this node's)"
        ),
        Some(ErrorCode::PermissionDenied) => "\nhint: reading needs events:read and writing \
                                              events:manage (bootstrap --event-access grants \
                                              both); publishing needs results:publish \
                                              (--publish-access)"
            .to_owned(),
        Some(ErrorCode::NotFound) => "\nhint: ids are 32 hex characters; a credential sees only \
                                      its own subscriptions, on queues in its scope"
            .to_owned(),
        _ if matches!(error, Error::Transport(_)) => format!(
            "\nhint: is a node running at {}? (--server or {SERVER_ENV})",
            remote.server
        ),
        _ => String::new(),
    };
    let request = match &error {
        Error::Api(api) => api
            .request_id
            .as_ref()
            .map(|r| format!(" (request {r})"))
            .unwrap_or_default(),
        _ => String::new(),
    };
    CliError(format!("{error}{request}{hint}"))
}

/// Prints tables or JSON to stdout.
struct Output {
    json: bool,
}

impl Output {
    fn new(json: bool) -> Output {
        Output { json }
    }

    fn value<T: serde::Serialize>(
        &mut self,
        value: &T,
        human: impl FnOnce() -> String,
    ) -> Result<(), CliError> {
        let text = if self.json {
            serde_json::to_string_pretty(value).map_err(|e| CliError(e.to_string()))?
        } else {
            human()
        };
        print(&text)
    }

    fn page<T: serde::Serialize>(&mut self, page: &Page<T>, table: String) -> Result<(), CliError> {
        if self.json {
            return self.value(page, String::new);
        }
        let mut text = table;
        if let Some(cursor) = &page.next_cursor {
            text.push_str(&format!(
                "\nMore: repeat with --cursor {cursor} (or --all for every page)."
            ));
        }
        print(&text)
    }
}

/// Writes `text` and a newline to stdout; a reader that stopped reading
/// (`| head`) is not a failure.
pub fn print(text: &str) -> Result<(), CliError> {
    let mut stdout = std::io::stdout().lock();
    match writeln!(stdout, "{}", text.trim_end()).and_then(|()| stdout.flush()) {
        // The reader stopped reading (`| head`): what it wanted, it has.
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        other => other.map_err(|e| CliError(format!("cannot write to stdout: {e}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn start_positions_are_new_start_or_a_sequence() {
        assert_eq!("new".parse(), Ok(StartPosition::New));
        assert_eq!("start".parse(), Ok(StartPosition::After(0)));
        assert_eq!("42".parse(), Ok(StartPosition::After(42)));
        assert!("042".parse::<StartPosition>().is_err());
        assert!("head".parse::<StartPosition>().is_err());
    }
}
