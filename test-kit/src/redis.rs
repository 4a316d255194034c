//! Redis Streams as a conformance-suite broker: the server of `REDIS_URL`.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use inbox::memory::Faults;
use inbox::redis::testing::Inspect as _;
use inbox::redis::{RedisConfig, RedisTransport};
use inbox::{ConsumerName, OutgoingMessage, Transport};

use crate::{BrokerFactory, TestBroker, services};

/// A transport per scenario (stream keys are unique per scenario).
pub struct Redis {
    /// The transport's settings.
    pub config: RedisConfig,
}

impl Redis {
    /// On `REDIS_URL`, with a short visibility timeout (a killed instance's entries come back
    /// within seconds) and frequent claims.
    pub fn new() -> Self {
        Self {
            config: RedisConfig::default()
                .visibility_timeout(Duration::from_secs(3))
                .claim_interval(Duration::from_millis(200))
                .block(Duration::from_millis(500)),
        }
    }

    /// A transport connected to `REDIS_URL`.
    pub async fn start_redis(&self) -> RedisTestBroker {
        let transport = RedisTransport::connect(services::redis_url(), self.config.clone())
            .await
            .expect("connect to Redis at REDIS_URL (scripts/test starts it; see the README)");
        RedisTestBroker {
            transport: Arc::new(transport),
        }
    }
}

impl Default for Redis {
    fn default() -> Self {
        Self::new()
    }
}

/// One scenario's Redis transport.
pub struct RedisTestBroker {
    /// The transport, for inspection.
    pub transport: Arc<RedisTransport>,
}

#[async_trait]
impl TestBroker for RedisTestBroker {
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
    async fn published(&self, destination: &str) -> Vec<OutgoingMessage> {
        self.transport
            .messages(destination)
            .await
            .unwrap_or_else(|e| panic!("read {destination}: {e}"))
    }
}

#[async_trait]
impl BrokerFactory for Redis {
    fn name(&self) -> &'static str {
        "redis"
    }
    fn injects_faults(&self) -> bool {
        false
    }
    async fn start(&self, _faults: Faults) -> Box<dyn TestBroker> {
        Box::new(self.start_redis().await)
    }
}
