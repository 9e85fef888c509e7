//! The `orbit-events` command line (spec: architecture.md §5).

use std::{path::PathBuf, process::ExitCode};

use clap::{Args, CommandFactory, Parser, Subcommand};
use orbit_events_client::cli::{
    self as admin, DeliveriesArgs, PublishArgs, QueuesArgs, SubscriptionsArgs,
};

use crate::{
    config::{Settings, redact_url},
    domain::{CredentialId, Permission, SubscriptionName},
    startup::Application,
    store::{
        Database,
        file_lock::{FileLock, lock_sqlite_file},
        tenancy,
    },
    telemetry,
};

/// orbit-events: delivers task results to applications over the
/// orbit.events.v1 WebSocket protocol, at least once, persisted before
/// announced.
#[derive(Debug, Parser)]
#[command(
    name = "orbit-events",
    version = crate::version::LONG_VERSION,
    propagate_version = true,
    after_help = "serve, migrate, bootstrap and credential work on the node's database (see \
                  --config and config/default.toml); subscriptions and deliveries talk to a \
                  running node over its HTTP API (--server or ORBIT_EVENTS_URL, token in \
                  ORBIT_EVENTS_TOKEN). `orbit-events COMMAND --help` says more; README.md and \
                  docs/ have the guides."
)]
pub struct Cli {
    /// Write log lines as JSON (to stderr), one object per line.
    #[arg(
        long,
        global = true,
        env = "ORBIT_EVENTS_LOG_JSON",
        help_heading = "Logging"
    )]
    pub log_json: bool,

    #[command(subcommand)]
    pub command: Command,
}

/// `--config FILE`: layered over config/default.toml, under the
/// ORBIT_EVENTS__SECTION__KEY environment variables.
#[derive(Debug, Args)]
pub struct ConfigArg {
    /// A TOML file layered over the defaults (see config/default.toml).
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run a node: create the SQLite file (under ./var/ by default), apply
    /// migrations, and listen for HTTP and WebSocket connections.
    Serve(ConfigArg),
    /// Apply database migrations and exit.
    Migrate(ConfigArg),
    /// Create (or reuse, by name) a namespace, application and queue, and a
    /// new credential scoped to that queue, with --event-access,
    /// --publish-access or both. Prints one JSON object on stdout; the token
    /// in it is shown only this once.
    Bootstrap(BootstrapArgs),
    /// List and revoke credentials, on the node's database (beside a
    /// running node or without one).
    Credential {
        #[command(subcommand)]
        command: CredentialCommand,
    },
    /// List, show, create, pause and resume subscriptions on a running
    /// node, over its HTTP API (token in ORBIT_EVENTS_TOKEN).
    Subscriptions(SubscriptionsArgs),
    /// List and show a subscription's deliveries, their history, and re-arm
    /// expired ones, on a running node over its HTTP API (token in
    /// ORBIT_EVENTS_TOKEN).
    Deliveries(DeliveriesArgs),
    /// List the queues of the credential's scope, on a running node over
    /// its HTTP API (token in ORBIT_EVENTS_TOKEN).
    Queues(QueuesArgs),
    /// Publish one task result to a queue, on a running node over its HTTP
    /// API (token with results:publish in ORBIT_EVENTS_TOKEN).
    Publish(PublishArgs),
    /// Print a completion script for SHELL to stdout, e.g. `orbit-events
    /// completions bash > ~/.local/share/bash-completion/completions/orbit-events`.
    #[command(after_help = COMPLETIONS_HELP)]
    Completions {
        /// The shell to complete for.
        #[arg(value_name = "SHELL")]
        shell: clap_complete::Shell,
    },
}

const COMPLETIONS_HELP: &str = "\
Install (then open a new shell):
  bash: orbit-events completions bash > ~/.local/share/bash-completion/completions/orbit-events
  zsh:  orbit-events completions zsh > ~/.zfunc/_orbit-events
        (with `fpath+=~/.zfunc; autoload -Uz compinit; compinit` in ~/.zshrc)
  fish: orbit-events completions fish > ~/.config/fish/completions/orbit-events.fish";

/// How `bootstrap` prints the new credential.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum BootstrapFormat {
    /// One JSON object.
    Json,
    /// Shell `export` lines (ORBIT_EVENTS_TOKEN and the ids), for `eval`.
    Env,
}

#[derive(Debug, Args)]
pub struct BootstrapArgs {
    #[command(flatten)]
    pub config: ConfigArg,
    /// Namespace (tenant) name.
    #[arg(long, value_name = "NAME")]
    pub namespace: String,
    /// Application name within the namespace.
    #[arg(long, value_name = "NAME")]
    pub application: String,
    /// Queue name within the namespace; the credential is scoped to it.
    #[arg(long, value_name = "NAME")]
    pub queue: String,
    /// Grant events:manage, events:read and events:consume (subscriptions
    /// and the WebSocket).
    #[arg(long)]
    pub event_access: bool,
    /// Grant results:publish (appending task results to the queue).
    #[arg(long)]
    pub publish_access: bool,
    /// Output: `json` (one object) or `env` (shell `export` lines, e.g.
    /// `eval "$(orbit-events bootstrap … --format env)"`).
    #[arg(long, value_name = "FORMAT", default_value = "json")]
    pub format: BootstrapFormat,
}

/// How `credential list` prints the credentials.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ListFormat {
    /// A table for people.
    Table,
    /// One JSON array, for scripts.
    Json,
}

#[derive(Debug, Subcommand)]
pub enum CredentialCommand {
    /// List every credential of the node's database, revoked ones too,
    /// oldest first: id, namespace, application, permissions, queue scope,
    /// when created and revoked; never a token or its digest. Reads the
    /// database directly and works beside a running node.
    List {
        #[command(flatten)]
        config: ConfigArg,
        /// Output: `table` or `json` (one array; ids as well as names).
        #[arg(long, value_name = "FORMAT", default_value = "table")]
        format: ListFormat,
    },
    /// Revoke a credential: its token stops working on HTTP at once, and
    /// its WebSocket sessions are closed at their next ping or claim.
    Revoke {
        #[command(flatten)]
        config: ConfigArg,
        /// The credential id printed by `bootstrap`.
        #[arg(value_name = "CREDENTIAL_ID")]
        credential_id: String,
    },
}

/// Runs the command; the exit code is 0 on success.
pub async fn run(cli: Cli) -> ExitCode {
    telemetry::init(cli.log_json);
    let result = match cli.command {
        Command::Serve(args) => serve(args).await,
        Command::Migrate(args) => migrate(args).await,
        Command::Bootstrap(args) => bootstrap(args).await,
        Command::Credential {
            command: CredentialCommand::List { config, format },
        } => list_credentials(config, format).await,
        Command::Credential {
            command:
                CredentialCommand::Revoke {
                    config,
                    credential_id,
                },
        } => revoke(config, &credential_id).await,
        Command::Subscriptions(args) => admin::run_subscriptions(args)
            .await
            .map_err(|e| e.to_string()),
        Command::Deliveries(args) => admin::run_deliveries(args).await.map_err(|e| e.to_string()),
        Command::Queues(args) => admin::run_queues(args).await.map_err(|e| e.to_string()),
        Command::Publish(args) => admin::run_publish(args).await.map_err(|e| e.to_string()),
        Command::Completions { shell } => completions(shell),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("orbit-events: {message}");
            ExitCode::FAILURE
        }
    }
}

fn load(args: &ConfigArg) -> Result<Settings, String> {
    Settings::load(args.config.as_deref()).map_err(|e| e.to_string())
}

async fn open(settings: &Settings) -> Result<Database, String> {
    let db = Database::connect(&settings.database)
        .await
        .map_err(|e| format!("cannot open {}: {e}", redact_url(&settings.database.url)))?;
    db.migrate()
        .await
        .map_err(|e| format!("migration failed: {e}"))?;
    Ok(db)
}

/// The lock of the node's SQLite file (none for PostgreSQL), held until
/// the caller ends: a second `serve` or `migrate` on the file stops here.
fn lock(settings: &Settings) -> Result<Option<FileLock>, String> {
    lock_sqlite_file(&settings.database.url).map_err(|e| e.to_string())
}

async fn serve(args: ConfigArg) -> Result<(), String> {
    let settings = load(&args)?;
    let _lock = lock(&settings)?;
    let db = open(&settings).await?;
    let listen = settings.server.listen.clone();
    let database = database_name(&settings);
    // `key=value` pairs, e.g. `timing.lease_ms=2000`: a setting that
    // differs from the defaults should be seen, not guessed.
    let changed = settings
        .differences()
        .into_iter()
        .map(|(key, value)| format!("{key}={value}"))
        .collect::<Vec<_>>()
        .join(" ");
    let app = Application::build_with_database(settings, db)
        .await
        .map_err(|e| e.to_string())?;
    let host = listen
        .rsplit_once(':')
        .map(|(h, _)| h)
        .unwrap_or("127.0.0.1");
    let address = format!("http://{host}:{port}", port = app.port());
    tracing::info!(
        version = crate::version::VERSION,
        commit = crate::version::COMMIT,
        %address,
        %database,
        node_id = %app.state().node_id,
        settings = if changed.is_empty() { "defaults" } else { changed.as_str() },
        "orbit-events {} listening on {address}",
        crate::version::LONG_VERSION,
    );
    if let Some(port) = app.metrics_port() {
        tracing::info!("metrics on http://{host}:{port}/metrics (server.metrics_listen)");
    }
    tracing::info!(
        "next: create a credential with `cargo run --release -- bootstrap --namespace demo \
         --application app --queue results --event-access --publish-access`, then follow \
         README.md (walk-through) and docs/ (HTTP API and orbit.events.v1 guides); the API \
         reference is served at {address}/docs/"
    );
    app.run_until_signal().await.map_err(|e| e.to_string())
}

async fn migrate(args: ConfigArg) -> Result<(), String> {
    let settings = load(&args)?;
    let _lock = lock(&settings)?;
    open(&settings).await?;
    tracing::info!("migrations applied to {}", database_name(&settings));
    Ok(())
}

async fn bootstrap(args: BootstrapArgs) -> Result<(), String> {
    for (flag, value) in [
        ("--namespace", &args.namespace),
        ("--application", &args.application),
        ("--queue", &args.queue),
    ] {
        if SubscriptionName::parse(value).is_none() {
            return Err(format!(
                "{flag} must be 1-128 characters: a letter or digit, then letters, digits, '.', '_' or '-'"
            ));
        }
    }
    // The spec keeps both flags optional (http-api.md §1: the `events:*`
    // actions only with an explicit flag), so a credential without either is
    // still created; but it can do nothing except get 403, so say so.
    if !args.event_access && !args.publish_access {
        eprintln!(
            "orbit-events: warning: this credential has no permission and will get 403 \
             everywhere; give --event-access (subscriptions and the WebSocket), \
             --publish-access (appending results), or both"
        );
    }
    let mut permissions = Vec::new();
    if args.event_access {
        permissions.extend(Permission::EVENT_ACCESS);
    }
    if args.publish_access {
        permissions.push(Permission::ResultsPublish);
    }
    let settings = load(&args.config)?;
    let db = open(&settings).await?;
    let out = tenancy::bootstrap(
        &db,
        &args.namespace,
        &args.application,
        &args.queue,
        &permissions,
    )
    .await
    .map_err(|e| format!("bootstrap failed: {e}"))?;
    match args.format {
        BootstrapFormat::Json => {
            let json = serde_json::to_string(&out).map_err(|e| e.to_string())?;
            println!("{json}");
        }
        BootstrapFormat::Env => {
            // Tokens and ids are base64url and hex: nothing to escape
            // inside single quotes.
            for (name, value) in [
                (admin::TOKEN_ENV, &out.token),
                ("ORBIT_EVENTS_QUEUE_ID", &out.queue_id),
                ("ORBIT_EVENTS_CREDENTIAL_ID", &out.credential_id),
                ("ORBIT_EVENTS_NAMESPACE_ID", &out.namespace_id),
                ("ORBIT_EVENTS_APPLICATION_ID", &out.application_id),
            ] {
                println!("export {name}='{value}'");
            }
        }
    }
    // The token works only on nodes of this database: name it, resolved,
    // since the default SQLite path is relative to the working directory.
    tracing::info!("credential created in {}", database_name(&settings));
    Ok(())
}

/// The database of `settings` for messages: the SQLite file's absolute
/// path when there is one, else the URL without its password.
fn database_name(settings: &Settings) -> String {
    let url = &settings.database.url;
    crate::store::sqlite_path(url)
        .and_then(|path| std::path::absolute(path).ok())
        .map_or_else(|| redact_url(url), |path| path.display().to_string())
}

async fn revoke(args: ConfigArg, credential_id: &str) -> Result<(), String> {
    let id = CredentialId::parse(credential_id)
        .ok_or_else(|| "CREDENTIAL_ID must be 32 lowercase hex characters".to_owned())?;
    let settings = load(&args)?;
    let db = open(&settings).await?;
    match tenancy::revoke_credential(&db, &id).await {
        Ok(Some(at)) => {
            println!(
                "{}",
                serde_json::json!({ "credential_id": id, "revoked_at": at })
            );
            Ok(())
        }
        Ok(None) => Err(format!("no credential {id}")),
        Err(e) => Err(format!("revoke failed: {e}")),
    }
}

/// `credential list`: a read of the database as it is, so it takes no lock
/// (decision 0082) and applies no migration, and it refuses to create a
/// SQLite file that is not there (most likely the wrong working directory).
async fn list_credentials(args: ConfigArg, format: ListFormat) -> Result<(), String> {
    let settings = load(&args)?;
    let database = database_name(&settings);
    if let Some(path) = crate::store::sqlite_path(&settings.database.url)
        && !std::path::Path::new(path).exists()
    {
        return Err(format!(
            "no database at {database}: give the node's configuration (--config, \
             ORBIT_EVENTS__DATABASE__URL) or run from the node's working directory"
        ));
    }
    let db = Database::connect(&settings.database)
        .await
        .map_err(|e| format!("cannot open {database}: {e}"))?;
    let credentials = tenancy::list_credentials(db.reader()).await.map_err(|e| {
        format!(
            "cannot list the credentials of {database}: {e} (is it a node's database? \
                 `orbit-events migrate` creates the tables)"
        )
    })?;
    if credentials.is_empty() {
        eprintln!(
            "orbit-events: no credentials in {database}; `orbit-events bootstrap` creates one"
        );
    } else {
        let n = credentials.len();
        tracing::info!(
            "{n} credential{} in {database}",
            if n == 1 { "" } else { "s" }
        );
    }
    let text = match format {
        ListFormat::Json => {
            serde_json::to_string_pretty(&credentials).map_err(|e| e.to_string())?
        }
        ListFormat::Table if credentials.is_empty() => return Ok(()),
        ListFormat::Table => credentials_table(&credentials),
    };
    admin::print(&text).map_err(|e| e.to_string())
}

fn credentials_table(credentials: &[tenancy::CredentialListing]) -> String {
    let list = |items: Vec<&str>| {
        if items.is_empty() {
            "none".to_owned()
        } else {
            items.join(",")
        }
    };
    let rows = credentials
        .iter()
        .map(|c| {
            vec![
                c.credential_id.clone(),
                c.namespace
                    .clone()
                    .unwrap_or_else(|| c.namespace_id.clone()),
                c.application
                    .clone()
                    .unwrap_or_else(|| c.application_id.clone()),
                list(c.permissions.iter().map(String::as_str).collect()),
                list(
                    c.queue_scope
                        .iter()
                        .map(|q| q.name.as_deref().unwrap_or(&q.id))
                        .collect(),
                ),
                seconds(c.created_at),
                c.revoked_at.map_or_else(|| "no".to_owned(), seconds),
            ]
        })
        .collect();
    admin::plain_table(
        &[
            "CREDENTIAL",
            "NAMESPACE",
            "APPLICATION",
            "PERMISSIONS",
            "QUEUES",
            "CREATED",
            "REVOKED",
        ],
        rows,
    )
}

/// RFC 3339 to the second, as the other tables show times.
fn seconds(t: crate::domain::Timestamp) -> String {
    chrono::DateTime::from_timestamp_micros(t.micros()).map_or_else(
        || t.to_rfc3339(),
        |t| t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
    )
}

/// `completions SHELL`: clap_complete's script for the whole command line.
fn completions(shell: clap_complete::Shell) -> Result<(), String> {
    let mut script = Vec::new();
    clap_complete::generate(shell, &mut Cli::command(), "orbit-events", &mut script);
    let mut script = String::from_utf8(script).map_err(|e| e.to_string())?;
    if shell == clap_complete::Shell::Bash {
        // clap_complete's bash script names a subcommand's state after the
        // binary with `-` turned into `__subcmd__` in its case labels but
        // `__` where it sets the state (clap-rs/clap#6421): below the first
        // word nothing matched. One spelling for both.
        script = script.replace("orbit__subcmd__events", "orbit__events");
    }
    admin::print(&script).map_err(|e| e.to_string())
}
