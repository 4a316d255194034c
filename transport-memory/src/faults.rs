//! What faults to inject ([`Faults`]), and how the seeded random source decides each one.

use rand::Rng;

use crate::state::State;

/// Faults to inject, each a probability per opportunity, and the seed that decides them.
#[derive(Debug, Clone, PartialEq)]
pub struct Faults {
    pub(crate) seed: u64,
    pub(crate) duplicate_publish: f64,
    pub(crate) lose_ack: f64,
    pub(crate) concurrent_copy: f64,
    pub(crate) reorder: f64,
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

impl State {
    /// Decides one fault of `kind` for message `seq`.
    pub(crate) fn roll(&mut self, kind: u8, p: f64, seq: u64) -> bool {
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
}

pub(crate) const DUPLICATE: u8 = 0;
pub(crate) const LOSE_ACK: u8 = 1;
pub(crate) const COPY: u8 = 2;
pub(crate) const REORDER: u8 = 3;
