//! The transport's settings.

use std::time::Duration;

/// What a source's stream keeps, and for how long.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Retention {
    /// Messages stay until [`NatsConfig::max_age`] (or the stream's other limits) removes them,
    /// whether consumed or not; a consumer name that appears later reads the stream from its
    /// beginning. Nothing published before a consumer declares itself is lost.
    #[default]
    Limits,
    /// A message is removed once every consumer that existed when it was published acked it
    /// (JetStream's interest retention). Messages published while no consumer exists are
    /// dropped: declare the consumers first (`Consumer::run` declares before it consumes;
    /// [`Transport::declare`](inbox_core::Transport::declare) does it alone).
    Interest,
}

/// How the transport names, creates and consumes streams.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct NatsConfig {
    /// The connection name the server shows (`nats server report connections`, monitoring).
    pub connection_name: String,
    /// How long the server waits for an ack before it delivers a message again (default 30 s).
    /// A delivery still being handled is kept alive with in-progress acks every third of this,
    /// so a long handler does not lose it; a crashed instance's messages come back after it.
    pub ack_wait: Duration,
    /// How long a handed-back message (nak) waits before the server delivers it again (default
    /// 100 ms): a failing message is retried with a short pause, not in a tight loop.
    pub redelivery_delay: Duration,
    /// How often the server delivers a message before it stops (`max_deliver`; default 25).
    /// The engine dead-letters a message itself once it passes its own `max_deliveries` (20 by
    /// default; a limit set here at or below the consumer's is raised to its `max_deliveries` + 5,
    /// with a warning), so the server's limit only stops what the engine never sees — a message the client cannot even parse (header bytes that are not UTF-8, which
    /// async-nats refuses by dropping the connection), redelivered for ever otherwise. Such a
    /// message stays in the stream; the transport logs the server's advisory with its sequence.
    /// `None`: no limit.
    pub max_deliver: Option<i64>,
    /// Unacknowledged messages the server lets one durable consumer have at once, across all
    /// its instances (`max_ack_pending`; default 10,000). Keep it above instances × prefetch.
    pub max_ack_pending: i64,
    /// What a stream this transport creates keeps.
    pub retention: Retention,
    /// Removes messages older than this from streams this transport creates (`max_age`;
    /// default `None`: kept until the other limits). Consumed or not: set it well above the
    /// longest outage a consumer may have.
    pub max_age: Option<Duration>,
    /// Removes a durable consumer that has had no instance for this long (`inactive_threshold`;
    /// default `None`: kept). For short-lived consumers and tests.
    pub inactive_threshold: Option<Duration>,
    /// Replicas of a stream this transport creates (default 1; 3 on a cluster that should
    /// survive a server's loss).
    pub replicas: usize,
    /// How long a publish, or a JetStream API call, may wait for the server's answer (default
    /// 10 s) before it fails as transient.
    pub request_timeout: Duration,
    /// Publish the message id as `Nats-Msg-Id` too (default true), so that JetStream drops a
    /// copy published again within the stream's duplicate window (2 minutes by default): a
    /// producer's retry never reaches the consumers. Off, every copy is stored and the inbox
    /// discards it at the consumer (the tests turn it off to put the inbox to work).
    pub deduplicate: bool,
}

impl Default for NatsConfig {
    fn default() -> Self {
        Self {
            connection_name: "inbox".to_owned(),
            ack_wait: Duration::from_secs(30),
            redelivery_delay: Duration::from_millis(100),
            max_deliver: Some(25),
            max_ack_pending: 10_000,
            retention: Retention::Limits,
            max_age: None,
            inactive_threshold: None,
            replicas: 1,
            request_timeout: Duration::from_secs(10),
            deduplicate: true,
        }
    }
}

impl NatsConfig {
    /// Sets the connection name.
    pub fn connection_name(mut self, name: impl Into<String>) -> Self {
        self.connection_name = name.into();
        self
    }

    /// Sets the ack wait (at least 1 s).
    pub fn ack_wait(mut self, wait: Duration) -> Self {
        self.ack_wait = wait.max(Duration::from_secs(1));
        self
    }

    /// Sets the redelivery delay of a handed-back message.
    pub fn redelivery_delay(mut self, delay: Duration) -> Self {
        self.redelivery_delay = delay;
        self
    }

    /// Sets the server's delivery limit (at least 1; `None`: none).
    pub fn max_deliver(mut self, limit: Option<i64>) -> Self {
        self.max_deliver = limit.map(|n| n.max(1));
        self
    }

    /// Sets `max_ack_pending` (at least 1).
    pub fn max_ack_pending(mut self, max: i64) -> Self {
        self.max_ack_pending = max.max(1);
        self
    }

    /// Sets the retention of the streams this transport creates.
    pub fn retention(mut self, retention: Retention) -> Self {
        self.retention = retention;
        self
    }

    /// Sets the maximum age of messages in the streams this transport creates.
    pub fn max_age(mut self, age: Option<Duration>) -> Self {
        self.max_age = age;
        self
    }

    /// Sets the inactivity after which a durable consumer is removed.
    pub fn inactive_threshold(mut self, threshold: Option<Duration>) -> Self {
        self.inactive_threshold = threshold;
        self
    }

    /// Sets the replicas of the streams this transport creates (at least 1).
    pub fn replicas(mut self, replicas: usize) -> Self {
        self.replicas = replicas.max(1);
        self
    }

    /// Sets the request timeout.
    pub fn request_timeout(mut self, timeout: Duration) -> Self {
        self.request_timeout = timeout;
        self
    }

    /// Sets whether the message id is published as `Nats-Msg-Id`.
    pub fn deduplicate(mut self, yes: bool) -> Self {
        self.deduplicate = yes;
        self
    }
}
