//! Retention cleanup on PostgreSQL (`DATABASE_URL`): bounded batches, one instance at a time,
//! the retention window, dead rows kept; and a million rows cleaned while a consumer runs, with
//! the consumer's claim latency measured before and during the cleanup.

use inbox_test_kit as conformance;

use std::sync::Arc;
use std::time::{Duration, Instant};

use conformance::eventually;
use conformance::metrics::{claim_latencies, snapshotter};
use conformance::stores::Postgres;
use inbox::memory::MemoryBroker;
use inbox::transport::Subscription;
use inbox::{
    CancellationToken, Cleanup, Consumer, ConsumerName, Handler, HandlerError, InboxAdmin, Message,
    OutgoingMessage, PgTx, PostgresStore, Transport, async_trait,
};
use sqlx::{Connection, Executor};

const DAY: Duration = Duration::from_secs(86_400);
/// The PostgreSQL store's cleanup lock ("inbox" + 2).
const CLEANUP_LOCK: i64 = 0x696e_626f_7800_0002;

async fn fresh() -> (String, PostgresStore) {
    let url = Postgres::fresh_url().await;
    let store = PostgresStore::connect(&url, 8).await.unwrap();
    store.migrate().await.unwrap();
    (url, store)
}

async fn rows(store: &PostgresStore, filter: &str) -> i64 {
    sqlx::query_scalar(&format!(
        "SELECT count(*) FROM inbox_messages WHERE {filter}"
    ))
    .fetch_one(store.pool())
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cleanup_deletes_old_processed_rows_in_batches_one_instance_at_a_time() {
    let (url, store) = fresh().await;
    for sql in [
        "INSERT INTO inbox_messages (consumer, message_id, received_at, processed_at)
         SELECT 'c', 'old-' || g, now() - interval '30 days', now() - interval '30 days'
         FROM generate_series(1, 1050) g",
        "INSERT INTO inbox_messages (consumer, message_id, processed_at)
         SELECT 'c', 'new-' || g, now() - interval '6 days' FROM generate_series(1, 5) g",
        "INSERT INTO inbox_messages (consumer, message_id, received_at, attempts, dead_lettered_at)
         SELECT 'c', 'dead-' || g, now() - interval '90 days', 5, now() - interval '90 days'
         FROM generate_series(1, 3) g",
        "INSERT INTO inbox_messages (consumer, message_id, received_at, attempts)
         SELECT 'c', 'failing-' || g, now() - interval '90 days', 2 FROM generate_series(1, 2) g",
    ] {
        store.pool().execute(sql).await.unwrap();
    }
    assert_eq!(
        store.count_expired(7 * DAY).await.unwrap(),
        1050,
        "what a cleanup would delete"
    );
    let cleanup = Cleanup::new(store.clone(), 7 * DAY).batch_size(100);

    // Another instance cleaning up: this one does nothing and says so.
    let mut other = sqlx::PgConnection::connect(&url).await.unwrap();
    sqlx::query("SELECT pg_advisory_lock($1)")
        .bind(CLEANUP_LOCK)
        .execute(&mut other)
        .await
        .unwrap();
    let skipped = cleanup.run_once().await.unwrap();
    assert!(
        skipped.skipped_locked && skipped.deleted == 0,
        "{skipped:?}"
    );
    sqlx::query("SELECT pg_advisory_unlock($1)")
        .bind(CLEANUP_LOCK)
        .execute(&mut other)
        .await
        .unwrap();

    // A pass cancelled after its first batch (a shutdown) must not leave the lock held by a
    // pooled connection, or every later pass would be skipped.
    let (first_batch, mut done) = tokio::sync::watch::channel(0u64);
    let progress = move |n| {
        let _ = first_batch.send(n);
    };
    tokio::select! {
        _ = cleanup.run_once_with_progress(&progress) => {
            panic!("cancelled after the first batch, it cannot finish")
        }
        _ = done.wait_for(|n| *n > 0) => {}
    }
    eventually("the lock is free again", || async {
        let mut probe = sqlx::PgConnection::connect(&url).await.unwrap();
        let free: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
            .bind(CLEANUP_LOCK)
            .fetch_one(&mut probe)
            .await
            .unwrap();
        if free {
            sqlx::query("SELECT pg_advisory_unlock($1)")
                .bind(CLEANUP_LOCK)
                .execute(&mut probe)
                .await
                .unwrap();
            Ok(())
        } else {
            Err("still held".to_owned())
        }
    })
    .await;

    // Two instances at once: one deletes, the other is skipped or finds less; nothing is
    // deleted twice, nothing fails.
    let left = rows(&store, "message_id LIKE 'old-%'").await as u64;
    assert!((1..1050).contains(&left), "cancelled mid-way: {left} left");
    let twin = cleanup.clone();
    let (a, b) = tokio::join!(cleanup.run_once(), twin.run_once());
    let (a, b) = (a.unwrap(), b.unwrap());
    assert_eq!(a.deleted + b.deleted, left, "{a:?} {b:?}");
    let working = if a.skipped_locked { &b } else { &a };
    assert!(
        working.batches >= left / 100,
        "batches of at most 100 rows: {working:?}"
    );

    assert_eq!(rows(&store, "message_id LIKE 'old-%'").await, 0);
    assert_eq!(
        rows(&store, "message_id LIKE 'new-%'").await,
        5,
        "inside the retention"
    );
    assert_eq!(
        rows(&store, "message_id LIKE 'dead-%'").await,
        3,
        "dead rows are kept"
    );
    assert_eq!(
        rows(&store, "message_id LIKE 'failing-%'").await,
        2,
        "unfinished rows are kept"
    );

    // The cleanup's session settings do not outlive it: a pool of one connection gets it back
    // as it was (its batches commit without waiting for the disk; the application's must not).
    let single = PostgresStore::connect(&url, 1).await.unwrap();
    let report = Cleanup::new(single.clone(), 7 * DAY)
        .run_once()
        .await
        .unwrap();
    assert!(!report.skipped_locked, "{report:?}");
    let setting: String = sqlx::query_scalar("SHOW synchronous_commit")
        .fetch_one(single.pool())
        .await
        .unwrap();
    assert_eq!(setting, "on");
}

fn summary(values: &[Duration]) -> String {
    let at = |p: f64| values[((values.len() - 1) as f64 * p).round() as usize].as_secs_f64() * 1e3;
    format!(
        "{} claims, p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
        values.len(),
        at(0.5),
        at(0.99),
        at(1.0)
    )
}

struct Nothing;

#[async_trait]
impl Handler<PgTx> for Nothing {
    async fn handle(&self, _: &Message<'_>, _: &mut PgTx) -> Result<(), HandlerError> {
        Ok(())
    }
}

/// Publishes `n` messages numbered from `from`, then waits until the consumer processed them.
async fn feed(
    broker: &MemoryBroker,
    source: &str,
    from: usize,
    n: usize,
    processed: impl Fn() -> u64,
) {
    for i in from..from + n {
        broker
            .publish(source, OutgoingMessage::new(format!("m-{i}"), "{}"))
            .await
            .unwrap();
    }
    eventually("the messages processed", || async {
        let done = processed();
        if done >= (from + n) as u64 {
            Ok(())
        } else {
            Err(format!("{done} of {}", from + n))
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_million_rows_cleaned_while_a_consumer_runs() {
    conformance::init_tracing();
    let _ = snapshotter();
    let (_, store) = fresh().await;
    let started = Instant::now();
    store
        .pool()
        .execute(
            "INSERT INTO inbox_messages (consumer, message_id, received_at, processed_at)
             SELECT 'history', 'h-' || g, now() - interval '30 days', now() - interval '30 days'
             FROM generate_series(1, 1000000) g",
        )
        .await
        .unwrap();
    eprintln!(
        "1M old rows written in {:.1} s",
        started.elapsed().as_secs_f64()
    );

    let broker = MemoryBroker::new();
    let source = "operating";
    let name = ConsumerName::new("live").unwrap();
    broker
        .declare(&Subscription::new(source, name.clone(), 1))
        .await
        .unwrap();
    let consumer = Consumer::new(
        name,
        source,
        Arc::new(broker.clone()) as Arc<dyn Transport>,
        store.clone(),
        Nothing,
    )
    .concurrency(4);
    let token = CancellationToken::new();
    let running = {
        let (consumer, token) = (consumer.clone(), token.clone());
        tokio::spawn(async move { consumer.run(token).await })
    };
    let processed = || consumer.report().processed;

    // Before: the claim latency of this machine now.
    feed(&broker, source, 0, 2000, processed).await;
    let before = claim_latencies("live");

    // During: messages keep coming, 200 at a time, until the cleanup is done.
    // Unpaced: the test is that batches with SKIP LOCKED never block a claim; what pacing
    // does for the claims' latency is the benchmark's `cleanup_during` mode.
    let cleanup = Cleanup::new(store.clone(), 7 * DAY)
        .batch_size(10_000)
        .unpaced();
    let started = Instant::now();
    let mut pass = tokio::spawn(async move { cleanup.run_once().await });
    let mut next = 2000;
    let report = loop {
        tokio::select! {
            report = &mut pass => break report.unwrap().unwrap(),
            () = feed(&broker, source, next, 200, processed) => next += 200,
        }
    };
    let took = started.elapsed();
    // What the cancelled feed had published is processed too.
    eventually("the rest processed", || async {
        let published = broker.stats().published;
        if processed() >= published {
            Ok(())
        } else {
            Err(format!("{} of {published}", processed()))
        }
    })
    .await;
    let during = claim_latencies("live");
    token.cancel();
    running.await.unwrap().unwrap();

    assert_eq!(report.deleted, 1_000_000, "{report:?}");
    assert_eq!(
        report.batches, 101,
        "10 000 rows per batch, and the empty last one"
    );
    assert_eq!(rows(&store, "consumer = 'history'").await, 0);
    let r = consumer.report();
    assert_eq!(
        (r.processed, r.duplicates_discarded),
        (broker.stats().published, 0)
    );
    eprintln!(
        "cleanup of {} rows in {} batches took {:.1} s; claim latency before: {}; during: {}",
        report.deleted,
        report.batches,
        took.as_secs_f64(),
        summary(&before),
        summary(&during)
    );
    assert!(
        during.len() >= 200,
        "claims ran during the cleanup: {}",
        during.len()
    );
    // Bounded, not timed: a cleanup that blocked claims (one huge DELETE behind a lock, a table
    // lock) holds them for its whole length, seconds here; batches with SKIP LOCKED never do.
    let max = during.last().copied().unwrap_or_default();
    assert!(
        max < Duration::from_secs(2),
        "a claim waited {max:?} during the cleanup: {}",
        summary(&during)
    );
}
