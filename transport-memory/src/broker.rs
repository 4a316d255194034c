//! The broker: its public handle and counters, and how messages are dispatched to a group's
//! instances and settled.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use inbox_core::OutgoingMessage;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tokio::sync::Notify;

use crate::delivery::MemoryDelivery;
use crate::faults::{COPY, Faults, LOSE_ACK, REORDER};
use crate::state::{Group, Pending, Shared, State};

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

/// The in-process broker. Cheap to clone: clones share the broker.
#[derive(Clone)]
pub struct MemoryBroker {
    pub(crate) shared: Arc<Shared>,
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
    pub(crate) async fn next_delivery(&self, topic: &str, group: &str) -> MemoryDelivery {
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
    pub(crate) fn dispatch(&self, topic: &str, group: &str) -> Option<MemoryDelivery> {
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
    pub(crate) fn settle(&self, topic: &str, group: &str, tag: u64, outcome: Settle) {
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

pub(crate) enum Settle {
    Ack,
    Requeue,
    Discard,
}
