//! The outbox on SQLite. One writer at a time: a row's id is taken under the database's write
//! lock, so id order is commit order, and publishing each key's rows in id order keeps the order
//! they were written in without a lock of our own.

use std::time::Duration;

use async_trait::async_trait;

use super::codec::{encode_headers, traceparent};
use super::{OutboxBatch, OutboxDeadRow, OutboxRow, OutboxStats, OutboxStore, PublishFailure};
use crate::error::StoreError;
use crate::message::OutgoingMessage;
use crate::store::sqlite::{SqliteStore, SqliteTx};
use crate::store::{storable_error, store_error};

/// `now` as stored: UTC ISO-8601 with milliseconds, which sorts chronologically.
macro_rules! now {
    () => {
        "strftime('%Y-%m-%dT%H:%M:%fZ', 'now')"
    };
}

/// `now` plus a bound number of milliseconds.
macro_rules! now_plus_ms {
    ($param:literal) => {
        concat!(
            "strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '+' || (",
            $param,
            " / 1000.0) || ' seconds')"
        )
    };
}

/// Seconds since a stored timestamp.
macro_rules! age_secs {
    ($col:literal) => {
        concat!("((julianday('now') - julianday(", $col, ")) * 86400.0)")
    };
}

const CLAIM: &str = concat!(
    "UPDATE outbox_messages SET lease_token = $1, lease_until = ",
    now_plus_ms!("$2"),
    "
WHERE id IN (
  SELECT c.id FROM outbox_messages c
  WHERE c.published_at IS NULL AND c.dead_at IS NULL
    AND c.available_at <= ",
    now!(),
    "
    AND (c.lease_until IS NULL OR c.lease_until < ",
    now!(),
    ")
    AND (c.ordering_key IS NULL OR NOT EXISTS (
      SELECT 1 FROM outbox_messages e
      WHERE e.destination = c.destination AND e.ordering_key = c.ordering_key
        AND e.published_at IS NULL AND e.id < c.id))
  ORDER BY c.id
  LIMIT $3)
RETURNING id, destination, message_id, ordering_key, payload, headers, attempts, no_routes, ",
    age_secs!("created_at")
);

#[async_trait]
impl OutboxStore for SqliteStore {
    async fn insert_outbox(
        &self,
        tx: &mut SqliteTx,
        destination: &str,
        message_id: &str,
        message: &OutgoingMessage,
        ordering_key: Option<&str>,
    ) -> Result<(i64, bool), StoreError> {
        let inserted: Option<i64> = sqlx::query_scalar(
            "INSERT INTO outbox_messages (destination, message_id, ordering_key, payload, headers, traceparent)
             VALUES ($1, $2, $3, $4, $5, $6)
             ON CONFLICT (destination, message_id) DO NOTHING
             RETURNING id",
        )
        .bind(destination)
        .bind(message_id)
        .bind(ordering_key)
        .bind(message.payload.as_ref())
        .bind(encode_headers(&message.headers))
        .bind(traceparent(message))
        .fetch_optional(&mut **tx)
        .await
        .map_err(store_error)?;
        if let Some(id) = inserted {
            return Ok((id, true));
        }
        let existing: Option<i64> = sqlx::query_scalar(
            "SELECT id FROM outbox_messages WHERE destination = $1 AND message_id = $2",
        )
        .bind(destination)
        .bind(message_id)
        .fetch_optional(&mut **tx)
        .await
        .map_err(store_error)?;
        match existing {
            Some(id) => Ok((id, false)),
            // Published and deleted between the two statements: the send's dedup ends with the
            // row, so this is a new row (a duplicate the consumer's inbox discards).
            None => {
                Box::pin(self.insert_outbox(tx, destination, message_id, message, ordering_key))
                    .await
            }
        }
    }

    async fn claim_outbox(&self, limit: u32, lease: Duration) -> Result<OutboxBatch, StoreError> {
        let token = uuid::Uuid::new_v4().to_string();
        let token = token.as_str();
        // No later than the database's start of the lease.
        let started = std::time::Instant::now();
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
        let rows: Vec<Row> = sqlx::query_as(CLAIM)
            .bind(token)
            .bind(lease.as_millis() as f64)
            .bind(i64::from(limit))
            .fetch_all(self.pool())
            .await
            .map_err(store_error)?;
        let mut rows: Vec<OutboxRow> = rows
            .into_iter()
            .map(
                |(id, destination, message_id, key, payload, headers, attempts, no_routes, age)| {
                    let counts = (attempts, no_routes);
                    super::row(
                        id,
                        destination,
                        message_id,
                        key,
                        payload,
                        &headers,
                        counts,
                        age,
                    )
                },
            )
            .collect();
        rows.sort_by_key(|r| r.id);
        Ok(super::leased(self, token, rows, started))
    }

    async fn outbox_pending_stats(&self) -> Result<Vec<OutboxStats>, StoreError> {
        type Row = (String, i64, i64, i64, i64, i64, Option<f64>);
        // `published_at IS NULL`: the partial index `outbox_messages_pending`, so the kept rows
        // are not read.
        let rows: Vec<Row> = sqlx::query_as(concat!(
            "SELECT destination,
                    count(*),
                    count(*) FILTER (WHERE dead_at IS NULL AND attempts > 0),
                    count(*) FILTER (WHERE dead_at IS NOT NULL),
                    count(DISTINCT ordering_key) FILTER (WHERE dead_at IS NOT NULL OR attempts > 0),
                    0,
                    max(",
            age_secs!("created_at"),
            ") FILTER (WHERE dead_at IS NULL)
             FROM outbox_messages INDEXED BY outbox_messages_pending
             WHERE published_at IS NULL GROUP BY destination"
        ))
        .fetch_all(self.pool())
        .await
        .map_err(store_error)?;
        Ok(rows.into_iter().map(super::stats).collect())
    }

    async fn outbox_kept(&self) -> Result<Vec<(String, u64)>, StoreError> {
        let rows: Vec<(String, i64)> = sqlx::query_as(super::KEPT)
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
        let rows: Vec<Row> = sqlx::query_as(concat!(
            "SELECT id, destination, message_id, ordering_key, attempts, last_error, ",
            age_secs!("created_at"),
            " FROM outbox_messages INDEXED BY outbox_messages_pending",
            " WHERE published_at IS NULL AND dead_at IS NOT NULL ORDER BY id LIMIT $1"
        ))
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
        let ids = ids
            .map(serde_json::to_string)
            .transpose()
            .map_err(|e| StoreError::Invalid(e.to_string()))?;
        let done = sqlx::query(concat!(
            "UPDATE outbox_messages INDEXED BY outbox_messages_pending",
            " SET dead_at = NULL, attempts = 0, no_routes = 0, available_at = ",
            now!(),
            " WHERE published_at IS NULL AND dead_at IS NOT NULL",
            " AND ($1 IS NULL OR id IN (SELECT value FROM json_each($1)))"
        ))
        .bind(ids)
        .execute(self.pool())
        .await
        .map_err(store_error)?;
        Ok(done.rows_affected())
    }

    async fn outbox_skip(&self, ids: &[i64]) -> Result<u64, StoreError> {
        let ids = serde_json::to_string(ids).map_err(|e| StoreError::Invalid(e.to_string()))?;
        let done = sqlx::query(
            "DELETE FROM outbox_messages WHERE published_at IS NULL AND (dead_at IS NOT NULL OR attempts > 0)
               AND id IN (SELECT value FROM json_each($1))",
        )
        .bind(ids)
        .execute(self.pool())
        .await
        .map_err(store_error)?;
        Ok(done.rows_affected())
    }

    async fn outbox_cleanup(&self, older_than: Duration, limit: u32) -> Result<u64, StoreError> {
        let done = sqlx::query(concat!(
            "DELETE FROM outbox_messages WHERE id IN (
               SELECT id FROM outbox_messages
               WHERE published_at IS NOT NULL AND ",
            age_secs!("published_at"),
            " * 1000.0 > $1
               ORDER BY published_at LIMIT $2)"
        ))
        .bind(older_than.as_millis() as f64)
        .bind(i64::from(limit))
        .execute(self.pool())
        .await
        .map_err(store_error)?;
        Ok(done.rows_affected())
    }
}

#[async_trait]
impl super::TokenLeases for SqliteStore {
    async fn mark_leased(&self, token: &str, ids: &[i64], keep: bool) -> Result<u64, StoreError> {
        // SQLite has no arrays: the ids as a JSON array, read by json_each.
        let ids = serde_json::to_string(ids).map_err(|e| StoreError::Invalid(e.to_string()))?;
        let sql = if keep {
            concat!(
                "UPDATE outbox_messages SET published_at = ",
                now!(),
                ", lease_token = NULL, lease_until = NULL
                 WHERE id IN (SELECT value FROM json_each($1)) AND lease_token = $2"
            )
        } else {
            "DELETE FROM outbox_messages WHERE id IN (SELECT value FROM json_each($1)) AND lease_token = $2"
        };
        let done = sqlx::query(sql)
            .bind(ids)
            .bind(token)
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
        let mut tx = self
            .pool()
            .begin_with("BEGIN IMMEDIATE")
            .await
            .map_err(store_error)?;
        for failure in failures {
            sqlx::query(concat!(
                "UPDATE outbox_messages SET attempts = attempts + 1, no_routes = no_routes + $6, last_error = $1, available_at = ",
                now_plus_ms!("$2"),
                ", dead_at = CASE WHEN $3 THEN ",
                now!(),
                " END, lease_token = NULL, lease_until = NULL
                 WHERE id = $4 AND lease_token = $5"
            ))
            .bind(storable_error(&failure.error))
            .bind(failure.retry_after.as_millis() as f64)
            .bind(failure.dead)
            .bind(failure.id)
            .bind(token)
            .bind(i64::from(failure.no_route))
            .execute(&mut *tx)
            .await
            .map_err(store_error)?;
        }
        tx.commit().await.map_err(store_error)
    }
}
