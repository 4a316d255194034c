//! The orphaned-partition guard ([`KafkaConfig::orphan_guard`](crate::KafkaConfig::orphan_guard),
//! off by default): a consumer that sits idle beside a backlog nobody reads rejoins its group.
//!
//! A group coordinator can settle a generation whose assignment names members that are gone:
//! tansu 0.6 drops members whose session expired while a generation forms without starting a
//! new one, so the leader's assignment may give partitions to dead members, and with no member
//! left to expire nothing rebalances again (a crash-looping instance then holds one partition of
//! three for ever; a plain confluent-kafka consumer gets stuck the same way). Apache Kafka's
//! coordinator waits for the members before it completes a join and does not get there. The
//! direct check — which partitions no member of the group holds (DescribeGroups) — does not work
//! on tansu 0.6, which lists no members; so the guard infers it from offsets.
//!
//! The signal: this consumer has nothing in flight, and a partition of its topic that is not
//! assigned to it has records after its committed offset, and that committed offset has not
//! moved for [`Guard::strikes`] checks in a row after the first. Then the stream ends with a
//! transient error, the engine subscribes again with a fresh consumer, and the group forms anew.
//!
//! The same signs have other causes on a healthy group, which is why the guard is opt-in: an
//! owner whose head record is slow, retried in place or waiting out a database outage commits
//! nothing meanwhile; a transactional producer's commit marker leaves a quiet partition's
//! committed offset one short of its end. Each firing is a rebalance of the whole group, so each
//! one doubles the checks the group's next firing needs (up to 32) until this instance receives
//! a record again.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use rdkafka::consumer::{Consumer, ConsumerContext};
use rdkafka::error::KafkaResult;
use rdkafka::{Offset, TopicPartitionList};

/// Checks in a row, after the first, a backlog must stay frozen before the consumer rejoins (the
/// first time).
pub(crate) const STRIKES: u32 = 2;

/// A subscription's guard: how often it checks, and how often its group's guard fired since this
/// instance last received a record (shared by the group's subscriptions in this transport).
#[derive(Debug, Clone)]
pub(crate) struct Guard {
    pub(crate) every: Duration,
    pub(crate) rejoins: Arc<AtomicU32>,
}

impl Guard {
    /// Checks in a row needed now: [`STRIKES`], doubled for each firing since the last record.
    pub(crate) fn strikes(&self) -> u32 {
        STRIKES << self.rejoins.load(Ordering::SeqCst).min(4)
    }

    /// This instance received a record: the group is being read.
    pub(crate) fn received(&self) {
        self.rejoins.store(0, Ordering::SeqCst);
    }

    /// The guard fired.
    pub(crate) fn fired(&self) {
        self.rejoins.fetch_add(1, Ordering::SeqCst);
    }
}

/// How often the guard checks: the session timeout (the time a dead member keeps its
/// partitions), at least 5 s.
pub(crate) fn check_interval(session_timeout: Option<Duration>) -> Duration {
    // librdkafka's default session timeout.
    session_timeout
        .unwrap_or(Duration::from_secs(45))
        .max(Duration::from_secs(5))
}

/// A partition of the topic not assigned to this consumer, as one check saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Sample {
    pub(crate) partition: i32,
    /// The group's committed offset, if it has one.
    pub(crate) committed: Option<i64>,
    /// Records after the committed offset (all of them when there is none).
    pub(crate) backlog: i64,
}

/// What the guard remembers between checks: per partition, the committed offset last seen and
/// how many checks in a row it stood still over a backlog.
#[derive(Debug, Default)]
pub(crate) struct Orphans {
    seen: HashMap<i32, (Option<i64>, u32)>,
}

impl Orphans {
    /// Takes one check's samples; returns the partitions frozen for `strikes` checks.
    pub(crate) fn observe(&mut self, samples: &[Sample], strikes: u32) -> Vec<i32> {
        let mut next = HashMap::new();
        let mut frozen = Vec::new();
        for sample in samples {
            let row = match self.seen.get(&sample.partition) {
                Some(&(committed, row)) if committed == sample.committed && sample.backlog > 0 => {
                    row + 1
                }
                _ => 0,
            };
            if row >= strikes {
                frozen.push(sample.partition);
            }
            next.insert(sample.partition, (sample.committed, row));
        }
        self.seen = next;
        frozen
    }

    /// Forgets what was seen: this consumer was busy, so the checks do not count as in a row.
    pub(crate) fn forget(&mut self) {
        self.seen.clear();
    }
}

/// Samples the partitions of `topic` not assigned to `consumer` (blocking: metadata, committed
/// offsets and watermarks from the broker).
pub(crate) fn sample<C, K>(consumer: &K, topic: &str) -> KafkaResult<Vec<Sample>>
where
    C: ConsumerContext,
    K: Consumer<C>,
{
    let timeout = Duration::from_secs(5);
    let assigned = consumer.assignment()?;
    let mut others = TopicPartitionList::new();
    let metadata = consumer.fetch_metadata(Some(topic), timeout)?;
    for partition in metadata
        .topics()
        .iter()
        .flat_map(|t| t.partitions().iter().map(|p| p.id()))
    {
        if assigned.find_partition(topic, partition).is_none() {
            others.add_partition(topic, partition);
        }
    }
    if others.count() == 0 {
        return Ok(Vec::new());
    }
    let committed = consumer.committed_offsets(others, timeout)?;
    let mut samples = Vec::new();
    for element in committed.elements() {
        // A partition whose committed offset could not be read is left out, not taken as
        // having none.
        if element.error().is_err() {
            continue;
        }
        let (low, high) = consumer.fetch_watermarks(topic, element.partition(), timeout)?;
        let committed = match element.offset() {
            Offset::Offset(o) => Some(o),
            _ => None,
        };
        samples.push(Sample {
            partition: element.partition(),
            committed,
            backlog: (high - committed.unwrap_or(low)).max(0),
        });
    }
    Ok(samples)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(partition: i32, committed: Option<i64>, backlog: i64) -> Sample {
        Sample {
            partition,
            committed,
            backlog,
        }
    }

    #[test]
    fn a_backlog_frozen_for_the_strikes_is_orphaned() {
        let mut orphans = Orphans::default();
        let samples = [at(1, Some(10), 5), at(2, None, 7)];
        for _ in 0..STRIKES {
            assert!(orphans.observe(&samples, STRIKES).is_empty());
        }
        assert_eq!(orphans.observe(&samples, STRIKES), vec![1, 2]);
    }

    #[test]
    fn each_firing_doubles_the_strikes_until_a_record_arrives() {
        let guard = Guard {
            every: Duration::from_secs(6),
            rejoins: Arc::default(),
        };
        assert_eq!(guard.strikes(), STRIKES);
        guard.fired();
        assert_eq!(guard.strikes(), 2 * STRIKES);
        for _ in 0..10 {
            guard.fired();
        }
        assert_eq!(guard.strikes(), 16 * STRIKES, "capped");
        guard.received();
        assert_eq!(guard.strikes(), STRIKES);
    }

    #[test]
    fn progress_or_no_backlog_is_not_orphaned() {
        let mut orphans = Orphans::default();
        for round in 0..10 {
            // Partition 1's owner commits; partition 2 is read to its end.
            let samples = [at(1, Some(10 + round), 5), at(2, Some(40), 0)];
            assert!(
                orphans.observe(&samples, STRIKES).is_empty(),
                "round {round}"
            );
        }
    }

    #[test]
    fn a_busy_check_breaks_the_row() {
        let mut orphans = Orphans::default();
        let samples = [at(0, Some(3), 1)];
        for _ in 0..STRIKES {
            assert!(orphans.observe(&samples, STRIKES).is_empty());
        }
        orphans.forget();
        for _ in 0..STRIKES {
            assert!(orphans.observe(&samples, STRIKES).is_empty());
        }
        assert_eq!(orphans.observe(&samples, STRIKES), vec![0]);
    }

    #[test]
    fn the_interval_follows_the_session_timeout() {
        assert_eq!(
            check_interval(Some(Duration::from_secs(6))),
            Duration::from_secs(6)
        );
        assert_eq!(
            check_interval(Some(Duration::from_secs(1))),
            Duration::from_secs(5)
        );
        assert_eq!(check_interval(None), Duration::from_secs(45));
    }
}
