//! The transport's configuration: [`KafkaConfig`], its secret-hiding `Debug`, and the client
//! settings every client of the transport starts from.

use std::fmt;
use std::time::Duration;

use rdkafka::config::ClientConfig;

/// How the transport connects and what it creates. Its `Debug` hides the values of `extra`
/// settings whose names suggest a secret (`sasl.password`, `ssl.key.password`, …).
#[derive(Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct KafkaConfig {
    /// `bootstrap.servers`.
    pub brokers: String,
    /// Partitions of the topics this transport creates (sources and dead-letter topics).
    pub partitions: i32,
    /// Replication factor of the topics this transport creates.
    pub replication: i32,
    /// How often stored offsets are committed (`auto.commit.interval.ms`).
    pub commit_interval: Duration,
    /// The consumers' `session.timeout.ms`: how long a vanished instance keeps its partitions.
    /// `None`: librdkafka's default (45 s).
    pub session_timeout: Option<Duration>,
    /// Handle each partition's records one after another, in order (default). Off: records are
    /// handled concurrently whatever their partition; offsets are still stored contiguously.
    pub ordered: bool,
    /// Rejoin the group when this consumer sits idle beside a partition whose backlog nobody
    /// reads (off by default; see [`orphan_guard`](Self::orphan_guard)).
    pub orphan_guard: bool,
    /// Extra client settings, applied last (for example `security.protocol`).
    pub extra: Vec<(String, String)>,
}

impl fmt::Debug for KafkaConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let extra: Vec<(&str, &str)> = self
            .extra
            .iter()
            .map(|(key, value)| {
                let secret = ["password", "secret", "key", "token", "jaas"]
                    .iter()
                    .any(|word| key.to_ascii_lowercase().contains(word));
                (key.as_str(), if secret { "***" } else { value.as_str() })
            })
            .collect();
        f.debug_struct("KafkaConfig")
            .field("brokers", &self.brokers)
            .field("partitions", &self.partitions)
            .field("replication", &self.replication)
            .field("commit_interval", &self.commit_interval)
            .field("session_timeout", &self.session_timeout)
            .field("ordered", &self.ordered)
            .field("orphan_guard", &self.orphan_guard)
            .field("extra", &extra)
            .finish()
    }
}

impl KafkaConfig {
    /// Defaults for `brokers`: 3 partitions, replication 1, commits every second.
    pub fn new(brokers: impl Into<String>) -> Self {
        Self {
            brokers: brokers.into(),
            partitions: 3,
            replication: 1,
            commit_interval: Duration::from_secs(1),
            session_timeout: None,
            ordered: true,
            orphan_guard: false,
            extra: Vec::new(),
        }
    }

    /// Sets the partitions of created topics.
    pub fn partitions(mut self, n: i32) -> Self {
        self.partitions = n.max(1);
        self
    }

    /// Sets the commit interval.
    pub fn commit_interval(mut self, every: Duration) -> Self {
        self.commit_interval = every;
        self
    }

    /// Sets `ordered`.
    pub fn ordered(mut self, ordered: bool) -> Self {
        self.ordered = ordered;
        self
    }

    /// Turns on the orphaned-partition guard, for brokers whose group coordinator can settle an
    /// assignment that gives partitions to members already gone (tansu 0.6 does, after a crash
    /// loop; Apache Kafka does not): every session timeout (at least 5 s) a consumer with nothing
    /// in flight looks at the partitions of its topic that are not its own, and when one has
    /// records after its committed offset and that offset stood still for two checks after the
    /// first, it rejoins the group with a fresh client.
    ///
    /// Off by default because on a healthy group the same signs have other causes: an owner
    /// whose head record is slow or retried in place commits nothing meanwhile, and a
    /// transactional producer's commit marker leaves a quiet partition's committed offset one
    /// short of its end. Each firing is a rebalance of the whole group; after one, the group's
    /// next firing needs twice as many checks (up to 32), until this instance receives a record.
    /// Its cost: per check, one metadata, one committed-offsets and two watermark requests per
    /// partition not assigned to this consumer.
    pub fn orphan_guard(mut self, on: bool) -> Self {
        self.orphan_guard = on;
        self
    }

    /// Sets the consumers' session timeout.
    pub fn session_timeout(mut self, timeout: Duration) -> Self {
        self.session_timeout = Some(timeout);
        self
    }

    /// Adds a client setting.
    pub fn set(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.extra.push((key.into(), value.into()));
        self
    }

    pub(crate) fn client(&self) -> ClientConfig {
        let mut config = ClientConfig::new();
        config.set("bootstrap.servers", &self.brokers);
        for (key, value) in &self.extra {
            config.set(key, value);
        }
        config
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_in_extra_settings_are_not_printed() {
        let config = KafkaConfig::new("broker:9092")
            .set("security.protocol", "SASL_SSL")
            .set("sasl.password", "hunter2")
            .set("ssl.key.password", "s3cret");
        let printed = format!("{config:?}");
        assert!(
            !printed.contains("hunter2") && !printed.contains("s3cret"),
            "{printed}"
        );
        assert!(printed.contains("SASL_SSL"), "{printed}");
    }
}
