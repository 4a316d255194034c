//! The relay: claims committed outbox rows in batches, publishes them pipelined, marks them.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use futures::stream::BoxStream;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::{Outbox, OutboxRow, OutboxStore, PublishFailure};
use crate::error::{ErrorKind, StoreError, TransportError, error_chain};
use crate::metrics::outbox as m;
use crate::transport::Transport;

/// How soon an idle relay looks again after finding nothing, doubling up to the poll interval.
const FIRST_IDLE_POLL: Duration = Duration::from_millis(10);

/// Why [`Relay::run`] stopped with an error.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RelayError {
    /// The store failed in a way retrying will not fix (for example the outbox table is
    /// missing: run the migrations).
    #[error("outbox store failed permanently: {0}")]
    Store(#[source] StoreError),
}

impl RelayError {
    /// Always permanent: transient failures are retried inside the relay.
    pub fn kind(&self) -> ErrorKind {
        ErrorKind::Permanent
    }
}

impl RelayReport {
    fn add(&mut self, other: &RelayReport) {
        self.batches += other.batches;
        self.published += other.published;
        self.failed += other.failed;
        self.dead += other.dead;
        self.fenced += other.fenced;
        self.cleaned += other.cleaned;
    }
}

/// What a relay did, returned by [`Relay::run`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RelayReport {
    /// Batches claimed.
    pub batches: u64,
    /// Rows published and marked.
    pub published: u64,
    /// Publishes that failed (the rows are retried, or dead).
    pub failed: u64,
    /// Rows marked dead.
    pub dead: u64,
    /// Rows published whose mark was refused because their lease had lapsed and another relay
    /// took them (it publishes them again: the consumer's inbox discards the copy).
    pub fenced: u64,
    /// Published rows deleted by retention.
    pub cleaned: u64,
}

/// Publishes the outbox's committed rows through a [`Transport`]; see the [module](super) docs.
///
/// Any number of relays may run at once, in one process or many, without a leader: each batch is
/// claimed under a lease, and a batch whose rows another relay has taken can no longer mark them
/// or record failures on them (fencing; see [`OutboxStore`]). A relay stalled mid-batch loses its
/// rows to another relay once the lease lapses (5 s by default); one killed, on PostgreSQL at
/// once (its connection closes), elsewhere after the lease.
pub struct Relay<S> {
    outbox: Outbox<S>,
    transport: Arc<dyn Transport>,
    batch_size: u32,
    lease: Duration,
    poll_interval: Duration,
    retention: Duration,
    cleanup_interval: Duration,
    stats_interval: Duration,
    min_delay: Duration,
    max_delay: Duration,
    max_no_route_attempts: u32,
    concurrency: usize,
    /// Batches publish under the shared side; a publish retried alone under the exclusive one.
    publishing: tokio::sync::RwLock<()>,
}

impl<S> std::fmt::Debug for Relay<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Relay")
            .field("transport", &self.transport.name())
            .field("batch_size", &self.batch_size)
            .field("lease", &self.lease)
            .field("poll_interval", &self.poll_interval)
            .field("retention", &self.retention)
            .field("cleanup_interval", &self.cleanup_interval)
            .field("stats_interval", &self.stats_interval)
            .finish_non_exhaustive()
    }
}

impl<S: OutboxStore> Relay<S> {
    pub(super) fn new(outbox: Outbox<S>, transport: Arc<dyn Transport>) -> Self {
        Self {
            outbox,
            transport,
            batch_size: 500,
            lease: Duration::from_secs(5),
            poll_interval: Duration::from_secs(1),
            retention: Duration::ZERO,
            cleanup_interval: Duration::from_secs(10),
            stats_interval: Duration::from_secs(15),
            min_delay: Duration::from_millis(100),
            max_delay: Duration::from_secs(30),
            max_no_route_attempts: 100,
            concurrency: 2,
            publishing: tokio::sync::RwLock::new(()),
        }
    }

    /// Rows claimed and published per batch (default 500, at least 1). Large batches amortise
    /// the claim's and the mark's statements: on this project's bench, 500 rows (two batches in
    /// flight) kept up with the broker's own publish rate where 100 reached about half of it.
    pub fn batch_size(mut self, rows: u32) -> Self {
        self.batch_size = rows.max(1);
        self
    }

    /// How long a batch's claim lasts (default 5 s). A relay that dies or stalls loses its rows
    /// to the others after this; publishes still unconfirmed by then count as failed. Keep it
    /// longer than a batch's publish takes. On PostgreSQL each batch in flight holds a pooled
    /// connection (in a transaction, its rows locked) until its publishes are confirmed.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease.max(Duration::from_millis(100));
        self
    }

    /// The longest an idle relay waits before it looks for rows without a wake-up (default
    /// 1 s). Idle, it looks after 10 ms, then doubles the wait up to this: an idle relay costs at
    /// most one look per interval (on PostgreSQL three round trips: `BEGIN`, the claim,
    /// `ROLLBACK`). Wake-ups (commits through [`Outbox::commit`], a consumer's
    /// [`Outbox::after_commit`], PostgreSQL's `NOTIFY` from other processes) cut the wait short.
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.poll_interval = interval.max(FIRST_IDLE_POLL);
        self
    }

    /// How long published rows are kept (default zero: deleted by the statement that marks them
    /// published). Kept rows are deleted in batches of 1,000, every
    /// [`cleanup_interval`](Self::cleanup_interval), by any relay. While a row is kept, a send of
    /// the same message id to the same destination writes nothing.
    pub fn retention(mut self, retention: Duration) -> Self {
        self.retention = retention;
        self
    }

    /// How often the relay deletes a batch of up to 1,000 published rows older than the
    /// retention (default 10 s; at least 10 ms).
    pub fn cleanup_interval(mut self, every: Duration) -> Self {
        self.cleanup_interval = every.max(Duration::from_millis(10));
        self
    }

    /// How often the relay samples the pending rows' gauges (default 15 s; at least 10 ms): one
    /// statement reading the rows not published yet, by their indexes.
    pub fn stats_interval(mut self, every: Duration) -> Self {
        self.stats_interval = every.max(Duration::from_millis(10));
        self
    }

    /// The backoff of a row whose publish failed transiently: `min` doubling per failed attempt
    /// up to `max` (default 100 ms to 30 s). The relay pauses as long when a whole batch failed.
    pub fn retry_delays(mut self, min: Duration, max: Duration) -> Self {
        self.min_delay = min;
        self.max_delay = max.max(min);
        self
    }

    /// How often a publish may find no route (RabbitMQ: no queue bound yet; Kafka: no topic)
    /// before the row is dead (default 100, about 45 minutes with the default delays): the
    /// consumers' queues may not exist yet when the first rows are written. Other transient
    /// failures (the broker down) never make a row dead; permanent ones (the broker refuses the
    /// message) do at once.
    pub fn max_no_route_attempts(mut self, attempts: u32) -> Self {
        self.max_no_route_attempts = attempts.max(1);
        self
    }

    /// Batches in flight at once (default 2, at least 1): while one batch's publishes wait for
    /// the broker's confirms, another is claimed or marked, so the database's round trips and the
    /// broker's overlap. Order is kept all the same: a key's next row is not claimed while an
    /// earlier one is pending, whichever batch holds it.
    pub fn concurrency(mut self, batches: usize) -> Self {
        self.concurrency = batches.max(1);
        self
    }

    /// Runs until `stop` is cancelled, then finishes the batches in flight (publishes and marks
    /// them) and returns. Transient errors are retried with backoff; a permanent store error ends
    /// the run.
    pub async fn run(&self, stop: CancellationToken) -> Result<RelayReport, RelayError> {
        // A permanent error in one worker stops the others.
        let failed = stop.child_token();
        let workers = (0..self.concurrency).map(|worker| {
            let failed = failed.clone();
            async move {
                let result = self.work(worker, &failed).await;
                if result.is_err() {
                    failed.cancel();
                }
                result
            }
        });
        let mut total = RelayReport::default();
        let mut error = None;
        for result in futures::future::join_all(workers).await {
            match result {
                Ok(report) => total.add(&report),
                Err(e) => error = error.or(Some(e)),
            }
        }
        match error {
            Some(e) => Err(e),
            None => Ok(total),
        }
    }

    /// One worker's loop: claim, publish, mark, until `stop`. Worker 0 also listens for other
    /// processes' wake-ups (one listening connection per relay), samples the gauges and runs the
    /// retention cleanup.
    async fn work(
        &self,
        worker: usize,
        stop: &CancellationToken,
    ) -> Result<RelayReport, RelayError> {
        let mut report = RelayReport::default();
        let mut signals = if worker == 0 {
            self.signals().await
        } else {
            None
        };
        let mut idle = FIRST_IDLE_POLL;
        let mut failures = 0u32;
        let mut next_cleanup = Instant::now();
        let mut next_stats = Instant::now();
        let mut gauged = HashSet::new();
        while !stop.is_cancelled() {
            match self.run_once_into(&mut report).await {
                Ok(Batch::Empty) => {
                    failures = 0;
                    tokio::select! {
                        biased;
                        () = stop.cancelled() => break,
                        () = self.outbox.woken() => idle = FIRST_IDLE_POLL,
                        Some(()) = next_signal(&mut signals) => {
                            // Another process committed: this relay's other workers too.
                            self.outbox.wake_local();
                            idle = FIRST_IDLE_POLL;
                        }
                        () = tokio::time::sleep(idle) => idle = (idle * 2).min(self.poll_interval),
                    }
                }
                Ok(Batch::Published) => {
                    failures = 0;
                    idle = FIRST_IDLE_POLL;
                }
                Ok(Batch::Full) => {
                    // There is likely more: the idle workers too.
                    failures = 0;
                    idle = FIRST_IDLE_POLL;
                    self.outbox.wake_local();
                }
                Ok(Batch::AllFailed) => {
                    // The broker is down, most likely: pause instead of claiming the next rows.
                    failures += 1;
                    self.pause(failures, stop).await;
                }
                Err(e) if e.is_transient() => {
                    failures += 1;
                    // One line per outage and relay, not one per worker.
                    if worker == 0 {
                        tracing::warn!(error = %error_chain(&e), "outbox relay: store unavailable; retrying");
                    }
                    self.pause(failures, stop).await;
                }
                Err(e) => return Err(RelayError::Store(e)),
            }
            if worker > 0 {
                continue;
            }
            if Instant::now() >= next_stats {
                next_stats = Instant::now() + self.stats_interval;
                self.sample_stats(&mut gauged).await;
            }
            // Also with no retention: a store may have more to clean than published rows (the
            // lock rows of ordering keys on MySQL).
            if Instant::now() >= next_cleanup {
                next_cleanup = Instant::now() + self.cleanup_interval;
                match self.outbox.store.outbox_cleanup(self.retention, 1000).await {
                    Ok(n) => report.cleaned += n,
                    Err(e) => tracing::warn!(error = %error_chain(&e), "outbox cleanup failed"),
                }
            }
        }
        Ok(report)
    }

    /// Claims, publishes and marks one batch. Returns how many rows it published; zero when
    /// there was nothing to claim (or nothing went out).
    pub async fn run_once(&self) -> Result<usize, StoreError> {
        let mut report = RelayReport::default();
        self.run_once_into(&mut report).await?;
        Ok(report.published as usize)
    }

    async fn run_once_into(&self, report: &mut RelayReport) -> Result<Batch, StoreError> {
        let batch = self
            .outbox
            .store
            .claim_outbox(self.batch_size, self.lease)
            .await?;
        // The lease runs from the claim (not from before it: on PostgreSQL the claim may have
        // waited for a pooled connection); stop waiting for confirms a tenth of it before it
        // ends, so that no publish of ours is still in flight once another relay may have the
        // row (and the next row of its key).
        let deadline = Instant::from_std(batch.lease_started()) + self.lease - self.lease / 10;
        let (rows, claim) = batch.into_parts();
        if rows.is_empty() {
            return Ok(Batch::Empty);
        }
        report.batches += 1;
        let span = tracing::info_span!(
            "outbox_publish",
            transport = self.transport.name(),
            rows = rows.len()
        );
        let started = Instant::now();
        // Pipelined: every publish in flight at once, each bounded by the lease. Shared with the
        // other workers' batches; a publish retried alone takes it exclusively.
        let shared = self.publishing.read().await;
        let results = futures::future::join_all(rows.iter().map(|row| {
            let publish = self
                .transport
                .publish(&row.destination, row.message.clone());
            async move {
                match tokio::time::timeout_at(deadline, publish).await {
                    Ok(result) => result,
                    Err(_) => Err(TransportError::NotConfirmed(
                        "not confirmed within the relay's lease".into(),
                    )),
                }
            }
        }))
        .instrument(span)
        .await;
        drop(shared);
        let confirmed_after = started.elapsed();
        let mut published = Vec::new();
        let mut failed = Vec::new();
        for (row, result) in rows.iter().zip(results) {
            let result = match result {
                // Tried once more on its own before the row is dead: on a broker whose channel
                // one refused message closes (RabbitMQ), every publish in flight on it fails
                // with that refusal, the innocent ones too — this batch's and, with batches in
                // flight at once, another worker's. Alone means alone in the relay: the retry
                // waits until no other batch is publishing. One that cannot be tried before the
                // lease ends is retried later, not dead.
                Err(e) if !e.is_transient() => {
                    tracing::debug!(row = row.id, error = %e, "outbox publish refused; trying it alone");
                    let alone = async {
                        let _alone = self.publishing.write().await;
                        self.transport
                            .publish(&row.destination, row.message.clone())
                            .await
                    };
                    match tokio::time::timeout_at(deadline, alone).await {
                        Ok(result) => result,
                        Err(_) => Err(TransportError::NotConfirmed(
                            format!("refused ({e}), and not tried alone within the relay's lease")
                                .into(),
                        )),
                    }
                }
                other => other,
            };
            match result {
                Ok(()) => published.push(row),
                Err(e) => failed.push((row, self.failure(row, &e))),
            }
        }
        let ids: Vec<i64> = published.iter().map(|r| r.id).collect();
        let failures: Vec<PublishFailure> = failed.iter().map(|(_, f)| f.clone()).collect();
        let keep = self.retention > Duration::ZERO;
        let marked = claim.finish(&ids, &failures, keep).await?;
        let fenced = ids.len() as u64 - marked.min(ids.len() as u64);
        if fenced > 0 {
            tracing::warn!(
                fenced,
                "outbox relay: lease lapsed before the mark; another relay publishes those rows again"
            );
        }
        // The handles once per destination (a batch has one, mostly), not per row: each
        // lookup allocates its labels and hashes them.
        let mut start = 0;
        while start < published.len() {
            let destination = &published[start].destination;
            let end = published[start..]
                .iter()
                .position(|row| &row.destination != destination)
                .map_or(published.len(), |n| start + n);
            let labels = self.labels(destination);
            metrics::counter!(m::PUBLISHED, &labels).increment((end - start) as u64);
            let latency = metrics::histogram!(m::COMMIT_TO_CONFIRM_SECONDS, &labels);
            for row in &published[start..end] {
                latency.record((row.age + confirmed_after).as_secs_f64());
            }
            start = end;
        }
        report.published += marked;
        report.fenced += fenced;
        for (row, failure) in &failed {
            let labels = self.labels(&row.destination);
            metrics::counter!(m::FAILED, &labels).increment(1);
            if failure.dead {
                metrics::counter!(m::DEAD, &labels).increment(1);
                tracing::error!(row = row.id, message_id = row.message.message_id.as_deref().unwrap_or(""), destination = %row.destination, reason = %failure.error, "outbox row dead: it will not be published unless an operator retries it");
            } else {
                tracing::debug!(row = row.id, reason = %failure.error, "outbox publish failed; retrying later");
            }
        }
        report.failed += failures.len() as u64;
        report.dead += failures.iter().filter(|f| f.dead).count() as u64;
        if published.is_empty() && failures.iter().any(|f| !f.dead) {
            // The broker is down, most likely.
            return Ok(Batch::AllFailed);
        }
        Ok(if rows.len() >= self.batch_size as usize {
            Batch::Full
        } else {
            Batch::Published
        })
    }

    /// Samples the per-destination gauges from the rows not published yet. A destination with
    /// none has no row in the sample: its gauges, if this relay set them before, go to zero
    /// (`gauged` holds the destinations of the last sample).
    async fn sample_stats(&self, gauged: &mut HashSet<String>) {
        match self.outbox.store.outbox_pending_stats().await {
            Ok(stats) => {
                let now: HashSet<String> = stats.iter().map(|s| s.destination.clone()).collect();
                for gone in gauged.difference(&now) {
                    let labels = [("destination", gone.clone())];
                    for gauge in [
                        m::PENDING,
                        m::DEAD_ROWS,
                        m::BLOCKED_KEYS,
                        m::OLDEST_PENDING_SECONDS,
                    ] {
                        metrics::gauge!(gauge, &labels).set(0.0);
                    }
                }
                *gauged = now;
                for s in stats {
                    let labels = [("destination", s.destination.clone())];
                    metrics::gauge!(m::PENDING, &labels).set(s.pending as f64);
                    metrics::gauge!(m::DEAD_ROWS, &labels).set(s.dead as f64);
                    metrics::gauge!(m::BLOCKED_KEYS, &labels).set(s.blocked_keys as f64);
                    metrics::gauge!(m::OLDEST_PENDING_SECONDS, &labels)
                        .set(s.oldest_pending_seconds.unwrap_or(0.0));
                }
            }
            Err(e) => tracing::debug!(error = %error_chain(&e), "outbox stats not sampled"),
        }
    }

    fn failure(&self, row: &OutboxRow, error: &TransportError) -> PublishFailure {
        let attempts = row.attempts.saturating_add(1);
        let no_route = matches!(error, TransportError::NoRoute(_));
        let dead = if no_route {
            row.no_routes.saturating_add(1) >= self.max_no_route_attempts
        } else {
            !error.is_transient()
        };
        PublishFailure {
            id: row.id,
            error: error_chain(error),
            retry_after: self.backoff(attempts),
            dead,
            no_route,
        }
    }

    fn backoff(&self, attempts: u32) -> Duration {
        let factor = 2u32.saturating_pow(attempts.saturating_sub(1).min(20));
        self.min_delay.saturating_mul(factor).min(self.max_delay)
    }

    async fn pause(&self, failures: u32, stop: &CancellationToken) {
        tokio::select! {
            () = stop.cancelled() => {}
            () = tokio::time::sleep(self.backoff(failures)) => {}
        }
    }

    fn labels(&self, destination: &str) -> [(&'static str, String); 2] {
        [
            ("destination", destination.to_owned()),
            ("transport", self.transport.name().to_owned()),
        ]
    }

    async fn signals(&self) -> Option<BoxStream<'static, ()>> {
        match self.outbox.store.relay_signals().await {
            Ok(signals) => signals,
            Err(e) => {
                tracing::warn!(error = %error_chain(&e), "outbox relay: no wake-ups from other processes; polling");
                None
            }
        }
    }
}

enum Batch {
    Empty,
    Published,
    /// Published, and the claim was full: more rows may be waiting.
    Full,
    AllFailed,
}

/// The next signal; never resolves when there is no signal stream (or it ended).
async fn next_signal(signals: &mut Option<BoxStream<'static, ()>>) -> Option<()> {
    match signals {
        Some(stream) => match stream.next().await {
            Some(()) => Some(()),
            None => {
                *signals = None;
                std::future::pending().await
            }
        },
        None => std::future::pending().await,
    }
}
