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

// Offsets mode with ids (`Dedup::OffsetsAndIds`): every scenario, producer duplicates too.
conformance_suite!(
    kafka_postgres_offsets_and_ids,
    Kafka { ordered: true },
    async { conformance::stores::Postgres },
    dedup = OffsetsAndIds
);
// Offsets mode alone: each partition's next offset in `inbox_offsets`, no row per message; the
// scenarios without producer duplicates, per message, in batches and with a batch handler on
// PostgreSQL, and per message on MariaDB and SQLite.
conformance::offsets_suite!(kafka_postgres_offsets, Kafka { ordered: true }, async {
    conformance::stores::Postgres
});
conformance::offsets_suite!(
    kafka_postgres_offsets_batched,
    Kafka { ordered: true },
    async { conformance::stores::Postgres },
    batched = true,
    whole = false
);
conformance::offsets_suite!(
    kafka_postgres_offsets_whole_batches,
    Kafka { ordered: true },
    async { conformance::stores::Postgres },
    batched = true,
    whole = true
);
conformance::offsets_suite!(kafka_mysql_offsets, Kafka { ordered: true }, async {
    conformance::stores::MySql
});
conformance::offsets_suite!(kafka_sqlite_offsets, Kafka { ordered: true }, async {
    conformance::stores::Sqlite
});

/// A scenario on PostgreSQL whose source has one partition (its offsets are the publish order),
/// with ten messages published; their ids.
async fn one_partition_of_ten() -> (
    conformance::Scenario<conformance::stores::Postgres>,
    Vec<String>,
) {
    use inbox::kafka::{KafkaConfig, KafkaTransport};

    conformance::init_tracing();
    let db = std::sync::Arc::new(conformance::stores::Postgres);
    let s =
        conformance::Scenario::new(&Kafka { ordered: true }, &db, inbox::memory::Faults::none())
            .await;
    let one =
        KafkaTransport::new(KafkaConfig::new(conformance::services::kafka_brokers()).partitions(1))
            .unwrap();
    one.create_topics(&[&s.source]).await.unwrap();
    let ids: Vec<String> = (0..10).map(|i| s.id(i)).collect();
    for (i, id) in ids.iter().enumerate() {
        s.publish(id, i).await;
    }
    (s, ids)
}

/// Sets the offset kept for partition 0 of the scenario's source, as a consumer's commit would.
async fn keep_offset(
    s: &conformance::Scenario<conformance::stores::Postgres>,
    name: &inbox::ConsumerName,
    next: i64,
) {
    use inbox::InboxStore;

    let mut tx = s.store.begin().await.unwrap();
    s.store
        .claim_offsets(&mut tx, name, &s.source, 0, (0, 0))
        .await
        .unwrap();
    s.store
        .set_next_offset(&mut tx, name, &s.source, 0, next)
        .await
        .unwrap();
    s.store.commit(tx).await.unwrap();
}

/// Offsets mode: a kept offset past the partition's end belongs to another log (the topic was
/// deleted and created again under its name): starting there would take every record before it
/// for a copy and lose it unread. The consumer stops with an error that names the rows to
/// delete, having handled nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kept_offset_past_the_partitions_end_stops_the_consumer() {
    use inbox::{CancellationToken, ConsumerError, Dedup, TransportError};
    use std::sync::Arc;
    use std::time::Duration;

    let (s, _) = one_partition_of_ten().await;
    let name = s.name("recreated");
    keep_offset(&s, &name, 1_000).await;
    let script = Arc::new(conformance::Script::default());
    let consumer = conformance::DEDUP
        .scope(Dedup::Offsets, async { s.consumer(&name, &script) })
        .await;
    let ended = tokio::time::timeout(
        Duration::from_secs(60),
        consumer.run(CancellationToken::new()),
    )
    .await
    .expect("the consumer stops by itself");
    match ended {
        Err(ConsumerError::Transport(TransportError::Config(reason))) => assert!(
            reason.contains("past the partition's end") && reason.contains("inbox_offsets"),
            "{reason}"
        ),
        other => panic!("the consumer should stop with a configuration error: {other:?}"),
    }
    assert!(s.effects().await.is_empty(), "nothing is handled");
    assert_eq!(consumer.report().deliveries, 0);
}

/// Offsets mode: a partition starts where the database says, not where the broker's committed
/// offset is — past records the database has (committed before a crash kept the broker from
/// hearing of them: skipped unread), and back to records it lacks (a database restored from a
/// backup: handled again). The broker learns the position, so its lag is right.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kept_offset_decides_where_a_partition_starts() {
    use inbox::{Dedup, InboxStore};
    use std::sync::Arc;

    let (s, ids) = one_partition_of_ten().await;
    let name = s.name("kept");
    let keep = |next: i64| keep_offset(&s, &name, next);
    // Records 0..=3 handled and committed to the database, the broker not told.
    keep(4).await;
    let script = Arc::new(conformance::Script::default());
    let consumer = conformance::DEDUP
        .scope(Dedup::Offsets, async { s.consumer(&name, &script) })
        .await;
    let running = conformance::Running::start(&consumer, 1);
    s.wait_for(&[&name], 6).await;
    running.stop().await;
    let effects = s.effects().await;
    for (i, id) in ids.iter().enumerate() {
        let n = effects
            .get(&(name.to_string(), id.clone()))
            .copied()
            .unwrap_or(0);
        assert_eq!(n, i64::from(i >= 4), "{id} (offset {i})");
    }
    let report = consumer.report();
    assert_eq!(
        (report.processed, report.duplicates_discarded),
        (6, 0),
        "the records before the kept offset are skipped unread: {report:?}"
    );
    assert_eq!(
        s.store.next_offset(&name, &s.source, 0).await.unwrap(),
        Some(10)
    );

    // The database restored to a backup taken after record 6: 7..=9 are handled again once a
    // record arrives (the partition's start is looked up at its first record).
    keep(7).await;
    let running = conformance::Running::start(&consumer, 1);
    let late = s.id(10);
    s.publish(&late, 10).await;
    s.wait_for(&[&name], 6 + 4).await;
    running.stop().await;
    let effects = s.effects().await;
    for (i, id) in ids.iter().chain([&late]).enumerate() {
        let n = effects
            .get(&(name.to_string(), id.clone()))
            .copied()
            .unwrap_or(0);
        let expected = match i {
            0..=3 => 0,
            4..=6 => 1,
            7..=9 => 2,
            _ => 1,
        };
        assert_eq!(n, expected, "{id} (offset {i})");
    }
    assert_eq!(
        s.store.next_offset(&name, &s.source, 0).await.unwrap(),
        Some(11)
    );
}

/// Offsets mode in batches: a record that fails goes the per-message way after its batch, and
/// shutdown comes while it waits for its next try. It is handed back, and so are the later
/// records of its partition — none is handled before it, or the kept offset would pass it. After
/// a restart every record is handled once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_handed_back_at_shutdown_holds_back_its_partition() {
    use inbox::{Dedup, HandlerError, InboxStore, RetryPolicy};
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;

    let (s, ids) = one_partition_of_ten().await;
    let name = s.name("held");
    // Record 3 fails (transiently) until the fix is deployed.
    let broken = Arc::new(AtomicBool::new(true));
    let failing = ids[3].clone();
    let script = Arc::new(conformance::Script {
        hook: Some({
            let (broken, failing) = (Arc::clone(&broken), failing.clone());
            Arc::new(move |id: String, _call| {
                let fail = id == failing && broken.load(Ordering::SeqCst);
                Box::pin(async move {
                    if fail {
                        Err(HandlerError::transient("the carrier's API is down"))
                    } else {
                        Ok(())
                    }
                })
            })
        }),
        ..conformance::Script::default()
    });
    let consumer = conformance::DEDUP
        .scope(
            Dedup::Offsets,
            conformance::BATCHED.scope(true, async { s.consumer(&name, &script) }),
        )
        .await
        .retry(
            RetryPolicy::default()
                .with_max_attempts(1000)
                .with_delays(Duration::from_secs(30), Duration::from_secs(30)),
        );
    let running = conformance::Running::start(&consumer, 1);
    conformance::eventually("record 3 tried (its next try is 30 s away)", || async {
        match script.calls(&failing) {
            n if n >= 1 => Ok(()),
            n => Err(format!("{n} calls")),
        }
    })
    .await;
    running.stop().await;
    let effects = s.effects().await;
    let handled: Vec<&String> = ids
        .iter()
        .filter(|id| effects.contains_key(&(name.to_string(), (*id).clone())))
        .collect();
    assert_eq!(
        handled,
        ids[..3].iter().collect::<Vec<_>>(),
        "handled before shutdown"
    );
    assert_eq!(
        s.store.next_offset(&name, &s.source, 0).await.unwrap(),
        Some(3),
        "the kept offset waits at the record handed back"
    );

    broken.store(false, Ordering::SeqCst);
    let running = conformance::Running::start(&consumer, 1);
    s.wait_for(&[&name], ids.len()).await;
    running.stop().await;
    s.assert_exactly_once(&[&name], &ids).await;
}

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
