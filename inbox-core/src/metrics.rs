//! Metric names and the handles one consumer run records through (the `metrics` facade: install
//! any recorder, e.g. `metrics-exporter-prometheus`).

use std::future::Future;
use std::time::Instant;

use metrics::{Counter, Gauge, Histogram, counter, gauge, histogram};

use crate::id::ConsumerName;

/// Messages handled and committed.
pub const PROCESSED: &str = "inbox_processed_total";
/// Deliveries discarded as already processed or dead-lettered.
pub const DUPLICATES_DISCARDED: &str = "inbox_duplicates_discarded_total";
/// Failed attempts.
pub const FAILED: &str = "inbox_failed_total";
/// Attempts retried in process.
pub const RETRIED: &str = "inbox_retried_total";
/// Messages dead-lettered.
pub const DEAD_LETTERED: &str = "inbox_dead_lettered_total";
/// Batches whose transaction failed as a whole, so that their messages were handled one by one
/// (batch mode). Steadily above zero means batches buy nothing: look at the logs for why.
pub const BATCH_FALLBACKS: &str = "inbox_batch_fallbacks_total";
/// Batches a batch handler failed that were split to isolate the failing message. Steadily
/// above zero means most batches hold a message that fails: look at the logs for why.
pub const BATCH_SPLITS: &str = "inbox_batch_splits_total";
/// Rows in the inbox table (gauge, sampled by a running consumer; see
/// `Consumer::sample_stats_every`).
pub const ROWS: &str = "inbox_rows";
/// Dead-lettered rows in the inbox table (gauge, sampled like [`ROWS`]).
pub const DEAD_ROWS: &str = "inbox_dead_rows";
/// Rows deleted by [`Cleanup`](crate::Cleanup) (not labelled by consumer: one pass covers all).
pub const CLEANUP_DELETED: &str = "inbox_cleanup_deleted_total";
/// Seconds spent claiming: a message's `BEGIN` and claim (one round trip on PostgreSQL for a
/// message not seen before), or a batch's claim statement.
pub const CLAIM_SECONDS: &str = "inbox_claim_seconds";
/// Seconds spent in the handler.
pub const HANDLE_SECONDS: &str = "inbox_handle_seconds";

/// Handles registered once per run, labelled by consumer and transport.
pub(crate) struct Metrics {
    processed: Counter,
    duplicates: Counter,
    failed: Counter,
    retried: Counter,
    dead_lettered: Counter,
    batch_fallbacks: Counter,
    batch_splits: Counter,
    claim_seconds: Histogram,
    handle_seconds: Histogram,
    rows: Gauge,
    dead_rows: Gauge,
}

impl Metrics {
    pub(crate) fn new(consumer: &ConsumerName, transport: &'static str) -> Self {
        let labels = [
            ("consumer", consumer.as_str().to_owned()),
            ("transport", transport.to_owned()),
        ];
        Self {
            processed: counter!(PROCESSED, &labels),
            duplicates: counter!(DUPLICATES_DISCARDED, &labels),
            failed: counter!(FAILED, &labels),
            retried: counter!(RETRIED, &labels),
            dead_lettered: counter!(DEAD_LETTERED, &labels),
            batch_fallbacks: counter!(BATCH_FALLBACKS, &labels),
            batch_splits: counter!(BATCH_SPLITS, &labels),
            claim_seconds: histogram!(CLAIM_SECONDS, &labels),
            handle_seconds: histogram!(HANDLE_SECONDS, &labels),
            rows: gauge!(ROWS, &labels),
            dead_rows: gauge!(DEAD_ROWS, &labels),
        }
    }

    pub(crate) fn processed(&self) {
        self.processed.increment(1);
    }
    pub(crate) fn duplicate(&self) {
        self.duplicates.increment(1);
    }
    pub(crate) fn failed(&self) {
        self.failed.increment(1);
    }
    pub(crate) fn retried(&self) {
        self.retried.increment(1);
    }
    pub(crate) fn dead_lettered(&self) {
        self.dead_lettered.increment(1);
    }
    pub(crate) fn batch_fallback(&self) {
        self.batch_fallbacks.increment(1);
    }
    pub(crate) fn batch_split(&self) {
        self.batch_splits.increment(1);
    }

    pub(crate) fn rows(&self, rows: u64, dead: u64) {
        self.rows.set(rows as f64);
        self.dead_rows.set(dead as f64);
    }

    pub(crate) async fn time_claim<T>(&self, f: impl Future<Output = T>) -> T {
        let start = Instant::now();
        let out = f.await;
        self.claim_seconds.record(start.elapsed().as_secs_f64());
        out
    }

    pub(crate) async fn time_handle<T>(&self, f: impl Future<Output = T>) -> T {
        let start = Instant::now();
        let out = f.await;
        self.handle_seconds.record(start.elapsed().as_secs_f64());
        out
    }
}

/// The outbox relay's metrics, labelled by `destination` and `transport`.
pub mod outbox {
    /// Counter: rows published (confirmed by the broker) and marked.
    pub const PUBLISHED: &str = "inbox_outbox_published_total";
    /// Counter: publishes that failed (the row is retried, or dead).
    pub const FAILED: &str = "inbox_outbox_failed_total";
    /// Counter: rows marked dead.
    pub const DEAD: &str = "inbox_outbox_dead_total";
    /// Histogram: seconds from a row's write to the broker's confirmation of its publish.
    pub const COMMIT_TO_CONFIRM_SECONDS: &str = "inbox_outbox_commit_to_confirm_seconds";
    /// Gauge (labelled by `destination` only): rows not published yet, dead ones included.
    pub const PENDING: &str = "inbox_outbox_pending";
    /// Gauge (by `destination`): age of the oldest pending row that is not dead, in seconds.
    pub const OLDEST_PENDING_SECONDS: &str = "inbox_outbox_oldest_pending_seconds";
    /// Gauge (by `destination`): dead rows.
    pub const DEAD_ROWS: &str = "inbox_outbox_dead_rows";
    /// Gauge (by `destination`): ordering keys held back by a failing or dead row.
    pub const BLOCKED_KEYS: &str = "inbox_outbox_blocked_keys";
}
