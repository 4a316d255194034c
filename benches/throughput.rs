//! What the inbox costs, measured side by side in one run (issue 6), for each transport (memory,
//! RabbitMQ at `AMQP_URL`, Kafka at `KAFKA_BROKERS`, NATS at `NATS_URL`, Redis at `REDIS_URL`)
//! against PostgreSQL (`DATABASE_URL`):
//!
//! - inbox per message, and in batch mode;
//! - the same consumer with no inbox (business write + commit + ack);
//! - the naive algorithm (look the id up, then handle and insert it), for throughput and for
//!   double effects under concurrent duplicates;
//! - the ceilings: `pgbench` running the inbox's transaction shape (claim + business insert +
//!   the store's `SELECT 1` proof that the transaction is live + commit) at the same
//!   concurrency, and the broker's raw consume+ack rate.
//!
//! And the outbox (issue 14), per transport:
//!
//! - the relay's rate (one relay, its default batches: 500 rows, two in flight) beside the
//!   broker's own rate of publishes with confirms, as many in flight, and beside a relay of one
//!   row at a time;
//! - the latency from a producer's commit to the broker's confirm at a steady rate
//!   (`--outbox-rate`, 1,000 rows/s), with the relay woken by the commits and polling only;
//! - the producer's own write rate (a parcel row per transaction, `--concurrency` writers) with
//!   its outbox row and without.
//!
//! And, with `--cleanup ROWS` instead of the rest, the claims' latency before and during a
//! retention cleanup of ROWS old rows, paced and unpaced (issue 17).
//!
//! `cargo bench --bench throughput --all-features -- [--transport memory|rabbitmq|kafka|all]
//! [--messages N] [--concurrency C] [--outbox-rate R] [--producer-messages M] [--json FILE]`
//!
//! Each mode gets a source of its own with N messages published before it starts (the "copies"
//! modes: each message twice in a row, so that the copies are handled at once); its clock starts
//! at the first settled delivery (connecting and joining a group are not counted) and stops when
//! every delivery is settled.
//!
//! Ratios are what to read: the machine is shared and noisy, absolute rates are context only.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::{Parser, ValueEnum};
use futures::StreamExt;
use inbox::memory::MemoryBroker;
use inbox::outbox::Outbox;
use inbox::transport::{AckToken, Capabilities, Delivery, DeliveryStream, Subscription};
use inbox::{
    BatchError, BatchHandler, Batching, CancellationToken, Consumer, ConsumerName, Dedup, Handler,
    HandlerError, Headers, InboxAdmin, InboxStore, Message, MySqlStore, MySqlTx, OutgoingMessage,
    PgTx, PostgresStore, Transport, TransportError, async_trait,
};
use sqlx::{Connection, Executor, PgPool};
use tokio::sync::Semaphore;

#[path = "support/cpu.rs"]
mod cpu;

#[derive(Clone, Copy, PartialEq, ValueEnum)]
enum Which {
    Memory,
    Rabbitmq,
    Kafka,
    Nats,
    Redis,
    All,
}

/// What the soak runs.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum SoakMode {
    Batch,
    BatchHandler,
    KafkaOffsets,
}

#[derive(Parser)]
#[command(about = "Inbox throughput against PostgreSQL, beside its baselines")]
struct Args {
    /// The transports to measure.
    #[arg(long, value_enum, default_value = "all")]
    transport: Which,
    /// Messages per measured mode.
    #[arg(long, default_value_t = 10_000)]
    messages: usize,
    /// Handlers (or pgbench clients) in flight.
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    /// Seconds pgbench runs.
    #[arg(long, default_value_t = 10)]
    pgbench_seconds: u64,
    /// Rows per second the producer commits in the outbox's latency modes (for at most
    /// `--messages` rows or 5 seconds).
    #[arg(long, default_value_t = 1000)]
    outbox_rate: u64,
    /// Outbox messages each producer transaction sends (the producer's modes; the parcel row is
    /// one per transaction whatever this says).
    #[arg(long, default_value_t = 1)]
    producer_messages: usize,
    /// Only the outbox's modes.
    #[arg(long)]
    outbox_only: bool,
    /// The measured relay's batch size.
    #[arg(long, default_value_t = 500)]
    relay_batch: u32,
    /// The measured relay's batches in flight (default: the relay's own default).
    #[arg(long)]
    relay_concurrency: Option<usize>,
    /// Only the per-message inbox mode on each chosen transport, no baselines: the run to put
    /// under a profiler (`perf record -g`).
    #[arg(long)]
    profile: bool,
    /// Instead of the comparison: one batched inbox consumer over this many messages (published
    /// as it goes, at most 20 000 waiting), sampling the process's resident memory.
    #[arg(long)]
    soak: Option<u64>,
    /// The soak's mode: `batch` (RabbitMQ, a savepoint per message), `batch-handler` (RabbitMQ,
    /// the handler's batch form) or `kafka-offsets` (Kafka, batches, offsets kept in the
    /// database, no row per message).
    #[arg(long, value_enum, default_value = "batch")]
    soak_mode: SoakMode,
    /// Also write the results to this file as JSON: `{"rows": [{"transport", "mode",
    /// "msgs_per_s", "p50_ms", "p99_ms", "double_effects"}…], "rss_mib": …}` (`rss_mib`: the
    /// process's peak; with `--soak`, the highest sample and no rows).
    #[arg(long, value_name = "FILE")]
    json: Option<std::path::PathBuf>,
    /// The PostgreSQL server (a database of its own is created on it).
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    database: String,
    /// A MySQL / MariaDB server to compare with: the inbox per message and batched on it too
    /// (rows `mysql_per_message`, `mysql_batch`; a database of its own is created on it).
    #[arg(long, env = "MYSQL_URL", hide_env_values = true)]
    mysql: Option<String>,
    /// Instead of the comparison: retention cleanup of this many old rows while a consumer
    /// claims new messages at `--cleanup-claim-rate` (memory transport), with the claims' latency
    /// before and during the cleanup (rows `cleanup_before`, `cleanup_during`; and
    /// `cleanup_during_unpaced` for the same cleanup unpaced).
    #[arg(long, value_name = "ROWS")]
    cleanup: Option<u64>,
    /// Seconds the claims are measured before each cleanup.
    #[arg(long, default_value_t = 5.0)]
    cleanup_before_seconds: f64,
    /// Messages per second the consumer gets in the cleanup modes.
    #[arg(long, default_value_t = 1000)]
    cleanup_claim_rate: u64,
    /// The paced cleanup's rest, as a multiple of each batch's duration (the library's default:
    /// 4).
    #[arg(long, default_value_t = 4.0)]
    cleanup_rest: f64,
    /// The paced cleanup's batch time in milliseconds (the library's default: 20).
    #[arg(long, default_value_t = 20)]
    cleanup_batch_ms: u64,
    /// The PostgreSQL store claims in a round trip of its own, not with the `BEGIN` (to compare).
    #[arg(long)]
    claim_apart: bool,
    /// cargo bench passes this; ignored.
    #[arg(long, hide = true)]
    bench: bool,
}

type Error = Box<dyn std::error::Error + Send + Sync>;

/// The business write every mode does: one row per handled message (not unique by message id,
/// so a double effect shows as two rows).
async fn business_write(
    conn: &mut sqlx::PgConnection,
    run: &str,
    message_id: &str,
) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO bench_effects (run, message_id, payload) VALUES ($1, $2, $3)")
        .bind(run)
        .bind(message_id)
        .bind("booked")
        .execute(conn)
        .await
        .map(drop)
}

struct BenchHandler {
    run: String,
    /// A batch handler in batch mode: each batch's rows in one statement.
    whole: bool,
}

#[async_trait]
impl Handler<PgTx> for BenchHandler {
    async fn handle(&self, message: &Message<'_>, tx: &mut PgTx) -> Result<(), HandlerError> {
        business_write(tx, &self.run, message.id.as_str()).await?;
        Ok(())
    }

    fn as_batch_handler(&self) -> Option<&dyn BatchHandler<PgTx>> {
        self.whole.then_some(self as &dyn BatchHandler<PgTx>)
    }
}

#[async_trait]
impl BatchHandler<PgTx> for BenchHandler {
    async fn handle_batch(
        &self,
        messages: &[Message<'_>],
        tx: &mut PgTx,
    ) -> Result<(), BatchError> {
        let ids: Vec<&str> = messages.iter().map(|m| m.id.as_str()).collect();
        sqlx::query(
            "INSERT INTO bench_effects (run, message_id, payload)
             SELECT $1, id, 'booked' FROM unnest($2::text[]) AS t(id)",
        )
        .bind(&self.run)
        .bind(&ids)
        .execute(&mut **tx)
        .await?;
        Ok(())
    }
}

#[async_trait]
impl Handler<MySqlTx> for BenchHandler {
    async fn handle(&self, message: &Message<'_>, tx: &mut MySqlTx) -> Result<(), HandlerError> {
        sqlx::query("INSERT INTO bench_effects (run, message_id, payload) VALUES (?, ?, ?)")
            .bind(&self.run)
            .bind(message.id.as_str())
            .bind("booked")
            .execute(&mut **tx)
            .await?;
        Ok(())
    }

    fn as_batch_handler(&self) -> Option<&dyn BatchHandler<MySqlTx>> {
        self.whole.then_some(self as &dyn BatchHandler<MySqlTx>)
    }
}

#[async_trait]
impl BatchHandler<MySqlTx> for BenchHandler {
    async fn handle_batch(
        &self,
        messages: &[Message<'_>],
        tx: &mut MySqlTx,
    ) -> Result<(), BatchError> {
        let rows = vec!["(?, ?, 'booked')"; messages.len()].join(", ");
        let statement =
            format!("INSERT INTO bench_effects (run, message_id, payload) VALUES {rows}");
        let mut query = sqlx::query(&statement);
        for message in messages {
            query = query.bind(&self.run).bind(message.id.as_str());
        }
        query.execute(&mut **tx).await?;
        Ok(())
    }
}

/// A store the inbox modes run on: PostgreSQL, or MySQL / MariaDB.
#[async_trait]
trait BenchStore: InboxStore + Clone
where
    BenchHandler: Handler<Self::Tx>,
{
    /// Messages of `run` with more than one effect row.
    async fn doubles(&self, run: &str) -> Result<i64, Error>;
}

#[async_trait]
impl BenchStore for PostgresStore {
    async fn doubles(&self, run: &str) -> Result<i64, Error> {
        doubles(self.pool(), run).await
    }
}

#[async_trait]
impl BenchStore for MySqlStore {
    async fn doubles(&self, run: &str) -> Result<i64, Error> {
        Ok(sqlx::query_scalar(
            "SELECT COUNT(*) FROM (SELECT message_id FROM bench_effects WHERE run = ?
               GROUP BY message_id HAVING COUNT(*) > 1) d",
        )
        .bind(run)
        .fetch_one(self.pool())
        .await?)
    }
}

/// A new database on the MySQL server at `url`, migrated, with the bench's effects table.
async fn mysql_store(url: &str, connections: u32) -> Result<MySqlStore, Error> {
    let name = format!("inbox_bench_{}", uuid::Uuid::new_v4().simple());
    let admin = MySqlStore::connect(url, 1).await?;
    admin
        .pool()
        .execute(format!("CREATE DATABASE {name}").as_str())
        .await?;
    admin.pool().close().await;
    let (head, query) = url.split_once('?').map_or((url, ""), |(h, q)| (h, q));
    let scheme_end = head.find("://").ok_or("MYSQL_URL is not a URL")? + 3;
    let base = match head[scheme_end..].find('/') {
        Some(slash) => &head[..scheme_end + slash],
        None => head,
    };
    let query = if query.is_empty() {
        String::new()
    } else {
        format!("?{query}")
    };
    let store = MySqlStore::connect(&format!("{base}/{name}{query}"), connections).await?;
    store.migrate().await?;
    store
        .pool()
        .execute(
            "CREATE TABLE bench_effects (run VARCHAR(64) NOT NULL, message_id VARBINARY(255) NOT NULL,
               payload VARCHAR(32) NOT NULL, KEY bench_effects_run (run, message_id))",
        )
        .await?;
    Ok(store)
}

/// One measured mode.
struct Measured {
    name: &'static str,
    /// The row's `mode` in the JSON output (stable names; `name` is for the table).
    mode: &'static str,
    messages: usize,
    seconds: f64,
    doubles: Option<i64>,
    /// Delivery-to-ack latencies of the mode's acked deliveries, sorted.
    latencies: Vec<Duration>,
    /// The CPU each side spent, where the mode keeps an account.
    cpu: Option<cpu::CpuAccount>,
}

impl Measured {
    fn rate(&self) -> f64 {
        self.messages as f64 / self.seconds
    }

    /// The `p`-th percentile latency in milliseconds, if any delivery was acked.
    fn percentile_ms(&self, p: f64) -> Option<f64> {
        let last = self.latencies.len().checked_sub(1)?;
        let at = (last as f64 * p / 100.0).round() as usize;
        Some(self.latencies[at].as_secs_f64() * 1e3)
    }

    /// The `p`-th percentile latency, as milliseconds for the table.
    fn percentile(&self, p: f64) -> String {
        self.percentile_ms(p)
            .map_or("-".to_owned(), |ms| format!("{ms:.1}"))
    }

    /// The mode's row of the JSON output.
    fn row(&self, transport: &str) -> serde_json::Value {
        let mut row = serde_json::json!({
            "transport": transport,
            "mode": self.mode,
            "msgs_per_s": self.rate(),
            "p50_ms": self.percentile_ms(50.0),
            "p99_ms": self.percentile_ms(99.0),
            "double_effects": self.doubles,
        });
        if let Some(cpu) = &self.cpu {
            row["cpu"] = cpu.json(self.messages);
        }
        row
    }
}

/// The transport under test, wrapped so that each delivery's time from being handed over to
/// being acked is recorded (the latency column): the same for the engine and the baselines.
#[derive(Debug)]
struct Timed {
    inner: Arc<dyn Transport>,
    latencies: Arc<Mutex<Vec<Duration>>>,
    /// When set, the moment each publish was confirmed, by message id (the outbox's latency).
    confirms: Mutex<Option<HashMap<String, Instant>>>,
}

impl Timed {
    /// The latencies recorded since the last call, sorted.
    fn take(&self) -> Vec<Duration> {
        let mut taken = std::mem::take(&mut *self.latencies.lock().expect("not poisoned"));
        taken.sort_unstable();
        taken
    }
}

#[async_trait]
impl Transport for Timed {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
    async fn declare(&self, subscription: &Subscription) -> Result<(), TransportError> {
        self.inner.declare(subscription).await
    }
    async fn subscribe(
        &self,
        subscription: &Subscription,
    ) -> Result<DeliveryStream, TransportError> {
        let latencies = Arc::clone(&self.latencies);
        let stream = self.inner.subscribe(subscription).await?;
        Ok(stream
            .map(move |delivery| {
                delivery.map(|inner| {
                    Box::new(TimedDelivery {
                        inner,
                        at: Instant::now(),
                        latencies: Arc::clone(&latencies),
                    }) as Box<dyn Delivery>
                })
            })
            .boxed())
    }
    async fn publish(
        &self,
        destination: &str,
        message: OutgoingMessage,
    ) -> Result<(), TransportError> {
        let id = message.message_id.clone();
        self.inner.publish(destination, message).await?;
        if let (Some(confirms), Some(id)) =
            (self.confirms.lock().expect("not poisoned").as_mut(), id)
        {
            confirms.entry(id).or_insert_with(Instant::now);
        }
        Ok(())
    }
}

#[derive(Debug)]
struct TimedDelivery {
    inner: Box<dyn Delivery>,
    at: Instant,
    latencies: Arc<Mutex<Vec<Duration>>>,
}

#[async_trait]
impl Delivery for TimedDelivery {
    fn payload(&self) -> &[u8] {
        self.inner.payload()
    }
    fn headers(&self) -> &Headers {
        self.inner.headers()
    }
    fn broker_message_id(&self) -> Option<&[u8]> {
        self.inner.broker_message_id()
    }
    fn redelivered(&self) -> bool {
        self.inner.redelivered()
    }
    fn delivery_count(&self) -> Option<u32> {
        self.inner.delivery_count()
    }
    fn coordinates(&self) -> Option<String> {
        self.inner.coordinates()
    }
    fn ordering_key(&self) -> Option<&str> {
        self.inner.ordering_key()
    }
    async fn ack(self: Box<Self>, token: AckToken) -> Result<(), TransportError> {
        let result = self.inner.ack(token).await;
        self.latencies
            .lock()
            .expect("not poisoned")
            .push(self.at.elapsed());
        result
    }
    async fn nack(self: Box<Self>, requeue: bool) -> Result<(), TransportError> {
        self.inner.nack(requeue).await
    }
}

/// A transport to measure, and how to make one.
struct Target {
    name: &'static str,
    transport: Arc<dyn Transport>,
    timed: Arc<Timed>,
}

impl Target {
    fn new(name: &'static str, inner: Arc<dyn Transport>) -> Self {
        let timed = Arc::new(Timed {
            inner,
            latencies: Arc::default(),
            confirms: Mutex::new(None),
        });
        Self {
            name,
            transport: Arc::clone(&timed) as Arc<dyn Transport>,
            timed,
        }
    }
}

/// A mode's own source with `n` messages waiting for consumer `run` (each twice in a row with
/// `copies`). Returns the source and the messages published.
async fn prepare(
    target: &Target,
    run: &str,
    n: usize,
    copies: bool,
) -> Result<(String, u64), Error> {
    let source = format!("bench-{}", uuid::Uuid::new_v4().simple());
    let subscription = Subscription::new(source.clone(), ConsumerName::new(run)?, 1);
    target.transport.declare(&subscription).await?;
    let per = if copies { 2 } else { 1 };
    let messages = (0..n).flat_map(|i| {
        std::iter::repeat_n(
            OutgoingMessage::new(format!("{run}-{i}"), format!(r#"{{"n":{i}}}"#))
                .with_key(i.to_string()),
            per,
        )
    });
    // Many publishes in flight: publishing is not what is measured.
    let transport = &target.transport;
    let source_ref = &source;
    let results: Vec<_> = futures::stream::iter(messages)
        .map(|m| async move { transport.publish(source_ref, m).await })
        .buffered(64)
        .collect()
        .await;
    for r in results {
        r?;
    }
    Ok((source, (n * per) as u64))
}

/// Waits until `settled()` reaches `total`; the clock runs from the first settled delivery.
async fn clock(total: u64, settled: impl Fn() -> u64) -> Result<f64, Error> {
    let deadline = Instant::now() + Duration::from_secs(900);
    let mut first = None;
    loop {
        let n = settled();
        if n > 0 && first.is_none() {
            first = Some(Instant::now());
        }
        if n >= total {
            let first = first.expect("set above");
            return Ok(first.elapsed().as_secs_f64().max(1e-3));
        }
        if Instant::now() > deadline {
            return Err(format!("{n} of {total} deliveries settled after 15 min").into());
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

async fn doubles(pool: &PgPool, run: &str) -> Result<i64, Error> {
    Ok(sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT message_id FROM bench_effects WHERE run = $1
           GROUP BY message_id HAVING count(*) > 1) d",
    )
    .bind(run)
    .fetch_one(pool)
    .await?)
}

fn run_name(mode: &str) -> String {
    format!(
        "{mode}-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    )
}

/// The inbox consumer, per message or batched.
async fn inbox_mode<S: BenchStore>(
    name: &'static str,
    target: &Target,
    store: &S,
    args: &Args,
    batch: Option<Batching>,
    copies: bool,
) -> Result<Measured, Error>
where
    BenchHandler: Handler<S::Tx>,
{
    inbox_mode_with(
        name,
        target,
        store,
        args,
        batch,
        copies,
        (false, Dedup::Ids),
    )
    .await
}

/// [`inbox_mode`], with the handler in its batch form when `whole`, copies told by `dedup`.
async fn inbox_mode_with<S: BenchStore>(
    name: &'static str,
    target: &Target,
    store: &S,
    args: &Args,
    batch: Option<Batching>,
    copies: bool,
    (whole, dedup): (bool, Dedup),
) -> Result<Measured, Error>
where
    BenchHandler: Handler<S::Tx>,
{
    let run = run_name("inbox");
    let (source, total) = prepare(target, &run, args.messages, copies).await?;
    let mut consumer = Consumer::new(
        ConsumerName::new(run.clone())?,
        source,
        Arc::clone(&target.transport),
        store.clone(),
        BenchHandler {
            run: run.clone(),
            whole,
        },
    )
    .concurrency(args.concurrency)
    .dedup(dedup);
    if let Some(batch) = batch {
        consumer = consumer.batch(batch);
    }
    let token = CancellationToken::new();
    let mut running = {
        let (consumer, token) = (consumer.clone(), token.clone());
        tokio::spawn(async move { consumer.run(token).await })
    };
    let settled = || {
        let r = consumer.report();
        r.processed + r.duplicates_discarded + r.dead_lettered
    };
    let seconds = tokio::select! {
        seconds = clock(total, settled) => seconds?,
        stopped = &mut running => return Err(format!("{name}: the consumer stopped: {stopped:?}").into()),
    };
    token.cancel();
    running.await??;
    Ok(Measured {
        name,
        mode: match (batch, copies) {
            (Some(_), _) if dedup != Dedup::Ids && whole => "kafka_offsets_batch_handler",
            (Some(_), _) if dedup != Dedup::Ids => "kafka_offsets",
            (None, _) if dedup != Dedup::Ids => "kafka_offsets_per_message",
            (Some(_), _) if whole => "batch_handler",
            (Some(_), _) => "batch",
            (None, true) => "copies",
            (None, false) => "per_message",
        },
        messages: total as usize,
        seconds,
        doubles: Some(store.doubles(&run).await?),
        latencies: target.timed.take(),
        cpu: None,
    })
}

/// Consumes with `work` per delivery, `concurrency` at a time, then acks; no inbox engine.
async fn hand_rolled<F, Fut>(
    (name, mode): (&'static str, &'static str),
    target: &Target,
    args: &Args,
    (copies, ordered): (bool, bool),
    pool: &PgPool,
    work: F,
) -> Result<Measured, Error>
where
    F: Fn(String, String) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<(), sqlx::Error>> + Send + 'static,
{
    let run = run_name("plain");
    let (source, total) = prepare(target, &run, args.messages, copies).await?;
    let subscription = Subscription::new(
        source,
        ConsumerName::new(run.clone())?,
        u16::try_from(args.concurrency * 2).unwrap_or(u16::MAX),
    );
    let mut stream = target.transport.subscribe(&subscription).await?;
    let permits = Arc::new(Semaphore::new(args.concurrency));
    let work = Arc::new(work);
    let acked = Arc::new(AtomicU64::new(0));
    let mut consume = tokio::spawn({
        let (run, acked) = (run.clone(), Arc::clone(&acked));
        async move {
            let mut tasks = tokio::task::JoinSet::new();
            // Ordered: a lane per ordering key (a Kafka partition), its deliveries one after
            // another — what the engine does on an ordered transport.
            let mut lanes: HashMap<String, tokio::sync::mpsc::UnboundedSender<Job>> =
                HashMap::new();
            type Job = (Box<dyn Delivery>, tokio::sync::OwnedSemaphorePermit, String);
            let handle = {
                let (work, run, acked) = (Arc::clone(&work), run.clone(), Arc::clone(&acked));
                move |(delivery, permit, id): Job| {
                    let (work, run, acked) = (Arc::clone(&work), run.clone(), Arc::clone(&acked));
                    async move {
                        let result = work(run, id).await;
                        if result.is_ok() {
                            // The baseline has no engine to hand it a proof of commit.
                            let _ = delivery.ack(AckToken::for_transport_tests()).await;
                            acked.fetch_add(1, Ordering::SeqCst);
                        }
                        drop(permit);
                        result
                    }
                }
            };
            while let Some(delivery) = stream.next().await {
                let permit = Arc::clone(&permits).acquire_owned().await?;
                let delivery = delivery?;
                let id = delivery
                    .broker_message_id()
                    .or_else(|| delivery.headers().get(inbox::DEFAULT_ID_HEADER))
                    .map(|id| String::from_utf8_lossy(id).into_owned())
                    .unwrap_or_default();
                let key = ordered
                    .then(|| delivery.ordering_key().map(str::to_owned))
                    .flatten();
                match key {
                    Some(key) => {
                        let lane = lanes.entry(key).or_insert_with(|| {
                            let (lane, mut queue) = tokio::sync::mpsc::unbounded_channel::<Job>();
                            let handle = handle.clone();
                            tasks.spawn(async move {
                                while let Some(job) = queue.recv().await {
                                    handle(job).await?;
                                }
                                Ok::<(), sqlx::Error>(())
                            });
                            lane
                        });
                        lane.send((delivery, permit, id))
                            .map_err(|_| "a lane ended early")?;
                    }
                    None => {
                        tasks.spawn(handle((delivery, permit, id)));
                    }
                }
                while let Some(done) = tasks.try_join_next() {
                    done??;
                }
            }
            Ok::<(), Error>(())
        }
    });
    let seconds = tokio::select! {
        seconds = clock(total, || acked.load(Ordering::SeqCst)) => seconds?,
        stopped = &mut consume => return Err(format!("{name}: the consumer stopped: {stopped:?}").into()),
    };
    // Unsubscribe before the next mode, so its latencies are its own.
    consume.abort();
    Ok(Measured {
        name,
        mode,
        messages: total as usize,
        seconds,
        doubles: Some(doubles(pool, &run).await?),
        latencies: target.timed.take(),
        cpu: None,
    })
}

/// The business write alone: BEGIN, insert, COMMIT, ack. `ordered`: with the engine's order on
/// an ordered transport (one delivery at a time per key: a Kafka partition).
async fn no_inbox(
    target: &Target,
    args: &Args,
    pool: &PgPool,
    ordered: bool,
) -> Result<Measured, Error> {
    let p = pool.clone();
    let name = if ordered {
        ("no inbox, ordered", "no_inbox_ordered")
    } else {
        ("no inbox", "no_inbox")
    };
    hand_rolled(
        name,
        target,
        args,
        (false, ordered),
        pool,
        move |run, id| {
            let pool = p.clone();
            async move {
                let mut tx = pool.begin().await?;
                business_write(&mut tx, &run, &id).await?;
                tx.commit().await
            }
        },
    )
    .await
}

/// The seed article's algorithm: look the id up; if unseen, handle and insert it.
async fn naive(
    name: &'static str,
    target: &Target,
    args: &Args,
    (copies, ordered): (bool, bool),
    pool: &PgPool,
) -> Result<Measured, Error> {
    let p = pool.clone();
    let mode = match (copies, ordered) {
        (true, _) => "naive_copies",
        (false, true) => "naive_ordered",
        (false, false) => "naive",
    };
    hand_rolled(
        (name, mode),
        target,
        args,
        (copies, ordered),
        pool,
        move |run, id| {
            let pool = p.clone();
            async move {
                let seen: Option<i32> = sqlx::query_scalar(
                    "SELECT 1 FROM naive_processed WHERE consumer = $1 AND message_id = $2",
                )
                .bind(&run)
                .bind(&id)
                .fetch_optional(&pool)
                .await?;
                if seen.is_some() {
                    return Ok(());
                }
                let mut tx = pool.begin().await?;
                business_write(&mut tx, &run, &id).await?;
                sqlx::query(
                    "INSERT INTO naive_processed (consumer, message_id) VALUES ($1, $2)
                 ON CONFLICT DO NOTHING",
                )
                .bind(&run)
                .bind(&id)
                .execute(&mut *tx)
                .await?;
                tx.commit().await
            }
        },
    )
    .await
}

/// The broker alone: consume and ack.
async fn raw_broker(target: &Target, args: &Args) -> Result<Measured, Error> {
    let run = run_name("raw");
    let (source, total) = prepare(target, &run, args.messages, false).await?;
    let subscription = Subscription::new(source, ConsumerName::new(run.clone())?, 1024);
    let mut stream = target.transport.subscribe(&subscription).await?;
    let mut first = None;
    for _ in 0..total {
        let delivery = stream.next().await.ok_or("the stream ended")??;
        first.get_or_insert_with(Instant::now);
        delivery.ack(AckToken::for_transport_tests()).await?;
    }
    Ok(Measured {
        name: "broker consume+ack",
        mode: "raw_broker",
        messages: total as usize,
        seconds: first.map_or(1e-3, |f| f.elapsed().as_secs_f64().max(1e-3)),
        doubles: None,
        latencies: target.timed.take(),
        cpu: None,
    })
}

/// pgbench running the inbox's transaction shape at the same concurrency.
async fn pgbench(args: &Args, url: &str) -> Result<Measured, Error> {
    let script = std::env::temp_dir().join(format!("inbox-bench-{}.sql", uuid::Uuid::new_v4()));
    std::fs::write(
        &script,
        "\\set n random(1, 2000000000)
BEGIN;
INSERT INTO inbox_messages (consumer, message_id, processed_at) VALUES ('pgbench', :client_id || '-' || :n, now()) ON CONFLICT (consumer, message_id) DO UPDATE SET processed_at = now() WHERE inbox_messages.processed_at IS NULL AND inbox_messages.dead_lettered_at IS NULL RETURNING attempts, last_error;
INSERT INTO bench_effects (run, message_id, payload) VALUES ('pgbench', :client_id || '-' || :n, 'booked');
SELECT 1;
COMMIT;
",
    )?;
    let output = tokio::process::Command::new("pgbench")
        .args([
            "-n",
            "-M",
            "prepared",
            "-c",
            &args.concurrency.to_string(),
            "-j",
            "2",
            "-T",
            &args.pgbench_seconds.to_string(),
            "-f",
        ])
        .arg(&script)
        .arg(url)
        .output()
        .await
        .map_err(|e| format!("pgbench (PostgreSQL's client tools) runs: {e}"))?;
    let _ = std::fs::remove_file(&script);
    let text = String::from_utf8_lossy(&output.stdout);
    let tps = text
        .lines()
        .find(|l| l.starts_with("tps = "))
        .and_then(|l| l[6..].split_whitespace().next())
        .and_then(|v| v.parse::<f64>().ok())
        .ok_or_else(|| {
            format!(
                "pgbench gave no tps: {text}{}",
                String::from_utf8_lossy(&output.stderr)
            )
        })?;
    Ok(Measured {
        name: "pgbench, same SQL",
        mode: "pgbench",
        messages: (tps * args.pgbench_seconds as f64) as usize,
        seconds: args.pgbench_seconds as f64,
        doubles: None,
        latencies: Vec::new(),
        cpu: None,
    })
}

/// A destination of its own on `target`, with a queue (RabbitMQ) or topic (Kafka) so that
/// publishes to it have a route.
async fn sink(target: &Target) -> Result<String, Error> {
    let destination = format!("bench-outbox-{}", uuid::Uuid::new_v4().simple());
    let subscription = Subscription::new(destination.clone(), ConsumerName::new("sink")?, 1);
    target.transport.declare(&subscription).await?;
    Ok(destination)
}

/// The broker alone: `n` publishes with confirms, as many in flight as the measured relay has
/// (its batch times its batches in flight).
async fn raw_publish(target: &Target, n: usize, in_flight: usize) -> Result<Measured, Error> {
    let destination = sink(target).await?;
    let clock = cpu::CpuClock::start();
    let started = Instant::now();
    let transport = &target.transport;
    let destination = &destination;
    let mut publishes = futures::stream::iter(0..n)
        .map(|i| async move {
            let message =
                OutgoingMessage::new(format!("raw-{i}"), r#"{"parcel":1}"#).with_key(i.to_string());
            transport.publish(destination, message).await
        })
        .buffer_unordered(in_flight.max(1));
    while let Some(published) = publishes.next().await {
        published?;
    }
    Ok(Measured {
        name: "broker publish+confirm",
        mode: "raw_publish",
        messages: n,
        seconds: started.elapsed().as_secs_f64().max(1e-3),
        doubles: None,
        latencies: Vec::new(),
        cpu: clock.stop(),
    })
}

/// `n` outbox rows to `destination`, one key each, written in transactions of 500.
async fn fill_outbox(
    outbox: &Outbox<PostgresStore>,
    destination: &str,
    n: usize,
) -> Result<(), Error> {
    for chunk in (0..n).collect::<Vec<_>>().chunks(500) {
        let mut tx = outbox.store().begin().await?;
        for i in chunk {
            let message = OutgoingMessage::new(uuid::Uuid::now_v7().to_string(), r#"{"parcel":1}"#)
                .with_key(format!("parcel-{i}"));
            outbox.send(&mut tx, destination, message).await?;
        }
        outbox.store().commit(tx).await?;
    }
    Ok(())
}

/// One relay publishing `n` waiting rows, `batch` at a time (with its default batches in flight;
/// one at a time for the one-row relay, the naive baseline): its rate from the start to the
/// last mark.
async fn relay_rate(
    target: &Target,
    store: &PostgresStore,
    args: &Args,
    n: usize,
    batch: u32,
) -> Result<Measured, Error> {
    let outbox = Outbox::new(store.clone()).signal_other_processes(false);
    let destination = sink(target).await?;
    // Every relay measured starts on a vacuumed table, not on the dead rows of the one before.
    sqlx::query("VACUUM outbox_messages")
        .execute(store.pool())
        .await?;
    fill_outbox(&outbox, &destination, n).await?;
    let mut relay = outbox
        .relay(Arc::clone(&target.transport))
        .batch_size(batch);
    if batch == 1 {
        relay = relay.concurrency(1);
    } else if let Some(batches) = args.relay_concurrency {
        relay = relay.concurrency(batches);
    }
    *target.timed.confirms.lock().expect("not poisoned") = Some(HashMap::new());
    let clock = cpu::CpuClock::start();
    let started = Instant::now();
    let stop = CancellationToken::new();
    let running = {
        let stop = stop.clone();
        tokio::spawn(async move { relay.run(stop).await })
    };
    wait_for_confirms(target, n).await?;
    // The relay finishes its batches (their marks) before `run` returns.
    stop.cancel();
    let report = running.await??;
    let seconds = started.elapsed().as_secs_f64().max(1e-3);
    let cpu = clock.stop();
    target.timed.confirms.lock().expect("not poisoned").take();
    if report.published < n as u64 {
        return Err(format!("the relay marked {} of {n} rows", report.published).into());
    }
    Ok(Measured {
        name: if batch == 1 {
            "relay, one row at a time"
        } else {
            "relay, batches"
        },
        mode: if batch == 1 {
            "outbox_relay_one_row"
        } else {
            "outbox_relay"
        },
        messages: n,
        seconds,
        doubles: None,
        latencies: Vec::new(),
        cpu,
    })
}

/// Waits until `n` distinct messages were confirmed since confirms were switched on.
async fn wait_for_confirms(target: &Target, n: usize) -> Result<(), Error> {
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let count = target
            .timed
            .confirms
            .lock()
            .expect("not poisoned")
            .as_ref()
            .map_or(0, HashMap::len);
        if count >= n {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!("{count} of {n} rows published after 5 min").into());
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// A producer committing one row per transaction at `--outbox-rate` while a relay runs: the
/// latency from each commit to the broker's confirm. `woken`: the relay shares the producer's
/// outbox, so each commit wakes it; otherwise it finds rows by polling only.
async fn outbox_latency(
    target: &Target,
    store: &PostgresStore,
    args: &Args,
    woken: bool,
) -> Result<Measured, Error> {
    let n = args.messages.min(5 * args.outbox_rate as usize).max(1);
    let producer = Outbox::new(store.clone()).signal_other_processes(false);
    let relay = if woken {
        producer.clone()
    } else {
        Outbox::new(store.clone()).signal_other_processes(false)
    }
    .relay(Arc::clone(&target.transport));
    let destination = sink(target).await?;
    *target.timed.confirms.lock().expect("not poisoned") = Some(HashMap::new());
    let stop = CancellationToken::new();
    let running = {
        let stop = stop.clone();
        tokio::spawn(async move { relay.run(stop).await })
    };
    let committed = Arc::new(Mutex::new(HashMap::new()));
    let mut ticks = tokio::time::interval(Duration::from_secs_f64(
        1.0 / args.outbox_rate.max(1) as f64,
    ));
    let writers = Arc::new(Semaphore::new(64));
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..n {
        ticks.tick().await;
        let permit = Arc::clone(&writers).acquire_owned().await?;
        let (producer, committed, destination) = (
            producer.clone(),
            Arc::clone(&committed),
            destination.clone(),
        );
        tasks.spawn(async move {
            let _permit = permit;
            let id = format!("latency-{}", uuid::Uuid::now_v7());
            let mut tx = producer.store().begin().await?;
            let message =
                OutgoingMessage::new(id.clone(), r#"{"parcel":1}"#).with_key(format!("p-{i}"));
            producer.send(&mut tx, &destination, message).await?;
            producer.commit(tx).await?;
            committed
                .lock()
                .expect("not poisoned")
                .insert(id, Instant::now());
            Ok::<(), inbox::StoreError>(())
        });
    }
    while let Some(done) = tasks.join_next().await {
        done??;
    }
    wait_for_confirms(target, n).await?;
    let confirms = target
        .timed
        .confirms
        .lock()
        .expect("not poisoned")
        .take()
        .unwrap_or_default();
    let seconds = started.elapsed().as_secs_f64();
    stop.cancel();
    running.await??;
    let committed = committed.lock().expect("not poisoned");
    let mut latencies: Vec<Duration> = committed
        .iter()
        .filter_map(|(id, at)| confirms.get(id).map(|c| c.saturating_duration_since(*at)))
        .collect();
    latencies.sort_unstable();
    Ok(Measured {
        name: if woken {
            "commit->confirm, woken"
        } else {
            "commit->confirm, polling"
        },
        mode: if woken {
            "outbox_latency"
        } else {
            "outbox_latency_polling"
        },
        messages: n,
        seconds,
        doubles: None,
        latencies,
        cpu: None,
    })
}

/// How the producer's transaction sends its message.
#[derive(Clone, Copy, PartialEq)]
enum Producing {
    /// No outbox row: the baseline.
    Plain,
    /// `Outbox::send` in the application's transaction, committed by `Outbox::commit`.
    Send,
    /// Staged in an `OutboxTx`, written as it commits.
    Staged,
}

/// The producer's own writes, `--concurrency` writers: a parcel row per transaction, with its
/// outbox row or without.
async fn producer_writes(
    store: &PostgresStore,
    args: &Args,
    producing: Producing,
    n: usize,
) -> Result<Measured, Error> {
    let outbox = Outbox::new(store.clone()).signal_other_processes(false);
    let destination = format!("bench-producer-{}", uuid::Uuid::new_v4().simple());
    let clock = cpu::CpuClock::start();
    let started = Instant::now();
    let outbox = &outbox;
    let destination = &destination;
    let mut writes = futures::stream::iter(0..n)
        .map(|i| async move {
            let id = uuid::Uuid::new_v4().to_string();
            let insert =
                sqlx::query("INSERT INTO bench_parcels (id, tracking_number) VALUES ($1, $2)")
                    .bind(id.clone())
                    .bind(format!("TRK{i:08}"));
            let messages = (0..args.producer_messages).map(|m| {
                OutgoingMessage::new(format!("parcel-created-{id}-{m}"), "{}").with_key(id.clone())
            });
            match producing {
                Producing::Plain | Producing::Send => {
                    let mut tx = outbox.store().begin().await?;
                    insert.execute(&mut *tx).await?;
                    if producing == Producing::Send {
                        for message in messages {
                            outbox.send(&mut tx, destination, message).await?;
                        }
                    }
                    outbox.store().commit(tx).await?;
                }
                Producing::Staged => {
                    let mut tx = outbox.begin().await?;
                    insert.execute(&mut **tx).await?;
                    for message in messages {
                        tx.send(destination, message)?;
                    }
                    tx.commit().await?;
                }
            }
            Ok::<(), Error>(())
        })
        .buffer_unordered(args.concurrency);
    while let Some(written) = writes.next().await {
        written?;
    }
    let seconds = started.elapsed().as_secs_f64().max(1e-3);
    let cpu = clock.stop();
    // Nobody publishes these: gone, so that the next relay measured does not find them.
    sqlx::query("DELETE FROM outbox_messages WHERE destination = $1")
        .bind(destination)
        .execute(store.pool())
        .await?;
    let (name, mode) = match producing {
        Producing::Plain => ("producer, no outbox", "producer_no_outbox"),
        Producing::Send => ("producer, outbox send", "producer_outbox_send"),
        Producing::Staged => ("producer, outbox staged", "producer_outbox"),
    };
    Ok(Measured {
        name,
        mode,
        messages: n,
        seconds,
        doubles: None,
        latencies: Vec::new(),
        cpu,
    })
}

/// The producer's three modes in alternating rounds (none, staged, send; three times, a third
/// of `--messages` each), so that a drift of the server's state during the run (autovacuum, a
/// checkpoint) falls on every mode alike. Each mode's rate is over its rounds together; also
/// returns staged / none per round.
async fn producer_rounds(
    store: &PostgresStore,
    args: &Args,
) -> Result<(Measured, Measured, Measured, Vec<f64>), Error> {
    const ROUNDS: usize = 3;
    let n = args.messages.div_ceil(ROUNDS).max(1);
    let mut totals: [Option<Measured>; 3] = [None, None, None];
    let mut ratios = Vec::new();
    for _ in 0..ROUNDS {
        let mut rates = [0.0; 3];
        for (i, producing) in [Producing::Plain, Producing::Staged, Producing::Send]
            .into_iter()
            .enumerate()
        {
            let m = producer_writes(store, args, producing, n).await?;
            rates[i] = m.rate();
            match &mut totals[i] {
                Some(total) => {
                    total.messages += m.messages;
                    total.seconds += m.seconds;
                    if let (Some(sum), Some(cpu)) = (&mut total.cpu, m.cpu) {
                        sum.absorb(cpu);
                    }
                }
                slot => *slot = Some(m),
            }
        }
        ratios.push(rates[1] / rates[0]);
    }
    let [Some(plain), Some(staged), Some(send)] = totals else {
        unreachable!("every round runs the three modes");
    };
    Ok((plain, staged, send, ratios))
}

/// The outbox's modes on `target`, printed as a table with their ratios.
async fn outbox_modes(
    target: &Target,
    store: &PostgresStore,
    args: &Args,
) -> Result<Vec<serde_json::Value>, Error> {
    let n = args.messages;
    let in_flight = args.relay_batch as usize * args.relay_concurrency.unwrap_or(2);
    let raw = raw_publish(target, n, in_flight).await?;
    let relay = relay_rate(target, store, args, n, args.relay_batch).await?;
    // The same relay with a broker that costs nothing, in the same run: what the database and
    // the relay's own code allow on this machine (on the memory transport, that is the relay).
    let free = if target.name == "memory" {
        None
    } else {
        let memory = Target::new("memory", Arc::new(MemoryBroker::new()));
        let mut free = relay_rate(&memory, store, args, n, args.relay_batch).await?;
        free.name = "relay, free broker";
        free.mode = "outbox_relay_free_broker";
        Some(free)
    };
    let one_row = relay_rate(target, store, args, (n / 10).max(10), 1).await?;
    let woken = outbox_latency(target, store, args, true).await?;
    let polling = outbox_latency(target, store, args, false).await?;
    let (plain, with_outbox, with_send, round_ratios) = producer_rounds(store, args).await?;
    println!();
    println!("== {} outbox ==", target.name);
    println!(
        "{:<28}{:>10}{:>10}{:>10}",
        "mode", "msgs/s", "p50 ms", "p99 ms"
    );
    let mut rows = Vec::new();
    for m in [Some(&relay), free.as_ref(), Some(&one_row), Some(&raw)]
        .into_iter()
        .flatten()
        .chain([&woken, &polling, &with_outbox, &with_send, &plain])
    {
        rows.push(m.row(target.name));
        println!(
            "{:<28}{:>10.0}{:>10}{:>10}",
            m.name,
            m.rate(),
            m.percentile(50.0),
            m.percentile(99.0)
        );
    }
    let ratio = |a: &Measured, b: &Measured| a.rate() / b.rate();
    let line = |what: &str, value: f64, target: f64| {
        let verdict = if value >= target { "met" } else { "NOT met" };
        println!("{what:<36}{value:>8.2}   target >= {target:<5} {verdict}");
    };
    line("relay / broker publish+confirm", ratio(&relay, &raw), 0.7);
    if let Some(free) = &free {
        println!(
            "{:<36}{:>8.2}   (what the database and the relay's code allow, beside the broker)",
            "relay with a free broker / broker",
            ratio(free, &raw)
        );
    }
    line("relay / one row at a time", ratio(&relay, &one_row), 10.0);
    line(
        "producer with outbox / without",
        ratio(&with_outbox, &plain),
        0.8,
    );
    println!(
        "(with Outbox::send in the application's transaction: {:.2}; staged / none per round: {})",
        ratio(&with_send, &plain),
        round_ratios
            .iter()
            .map(|r| format!("{r:.2}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let at = |m: &Measured, p| m.percentile_ms(p).unwrap_or(f64::INFINITY);
    println!(
        "commit->confirm at {} rows/s, woken: p50 {:.1} ms (target <= 15) {}, p99 {:.1} ms (target <= 100) {}",
        args.outbox_rate,
        at(&woken, 50.0),
        if at(&woken, 50.0) <= 15.0 {
            "met"
        } else {
            "NOT met"
        },
        at(&woken, 99.0),
        if at(&woken, 99.0) <= 100.0 {
            "met"
        } else {
            "NOT met"
        },
    );
    cpu_account(
        target.name,
        [
            Some(&relay),
            free.as_ref(),
            Some(&raw),
            Some(&plain),
            Some(&with_outbox),
        ],
        &raw,
    );
    Ok(rows)
}

/// The CPU each side spent per row in the outbox's modes, and what it allows: with every side
/// on the same processors, the relay can publish at most `processors / (the database's + the
/// broker's CPU per row)`, whatever its own code costs — a ceiling that only cheaper SQL or a
/// cheaper publish can raise. And the database's CPU per producer transaction.
fn cpu_account(broker: &str, modes: [Option<&Measured>; 5], raw: &Measured) {
    let measured: Vec<(&Measured, &cpu::CpuAccount)> = modes
        .into_iter()
        .flatten()
        .filter_map(|m| Some((m, m.cpu.as_ref()?)))
        .collect();
    if measured.is_empty() {
        println!("(no CPU account: it is read from /proc, on Linux only)");
        return;
    }
    println!(
        "{:<28}{:>10}{:>10}{:>10}{:>10}{:>8}",
        "CPU per row, us",
        "database",
        if broker == "memory" { "-" } else { broker },
        "bench",
        "other",
        "busy"
    );
    for (m, cpu) in &measured {
        let us = |side| cpu.per_row_us(side, m.messages);
        println!(
            "{:<28}{:>10.1}{:>10.1}{:>10.1}{:>10.1}{:>7.0}%",
            m.name,
            us("postgres"),
            if broker == "memory" { 0.0 } else { us(broker) },
            us("bench"),
            us("other"),
            cpu.busy() * 100.0
        );
    }
    let account = |mode: &str| measured.iter().find(|(m, _)| m.mode == mode);
    if let Some((relay, cpu)) = account("outbox_relay")
        && broker != "memory"
    {
        match cpu.ceiling(&["postgres", broker], relay.messages) {
            Some(ceiling) => {
                println!(
                    "{:<36}{:>8.0}   ({} processors / the database's and the broker's CPU per row in the relay's run)",
                    "relay ceiling msgs/s", ceiling, cpu.processors
                );
                println!(
                    "{:<36}{:>8.2}   (that ceiling / broker publish+confirm: the most this relay's SQL and publish allow here)",
                    "relay / broker at most",
                    ceiling / raw.rate()
                );
            }
            None => println!("(no relay ceiling: too little CPU counted; run more --messages)"),
        }
    }
    if let (Some((plain, without)), Some((staged, with))) =
        (account("producer_no_outbox"), account("producer_outbox"))
    {
        let database = |m: &Measured, cpu: &cpu::CpuAccount| cpu.per_row_us("postgres", m.messages);
        println!(
            "{:<36}{:>8.2}   (the database's CPU per transaction without the outbox / with it)",
            "producer database CPU, without / with",
            database(plain, without) / database(staged, with)
        );
    }
}

/// Retention cleanup of `rows` old rows while a consumer on the memory transport gets
/// `--cleanup-claim-rate` messages a second: the claims' latency before the cleanup, during the
/// paced cleanup (the library's default pace, `--cleanup-rest`), and during the same cleanup
/// unpaced. Each row's rate is the claims' rate; the cleanup's own rate is printed.
async fn cleanup_modes(
    store: &PostgresStore,
    args: &Args,
    rows: u64,
) -> Result<Vec<serde_json::Value>, Error> {
    let _ = inbox_test_kit::metrics::snapshotter();
    let broker = MemoryBroker::new();
    let run = run_name("cleanup");
    let source = format!("bench-{}", uuid::Uuid::new_v4().simple());
    let name = ConsumerName::new(run.clone())?;
    broker
        .declare(&Subscription::new(source.clone(), name.clone(), 1))
        .await?;
    let consumer = Consumer::new(
        name,
        source.clone(),
        Arc::new(broker.clone()) as Arc<dyn Transport>,
        store.clone(),
        BenchHandler {
            run: run.clone(),
            whole: false,
        },
    )
    .concurrency(args.concurrency);
    let token = CancellationToken::new();
    let running = {
        let (consumer, token) = (consumer.clone(), token.clone());
        tokio::spawn(async move { consumer.run(token).await })
    };
    // A steady feed, as a service's traffic: the claims are measured at a rate they keep up
    // with, so that their latency is the database's, not a queue's.
    let feeding = CancellationToken::new();
    let feed = {
        let (broker, source, token) = (broker.clone(), source.clone(), feeding.clone());
        let rate = args.cleanup_claim_rate.max(1);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / rate as f64));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            for i in 0u64.. {
                tokio::select! {
                    () = token.cancelled() => return Ok::<u64, TransportError>(i),
                    _ = tick.tick() => {}
                }
                broker
                    .publish(&source, OutgoingMessage::new(format!("m-{i}"), "{}"))
                    .await?;
            }
            unreachable!()
        })
    };
    let fill = |rows: u64| async move {
        let started = Instant::now();
        sqlx::query(
            "INSERT INTO inbox_messages (consumer, message_id, received_at, processed_at)
             SELECT 'history', 'h-' || g, now() - interval '30 days', now() - interval '30 days'
             FROM generate_series(1, $1) g",
        )
        .bind(rows as i64)
        .execute(store.pool())
        .await?;
        sqlx::query("VACUUM ANALYZE inbox_messages")
            .execute(store.pool())
            .await?;
        Ok::<Duration, Error>(started.elapsed())
    };
    let measure = |name: &'static str, mode: &'static str, seconds: f64| {
        let latencies = inbox_test_kit::metrics::claim_latencies(&run);
        Measured {
            name,
            mode,
            messages: latencies.len(),
            seconds: seconds.max(1e-3),
            doubles: None,
            latencies,
            cpu: None,
        }
    };
    let week = Duration::from_secs(7 * 24 * 3600);
    let mut measured = Vec::new();
    let mut report = Vec::new();
    for paced in [true, false] {
        let filled = fill(rows).await?;
        println!("{rows} old rows written in {:.1} s", filled.as_secs_f64());
        // Before: the claims of a quiet table at this rate.
        let _ = inbox_test_kit::metrics::claim_latencies(&run);
        let before = Instant::now();
        tokio::time::sleep(Duration::from_secs_f64(
            args.cleanup_before_seconds.max(0.1),
        ))
        .await;
        let before = measure(
            "claims before the cleanup",
            "cleanup_before",
            before.elapsed().as_secs_f64(),
        );
        let cleanup = inbox::Cleanup::new(store.clone(), week);
        let cleanup = if paced {
            cleanup.pace(
                Duration::from_millis(args.cleanup_batch_ms),
                args.cleanup_rest,
            )
        } else {
            cleanup.unpaced()
        };
        let started = Instant::now();
        let done = cleanup.run_once().await?;
        let took = started.elapsed();
        let during = if paced {
            measure("claims during, paced", "cleanup_during", took.as_secs_f64())
        } else {
            measure(
                "claims during, unpaced",
                "cleanup_during_unpaced",
                took.as_secs_f64(),
            )
        };
        report.push(format!(
            "{} cleanup: {} rows in {} batches, {:.1} s ({:.0} rows/s)",
            if paced { "paced" } else { "unpaced" },
            done.deleted,
            done.batches,
            took.as_secs_f64(),
            done.deleted as f64 / took.as_secs_f64().max(1e-3)
        ));
        if done.deleted != rows {
            return Err(format!("the cleanup deleted {} of {rows} rows", done.deleted).into());
        }
        // The paced run's "before" is the row; the unpaced run's is only context.
        if paced {
            measured.push(before);
        }
        measured.push(during);
    }
    feeding.cancel();
    let fed = feed.await??;
    clock(fed, || consumer.report().processed).await?;
    token.cancel();
    running.await??;
    println!();
    println!(
        "== cleanup of {rows} rows while claiming {} msgs/s ==",
        args.cleanup_claim_rate
    );
    println!(
        "{:<28}{:>10}{:>10}{:>10}",
        "mode", "claims/s", "p50 ms", "p99 ms"
    );
    for m in &measured {
        println!(
            "{:<28}{:>10.0}{:>10}{:>10}",
            m.name,
            m.rate(),
            m.percentile_ms(50.0)
                .map_or("-".into(), |v| format!("{v:.2}")),
            m.percentile_ms(99.0)
                .map_or("-".into(), |v| format!("{v:.2}"))
        );
    }
    for line in &report {
        println!("{line}");
    }
    let p99 = |m: &Measured| m.percentile_ms(99.0).unwrap_or(f64::INFINITY);
    let ratio = p99(&measured[1]) / p99(&measured[0]);
    println!(
        "claim p99 during / before (paced){:>12.2}   target <= 1.2   {}",
        ratio,
        if ratio <= 1.2 { "met" } else { "NOT met" }
    );
    println!(
        "claim p99 during / before (unpaced){:>10.2}",
        p99(&measured[2]) / p99(&measured[0])
    );
    Ok(measured.iter().map(|m| m.row("memory")).collect())
}

/// A database of the bench's own on the server of `url`.
async fn fresh_database(url: &str) -> Result<String, Error> {
    let name = format!("inbox_bench_{}", uuid::Uuid::new_v4().simple());
    let mut admin = sqlx::PgConnection::connect(url).await?;
    admin
        .execute(format!("CREATE DATABASE {name}").as_str())
        .await?;
    let (head, query) = match url.split_once('?') {
        Some((h, q)) => (h, format!("?{q}")),
        None => (url, String::new()),
    };
    let scheme_end = head.find("://").ok_or("DATABASE_URL is not a URL")? + 3;
    let base = match head[scheme_end..].find('/') {
        Some(slash) => &head[..scheme_end + slash],
        None => head,
    };
    Ok(format!("{base}/{name}{query}"))
}

/// Resident memory of this process from /proc: `VmHWM` (peak) or `VmRSS` (now).
fn rss_mib(field: &str) -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(field))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024.0)
}

fn peak_rss_mib() -> Option<f64> {
    rss_mib("VmHWM:")
}

/// The soak run: `total` messages through one batched inbox consumer on RabbitMQ or Kafka (a
/// broker in another process, so that what grows is ours), published as it goes with at most
/// 20 000 waiting, and the resident memory sampled at every tenth.
async fn soak(total: u64, args: &Args, store: &PostgresStore) -> Result<(), Error> {
    const WAITING: u64 = 20_000;
    let (transport, broker): (Arc<dyn Transport>, &str) = match args.soak_mode {
        SoakMode::Batch | SoakMode::BatchHandler => {
            let url = std::env::var("AMQP_URL")
                .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned());
            let transport = inbox::rabbitmq::RabbitMqTransport::new(url, bench_queues());
            (Arc::new(transport), "RabbitMQ")
        }
        SoakMode::KafkaOffsets => {
            let brokers =
                std::env::var("KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".to_owned());
            let transport =
                inbox::kafka::KafkaTransport::new(inbox::kafka::KafkaConfig::new(brokers))?;
            (Arc::new(transport), "Kafka, offsets kept in the database,")
        }
    };
    let run = run_name("soak");
    let source = format!("bench-{}", uuid::Uuid::new_v4().simple());
    let name = ConsumerName::new(run.clone())?;
    transport
        .declare(&Subscription::new(source.clone(), name.clone(), 1))
        .await?;
    let consumer = Consumer::new(
        name,
        source.clone(),
        Arc::clone(&transport),
        store.clone(),
        BenchHandler {
            run: run.clone(),
            whole: args.soak_mode == SoakMode::BatchHandler,
        },
    )
    .concurrency(args.concurrency)
    .batch(Batching::new(100, Duration::from_millis(5)))
    .dedup(if args.soak_mode == SoakMode::KafkaOffsets {
        Dedup::Offsets
    } else {
        Dedup::Ids
    });
    let settled = {
        let consumer = consumer.clone();
        move || {
            let r = consumer.report();
            r.processed + r.duplicates_discarded + r.dead_lettered
        }
    };
    let token = CancellationToken::new();
    let mut running = {
        let (consumer, token) = (consumer.clone(), token.clone());
        tokio::spawn(async move { consumer.run(token).await })
    };
    let producer = {
        let (transport, settled, run) = (Arc::clone(&transport), settled.clone(), run.clone());
        tokio::spawn(async move {
            let mut published = 0u64;
            while published < total {
                while published >= settled() + WAITING {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                let chunk = (published..(published + 1000).min(total))
                    .map(|i| OutgoingMessage::new(format!("{run}-{i}"), format!(r#"{{"n":{i}}}"#)));
                let results: Vec<_> = futures::stream::iter(chunk)
                    .map(|m| transport.publish(&source, m))
                    .buffered(64)
                    .collect()
                    .await;
                for r in results {
                    r?;
                }
                published = (published + 1000).min(total);
            }
            Ok::<(), Error>(())
        })
    };
    println!(
        "soak: {total} messages, batched inbox{} on {broker} {} in flight",
        if args.soak_mode == SoakMode::BatchHandler {
            " with a batch handler"
        } else {
            ""
        },
        args.concurrency
    );
    println!("{:>10}{:>10}{:>12}", "handled", "msgs/s", "RSS MiB");
    let started = Instant::now();
    let mut samples = Vec::new();
    let mut next = total / 10;
    let (mut last_n, mut last_progress) = (0, Instant::now());
    loop {
        let n = settled();
        if n > last_n {
            (last_n, last_progress) = (n, Instant::now());
        } else if last_progress.elapsed() > Duration::from_secs(60) {
            token.cancel();
            return Err(format!("soak: no progress for 60 s at {n} of {total}").into());
        }
        if n >= next {
            let rss = rss_mib("VmRSS:").unwrap_or(0.0);
            let rate = n as f64 / started.elapsed().as_secs_f64();
            println!("{n:>10}{rate:>10.0}{rss:>12.1}");
            samples.push(rss);
            if n >= total {
                break;
            }
            next = (next + total / 10).min(total);
        }
        if running.is_finished() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    token.cancel();
    let report = (&mut running).await??;
    producer.await??;
    if report.processed + report.duplicates_discarded < total {
        return Err(format!("soak: the consumer stopped after {report:?}").into());
    }
    let doubles = doubles(store.pool(), &run).await?;
    // The first tenth is warm-up (pools, buffers, the allocator's arenas); flat means the rest
    // stays within 10 % of where it was then.
    let (first, last) = (samples[0], *samples.last().expect("ten samples"));
    let max = samples.iter().copied().fold(0.0, f64::max);
    let flat = max <= first * 1.1;
    println!(
        "RSS after 10 %: {first:.1} MiB, at the end: {last:.1} MiB, highest: {max:.1} MiB; \
         double effects: {doubles}; target: flat (within 10 % of the 10 % mark)   {}",
        if flat { "met" } else { "NOT met" }
    );
    write_json(args, Vec::new(), Some(max))
}

fn main() -> Result<(), Error> {
    let args = Args::parse();
    // Warnings (an outage, a relay's failed publishes) on stderr; RUST_LOG for more.
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(bench(args))
}

/// The bench's RabbitMQ queues (one per mode) go away 10 minutes after their last use rather than
/// pile up in the broker.
fn bench_queues() -> inbox::rabbitmq::RabbitMqConfig {
    inbox::rabbitmq::RabbitMqConfig::default().queue_expires(Duration::from_secs(600))
}

async fn targets(which: Which) -> Result<Vec<Target>, Error> {
    let mut targets = Vec::new();
    if matches!(which, Which::Memory | Which::All) {
        targets.push(Target::new("memory", Arc::new(MemoryBroker::new())));
    }
    if matches!(which, Which::Rabbitmq | Which::All) {
        let url = std::env::var("AMQP_URL")
            .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned());
        targets.push(Target::new(
            "rabbitmq",
            Arc::new(inbox::rabbitmq::RabbitMqTransport::new(url, bench_queues())),
        ));
    }
    if matches!(which, Which::Kafka | Which::All) {
        let brokers =
            std::env::var("KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".to_owned());
        targets.push(Target::new(
            "kafka",
            Arc::new(inbox::kafka::KafkaTransport::new(
                inbox::kafka::KafkaConfig::new(brokers),
            )?),
        ));
    }
    if matches!(which, Which::Nats | Which::All) {
        let url = std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned());
        // Every copy stored (the copies modes publish each message twice with one id), and the
        // bench's streams emptied 10 minutes after.
        let config = inbox::nats::NatsConfig::default()
            .deduplicate(false)
            .max_age(Some(Duration::from_secs(600)))
            .inactive_threshold(Some(Duration::from_secs(600)));
        targets.push(Target::new(
            "nats",
            Arc::new(inbox::nats::NatsTransport::connect(url, config).await?),
        ));
    }
    if matches!(which, Which::Redis | Which::All) {
        let url =
            std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned());
        targets.push(Target::new(
            "redis",
            Arc::new(inbox::redis::RedisTransport::connect(url, Default::default()).await?),
        ));
    }
    Ok(targets)
}

async fn bench(args: Args) -> Result<(), Error> {
    let url = fresh_database(&args.database).await?;
    let store = PostgresStore::connect(&url, (args.concurrency + 2) as u32)
        .await?
        .claim_with_begin(!args.claim_apart);
    store.migrate().await?;
    let pool = store.pool().clone();
    for ddl in [
        "CREATE TABLE bench_effects (run text NOT NULL, message_id text NOT NULL, payload text NOT NULL)",
        "CREATE INDEX ON bench_effects (run, message_id)",
        "CREATE TABLE naive_processed (consumer text NOT NULL, message_id text NOT NULL, PRIMARY KEY (consumer, message_id))",
        "CREATE TABLE bench_parcels (id text PRIMARY KEY, tracking_number text NOT NULL, created_at timestamptz NOT NULL DEFAULT now())",
    ] {
        pool.execute(ddl).await?;
    }
    if let Some(total) = args.soak {
        return soak(total, &args, &store).await;
    }
    println!(
        "inbox throughput: {} messages per mode, {} in flight, PostgreSQL",
        args.messages, args.concurrency
    );
    if args.producer_messages != 1 {
        println!(
            "producer transactions send {} outbox messages each",
            args.producer_messages
        );
    }
    let mut rows = Vec::new();
    if args.profile {
        for target in targets(args.transport).await? {
            let m = inbox_mode("inbox per message", &target, &store, &args, None, false).await?;
            rows.push(m.row(target.name));
            println!(
                "{}: {:.0} msgs/s, p50 {} ms, p99 {} ms",
                target.name,
                m.rate(),
                m.percentile(50.0),
                m.percentile(99.0)
            );
        }
        return write_json(&args, rows, peak_rss_mib());
    }
    if let Some(rows) = args.cleanup {
        let measured = cleanup_modes(&store, &args, rows).await?;
        return write_json(&args, measured, peak_rss_mib());
    }
    if args.outbox_only {
        for target in targets(args.transport).await? {
            rows.extend(outbox_modes(&target, &store, &args).await?);
        }
        return write_json(&args, rows, peak_rss_mib());
    }
    let mysql = match &args.mysql {
        Some(url) => Some(mysql_store(url, (args.concurrency + 2) as u32).await?),
        None => None,
    };
    let ceiling = pgbench(&args, &url).await?;
    println!(
        "pgbench, the inbox's transaction shape, {} clients: {:.0} tx/s",
        args.concurrency,
        ceiling.rate()
    );
    for target in targets(args.transport).await? {
        let t = &target;
        let raw = raw_broker(t, &args).await?;
        let per_message = inbox_mode("inbox per message", t, &store, &args, None, false).await?;
        let batched = inbox_mode(
            "inbox batch (100, 5 ms)",
            t,
            &store,
            &args,
            Some(Batching::new(100, Duration::from_millis(5))),
            false,
        )
        .await?;
        let batch_handler = inbox_mode_with(
            "inbox batch handler (100)",
            t,
            &store,
            &args,
            Some(Batching::new(100, Duration::from_millis(5))),
            false,
            (true, Dedup::Ids),
        )
        .await?;
        // Offsets mode where the transport has log positions (Kafka): batch mode as above,
        // copies told by each partition's kept offset, no row per message; and per message.
        let by_offsets = if t.transport.capabilities().log_positions {
            let offsets = |name, batch, whole| {
                inbox_mode_with(
                    name,
                    t,
                    &store,
                    &args,
                    batch,
                    false,
                    (whole, Dedup::Offsets),
                )
            };
            let batching = Some(Batching::new(100, Duration::from_millis(5)));
            Some((
                offsets("offsets batch (100, 5 ms)", batching, false).await?,
                offsets("offsets per message", None, false).await?,
                offsets("offsets batch handler (100)", batching, true).await?,
            ))
        } else {
            None
        };
        let plain = no_inbox(t, &args, &pool, false).await?;
        let naive_rate = naive("naive check-then-insert", t, &args, (false, false), &pool).await?;
        let inbox_copies =
            inbox_mode("inbox, copies at once", t, &store, &args, None, true).await?;
        let naive_copies = naive("naive, copies at once", t, &args, (true, false), &pool).await?;
        // On an ordered transport, the baselines with the engine's order too (a Kafka
        // partition's records one at a time): the like-for-like comparison.
        let ordered_baselines = if t.transport.capabilities().ordered {
            Some((
                no_inbox(t, &args, &pool, true).await?,
                naive("naive, ordered", t, &args, (false, true), &pool).await?,
            ))
        } else {
            None
        };

        println!();
        println!("== {} ==", t.name);
        println!(
            "{:<28}{:>10}{:>10}{:>10}{:>16}",
            "mode", "msgs/s", "p50 ms", "p99 ms", "double effects"
        );
        let mut shown = vec![
            &per_message,
            &batched,
            &batch_handler,
            &plain,
            &naive_rate,
            &inbox_copies,
            &naive_copies,
            &ceiling,
            &raw,
        ];
        if let Some((no_inbox_ordered, naive_ordered)) = &ordered_baselines {
            shown.extend([no_inbox_ordered, naive_ordered]);
        }
        if let Some((offsets_batch, offsets_per_message, offsets_batch_handler)) = &by_offsets {
            shown.extend([offsets_batch, offsets_per_message, offsets_batch_handler]);
        }
        for m in shown {
            rows.push(m.row(t.name));
            let doubles = m.doubles.map_or("-".to_owned(), |d| d.to_string());
            println!(
                "{:<28}{:>10.0}{:>10}{:>10}{:>16}",
                m.name,
                m.rate(),
                m.percentile(50.0),
                m.percentile(99.0),
                doubles
            );
        }
        let ratio = |a: &Measured, b: &Measured| a.rate() / b.rate();
        let line = |what: &str, value: f64, target: f64| {
            let verdict = if value >= target { "met" } else { "NOT met" };
            println!("{what:<36}{value:>8.2}   target >= {target:<5} {verdict}");
        };
        line(
            "inbox per message / pgbench",
            ratio(&per_message, &ceiling),
            0.9,
        );
        line(
            "inbox per message / no inbox",
            ratio(&per_message, &plain),
            0.8,
        );
        line("batch / broker consume+ack", ratio(&batched, &raw), 0.5);
        line("batch / per message", ratio(&batched, &per_message), 10.0);
        line(
            "batch handler / per message",
            ratio(&batch_handler, &per_message),
            10.0,
        );
        line(
            "batch handler / broker consume+ack",
            ratio(&batch_handler, &raw),
            if t.name == "kafka" { 0.6 } else { 0.8 },
        );
        line(
            "inbox per message / naive",
            ratio(&per_message, &naive_rate),
            1.2,
        );
        if let Some((no_inbox_ordered, naive_ordered)) = &ordered_baselines {
            line(
                "per message / no inbox, ordered",
                ratio(&per_message, no_inbox_ordered),
                0.9,
            );
            line(
                "per message / naive, ordered",
                ratio(&per_message, naive_ordered),
                1.2,
            );
        }
        if let Some((offsets_batch, offsets_per_message, offsets_batch_handler)) = &by_offsets {
            line(
                "offsets batch / batch (by id)",
                ratio(offsets_batch, &batched),
                1.5,
            );
            line(
                "offsets per message / per message",
                ratio(offsets_per_message, &per_message),
                1.0,
            );
            line(
                "offsets batch handler / batch handler",
                ratio(offsets_batch_handler, &batch_handler),
                1.0,
            );
            line(
                "offsets batch handler / consume+ack",
                ratio(offsets_batch_handler, &raw),
                0.6,
            );
        }
        println!(
            "double effects with copies at once: inbox {}, naive {}",
            inbox_copies.doubles.unwrap_or(0),
            naive_copies.doubles.unwrap_or(0)
        );
        if let Some(mysql) = &mysql {
            let batching = Some(Batching::new(100, Duration::from_millis(5)));
            let mut my_per_message =
                inbox_mode("MariaDB per message", t, mysql, &args, None, false).await?;
            my_per_message.mode = "mysql_per_message";
            let mut my_batch =
                inbox_mode("MariaDB batch", t, mysql, &args, batching, false).await?;
            my_batch.mode = "mysql_batch";
            for m in [&my_per_message, &my_batch] {
                rows.push(m.row(t.name));
                println!(
                    "{:<28}{:>10.0}{:>10}{:>10}{:>16}",
                    m.name,
                    m.rate(),
                    m.percentile(50.0),
                    m.percentile(99.0),
                    m.doubles.map_or("-".to_owned(), |d| d.to_string())
                );
            }
            println!(
                "MariaDB / PostgreSQL: per message {:.2}, batch {:.2}",
                ratio(&my_per_message, &per_message),
                ratio(&my_batch, &batched)
            );
        }
        if t.name == "kafka" {
            rows.extend(wider_kafka(&store, &args, &pool).await?);
        }
        rows.extend(outbox_modes(t, &store, &args).await?);
    }
    let rss = peak_rss_mib();
    if let Some(rss) = rss {
        println!("\npeak RSS of the bench process: {rss:.0} MiB");
    }
    write_json(&args, rows, rss)
}

/// Kafka with topics of 12 partitions instead of 3: more lanes in flight, per message and in the
/// ordered baseline.
async fn wider_kafka(
    store: &PostgresStore,
    args: &Args,
    pool: &PgPool,
) -> Result<Vec<serde_json::Value>, Error> {
    let brokers = std::env::var("KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".to_owned());
    let t = &Target::new(
        "kafka",
        Arc::new(inbox::kafka::KafkaTransport::new(
            inbox::kafka::KafkaConfig::new(brokers).partitions(12),
        )?),
    );
    let mut per_message = inbox_mode("inbox per message", t, store, args, None, false).await?;
    per_message.mode = "per_message_12_partitions";
    let mut ordered = no_inbox(t, args, pool, true).await?;
    ordered.mode = "no_inbox_ordered_12_partitions";
    let mut unordered = no_inbox(t, args, pool, false).await?;
    unordered.mode = "no_inbox_12_partitions";
    println!();
    println!("== kafka, 12 partitions ==");
    for m in [&per_message, &ordered, &unordered] {
        println!(
            "{:<28}{:>10.0}{:>10}{:>10}",
            m.name,
            m.rate(),
            m.percentile(50.0),
            m.percentile(99.0)
        );
    }
    let ratio = per_message.rate() / ordered.rate();
    println!(
        "{:<36}{ratio:>8.2}   target >= 0.9   {}",
        "per message / no inbox, ordered",
        if ratio >= 0.9 { "met" } else { "NOT met" }
    );
    Ok([&per_message, &ordered, &unordered]
        .iter()
        .map(|m| m.row(t.name))
        .collect())
}

/// Writes `--json`'s file, if asked for.
fn write_json(
    args: &Args,
    rows: Vec<serde_json::Value>,
    rss_mib: Option<f64>,
) -> Result<(), Error> {
    let Some(path) = &args.json else {
        return Ok(());
    };
    let document = serde_json::json!({ "rows": rows, "rss_mib": rss_mib });
    std::fs::write(path, serde_json::to_vec_pretty(&document)?)
        .map_err(|e| format!("writing {}: {e}", path.display()))?;
    println!("results written to {}", path.display());
    Ok(())
}
