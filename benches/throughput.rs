//! What the inbox costs, measured side by side in one run (issue 6) — so far on the in-memory
//! transport against PostgreSQL (`DATABASE_URL`):
//!
//! - inbox per message, and in batch mode;
//! - the same consumer with no inbox (business write + commit + ack);
//! - the naive algorithm (look the id up, then handle and insert it), for throughput and for
//!   double effects under concurrent duplicates;
//! - the ceilings: `pgbench` running the inbox's transaction shape (claim + business insert +
//!   commit) at the same concurrency, and the broker's raw consume+ack rate.
//!
//! `cargo bench --bench throughput --all-features -- [--messages N] [--concurrency C]`
//!
//! Ratios are what to read: the machine is shared and noisy, absolute rates are context only.

use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use futures::StreamExt;
use inbox::memory::{Faults, MemoryBroker};
use inbox::{
    AckToken, Batching, CancellationToken, Consumer, ConsumerName, Handler, HandlerError,
    InboxStore, Message, OutgoingMessage, PgTx, PostgresStore, Subscription, Transport,
    async_trait,
};
use sqlx::{Connection, Executor, PgPool};
use tokio::sync::Semaphore;

#[derive(Parser)]
#[command(about = "Inbox throughput against PostgreSQL, beside its baselines")]
struct Args {
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

const TOPIC: &str = "bench";

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

async fn publish(broker: &MemoryBroker, topic: &str, group: &str, n: usize) {
    broker.declare_group(topic, group);
    for i in 0..n {
        broker
            .publish(
                topic,
                OutgoingMessage::new(format!("{group}-{i}"), format!(r#"{{"n":{i}}}"#)),
            )
            .await
            .expect("publish");
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

/// The inbox consumer, per message or batched.
async fn inbox_mode(
    name: &'static str,
    store: &PostgresStore,
    args: &Args,
    batch: Option<Batching>,
    faults: Faults,
) -> Result<Measured, Error> {
    let run = format!("{name}-{}", uuid::Uuid::new_v4().simple());
    let broker = MemoryBroker::with_faults(faults);
    publish(&broker, TOPIC, &run, args.messages).await;
    let transport: Arc<dyn Transport> = Arc::new(broker.clone());
    let mut consumer = Consumer::new(
        ConsumerName::new(run.clone())?,
        TOPIC,
        transport,
        store.clone(),
        BenchHandler { run: run.clone() },
    )
    .concurrency(args.concurrency);
    if let Some(batch) = batch {
        consumer = consumer.batch(batch);
    }
    let token = CancellationToken::new();
    let started = Instant::now();
    let mut running = {
        let (consumer, token) = (consumer.clone(), token.clone());
        tokio::spawn(async move { consumer.run(token).await })
    };
    let groups = [run.as_str()];
    tokio::select! {
        settled = broker.wait_settled(TOPIC, &groups, Duration::from_secs(600)) => settled?,
        stopped = &mut running => return Err(format!("{name}: the consumer stopped: {stopped:?}").into()),
    }
    let seconds = started.elapsed().as_secs_f64();
    token.cancel();
    running.await??;
    Ok(Measured {
        name,
        messages: args.messages,
        seconds,
        doubles: Some(doubles(store.pool(), &run).await?),
    })
}

/// Consumes with `work` per delivery, `concurrency` at a time, then acks; no inbox engine.
async fn hand_rolled<F, Fut>(
    name: &'static str,
    args: &Args,
    faults: Faults,
    pool: &PgPool,
    work: F,
) -> Result<Measured, Error>
where
    F: Fn(String, String) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<(), sqlx::Error>> + Send,
{
    let run = format!("{name}-{}", uuid::Uuid::new_v4().simple());
    let broker = MemoryBroker::with_faults(faults);
    publish(&broker, TOPIC, &run, args.messages).await;
    let subscription = Subscription::new(TOPIC, ConsumerName::new(run.clone())?, 1024);
    let mut stream = broker.subscribe(&subscription).await?;
    let permits = Arc::new(Semaphore::new(args.concurrency));
    let work = Arc::new(work);
    let started = Instant::now();
    let waiter = {
        let (broker, run) = (broker.clone(), run.clone());
        tokio::spawn(async move {
            broker
                .wait_settled(TOPIC, &[&run], Duration::from_secs(600))
                .await
        })
    };
    let consume = tokio::spawn({
        let run = run.clone();
        async move {
            let mut tasks = tokio::task::JoinSet::new();
            while let Some(delivery) = stream.next().await {
                let permit = Arc::clone(&permits).acquire_owned().await?;
                let delivery = delivery?;
                let id = String::from_utf8_lossy(delivery.broker_message_id().unwrap_or_default())
                    .into_owned();
                let (work, run) = (Arc::clone(&work), run.clone());
                tasks.spawn(async move {
                    let result = work(run, id).await;
                    if result.is_ok() {
                        // The baseline has no engine to hand it a proof of commit.
                        let _ = delivery.ack(AckToken::for_transport_tests()).await;
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
    // Settled: every delivery acked, so the workers are done; the consuming loop never ends on
    // its own (the stream waits for more).
    let settled = tokio::select! {
        settled = waiter => settled?,
        stopped = consume => return Err(format!("{name}: the consumer stopped: {stopped:?}").into()),
    };
    settled?;
    Ok(Measured {
        name,
        messages: args.messages,
        seconds: started.elapsed().as_secs_f64(),
        doubles: Some(doubles(pool, &run).await?),
    })
}

/// The business write alone: BEGIN, insert, COMMIT, ack.
async fn no_inbox(args: &Args, pool: &PgPool) -> Result<Measured, Error> {
    let p = pool.clone();
    hand_rolled("no inbox", args, Faults::none(), pool, move |run, id| {
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
    args: &Args,
    faults: Faults,
    pool: &PgPool,
) -> Result<Measured, Error> {
    let p = pool.clone();
    hand_rolled(name, args, faults, pool, move |run, id| {
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
async fn raw_broker(args: &Args) -> Result<Measured, Error> {
    let run = format!("raw-{}", uuid::Uuid::new_v4().simple());
    let broker = MemoryBroker::new();
    publish(&broker, TOPIC, &run, args.messages).await;
    let subscription = Subscription::new(TOPIC, ConsumerName::new(run.clone())?, 1024);
    let mut stream = broker.subscribe(&subscription).await?;
    let started = Instant::now();
    for _ in 0..args.messages {
        let delivery = stream.next().await.expect("a delivery")?;
        delivery.ack(AckToken::for_transport_tests()).await?;
    }
    Ok(Measured {
        name: "broker consume+ack",
        messages: args.messages,
        seconds: started.elapsed().as_secs_f64(),
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
        "inbox throughput: {} messages per mode, {} in flight, memory transport, PostgreSQL",
        args.messages, args.concurrency
    );
    // Concurrent copies of every message (as after a lost ack, or a second instance).
    let copies = || Faults::seeded(7).concurrent_copy(1.0).max_per_message(1);
    let raw = raw_broker(&args).await?;
    let per_message = inbox_mode("inbox per message", &store, &args, None, Faults::none()).await?;
    let batched = inbox_mode(
        "inbox batch (100, 5 ms)",
        &store,
        &args,
        Some(Batching::new(100, Duration::from_millis(5))),
        Faults::none(),
    )
    .await?;
    let plain = no_inbox(&args, &pool).await?;
    let naive_rate = naive("naive check-then-insert", &args, Faults::none(), &pool).await?;
    let naive_copies = naive("naive, concurrent copies", &args, copies(), &pool).await?;
    let inbox_copies =
        inbox_mode("inbox, concurrent copies", &store, &args, None, copies()).await?;
    let ceiling = pgbench(&args, &url).await?;

    println!();
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
    println!();
    let ratio = |a: &Measured, b: &Measured| a.rate() / b.rate();
    let line = |what: &str, value: f64, target: f64| {
        let verdict = if value >= target { "met" } else { "NOT met" };
        println!("{what:<40}{value:>8.2}   target >= {target:<6} {verdict}");
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
        "double effects under concurrent copies: inbox {}, naive {}",
        inbox_copies.doubles.unwrap_or(0),
        naive_copies.doubles.unwrap_or(0)
    );
    if let Some(rss) = peak_rss_mib() {
        println!("peak RSS of the bench process: {rss:.0} MiB");
    }
    Ok(())
}
