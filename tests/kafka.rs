//! The conformance suite on a Kafka-API broker (`KAFKA_BROKERS`; tansu in `scripts/test`) with
//! PostgreSQL.

use inbox_test_kit::{self as conformance, conformance_suite};

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
// Batch mode with a batch handler: each batch handled in one call, failures isolated by
// splitting the batch.
conformance_suite!(
    kafka_postgres_whole_batches,
    Kafka { ordered: true },
    async { conformance::stores::Postgres },
    whole_batches
);

/// Each partition's records handled in publish order: per message, in batches (split by
/// partition into lanes, several batches in flight) and with a batch handler.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_key_is_handled_in_order_in_every_mode() {
    conformance::init_tracing();
    let db = std::sync::Arc::new(conformance::stores::Postgres);
    for (batched, whole) in [(false, false), (true, false), (true, true)] {
        conformance::BATCHED
            .scope(
                batched,
                conformance::WHOLE_BATCHES.scope(
                    whole,
                    conformance::an_ordered_transport_keeps_each_key_in_order(
                        &Kafka { ordered: true },
                        &db,
                    ),
                ),
            )
            .await;
    }
}

conformance::outbox_suite!(outbox_kafka_postgres, Kafka { ordered: true }, async {
    conformance::stores::Postgres
});
conformance::outbox_suite!(outbox_kafka_sqlite, Kafka { ordered: true }, async {
    conformance::stores::Sqlite
});

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

    let (events, duplicated) = (30usize, 10usize);
    conformance::kafka::produce_with_confluent_kafka(
        &brokers,
        &source,
        (events, duplicated),
        false,
    )
    .await;
    demo.wait_for_effects(events as i64).await;
    eventually("every record committed by both groups", || async {
        let lag =
            conformance::kafka::lag(&transport, &source, &["notification", "carrier-assignment"])
                .await?;
        if lag == 0 {
            Ok(())
        } else {
            Err(format!("lag {lag}"))
        }
    })
    .await;
    demo.stop_exactly_once(events as u64, duplicated as u64)
        .await;
}

/// Hostile input produced by confluent-kafka to the demo's consumers running as a separate
/// process: every bad id and payload is dead-lettered once per consumer with its reason, the
/// valid ones are handled once, and the process drains on SIGTERM with exit 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_input_from_another_client() {
    use conformance::demo::DemoConsumer;
    use conformance::hostile;
    use inbox::kafka::{KafkaConfig, KafkaTransport};

    let brokers = conformance::services::kafka_brokers();
    let transport = KafkaTransport::new(KafkaConfig::new(brokers.clone())).unwrap();
    let source = format!("hostile-{}", uuid::Uuid::new_v4().simple());
    let run = uuid::Uuid::new_v4().simple().to_string()[..8].to_owned();
    transport.create_topics(&[&source]).await.unwrap();
    let demo = DemoConsumer::start("kafka", &source, &[("KAFKA_BROKERS", brokers.clone())]).await;
    hostile::publish_all("kafka", &brokers, &source, &run).await;
    let dead_letter = inbox::dead_letter::default_destination(&source);
    hostile::assert_settled(&demo, &run, || async {
        transport.read_topic(&dead_letter).await.unwrap_or_default()
    })
    .await;
    demo.stop().await;
}
