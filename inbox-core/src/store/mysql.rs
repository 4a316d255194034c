//! The MySQL / MariaDB store (InnoDB; MySQL 8.0.16+, MariaDB 10.6+).
//!
//! Three things differ from PostgreSQL and shape this file:
//!
//! - **No `RETURNING` on MySQL, and ambiguous affected-row counts.** sqlx sets
//!   `CLIENT_FOUND_ROWS`, so an `INSERT … ON DUPLICATE KEY UPDATE` answers 1 both for a new row
//!   and for an existing row it left unchanged. The upserts here report what they found through
//!   `LAST_INSERT_ID(expr)` instead: evaluated only on the duplicate path, it puts `expr` into the
//!   statement's OK packet; a plain insert into a table without `AUTO_INCREMENT` reports 0. One
//!   statement, so no window between looking and writing.
//! - **A deadlock rolls back the whole transaction**, and the session carries on in autocommit
//!   mode: a handler that swallowed error 1213 would have its later writes committed one by one
//!   and the final `COMMIT` would succeed with nothing in it — the claim gone, the message acked.
//!   [`commit`](InboxStore::commit) checks first that the transaction is still open, and in a
//!   batch each message's savepoint is released explicitly, which fails once the transaction is
//!   gone — before the next handler can run in autocommit mode.
//! - **Isolation is per transaction.** InnoDB defaults to REPEATABLE READ, under which a read
//!   after waiting on a row lock can see an old snapshot; every transaction this store begins is
//!   READ COMMITTED, whatever the pool's sessions were set to.

use std::str::FromStr;
use std::time::Duration;

use async_trait::async_trait;
use sqlx::mysql::{MySqlConnectOptions, MySqlDatabaseError, MySqlPoolOptions};
use sqlx::{MySql, MySqlPool};

use super::{
    Claim, CleanupPace, CleanupReport, ConsumerStats, DeadLetter, InboxAdmin, InboxStore,
    LockedSession, OffsetClaim, Pacer, storable_error, store_error,
};
use crate::error::StoreError;
use crate::id::{ConsumerName, MessageId};

/// The transaction a MySQL consumer's handler writes through.
pub type MySqlTx = sqlx::Transaction<'static, MySql>;

/// Named locks (`GET_LOCK`, held by a session): migrations and cleanup. Their names are
/// server-wide, so the database's name (hashed, to stay within 64 characters) is added: two
/// schemas on one server do not share them.
const MIGRATE_LOCK: &str = "inbox.migrate.";
const CLEANUP_LOCK: &str = "inbox.cleanup.";

/// Sent as one request: the isolation applies to the transaction it opens only.
pub(crate) const BEGIN: &str = "SET TRANSACTION ISOLATION LEVEL READ COMMITTED; START TRANSACTION";

/// `RELEASE SAVEPOINT` of a savepoint that no longer exists: the transaction was rolled back.
const ER_SP_DOES_NOT_EXIST: u16 = 1305;

/// The probe [`commit`](InboxStore::commit) sends first. Changing the characteristics of the
/// transaction is refused (error 1568) while one is open, on MySQL and MariaDB alike; accepted,
/// it proves the transaction is gone (a deadlock rolled it back). It changes nothing either way:
/// READ WRITE is the default.
const STILL_IN_TRANSACTION: &str = "SET TRANSACTION READ WRITE";
const ER_CANT_CHANGE_TX_CHARACTERISTICS: u16 = 1568;

/// Fails unless `tx` is still open. A transaction can end under its owner: rolled back by a
/// deadlock whose error a handler (or the application) swallowed — what runs after it is
/// autocommitted statement by statement — or committed by a statement that commits implicitly
/// (DDL, LOCK TABLES, START TRANSACTION). A message must then be handled again, not acked, and an
/// outbox row must not be written on its own.
pub(crate) async fn still_in_transaction(tx: &mut MySqlTx) -> Result<(), StoreError> {
    match sqlx::query(STILL_IN_TRANSACTION).execute(&mut **tx).await {
        Err(e) if mysql_number(&e) == Some(ER_CANT_CHANGE_TX_CHARACTERISTICS) => Ok(()),
        Err(e) => Err(store_error(e)),
        Ok(_) => Err(StoreError::Aborted(
            "the transaction had ended: rolled back by the server (a deadlock whose error was \
             not returned) or committed early by a statement that commits implicitly"
                .into(),
        )),
    }
}

/// The inbox on MySQL or MariaDB.
#[derive(Debug, Clone)]
pub struct MySqlStore {
    pool: MySqlPool,
}

impl MySqlStore {
    /// Wraps an existing pool (share it with your application's own queries). Give it the
    /// `after_release` hook [`release_clean`](super::release_clean). The isolation the claim
    /// needs is set per transaction, so the pool's sessions may keep the server's default.
    pub fn new(pool: MySqlPool) -> Self {
        Self { pool }
    }

    /// Connects with a pool of `max_connections`. `url` is `mysql://…` or `mariadb://…`; its
    /// password is never logged. Sessions are READ COMMITTED too, for the application's own
    /// transactions on this pool.
    pub async fn connect(url: &str, max_connections: u32) -> Result<Self, StoreError> {
        let url = match url.strip_prefix("mariadb://") {
            Some(rest) => std::borrow::Cow::Owned(format!("mysql://{rest}")),
            None => std::borrow::Cow::Borrowed(url),
        };
        let options = MySqlConnectOptions::from_str(&url).map_err(store_error)?;
        let pool = MySqlPoolOptions::new()
            .max_connections(max_connections)
            .acquire_timeout(Duration::from_secs(10))
            // As on PostgreSQL: no ping before every BEGIN; a broken connection fails its first
            // statement, transiently.
            .test_before_acquire(false)
            .after_connect(|conn, _| {
                Box::pin(async move {
                    // autocommit on: the store's own single statements (failures, dead marks,
                    // outbox marks) must commit by themselves.
                    sqlx::Executor::execute(
                        conn,
                        "SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED; SET autocommit = 1",
                    )
                    .await
                    .map(drop)
                })
            })
            .after_release(|conn, _| Box::pin(async move { Ok(super::release_clean(conn)) }))
            .connect_with(options)
            .await
            .map_err(store_error)?;
        Ok(Self::new(pool))
    }

    /// The pool, for the application's own queries.
    pub fn pool(&self) -> &MySqlPool {
        &self.pool
    }
}

/// The claim, in one statement. A new row is inserted processed: the OK packet reports 0. An
/// existing row is locked (an upsert takes an exclusive lock on the duplicate, waiting for a
/// concurrent claim's transaction to end, then reads its latest committed state) and reports
/// 1 = processed, 2 = dead, 3 = neither (then taken: marked processed as of this transaction).
/// A concurrent copy's uncommitted insert makes this statement wait too: if that transaction
/// commits, this one finds the row processed; if it rolls back, the row is gone and this one
/// inserts it.
const CLAIM: &str = "\
INSERT INTO inbox_messages (consumer, message_id, received_at, processed_at)
VALUES (?, ?, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6))
ON DUPLICATE KEY UPDATE processed_at = IF(
  LAST_INSERT_ID(CASE WHEN processed_at IS NOT NULL THEN 1
                      WHEN dead_lettered_at IS NOT NULL THEN 2 ELSE 3 END) = 3,
  UTC_TIMESTAMP(6), processed_at)";

const CLAIMED_EXISTING: u64 = 3;
const FOUND_DONE: u64 = 1;

/// `?, ?, …` for `n` parameters.
fn placeholders(n: usize, each: &str) -> String {
    let mut s = String::with_capacity(n * (each.len() + 2));
    for i in 0..n {
        if i > 0 {
            s.push_str(", ");
        }
        s.push_str(each);
    }
    s
}

/// A column holding UTF-8 bytes (ids are VARBINARY), as text.
fn text(bytes: Vec<u8>) -> String {
    String::from_utf8(bytes).unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned())
}

fn mysql_number(error: &sqlx::Error) -> Option<u16> {
    match error {
        sqlx::Error::Database(db) => db
            .try_downcast_ref::<MySqlDatabaseError>()
            .map(|e| e.number()),
        _ => None,
    }
}

#[async_trait]
impl InboxStore for MySqlStore {
    type Tx = MySqlTx;

    async fn begin(&self) -> Result<MySqlTx, StoreError> {
        // On its own task, so that it is never cancelled half-way (see the PostgreSQL store).
        let pool = self.pool.clone();
        tokio::spawn(async move { pool.begin_with(BEGIN).await })
            .await
            .map_err(|e| StoreError::Unavailable(Box::new(e)))?
            .map_err(store_error)
    }

    async fn claim(
        &self,
        tx: &mut MySqlTx,
        consumer: &ConsumerName,
        id: &MessageId,
    ) -> Result<Claim, StoreError> {
        let found = sqlx::query(CLAIM)
            .bind(consumer.as_str())
            .bind(id.as_str())
            .execute(&mut **tx)
            .await
            .map_err(store_error)?
            .last_insert_id();
        match found {
            0 => Ok(Claim::Claimed {
                attempts: 0,
                last_error: None,
            }),
            CLAIMED_EXISTING => {
                // A retry: its failures so far. The claim holds the row's lock.
                let (attempts, last_error): (i32, Option<String>) = sqlx::query_as(
                    "SELECT attempts, last_error FROM inbox_messages WHERE consumer = ? AND message_id = ?",
                )
                .bind(consumer.as_str())
                .bind(id.as_str())
                .fetch_one(&mut **tx)
                .await
                .map_err(store_error)?;
                Ok(Claim::Claimed {
                    attempts: attempts.max(0) as u32,
                    last_error,
                })
            }
            FOUND_DONE => Ok(Claim::Done),
            _ => Ok(Claim::Dead),
        }
    }

    async fn claim_offsets(
        &self,
        tx: &mut MySqlTx,
        consumer: &ConsumerName,
        topic: &str,
        partition: i32,
        (first, last): (i64, i64),
    ) -> Result<OffsetClaim, StoreError> {
        // A locking read sees the latest committed offset (a plain one, the snapshot's) and
        // holds the row until the transaction ends. No row yet: insert it; an insert that
        // collides with another transaction's waits for it, then fails with a duplicate key
        // (the statement only), and the locking read finds the row this time.
        for _ in 0..2 {
            let next: Option<i64> = sqlx::query_scalar(
                "SELECT next_offset FROM inbox_offsets
                 WHERE consumer = ? AND topic = ? AND partition_id = ? FOR UPDATE",
            )
            .bind(consumer.as_str())
            .bind(topic)
            .bind(partition)
            .fetch_optional(&mut **tx)
            .await
            .map_err(store_error)?;
            let moved = match next {
                Some(next) if next > first => return Ok(OffsetClaim::Consumed { next }),
                Some(_) => sqlx::query(
                    "UPDATE inbox_offsets SET next_offset = ?, updated_at = UTC_TIMESTAMP(6)
                     WHERE consumer = ? AND topic = ? AND partition_id = ?",
                )
                .bind(last.saturating_add(1))
                .bind(consumer.as_str())
                .bind(topic)
                .bind(partition)
                .execute(&mut **tx)
                .await
                .map(drop),
                None => sqlx::query(
                    "INSERT INTO inbox_offsets (consumer, topic, partition_id, next_offset)
                     VALUES (?, ?, ?, ?)",
                )
                .bind(consumer.as_str())
                .bind(topic)
                .bind(partition)
                .bind(last.saturating_add(1))
                .execute(&mut **tx)
                .await
                .map(drop),
            };
            match moved {
                Ok(()) => return Ok(OffsetClaim::New),
                Err(sqlx::Error::Database(e)) if e.is_unique_violation() => continue,
                Err(e) => return Err(store_error(e)),
            }
        }
        Err(StoreError::Conflict(
            "the partition's offset row kept colliding with another transaction's".into(),
        ))
    }

    async fn set_next_offset(
        &self,
        tx: &mut MySqlTx,
        consumer: &ConsumerName,
        topic: &str,
        partition: i32,
        next: i64,
    ) -> Result<(), StoreError> {
        sqlx::query(
            "UPDATE inbox_offsets SET next_offset = ?, updated_at = UTC_TIMESTAMP(6)
             WHERE consumer = ? AND topic = ? AND partition_id = ?",
        )
        .bind(next)
        .bind(consumer.as_str())
        .bind(topic)
        .bind(partition)
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
            "SELECT next_offset FROM inbox_offsets WHERE consumer = ? AND topic = ? AND partition_id = ?",
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
        tx: &mut MySqlTx,
        consumer: &ConsumerName,
        ids: &[MessageId],
    ) -> Result<Vec<Claim>, StoreError> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        // Three statements in the claim's transaction, with no window between them: the first
        // inserts the new rows and locks the existing ones (an upsert's exclusive lock, even
        // when it changes nothing), in byte order — the order InnoDB compares VARBINARY in — so
        // overlapping batches never deadlock; from then on no other transaction can change
        // these rows, so the second reads their final state and the third takes the free ones.
        let mut sorted: Vec<&str> = ids.iter().map(MessageId::as_str).collect();
        sorted.sort_unstable();
        let lock = format!(
            "INSERT INTO inbox_messages (consumer, message_id, received_at) VALUES {}
             ON DUPLICATE KEY UPDATE attempts = attempts",
            placeholders(sorted.len(), "(?, ?, UTC_TIMESTAMP(6))")
        );
        // Not prepared: each batch size is a statement of its own, and prepared ones would
        // pile up against the server's max_prepared_stmt_count.
        let mut query = sqlx::query(&lock).persistent(false);
        for id in &sorted {
            query = query.bind(consumer.as_str()).bind(*id);
        }
        query.execute(&mut **tx).await.map_err(store_error)?;

        let select = format!(
            "SELECT message_id, attempts, last_error FROM inbox_messages
             WHERE consumer = ? AND message_id IN ({})
               AND processed_at IS NULL AND dead_lettered_at IS NULL",
            placeholders(sorted.len(), "?")
        );
        let mut query = sqlx::query_as(&select)
            .persistent(false)
            .bind(consumer.as_str());
        for id in &sorted {
            query = query.bind(*id);
        }
        let free: Vec<(Vec<u8>, i32, Option<String>)> =
            query.fetch_all(&mut **tx).await.map_err(store_error)?;

        if !free.is_empty() {
            let take = format!(
                "UPDATE inbox_messages SET processed_at = UTC_TIMESTAMP(6)
                 WHERE consumer = ? AND message_id IN ({})",
                placeholders(free.len(), "?")
            );
            let mut query = sqlx::query(&take).persistent(false).bind(consumer.as_str());
            for (id, _, _) in &free {
                query = query.bind(id.as_slice());
            }
            query.execute(&mut **tx).await.map_err(store_error)?;
        }
        Ok(super::batch_claims(
            ids,
            free.into_iter()
                .map(|(id, attempts, e)| (text(id), attempts.max(0) as u32, e)),
        ))
    }

    async fn savepoint(&self, tx: &mut MySqlTx) -> Result<(), StoreError> {
        // A savepoint of an existing name replaces it, so one name serves every message.
        sqlx::query("SAVEPOINT inbox_message")
            .execute(&mut **tx)
            .await
            .map(drop)
            .map_err(store_error)
    }

    async fn rollback_to_savepoint(&self, tx: &mut MySqlTx) -> Result<(), StoreError> {
        sqlx::query("ROLLBACK TO SAVEPOINT inbox_message")
            .execute(&mut **tx)
            .await
            .map(drop)
            .map_err(store_error)
    }

    async fn release_savepoint(&self, tx: &mut MySqlTx) -> Result<(), StoreError> {
        // Sent, unlike on PostgreSQL, for what it proves: a deadlock that a handler swallowed
        // rolled back the whole batch and left the session in autocommit mode, where the next
        // handler's writes would commit one by one. The savepoint is gone with the transaction,
        // so this fails there and the batch goes the per-message way.
        match sqlx::query("RELEASE SAVEPOINT inbox_message")
            .execute(&mut **tx)
            .await
        {
            Ok(_) => Ok(()),
            Err(e) if mysql_number(&e) == Some(ER_SP_DOES_NOT_EXIST) => {
                Err(StoreError::Aborted(Box::new(e)))
            }
            Err(e) => Err(store_error(e)),
        }
    }

    async fn release_claim(
        &self,
        tx: &mut MySqlTx,
        consumer: &ConsumerName,
        id: &MessageId,
        failure: Option<(u32, &str)>,
    ) -> Result<(), StoreError> {
        let (attempt, error) = failure.map_or((0, None), |(a, e)| (a, Some(storable_error(e))));
        sqlx::query(
            "UPDATE inbox_messages SET processed_at = NULL,
                attempts = GREATEST(attempts + ?, ?),
                last_error = COALESCE(?, last_error)
             WHERE consumer = ? AND message_id = ?",
        )
        .bind(i32::from(error.is_some()))
        .bind(attempt as i32)
        .bind(error)
        .bind(consumer.as_str())
        .bind(id.as_str())
        .execute(&mut **tx)
        .await
        .map_err(store_error)?;
        Ok(())
    }

    async fn record_dead_in(
        &self,
        tx: &mut MySqlTx,
        consumer: &ConsumerName,
        id: &MessageId,
        attempts: u32,
        reason: &str,
    ) -> Result<(), StoreError> {
        sqlx::query(
            "UPDATE inbox_messages SET processed_at = NULL, dead_lettered_at = UTC_TIMESTAMP(6),
                attempts = GREATEST(attempts, ?), last_error = ?
             WHERE consumer = ? AND message_id = ?",
        )
        .bind(attempts as i32)
        .bind(storable_error(reason))
        .bind(consumer.as_str())
        .bind(id.as_str())
        .execute(&mut **tx)
        .await
        .map_err(store_error)?;
        Ok(())
    }

    async fn commit(&self, mut tx: MySqlTx) -> Result<(), StoreError> {
        if let Err(e) = still_in_transaction(&mut tx).await {
            let _ = tx.rollback().await;
            return Err(e);
        }
        tx.commit().await.map_err(store_error)
    }

    async fn rollback(&self, tx: MySqlTx) -> Result<(), StoreError> {
        tx.rollback().await.map_err(store_error)
    }

    async fn record_failure(
        &self,
        consumer: &ConsumerName,
        id: &MessageId,
        attempt: u32,
        error: &str,
    ) -> Result<u32, StoreError> {
        // Reports (through LAST_INSERT_ID) 1 for a row processed or dead by now (left alone),
        // else the attempts recorded plus one; 0 for a new row.
        let attempt = attempt.max(1) as i32;
        let error = storable_error(error);
        let found = sqlx::query(
            "INSERT INTO inbox_messages (consumer, message_id, received_at, attempts, last_error)
             VALUES (?, ?, UTC_TIMESTAMP(6), ?, ?)
             ON DUPLICATE KEY UPDATE
               attempts = IF(processed_at IS NULL AND dead_lettered_at IS NULL,
                             LAST_INSERT_ID(GREATEST(attempts + 1, ?) + 1) - 1,
                             attempts + 0 * LAST_INSERT_ID(1)),
               last_error = IF(processed_at IS NULL AND dead_lettered_at IS NULL, ?, last_error)",
        )
        .bind(consumer.as_str())
        .bind(id.as_str())
        .bind(attempt)
        .bind(&error)
        .bind(attempt)
        .bind(&error)
        .execute(&self.pool)
        .await
        .map_err(store_error)?
        .last_insert_id();
        Ok(match found {
            0 | 1 => attempt as u32,
            n => u32::try_from(n - 1).unwrap_or(u32::MAX),
        })
    }

    async fn record_delivery(
        &self,
        consumer: &ConsumerName,
        id: &MessageId,
    ) -> Result<u32, StoreError> {
        // LAST_INSERT_ID: 0 for a new row (counted 1), 1 for one processed or dead (0), else
        // the new count plus one.
        let found = sqlx::query(
            "INSERT INTO inbox_messages (consumer, message_id, received_at, unfinished)
             VALUES (?, ?, UTC_TIMESTAMP(6), 1)
             ON DUPLICATE KEY UPDATE unfinished = IF(
               processed_at IS NULL AND dead_lettered_at IS NULL,
               LAST_INSERT_ID(unfinished + 2) - 1, unfinished + 0 * LAST_INSERT_ID(1))",
        )
        .bind(consumer.as_str())
        .bind(id.as_str())
        .execute(&self.pool)
        .await
        .map_err(store_error)?
        .last_insert_id();
        Ok(match found {
            0 => 1,
            1 => 0,
            n => u32::try_from(n - 1).unwrap_or(u32::MAX),
        })
    }

    async fn record_dead(
        &self,
        consumer: &ConsumerName,
        id: &MessageId,
        attempts: u32,
        reason: &str,
    ) -> Result<(), StoreError> {
        // Assignments run left to right: `dead_lettered_at` last, so the others still see it
        // unset.
        let reason = storable_error(reason);
        sqlx::query(
            "INSERT INTO inbox_messages (consumer, message_id, received_at, attempts, last_error, dead_lettered_at)
             VALUES (?, ?, UTC_TIMESTAMP(6), ?, ?, UTC_TIMESTAMP(6))
             ON DUPLICATE KEY UPDATE
               attempts = IF(processed_at IS NULL AND dead_lettered_at IS NULL, GREATEST(attempts, ?), attempts),
               last_error = IF(processed_at IS NULL AND dead_lettered_at IS NULL, ?, last_error),
               dead_lettered_at = IF(processed_at IS NULL AND dead_lettered_at IS NULL,
                                     UTC_TIMESTAMP(6), dead_lettered_at)",
        )
        .bind(consumer.as_str())
        .bind(id.as_str())
        .bind(attempts as i32)
        .bind(&reason)
        .bind(attempts as i32)
        .bind(&reason)
        .execute(&self.pool)
        .await
        .map_err(store_error)?;
        Ok(())
    }

    async fn revive_in(
        &self,
        tx: &mut MySqlTx,
        consumer: &ConsumerName,
        id: &MessageId,
    ) -> Result<bool, StoreError> {
        let done = sqlx::query(
            "UPDATE inbox_messages SET dead_lettered_at = NULL, attempts = 0, unfinished = 0
             WHERE consumer = ? AND message_id = ? AND dead_lettered_at IS NOT NULL",
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
        let rows: Vec<(Vec<u8>, i64, i64, i64, i64, i64, Option<f64>)> = sqlx::query_as(
            "SELECT consumer,
                    COUNT(*),
                    COUNT(processed_at),
                    COUNT(CASE WHEN processed_at > UTC_TIMESTAMP(6) - INTERVAL 1 HOUR THEN 1 END),
                    COUNT(CASE WHEN processed_at IS NULL AND dead_lettered_at IS NULL THEN 1 END),
                    COUNT(dead_lettered_at),
                    TIMESTAMPDIFF(MICROSECOND,
                        MIN(CASE WHEN processed_at IS NULL AND dead_lettered_at IS NULL THEN received_at END),
                        UTC_TIMESTAMP(6)) / 1e6
             FROM inbox_messages
             WHERE ? IS NULL OR consumer = ?
             GROUP BY consumer ORDER BY consumer",
        )
        .bind(consumer.map(|c| c.as_str()))
        .bind(consumer.map(|c| c.as_str()))
        .fetch_all(&self.pool)
        .await
        .map_err(store_error)?;
        Ok(rows
            .into_iter()
            .map(|(c, rows, processed, hour, failing, dead, oldest)| {
                ConsumerStats::from_row((text(c), rows, processed, hour, failing, dead, oldest))
            })
            .collect())
    }
}

impl MySqlStore {
    /// Takes the named lock `name` on a connection of its own, waiting up to `wait` (0: try
    /// once). `None`: another session holds it.
    async fn lock_session(
        &self,
        name: &str,
        wait: Duration,
    ) -> Result<Option<LockedSession<MySql>>, StoreError> {
        let mut held = LockedSession::new(self.pool.acquire().await.map_err(store_error)?);
        let conn = held.0.as_mut().expect("just set");
        let got: Option<i64> = sqlx::query_scalar("SELECT GET_LOCK(CONCAT(?, MD5(DATABASE())), ?)")
            .bind(name)
            .bind(wait.as_secs() as i64)
            .fetch_one(&mut **conn)
            .await
            .map_err(store_error)?;
        if got == Some(1) {
            Ok(Some(held))
        } else {
            held.release();
            Ok(None)
        }
    }

    /// Releases the named lock and returns the connection to the pool (or closes it, if the
    /// release failed).
    async fn unlock_session(mut held: LockedSession<MySql>, name: &str) {
        let Some(conn) = held.0.as_mut() else { return };
        let unlocked = sqlx::query("SELECT RELEASE_LOCK(CONCAT(?, MD5(DATABASE())))")
            .bind(name)
            .execute(&mut **conn)
            .await;
        if unlocked.is_ok() {
            held.release();
        }
    }
}

#[async_trait]
impl InboxAdmin for MySqlStore {
    async fn migrate(&self) -> Result<(), StoreError> {
        let Some(mut held) = self
            .lock_session(MIGRATE_LOCK, Duration::from_secs(300))
            .await?
        else {
            return Err(StoreError::Migration(
                "another process held the migration lock for 5 minutes".into(),
            ));
        };
        let conn = held.0.as_mut().expect("locked");
        // MySQL commits DDL implicitly, so a migration and its bookkeeping row are not one
        // transaction here; the migrations are written to be re-run (IF NOT EXISTS) should a
        // crash fall between the two.
        let result = async {
            super::migrate::apply!(
                &mut **conn,
                &inbox_migrations::MYSQL,
                create = "CREATE TABLE IF NOT EXISTS inbox_schema_migrations (
                    version BIGINT PRIMARY KEY, description TEXT NOT NULL,
                    checksum BLOB NOT NULL,
                    applied_at DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6))) ENGINE = InnoDB",
                insert = "INSERT INTO inbox_schema_migrations (version, description, checksum) VALUES (?, ?, ?)"
            )
        }
        .await;
        Self::unlock_session(held, MIGRATE_LOCK).await;
        result
    }

    async fn dead_letters(
        &self,
        consumer: Option<&ConsumerName>,
        limit: u32,
    ) -> Result<Vec<DeadLetter>, StoreError> {
        let rows: Vec<(Vec<u8>, Vec<u8>, i32, Option<String>, f64)> = sqlx::query_as(
            "SELECT consumer, message_id, attempts, last_error,
                    TIMESTAMPDIFF(MICROSECOND, dead_lettered_at, UTC_TIMESTAMP(6)) / 1e6
             FROM inbox_messages
             WHERE processed_at IS NULL AND dead_lettered_at IS NOT NULL
               AND (? IS NULL OR consumer = ?)
             ORDER BY dead_lettered_at LIMIT ?",
        )
        .bind(consumer.map(|c| c.as_str()))
        .bind(consumer.map(|c| c.as_str()))
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await
        .map_err(store_error)?;
        Ok(rows
            .into_iter()
            .map(
                |(consumer, message_id, attempts, last_error, age)| DeadLetter {
                    consumer: text(consumer),
                    message_id: text(message_id),
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
        let Some(mut held) = self.lock_session(CLEANUP_LOCK, Duration::ZERO).await? else {
            return Ok(CleanupReport {
                skipped_locked: true,
                ..CleanupReport::default()
            });
        };
        let conn = held.0.as_mut().expect("locked");
        let mut pacer = Pacer::new(pace);
        let mut report = CleanupReport::default();
        let result: Result<(), StoreError> = async {
            loop {
                let rows = pacer.rows();
                // Autocommitted, one bounded batch at a time, oldest first along the
                // processed_at index. A row a duplicate's claim holds is waited for (a claim's
                // transaction is short); InnoDB has no SKIP LOCKED for DELETE.
                // In a READ COMMITTED transaction of its own: under the REPEATABLE READ a pool
                // the application hands in may have, the range delete would take gap locks
                // that block inserts of new rows.
                let mut tx = sqlx::Connection::begin_with(&mut **conn, BEGIN)
                    .await
                    .map_err(store_error)?;
                let deleted = sqlx::query(
                    "DELETE FROM inbox_messages
                     WHERE processed_at IS NOT NULL
                       AND processed_at < UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND
                     ORDER BY processed_at LIMIT ?",
                )
                .bind(older_than.as_micros().min(i64::MAX as u128) as i64)
                .bind(rows)
                .execute(&mut *tx)
                .await
                .map_err(store_error)?
                .rows_affected();
                tx.commit().await.map_err(store_error)?;
                report.deleted += deleted;
                report.batches += 1;
                progress(report.deleted);
                if pacer.batch_done(deleted).await {
                    return Ok(());
                }
            }
        }
        .await;
        Self::unlock_session(held, CLEANUP_LOCK).await;
        result.map(|()| report)
    }

    async fn count_expired(&self, older_than: Duration) -> Result<u64, StoreError> {
        let n: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM inbox_messages
             WHERE processed_at IS NOT NULL
               AND processed_at < UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND",
        )
        .bind(older_than.as_micros().min(i64::MAX as u128) as i64)
        .fetch_one(&self.pool)
        .await
        .map_err(store_error)?;
        Ok(u64::try_from(n).unwrap_or(0))
    }
}
