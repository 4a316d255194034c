//! The MySQL / MariaDB store (`MYSQL_URL`): the conformance suite on memory and on RabbitMQ,
//! per message and batched, the outbox suite, and what only InnoDB's locking shows — a
//! concurrent claim seen waiting in `information_schema.INNODB_TRX`, ids compared byte for byte,
//! a swallowed deadlock caught at commit.

use inbox_test_kit::{self as conformance, conformance_suite};

use conformance::memory::Memory;
use conformance::rabbitmq::RabbitMq;
use inbox::rabbitmq::QueueType;

conformance_suite!(memory_mysql, Memory, async { conformance::stores::MySql });
conformance_suite!(
    memory_mysql_batched,
    Memory,
    async { conformance::stores::MySql },
    batched = true
);
// Batch mode with a batch handler: each batch handled in one call, failures isolated by
// splitting the batch.
conformance_suite!(
    memory_mysql_whole_batches,
    Memory,
    async { conformance::stores::MySql },
    whole_batches
);
conformance_suite!(rabbitmq_mysql, RabbitMq::new(QueueType::Classic), async {
    conformance::stores::MySql
});
conformance_suite!(
    rabbitmq_quorum_mysql_batched,
    RabbitMq::new(QueueType::Quorum),
    async { conformance::stores::MySql },
    batched = true
);
conformance::outbox_suite!(outbox_memory_mysql, Memory, async {
    conformance::stores::MySql
});
conformance::outbox_suite!(
    outbox_rabbitmq_mysql,
    RabbitMq::new(QueueType::Classic),
    async { conformance::stores::MySql }
);

/// InnoDB's locks in action: a concurrent claim of the same message waits for the first
/// transaction instead of failing or passing, then sees its outcome.
mod claims {
    use inbox::store::Claim;
    use inbox::{ConsumerName, InboxStore, MessageId, MySqlStore, StoreError};

    use crate::conformance::stores::MySql;
    use crate::conformance::{TestDb, eventually};

    /// Whether the transaction of connection `thread` is waiting on a lock (InnoDB's own view).
    ///
    /// MariaDB refreshes `INNODB_TRX` from the engine only when it was not read for 100 ms, so
    /// a poll faster than that keeps reading the view of the first one. Each check therefore
    /// waits out that idle time first (pacing, not synchronisation: the condition is still what
    /// the test waits for), and these tests run one at a time (`.config/nextest.toml`).
    async fn lock_wait(store: &MySqlStore, thread: u64) -> Result<(), String> {
        tokio::time::sleep(std::time::Duration::from_millis(150)).await;
        let state: Option<String> = sqlx::query_scalar(
            "SELECT CAST(trx_state AS CHAR) FROM information_schema.INNODB_TRX
             WHERE trx_mysql_thread_id = ?",
        )
        .bind(thread)
        .fetch_optional(store.pool())
        .await
        .map_err(|e| e.to_string())?;
        match state.as_deref() {
            Some("LOCK WAIT") => Ok(()),
            other => Err(format!("connection {thread}'s transaction: {other:?}")),
        }
    }

    /// The server's id of the connection `tx` runs on.
    async fn thread_of(tx: &mut inbox::MySqlTx) -> u64 {
        sqlx::query_scalar("SELECT CONNECTION_ID()")
            .fetch_one(&mut **tx)
            .await
            .unwrap()
    }

    async fn second_claim_on(store: MySqlStore, ids: [&str; 2], commit_first: bool) -> Claim {
        let consumer = ConsumerName::new("claims").unwrap();
        let (first_id, second_id) = (
            MessageId::new(ids[0]).unwrap(),
            MessageId::new(ids[1]).unwrap(),
        );
        let mut first = store.begin().await.unwrap();
        assert!(matches!(
            store.claim(&mut first, &consumer, &first_id).await.unwrap(),
            Claim::Claimed { .. }
        ));
        let mut tx = store.begin().await.unwrap();
        let thread = thread_of(&mut tx).await;
        let second = tokio::spawn({
            let (store, consumer) = (store.clone(), consumer.clone());
            async move {
                let claim = store.claim(&mut tx, &consumer, &second_id).await.unwrap();
                store.rollback(tx).await.unwrap();
                claim
            }
        });
        eventually("the second claim waits in LOCK WAIT", || {
            lock_wait(&store, thread)
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
        let store = MySql.store().await;
        assert_eq!(
            second_claim_on(store, ["m-1", "m-1"], true).await,
            Claim::Done
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_concurrent_claim_waits_and_then_takes_over_after_a_rollback() {
        let store = MySql.store().await;
        assert_eq!(
            second_claim_on(store, ["m-1", "m-1"], false).await,
            Claim::Claimed {
                attempts: 0,
                last_error: None
            }
        );
    }

    /// On a pool the application built with another isolation for its sessions (here
    /// SERIALIZABLE; InnoDB's default is REPEATABLE READ), the copy that waited still sees the
    /// message done: the store sets READ COMMITTED on each transaction it begins.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_claim_does_not_depend_on_the_session_isolation() {
        let url = MySql::url_of(&MySql.store().await).await;
        let pool = sqlx::mysql::MySqlPoolOptions::new()
            .max_connections(4)
            .after_connect(|conn, _| {
                Box::pin(async move {
                    sqlx::Executor::execute(
                        conn,
                        "SET SESSION TRANSACTION ISOLATION LEVEL SERIALIZABLE",
                    )
                    .await
                    .map(drop)
                })
            })
            .connect(&url)
            .await
            .unwrap();
        let store = MySqlStore::new(pool);
        assert_eq!(
            second_claim_on(store, ["m-1", "m-1"], true).await,
            Claim::Done
        );
    }

    /// `a`, `A` and `a ` are three messages: VARBINARY compares bytes (a `_bin` collation pads
    /// trailing spaces on MariaDB, a `_ci` one folds case). None waits for another.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn ids_are_compared_byte_for_byte() {
        let store = MySql.store().await;
        let consumer = ConsumerName::new("bytes").unwrap();
        let mut tx = store.begin().await.unwrap();
        for id in ["a", "A", "a ", "ä"] {
            let claim = store
                .claim(&mut tx, &consumer, &MessageId::new(id).unwrap())
                .await
                .unwrap();
            assert!(matches!(claim, Claim::Claimed { .. }), "{id:?}: {claim:?}");
        }
        store.commit(tx).await.unwrap();
        let mut tx = store.begin().await.unwrap();
        for id in ["a", "A", "a ", "ä"] {
            let claim = store
                .claim(&mut tx, &consumer, &MessageId::new(id).unwrap())
                .await
                .unwrap();
            assert_eq!(claim, Claim::Done, "{id:?}");
        }
        let batch: Vec<MessageId> = ["a ", "b", "A", "B "]
            .iter()
            .map(|id| MessageId::new(*id).unwrap())
            .collect();
        let claims = store.claim_batch(&mut tx, &consumer, &batch).await.unwrap();
        let fresh = Claim::Claimed {
            attempts: 0,
            last_error: None,
        };
        assert_eq!(
            claims,
            vec![Claim::Done, fresh.clone(), Claim::Done, fresh],
            "the batch claim agrees"
        );
        store.rollback(tx).await.unwrap();
    }

    /// A deadlock rolls back the victim's whole transaction and the session carries on in
    /// autocommit mode. A handler that swallows the error must not get its claim "committed":
    /// the commit finds the transaction gone and fails transiently, so the message is retried;
    /// in a batch, releasing the message's savepoint fails first.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_swallowed_deadlock_is_caught_at_commit() {
        let store = MySql.store().await;
        let consumer = ConsumerName::new("deadlock").unwrap();
        let (one, two) = (
            MessageId::new("one").unwrap(),
            MessageId::new("two").unwrap(),
        );
        let mut a = store.begin().await.unwrap();
        let mut b = store.begin().await.unwrap();
        let thread_a = thread_of(&mut a).await;
        store.claim(&mut a, &consumer, &one).await.unwrap();
        store.claim(&mut b, &consumer, &two).await.unwrap();
        // As in a batch: each next message's work inside a savepoint.
        store.savepoint(&mut a).await.unwrap();
        store.savepoint(&mut b).await.unwrap();
        // Each now wants the other's row: one of them is chosen as the victim.
        let a_wants_two = tokio::spawn({
            let (store, consumer, two) = (store.clone(), consumer.clone(), two.clone());
            async move {
                let result = store.claim(&mut a, &consumer, &two).await;
                (a, result)
            }
        });
        eventually("a waits for two", || lock_wait(&store, thread_a)).await;
        let b_result = store.claim(&mut b, &consumer, &one).await;
        let (a, a_result) = a_wants_two.await.unwrap();
        let (victim, survivor) = match (a_result, b_result) {
            (Err(e), Ok(_)) => ((a, e), b),
            (Ok(_), Err(e)) => ((b, e), a),
            other => panic!("expected one deadlock victim: {other:?}"),
        };
        assert!(
            matches!(victim.1, StoreError::Conflict(_)),
            "a deadlock is a transient conflict: {:?}",
            victim.1
        );
        // The survivor commits both claims.
        store.commit(survivor).await.unwrap();
        // The victim's handler swallowed the error and wrote on; the commit must refuse.
        let mut tx = victim.0;
        sqlx::query("SELECT 1").execute(&mut *tx).await.unwrap();
        // Nor may it send: the row would be autocommitted on its own, a message about a change
        // that was rolled back.
        let outbox = inbox::outbox::Outbox::new(store.clone()).signal_other_processes(false);
        let sent = outbox
            .send(
                &mut tx,
                "deadlock-victim",
                inbox::OutgoingMessage::new("m-1", "{}"),
            )
            .await;
        assert!(
            matches!(sent, Err(StoreError::Aborted(_))),
            "a send after the transaction ended: {sent:?}"
        );
        let written: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM outbox_messages WHERE destination = 'deadlock-victim'",
        )
        .fetch_one(store.pool())
        .await
        .unwrap();
        assert_eq!(written, 0, "no outbox row written outside the transaction");
        // In a batch, releasing the message's savepoint already says so, before the next
        // handler could run in autocommit mode.
        let released = store.release_savepoint(&mut tx).await;
        assert!(
            matches!(released, Err(StoreError::Aborted(_))),
            "the savepoint went with the transaction: {released:?}"
        );
        let refused = store.commit(tx).await;
        assert!(
            matches!(refused, Err(StoreError::Aborted(_))),
            "the commit of a transaction the server rolled back: {refused:?}"
        );
    }
}

/// A batch handler's failures isolated by splitting (see the scenario).
mod whole_batch_splitting {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn on_mysql() {
        conformance::init_tracing();
        let db = std::sync::Arc::new(async { conformance::stores::MySql }.await);
        conformance::whole_batches_isolate_the_failing_message(&Memory, &db).await;
    }
}

/// The outbox's operator statements on a table that keeps its published rows: they read the
/// rows not published yet, by their index, not the kept ones. InnoDB's handler counters of the
/// session (one pooled connection) count the rows each statement read.
mod outbox_plans {
    use inbox::outbox::OutboxStore;
    use inbox::{InboxAdmin, MySqlStore};

    use crate::conformance::stores::MySql;

    /// Rows the session's handlers have read so far.
    async fn rows_read(store: &MySqlStore) -> i64 {
        let counters: Vec<(String, String)> =
            sqlx::query_as("SHOW SESSION STATUS LIKE 'Handler_read%'")
                .fetch_all(store.pool())
                .await
                .unwrap();
        counters
            .iter()
            .map(|(_, value)| value.parse::<i64>().unwrap_or(0))
            .sum()
    }

    /// A full scan reads 5,001 rows here (and the retry as many again).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn dead_rows_are_listed_and_retried_without_reading_the_kept_ones() {
        let store = &MySqlStore::connect(&MySql::fresh_url().await, 1)
            .await
            .expect("connect MySQL");
        store.migrate().await.unwrap();
        // 5,000 kept rows: 0 to 4,999 from four digits (MySQL's recursion depth stops at 1,000).
        let digit = "(SELECT 0 AS n UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3
                      UNION ALL SELECT 4 UNION ALL SELECT 5 UNION ALL SELECT 6 UNION ALL SELECT 7
                      UNION ALL SELECT 8 UNION ALL SELECT 9)";
        let kept = format!(
            "INSERT INTO outbox_messages (destination, message_id, ordering_key, payload, published_at)
             SELECT 'backlog', CONCAT('m-', g.n), CONCAT('k-', g.n), '{{}}', UTC_TIMESTAMP(6)
             FROM (SELECT a.n * 1000 + b.n * 100 + c.n * 10 + d.n AS n
                   FROM {digit} a, {digit} b, {digit} c, {digit} d) g
             WHERE g.n < 5000"
        );
        for sql in [
            kept.as_str(),
            "INSERT INTO outbox_messages (destination, message_id, ordering_key, payload, attempts, dead_at)
             VALUES ('backlog', 'dead-1', 'k-dead', '{}', 3, UTC_TIMESTAMP(6))",
            "ANALYZE TABLE outbox_messages",
        ] {
            sqlx::query(sql).execute(store.pool()).await.unwrap();
        }
        let before = rows_read(store).await;
        let dead = store.outbox_dead(100).await.unwrap();
        let read = rows_read(store).await - before;
        assert_eq!(dead.len(), 1);
        assert!(
            read < 100,
            "`outbox dead list` read {read} rows for one dead row among 5,000 kept"
        );
        let before = rows_read(store).await;
        assert_eq!(store.outbox_retry(None).await.unwrap(), 1);
        let read = rows_read(store).await - before;
        assert!(
            read < 100,
            "`outbox dead retry --all` read {read} rows for one dead row among 5,000 kept"
        );
        assert!(store.outbox_dead(100).await.unwrap().is_empty());
    }
}
