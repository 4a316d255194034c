//! Batch handlers: a batch that fails is split until the failing message is alone, its
//! batch-mates commit without using up an attempt, and a failure of the whole batch (a
//! deadlock) retries the whole batch.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use inbox::memory::Faults;
use inbox::{
    BatchError, BatchHandler, Batched, Batching, Consumer, HandlerError, InboxStore, Message,
    RetryPolicy,
};

use crate::{BrokerFactory, Running, Scenario, TestDb, eventually};

/// Writes each message's effect; fails the way its fields say.
struct Picky<D: TestDb> {
    db: Arc<D>,
    run: String,
    /// Fails permanently, naming no message.
    poison: String,
    /// Fails transiently the first time it is reached, naming itself.
    flaky: String,
    flaky_failed: AtomicBool,
    /// The first call with more than one message fails as a whole, transiently (a deadlock).
    deadlock: AtomicBool,
    /// The ids of each call, in order.
    calls: Mutex<Vec<Vec<String>>>,
}

#[async_trait]
impl<D: TestDb> BatchHandler<<D::Store as InboxStore>::Tx> for Picky<D> {
    async fn handle_batch(
        &self,
        messages: &[Message<'_>],
        tx: &mut <D::Store as InboxStore>::Tx,
    ) -> Result<(), BatchError> {
        let ids: Vec<String> = messages.iter().map(|m| m.id.to_string()).collect();
        self.calls.lock().unwrap().push(ids);
        if messages.len() > 1 && self.deadlock.swap(false, Ordering::SeqCst) {
            return Err(HandlerError::transient("deadlock detected").into());
        }
        for message in messages {
            let id = message.id.as_str();
            self.db
                .write_effect(tx, &self.run, message.consumer.as_str(), id)
                .await?;
            if id == self.poison {
                return Err(HandlerError::permanent(format!("{id} cannot be booked")).into());
            }
            if id == self.flaky && !self.flaky_failed.swap(true, Ordering::SeqCst) {
                return Err(BatchError::message(
                    message.id,
                    HandlerError::transient("carrier busy"),
                ));
            }
        }
        Ok(())
    }
}

/// Sixteen messages in one batch: the first call deadlocks (the whole batch is tried again), one
/// message can never succeed (no name: found by halving) and one fails once (named: run alone).
/// Every other message is handled once and commits without a failed attempt; the poison is
/// dead-lettered after one attempt of its own; the flaky one succeeds alone (on an ordered
/// transport it waits behind the poison, and its failure there, alone, is an attempt).
pub async fn whole_batches_isolate_the_failing_message<D: TestDb>(
    brokers: &dyn BrokerFactory,
    db: &Arc<D>,
) {
    let s = Scenario::new(brokers, db, Faults::none()).await;
    let name = s.name("whole");
    s.broker.prepare(&s.source, &[&name]).await;
    let ids: Vec<String> = (0..16).map(|i| s.id(i)).collect();
    let handler = Arc::new(Picky {
        db: Arc::clone(db),
        run: s.run.clone(),
        poison: ids[5].clone(),
        flaky: ids[9].clone(),
        flaky_failed: AtomicBool::new(false),
        deadlock: AtomicBool::new(true),
        calls: Mutex::new(Vec::new()),
    });
    let consumer = Consumer::new(
        name.clone(),
        s.source.clone(),
        s.broker.transport(),
        s.store.clone(),
        Batched(Arc::clone(&handler)),
    )
    .batch(Batching::new(16, Duration::from_millis(500)))
    .concurrency(1)
    .retry(
        RetryPolicy::default()
            .with_max_attempts(3)
            .with_delays(Duration::from_millis(5), Duration::from_millis(20)),
    );
    // Running first, so that the sixteen arrive together as fresh deliveries (on Kafka the first
    // record of a partition after an assignment may be a redelivery, which is never batched).
    let running = Running::start(&consumer, 1);
    let warm_up = s.id(100);
    s.publish(&warm_up, 100).await;
    s.wait_for(&[&name], 1).await;
    for (i, id) in ids.iter().enumerate() {
        s.publish(id, i).await;
    }
    eventually("the poison dead, the rest handled", || async {
        let poison = s.db.row(&s.store, &name, &ids[5]).await;
        let handled = s.effects().await.len();
        match poison {
            Some(row) if row.dead && handled == 16 => Ok(()),
            other => Err(format!("{handled} handled; poison {other:?}")),
        }
    })
    .await;
    running.stop().await;
    let report = consumer.report();
    assert!(report.batch_splits >= 1, "splits are counted: {report:?}");
    let effects = s.effects().await;
    for (i, id) in ids.iter().enumerate() {
        let row = s.db.row(&s.store, &name, id).await.expect("an inbox row");
        if i == 5 {
            assert!(row.dead && !row.processed, "{id}: {row:?}");
            assert_eq!(effects.get(&(name.as_str().to_owned(), id.clone())), None);
            continue;
        }
        assert!(row.processed, "{id}: {row:?}");
        // The flaky one is reached first alone where it waits behind the poison (an ordered
        // transport's partition); then its one failure is an attempt.
        let allowed = if i == 9 { 1 } else { 0 };
        assert!(
            row.attempts <= allowed,
            "{id} never failed on its own, so no attempt is counted: {row:?}"
        );
        assert_eq!(
            effects.get(&(name.as_str().to_owned(), id.clone())),
            Some(&1),
            "{id}: one effect"
        );
    }
    let poison = s.db.row(&s.store, &name, &ids[5]).await.unwrap();
    assert!(poison.attempts <= 1, "{poison:?}");
    let calls = handler.calls.lock().unwrap().clone();
    // (Where a transport marks the first record of a partition as a possible redelivery —
    // Kafka — that one goes the per-message way, a call of its own, before its batch.)
    let first = calls
        .iter()
        .position(|c| c.len() > 1)
        .unwrap_or_else(|| panic!("a batch: {calls:?}"));
    assert_eq!(
        calls.get(first + 1),
        Some(&calls[first]),
        "the deadlocked batch tried again whole: {calls:?}"
    );
    assert!(
        calls[first + 2..]
            .iter()
            .any(|c| c.len() >= 2 && !c.contains(&ids[5]) && !c.contains(&ids[9])),
        "batch-mates committed in batches of their own, not one by one: {calls:?}"
    );
    let alone = |id: &str| calls.iter().any(|c| c.len() == 1 && c[0] == id);
    assert!(
        alone(&ids[5]) && alone(&ids[9]),
        "the culprits ran alone: {calls:?}"
    );
    for (i, id) in ids.iter().enumerate() {
        if i != 5 && i != 9 {
            let failed_alone = calls
                .windows(2)
                .any(|w| w[0].len() == 1 && w[0][0] == *id && w[1].len() == 1 && w[1][0] == *id);
            assert!(!failed_alone, "{id} was retried alone: {calls:?}");
        }
    }
}
