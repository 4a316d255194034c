//! What a consumer did, counted once and reported twice: in [`ConsumerReport`] (atomics shared by
//! every instance of one consumer) and in the [`metrics`](crate::metrics) of the run.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::metrics::Metrics;

/// Counts of what one consumer did, since it was built.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct ConsumerReport {
    /// Deliveries received from the transport.
    pub deliveries: u64,
    /// Messages handled and committed.
    pub processed: u64,
    /// Deliveries discarded because the message was already processed or dead-lettered.
    pub duplicates_discarded: u64,
    /// Failed handler attempts (each retry that fails counts).
    pub failed: u64,
    /// Messages dead-lettered (by this consumer's instances).
    pub dead_lettered: u64,
    /// Deliveries handed back to the broker for redelivery.
    pub requeued: u64,
    /// Acks that did not reach the broker (the copy it redelivers is discarded).
    pub ack_failures: u64,
    /// Batches whose transaction failed as a whole, so that their messages were handled one by
    /// one (batch mode).
    pub batch_fallbacks: u64,
    /// Batches a batch handler failed that were split to isolate the failing message (batch
    /// mode with a [`BatchHandler`](crate::BatchHandler)).
    pub batch_splits: u64,
}

/// One thing that happened to a delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Event {
    /// A delivery came in.
    Delivery,
    /// Its message was handled and committed.
    Processed,
    /// It was a copy of a message done or dead before.
    Duplicate,
    /// An attempt failed.
    Failed,
    /// It is tried again in process.
    Retried,
    /// Its message went to the dead-letter destination.
    DeadLettered,
    /// It was handed back to the broker for redelivery.
    Requeued,
    /// Its ack did not reach the broker.
    AckLost,
    /// A batch's transaction failed and its messages went one by one.
    BatchFallback,
    /// A batch handler's batch failed and was split.
    BatchSplit,
}

/// The consumer's counters, behind [`ConsumerReport`].
#[derive(Debug, Default)]
pub(super) struct Counters {
    deliveries: AtomicU64,
    processed: AtomicU64,
    duplicates: AtomicU64,
    failed: AtomicU64,
    dead_lettered: AtomicU64,
    requeued: AtomicU64,
    ack_failures: AtomicU64,
    batch_fallbacks: AtomicU64,
    batch_splits: AtomicU64,
}

impl Counters {
    /// Counts `event` here and in `metrics`.
    pub(super) fn count(&self, metrics: &Metrics, event: Event) {
        let counter = match event {
            Event::Delivery => &self.deliveries,
            Event::Processed => {
                metrics.processed();
                &self.processed
            }
            Event::Duplicate => {
                metrics.duplicate();
                &self.duplicates
            }
            Event::Failed => {
                metrics.failed();
                &self.failed
            }
            Event::Retried => {
                metrics.retried();
                return;
            }
            Event::DeadLettered => {
                metrics.dead_lettered();
                &self.dead_lettered
            }
            Event::Requeued => &self.requeued,
            Event::AckLost => &self.ack_failures,
            Event::BatchFallback => {
                metrics.batch_fallback();
                &self.batch_fallbacks
            }
            Event::BatchSplit => {
                metrics.batch_split();
                &self.batch_splits
            }
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    pub(super) fn report(&self) -> ConsumerReport {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        ConsumerReport {
            deliveries: get(&self.deliveries),
            processed: get(&self.processed),
            duplicates_discarded: get(&self.duplicates),
            failed: get(&self.failed),
            dead_lettered: get(&self.dead_lettered),
            requeued: get(&self.requeued),
            ack_failures: get(&self.ack_failures),
            batch_fallbacks: get(&self.batch_fallbacks),
            batch_splits: get(&self.batch_splits),
        }
    }
}
