//! Property tests: random fault schedules on the in-memory broker. Whatever the schedule, every
//! message's effect is committed exactly once per consumer, and nothing is acked before the inbox
//! holds its outcome.

mod conformance;

use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use conformance::memory::Existing;
use conformance::stores::Sqlite;
use conformance::{Running, Scenario, Script, TestDb};
use inbox::memory::{AckObserver, Faults, MemoryBroker};
use inbox::{ConsumerName, SqliteStore};
use proptest::prelude::*;

/// Checks, at every ack, that the acked message's inbox row is committed as processed or dead.
struct CommittedBeforeAck {
    store: SqliteStore,
    consumer: ConsumerName,
    violations: Mutex<Vec<String>>,
    acks: Mutex<u64>,
}

#[async_trait]
impl AckObserver for CommittedBeforeAck {
    async fn before_ack(&self, _topic: &str, _group: &str, message_id: Option<&str>) {
        *self.acks.lock().unwrap() += 1;
        let Some(id) = message_id else { return };
        let row = Sqlite.row(&self.store, &self.consumer, id).await;
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
    messages: usize,
    instances: usize,
    fail_first: u32,
}

prop_compose! {
    fn schedules()(
        seed in any::<u64>(),
        duplicate_publish in 0.0..0.6f64,
        lose_ack in 0.0..0.6f64,
        concurrent_copy in 0.0..0.6f64,
        reorder in 0.0..1.0f64,
        messages in 1usize..40,
        instances in 1usize..4,
        fail_first in 0u32..3,
    ) -> Schedule {
        Schedule { seed, duplicate_publish, lose_ack, concurrent_copy, reorder, messages, instances, fail_first }
    }
}

async fn run(schedule: Schedule) {
    let faults = Faults::seeded(schedule.seed)
        .duplicate_publish(schedule.duplicate_publish)
        .lose_ack(schedule.lose_ack)
        .concurrent_copy(schedule.concurrent_copy)
        .reorder(schedule.reorder);
    let broker = MemoryBroker::with_faults(faults);
    let db = Arc::new(Sqlite);
    let s = Scenario::new(
        &Existing(Mutex::new(Some(broker.clone()))),
        &db,
        Faults::none(),
    )
    .await;
    let name = s.name("prop");
    let observer = Arc::new(CommittedBeforeAck {
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
    let script = Arc::new(Script {
        fail_first: schedule.fail_first,
        ..Script::default()
    });
    let consumer = s.consumer(&name, &script);
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

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    #[test]
    fn exactly_once_and_ack_after_commit_under_random_faults(schedule in schedules()) {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap()
            .block_on(run(schedule));
    }
}
