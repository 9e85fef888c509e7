//! `orbit-bench`: durable acknowledged deliveries per second and latency of
//! orbit-events, side by side with Redis Streams and a plain SQL queue, on
//! the same workload in one command (see README.md and
//! docs/performance.md).

mod drive;
mod floor;
mod handoff;
mod jetstream;
mod orbit;
mod redis_streams;
mod sql_queue;
mod stats;

use std::{path::PathBuf, time::Duration};

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand, ValueEnum};

use crate::{
    drive::Workload,
    orbit::{Backend, NodeOptions},
    redis_streams::RedisOptions,
    sql_queue::QueueBackend,
    stats::{RunResult, Summary},
};

#[derive(Parser)]
#[command(version, about = "Benchmark durable acknowledged deliveries", long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Runs the workload against each target, `--repeat` times
    /// (interleaved), and prints one table with median (min–max).
    Run(RunArgs),
    /// RSS of an orbit-events node with 0 and then N idle bound sessions.
    Idle(IdleArgs),
    /// The data model's ceiling: only the rows a delivery writes (event,
    /// delivery materialized, leased, ACKed on its row), B per
    /// transaction, with no service in between (see docs/performance.md).
    Floor(FloorArgs),
    /// The node's SQLite statements per delivery through sqlx (one
    /// hand-off per statement) and through rusqlite on a thread of its own
    /// (one hand-off per transaction), alternated.
    Handoff(HandoffArgs),
    /// The disk's durable-write latency: 4 KiB appends, each followed by
    /// `fdatasync`, in the scratch folder (what one commit waits for at
    /// least).
    Fsync(FsyncArgs),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Target {
    /// orbit-events on a fresh SQLite file (WAL, synchronous=FULL).
    OrbitSqlite,
    /// orbit-events on a fresh PostgreSQL database (needs --postgres).
    OrbitPostgres,
    /// Redis Streams, consumer groups, XACK per message (needs --redis).
    Redis,
    /// NATS JetStream, file storage, a durable pull consumer, one
    /// confirmed ACK per message (needs --nats).
    Jetstream,
    /// A plain PostgreSQL SKIP LOCKED queue, one commit per ACK.
    PgQueue,
    /// The same queue on SQLite (WAL, synchronous=FULL).
    SqliteQueue,
}

impl Target {
    fn label(self) -> &'static str {
        match self {
            Target::OrbitSqlite => "orbit-sqlite",
            Target::OrbitPostgres => "orbit-postgres",
            Target::Redis => "redis",
            Target::Jetstream => "jetstream",
            Target::PgQueue => "pg-queue",
            Target::SqliteQueue => "sqlite-queue",
        }
    }
}

#[derive(clap::Args, Clone)]
struct Common {
    /// The orbit-events binary (default: next to this one).
    #[arg(long)]
    orbit_bin: Option<PathBuf>,
    /// A PostgreSQL server URL (each run creates and drops its own database).
    #[arg(long, env = "ORBIT_BENCH_POSTGRES")]
    postgres: Option<String>,
    /// Temporary folders (SQLite files) go here.
    #[arg(long)]
    scratch: Option<PathBuf>,
}

#[derive(clap::Args)]
struct RunArgs {
    /// Targets, comma-separated.
    #[arg(long, value_delimiter = ',', required = true)]
    targets: Vec<Target>,
    #[command(flatten)]
    common: Common,
    /// Redis URL (started with appendonly yes, appendfsync always).
    #[arg(long, env = "ORBIT_BENCH_REDIS")]
    redis: Option<String>,
    /// Redis' data folder, for the size of its append-only file.
    #[arg(long, env = "ORBIT_BENCH_REDIS_DIR")]
    redis_dir: Option<PathBuf>,
    /// NATS URL (nats-server with JetStream; started by scripts/bench).
    #[arg(long, env = "ORBIT_BENCH_NATS")]
    nats: Option<String>,
    /// nats-server's JetStream store folder, for the bytes a run writes.
    #[arg(long, env = "ORBIT_BENCH_NATS_DIR")]
    nats_dir: Option<PathBuf>,
    /// nats-server's process id, for its RSS.
    #[arg(long, env = "ORBIT_BENCH_NATS_PID")]
    nats_pid: Option<u32>,
    /// How nats-server syncs its file store (printed with the table).
    #[arg(long, env = "ORBIT_BENCH_NATS_SYNC", default_value = "as started")]
    nats_sync: String,
    /// Results published (N).
    #[arg(short = 'n', long, default_value_t = 50_000)]
    events: u64,
    /// Consumer connections (C).
    #[arg(short = 'c', long, default_value_t = 8)]
    consumers: usize,
    /// Deliveries per consumer at once (K).
    #[arg(short = 'k', long, default_value_t = 32)]
    capacity: u32,
    /// Subscriptions (S), each receiving every result.
    #[arg(short = 's', long, default_value_t = 1)]
    subscriptions: usize,
    /// Publish one result per request at this rate (per second) instead
    /// of full speed.
    #[arg(long)]
    rate: Option<f64>,
    /// Results per publish request at full speed.
    #[arg(long, default_value_t = 100)]
    batch: usize,
    /// Concurrent publishers at full speed.
    #[arg(long, default_value_t = 4)]
    publishers: usize,
    /// Filler bytes per result.
    #[arg(long, default_value_t = 200)]
    payload: usize,
    /// Runs per target.
    #[arg(long, default_value_t = 3)]
    repeat: usize,
    /// orbit-events only: entries written into the log by SQL before the
    /// node starts (subscriptions start after them). A benchmark setup
    /// tool: the log is prefilled once per target into a template database
    /// that every run copies (see docs/performance.md). Several sizes,
    /// comma-separated, make one row per size, interleaved like targets.
    #[arg(long, alias = "prefill", value_delimiter = ',', default_value = "0")]
    preload: Vec<u64>,
    /// Give up on a run after this many seconds.
    #[arg(long, default_value_t = 600)]
    timeout_s: u64,
}

#[derive(clap::Args)]
struct IdleArgs {
    #[command(flatten)]
    common: Common,
    /// sqlite or postgres.
    #[arg(long, default_value = "sqlite")]
    backend: String,
    /// Idle bound sessions.
    #[arg(long, default_value_t = 128)]
    connections: usize,
    /// Capacity each session asks for.
    #[arg(short = 'k', long, default_value_t = 32)]
    capacity: u32,
    /// Measurements.
    #[arg(long, default_value_t = 3)]
    repeat: usize,
}

#[derive(clap::Args)]
struct FloorArgs {
    #[command(flatten)]
    common: Common,
    /// sqlite or postgres.
    #[arg(long, default_value = "sqlite")]
    backend: String,
    /// Deliveries written per measurement.
    #[arg(short = 'n', long, default_value_t = 50_000)]
    deliveries: u64,
    /// Deliveries per transaction, comma-separated (one row each).
    #[arg(long, value_delimiter = ',', default_value = "32,256")]
    batches: Vec<u64>,
    /// Commits per batch, comma-separated: 1 (all in one) and/or 3
    /// (publish and materialize, lease, ACK).
    #[arg(long, value_delimiter = ',', default_value = "1,3")]
    commits: Vec<u8>,
    /// Writers at once, each on its own connection.
    #[arg(long, default_value_t = 1)]
    writers: usize,
    /// Filler bytes per result.
    #[arg(long, default_value_t = 200)]
    payload: usize,
    /// Measurements per row (interleaved).
    #[arg(long, default_value_t = 3)]
    repeat: usize,
}

#[derive(clap::Args)]
struct HandoffArgs {
    #[command(flatten)]
    common: Common,
    /// sqlite (sqlx against rusqlite) or postgres (the claim as the node
    /// runs it against one statement).
    #[arg(long, default_value = "sqlite")]
    backend: String,
    /// Deliveries per measurement.
    #[arg(short = 'n', long, default_value_t = 50_000)]
    deliveries: u64,
    /// Deliveries per publish and per ACK transaction.
    #[arg(long, default_value_t = 64)]
    batch: u64,
    /// Rows per claim (at most the write queue, 8, in the node).
    #[arg(long, default_value_t = 8)]
    claim: u64,
    /// Measurements per driver (alternated).
    #[arg(long, default_value_t = 3)]
    repeat: usize,
}

#[derive(clap::Args)]
struct FsyncArgs {
    #[command(flatten)]
    common: Common,
    /// Appends, each synced.
    #[arg(short = 'n', long, default_value_t = 3_000)]
    count: usize,
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        match cli.command {
            Command::Run(args) => run(args).await,
            Command::Idle(args) => idle(args).await,
            Command::Floor(args) => floor_table(args).await,
            Command::Handoff(args) => handoff_table(args).await,
            Command::Fsync(args) => fsync_latency(args),
        }
    })
}

fn node_options(
    common: &Common,
    backend: Backend,
    preload: u64,
    template: &orbit::TemplateSlot,
) -> Result<NodeOptions> {
    let bin = match &common.orbit_bin {
        Some(b) => b.clone(),
        None => std::env::current_exe()?
            .parent()
            .context("no folder of this binary")?
            .join("orbit-events"),
    };
    if !bin.exists() {
        bail!(
            "{} not found: build it with `cargo build --release` or pass --orbit-bin",
            bin.display()
        );
    }
    Ok(NodeOptions {
        bin,
        backend,
        scratch: scratch(common),
        preload,
        template: template.clone(),
    })
}

fn scratch(common: &Common) -> PathBuf {
    common.scratch.clone().unwrap_or_else(std::env::temp_dir)
}

fn postgres(common: &Common) -> Result<String> {
    common
        .postgres
        .clone()
        .context("this target needs --postgres URL (or ORBIT_BENCH_POSTGRES)")
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "?".to_owned())
}

fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

async fn run_target(args: &RunArgs, row: &Row, w: &Workload) -> Result<RunResult> {
    let (target, preload, template) = (row.target, row.preload, &row.template);
    let label = row.label.as_str();
    match target {
        Target::OrbitSqlite => {
            let opts = node_options(&args.common, Backend::Sqlite, preload, template)?;
            orbit::run_once(&opts, w, label).await
        }
        Target::OrbitPostgres => {
            let opts = node_options(
                &args.common,
                Backend::Postgres(postgres(&args.common)?),
                preload,
                template,
            )?;
            orbit::run_once(&opts, w, label).await
        }
        Target::Redis => {
            let url = args
                .redis
                .clone()
                .context("the redis target needs --redis URL (or ORBIT_BENCH_REDIS)")?;
            let opts = RedisOptions {
                url,
                dir: args.redis_dir.clone(),
            };
            redis_streams::run_once(&opts, w, label).await
        }
        Target::Jetstream => {
            let url = args
                .nats
                .clone()
                .context("the jetstream target needs --nats URL (or ORBIT_BENCH_NATS)")?;
            let opts = jetstream::NatsOptions {
                url,
                dir: args.nats_dir.clone(),
                pid: args.nats_pid,
            };
            jetstream::run_once(&opts, w, label).await
        }
        Target::PgQueue => {
            let backend = QueueBackend::Postgres(postgres(&args.common)?);
            sql_queue::run_once(&backend, w, label).await
        }
        Target::SqliteQueue => {
            let backend = QueueBackend::Sqlite(scratch(&args.common));
            sql_queue::run_once(&backend, w, label).await
        }
    }
}

/// One row of the table: a target, and for orbit-events the size of the
/// prefilled log.
struct Row {
    target: Target,
    preload: u64,
    label: String,
    runs: Vec<RunResult>,
    template: orbit::TemplateSlot,
}

fn rows(args: &RunArgs) -> Vec<Row> {
    let mut rows = Vec::new();
    for target in &args.targets {
        let orbit = matches!(target, Target::OrbitSqlite | Target::OrbitPostgres);
        let sizes: &[u64] = if orbit { &args.preload } else { &[0] };
        for &preload in sizes {
            let label = if orbit && args.preload.len() > 1 {
                format!("{}+{preload}", target.label())
            } else {
                target.label().to_owned()
            };
            rows.push(Row {
                target: *target,
                preload,
                label,
                runs: Vec::new(),
                template: orbit::TemplateSlot::default(),
            });
        }
    }
    rows
}

/// Every run of every row, interleaved so that a noisy minute hurts
/// every row alike.
async fn run_all(args: &RunArgs, w: &Workload, rows: &mut [Row]) -> Result<()> {
    for rep in 1..=args.repeat {
        for row in rows.iter_mut() {
            let r = run_target(args, row, w)
                .await
                .with_context(|| format!("{} run {rep}", row.label))?;
            eprintln!(
                "{} run {rep}: {:.0} acked/s in {:.2} s, load {}",
                row.label,
                r.acked_per_s(),
                r.elapsed.as_secs_f64(),
                load_average()
            );
            row.runs.push(r);
        }
    }
    Ok(())
}

async fn run(args: RunArgs) -> Result<()> {
    let w = Workload {
        events: args.events,
        consumers: args.consumers,
        capacity: args.capacity,
        subscriptions: args.subscriptions.max(1),
        rate: args.rate,
        batch: args.batch.clamp(1, 100),
        publishers: args.publishers,
        payload_bytes: args.payload,
        timeout: Duration::from_secs(args.timeout_s),
    };
    let load_before = load_average();
    let mut rows = rows(&args);
    let measured = run_all(&args, &w, &mut rows).await;
    for row in &rows {
        if let Some(template) = row.template.lock().await.take() {
            template.remove().await?;
        }
    }
    measured?;
    let summaries: Vec<Summary> = rows
        .iter_mut()
        .map(|row| Summary::of(&row.label, &mut row.runs))
        .collect();

    let mode = match w.rate {
        Some(r) => format!("paced at {r}/s, one result per request"),
        None => format!(
            "full speed, {} results per request, {} publishers",
            w.batch, w.publishers
        ),
    };
    println!(
        "orbit-bench: N={} results, S={} subscription(s), C={} consumers, K={}, {} filler bytes, {}",
        w.events, w.subscriptions, w.consumers, w.capacity, w.payload_bytes, mode
    );
    if args.preload.iter().any(|&n| n > 0) {
        let sizes: Vec<String> = args.preload.iter().map(u64::to_string).collect();
        println!(
            "orbit-events logs prefilled with {} entries (row label +N), subscriptions from the head",
            sizes.join(" / ")
        );
    }
    println!(
        "{} runs per target (interleaved); {} cores; load average {} before, {} after",
        args.repeat,
        cores(),
        load_before,
        load_average()
    );
    println!(
        "durability: orbit-events SQLite WAL synchronous=FULL, PostgreSQL synchronous_commit=on; Redis appendfsync always; queues commit every ACK"
    );
    if args.targets.contains(&Target::Jetstream) {
        println!(
            "jetstream: file storage, explicit ACK confirmed by the server; {}",
            args.nats_sync
        );
    }
    println!("each cell: median (min–max); latencies in ms");
    print_table(&summaries);
    print_ratios(&summaries, w.rate.is_some());
    print_history_ratios(&args, &summaries);
    Ok(())
}

fn cell(s: &Option<stats::Spread>, decimals: usize) -> String {
    s.map_or_else(|| "n/a".to_owned(), |s| s.show(decimals))
}

fn print_table(summaries: &[Summary]) {
    let header = [
        "target",
        "acked/s",
        "p50",
        "p99",
        "p99.9",
        "ack p50",
        "ack p99",
        "RSS MiB",
        "RSS/conn KiB",
        "DB MiB",
    ];
    let rows: Vec<Vec<String>> = summaries
        .iter()
        .map(|s| {
            vec![
                s.target.clone(),
                cell(&s.acked_per_s, 0),
                cell(&s.p50_ms, 1),
                cell(&s.p99_ms, 1),
                cell(&s.p999_ms, 1),
                cell(&s.ack_p50_ms, 2),
                cell(&s.ack_p99_ms, 2),
                cell(&s.rss_mib, 0),
                cell(&s.rss_per_connection_kib, 0),
                cell(&s.db_mib, 1),
            ]
        })
        .collect();
    let widths: Vec<usize> = (0..header.len())
        .map(|i| {
            rows.iter()
                .map(|r| r[i].chars().count())
                .chain([header[i].len()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    let line = |cells: Vec<String>| {
        let padded: Vec<String> = cells
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        println!("| {} |", padded.join(" | "));
    };
    line(header.iter().map(|h| (*h).to_owned()).collect());
    println!(
        "|{}|",
        widths
            .iter()
            .map(|w| "-".repeat(w + 2))
            .collect::<Vec<_>>()
            .join("|")
    );
    for r in rows {
        line(r);
    }
}

/// With several prefill sizes: each larger log's acked/s against the
/// smallest's (docs/performance.md "History does not slow the hot paths").
fn print_history_ratios(args: &RunArgs, summaries: &[Summary]) {
    let (Some(&small), true) = (args.preload.iter().min(), args.preload.len() > 1) else {
        return;
    };
    let acked = |label: &str| {
        summaries
            .iter()
            .find(|s| s.target == label)
            .and_then(|s| s.acked_per_s)
            .map(|s| s.median)
    };
    for orbit in ["orbit-sqlite", "orbit-postgres"] {
        for &big in args.preload.iter().filter(|&&n| n != small) {
            if let (Some(b), Some(s)) = (
                acked(&format!("{orbit}+{big}")),
                acked(&format!("{orbit}+{small}")),
            ) {
                println!(
                    "{orbit} acked/s with {big} entries ÷ with {small}: {:.3}× ({:+.1} %)",
                    b / s,
                    (b / s - 1.0) * 100.0
                );
            }
        }
    }
}

/// Throughput ratios; latency ratios only for paced runs (at full speed the
/// latency is the time a result waits in the backlog, not a target's).
fn print_ratios(summaries: &[Summary], paced: bool) {
    let median = |name: &str, f: &dyn Fn(&Summary) -> Option<stats::Spread>| {
        summaries
            .iter()
            .find(|s| s.target == name)
            .and_then(f)
            .map(|s| s.median)
    };
    for orbit in ["orbit-sqlite", "orbit-postgres"] {
        let Some(ours) = median(orbit, &|s| s.acked_per_s) else {
            continue;
        };
        for base in ["redis", "pg-queue", "sqlite-queue"] {
            if let Some(theirs) = median(base, &|s| s.acked_per_s) {
                println!("{orbit} acked/s ÷ {base}: {:.2}×", ours / theirs);
            }
        }
        if let (true, Some(ours), Some(theirs)) = (
            paced,
            median(orbit, &|s| s.p99_ms),
            median("redis", &|s| s.p99_ms),
        ) {
            println!("{orbit} p99 ÷ redis p99: {:.2}×", ours / theirs);
        }
    }
}

async fn idle(args: IdleArgs) -> Result<()> {
    let backend = match args.backend.as_str() {
        "sqlite" => Backend::Sqlite,
        "postgres" => Backend::Postgres(postgres(&args.common)?),
        other => bail!("--backend is sqlite or postgres, not {other}"),
    };
    let opts = node_options(&args.common, backend, 0, &orbit::TemplateSlot::default())?;
    let load_before = load_average();
    let mut per = Vec::new();
    let mut rows = Vec::new();
    for _ in 0..args.repeat {
        let (rss0, rss_n) = orbit::idle_rss(&opts, args.connections, args.capacity).await?;
        let per_conn = (rss_n as f64 - rss0 as f64) / args.connections as f64;
        per.push(per_conn);
        rows.push((rss0, rss_n, per_conn));
    }
    println!(
        "orbit-bench idle: {} backend, {} idle bound sessions (capacity {}), {} runs; {} cores; load average {} before, {} after",
        args.backend,
        args.connections,
        args.capacity,
        args.repeat,
        cores(),
        load_before,
        load_average()
    );
    for (rss0, rss_n, per_conn) in rows {
        println!(
            "RSS with 0 sessions {rss0} KiB, with {} sessions {rss_n} KiB: {per_conn:.1} KiB per connection",
            args.connections
        );
    }
    if let Some(s) = stats::Spread::of(per) {
        println!("RSS per idle connection, KiB: {}", s.show(1));
    }
    Ok(())
}

async fn floor_table(args: FloorArgs) -> Result<()> {
    let backend = match args.backend.as_str() {
        "sqlite" => floor::FloorBackend::Sqlite(scratch(&args.common)),
        "postgres" => floor::FloorBackend::Postgres(postgres(&args.common)?),
        other => bail!("--backend is sqlite or postgres, not {other}"),
    };
    let bin = node_options(
        &args.common,
        Backend::Sqlite,
        0,
        &orbit::TemplateSlot::default(),
    )?
    .bin;
    let shapes: Vec<floor::FloorShape> = args
        .batches
        .iter()
        .flat_map(|&batch| {
            args.commits
                .iter()
                .map(move |&commits_per_batch| floor::FloorShape {
                    deliveries: args.deliveries,
                    batch,
                    commits_per_batch,
                    writers: args.writers,
                })
        })
        .collect();
    let load_before = load_average();
    let mut rates = vec![Vec::new(); shapes.len()];
    for _ in 0..args.repeat {
        for (shape, rates) in shapes.iter().zip(&mut rates) {
            let rate = floor::run_once(&backend, &bin, *shape, args.payload).await?;
            eprintln!(
                "floor {} batch {} commits {} writers {}: {rate:.0} deliveries/s",
                args.backend, shape.batch, shape.commits_per_batch, shape.writers
            );
            rates.push(rate);
        }
    }
    println!(
        "orbit-bench floor: {} backend, N={} deliveries, {} filler bytes, {} writer(s), {} runs per row; {} cores; load average {} before, {} after",
        args.backend,
        args.deliveries,
        args.payload,
        args.writers,
        args.repeat,
        cores(),
        load_before,
        load_average()
    );
    println!("durability: SQLite WAL synchronous=FULL, PostgreSQL synchronous_commit=on");
    println!("| deliveries per transaction | commits per batch | deliveries/s |");
    println!("|---|---|---|");
    for (shape, rates) in shapes.iter().zip(rates) {
        let shown = stats::Spread::of(rates).map_or_else(|| "-".to_owned(), |s| s.show(0));
        println!(
            "| {} | {} | {shown} |",
            shape.batch, shape.commits_per_batch
        );
    }
    Ok(())
}

async fn handoff_table(args: HandoffArgs) -> Result<()> {
    let bin = node_options(
        &args.common,
        Backend::Sqlite,
        0,
        &orbit::TemplateSlot::default(),
    )?
    .bin;
    let shape = handoff::HandoffShape {
        deliveries: args.deliveries,
        batch: args.batch,
        claim: args.claim,
    };
    let (backend, drivers) = match args.backend.as_str() {
        "sqlite" => (
            floor::FloorBackend::Sqlite(scratch(&args.common)),
            [handoff::Driver::Sqlx, handoff::Driver::Rusqlite],
        ),
        "postgres" => (
            floor::FloorBackend::Postgres(postgres(&args.common)?),
            [
                handoff::Driver::PgStatements,
                handoff::Driver::PgClaimStatement,
            ],
        ),
        other => bail!("--backend is sqlite or postgres, not {other}"),
    };
    let load_before = load_average();
    // One unmeasured run first: a fresh PostgreSQL cluster allocates its
    // WAL segments during its first run, which then goes 4× slower.
    handoff::run_once(&bin, &backend, drivers[0], shape).await?;
    let mut rates = vec![Vec::new(); drivers.len()];
    let mut cpus = vec![Vec::new(); drivers.len()];
    for round in 0..args.repeat {
        // ABBA: neither driver always runs first.
        let order: Vec<usize> = if round % 2 == 0 {
            vec![0, 1]
        } else {
            vec![1, 0]
        };
        for k in order {
            let (rate, cpu) = handoff::run_once(&bin, &backend, drivers[k], shape).await?;
            eprintln!(
                "handoff {}: {rate:.0} deliveries/s, {cpu:.1} ms CPU per 1000",
                drivers[k].name()
            );
            rates[k].push(rate);
            cpus[k].push(cpu);
        }
    }
    println!(
        "orbit-bench handoff: {}, N={} deliveries, {} per publish and ACK transaction, {} per claim, {} runs per driver; {} cores; load average {} before, {} after",
        args.backend,
        args.deliveries,
        args.batch,
        args.claim,
        args.repeat,
        cores(),
        load_before,
        load_average()
    );
    println!("| driver | deliveries/s | CPU ms per 1,000 |");
    println!("|---|---|---|");
    let mut medians = Vec::new();
    for ((driver, rates), cpus) in drivers.iter().zip(rates).zip(cpus) {
        let spread = stats::Spread::of(rates);
        medians.push(spread.as_ref().map(|s| s.median));
        let shown = spread.map_or_else(|| "-".to_owned(), |s| s.show(0));
        let cpu = stats::Spread::of(cpus).map_or_else(|| "-".to_owned(), |s| s.show(1));
        println!("| {} | {shown} | {cpu} |", driver.name());
    }
    if let [Some(before), Some(after)] = medians[..] {
        println!(
            "- {} ÷ {}: {:.2}×",
            drivers[1].name(),
            drivers[0].name(),
            after / before
        );
    }
    Ok(())
}

fn fsync_latency(args: FsyncArgs) -> Result<()> {
    use std::io::Write;
    let dir = tempfile::Builder::new()
        .prefix("fsync-bench-")
        .tempdir_in(scratch(&args.common))?;
    let mut file = std::fs::File::create(dir.path().join("appends"))?;
    let block = vec![0x5a_u8; 4096];
    let load_before = load_average();
    let mut millis = Vec::with_capacity(args.count);
    let started = std::time::Instant::now();
    for _ in 0..args.count {
        let t = std::time::Instant::now();
        file.write_all(&block)?;
        file.sync_data()?;
        millis.push(t.elapsed().as_secs_f64() * 1000.0);
    }
    let per_second = args.count as f64 / started.elapsed().as_secs_f64();
    millis.sort_by(f64::total_cmp);
    let at = |q: f64| millis[((q * millis.len() as f64) as usize).min(millis.len() - 1)];
    println!(
        "orbit-bench fsync: {} appends of 4 KiB, each followed by fdatasync; {} cores; load average {} before, {} after",
        args.count,
        cores(),
        load_before,
        load_average()
    );
    println!(
        "p50 {:.2} ms, p99 {:.2} ms, p99.9 {:.2} ms, max {:.2} ms; {per_second:.0} synced appends/s",
        at(0.5),
        at(0.99),
        at(0.999),
        at(1.0)
    );
    Ok(())
}
