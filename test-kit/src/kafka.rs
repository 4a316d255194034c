//! Kafka as a conformance-suite broker: the cluster of `KAFKA_BROKERS`.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use inbox::kafka::testing::Inspect as _;
use inbox::kafka::{KafkaConfig, KafkaTransport};
use inbox::memory::Faults;
use inbox::{ConsumerName, OutgoingMessage, Transport};

use crate::{BrokerFactory, TestBroker, services};

/// Produces the demo's events with PyPI's `confluent-kafka` (not our code): `events` events to
/// `topic`, the first `duplicated` of them sent twice (a producer retrying), each with its id in
/// the `message-id` header. Panics unless every record was acknowledged.
///
/// `record_batches`: each record in a batch of its own. tansu 0.6 skips the rest of a batch for a
/// consumer that resumes inside it (a committed offset, or a revoked partition's new owner,
/// mid-batch): those records are never delivered to that group, whatever the client
/// (`scripts/repro/tansu-mid-batch`). Tests that move partitions between instances need it.
pub async fn produce_with_confluent_kafka(
    brokers: &str,
    topic: &str,
    (events, duplicated): (usize, usize),
    record_batches: bool,
) {
    let producer = r#"
import json, sys, uuid
from confluent_kafka import Producer
brokers, topic, events, duplicated = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
settings = {"bootstrap.servers": brokers}
if sys.argv[5] == "1":
    settings.update({"linger.ms": 0, "batch.num.messages": 1})
producer = Producer(settings)
for n in range(events):
    payload = json.dumps({"parcel_id": str(uuid.uuid4()), "tracking_number": f"TRK-PY-{n}", "destination": "Oslo"})
    for _ in range(2 if n < duplicated else 1):
        producer.produce(topic, payload.encode(), key=str(n).encode(), headers=[("message-id", f"py-{topic}-{n}".encode())])
        producer.poll(0)
left = producer.flush(30)
sys.exit(1 if left else 0)
"#;
    crate::python(
        "confluent-kafka producer",
        producer,
        &[
            brokers,
            topic,
            &events.to_string(),
            &duplicated.to_string(),
            if record_batches { "1" } else { "0" },
        ],
    )
    .await;
}

/// A transport per scenario (topics and groups are unique per scenario); `ordered: false` handles
/// records concurrently whatever their partition.
pub struct Kafka {
    /// Records of a partition one at a time, in offset order (the transport's default).
    pub ordered: bool,
}

/// One scenario's Kafka transport.
pub struct KafkaTestBroker {
    /// The transport, for inspection.
    pub transport: Arc<KafkaTransport>,
}

impl Kafka {
    /// A transport on `KAFKA_BROKERS` with a short commit interval and session.
    pub fn start_kafka(&self) -> KafkaTestBroker {
        let config = KafkaConfig::new(services::kafka_brokers())
            .commit_interval(Duration::from_millis(100))
            .session_timeout(Duration::from_secs(6))
            .ordered(self.ordered);
        KafkaTestBroker {
            transport: Arc::new(
                KafkaTransport::new(config).expect("a Kafka client for KAFKA_BROKERS"),
            ),
        }
    }
}

#[async_trait]
impl TestBroker for KafkaTestBroker {
    fn transport(&self) -> Arc<dyn Transport> {
        self.transport.clone()
    }
    async fn prepare(&self, source: &str, _consumers: &[&ConsumerName]) {
        self.transport
            .create_topics(&[source])
            .await
            .expect("create the topic");
    }
    async fn settled(&self, source: &str, consumers: &[&ConsumerName]) -> Result<(), String> {
        let mut left = Vec::new();
        let groups: Vec<&str> = consumers.iter().map(|c| c.as_str()).collect();
        match lag(&self.transport, source, &groups).await? {
            0 => {}
            n => left.push(format!("{n} records not committed by {groups:?}")),
        }
        match self.transport.unsettled() {
            0 => {}
            n => left.push(format!("{n} deliveries unsettled")),
        }
        if left.is_empty() {
            Ok(())
        } else {
            Err(left.join("; "))
        }
    }
    async fn published(&self, destination: &str) -> Vec<OutgoingMessage> {
        self.transport
            .read_topic(destination)
            .await
            .unwrap_or_default()
    }
}

#[async_trait]
impl BrokerFactory for Kafka {
    fn name(&self) -> &'static str {
        "kafka"
    }
    fn injects_faults(&self) -> bool {
        false
    }
    async fn start(&self, _faults: Faults) -> Box<dyn TestBroker> {
        Box::new(self.start_kafka())
    }
}

/// Records of `source` not yet committed by these consumer groups, summed: what every Kafka
/// test waits to see reach 0.
pub async fn lag(transport: &KafkaTransport, source: &str, groups: &[&str]) -> Result<i64, String> {
    let mut lag = 0;
    for group in groups {
        lag += transport
            .consumer_lag(source, group)
            .await
            .map_err(|e| format!("lag of {group} on {source}: {e}"))?;
    }
    Ok(lag)
}
