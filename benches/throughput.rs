//! What the inbox costs, measured side by side in one run (issue 6), for each transport (memory,
//! RabbitMQ at `AMQP_URL`, Kafka at `KAFKA_BROKERS`) against PostgreSQL (`DATABASE_URL`):
//!
//! - inbox per message, and in batch mode;
//! - the same consumer with no inbox (business write + commit + ack);
//! - the naive algorithm (look the id up, then handle and insert it), for throughput and for
//!   double effects under concurrent duplicates;
//! - the ceilings: `pgbench` running the inbox's transaction shape (claim + business insert +
//!   commit) at the same concurrency, and the broker's raw consume+ack rate.
//!
//! `cargo bench --bench throughput --all-features -- [--transport memory|rabbitmq|kafka|all]
//! [--messages N] [--concurrency C]`
//!
//! Each mode gets a source of its own with N messages published before it starts (the "copies"
//! modes: each message twice in a row, so that the copies are handled at once); its clock starts
//! at the first settled delivery (connecting and joining a group are not counted) and stops when
//! every delivery is settled.
//!
//! Ratios are what to read: the machine is shared and noisy, absolute rates are context only.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use clap::{Parser, ValueEnum};
use futures::StreamExt;
use inbox::memory::MemoryBroker;
use inbox::{
    AckToken, Batching, CancellationToken, Consumer, ConsumerName, Handler, HandlerError,
    InboxStore, Message, OutgoingMessage, PgTx, PostgresStore, Subscription, Transport,
    async_trait,
};
use sqlx::{Connection, Executor, PgPool};
use tokio::sync::Semaphore;

#[derive(Clone, Copy, PartialEq, ValueEnum)]
enum Which {
    Memory,
    Rabbitmq,
    Kafka,
    All,
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
    /// The PostgreSQL server (a database of its own is created on it).
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    database: String,
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
}

#[async_trait]
impl Handler<PgTx> for BenchHandler {
    async fn handle(&self, message: &Message<'_>, tx: &mut PgTx) -> Result<(), HandlerError> {
        business_write(tx, &self.run, message.id.as_str()).await?;
        Ok(())
    }
}

/// One measured mode.
struct Measured {
    name: &'static str,
    messages: usize,
    seconds: f64,
    doubles: Option<i64>,
}

impl Measured {
    fn rate(&self) -> f64 {
        self.messages as f64 / self.seconds
    }
}

/// A transport to measure, and how to make one.
struct Target {
    name: &'static str,
    transport: Arc<dyn Transport>,
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
async fn inbox_mode(
    name: &'static str,
    target: &Target,
    store: &PostgresStore,
    args: &Args,
    batch: Option<Batching>,
    copies: bool,
) -> Result<Measured, Error> {
    let run = run_name("inbox");
    let (source, total) = prepare(target, &run, args.messages, copies).await?;
    let mut consumer = Consumer::new(
        ConsumerName::new(run.clone())?,
        source,
        Arc::clone(&target.transport),
        store.clone(),
        BenchHandler { run: run.clone() },
    )
    .concurrency(args.concurrency);
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
        messages: total as usize,
        seconds,
        doubles: Some(doubles(store.pool(), &run).await?),
    })
}

/// Consumes with `work` per delivery, `concurrency` at a time, then acks; no inbox engine.
async fn hand_rolled<F, Fut>(
    name: &'static str,
    target: &Target,
    args: &Args,
    copies: bool,
    pool: &PgPool,
    work: F,
) -> Result<Measured, Error>
where
    F: Fn(String, String) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<(), sqlx::Error>> + Send,
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
    let consume = tokio::spawn({
        let (run, acked) = (run.clone(), Arc::clone(&acked));
        async move {
            let mut tasks = tokio::task::JoinSet::new();
            while let Some(delivery) = stream.next().await {
                let permit = Arc::clone(&permits).acquire_owned().await?;
                let delivery = delivery?;
                let id = delivery
                    .broker_message_id()
                    .or_else(|| delivery.headers().get(inbox::DEFAULT_ID_HEADER))
                    .map(|id| String::from_utf8_lossy(id).into_owned())
                    .unwrap_or_default();
                let (work, run, acked) = (Arc::clone(&work), run.clone(), Arc::clone(&acked));
                tasks.spawn(async move {
                    let result = work(run, id).await;
                    if result.is_ok() {
                        // The baseline has no engine to hand it a proof of commit.
                        let _ = delivery.ack(AckToken::for_transport_tests()).await;
                        acked.fetch_add(1, Ordering::SeqCst);
                    }
                    drop(permit);
                    result
                });
                while let Some(done) = tasks.try_join_next() {
                    done??;
                }
            }
            Ok::<(), Error>(())
        }
    });
    let seconds = tokio::select! {
        seconds = clock(total, || acked.load(Ordering::SeqCst)) => seconds?,
        stopped = consume => return Err(format!("{name}: the consumer stopped: {stopped:?}").into()),
    };
    Ok(Measured {
        name,
        messages: total as usize,
        seconds,
        doubles: Some(doubles(pool, &run).await?),
    })
}

/// The business write alone: BEGIN, insert, COMMIT, ack.
async fn no_inbox(target: &Target, args: &Args, pool: &PgPool) -> Result<Measured, Error> {
    let p = pool.clone();
    hand_rolled("no inbox", target, args, false, pool, move |run, id| {
        let pool = p.clone();
        async move {
            let mut tx = pool.begin().await?;
            business_write(&mut tx, &run, &id).await?;
            tx.commit().await
        }
    })
    .await
}

/// The seed article's algorithm: look the id up; if unseen, handle and insert it.
async fn naive(
    name: &'static str,
    target: &Target,
    args: &Args,
    copies: bool,
    pool: &PgPool,
) -> Result<Measured, Error> {
    let p = pool.clone();
    hand_rolled(name, target, args, copies, pool, move |run, id| {
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
    })
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
        messages: total as usize,
        seconds: first.map_or(1e-3, |f| f.elapsed().as_secs_f64().max(1e-3)),
        doubles: None,
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
        messages: (tps * args.pgbench_seconds as f64) as usize,
        seconds: args.pgbench_seconds as f64,
        doubles: None,
    })
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

/// Peak resident memory of this process, from /proc.
fn peak_rss_mib() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024.0)
}

fn main() -> Result<(), Error> {
    let args = Args::parse();
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(bench(args))
}

fn targets(which: Which) -> Result<Vec<Target>, Error> {
    let mut targets = Vec::new();
    if matches!(which, Which::Memory | Which::All) {
        targets.push(Target {
            name: "memory",
            transport: Arc::new(MemoryBroker::new()),
        });
    }
    if matches!(which, Which::Rabbitmq | Which::All) {
        let url = std::env::var("AMQP_URL")
            .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned());
        targets.push(Target {
            name: "rabbitmq",
            transport: Arc::new(inbox::rabbitmq::RabbitMqTransport::new(
                url,
                Default::default(),
            )),
        });
    }
    if matches!(which, Which::Kafka | Which::All) {
        let brokers =
            std::env::var("KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".to_owned());
        targets.push(Target {
            name: "kafka",
            transport: Arc::new(inbox::kafka::KafkaTransport::new(
                inbox::kafka::KafkaConfig::new(brokers),
            )?),
        });
    }
    Ok(targets)
}

async fn bench(args: Args) -> Result<(), Error> {
    let url = fresh_database(&args.database).await?;
    let store = PostgresStore::connect(&url, (args.concurrency + 2) as u32).await?;
    store.migrate().await?;
    let pool = store.pool().clone();
    for ddl in [
        "CREATE TABLE bench_effects (run text NOT NULL, message_id text NOT NULL, payload text NOT NULL)",
        "CREATE INDEX ON bench_effects (run, message_id)",
        "CREATE TABLE naive_processed (consumer text NOT NULL, message_id text NOT NULL, PRIMARY KEY (consumer, message_id))",
    ] {
        pool.execute(ddl).await?;
    }
    println!(
        "inbox throughput: {} messages per mode, {} in flight, PostgreSQL",
        args.messages, args.concurrency
    );
    let ceiling = pgbench(&args, &url).await?;
    println!(
        "pgbench, the inbox's transaction shape, {} clients: {:.0} tx/s",
        args.concurrency,
        ceiling.rate()
    );
    for target in targets(args.transport)? {
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
        let plain = no_inbox(t, &args, &pool).await?;
        let naive_rate = naive("naive check-then-insert", t, &args, false, &pool).await?;
        let inbox_copies =
            inbox_mode("inbox, copies at once", t, &store, &args, None, true).await?;
        let naive_copies = naive("naive, copies at once", t, &args, true, &pool).await?;

        println!();
        println!("== {} ==", t.name);
        println!("{:<28}{:>12}{:>16}", "mode", "msgs/s", "double effects");
        for m in [
            &per_message,
            &batched,
            &plain,
            &naive_rate,
            &inbox_copies,
            &naive_copies,
            &ceiling,
            &raw,
        ] {
            let doubles = m.doubles.map_or("-".to_owned(), |d| d.to_string());
            println!("{:<28}{:>12.0}{:>16}", m.name, m.rate(), doubles);
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
            "inbox per message / naive",
            ratio(&per_message, &naive_rate),
            1.2,
        );
        println!(
            "double effects with copies at once: inbox {}, naive {}",
            inbox_copies.doubles.unwrap_or(0),
            naive_copies.doubles.unwrap_or(0)
        );
    }
    if let Some(rss) = peak_rss_mib() {
        println!("\npeak RSS of the bench process: {rss:.0} MiB");
    }
    Ok(())
}
