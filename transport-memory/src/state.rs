//! The broker's state: topics with their log, each group's waiting and in-flight messages, and
//! the lock and wake-up that every broker clone shares.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

use bytes::Bytes;
use inbox_core::Headers;
use rand_chacha::ChaCha8Rng;
use tokio::sync::Notify;

use crate::broker::{AckObserver, BrokerStats};
use crate::faults::Faults;

#[derive(Debug)]
pub(crate) struct Envelope {
    pub(crate) seq: u64,
    pub(crate) message_id: Option<String>,
    pub(crate) payload: Bytes,
    pub(crate) headers: Headers,
}

#[derive(Debug, Clone)]
pub(crate) struct Pending {
    pub(crate) envelope: Arc<Envelope>,
    pub(crate) deliveries: u32,
}

#[derive(Debug, Default)]
pub(crate) struct Group {
    pub(crate) ready: VecDeque<Pending>,
    pub(crate) in_flight: HashMap<u64, Pending>,
}

#[derive(Debug, Default)]
pub(crate) struct Topic {
    pub(crate) log: Vec<Arc<Envelope>>,
    pub(crate) groups: HashMap<String, Group>,
}

pub(crate) struct State {
    pub(crate) topics: HashMap<String, Topic>,
    pub(crate) next_seq: u64,
    pub(crate) next_tag: u64,
    pub(crate) stats: BrokerStats,
    pub(crate) rng: ChaCha8Rng,
    pub(crate) faults: Faults,
    /// Faults suffered per message, by (kind, seq).
    pub(crate) fault_counts: HashMap<(u8, u64), u32>,
}

impl State {
    pub(crate) fn topic(&mut self, name: &str) -> &mut Topic {
        self.topics.entry(name.to_owned()).or_default()
    }
}

pub(crate) struct Shared {
    pub(crate) state: Mutex<State>,
    /// Woken on every change: new messages, settlements.
    pub(crate) changed: Notify,
    pub(crate) observer: Mutex<Option<Arc<dyn AckObserver>>>,
}

impl Shared {
    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves consistent state (every change is one step).
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}
