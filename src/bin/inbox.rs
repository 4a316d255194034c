//! `inbox`: the operator's command line for an inbox table (migrate, stats, cleanup, dead
//! letters) and its outbox (stats, dead rows). Reads `DATABASE_URL` (PostgreSQL, MySQL /
//! MariaDB, or SQLite); replay reads `AMQP_URL`, `KAFKA_BROKERS`, `NATS_URL` or `REDIS_URL`. Errors are one line on stderr and a non-zero exit; the database password is
//! never printed.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Args, Parser, Subcommand, ValueEnum};
use inbox::dead_letter::Replay;
use inbox::outbox::OutboxStore;
use inbox::store::{ConsumerStats, DeadLetter};
use inbox::{
    Cleanup, ConsumerName, InboxAdmin, MessageId, MySqlStore, PostgresStore, SqliteStore, Transport,
};

/// Operate an inbox table: migrate it, see what it holds, clean it up, and replay dead letters.
#[derive(Parser)]
#[command(name = "inbox", version, propagate_version = true)]
struct Cli {
    /// The database holding the inbox table: `postgres://…`, `mysql://…` (or `mariadb://…`) or `sqlite:…`.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true, global = true)]
    database_url: Option<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Create or update the inbox schema (its own migration table; safe to run from many
    /// instances at once).
    Migrate,
    /// Rows, throughput, failures and dead letters per consumer.
    Stats {
        /// Only this consumer.
        #[arg(long)]
        consumer: Option<String>,
        /// One JSON array, for scripts.
        #[arg(long)]
        json: bool,
    },
    /// Delete processed rows older than the retention window (dead-lettered rows are kept).
    Cleanup(CleanupArgs),
    /// Dead-lettered messages.
    #[command(subcommand)]
    Dead(DeadCommand),
    /// The outbox: what waits to be published, and rows that could not be.
    #[command(subcommand)]
    Outbox(OutboxCommand),
}

#[derive(Subcommand)]
enum OutboxCommand {
    /// Pending, failing and dead rows, blocked ordering keys and the relay's lag, per
    /// destination.
    Stats {
        /// One JSON array, for scripts.
        #[arg(long)]
        json: bool,
    },
    /// Rows the relay gave up on.
    #[command(subcommand)]
    Dead(OutboxDeadCommand),
}

#[derive(Subcommand)]
enum OutboxDeadCommand {
    /// List dead rows, oldest first.
    List {
        /// At most this many.
        #[arg(long, default_value_t = 100)]
        limit: u32,
        /// One JSON array, for scripts.
        #[arg(long)]
        json: bool,
    },
    /// Publish dead rows again, with a fresh attempt budget (their keys' later rows follow).
    Retry {
        /// Row ids (the `id` column of `outbox dead list`).
        #[arg(required_unless_present = "all", conflicts_with = "all")]
        rows: Vec<i64>,
        /// Every dead row.
        #[arg(long)]
        all: bool,
    },
    /// Delete dead rows without publishing them, releasing the later rows of their keys.
    Skip {
        /// Row ids (the `id` column of `outbox dead list`).
        #[arg(required = true)]
        rows: Vec<i64>,
    },
}

#[derive(Args)]
struct CleanupArgs {
    /// Delete rows processed longer ago than this (`7d`, `36h`, `90m`).
    #[arg(long, value_parser = humantime::parse_duration)]
    older_than: Duration,
    /// The most rows per transaction.
    #[arg(long, default_value_t = 10_000)]
    batch_size: u32,
    /// Pacing: batches of about 20 ms, each followed by a rest of this many times its duration,
    /// so that running consumers barely feel the cleanup (it deletes at about 1 / (1 + REST) of
    /// the unpaced rate).
    #[arg(long, default_value_t = 4.0)]
    rest: f64,
    /// Batches of --batch-size back to back: as fast as the database deletes, felt most by
    /// the consumers running beside it.
    #[arg(long, conflicts_with = "rest")]
    unpaced: bool,
    /// How long copies of a message can still arrive (broker retention, replays); a shorter
    /// `--older-than` is warned about.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "7d")]
    redelivery_horizon: Duration,
}

#[derive(Subcommand)]
enum DeadCommand {
    /// List dead-lettered messages, oldest first.
    List {
        /// Only this consumer.
        #[arg(long)]
        consumer: Option<String>,
        /// At most this many.
        #[arg(long, default_value_t = 100)]
        limit: u32,
        /// One JSON array, for scripts.
        #[arg(long)]
        json: bool,
    },
    /// Clear the dead mark and publish the message to its source again; the consumer then
    /// handles it once (other consumers of the source discard the copy).
    Replay(ReplayArgs),
}

#[derive(Args)]
struct ReplayArgs {
    /// Message ids to replay.
    #[arg(required_unless_present = "all", conflicts_with = "all")]
    ids: Vec<String>,
    /// Every message the consumer dead-lettered.
    #[arg(long)]
    all: bool,
    /// The consumer whose dead letters to replay.
    #[arg(long)]
    consumer: String,
    /// The consumer's source; its dead letters are read from `<source>.dead-letter`.
    #[arg(long, required_unless_present = "dead_letter")]
    source: Option<String>,
    /// The dead-letter destination, when the consumer set one of its own.
    #[arg(long)]
    dead_letter: Option<String>,
    /// The broker: RabbitMQ reads `AMQP_URL`, Kafka `KAFKA_BROKERS`, NATS `NATS_URL`, Redis
    /// `REDIS_URL`.
    #[arg(long, value_enum)]
    transport: TransportKind,
}

#[derive(Clone, Copy, ValueEnum)]
enum TransportKind {
    Rabbitmq,
    Kafka,
    Nats,
    Redis,
}

type Error = Box<dyn std::error::Error + Send + Sync>;

fn main() -> ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let result = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(Error::from)
        .and_then(|runtime| runtime.block_on(run(cli)));
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {}", inbox::error_chain(&*e));
            ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> Result<ExitCode, Error> {
    let url = cli
        .database_url
        .ok_or("no database: set DATABASE_URL or pass --database-url")?;
    if url.starts_with("postgres:") || url.starts_with("postgresql:") {
        command(cli.command, PostgresStore::connect(&url, 4).await?).await
    } else if url.starts_with("mysql:") || url.starts_with("mariadb:") {
        command(cli.command, MySqlStore::connect(&url, 4).await?).await
    } else if url.starts_with("sqlite:") {
        command(cli.command, SqliteStore::connect(&url).await?).await
    } else {
        Err("DATABASE_URL must start with postgres://, mysql://, mariadb:// or sqlite:".into())
    }
}

async fn command<S: InboxAdmin + OutboxStore + Clone>(
    command: Command,
    store: S,
) -> Result<ExitCode, Error> {
    match command {
        Command::Migrate => {
            store.migrate().await?;
            println!("inbox schema is up to date");
        }
        Command::Stats { consumer, json } => {
            let consumer = consumer.map(ConsumerName::new).transpose()?;
            let stats = store.stats(consumer.as_ref()).await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&stats_json(&stats))?);
            } else {
                print_stats(&stats);
            }
        }
        Command::Cleanup(args) => cleanup(store, args).await?,
        Command::Dead(DeadCommand::List {
            consumer,
            limit,
            json,
        }) => {
            let consumer = consumer.map(ConsumerName::new).transpose()?;
            let dead = store.dead_letters(consumer.as_ref(), limit).await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&dead_json(&dead))?);
            } else {
                print_dead(&dead);
            }
        }
        Command::Dead(DeadCommand::Replay(args)) => return replay(&store, args).await,
        Command::Outbox(command) => outbox(&store, command).await?,
    }
    Ok(ExitCode::SUCCESS)
}

async fn outbox<S: OutboxStore>(store: &S, command: OutboxCommand) -> Result<(), Error> {
    match command {
        OutboxCommand::Stats { json } => {
            let stats = store.outbox_stats().await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&stats)?);
            } else if stats.is_empty() {
                println!("no outbox rows");
            } else {
                let width = stats
                    .iter()
                    .map(|s| s.destination.len())
                    .max()
                    .unwrap_or(0)
                    .max(11);
                println!(
                    "{:<width$}  {:>8}  {:>8}  {:>6}  {:>12}  {:>10}  {:>14}",
                    "destination",
                    "pending",
                    "failing",
                    "dead",
                    "blocked keys",
                    "published",
                    "oldest pending"
                );
                for s in &stats {
                    println!(
                        "{:<width$}  {:>8}  {:>8}  {:>6}  {:>12}  {:>10}  {:>14}",
                        s.destination,
                        s.pending,
                        s.failing,
                        s.dead,
                        s.blocked_keys,
                        s.published_kept,
                        s.oldest_pending_seconds
                            .map_or("-".to_owned(), |secs| age(Duration::from_secs_f64(secs))),
                    );
                }
            }
        }
        OutboxCommand::Dead(OutboxDeadCommand::List { limit, json }) => {
            let dead = store.outbox_dead(limit).await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&dead)?);
            } else if dead.is_empty() {
                println!("no dead outbox rows");
            } else {
                println!(
                    "{:>10}  {:<24}  {:<38}  {:<16}  {:>8}  last error",
                    "id", "destination", "message id", "key", "attempts"
                );
                for d in &dead {
                    let error = one_line(d.last_error.as_deref().unwrap_or("-"));
                    println!(
                        "{:>10}  {:<24}  {:<38}  {:<16}  {:>8}  {}",
                        d.id,
                        d.destination,
                        d.message_id,
                        d.ordering_key.as_deref().unwrap_or("-"),
                        d.attempts,
                        error
                    );
                }
            }
        }
        OutboxCommand::Dead(OutboxDeadCommand::Retry { rows, all }) => {
            let retried = store
                .outbox_retry(if all { None } else { Some(&rows) })
                .await?;
            println!("{retried} dead rows will be published again");
        }
        OutboxCommand::Dead(OutboxDeadCommand::Skip { rows }) => {
            let skipped = store.outbox_skip(&rows).await?;
            println!("{skipped} dead rows deleted without publishing");
        }
    }
    Ok(())
}

fn print_stats(stats: &[ConsumerStats]) {
    if stats.is_empty() {
        println!("no rows");
        return;
    }
    let width = stats
        .iter()
        .map(|s| s.consumer.len())
        .max()
        .unwrap_or(0)
        .max(8);
    println!(
        "{:<width$}  {:>10}  {:>10}  {:>10}  {:>8}  {:>8}  {:>18}",
        "consumer", "rows", "processed", "last hour", "failing", "dead", "oldest unprocessed"
    );
    for s in stats {
        println!(
            "{:<width$}  {:>10}  {:>10}  {:>10}  {:>8}  {:>8}  {:>18}",
            s.consumer,
            s.rows,
            s.processed,
            s.processed_last_hour,
            s.failing,
            s.dead,
            s.oldest_unprocessed.map_or("-".to_owned(), age),
        );
    }
}

fn stats_json(stats: &[ConsumerStats]) -> serde_json::Value {
    stats
        .iter()
        .map(|s| {
            serde_json::json!({
                "consumer": s.consumer,
                "rows": s.rows,
                "processed": s.processed,
                "processed_last_hour": s.processed_last_hour,
                "failing": s.failing,
                "dead": s.dead,
                "oldest_unprocessed_seconds": s.oldest_unprocessed.map(|d| d.as_secs_f64()),
            })
        })
        .collect()
}

fn print_dead(dead: &[DeadLetter]) {
    if dead.is_empty() {
        println!("no dead letters");
        return;
    }
    let id_width = dead
        .iter()
        .map(|d| d.message_id.len())
        .max()
        .unwrap_or(0)
        .max(2);
    let consumer_width = dead
        .iter()
        .map(|d| d.consumer.len())
        .max()
        .unwrap_or(0)
        .max(8);
    println!(
        "{:<id_width$}  {:<consumer_width$}  {:>8}  {:>10}  last error",
        "id", "consumer", "attempts", "dead for"
    );
    for d in dead {
        let error = one_line(d.last_error.as_deref().unwrap_or("-"));
        println!(
            "{:<id_width$}  {:<consumer_width$}  {:>8}  {:>10}  {}",
            d.message_id,
            d.consumer,
            d.attempts,
            age(d.age),
            error
        );
    }
}

fn dead_json(dead: &[DeadLetter]) -> serde_json::Value {
    dead.iter()
        .map(|d| {
            serde_json::json!({
                "message_id": d.message_id,
                "consumer": d.consumer,
                "attempts": d.attempts,
                "last_error": d.last_error,
                "dead_for_seconds": d.age.as_secs_f64(),
            })
        })
        .collect()
}

/// An error text on one line of at most 120 characters, however long it is and whatever it holds.
fn one_line(text: &str) -> String {
    text.chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .take(120)
        .collect()
}

/// A duration in its largest unit and the next one when not zero: `40d 2h`, `7d`, `12m 5s`.
fn age(d: Duration) -> String {
    let secs = d.as_secs();
    let units = [(86_400, "d"), (3_600, "h"), (60, "m"), (1, "s")];
    let Some(first) = units.iter().position(|&(n, _)| secs >= n) else {
        return "0s".to_owned();
    };
    let (n, unit) = units[first];
    let mut text = format!("{}{unit}", secs / n);
    if let Some(&(m, next)) = units.get(first + 1) {
        let rest = secs % n / m;
        if rest > 0 {
            text.push_str(&format!(" {rest}{next}"));
        }
    }
    text
}

async fn cleanup<S: InboxAdmin + Clone>(store: S, args: CleanupArgs) -> Result<(), Error> {
    let cleanup = Cleanup::new(store.clone(), args.older_than)
        .batch_size(args.batch_size)
        .redelivery_horizon(args.redelivery_horizon);
    let cleanup = if args.unpaced {
        cleanup.unpaced()
    } else {
        cleanup.pace(Duration::from_millis(20), args.rest)
    };
    if !cleanup.retention_covers_horizon() {
        eprintln!(
            "warning: --older-than {} is shorter than the redelivery horizon {}: a copy arriving after its row is deleted is handled again",
            age(args.older_than),
            age(args.redelivery_horizon)
        );
    }
    let expired = store.count_expired(args.older_than).await?;
    let bar =
        indicatif::ProgressBar::new(expired).with_style(indicatif::ProgressStyle::with_template(
            "{bar:40} {pos}/{len} rows deleted ({per_sec}, {eta} left)",
        )?);
    let started = Instant::now();
    let report = cleanup
        .run_once_with_progress(&|deleted| bar.set_position(deleted))
        .await?;
    bar.finish_and_clear();
    if report.skipped_locked {
        println!("another instance is cleaning up now; nothing deleted");
    } else {
        println!(
            "deleted {} rows in {} {} in {:.1} s (dead-lettered rows kept)",
            report.deleted,
            report.batches,
            if report.batches == 1 {
                "batch"
            } else {
                "batches"
            },
            started.elapsed().as_secs_f64()
        );
    }
    Ok(())
}

async fn replay<S: InboxAdmin>(store: &S, args: ReplayArgs) -> Result<ExitCode, Error> {
    let consumer = ConsumerName::new(args.consumer)?;
    let destination = match (args.dead_letter, args.source) {
        (Some(d), _) => d,
        (None, Some(source)) => inbox::dead_letter::default_destination(&source),
        (None, None) => unreachable!("clap requires one"),
    };
    let which = if args.all {
        Replay::All
    } else {
        Replay::Ids(
            args.ids
                .into_iter()
                .map(MessageId::new)
                .collect::<Result<_, _>>()?,
        )
    };
    let transport = transport(args.transport).await?;
    let report =
        inbox::dead_letter::replay(&*transport, store, &consumer, &destination, which).await?;
    println!(
        "replayed {} (read {} dead letters from {destination})",
        report.replayed.len(),
        report.read
    );
    for id in &report.replayed {
        println!("  replayed   {id}");
    }
    for id in &report.not_dead {
        println!("  not dead   {id}");
    }
    for id in &report.missing {
        println!("  no letter  {id}");
    }
    if report.missing.is_empty() && report.not_dead.is_empty() {
        Ok(ExitCode::SUCCESS)
    } else {
        let mut problems = Vec::new();
        if !report.not_dead.is_empty() {
            problems.push(format!(
                "{} not dead-lettered by {consumer}",
                report.not_dead.len()
            ));
        }
        if !report.missing.is_empty() {
            problems.push(format!(
                "{} with no dead letter in {destination}",
                report.missing.len()
            ));
        }
        eprintln!("error: {}", problems.join(", "));
        Ok(ExitCode::FAILURE)
    }
}

/// RabbitMQ reads `AMQP_URL`, Kafka `KAFKA_BROKERS`, NATS `NATS_URL`, Redis `REDIS_URL`.
async fn transport(kind: TransportKind) -> Result<Arc<dyn Transport>, Error> {
    match kind {
        #[cfg(feature = "rabbitmq")]
        TransportKind::Rabbitmq => {
            let url =
                std::env::var("AMQP_URL").map_err(|_| "set AMQP_URL to replay through RabbitMQ")?;
            Ok(Arc::new(inbox::rabbitmq::RabbitMqTransport::new(
                url,
                Default::default(),
            )))
        }
        #[cfg(feature = "kafka")]
        TransportKind::Kafka => {
            let brokers = std::env::var("KAFKA_BROKERS")
                .map_err(|_| "set KAFKA_BROKERS to replay through Kafka")?;
            Ok(Arc::new(inbox::kafka::KafkaTransport::new(
                inbox::kafka::KafkaConfig::new(brokers),
            )?))
        }
        #[cfg(feature = "nats")]
        TransportKind::Nats => {
            let url = std::env::var("NATS_URL").map_err(|_| "set NATS_URL to replay through NATS")?;
            Ok(Arc::new(
                inbox::nats::NatsTransport::connect(url, Default::default()).await?,
            ))
        }
        #[cfg(feature = "redis")]
        TransportKind::Redis => {
            let url =
                std::env::var("REDIS_URL").map_err(|_| "set REDIS_URL to replay through Redis")?;
            Ok(Arc::new(
                inbox::redis::RedisTransport::connect(url, Default::default()).await?,
            ))
        }
        #[allow(unreachable_patterns)]
        _ => Err(
            "this build of inbox has no such transport: build it with --features rabbitmq,kafka,nats,redis"
                .into(),
        ),
    }
}
