//! parcel-tracker: the inbox demo.
//!
//! A producer creates parcels, each with its `ParcelCreatedEvent` in the outbox in the same
//! transaction; a relay publishes the events; two consumers — `notification` and
//! `carrier-assignment` — each write their effect rows in the inbox transaction. Run without
//! arguments it needs no service: in-memory broker with injected faults, a relay that crashes
//! mid-batch, SQLite in a temporary file. Its subcommands drive real infrastructure (see
//! `--help`).

mod domain;
mod producer;

use std::collections::HashSet;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};
use domain::{CarrierAssignment, Dialect, Notification, Report};
#[cfg(feature = "mysql")]
use inbox::MySqlStore;
#[cfg(feature = "postgres")]
use inbox::PostgresStore;
use inbox::memory::{Faults, MemoryBroker};
use inbox::outbox::{Outbox, OutboxStore};
use inbox::{
    CancellationToken, Consumer, ConsumerName, Handler, InboxAdmin, InboxStore, OutgoingMessage,
    SqliteStore, Transport,
};
use indicatif::{ProgressBar, ProgressStyle};

#[derive(Parser)]
#[command(
    name = "parcel_tracker",
    about = "The inbox demo: exactly-once parcel notifications and carrier bookings"
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    demo: DemoArgs,
}

#[derive(Subcommand)]
enum Command {
    /// Consume until SIGINT/SIGTERM, then drain and exit 0.
    Consume(ConsumeArgs),
    /// Publish ParcelCreatedEvents straight to the broker (some twice, as a retrying producer
    /// would), without the outbox.
    Publish(PublishArgs),
    /// Create parcels, each with its event in the outbox in the same transaction.
    Produce(ProduceArgs),
    /// Serve the HTTP API that creates parcels (POST /parcels, GET /health) until SIGINT/SIGTERM.
    Serve(ServeArgs),
    /// Publish the outbox's events until SIGINT/SIGTERM, then finish the batch and exit 0.
    Relay(RelayArgs),
    /// Print what the consumers did, from the database.
    Report(ReportArgs),
}

/// The demo without a subcommand: everything in process.
#[derive(Args)]
struct DemoArgs {
    /// Parcels to publish.
    #[arg(long, default_value_t = 500)]
    parcels: usize,
    /// Fault-injection seed (same seed, same faults).
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Database URL (default: a new SQLite file in the temporary directory).
    #[arg(long)]
    database: Option<String>,
}

#[derive(Clone, Copy, ValueEnum)]
enum TransportKind {
    Memory,
    Rabbitmq,
    Kafka,
    Nats,
    Redis,
}

#[derive(Clone, Copy, ValueEnum, PartialEq)]
enum Which {
    Notification,
    CarrierAssignment,
    Both,
}

/// How the demo's consumers handle messages.
#[derive(Clone, Copy, ValueEnum, PartialEq, Debug)]
enum HandlerShape {
    PerMessage,
    Batch,
}

/// How the demo's consumers tell copies from new messages.
#[derive(Clone, Copy, ValueEnum, PartialEq, Debug)]
enum DedupArg {
    /// A row per message id (every transport).
    Ids,
    /// The partition's next offset kept in the database (Kafka); misses producer duplicates.
    Offsets,
    /// Both (Kafka).
    OffsetsAndIds,
}

impl From<DedupArg> for inbox::Dedup {
    fn from(dedup: DedupArg) -> Self {
        match dedup {
            DedupArg::Ids => inbox::Dedup::Ids,
            DedupArg::Offsets => inbox::Dedup::Offsets,
            DedupArg::OffsetsAndIds => inbox::Dedup::OffsetsAndIds,
        }
    }
}

#[derive(Args)]
struct ConsumeArgs {
    #[arg(long, value_enum)]
    transport: TransportKind,
    /// Database URL: postgres://…, mysql://… or sqlite:…
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    database: String,
    /// The topic / exchange to consume.
    #[arg(long, default_value = "parcels")]
    source: String,
    #[arg(long, value_enum, default_value = "both")]
    consumer: Which,
    /// Handlers in flight per consumer.
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    /// `per-message`: one call per message. `batch`: batch mode with the handlers' batch forms,
    /// each batch's rows written in one statement.
    #[arg(long, value_enum, default_value = "per-message")]
    handler: HandlerShape,
    /// With `--handler batch`: the most messages in a batch (at most 1,000: the batch forms
    /// bind four parameters a row, and SQLite takes 32,766 a statement).
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u16).range(1..=1000))]
    batch: u16,
    /// With `--handler batch`: how long a batch waits to fill, in milliseconds.
    #[arg(long, default_value_t = 5)]
    batch_wait: u64,
    /// How copies are told from new messages: `offsets` and `offsets-and-ids` keep each Kafka
    /// partition's next offset in the database (table `inbox_offsets`).
    #[arg(long, value_enum, env = "PARCEL_TRACKER_DEDUP", default_value = "ids")]
    dedup: DedupArg,
    /// Fault injection for the crash harness: this fraction of committed messages stalls for
    /// ever between the commit and the ack, after printing `stalled before ack: <id>` on stderr,
    /// so that a SIGKILL lands exactly there. (A stalled process does not drain on SIGTERM.)
    #[arg(long, default_value_t = 0.0)]
    stall_before_ack: f64,
    /// Serve the consumers' metrics for Prometheus at http://ADDR/metrics (e.g. 127.0.0.1:9000).
    #[arg(long)]
    metrics_addr: Option<std::net::SocketAddr>,
    /// Delete processed inbox rows older than this, every 10 minutes (`7d`, `36h`); off when
    /// not given.
    #[arg(long, value_parser = humantime::parse_duration)]
    retention: Option<Duration>,
}

#[derive(Args)]
struct PublishArgs {
    #[arg(long, value_enum)]
    transport: TransportKind,
    /// The topic / exchange to publish to.
    #[arg(long, default_value = "parcels")]
    source: String,
    /// Events to publish.
    #[arg(long)]
    count: usize,
    /// Fraction of events published a second time with the same id.
    #[arg(long, default_value_t = 0.0)]
    duplicates: f64,
}

#[derive(Args)]
struct ProduceArgs {
    /// The producer's database URL: postgres://…, mysql://… or sqlite:…
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    database: String,
    /// Parcels to create.
    #[arg(long)]
    count: usize,
    /// Parcels per second (default: as fast as eight writers go).
    #[arg(long)]
    rate: Option<f64>,
    /// Where their events go (the topic / exchange).
    #[arg(long, default_value = "parcels")]
    source: String,
}

#[derive(Args)]
struct ServeArgs {
    /// The producer's database URL: postgres://…, mysql://… or sqlite:…
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    database: String,
    /// Where to listen (port 0: any free port; the line `listening on http://ADDR` says which).
    #[arg(long, default_value = "127.0.0.1:8080")]
    addr: std::net::SocketAddr,
    /// Where the parcels' events go (the topic / exchange).
    #[arg(long, default_value = "parcels")]
    source: String,
}

#[derive(Args)]
struct RelayArgs {
    #[arg(long, value_enum)]
    transport: TransportKind,
    /// The producer's database URL: postgres://…, mysql://… or sqlite:…
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    database: String,
    /// The demo's destination, whose topology (the consumers' queues or groups) is declared
    /// first, so that nothing published before the consumers start is lost. Rows go to the
    /// destination stored in them, whatever it is.
    #[arg(long, default_value = "parcels")]
    source: String,
    /// How long a batch's claim lasts: a relay killed mid-batch loses its rows to another
    /// after this.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "5s")]
    lease: Duration,
    /// Fault injection for the crash harness: this fraction of confirmed publishes stalls for
    /// ever before the batch is marked, after printing `stalled after publish: <id>` on stderr,
    /// so that a SIGKILL lands exactly there.
    #[arg(long, default_value_t = 0.0)]
    stall_after_publish: f64,
}

#[derive(Args)]
struct ReportArgs {
    /// The consumers' database URL.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    database: String,
    /// The producer's database, where `parcels` is (default: the consumers' database).
    #[arg(long)]
    parcels_database: Option<String>,
    /// Machine-readable output.
    #[arg(long)]
    json: bool,
    /// Fail unless exactly this many parcels each have one notification and one booking (and,
    /// where parcels were created through the outbox, exactly this many were created).
    #[arg(long)]
    expect: Option<u64>,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let default_log = if matches!(
        cli.command,
        Some(Command::Consume(_) | Command::Relay(_) | Command::Serve(_))
    ) {
        "info"
    } else {
        "error"
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| default_log.into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    let code = match runtime.block_on(run(cli)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("parcel_tracker: {e}");
            ExitCode::FAILURE
        }
    };
    // Everything is drained by now. Dropping the runtime would wait for ever for a broker
    // client's background work that outlived its connection (seen after a RabbitMQ restart).
    runtime.shutdown_timeout(Duration::from_secs(2));
    code
}

type Error = Box<dyn std::error::Error + Send + Sync>;

async fn run(cli: Cli) -> Result<ExitCode, Error> {
    match cli.command {
        None => demo(cli.demo).await,
        Some(Command::Consume(args)) => consume(args).await,
        Some(Command::Publish(args)) => publish(args).await,
        Some(Command::Produce(args)) => produce(args).await,
        Some(Command::Serve(args)) => serve(args).await,
        Some(Command::Relay(args)) => relay(args).await,
        Some(Command::Report(args)) => report(args).await,
    }
}

/// The broker to use. RabbitMQ reads `AMQP_URL` (default `amqp://guest:guest@127.0.0.1:5672/%2f`),
/// `RABBITMQ_QUEUE_TYPE` (`quorum`; classic otherwise) and `RABBITMQ_DELIVERY_LIMIT`; Kafka
/// `KAFKA_BROKERS` (default `127.0.0.1:9092`), `KAFKA_SESSION_TIMEOUT_MS`, `KAFKA_ORPHAN_GUARD`
/// (`0`: off; on otherwise) and `KAFKA_CONFIG` (more client settings: `key=value,key=value`);
/// NATS `NATS_URL` (default `nats://127.0.0.1:4222`), `NATS_ACK_WAIT_MS` and `NATS_DEDUPLICATE`
/// (`0`: publish without `Nats-Msg-Id`; on otherwise); Redis `REDIS_URL`
/// (default `redis://127.0.0.1:6379`) and `REDIS_VISIBILITY_MS`.
async fn transport(kind: TransportKind) -> Result<Arc<dyn Transport>, Error> {
    match kind {
        TransportKind::Memory => Ok(Arc::new(MemoryBroker::new())),
        #[cfg(feature = "rabbitmq")]
        TransportKind::Rabbitmq => {
            let url = std::env::var("AMQP_URL")
                .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned());
            let mut config = inbox::rabbitmq::RabbitMqConfig::default();
            // Quorum queues count deliveries, and take out what lapin cannot parse.
            if std::env::var("RABBITMQ_QUEUE_TYPE").is_ok_and(|t| t == "quorum") {
                config = config.queue_type(inbox::rabbitmq::QueueType::Quorum);
            }
            if let Some(limit) = std::env::var("RABBITMQ_DELIVERY_LIMIT")
                .ok()
                .and_then(|v| v.parse().ok())
            {
                config = config.delivery_limit(Some(limit));
            }
            Ok(Arc::new(inbox::rabbitmq::RabbitMqTransport::new(
                url, config,
            )))
        }
        #[cfg(not(feature = "rabbitmq"))]
        TransportKind::Rabbitmq => {
            Err("this build has no RabbitMQ transport: run with --features rabbitmq".into())
        }
        #[cfg(feature = "kafka")]
        TransportKind::Kafka => {
            let brokers =
                std::env::var("KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".to_owned());
            let mut config = inbox::kafka::KafkaConfig::new(brokers);
            // A crashed instance holds its partitions until its session times out.
            if let Some(ms) = std::env::var("KAFKA_SESSION_TIMEOUT_MS")
                .ok()
                .and_then(|v| v.parse().ok())
            {
                config = config.session_timeout(Duration::from_millis(ms));
            }
            // The demo's tests run on tansu 0.6, whose coordinator can leave partitions with
            // members that are gone (see KafkaConfig::orphan_guard); KAFKA_ORPHAN_GUARD=0 turns
            // the guard off.
            config = config.orphan_guard(std::env::var("KAFKA_ORPHAN_GUARD").as_deref() != Ok("0"));
            // Any other client setting, `key=value` pairs separated by commas.
            for setting in std::env::var("KAFKA_CONFIG").unwrap_or_default().split(',') {
                if let Some((key, value)) = setting.split_once('=') {
                    config = config.set(key.trim(), value.trim());
                }
            }
            Ok(Arc::new(inbox::kafka::KafkaTransport::new(config)?))
        }
        #[cfg(not(feature = "kafka"))]
        TransportKind::Kafka => {
            Err("this build has no Kafka transport: run with --features kafka".into())
        }
        #[cfg(feature = "nats")]
        TransportKind::Nats => {
            let url =
                std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned());
            let mut config = inbox::nats::NatsConfig::default();
            // A killed instance's messages come back after the ack wait.
            if let Some(ms) = std::env::var("NATS_ACK_WAIT_MS")
                .ok()
                .and_then(|v| v.parse().ok())
            {
                config = config.ack_wait(Duration::from_millis(ms));
            }
            // Off, a relay's second publish of a row reaches the consumers (for their inboxes to
            // discard) instead of being dropped by the stream's duplicate window.
            if std::env::var("NATS_DEDUPLICATE").is_ok_and(|v| v == "0") {
                config = config.deduplicate(false);
            }
            Ok(Arc::new(
                inbox::nats::NatsTransport::connect(url, config).await?,
            ))
        }
        #[cfg(not(feature = "nats"))]
        TransportKind::Nats => {
            Err("this build has no NATS transport: run with --features nats".into())
        }
        #[cfg(feature = "redis")]
        TransportKind::Redis => {
            let url =
                std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned());
            let mut config = inbox::redis::RedisConfig::default();
            // A killed instance's entries are claimed after the visibility timeout.
            if let Some(ms) = std::env::var("REDIS_VISIBILITY_MS")
                .ok()
                .and_then(|v| v.parse::<u64>().ok())
            {
                config = config
                    .visibility_timeout(Duration::from_millis(ms))
                    .claim_interval(Duration::from_millis(ms / 10));
            }
            Ok(Arc::new(
                inbox::redis::RedisTransport::connect(url, config).await?,
            ))
        }
        #[cfg(not(feature = "redis"))]
        TransportKind::Redis => {
            Err("this build has no Redis transport: run with --features redis".into())
        }
    }
}

/// `$body` with `$s` bound to the store of `$db`, whichever it is.
macro_rules! with_store {
    ($db:expr, $s:ident => $body:expr) => {
        match $db {
            #[cfg(feature = "postgres")]
            Db::Postgres($s) => $body,
            #[cfg(feature = "mysql")]
            Db::MySql($s) => $body,
            Db::Sqlite($s) => $body,
        }
    };
}

/// A store picked by the URL's scheme.
#[derive(Clone)]
enum Db {
    #[cfg(feature = "postgres")]
    Postgres(PostgresStore),
    #[cfg(feature = "mysql")]
    MySql(MySqlStore),
    Sqlite(SqliteStore),
}

impl Db {
    async fn open(url: &str) -> Result<Self, Error> {
        let db = if url.starts_with("postgres:") || url.starts_with("postgresql:") {
            #[cfg(feature = "postgres")]
            {
                Db::Postgres(PostgresStore::connect(url, 16).await?)
            }
            #[cfg(not(feature = "postgres"))]
            return Err("this build has no PostgreSQL store: run with --features postgres".into());
        } else if url.starts_with("mysql:") || url.starts_with("mariadb:") {
            #[cfg(feature = "mysql")]
            {
                Db::MySql(MySqlStore::connect(url, 16).await?)
            }
            #[cfg(not(feature = "mysql"))]
            return Err("this build has no MySQL store: run with --features mysql".into());
        } else if url.starts_with("sqlite:") {
            Db::Sqlite(SqliteStore::connect(url).await?)
        } else {
            return Err(
                "--database must be a postgres://, mysql://, mariadb:// or sqlite: URL".into(),
            );
        };
        // Every process of the demo may start at once on a new database: the inbox's
        // migrations take their lock, and the demo's tables are created under one of their own
        // (PostgreSQL: an advisory lock; SQLite: the write lock, from BEGIN IMMEDIATE), so no
        // two `CREATE TABLE IF NOT EXISTS` race.
        match &db {
            #[cfg(feature = "postgres")]
            Db::Postgres(s) => {
                s.migrate().await?;
                let mut tx = s.pool().begin().await?;
                sqlx::query("SELECT pg_advisory_xact_lock(hashtext('parcel_tracker tables'))")
                    .execute(&mut *tx)
                    .await?;
                for statement in domain::table_statements(Dialect::Postgres) {
                    sqlx::query(&statement).execute(&mut *tx).await?;
                }
                tx.commit().await?;
            }
            // MySQL: CREATE TABLE IF NOT EXISTS is safe from several sessions at once (the
            // metadata lock orders them), and the indexes are created with the tables.
            #[cfg(feature = "mysql")]
            Db::MySql(s) => {
                s.migrate().await?;
                for statement in domain::table_statements(Dialect::MySql) {
                    sqlx::query(&statement).execute(s.pool()).await?;
                }
            }
            Db::Sqlite(s) => {
                use sqlx::Connection as _;
                s.migrate().await?;
                let mut conn = s.pool().acquire().await?;
                let mut tx = conn.begin_with("BEGIN IMMEDIATE").await?;
                for statement in domain::table_statements(Dialect::Sqlite) {
                    sqlx::query(&statement).execute(&mut *tx).await?;
                }
                tx.commit().await?;
            }
        }
        Ok(db)
    }

    /// Runs the chosen consumers on this store until `token` is cancelled.
    async fn run_consumers(
        self,
        transport: Arc<dyn Transport>,
        source: &str,
        which: Which,
        shape: Shape,
        token: CancellationToken,
    ) -> Result<Vec<(String, inbox::ConsumerReport)>, Error> {
        match self {
            #[cfg(feature = "postgres")]
            Db::Postgres(s) => run_consumers(s, transport, source, which, shape, token).await,
            #[cfg(feature = "mysql")]
            Db::MySql(s) => run_consumers(s, transport, source, which, shape, token).await,
            Db::Sqlite(s) => run_consumers(s, transport, source, which, shape, token).await,
        }
    }

    /// The consumers' report; with the producer's database, the created parcels in it.
    async fn report(&self, parcels: Option<&Db>) -> Result<Report, Error> {
        let report = with_store!(self, s => Report::read(s, s.pool()).await?);
        let Some(parcels) = parcels else {
            return Ok(report);
        };
        let created = with_store!(parcels, s => ids(s.pool(), "SELECT id FROM parcels").await?);
        let complete = with_store!(self, s => ids(s.pool(), domain::COMPLETE_PARCEL_IDS).await?);
        Ok(report.with_parcels(&created, &complete))
    }

    /// Outbox rows not published yet.
    async fn outbox_pending(&self) -> Result<u64, Error> {
        let stats = with_store!(self, s => s.outbox_stats().await?);
        Ok(stats.iter().map(|s| s.pending).sum())
    }
}

/// The first column of `sql`'s rows.
async fn ids<'e, E>(executor: E, sql: &'static str) -> Result<HashSet<String>, sqlx::Error>
where
    E: sqlx::Executor<'e>,
    String: sqlx::Type<E::Database> + for<'r> sqlx::Decode<'r, E::Database>,
    usize: sqlx::ColumnIndex<<E::Database as sqlx::Database>::Row>,
    for<'q> <E::Database as sqlx::Database>::Arguments<'q>: sqlx::IntoArguments<'q, E::Database>,
{
    let ids: Vec<String> = sqlx::query_scalar(sql).fetch_all(executor).await?;
    Ok(ids.into_iter().collect())
}

fn consumer_names(which: Which) -> Vec<&'static str> {
    match which {
        Which::Notification => vec![domain::NOTIFICATION],
        Which::CarrierAssignment => vec![domain::CARRIER_ASSIGNMENT],
        Which::Both => vec![domain::NOTIFICATION, domain::CARRIER_ASSIGNMENT],
    }
}

/// How the consumers run.
#[derive(Clone, Copy)]
struct Shape {
    /// Handlers in flight per instance.
    concurrency: usize,
    /// Batch mode with the handlers' batch forms.
    batches: Option<inbox::Batching>,
    /// Instances per consumer.
    instances: usize,
    /// Fraction of commits that stall before the ack (fault injection).
    stall_before_ack: f64,
    /// How copies are told from new messages.
    dedup: inbox::Dedup,
}

/// The after-commit hook of `--stall-before-ack`.
fn stall_hook(fraction: f64) -> inbox::AfterCommit {
    Arc::new(move |id| {
        let roll = f64::from(uuid::Uuid::new_v4().as_bytes()[0]) / 256.0;
        if roll < fraction {
            eprintln!("stalled before ack: {id}");
            Box::pin(std::future::pending())
        } else {
            Box::pin(std::future::ready(()))
        }
    })
}

/// Runs the chosen consumers until `token` is cancelled.
async fn run_consumers<S>(
    store: S,
    transport: Arc<dyn Transport>,
    source: &str,
    which: Which,
    shape: Shape,
    token: CancellationToken,
) -> Result<Vec<(String, inbox::ConsumerReport)>, Error>
where
    S: InboxStore + Clone,
    Notification: Handler<S::Tx> + inbox::BatchHandler<S::Tx>,
    CarrierAssignment: Handler<S::Tx> + inbox::BatchHandler<S::Tx>,
{
    let mut tasks = tokio::task::JoinSet::new();
    for name in consumer_names(which) {
        let consumer_name = ConsumerName::new(name)?;
        macro_rules! spawn {
            ($handler:expr) => {{
                let mut consumer = Consumer::new(
                    consumer_name,
                    source,
                    Arc::clone(&transport),
                    store.clone(),
                    $handler,
                )
                .concurrency(shape.concurrency)
                .dedup(shape.dedup);
                if let Some(batching) = shape.batches {
                    consumer = consumer.batch(batching);
                }
                if shape.stall_before_ack > 0.0 {
                    consumer = consumer.after_commit(stall_hook(shape.stall_before_ack));
                }
                for _ in 0..shape.instances {
                    let (consumer, token) = (consumer.clone(), token.clone());
                    tasks.spawn(
                        async move { consumer.run(token).await.map(|r| (name.to_owned(), r)) },
                    );
                }
            }};
        }
        match (name == domain::NOTIFICATION, shape.batches) {
            (true, None) => spawn!(Notification),
            (false, None) => spawn!(CarrierAssignment),
            (true, Some(_)) => spawn!(inbox::Batched(Notification)),
            (false, Some(_)) => spawn!(inbox::Batched(CarrierAssignment)),
        }
    }
    let mut reports: Vec<(String, inbox::ConsumerReport)> = Vec::new();
    while let Some(done) = tasks.join_next().await {
        let (name, report) = done??;
        // Instances of one consumer share their counters: keep one report per consumer.
        if !reports.iter().any(|(n, _)| *n == name) {
            reports.push((name, report));
        }
    }
    reports.sort_by(|a, b| b.0.cmp(&a.0));
    Ok(reports)
}

async fn shutdown_signal(token: CancellationToken) {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("install the SIGTERM handler");
        tokio::select! {
            _ = ctrl_c => {},
            _ = term.recv() => {},
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
    tracing::info!("shutdown requested: draining");
    token.cancel();
}

async fn consume(args: ConsumeArgs) -> Result<ExitCode, Error> {
    let transport = transport(args.transport).await?;
    let db = Db::open(&args.database).await?;
    let token = CancellationToken::new();
    tokio::spawn(shutdown_signal(token.clone()));
    if let Some(addr) = args.metrics_addr {
        metrics_exporter_prometheus::PrometheusBuilder::new()
            .with_http_listener(addr)
            .install()?;
        eprintln!("metrics at http://{addr}/metrics");
    }
    if let Some(retention) = args.retention {
        let token = token.clone();
        match &db {
            #[cfg(feature = "postgres")]
            Db::Postgres(store) => {
                let cleanup = inbox::Cleanup::new(store.clone(), retention);
                tokio::spawn(async move { cleanup.run(token).await });
            }
            #[cfg(feature = "mysql")]
            Db::MySql(store) => {
                let cleanup = inbox::Cleanup::new(store.clone(), retention);
                tokio::spawn(async move { cleanup.run(token).await });
            }
            Db::Sqlite(store) => {
                let cleanup = inbox::Cleanup::new(store.clone(), retention);
                tokio::spawn(async move { cleanup.run(token).await });
            }
        }
    }
    let reports = db
        .run_consumers(
            transport,
            &args.source,
            args.consumer,
            Shape {
                concurrency: args.concurrency,
                batches: (args.handler == HandlerShape::Batch).then(|| {
                    inbox::Batching::new(
                        usize::from(args.batch),
                        Duration::from_millis(args.batch_wait),
                    )
                }),
                instances: 1,
                stall_before_ack: args.stall_before_ack,
                dedup: args.dedup.into(),
            },
            token,
        )
        .await?;
    for (name, r) in reports {
        eprintln!(
            "{name}: deliveries {} processed {} duplicates {} failed {} dead-lettered {}",
            r.deliveries, r.processed, r.duplicates_discarded, r.failed, r.dead_lettered
        );
    }
    Ok(ExitCode::SUCCESS)
}

async fn publish(args: PublishArgs) -> Result<ExitCode, Error> {
    let transport = transport(args.transport).await?;
    declare_topology(&*transport, &args.source).await?;
    let published =
        domain::publish_events(&*transport, &args.source, args.count, args.duplicates, 7).await?;
    println!("published {} messages ({} events)", published, args.count);
    Ok(ExitCode::SUCCESS)
}

/// Declares the consumers' queues (or groups) on `source`, so that nothing published before the
/// consumers start is lost.
async fn declare_topology(transport: &dyn Transport, source: &str) -> Result<(), Error> {
    for name in consumer_names(Which::Both) {
        let subscription =
            inbox::transport::Subscription::new(source.to_owned(), ConsumerName::new(name)?, 1);
        transport.declare(&subscription).await?;
    }
    Ok(())
}

async fn produce(args: ProduceArgs) -> Result<ExitCode, Error> {
    let db = Db::open(&args.database).await?;
    let n = with_store!(db, s => producer::produce(Outbox::new(s), &args.source, args.count, args.rate).await?);
    println!("produced {n} parcels");
    Ok(ExitCode::SUCCESS)
}

async fn serve(args: ServeArgs) -> Result<ExitCode, Error> {
    let db = Db::open(&args.database).await?;
    let token = CancellationToken::new();
    tokio::spawn(shutdown_signal(token.clone()));
    with_store!(db, s => producer::serve(s, args.source, args.addr, token).await?);
    Ok(ExitCode::SUCCESS)
}

async fn relay(args: RelayArgs) -> Result<ExitCode, Error> {
    let transport = transport(args.transport).await?;
    let db = Db::open(&args.database).await?;
    let token = CancellationToken::new();
    tokio::spawn(shutdown_signal(token.clone()));
    declare_topology(&*transport, &args.source).await?;
    let transport: Arc<dyn Transport> = if args.stall_after_publish > 0.0 {
        let seed = u64::from(uuid::Uuid::new_v4().as_fields().0);
        Arc::new(producer::StallAfterPublish::new(
            transport,
            args.stall_after_publish,
            seed,
            true,
        ))
    } else {
        transport
    };
    with_store!(db, s => producer::relay(s, transport, args.lease, token).await?);
    Ok(ExitCode::SUCCESS)
}

async fn report(args: ReportArgs) -> Result<ExitCode, Error> {
    let db = Db::open(&args.database).await?;
    let parcels = match &args.parcels_database {
        Some(url) => Db::open(url).await?,
        None => db.clone(),
    };
    let report = db.report(Some(&parcels)).await?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", report.table());
    }
    // Given a producer's database, it must hold the parcels (a mistyped SQLite path would be a
    // new, empty file).
    let created_expected = args.parcels_database.is_some();
    let ok = report.consistent()
        && args.expect.is_none_or(|n| {
            report.parcels_complete == n
                && if created_expected || report.parcels_created > 0 {
                    report.parcels_created == n
                } else {
                    true
                }
        });
    Ok(if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// Everything in process: parcels created through the outbox, a relay that crashes mid-batch
/// publishing them to a broker with faults, two consumers; then the table.
async fn demo(args: DemoArgs) -> Result<ExitCode, Error> {
    let url = args.database.clone().unwrap_or_else(|| {
        let file = std::env::temp_dir().join(format!(
            "parcel-tracker-{}.db",
            uuid::Uuid::new_v4().simple()
        ));
        format!("sqlite:{}", file.display())
    });
    let faults = Faults::seeded(args.seed)
        .duplicate_publish(0.05)
        .lose_ack(0.05)
        .concurrent_copy(0.05)
        .reorder(0.2);
    let broker = MemoryBroker::with_faults(faults);
    let source = "parcels";
    for name in [domain::NOTIFICATION, domain::CARRIER_ASSIGNMENT] {
        broker.declare_group(source, name);
    }
    println!(
        "parcel-tracker demo: parcels written with their events through the outbox; a relay that \
         crashes mid-batch; in-memory broker (seed {}: 5% duplicate publishes, 5% lost acks, \
         5% concurrent copies, 20% reordered); database {}",
        args.seed,
        inbox::redact_url(&url)
    );
    // Two poison messages, published straight to the broker: one without an id, one whose
    // payload is not an event.
    broker
        .publish(
            source,
            OutgoingMessage {
                payload: domain::sample_event(0).to_json().into(),
                ..Default::default()
            },
        )
        .await?;
    broker
        .publish(
            source,
            OutgoingMessage::new("not-an-event", "{\"parcel\": 1"),
        )
        .await?;

    let db = Db::open(&url).await?;
    let token = CancellationToken::new();
    let progress = ProgressBar::new(2 * args.parcels as u64).with_style(
        ProgressStyle::with_template("{spinner} handled {pos}/{len} effects {wide_bar} {elapsed}")
            .expect("a valid template"),
    );
    let transport: Arc<dyn Transport> = Arc::new(broker.clone());
    let running = {
        let (db, transport, token) = (db.clone(), Arc::clone(&transport), token.clone());
        tokio::spawn(async move {
            let shape = Shape {
                concurrency: 4,
                batches: None,
                instances: 2,
                stall_before_ack: 0.0,
                dedup: inbox::Dedup::Ids,
            };
            db.run_consumers(transport, source, Which::Both, shape, token)
                .await
        })
    };
    let relayed = Arc::new(AtomicU64::new(0));
    let (relay, created) = with_store!(db.clone(), s => {
        // One outbox for the producer and the relay: each commit wakes the relay at once.
        let outbox = Outbox::new(s).signal_other_processes(false);
        let relay = tokio::spawn(producer::crashing_relay(
            outbox.clone(),
            Arc::clone(&transport),
            args.seed,
            Arc::clone(&relayed),
            token.clone(),
        ));
        (relay, producer::produce(outbox, source, args.parcels, None).await?)
    });
    loop {
        // Nothing pending in the outbox first, then the broker settled: every row is published
        // before it is marked, so what the relay published is in the broker by then.
        let pending = db.outbox_pending().await?;
        let settled = broker
            .wait_settled(
                source,
                &[domain::NOTIFICATION, domain::CARRIER_ASSIGNMENT],
                Duration::from_millis(200),
            )
            .await;
        let report = db.report(None).await?;
        progress.set_position(report.notifications + report.bookings);
        if (pending == 0 && settled.is_ok()) || running.is_finished() || relay.is_finished() {
            break;
        }
    }
    progress.finish_and_clear();
    token.cancel();
    let consumers = running.await??;
    let crashes = relay.await??;
    let report = db.report(Some(&db)).await?;
    let stats = broker.stats();
    let relayed = relayed.load(Ordering::SeqCst);

    println!();
    println!(
        "parcels created       {:>6}, each with its event in the outbox, in one transaction",
        created
    );
    println!(
        "published by relay    {:>6} events: {} again after {} relay crashes mid-batch",
        relayed,
        relayed.saturating_sub(created),
        crashes
    );
    println!(
        "broker                {:>6} messages stored ({} duplicated by the broker, 2 poison), {} deliveries, {} lost acks, {} concurrent copies",
        stats.published,
        stats.injected_duplicates,
        stats.deliveries,
        stats.injected_lost_acks,
        stats.injected_concurrent_copies
    );
    println!();
    print!("{:<22}", "");
    for (name, _) in &consumers {
        print!("{name:>20}");
    }
    println!();
    let row = |label: &str, get: &dyn Fn(&inbox::ConsumerReport) -> u64| {
        print!("{label:<22}");
        for (_, r) in &consumers {
            print!("{:>20}", get(r));
        }
        println!();
    };
    row("deliveries", &|r| r.deliveries);
    row("handled (committed)", &|r| r.processed);
    row("duplicates discarded", &|r| r.duplicates_discarded);
    row("failed attempts", &|r| r.failed);
    row("dead-lettered", &|r| r.dead_lettered);
    print!("{:<22}", "effect rows");
    for (name, _) in &consumers {
        let n = if name == domain::NOTIFICATION {
            report.notifications
        } else {
            report.bookings
        };
        print!("{n:>20}");
    }
    println!();
    println!();
    let ok = report.consistent()
        && report.parcels_created == args.parcels as u64
        && report.created_parcels_complete == args.parcels as u64
        && report.parcels_complete == args.parcels as u64;
    println!(
        "parcels created with exactly one notification and one booking: {} of {} — {}",
        report.created_parcels_complete,
        args.parcels,
        if ok { "OK" } else { "FAILED" }
    );
    if !ok {
        print!("{}", report.table());
    }
    Ok(if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
