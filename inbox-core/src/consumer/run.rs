//! The run loop: subscribe, take deliveries as permits allow, gather batches, keep one lane per
//! ordering key, stop taking while the store is down, resubscribe after a broken stream, and
//! drain on shutdown.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::{Consumer, ConsumerReport, Inner, Run, default_dead_letter_destination};
use crate::error::{ConsumerError, TransportError};
use crate::handler::Handler;
use crate::metrics::Metrics;
use crate::store::InboxStore;
use crate::transport::{Delivery, DeliveryStream, Subscription};

use super::settings::Batching;

/// What a lane runs: one delivery, or one key's part of a batch (batch mode on an ordered
/// transport).
enum Work {
    One(Box<dyn Delivery>),
    Part(Vec<Box<dyn Delivery>>),
}

/// The queue of one ordering key: its work, in order, each with the permit it was taken under
/// (a batch's parts share the batch's, released when the last is done).
type Lane = mpsc::UnboundedSender<(Work, Arc<OwnedSemaphorePermit>)>;

/// What the stream gave after a delivery: the next one, an error, or its end.
type Next = Option<Result<Box<dyn Delivery>, TransportError>>;

/// The tasks of one run: handlers, lanes and batches in flight, and the stats sampler.
type Tasks = JoinSet<Result<(), ConsumerError>>;

impl<S: InboxStore, H: Handler<S::Tx>> Consumer<S, H> {
    /// Consumes until `shutdown` is cancelled, then stops taking deliveries, lets the handlers in
    /// flight finish (commit, ack), hands back what waits for a retry, and returns.
    ///
    /// Transient failures — a lost broker connection, an unreachable database — are retried with
    /// backoff inside. It returns an error only for what retrying cannot fix (a missing inbox
    /// table, a refused subscription).
    pub async fn run(&self, shutdown: CancellationToken) -> Result<ConsumerReport, ConsumerError> {
        let run = Run {
            consumer: Arc::clone(&self.inner),
            metrics: Arc::new(Metrics::new(&self.inner.name, self.inner.transport.name())),
            stop: shutdown.child_token(),
        };
        match run.run().await {
            Some(e) => Err(e),
            None => Ok(self.report()),
        }
    }
}

impl<S: InboxStore, H: Handler<S::Tx>> Inner<S, H> {
    /// Batch mode's settings, capped by what the store can take in one transaction (its
    /// savepoints; a batch handler takes none).
    fn batching(&self) -> Option<Batching> {
        let whole = self.handler.as_batch_handler().is_some();
        self.settings.batch.map(|b| match self.store.max_batch() {
            Some(limit) if limit < b.max_size && !whole => Batching::new(limit, b.max_wait),
            _ => b,
        })
    }
}

impl<S: InboxStore, H> Inner<S, H> {
    pub(super) fn dead_letter_destination(&self) -> String {
        match &self.settings.dead_letter_destination {
            Some(d) => d.clone(),
            None => default_dead_letter_destination(&self.source),
        }
    }
}

impl<S: InboxStore, H: Handler<S::Tx>> Run<S, H> {
    /// The whole run; the fatal error that ended it, if one did.
    async fn run(self) -> Option<ConsumerError> {
        let batching = self.batching();
        let ordered = self.transport.capabilities().ordered;
        // On an ordered transport a batch is split by key and each part queued in its key's lane,
        // so batches in flight never handle one key's messages at once or out of order.
        let slots = self.settings.concurrency;
        let permits = Arc::new(Semaphore::new(slots));
        let window = match batching {
            Some(b) => slots * b.max_size * 2,
            None => self.settings.concurrency * 2,
        };
        let prefetch = self
            .settings
            .prefetch
            .unwrap_or_else(|| u16::try_from(window).unwrap_or(u16::MAX));
        let mut subscription = Subscription::new(self.source.clone(), self.name.clone(), prefetch)
            .with_dead_letter(self.dead_letter_destination())
            .with_max_deliveries(self.settings.retry.max_deliveries);
        match self.subscription_offsets() {
            Ok(offsets) => subscription.offsets = offsets,
            Err(e) => return Some(e),
        }
        let mut tasks = Tasks::new();
        // Ends with the run whatever ends it (a fatal error does not cancel `stop`).
        let sampling = self.stop.child_token();
        if let Some(every) = self.settings.stats_interval {
            let (run, sampling) = (self.clone(), sampling.clone());
            tasks.spawn(async move {
                run.sample_stats(every, &sampling).await;
                Ok(())
            });
        }
        let mut lanes: HashMap<String, Lane> = HashMap::new();
        let mut fatal: Option<ConsumerError> = None;
        let mut reconnect = self.settings.reconnect.delays();
        // What the stream said after a batch was cut short by it (an error, its end).
        let mut pushed_back: Option<Next> = None;
        let stop = &self.stop;

        'subscribe: while !stop.is_cancelled() {
            let subscribed = tokio::select! {
                biased;
                () = stop.cancelled() => break,
                s = self.transport.subscribe(&subscription) => s,
            };
            let mut stream = match subscribed {
                Ok(stream) => stream,
                Err(e) if e.is_transient() => {
                    if let Some(n) = self.broker_down.due() {
                        tracing::warn!(consumer = %self.name, error = %e, failures = n, "cannot subscribe; retrying with backoff");
                    }
                    if !sleep_unless_stopped(next_delay(&mut reconnect), stop).await {
                        break;
                    }
                    continue;
                }
                Err(e) => {
                    fatal = Some(ConsumerError::Transport(e));
                    break;
                }
            };
            tracing::info!(consumer = %self.name, source = %self.source, transport = self.transport.name(), "consuming");
            loop {
                let permit = tokio::select! {
                    biased;
                    () = stop.cancelled() => break 'subscribe,
                    p = Arc::clone(&permits).acquire_owned() => p.expect("the semaphore is never closed"),
                };
                // No new deliveries while the store is down: they would only wait in memory.
                if !self.store_outage.is_up() && !self.store_outage.wait_for_recovery(stop).await {
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
                    Some(Ok(first)) => {
                        reconnect = self.settings.reconnect.delays();
                        match batching {
                            Some(batching) => {
                                let (batch, rest) = gather(first, &mut stream, batching).await;
                                pushed_back = rest;
                                if ordered {
                                    self.dispatch_batch(batch, permit, &mut lanes, &mut tasks);
                                } else {
                                    let run = self.clone();
                                    tasks.spawn(async move {
                                        let result = run.settle_batch(batch).await;
                                        drop(permit);
                                        result
                                    });
                                }
                            }
                            None => self.dispatch(first, permit, &mut lanes, &mut tasks),
                        }
                    }
                    Some(Err(e)) if !e.is_transient() => {
                        fatal = Some(ConsumerError::Transport(e));
                        break 'subscribe;
                    }
                    Some(Err(e)) => {
                        tracing::warn!(consumer = %self.name, error = %e, "delivery stream failed; subscribing again");
                        break;
                    }
                    None => {
                        tracing::warn!(consumer = %self.name, "delivery stream ended; subscribing again");
                        break;
                    }
                }
                while let Some(done) = tasks.try_join_next() {
                    if let Some(e) = self.task_failure(done) {
                        fatal.get_or_insert(e);
                        stop.cancel();
                    }
                }
            }
            if !sleep_unless_stopped(next_delay(&mut reconnect), stop).await {
                break;
            }
        }
        // Drain: in-flight handlers finish and ack; waiting retries and queued lane deliveries
        // are handed back.
        sampling.cancel();
        lanes.clear();
        if let Some(e) = self.drain(tasks).await {
            fatal.get_or_insert(e);
        }
        self.transport.drained().await;
        fatal
    }

    /// Starts one delivery: in its own task, or, when it has an ordering key, in its key's lane,
    /// where its key's deliveries are handled one after another.
    fn dispatch(
        &self,
        delivery: Box<dyn Delivery>,
        permit: OwnedSemaphorePermit,
        lanes: &mut HashMap<String, Lane>,
        tasks: &mut Tasks,
    ) {
        match delivery.ordering_key().map(str::to_owned) {
            Some(key) => self.enqueue(key, Work::One(delivery), Arc::new(permit), lanes, tasks),
            None => {
                let run = self.clone();
                tasks.spawn(async move {
                    let result = run.settle_delivery(delivery).await;
                    drop(permit);
                    result.map(drop)
                });
            }
        }
    }

    /// Batch mode on an ordered transport: the batch split by ordering key (a Kafka partition),
    /// keeping its order, and each key's part queued in that key's lane behind the parts of
    /// earlier batches. Parts of different keys run at once.
    fn dispatch_batch(
        &self,
        batch: Vec<Box<dyn Delivery>>,
        permit: OwnedSemaphorePermit,
        lanes: &mut HashMap<String, Lane>,
        tasks: &mut Tasks,
    ) {
        let permit = Arc::new(permit);
        // Few keys per batch (a consumer's partitions): a list, not a map.
        let mut parts: Vec<(Option<String>, Vec<_>)> = Vec::new();
        for delivery in batch {
            let key = delivery.ordering_key().map(str::to_owned);
            match parts.iter_mut().find(|(k, _)| *k == key) {
                Some((_, part)) => part.push(delivery),
                None => parts.push((key, vec![delivery])),
            }
        }
        for (key, part) in parts {
            let permit = Arc::clone(&permit);
            match key {
                Some(key) => self.enqueue(key, Work::Part(part), permit, lanes, tasks),
                None => {
                    let run = self.clone();
                    tasks.spawn(async move {
                        let result = run.settle_batch(part).await;
                        drop(permit);
                        result
                    });
                }
            }
        }
    }

    /// Queues `work` in the lane of `key`, starting the lane if it has none.
    fn enqueue(
        &self,
        key: String,
        work: Work,
        permit: Arc<OwnedSemaphorePermit>,
        lanes: &mut HashMap<String, Lane>,
        tasks: &mut Tasks,
    ) {
        let mut item = (work, permit);
        if let Some(lane) = lanes.get(&key) {
            match lane.send(item) {
                Ok(()) => return,
                // The lane ended (its task saw an error); a new one takes over.
                Err(mpsc::error::SendError(back)) => item = back,
            }
        }
        let (lane, queue) = mpsc::unbounded_channel();
        let _ = lane.send(item);
        lanes.insert(key, lane);
        tasks.spawn(self.clone().run_lane(queue));
    }

    /// Handles one ordering key's work in order. After shutdown, what is still queued is handed
    /// back unhandled.
    async fn run_lane(
        self,
        mut queue: mpsc::UnboundedReceiver<(Work, Arc<OwnedSemaphorePermit>)>,
    ) -> Result<(), ConsumerError> {
        while let Some((work, permit)) = queue.recv().await {
            let stopped = self.stop.is_cancelled();
            let result = match work {
                Work::One(delivery) if stopped => {
                    self.hand_back(delivery).await;
                    Ok(())
                }
                Work::Part(part) if stopped => {
                    for delivery in part {
                        self.hand_back(delivery).await;
                    }
                    Ok(())
                }
                Work::One(delivery) => self.settle_delivery(delivery).await.map(drop),
                Work::Part(part) => self.settle_batch(part).await,
            };
            drop(permit);
            result?;
        }
        Ok(())
    }

    /// Waits for the tasks in flight, up to the drain timeout; the first fatal error among them.
    async fn drain(&self, mut tasks: Tasks) -> Option<ConsumerError> {
        let deadline = self
            .settings
            .drain_timeout
            .map(|t| tokio::time::Instant::now() + t);
        let mut fatal = None;
        loop {
            let next = match deadline {
                Some(deadline) => {
                    match tokio::time::timeout_at(deadline, tasks.join_next()).await {
                        Ok(next) => next,
                        Err(_) => {
                            tracing::warn!(
                                consumer = %self.name,
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
            if let Some(e) = self.task_failure(done) {
                fatal.get_or_insert(e);
            }
        }
        fatal
    }

    /// Samples this consumer's row counts into its gauges until `stop`.
    async fn sample_stats(&self, every: Duration, stop: &CancellationToken) {
        loop {
            match self.store.stats(Some(&self.name)).await {
                Ok(stats) => {
                    let s = stats.first();
                    self.metrics
                        .rows(s.map_or(0, |s| s.rows), s.map_or(0, |s| s.dead));
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
}

/// A batch: `first` and what else the stream has within `max_wait`, up to `max_size`. The second
/// value is what cut it short (an error, the stream's end), to be seen next.
async fn gather(
    first: Box<dyn Delivery>,
    stream: &mut DeliveryStream,
    batching: Batching,
) -> (Vec<Box<dyn Delivery>>, Option<Next>) {
    let mut batch = vec![first];
    let deadline = tokio::time::Instant::now() + batching.max_wait;
    while batch.len() < batching.max_size {
        match tokio::time::timeout_at(deadline, stream.next()).await {
            Err(_) => break,
            Ok(Some(Ok(delivery))) => batch.push(delivery),
            Ok(other) => return (batch, Some(other)),
        }
    }
    (batch, None)
}

impl<S: InboxStore, H> Run<S, H> {
    /// The fatal error a finished task ended with, if any.
    fn task_failure(
        &self,
        done: Result<Result<(), ConsumerError>, tokio::task::JoinError>,
    ) -> Option<ConsumerError> {
        match done {
            Ok(Ok(())) => None,
            Ok(Err(e)) => Some(e),
            // Our own code panicked (handler panics are caught earlier): the deliveries it held
            // were dropped, so the broker redelivers them. In offsets mode a lane that takes
            // over would claim its key's later records past them: the consumer stops instead.
            Err(join) if self.settings.dedup.offsets() => {
                tracing::error!(error = %join, "inbox delivery task failed; stopping (offsets mode)");
                Some(ConsumerError::Panicked(join.to_string()))
            }
            Err(join) => {
                tracing::error!(error = %join, "inbox delivery task failed");
                None
            }
        }
    }
}

pub(super) fn next_delay(delays: &mut impl Iterator<Item = Duration>) -> Duration {
    delays.next().unwrap_or(Duration::from_secs(1))
}

/// Sleeps; false when the stop token fired first.
pub(super) async fn sleep_unless_stopped(delay: Duration, stop: &CancellationToken) -> bool {
    tokio::select! {
        biased;
        () = stop.cancelled() => false,
        () = tokio::time::sleep(delay) => true,
    }
}
