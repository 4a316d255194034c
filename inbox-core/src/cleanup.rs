//! Retention: deleting processed rows once no copy of their message can come back (`docs/design.md`
//! "Cleanup").
//!
//! A processed row is what makes a redelivered copy a duplicate. Deleting it before the broker
//! stops redelivering (its retention, a dead-letter replay, an upstream outbox's retries) would
//! let a late copy be handled a second time; keeping it for ever grows the table. [`Cleanup`]
//! deletes rows older than a retention window, in bounded batches, on one instance at a time.

use std::time::Duration;

use metrics::counter;
use tokio_util::sync::CancellationToken;

use crate::error::StoreError;
use crate::metrics::CLEANUP_DELETED;
use crate::store::{CleanupPace, CleanupReport, InboxAdmin};

/// Deletes processed rows older than a retention window: once ([`run_once`](Self::run_once)) or
/// every interval in the background ([`run`](Self::run)). Dead-lettered rows are kept.
///
/// ```no_run
/// # #[cfg(feature = "postgres")]
/// # async fn f(store: inbox_core::PostgresStore) {
/// use std::time::Duration;
/// use inbox_core::{CancellationToken, Cleanup};
///
/// let day = Duration::from_secs(24 * 3600);
/// let cleanup = Cleanup::new(store, 14 * day).redelivery_horizon(7 * day);
/// let shutdown = CancellationToken::new();
/// tokio::spawn(async move { cleanup.run(shutdown).await });
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct Cleanup<S> {
    store: S,
    retention: Duration,
    interval: Duration,
    pace: CleanupPace,
    redelivery_horizon: Duration,
}

/// Kafka's default `retention.ms`: a consumer group reset to the earliest offset can bring back
/// a week of messages.
const DEFAULT_HORIZON: Duration = Duration::from_secs(7 * 24 * 3600);

/// The default pace: batches of about 20 ms, each followed by a rest of 4 times as long, so the
/// cleanup takes about a fifth of the database's time. In the benchmark's `cleanup_during` mode
/// on a 2-core machine it lowered the claims' p99 during a cleanup whose batches commit
/// synchronously (2.1–2.4 ms against 3.2–3.3 unpaced); see the README for the rest.
const DEFAULT_BATCH_TIME: Duration = Duration::from_millis(20);
const DEFAULT_REST: f64 = 4.0;

impl<S: InboxAdmin> Cleanup<S> {
    /// Cleanup of rows processed more than `retention` ago, every 10 minutes, paced (batches of
    /// about 20 ms, at most 10 000 rows, each followed by a rest 4 times as long: see
    /// [`pace`](Self::pace)), assuming copies can come back for 7 days (see
    /// [`redelivery_horizon`](Self::redelivery_horizon)).
    pub fn new(store: S, retention: Duration) -> Self {
        Self {
            store,
            retention,
            interval: Duration::from_secs(600),
            pace: CleanupPace::paced(10_000, DEFAULT_BATCH_TIME, DEFAULT_REST),
            redelivery_horizon: DEFAULT_HORIZON,
        }
    }

    /// How often [`run`](Self::run) cleans up.
    pub fn interval(mut self, interval: Duration) -> Self {
        self.interval = interval.max(Duration::from_millis(1));
        self
    }

    /// The most rows per transaction (at least 1). Each batch holds its row locks only while it
    /// deletes: cleanup never waits for a claim, and only a late copy of a row in the batch
    /// being deleted waits, for that one batch.
    pub fn batch_size(mut self, rows: u32) -> Self {
        self.pace.max_rows = rows.max(1);
        self
    }

    /// Batches sized to take about `batch_time` each, each followed by a rest of `rest` times
    /// its duration, so that the consumers' claims barely feel the cleanup (see
    /// [`CleanupPace`]). A rest of `r` deletes at about `1 / (1 + r)` of the unpaced rate.
    pub fn pace(mut self, batch_time: Duration, rest: f64) -> Self {
        self.pace = CleanupPace::paced(self.pace.max_rows, batch_time, rest);
        self
    }

    /// Batches of [`batch_size`](Self::batch_size) rows back to back: the fastest cleanup, felt
    /// most by the claims running beside it.
    pub fn unpaced(mut self) -> Self {
        self.pace = CleanupPace::unpaced(self.pace.max_rows);
        self
    }

    /// The longest time after which a copy of a processed message can still arrive: the broker's
    /// retention, the longest dead-letter replay, the producer's retries. A retention shorter than
    /// this is logged as a warning when [`run`](Self::run) starts, since a copy arriving after
    /// its row was deleted is handled again.
    pub fn redelivery_horizon(mut self, horizon: Duration) -> Self {
        self.redelivery_horizon = horizon;
        self
    }

    /// Whether the retention covers the redelivery horizon.
    pub fn retention_covers_horizon(&self) -> bool {
        self.retention >= self.redelivery_horizon
    }

    /// One cleanup pass now. Returns at once, with
    /// [`skipped_locked`](CleanupReport::skipped_locked), when another instance is cleaning up.
    pub async fn run_once(&self) -> Result<CleanupReport, StoreError> {
        self.run_once_with_progress(&|_| {}).await
    }

    /// [`run_once`](Self::run_once), calling `progress` with the rows deleted so far after each
    /// batch.
    pub async fn run_once_with_progress(
        &self,
        progress: &(dyn Fn(u64) + Send + Sync),
    ) -> Result<CleanupReport, StoreError> {
        let report = self
            .store
            .cleanup_with_progress(self.retention, self.pace, progress)
            .await?;
        counter!(CLEANUP_DELETED).increment(report.deleted);
        Ok(report)
    }

    /// Cleans up every interval until `shutdown`, starting at once. A failed pass is logged and
    /// tried again at the next interval; the consumer does not depend on it.
    pub async fn run(&self, shutdown: CancellationToken) {
        if !self.retention_covers_horizon() {
            tracing::warn!(
                retention = ?self.retention,
                redelivery_horizon = ?self.redelivery_horizon,
                "inbox retention is shorter than the redelivery horizon: a copy arriving after its row is deleted will be handled again"
            );
        }
        loop {
            let pass = tokio::select! {
                biased;
                () = shutdown.cancelled() => return,
                pass = self.run_once() => pass,
            };
            match pass {
                Ok(report) if report.skipped_locked => {
                    tracing::debug!("inbox cleanup skipped: another instance holds the lock");
                }
                Ok(report) => {
                    tracing::info!(
                        deleted = report.deleted,
                        batches = report.batches,
                        "inbox cleanup"
                    );
                }
                Err(e) => {
                    tracing::warn!(error = %e, "inbox cleanup failed; trying again at the next interval")
                }
            }
            tokio::select! {
                biased;
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(self.interval) => {}
            }
        }
    }
}
