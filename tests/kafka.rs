//! The conformance suite on a Kafka-API broker (`KAFKA_BROKERS`; tansu in `scripts/test`) with
//! PostgreSQL.
#![cfg(feature = "kafka")]

mod conformance;

use conformance::kafka::Kafka;

conformance_suite!(kafka_postgres, Kafka { ordered: true }, async {
    conformance::stores::Postgres
});
// Partitions' records handled concurrently: offsets must still be stored only contiguously.
conformance_suite!(kafka_unordered_postgres, Kafka { ordered: false }, async {
    conformance::stores::Postgres
});
// Batch mode: a poll's records claimed in one statement; offsets stored after one commit.
conformance_suite!(
    kafka_postgres_batched,
    Kafka { ordered: true },
    async { conformance::stores::Postgres },
    batched = true
);

/// Records produced by PyPI's `confluent-kafka` (not our code) with duplicate `message-id`
/// headers are handled exactly once by the demo's consumers, running as a separate process that
/// drains on SIGTERM.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_clients_records_are_handled_once_by_the_demo() {
    use conformance::demo::DemoConsumer;
    use conformance::eventually;
    use inbox::kafka::{KafkaConfig, KafkaTransport};

    let brokers = conformance::services::kafka_brokers();
    let transport = KafkaTransport::new(KafkaConfig::new(brokers.clone())).unwrap();
    let source = format!("parcels-{}", uuid::Uuid::new_v4().simple());
    transport.create_topics(&[&source]).await.unwrap();
    let demo = DemoConsumer::start("kafka", &source, &[("KAFKA_BROKERS", brokers.clone())]).await;

    let (events, duplicated) = (30, 10);
    let producer = r#"
import json, sys, uuid
from confluent_kafka import Producer
brokers, topic, events, duplicated = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
producer = Producer({"bootstrap.servers": brokers})
for n in range(events):
    payload = json.dumps({"parcel_id": str(uuid.uuid4()), "tracking_number": f"TRK-PY-{n}", "destination": "Oslo"})
    for _ in range(2 if n < duplicated else 1):
        producer.produce(topic, payload.encode(), key=str(n).encode(), headers=[("message-id", f"py-{topic}-{n}".encode())])
left = producer.flush(30)
sys.exit(1 if left else 0)
"#;
    let produced = tokio::process::Command::new("python3")
        .args([
            "-c",
            producer,
            &brokers,
            &source,
            &events.to_string(),
            &duplicated.to_string(),
        ])
        .output()
        .await
        .expect("python3 runs");
    assert!(
        produced.status.success(),
        "confluent-kafka producer (scripts/test installs it): {}",
        String::from_utf8_lossy(&produced.stderr)
    );

    demo.wait_for_effects(events).await;
    eventually("every record committed by both groups", || async {
        let mut lag = 0;
        for group in ["notification", "carrier-assignment"] {
            lag += transport
                .consumer_lag(&source, group)
                .await
                .map_err(|e| e.to_string())?;
        }
        if lag == 0 {
            Ok(())
        } else {
            Err(format!("lag {lag}"))
        }
    })
    .await;
    let database = demo.database.clone();
    let stderr = demo.stop().await;
    println!("{stderr}");
    DemoConsumer::assert_exactly_once(&database, &stderr, events as u64, duplicated as u64).await;
}
