//! The conformance suite on the in-memory transport, against SQLite and PostgreSQL.

use inbox_test_kit::{self as conformance, conformance_suite};

use conformance::memory::Memory;

conformance_suite!(memory_sqlite, Memory, async { conformance::stores::Sqlite });
conformance_suite!(memory_postgres, Memory, async {
    conformance::stores::Postgres
});
// Batch mode: one claim statement and one transaction per batch, a savepoint per message.
conformance_suite!(
    memory_sqlite_batched,
    Memory,
    async { conformance::stores::Sqlite },
    batched = true
);
// Batch mode with a batch handler: each batch handled in one call, failures isolated by
// splitting the batch.
conformance_suite!(
    memory_sqlite_whole_batches,
    Memory,
    async { conformance::stores::Sqlite },
    whole_batches
);
conformance_suite!(
    memory_postgres_batched,
    Memory,
    async { conformance::stores::Postgres },
    batched = true
);
// Batch mode with a batch handler: each batch handled in one call, failures isolated by
// splitting the batch.
conformance_suite!(
    memory_postgres_whole_batches,
    Memory,
    async { conformance::stores::Postgres },
    whole_batches
);
conformance::outbox_suite!(outbox_memory_sqlite, Memory, async {
    conformance::stores::Sqlite
});
conformance::outbox_suite!(outbox_memory_postgres, Memory, async {
    conformance::stores::Postgres
});

/// PostgreSQL's row lock in action: a concurrent claim of the same message waits for the first
/// transaction instead of failing, then sees its outcome.
mod postgres_claims {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    use inbox::memory::Faults;
    use inbox::store::Claim;
    use inbox::{ConsumerName, InboxStore, MessageId, PostgresStore};

    use crate::conformance::memory::Memory;
    use crate::conformance::stores::Postgres;
    use crate::conformance::{Running, Scenario, Script, TestDb, eventually};

    /// Backends of this store's database waiting on a lock.
    async fn lock_waiters(store: &PostgresStore) -> i64 {
        sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity
             WHERE datname = current_database() AND wait_event_type = 'Lock'",
        )
        .fetch_one(store.pool())
        .await
        .unwrap()
    }

    async fn second_claim_waits_then_sees(commit_first: bool) -> Claim {
        second_claim_on(Postgres.store().await, commit_first).await
    }

    async fn second_claim_on(store: PostgresStore, commit_first: bool) -> Claim {
        let consumer = ConsumerName::new("claims").unwrap();
        let id = MessageId::new("m-1").unwrap();
        let mut first = store.begin().await.unwrap();
        assert!(matches!(
            store.claim(&mut first, &consumer, &id).await.unwrap(),
            Claim::Claimed { .. }
        ));

        let second = tokio::spawn({
            let (store, consumer, id) = (store.clone(), consumer.clone(), id.clone());
            async move {
                let mut tx = store.begin().await.unwrap();
                let claim = store.claim(&mut tx, &consumer, &id).await.unwrap();
                store.rollback(tx).await.unwrap();
                claim
            }
        });
        eventually("the second claim blocks on the row lock", || async {
            match lock_waiters(&store).await {
                0 => Err("no backend waits on a lock yet".to_owned()),
                _ => Ok(()),
            }
        })
        .await;
        assert!(
            !second.is_finished(),
            "the second claim must wait, not fail or pass"
        );
        if commit_first {
            store.commit(first).await.unwrap();
        } else {
            store.rollback(first).await.unwrap();
        }
        second.await.unwrap()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_concurrent_claim_waits_and_then_sees_the_commit() {
        assert_eq!(second_claim_waits_then_sees(true).await, Claim::Done);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_concurrent_claim_waits_and_then_takes_over_after_a_rollback() {
        assert_eq!(
            second_claim_waits_then_sees(false).await,
            Claim::Claimed {
                attempts: 0,
                last_error: None
            }
        );
    }

    /// The claim sets READ COMMITTED itself: on a server (or a pool the application hands in)
    /// whose default is SERIALIZABLE, the copy that waited sees the message done instead of
    /// failing with a serialization error.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_claim_does_not_depend_on_the_default_isolation() {
        let url = Postgres.store().await;
        let url = Postgres::url_of(&url).await;
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(4)
            .after_connect(|conn, _| {
                Box::pin(async move {
                    sqlx::Executor::execute(
                        conn,
                        "SET default_transaction_isolation = 'serializable'",
                    )
                    .await
                    .map(drop)
                })
            })
            .connect(&url)
            .await
            .unwrap();
        let store = PostgresStore::new(pool);
        assert_eq!(second_claim_on(store, true).await, Claim::Done);
    }

    /// Two instances get the same message at the same moment; the one that claims first holds
    /// its handler until the other is seen waiting on the row lock. One effect, one duplicate
    /// discarded, no failure.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn two_instances_one_message_one_effect_and_the_second_waits() {
        let db = Arc::new(Postgres);
        let faults = Faults::seeded(1).concurrent_copy(1.0);
        let s = Scenario::new(&Memory, &db, faults).await;
        let name = s.name("twins");
        s.broker.prepare(&s.source, &[&name]).await;
        let saw_waiter = Arc::new(AtomicBool::new(false));
        let script = Arc::new(Script {
            hook: Some({
                let (store, saw_waiter) = (s.store.clone(), Arc::clone(&saw_waiter));
                Arc::new(move |_, _| {
                    let (store, saw_waiter) = (store.clone(), Arc::clone(&saw_waiter));
                    Box::pin(async move {
                        eventually("the other instance waits on the row lock", || async {
                            if lock_waiters(&store).await > 0 {
                                Ok(())
                            } else {
                                Err("no waiter".into())
                            }
                        })
                        .await;
                        saw_waiter.store(true, Ordering::SeqCst);
                        Ok(())
                    })
                })
            }),
            ..Script::default()
        });
        let consumer = s.consumer(&name, &script).concurrency(1).prefetch(1);
        let running = Running::start(&consumer, 2);
        let id = s.id(0);
        s.publish(&id, 0).await;
        s.wait_for(&[&name], 1).await;
        eventually("both copies settled", || async {
            let r = consumer.report();
            if r.processed + r.duplicates_discarded == 2 {
                Ok(())
            } else {
                Err(format!("{r:?}"))
            }
        })
        .await;
        running.stop().await;
        s.assert_exactly_once(&[&name], &[id]).await;
        let report = consumer.report();
        assert!(saw_waiter.load(Ordering::SeqCst));
        assert_eq!(
            (report.processed, report.duplicates_discarded, report.failed),
            (1, 1, 0),
            "{report:?}"
        );
    }
}

/// SQLite commits are on disk before the ack: `synchronous = FULL` (2), not WAL's usual NORMAL,
/// under which a power loss can undo an acked commit.
#[tokio::test]
async fn sqlite_commits_are_durable_before_the_ack() {
    let path =
        std::env::temp_dir().join(format!("inbox-sync-{}.db", uuid::Uuid::new_v4().simple()));
    let store = inbox::SqliteStore::connect(&format!("sqlite:{}", path.display()))
        .await
        .unwrap();
    let level: i64 = sqlx::query_scalar("PRAGMA synchronous")
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(level, 2, "PRAGMA synchronous");
    std::fs::remove_file(&path).ok();
}

/// Processes that start at once on a new SQLite file all migrate it: each waits for the write
/// lock instead of finding a migration pending that another is applying (and failing on it).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_migrations_from_many_processes_at_once() {
    use inbox::InboxAdmin;
    for round in 0..5 {
        let path = std::env::temp_dir().join(format!(
            "inbox-migrate-{}.db",
            uuid::Uuid::new_v4().simple()
        ));
        let url = format!("sqlite:{}", path.display());
        // Separate stores: separate connections, as separate processes would have.
        let mut stores = Vec::new();
        for _ in 0..6 {
            stores.push(inbox::SqliteStore::connect(&url).await.unwrap());
        }
        let results = futures::future::join_all(stores.iter().map(|s| s.migrate())).await;
        for result in results {
            result.unwrap_or_else(|e| panic!("round {round}: {e}"));
        }
        let applied: i64 = sqlx::query_scalar("SELECT count(*) FROM inbox_schema_migrations")
            .fetch_one(stores[0].pool())
            .await
            .unwrap();
        assert_eq!(applied as usize, inbox_migrations_count(), "round {round}");
        std::fs::remove_file(&path).ok();
    }
}

/// Our SQLite migrations.
fn inbox_migrations_count() -> usize {
    std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/migrations/sqlite"))
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .is_ok_and(|e| e.path().extension().is_some_and(|x| x == "sql"))
        })
        .count()
}

/// Batch mode really batches: 200 waiting messages take a handful of transactions, not 200.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn batch_mode_uses_one_transaction_per_batch() {
    use std::sync::Arc;
    use std::time::Duration;

    use conformance::flaky::FlakyStore;
    use conformance::stores::Postgres;
    use conformance::{Scenario, Script};
    use inbox::memory::Faults;
    use inbox::{Batching, CancellationToken, Consumer};

    conformance::init_tracing();
    let db = Arc::new(Postgres);
    let s = Scenario::new(&Memory, &db, Faults::none()).await;
    let name = s.name("batches");
    s.broker.prepare(&s.source, &[&name]).await;
    let ids: Vec<String> = (0..200).map(|i| s.id(i)).collect();
    for (i, id) in ids.iter().enumerate() {
        s.publish(id, i).await;
    }
    let store = FlakyStore::new(s.store.clone());
    let consumer = Consumer::new(
        name.clone(),
        s.source.clone(),
        s.broker.transport(),
        store.clone(),
        s.handler(&Arc::new(Script::default())),
    )
    .concurrency(2)
    .batch(Batching::new(50, Duration::from_millis(20)));
    let token = CancellationToken::new();
    let running = {
        let (consumer, token) = (consumer.clone(), token.clone());
        tokio::spawn(async move { consumer.run(token).await })
    };
    s.wait_for(&[&name], ids.len()).await;
    token.cancel();
    running.await.unwrap().unwrap();
    s.assert_exactly_once(&[&name], &ids).await;
    let begun = store.begun();
    println!("200 messages in {begun} transactions");
    assert_eq!(
        consumer.report().batch_fallbacks,
        0,
        "{:?}",
        consumer.report()
    );
    assert!(
        begun <= 12,
        "{begun} transactions for 200 messages in batches of 50"
    );
}

/// `handler_timeout` abandons a handler stuck in the database, but the rollback after it would
/// wait for the statement it left running — here a lock wait that never ends. With the store's
/// statement timeout the statement is cancelled, the attempt fails, and the message goes the
/// failure way (dead-lettered after its attempts) while the lock is still held; the other
/// messages are handled meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_statement_stuck_on_a_lock_is_cancelled() {
    use std::sync::Arc;
    use std::time::Duration;

    use async_trait::async_trait;
    use conformance::stores::Postgres;
    use conformance::{Running, Scenario, TestDb};
    use inbox::memory::Faults;
    use inbox::{Consumer, Handler, HandlerError, Message, PgTx, RetryPolicy};
    use sqlx::Executor;

    struct Locking;

    #[async_trait]
    impl Handler<PgTx> for Locking {
        async fn handle(&self, message: &Message<'_>, tx: &mut PgTx) -> Result<(), HandlerError> {
            if message.id.as_str().ends_with("-locked") {
                sqlx::query("SELECT id FROM test_locks WHERE id = 1 FOR UPDATE")
                    .execute(&mut **tx)
                    .await?;
            }
            sqlx::query("INSERT INTO test_done (id) VALUES ($1)")
                .bind(message.id.as_str())
                .execute(&mut **tx)
                .await?;
            Ok(())
        }
    }

    conformance::init_tracing();
    let db = Arc::new(Postgres);
    let s = Scenario::new(&Memory, &db, Faults::none()).await;
    let pool = s.store.pool().clone();
    pool.execute("CREATE TABLE test_locks (id int PRIMARY KEY); INSERT INTO test_locks VALUES (1); CREATE TABLE test_done (id text PRIMARY KEY)")
        .await
        .unwrap();
    // Held until the end of the test.
    let mut holder = pool.begin().await.unwrap();
    sqlx::query("SELECT id FROM test_locks WHERE id = 1 FOR UPDATE")
        .execute(&mut *holder)
        .await
        .unwrap();

    let name = s.name("locked");
    s.broker.prepare(&s.source, &[&name]).await;
    let store = s
        .store
        .clone()
        .with_statement_timeout(Duration::from_millis(500));
    let consumer = Consumer::new(
        name.clone(),
        s.source.clone(),
        s.broker.transport(),
        store,
        Locking,
    )
    .handler_timeout(Duration::from_millis(200))
    .retry(
        RetryPolicy::default()
            .with_max_attempts(2)
            .with_delays(Duration::from_millis(5), Duration::from_millis(20)),
    );
    let locked = format!("{}-locked", s.run);
    s.publish(&locked, 0).await;
    let fine: Vec<String> = (0..5).map(|i| s.id(i)).collect();
    for (i, id) in fine.iter().enumerate() {
        s.publish(id, i).await;
    }
    let running = Running::start(&consumer, 1);
    s.dead_letters(1).await;
    conformance::eventually("the other messages handled", || async {
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM test_done")
            .fetch_one(&pool)
            .await
            .unwrap();
        if n == fine.len() as i64 {
            Ok(())
        } else {
            Err(format!("{n} handled"))
        }
    })
    .await;
    running.stop().await;
    let row = db.row(&s.store, &name, &locked).await.expect("a row");
    assert!(row.dead, "{row:?}");
    holder.rollback().await.unwrap();
}

/// A handler that never returns cannot keep `run` from returning after shutdown when a drain
/// timeout is set: its work is abandoned (rolled back, the delivery back to the broker) and the
/// next instance handles the message.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_hung_handler_is_abandoned_at_the_drain_timeout() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;

    use conformance::stores::Postgres;
    use conformance::{Running, Scenario, Script, eventually};
    use inbox::CancellationToken;
    use inbox::memory::Faults;

    let db = Arc::new(Postgres);
    let s = Scenario::new(&Memory, &db, Faults::none()).await;
    let name = s.name("hung");
    s.broker.prepare(&s.source, &[&name]).await;
    let (hang, entered) = (
        Arc::new(AtomicBool::new(true)),
        Arc::new(AtomicBool::new(false)),
    );
    let script = Arc::new(Script {
        hook: Some({
            let (hang, entered) = (Arc::clone(&hang), Arc::clone(&entered));
            Arc::new(move |_, _| {
                let hangs = hang.load(Ordering::SeqCst);
                entered.store(true, Ordering::SeqCst);
                Box::pin(async move {
                    if hangs {
                        std::future::pending::<()>().await;
                    }
                    Ok(())
                })
            })
        }),
        ..Script::default()
    });
    let consumer = s
        .consumer(&name, &script)
        .drain_timeout(Duration::from_millis(200));
    let id = s.id(0);
    s.publish(&id, 0).await;
    let token = CancellationToken::new();
    let run = {
        let (consumer, token) = (consumer.clone(), token.clone());
        tokio::spawn(async move { consumer.run(token).await })
    };
    eventually("the handler hangs", || async {
        if entered.load(Ordering::SeqCst) {
            Ok(())
        } else {
            Err("not yet".into())
        }
    })
    .await;
    token.cancel();
    tokio::time::timeout(conformance::DEADLINE, run)
        .await
        .expect("run returns despite the hung handler")
        .unwrap()
        .expect("a clean stop");
    hang.store(false, Ordering::SeqCst);
    let running = Running::start(&consumer, 1);
    s.wait_for(&[&name], 1).await;
    running.stop().await;
    s.assert_exactly_once(&[&name], &[id]).await;
}

/// A transaction begun and cancelled half-way — an aborted consumer task, a drain timeout, a
/// `select!` — leaves no transaction open on the connection the pool hands out next. (sqlx 0.8's
/// `Pool::begin` on PostgreSQL raises its depth only after the `BEGIN` round trip, so a future
/// dropped in between left the session inside a transaction nobody rolled back: the next
/// borrower's statements ran in it, uncommitted, holding their locks — the Kafka
/// `killed_and_restarted` stall, a claim waiting a minute for a lock taken by a bookkeeping
/// statement that never committed.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_begin_leaves_no_transaction_open() {
    use std::future::Future;
    use std::task::{Context, Poll};

    use conformance::stores::Postgres;
    use inbox::{InboxStore, PostgresStore};

    // One connection: the one a cancelled begin used is the one every later statement gets.
    let store = PostgresStore::connect(&Postgres::fresh_url().await, 1)
        .await
        .expect("connect PostgreSQL");
    let waker = futures::task::noop_waker();
    let mut cancelled_in_flight = 0;
    for round in 0..300u32 {
        let mut begin = Box::pin(store.begin());
        // Poll until the BEGIN is on its way, give the server a moment to answer (or not), and
        // drop the future there, as a cancellation would.
        let mut done = false;
        for _ in 0..(1 + round % 3) {
            if let Poll::Ready(tx) = begin.as_mut().poll(&mut Context::from_waker(&waker)) {
                drop(tx);
                done = true;
                break;
            }
            for _ in 0..(round % 7) {
                tokio::task::yield_now().await;
            }
        }
        if !done {
            cancelled_in_flight += 1;
        }
        drop(begin);
        assert!(
            outside_transaction(store.pool()).await,
            "round {round}: the pool handed out a connection inside a transaction left by a cancelled begin"
        );
    }
    assert!(cancelled_in_flight > 0, "no begin was cancelled in flight");
}

/// Whether the session the pool hands out next is outside any transaction: the transaction id of
/// a statement on its own is new each time; two statements inside one transaction share it.
/// (Pools of one connection: that session is the one the test left.)
async fn outside_transaction(pool: &sqlx::PgPool) -> bool {
    let mut conn = pool.acquire().await.expect("a connection");
    let xact = "SELECT txid_current()";
    let first: i64 = sqlx::query_scalar(xact)
        .fetch_one(&mut *conn)
        .await
        .expect("txid");
    let second: i64 = sqlx::query_scalar(xact)
        .fetch_one(&mut *conn)
        .await
        .expect("txid");
    first != second
}

/// The one-trip claim (`BEGIN` and claim in one round trip, ids quoted into the statement):
/// hostile ids are stored as they are and claim nothing else; a message seen before falls back
/// to the usual claim and leaves its session outside any transaction (one pooled connection,
/// so the next borrower gets that session); the transaction is READ COMMITTED even where the
/// database's default is not, with the statement timeout set; and without the migration's
/// function the store claims the usual way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_one_trip_claim_quotes_ids_and_falls_back_cleanly() {
    use std::time::Duration;

    conformance::init_tracing();
    use conformance::stores::Postgres;
    use inbox::store::Claim;
    use inbox::{ConsumerName, InboxAdmin, InboxStore, MessageId, PostgresStore};

    let url = Postgres::fresh_url().await;
    let admin = sqlx::PgPool::connect(&url).await.expect("connect");
    let db: String = sqlx::query_scalar("SELECT current_database()")
        .fetch_one(&admin)
        .await
        .unwrap();
    for setting in [
        "default_transaction_isolation = 'repeatable read'",
        // Backslashes in plain literals are escapes then: the quoting must hold either way.
        "standard_conforming_strings = off",
        // pg_stat_xact_user_functions then tells which way a claim went.
        "track_functions = 'pl'",
    ] {
        sqlx::query(&format!("ALTER DATABASE {db} SET {setting}"))
            .execute(&admin)
            .await
            .unwrap();
    }
    // Calls the session has not yet reported, this transaction's among them: at least one if
    // this transaction called the function (exact for the first claim, the session's first call).
    async fn one_trip(tx: &mut inbox::PgTx) -> bool {
        called(tx, "inbox_claim_new").await
    }
    async fn called(tx: &mut inbox::PgTx, function: &str) -> bool {
        let calls: i64 = sqlx::query_scalar(
            "SELECT coalesce(sum(calls), 0)::bigint FROM pg_stat_xact_user_functions WHERE funcname = $1",
        )
        .bind(function)
        .fetch_one(&mut **tx)
        .await
        .unwrap();
        calls >= 1
    }
    let store = PostgresStore::connect(&url, 1)
        .await
        .expect("connect PostgreSQL")
        .with_statement_timeout(Duration::from_millis(1500));
    store.migrate().await.expect("migrate");
    let consumer = ConsumerName::new("it's \\ a 'consumer'").unwrap();
    let ids = [
        "plain".to_owned(),
        "it's".to_owned(),
        "back\\slash\\".to_owned(),
        "'); DELETE FROM inbox_messages; --".to_owned(),
        "E'x' || '\\'".to_owned(),
        "$$ $q$ \"quoted\"".to_owned(),
        "ünïcødé € 😀".to_owned(),
        "x".repeat(255),
    ];
    for id in &ids {
        let message = MessageId::new(id.as_str()).unwrap();
        let (mut tx, claim) = store
            .begin_and_claim(&consumer, &message, true)
            .await
            .unwrap_or_else(|e| panic!("claim {id:?}: {e}"));
        assert_eq!(
            claim,
            Claim::Claimed {
                attempts: 0,
                last_error: None
            },
            "{id:?}"
        );
        let settings: (String, String) = sqlx::query_as(
            "SELECT current_setting('transaction_isolation'), current_setting('statement_timeout')",
        )
        .fetch_one(&mut *tx)
        .await
        .unwrap();
        assert_eq!(
            settings,
            ("read committed".into(), "1500ms".into()),
            "{id:?}"
        );
        assert!(one_trip(&mut tx).await, "{id:?}: claimed in one trip");
        store.commit(tx).await.expect("commit");
        // Seen before: the one-trip claim fails, the usual one finds the message done.
        let (tx, claim) = store
            .begin_and_claim(&consumer, &message, true)
            .await
            .unwrap_or_else(|e| panic!("claim {id:?} again: {e}"));
        // Done: only the usual claim can say so.
        assert_eq!(claim, Claim::Done, "{id:?}");
        store.rollback(tx).await.unwrap();
        assert!(
            outside_transaction(store.pool()).await,
            "{id:?}: a session left in a transaction"
        );
    }
    let stored: Vec<String> = sqlx::query_scalar(
        "SELECT message_id FROM inbox_messages WHERE consumer = $1 AND processed_at IS NOT NULL ORDER BY message_id",
    )
    .bind(consumer.as_str())
    .fetch_all(&admin)
    .await
    .unwrap();
    let mut expected = ids.to_vec();
    expected.sort();
    assert_eq!(stored, expected, "each id stored as it is, nothing else");
    let all: i64 = sqlx::query_scalar("SELECT count(*) FROM inbox_messages")
        .fetch_one(&admin)
        .await
        .unwrap();
    assert_eq!(all, ids.len() as i64);

    // Offsets mode's one-trip claim, with the topics quoted the same way.
    for (partition, topic) in ids.iter().enumerate() {
        let partition = partition as i32;
        let (mut tx, found) = store
            .begin_and_claim_offset(&consumer, topic, partition, 5)
            .await
            .unwrap_or_else(|e| panic!("offset claim in {topic:?}: {e}"));
        assert_eq!(found, inbox::store::OffsetClaim::New, "{topic:?}");
        assert!(
            called(&mut tx, "inbox_claim_offset").await,
            "{topic:?}: claimed in one trip"
        );
        store.commit(tx).await.expect("commit");
        let (tx, found) = store
            .begin_and_claim_offset(&consumer, topic, partition, 5)
            .await
            .unwrap_or_else(|e| panic!("offset claim in {topic:?} again: {e}"));
        assert_eq!(
            found,
            inbox::store::OffsetClaim::Consumed { next: 6 },
            "{topic:?}"
        );
        store.rollback(tx).await.unwrap();
        assert!(
            outside_transaction(store.pool()).await,
            "{topic:?}: a session left in a transaction"
        );
        assert_eq!(
            store
                .next_offset(&consumer, topic, partition)
                .await
                .unwrap(),
            Some(6)
        );
    }
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM inbox_offsets")
        .fetch_one(&admin)
        .await
        .unwrap();
    assert_eq!(
        rows,
        ids.len() as i64,
        "one row per partition, nothing else"
    );

    // Without the function: the usual claim, from the first message on.
    sqlx::query("DROP FUNCTION inbox_claim_new(text, text)")
        .execute(&admin)
        .await
        .unwrap();
    for id in ["after-1", "after-2"] {
        let message = MessageId::new(id).unwrap();
        let (tx, claim) = store
            .begin_and_claim(&consumer, &message, true)
            .await
            .unwrap_or_else(|e| panic!("claim {id:?} without the function: {e}"));
        assert!(
            matches!(claim, Claim::Claimed { attempts: 0, .. }),
            "{claim:?}"
        );
        store.commit(tx).await.expect("commit");
        assert!(
            outside_transaction(store.pool()).await,
            "{id}: a session left in a transaction"
        );
    }
}

/// A commit leaves its session outside any transaction (one pooled connection, so the next
/// borrower gets it), with the writes committed; an aborted transaction (an error swallowed) is
/// refused as `Aborted` and rolled back; a `COMMIT` that itself fails (a deferred constraint) is
/// an error, not a success, and leaves the session clean too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_refuses_an_aborted_transaction_and_leaves_its_session_clean() {
    use conformance::stores::Postgres;
    use inbox::{ConsumerName, InboxAdmin, InboxStore, MessageId, PostgresStore, StoreError};
    use sqlx::Executor;

    let url = Postgres::fresh_url().await;
    let admin = sqlx::PgPool::connect(&url).await.expect("connect");
    admin
        .execute(
            "CREATE TABLE commit_checks (id int PRIMARY KEY, ref int)
             ;ALTER TABLE commit_checks ADD CONSTRAINT later UNIQUE (ref) DEFERRABLE INITIALLY DEFERRED",
        )
        .await
        .unwrap();
    let store = PostgresStore::connect(&url, 1)
        .await
        .expect("connect PostgreSQL");
    store.migrate().await.expect("migrate");
    let consumer = ConsumerName::new("commits").unwrap();
    let claimed = |id: &str| {
        let (admin, id) = (admin.clone(), id.to_owned());
        async move {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM inbox_messages WHERE message_id = $1 AND processed_at IS NOT NULL",
            )
            .bind(id)
            .fetch_one(&admin)
            .await
            .unwrap()
        }
    };

    for round in 0..3 {
        let id = format!("fine-{round}");
        let (mut tx, _) = store
            .begin_and_claim(&consumer, &MessageId::new(id.as_str()).unwrap(), true)
            .await
            .unwrap();
        sqlx::query("INSERT INTO commit_checks (id, ref) VALUES ($1, $1)")
            .bind(round)
            .execute(&mut *tx)
            .await
            .unwrap();
        store.commit(tx).await.expect("commit");
        assert!(
            outside_transaction(store.pool()).await,
            "round {round}: left inside a transaction"
        );
        assert_eq!(claimed(&id).await, 1, "round {round}: committed");
    }

    // A swallowed error: refused, rolled back, the session clean.
    let (mut tx, _) = store
        .begin_and_claim(&consumer, &MessageId::new("swallowed").unwrap(), true)
        .await
        .unwrap();
    let _ = sqlx::query("SELECT 1 / 0").execute(&mut *tx).await;
    let error = store.commit(tx).await.expect_err("an aborted transaction");
    assert!(matches!(error, StoreError::Aborted(_)), "{error:?}");
    assert!(
        outside_transaction(store.pool()).await,
        "after an aborted commit"
    );
    assert_eq!(claimed("swallowed").await, 0);

    // The COMMIT itself fails: an error, nothing committed, the session clean.
    let (mut tx, _) = store
        .begin_and_claim(&consumer, &MessageId::new("deferred").unwrap(), true)
        .await
        .unwrap();
    sqlx::query("INSERT INTO commit_checks (id, ref) VALUES (100, 0)")
        .execute(&mut *tx)
        .await
        .unwrap();
    let error = store
        .commit(tx)
        .await
        .expect_err("a deferred unique violation");
    assert!(format!("{error:?}").contains("23505"), "{error:?}");
    assert!(
        outside_transaction(store.pool()).await,
        "after a failed COMMIT"
    );
    assert_eq!(claimed("deferred").await, 0);
}

/// A session the server ends (`pg_terminate_backend`, as a restart or a failover does: SQLSTATE
/// 57P01) is an outage of the store, not a conflict between transactions: the consumer then
/// pauses its deliveries and probes, instead of retrying each message against a database that
/// is going away. (It was a `Conflict`; the harness's database restart showed it.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_the_server_ends_is_an_outage() {
    use conformance::stores::Postgres;
    use inbox::{ConsumerName, InboxAdmin, InboxStore, MessageId, PostgresStore, StoreError};

    let url = Postgres::fresh_url().await;
    let store = PostgresStore::connect(&url, 1)
        .await
        .expect("connect PostgreSQL");
    store.migrate().await.expect("migrate");
    let mut tx = store.begin().await.expect("begin");
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *tx)
        .await
        .expect("the session's pid");
    let admin = sqlx::PgPool::connect(&url).await.expect("a second session");
    let ended: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
        .bind(pid)
        .fetch_one(&admin)
        .await
        .expect("terminate");
    assert!(ended);
    let consumer = ConsumerName::new("outage").unwrap();
    let id = MessageId::new("m1").unwrap();
    let error = store
        .claim(&mut tx, &consumer, &id)
        .await
        .expect_err("the session is gone");
    let text = format!("{error:?}");
    assert!(
        matches!(error, StoreError::Unavailable(_)),
        "an outage, not {text}"
    );
    assert!(
        text.contains("57P01") || text.contains("administrator command"),
        "the server's own answer was seen (not only a broken pipe): {text}"
    );
}

/// A delivery task's fatal error — here the store refusing a claim for good, which stops the
/// consumer — ends the run when it happens, not at the next delivery: on a quiet queue the
/// consumer ran on half-broken until more traffic came (review #22).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fatal_error_ends_a_quiet_run() {
    use std::sync::Arc;

    use conformance::flaky::{Fault, FlakyStore, Method};
    use conformance::stores::Postgres;
    use conformance::{Scenario, Script};
    use inbox::memory::Faults;
    use inbox::{CancellationToken, Consumer};

    let db = Arc::new(Postgres);
    let s = Scenario::new(&Memory, &db, Faults::none()).await;
    let name = s.name("fatal");
    s.broker.prepare(&s.source, &[&name]).await;
    let store = FlakyStore::new(s.store.clone());
    let id = s.id(0);
    store.inject(Method::Claim, Some(&id), Fault::Refused, 1);
    let consumer = Consumer::new(
        name.clone(),
        s.source.clone(),
        s.broker.transport(),
        store.clone(),
        s.handler(&Arc::new(Script::default())),
    );
    let run = tokio::spawn({
        let consumer = consumer.clone();
        async move { consumer.run(CancellationToken::new()).await }
    });
    s.publish(&id, 0).await;
    let ended = tokio::time::timeout(conformance::DEADLINE, run)
        .await
        .expect("the run ends by itself, with no later delivery to notice the failure")
        .expect("the run's task");
    assert!(ended.is_err(), "a fatal error: {ended:?}");
    assert_eq!(store.fired(), [(Method::Claim, Fault::Refused)]);
}

/// The outbox's order check catches the commonest relay bug: reading "id > last seen" loses the
/// row of a transaction that took its id first and committed last. The relay, in the same
/// situation, publishes it.
mod outbox_late_commits {
    use std::sync::Arc;

    use inbox::memory::MemoryBroker;
    use inbox::outbox::Outbox;
    use inbox::{InboxStore, OutgoingMessage, PostgresStore, Transport};

    use crate::conformance::publishing::Publishing;
    use crate::conformance::stores::Postgres;
    use crate::conformance::{CommittedRow, TestDb, check_published};

    /// a1 (key k0) is written first and committed last; b1 (key k1) commits in between, and the
    /// relay under test looks once before a1's commit and once after.
    async fn late_commit(
        mut look: impl AsyncFnMut(&PostgresStore, &Arc<Publishing>),
    ) -> Result<(), String> {
        let store = Postgres.store().await;
        let outbox = Outbox::new(store.clone());
        let transport = Publishing::new(Arc::new(MemoryBroker::new()));
        let mut committed: Vec<CommittedRow> = Vec::new();
        let message = |id: &str, key: &str| OutgoingMessage::new(id, "{}").with_key(key.to_owned());
        let mut tx_a = store.begin().await.unwrap();
        let a = outbox
            .send(&mut tx_a, "late", message("a1", "k0"))
            .await
            .unwrap();
        let mut tx_b = store.begin().await.unwrap();
        let b = outbox
            .send(&mut tx_b, "late", message("b1", "k1"))
            .await
            .unwrap();
        outbox.commit(tx_b).await.unwrap();
        committed.push((b.row_id, "b1".into(), Some("k1".into())));
        assert!(a.row_id < b.row_id, "a1 took its id first");
        look(&store, &transport).await;
        outbox.commit(tx_a).await.unwrap();
        committed.push((a.row_id, "a1".into(), Some("k0".into())));
        look(&store, &transport).await;
        check_published(&committed, &transport.log(), true)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_relay_reading_past_the_last_id_loses_a_late_commit() {
        let mut last = 0i64;
        let naive = late_commit(async |store: &PostgresStore, transport: &Arc<Publishing>| {
            let rows: Vec<(i64, String, Option<String>)> = sqlx::query_as(
                "SELECT id, message_id, ordering_key FROM outbox_messages WHERE id > $1 ORDER BY id",
            )
            .bind(last)
            .fetch_all(store.pool())
            .await
            .unwrap();
            for (id, message_id, key) in rows {
                let mut message = OutgoingMessage::new(message_id, "{}");
                message.key = key.map(Into::into);
                transport.publish("late", message).await.unwrap();
                last = id;
            }
        })
        .await;
        let error = naive.expect_err("the naive relay passes the order check");
        assert!(error.contains("a1 never published"), "{error}");

        let relay = late_commit(async |store: &PostgresStore, transport: &Arc<Publishing>| {
            let relay =
                Outbox::new(store.clone()).relay(Arc::clone(transport) as Arc<dyn Transport>);
            relay.run_once().await.unwrap();
        })
        .await;
        relay.expect("the relay publishes the late commit");
    }
}

/// Fencing: a batch whose lease lapsed and whose rows another relay claimed can neither mark them
/// published nor record a failure on them; the new holder can.
mod outbox_fencing {
    use std::time::Duration;

    use inbox::OutgoingMessage;
    use inbox::outbox::{Outbox, OutboxBatch, OutboxStore, PublishFailure};

    use crate::conformance::TestDb;
    use crate::conformance::stores::{Postgres, Sqlite};

    /// A batch holding the one row, once the lease of whoever held it before lapsed.
    async fn claim_after_lapse<S: OutboxStore>(store: &S, lease: Duration) -> OutboxBatch {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            let batch = store.claim_outbox(10, lease).await.unwrap();
            if batch.rows.len() == 1 {
                return batch;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "the lease lapsed and no other batch could claim the row within 30 s"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn a_lapsed_lease_cannot_mark<S: OutboxStore>(store: S) {
        let outbox = Outbox::new(store.clone()).signal_other_processes(false);
        let mut tx = store.begin().await.unwrap();
        let sent = outbox
            .send(
                &mut tx,
                "fenced",
                OutgoingMessage::new("f-1", "{}").with_key("k"),
            )
            .await
            .unwrap();
        outbox.commit(tx).await.unwrap();
        let short = Duration::from_millis(200);
        let first = store.claim_outbox(10, short).await.unwrap();
        assert_eq!(first.rows.len(), 1);
        let second = claim_after_lapse(&store, short).await;
        assert_eq!(
            first.finish(&[sent.row_id], &[], false).await.unwrap(),
            0,
            "a stale batch cannot mark the row"
        );
        let third = claim_after_lapse(&store, Duration::from_secs(60)).await;
        let failure = PublishFailure::new(sent.row_id, "stale", Duration::ZERO, true);
        second.finish(&[], &[failure], false).await.unwrap();
        assert!(
            store.outbox_dead(10).await.unwrap().is_empty(),
            "a stale batch cannot kill the row"
        );
        assert_eq!(third.finish(&[sent.row_id], &[], false).await.unwrap(), 1);
        assert_eq!(
            store.outbox_stats().await.unwrap().len(),
            0,
            "published and deleted"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_lapsed_lease_cannot_mark_on_postgres() {
        a_lapsed_lease_cannot_mark(Postgres.store().await).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_lapsed_lease_cannot_mark_on_sqlite() {
        a_lapsed_lease_cannot_mark(Sqlite.store().await).await;
    }
}

/// A batch handler's failures isolated by splitting (see the scenario).
mod whole_batch_splitting {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn on_postgres() {
        conformance::init_tracing();
        let db = std::sync::Arc::new(async { conformance::stores::Postgres }.await);
        conformance::whole_batches_isolate_the_failing_message(&Memory, &db).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn on_sqlite() {
        conformance::init_tracing();
        let db = std::sync::Arc::new(async { conformance::stores::Sqlite }.await);
        conformance::whole_batches_isolate_the_failing_message(&Memory, &db).await;
    }
}

/// The outbox's loops read PostgreSQL's outbox table by its indexes whatever the table's
/// statistics say. A queue table is nearly empty whenever autovacuum analyzes it; with those
/// statistics the planner prefers reading the whole table, which is the backlog (for the claim)
/// or the published rows kept for retention (for the relay's gauges). The table's own counters
/// of rows read tell which plan ran (a sequential or a bitmap scan reads them all). They reach
/// other sessions a moment after a transaction ends (at once after `pg_stat_force_next_flush`,
/// PostgreSQL 15 and later), so each reading waits for a counter it knows must have moved.
mod outbox_plans {
    use std::time::Duration;

    use crate::conformance::eventually;
    use crate::conformance::stores::Postgres;
    use inbox::outbox::OutboxStore;
    use inbox::{InboxAdmin, PostgresStore};

    /// (rows read, scans, rows inserted, rows updated) of the outbox table, as far as they have
    /// arrived.
    async fn counters(store: &PostgresStore) -> (i64, i64, i64, i64) {
        // PERFORM is planned when it runs: older servers never meet the function.
        sqlx::query(
            "DO $$ BEGIN
               IF current_setting('server_version_num')::int >= 150000 THEN
                 PERFORM pg_stat_force_next_flush();
               END IF;
             END $$",
        )
        .execute(store.pool())
        .await
        .unwrap();
        sqlx::query_as(
            "SELECT seq_tup_read + coalesce(idx_tup_fetch, 0), seq_scan + coalesce(idx_scan, 0), n_tup_ins,
               n_tup_upd
             FROM pg_stat_user_tables WHERE relname = 'outbox_messages'",
        )
        .fetch_one(store.pool())
        .await
        .unwrap()
    }

    /// A fresh database whose outbox table has an empty table's statistics, as autovacuum leaves
    /// them, and `rows` rows (a key each) inserted after: those statistics stay, since
    /// autovacuum is off for the table (an autoanalyze mid-test would describe the rows).
    /// Returns once the insert is in the table's counters.
    async fn rows_under_empty_statistics(rows: i64) -> PostgresStore {
        let store = PostgresStore::connect(&Postgres::fresh_url().await, 1)
            .await
            .expect("connect PostgreSQL");
        store.migrate().await.unwrap();
        for sql in [
            "ALTER TABLE outbox_messages SET (autovacuum_enabled = false)",
            "ANALYZE outbox_messages",
        ] {
            sqlx::query(sql).execute(store.pool()).await.unwrap();
        }
        sqlx::query(
            "INSERT INTO outbox_messages (destination, message_id, ordering_key, payload)
             SELECT 'backlog', 'm-' || g, 'k-' || g, '\\x7b7d' FROM generate_series(1, $1) g",
        )
        .bind(rows)
        .execute(store.pool())
        .await
        .unwrap();
        // Once the insert's counts are in, so are those of everything before it (the
        // migrations).
        written_in_counters(&store, rows, 0).await;
        store
    }

    /// Waits until the table's counters hold `inserted` and `updated` rows: then they hold what
    /// every statement before did, its rows read included. (PostgreSQL 14 and older send
    /// counters over UDP, which may drop one: the deadline fails.)
    async fn written_in_counters(store: &PostgresStore, inserted: i64, updated: i64) {
        eventually("the writes in the table's counters", || async {
            match counters(store).await {
                (_, _, ins, upd) if ins >= inserted && upd >= updated => Ok(()),
                (_, _, ins, upd) => Err(format!("{ins} rows inserted and {upd} updated so far")),
            }
        })
        .await;
    }

    /// Rows read since `before`, once the scans of what ran since are counted.
    async fn rows_read_since(
        store: &PostgresStore,
        (read_before, scans_before, ..): (i64, i64, i64, i64),
    ) -> i64 {
        eventually("the scans in the table's counters", || async {
            match counters(store).await {
                (_, scans, ..) if scans > scans_before => Ok(()),
                _ => Err("no scan counted yet".to_owned()),
            }
        })
        .await;
        counters(store).await.0 - read_before
    }

    /// Without the claim's plan (fails with 10,000 rows read, and 5,100 with only sequential
    /// scans forbidden, a bitmap scan and a sort), draining a backlog takes time quadratic in
    /// its size.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_backlog_is_claimed_by_the_index_whatever_the_statistics() {
        let store = &rows_under_empty_statistics(5000).await;
        let before = counters(store).await;
        let batch = store
            .claim_outbox(100, Duration::from_secs(30))
            .await
            .unwrap();
        let ids: Vec<i64> = batch.rows.iter().map(|row| row.id).collect();
        assert_eq!(ids.len(), 100);
        assert!(
            ids.windows(2).all(|w| w[0] < w[1]) && ids[0] == 1,
            "the oldest rows, in id order"
        );
        assert_eq!(batch.finish(&ids, &[], false).await.unwrap(), 100);
        let read = rows_read_since(store, before).await;
        // 100 rows claimed and 100 deleted, each read once or twice; a scan of the backlog is 5,000.
        assert!(
            read < 1000,
            "the claim and its mark read {read} rows of a backlog of 5,000: the claim read the table, not its index of pending rows"
        );
    }

    /// The relay samples its gauges every 15 s; with a retention window the table holds every
    /// row published in it, which the gauges must not read (a sequential scan reads 5,010
    /// rows here).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_relays_gauges_read_the_pending_rows_not_the_kept_ones() {
        let store = &rows_under_empty_statistics(5000).await;
        // The 5,000 rows published and kept; then 10 pending, of which one failed and one is dead.
        for sql in [
            "UPDATE outbox_messages SET published_at = clock_timestamp()",
            "INSERT INTO outbox_messages (destination, message_id, ordering_key, payload)
             SELECT 'backlog', 'later-' || g, 'k-' || g, '\\x7b7d' FROM generate_series(1, 10) g",
            "UPDATE outbox_messages SET attempts = 1 WHERE message_id = 'later-1'",
            "UPDATE outbox_messages SET attempts = 5, dead_at = clock_timestamp()
             WHERE message_id = 'later-2'",
        ] {
            sqlx::query(sql).execute(store.pool()).await.unwrap();
        }
        written_in_counters(store, 5010, 5002).await;
        let before = counters(store).await;
        let stats = store.outbox_pending_stats().await.unwrap();
        let read = rows_read_since(store, before).await;
        assert_eq!(stats.len(), 1);
        let stats = &stats[0];
        assert_eq!(
            (
                stats.pending,
                stats.failing,
                stats.dead,
                stats.blocked_keys,
                stats.published_kept
            ),
            (10, 1, 1, 2, 0)
        );
        assert!(stats.oldest_pending_seconds.is_some());
        assert!(
            read < 100,
            "the gauges read {read} rows for 10 pending among 5,000 kept: they read the kept rows"
        );
        // An operator's `outbox stats` counts the kept rows too.
        let all = store.outbox_stats().await.unwrap();
        assert_eq!((all[0].pending, all[0].published_kept), (10, 5000));
    }

    /// `inbox outbox dead list` and `dead retry --all` on an outbox that keeps its published
    /// rows: they read the dead rows by their index, not the kept rows. (Here the list took the
    /// dead rows' index already; the retry read all 5,001 rows.)
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn dead_rows_are_listed_and_retried_without_reading_the_kept_ones() {
        let store = &rows_under_empty_statistics(5000).await;
        for sql in [
            "UPDATE outbox_messages SET published_at = clock_timestamp()",
            "INSERT INTO outbox_messages (destination, message_id, ordering_key, payload, attempts, dead_at)
             VALUES ('backlog', 'dead-1', 'k-dead', '\\x7b7d', 3, clock_timestamp())",
        ] {
            sqlx::query(sql).execute(store.pool()).await.unwrap();
        }
        written_in_counters(store, 5001, 5000).await;
        let before = counters(store).await;
        let dead = store.outbox_dead(100).await.unwrap();
        let read = rows_read_since(store, before).await;
        assert_eq!(dead.len(), 1);
        assert!(
            read < 100,
            "`outbox dead list` read {read} rows for one dead row among 5,000 kept"
        );
        let before = counters(store).await;
        assert_eq!(store.outbox_retry(None).await.unwrap(), 1);
        let read = rows_read_since(store, before).await;
        assert!(
            read < 100,
            "`outbox dead retry --all` read {read} rows for one dead row among 5,000 kept"
        );
        assert!(store.outbox_dead(100).await.unwrap().is_empty());
    }
}

/// The relay's store calls failing, one method at a time (the store wrapped in `FlakyStore`):
/// its gauges' sample and its retention pass on every call, transiently and permanently, and its
/// claim three times. Neither sampling nor cleanup is on the publishing path: every row is
/// published, each once in this otherwise quiet run, and the relay stops cleanly.
mod outbox_store_faults {
    use std::collections::HashSet;
    use std::sync::Arc;
    use std::time::Duration;

    use inbox::memory::MemoryBroker;
    use inbox::outbox::{Outbox, OutboxStore};
    use inbox::{CancellationToken, OutgoingMessage};

    use crate::conformance::flaky::{Fault, FlakyStore, Method};
    use crate::conformance::stores::{Postgres, Sqlite};
    use crate::conformance::{TestDb, eventually};

    async fn the_relay_publishes_through_failing_samples_cleanups_and_claims<S>(inner: S)
    where
        S: OutboxStore + Send + Sync + 'static,
    {
        let store = FlakyStore::new(inner);
        store.inject(
            Method::OutboxPendingStats,
            None,
            Fault::Unavailable,
            u32::MAX,
        );
        store.inject(Method::OutboxCleanup, None, Fault::Refused, u32::MAX);
        store.inject(Method::ClaimOutbox, None, Fault::Unavailable, 3);
        let outbox = Outbox::new(store.clone()).signal_other_processes(false);
        let broker = Arc::new(MemoryBroker::new());
        let relay = outbox
            .relay(broker.clone())
            .stats_interval(Duration::from_millis(10))
            .cleanup_interval(Duration::from_millis(10))
            .retry_delays(Duration::from_millis(10), Duration::from_millis(50))
            .poll_interval(Duration::from_millis(50));
        let stop = CancellationToken::new();
        let running = {
            let stop = stop.clone();
            tokio::spawn(async move { relay.run(stop).await })
        };
        for t in 0..4 {
            let mut tx = outbox.begin().await.unwrap();
            for i in 0..5 {
                let message =
                    OutgoingMessage::new(format!("f-{t}-{i}"), "{}").with_key(format!("k{i}"));
                tx.send("faults", message).unwrap();
            }
            tx.commit().await.unwrap();
        }
        eventually("the 20 rows published", || async {
            match broker.messages("faults").len() {
                20.. => Ok(()),
                n => Err(format!("{n} published")),
            }
        })
        .await;
        let fired = |method: Method| {
            let fired = store.fired();
            fired.iter().filter(|(m, _)| *m == method).count()
        };
        eventually(
            "the sample and the cleanup failing again and again",
            || async {
                match (
                    fired(Method::OutboxPendingStats),
                    fired(Method::OutboxCleanup),
                ) {
                    (s, c) if s >= 3 && c >= 3 => Ok(()),
                    (s, c) => Err(format!("{s} samples and {c} cleanups failed so far")),
                }
            },
        )
        .await;
        assert_eq!(fired(Method::ClaimOutbox), 3);
        stop.cancel();
        let report = running.await.unwrap().expect("the relay stops cleanly");
        assert_eq!(report.published, 20);
        let published = broker.messages("faults");
        let ids: HashSet<_> = published.iter().map(|m| m.message_id.clone()).collect();
        assert_eq!((published.len(), ids.len()), (20, 20), "each row once");
        let left = store
            .claim_outbox(100, Duration::from_secs(5))
            .await
            .unwrap();
        assert!(left.rows.is_empty(), "every row marked");
    }

    /// An `OutboxTx` whose `COMMIT` was applied and whose reply was lost: the caller sees a
    /// transient error and runs its transaction again with the same message ids (what an
    /// idempotent API does with a client's retry). The retry writes nothing; each message is
    /// published once.
    async fn a_lost_commit_reply_retried_writes_each_message_once<S>(inner: S)
    where
        S: OutboxStore + Send + Sync + 'static,
    {
        let store = FlakyStore::new(inner);
        store.inject(Method::CommitOutbox, None, Fault::CommitAppliedReplyLost, 1);
        let outbox = Outbox::new(store.clone()).signal_other_processes(false);
        let mut attempts = 0;
        let sent = loop {
            attempts += 1;
            let mut tx = outbox.begin().await.unwrap();
            for i in 0..3 {
                let message = OutgoingMessage::new(format!("r-{i}"), "{}").with_key("k");
                tx.send("lost-reply", message).unwrap();
            }
            match tx.commit().await {
                Ok(sent) => break sent,
                Err(e) => {
                    assert!(e.is_transient(), "a lost reply is transient: {e}");
                    assert!(attempts < 3, "{e}");
                }
            }
        };
        assert_eq!(attempts, 2);
        assert_eq!(store.fired().len(), 1, "{:?}", store.fired());
        assert!(
            sent.iter().all(|s| !s.written),
            "the retry finds the rows the lost commit wrote: {sent:?}"
        );
        // A later transaction with one of those messages and a new one: only the new one is
        // written (on PostgreSQL, the one statement returns one row of two).
        let mut tx = outbox.begin().await.unwrap();
        for id in ["r-1", "r-3"] {
            tx.send("lost-reply", OutgoingMessage::new(id, "{}").with_key("k"))
                .unwrap();
        }
        let again = tx.commit().await.unwrap();
        assert_eq!(
            (again[0].written, again[0].row_id, again[1].written),
            (false, sent[1].row_id, true),
            "{again:?}"
        );
        let broker = Arc::new(MemoryBroker::new());
        let relay = outbox.relay(broker.clone());
        while relay.run_once().await.unwrap() > 0 {}
        let published: Vec<_> = broker
            .messages("lost-reply")
            .into_iter()
            .map(|m| m.message_id.unwrap_or_default())
            .collect();
        assert_eq!(published, ["r-0", "r-1", "r-2", "r-3"]);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn on_postgres() {
        the_relay_publishes_through_failing_samples_cleanups_and_claims(Postgres.store().await)
            .await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_lost_commit_reply_on_postgres() {
        a_lost_commit_reply_retried_writes_each_message_once(Postgres.store().await).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_lost_commit_reply_on_sqlite() {
        a_lost_commit_reply_retried_writes_each_message_once(Sqlite.store().await).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn on_sqlite() {
        the_relay_publishes_through_failing_samples_cleanups_and_claims(Sqlite.store().await).await;
    }
}
