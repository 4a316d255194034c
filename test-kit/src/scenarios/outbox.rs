//! The outbox: every committed row published, none from a rolled-back transaction; duplicates
//! from relay crashes discarded by the consumer's inbox; several relays at once; per-key order
//! when transactions commit out of order; a poison row that holds back only its key; a broker
//! outage; a drain on shutdown; and the consume-transform-produce chain.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use inbox::memory::Faults;
use inbox::outbox::{Outbox, OutboxStats, OutboxStore, Relay, RelayError, RelayReport};
use inbox::{
    CancellationToken, Consumer, Handler, HandlerError, InboxStore, Message, OutgoingMessage,
    Transport,
};
use tokio::task::JoinHandle;

use super::faults_or_none;
use crate::publishing::{Published, Publishing};
use crate::{BrokerFactory, Running, Scenario, Script, TestDb, TestHandler, eventually};

const TRACEPARENT: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

/// A committed row as a scenario remembers it: (row id, message id, ordering key).
pub type CommittedRow = (i64, String, Option<String>);

fn message(id: &str, key: Option<&str>) -> OutgoingMessage {
    let message = OutgoingMessage::new(id, format!(r#"{{"id":"{id}"}}"#))
        .with_header("traceparent", TRACEPARENT);
    match key {
        Some(key) => message.with_key(key.to_owned()),
        None => message,
    }
}

/// Sends one message in a transaction of its own and commits it through the outbox.
async fn send_committed<S: OutboxStore>(
    outbox: &Outbox<S>,
    destination: &str,
    id: &str,
    key: Option<&str>,
) -> CommittedRow {
    let mut tx = outbox.store().begin().await.expect("begin");
    let sent = outbox
        .send(&mut tx, destination, message(id, key))
        .await
        .expect("send");
    assert!(sent.written, "{id} written");
    outbox.commit(tx).await.expect("commit");
    (sent.row_id, id.to_owned(), key.map(str::to_owned))
}

/// A relay with test-speed settings.
fn relay<S: OutboxStore>(outbox: &Outbox<S>, transport: &Arc<Publishing>) -> Relay<S> {
    outbox
        .relay(Arc::clone(transport) as Arc<dyn Transport>)
        .poll_interval(Duration::from_millis(100))
        .retry_delays(Duration::from_millis(10), Duration::from_millis(100))
}

/// A relay running in the background.
pub struct RunningRelay {
    stop: CancellationToken,
    task: JoinHandle<Result<RelayReport, RelayError>>,
}

impl RunningRelay {
    /// Starts `relay`.
    pub fn start<S: OutboxStore>(relay: Relay<S>) -> Self {
        let stop = CancellationToken::new();
        let token = stop.clone();
        let task = tokio::spawn(async move { relay.run(token).await });
        Self { stop, task }
    }

    /// Stops it (it finishes its batch) and returns its report.
    pub async fn stop(self) -> RelayReport {
        self.stop.cancel();
        tokio::time::timeout(crate::DEADLINE, self.task)
            .await
            .expect("the relay stops within the deadline")
            .expect("the relay task does not panic")
            .expect("the relay stops without error")
    }

    /// Kills it like a crash: whatever it held stays leased until the lease lapses.
    pub async fn kill(self) {
        self.task.abort();
        let _ = self.task.await;
    }
}

async fn pending<S: OutboxStore>(store: &S) -> u64 {
    store
        .outbox_stats()
        .await
        .expect("outbox stats")
        .iter()
        .map(|s| s.pending)
        .sum()
}

async fn wait_until_empty<S: OutboxStore>(store: &S) {
    eventually("every outbox row published", || async {
        match pending(store).await {
            0 => Ok(()),
            n => Err(format!("{n} rows pending")),
        }
    })
    .await;
}

/// Checks a publish log against the rows committed: every committed row published, nothing
/// else, and each key's rows in the order their transactions wrote them (row id order). With
/// `exactly_once`, no row published twice (a quiet run).
pub fn check_published(
    committed: &[CommittedRow],
    log: &[Published],
    exactly_once: bool,
) -> Result<(), String> {
    let mut problems = Vec::new();
    let mut counts: HashMap<&str, usize> = HashMap::new();
    for p in log {
        *counts.entry(p.message_id.as_str()).or_default() += 1;
    }
    for (_, id, _) in committed {
        match counts.remove(id.as_str()) {
            None => problems.push(format!("{id} never published")),
            Some(n) if exactly_once && n > 1 => problems.push(format!("{id} published {n} times")),
            Some(_) => {}
        }
    }
    if !counts.is_empty() {
        problems.push(format!(
            "published but never committed: {:?}",
            counts.keys()
        ));
    }
    let mut by_key: HashMap<&str, Vec<&CommittedRow>> = HashMap::new();
    for row in committed {
        if let Some(key) = &row.2 {
            by_key.entry(key.as_str()).or_default().push(row);
        }
    }
    for (key, mut rows) in by_key {
        rows.sort_by_key(|r| r.0);
        let written: Vec<&str> = rows.iter().map(|r| r.1.as_str()).collect();
        // First publishes only: a duplicate from a lapsed lease may come later, and the
        // consumer's inbox discards it.
        let mut seen = std::collections::HashSet::new();
        let published: Vec<&str> = log
            .iter()
            .filter(|p| p.key.as_deref() == Some(key) && seen.insert(p.message_id.as_str()))
            .map(|p| p.message_id.as_str())
            .collect();
        if published != written {
            let at = written
                .iter()
                .zip(&published)
                .position(|(w, p)| w != p)
                .unwrap_or(written.len().min(published.len()));
            let end = (at + 3).min(written.len().max(published.len()));
            problems.push(format!(
                "key {key}: {} rows written, {} published; from position {at} written {:?}, published {:?}",
                written.len(),
                published.len(),
                written.get(at..end.min(written.len())).unwrap_or_default(),
                published.get(at..end.min(published.len())).unwrap_or_default(),
            ));
        }
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(problems.join("; "))
    }
}

/// Committed rows are published once each in a quiet run and handled once; rows of rolled-back
/// transactions never; a message sent twice (in one transaction, or by a retry of the caller)
/// is one row; a message without an id gets a UUIDv7; headers arrive.
pub async fn outbox_publishes_committed_rows_once<D: TestDb>(
    brokers: &dyn BrokerFactory,
    db: &Arc<D>,
) {
    let s = Scenario::new(brokers, db, Faults::none()).await;
    let name = s.name("outbox");
    s.broker.prepare(&s.source, &[&name]).await;
    let transport = Publishing::new(s.broker.transport());
    let outbox = Outbox::new(s.store.clone());
    let mut committed = Vec::new();
    for i in 0..40 {
        let id = s.id(i);
        let key = (i % 3 != 0).then(|| format!("k{}", i % 4));
        let mut tx = s.store.begin().await.unwrap();
        let sent = outbox
            .send(&mut tx, &s.source, message(&id, key.as_deref()))
            .await
            .unwrap();
        assert!(sent.written);
        if i % 5 == 0 {
            let again = outbox
                .send(&mut tx, &s.source, message(&id, key.as_deref()))
                .await
                .unwrap();
            assert!(!again.written, "the same message twice in one transaction");
            assert_eq!(again.row_id, sent.row_id);
        }
        outbox.commit(tx).await.unwrap();
        committed.push((sent.row_id, id, key));
    }
    for (row_id, id, key) in committed.iter().take(5) {
        let mut tx = s.store.begin().await.unwrap();
        let again = outbox
            .send(&mut tx, &s.source, message(id, key.as_deref()))
            .await
            .unwrap();
        assert!(!again.written, "a retry of the caller writes nothing");
        assert_eq!(again.row_id, *row_id);
        outbox.commit(tx).await.unwrap();
    }
    let rolled_back: Vec<String> = (100..110).map(|i| s.id(i)).collect();
    for (i, id) in rolled_back.iter().enumerate() {
        let mut tx = s.store.begin().await.unwrap();
        let key = format!("k{}", i % 4);
        outbox
            .send(&mut tx, &s.source, message(id, Some(&key)))
            .await
            .unwrap();
        s.store.rollback(tx).await.unwrap();
    }
    let mut tx = s.store.begin().await.unwrap();
    let fresh = outbox
        .send(
            &mut tx,
            &s.source,
            OutgoingMessage {
                payload: "{}".into(),
                ..OutgoingMessage::default()
            }
            .with_header("traceparent", TRACEPARENT),
        )
        .await
        .unwrap();
    outbox.commit(tx).await.unwrap();
    // Through a transaction that writes its messages as it commits: its own statements run
    // through it; the same message twice writes one row; rolled back or dropped, nothing.
    for i in 200..210 {
        let id = s.id(i);
        let key = (i % 2 == 0).then(|| format!("k{}", i % 4));
        let mut tx = outbox.begin().await.unwrap();
        db.write_effect(&mut tx, &format!("{}-tx", s.run), "app", &id)
            .await
            .unwrap();
        assert_eq!(
            tx.send(&s.source, message(&id, key.as_deref())).unwrap(),
            id
        );
        tx.send(&s.source, message(&id, key.as_deref())).unwrap();
        let sent = tx.commit().await.unwrap();
        assert_eq!(sent.len(), 2);
        assert!(sent[0].written && !sent[1].written, "{sent:?}");
        assert_eq!(sent[0].row_id, sent[1].row_id);
        committed.push((sent[0].row_id, id, key));
    }
    // Two messages of one key in one transaction, another key between them: rows (and so
    // publishes) in the order they were staged.
    let mut tx = outbox.begin().await.unwrap();
    let staged = [(s.id(210), "k3"), (s.id(211), "k1"), (s.id(212), "k3")];
    for (id, key) in &staged {
        tx.send(&s.source, message(id, Some(key))).unwrap();
    }
    let sent = tx.commit().await.unwrap();
    assert!(
        sent[0].row_id < sent[2].row_id,
        "staged order within a key: {sent:?}"
    );
    for (sent, (id, key)) in sent.iter().zip(staged) {
        committed.push((sent.row_id, id, Some(key.to_owned())));
    }
    let mut tx = outbox.begin().await.unwrap();
    tx.send(&s.source, message(&s.id(300), Some("k0"))).unwrap();
    tx.rollback().await.unwrap();
    let mut tx = outbox.begin().await.unwrap();
    tx.send(&s.source, message(&s.id(301), None)).unwrap();
    drop(tx);
    assert!(
        outbox
            .begin()
            .await
            .unwrap()
            .send(&s.source, message("", None))
            .is_err(),
        "an invalid id is refused when staged"
    );
    if D::FAILED_STATEMENT_ABORTS {
        // A statement failed and the application went on: the commit must fail (not turn into
        // a silent rollback reported as success), and nothing is written.
        let mut tx = outbox.begin().await.unwrap();
        tx.send(&s.source, message(&s.id(302), None)).unwrap();
        assert!(db.failing_statement(&mut tx).await.is_err());
        let refused = tx.commit().await;
        assert!(refused.is_err(), "{refused:?}");
    }
    let version = uuid::Uuid::parse_str(&fresh.message_id).map(|u| u.get_version_num());
    assert_eq!(
        version,
        Ok(7),
        "a fresh id is a UUIDv7: {}",
        fresh.message_id
    );
    committed.push((fresh.row_id, fresh.message_id.clone(), None));

    let relay = RunningRelay::start(relay(&outbox, &transport));
    let script = Arc::new(Script::default());
    let consumer = s.consumer(&name, &script);
    let running = Running::start(&consumer, 1);
    let ids: Vec<String> = committed.iter().map(|r| r.1.clone()).collect();
    s.wait_for(&[&name], ids.len()).await;
    wait_until_empty(&s.store).await;
    let report = relay.stop().await;
    running.stop().await;
    s.assert_exactly_once(&[&name], &ids).await;
    check_published(&committed, &transport.log(), true).unwrap();
    assert_eq!(report.published, ids.len() as u64, "{report:?}");
    // Where the test broker can show what it holds (memory), the headers arrived.
    for published in s.broker.published(&s.source).await {
        assert_eq!(
            published.headers.get_str("traceparent"),
            Some(TRACEPARENT),
            "{published:?}"
        );
    }
}

/// Four relays, then two, at once without a leader: every row published exactly once in a quiet
/// run, and handled once.
pub async fn outbox_relays_share_the_work<D: TestDb>(brokers: &dyn BrokerFactory, db: &Arc<D>) {
    let s = Scenario::new(brokers, db, Faults::none()).await;
    let name = s.name("relays");
    s.broker.prepare(&s.source, &[&name]).await;
    let transport = Publishing::new(s.broker.transport());
    let outbox = Outbox::new(s.store.clone());
    let script = Arc::new(Script::default());
    let consumer = s.consumer(&name, &script);
    let running = Running::start(&consumer, 2);
    let mut committed = Vec::new();
    let mut next = 0;
    for relays in [4, 2] {
        let started: Vec<RunningRelay> = (0..relays)
            .map(|_| RunningRelay::start(relay(&outbox, &transport).batch_size(16)))
            .collect();
        for _ in 0..120 {
            let key = (next % 2 == 0).then(|| format!("k{}", next % 10));
            committed.push(send_committed(&outbox, &s.source, &s.id(next), key.as_deref()).await);
            next += 1;
        }
        wait_until_empty(&s.store).await;
        let mut published = 0;
        for relay in started {
            published += relay.stop().await.published;
        }
        assert_eq!(published, 120, "{relays} relays published each row once");
        assert_eq!(
            transport.most_in_flight_per_key(),
            1,
            "one publish in flight per key"
        );
    }
    let ids: Vec<String> = committed.iter().map(|r| r.1.clone()).collect();
    s.wait_for(&[&name], ids.len()).await;
    running.stop().await;
    check_published(&committed, &transport.log(), true).unwrap();
    s.assert_exactly_once(&[&name], &ids).await;
}

/// A relay killed between its publishes and its mark, and confirmations lost after the broker
/// took the message: those rows are published again (by another relay, after the lease) and
/// the consumer's inbox discards the copies. One effect each.
pub async fn outbox_relay_dies_between_publish_and_mark<D: TestDb>(
    brokers: &dyn BrokerFactory,
    db: &Arc<D>,
) {
    let s = Scenario::new(brokers, db, Faults::none()).await;
    let name = s.name("relaycrash");
    s.broker.prepare(&s.source, &[&name]).await;
    let transport = Publishing::new(s.broker.transport());
    let outbox = Outbox::new(s.store.clone());
    let ids: Vec<String> = (0..30).map(|i| s.id(i)).collect();
    transport.lose_confirm(&[&ids[20], &ids[21]]);
    transport.stall_after_publish(3);
    let mut committed = Vec::new();
    for (i, id) in ids.iter().enumerate() {
        let key = (i % 2 == 0).then(|| format!("k{}", i % 6));
        committed.push(send_committed(&outbox, &s.source, id, key.as_deref()).await);
    }
    let lease = Duration::from_millis(500);
    let doomed = RunningRelay::start(relay(&outbox, &transport).batch_size(5).lease(lease));
    eventually("the first relay stalls after its publishes", || async {
        match transport.stalled() {
            3 => Ok(()),
            n => Err(format!("{n} of 3 stalled")),
        }
    })
    .await;
    doomed.kill().await;
    let survivor = RunningRelay::start(relay(&outbox, &transport).lease(lease));
    let script = Arc::new(Script::default());
    let consumer = s.consumer(&name, &script);
    let running = Running::start(&consumer, 1);
    wait_until_empty(&s.store).await;
    s.wait_for(&[&name], ids.len()).await;
    survivor.stop().await;
    running.stop().await;
    s.assert_exactly_once(&[&name], &ids).await;
    let log = transport.log();
    check_published(&committed, &log, false).unwrap();
    let twice = ids.iter().filter(|id| transport.count(id) > 1).count();
    assert!(
        twice >= 5,
        "3 stalled and 2 unconfirmed publishes were published again: {twice} were"
    );
    let report = consumer.report();
    assert!(report.duplicates_discarded >= 5, "{report:?}");
}

/// Rows of one key are published in the order their transactions wrote them, also when those
/// transactions commit out of order and when many writers and two relays run at once; rows of
/// rolled-back transactions never. (A relay that reads "id > last seen" loses the row of a
/// transaction that commits late: `tests/memory.rs` shows this check catching it.)
pub async fn outbox_keeps_key_order_under_out_of_order_commits<D: TestDb>(
    brokers: &dyn BrokerFactory,
    db: &Arc<D>,
) {
    let s = Scenario::new(brokers, db, Faults::none()).await;
    let transport = Publishing::new(s.broker.transport());
    let outbox = Outbox::new(s.store.clone());
    s.broker.prepare(&s.source, &[&s.name("sink")]).await;
    let relays: Vec<RunningRelay> = (0..2)
        .map(|_| RunningRelay::start(relay(&outbox, &transport).batch_size(8)))
        .collect();
    let mut committed = Vec::new();
    if D::CONCURRENT_WRITERS {
        // Written first, committed last: a1 (key k0) stays open while b1 (key k1) commits and
        // is published, and while c1 (key k0 again) waits for a1's key.
        let (a1, b1, c1) = (s.id(1), s.id(2), s.id(3));
        let mut tx_a = s.store.begin().await.unwrap();
        let sent_a = outbox
            .send(&mut tx_a, &s.source, message(&a1, Some("k0")))
            .await
            .unwrap();
        committed.push(send_committed(&outbox, &s.source, &b1, Some("k1")).await);
        let c = {
            let (outbox, source, c1) = (outbox.clone(), s.source.clone(), c1.clone());
            tokio::spawn(async move { send_committed(&outbox, &source, &c1, Some("k0")).await })
        };
        eventually(
            "b1, committed after a1 was written, is published",
            || async {
                match transport.count(&b1) {
                    0 => Err("not yet".to_owned()),
                    _ => Ok(()),
                }
            },
        )
        .await;
        assert_eq!(transport.count(&a1), 0, "a1 is not committed yet");
        assert_eq!(transport.count(&c1), 0, "c1 waits for a1's key");
        outbox.commit(tx_a).await.unwrap();
        committed.push((sent_a.row_id, a1, Some("k0".to_owned())));
        committed.push(c.await.unwrap());
    }
    // Many writers at once, each transaction sending to one to three keys (in key order, as the
    // outbox asks, so writers never deadlock; half of them staged through `Outbox::begin`), one
    // in seven rolled back.
    let writers: Vec<JoinHandle<Vec<CommittedRow>>> = (0..6)
        .map(|w| {
            let (outbox, source, run) = (outbox.clone(), s.source.clone(), s.run.clone());
            tokio::spawn(async move {
                let mut mine = Vec::new();
                for t in 0..20usize {
                    let n = w * 1000 + t;
                    let mut keys: Vec<String> = (0..1 + n % 3)
                        .map(|j| format!("k{}", (n * 7 + j * 3) % 4))
                        .collect();
                    keys.sort();
                    keys.dedup();
                    if w % 2 == 1 {
                        // Staged, written at the commit: the keys in any order (the outbox
                        // writes them sorted).
                        keys.reverse();
                        let mut tx = outbox.begin().await.unwrap();
                        let ids: Vec<String> = (0..keys.len())
                            .map(|j| format!("{run}-w{w}-t{t}-{j}"))
                            .collect();
                        for (id, key) in ids.iter().zip(&keys) {
                            tx.send(&source, message(id, Some(key))).unwrap();
                        }
                        if n % 7 == 3 {
                            tx.rollback().await.unwrap();
                        } else {
                            let sent = tx.commit().await.unwrap();
                            for ((sent, id), key) in sent.into_iter().zip(ids).zip(&keys) {
                                mine.push((sent.row_id, id, Some(key.clone())));
                            }
                        }
                        continue;
                    }
                    let mut tx = outbox.store().begin().await.unwrap();
                    let mut rows = Vec::new();
                    for (j, key) in keys.iter().enumerate() {
                        let id = format!("{run}-w{w}-t{t}-{j}");
                        let sent = outbox
                            .send(&mut tx, &source, message(&id, Some(key)))
                            .await
                            .unwrap();
                        rows.push((sent.row_id, id, Some(key.clone())));
                    }
                    if n % 7 == 3 {
                        outbox.store().rollback(tx).await.unwrap();
                    } else {
                        outbox.commit(tx).await.unwrap();
                        mine.extend(rows);
                    }
                }
                mine
            })
        })
        .collect();
    for writer in writers {
        committed.extend(writer.await.unwrap());
    }
    wait_until_empty(&s.store).await;
    for relay in relays {
        relay.stop().await;
    }
    check_published(&committed, &transport.log(), true).unwrap();
    assert_eq!(
        transport.most_in_flight_per_key(),
        1,
        "one publish in flight per key"
    );
}

/// A row the broker refuses is dead after its attempts, with its reason, and holds back the
/// later rows of its key only; other keys and unkeyed rows go on. An operator's retry publishes
/// it (then the rest of its key, in order); a skip drops it and releases its key.
pub async fn outbox_poison_row_holds_back_only_its_key<D: TestDb>(
    brokers: &dyn BrokerFactory,
    db: &Arc<D>,
) {
    let s = Scenario::new(brokers, db, Faults::none()).await;
    // A queue for the messages to land in (RabbitMQ has no route without one).
    s.broker.prepare(&s.source, &[&s.name("sink")]).await;
    let transport = Publishing::new(s.broker.transport());
    let outbox = Outbox::new(s.store.clone());
    let [p1, p2, q1, u1, r1, r2] =
        ["p1", "p2", "q1", "u1", "r1", "r2"].map(|n| format!("{}-{n}", s.run));
    transport.refuse(&[&p1, &r1]);
    // And one the broker never has a route for: dead after its no-route attempts.
    let lost = format!("{}-lost", s.run);
    transport.no_route(&[&lost]);
    let mut committed = Vec::new();
    for (id, key) in [
        (&p1, Some("kp")),
        (&p2, Some("kp")),
        (&q1, Some("kq")),
        (&u1, None),
        (&r1, Some("kr")),
        (&r2, Some("kr")),
    ] {
        committed.push(send_committed(&outbox, &s.source, id, key).await);
    }
    send_committed(&outbox, &s.source, &lost, Some("kl")).await;
    let running = RunningRelay::start(relay(&outbox, &transport).max_no_route_attempts(3));
    eventually(
        "the poison rows are dead and the others published",
        || async {
            let dead = s.store.outbox_dead(10).await.map_err(|e| e.to_string())?;
            if dead.len() != 3 || transport.count(&q1) == 0 || transport.count(&u1) == 0 {
                return Err(format!("dead {dead:?}, published {:?}", transport.log()));
            }
            Ok(())
        },
    )
    .await;
    let dead = s.store.outbox_dead(10).await.unwrap();
    for d in &dead {
        let (reason, attempts) = if d.message_id == lost {
            ("no route", 3)
        } else {
            ("message too large", 1)
        };
        let error = d.last_error.as_deref().unwrap_or_default();
        assert!(error.contains(reason) && d.attempts == attempts, "{d:?}");
    }
    // Nothing of the blocked keys goes out while their heads are dead.
    assert_eq!(relay(&outbox, &transport).run_once().await.unwrap(), 0);
    assert_eq!(transport.count(&p2) + transport.count(&r2), 0);
    let stats = s.store.outbox_stats().await.unwrap();
    let ours = stats.iter().find(|st| st.destination == s.source).unwrap();
    assert_eq!(
        (ours.dead, ours.blocked_keys, ours.pending),
        (3, 3, 5),
        "{ours:?}"
    );

    // The fix is deployed: retry p1; skip r1.
    transport.allow(&[&p1]);
    let p1_row = dead.iter().find(|d| d.message_id == p1).unwrap().id;
    let r1_row = dead.iter().find(|d| d.message_id == r1).unwrap().id;
    assert_eq!(s.store.outbox_retry(Some(&[p1_row])).await.unwrap(), 1);
    let lost_row = dead.iter().find(|d| d.message_id == lost).unwrap().id;
    assert_eq!(s.store.outbox_skip(&[r1_row, lost_row]).await.unwrap(), 2);
    outbox.wake();
    wait_until_empty(&s.store).await;
    running.stop().await;
    committed.retain(|row| row.1 != r1);
    check_published(&committed, &transport.log(), true).unwrap();
    assert_eq!(transport.count(&r1), 0, "a skipped row is never published");
}

/// The broker is down while rows are written: they are retried with backoff and none is dead;
/// once it is back, every row is published and handled once.
pub async fn outbox_broker_outage_then_back<D: TestDb>(brokers: &dyn BrokerFactory, db: &Arc<D>) {
    let s = Scenario::new(brokers, db, Faults::none()).await;
    let name = s.name("outage");
    s.broker.prepare(&s.source, &[&name]).await;
    let transport = Publishing::new(s.broker.transport());
    let outbox = Outbox::new(s.store.clone());
    transport.set_down(true);
    let running_relay = RunningRelay::start(relay(&outbox, &transport));
    let mut committed = Vec::new();
    for i in 0..20 {
        let key = (i % 2 == 0).then(|| format!("k{}", i % 3));
        committed.push(send_committed(&outbox, &s.source, &s.id(i), key.as_deref()).await);
    }
    eventually("rows fail while the broker is down", || async {
        let stats = s.store.outbox_stats().await.map_err(|e| e.to_string())?;
        match stats.first() {
            Some(st) if st.failing >= 5 => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    transport.set_down(false);
    let script = Arc::new(Script::default());
    let consumer = s.consumer(&name, &script);
    let running = Running::start(&consumer, 1);
    wait_until_empty(&s.store).await;
    let ids: Vec<String> = committed.iter().map(|r| r.1.clone()).collect();
    s.wait_for(&[&name], ids.len()).await;
    let report = running_relay.stop().await;
    running.stop().await;
    assert_eq!(report.dead, 0, "an outage makes no row dead: {report:?}");
    assert!(report.failed > 0, "{report:?}");
    check_published(&committed, &transport.log(), true).unwrap();
    s.assert_exactly_once(&[&name], &ids).await;
}

/// Stopped while its batch is in flight, the relay finishes it: the rows are published and
/// marked before `run` returns.
pub async fn outbox_shutdown_drains_the_batch<D: TestDb>(brokers: &dyn BrokerFactory, db: &Arc<D>) {
    let s = Scenario::new(brokers, db, Faults::none()).await;
    // A queue for the messages to land in (RabbitMQ has no route without one).
    s.broker.prepare(&s.source, &[&s.name("sink")]).await;
    let transport = Publishing::new(s.broker.transport());
    let outbox = Outbox::new(s.store.clone());
    transport.set_gate_open(false);
    let mut committed = Vec::new();
    for i in 0..10 {
        committed.push(send_committed(&outbox, &s.source, &s.id(i), None).await);
    }
    let running = RunningRelay::start(relay(&outbox, &transport));
    eventually("the batch is in flight", || async {
        match transport.at_gate() {
            10 => Ok(()),
            n => Err(format!("{n} of 10 publishes in flight")),
        }
    })
    .await;
    running.stop.cancel();
    transport.set_gate_open(true);
    let report = running.stop().await;
    assert_eq!(report.published, 10, "{report:?}");
    assert_eq!(
        pending(&s.store).await,
        0,
        "the batch was marked before run returned"
    );
    check_published(&committed, &transport.log(), true).unwrap();
}

/// Retention: published rows are kept for the window — counted by `outbox stats` but not read by
/// the relay's gauges, and a send of a kept message id writes nothing — then deleted in bounded
/// batches once they are older than the window.
pub async fn outbox_retention_keeps_then_deletes<D: TestDb>(
    brokers: &dyn BrokerFactory,
    db: &Arc<D>,
) {
    let s = Scenario::new(brokers, db, Faults::none()).await;
    s.broker.prepare(&s.source, &[&s.name("sink")]).await;
    let transport = Publishing::new(s.broker.transport());
    let outbox = Outbox::new(s.store.clone());
    let mut committed = Vec::new();
    for i in 0..10 {
        let key = (i % 2 == 0).then(|| format!("k{}", i % 3));
        committed.push(send_committed(&outbox, &s.source, &s.id(i), key.as_deref()).await);
    }
    let mine = |stats: Vec<OutboxStats>| stats.into_iter().find(|st| st.destination == s.source);
    let kept = RunningRelay::start(relay(&outbox, &transport).retention(Duration::from_secs(3600)));
    eventually("every row published and kept", || async {
        match mine(s.store.outbox_stats().await.map_err(|e| e.to_string())?) {
            Some(st) if st.pending == 0 && st.published_kept == 10 => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    let report = kept.stop().await;
    assert_eq!((report.published, report.cleaned), (10, 0), "{report:?}");
    check_published(&committed, &transport.log(), true).unwrap();
    // The gauges' counts leave the kept rows out (that they do not read them either is
    // PostgreSQL's plan test, in tests/memory.rs).
    let gauges = mine(s.store.outbox_pending_stats().await.unwrap());
    assert!(
        gauges
            .as_ref()
            .is_none_or(|st| st.pending == 0 && st.published_kept == 0),
        "{gauges:?}"
    );
    // Kept, a message id is still known: the caller's retry writes nothing.
    let mut tx = s.store.begin().await.unwrap();
    let again = outbox
        .send(&mut tx, &s.source, message(&s.id(3), None))
        .await
        .unwrap();
    assert!(!again.written, "a retry within the retention wrote a row");
    outbox.commit(tx).await.unwrap();
    // Bounded batches, and nothing younger than the window.
    assert_eq!(
        s.store
            .outbox_cleanup(Duration::from_secs(3600), 1000)
            .await
            .unwrap(),
        0
    );
    assert_eq!(s.store.outbox_cleanup(Duration::ZERO, 3).await.unwrap(), 3);
    // A relay with a short window deletes the rest by itself, and, at its next rounds, what it
    // publishes meanwhile.
    let cleaning = RunningRelay::start(
        relay(&outbox, &transport)
            .retention(Duration::from_millis(1))
            .cleanup_interval(Duration::from_millis(20)),
    );
    let gone = || async {
        match mine(s.store.outbox_stats().await.map_err(|e| e.to_string())?) {
            None => Ok(()),
            other => Err(format!("{other:?}")),
        }
    };
    eventually("the kept rows deleted", gone).await;
    for i in 10..15 {
        committed.push(send_committed(&outbox, &s.source, &s.id(i), None).await);
    }
    eventually("the rows published since deleted too", gone).await;
    let report = cleaning.stop().await;
    assert_eq!(report.published, 5, "{report:?}");
    assert!(report.cleaned >= 12, "{report:?}");
    check_published(&committed, &transport.log(), true).unwrap();
}

/// A handler that writes its effect and sends a message on, both through its inbox transaction.
struct Forward<D: TestDb> {
    inner: TestHandler<D>,
    outbox: Outbox<D::Store>,
    to: String,
}

#[async_trait]
impl<D: TestDb> Handler<<D::Store as InboxStore>::Tx> for Forward<D> {
    async fn handle(
        &self,
        message: &Message<'_>,
        tx: &mut <D::Store as InboxStore>::Tx,
    ) -> Result<(), HandlerError> {
        self.inner.handle(message, tx).await?;
        let onward = OutgoingMessage::new(format!("{}.out", message.id), message.payload.to_vec())
            .with_key(message.id.as_str().to_owned());
        self.outbox.send(tx, &self.to, onward).await?;
        Ok(())
    }
}

/// Consume, transform, produce: a consumer's handler sends a message on through its inbox
/// transaction; the relay publishes it; a second consumer handles it. Under duplicates (and,
/// where the broker injects them, lost acks), every message is handled once at each step.
pub async fn outbox_consume_transform_produce<D: TestDb>(brokers: &dyn BrokerFactory, db: &Arc<D>) {
    let faults = Faults::seeded(23).duplicate_publish(0.3).lose_ack(0.2);
    let s = Scenario::new(brokers, db, faults_or_none(brokers, faults)).await;
    let (first, second) = (s.name("transform"), s.name("downstream"));
    let onward = format!("{}.out", s.source);
    s.broker.prepare(&s.source, &[&first]).await;
    s.broker.prepare(&onward, &[&second]).await;
    let transport = Publishing::new(s.broker.transport());
    let outbox = Outbox::new(s.store.clone());
    let script = Arc::new(Script::default());
    let forward = Forward {
        inner: s.handler(&script),
        outbox: outbox.clone(),
        to: onward.clone(),
    };
    let transform = Consumer::new(
        first.clone(),
        s.source.clone(),
        s.broker.transport(),
        s.store.clone(),
        forward,
    )
    .after_commit(outbox.after_commit());
    let downstream = Consumer::new(
        second.clone(),
        onward.clone(),
        s.broker.transport(),
        s.store.clone(),
        s.handler(&script),
    );
    let running = (
        Running::start(&transform, 2),
        Running::start(&downstream, 1),
    );
    let relay = RunningRelay::start(relay(&outbox, &transport));
    let ids: Vec<String> = (0..40).map(|i| s.id(i)).collect();
    for (i, id) in ids.iter().enumerate() {
        s.publish(id, i).await;
        if i % 4 == 0 {
            s.publish(id, i).await;
        }
    }
    let expected: Vec<(String, String)> = ids
        .iter()
        .map(|id| (first.to_string(), id.clone()))
        .chain(
            ids.iter()
                .map(|id| (second.to_string(), format!("{id}.out"))),
        )
        .collect();
    eventually("every message handled at both steps", || async {
        let effects = s.effects().await;
        let missing = expected
            .iter()
            .filter(|k| !effects.contains_key(*k))
            .count();
        match missing {
            0 => Ok(()),
            n => Err(format!("{n} of {} effects missing", expected.len())),
        }
    })
    .await;
    wait_until_empty(&s.store).await;
    relay.stop().await;
    running.0.stop().await;
    running.1.stop().await;
    let effects = s.effects().await;
    let wrong: Vec<_> = effects.iter().filter(|(_, n)| **n != 1).collect();
    assert!(wrong.is_empty(), "exactly once at each step: {wrong:?}");
    assert_eq!(effects.len(), expected.len(), "{effects:?}");
    let forwarded = transport
        .log()
        .iter()
        .filter(|p| p.destination == onward)
        .map(|p| p.message_id.clone())
        .collect::<std::collections::HashSet<_>>();
    assert_eq!(
        forwarded.len(),
        ids.len(),
        "one outbox row per consumed message"
    );
}
