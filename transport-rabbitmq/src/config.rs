//! The configuration, and how queues are named.

use inbox_core::TransportError;

/// The queue type of consumer queues.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum QueueType {
    /// Classic queues.
    #[default]
    Classic,
    /// Quorum queues: replicated, and they count deliveries (`x-delivery-count`).
    Quorum,
}

/// How the transport names and declares things.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RabbitMqConfig {
    /// The type of the consumer queues this transport declares.
    pub queue_type: QueueType,
    /// The connection name the broker shows (management UI, `rabbitmqctl list_connections`).
    pub connection_name: String,
    /// Delete declared queues after they have been unused this long (`x-expires`); for
    /// short-lived consumers and tests. `None`: keep them.
    pub queue_expires: Option<std::time::Duration>,
    /// Quorum queues only: how often the broker may deliver a message of a consumer's queue
    /// before it moves it to the consumer's quarantine queue `<source>.<consumer>.quarantine`
    /// (`x-delivery-limit`, with that queue as its dead-letter target; default 25). The engine
    /// dead-letters a message itself once the count passes its own `max_deliveries` (20 by
    /// default: keep it below this), so the broker's limit only takes out what the engine never
    /// sees: a message lapin cannot parse (a non-UTF-8 `message_id`, say), whose every delivery
    /// kills the connection. `None`: no limit (RabbitMQ 4 then applies its default of 20 and,
    /// without a dead-letter target, drops the message).
    pub delivery_limit: Option<u32>,
    /// How long a publish may wait for the broker's confirm (default 30 s) before it fails as
    /// [`TransportError::NotConfirmed`]. A broker under a memory or disk alarm blocks publishing
    /// connections and never confirms; the dead-letter publish that waits holds its message's
    /// inbox transaction meanwhile.
    pub publish_timeout: std::time::Duration,
}

impl Default for RabbitMqConfig {
    fn default() -> Self {
        Self {
            queue_type: QueueType::Classic,
            connection_name: "inbox".to_owned(),
            queue_expires: None,
            delivery_limit: Some(25),
            publish_timeout: std::time::Duration::from_secs(30),
        }
    }
}

impl RabbitMqConfig {
    /// Sets the queue type.
    pub fn queue_type(mut self, queue_type: QueueType) -> Self {
        self.queue_type = queue_type;
        self
    }

    /// Sets the connection name.
    pub fn connection_name(mut self, name: impl Into<String>) -> Self {
        self.connection_name = name.into();
        self
    }

    /// Sets `queue_expires`.
    pub fn queue_expires(mut self, after: std::time::Duration) -> Self {
        self.queue_expires = Some(after);
        self
    }

    /// Sets `delivery_limit`.
    pub fn delivery_limit(mut self, limit: Option<u32>) -> Self {
        self.delivery_limit = limit;
        self
    }

    /// Sets `publish_timeout`.
    pub fn publish_timeout(mut self, timeout: std::time::Duration) -> Self {
        self.publish_timeout = timeout;
        self
    }
}

/// The queue a consumer reads: `<source>.<consumer>`.
pub fn queue_name(source: &str, consumer: &str) -> String {
    format!("{source}.{consumer}")
}

/// Where a quorum consumer queue's broker-side dead letters go: `<queue>.quarantine`.
pub fn quarantine_name(source: &str, consumer: &str) -> String {
    format!("{}.quarantine", queue_name(source, consumer))
}

/// Consumer names this transport can give a queue of their own. A dot would make two
/// (source, consumer) pairs share a queue — `a.b` + `c` and `a` + `b.c` both read `a.b.c`, so
/// each message would reach only one of the two consumers — and `dead-letter` would read the
/// source's dead-letter queue.
pub(crate) fn check_consumer_name(consumer: &str) -> Result<(), TransportError> {
    if consumer.contains('.') {
        return Err(TransportError::Config(format!(
            "consumer name {consumer:?} contains '.': on RabbitMQ the queue is \"<source>.<consumer>\", and a dot would let two consumers share one queue; use '-' or '_'"
        )));
    }
    if consumer == "dead-letter" || consumer == "quarantine" {
        return Err(TransportError::Config(format!(
            "consumer name {consumer:?} is reserved: its queue would be a dead-letter or quarantine queue"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn consumer_names_that_would_share_a_queue_are_refused() {
        assert!(check_consumer_name("carrier-assignment").is_ok());
        assert!(check_consumer_name("eu.notification").is_err());
        assert!(check_consumer_name("dead-letter").is_err());
    }
}
