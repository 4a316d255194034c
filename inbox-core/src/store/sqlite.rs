//! The SQLite store: the same semantics on a single-writer database (tests, the demo, small
//! single-node services).

use std::str::FromStr;
use std::time::Duration;

use async_trait::async_trait;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use sqlx::{Sqlite, SqlitePool};

use super::{
    Claim, CleanupPace, CleanupReport, ConsumerStats, DeadLetter, InboxAdmin, InboxStore,
    OffsetClaim, Pacer, storable_error, store_error,
};
use crate::error::StoreError;
use crate::id::{ConsumerName, MessageId};

/// The transaction a SQLite consumer's handler writes through.
pub type SqliteTx = sqlx::Transaction<'static, Sqlite>;

/// `now` as stored: UTC ISO-8601 with milliseconds, which sorts chronologically.
macro_rules! now {
    () => {
        "strftime('%Y-%m-%dT%H:%M:%fZ', 'now')"
    };
}

/// Seconds since a stored timestamp.
macro_rules! age_secs {
    ($col:literal) => {
        concat!("((julianday('now') - julianday(", $col, ")) * 86400.0)")
    };
}

/// The inbox on SQLite.
#[derive(Debug, Clone)]
pub struct SqliteStore {
    pool: SqlitePool,
}

impl SqliteStore {
    /// Wraps an existing pool. Use WAL mode and a generous busy timeout (writers queue on the
    /// database lock, and a claim waits there for a concurrent copy's transaction), and see
    /// [`release_clean`](super::release_clean) for the `after_release` hook the pool needs.
    pub fn new(pool: SqlitePool) -> Self {
        Self { pool }
    }

    /// Opens (creating if missing) a database file, in WAL mode with a 30 s busy timeout and
    /// `synchronous = FULL`: a commit is on disk before the consumer acks it. (NORMAL, SQLite's
    /// usual pairing with WAL, is faster but a power loss or OS crash can roll back commits that
    /// were already acked — messages lost. Build the pool yourself and use [`new`](Self::new)
    /// if that trade is yours to make.) `url` is `sqlite:path.db` or `sqlite::memory:`.
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        let options = SqliteConnectOptions::from_str(url)
            .map_err(store_error)?
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Full)
            .busy_timeout(Duration::from_secs(30));
        // An in-memory database exists once per connection: keep exactly one.
        let max = if url.contains(":memory:") || url.contains("mode=memory") {
            1
        } else {
            8
        };
        let pool = SqlitePoolOptions::new()
            .max_connections(max)
            .min_connections(if max == 1 { 1 } else { 0 })
            .idle_timeout(if max == 1 {
                None
            } else {
                Some(Duration::from_secs(600))
            })
            .max_lifetime(if max == 1 {
                None
            } else {
                Some(Duration::from_secs(1800))
            })
            .after_release(|conn, _| Box::pin(async move { Ok(super::release_clean(conn)) }))
            .connect_with(options)
            .await
            .map_err(store_error)?;
        Ok(Self { pool })
    }

    /// The pool, for the application's own queries.
    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }
}

#[async_trait]
impl InboxStore for SqliteStore {
    type Tx = SqliteTx;

    async fn begin(&self) -> Result<SqliteTx, StoreError> {
        // Take the write lock up front: a deferred transaction that reads first can fail to
        // upgrade (SQLITE_BUSY_SNAPSHOT) when another writer committed meanwhile.
        self.pool
            .begin_with("BEGIN IMMEDIATE")
            .await
            .map_err(store_error)
    }

    async fn claim(
        &self,
        tx: &mut SqliteTx,
        consumer: &ConsumerName,
        id: &MessageId,
    ) -> Result<Claim, StoreError> {
        let row: Option<(i64, Option<String>)> = sqlx::query_as(concat!(
            "INSERT INTO inbox_messages (consumer, message_id, processed_at) VALUES ($1, $2, ",
            now!(),
            ")
             ON CONFLICT (consumer, message_id) DO UPDATE SET processed_at = ",
            now!(),
            "
               WHERE inbox_messages.processed_at IS NULL AND inbox_messages.dead_lettered_at IS NULL
             RETURNING attempts, last_error"
        ))
        .bind(consumer.as_str())
        .bind(id.as_str())
        .fetch_optional(&mut **tx)
        .await
        .map_err(store_error)?;
        if let Some((attempts, last_error)) = row {
            return Ok(Claim::Claimed {
                attempts: attempts.clamp(0, i64::from(u32::MAX)) as u32,
                last_error,
            });
        }
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
        tx: &mut SqliteTx,
        consumer: &ConsumerName,
        topic: &str,
        partition: i32,
        (first, last): (i64, i64),
    ) -> Result<OffsetClaim, StoreError> {
        // The transaction holds the database's write lock (BEGIN IMMEDIATE): nothing changes the
        // row between the read and the write.
        let next: Option<i64> = sqlx::query_scalar(
            "SELECT next_offset FROM inbox_offsets WHERE consumer = $1 AND topic = $2 AND partition_id = $3",
        )
        .bind(consumer.as_str())
        .bind(topic)
        .bind(partition)
        .fetch_optional(&mut **tx)
        .await
        .map_err(store_error)?;
        if let Some(next) = next.filter(|&next| next > first) {
            return Ok(OffsetClaim::Consumed { next });
        }
        sqlx::query(concat!(
            "INSERT INTO inbox_offsets (consumer, topic, partition_id, next_offset) VALUES ($1, $2, $3, $4)
             ON CONFLICT (consumer, topic, partition_id) DO UPDATE
                 SET next_offset = excluded.next_offset, updated_at = ",
            now!()
        ))
        .bind(consumer.as_str())
        .bind(topic)
        .bind(partition)
        .bind(last.saturating_add(1))
        .execute(&mut **tx)
        .await
        .map_err(store_error)?;
        Ok(OffsetClaim::New)
    }

    async fn set_next_offset(
        &self,
        tx: &mut SqliteTx,
        consumer: &ConsumerName,
        topic: &str,
        partition: i32,
        next: i64,
    ) -> Result<(), StoreError> {
        sqlx::query(concat!(
            "UPDATE inbox_offsets SET next_offset = $4, updated_at = ",
            now!(),
            " WHERE consumer = $1 AND topic = $2 AND partition_id = $3"
        ))
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
        tx: &mut SqliteTx,
        consumer: &ConsumerName,
        ids: &[MessageId],
    ) -> Result<Vec<Claim>, StoreError> {
        let texts: Vec<&str> = ids.iter().map(MessageId::as_str).collect();
        let json = serde_json::to_string(&texts).expect("strings serialize");
        // `WHERE true` tells SQLite's parser that ON CONFLICT belongs to the INSERT.
        let rows: Vec<(String, i64, Option<String>)> = sqlx::query_as(concat!(
            "INSERT INTO inbox_messages (consumer, message_id, processed_at)
             SELECT $1, value, ",
            now!(),
            " FROM json_each($2) WHERE true ORDER BY value
             ON CONFLICT (consumer, message_id) DO UPDATE SET processed_at = ",
            now!(),
            "
               WHERE inbox_messages.processed_at IS NULL AND inbox_messages.dead_lettered_at IS NULL
             RETURNING message_id, attempts, last_error"
        ))
        .bind(consumer.as_str())
        .bind(json)
        .fetch_all(&mut **tx)
        .await
        .map_err(store_error)?;
        Ok(super::batch_claims(
            ids,
            rows.into_iter()
                .map(|(id, a, e)| (id, a.clamp(0, i64::from(u32::MAX)) as u32, e)),
        ))
    }

    async fn savepoint(&self, tx: &mut SqliteTx) -> Result<(), StoreError> {
        sqlx::query("SAVEPOINT inbox_message")
            .execute(&mut **tx)
            .await
            .map(drop)
            .map_err(store_error)
    }

    async fn rollback_to_savepoint(&self, tx: &mut SqliteTx) -> Result<(), StoreError> {
        sqlx::query("ROLLBACK TO SAVEPOINT inbox_message")
            .execute(&mut **tx)
            .await
            .map_err(store_error)?;
        self.release_savepoint(tx).await
    }

    async fn release_savepoint(&self, tx: &mut SqliteTx) -> Result<(), StoreError> {
        sqlx::query("RELEASE SAVEPOINT inbox_message")
            .execute(&mut **tx)
            .await
            .map(drop)
            .map_err(store_error)
    }

    async fn release_claim(
        &self,
        tx: &mut SqliteTx,
        consumer: &ConsumerName,
        id: &MessageId,
        failure: Option<(u32, &str)>,
    ) -> Result<(), StoreError> {
        let (attempt, error) = failure.map_or((0, None), |(a, e)| (a, Some(storable_error(e))));
        sqlx::query(
            "UPDATE inbox_messages SET processed_at = NULL,
                attempts = MAX(attempts + CASE WHEN $4 IS NULL THEN 0 ELSE 1 END, $3),
                last_error = COALESCE($4, last_error)
             WHERE consumer = $1 AND message_id = $2",
        )
        .bind(consumer.as_str())
        .bind(id.as_str())
        .bind(i64::from(attempt))
        .bind(error)
        .execute(&mut **tx)
        .await
        .map_err(store_error)?;
        Ok(())
    }

    async fn record_dead_in(
        &self,
        tx: &mut SqliteTx,
        consumer: &ConsumerName,
        id: &MessageId,
        attempts: u32,
        reason: &str,
    ) -> Result<(), StoreError> {
        sqlx::query(concat!(
            "UPDATE inbox_messages SET processed_at = NULL, dead_lettered_at = ",
            now!(),
            ",
                attempts = MAX(attempts, $3), last_error = $4
             WHERE consumer = $1 AND message_id = $2"
        ))
        .bind(consumer.as_str())
        .bind(id.as_str())
        .bind(i64::from(attempts))
        .bind(storable_error(reason))
        .execute(&mut **tx)
        .await
        .map_err(store_error)?;
        Ok(())
    }

    async fn commit(&self, tx: SqliteTx) -> Result<(), StoreError> {
        tx.commit().await.map_err(store_error)
    }

    async fn rollback(&self, tx: SqliteTx) -> Result<(), StoreError> {
        tx.rollback().await.map_err(store_error)
    }

    async fn record_failure(
        &self,
        consumer: &ConsumerName,
        id: &MessageId,
        attempt: u32,
        error: &str,
    ) -> Result<u32, StoreError> {
        let attempts: Option<i64> = sqlx::query_scalar(
            "INSERT INTO inbox_messages (consumer, message_id, attempts, last_error) VALUES ($1, $2, $3, $4)
             ON CONFLICT (consumer, message_id) DO UPDATE
               SET attempts = MAX(inbox_messages.attempts + 1, excluded.attempts),
                   last_error = excluded.last_error
               WHERE inbox_messages.processed_at IS NULL AND inbox_messages.dead_lettered_at IS NULL
             RETURNING attempts",
        )
        .bind(consumer.as_str())
        .bind(id.as_str())
        .bind(i64::from(attempt.max(1)))
        .bind(storable_error(error))
        .fetch_optional(&self.pool)
        .await
        .map_err(store_error)?;
        Ok(attempts
            .unwrap_or(i64::from(attempt))
            .clamp(0, i64::from(u32::MAX)) as u32)
    }

    async fn record_delivery(
        &self,
        consumer: &ConsumerName,
        id: &MessageId,
    ) -> Result<u32, StoreError> {
        let unfinished: Option<i64> = sqlx::query_scalar(
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
        sqlx::query(concat!(
            "INSERT INTO inbox_messages (consumer, message_id, attempts, last_error, dead_lettered_at)
             VALUES ($1, $2, $3, $4, ", now!(), ")
             ON CONFLICT (consumer, message_id) DO UPDATE
               SET attempts = MAX(inbox_messages.attempts, excluded.attempts),
                   last_error = excluded.last_error, dead_lettered_at = ", now!(), "
               WHERE inbox_messages.processed_at IS NULL AND inbox_messages.dead_lettered_at IS NULL"
        ))
        .bind(consumer.as_str())
        .bind(id.as_str())
        .bind(i64::from(attempts))
        .bind(storable_error(reason))
        .execute(&self.pool)
        .await
        .map_err(store_error)?;
        Ok(())
    }

    async fn revive_in(
        &self,
        tx: &mut SqliteTx,
        consumer: &ConsumerName,
        id: &MessageId,
    ) -> Result<bool, StoreError> {
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
        let rows: Vec<(String, i64, i64, i64, i64, i64, Option<f64>)> = sqlx::query_as(concat!(
            "SELECT consumer,
                    count(*),
                    count(processed_at),
                    count(*) FILTER (WHERE processed_at > strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '-1 hour')),
                    count(*) FILTER (WHERE processed_at IS NULL AND dead_lettered_at IS NULL),
                    count(dead_lettered_at),
                    ", age_secs!("min(received_at) FILTER (WHERE processed_at IS NULL AND dead_lettered_at IS NULL)"), "
             FROM inbox_messages
             WHERE $1 IS NULL OR consumer = $1
             GROUP BY consumer ORDER BY consumer"
        ))
        .bind(consumer.map(|c| c.as_str()))
        .fetch_all(&self.pool)
        .await
        .map_err(store_error)?;
        Ok(rows.into_iter().map(ConsumerStats::from_row).collect())
    }
}

#[async_trait]
impl InboxAdmin for SqliteStore {
    async fn migrate(&self) -> Result<(), StoreError> {
        use sqlx::Connection as _;
        let mut conn = self.pool.acquire().await.map_err(store_error)?;
        // Under the database's write lock from the first read: processes migrating one new file
        // at once would otherwise each find a migration pending, and all but one fail applying
        // it. Each migration runs in a savepoint of this transaction.
        let mut locked = conn
            .begin_with("BEGIN IMMEDIATE")
            .await
            .map_err(store_error)?;
        super::migrate::apply!(
            &mut *locked,
            &inbox_migrations::SQLITE,
            create = "CREATE TABLE IF NOT EXISTS inbox_schema_migrations (
                version INTEGER PRIMARY KEY, description TEXT NOT NULL,
                checksum BLOB NOT NULL, applied_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')))",
            insert = "INSERT INTO inbox_schema_migrations (version, description, checksum) VALUES ($1, $2, $3)"
        )?;
        locked.commit().await.map_err(store_error)
    }

    async fn dead_letters(
        &self,
        consumer: Option<&ConsumerName>,
        limit: u32,
    ) -> Result<Vec<DeadLetter>, StoreError> {
        let rows: Vec<(String, String, i64, Option<String>, f64)> = sqlx::query_as(concat!(
            "SELECT consumer, message_id, attempts, last_error, ",
            age_secs!("dead_lettered_at"),
            "
             FROM inbox_messages
             WHERE processed_at IS NULL AND dead_lettered_at IS NOT NULL
               AND ($1 IS NULL OR consumer = $1)
             ORDER BY dead_lettered_at LIMIT $2"
        ))
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
                    attempts: attempts.clamp(0, i64::from(u32::MAX)) as u32,
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
        // SQLite has one writer at a time: each batch is a short write transaction, so claims
        // wait at most one batch.
        let modifier = ago(older_than);
        let mut pacer = Pacer::new(pace);
        let mut report = CleanupReport::default();
        loop {
            let rows = pacer.rows();
            let deleted = sqlx::query(
                "DELETE FROM inbox_messages WHERE rowid IN (
                    SELECT rowid FROM inbox_messages
                    WHERE processed_at IS NOT NULL
                      AND processed_at < strftime('%Y-%m-%dT%H:%M:%fZ', 'now', $1)
                    LIMIT $2)",
            )
            .bind(&modifier)
            .bind(i64::from(rows))
            .execute(&self.pool)
            .await
            .map_err(store_error)?
            .rows_affected();
            report.deleted += deleted;
            report.batches += 1;
            progress(report.deleted);
            if pacer.batch_done(deleted).await {
                return Ok(report);
            }
        }
    }

    async fn count_expired(&self, older_than: Duration) -> Result<u64, StoreError> {
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM inbox_messages
             WHERE processed_at IS NOT NULL
               AND processed_at < strftime('%Y-%m-%dT%H:%M:%fZ', 'now', $1)",
        )
        .bind(ago(older_than))
        .fetch_one(&self.pool)
        .await
        .map_err(store_error)?;
        Ok(u64::try_from(n).unwrap_or(0))
    }
}

/// The `strftime` modifier for "`older_than` before now".
fn ago(older_than: Duration) -> String {
    format!("-{:.3} seconds", older_than.as_secs_f64())
}
