//! NATS JetStream as a conformance-suite broker: the server of `NATS_URL`.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use inbox::memory::Faults;
use inbox::nats::testing::Inspect as _;
use inbox::nats::{NatsConfig, NatsTransport};
use inbox::{ConsumerName, OutgoingMessage, Transport};

use crate::{BrokerFactory, TestBroker, services};

/// A transport per scenario (subjects are unique per scenario, so their streams do not meet).
/// Streams and consumers of a scenario are removed by the server 10 minutes after their last use.
pub struct Nats {
    /// The transport's settings.
    pub config: NatsConfig,
}

impl Nats {
    /// On `NATS_URL`, with a short ack wait (a killed instance's messages come back within
    /// seconds), scenario streams that empty themselves, and no `Nats-Msg-Id` deduplication:
    /// every copy a scenario publishes reaches the consumers, for the inbox to discard.
    pub fn new() -> Self {
        Self {
            config: NatsConfig::default()
                .deduplicate(false)
                .ack_wait(Duration::from_secs(5))
                .max_age(Some(Duration::from_secs(600)))
                .inactive_threshold(Some(Duration::from_secs(600))),
        }
    }

    /// A transport connected to `NATS_URL`.
    pub async fn start_nats(&self) -> NatsTestBroker {
        let transport = NatsTransport::connect(services::nats_url(), self.config.clone())
            .await
            .expect("connect to NATS at NATS_URL (scripts/test starts it; see the README)");
        NatsTestBroker {
            transport: Arc::new(transport),
        }
    }
}

impl Default for Nats {
    fn default() -> Self {
        Self::new()
    }
}

/// One scenario's NATS transport.
pub struct NatsTestBroker {
    /// The transport, for inspection.
    pub transport: Arc<NatsTransport>,
}

#[async_trait]
impl TestBroker for NatsTestBroker {
    fn transport(&self) -> Arc<dyn Transport> {
        self.transport.clone()
    }
    async fn prepare(&self, source: &str, consumers: &[&ConsumerName]) {
        crate::declare_consumers(&*self.transport, source, consumers).await;
    }
    async fn settled(&self, source: &str, consumers: &[&ConsumerName]) -> Result<(), String> {
        crate::settled_by_pending(
            consumers,
            self.transport.unsettled(),
            |consumer| async move { self.transport.pending(source, &consumer).await },
        )
        .await
    }
    fn connections_opened(&self) -> usize {
        self.transport.connections_opened()
    }
    async fn published(&self, destination: &str) -> Vec<OutgoingMessage> {
        self.transport
            .messages(destination)
            .await
            .unwrap_or_else(|e| panic!("read {destination}: {e}"))
    }
}

#[async_trait]
impl BrokerFactory for Nats {
    fn name(&self) -> &'static str {
        "nats"
    }
    fn injects_faults(&self) -> bool {
        false
    }
    async fn start(&self, _faults: Faults) -> Box<dyn TestBroker> {
        Box::new(self.start_nats().await)
    }
}
