//! The PostgreSQL store.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{PgPool, Postgres};

use super::{
    Claim, CleanupPace, CleanupReport, ConsumerStats, DeadLetter, InboxAdmin, InboxStore,
    LockedSession, OffsetClaim, Pacer, storable_error, store_error,
};
use crate::error::StoreError;
use crate::id::{ConsumerName, MessageId};

/// The transaction a PostgreSQL consumer's handler writes through.
pub type PgTx = sqlx::Transaction<'static, Postgres>;

/// Session advisory lock keys: one for migrations, one for cleanup ("inbox" + a number).
const MIGRATE_LOCK: i64 = 0x696e_626f_7800_0001;
const CLEANUP_LOCK: i64 = 0x696e_626f_7800_0002;

/// The inbox on PostgreSQL.
#[derive(Debug, Clone)]
pub struct PostgresStore {
    pool: PgPool,
    /// `BEGIN` and what goes with it, sent as one statement.
    begin: std::borrow::Cow<'static, str>,
    /// What goes with the `BEGIN`, as statements that set up the transaction before it begins
    /// (the one-trip claim runs between them and the `BEGIN`).
    prelude: std::borrow::Cow<'static, str>,
    /// Whether a message seen for the first time is claimed with the `BEGIN`, in one round trip.
    /// Off for good once that fails in a way retrying cannot fix (migrations not run).
    claim_with_begin: Arc<AtomicBool>,
}

/// The claim needs READ COMMITTED; it is set here, not left to the server's default: under
/// REPEATABLE READ or SERIALIZABLE a copy that waited on the claim's row lock fails with 40001
/// instead of seeing the message done.
const BEGIN: &str = "BEGIN ISOLATION LEVEL READ COMMITTED";

/// The same, as set before a `BEGIN` that comes after a statement (the one-trip claim): a
/// transaction's isolation is fixed by its first statement.
const PRELUDE: &str = "SET TRANSACTION ISOLATION LEVEL READ COMMITTED";

/// What `inbox_claim_new` raises for a message it finds a row of.
const SEEN_BEFORE: &str = "IBX01";

/// What `inbox_claim_offset` raises for a record its partition's kept offset is past.
const CONSUMED_BEFORE: &str = "IBX02";

impl PostgresStore {
    /// Wraps an existing pool (share it with your application's own queries). Give the pool the
    /// `after_release` hook [`release_clean`](super::release_clean), and consider
    /// `test_before_acquire(false)`: sqlx's default pings every connection it hands out, a round
    /// trip before each message's `BEGIN` (a quarter of the per-message path in the profile);
    /// a broken connection then fails its first statement instead, which the consumer retries.
    pub fn new(pool: PgPool) -> Self {
        Self {
            pool,
            begin: BEGIN.into(),
            prelude: PRELUDE.into(),
            claim_with_begin: Arc::new(AtomicBool::new(true)),
        }
    }

    /// Whether a message the consumer has no sign of having seen before is claimed in the same
    /// round trip as its `BEGIN` (on by default). That saves one of the five round trips a
    /// message costs (`BEGIN`, claim, the handler's write, the liveness check, `COMMIT`).
    ///
    /// The `BEGIN` cannot carry parameters or return rows, so the claim goes with it as a call
    /// of `inbox_claim_new` (a migration) with the ids quoted, and answers only by failing:
    /// when the message has a row already (a duplicate; a retry the broker does not flag), it
    /// fails with SQLSTATE `IBX01` and the store begins again and claims the usual way. The
    /// claim itself is the same insert, taking the same row lock. The cost: each such message
    /// costs a round trip more, and the server logs the failure as an `ERROR` ("inbox: message
    /// seen before … (not a failure)", with the statement and so the message id). Deliveries
    /// the broker flags as redeliveries skip the one-trip claim; on Kafka only a partition's
    /// first record after an assignment is so flagged, so a replay after a rebalance costs that
    /// for each record replayed. Turn it off where duplicates are common or the log is watched
    /// for errors. A failure other than `IBX01` that retrying cannot fix (the function missing
    /// because the migrations were not run, no `EXECUTE` right on it) turns it off for this
    /// store, with a warning.
    ///
    /// Offsets mode ([`Dedup::Offsets`](crate::Dedup)) claims by offset the same way, with
    /// `inbox_claim_offset`, which fails with `IBX02` for a record its partition consumed
    /// before; this setting turns both off.
    pub fn claim_with_begin(mut self, on: bool) -> Self {
        // A flag of its own: clones made before keep theirs.
        self.claim_with_begin = Arc::new(AtomicBool::new(on));
        self
    }

    /// Bounds every statement of the inbox transactions — the handler's included — to
    /// `timeout` (`SET LOCAL statement_timeout`, sent with the `BEGIN`: no extra round trip). A
    /// statement past it fails transiently and the message is retried.
    ///
    /// Pair it with [`Consumer::handler_timeout`](crate::Consumer::handler_timeout): that one
    /// abandons a handler, but cannot stop a statement it left running — the rollback waits for
    /// it, holding the connection and the claim's row lock, as long as, say, a lock wait lasts.
    pub fn with_statement_timeout(mut self, timeout: Duration) -> Self {
        let set = format!(
            "SET LOCAL statement_timeout = {}",
            timeout.as_millis().max(1)
        );
        self.begin = format!("{BEGIN}; {set}").into();
        self.prelude = format!("{PRELUDE}; {set}").into();
        self
    }

    /// `BEGIN` (and what the store sends with it), then `more`, as one statement, on a task of its
    /// own (see [`InboxStore::begin`]).
    pub(crate) async fn begin_and(&self, more: &str) -> Result<PgTx, StoreError> {
        self.begin_with(format!("{}; {more}", self.begin).into())
            .await
    }

    /// The one-trip claim: `claim` (a call of a function that raises `refused` where the usual
    /// claim would not find the message new) sent before the `BEGIN`, in the implicit
    /// transaction that the `BEGIN` turns into the explicit one: one transaction. `None` when it
    /// is off or refused the message: a failure rolls the implicit transaction back and leaves
    /// the session outside any transaction, and the caller claims the usual way.
    async fn begin_with_claim(
        &self,
        claim: &str,
        refused: &str,
    ) -> Result<Option<PgTx>, StoreError> {
        if !self.claim_with_begin.load(Ordering::Relaxed) {
            return Ok(None);
        }
        let sql = format!("{}; {claim}; BEGIN", self.prelude);
        let pool = self.pool.clone();
        let begun = tokio::spawn(async move { pool.begin_with(sql).await })
            .await
            .map_err(|e| StoreError::Unavailable(Box::new(e)))?;
        match begun {
            Ok(tx) => Ok(Some(tx)),
            Err(e) if e.as_database_error().and_then(|d| d.code()).as_deref() == Some(refused) => {
                Ok(None)
            }
            Err(e) => {
                let error = store_error(e);
                if error.is_transient() {
                    return Err(error);
                }
                // The function missing (migrations not run), not executable by this role, …:
                // the usual claim may still work, and reports the schema's own errors.
                tracing::warn!(
                    error = %crate::error_chain(&error),
                    "the one-trip claim failed; claiming in a round trip of its own from now on"
                );
                self.claim_with_begin.store(false, Ordering::Relaxed);
                Ok(None)
            }
        }
    }

    async fn begin_with(&self, sql: std::borrow::Cow<'static, str>) -> Result<PgTx, StoreError> {
        let pool = self.pool.clone();
        tokio::spawn(async move { pool.begin_with(sql).await })
            .await
            .map_err(|e| StoreError::Unavailable(Box::new(e)))?
            .map_err(store_error)
    }

    /// Connects with a pool of `max_connections`. The URL's password is never logged.
    pub async fn connect(url: &str, max_connections: u32) -> Result<Self, StoreError> {
        let options: PgConnectOptions = url.parse().map_err(store_error)?;
        let pool = PgPoolOptions::new()
            .max_connections(max_connections)
            .acquire_timeout(Duration::from_secs(10))
            // No ping before each acquire: it is a round trip before every message's BEGIN. A
            // connection that broke while idle fails its first statement instead (transient:
            // the consumer retries, and the pool drops the connection).
            .test_before_acquire(false)
            .after_release(|conn, _| Box::pin(async move { Ok(super::release_clean(conn)) }))
            .connect_with(options)
            .await
            .map_err(store_error)?;
        Ok(Self::new(pool))
    }

    /// The pool, for the application's own queries.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }
}

const CLAIM: &str = "\
INSERT INTO inbox_messages (consumer, message_id, processed_at) VALUES ($1, $2, now())
ON CONFLICT (consumer, message_id) DO UPDATE SET processed_at = now()
  WHERE inbox_messages.processed_at IS NULL AND inbox_messages.dead_lettered_at IS NULL
RETURNING attempts, last_error";

/// The batch claim: the same upsert over an array of ids, taken in id order so that two batches
/// sharing ids lock them in the same order.
const CLAIM_BATCH: &str = "\
INSERT INTO inbox_messages (consumer, message_id, processed_at)
SELECT $1, id, now() FROM unnest($2::text[]) AS t(id) ORDER BY id
ON CONFLICT (consumer, message_id) DO UPDATE SET processed_at = now()
  WHERE inbox_messages.processed_at IS NULL AND inbox_messages.dead_lettered_at IS NULL
RETURNING message_id, attempts, last_error";

/// `text` as an SQL string literal, whatever `standard_conforming_strings` says: the `E''` form,
/// with quotes and backslashes doubled. (Ids hold no control characters, so no NUL.)
fn literal(text: &str) -> String {
    let mut quoted = String::with_capacity(text.len() + 3);
    quoted.push_str("E'");
    for c in text.chars() {
        match c {
            '\'' => quoted.push_str("''"),
            '\\' => quoted.push_str("\\\\"),
            c => quoted.push(c),
        }
    }
    quoted.push('\'');
    quoted
}

#[async_trait]
impl InboxStore for PostgresStore {
    type Tx = PgTx;

    async fn begin(&self) -> Result<PgTx, StoreError> {
        // On its own task, so that it is never cancelled half-way. sqlx 0.8's `Pool::begin`
        // counts the transaction only once `BEGIN` is answered: a future dropped in between (an
        // aborted consumer, the drain timeout, a `select!`) left the session inside a
        // transaction that nothing rolled back, and the pool handed it to the next borrower —
        // the application's own statements too — whose writes then never committed and whose
        // locks were never released (sqlx issues #2805, #4393). Finished on its task, an
        // unwanted transaction is dropped whole, which rolls it back.
        self.begin_with(self.begin.clone()).await
    }

    async fn begin_and_claim(
        &self,
        consumer: &ConsumerName,
        id: &MessageId,
        unseen: bool,
    ) -> Result<(PgTx, Claim), StoreError> {
        if unseen {
            let claim = format!(
                "SELECT inbox_claim_new({}, {})",
                literal(consumer.as_str()),
                literal(id.as_str())
            );
            if let Some(tx) = self.begin_with_claim(&claim, SEEN_BEFORE).await? {
                let fresh = Claim::Claimed {
                    attempts: 0,
                    last_error: None,
                };
                return Ok((tx, fresh));
            }
        }
        let mut tx = self.begin().await?;
        let claim = self.claim(&mut tx, consumer, id).await?;
        Ok((tx, claim))
    }

    async fn begin_and_claim_offset(
        &self,
        consumer: &ConsumerName,
        topic: &str,
        partition: i32,
        offset: i64,
    ) -> Result<(PgTx, OffsetClaim), StoreError> {
        let claim = format!(
            "SELECT inbox_claim_offset({}, {}, {partition}, {offset})",
            literal(consumer.as_str()),
            literal(topic)
        );
        if let Some(tx) = self.begin_with_claim(&claim, CONSUMED_BEFORE).await? {
            return Ok((tx, OffsetClaim::New));
        }
        let mut tx = self.begin().await?;
        let found = self
            .claim_offsets(&mut tx, consumer, topic, partition, (offset, offset))
            .await?;
        Ok((tx, found))
    }

    async fn claim(
        &self,
        tx: &mut PgTx,
        consumer: &ConsumerName,
        id: &MessageId,
    ) -> Result<Claim, StoreError> {
        let row: Option<(i32, Option<String>)> = sqlx::query_as(CLAIM)
            .bind(consumer.as_str())
            .bind(id.as_str())
            .fetch_optional(&mut **tx)
            .await
            .map_err(store_error)?;
        if let Some((attempts, last_error)) = row {
            return Ok(Claim::Claimed {
                attempts: attempts.max(0) as u32,
                last_error,
            });
        }
        // The row exists and is finished; which way only matters for counting. The claim above
        // holds the row lock, so this read sees the committed state.
        let dead: bool = sqlx::query_scalar(
            "SELECT dead_lettered_at IS NOT NULL FROM inbox_messages WHERE consumer = $1 AND message_id = $2",
        )
        .bind(consumer.as_str())
        .bind(id.as_str())
        .fetch_one(&mut **tx)
        .await
        .map_err(store_error)?;
        Ok(if dead { Claim::Dead } else { Claim::Done })
    }

    async fn claim_offsets(
        &self,
        tx: &mut PgTx,
        consumer: &ConsumerName,
        topic: &str,
        partition: i32,
        (first, last): (i64, i64),
    ) -> Result<OffsetClaim, StoreError> {
        // ON CONFLICT DO UPDATE locks the row even where its WHERE is false, and waits for a
        // concurrent insert of it to end: both owners of a partition during a rebalance see the
        // other's committed offset.
        let moved = sqlx::query(
            "INSERT INTO inbox_offsets AS o (consumer, topic, partition_id, next_offset)
             VALUES ($1, $2, $3, $5)
             ON CONFLICT (consumer, topic, partition_id) DO UPDATE
                 SET next_offset = EXCLUDED.next_offset, updated_at = now()
                 WHERE o.next_offset <= $4",
        )
        .bind(consumer.as_str())
        .bind(topic)
        .bind(partition)
        .bind(first)
        .bind(last.saturating_add(1))
        .execute(&mut **tx)
        .await
        .map_err(store_error)?
        .rows_affected();
        if moved == 1 {
            return Ok(OffsetClaim::New);
        }
        // Locked by the statement above: this read sees the committed value.
        let next: i64 = sqlx::query_scalar(
            "SELECT next_offset FROM inbox_offsets WHERE consumer = $1 AND topic = $2 AND partition_id = $3",
        )
        .bind(consumer.as_str())
        .bind(topic)
        .bind(partition)
        .fetch_one(&mut **tx)
        .await
        .map_err(store_error)?;
        Ok(OffsetClaim::Consumed { next })
    }

    async fn set_next_offset(
        &self,
        tx: &mut PgTx,
        consumer: &ConsumerName,
        topic: &str,
        partition: i32,
        next: i64,
    ) -> Result<(), StoreError> {
        sqlx::query(
            "UPDATE inbox_offsets SET next_offset = $4, updated_at = now()
             WHERE consumer = $1 AND topic = $2 AND partition_id = $3",
        )
        .bind(consumer.as_str())
        .bind(topic)
        .bind(partition)
        .bind(next)
        .execute(&mut **tx)
        .await
        .map_err(store_error)?;
        Ok(())
    }

    async fn next_offset(
        &self,
        consumer: &ConsumerName,
        topic: &str,
        partition: i32,
    ) -> Result<Option<i64>, StoreError> {
        sqlx::query_scalar(
            "SELECT next_offset FROM inbox_offsets WHERE consumer = $1 AND topic = $2 AND partition_id = $3",
        )
        .bind(consumer.as_str())
        .bind(topic)
        .bind(partition)
        .fetch_optional(&self.pool)
        .await
        .map_err(store_error)
    }

    async fn claim_batch(
        &self,
        tx: &mut PgTx,
        consumer: &ConsumerName,
        ids: &[MessageId],
    ) -> Result<Vec<Claim>, StoreError> {
        let texts: Vec<&str> = ids.iter().map(MessageId::as_str).collect();
        let rows: Vec<(String, i32, Option<String>)> = sqlx::query_as(CLAIM_BATCH)
            .bind(consumer.as_str())
            .bind(&texts)
            .fetch_all(&mut **tx)
            .await
            .map_err(store_error)?;
        Ok(super::batch_claims(
            ids,
            rows.into_iter()
                .map(|(id, attempts, e)| (id, attempts.max(0) as u32, e)),
        ))
    }

    /// 64: each savepoint a handler writes in takes a subtransaction id, and a backend caches 64
    /// of them; past that the transaction's subtransactions overflow to `pg_subtrans`, and while
    /// it is open every snapshot in the cluster (replicas included) has to look there — a known
    /// performance cliff for everyone, not just this consumer.
    fn max_batch(&self) -> Option<usize> {
        Some(64)
    }

    async fn savepoint(&self, tx: &mut PgTx) -> Result<(), StoreError> {
        sqlx::query("SAVEPOINT inbox_message")
            .execute(&mut **tx)
            .await
            .map(drop)
            .map_err(store_error)
    }

    async fn rollback_to_savepoint(&self, tx: &mut PgTx) -> Result<(), StoreError> {
        sqlx::query("ROLLBACK TO SAVEPOINT inbox_message")
            .execute(&mut **tx)
            .await
            .map(drop)
            .map_err(store_error)
    }

    async fn release_savepoint(&self, _tx: &mut PgTx) -> Result<(), StoreError> {
        // Nothing to send: the next message's `SAVEPOINT inbox_message` shadows this one (a
        // ROLLBACK TO goes to the newest of that name) and COMMIT keeps them all. A RELEASE
        // would cost a round trip per message, a third of a batched message's statements.
        Ok(())
    }

    async fn release_claim(
        &self,
        tx: &mut PgTx,
        consumer: &ConsumerName,
        id: &MessageId,
        failure: Option<(u32, &str)>,
    ) -> Result<(), StoreError> {
        let (attempt, error) = failure.map_or((0, None), |(a, e)| (a, Some(storable_error(e))));
        sqlx::query(
            "UPDATE inbox_messages SET processed_at = NULL,
                attempts = GREATEST(attempts + CASE WHEN $4::text IS NULL THEN 0 ELSE 1 END, $3),
                last_error = COALESCE($4, last_error)
             WHERE consumer = $1 AND message_id = $2",
        )
        .bind(consumer.as_str())
        .bind(id.as_str())
        .bind(attempt as i32)
        .bind(error)
        .execute(&mut **tx)
        .await
        .map_err(store_error)?;
        Ok(())
    }

    async fn record_dead_in(
        &self,
        tx: &mut PgTx,
        consumer: &ConsumerName,
        id: &MessageId,
        attempts: u32,
        reason: &str,
    ) -> Result<(), StoreError> {
        sqlx::query(
            "UPDATE inbox_messages SET processed_at = NULL, dead_lettered_at = now(),
                attempts = GREATEST(attempts, $3), last_error = $4
             WHERE consumer = $1 AND message_id = $2",
        )
        .bind(consumer.as_str())
        .bind(id.as_str())
        .bind(attempts as i32)
        .bind(storable_error(reason))
        .execute(&mut **tx)
        .await
        .map_err(store_error)?;
        Ok(())
    }

    async fn commit(&self, mut tx: PgTx) -> Result<(), StoreError> {
        // PostgreSQL answers COMMIT of an aborted transaction (a handler swallowed a failed
        // statement's error) with "ROLLBACK" and no error, and sqlx reports success: the engine
        // would ack a message whose claim was rolled back. One statement proves the transaction
        // is live first; in an aborted one it fails with 25P02 (`StoreError::Aborted`).
        //
        // Its own round trip: sent with the COMMIT in one simple query it would save one, but
        // sqlx cannot be told that the transaction ended, and the empty transaction begun for
        // it to roll back doubles the server's rollback count (`xact_rollback`, which
        // dashboards alarm on); measured, the saving was within the noise on this path.
        if let Err(e) = sqlx::query("SELECT 1").execute(&mut *tx).await {
            let _ = tx.rollback().await;
            return Err(store_error(e));
        }
        tx.commit().await.map_err(store_error)
    }

    async fn rollback(&self, tx: PgTx) -> Result<(), StoreError> {
        tx.rollback().await.map_err(store_error)
    }

    async fn record_failure(
        &self,
        consumer: &ConsumerName,
        id: &MessageId,
        attempt: u32,
        error: &str,
    ) -> Result<u32, StoreError> {
        let attempts: Option<i32> = sqlx::query_scalar(
            "INSERT INTO inbox_messages (consumer, message_id, attempts, last_error) VALUES ($1, $2, $3, $4)
             ON CONFLICT (consumer, message_id) DO UPDATE
               SET attempts = GREATEST(inbox_messages.attempts + 1, EXCLUDED.attempts),
                   last_error = EXCLUDED.last_error
               WHERE inbox_messages.processed_at IS NULL AND inbox_messages.dead_lettered_at IS NULL
             RETURNING attempts",
        )
        .bind(consumer.as_str())
        .bind(id.as_str())
        .bind(attempt.max(1) as i32)
        .bind(storable_error(error))
        .fetch_optional(&self.pool)
        .await
        .map_err(store_error)?;
        Ok(attempts.unwrap_or(attempt as i32).max(0) as u32)
    }

    async fn record_delivery(
        &self,
        consumer: &ConsumerName,
        id: &MessageId,
    ) -> Result<u32, StoreError> {
        let unfinished: Option<i32> = sqlx::query_scalar(
            "INSERT INTO inbox_messages (consumer, message_id, unfinished) VALUES ($1, $2, 1)
             ON CONFLICT (consumer, message_id) DO UPDATE SET unfinished = inbox_messages.unfinished + 1
               WHERE inbox_messages.processed_at IS NULL AND inbox_messages.dead_lettered_at IS NULL
             RETURNING unfinished",
        )
        .bind(consumer.as_str())
        .bind(id.as_str())
        .fetch_optional(&self.pool)
        .await
        .map_err(store_error)?;
        Ok(u32::try_from(unfinished.unwrap_or(0)).unwrap_or(0))
    }

    async fn record_dead(
        &self,
        consumer: &ConsumerName,
        id: &MessageId,
        attempts: u32,
        reason: &str,
    ) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO inbox_messages (consumer, message_id, attempts, last_error, dead_lettered_at)
             VALUES ($1, $2, $3, $4, now())
             ON CONFLICT (consumer, message_id) DO UPDATE
               SET attempts = GREATEST(inbox_messages.attempts, EXCLUDED.attempts),
                   last_error = EXCLUDED.last_error, dead_lettered_at = now()
               WHERE inbox_messages.processed_at IS NULL AND inbox_messages.dead_lettered_at IS NULL",
        )
        .bind(consumer.as_str())
        .bind(id.as_str())
        .bind(attempts as i32)
        .bind(storable_error(reason))
        .execute(&self.pool)
        .await
        .map_err(store_error)?;
        Ok(())
    }

    async fn revive_in(
        &self,
        tx: &mut PgTx,
        consumer: &ConsumerName,
        id: &MessageId,
    ) -> Result<bool, StoreError> {
        // The replayed message starts afresh: a new attempt budget.
        let done = sqlx::query(
            "UPDATE inbox_messages SET dead_lettered_at = NULL, attempts = 0, unfinished = 0
             WHERE consumer = $1 AND message_id = $2 AND dead_lettered_at IS NOT NULL",
        )
        .bind(consumer.as_str())
        .bind(id.as_str())
        .execute(&mut **tx)
        .await
        .map_err(store_error)?;
        Ok(done.rows_affected() > 0)
    }

    async fn stats(
        &self,
        consumer: Option<&ConsumerName>,
    ) -> Result<Vec<ConsumerStats>, StoreError> {
        let rows: Vec<(String, i64, i64, i64, i64, i64, Option<f64>)> = sqlx::query_as(
            "SELECT consumer,
                    count(*),
                    count(processed_at),
                    count(*) FILTER (WHERE processed_at > now() - interval '1 hour'),
                    count(*) FILTER (WHERE processed_at IS NULL AND dead_lettered_at IS NULL),
                    count(dead_lettered_at),
                    EXTRACT(EPOCH FROM now() - min(received_at)
                        FILTER (WHERE processed_at IS NULL AND dead_lettered_at IS NULL))::float8
             FROM inbox_messages
             WHERE $1::text IS NULL OR consumer = $1
             GROUP BY consumer ORDER BY consumer",
        )
        .bind(consumer.map(|c| c.as_str()))
        .fetch_all(&self.pool)
        .await
        .map_err(store_error)?;
        Ok(rows.into_iter().map(ConsumerStats::from_row).collect())
    }
}

#[async_trait]
impl InboxAdmin for PostgresStore {
    async fn migrate(&self) -> Result<(), StoreError> {
        let mut held = LockedSession::new(self.pool.acquire().await.map_err(store_error)?);
        let conn = held.0.as_mut().expect("just set");
        sqlx::query("SELECT pg_advisory_lock($1)")
            .bind(MIGRATE_LOCK)
            .execute(&mut **conn)
            .await
            .map_err(store_error)?;
        let result = async {
            super::migrate::apply!(
                &mut **conn,
                &inbox_migrations::POSTGRES,
                create = "CREATE TABLE IF NOT EXISTS inbox_schema_migrations (
                    version bigint PRIMARY KEY, description text NOT NULL,
                    checksum bytea NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())",
                insert = "INSERT INTO inbox_schema_migrations (version, description, checksum) VALUES ($1, $2, $3)"
            )
        }
        .await;
        let unlocked = sqlx::query("SELECT pg_advisory_unlock($1)")
            .bind(MIGRATE_LOCK)
            .execute(&mut **conn)
            .await;
        if unlocked.is_ok() {
            held.release();
        }
        result
    }

    async fn dead_letters(
        &self,
        consumer: Option<&ConsumerName>,
        limit: u32,
    ) -> Result<Vec<DeadLetter>, StoreError> {
        let rows: Vec<(String, String, i32, Option<String>, f64)> = sqlx::query_as(
            "SELECT consumer, message_id, attempts, last_error,
                    EXTRACT(EPOCH FROM now() - dead_lettered_at)::float8
             FROM inbox_messages
             WHERE processed_at IS NULL AND dead_lettered_at IS NOT NULL
               AND ($1::text IS NULL OR consumer = $1)
             ORDER BY dead_lettered_at LIMIT $2",
        )
        .bind(consumer.map(|c| c.as_str()))
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await
        .map_err(store_error)?;
        Ok(rows
            .into_iter()
            .map(
                |(consumer, message_id, attempts, last_error, age)| DeadLetter {
                    consumer,
                    message_id,
                    attempts: attempts.max(0) as u32,
                    last_error,
                    age: Duration::from_secs_f64(age.max(0.0)),
                },
            )
            .collect())
    }

    async fn cleanup_with_progress(
        &self,
        older_than: Duration,
        pace: CleanupPace,
        progress: &(dyn Fn(u64) + Send + Sync),
    ) -> Result<CleanupReport, StoreError> {
        let mut held = LockedSession::new(self.pool.acquire().await.map_err(store_error)?);
        let conn = held.0.as_mut().expect("just set");
        let locked: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
            .bind(CLEANUP_LOCK)
            .fetch_one(&mut **conn)
            .await
            .map_err(store_error)?;
        if !locked {
            held.release();
            return Ok(CleanupReport {
                skipped_locked: true,
                ..CleanupReport::default()
            });
        }
        let mut report = CleanupReport::default();
        let mut pacer = Pacer::new(pace);
        let result: Result<(), StoreError> = async {
            loop {
                let rows = pacer.rows();
                // SKIP LOCKED: never wait for a claim that holds one of these rows. The batch's
                // commit does not wait for its WAL to reach the disk (`set_config`, local to
                // this statement's transaction, so no session setting outlives it, behind a
                // transaction-pooling proxy too): a claim's commit would otherwise share each
                // of those flushes. Safe: a delete lost to a crash brings back rows past
                // retention, which the next pass deletes.
                let deleted = sqlx::query(
                    "DELETE FROM inbox_messages m USING (
                        SELECT consumer, message_id FROM inbox_messages
                        WHERE processed_at IS NOT NULL AND processed_at < now() - make_interval(secs => $1)
                        LIMIT $2 FOR UPDATE SKIP LOCKED) old,
                       (SELECT set_config('synchronous_commit', 'off', true)) AS async_commit
                     WHERE m.consumer = old.consumer AND m.message_id = old.message_id",
                )
                .bind(older_than.as_secs_f64())
                .bind(i64::from(rows))
                .execute(&mut **conn)
                .await
                .map_err(store_error)?
                .rows_affected();
                report.deleted += deleted;
                report.batches += 1;
                progress(report.deleted);
                if pacer.batch_done(deleted).await {
                    return Ok(());
                }
            }
        }
        .await;
        let unlocked = sqlx::query("SELECT pg_advisory_unlock($1)")
            .bind(CLEANUP_LOCK)
            .execute(&mut **conn)
            .await;
        if unlocked.is_ok() {
            held.release();
        }
        result.map(|()| report)
    }

    async fn count_expired(&self, older_than: Duration) -> Result<u64, StoreError> {
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM inbox_messages
             WHERE processed_at IS NOT NULL AND processed_at < now() - make_interval(secs => $1)",
        )
        .bind(older_than.as_secs_f64())
        .fetch_one(&self.pool)
        .await
        .map_err(store_error)?;
        Ok(u64::try_from(n).unwrap_or(0))
    }
}
