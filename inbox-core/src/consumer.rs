//! The consumer: the dedup-and-commit-then-ack algorithm of DESIGN.md, in one place.

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures::{FutureExt, StreamExt};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, field};

use crate::error::{
    ConsumerError, ErrorKind, HandlerError, StoreError, TransportError, error_chain,
};
use crate::handler::Handler;
use crate::id::{ConsumerName, IdStrategy, MessageId};
use crate::message::{Message, OutgoingMessage};
use crate::metrics::Metrics;
use crate::outage::{Outage, Throttle};
use crate::retry::RetryPolicy;
use crate::store::{Claim, InboxStore};
use crate::transport::{AckToken, Delivery, Subscription, Transport};

/// Headers a dead letter carries besides the original ones.
pub mod dead_letter_headers {
    /// Why the message was dead-lettered.
    pub const REASON: &str = "x-inbox-reason";
    /// The consumer that gave up on it.
    pub const CONSUMER: &str = "x-inbox-consumer";
    /// Attempts made.
    pub const ATTEMPTS: &str = "x-inbox-attempts";
    /// The source it was consumed from (where a replay publishes it again).
    pub const SOURCE: &str = "x-inbox-source";
    /// The message id, when it had a valid one.
    pub const MESSAGE_ID: &str = "x-inbox-message-id";
    /// The record's coordinates, where the transport has them.
    pub const COORDINATES: &str = "x-inbox-coordinates";
    /// On a replayed message: the one consumer it is replayed for. A replay is published to the
    /// source, which every consumer of it reads; the others discard the copy unhandled — also
    /// once their own row of it is gone to cleanup, when the inbox could no longer tell.
    pub const REPLAY_FOR: &str = "x-inbox-replay-for";
}

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
}

#[derive(Debug, Default)]
struct Counters {
    deliveries: AtomicU64,
    processed: AtomicU64,
    duplicates: AtomicU64,
    failed: AtomicU64,
    dead_lettered: AtomicU64,
    requeued: AtomicU64,
    ack_failures: AtomicU64,
    batch_fallbacks: AtomicU64,
}

fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

/// Settings of a consumer; see the setters on [`Consumer`].
#[derive(Debug, Clone)]
struct Settings {
    concurrency: usize,
    prefetch: Option<u16>,
    id_strategy: IdStrategy,
    retry: RetryPolicy,
    dead_letter_destination: Option<String>,
    max_payload_bytes: usize,
    handler_timeout: Option<Duration>,
    reconnect: RetryPolicy,
    after_commit: Hook,
    batch: Option<Batching>,
    stats_interval: Option<Duration>,
    drain_timeout: Option<Duration>,
}

/// Batch mode: deliveries that arrive together are claimed in one statement and handled in one
/// transaction, a savepoint per message, with one commit for all of them. See
/// [`Consumer::batch`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Batching {
    /// The most deliveries in one transaction.
    pub max_size: usize,
    /// How long to wait for more deliveries once one is there. What is already waiting is taken
    /// at once, so at low rates a message waits at most this long.
    pub max_wait: Duration,
}

impl Batching {
    /// Up to `max_size` deliveries (at least 1), waiting at most `max_wait` to fill a batch.
    pub fn new(max_size: usize, max_wait: Duration) -> Self {
        Self {
            max_size: max_size.max(1),
            max_wait,
        }
    }
}

impl Default for Batching {
    /// 100 deliveries, 5 ms.
    fn default() -> Self {
        Self::new(100, Duration::from_millis(5))
    }
}

/// See [`Consumer::after_commit`].
pub type AfterCommit =
    Arc<dyn Fn(&MessageId) -> futures::future::BoxFuture<'static, ()> + Send + Sync>;

/// The optional hook, printable.
#[derive(Clone, Default)]
struct Hook(Option<AfterCommit>);

impl std::fmt::Debug for Hook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "Some(<hook>)"
        } else {
            "None"
        })
    }
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            concurrency: 8,
            prefetch: None,
            id_strategy: IdStrategy::default(),
            retry: RetryPolicy::default(),
            dead_letter_destination: None,
            max_payload_bytes: 1024 * 1024,
            handler_timeout: None,
            reconnect: RetryPolicy::default()
                .with_delays(Duration::from_millis(100), Duration::from_secs(5)),
            after_commit: Hook::default(),
            batch: None,
            stats_interval: Some(Duration::from_secs(30)),
            drain_timeout: None,
        }
    }
}

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

/// The W3C Trace Context header a producer's tracing puts on a message.
pub const TRACEPARENT: &str = "traceparent";

/// A valid W3C `traceparent` value (`00-<trace id>-<parent span id>-<flags>`), whose ids the
/// delivery span records as `trace_id` and `parent_span_id`, so that the consumer's work joins
/// the producer's trace (an OpenTelemetry layer can set the span's parent from them; a log search
/// finds both sides by trace id).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct TraceParent<'a> {
    /// 32 lowercase hex digits, not all zero.
    pub trace_id: &'a str,
    /// 16 lowercase hex digits, not all zero.
    pub span_id: &'a str,
    /// The trace flags (bit 0: sampled).
    pub flags: u8,
}

impl<'a> TraceParent<'a> {
    /// Parses a `traceparent` header value; `None` when it is not valid (then it is ignored, as
    /// the specification says).
    pub fn parse(value: &'a str) -> Option<Self> {
        let mut parts = value.trim().split('-');
        let (version, trace_id, span_id, flags) =
            (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        let hex = |s: &str, len: usize| {
            s.len() == len && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
        };
        let nonzero = |s: &str| s.bytes().any(|b| b != b'0');
        // Version 00 has exactly four fields; later versions may append more; ff is invalid.
        let valid = hex(version, 2)
            && version != "ff"
            && (version != "00" || parts.next().is_none())
            && hex(trace_id, 32)
            && nonzero(trace_id)
            && hex(span_id, 16)
            && nonzero(span_id)
            && hex(flags, 2);
        valid.then(|| Self {
            trace_id,
            span_id,
            flags: u8::from_str_radix(flags, 16).unwrap_or(0),
        })
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
    /// `"<source>.dead-letter"`, payloads up to 1 MiB.
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
        self.inner_mut().settings.stats_interval = interval;
        self
    }

    /// Where dead letters are published (default `"<source>.dead-letter"`).
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

    /// Batch mode (DESIGN.md, "Batches"): deliveries that arrive together — a Kafka poll, a
    /// RabbitMQ prefetch window — are claimed in ONE statement and handled in ONE transaction,
    /// each message in a savepoint; one commit, then every ack. A store may cap the batch size
    /// ([`InboxStore::max_batch`]: 64 on PostgreSQL). A message whose handler fails is
    /// rolled back to its savepoint, its failure recorded in the same transaction, and it goes
    /// through the usual failure model after the commit (retry, requeue, dead-letter) without
    /// costing the others. On an ordered transport, later messages of its key wait for it, and
    /// batches run one at a time. `concurrency` becomes batches in flight; the default prefetch
    /// becomes enough for them.
    pub fn batch(mut self, batching: Batching) -> Self {
        self.settings_mut().batch = Some(batching);
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
        let c = &self.inner.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        ConsumerReport {
            deliveries: get(&c.deliveries),
            processed: get(&c.processed),
            duplicates_discarded: get(&c.duplicates),
            failed: get(&c.failed),
            dead_lettered: get(&c.dead_lettered),
            requeued: get(&c.requeued),
            ack_failures: get(&c.ack_failures),
            batch_fallbacks: get(&c.batch_fallbacks),
        }
    }

    /// Consumes until `shutdown` is cancelled, then stops taking deliveries, lets the handlers in
    /// flight finish (commit, ack), hands back what waits for a retry, and returns.
    ///
    /// Transient failures — a lost broker connection, an unreachable database — are retried with
    /// backoff inside. It returns an error only for what retrying cannot fix (a missing inbox
    /// table, a refused subscription).
    pub async fn run(&self, shutdown: CancellationToken) -> Result<ConsumerReport, ConsumerError> {
        let inner = &self.inner;
        let metrics = Arc::new(Metrics::new(&inner.name, inner.transport.name()));
        let stop = shutdown.child_token();
        let batching = inner.settings.batch.map(|b| match inner.store.max_batch() {
            Some(limit) if limit < b.max_size => Batching::new(limit, b.max_wait),
            _ => b,
        });
        let ordered = inner.transport.capabilities().ordered;
        // Batches of an ordered transport run one at a time: two in flight could hold messages
        // of the same key.
        let slots = match batching {
            Some(_) if ordered => 1,
            _ => inner.settings.concurrency,
        };
        let permits = Arc::new(Semaphore::new(slots));
        let window = match batching {
            Some(b) => slots * b.max_size * 2,
            None => inner.settings.concurrency * 2,
        };
        let prefetch = inner
            .settings
            .prefetch
            .unwrap_or_else(|| u16::try_from(window).unwrap_or(u16::MAX));
        let subscription = Subscription::new(inner.source.clone(), inner.name.clone(), prefetch)
            .with_dead_letter(inner.dead_letter_destination());
        let mut tasks: JoinSet<Result<(), ConsumerError>> = JoinSet::new();
        // Ends with the run whatever ends it (a fatal error does not cancel `stop`).
        let sampling = stop.child_token();
        if let Some(every) = inner.settings.stats_interval {
            let (inner, metrics, sampling) =
                (Arc::clone(inner), Arc::clone(&metrics), sampling.clone());
            tasks.spawn(async move {
                inner.sample_stats(every, &metrics, &sampling).await;
                Ok(())
            });
        }
        let mut lanes: HashMap<String, Lane> = HashMap::new();
        let mut fatal: Option<ConsumerError> = None;
        let mut reconnect = inner.settings.reconnect.delays();
        // What the stream said after a batch was cut short by it (an error, its end).
        let mut pushed_back = None;

        'subscribe: while !stop.is_cancelled() {
            let subscribed = tokio::select! {
                biased;
                () = stop.cancelled() => break,
                s = inner.transport.subscribe(&subscription) => s,
            };
            let mut stream = match subscribed {
                Ok(stream) => stream,
                Err(e) if e.is_transient() => {
                    if let Some(n) = inner.broker_down.due() {
                        tracing::warn!(consumer = %inner.name, error = %e, failures = n, "cannot subscribe; retrying with backoff");
                    }
                    if !sleep_unless_stopped(next_delay(&mut reconnect), &stop).await {
                        break;
                    }
                    continue;
                }
                Err(e) => {
                    fatal = Some(ConsumerError::Transport(e));
                    break;
                }
            };
            tracing::info!(consumer = %inner.name, source = %inner.source, transport = inner.transport.name(), "consuming");
            loop {
                let permit = tokio::select! {
                    biased;
                    () = stop.cancelled() => break 'subscribe,
                    p = Arc::clone(&permits).acquire_owned() => p.expect("the semaphore is never closed"),
                };
                // No new deliveries while the store is down: they would only wait in memory.
                if !inner.store_outage.is_up() && !inner.store_outage.wait_for_recovery(&stop).await
                {
                    break 'subscribe;
                }
                let next = match pushed_back.take() {
                    Some(next) => next,
                    None => tokio::select! {
                        biased;
                        () = stop.cancelled() => break 'subscribe,
                        next = stream.next() => next,
                    },
                };
                match next {
                    Some(Ok(delivery)) if batching.is_some() => {
                        reconnect = inner.settings.reconnect.delays();
                        let batching = batching.expect("checked above");
                        let mut batch = vec![delivery];
                        let deadline = tokio::time::Instant::now() + batching.max_wait;
                        while batch.len() < batching.max_size {
                            match tokio::time::timeout_at(deadline, stream.next()).await {
                                Err(_) => break,
                                Ok(Some(Ok(delivery))) => batch.push(delivery),
                                Ok(other) => {
                                    pushed_back = Some(other);
                                    break;
                                }
                            }
                        }
                        let inner = Arc::clone(inner);
                        let metrics = Arc::clone(&metrics);
                        let stop = stop.clone();
                        tasks.spawn(async move {
                            let result = inner.process_batch(batch, &metrics, &stop).await;
                            drop(permit);
                            result
                        });
                    }
                    Some(Ok(delivery)) => {
                        reconnect = inner.settings.reconnect.delays();
                        match delivery.ordering_key().map(str::to_owned) {
                            None => {
                                let inner = Arc::clone(inner);
                                let metrics = Arc::clone(&metrics);
                                let stop = stop.clone();
                                tasks.spawn(async move {
                                    let result = inner.process(delivery, &metrics, &stop).await;
                                    drop(permit);
                                    result
                                });
                            }
                            Some(key) => {
                                // One lane per key: its deliveries are handled one after another.
                                let mut item = (delivery, permit);
                                if let Some(lane) = lanes.get(&key) {
                                    match lane.send(item) {
                                        Ok(()) => continue,
                                        Err(mpsc::error::SendError(back)) => item = back,
                                    }
                                }
                                let (lane, queue) = mpsc::unbounded_channel();
                                let _ = lane.send(item);
                                lanes.insert(key, lane);
                                tasks.spawn(Arc::clone(inner).run_lane(
                                    queue,
                                    Arc::clone(&metrics),
                                    stop.clone(),
                                ));
                            }
                        }
                    }
                    Some(Err(e)) if !e.is_transient() => {
                        fatal = Some(ConsumerError::Transport(e));
                        break 'subscribe;
                    }
                    Some(Err(e)) => {
                        tracing::warn!(consumer = %inner.name, error = %e, "delivery stream failed; subscribing again");
                        break;
                    }
                    None => {
                        tracing::warn!(consumer = %inner.name, "delivery stream ended; subscribing again");
                        break;
                    }
                }
                while let Some(done) = tasks.try_join_next() {
                    if let Some(e) = task_failure(done) {
                        fatal.get_or_insert(e);
                        stop.cancel();
                    }
                }
            }
            if !sleep_unless_stopped(next_delay(&mut reconnect), &stop).await {
                break;
            }
        }
        // Drain: in-flight handlers finish and ack; waiting retries and queued lane deliveries
        // are handed back.
        sampling.cancel();
        lanes.clear();
        let deadline = inner
            .settings
            .drain_timeout
            .map(|t| tokio::time::Instant::now() + t);
        loop {
            let next = match deadline {
                Some(deadline) => {
                    match tokio::time::timeout_at(deadline, tasks.join_next()).await {
                        Ok(next) => next,
                        Err(_) => {
                            tracing::warn!(
                                consumer = %inner.name,
                                abandoned = tasks.len(),
                                "drain timeout: abandoning what is still in flight (rolled back; the broker redelivers it)"
                            );
                            tasks.abort_all();
                            while tasks.join_next().await.is_some() {}
                            break;
                        }
                    }
                }
                None => tasks.join_next().await,
            };
            let Some(done) = next else { break };
            if let Some(e) = task_failure(done) {
                fatal.get_or_insert(e);
            }
        }
        inner.transport.drained().await;
        match fatal {
            Some(e) => Err(e),
            None => Ok(self.report()),
        }
    }
}

/// The queue of one ordering key: deliveries with the permit each took.
type Lane = mpsc::UnboundedSender<(Box<dyn Delivery>, OwnedSemaphorePermit)>;

fn task_failure(
    done: Result<Result<(), ConsumerError>, tokio::task::JoinError>,
) -> Option<ConsumerError> {
    match done {
        Ok(Ok(())) => None,
        Ok(Err(e)) => Some(e),
        Err(join) => {
            // Our own code panicked (handler panics are caught earlier): the delivery was dropped,
            // so the broker redelivers it.
            tracing::error!(error = %join, "inbox delivery task failed");
            None
        }
    }
}

fn next_delay(delays: &mut impl Iterator<Item = Duration>) -> Duration {
    delays.next().unwrap_or(Duration::from_secs(1))
}

/// Sleeps; false when the stop token fired first.
async fn sleep_unless_stopped(delay: Duration, stop: &CancellationToken) -> bool {
    tokio::select! {
        biased;
        () = stop.cancelled() => false,
        () = tokio::time::sleep(delay) => true,
    }
}

/// Why an attempt failed, with what that means for the message.
struct Failure {
    kind: ErrorKind,
    reason: String,
}

impl Failure {
    fn transient(reason: impl Into<String>) -> Self {
        Self {
            kind: ErrorKind::Transient,
            reason: reason.into(),
        }
    }
}

impl From<HandlerError> for Failure {
    fn from(e: HandlerError) -> Self {
        Self {
            kind: e.kind(),
            reason: error_chain(e.inner()),
        }
    }
}

fn panic_text(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "non-text panic payload".to_owned())
}

/// What a batch's transaction did with one of its messages.
enum Fate {
    /// Handled; committed with the batch.
    Handled,
    /// Done or dead-lettered before.
    Duplicate,
    /// Failed permanently; the dead letter is published and the row marked dead in the batch.
    DeadLettered(String),
    /// Not handled in the batch (failed, exhausted, or behind a failed one of its key): the
    /// per-message way after the commit.
    Later,
}

/// How one delivery ended, for the span and the logs.
#[derive(Debug, Clone, Copy)]
enum Outcome {
    Processed,
    Duplicate,
    DeadLettered,
    Requeued,
    /// Shutdown came while the message waited for a retry: handed back to the broker.
    HandedBack,
}

impl Outcome {
    fn as_str(self) -> &'static str {
        match self {
            Outcome::Processed => "processed",
            Outcome::Duplicate => "duplicate",
            Outcome::DeadLettered => "dead_lettered",
            Outcome::Requeued => "requeued",
            Outcome::HandedBack => "handed_back",
        }
    }
}

impl<S: InboxStore, H: Handler<S::Tx>> Inner<S, H> {
    /// Handles one ordering key's deliveries in order. After shutdown, what is still queued is
    /// handed back unhandled.
    async fn run_lane(
        self: Arc<Self>,
        mut queue: mpsc::UnboundedReceiver<(Box<dyn Delivery>, OwnedSemaphorePermit)>,
        metrics: Arc<Metrics>,
        stop: CancellationToken,
    ) -> Result<(), ConsumerError> {
        while let Some((delivery, permit)) = queue.recv().await {
            if stop.is_cancelled() {
                self.hand_back(delivery).await;
                continue;
            }
            let result = self.process(delivery, &metrics, &stop).await;
            drop(permit);
            result?;
        }
        Ok(())
    }

    /// Samples this consumer's row counts into its gauges until `stop`.
    async fn sample_stats(&self, every: Duration, metrics: &Metrics, stop: &CancellationToken) {
        loop {
            match self.store.stats(Some(&self.name)).await {
                Ok(stats) => {
                    let s = stats.first();
                    metrics.rows(s.map_or(0, |s| s.rows), s.map_or(0, |s| s.dead));
                }
                Err(e) => {
                    tracing::debug!(consumer = %self.name, error = %e, "could not sample inbox stats")
                }
            }
            if !sleep_unless_stopped(every, stop).await {
                return;
            }
        }
    }

    /// A replay meant for another consumer of the same source (see
    /// [`dead_letter_headers::REPLAY_FOR`]).
    fn replayed_for_another(&self, delivery: &dyn Delivery) -> bool {
        delivery
            .headers()
            .get(dead_letter_headers::REPLAY_FOR)
            .is_some_and(|target| target != self.name.as_str().as_bytes())
    }

    fn dead_letter_destination(&self) -> String {
        match &self.settings.dead_letter_destination {
            Some(d) => d.clone(),
            None => format!("{}.dead-letter", self.source),
        }
    }

    /// Batch mode: see [`Consumer::batch`].
    async fn process_batch(
        &self,
        deliveries: Vec<Box<dyn Delivery>>,
        metrics: &Metrics,
        stop: &CancellationToken,
    ) -> Result<(), ConsumerError> {
        let span = tracing::info_span!(
            "inbox.batch",
            consumer = %self.name,
            transport = self.transport.name(),
            size = deliveries.len(),
            processed = field::Empty,
            duplicates = field::Empty,
            later = field::Empty,
        );
        async {
            // Bad input and copies of a message already in the batch go the per-message way. So
            // do redeliveries: if the process died in the batch they came in, the message it
            // died on is among them, and alone it cannot take batch-mates down with it when its
            // delivery count runs out.
            let mut entries: Vec<(Box<dyn Delivery>, MessageId)> = Vec::new();
            let mut later: Vec<Box<dyn Delivery>> = Vec::new();
            let mut ids = Vec::new();
            let mut seen = std::collections::HashSet::new();
            let mut held_keys = std::collections::HashSet::new();
            for delivery in deliveries {
                let id = match self.settings.id_strategy.extract(&*delivery) {
                    Ok(id)
                        if delivery.payload().len() <= self.settings.max_payload_bytes
                            && !self.replayed_for_another(&*delivery) =>
                    {
                        id
                    }
                    _ => {
                        self.process(delivery, metrics, stop).await?;
                        continue;
                    }
                };
                let held = delivery
                    .ordering_key()
                    .is_some_and(|k| held_keys.contains(k));
                if delivery.redelivered() || held {
                    // Later messages of its key follow it, in order.
                    held_keys.extend(delivery.ordering_key().map(str::to_owned));
                    later.push(delivery);
                } else if seen.insert(id.clone()) {
                    ids.push(id.clone());
                    entries.push((delivery, id));
                } else {
                    later.push(delivery);
                }
            }
            if entries.is_empty() {
                return self.process_each(later, metrics, stop).await;
            }
            let fates = match self.handle_batch(&entries, &ids, metrics).await {
                Ok(fates) => fates,
                Err(e) => {
                    // The batch's transaction is gone (rolled back, or its commit's outcome is
                    // unknown): every message goes the per-message way, which waits out an
                    // outage and finds what did commit.
                    tracing::warn!(error = %e, "batch failed; handling its messages one by one");
                    bump(&self.counters.batch_fallbacks);
                    metrics.batch_fallback();
                    let all = entries.into_iter().map(|(d, _)| d).chain(later).collect();
                    return self.process_each(all, metrics, stop).await;
                }
            };
            let (mut processed, mut duplicates) = (0u64, 0u64);
            let mut deferred = Vec::new();
            for ((delivery, id), fate) in entries.into_iter().zip(fates) {
                match fate {
                    Fate::Handled => {
                        bump(&self.counters.deliveries);
                        if let Some(hook) = &self.settings.after_commit.0 {
                            hook(&id).await;
                        }
                        self.ack(delivery).await;
                        bump(&self.counters.processed);
                        metrics.processed();
                        processed += 1;
                    }
                    Fate::Duplicate => {
                        bump(&self.counters.deliveries);
                        self.ack(delivery).await;
                        bump(&self.counters.duplicates);
                        metrics.duplicate();
                        duplicates += 1;
                    }
                    Fate::DeadLettered(reason) => {
                        bump(&self.counters.deliveries);
                        self.ack(delivery).await;
                        self.count_dead_letter(metrics, &reason);
                    }
                    Fate::Later => deferred.push(delivery),
                }
            }
            deferred.extend(later);
            let current = tracing::Span::current();
            current.record("processed", processed);
            current.record("duplicates", duplicates);
            current.record("later", deferred.len());
            self.process_each(deferred, metrics, stop).await
        }
        .instrument(span)
        .await
    }

    /// The per-message way: on an ordered transport one after another, in order; otherwise up
    /// to `concurrency` at once, so that one that hangs (the message a crash loop is about)
    /// does not hold the others back.
    async fn process_each(
        &self,
        deliveries: Vec<Box<dyn Delivery>>,
        metrics: &Metrics,
        stop: &CancellationToken,
    ) -> Result<(), ConsumerError> {
        if self.transport.capabilities().ordered {
            for delivery in deliveries {
                self.process(delivery, metrics, stop).await?;
            }
            return Ok(());
        }
        // A plain loop over `FuturesUnordered` rather than `buffer_unordered` with a closure,
        // whose higher-ranked lifetimes the spawned batch task's future cannot satisfy.
        let mut waiting = deliveries.into_iter();
        let mut running = futures::stream::FuturesUnordered::new();
        for delivery in waiting.by_ref().take(self.settings.concurrency) {
            running.push(self.process(delivery, metrics, stop));
        }
        let mut first_error = None;
        while let Some(result) = running.next().await {
            if let Err(e) = result {
                first_error.get_or_insert(e);
            }
            if let Some(delivery) = waiting.next() {
                running.push(self.process(delivery, metrics, stop));
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// The batch's transaction: claim all, handle each claimed one in a savepoint, commit.
    async fn handle_batch(
        &self,
        entries: &[(Box<dyn Delivery>, MessageId)],
        ids: &[MessageId],
        metrics: &Metrics,
    ) -> Result<Vec<Fate>, StoreError> {
        let mut tx = self.store.begin().await?;
        let claims = metrics
            .time_claim(self.store.claim_batch(&mut tx, &self.name, ids))
            .await?;
        self.store_outage.succeeded();
        let ordered = self.transport.capabilities().ordered;
        let policy = &self.settings.retry;
        // Keys with a message that waits: their later messages wait too (ordered transports).
        let mut waiting: std::collections::HashSet<String> = std::collections::HashSet::new();
        let mut fates = Vec::with_capacity(entries.len());
        for ((delivery, id), claim) in entries.iter().zip(claims) {
            let key = if ordered {
                delivery.ordering_key().map(str::to_owned)
            } else {
                None
            };
            let attempts = match claim {
                Claim::Claimed { attempts, .. } => attempts,
                Claim::Done | Claim::Dead => {
                    fates.push(Fate::Duplicate);
                    continue;
                }
            };
            let attempt = attempts.saturating_add(1);
            let blocked = key.as_ref().is_some_and(|k| waiting.contains(k));
            let exhausted = attempt > policy.max_attempts
                || delivery
                    .delivery_count()
                    .is_some_and(|n| n > policy.max_deliveries);
            if blocked || exhausted {
                // The per-message way dead-letters an exhausted one with its reason.
                self.store
                    .release_claim(&mut tx, &self.name, id, None)
                    .await?;
                waiting.extend(key);
                fates.push(Fate::Later);
                continue;
            }
            self.store.savepoint(&mut tx).await?;
            match self
                .run_handler(id, &**delivery, attempt, &mut tx, metrics)
                .await
            {
                Ok(()) => {
                    self.store.release_savepoint(&mut tx).await?;
                    fates.push(Fate::Handled);
                }
                Err(failure) => {
                    self.store.rollback_to_savepoint(&mut tx).await?;
                    bump(&self.counters.failed);
                    metrics.failed();
                    tracing::warn!(message_id = %id, attempt, error = %failure.reason, "attempt failed in a batch");
                    if failure.kind == ErrorKind::Permanent
                        && self
                            .publish_dead_letter(&**delivery, Some(id), attempt, &failure.reason)
                            .await
                            .is_ok()
                    {
                        self.store
                            .mark_dead_claimed(&mut tx, &self.name, id, attempt, &failure.reason)
                            .await?;
                        fates.push(Fate::DeadLettered(failure.reason));
                        continue;
                    }
                    self.store
                        .release_claim(&mut tx, &self.name, id, Some((attempt, &failure.reason)))
                        .await?;
                    waiting.extend(key);
                    fates.push(Fate::Later);
                }
            }
        }
        self.store.commit(tx).await?;
        Ok(fates)
    }

    async fn process(
        &self,
        delivery: Box<dyn Delivery>,
        metrics: &Metrics,
        stop: &CancellationToken,
    ) -> Result<(), ConsumerError> {
        let span = tracing::info_span!(
            "inbox.delivery",
            consumer = %self.name,
            transport = self.transport.name(),
            message_id = field::Empty,
            attempt = field::Empty,
            outcome = field::Empty,
            trace_id = field::Empty,
            parent_span_id = field::Empty,
        );
        if let Some(parent) = delivery
            .headers()
            .get_str(TRACEPARENT)
            .and_then(TraceParent::parse)
        {
            span.record("trace_id", parent.trace_id);
            span.record("parent_span_id", parent.span_id);
        }
        async {
            bump(&self.counters.deliveries);
            let outcome = self.process_inner(delivery, metrics, stop).await?;
            tracing::Span::current().record("outcome", outcome.as_str());
            tracing::debug!(outcome = outcome.as_str(), "delivery settled");
            Ok(())
        }
        .instrument(span)
        .await
    }

    async fn process_inner(
        &self,
        delivery: Box<dyn Delivery>,
        metrics: &Metrics,
        stop: &CancellationToken,
    ) -> Result<Outcome, ConsumerError> {
        let span = tracing::Span::current();
        let id = match self.settings.id_strategy.extract(&*delivery) {
            Ok(id) => id,
            Err(invalid) => {
                span.record("message_id", "<invalid>");
                let reason = format!("invalid message id: {invalid}");
                return Ok(self
                    .dead_letter_unrecorded(delivery, reason, metrics, stop)
                    .await);
            }
        };
        span.record("message_id", id.as_str());
        if self.replayed_for_another(&*delivery) {
            self.ack(delivery).await;
            bump(&self.counters.duplicates);
            metrics.duplicate();
            return Ok(Outcome::Duplicate);
        }
        // Where the broker counts no deliveries, a delivery that may be a redelivery is counted
        // in the inbox row first, committed: if the consumer dies on the message, the count
        // survives the crash, and a message it keeps dying on is dead-lettered instead of looping
        // for ever.
        let mut unfinished = None;
        if delivery.delivery_count().is_none() && delivery.redelivered() {
            match self
                .retry_store(stop, || self.store.note_delivery(&self.name, &id))
                .await
            {
                Ok(Some(n)) => unfinished = Some(n),
                Ok(None) => return Ok(self.hand_back(delivery).await),
                Err(e) => {
                    tracing::warn!(error = %e, "could not count the delivery; handling it uncounted")
                }
            }
        }
        let mut retry_delays = self.settings.retry.delays();
        let mut dead_letter_delays = self.settings.reconnect.delays();
        let mut local_retries = 0u32;
        loop {
            let mut tx = match self.store.begin().await {
                Ok(tx) => tx,
                Err(e) => {
                    if self
                        .wait_out_store_error(e, &mut retry_delays, stop)
                        .await?
                    {
                        continue;
                    }
                    return Ok(self.hand_back(delivery).await);
                }
            };
            let claimed = metrics
                .time_claim(self.store.claim(&mut tx, &self.name, &id))
                .await;
            let claim = match claimed {
                Ok(claim) => claim,
                Err(e) => {
                    drop(tx);
                    if self
                        .wait_out_store_error(e, &mut retry_delays, stop)
                        .await?
                    {
                        continue;
                    }
                    return Ok(self.hand_back(delivery).await);
                }
            };
            self.store_outage.succeeded();
            let (attempts, last_error) = match claim {
                Claim::Done | Claim::Dead => {
                    let _ = self.store.rollback(tx).await;
                    self.ack(delivery).await;
                    bump(&self.counters.duplicates);
                    metrics.duplicate();
                    return Ok(Outcome::Duplicate);
                }
                Claim::Claimed {
                    attempts,
                    last_error,
                } => (attempts, last_error),
            };
            let attempt = attempts.saturating_add(1);
            span.record("attempt", attempt);
            let policy = &self.settings.retry;
            // Checked under the claim, so that a redelivered copy of a message dead-lettered for
            // its size is a duplicate, not a second dead letter.
            let exhausted = if delivery.payload().len() > self.settings.max_payload_bytes {
                Some(format!(
                    "payload of {} bytes exceeds the limit of {} bytes",
                    delivery.payload().len(),
                    self.settings.max_payload_bytes
                ))
            } else if attempt > policy.max_attempts {
                Some(format!(
                    "gave up after {attempts} attempts; last error: {}",
                    last_error.as_deref().unwrap_or("none recorded")
                ))
            } else {
                // Deliveries that never reached an outcome (the consumer died on them) count
                // against a separate, larger limit: a message that crashes the process is poison
                // too, but a crash of the process alone must not dead-letter its prefetched rest.
                match delivery.delivery_count() {
                    Some(n) if n > policy.max_deliveries => Some(format!(
                        "delivered {n} times without an outcome ({attempts} failures recorded): the consumer may be crashing on it"
                    )),
                    _ => match unfinished {
                        Some(n) if n > policy.max_deliveries => Some(format!(
                            "delivered {n} times without an outcome, as counted in the inbox ({attempts} failures recorded): the consumer may be crashing on it"
                        )),
                        _ => None,
                    },
                }
            };
            if let Some(reason) = exhausted {
                if self
                    .dead_letter_claimed(tx, &*delivery, &id, attempts, &reason)
                    .await
                {
                    self.ack(delivery).await;
                    self.count_dead_letter(metrics, &reason);
                    return Ok(Outcome::DeadLettered);
                }
                // Not settled (the dead letter or its mark failed): the message stays here and
                // is tried again, never handed back — on Kafka a handed-back record is skipped.
                if sleep_unless_stopped(next_delay(&mut dead_letter_delays), stop).await {
                    continue;
                }
                return Ok(self.hand_back(delivery).await);
            }

            let failure = match self
                .run_handler(&id, &*delivery, attempt, &mut tx, metrics)
                .await
            {
                Ok(()) => match self.store.commit(tx).await {
                    Ok(()) => {
                        if let Some(hook) = &self.settings.after_commit.0 {
                            hook(&id).await;
                        }
                        self.ack(delivery).await;
                        bump(&self.counters.processed);
                        metrics.processed();
                        return Ok(Outcome::Processed);
                    }
                    Err(e @ StoreError::Aborted(_)) => Failure {
                        kind: e.kind(),
                        reason: format!(
                            "the handler returned Ok, but a statement in its transaction had failed (an error swallowed?), so nothing was committed: {}",
                            error_chain(&e)
                        ),
                    },
                    // The commit may or may not have happened: retry; a redelivery finds the row
                    // if it did.
                    Err(e) => Failure {
                        kind: e.kind(),
                        reason: format!("commit failed (outcome unknown): {}", error_chain(&e)),
                    },
                },
                Err(failure) => {
                    let _ = self.store.rollback(tx).await;
                    failure
                }
            };
            bump(&self.counters.failed);
            metrics.failed();
            if failure.kind == ErrorKind::Permanent {
                tracing::warn!(error = %failure.reason, "permanent failure; dead-lettering");
                return Ok(self
                    .dead_letter_after_failure(
                        delivery,
                        &id,
                        attempt,
                        failure.reason,
                        metrics,
                        stop,
                    )
                    .await);
            }
            tracing::warn!(attempt, error = %failure.reason, "attempt failed");
            let recorded = self
                .retry_store(stop, || {
                    self.store
                        .record_failure(&self.name, &id, attempt, &failure.reason)
                })
                .await;
            match recorded {
                Ok(Some(_)) => {}
                Ok(None) => return Ok(self.hand_back(delivery).await),
                Err(e) => {
                    // Uncounted, a failure could repeat for ever: the message goes to the
                    // dead-letter destination instead, and the consumer goes on.
                    let reason = format!(
                        "{}; the failure could not be recorded: {}",
                        failure.reason,
                        error_chain(&e)
                    );
                    return Ok(self
                        .dead_letter_after_failure(delivery, &id, attempt, reason, metrics, stop)
                        .await);
                }
            }
            if attempt >= self.settings.retry.max_attempts {
                // The next claim sees the limit reached and dead-letters under the row lock.
                continue;
            }
            let retry_in_place = !self.transport.capabilities().requeue;
            if local_retries < self.settings.retry.in_process_retries || retry_in_place {
                local_retries += 1;
                metrics.retried();
                if sleep_unless_stopped(next_delay(&mut retry_delays), stop).await {
                    continue;
                }
                return Ok(self.hand_back(delivery).await);
            }
            if let Err(e) = delivery.nack(true).await {
                tracing::warn!(error = %e, "nack failed; the broker redelivers on its own");
            }
            bump(&self.counters.requeued);
            return Ok(Outcome::Requeued);
        }
    }

    async fn run_handler(
        &self,
        id: &MessageId,
        delivery: &dyn Delivery,
        attempt: u32,
        tx: &mut S::Tx,
        metrics: &Metrics,
    ) -> Result<(), Failure> {
        let message = Message {
            id,
            consumer: &self.name,
            source: &self.source,
            payload: delivery.payload(),
            headers: delivery.headers(),
            attempt,
            redelivered: delivery.redelivered(),
        };
        let handled = AssertUnwindSafe(self.handler.handle(&message, tx)).catch_unwind();
        let handled = metrics.time_handle(async {
            match self.settings.handler_timeout {
                Some(limit) => tokio::time::timeout(limit, handled)
                    .await
                    .map_err(|_| Failure::transient(format!("handler timed out after {limit:?}"))),
                None => Ok(handled.await),
            }
        });
        match handled.await? {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(e.into()),
            Err(panic) => Err(Failure::transient(format!(
                "handler panicked: {}",
                panic_text(&*panic)
            ))),
        }
    }

    /// A store error on the way to a claim. Permanent ones stop the consumer: before a claim
    /// they are the schema's or the configuration's (a missing table), not one message's.
    /// Conflicts (a deadlock, a serialization failure, a busy SQLite) are retried after a short
    /// backoff: they are what concurrent copies do, not an outage. Anything else transient is an
    /// outage: one task probes with backoff, the others wait for it. Returns false when shutdown
    /// came first.
    async fn wait_out_store_error(
        &self,
        error: StoreError,
        retry_delays: &mut impl Iterator<Item = Duration>,
        stop: &CancellationToken,
    ) -> Result<bool, ConsumerError> {
        if !error.is_transient() {
            tracing::error!(error = %error, "inbox store failed permanently; stopping the consumer");
            stop.cancel();
            return Err(ConsumerError::Store(error));
        }
        if matches!(error, StoreError::Conflict(_) | StoreError::Aborted(_)) {
            tracing::debug!(error = %error, "claim conflicted; retrying");
            return Ok(sleep_unless_stopped(next_delay(retry_delays), stop).await);
        }
        Ok(self.store_outage.failed(&error, stop).await)
    }

    /// Runs a bookkeeping write in its own transaction until it succeeds, waiting out transient
    /// errors through the outage gate. `Ok(None)`: shutdown came first; `Err`: a permanent
    /// error, which belongs to this message (the claim worked, so the schema is fine).
    async fn retry_store<T, F, Fut>(
        &self,
        stop: &CancellationToken,
        mut write: F,
    ) -> Result<Option<T>, StoreError>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T, StoreError>>,
    {
        let mut conflicts = self.settings.retry.delays();
        loop {
            match write().await {
                Ok(value) => {
                    self.store_outage.succeeded();
                    return Ok(Some(value));
                }
                // A deadlock or serialization failure is this write's, not an outage.
                Err(StoreError::Conflict(_)) => {
                    if !sleep_unless_stopped(next_delay(&mut conflicts), stop).await {
                        return Ok(None);
                    }
                }
                Err(e) if e.is_transient() => {
                    if !self.store_outage.failed(&e, stop).await {
                        return Ok(None);
                    }
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Dead-letters a claimed message: publish, mark dead in the claim's transaction, commit.
    /// True when the message may be acked: the dead letter is published and, unless the table
    /// refused it for good, marked. False: try again (nothing is marked; a second attempt may
    /// publish a second copy of the dead letter, which a replay discards).
    ///
    /// The letter is published before the mark commits, not after: a mark committed with the
    /// publish failing would make every redelivery a "duplicate" with no dead letter anywhere.
    async fn dead_letter_claimed(
        &self,
        mut tx: S::Tx,
        delivery: &dyn Delivery,
        id: &MessageId,
        attempts: u32,
        reason: &str,
    ) -> bool {
        if let Err(e) = self
            .publish_dead_letter(delivery, Some(id), attempts, reason)
            .await
        {
            let _ = self.store.rollback(tx).await;
            self.dead_letter_publish_failed(&e);
            return false;
        }
        let marked = async {
            self.store
                .mark_dead_claimed(&mut tx, &self.name, id, attempts, reason)
                .await?;
            self.store.commit(tx).await
        };
        match marked.await {
            Ok(()) => true,
            Err(e) if e.is_transient() => {
                tracing::warn!(error = %e, "could not mark the message dead; trying again");
                false
            }
            Err(e) => {
                tracing::error!(error = %e, "dead letter published, but the inbox table refused the dead mark");
                true
            }
        }
    }

    /// Dead-letters after a failure whose transaction is gone: publish, record dead, ack.
    async fn dead_letter_after_failure(
        &self,
        delivery: Box<dyn Delivery>,
        id: &MessageId,
        attempts: u32,
        reason: String,
        metrics: &Metrics,
        stop: &CancellationToken,
    ) -> Outcome {
        if !self
            .publish_dead_letter_until_done(&*delivery, Some(id), attempts, &reason, stop)
            .await
        {
            return self.hand_back(delivery).await;
        }
        match self
            .retry_store(stop, || {
                self.store.record_dead(&self.name, id, attempts, &reason)
            })
            .await
        {
            Ok(Some(())) => {}
            // The message is safe in the dead-letter destination; only the table misses the mark.
            Ok(None) => {
                tracing::warn!("dead letter published; shutdown came before the dead mark")
            }
            Err(e) => {
                tracing::error!(error = %e, "dead letter published, but the inbox table refused the dead mark")
            }
        }
        self.ack(delivery).await;
        self.count_dead_letter(metrics, &reason);
        Outcome::DeadLettered
    }

    /// Dead-letters a message that has no valid id, so no inbox row.
    async fn dead_letter_unrecorded(
        &self,
        delivery: Box<dyn Delivery>,
        reason: String,
        metrics: &Metrics,
        stop: &CancellationToken,
    ) -> Outcome {
        if !self
            .publish_dead_letter_until_done(&*delivery, None, 0, &reason, stop)
            .await
        {
            return self.hand_back(delivery).await;
        }
        self.ack(delivery).await;
        self.count_dead_letter(metrics, &reason);
        Outcome::DeadLettered
    }

    fn count_dead_letter(&self, metrics: &Metrics, reason: &str) {
        tracing::warn!(reason, "message dead-lettered");
        bump(&self.counters.dead_lettered);
        metrics.dead_lettered();
    }

    /// Publishes a dead letter, retrying with backoff until it is out. False: shutdown came
    /// first. The message stays with this task meanwhile instead of going back to the broker:
    /// a broker that redelivers would only bring it back to the same failure, and one that
    /// cannot (Kafka) would skip it.
    async fn publish_dead_letter_until_done(
        &self,
        delivery: &dyn Delivery,
        id: Option<&MessageId>,
        attempts: u32,
        reason: &str,
        stop: &CancellationToken,
    ) -> bool {
        let mut delays = self.settings.reconnect.delays();
        loop {
            match self
                .publish_dead_letter(delivery, id, attempts, reason)
                .await
            {
                Ok(()) => return true,
                Err(e) => self.dead_letter_publish_failed(&e),
            }
            if !sleep_unless_stopped(next_delay(&mut delays), stop).await {
                return false;
            }
        }
    }

    fn dead_letter_publish_failed(&self, error: &TransportError) {
        if let Some(n) = self.dead_letter_failures.due() {
            tracing::error!(error = %error, failures = n, "could not publish a dead letter; the message waits and is tried again");
        }
    }

    async fn publish_dead_letter(
        &self,
        delivery: &dyn Delivery,
        id: Option<&MessageId>,
        attempts: u32,
        reason: &str,
    ) -> Result<(), TransportError> {
        use dead_letter_headers as h;
        let mut headers = delivery.headers().clone();
        headers.insert(h::REASON, reason.to_owned());
        headers.insert(h::CONSUMER, self.name.as_str().to_owned());
        headers.insert(h::ATTEMPTS, attempts.to_string());
        headers.insert(h::SOURCE, self.source.clone());
        if let Some(id) = id {
            headers.insert(h::MESSAGE_ID, id.as_str().to_owned());
        }
        if let Some(coordinates) = delivery.coordinates() {
            headers.insert(h::COORDINATES, coordinates);
        }
        let message = OutgoingMessage {
            message_id: delivery
                .broker_message_id()
                .and_then(|raw| std::str::from_utf8(raw).ok())
                .map(str::to_owned),
            payload: bytes::Bytes::copy_from_slice(delivery.payload()),
            headers,
            key: None,
        };
        self.transport
            .publish(&self.dead_letter_destination(), message)
            .await
    }

    /// Acks; the token proves the inbox already holds the outcome. A lost ack is not an error for
    /// the message: the broker redelivers and the inbox discards the copy.
    async fn ack(&self, delivery: Box<dyn Delivery>) {
        if let Err(e) = delivery.ack(AckToken::new()).await {
            bump(&self.counters.ack_failures);
            if let Some(n) = self.lost_acks.due() {
                tracing::warn!(error = %e, lost = n, "ack lost; the broker will redeliver and the inbox will discard the copy");
            }
        }
    }

    /// Gives the delivery back to the broker unsettled.
    async fn hand_back(&self, delivery: Box<dyn Delivery>) -> Outcome {
        if let Err(e) = delivery.nack(true).await {
            tracing::warn!(error = %e, "nack failed; the broker redelivers on its own");
        }
        Outcome::HandedBack
    }
}

#[cfg(test)]
mod tests {
    use super::TraceParent;

    #[test]
    fn traceparent_is_parsed_as_the_w3c_spec_says() {
        let p = TraceParent::parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
            .expect("the spec's example");
        assert_eq!(p.trace_id, "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(p.span_id, "00f067aa0ba902b7");
        assert_eq!(p.flags, 1);
        // A later version may add fields.
        assert!(
            TraceParent::parse("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00-extra")
                .is_some()
        );
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-1",
        ] {
            assert_eq!(TraceParent::parse(bad), None, "{bad:?}");
        }
    }
}
