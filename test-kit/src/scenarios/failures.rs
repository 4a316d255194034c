//! Failures of a message or its handler: retries, invalid ids, poison messages, a message that
//! crashes its consumer, a handler that swallows a database error, error texts the database
//! cannot store. Each ends retried, dead-lettered with its reason, or committed — never lost.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use inbox::dead_letter::headers as dead_letter_headers;
use inbox::memory::Faults;
use inbox::{HandlerError, InboxAdmin, InboxStore, OutgoingMessage, RetryPolicy};

use super::{header, reasons_by_id};
use crate::{BrokerFactory, RefuseFirstPublishes, Running, Scenario, Script, TestDb, eventually};

/// A handler that fails twice per message, then succeeds: retried in process and through the
/// broker, one effect each, the attempts recorded.
pub async fn failing_handler_is_retried_then_succeeds<D: TestDb>(
    brokers: &dyn BrokerFactory,
    db: &Arc<D>,
) {
    let s = Scenario::new(brokers, db, Faults::none()).await;
    let name = s.name("retry");
    s.broker.prepare(&s.source, &[&name]).await;
    let ids: Vec<String> = (0..20).map(|i| s.id(i)).collect();
    for (i, id) in ids.iter().enumerate() {
        s.publish(id, i).await;
    }
    let script = Arc::new(Script {
        fail_first: 2,
        panic_once: HashSet::from([ids[0].clone()]),
        ..Script::default()
    });
    let consumer = s.consumer(&name, &script);
    let running = Running::start(&consumer, 1);
    s.wait_for(&[&name], ids.len()).await;
    running.stop().await;
    s.assert_exactly_once(&[&name], &ids).await;
    let report = consumer.report();
    assert_eq!(report.dead_lettered, 0, "{report:?}");
    // A batch handler's failures in a batch count against no message: a message's first
    // failure there isolates it, and only its failures alone are attempts.
    let whole = crate::whole_batches();
    if !whole {
        assert_eq!(report.failed, 2 * ids.len() as u64, "{report:?}");
    }
    for id in &ids {
        let calls = script.calls(id);
        assert!(
            calls == 3 || (whole && calls > 3 && calls <= 3 + crate::WHOLE_BATCH_EXTRA_CALLS),
            "{id}: {calls} calls"
        );
        // By offsets alone a failure inside a batch has no row to be counted in (one would
        // never be finished): only the failures the message has on its own count. With a batch
        // handler, a record that failed only in batches (its batch, then alone) and then
        // succeeded has no row at all — its offset is its record. Which ones those are depends
        // on how the broker splits the records into polls: a partition's first record since the
        // assignment, and the rest of its poll, go the per-message way, with a row.
        let uncounted_in_batch = crate::batched() && crate::dedup() == inbox::Dedup::Offsets;
        let Some(row) = s.db.row(&s.store, &name, id).await else {
            assert!(whole && uncounted_in_batch, "{id}: no inbox row");
            continue;
        };
        assert!(row.processed && !row.dead, "{row:?}");
        assert!(
            row.attempts == 2 || ((whole || uncounted_in_batch) && row.attempts < 2),
            "{id}: {row:?}"
        );
    }
}

/// Missing, empty, over-long and non-UTF-8 ids are dead-lettered with their reason; the consumer
/// keeps going.
pub async fn invalid_ids_are_dead_lettered<D: TestDb>(brokers: &dyn BrokerFactory, db: &Arc<D>) {
    let s = Scenario::new(brokers, db, Faults::none()).await;
    let name = s.name("ids");
    s.broker.prepare(&s.source, &[&name]).await;
    let script = Arc::new(Script::default());
    let consumer = s.consumer(&name, &script);
    let running = Running::start(&consumer, 1);
    let before = s.id(0);
    s.publish(&before, 0).await;
    let mut bad = vec![
        (
            OutgoingMessage {
                payload: "{}".into(),
                ..OutgoingMessage::default()
            },
            "no message id",
        ),
        (OutgoingMessage::new("", "{}"), "is empty"),
        (OutgoingMessage::new("x".repeat(256), "{}"), "256 bytes"),
        (
            OutgoingMessage::new("nul\u{0}id", "{}"),
            "control character",
        ),
    ];
    // A header id that is not UTF-8, where headers can carry one (NATS headers are text).
    if s.broker.transport().capabilities().binary_headers {
        bad.push((
            OutgoingMessage {
                payload: "{}".into(),
                ..OutgoingMessage::default()
            }
            .with_header("message-id", vec![0xff, 0xfe]),
            "UTF-8",
        ));
    }
    for (message, _) in &bad {
        s.publish_raw(message.clone()).await;
    }
    let after = s.id(1);
    s.publish(&after, 1).await;
    s.wait_for(&[&name], 2).await;
    running.stop().await;
    s.assert_exactly_once(&[&name], &[before, after]).await;
    let dead = s.dead_letters(bad.len()).await;
    assert_eq!(dead.len(), bad.len(), "{dead:?}");
    for letter in &dead {
        assert_eq!(header(letter, dead_letter_headers::CONSUMER), name.as_str());
        assert_eq!(header(letter, dead_letter_headers::SOURCE), s.source);
    }
    for (_, why) in &bad {
        let reasons: Vec<&str> = dead
            .iter()
            .map(|l| header(l, dead_letter_headers::REASON))
            .collect();
        assert!(
            reasons.iter().any(|r| r.contains(why)),
            "no dead letter says {why:?}: {reasons:?}"
        );
    }
    assert_eq!(consumer.report().dead_lettered, bad.len() as u64);
}

/// Poison messages: one failing for ever is dead-lettered after the attempt limit, one failing
/// permanently at once, one with a payload that does not decode, one too large. The rest pass.
pub async fn poison_messages_are_dead_lettered<D: TestDb>(
    brokers: &dyn BrokerFactory,
    db: &Arc<D>,
) {
    let s = Scenario::new(brokers, db, Faults::none()).await;
    let name = s.name("poison");
    s.broker.prepare(&s.source, &[&name]).await;
    let (forever, permanent, garbage, huge) = (s.id(100), s.id(101), s.id(102), s.id(103));
    let (empty, wrong_shape) = (s.id(104), s.id(105));
    let good: Vec<String> = (0..10).map(|i| s.id(i)).collect();
    for (i, id) in good.iter().enumerate() {
        s.publish(id, i).await;
    }
    s.publish(&forever, 0).await;
    s.publish(&permanent, 0).await;
    s.publish_raw(OutgoingMessage::new(garbage.clone(), "not json {"))
        .await;
    s.publish_raw(OutgoingMessage::new(
        huge.clone(),
        format!(r#"{{"n":1,"pad":"{}"}}"#, "x".repeat(4096)),
    ))
    .await;
    s.publish_raw(OutgoingMessage::new(empty.clone(), "")).await;
    s.publish_raw(OutgoingMessage::new(
        wrong_shape.clone(),
        r#"{"parcel_id": 7}"#,
    ))
    .await;
    let script = Arc::new(Script {
        always_fail: HashSet::from([forever.clone()]),
        permanent: HashSet::from([permanent.clone()]),
        decode_json: true,
        ..Script::default()
    });
    let consumer = s.consumer(&name, &script).max_payload_bytes(1024);
    let running = Running::start(&consumer, 2);
    s.wait_for(&[&name], good.len()).await;
    s.dead_letters(6).await;
    eventually("settled", || async {
        s.broker.settled(&s.source, &[&name]).await
    })
    .await;
    running.stop().await;
    s.assert_exactly_once(&[&name], &good).await;

    // A batch handler also meets them in batches, where failing counts against no message.
    let whole = crate::whole_batches();
    let (forever_calls, permanent_calls) = (script.calls(&forever), script.calls(&permanent));
    assert!(
        forever_calls == 4
            || (whole && forever_calls > 4 && forever_calls <= 4 + crate::WHOLE_BATCH_EXTRA_CALLS),
        "tried max_attempts times, then never again: {forever_calls} calls"
    );
    assert!(
        permanent_calls == 1
            || (whole
                && permanent_calls > 1
                && permanent_calls <= 1 + crate::WHOLE_BATCH_EXTRA_CALLS),
        "{permanent_calls} calls"
    );
    assert_eq!(
        script.calls(&huge),
        0,
        "too large: never handed to the handler"
    );
    let dead = s.dead_letters(6).await;
    assert_eq!(dead.len(), 6, "{dead:?}");
    let by_id: HashMap<&str, &OutgoingMessage> = dead
        .iter()
        .map(|m| (header(m, dead_letter_headers::MESSAGE_ID), m))
        .collect();
    let reasons = reasons_by_id(&dead);
    let reason = |id: &str| reasons[id].clone();
    assert!(
        reason(&forever).contains("gave up after 4 attempts"),
        "{}",
        reason(&forever)
    );
    assert!(
        reason(&forever).contains("fails every time"),
        "{}",
        reason(&forever)
    );
    assert_eq!(
        header(by_id[forever.as_str()], dead_letter_headers::ATTEMPTS),
        "4"
    );
    assert!(
        reason(&permanent).contains("can never succeed"),
        "{}",
        reason(&permanent)
    );
    assert!(
        reason(&garbage).contains("not the expected JSON"),
        "{}",
        reason(&garbage)
    );
    assert!(
        reason(&huge).contains("exceeds the limit of 1024 bytes"),
        "{}",
        reason(&huge)
    );
    assert!(
        reason(&empty).contains("empty payload"),
        "{}",
        reason(&empty)
    );
    assert!(
        reason(&wrong_shape).contains("missing field `n`"),
        "{}",
        reason(&wrong_shape)
    );
    assert_eq!(
        by_id[garbage.as_str()].payload.as_ref(),
        b"not json {",
        "the original payload travels"
    );
    for id in [&forever, &permanent, &garbage, &huge, &empty, &wrong_shape] {
        let row = s.db.row(&s.store, &name, id).await.expect("a dead row");
        assert!(row.dead && !row.processed, "{id}: {row:?}");
        assert!(row.last_error.is_some(), "{id}: {row:?}");
    }
    let stats = s.store.stats(Some(&name)).await.unwrap();
    assert_eq!(stats.len(), 1);
    assert_eq!(
        (stats[0].processed, stats[0].dead, stats[0].failing),
        (10, 6, 0),
        "{stats:?}"
    );

    // A later copy of a dead message is discarded, not handled again. (As many instances as
    // before: tansu 0.6 does not complete a group's rebalance when fewer members come back after
    // all left — see the README's notes on tansu.)
    let running = Running::start(&consumer, 2);
    s.publish(&permanent, 0).await;
    eventually("the copy is discarded", || async {
        s.broker.settled(&s.source, &[&name]).await?;
        if consumer.report().duplicates_discarded >= 1 {
            Ok(())
        } else {
            Err("not yet".into())
        }
    })
    .await;
    running.stop().await;
    assert_eq!(
        script.calls(&permanent),
        permanent_calls,
        "the copy of a dead message is not handled"
    );

    // The operator's replay: clear the mark; the next delivery is handled (and fails again).
    assert!(
        s.store
            .revive(&name, &inbox::MessageId::new(permanent.clone()).unwrap())
            .await
            .unwrap()
    );
    let row = s.db.row(&s.store, &name, &permanent).await.unwrap();
    assert!(!row.dead && !row.processed, "{row:?}");
}

/// A message the consumer dies on (no failure is ever recorded) is dead-lettered once its
/// delivery count passes `max_deliveries` — the broker's where it counts deliveries, otherwise
/// the inbox's own count of deliveries that may be redeliveries (AMQP's `redelivered`, the first
/// record of a Kafka partition after an assignment); the others are unaffected.
pub async fn crash_looping_message_is_dead_lettered<D: TestDb>(
    brokers: &dyn BrokerFactory,
    db: &Arc<D>,
) {
    let s = Scenario::new(brokers, db, Faults::none()).await;
    let name = s.name("crashloop");
    s.broker.prepare(&s.source, &[&name]).await;
    let (poison, fine) = (s.id(0), s.id(1));
    // Batch-mates that arrive with the poison: a crash must not take them to the dead-letter
    // queue with it (in batch mode they shared its transaction until redeliveries were taken
    // out of batches). Not on SQLite: there the stuck handler holds the database's one write
    // lock, so nothing else commits until the crash, and every crash redelivers them too.
    // Nor on an ordered transport, where those of the poison's partition wait behind it.
    let ordered = s.broker.transport().capabilities().ordered;
    let mates: Vec<String> = if D::CONCURRENT_WRITERS && !ordered {
        (10..16).map(|i| s.id(i)).collect()
    } else {
        Vec::new()
    };
    s.publish(&poison, 0).await;
    for (i, id) in mates.iter().enumerate() {
        s.publish(id, i).await;
    }
    let entered = Arc::new(AtomicUsize::new(0));
    let fixed = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let script = Arc::new(Script {
        hook: Some({
            let (entered, poison, fixed) =
                (Arc::clone(&entered), poison.clone(), Arc::clone(&fixed));
            Arc::new(move |id, _| {
                let (entered, is_poison) = (Arc::clone(&entered), id == poison);
                let crash = is_poison && !fixed.load(Ordering::SeqCst);
                Box::pin(async move {
                    if crash {
                        entered.fetch_add(1, Ordering::SeqCst);
                        // Never returns: the "process" dies here.
                        std::future::pending::<()>().await;
                    }
                    Ok(())
                })
            })
        }),
        ..Script::default()
    });
    let max_deliveries = 3;
    let consumer = s.consumer(&name, &script).retry(
        RetryPolicy::default()
            .with_max_deliveries(max_deliveries)
            .with_delays(Duration::from_millis(5), Duration::from_millis(40)),
    );
    // Crash whenever the handler is stuck in it, until the broker's count passes the limit. (A
    // broker may count more than one delivery per crash: RabbitMQ counts every return to the
    // queue, and an aborted consumer may return it twice.)
    let dead_letters = || async { s.broker.published(&s.dead_letter_destination()).await.len() };
    let mut crashes = 0;
    // (Where the count is the inbox's, the first delivery may not count: it is no redelivery.)
    while dead_letters().await == 0 {
        assert!(
            crashes <= max_deliveries as usize + 1,
            "still not dead-lettered after {crashes} crashes"
        );
        let running = Running::start(&consumer, 1);
        // Stuck in the poison message (after the batch-mates are handled, except in a first
        // batch, which shares the poison's transaction), or done with it.
        let batched = crate::batched();
        eventually("stuck in the poison message, or done with it", || async {
            let mates_done = s.effects().await.len() >= mates.len();
            let stuck = entered.load(Ordering::SeqCst) > crashes
                && (mates_done || (batched && crashes == 0));
            if stuck || dead_letters().await > 0 {
                Ok(())
            } else {
                Err(format!("waiting; batch-mates handled: {mates_done}"))
            }
        })
        .await;
        running.abort().await;
        crashes = entered.load(Ordering::SeqCst);
    }
    let running = Running::start(&consumer, 1);
    s.publish(&fine, 1).await;
    s.wait_for(&[&name], 1 + mates.len()).await;
    eventually("the poison message dead-lettered", || async {
        match s.broker.published(&s.dead_letter_destination()).await.len() {
            0 => Err("no dead letter yet".to_owned()),
            _ => Ok(()),
        }
    })
    .await;
    running.stop().await;
    let entered = entered.load(Ordering::SeqCst);
    assert!(
        (1..=max_deliveries as usize + 1).contains(&entered),
        "handed to the handler {entered} times, then never again"
    );
    let mut all = mates.clone();
    all.push(fine);
    s.assert_exactly_once(&[&name], &all).await;
    let dead = s.broker.published(&s.dead_letter_destination()).await;
    // (A crash between publishing the dead letter and marking it may publish a second copy.)
    assert!(
        dead.iter()
            .all(|d| header(d, dead_letter_headers::MESSAGE_ID) == poison),
        "only the poison is dead-lettered: {dead:?}"
    );
    let reason = header(&dead[0], dead_letter_headers::REASON);
    assert!(reason.contains("without an outcome"), "{reason}");
    let row =
        s.db.row(&s.store, &name, &poison)
            .await
            .expect("a dead row");
    assert!(row.dead, "{row:?}");

    // The bug is fixed and the letter replayed: handled once. (The dead letter must not carry
    // the broker's delivery count of the crash loop: a quorum queue would see it as delivered 21
    // times and dead-letter it again at once.)
    fixed.store(true, Ordering::SeqCst);
    let running = Running::start(&consumer, 1);
    eventually("the crash-looped letter replayed", || async {
        let report = inbox::dead_letter::replay(
            &*s.broker.transport(),
            &s.store,
            &name,
            &s.dead_letter_destination(),
            inbox::dead_letter::Replay::Ids(vec![inbox::MessageId::new(poison.clone()).unwrap()]),
        )
        .await
        .map_err(|e| e.to_string())?;
        if report.replayed == vec![poison.clone()] {
            Ok(())
        } else {
            Err(format!("{report:?}"))
        }
    })
    .await;
    s.wait_for(&[&name], all.len() + 1).await;
    running.stop().await;
    all.push(poison);
    s.assert_exactly_once(&[&name], &all).await;
}

/// A handler that writes its effect, then swallows the error of a statement the database refused,
/// returns Ok. On PostgreSQL that transaction is aborted: its COMMIT reports success and rolls
/// back, so acking would lose the message. Nothing may be lost: every message ends with exactly
/// one effect or exactly one dead letter — on PostgreSQL the swallowing ones are retried and then
/// dead-lettered with the reason, on SQLite (where a failed statement aborts nothing) they commit.
/// In batch mode the swallowing messages sit in the middle and at the end of the batch.
pub async fn swallowed_database_errors_lose_nothing<D: TestDb>(
    brokers: &dyn BrokerFactory,
    db: &Arc<D>,
) {
    let s = Scenario::new(brokers, db, Faults::none()).await;
    let name = s.name("swallow");
    s.broker.prepare(&s.source, &[&name]).await;
    let ids: Vec<String> = (0..8).map(|i| s.id(i)).collect();
    let swallowers = HashSet::from([ids[2].clone(), ids[7].clone()]);
    for (i, id) in ids.iter().enumerate() {
        s.publish(id, i).await;
    }
    let script = Arc::new(Script {
        swallow_always: swallowers.clone(),
        ..Script::default()
    });
    let consumer = s.consumer(&name, &script);
    let running = Running::start(&consumer, 1);
    let good: Vec<String> = if D::FAILED_STATEMENT_ABORTS {
        ids.iter()
            .filter(|id| !swallowers.contains(*id))
            .cloned()
            .collect()
    } else {
        ids.clone()
    };
    s.wait_for(&[&name], good.len()).await;
    if D::FAILED_STATEMENT_ABORTS {
        s.dead_letters(swallowers.len()).await;
    }
    eventually("settled", || async {
        s.broker.settled(&s.source, &[&name]).await
    })
    .await;
    running.stop().await;
    s.assert_exactly_once(&[&name], &good).await;
    let dead = s.broker.published(&s.dead_letter_destination()).await;
    if !D::FAILED_STATEMENT_ABORTS {
        assert!(dead.is_empty(), "{dead:?}");
        return;
    }
    let dead_ids: HashSet<&str> = dead
        .iter()
        .map(|m| header(m, dead_letter_headers::MESSAGE_ID))
        .collect();
    assert_eq!(
        dead_ids,
        swallowers.iter().map(String::as_str).collect(),
        "each swallowing message dead-lettered once: {dead:?}"
    );
    assert_eq!(dead.len(), swallowers.len(), "{dead:?}");
    for letter in &dead {
        let reason = header(letter, dead_letter_headers::REASON);
        assert!(reason.contains("nothing was committed"), "{reason}");
    }
    for id in &swallowers {
        let row = s.db.row(&s.store, &name, id).await.expect("a dead row");
        assert!(row.dead && !row.processed, "{id}: {row:?}");
        // In batch mode the batch's own tries come first; they count against no message.
        let batched = crate::batched();
        let calls = script.calls(id);
        assert!(
            calls == 4
                || (batched && calls == 5)
                || (crate::whole_batches()
                    && calls > 5
                    && calls <= 5 + crate::WHOLE_BATCH_EXTRA_CALLS),
            "{id}: retried up to max_attempts, {calls} calls"
        );
    }
}

/// Error texts with a NUL in them (a decoder quoting a crafted payload, a handler's own message)
/// are stored, not refused: PostgreSQL's `text` cannot hold NUL, and a bookkeeping write the
/// database refuses must never stop the consumer. A transient failure is retried and succeeds, a
/// permanent one and an undecodable payload are dead-lettered, and a good message after them is
/// handled by the same running consumer.
pub async fn error_texts_with_nul_are_stored<D: TestDb>(brokers: &dyn BrokerFactory, db: &Arc<D>) {
    let s = Scenario::new(brokers, db, Faults::none()).await;
    let name = s.name("nul");
    s.broker.prepare(&s.source, &[&name]).await;
    let (flaky, broken, crafted, after) = (s.id(0), s.id(1), s.id(2), s.id(3));
    s.publish(&flaky, 0).await;
    s.publish(&broken, 1).await;
    // serde quotes an unknown enum variant verbatim: the NUL reaches the error text.
    s.publish_raw(OutgoingMessage::new(
        crafted.clone(),
        "{\"n\":2,\"kind\":\"\\u0000nul\"}",
    ))
    .await;
    let script = Arc::new(Script {
        permanent: HashSet::from([broken.clone()]),
        decode_json: true,
        nul_in_errors: true,
        hook: Some({
            let flaky = flaky.clone();
            Arc::new(move |id: String, call: u32| {
                let fail = id == flaky && call == 1;
                Box::pin(async move {
                    if fail {
                        Err(HandlerError::transient("upstream said \0 no"))
                    } else {
                        Ok(())
                    }
                })
            })
        }),
        ..Script::default()
    });
    let consumer = s.consumer(&name, &script);
    let running = Running::start(&consumer, 1);
    s.dead_letters(2).await;
    s.publish(&after, 3).await;
    s.wait_for(&[&name], 2).await;
    assert!(running.is_running(), "the consumer is still running");
    running.stop().await;
    s.assert_exactly_once(&[&name], &[flaky.clone(), after])
        .await;
    let row = s.db.row(&s.store, &name, &broken).await.expect("a row");
    assert!(row.dead, "{row:?}");
    let stored = row.last_error.unwrap_or_default();
    assert!(
        stored.contains("can never succeed\u{fffd}"),
        "NUL stored as U+FFFD: {stored:?}"
    );
    let row = s.db.row(&s.store, &name, &crafted).await.expect("a row");
    assert!(row.dead, "{row:?}");
    assert!(
        row.last_error.unwrap_or_default().contains('\u{fffd}'),
        "the decoder's text, NUL replaced"
    );
    let row = s.db.row(&s.store, &name, &flaky).await.expect("a row");
    // A batch handler's failure counts only once the message fails on its own; this one failed
    // in a batch, then succeeded alone.
    let attempts_ok = row.attempts == 1 || (crate::whole_batches() && row.attempts == 0);
    assert!(row.processed && attempts_ok, "{row:?}");
}

/// Dead letters the broker will not take at first (each refused once, as a letter over the
/// broker's size limit is, then not confirmed once), on both ways to the dead-letter destination:
/// a permanent failure (no claim held) and a message out of attempts (dead-lettered under its
/// claim). Each message waits with its consumer until its letter is out — never handed back,
/// which on Kafka would skip it and pin the partition's offset — and is dead-lettered once; the
/// messages behind them are handled once, and the broker settles without a restart (Kafka: lag
/// 0, the committed offset past them).
pub async fn dead_letters_the_broker_refuses_wait<D: TestDb>(
    brokers: &dyn BrokerFactory,
    db: &Arc<D>,
) {
    let s = Scenario::new(brokers, db, Faults::none()).await;
    let name = s.name("refused-dead-letter");
    s.broker.prepare(&s.source, &[&name]).await;
    let (permanent, exhausted) = (s.id(0), s.id(1));
    let good: Vec<String> = (2..=21).map(|i| s.id(i)).collect();
    s.publish(&permanent, 0).await;
    s.publish(&exhausted, 1).await;
    for (i, id) in good.iter().enumerate() {
        s.publish(id, i + 2).await;
    }
    let refusing = Arc::new(RefuseFirstPublishes::new(
        s.broker.transport(),
        s.dead_letter_destination(),
        2,
    ));
    let script = Arc::new(Script {
        permanent: HashSet::from([permanent.clone()]),
        always_fail: HashSet::from([exhausted.clone()]),
        ..Script::default()
    });
    let consumer = s.consumer_on(refusing.clone(), &name, &script);
    let running = Running::start(&consumer, 1);
    s.wait_for(&[&name], good.len()).await;
    let letters = s.dead_letters_of(&[&permanent, &exhausted]).await;
    eventually("settled without a restart", || async {
        s.broker.settled(&s.source, &[&name]).await
    })
    .await;
    running.stop().await;
    s.assert_exactly_once(&[&name], &good).await;
    assert_eq!(refusing.refused(), 4, "every injected refusal was met");
    let mut dead: Vec<&str> = letters
        .iter()
        .map(|l| header(l, dead_letter_headers::MESSAGE_ID))
        .collect();
    dead.sort_unstable();
    assert_eq!(
        dead,
        [permanent.as_str(), exhausted.as_str()],
        "one letter each"
    );
    for id in [&permanent, &exhausted] {
        let row = s.db.row(&s.store, &name, id).await.expect("a dead row");
        assert!(row.dead && !row.processed, "{id}: {row:?}");
    }
    let report = consumer.report();
    assert_eq!(report.dead_lettered, 2, "{report:?}");
    assert_eq!(report.processed, good.len() as u64, "{report:?}");
}
