//! Delivery: every message has one effect per consumer, whatever the broker and the consumers'
//! lifecycle do — producer duplicates, crashes between commit and ack, kills, concurrent copies,
//! several consumers, a drain on shutdown, an instance joining mid-stream.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use inbox::memory::Faults;
use inbox::{InboxStore, Transport};

use super::faults_or_none;
use crate::{
    BrokerFactory, CrashBeforeFirstAck, Hook, Running, Scenario, Script, TestDb, eventually,
};

/// Duplicates from the producer (and, where the broker injects them, duplicate publishes, lost
/// acks, concurrent copies and reordering): every message has exactly one effect.
pub async fn exactly_once_under_duplicates<D: TestDb>(brokers: &dyn BrokerFactory, db: &Arc<D>) {
    let faults = Faults::seeded(11)
        .duplicate_publish(0.3)
        .lose_ack(0.2)
        .concurrent_copy(0.2)
        .reorder(0.3);
    let s = Scenario::new(brokers, db, faults_or_none(brokers, faults)).await;
    let name = s.name("dedup");
    s.broker.prepare(&s.source, &[&name]).await;
    let ids: Vec<String> = (0..120).map(|i| s.id(i)).collect();
    let mut producer_duplicates = 0;
    for (i, id) in ids.iter().enumerate() {
        s.publish(id, i).await;
        if i % 3 == 0 {
            s.publish(id, i).await;
            producer_duplicates += 1;
        }
    }
    let script = Arc::new(Script::default());
    let consumer = s.consumer(&name, &script);
    let running = Running::start(&consumer, 2);
    s.wait_for(&[&name], ids.len()).await;
    running.stop().await;
    s.assert_exactly_once(&[&name], &ids).await;
    let report = consumer.report();
    assert_eq!(report.processed, ids.len() as u64, "{report:?}");
    assert!(
        report.duplicates_discarded >= producer_duplicates,
        "{report:?}"
    );
    assert_eq!(report.failed, 0, "{report:?}");
}

/// The consumer "crashes" between commit and ack for every message: each comes back and is
/// discarded as a duplicate; one effect each.
pub async fn crash_before_ack_leaves_one_effect<D: TestDb>(
    brokers: &dyn BrokerFactory,
    db: &Arc<D>,
) {
    let s = Scenario::new(brokers, db, Faults::none()).await;
    let name = s.name("crash");
    s.broker.prepare(&s.source, &[&name]).await;
    let ids: Vec<String> = (0..40).map(|i| s.id(i)).collect();
    for (i, id) in ids.iter().enumerate() {
        s.publish(id, i).await;
    }
    let crashing = Arc::new(CrashBeforeFirstAck::new(s.broker.transport()));
    let script = Arc::new(Script::default());
    let consumer = s.consumer_on(crashing.clone(), &name, &script);
    let mut running = Running::start(&consumer, 1);
    if !crashing.capabilities().requeue {
        // Without requeue (Kafka) a message comes back only from the last committed offset:
        // after a restart, as after a real crash.
        eventually("every message handled once", || async {
            match consumer.report().processed {
                n if n == ids.len() as u64 => Ok(()),
                n => Err(format!("{n} processed")),
            }
        })
        .await;
        running.stop().await;
        running = Running::start(&consumer, 1);
    }
    // In offsets mode a restarted consumer starts each partition at the offset it kept: the
    // copies are skipped unread rather than discarded.
    let skipped_unread = crate::dedup() != inbox::Dedup::Ids;
    eventually(
        "every message redelivered after its commit and discarded",
        || async {
            let report = consumer.report();
            if report.duplicates_discarded < ids.len() as u64 && !skipped_unread {
                return Err(format!("{report:?}"));
            }
            s.broker.settled(&s.source, &[&name]).await
        },
    )
    .await;
    running.stop().await;
    s.assert_exactly_once(&[&name], &ids).await;
    assert_eq!(crashing.crashes.load(Ordering::SeqCst), ids.len());
    assert_eq!(consumer.report().processed, ids.len() as u64);
}

/// Consumer instances killed mid-stream (no drain) and restarted: nothing lost, nothing doubled.
pub async fn killed_and_restarted<D: TestDb>(brokers: &dyn BrokerFactory, db: &Arc<D>) {
    let s = Scenario::new(brokers, db, Faults::none()).await;
    let name = s.name("killed");
    s.broker.prepare(&s.source, &[&name]).await;
    let ids: Vec<String> = (0..150).map(|i| s.id(i)).collect();
    for (i, id) in ids.iter().enumerate() {
        s.publish(id, i).await;
    }
    let script = Arc::new(Script {
        hook: Some(Arc::new(|_, _| {
            Box::pin(async {
                tokio::task::yield_now().await;
                Ok(())
            })
        })),
        ..Script::default()
    });
    let consumer = s.consumer(&name, &script);
    for round in 1..=5 {
        let running = Running::start(&consumer, 2);
        let target = (ids.len() * round / 6) as i64;
        s.wait_for_effects(target).await;
        running.abort().await;
    }
    let running = Running::start(&consumer, 2);
    s.wait_for(&[&name], ids.len()).await;
    running.stop().await;
    s.assert_exactly_once(&[&name], &ids).await;
}

/// Several instances get copies of the same messages at the same moment: no double commit.
pub async fn concurrent_duplicates_never_commit_twice<D: TestDb>(
    brokers: &dyn BrokerFactory,
    db: &Arc<D>,
) {
    let faults = Faults::seeded(5).concurrent_copy(0.5).max_per_message(2);
    let s = Scenario::new(brokers, db, faults_or_none(brokers, faults)).await;
    let name = s.name("concurrent");
    s.broker.prepare(&s.source, &[&name]).await;
    let ids: Vec<String> = (0..60).map(|i| s.id(i)).collect();
    for (i, id) in ids.iter().enumerate() {
        for _ in 0..3 {
            s.publish(id, i).await;
        }
    }
    let script = Arc::new(Script {
        // Widen the window between claim and commit.
        hook: Some(Arc::new(|_, _| {
            Box::pin(async {
                for _ in 0..5 {
                    tokio::task::yield_now().await;
                }
                Ok(())
            })
        })),
        ..Script::default()
    });
    let consumer = s.consumer(&name, &script);
    let running = Running::start(&consumer, 4);
    s.wait_for(&[&name], ids.len()).await;
    eventually("all copies settled", || async {
        let report = consumer.report();
        if report.duplicates_discarded >= 2 * ids.len() as u64 {
            Ok(())
        } else {
            Err(format!("{report:?}"))
        }
    })
    .await;
    running.stop().await;
    s.assert_exactly_once(&[&name], &ids).await;
    let report = consumer.report();
    assert_eq!(report.processed, ids.len() as u64, "{report:?}");
    assert_eq!(
        report.failed, 0,
        "a concurrent copy waits instead of failing: {report:?}"
    );
}

/// Two consumers of one source each handle every message once, independently.
pub async fn two_consumers_each_handle_once<D: TestDb>(brokers: &dyn BrokerFactory, db: &Arc<D>) {
    let s = Scenario::new(brokers, db, Faults::none()).await;
    let (a, b) = (s.name("notification"), s.name("carrier-assignment"));
    s.broker.prepare(&s.source, &[&a, &b]).await;
    let ids: Vec<String> = (0..30).map(|i| s.id(i)).collect();
    for (i, id) in ids.iter().enumerate() {
        s.publish(id, i).await;
        s.publish(id, i).await;
    }
    let script = Arc::new(Script::default());
    let (ca, cb) = (s.consumer(&a, &script), s.consumer(&b, &script));
    let (ra, rb) = (Running::start(&ca, 1), Running::start(&cb, 1));
    s.wait_for(&[&a, &b], 2 * ids.len()).await;
    ra.stop().await;
    rb.stop().await;
    s.assert_exactly_once(&[&a, &b], &ids).await;
    assert_eq!(ca.report().processed, ids.len() as u64);
    assert_eq!(cb.report().processed, ids.len() as u64);
}

/// Shutdown: stop taking deliveries, let in-flight handlers finish and commit and ack, return.
/// A restart then handles the rest, each once.
pub async fn shutdown_drains_in_flight<D: TestDb>(brokers: &dyn BrokerFactory, db: &Arc<D>) {
    let s = Scenario::new(brokers, db, Faults::none()).await;
    let name = s.name("drain");
    s.broker.prepare(&s.source, &[&name]).await;
    let ids: Vec<String> = (0..12).map(|i| s.id(i)).collect();
    for (i, id) in ids.iter().enumerate() {
        s.publish(id, i).await;
    }
    let entered = Arc::new(AtomicUsize::new(0));
    let release = Arc::new(tokio::sync::Semaphore::new(0));
    let script = Arc::new(Script {
        hook: Some({
            let (entered, release) = (Arc::clone(&entered), Arc::clone(&release));
            Arc::new(move |_, _| {
                let (entered, release) = (Arc::clone(&entered), Arc::clone(&release));
                Box::pin(async move {
                    entered.fetch_add(1, Ordering::SeqCst);
                    release.acquire().await.unwrap().forget();
                    Ok(())
                })
            })
        }),
        ..Script::default()
    });
    let consumer = s.consumer(&name, &script).concurrency(3).prefetch(3);
    let running = Running::start(&consumer, 1);
    // A single-writer database lets one handler in at a time; the others wait in BEGIN. An
    // ordered transport queues a partition's deliveries behind the one in its handler.
    let ordered = s.broker.transport().capabilities().ordered;
    let in_handler = if D::CONCURRENT_WRITERS { 3 } else { 1 };
    // In batch mode the deliveries of a batch are counted when it commits.
    let batched = crate::batched();
    eventually("handlers in flight", || async {
        let (entered, taken) = (entered.load(Ordering::SeqCst), consumer.report().deliveries);
        let ready = if batched {
            entered >= 1
        } else if ordered {
            entered >= 1 && entered as u64 == taken
        } else {
            entered == in_handler && taken == 3
        };
        if ready {
            Ok(())
        } else {
            Err(format!(
                "{entered} in the handler, {taken} deliveries taken"
            ))
        }
    })
    .await;
    running.token().cancel();
    release.add_permits(1000);
    running.stop().await;
    let handled: i64 = s.effects().await.values().sum();
    let report = consumer.report();
    assert_eq!(
        handled as u64, report.processed,
        "what was handled was committed: {report:?}"
    );
    assert_eq!(
        report.deliveries, report.processed,
        "every delivery taken in finished; none after the stop: {report:?}"
    );
    assert_eq!(
        entered.load(Ordering::SeqCst) as u64,
        report.processed,
        "{report:?}"
    );
    if !ordered && !batched {
        assert_eq!(
            report.processed, 3,
            "exactly the in-flight messages were finished"
        );
    }

    let running = Running::start(&consumer, 1);
    s.wait_for(&[&name], ids.len()).await;
    running.stop().await;
    s.assert_exactly_once(&[&name], &ids).await;
}

/// A second instance joins while the first consumes (a rebalance on Kafka): it gets work, and
/// every message still has exactly one effect.
pub async fn an_instance_joins_mid_stream<D: TestDb>(brokers: &dyn BrokerFactory, db: &Arc<D>) {
    let s = Scenario::new(brokers, db, Faults::none()).await;
    let name = s.name("joined");
    s.broker.prepare(&s.source, &[&name]).await;
    let ids: Vec<String> = (0..600).map(|i| s.id(i)).collect();
    for (i, id) in ids.iter().enumerate() {
        s.publish(id, i).await;
    }
    // Handlers that take a while, so that the stream is not over before the join takes effect.
    let slow: Hook = Arc::new(|_, _| {
        Box::pin(async {
            tokio::time::sleep(Duration::from_millis(20)).await;
            Ok(())
        })
    });
    let script = Arc::new(Script {
        hook: Some(slow),
        ..Script::default()
    });
    let first = s.consumer(&name, &script);
    let second = s.consumer(&name, &script);
    let running_first = Running::start(&first, 1);
    s.wait_for_effects(50).await;
    let running_second = Running::start(&second, 1);
    // A join takes effect when the broker says so (on Kafka after a rebalance, seconds on a
    // loaded machine): until the second instance has work, the backlog is kept from running out,
    // so that a slow join is not mistaken for no join.
    let ids = Mutex::new(ids);
    eventually("the joining instance got work", || async {
        if second.report().processed > 0 {
            return Ok(());
        }
        let effects: i64 = s.effects().await.values().sum();
        let published = ids.lock().unwrap().len();
        if effects as usize + 100 >= published {
            for i in published..published + 100 {
                let id = s.id(i);
                s.publish(&id, i).await;
                ids.lock().unwrap().push(id);
            }
        }
        Err(format!("{:?}", second.report()))
    })
    .await;
    let ids = ids.into_inner().unwrap();
    s.wait_for(&[&name], ids.len()).await;
    running_first.stop().await;
    running_second.stop().await;
    s.assert_exactly_once(&[&name], &ids).await;
    assert_eq!(
        first.report().processed + second.report().processed,
        ids.len() as u64
    );
}

/// An ordered transport (Kafka: a partition's records) hands each key's messages to the handler
/// in the order they were published — per message, in batches (each batch split by key, the
/// parts of several batches in flight at once) and with a batch handler — while other keys'
/// handlers overlap. Refuses an unordered transport rather than pass there.
pub async fn an_ordered_transport_keeps_each_key_in_order<D: TestDb>(
    brokers: &dyn BrokerFactory,
    db: &Arc<D>,
) {
    let s = Scenario::new(brokers, db, Faults::none()).await;
    assert!(
        s.broker.transport().capabilities().ordered,
        "this scenario is for ordered transports"
    );
    let name = s.name("ordered");
    s.broker.prepare(&s.source, &[&name]).await;
    let (n, keys) = (240usize, 6usize);
    let handled: Arc<Mutex<Vec<String>>> = Arc::default();
    let script = Arc::new(Script {
        hook: Some({
            let handled = Arc::clone(&handled);
            Arc::new(move |id, _| {
                let calls = {
                    let mut handled = handled.lock().expect("not poisoned");
                    handled.push(id);
                    handled.len() as u64
                };
                // A little work, different per message, so that overlapping handlers of
                // different keys finish out of step.
                let pause = Duration::from_micros(200 * ((calls * 7 + 3) % 5));
                Box::pin(async move {
                    tokio::time::sleep(pause).await;
                    Ok(())
                }) as futures::future::BoxFuture<'static, _>
            }) as Hook
        }),
        ..Script::default()
    });
    let consumer = s.consumer(&name, &script).concurrency(4);
    let running = Running::start(&consumer, 1);
    let ids: Vec<String> = (0..n).map(|i| s.id(i)).collect();
    for (i, id) in ids.iter().enumerate() {
        s.publish_raw(
            inbox::OutgoingMessage::new(id.as_str(), format!(r#"{{"n":{i}}}"#))
                .with_key((i % keys).to_string()),
        )
        .await;
    }
    s.wait_for(&[&name], n).await;
    running.stop().await;
    s.assert_exactly_once(&[&name], &ids).await;
    let position: std::collections::HashMap<&str, usize> = ids
        .iter()
        .enumerate()
        .map(|(i, id)| (id.as_str(), i))
        .collect();
    let handled = handled.lock().expect("not poisoned");
    let mut last: Vec<Option<usize>> = vec![None; keys];
    let mut seen = std::collections::HashSet::new();
    // First calls only: a batch tried again runs its messages again, in order.
    for id in handled.iter().filter(|id| seen.insert(id.as_str())) {
        let i = position[id.as_str()];
        let key = i % keys;
        if let Some(before) = last[key] {
            assert!(
                i >= before,
                "key {key}: message {i} handled after message {before}: {:?}",
                handled
                    .iter()
                    .map(|id| position[id.as_str()])
                    .filter(|j| j % keys == key)
                    .collect::<Vec<_>>()
            );
        }
        last[key] = Some(i);
    }
}

/// A producer that sends every message twice (two records, two offsets): one effect each when
/// copies are told by id (`Dedup::Ids`, `Dedup::OffsetsAndIds`); both records handled by offsets
/// alone (`Dedup::Offsets`), which catch redeliveries of a record, not a second record — the
/// documented limit — and which write no inbox row per message.
pub async fn producer_duplicates_by_dedup_mode<D: TestDb>(
    brokers: &dyn BrokerFactory,
    db: &Arc<D>,
) {
    let s = Scenario::new(brokers, db, Faults::none()).await;
    let name = s.name("producer-duplicates");
    s.broker.prepare(&s.source, &[&name]).await;
    let ids: Vec<String> = (0..20).map(|i| s.id(i)).collect();
    for (i, id) in ids.iter().enumerate() {
        s.publish(id, i).await;
        s.publish(id, i).await;
    }
    let offsets_alone = crate::dedup() == inbox::Dedup::Offsets;
    // By offsets alone both records of a message are handled — except where the second is its
    // partition's first record since the assignment: that one claims its id row (it may be one
    // a previous owner died on), which finds the first copy done. The suite's topics have 3
    // partitions.
    let (least, caught_at_most) = if offsets_alone {
        (2 * ids.len() - 3, 3)
    } else {
        (ids.len(), ids.len())
    };
    let script = Arc::new(Script::default());
    let consumer = s.consumer(&name, &script);
    let running = Running::start(&consumer, 1);
    s.wait_for(&[&name], least).await;
    running.stop().await;
    let effects = s.effects().await;
    let mut caught = 0;
    for id in &ids {
        match effects.get(&(name.to_string(), id.clone())).copied() {
            Some(1) => caught += 1,
            Some(2) if offsets_alone => {}
            n => panic!("{id}: {n:?} effects in {:?} mode", crate::dedup()),
        }
    }
    assert!(
        caught <= caught_at_most,
        "{caught} producer duplicates caught in {:?} mode",
        crate::dedup()
    );
    let report = consumer.report();
    assert_eq!(
        report.processed,
        (2 * ids.len() - caught) as u64,
        "{report:?}"
    );
    let rows = s.store.stats(Some(&name)).await.unwrap();
    let rows = rows.first().map_or(0, |stats| stats.rows);
    if offsets_alone {
        // Only a partition's first record since its assignment gets a row (it may be the one a
        // previous owner died on: its deliveries are counted there); the suite's topics have 3.
        assert!(rows <= 3, "{rows} inbox rows by offsets alone");
    } else {
        assert_eq!(rows, ids.len() as u64, "inbox rows by id");
    }
}
