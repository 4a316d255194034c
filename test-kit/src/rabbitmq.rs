//! RabbitMQ as a conformance-suite broker: the server of `AMQP_URL`.

use std::sync::Arc;

use async_trait::async_trait;
use inbox::memory::Faults;
use inbox::rabbitmq::testing::Inspect as _;
use inbox::rabbitmq::{QueueType, RabbitMqConfig, RabbitMqTransport, queue_name};
use inbox::{ConsumerName, OutgoingMessage, Transport};

use crate::{BrokerFactory, TestBroker, services};

/// A transport per scenario (names are unique per scenario, so they do not meet).
pub struct RabbitMq {
    /// The transport's settings.
    pub config: RabbitMqConfig,
    /// Another URL than `AMQP_URL` (a vhost of its own).
    pub url: Option<String>,
}

impl RabbitMq {
    /// Classic or quorum queues on `AMQP_URL`. Scenario queues expire 10 minutes after their
    /// last use, so test runs leave nothing behind.
    pub fn new(queue_type: QueueType) -> Self {
        Self {
            config: RabbitMqConfig::default()
                .queue_type(queue_type)
                .queue_expires(std::time::Duration::from_secs(600)),
            url: None,
        }
    }
}

/// One scenario's RabbitMQ transport.
pub struct RabbitTestBroker {
    /// The transport, for inspection.
    pub transport: Arc<RabbitMqTransport>,
}

#[async_trait]
impl TestBroker for RabbitTestBroker {
    fn transport(&self) -> Arc<dyn Transport> {
        self.transport.clone()
    }
    async fn prepare(&self, source: &str, consumers: &[&ConsumerName]) {
        for consumer in consumers {
            self.transport
                .declare_consumer_queue(source, consumer.as_str())
                .await
                .expect("declare the consumer queue");
        }
    }
    async fn settled(&self, source: &str, consumers: &[&ConsumerName]) -> Result<(), String> {
        let mut left = Vec::new();
        for consumer in consumers {
            let ready = self
                .transport
                .ready(source, consumer.as_str())
                .await
                .map_err(|e| e.to_string())?;
            if ready > 0 {
                left.push(format!(
                    "{}: {ready} ready",
                    queue_name(source, consumer.as_str())
                ));
            }
        }
        match self.transport.unsettled() {
            0 => {}
            n => left.push(format!("{n} deliveries unacked")),
        }
        if left.is_empty() {
            Ok(())
        } else {
            Err(left.join("; "))
        }
    }
    fn connections_opened(&self) -> usize {
        self.transport.connections_opened()
    }
    async fn published(&self, destination: &str) -> Vec<OutgoingMessage> {
        // Dead-letter destinations have a queue of their own name: read it, leaving the letters
        // there for a replay. A queue not declared yet (no consumer subscribed so far) holds
        // nothing.
        match self.transport.peek_messages(destination, 10_000).await {
            Ok(letters) => letters,
            Err(inbox::TransportError::Refused(_)) => Vec::new(),
            Err(e) => panic!("read {destination}: {e}"),
        }
    }
}

#[async_trait]
impl BrokerFactory for RabbitMq {
    fn name(&self) -> &'static str {
        "rabbitmq"
    }
    fn injects_faults(&self) -> bool {
        false
    }
    async fn start(&self, _faults: Faults) -> Box<dyn TestBroker> {
        Box::new(self.start_rabbit().await)
    }
}

impl RabbitMq {
    /// A transport connected to `AMQP_URL` (or [`url`](Self::url)).
    pub async fn start_rabbit(&self) -> RabbitTestBroker {
        let url = self.url.clone().unwrap_or_else(services::amqp_url);
        let transport = RabbitMqTransport::connect(url, self.config.clone())
            .await
            .expect("connect to RabbitMQ at AMQP_URL (scripts/test starts it; see the README)");
        RabbitTestBroker {
            transport: Arc::new(transport),
        }
    }
}
