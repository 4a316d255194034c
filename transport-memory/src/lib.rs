//! An in-process broker with real at-least-once semantics, for unit tests and demos.
//!
//! - **Topics and consumer groups.** A topic keeps every message published to it; each consumer
//!   name subscribing to it is a group that receives every message once (starting from the
//!   beginning, like Kafka's `earliest`), and the instances of a group compete for them.
//! - **At-least-once.** A delivery that is nacked with requeue, or dropped without being settled
//!   (a crashed consumer), is delivered again, flagged redelivered, with its delivery count.
//! - **Fault injection, deterministic from a seed** ([`Faults`]): duplicate publishes, acks that
//!   are lost after the consumer sent them (the message comes back), the same message handed to
//!   two consumers at once, and reordering. For one sequence of broker operations, a seed always
//!   makes the same decisions.
//!
//! ```
//! # async fn demo() -> Result<(), inbox_core::TransportError> {
//! use inbox_core::{OutgoingMessage, Transport};
//! use inbox_transport_memory::{Faults, MemoryBroker};
//!
//! let broker = MemoryBroker::with_faults(Faults::seeded(42).duplicate_publish(0.2).lose_ack(0.1));
//! broker.publish("parcels", OutgoingMessage::new("m-1", r#"{"n":1}"#)).await?;
//! # Ok(()) }
//! ```
#![forbid(unsafe_code)]

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use futures::stream;
use inbox_core::{
    AckToken, Capabilities, Delivery, DeliveryStream, Headers, OutgoingMessage, Subscription,
    Transport, TransportError,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tokio::sync::Notify;

/// Faults to inject, each a probability per opportunity, and the seed that decides them.
#[derive(Debug, Clone, PartialEq)]
pub struct Faults {
    seed: u64,
    duplicate_publish: f64,
    lose_ack: f64,
    concurrent_copy: f64,
    reorder: f64,
    max_per_message: u32,
}

impl Faults {
    /// No faults.
    pub fn none() -> Self {
        Self::seeded(0)
    }

    /// No faults yet, decided by `seed` once some are set.
    pub fn seeded(seed: u64) -> Self {
        Self {
            seed,
            duplicate_publish: 0.0,
            lose_ack: 0.0,
            concurrent_copy: 0.0,
            reorder: 0.0,
            max_per_message: 1,
        }
    }

    /// A publish is stored twice: the producer's retry after a lost publisher confirm.
    pub fn duplicate_publish(mut self, p: f64) -> Self {
        self.duplicate_publish = p.clamp(0.0, 1.0);
        self
    }

    /// An ack is accepted from the consumer and then lost: the message is delivered again, as
    /// after a connection that broke between the consumer's ack and the broker.
    pub fn lose_ack(mut self, p: f64) -> Self {
        self.lose_ack = p.clamp(0.0, 1.0);
        self
    }

    /// A dispatched message is also handed, at once, to the next instance that asks: two copies
    /// in flight concurrently.
    pub fn concurrent_copy(mut self, p: f64) -> Self {
        self.concurrent_copy = p.clamp(0.0, 1.0);
        self
    }

    /// A dispatch takes a random waiting message instead of the oldest.
    pub fn reorder(mut self, p: f64) -> Self {
        self.reorder = p.clamp(0.0, 1.0);
        self
    }

    /// How many faults of each kind one message may suffer (default 1), so that a probability of
    /// 1.0 still lets every message through in the end.
    pub fn max_per_message(mut self, n: u32) -> Self {
        self.max_per_message = n;
        self
    }

    /// The seed.
    pub fn seed(&self) -> u64 {
        self.seed
    }
}

impl Default for Faults {
    fn default() -> Self {
        Self::none()
    }
}

/// Called before the broker applies an ack. Tests use it to check that what is acked is already
/// committed ("nothing acked before commit").
#[async_trait]
pub trait AckObserver: Send + Sync {
    /// The ack of `message_id` (if the message had one) by `group` on `topic` is about to apply.
    async fn before_ack(&self, topic: &str, group: &str, message_id: Option<&str>);
}

/// Counts of what the broker did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct BrokerStats {
    /// Messages published (after injected duplicates: what was stored).
    pub published: u64,
    /// Deliveries handed to consumers.
    pub deliveries: u64,
    /// Acks applied.
    pub acks: u64,
    /// Nacks with requeue, and deliveries dropped unsettled.
    pub requeued: u64,
    /// Nacks without requeue: the message was discarded.
    pub discarded: u64,
    /// Injected duplicate publishes.
    pub injected_duplicates: u64,
    /// Injected lost acks.
    pub injected_lost_acks: u64,
    /// Injected concurrent copies.
    pub injected_concurrent_copies: u64,
    /// Injected reorderings.
    pub injected_reorders: u64,
}

#[derive(Debug)]
struct Envelope {
    seq: u64,
    message_id: Option<String>,
    payload: Bytes,
    headers: Headers,
}

#[derive(Debug, Clone)]
struct Pending {
    envelope: Arc<Envelope>,
    deliveries: u32,
}

#[derive(Debug, Default)]
struct Group {
    ready: VecDeque<Pending>,
    in_flight: HashMap<u64, Pending>,
}

#[derive(Debug, Default)]
struct Topic {
    log: Vec<Arc<Envelope>>,
    groups: HashMap<String, Group>,
}

struct State {
    topics: HashMap<String, Topic>,
    next_seq: u64,
    next_tag: u64,
    stats: BrokerStats,
    rng: ChaCha8Rng,
    faults: Faults,
    /// Faults suffered per message, by (kind, seq).
    fault_counts: HashMap<(u8, u64), u32>,
}

impl State {
    /// Decides one fault of `kind` for message `seq`.
    fn roll(&mut self, kind: u8, p: f64, seq: u64) -> bool {
        if p <= 0.0 {
            return false;
        }
        let hit = self.rng.random_bool(p);
        if !hit {
            return false;
        }
        let count = self.fault_counts.entry((kind, seq)).or_default();
        if *count >= self.faults.max_per_message {
            return false;
        }
        *count += 1;
        true
    }

    fn topic(&mut self, name: &str) -> &mut Topic {
        self.topics.entry(name.to_owned()).or_default()
    }
}

/// The group that reads dead-letter topics for a replay.
const REPLAY_GROUP: &str = "inbox-replay";

const DUPLICATE: u8 = 0;
const LOSE_ACK: u8 = 1;
const COPY: u8 = 2;
const REORDER: u8 = 3;

struct Shared {
    state: Mutex<State>,
    /// Woken on every change: new messages, settlements.
    changed: Notify,
    observer: Mutex<Option<Arc<dyn AckObserver>>>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves consistent state (every change is one step).
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// The in-process broker. Cheap to clone: clones share the broker.
#[derive(Clone)]
pub struct MemoryBroker {
    shared: Arc<Shared>,
}

impl fmt::Debug for MemoryBroker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = self.shared.lock();
        f.debug_struct("MemoryBroker")
            .field("topics", &state.topics.len())
            .field("faults", &state.faults)
            .finish()
    }
}

impl Default for MemoryBroker {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryBroker {
    /// A broker without faults.
    pub fn new() -> Self {
        Self::with_faults(Faults::none())
    }

    /// A broker injecting `faults`.
    pub fn with_faults(faults: Faults) -> Self {
        Self {
            shared: Arc::new(Shared {
                state: Mutex::new(State {
                    topics: HashMap::new(),
                    next_seq: 0,
                    next_tag: 0,
                    stats: BrokerStats::default(),
                    rng: ChaCha8Rng::seed_from_u64(faults.seed),
                    fault_counts: HashMap::new(),
                    faults,
                }),
                changed: Notify::new(),
                observer: Mutex::new(None),
            }),
        }
    }

    /// Changes the faults from now on (the random sequence goes on; the seed is not reset).
    pub fn set_faults(&self, faults: Faults) {
        self.shared.lock().faults = faults;
    }

    /// Installs an observer called before every ack applies.
    pub fn set_ack_observer(&self, observer: Arc<dyn AckObserver>) {
        *self
            .shared
            .observer
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Some(observer);
    }

    /// Creates a consumer group ahead of its first subscription, so that it is counted as
    /// pending work at once.
    pub fn declare_group(&self, topic: &str, group: &str) {
        let mut state = self.shared.lock();
        Self::ensure_group(&mut state, topic, group);
    }

    fn ensure_group<'s>(state: &'s mut State, topic: &str, group: &str) -> &'s mut Group {
        let topic = state.topic(topic);
        if !topic.groups.contains_key(group) {
            let ready = topic
                .log
                .iter()
                .map(|envelope| Pending {
                    envelope: Arc::clone(envelope),
                    deliveries: 0,
                })
                .collect();
            topic.groups.insert(
                group.to_owned(),
                Group {
                    ready,
                    in_flight: HashMap::new(),
                },
            );
        }
        topic.groups.get_mut(group).expect("inserted above")
    }

    /// Counts so far.
    pub fn stats(&self) -> BrokerStats {
        self.shared.lock().stats
    }

    /// Messages waiting for `group` on `topic`, and messages delivered but not yet settled. A
    /// group that has not subscribed yet has the whole topic waiting (it starts from the
    /// beginning).
    pub fn backlog(&self, topic: &str, group: &str) -> (usize, usize) {
        let state = self.shared.lock();
        let Some(topic) = state.topics.get(topic) else {
            return (0, 0);
        };
        match topic.groups.get(group) {
            Some(g) => (g.ready.len(), g.in_flight.len()),
            None => (topic.log.len(), 0),
        }
    }

    /// Every message ever published to `topic`, in order (for example a dead-letter topic).
    pub fn messages(&self, topic: &str) -> Vec<OutgoingMessage> {
        let state = self.shared.lock();
        state
            .topics
            .get(topic)
            .map(|t| {
                t.log
                    .iter()
                    .map(|e| OutgoingMessage {
                        message_id: e.message_id.clone(),
                        payload: e.payload.clone(),
                        headers: e.headers.clone(),
                        key: None,
                    })
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Waits until every listed group of `topic` has nothing waiting and nothing in flight, or
    /// the timeout passes (then says what is left).
    pub async fn wait_settled(
        &self,
        topic: &str,
        groups: &[&str],
        timeout: Duration,
    ) -> Result<(), String> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let changed = self.shared.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            let left: Vec<String> = groups
                .iter()
                .filter_map(|g| {
                    let (ready, in_flight) = self.backlog(topic, g);
                    (ready + in_flight > 0)
                        .then(|| format!("{g}: {ready} waiting, {in_flight} in flight"))
                })
                .collect();
            if left.is_empty() {
                return Ok(());
            }
            if tokio::time::timeout_at(deadline, changed).await.is_err() {
                return Err(format!(
                    "not settled after {timeout:?}: {}",
                    left.join("; ")
                ));
            }
        }
    }

    /// Waits for the next message for `group`.
    async fn next_delivery(&self, topic: &str, group: &str) -> MemoryDelivery {
        loop {
            // Registered before looking, so a publish in between is not missed.
            let changed = self.shared.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if let Some(delivery) = self.dispatch(topic, group) {
                return delivery;
            }
            changed.await;
        }
    }

    /// Takes the next message for `group`, if any.
    fn dispatch(&self, topic: &str, group: &str) -> Option<MemoryDelivery> {
        let mut state = self.shared.lock();
        let (reorder, copy) = (state.faults.reorder, state.faults.concurrent_copy);
        let len = Self::ensure_group(&mut state, topic, group).ready.len();
        if len == 0 {
            return None;
        }
        let mut index = 0;
        if len > 1 {
            let candidate = state.rng.random_range(0..len);
            let seq = state.topics[topic].groups[group].ready[candidate]
                .envelope
                .seq;
            if candidate != 0 && state.roll(REORDER, reorder, seq) {
                index = candidate;
                state.stats.injected_reorders += 1;
            }
        }
        let tag = state.next_tag;
        state.next_tag += 1;
        let group_state = state
            .topics
            .get_mut(topic)
            .and_then(|t| t.groups.get_mut(group))
            .expect("ensured above");
        let mut pending = group_state.ready.remove(index).expect("index < len");
        pending.deliveries += 1;
        group_state.in_flight.insert(tag, pending.clone());
        let seq = pending.envelope.seq;
        if state.roll(COPY, copy, seq) {
            state.stats.injected_concurrent_copies += 1;
            let group_state = state
                .topics
                .get_mut(topic)
                .and_then(|t| t.groups.get_mut(group))
                .expect("ensured above");
            group_state.ready.push_front(pending.clone());
        }
        state.stats.deliveries += 1;
        drop(state);
        self.shared.changed.notify_waiters();
        Some(MemoryDelivery {
            broker: self.clone(),
            topic: topic.to_owned(),
            group: group.to_owned(),
            tag,
            envelope: pending.envelope,
            deliveries: pending.deliveries,
            settled: false,
        })
    }

    /// Settles delivery `tag`: `requeue` puts the message back, otherwise it is done.
    fn settle(&self, topic: &str, group: &str, tag: u64, outcome: Settle) {
        let mut state = self.shared.lock();
        let Some(group_state) = state
            .topics
            .get_mut(topic)
            .and_then(|t| t.groups.get_mut(group))
        else {
            return;
        };
        let Some(pending) = group_state.in_flight.remove(&tag) else {
            return;
        };
        match outcome {
            Settle::Ack => {
                let (p, seq) = (state.faults.lose_ack, pending.envelope.seq);
                if state.roll(LOSE_ACK, p, seq) {
                    state.stats.injected_lost_acks += 1;
                    state.stats.requeued += 1;
                    Self::requeue(&mut state, topic, group, pending);
                } else {
                    state.stats.acks += 1;
                }
            }
            Settle::Requeue => {
                state.stats.requeued += 1;
                Self::requeue(&mut state, topic, group, pending);
            }
            Settle::Discard => state.stats.discarded += 1,
        }
        drop(state);
        self.shared.changed.notify_waiters();
    }

    fn requeue(state: &mut State, topic: &str, group: &str, pending: Pending) {
        if let Some(g) = state
            .topics
            .get_mut(topic)
            .and_then(|t| t.groups.get_mut(group))
        {
            g.ready.push_back(pending);
        }
    }
}

enum Settle {
    Ack,
    Requeue,
    Discard,
}

#[async_trait]
impl Transport for MemoryBroker {
    fn name(&self) -> &'static str {
        "memory"
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::basic().with_delivery_count(true)
    }

    async fn subscribe(
        &self,
        subscription: &Subscription,
    ) -> Result<DeliveryStream, TransportError> {
        let topic = subscription.source.clone();
        let group = subscription.consumer.as_str().to_owned();
        self.declare_group(&topic, &group);
        let broker = self.clone();
        let deliveries = stream::unfold(
            (broker, topic, group),
            |(broker, topic, group)| async move {
                let delivery = broker.next_delivery(&topic, &group).await;
                let boxed: Box<dyn Delivery> = Box::new(delivery);
                Some((Ok(boxed), (broker, topic, group)))
            },
        );
        Ok(Box::pin(deliveries))
    }

    /// The dead-letter topic through a group of its own (`inbox-replay`), which starts at the
    /// topic's beginning; the stream ends when nothing is waiting for that group.
    async fn read_dead_letters(&self, destination: &str) -> Result<DeliveryStream, TransportError> {
        let topic = destination.to_owned();
        self.declare_group(&topic, REPLAY_GROUP);
        let deliveries = stream::unfold((self.clone(), topic), |(broker, topic)| async move {
            let delivery = broker.dispatch(&topic, REPLAY_GROUP)?;
            let boxed: Box<dyn Delivery> = Box::new(delivery);
            Some((Ok(boxed), (broker, topic)))
        });
        Ok(Box::pin(deliveries))
    }

    async fn publish(
        &self,
        destination: &str,
        message: OutgoingMessage,
    ) -> Result<(), TransportError> {
        let mut state = self.shared.lock();
        let seq = state.next_seq;
        let p = state.faults.duplicate_publish;
        let copies = if state.roll(DUPLICATE, p, seq) {
            state.stats.injected_duplicates += 1;
            2
        } else {
            1
        };
        let OutgoingMessage {
            message_id,
            payload,
            headers,
            ..
        } = message;
        for _ in 0..copies {
            let envelope = Arc::new(Envelope {
                seq: state.next_seq,
                message_id: message_id.clone(),
                payload: payload.clone(),
                headers: headers.clone(),
            });
            state.next_seq += 1;
            state.stats.published += 1;
            let topic = state.topic(destination);
            topic.log.push(Arc::clone(&envelope));
            for group in topic.groups.values_mut() {
                group.ready.push_back(Pending {
                    envelope: Arc::clone(&envelope),
                    deliveries: 0,
                });
            }
        }
        drop(state);
        self.shared.changed.notify_waiters();
        Ok(())
    }
}

/// A delivery from the [`MemoryBroker`]. Dropped unsettled, it is redelivered.
pub struct MemoryDelivery {
    broker: MemoryBroker,
    topic: String,
    group: String,
    tag: u64,
    envelope: Arc<Envelope>,
    deliveries: u32,
    settled: bool,
}

impl fmt::Debug for MemoryDelivery {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryDelivery")
            .field("topic", &self.topic)
            .field("group", &self.group)
            .field("tag", &self.tag)
            .field("message_id", &self.envelope.message_id)
            .field("deliveries", &self.deliveries)
            .finish()
    }
}

#[async_trait]
impl Delivery for MemoryDelivery {
    fn payload(&self) -> &[u8] {
        &self.envelope.payload
    }

    fn headers(&self) -> &Headers {
        &self.envelope.headers
    }

    fn broker_message_id(&self) -> Option<&[u8]> {
        self.envelope.message_id.as_deref().map(str::as_bytes)
    }

    fn redelivered(&self) -> bool {
        self.deliveries > 1
    }

    fn delivery_count(&self) -> Option<u32> {
        Some(self.deliveries)
    }

    fn coordinates(&self) -> Option<String> {
        Some(format!("{}/0/{}", self.topic, self.envelope.seq))
    }

    async fn ack(mut self: Box<Self>, _token: AckToken) -> Result<(), TransportError> {
        let observer = self
            .broker
            .shared
            .observer
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        if let Some(observer) = observer {
            observer
                .before_ack(
                    &self.topic,
                    &self.group,
                    self.envelope.message_id.as_deref(),
                )
                .await;
        }
        self.settled = true;
        self.broker
            .settle(&self.topic, &self.group, self.tag, Settle::Ack);
        Ok(())
    }

    async fn nack(mut self: Box<Self>, requeue: bool) -> Result<(), TransportError> {
        self.settled = true;
        let outcome = if requeue {
            Settle::Requeue
        } else {
            Settle::Discard
        };
        self.broker
            .settle(&self.topic, &self.group, self.tag, outcome);
        Ok(())
    }
}

impl Drop for MemoryDelivery {
    fn drop(&mut self) {
        if !self.settled {
            tracing::debug!(
                tag = self.tag,
                "memory delivery dropped unsettled; redelivering"
            );
            self.broker
                .settle(&self.topic, &self.group, self.tag, Settle::Requeue);
        }
    }
}

#[cfg(test)]
mod tests {
    use futures::StreamExt;
    use inbox_core::ConsumerName;

    use super::*;

    fn sub(topic: &str, group: &str) -> Subscription {
        Subscription::new(topic, ConsumerName::new(group).unwrap(), 10)
    }

    #[tokio::test]
    async fn nack_and_drop_redeliver_ack_settles() {
        let broker = MemoryBroker::new();
        let mut stream = broker.subscribe(&sub("t", "g")).await.unwrap();
        broker
            .publish("t", OutgoingMessage::new("a", "1"))
            .await
            .unwrap();

        let first = stream.next().await.unwrap().unwrap();
        assert!(!first.redelivered());
        first.nack(true).await.unwrap();
        let second = stream.next().await.unwrap().unwrap();
        assert!(second.redelivered());
        assert_eq!(second.delivery_count(), Some(2));
        drop(second);
        let third = stream.next().await.unwrap().unwrap();
        assert_eq!(third.delivery_count(), Some(3));
        third.ack(AckToken::for_transport_tests()).await.unwrap();
        assert_eq!(broker.backlog("t", "g"), (0, 0));
        assert_eq!(broker.stats().requeued, 2);
    }

    #[tokio::test]
    async fn groups_fan_out_and_instances_compete() {
        let broker = MemoryBroker::new();
        let mut a1 = broker.subscribe(&sub("t", "a")).await.unwrap();
        let mut a2 = broker.subscribe(&sub("t", "a")).await.unwrap();
        for i in 0..2 {
            broker
                .publish("t", OutgoingMessage::new(format!("m{i}"), "x"))
                .await
                .unwrap();
        }
        // A group created later still gets everything.
        let mut b = broker.subscribe(&sub("t", "b")).await.unwrap();
        let x = a1.next().await.unwrap().unwrap();
        let y = a2.next().await.unwrap().unwrap();
        assert_ne!(x.broker_message_id(), y.broker_message_id());
        assert_eq!(broker.backlog("t", "a"), (0, 2));
        for _ in 0..2 {
            b.next()
                .await
                .unwrap()
                .unwrap()
                .ack(AckToken::for_transport_tests())
                .await
                .unwrap();
        }
        assert_eq!(broker.backlog("t", "b"), (0, 0));
    }

    async fn run_schedule(seed: u64) -> (Vec<String>, BrokerStats) {
        let faults = Faults::seeded(seed)
            .duplicate_publish(0.3)
            .lose_ack(0.3)
            .concurrent_copy(0.3)
            .reorder(0.5);
        let broker = MemoryBroker::with_faults(faults);
        let mut stream = broker.subscribe(&sub("t", "g")).await.unwrap();
        for i in 0..50 {
            broker
                .publish("t", OutgoingMessage::new(format!("m{i}"), "x"))
                .await
                .unwrap();
        }
        let mut seen = Vec::new();
        while broker.backlog("t", "g") != (0, 0) {
            let d = stream.next().await.unwrap().unwrap();
            seen.push(String::from_utf8(d.broker_message_id().unwrap().to_vec()).unwrap());
            d.ack(AckToken::for_transport_tests()).await.unwrap();
        }
        (seen, broker.stats())
    }

    #[tokio::test]
    async fn faults_are_deterministic_from_the_seed() {
        let (a, stats_a) = run_schedule(7).await;
        let (b, stats_b) = run_schedule(7).await;
        assert_eq!(a, b);
        assert_eq!(stats_a, stats_b);
        assert!(stats_a.injected_duplicates > 0 && stats_a.injected_lost_acks > 0);
        assert!(stats_a.injected_concurrent_copies > 0 && stats_a.injected_reorders > 0);
        let (c, _) = run_schedule(8).await;
        assert_ne!(a, c);
        // Every message got through at least once.
        for i in 0..50 {
            assert!(a.contains(&format!("m{i}")));
        }
    }
}
