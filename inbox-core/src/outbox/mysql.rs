//! The outbox on MySQL / MariaDB.
//!
//! Order per key (DESIGN.md's rule 1, with a lock row instead of a counter): a writer of a keyed
//! row first upserts the key's row in `outbox_keys` — which locks it until the transaction ends —
//! and only then inserts the outbox row, whose `AUTO_INCREMENT` id is taken at that insert.
//! Writers of one key therefore take ids in the order they commit, and the relay publishes the
//! first pending row of each key and nothing after it until that one is marked. MySQL's named
//! locks (`GET_LOCK`) were rejected: they belong to the session, not the transaction, so a
//! transaction committed by the application's own code would leave its keys locked. The lock
//! rows hold no state: deleting one is always safe (the next writer inserts it again), and the
//! relay's cleanup deletes those whose key has nothing pending.

use std::time::Duration;

use async_trait::async_trait;

use super::codec::{encode_headers, traceparent};
use super::{OutboxBatch, OutboxDeadRow, OutboxStats, OutboxStore, PublishFailure};
use crate::error::StoreError;
use crate::message::OutgoingMessage;
use crate::store::mysql::{MySqlStore, MySqlTx};
use crate::store::{storable_error, store_error};

/// Reports the row's id through `LAST_INSERT_ID`: the new id when it inserts; when the message
/// is there already, the existing id negated (an unsigned 64-bit value above `i64::MAX`), since
/// with `CLIENT_FOUND_ROWS` the affected-row count is 1 either way.
const INSERT: &str = "\
INSERT INTO outbox_messages
  (destination, message_id, ordering_key, payload, headers, traceparent, created_at, available_at)
VALUES (?, ?, ?, ?, ?, ?, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6))
ON DUPLICATE KEY UPDATE id = id + 0 * LAST_INSERT_ID(-id)";

const LOCK_KEY: &str = "\
INSERT INTO outbox_keys (destination, ordering_key) VALUES (?, ?)
ON DUPLICATE KEY UPDATE ordering_key = ordering_key";

/// Pending, due, not leased, and the first pending row of its key (a dead or failing head holds
/// its key back). SKIP LOCKED: two relays claiming at once take different rows.
const CLAIM: &str = "\
SELECT c.id, CONVERT(c.destination USING utf8mb4), CONVERT(c.message_id USING utf8mb4),
       CONVERT(c.ordering_key USING utf8mb4), c.payload, c.headers,
       CAST(c.attempts AS SIGNED), CAST(c.no_routes AS SIGNED),
       TIMESTAMPDIFF(MICROSECOND, c.created_at, UTC_TIMESTAMP(6)) / 1e6
FROM outbox_messages c
WHERE c.published_at IS NULL AND c.dead_at IS NULL
  AND c.available_at <= UTC_TIMESTAMP(6)
  AND (c.lease_until IS NULL OR c.lease_until < UTC_TIMESTAMP(6))
  AND (c.ordering_key IS NULL OR NOT EXISTS (
    SELECT 1 FROM outbox_messages e
    WHERE e.destination = c.destination AND e.ordering_key = c.ordering_key
      AND e.published_at IS NULL AND e.id < c.id))
ORDER BY c.id
LIMIT ?
FOR UPDATE SKIP LOCKED";

/// `?, ?, …` for `n` parameters.
fn placeholders(n: usize) -> String {
    vec!["?"; n].join(", ")
}

/// Binds `ids` to `query`, in order.
macro_rules! bind_all {
    ($query:expr, $ids:expr) => {{
        let mut query = $query;
        for id in $ids {
            query = query.bind(*id);
        }
        query
    }};
}

#[async_trait]
impl OutboxStore for MySqlStore {
    async fn insert_outbox(
        &self,
        tx: &mut MySqlTx,
        destination: &str,
        message_id: &str,
        message: &OutgoingMessage,
        ordering_key: Option<&str>,
    ) -> Result<(i64, bool), StoreError> {
        // Written alone, an outbox row would publish a change that was rolled back.
        crate::store::mysql::still_in_transaction(tx).await?;
        if let Some(key) = ordering_key {
            sqlx::query(LOCK_KEY)
                .bind(destination)
                .bind(key)
                .execute(&mut **tx)
                .await
                .map_err(store_error)?;
        }
        let reported = sqlx::query(INSERT)
            .bind(destination)
            .bind(message_id)
            .bind(ordering_key)
            .bind(message.payload.as_ref())
            .bind(encode_headers(&message.headers))
            .bind(traceparent(message))
            .execute(&mut **tx)
            .await
            .map_err(store_error)?
            .last_insert_id() as i64;
        Ok(if reported < 0 {
            (-reported, false)
        } else {
            (reported, true)
        })
    }

    async fn claim_outbox(&self, limit: u32, lease: Duration) -> Result<OutboxBatch, StoreError> {
        let token = uuid::Uuid::new_v4().to_string();
        let token = token.as_str();
        type Row = (
            i64,
            String,
            String,
            Option<String>,
            Vec<u8>,
            String,
            i64,
            i64,
            f64,
        );
        // No UPDATE … WHERE id IN (SELECT … FROM the same table) on MySQL: the rows are picked
        // and locked first, then leased, in one short transaction.
        // `begin` runs on a task of its own: never cancelled half-way (see the store).
        let mut tx = crate::InboxStore::begin(self).await?;
        let rows: Vec<Row> = sqlx::query_as(CLAIM)
            .bind(i64::from(limit))
            .fetch_all(&mut *tx)
            .await
            .map_err(store_error)?;
        if rows.is_empty() {
            tx.rollback().await.map_err(store_error)?;
            return Ok(OutboxBatch::empty());
        }
        let ids: Vec<i64> = rows.iter().map(|r| r.0).collect();
        // No later than the database's start of the lease.
        let started = std::time::Instant::now();
        let lease_sql = format!(
            "UPDATE outbox_messages
             SET lease_token = ?, lease_until = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND
             WHERE id IN ({})",
            placeholders(ids.len())
        );
        bind_all!(
            sqlx::query(&lease_sql)
                .bind(token)
                .bind(lease.as_micros().min(i64::MAX as u128) as i64),
            &ids
        )
        .execute(&mut *tx)
        .await
        .map_err(store_error)?;
        tx.commit().await.map_err(store_error)?;
        let rows = rows
            .into_iter()
            .map(
                |(id, destination, message_id, key, payload, headers, attempts, no_routes, age)| {
                    super::row(
                        id,
                        destination,
                        message_id,
                        key,
                        payload,
                        &headers,
                        (attempts, no_routes),
                        age,
                    )
                },
            )
            .collect();
        Ok(super::leased(self, token, rows, started))
    }

    async fn outbox_pending_stats(&self) -> Result<Vec<OutboxStats>, StoreError> {
        type Row = (String, i64, i64, i64, i64, i64, Option<f64>);
        // `published_at IS NULL`: a range of `outbox_messages_pending (published_at, id)`, so
        // the kept rows are not read.
        let rows: Vec<Row> = sqlx::query_as(
            "SELECT CONVERT(destination USING utf8mb4),
                    COUNT(*),
                    COUNT(CASE WHEN dead_at IS NULL AND attempts > 0 THEN 1 END),
                    COUNT(dead_at),
                    COUNT(DISTINCT CASE WHEN dead_at IS NOT NULL OR attempts > 0 THEN ordering_key END),
                    0,
                    TIMESTAMPDIFF(MICROSECOND,
                        MIN(CASE WHEN dead_at IS NULL THEN created_at END),
                        UTC_TIMESTAMP(6)) / 1e6
             FROM outbox_messages FORCE INDEX (outbox_messages_pending)
             WHERE published_at IS NULL GROUP BY destination",
        )
        .fetch_all(self.pool())
        .await
        .map_err(store_error)?;
        Ok(rows.into_iter().map(super::stats).collect())
    }

    async fn outbox_kept(&self) -> Result<Vec<(String, u64)>, StoreError> {
        let rows: Vec<(String, i64)> = sqlx::query_as(
            "SELECT CONVERT(destination USING utf8mb4), COUNT(*) FROM outbox_messages
             WHERE published_at IS NOT NULL GROUP BY destination",
        )
        .fetch_all(self.pool())
        .await
        .map_err(store_error)?;
        Ok(super::kept(rows))
    }

    async fn outbox_dead(&self, limit: u32) -> Result<Vec<OutboxDeadRow>, StoreError> {
        type Row = (
            i64,
            String,
            String,
            Option<String>,
            i64,
            Option<String>,
            f64,
        );
        let rows: Vec<Row> = sqlx::query_as(
            "SELECT id, CONVERT(destination USING utf8mb4), CONVERT(message_id USING utf8mb4),
                    CONVERT(ordering_key USING utf8mb4), CAST(attempts AS SIGNED), last_error,
                    TIMESTAMPDIFF(MICROSECOND, created_at, UTC_TIMESTAMP(6)) / 1e6
             FROM outbox_messages FORCE INDEX (outbox_messages_pending)
             WHERE published_at IS NULL AND dead_at IS NOT NULL ORDER BY id LIMIT ?",
        )
        .bind(i64::from(limit))
        .fetch_all(self.pool())
        .await
        .map_err(store_error)?;
        Ok(rows
            .into_iter()
            .map(|(id, d, m, k, a, e, age)| super::dead_row(id, d, m, k, a, e, age))
            .collect())
    }

    async fn outbox_retry(&self, ids: Option<&[i64]>) -> Result<u64, StoreError> {
        const RETRY: &str = "UPDATE outbox_messages
             SET dead_at = NULL, attempts = 0, no_routes = 0, available_at = UTC_TIMESTAMP(6)
             WHERE published_at IS NULL AND dead_at IS NOT NULL";
        let done = match ids {
            None => sqlx::query(RETRY).execute(self.pool()).await,
            Some([]) => return Ok(0),
            Some(ids) => {
                let sql = format!("{RETRY} AND id IN ({})", placeholders(ids.len()));
                bind_all!(sqlx::query(&sql), ids).execute(self.pool()).await
            }
        }
        .map_err(store_error)?;
        Ok(done.rows_affected())
    }

    async fn outbox_skip(&self, ids: &[i64]) -> Result<u64, StoreError> {
        if ids.is_empty() {
            return Ok(0);
        }
        let sql = format!(
            "DELETE FROM outbox_messages
             WHERE published_at IS NULL AND (dead_at IS NOT NULL OR attempts > 0) AND id IN ({})",
            placeholders(ids.len())
        );
        let done = bind_all!(sqlx::query(&sql), ids)
            .execute(self.pool())
            .await
            .map_err(store_error)?;
        Ok(done.rows_affected())
    }

    async fn outbox_cleanup(&self, older_than: Duration, limit: u32) -> Result<u64, StoreError> {
        // READ COMMITTED transactions of their own: under REPEATABLE READ (a pool the
        // application hands in) these range deletes would take gap locks that block senders.
        let mut tx = crate::InboxStore::begin(self).await?;
        let done = sqlx::query(
            "DELETE FROM outbox_messages
             WHERE published_at IS NOT NULL
               AND published_at < UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND
             ORDER BY published_at LIMIT ?",
        )
        .bind(older_than.as_micros().min(i64::MAX as u128) as i64)
        .bind(i64::from(limit))
        .execute(&mut *tx)
        .await
        .map_err(store_error)?;
        tx.commit().await.map_err(store_error)?;
        let mut tx = crate::InboxStore::begin(self).await?;
        // Lock rows of keys with nothing pending. Safe whatever this statement reads: a key row
        // only orders writers that overlap, and one deleted under a finished writer is inserted
        // again by the next.
        sqlx::query(
            "DELETE FROM outbox_keys
             WHERE NOT EXISTS (
               SELECT 1 FROM outbox_messages m
               WHERE m.destination = outbox_keys.destination
                 AND m.ordering_key = outbox_keys.ordering_key AND m.published_at IS NULL)
             LIMIT ?",
        )
        .bind(i64::from(limit))
        .execute(&mut *tx)
        .await
        .map_err(store_error)?;
        tx.commit().await.map_err(store_error)?;
        Ok(done.rows_affected())
    }
}

#[async_trait]
impl super::TokenLeases for MySqlStore {
    async fn mark_leased(&self, token: &str, ids: &[i64], keep: bool) -> Result<u64, StoreError> {
        if ids.is_empty() {
            return Ok(0);
        }
        let sql = if keep {
            format!(
                "UPDATE outbox_messages
                 SET published_at = UTC_TIMESTAMP(6), lease_token = NULL, lease_until = NULL
                 WHERE lease_token = ? AND id IN ({})",
                placeholders(ids.len())
            )
        } else {
            format!(
                "DELETE FROM outbox_messages WHERE lease_token = ? AND id IN ({})",
                placeholders(ids.len())
            )
        };
        let done = bind_all!(sqlx::query(&sql).bind(token), ids)
            .execute(self.pool())
            .await
            .map_err(store_error)?;
        Ok(done.rows_affected())
    }

    async fn fail_leased(
        &self,
        token: &str,
        failures: &[PublishFailure],
    ) -> Result<(), StoreError> {
        // `begin` runs on a task of its own: never cancelled half-way (see the store).
        let mut tx = crate::InboxStore::begin(self).await?;
        for failure in failures {
            sqlx::query(
                "UPDATE outbox_messages
                 SET attempts = attempts + 1, no_routes = no_routes + ?, last_error = ?,
                     available_at = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND,
                     dead_at = IF(?, UTC_TIMESTAMP(6), NULL),
                     lease_token = NULL, lease_until = NULL
                 WHERE id = ? AND lease_token = ?",
            )
            .bind(i32::from(failure.no_route))
            .bind(storable_error(&failure.error))
            .bind(failure.retry_after.as_micros().min(i64::MAX as u128) as i64)
            .bind(failure.dead)
            .bind(failure.id)
            .bind(token)
            .execute(&mut *tx)
            .await
            .map_err(store_error)?;
        }
        tx.commit().await.map_err(store_error)
    }
}
