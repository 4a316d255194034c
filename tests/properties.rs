//! Property tests: random fault schedules on the in-memory broker and in the store, and handlers
//! that misbehave. Whatever the schedule, on SQLite and on PostgreSQL, every message's effect is
//! committed exactly once per consumer, and nothing is acked before the inbox holds its outcome.

use inbox_test_kit as conformance;

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use conformance::flaky::FlakyStore;
use conformance::memory::Existing;
use conformance::stores::{Postgres, Sqlite};
use conformance::{Running, Scenario, Script, TestDb};
use inbox::memory::{AckObserver, Faults, MemoryBroker};
use inbox::{Consumer, ConsumerName, RetryPolicy};
use proptest::prelude::*;

/// Checks, at every ack, that the acked message's inbox row is committed as processed or dead.
struct CommittedBeforeAck<D: TestDb> {
    db: Arc<D>,
    store: D::Store,
    consumer: ConsumerName,
    violations: Mutex<Vec<String>>,
    acks: Mutex<u64>,
}

#[async_trait]
impl<D: TestDb> AckObserver for CommittedBeforeAck<D> {
    async fn before_ack(&self, _topic: &str, _group: &str, message_id: Option<&str>) {
        *self.acks.lock().unwrap() += 1;
        let Some(id) = message_id else { return };
        let row = self.db.row(&self.store, &self.consumer, id).await;
        if !matches!(&row, Some(r) if r.processed || r.dead) {
            self.violations
                .lock()
                .unwrap()
                .push(format!("{id} acked while its row is {row:?}"));
        }
    }
}

#[derive(Debug, Clone)]
struct Schedule {
    seed: u64,
    duplicate_publish: f64,
    lose_ack: f64,
    concurrent_copy: f64,
    reorder: f64,
    /// Probability that a store call fails transiently (a commit: half applied, reply lost).
    store_fault: f64,
    messages: usize,
    instances: usize,
    fail_first: u32,
    /// Each message's first call: 0 behaves, 1 swallows a failed statement's error, 2 fails after
    /// writing its effect, 3 panics. Drawn per message from the seed.
    misbehave: f64,
    batched: bool,
}

prop_compose! {
    fn schedules()(
        seed in any::<u64>(),
        duplicate_publish in 0.0..0.6f64,
        lose_ack in 0.0..0.6f64,
        concurrent_copy in 0.0..0.6f64,
        reorder in 0.0..1.0f64,
        store_fault in 0.0..0.15f64,
        messages in 1usize..40,
        instances in 1usize..4,
        fail_first in 0u32..2,
        misbehave in 0.0..0.5f64,
        batched in any::<bool>(),
    ) -> Schedule {
        Schedule {
            seed, duplicate_publish, lose_ack, concurrent_copy, reorder, store_fault, messages,
            instances, fail_first, misbehave, batched,
        }
    }
}

async fn run<D: TestDb>(db: D, schedule: Schedule) {
    let faults = Faults::seeded(schedule.seed)
        .duplicate_publish(schedule.duplicate_publish)
        .lose_ack(schedule.lose_ack)
        .concurrent_copy(schedule.concurrent_copy)
        .reorder(schedule.reorder);
    let broker = MemoryBroker::with_faults(faults);
    let db = Arc::new(db);
    let s = Scenario::new(
        &Existing(Mutex::new(Some(broker.clone()))),
        &db,
        Faults::none(),
    )
    .await;
    let name = s.name("prop");
    let observer = Arc::new(CommittedBeforeAck {
        db: Arc::clone(&db),
        store: s.store.clone(),
        consumer: name.clone(),
        violations: Mutex::default(),
        acks: Mutex::default(),
    });
    broker.set_ack_observer(observer.clone());
    s.broker.prepare(&s.source, &[&name]).await;
    let ids: Vec<String> = (0..schedule.messages).map(|i| s.id(i)).collect();
    for (i, id) in ids.iter().enumerate() {
        s.publish(id, i).await;
    }
    // Misbehaving first calls, picked from the seed.
    let (mut swallow, mut fail_after_write, mut panic) =
        (HashSet::new(), HashSet::new(), HashSet::new());
    let mut state = schedule.seed ^ 0x5eed;
    for id in &ids {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let draw = (state >> 11) as f64 / (1u64 << 53) as f64;
        if draw < schedule.misbehave {
            match state % 3 {
                0 => swallow.insert(id.clone()),
                1 => fail_after_write.insert(id.clone()),
                _ => panic.insert(id.clone()),
            };
        }
    }
    let script = Arc::new(Script {
        fail_first: schedule.fail_first,
        swallow_once: swallow,
        fail_after_write_once: fail_after_write,
        panic_once: panic,
        ..Script::default()
    });
    let store = FlakyStore::seeded(s.store.clone(), schedule.seed, schedule.store_fault);
    let consumer = Consumer::new(
        name.clone(),
        s.source.clone(),
        s.broker.transport(),
        store,
        s.handler(&script),
    )
    .concurrency(4)
    // Enough attempts for the scripted failures plus the store's: this property is about
    // exactly once, not about the attempt limit.
    .retry(
        RetryPolicy::default()
            .with_max_attempts(50)
            .with_in_process_retries(1)
            .with_delays(Duration::from_millis(1), Duration::from_millis(20)),
    )
    .reconnect_backoff(
        RetryPolicy::default().with_delays(Duration::from_millis(1), Duration::from_millis(20)),
    );
    let consumer = if schedule.batched {
        consumer.batch(inbox::Batching::new(8, Duration::from_millis(2)))
    } else {
        consumer
    };
    let running = Running::start(&consumer, schedule.instances);
    s.wait_for(&[&name], ids.len()).await;
    running.stop().await;
    s.assert_exactly_once(&[&name], &ids).await;
    let violations = observer.violations.lock().unwrap().clone();
    assert!(violations.is_empty(), "acked before commit: {violations:?}");
    assert!(*observer.acks.lock().unwrap() >= ids.len() as u64);
    assert_eq!(
        consumer.report().dead_lettered,
        0,
        "{:?}",
        consumer.report()
    );
}

fn block_on(test: impl std::future::Future<Output = ()>) {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
        .block_on(test);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    #[test]
    fn sqlite_exactly_once_and_ack_after_commit_under_random_faults(schedule in schedules()) {
        block_on(run(Sqlite, schedule));
    }
}

proptest! {
    // Each case creates a database: fewer cases than on SQLite.
    #![proptest_config(ProptestConfig { cases: 16, ..ProptestConfig::default() })]

    /// PostgreSQL is where a swallowed error aborts the transaction and a COMMIT can "succeed"
    /// without committing: the ack observer watches it there too.
    #[test]
    fn postgres_exactly_once_and_ack_after_commit_under_random_faults(schedule in schedules()) {
        block_on(run(Postgres, schedule));
    }
}

/// One message as another client could send it: any id property, any bytes in the id header,
/// in `traceparent` and in the replay addressee header, any payload (often JSON-looking).
#[derive(Debug, Clone)]
struct Hostile {
    property: Option<String>,
    id_header: Option<Vec<u8>>,
    traceparent: Option<Vec<u8>>,
    replay_for: Option<Vec<u8>>,
    payload: Vec<u8>,
}

fn hostile() -> impl Strategy<Value = Hostile> {
    use proptest::collection::vec;
    use proptest::option::of;
    let payload = prop_oneof![
        vec(any::<u8>(), 0..300),
        any::<u64>().prop_map(|n| format!(r#"{{"n":{n}}}"#).into_bytes()),
        ".{0,40}".prop_map(|s| format!(r#"{{"n":1,"kind":{s:?}}}"#).into_bytes()),
        (1usize..3000).prop_map(|depth| {
            format!(
                r#"{{"n":1,"x":{}{}}}"#,
                "[".repeat(depth),
                "]".repeat(depth)
            )
            .into_bytes()
        }),
    ];
    (
        of(".{0,300}"),
        of(vec(any::<u8>(), 0..300)),
        of(vec(any::<u8>(), 0..60)),
        of(vec(any::<u8>(), 0..20)),
        payload,
    )
        .prop_map(
            |(property, id_header, traceparent, replay_for, payload)| Hostile {
                property,
                id_header,
                traceparent,
                replay_for,
                payload,
            },
        )
}

/// Whatever bytes arrive as ids, header values and payloads: the consumer never stops, every
/// delivery ends exactly one way (handled, dead-lettered, or discarded as a copy), each
/// handled id has one effect, every dead letter says why, and a good message sent after them
/// is handled. On PostgreSQL, which refuses NUL in text (the `kind` strings often carry one into
/// the decoder's error message).
async fn hostile_messages(messages: Vec<Hostile>) {
    use inbox::OutgoingMessage;
    use inbox::dead_letter::headers as dead_letter_headers;

    // PostgreSQL: the database that refuses NUL in text.
    let db = Arc::new(Postgres);
    let broker = MemoryBroker::new();
    let s = Scenario::new(
        &Existing(Mutex::new(Some(broker.clone()))),
        &db,
        Faults::none(),
    )
    .await;
    let name = s.name("fuzz");
    s.broker.prepare(&s.source, &[&name]).await;
    for m in &messages {
        let mut message = OutgoingMessage {
            message_id: m.property.clone(),
            payload: m.payload.clone().into(),
            ..OutgoingMessage::default()
        };
        for (header, value) in [
            ("message-id", &m.id_header),
            ("traceparent", &m.traceparent),
            (dead_letter_headers::REPLAY_FOR, &m.replay_for),
        ] {
            if let Some(value) = value {
                message = message.with_header(header, value.clone());
            }
        }
        s.publish_raw(message).await;
    }
    let good = s.id(0);
    s.publish(&good, 0).await;
    let script = Arc::new(Script {
        decode_json: true,
        ..Script::default()
    });
    let consumer = s.consumer(&name, &script);
    let running = Running::start(&consumer, 2);
    let total = messages.len() as u64 + 1;
    conformance::eventually("every delivery settled", || async {
        let r = consumer.report();
        let ended = r.processed + r.dead_lettered + r.duplicates_discarded;
        if ended >= total && r.deliveries == ended {
            s.broker.settled(&s.source, &[&name]).await
        } else {
            Err(format!("{r:?}"))
        }
    })
    .await;
    assert!(running.is_running(), "the consumer never stops");
    running.stop().await;
    let report = consumer.report();
    assert_eq!(
        report.processed + report.dead_lettered + report.duplicates_discarded,
        total,
        "each delivery ends one way: {report:?}"
    );
    let effects = s.effects().await;
    assert!(
        effects.values().all(|n| *n == 1),
        "one effect per id: {effects:?}"
    );
    assert_eq!(effects.len() as u64, report.processed, "{report:?}");
    assert_eq!(
        effects.get(&(name.to_string(), good)),
        Some(&1),
        "the good one"
    );
    let dead = s.broker.published(&s.dead_letter_destination()).await;
    assert_eq!(dead.len() as u64, report.dead_lettered);
    for letter in &dead {
        let reason = letter
            .headers
            .get_str(dead_letter_headers::REASON)
            .unwrap_or("");
        assert!(!reason.is_empty(), "a dead letter says why: {letter:?}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn hostile_bytes_never_stop_the_consumer(messages in proptest::collection::vec(hostile(), 1..12)) {
        block_on(hostile_messages(messages));
    }
}
