//! The outbox on PostgreSQL.
//!
//! Order per key (DESIGN.md's rule 1, with a lock instead of a counter row): a writer of a keyed
//! row first takes a transaction-scoped advisory lock on (destination, key), and only then takes
//! the row's id. Writers of one key therefore take ids in the order they commit, and a row of a
//! key is visible only once every earlier row of that key has committed or rolled back. The relay
//! publishes the first pending row of each key and nothing after it until that one is marked.
//! Chosen over the snapshot horizon (publishing only rows older than every running
//! transaction), which needs no lock but is cluster-wide: one long transaction anywhere would
//! hold every ordered row back. The lock costs no table and no cleanup; a hot key serialises its
//! writers, which the order needs anyway.

use std::time::Duration;

use async_trait::async_trait;
use futures::StreamExt;
use futures::stream::BoxStream;

use super::codec::{encode_headers, traceparent};
use super::{
    BatchClaim, OutboxBatch, OutboxDeadRow, OutboxRow, OutboxStats, OutboxStore, PublishFailure,
    Staged,
};
use crate::error::StoreError;
use crate::message::OutgoingMessage;
use crate::store::postgres::{PgTx, PostgresStore};
use crate::store::{storable_error, store_error};

/// The channel relays listen on.
const CHANNEL: &str = "inbox_outbox";

/// The advisory lock space of ordering keys: the two-integer form (`"inbx"`, hash of the key),
/// which never meets the one-bigint form of the migration and cleanup locks.
const INSERT_KEYED: &str = "\
INSERT INTO outbox_messages (destination, message_id, ordering_key, payload, headers, traceparent)
SELECT $1, $2, $3, $4, $5::jsonb, $6
FROM (SELECT pg_advisory_xact_lock(1768842872, hashtext($1 || chr(1) || $3))) AS key_lock
ON CONFLICT (destination, message_id) DO NOTHING
RETURNING id";

/// Several staged messages in one statement, one round trip instead of one per message: the
/// rows in the arrays' order (`staged_order`), each keyed row taking its key's lock before its
/// id, as in `INSERT_KEYED` (the lateral subquery runs once per row: a volatile call keeps the
/// planner from pulling it up, and a left join it cannot prove unique from removing it).
/// Returns the rows written; a message already there writes nothing.
const INSERT_MANY: &str = "\
INSERT INTO outbox_messages (destination, message_id, ordering_key, payload, headers, traceparent)
SELECT m.destination, m.message_id, m.ordering_key, m.payload, m.headers::jsonb, m.traceparent
FROM unnest($1::text[], $2::text[], $3::text[], $4::bytea[], $5::text[], $6::text[])
  WITH ORDINALITY AS m (destination, message_id, ordering_key, payload, headers, traceparent, n)
LEFT JOIN LATERAL (
  SELECT pg_advisory_xact_lock(1768842872, hashtext(m.destination || chr(1) || m.ordering_key))
  WHERE m.ordering_key IS NOT NULL) AS key_lock ON true
ORDER BY m.n
ON CONFLICT (destination, message_id) DO NOTHING
RETURNING id, destination, message_id";

const INSERT: &str = "\
INSERT INTO outbox_messages (destination, message_id, payload, headers, traceparent)
VALUES ($1, $2, $3, $4::jsonb, $5)
ON CONFLICT (destination, message_id) DO NOTHING
RETURNING id";

/// Pending, due, and the first pending row of its key (a dead or failing head holds its key
/// back), locked until the batch's transaction ends. The candidates come from
/// `outbox_messages_claimable` (pending, not dead); the key check, which must also see dead rows,
/// from `outbox_messages_pending_keys`. SKIP LOCKED: two relays claiming at once
/// take different rows; a key's next row is not claimable while its head is locked, since the
/// head is still pending to every other transaction.
const CLAIM: &str = "\
SELECT c.id, c.destination, c.message_id, c.ordering_key, c.payload, c.headers::text,
  c.attempts, c.no_routes, EXTRACT(EPOCH FROM clock_timestamp() - c.created_at)::float8
FROM outbox_messages c
WHERE c.published_at IS NULL AND c.dead_at IS NULL
  AND c.available_at <= clock_timestamp()
  AND (c.ordering_key IS NULL OR NOT EXISTS (
    SELECT 1 FROM outbox_messages e
    WHERE e.destination = c.destination AND e.ordering_key = c.ordering_key
      AND e.published_at IS NULL AND e.id < c.id))
ORDER BY c.id
LIMIT $1
FOR UPDATE SKIP LOCKED";

/// The claim's plan, whatever the statistics say: walk the pending rows in id order and stop at
/// the batch. A queue table is nearly empty whenever autovacuum analyzes it, so its statistics
/// describe an empty table (no null fractions: `published_at IS NULL` is guessed at 0.5 %); with
/// a backlog, after an outage, the planner then expects a handful of rows and prefers reading the
/// whole table and sorting it, checking every row's key on the way — each claim costs the whole
/// backlog, and draining it is quadratic, just when the relay has most to do (measured: a claim
/// of 500 from 30,000 rows took 50 ms that way and 1.6 ms by the index). Local to the claim's
/// transaction, so nothing else on the pooled connection plans differently.
const PLAN_BY_INDEX: &str = "SET LOCAL enable_seqscan = off; SET LOCAL enable_bitmapscan = off";

/// The rows not published yet, per destination: the pending rows that are not dead from
/// `outbox_messages_claimable`, the dead ones from `outbox_messages_dead`.
const PENDING_STATS: &str = "\
SELECT destination, count(*),
  count(*) FILTER (WHERE dead_at IS NULL AND attempts > 0),
  count(*) FILTER (WHERE dead_at IS NOT NULL),
  count(DISTINCT ordering_key) FILTER (WHERE dead_at IS NOT NULL OR attempts > 0),
  0::bigint,
  EXTRACT(EPOCH FROM clock_timestamp() - min(created_at) FILTER (WHERE dead_at IS NULL))::float8
FROM (
  SELECT destination, ordering_key, attempts, created_at, dead_at FROM outbox_messages
  WHERE published_at IS NULL AND dead_at IS NULL
  UNION ALL
  SELECT destination, ordering_key, attempts, created_at, dead_at FROM outbox_messages
  WHERE published_at IS NULL AND dead_at IS NOT NULL
) AS pending
GROUP BY destination";

/// A batch's claim on PostgreSQL: the transaction that holds the rows' locks. The rows are
/// written once, by the mark; a lease column would cost an `UPDATE` of each row besides. The
/// lease is the transaction's `idle_in_transaction_session_timeout`: a relay that stalls past
/// it loses its session, which releases the rows and fences the stalled relay out (its mark
/// fails with the session); a relay that dies releases them at once, as its connection closes.
struct Locked {
    tx: PgTx,
    claimed: std::time::Instant,
    lease: Duration,
}

#[async_trait]
impl BatchClaim for Locked {
    async fn finish(
        self: Box<Self>,
        published: &[i64],
        failures: &[PublishFailure],
        keep: bool,
    ) -> Result<u64, StoreError> {
        let Locked {
            mut tx,
            claimed,
            lease,
        } = *self;
        let finished = async {
            let mut marked = 0;
            if !published.is_empty() {
                let sql = if keep {
                    "UPDATE outbox_messages SET published_at = clock_timestamp() WHERE id = ANY($1)"
                } else {
                    "DELETE FROM outbox_messages WHERE id = ANY($1)"
                };
                marked = sqlx::query(sql)
                    .bind(published)
                    .execute(&mut *tx)
                    .await?
                    .rows_affected();
            }
            if !failures.is_empty() {
                record_failures(&mut tx, failures).await?;
            }
            tx.commit().await?;
            Ok::<_, sqlx::Error>(marked)
        };
        match finished.await {
            // The database ended the session at the lease: another relay may have the rows.
            Err(e) if claimed.elapsed() >= lease => {
                tracing::debug!(error = %e, "outbox batch: lease lapsed before the mark");
                Ok(0)
            }
            other => other.map_err(store_error),
        }
    }
}

/// The most payload bytes written in one statement: one array value must stay under
/// PostgreSQL's 1 GB; bigger sets go a row at a time.
const MANY_BYTES: usize = 64 << 20;

/// Writes several staged messages with `INSERT_MANY`; those already in the table (sent before,
/// or twice in this transaction) then one by one, as `insert_outbox` finds their rows. Returns
/// what was written, in `staged`'s order.
///
/// One difference from writing a row at a time: a message already there whose row is published
/// and deleted before that second pass is written again after the key's other new rows, not
/// between them. It is a copy of a message already published, which the consumer's inbox
/// discards.
async fn insert_many(
    store: &PostgresStore,
    tx: &mut PgTx,
    staged: &[Staged],
) -> Result<Vec<(i64, bool)>, StoreError> {
    let order = super::staged_order(staged);
    let mut destinations = Vec::with_capacity(order.len());
    let mut message_ids = Vec::with_capacity(order.len());
    let mut keys = Vec::with_capacity(order.len());
    let mut payloads = Vec::with_capacity(order.len());
    let mut headers = Vec::with_capacity(order.len());
    let mut traces = Vec::with_capacity(order.len());
    for &i in &order {
        let row = &staged[i];
        destinations.push(row.destination.as_str());
        message_ids.push(row.message_id.as_str());
        keys.push(super::codec::ordering_key(&row.message)?);
        payloads.push(row.message.payload.as_ref());
        headers.push(encode_headers(&row.message.headers));
        traces.push(traceparent(&row.message));
    }
    let inserted: Vec<(i64, String, String)> = sqlx::query_as(INSERT_MANY)
        .bind(&destinations)
        .bind(&message_ids)
        .bind(&keys)
        .bind(&payloads)
        .bind(&headers)
        .bind(&traces)
        .fetch_all(&mut **tx)
        .await
        .map_err(store_error)?;
    let mut ids: std::collections::HashMap<(&str, &str), i64> = inserted
        .iter()
        .map(|(id, destination, message_id)| ((destination.as_str(), message_id.as_str()), *id))
        .collect();
    let mut written = vec![(0, false); staged.len()];
    let mut already = Vec::new();
    for (&i, key) in order.iter().zip(&keys) {
        let row = &staged[i];
        // Of a message staged twice, the first in the order written is the one written.
        match ids.remove(&(row.destination.as_str(), row.message_id.as_str())) {
            Some(id) => written[i] = (id, true),
            None => already.push((i, *key)),
        }
    }
    for (i, key) in already {
        let row = &staged[i];
        written[i] = store
            .insert_outbox(tx, &row.destination, &row.message_id, &row.message, key)
            .await?;
    }
    Ok(written)
}

/// Records failed publishes: attempts, the reason, the backoff, dead or not.
async fn record_failures(tx: &mut PgTx, failures: &[PublishFailure]) -> Result<(), sqlx::Error> {
    let ids: Vec<i64> = failures.iter().map(|f| f.id).collect();
    let errors: Vec<String> = failures
        .iter()
        .map(|f| storable_error(&f.error).into_owned())
        .collect();
    let delays: Vec<f64> = failures
        .iter()
        .map(|f| f.retry_after.as_millis() as f64)
        .collect();
    let dead: Vec<bool> = failures.iter().map(|f| f.dead).collect();
    let no_route: Vec<bool> = failures.iter().map(|f| f.no_route).collect();
    sqlx::query(
        "UPDATE outbox_messages AS o
         SET attempts = o.attempts + 1, last_error = f.error,
             no_routes = o.no_routes + CASE WHEN f.no_route THEN 1 ELSE 0 END,
             available_at = clock_timestamp() + f.delay_ms * interval '1 millisecond',
             dead_at = CASE WHEN f.dead THEN clock_timestamp() END
         FROM unnest($1::bigint[], $2::text[], $3::float8[], $4::bool[], $5::bool[])
           AS f(id, error, delay_ms, dead, no_route)
         WHERE o.id = f.id",
    )
    .bind(&ids)
    .bind(&errors)
    .bind(&delays)
    .bind(&dead)
    .bind(&no_route)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

#[async_trait]
impl OutboxStore for PostgresStore {
    async fn insert_outbox(
        &self,
        tx: &mut PgTx,
        destination: &str,
        message_id: &str,
        message: &OutgoingMessage,
        ordering_key: Option<&str>,
    ) -> Result<(i64, bool), StoreError> {
        let headers = encode_headers(&message.headers);
        let trace = traceparent(message);
        let inserted: Option<i64> = match ordering_key {
            Some(key) => sqlx::query_scalar(INSERT_KEYED)
                .bind(destination)
                .bind(message_id)
                .bind(key)
                .bind(message.payload.as_ref())
                .bind(&headers)
                .bind(trace),
            None => sqlx::query_scalar(INSERT)
                .bind(destination)
                .bind(message_id)
                .bind(message.payload.as_ref())
                .bind(&headers)
                .bind(trace),
        }
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

    async fn commit_outbox(
        &self,
        mut tx: PgTx,
        staged: &[Staged],
    ) -> Result<Vec<(i64, bool)>, StoreError> {
        if staged.is_empty() {
            crate::InboxStore::commit(self, tx).await?;
            return Ok(Vec::new());
        }
        let bytes: usize = staged.iter().map(|s| s.message.payload.len()).sum();
        let written = if staged.len() == 1 || bytes > MANY_BYTES {
            super::insert_staged(self, &mut tx, staged).await
        } else {
            insert_many(self, &mut tx, staged).await
        };
        match written {
            Ok(written) => {
                // The writes just succeeded in this transaction, so it is live: PostgreSQL
                // fails every statement of an aborted one. No statement runs between them and
                // the COMMIT, which therefore cannot turn into a silent rollback.
                tx.commit().await.map_err(store_error)?;
                Ok(written)
            }
            Err(e) => {
                let _ = tx.rollback().await;
                Err(e)
            }
        }
    }

    async fn claim_outbox(&self, limit: u32, lease: Duration) -> Result<OutboxBatch, StoreError> {
        type Row = (
            i64,
            String,
            String,
            Option<String>,
            Vec<u8>,
            String,
            i32,
            i32,
            f64,
        );
        let mut tx = self
            .begin_and(&format!(
                "SET LOCAL idle_in_transaction_session_timeout = {}; {PLAN_BY_INDEX}",
                lease.as_millis().clamp(1, i32::MAX as u128)
            ))
            .await?;
        let claimed = std::time::Instant::now();
        let rows: Vec<Row> = sqlx::query_as(CLAIM)
            .bind(i64::from(limit))
            .fetch_all(&mut *tx)
            .await
            .map_err(store_error)?;
        if rows.is_empty() {
            tx.rollback().await.map_err(store_error)?;
            return Ok(OutboxBatch::empty());
        }
        let rows: Vec<OutboxRow> = rows
            .into_iter()
            .map(
                |(id, destination, message_id, key, payload, headers, attempts, no_routes, age)| {
                    let counts = (i64::from(attempts), i64::from(no_routes));
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
        let claim = Locked { tx, claimed, lease };
        Ok(OutboxBatch::new(rows, Box::new(claim)))
    }

    async fn outbox_pending_stats(&self) -> Result<Vec<OutboxStats>, StoreError> {
        type Row = (String, i64, i64, i64, i64, i64, Option<f64>);
        // By the indexes whatever the statistics say, as the claim: under an empty table's
        // statistics the planner would read the whole table, kept rows and all.
        let mut tx = self.begin_and(PLAN_BY_INDEX).await?;
        let rows: Vec<Row> = sqlx::query_as(PENDING_STATS)
            .fetch_all(&mut *tx)
            .await
            .map_err(store_error)?;
        tx.rollback().await.map_err(store_error)?;
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
            i32,
            Option<String>,
            f64,
        );
        // By `outbox_messages_dead` whatever the statistics say: the table may hold every row
        // published within the retention window.
        let mut tx = self.begin_and(PLAN_BY_INDEX).await?;
        let rows: Vec<Row> = sqlx::query_as(
            "SELECT id, destination, message_id, ordering_key, attempts, last_error,
                    EXTRACT(EPOCH FROM clock_timestamp() - created_at)::float8
             FROM outbox_messages WHERE dead_at IS NOT NULL ORDER BY id LIMIT $1",
        )
        .bind(i64::from(limit))
        .fetch_all(&mut *tx)
        .await
        .map_err(store_error)?;
        tx.rollback().await.map_err(store_error)?;
        Ok(rows
            .into_iter()
            .map(|(id, d, m, k, a, e, age)| super::dead_row(id, d, m, k, i64::from(a), e, age))
            .collect())
    }

    async fn outbox_retry(&self, ids: Option<&[i64]>) -> Result<u64, StoreError> {
        // As the dead list: by the dead rows' index, ids given or not.
        let mut tx = self.begin_and(PLAN_BY_INDEX).await?;
        let done = sqlx::query(
            "UPDATE outbox_messages SET dead_at = NULL, attempts = 0, no_routes = 0, available_at = clock_timestamp()
             WHERE dead_at IS NOT NULL AND ($1::bigint[] IS NULL OR id = ANY($1))",
        )
        .bind(ids)
        .execute(&mut *tx)
        .await
        .map_err(store_error)?;
        tx.commit().await.map_err(store_error)?;
        Ok(done.rows_affected())
    }

    async fn outbox_skip(&self, ids: &[i64]) -> Result<u64, StoreError> {
        let done =
            sqlx::query("DELETE FROM outbox_messages WHERE published_at IS NULL AND (dead_at IS NOT NULL OR attempts > 0) AND id = ANY($1)")
                .bind(ids)
                .execute(self.pool())
                .await
                .map_err(store_error)?;
        Ok(done.rows_affected())
    }

    async fn outbox_cleanup(&self, older_than: Duration, limit: u32) -> Result<u64, StoreError> {
        let done = sqlx::query(
            "DELETE FROM outbox_messages WHERE id IN (
               SELECT id FROM outbox_messages
               WHERE published_at IS NOT NULL
                 AND published_at < clock_timestamp() - $1 * interval '1 millisecond'
               ORDER BY published_at LIMIT $2 FOR UPDATE SKIP LOCKED)",
        )
        .bind(older_than.as_millis() as f64)
        .bind(i64::from(limit))
        .execute(self.pool())
        .await
        .map_err(store_error)?;
        Ok(done.rows_affected())
    }

    async fn signal_relays(&self) -> Result<(), StoreError> {
        sqlx::query("SELECT pg_notify($1, '')")
            .bind(CHANNEL)
            .execute(self.pool())
            .await
            .map_err(store_error)?;
        Ok(())
    }

    async fn relay_signals(&self) -> Result<Option<BoxStream<'static, ()>>, StoreError> {
        let mut listener = sqlx::postgres::PgListener::connect_with(self.pool())
            .await
            .map_err(store_error)?;
        listener.listen(CHANNEL).await.map_err(store_error)?;
        // `recv` reconnects by itself after a lost connection; what was signalled meanwhile is
        // found by the relay's poll.
        let signals = futures::stream::unfold(listener, |mut listener| async move {
            loop {
                match listener.recv().await {
                    Ok(_) => return Some(((), listener)),
                    Err(e) => {
                        tracing::debug!(error = %e, "outbox relay: listener lost; reconnecting");
                        tokio::time::sleep(Duration::from_secs(1)).await;
                    }
                }
            }
        });
        Ok(Some(signals.boxed()))
    }
}
