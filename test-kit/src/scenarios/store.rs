//! The store and its operators: dead letters replayed, an outage of the database, values bound
//! as parameters, cleanup, migrations beside the application's own, and faults aimed at single
//! store methods (a commit applied whose reply is lost among them).

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use inbox::memory::Faults;
use inbox::{Consumer, ConsumerName, InboxAdmin, InboxStore, RetryPolicy};

use super::reasons_by_id;
use crate::flaky;
use crate::{BrokerFactory, Running, Scenario, Script, TestDb, eventually, refusing};

/// The operator's replay: dead letters are read back from the dead-letter destination, the dead
/// mark is cleared and the message published to its source again, and then it is handled once —
/// by the consumer that gave up on it, while every other consumer of the source discards the copy.
pub async fn dead_letters_are_replayed<D: TestDb>(brokers: &dyn BrokerFactory, db: &Arc<D>) {
    use inbox::dead_letter::{Replay, replay};

    let s = Scenario::new(brokers, db, Faults::none()).await;
    let (name, other) = (s.name("replayed"), s.name("bystander"));
    s.broker.prepare(&s.source, &[&name, &other]).await;
    let ids: Vec<String> = (0..8).map(|i| s.id(i)).collect();
    let (a, b) = (ids[6].clone(), ids[7].clone());
    // A bug makes the handler refuse a and b, until the fix is deployed.
    let broken = Arc::new(Mutex::new(HashSet::from([a.clone(), b.clone()])));
    let script = Arc::new(Script {
        hook: Some(refusing(&broken)),
        ..Script::default()
    });
    let consumer = s.consumer(&name, &script);
    let bystander = s.consumer(&other, &Arc::new(Script::default()));
    let running = Running::start(&consumer, 1);
    let running_other = Running::start(&bystander, 1);
    for (i, id) in ids.iter().enumerate() {
        s.publish(id, i).await;
    }
    s.wait_for(&[&name, &other], 6 + 8).await;
    eventually("a and b dead", || async {
        let dead = s.store.dead_letters(Some(&name), 100).await.unwrap();
        if dead.len() == 2 {
            Ok(())
        } else {
            Err(format!("{dead:?}"))
        }
    })
    .await;
    broken.lock().unwrap().clear();

    let transport = s.broker.transport();
    let destination = s.dead_letter_destination();
    let id_of = |id: &str| inbox::MessageId::new(id.to_owned()).unwrap();
    // A broker may show a just-published dead letter a moment late: the replay then says it is
    // missing, and running it again is safe.
    let first = Mutex::new(None);
    eventually("a replayed", || async {
        let report = replay(
            &*transport,
            &s.store,
            &name,
            &destination,
            Replay::Ids(vec![id_of(&a)]),
        )
        .await
        .map_err(|e| e.to_string())?;
        let done = report.replayed == vec![a.clone()];
        *first.lock().unwrap() = Some(report.clone());
        if done {
            Ok(())
        } else {
            Err(format!("{report:?}"))
        }
    })
    .await;
    let first = first.into_inner().unwrap().unwrap();
    assert!(
        first.not_dead.is_empty() && first.missing.is_empty(),
        "{first:?}"
    );
    eventually("a handled", || async {
        let n = s
            .effects()
            .await
            .get(&(name.to_string(), a.clone()))
            .copied();
        if n == Some(1) {
            Ok(())
        } else {
            Err(format!("{n:?}"))
        }
    })
    .await;

    // Asking again for a (now processed) and for an id never seen replays nothing.
    let again = replay(
        &*transport,
        &s.store,
        &name,
        &destination,
        Replay::Ids(vec![id_of(&a), id_of("never-seen")]),
    )
    .await
    .unwrap();
    assert!(again.replayed.is_empty(), "{again:?}");
    assert_eq!(again.not_dead, vec![a.clone(), "never-seen".to_owned()]);

    // Retention passes before b's replay: the bystander's record of b is cleaned up, and only
    // the replay's addressee keeps it from handling b a second time.
    let cleaned = s.store.cleanup(Duration::ZERO, 1000).await.unwrap();
    assert!(cleaned.deleted >= 8, "{cleaned:?}");
    assert!(
        s.db.row(&s.store, &other, &b).await.is_none(),
        "the bystander's row of b is gone"
    );
    let all = replay(&*transport, &s.store, &name, &destination, Replay::All)
        .await
        .unwrap();
    assert_eq!(all.replayed, vec![b.clone()], "{all:?}");
    s.wait_for(&[&name, &other], 16).await;
    eventually("the bystander discarded both copies", || async {
        let n = bystander.report().duplicates_discarded;
        if n >= 2 {
            Ok(())
        } else {
            Err(format!("{n} duplicates"))
        }
    })
    .await;
    running.stop().await;
    running_other.stop().await;
    s.assert_exactly_once(&[&name, &other], &ids).await;
    // A batch handler may also meet a message in batches that a batch-mate's failure rolled
    // back: more calls, the same one effect.
    let calls = |id: &str| script.calls(id);
    let expected = |n: u32| {
        n == 2 || (crate::whole_batches() && n > 2 && n <= 2 + crate::WHOLE_BATCH_EXTRA_CALLS)
    };
    assert!(
        expected(calls(&a)),
        "refused once, handled once after the replay: {} calls",
        calls(&a)
    );
    assert!(expected(calls(&b)), "{} calls", calls(&b));
    let stats = s.store.stats(Some(&name)).await.unwrap();
    // Processed rows were cleaned up before b's replay: b's is the one left.
    assert_eq!((stats[0].processed, stats[0].dead), (1, 0), "{stats:?}");
    let nothing_left = replay(&*transport, &s.store, &name, &destination, Replay::All)
        .await
        .unwrap();
    assert_eq!(nothing_left, inbox::dead_letter::ReplayReport::default());
}

/// The database goes away: the consumer stops taking deliveries, one task probes with backoff
/// (not one per message, not a hot loop), and it resumes by itself when the database is back.
pub async fn store_outage_pauses_deliveries<D: TestDb>(brokers: &dyn BrokerFactory, db: &Arc<D>) {
    use flaky::FlakyStore;
    use std::time::Instant;

    let s = Scenario::new(brokers, db, Faults::none()).await;
    let name = s.name("outage");
    s.broker.prepare(&s.source, &[&name]).await;
    let store = FlakyStore::new(s.store.clone());
    let handler = s.handler(&Arc::new(Script::default()));
    let (min_delay, max_delay) = (Duration::from_millis(10), Duration::from_millis(200));
    let concurrency = 4;
    let consumer = Consumer::new(
        name.clone(),
        s.source.clone(),
        s.broker.transport(),
        store.clone(),
        handler,
    )
    .concurrency(concurrency)
    .reconnect_backoff(RetryPolicy::default().with_delays(min_delay, max_delay))
    .dedup(crate::dedup());
    let ids: Vec<String> = (0..40).map(|i| s.id(i)).collect();
    let running = Running::start(&consumer, 1);
    for (i, id) in ids[..10].iter().enumerate() {
        s.publish(id, i).await;
    }
    s.wait_for(&[&name], 10).await;
    let before = consumer.report().deliveries;

    store.set_down(true);
    let down_at = Instant::now();
    for (i, id) in ids.iter().enumerate().skip(10) {
        s.publish(id, i).await;
    }
    eventually("the consumer probing the dead store", || async {
        match store.refused() {
            n if n >= 12 => Ok(()),
            n => Err(format!("{n} refused calls")),
        }
    })
    .await;
    let (elapsed, refused) = (down_at.elapsed(), store.refused());
    let taken = consumer.report().deliveries - before;
    assert!(
        taken <= concurrency as u64,
        "no new deliveries while the store is down, beyond one per handler slot: {taken}"
    );
    // Each delivery in flight fails once and then waits; after that only the one prober calls,
    // at backoff delays of at least 10, 20, 40, ... 200 ms (jitter only adds).
    let mut probes = 0u64;
    let mut at = Duration::ZERO;
    let mut delay = min_delay;
    while at <= elapsed {
        probes += 1;
        at += delay;
        delay = (delay * 2).min(max_delay);
    }
    assert!(
        refused <= taken + probes + 1,
        "{refused} store calls in {elapsed:?} while down: more than {taken} in flight + {probes} probes"
    );

    store.set_down(false);
    s.wait_for(&[&name], ids.len()).await;
    running.stop().await;
    s.assert_exactly_once(&[&name], &ids).await;
}

/// Quotes, semicolons and SQL keywords in consumer names and ids are just text.
pub async fn hostile_values_are_bound_parameters<D: TestDb>(
    brokers: &dyn BrokerFactory,
    db: &Arc<D>,
) {
    let s = Scenario::new(brokers, db, Faults::none()).await;
    let name = ConsumerName::new(format!(
        "o'brien\"; DROP TABLE inbox_messages; -- {}",
        s.run
    ))
    .unwrap();
    s.broker.prepare(&s.source, &[&name]).await;
    let ids: Vec<String> = [
        "'); DELETE FROM inbox_messages; --",
        "\" OR 1=1 --",
        "%_\\ LIKE 'x'",
        "Robert'); DROP TABLE conformance_effects;--",
        "$1 $2 ? :name @p",
    ]
    .iter()
    .map(|v| format!("{v} {}", s.run))
    .collect();
    for (i, id) in ids.iter().enumerate() {
        s.publish(id, i).await;
        s.publish(id, i).await;
    }
    let script = Arc::new(Script::default());
    let consumer = s.consumer(&name, &script);
    let running = Running::start(&consumer, 1);
    s.wait_for(&[&name], ids.len()).await;
    running.stop().await;
    s.assert_exactly_once(&[&name], &ids).await;
    for id in &ids {
        let row =
            s.db.row(&s.store, &name, id)
                .await
                .expect("stored verbatim");
        assert!(row.processed);
    }
}

/// Cleanup deletes processed rows in batches and keeps dead-lettered ones.
pub async fn cleanup_keeps_dead_letters<D: TestDb>(brokers: &dyn BrokerFactory, db: &Arc<D>) {
    let s = Scenario::new(brokers, db, Faults::none()).await;
    let name = s.name("cleanup");
    s.broker.prepare(&s.source, &[&name]).await;
    let ids: Vec<String> = (0..25).map(|i| s.id(i)).collect();
    for (i, id) in ids.iter().enumerate() {
        s.publish(id, i).await;
    }
    let script = Arc::new(Script {
        permanent: HashSet::from([ids[0].clone()]),
        ..Script::default()
    });
    let consumer = s.consumer(&name, &script);
    let running = Running::start(&consumer, 1);
    s.wait_for(&[&name], ids.len() - 1).await;
    running.stop().await;
    // Each scenario has a database of its own: the counts are exactly ours.
    let report = s
        .store
        .cleanup(Duration::from_secs(3600), 10)
        .await
        .unwrap();
    assert!(!report.skipped_locked);
    let stats = s.store.stats(Some(&name)).await.unwrap();
    assert_eq!(
        stats[0].rows, 25,
        "nothing is younger than an hour ago: {report:?}"
    );
    let report = s.store.cleanup(Duration::ZERO, 10).await.unwrap();
    assert!(report.deleted == 24 && report.batches == 3, "{report:?}");
    let stats = s.store.stats(Some(&name)).await.unwrap();
    assert_eq!(
        (stats[0].rows, stats[0].dead),
        (1, 1),
        "only the dead row is left: {stats:?}"
    );
}

/// Our migrations are idempotent and keep out of the application's own sqlx migrations.
pub async fn migrations_coexist_with_the_application<D: TestDb>(
    _brokers: &dyn BrokerFactory,
    db: &Arc<D>,
) {
    let store = db.store().await;
    store.migrate().await.expect("migrating again is a no-op");
    db.check_app_migrations_coexist().await;
}

/// Faults as fine as the world's, aimed at one store method: a failure whose recording loses its
/// connection (the outage gate must reopen by itself — it once stayed shut with nobody probing),
/// a failure the table refuses to record (the message is dead-lettered instead of retried
/// uncounted for ever), a dead mark the table refuses (the dead letter is out: the consumer goes
/// on), a dead mark whose connection is lost (tried again), and commits applied whose reply is
/// lost (the retry finds them done: no second effect). The consumer never stops, and good
/// messages published afterwards are handled. In offsets mode the claim of a partition's
/// offset and a batch's correction of it lose their connection too, and a consumer started
/// again afterwards (its partitions starting at the kept offsets) handles only what is new.
pub async fn store_faults_neither_wedge_nor_stop<D: TestDb>(
    brokers: &dyn BrokerFactory,
    db: &Arc<D>,
) {
    use flaky::{Fault, FlakyStore, Method};

    let s = Scenario::new(brokers, db, Faults::none()).await;
    let name = s.name("faults");
    s.broker.prepare(&s.source, &[&name]).await;
    let store = FlakyStore::new(s.store.clone());
    let (gate, uncounted, unmarked) = (s.id(100), s.id(101), s.id(102));
    store.inject(Method::RecordFailure, Some(&gate), Fault::Unavailable, 2);
    store.inject(Method::MarkDeadClaimed, Some(&gate), Fault::Unavailable, 1);
    store.inject(Method::RecordFailure, Some(&uncounted), Fault::Refused, 1);
    store.inject(Method::RecordDead, Some(&unmarked), Fault::Refused, 1);
    // In batch mode its mark is refused first (the batch then goes message by message).
    store.inject(Method::MarkDeadClaimed, Some(&unmarked), Fault::Refused, 1);
    store.inject(Method::Commit, None, Fault::CommitAppliedReplyLost, 3);
    let by_offsets = crate::dedup() != inbox::Dedup::Ids;
    if by_offsets {
        store.inject(Method::ClaimOffsets, None, Fault::Unavailable, 3);
        store.inject(Method::SetNextOffset, None, Fault::Unavailable, 1);
    }
    let script = Arc::new(Script {
        always_fail: HashSet::from([gate.clone(), uncounted.clone()]),
        permanent: HashSet::from([unmarked.clone()]),
        ..Script::default()
    });
    let consumer = Consumer::new(
        name.clone(),
        s.source.clone(),
        s.broker.transport(),
        store.clone(),
        s.handler(&script),
    )
    .concurrency(4)
    .retry(
        RetryPolicy::default()
            .with_max_attempts(4)
            .with_in_process_retries(0)
            .with_delays(Duration::from_millis(5), Duration::from_millis(40)),
    )
    .reconnect_backoff(
        RetryPolicy::default().with_delays(Duration::from_millis(10), Duration::from_millis(200)),
    )
    .dedup(crate::dedup());
    let consumer = if crate::batched() {
        consumer.batch(inbox::Batching::new(16, Duration::from_millis(5)))
    } else {
        consumer
    };
    let good: Vec<String> = (0..15).map(|i| s.id(i)).collect();
    for (i, id) in good[..10].iter().enumerate() {
        s.publish(id, i).await;
    }
    for id in [&gate, &uncounted, &unmarked] {
        s.publish(id, 0).await;
    }
    let running = Running::start(&consumer, 1);
    s.wait_for(&[&name], 10).await;
    let dead = s.dead_letters_of(&[&gate, &uncounted, &unmarked]).await;
    for (i, id) in good.iter().enumerate().skip(10) {
        s.publish(id, i).await;
    }
    s.wait_for(&[&name], good.len()).await;
    assert!(running.is_running(), "the consumer is still running");
    running.stop().await;
    s.assert_exactly_once(&[&name], &good).await;

    let reasons = reasons_by_id(&dead);
    let reason = |id: &str| reasons[id].clone();
    assert!(
        reason(&gate).contains("gave up after 4 attempts"),
        "{}",
        reason(&gate)
    );
    assert!(
        reason(&uncounted).contains("could not be recorded"),
        "{}",
        reason(&uncounted)
    );
    assert!(
        reason(&unmarked).contains("can never succeed"),
        "{}",
        reason(&unmarked)
    );
    let fired = store.fired();
    let offset_faults = by_offsets.then_some((Method::ClaimOffsets, Fault::Unavailable));
    for expected in [
        (Method::RecordFailure, Fault::Unavailable),
        (Method::MarkDeadClaimed, Fault::Unavailable),
        (Method::RecordFailure, Fault::Refused),
        (Method::RecordDead, Fault::Refused),
        (Method::Commit, Fault::CommitAppliedReplyLost),
    ]
    .into_iter()
    .chain(offset_faults)
    {
        assert!(
            fired.contains(&expected),
            "{expected:?} never fired: {fired:?}"
        );
    }
    let row = s.db.row(&s.store, &name, &gate).await.expect("a row");
    assert!(row.dead, "{row:?}");
    if by_offsets {
        // Had a fault left a partition's kept offset behind what was handled and acked, the
        // consumer started again would be sent back there and handle those records twice.
        let later: Vec<String> = (15..18).map(|i| s.id(i)).collect();
        for (i, id) in later.iter().enumerate() {
            s.publish(id, 15 + i).await;
        }
        let running = Running::start(&consumer, 1);
        s.wait_for(&[&name], good.len() + later.len()).await;
        running.stop().await;
        let all: Vec<String> = good.iter().chain(&later).cloned().collect();
        s.assert_exactly_once(&[&name], &all).await;
    }
}

/// The store's bookkeeping answers, method by method, the same on every database: failures and
/// delivery counts recorded in their own transactions, what a claim then reads, and that a
/// processed or dead row is left alone by both. (The engine acts on these numbers: a store that
/// miscounted would retry a poison message for ever or dead-letter a healthy one.)
pub async fn store_bookkeeping_answers<D: TestDb>(_brokers: &dyn BrokerFactory, db: &Arc<D>) {
    use inbox::MessageId;
    use inbox::store::Claim;

    let store = db.store().await;
    let c = ConsumerName::new("bookkeeping").unwrap();
    let id = |s: &str| MessageId::new(s).unwrap();
    let claimed = |attempts, error: Option<&str>| Claim::Claimed {
        attempts,
        last_error: error.map(str::to_owned),
    };

    // Delivery counts: a new row counts 1, each later one more.
    assert_eq!(store.record_delivery(&c, &id("d")).await.unwrap(), 1);
    assert_eq!(store.record_delivery(&c, &id("d")).await.unwrap(), 2);

    // Failures: a new row takes the attempt; later ones one more, or the attempt if higher.
    assert_eq!(
        store.record_failure(&c, &id("f"), 1, "e1").await.unwrap(),
        1
    );
    assert_eq!(
        store.record_failure(&c, &id("f"), 1, "e2").await.unwrap(),
        2
    );
    assert_eq!(
        store.record_failure(&c, &id("f"), 5, "e3").await.unwrap(),
        5
    );
    let mut tx = store.begin().await.unwrap();
    assert_eq!(
        store.claim(&mut tx, &c, &id("f")).await.unwrap(),
        claimed(5, Some("e3"))
    );
    assert_eq!(
        store.claim(&mut tx, &c, &id("d")).await.unwrap(),
        claimed(0, None)
    );
    store.commit(tx).await.unwrap();

    // Processed: a late failure or delivery changes nothing (the failure answers its attempt).
    assert_eq!(
        store.record_failure(&c, &id("f"), 6, "late").await.unwrap(),
        6
    );
    assert_eq!(store.record_delivery(&c, &id("f")).await.unwrap(), 0);
    let row = db.row(&store, &c, "f").await.expect("row f");
    assert!(row.processed && !row.dead, "{row:?}");
    assert_eq!((row.attempts, row.last_error.as_deref()), (5, Some("e3")));

    // Dead: claimed as dead, and a second dead mark or a failure changes nothing.
    store.record_dead(&c, &id("x"), 3, "poison").await.unwrap();
    store.record_dead(&c, &id("x"), 9, "again").await.unwrap();
    assert_eq!(
        store.record_failure(&c, &id("x"), 4, "late").await.unwrap(),
        4
    );
    assert_eq!(store.record_delivery(&c, &id("x")).await.unwrap(), 0);
    let row = db.row(&store, &c, "x").await.expect("row x");
    assert!(row.dead && !row.processed, "{row:?}");
    assert_eq!(
        (row.attempts, row.last_error.as_deref()),
        (3, Some("poison"))
    );
    let mut tx = store.begin().await.unwrap();
    assert_eq!(
        store.claim(&mut tx, &c, &id("x")).await.unwrap(),
        Claim::Dead
    );
    store.rollback(tx).await.unwrap();

    // Revived: a fresh budget, the reason kept for the record.
    assert!(store.revive(&c, &id("x")).await.unwrap());
    assert!(
        !store.revive(&c, &id("x")).await.unwrap(),
        "not dead any more"
    );
    let mut tx = store.begin().await.unwrap();
    assert_eq!(
        store.claim(&mut tx, &c, &id("x")).await.unwrap(),
        claimed(0, Some("poison"))
    );
    store.commit(tx).await.unwrap();
}

/// Offsets mode's bookkeeping (`inbox_offsets`): a range is new until its partition's next
/// offset passes its first record; the next offset never moves back except where a batch sets it
/// to its first unfinished record in the claim's own transaction; a rolled-back claim leaves
/// nothing; and a second owner of the partition (a rebalance) waits for the first one's
/// transaction, then finds its records consumed — also when the partition's row did not exist.
pub async fn store_keeps_offsets_monotone<D: TestDb>(_brokers: &dyn BrokerFactory, db: &Arc<D>) {
    use inbox::store::OffsetClaim;

    let store = db.store().await;
    let c = ConsumerName::new(format!("offsets-{}", uuid::Uuid::new_v4().simple())).unwrap();
    let topic = "parcels'; DROP TABLE inbox_offsets; --";
    let claim = |range: (i64, i64)| {
        let (store, c) = (store.clone(), c.clone());
        async move {
            let mut tx = store.begin().await.unwrap();
            let found = store
                .claim_offsets(&mut tx, &c, topic, 0, range)
                .await
                .unwrap();
            (tx, found)
        }
    };
    assert_eq!(store.next_offset(&c, topic, 0).await.unwrap(), None);

    let (tx, found) = claim((0, 9)).await;
    assert_eq!(found, OffsetClaim::New, "nothing kept: all new");
    store.commit(tx).await.unwrap();
    assert_eq!(store.next_offset(&c, topic, 0).await.unwrap(), Some(10));

    let (tx, found) = claim((5, 5)).await;
    assert_eq!(found, OffsetClaim::Consumed { next: 10 });
    store.rollback(tx).await.unwrap();
    let (tx, found) = claim((8, 14)).await;
    assert_eq!(
        found,
        OffsetClaim::Consumed { next: 10 },
        "a range reaching past the next offset is partly consumed, and left as it is"
    );
    store.rollback(tx).await.unwrap();
    assert_eq!(store.next_offset(&c, topic, 0).await.unwrap(), Some(10));

    // A batch of 10..=19 whose record 15 goes the per-message way: the offset stops at 15.
    let (mut tx, found) = claim((10, 19)).await;
    assert_eq!(found, OffsetClaim::New);
    store
        .set_next_offset(&mut tx, &c, topic, 0, 15)
        .await
        .unwrap();
    store.commit(tx).await.unwrap();
    assert_eq!(store.next_offset(&c, topic, 0).await.unwrap(), Some(15));

    // A rolled-back claim moves nothing; gaps in the offsets are new records.
    let (tx, found) = claim((15, 15)).await;
    assert_eq!(found, OffsetClaim::New);
    store.rollback(tx).await.unwrap();
    assert_eq!(store.next_offset(&c, topic, 0).await.unwrap(), Some(15));
    let (tx, found) = claim((40, 40)).await;
    assert_eq!(found, OffsetClaim::New);
    store.commit(tx).await.unwrap();
    assert_eq!(store.next_offset(&c, topic, 0).await.unwrap(), Some(41));
    // Partitions and consumers are kept apart.
    assert_eq!(store.next_offset(&c, topic, 1).await.unwrap(), None);
    let other = ConsumerName::new(format!("{}-other", c.as_str())).unwrap();
    assert_eq!(store.next_offset(&other, topic, 0).await.unwrap(), None);

    if !D::CONCURRENT_WRITERS {
        return;
    }
    // Two owners of one partition at once (partition 0's row exists, partition 7's does not
    // yet): the second waits for the first, whose commit makes the record a copy to it.
    for (partition, offset) in [(0, 41), (7, 0)] {
        let mut first = store.begin().await.unwrap();
        let found = store
            .claim_offsets(&mut first, &c, topic, partition, (offset, offset))
            .await
            .unwrap();
        assert_eq!(found, OffsetClaim::New);
        let (store2, c2) = (store.clone(), c.clone());
        let mut second = tokio::spawn(async move {
            let mut tx = store2.begin().await.unwrap();
            let found = store2
                .claim_offsets(&mut tx, &c2, topic, partition, (offset, offset))
                .await
                .unwrap();
            store2.rollback(tx).await.unwrap();
            found
        });
        // Not a synchronisation: a second claim that did not wait would be back long before.
        assert!(
            tokio::time::timeout(Duration::from_millis(300), &mut second)
                .await
                .is_err(),
            "partition {partition}: the second owner's claim must wait for the first's transaction"
        );
        store.commit(first).await.unwrap();
        assert_eq!(
            second.await.unwrap(),
            OffsetClaim::Consumed { next: offset + 1 },
            "partition {partition}"
        );
    }
}
