//! How often and how fast a failing message is tried again.

use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBuilder};

/// Retry policy of one consumer.
///
/// A transiently failing message is retried in process `in_process_retries` times with
/// exponential backoff and jitter, then handed back to the broker (nack with requeue; where the
/// broker cannot requeue, it is retried in place). Every failed attempt is recorded in the inbox
/// table, so the limit `max_attempts` counts across redeliveries, instances and restarts. Past it,
/// the message is dead-lettered.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct RetryPolicy {
    /// Total attempts before dead-lettering (at least 1).
    pub max_attempts: u32,
    /// Deliveries the broker may make of one message, where it counts them (RabbitMQ quorum
    /// queues, the memory broker), before it is dead-lettered although no failure was recorded:
    /// the backstop for a message that crashes the consumer. Larger than `max_attempts`, since a
    /// crash also redelivers every message that was merely prefetched.
    pub max_deliveries: u32,
    /// Retries in process before handing the message back to the broker.
    pub in_process_retries: u32,
    /// First backoff delay.
    pub min_delay: Duration,
    /// Largest backoff delay.
    pub max_delay: Duration,
    /// Randomize delays so instances do not retry in lockstep.
    pub jitter: bool,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_attempts: 5,
            max_deliveries: 20,
            in_process_retries: 2,
            min_delay: Duration::from_millis(100),
            max_delay: Duration::from_secs(10),
            jitter: true,
        }
    }
}

impl RetryPolicy {
    /// Sets `max_attempts` (at least 1).
    pub fn with_max_attempts(mut self, n: u32) -> Self {
        self.max_attempts = n.max(1);
        self
    }

    /// Sets `max_deliveries` (at least 1).
    pub fn with_max_deliveries(mut self, n: u32) -> Self {
        self.max_deliveries = n.max(1);
        self
    }

    /// Sets `in_process_retries`.
    pub fn with_in_process_retries(mut self, n: u32) -> Self {
        self.in_process_retries = n;
        self
    }

    /// Sets the delay bounds.
    pub fn with_delays(mut self, min: Duration, max: Duration) -> Self {
        self.min_delay = min;
        self.max_delay = max.max(min);
        self
    }

    /// Sets `jitter`.
    pub fn with_jitter(mut self, jitter: bool) -> Self {
        self.jitter = jitter;
        self
    }

    /// The delays to wait between attempts: exponential from `min_delay`, capped at
    /// `max_delay`, never ending.
    pub fn delays(&self) -> impl Iterator<Item = Duration> + Send + use<> {
        let builder = ExponentialBuilder::default()
            .with_min_delay(self.min_delay)
            .with_max_delay(self.max_delay)
            .with_factor(2.0)
            .without_max_times();
        let builder = if self.jitter {
            builder.with_jitter()
        } else {
            builder
        };
        builder.build()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_grow_to_the_cap() {
        let policy = RetryPolicy::default()
            .with_delays(Duration::from_millis(10), Duration::from_millis(80))
            .with_jitter(false);
        let delays: Vec<_> = policy
            .delays()
            .take(6)
            .map(|d| d.as_secs_f64() * 1000.0)
            .collect();
        // backon computes in floating point: allow a millisecond of rounding.
        for (got, want) in delays.iter().zip([10.0, 20.0, 40.0, 80.0, 80.0, 80.0]) {
            assert!((got - want).abs() <= 1.0, "{delays:?}");
        }
    }
}
