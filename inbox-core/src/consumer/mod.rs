//! The consumer: the dedup-and-commit-then-ack algorithm of `docs/design.md`.
//!
//! For each delivery (`delivery.rs`):
//!
//! 1. take the message id (an invalid one: dead-letter, ack);
//! 2. begin a transaction and claim `(consumer, id)` — one statement that inserts the row or
//!    locks the one there;
//! 3. decide on the claim (`decision.rs`): done or dead before → ack the copy and discard it;
//!    over a limit → dead-letter under the claim; otherwise run the handler in the transaction;
//! 4. handler Ok → commit, then ack (the [`AckToken`](crate::AckToken) makes the reverse order
//!    impossible);
//! 5. handler Err → roll back; a permanent error is dead-lettered, a transient one is recorded in
//!    its own transaction and retried in process, handed back to the broker, or given up when its
//!    attempts run out.
//!
//! Batch mode (`batch.rs`) claims many ids in one statement and runs each handler in a savepoint
//! of one transaction; anything unusual in a batch goes the per-message way after its commit.
//! The run loop (`run.rs`) subscribes, gathers batches, keeps one lane per ordering key, waits
//! out store outages and drains on shutdown.

mod batch;
mod dead_letter;
mod decision;
mod delivery;
mod offsets;
mod run;
mod settings;
mod settle;
mod store_retry;
mod tally;
mod whole;

use std::ops::Deref;
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::handler::Handler;
use crate::id::{ConsumerName, IdStrategy};
use crate::metrics::Metrics;
use crate::outage::{Outage, Throttle};
use crate::retry::RetryPolicy;
use crate::store::InboxStore;
use crate::transport::Transport;

pub use dead_letter::{dead_letter_headers, default_dead_letter_destination};
pub use settings::{AfterCommit, Batching, Dedup};
pub use tally::ConsumerReport;

use settings::{Hook, Settings};
use tally::{Counters, Event};

/// A consumer: takes deliveries from a [`Transport`], dedups them through an [`InboxStore`],
/// runs the [`Handler`] in the inbox transaction, commits, and only then acks.
///
/// Cloning gives another handle on the same consumer (same counters); each
/// [`run`](Self::run) is one competing instance.
pub struct Consumer<S: InboxStore, H> {
    inner: Arc<Inner<S, H>>,
}

impl<S: InboxStore, H> Clone for Consumer<S, H> {
    fn clone(&self) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
        }
    }
}

/// The consumer, shared by its handles and its runs.
struct Inner<S: InboxStore, H> {
    name: ConsumerName,
    source: String,
    transport: Arc<dyn Transport>,
    store: S,
    handler: H,
    settings: Settings,
    counters: Counters,
    /// Shared by all instances: while the store is down, one task probes and none takes new
    /// deliveries.
    store_outage: Outage,
    /// Acks lost with a connection come in bursts: one log line per interval.
    lost_acks: Throttle,
    /// Subscribe failures while the broker is down: one log line per interval.
    broker_down: Throttle,
    /// Dead letters that cannot be published (a broken destination): one line per interval.
    dead_letter_failures: Throttle,
}

/// One run of a consumer as its tasks see it: the consumer, the run's metrics and its stop
/// token, in one value instead of three parameters of every function.
struct Run<S: InboxStore, H> {
    consumer: Arc<Inner<S, H>>,
    metrics: Arc<Metrics>,
    stop: CancellationToken,
}

impl<S: InboxStore, H> Clone for Run<S, H> {
    fn clone(&self) -> Self {
        Self {
            consumer: Arc::clone(&self.consumer),
            metrics: Arc::clone(&self.metrics),
            stop: self.stop.clone(),
        }
    }
}

/// The run reads the consumer's fields as its own.
impl<S: InboxStore, H> Deref for Run<S, H> {
    type Target = Inner<S, H>;

    fn deref(&self) -> &Inner<S, H> {
        &self.consumer
    }
}

impl<S: InboxStore, H> Run<S, H> {
    /// Counts `event` in the report and the metrics.
    fn count(&self, event: Event) {
        self.counters.count(&self.metrics, event);
    }
}

/// How often a continuing outage is logged.
const OUTAGE_LOG_INTERVAL: Duration = Duration::from_secs(10);

fn store_outage(policy: &RetryPolicy) -> Outage {
    Outage::new("inbox store", policy.clone(), OUTAGE_LOG_INTERVAL)
}

impl<S: InboxStore, H: Handler<S::Tx>> Consumer<S, H> {
    /// A consumer named `name` of `source`, with the default settings: 8 handlers in flight, id
    /// from the broker's id property or the `message-id` header, 5 attempts, dead letters to
    /// [`default_dead_letter_destination`], payloads up to 1 MiB.
    pub fn new(
        name: ConsumerName,
        source: impl Into<String>,
        transport: Arc<dyn Transport>,
        store: S,
        handler: H,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                name,
                source: source.into(),
                transport,
                store,
                handler,
                store_outage: store_outage(&Settings::default().reconnect),
                settings: Settings::default(),
                counters: Counters::default(),
                lost_acks: Throttle::new(OUTAGE_LOG_INTERVAL),
                broker_down: Throttle::new(OUTAGE_LOG_INTERVAL),
                dead_letter_failures: Throttle::new(OUTAGE_LOG_INTERVAL),
            }),
        }
    }

    fn inner_mut(&mut self) -> &mut Inner<S, H> {
        Arc::get_mut(&mut self.inner).expect("configure a consumer before cloning or running it")
    }

    fn settings_mut(&mut self) -> &mut Settings {
        &mut self.inner_mut().settings
    }

    /// Handlers in flight at once per instance (at least 1).
    pub fn concurrency(mut self, n: usize) -> Self {
        self.settings_mut().concurrency = n.max(1);
        self
    }

    /// Unacknowledged deliveries the broker may hand an instance (default: twice the
    /// concurrency).
    pub fn prefetch(mut self, n: u16) -> Self {
        self.settings_mut().prefetch = Some(n.max(1));
        self
    }

    /// Where message ids come from.
    pub fn id_strategy(mut self, strategy: IdStrategy) -> Self {
        self.settings_mut().id_strategy = strategy;
        self
    }

    /// Retries and the attempt limit.
    pub fn retry(mut self, policy: RetryPolicy) -> Self {
        self.settings_mut().retry = policy;
        self
    }

    /// Backoff while the database or the broker is unreachable (default: 100 ms doubling up to
    /// 5 s, with jitter). While the database is down, one task probes it at these delays, the
    /// others wait, and no new deliveries are taken.
    pub fn reconnect_backoff(mut self, policy: RetryPolicy) -> Self {
        let inner = self.inner_mut();
        inner.store_outage = store_outage(&policy);
        inner.settings.reconnect = policy;
        self
    }

    /// How often each running instance samples this consumer's row counts into the
    /// [`ROWS`](crate::metrics::ROWS) and [`DEAD_ROWS`](crate::metrics::DEAD_ROWS) gauges (default
    /// 30 s; `None`: never). A sample counts the consumer's rows, an index range scan: on
    /// PostgreSQL about 0.1 s per million rows.
    pub fn sample_stats_every(mut self, interval: Option<Duration>) -> Self {
        self.settings_mut().stats_interval = interval;
        self
    }

    /// Where dead letters are published (default: [`default_dead_letter_destination`]).
    pub fn dead_letter_to(mut self, destination: impl Into<String>) -> Self {
        self.settings_mut().dead_letter_destination = Some(destination.into());
        self
    }

    /// Payloads larger than this are dead-lettered unhandled.
    pub fn max_payload_bytes(mut self, n: usize) -> Self {
        self.settings_mut().max_payload_bytes = n;
        self
    }

    /// A handler that runs longer fails transiently (its transaction is rolled back).
    pub fn handler_timeout(mut self, timeout: Duration) -> Self {
        self.settings_mut().handler_timeout = Some(timeout);
        self
    }

    /// Runs `hook` after a message's inbox transaction committed and before its ack: the one
    /// moment a crash leaves a message done but unacknowledged. For fault injection — a crash
    /// harness stalls here and kills the process — and for observing commits in tests.
    pub fn after_commit(mut self, hook: AfterCommit) -> Self {
        self.settings_mut().after_commit = Hook(Some(hook));
        self
    }

    /// Batch mode (`docs/design.md`, "Batches"): deliveries that arrive together — a Kafka poll,
    /// a RabbitMQ prefetch window — are claimed in ONE statement and handled in ONE transaction,
    /// each message in a savepoint; one commit, then every ack. A store may cap the batch size
    /// ([`InboxStore::max_batch`]: 64 on PostgreSQL). A message whose handler fails is
    /// rolled back to its savepoint, its failure recorded in the same transaction, and it goes
    /// through the usual failure model after the commit (retry, requeue, dead-letter) without
    /// costing the others. On an ordered transport, later messages of its key wait for it, and
    /// each batch is split by key (a Kafka partition), each part running after the earlier
    /// parts of its key: batches in flight overlap only across keys. `concurrency` becomes
    /// batches in flight; the default prefetch becomes enough for them.
    ///
    /// With a batch handler (a handler whose [`Handler::as_batch_handler`] is `Some`, such as
    /// [`Batched`](crate::Batched)) each batch is handled in one call with no savepoints and no
    /// store cap; see [`BatchError`](crate::BatchError) for how a failing message is isolated.
    /// A wrapper handler must forward `as_batch_handler`, or its batches take the savepoint way.
    pub fn batch(mut self, batching: Batching) -> Self {
        self.settings_mut().batch = Some(batching);
        self
    }

    /// How copies are told from new messages (default [`Dedup::Ids`]).
    ///
    /// [`Dedup::Offsets`] keeps, per Kafka partition, the offset of the next record to handle in
    /// the table `inbox_offsets`, written in the handler's transaction by a conditional update
    /// that never moves it back (a revoked owner's late transaction waits for the new owner's
    /// and then finds its records consumed). A partition's records at earlier offsets are
    /// copies; no row is written per message (only for one that fails or may have crashed the
    /// consumer: its attempts and dead mark live there). The transport starts each partition it
    /// is assigned at the offset kept (the database, not the broker, is the truth of what was
    /// consumed); offsets are still committed to the broker after the database commits, so lag
    /// dashboards work. It needs a transport with [`Capabilities::log_positions`] that keeps
    /// each partition in order (Kafka with `ordered`): [`run`](Self::run) refuses others.
    ///
    /// It does not catch a producer that sent the same message twice (two records);
    /// [`Dedup::OffsetsAndIds`] does. The table is the consumer's position: a consumer that
    /// leaves offsets mode and comes back later must have its rows deleted first (`DELETE FROM
    /// inbox_offsets WHERE consumer = …`), or it would go back to where it left them.
    ///
    /// [`Capabilities::log_positions`]: crate::Capabilities::log_positions
    pub fn dedup(mut self, dedup: Dedup) -> Self {
        self.settings_mut().dedup = dedup;
        self
    }

    /// How long [`run`](Self::run) lets handlers in flight finish after shutdown (default: as
    /// long as they take). Past it, the rest are abandoned: their transactions roll back and
    /// their deliveries go back to the broker unacknowledged, so a hung handler or broker call
    /// cannot keep the process from exiting (set it below your orchestrator's kill grace).
    pub fn drain_timeout(mut self, timeout: Duration) -> Self {
        self.settings_mut().drain_timeout = Some(timeout);
        self
    }

    /// The consumer's name.
    pub fn name(&self) -> &ConsumerName {
        &self.inner.name
    }

    /// The store, for the application's own reads.
    pub fn store(&self) -> &S {
        &self.inner.store
    }

    /// Counts so far, over all instances of this consumer.
    pub fn report(&self) -> ConsumerReport {
        self.inner.counters.report()
    }
}
