//! The inbox table behind a trait, and its PostgreSQL, MySQL / MariaDB and SQLite implementations.

use std::time::Duration;

use async_trait::async_trait;

use crate::error::StoreError;
use crate::id::{ConsumerName, MessageId};

#[cfg(feature = "mysql")]
pub mod mysql;
#[cfg(feature = "postgres")]
pub mod postgres;
#[cfg(feature = "sqlite")]
pub mod sqlite;

/// The longest `last_error` kept, in characters; longer ones are cut.
pub const MAX_ERROR_CHARS: usize = 2000;

/// What [`InboxStore::claim`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Claim {
    /// The message is ours to handle in this transaction: its row is locked until the transaction
    /// ends, and committing marks it processed.
    Claimed {
        /// Failed attempts recorded so far.
        attempts: u32,
        /// The last recorded failure.
        last_error: Option<String>,
    },
    /// Already processed: a duplicate.
    Done,
    /// Already dead-lettered: not handled again unless an operator replays it.
    Dead,
}

/// What [`InboxStore::claim_offsets`] found (offsets mode).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum OffsetClaim {
    /// Nothing at or after the range's first offset was handled: the whole range is new. The
    /// partition's next offset is now one past the range's last, and locked until the
    /// transaction ends.
    New,
    /// The records before `next` were handled already (`next` is past the range's first
    /// offset). The next offset is unchanged, and locked until the transaction ends.
    Consumed {
        /// The partition's next offset as kept.
        next: i64,
    },
}

/// Counts for one consumer, as [`InboxStore::stats`] returns them.
#[derive(Debug, Clone, PartialEq, Default)]
#[non_exhaustive]
pub struct ConsumerStats {
    /// The consumer.
    pub consumer: String,
    /// Rows in the inbox table.
    pub rows: u64,
    /// Rows processed.
    pub processed: u64,
    /// Rows processed in the last hour.
    pub processed_last_hour: u64,
    /// Rows with recorded failures, neither processed nor dead yet.
    pub failing: u64,
    /// Rows dead-lettered.
    pub dead: u64,
    /// Age of the oldest row that is neither processed nor dead.
    pub oldest_unprocessed: Option<Duration>,
}

impl ConsumerStats {
    /// From one row of the stats query: consumer, rows, processed, processed in the last hour,
    /// failing, dead, age in seconds of the oldest unprocessed row.
    #[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
    pub(crate) fn from_row(
        (consumer, rows, processed, last_hour, failing, dead, oldest): (
            String,
            i64,
            i64,
            i64,
            i64,
            i64,
            Option<f64>,
        ),
    ) -> Self {
        let count = |n: i64| u64::try_from(n).unwrap_or(0);
        Self {
            consumer,
            rows: count(rows),
            processed: count(processed),
            processed_last_hour: count(last_hour),
            failing: count(failing),
            dead: count(dead),
            oldest_unprocessed: oldest.map(|s| Duration::from_secs_f64(s.max(0.0))),
        }
    }
}

/// A dead-lettered message as recorded in the inbox table.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct DeadLetter {
    /// The consumer.
    pub consumer: String,
    /// The message id.
    pub message_id: String,
    /// Attempts made.
    pub attempts: u32,
    /// Why it was dead-lettered.
    pub last_error: Option<String>,
    /// How long ago.
    pub age: Duration,
}

/// What one cleanup run did.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct CleanupReport {
    /// Rows deleted.
    pub deleted: u64,
    /// Batches (transactions) used.
    pub batches: u64,
    /// True when another instance held the cleanup lock, so this run did nothing.
    pub skipped_locked: bool,
}

/// How a cleanup sizes and spaces its batches: what keeps the consumers' claims from feeling it.
///
/// A batch's `DELETE` competes with the claims for the database's CPU and its WAL (or redo log)
/// flushes; a claim that lands in one waits longer. Short batches with rests between them make
/// the claims that land in one fewer and their wait shorter; the price is a slower cleanup (a
/// rest of 4× the batch time deletes at a fifth of the unpaced rate).
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct CleanupPace {
    /// The most rows one batch (transaction) deletes; at least 1.
    pub max_rows: u32,
    /// The time a batch should take: each next batch's size is scaled towards it, up to
    /// `max_rows`. `None`: every batch is `max_rows`.
    pub batch_time: Option<Duration>,
    /// After each batch, a rest of this many times the batch's own duration (0: none).
    pub rest: f64,
}

impl CleanupPace {
    /// `rows` per batch, back to back: as fast as the database deletes.
    pub fn unpaced(rows: u32) -> Self {
        Self {
            max_rows: rows.max(1),
            batch_time: None,
            rest: 0.0,
        }
    }

    /// Batches of about `batch_time` (at most `max_rows` rows), each followed by a rest of
    /// `rest` times its duration.
    pub fn paced(max_rows: u32, batch_time: Duration, rest: f64) -> Self {
        Self {
            max_rows: max_rows.max(1),
            batch_time: Some(batch_time.max(Duration::from_millis(1))),
            rest: if rest.is_finite() { rest.max(0.0) } else { 0.0 },
        }
    }
}

/// A cleanup loop's pacing: the next batch's size, and the rest after each.
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
pub(crate) struct Pacer {
    pace: CleanupPace,
    rows: u32,
    started: tokio::time::Instant,
}

#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
impl Pacer {
    /// Paced batches start small: the first batch measures the rate.
    pub(crate) fn new(pace: CleanupPace) -> Self {
        let rows = match pace.batch_time {
            Some(_) => pace.max_rows.clamp(1, 500),
            None => pace.max_rows.max(1),
        };
        Self {
            pace,
            rows,
            started: tokio::time::Instant::now(),
        }
    }

    /// The rows the next batch deletes; starts its clock.
    pub(crate) fn rows(&mut self) -> u32 {
        self.started = tokio::time::Instant::now();
        self.rows
    }

    /// After a batch that deleted `deleted` rows: `true` when it was the last (fewer than
    /// asked); otherwise sizes the next one and rests.
    pub(crate) async fn batch_done(&mut self, deleted: u64) -> bool {
        if deleted < u64::from(self.rows) {
            return true;
        }
        let took = self.started.elapsed();
        if let Some(target) = self.pace.batch_time {
            // Towards the target, by at most 2× a step: one slow batch (a checkpoint) does not
            // collapse the size, one fast one does not blow it up.
            let scale = (target.as_secs_f64() / took.as_secs_f64().max(1e-4)).clamp(0.5, 2.0);
            self.rows = ((f64::from(self.rows) * scale) as u32).clamp(1, self.pace.max_rows.max(1));
        }
        if self.pace.rest > 0.0 {
            tokio::time::sleep(took.mul_f64(self.pace.rest.min(1e3))).await;
        }
        false
    }
}

/// The inbox table as the engine uses it per delivery: the only place that knows SQL.
///
/// All statements bind their values as parameters (but PostgreSQL's claims sent with the
/// `BEGIN`, by id and by offset, where parameters cannot go: they quote them). Implementations must keep the claim to one
/// statement (see [`claim`](Self::claim)). What operators and the CLI need besides — migrations,
/// dead-letter listing, cleanup, replay — is [`InboxAdmin`].
///
/// Naming: a method that takes `tx` acts inside the caller's transaction; the others open and
/// commit their own. Where both exist they share a name, the in-transaction one ending in `_in`
/// ([`record_dead`](Self::record_dead) / [`record_dead_in`](Self::record_dead_in),
/// [`InboxAdmin::revive`] / [`revive_in`](Self::revive_in)).
#[async_trait]
pub trait InboxStore: Send + Sync + 'static {
    /// The transaction a claim runs in and the handler writes through.
    type Tx: Send + 'static;

    /// Begins a transaction (READ COMMITTED on PostgreSQL; a write transaction on SQLite).
    async fn begin(&self) -> Result<Self::Tx, StoreError>;

    /// Claims `(consumer, id)` in ONE statement: inserts the row, or takes an existing row that is
    /// neither processed nor dead; either way the row is locked and marked processed as of this
    /// transaction. A concurrent claim of the same message waits for this transaction to end,
    /// then sees the message done (if it committed) or free (if it rolled back).
    async fn claim(
        &self,
        tx: &mut Self::Tx,
        consumer: &ConsumerName,
        id: &MessageId,
    ) -> Result<Claim, StoreError>;

    /// [`begin`](Self::begin), then [`claim`](Self::claim): what the engine does per message.
    /// `unseen` says the consumer has no sign that the message came before (the broker does not
    /// call it a redelivery, and this is its first try here); a store may then do both in one
    /// round trip, as PostgreSQL does (see `PostgresStore::claim_with_begin`). On an error the
    /// transaction is rolled back.
    async fn begin_and_claim(
        &self,
        consumer: &ConsumerName,
        id: &MessageId,
        unseen: bool,
    ) -> Result<(Self::Tx, Claim), StoreError> {
        let _ = unseen;
        let mut tx = self.begin().await?;
        let claim = self.claim(&mut tx, consumer, id).await?;
        Ok((tx, claim))
    }

    /// Claims many messages in ONE statement (batch mode): the result says, for each id in
    /// order, [`Claim::Claimed`] or [`Claim::Done`] (done or dead: not to be handled). `ids` must
    /// be distinct. Rows are locked in id order, so batches that overlap do not deadlock.
    async fn claim_batch(
        &self,
        tx: &mut Self::Tx,
        consumer: &ConsumerName,
        ids: &[MessageId],
    ) -> Result<Vec<Claim>, StoreError>;

    /// Offsets mode: claims the records `first..=last` of `topic`'s `partition` for `consumer`
    /// in ONE statement, by the partition's next offset kept in `inbox_offsets`. When it is at
    /// or before `first` (or nothing is kept yet) the range is new and the next offset becomes
    /// `last + 1`; otherwise it is left as it is and returned. Either way the partition's row is
    /// locked until `tx` ends, so a revoked owner's late transaction waits for the new owner's
    /// and then finds the offsets consumed: the next offset never moves back.
    async fn claim_offsets(
        &self,
        tx: &mut Self::Tx,
        consumer: &ConsumerName,
        topic: &str,
        partition: i32,
        (first, last): (i64, i64),
    ) -> Result<OffsetClaim, StoreError> {
        let _ = (tx, consumer, topic, partition, first, last);
        Err(StoreError::Unsupported("offsets mode"))
    }

    /// Offsets mode, per message: [`begin`](Self::begin), then
    /// [`claim_offsets`](Self::claim_offsets) of the one record at `offset`. A store may do both
    /// in one round trip, as PostgreSQL does. On an error the transaction is rolled back.
    async fn begin_and_claim_offset(
        &self,
        consumer: &ConsumerName,
        topic: &str,
        partition: i32,
        offset: i64,
    ) -> Result<(Self::Tx, OffsetClaim), StoreError> {
        let mut tx = self.begin().await?;
        let found = self
            .claim_offsets(&mut tx, consumer, topic, partition, (offset, offset))
            .await?;
        Ok((tx, found))
    }

    /// Offsets mode: sets the next offset of a partition whose row `tx` locked with
    /// [`claim_offsets`](Self::claim_offsets) (the engine moves it back to the first record of
    /// a batch it did not finish, never before what the claim found).
    async fn set_next_offset(
        &self,
        tx: &mut Self::Tx,
        consumer: &ConsumerName,
        topic: &str,
        partition: i32,
        next: i64,
    ) -> Result<(), StoreError> {
        let _ = (tx, consumer, topic, partition, next);
        Err(StoreError::Unsupported("offsets mode"))
    }

    /// Offsets mode: the next offset kept for `consumer` in `topic`'s `partition`, if any.
    async fn next_offset(
        &self,
        consumer: &ConsumerName,
        topic: &str,
        partition: i32,
    ) -> Result<Option<i64>, StoreError> {
        let _ = (consumer, topic, partition);
        Err(StoreError::Unsupported("offsets mode"))
    }

    /// The most messages one batch transaction should hold, where the database sets a limit of
    /// its own (batch mode opens a savepoint per message). `None`: no such limit.
    fn max_batch(&self) -> Option<usize> {
        None
    }

    /// Opens a savepoint in `tx` (batch mode: one per message, so that a failing handler's
    /// writes can be undone without losing the others').
    async fn savepoint(&self, tx: &mut Self::Tx) -> Result<(), StoreError>;

    /// Undoes everything since [`savepoint`](Self::savepoint) and closes it.
    async fn rollback_to_savepoint(&self, tx: &mut Self::Tx) -> Result<(), StoreError>;

    /// Keeps everything since [`savepoint`](Self::savepoint) and closes it.
    async fn release_savepoint(&self, tx: &mut Self::Tx) -> Result<(), StoreError>;

    /// Gives back a row claimed in `tx` without handling it (batch mode): not processed, and,
    /// with `failure = Some((attempt, error))`, with that failed attempt recorded in `tx`.
    async fn release_claim(
        &self,
        tx: &mut Self::Tx,
        consumer: &ConsumerName,
        id: &MessageId,
        failure: Option<(u32, &str)>,
    ) -> Result<(), StoreError>;

    /// Turns a claimed row into a dead-lettered one, in the claim's transaction.
    async fn record_dead_in(
        &self,
        tx: &mut Self::Tx,
        consumer: &ConsumerName,
        id: &MessageId,
        attempts: u32,
        reason: &str,
    ) -> Result<(), StoreError>;

    /// Commits.
    async fn commit(&self, tx: Self::Tx) -> Result<(), StoreError>;

    /// Rolls back.
    async fn rollback(&self, tx: Self::Tx) -> Result<(), StoreError>;

    /// Records a failed attempt in its own transaction (the handler's was rolled back), unless the
    /// message is processed or dead by now. Returns the attempts recorded.
    async fn record_failure(
        &self,
        consumer: &ConsumerName,
        id: &MessageId,
        attempt: u32,
        error: &str,
    ) -> Result<u32, StoreError>;

    /// Counts, in its own committed transaction, a delivery that is about to be handled and may
    /// be a redelivery, on a broker that counts no deliveries itself (Kafka, classic RabbitMQ
    /// queues); returns the count, this one included — or 0 when the message is processed or
    /// dead by now. A count that keeps growing means the consumer keeps dying on the message
    /// before any outcome is recorded. [`revive_in`](Self::revive_in) resets it.
    async fn record_delivery(
        &self,
        consumer: &ConsumerName,
        id: &MessageId,
    ) -> Result<u32, StoreError>;

    /// Marks a message dead in its own transaction (a permanent failure after rollback), unless it
    /// is processed by now.
    async fn record_dead(
        &self,
        consumer: &ConsumerName,
        id: &MessageId,
        attempts: u32,
        reason: &str,
    ) -> Result<(), StoreError>;

    /// Clears the dead mark of a message in `tx`, with a fresh attempt and delivery budget, so that its next
    /// delivery is handled: the operator's replay. Returns whether there was such a dead row. The
    /// row stays locked until `tx` ends, so a copy delivered meanwhile waits for the outcome.
    async fn revive_in(
        &self,
        tx: &mut Self::Tx,
        consumer: &ConsumerName,
        id: &MessageId,
    ) -> Result<bool, StoreError>;

    /// Counts per consumer (one consumer, or all). The engine samples them into gauges.
    async fn stats(
        &self,
        consumer: Option<&ConsumerName>,
    ) -> Result<Vec<ConsumerStats>, StoreError>;
}

/// What operators and the CLI need of an inbox table besides the engine's protocol: creating it,
/// listing and reviving dead letters, cleanup.
#[async_trait]
pub trait InboxAdmin: InboxStore {
    /// Creates or updates the inbox schema. Uses its own migration bookkeeping, so it does not
    /// collide with the application's migrations.
    async fn migrate(&self) -> Result<(), StoreError>;

    /// [`revive_in`](InboxStore::revive_in) in a transaction of its own.
    async fn revive(&self, consumer: &ConsumerName, id: &MessageId) -> Result<bool, StoreError> {
        let mut tx = self.begin().await?;
        let revived = self.revive_in(&mut tx, consumer, id).await?;
        self.commit(tx).await?;
        Ok(revived)
    }

    /// Dead-lettered messages, oldest first.
    async fn dead_letters(
        &self,
        consumer: Option<&ConsumerName>,
        limit: u32,
    ) -> Result<Vec<DeadLetter>, StoreError>;

    /// Deletes processed rows older than `older_than`, in batches (transactions) sized and
    /// spaced by `pace`, one instance at a time (PostgreSQL and MySQL: a session lock; another
    /// instance's run makes this one return at once with [`CleanupReport::skipped_locked`]).
    /// Dead-lettered rows are kept. `progress` is called after each batch with the rows deleted
    /// so far. Use [`Cleanup`](crate::Cleanup) rather than calling this in a loop of your own.
    async fn cleanup_with_progress(
        &self,
        older_than: Duration,
        pace: CleanupPace,
        progress: &(dyn Fn(u64) + Send + Sync),
    ) -> Result<CleanupReport, StoreError>;

    /// [`cleanup_with_progress`](Self::cleanup_with_progress), unpaced batches of `batch_size`
    /// rows, without progress.
    async fn cleanup(
        &self,
        older_than: Duration,
        batch_size: u32,
    ) -> Result<CleanupReport, StoreError> {
        self.cleanup_with_progress(older_than, CleanupPace::unpaced(batch_size), &|_| {})
            .await
    }

    /// How many rows a cleanup with `older_than` would delete now (processed, older).
    async fn count_expired(&self, older_than: Duration) -> Result<u64, StoreError>;
}

/// The pool's `after_release` hook: `false` (close the connection) when it comes back still
/// inside a transaction.
///
/// That happens when a task is cancelled or aborted while its `BEGIN` is in flight: the driver
/// finishes the `BEGIN` after the future is gone, and nothing rolls it back. Back in the pool,
/// such a connection would hold its locks (on SQLite, the database's write lock) for ever and turn
/// the next `BEGIN` into a savepoint. Closing it rolls the transaction back.
///
/// ```no_run
/// # #[cfg(feature = "postgres")]
/// # async fn f() -> Result<(), sqlx::Error> {
/// let pool = sqlx::postgres::PgPoolOptions::new()
///     .after_release(|conn, _| Box::pin(async move { Ok(inbox_core::store::release_clean(conn)) }))
///     .connect("postgres://localhost/app")
///     .await?;
/// # Ok(()) }
/// ```
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
pub fn release_clean<C: sqlx::Connection>(conn: &mut C) -> bool {
    !conn.is_in_transaction()
}

/// A pooled connection that holds a session-scoped lock (PostgreSQL's advisory locks, MySQL's
/// named locks: migrations, cleanup). Dropped without [`release`](Self::release) (an error, or
/// the future cancelled mid-way), it is closed rather than returned to the pool: the lock dies
/// with the session instead of staying held by an idle pooled connection.
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) struct LockedSession<DB: sqlx::Database>(
    pub(crate) Option<sqlx::pool::PoolConnection<DB>>,
);

#[cfg(any(feature = "postgres", feature = "mysql"))]
impl<DB: sqlx::Database> LockedSession<DB> {
    pub(crate) fn new(conn: sqlx::pool::PoolConnection<DB>) -> Self {
        Self(Some(conn))
    }

    /// The lock is released (or was never taken): back to the pool.
    pub(crate) fn release(&mut self) {
        self.0.take();
    }
}

#[cfg(any(feature = "postgres", feature = "mysql"))]
impl<DB: sqlx::Database> Drop for LockedSession<DB> {
    fn drop(&mut self) {
        if let Some(conn) = self.0.take() {
            drop(conn.detach());
        }
    }
}

/// The batch claim's answer in the order of `ids`, from the rows it returned (id, attempts, last
/// error); an id without a row was done or dead.
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
pub(crate) fn batch_claims(
    ids: &[MessageId],
    rows: impl Iterator<Item = (String, u32, Option<String>)>,
) -> Vec<Claim> {
    let mut claimed: std::collections::HashMap<String, (u32, Option<String>)> =
        rows.map(|(id, a, e)| (id, (a, e))).collect();
    ids.iter()
        .map(|id| match claimed.remove(id.as_str()) {
            Some((attempts, last_error)) => Claim::Claimed {
                attempts,
                last_error,
            },
            None => Claim::Done,
        })
        .collect()
}

/// An error text as the inbox table can hold it: cut to [`MAX_ERROR_CHARS`], and NUL (which
/// PostgreSQL's `text` refuses, and which a payload can smuggle into a decoder's error message)
/// replaced by U+FFFD. A text the table refused would stop the bookkeeping of its message.
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
pub(crate) fn storable_error(error: &str) -> std::borrow::Cow<'_, str> {
    let cut = match error.char_indices().nth(MAX_ERROR_CHARS) {
        Some((at, _)) => &error[..at],
        None => error,
    };
    if cut.contains('\0') {
        std::borrow::Cow::Owned(cut.replace('\0', "\u{fffd}"))
    } else {
        std::borrow::Cow::Borrowed(cut)
    }
}

#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
pub(crate) use sql_errors::{Category, category, classify, store_error};

#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
mod sql_errors {
    use crate::error::{ErrorKind, StoreError};

    /// Whether a sqlx error may go away on retry.
    pub(crate) fn classify(error: &sqlx::Error) -> ErrorKind {
        match error {
            sqlx::Error::Io(_)
            | sqlx::Error::Tls(_)
            | sqlx::Error::Protocol(_)
            | sqlx::Error::PoolTimedOut
            | sqlx::Error::PoolClosed
            | sqlx::Error::WorkerCrashed => ErrorKind::Transient,
            sqlx::Error::Database(db) => match (mysql_error(db.as_ref()), db.code()) {
                (Some(MySqlError::Permanent), _) => ErrorKind::Permanent,
                (Some(_), _) => ErrorKind::Transient,
                (None, Some(code)) if transient_code(&code) || code == ABORTED => {
                    ErrorKind::Transient
                }
                _ => ErrorKind::Permanent,
            },
            _ => ErrorKind::Permanent,
        }
    }

    /// What a MySQL / MariaDB server error means for a retry, by its error number (its SQLSTATE
    /// is too coarse: lock wait timeout and read-only are both HY000).
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    #[cfg_attr(not(feature = "mysql"), allow(dead_code))]
    pub(crate) enum MySqlError {
        /// Deadlock (1213, the transaction was rolled back), lock wait timeout (1205), a
        /// statement interrupted or timed out (1317, 1969, 3024): retry.
        Conflict,
        /// The server not there for us: too many connections (1040, 1203), out of memory
        /// (1041), a resource limit (1226), too many prepared statements (1461), shutting
        /// down (1053), connection killed (1927, 4031), read-only (1290 with --read-only, 1836,
        /// 1792 — a replica, or a primary being switched over).
        Gone,
        /// Anything else: data errors, unknown tables, constraint violations.
        Permanent,
    }

    /// `error`'s meaning if it came from a MySQL / MariaDB server.
    #[allow(unused_variables)]
    pub(crate) fn mysql_error(error: &dyn sqlx::error::DatabaseError) -> Option<MySqlError> {
        #[cfg(feature = "mysql")]
        if let Some(e) = error.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>() {
            return Some(match e.number() {
                1205 | 1213 | 1317 | 1969 | 3024 => MySqlError::Conflict,
                1040 | 1053 | 1927 | 4031 | 1290 | 1836 | 1792 | 1041 | 1203 | 1226 | 1461 => {
                    MySqlError::Gone
                }
                _ => MySqlError::Permanent,
            });
        }
        None
    }

    /// PostgreSQL's "current transaction is aborted": a statement after one that failed. Retrying
    /// the whole transaction may well succeed.
    pub(crate) const ABORTED: &str = "25P02";

    fn transient_code(code: &str) -> bool {
        // PostgreSQL SQLSTATEs: the server not there for us (`server_gone`), serialization
        // failure and deadlock (40001, 40P01), lock not available (55P03), a statement cancelled
        // by statement_timeout (57014).
        if code.len() == 5 && code.chars().all(|c| c.is_ascii_alphanumeric()) {
            return server_gone(code) || matches!(code, "40001" | "40P01" | "55P03" | "57014");
        }
        // SQLite result codes (extended): BUSY (5) and LOCKED (6) in the low byte.
        code.parse::<i32>()
            .map(|c| matches!(c & 0xff, 5 | 6))
            .unwrap_or(false)
    }

    /// PostgreSQL's SQLSTATEs for a server that is not there for us: connection exceptions (08),
    /// too many connections (53300), shutdown, crash and start-up (57P01..57P03).
    fn server_gone(code: &str) -> bool {
        code.starts_with("08") || matches!(code, "53300" | "57P01" | "57P02" | "57P03")
    }

    /// Which [`StoreError`] a sqlx error becomes, read without taking it.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub(crate) enum Category {
        Unavailable,
        Conflict,
        Aborted,
        Database,
    }

    pub(crate) fn category(error: &sqlx::Error) -> Category {
        let transient = classify(error) == ErrorKind::Transient;
        match error {
            sqlx::Error::Database(db) => match mysql_error(db.as_ref()) {
                Some(MySqlError::Conflict) => Category::Conflict,
                Some(MySqlError::Gone) => Category::Unavailable,
                Some(MySqlError::Permanent) => Category::Database,
                None => match db.code() {
                    Some(code) if code == ABORTED => Category::Aborted,
                    // The server going away (shut down, restarting, out of connections) is an
                    // outage, not a conflict between transactions: the consumer pauses and
                    // probes instead of retrying the message at once.
                    Some(code) if server_gone(&code) => Category::Unavailable,
                    _ if transient => Category::Conflict,
                    _ => Category::Database,
                },
            },
            _ if transient => Category::Unavailable,
            _ => Category::Database,
        }
    }

    /// Maps a sqlx error to a [`StoreError`] of the right kind.
    pub(crate) fn store_error(error: sqlx::Error) -> StoreError {
        let wrap = match category(&error) {
            Category::Unavailable => StoreError::Unavailable,
            Category::Conflict => StoreError::Conflict,
            Category::Aborted => StoreError::Aborted,
            Category::Database => StoreError::Database,
        };
        wrap(Box::new(error))
    }
}

#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
pub(crate) mod migrate {
    //! Our migrations, applied with our own bookkeeping table (`inbox_schema_migrations`), so
    //! that the application's `_sqlx_migrations` never sees our versions.

    use sqlx::migrate::{Migration, Migrator};

    use crate::error::StoreError;

    /// The migrations not applied yet; an applied one whose text changed is an error.
    pub(crate) fn pending<'m>(
        migrator: &'m Migrator,
        applied: &[(i64, Vec<u8>)],
    ) -> Result<Vec<&'m Migration>, StoreError> {
        let mut todo = Vec::new();
        for migration in migrator
            .iter()
            .filter(|m| m.migration_type.is_up_migration())
        {
            match applied.iter().find(|(v, _)| *v == migration.version) {
                Some((_, checksum)) if checksum.as_slice() != &*migration.checksum => {
                    return Err(StoreError::Migration(format!(
                        "inbox migration {} ({}) was changed after it was applied",
                        migration.version, migration.description
                    )));
                }
                Some(_) => {}
                None => todo.push(migration),
            }
        }
        Ok(todo)
    }

    pub(crate) fn failed(what: &str, e: sqlx::Error) -> StoreError {
        StoreError::Migration(format!("{what}: {e}"))
    }

    /// Applies `$migrator`'s pending migrations on connection `$conn`, each in its own
    /// transaction together with its bookkeeping row. A macro rather than a generic function:
    /// sqlx's executor bounds do not survive an `async fn` generic over the database.
    macro_rules! apply {
        ($conn:expr, $migrator:expr, create = $create:expr, insert = $insert:expr) => {{
            use sqlx::Connection as _;
            use $crate::store::migrate::failed;
            let conn = $conn;
            sqlx::Executor::execute(&mut *conn, $create)
                .await
                .map_err(|e| failed("creating inbox_schema_migrations", e))?;
            let applied: Vec<(i64, Vec<u8>)> =
                sqlx::query_as("SELECT version, checksum FROM inbox_schema_migrations")
                    .fetch_all(&mut *conn)
                    .await
                    .map_err(|e| failed("reading inbox_schema_migrations", e))?;
            for migration in $crate::store::migrate::pending($migrator, &applied)? {
                let mut tx = conn.begin().await.map_err(|e| failed("begin", e))?;
                // A plain string runs unprepared, so a migration may hold several statements.
                sqlx::Executor::execute(&mut *tx, &*migration.sql)
                    .await
                    .map_err(|e| failed(&format!("applying {}", migration.description), e))?;
                sqlx::query($insert)
                    .bind(migration.version)
                    .bind(migration.description.to_string())
                    .bind(migration.checksum.to_vec())
                    .execute(&mut *tx)
                    .await
                    .map_err(|e| failed("recording the migration", e))?;
                tx.commit().await.map_err(|e| failed("commit", e))?;
                tracing::info!(version = migration.version, description = %migration.description, "applied inbox migration");
            }
            Ok::<(), StoreError>(())
        }};
    }
    pub(crate) use apply;
}

#[cfg(all(test, any(feature = "postgres", feature = "mysql", feature = "sqlite")))]
mod pacing {
    use std::time::Duration;

    use super::{CleanupPace, Pacer};

    /// Batches one at a time under tokio's paused clock: `took` is what the batch "lasted".
    async fn batch(
        pacer: &mut Pacer,
        deleted: impl FnOnce(u32) -> u64,
        took: Duration,
    ) -> (u32, bool, Duration) {
        let rows = pacer.rows();
        tokio::time::advance(took).await;
        let before = tokio::time::Instant::now();
        let last = pacer.batch_done(deleted(rows)).await;
        (rows, last, before.elapsed())
    }

    #[tokio::test(start_paused = true)]
    async fn paced_batches_grow_shrink_and_rest() {
        let ms = Duration::from_millis;
        let mut pacer = Pacer::new(CleanupPace::paced(2_000, ms(20), 4.0));
        let full = |rows: u32| u64::from(rows);
        // Starts small; a fast batch doubles the next, and rests 4 times its length.
        assert_eq!(batch(&mut pacer, full, ms(5)).await, (500, false, ms(20)));
        assert_eq!(batch(&mut pacer, full, ms(5)).await, (1_000, false, ms(20)));
        // Never past the most rows.
        assert_eq!(
            batch(&mut pacer, full, ms(10)).await,
            (2_000, false, ms(40))
        );
        assert_eq!(batch(&mut pacer, full, ms(1)).await.0, 2_000);
        // A slow batch halves the next at most.
        assert_eq!(
            batch(&mut pacer, full, ms(400)).await,
            (2_000, false, ms(1_600))
        );
        assert_eq!(batch(&mut pacer, full, ms(20)).await.0, 1_000);
        // Fewer rows than asked: the last batch, no rest.
        assert_eq!(
            batch(&mut pacer, |r| u64::from(r) - 1, ms(20)).await,
            (1_000, true, ms(0))
        );
    }

    #[tokio::test(start_paused = true)]
    async fn unpaced_batches_are_full_and_back_to_back() {
        let mut pacer = Pacer::new(CleanupPace::unpaced(10_000));
        for _ in 0..3 {
            let (rows, last, rested) =
                batch(&mut pacer, u64::from, Duration::from_millis(50)).await;
            assert_eq!((rows, last, rested), (10_000, false, Duration::ZERO));
        }
        assert_eq!(CleanupPace::paced(0, Duration::ZERO, f64::NAN).rest, 0.0);
        assert_eq!(CleanupPace::unpaced(0).max_rows, 1);
    }
}
