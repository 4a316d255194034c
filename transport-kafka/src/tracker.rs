//! The offset [`Tracker`] (which records of which partitions are done) and the rebalance
//! [`Context`] that resets it.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use rdkafka::consumer::{BaseConsumer, ConsumerContext, Rebalance, StreamConsumer};
use rdkafka::{ClientContext, TopicPartitionList};

/// Which records of which partitions are done, so that only contiguous progress is stored.
#[derive(Default)]
pub(crate) struct Tracker {
    partitions: Mutex<HashMap<(String, i32), Lane>>,
    generation: AtomicUsize,
    /// Offsets mode: where each partition starts since its assignment.
    starts: Mutex<HashMap<(String, i32), Start>>,
    /// Counts rebalances: a start looked up across one is stale.
    rebalances: AtomicUsize,
}

/// Offsets mode: a partition's start since its assignment. No entry: not looked up yet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Start {
    /// Moved to this offset: records before it are skipped.
    At(i64),
    /// Its records are delivered.
    Open,
}

/// One partition's records in delivery order, since its assignment.
struct Lane {
    generation: usize,
    pending: VecDeque<(i64, bool)>,
}

impl Tracker {
    /// Notes a delivered record; returns the assignment generation it belongs to, and whether it
    /// is its partition's first record since the assignment — the one a previous owner that died
    /// was most likely handling.
    pub(crate) fn delivered(&self, topic: &str, partition: i32, offset: i64) -> (usize, bool) {
        let mut partitions = self.partitions.lock().unwrap_or_else(|p| p.into_inner());
        let mut first = false;
        let lane = partitions
            .entry((topic.to_owned(), partition))
            .or_insert_with(|| {
                first = true;
                Lane {
                    generation: self.generation.fetch_add(1, Ordering::SeqCst),
                    pending: VecDeque::new(),
                }
            });
        lane.pending.push_back((offset, false));
        (lane.generation, first)
    }

    /// Marks a record done; returns the offset to store (the next record to read) when the
    /// contiguous done prefix grew.
    pub(crate) fn done(
        &self,
        topic: &str,
        partition: i32,
        offset: i64,
        generation: usize,
    ) -> Option<i64> {
        let mut partitions = self.partitions.lock().unwrap_or_else(|p| p.into_inner());
        let lane = partitions.get_mut(&(topic.to_owned(), partition))?;
        if lane.generation != generation {
            return None; // The partition was revoked since: its new owner decides.
        }
        if let Some(entry) = lane.pending.iter_mut().find(|(o, _)| *o == offset) {
            entry.1 = true;
        }
        let mut next = None;
        while let Some(&(o, true)) = lane.pending.front() {
            lane.pending.pop_front();
            next = Some(o + 1);
        }
        next
    }

    /// Forgets partitions (revoked or newly assigned): records still in flight for them are
    /// abandoned, and their starts are looked up again.
    pub(crate) fn reset(&self, list: &TopicPartitionList) {
        self.rebalances.fetch_add(1, Ordering::SeqCst);
        let mut partitions = self.partitions.lock().unwrap_or_else(|p| p.into_inner());
        let mut starts = self.starts.lock().unwrap_or_else(|p| p.into_inner());
        for element in list.elements() {
            let key = (element.topic().to_owned(), element.partition());
            partitions.remove(&key);
            starts.remove(&key);
        }
    }

    /// Offsets mode: what to do with a record at `offset`. `None`: its partition's start is
    /// not known yet; `Some(true)`: deliver it; `Some(false)`: skip it (before the start).
    pub(crate) fn admits(&self, topic: &str, partition: i32, offset: i64) -> Option<bool> {
        let mut starts = self.starts.lock().unwrap_or_else(|p| p.into_inner());
        let start = starts.get_mut(&(topic.to_owned(), partition))?;
        Some(match *start {
            Start::Open => true,
            Start::At(at) if offset >= at => {
                *start = Start::Open;
                true
            }
            Start::At(_) => false,
        })
    }

    /// Offsets mode: sets a partition's start, unless a rebalance came since `rebalances`
    /// was read (then it is looked up again).
    pub(crate) fn start(
        &self,
        topic: &str,
        partition: i32,
        start: Start,
        rebalances: usize,
    ) -> bool {
        let mut starts = self.starts.lock().unwrap_or_else(|p| p.into_inner());
        if self.rebalances.load(Ordering::SeqCst) != rebalances {
            return false;
        }
        starts.insert((topic.to_owned(), partition), start);
        true
    }

    /// Rebalances so far.
    pub(crate) fn rebalances(&self) -> usize {
        self.rebalances.load(Ordering::SeqCst)
    }
}

/// Resets the tracker on rebalances.
pub(crate) struct Context {
    pub(crate) tracker: Arc<Tracker>,
}

impl ClientContext for Context {}

impl ConsumerContext for Context {
    fn pre_rebalance(&self, _consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Revoke(list) = rebalance {
            tracing::info!(
                partitions = list.count(),
                "partitions revoked; abandoning their in-flight records"
            );
            self.tracker.reset(list);
        }
    }

    fn post_rebalance(&self, _consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Assign(list) = rebalance {
            tracing::info!(partitions = list.count(), "partitions assigned");
            self.tracker.reset(list);
        }
    }
}

pub(crate) type KafkaConsumer = StreamConsumer<Context>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_contiguous_progress_is_stored() {
        let tracker = Tracker::default();
        let (g, first) = tracker.delivered("t", 0, 10);
        assert!(first, "the first record since the assignment");
        assert!(!tracker.delivered("t", 0, 11).1);
        tracker.delivered("t", 0, 13); // offsets may have gaps
        assert_eq!(tracker.done("t", 0, 11, g), None, "10 is not done yet");
        assert_eq!(tracker.done("t", 0, 10, g), Some(12));
        assert_eq!(tracker.done("t", 0, 13, g), Some(14));
    }

    #[test]
    fn a_start_skips_what_comes_before_it_and_a_rebalance_forgets_it() {
        let tracker = Tracker::default();
        assert_eq!(tracker.admits("t", 0, 5), None, "not looked up yet");
        let seen = tracker.rebalances();
        assert!(tracker.start("t", 0, Start::At(7), seen));
        assert_eq!(tracker.admits("t", 0, 5), Some(false));
        assert_eq!(tracker.admits("t", 0, 8), Some(true), "past the start");
        assert_eq!(tracker.admits("t", 0, 6), Some(true), "open from then on");
        let mut list = TopicPartitionList::new();
        list.add_partition("t", 0);
        tracker.reset(&list);
        assert_eq!(tracker.admits("t", 0, 9), None);
        assert!(
            !tracker.start("t", 0, Start::Open, seen),
            "a start looked up before the rebalance is stale"
        );
        assert_eq!(tracker.admits("t", 0, 9), None);
    }

    #[test]
    fn acks_from_before_a_rebalance_store_nothing() {
        let tracker = Tracker::default();
        let (old, _) = tracker.delivered("t", 1, 5);
        let mut list = TopicPartitionList::new();
        list.add_partition("t", 1);
        tracker.reset(&list);
        let (new, _) = tracker.delivered("t", 1, 5);
        assert_ne!(old, new);
        assert_eq!(tracker.done("t", 1, 5, old), None);
        assert_eq!(tracker.done("t", 1, 5, new), Some(6));
    }
}
