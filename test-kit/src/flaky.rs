//! A store wrapper that injects faults as fine as the world's: the whole database switched off
//! (every call fails as a lost connection would), or one chosen method failing — for one message
//! id or for any, a number of times, transiently or permanently — including a commit that is
//! applied but whose reply is lost. From a seed, it fails calls at random. It also counts the
//! transactions begun and the calls refused.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use futures::stream::BoxStream;
use inbox::OutgoingMessage;
use inbox::outbox::{OutboxBatch, OutboxDeadRow, OutboxStats, OutboxStore, Staged};
use inbox::store::{Claim, ConsumerStats, DeadLetter, OffsetClaim};
use inbox::{
    CleanupPace, CleanupReport, ConsumerName, InboxAdmin, InboxStore, MessageId, StoreError,
};

/// The store methods a fault can be aimed at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    /// `begin`: a transaction.
    Begin,
    /// `claim`: one message's row.
    Claim,
    /// `claim_batch`: many rows in one statement.
    ClaimBatch,
    /// `savepoint` before a handler in a batch.
    Savepoint,
    /// `rollback_to_savepoint` after a handler failed in a batch.
    RollbackToSavepoint,
    /// `release_savepoint` after a handler succeeded in a batch.
    ReleaseSavepoint,
    /// `release_claim`: a batch-mate's claim given back.
    ReleaseClaim,
    /// `mark_dead_claimed`: a claimed row dead-lettered in the transaction.
    MarkDeadClaimed,
    /// `commit` of the inbox transaction.
    Commit,
    /// `record_failure`, in its own transaction.
    RecordFailure,
    /// `record_dead`, in its own transaction.
    RecordDead,
    /// `note_delivery`: the attempt counted before a handler runs.
    NoteDelivery,
    /// `revive`: a dead letter made claimable again (replay).
    Revive,
    /// `claim_offsets`: offsets mode's claim of a partition's records.
    ClaimOffsets,
    /// `set_next_offset`: a batch's partition offset set back to its first unfinished record.
    SetNextOffset,
    /// `insert_outbox`: an outbox row written at once (`Outbox::send`).
    InsertOutbox,
    /// `commit_outbox`: an `OutboxTx`'s staged rows written and committed (a lost reply: applied).
    CommitOutbox,
    /// `claim_outbox`: a relay's batch.
    ClaimOutbox,
    /// `outbox_pending_stats`: a relay's sample for its gauges.
    OutboxPendingStats,
    /// `outbox_cleanup`: a relay's retention pass.
    OutboxCleanup,
}

/// What an injected fault does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Fails before reaching the database, as a lost connection (transient).
    Unavailable,
    /// Fails before reaching the database, as a statement the database refuses (permanent).
    Refused,
    /// Commit only: the commit is applied, then the reply is lost (transient error).
    CommitAppliedReplyLost,
}

struct Injected {
    method: Method,
    id: Option<String>,
    fault: Fault,
    remaining: u32,
}

/// A store that fails where it is told to (see the module's docs); clones share the faults.
#[derive(Clone)]
pub struct FlakyStore<S> {
    inner: S,
    down: Arc<AtomicBool>,
    refused: Arc<AtomicU64>,
    begun: Arc<AtomicU64>,
    injected: Arc<Mutex<Vec<Injected>>>,
    /// (state of a SplitMix64, probability of a transient fault per call).
    random: Option<Arc<Mutex<(u64, f64)>>>,
    /// Faults that fired, per method (for assertions that the fault really happened).
    fired: Arc<Mutex<Vec<(Method, Fault)>>>,
}

impl<S> FlakyStore<S> {
    /// Wraps `inner`, with no fault yet.
    pub fn new(inner: S) -> Self {
        Self {
            inner,
            down: Arc::default(),
            refused: Arc::default(),
            begun: Arc::default(),
            injected: Arc::default(),
            random: None,
            fired: Arc::default(),
        }
    }

    /// Every call of a method that reaches the database fails transiently with `probability`
    /// (a commit: half of them applied, reply lost), decided by a generator seeded with `seed`.
    pub fn seeded(inner: S, seed: u64, probability: f64) -> Self {
        Self {
            random: Some(Arc::new(Mutex::new((seed, probability)))),
            ..Self::new(inner)
        }
    }

    /// Switches the whole database off (every call fails as a lost connection) or on again.
    pub fn set_down(&self, down: bool) {
        self.down.store(down, Ordering::SeqCst);
    }

    /// The next `times` calls of `method` (for message `id`, where given) fail with `fault`.
    pub fn inject(&self, method: Method, id: Option<&str>, fault: Fault, times: u32) {
        self.injected.lock().unwrap().push(Injected {
            method,
            id: id.map(str::to_owned),
            fault,
            remaining: times,
        });
    }

    /// The faults that fired so far.
    pub fn fired(&self) -> Vec<(Method, Fault)> {
        self.fired.lock().unwrap().clone()
    }

    /// Transactions begun since the start.
    pub fn begun(&self) -> u64 {
        self.begun.load(Ordering::SeqCst)
    }

    /// Calls refused since the start.
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::SeqCst)
    }

    fn check(&self) -> Result<(), StoreError> {
        if self.down.load(Ordering::SeqCst) {
            self.refused.fetch_add(1, Ordering::SeqCst);
            Err(StoreError::Unavailable(
                "connection refused (the test switched the database off)".into(),
            ))
        } else {
            Ok(())
        }
    }

    /// The fault for this call, if one is due.
    fn fault(&self, method: Method, id: Option<&MessageId>) -> Option<Fault> {
        let scripted = {
            let mut injected = self.injected.lock().unwrap();
            let due = injected.iter_mut().find(|f| {
                f.remaining > 0
                    && f.method == method
                    && f.id
                        .as_deref()
                        .is_none_or(|want| id.is_some_and(|id| id.as_str() == want))
            });
            due.map(|f| {
                f.remaining -= 1;
                f.fault
            })
        };
        let fault = scripted.or_else(|| {
            let random = self.random.as_ref()?;
            let mut random = random.lock().unwrap();
            let draw = splitmix(&mut random.0);
            if draw >= random.1 {
                return None;
            }
            Some(
                if method == Method::Commit && splitmix(&mut random.0) < 0.5 {
                    Fault::CommitAppliedReplyLost
                } else {
                    Fault::Unavailable
                },
            )
        })?;
        self.fired.lock().unwrap().push((method, fault));
        Some(fault)
    }

    /// Fails the call if the database is off or a fault (other than a lost commit reply) is due.
    fn enter(&self, method: Method, id: Option<&MessageId>) -> Result<(), StoreError> {
        self.check()?;
        match self.fault(method, id) {
            None | Some(Fault::CommitAppliedReplyLost) => Ok(()),
            Some(fault) => Err(error_of(fault)),
        }
    }
}

impl<S: InboxStore> FlakyStore<S> {
    /// Ends `tx` by `commit` (`method`'s call), or with its fault: rolled back, or — a lost
    /// reply — committed and then failed.
    async fn commit_with<T, F>(
        &self,
        method: Method,
        tx: S::Tx,
        commit: impl FnOnce(S::Tx) -> F,
    ) -> Result<T, StoreError>
    where
        F: std::future::Future<Output = Result<T, StoreError>>,
    {
        self.check()?;
        match self.fault(method, None) {
            None => commit(tx).await,
            Some(Fault::CommitAppliedReplyLost) => {
                commit(tx).await?;
                Err(error_of(Fault::CommitAppliedReplyLost))
            }
            Some(fault) => {
                let _ = self.inner.rollback(tx).await;
                Err(error_of(fault))
            }
        }
    }
}

fn error_of(fault: Fault) -> StoreError {
    match fault {
        Fault::Unavailable => StoreError::Unavailable("injected: connection lost".into()),
        Fault::Refused => StoreError::Database("injected: the database refused this".into()),
        Fault::CommitAppliedReplyLost => {
            StoreError::Unavailable("injected: connection lost after COMMIT was sent".into())
        }
    }
}

/// A uniform draw in [0, 1) from a SplitMix64 state.
fn splitmix(state: &mut u64) -> f64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    (z >> 11) as f64 / (1u64 << 53) as f64
}

#[async_trait]
impl<S: InboxStore> InboxStore for FlakyStore<S> {
    type Tx = S::Tx;

    async fn begin(&self) -> Result<S::Tx, StoreError> {
        self.enter(Method::Begin, None)?;
        self.begun.fetch_add(1, Ordering::SeqCst);
        self.inner.begin().await
    }

    async fn claim(
        &self,
        tx: &mut S::Tx,
        consumer: &ConsumerName,
        id: &MessageId,
    ) -> Result<Claim, StoreError> {
        self.enter(Method::Claim, Some(id))?;
        self.inner.claim(tx, consumer, id).await
    }

    async fn claim_batch(
        &self,
        tx: &mut S::Tx,
        consumer: &ConsumerName,
        ids: &[MessageId],
    ) -> Result<Vec<Claim>, StoreError> {
        self.enter(Method::ClaimBatch, None)?;
        self.inner.claim_batch(tx, consumer, ids).await
    }

    async fn claim_offsets(
        &self,
        tx: &mut S::Tx,
        consumer: &ConsumerName,
        topic: &str,
        partition: i32,
        range: (i64, i64),
    ) -> Result<OffsetClaim, StoreError> {
        self.enter(Method::ClaimOffsets, None)?;
        self.inner
            .claim_offsets(tx, consumer, topic, partition, range)
            .await
    }

    async fn set_next_offset(
        &self,
        tx: &mut S::Tx,
        consumer: &ConsumerName,
        topic: &str,
        partition: i32,
        next: i64,
    ) -> Result<(), StoreError> {
        self.enter(Method::SetNextOffset, None)?;
        self.inner
            .set_next_offset(tx, consumer, topic, partition, next)
            .await
    }

    async fn next_offset(
        &self,
        consumer: &ConsumerName,
        topic: &str,
        partition: i32,
    ) -> Result<Option<i64>, StoreError> {
        self.inner.next_offset(consumer, topic, partition).await
    }

    fn max_batch(&self) -> Option<usize> {
        self.inner.max_batch()
    }

    async fn savepoint(&self, tx: &mut S::Tx) -> Result<(), StoreError> {
        self.enter(Method::Savepoint, None)?;
        self.inner.savepoint(tx).await
    }

    async fn rollback_to_savepoint(&self, tx: &mut S::Tx) -> Result<(), StoreError> {
        self.enter(Method::RollbackToSavepoint, None)?;
        self.inner.rollback_to_savepoint(tx).await
    }

    async fn release_savepoint(&self, tx: &mut S::Tx) -> Result<(), StoreError> {
        self.enter(Method::ReleaseSavepoint, None)?;
        self.inner.release_savepoint(tx).await
    }

    async fn release_claim(
        &self,
        tx: &mut S::Tx,
        consumer: &ConsumerName,
        id: &MessageId,
        failure: Option<(u32, &str)>,
    ) -> Result<(), StoreError> {
        self.enter(Method::ReleaseClaim, Some(id))?;
        self.inner.release_claim(tx, consumer, id, failure).await
    }

    async fn record_dead_in(
        &self,
        tx: &mut S::Tx,
        consumer: &ConsumerName,
        id: &MessageId,
        attempts: u32,
        reason: &str,
    ) -> Result<(), StoreError> {
        self.enter(Method::MarkDeadClaimed, Some(id))?;
        self.inner
            .record_dead_in(tx, consumer, id, attempts, reason)
            .await
    }

    async fn commit(&self, tx: S::Tx) -> Result<(), StoreError> {
        self.commit_with(Method::Commit, tx, |tx| self.inner.commit(tx))
            .await
    }

    async fn rollback(&self, tx: S::Tx) -> Result<(), StoreError> {
        self.inner.rollback(tx).await
    }

    async fn record_failure(
        &self,
        consumer: &ConsumerName,
        id: &MessageId,
        attempt: u32,
        error: &str,
    ) -> Result<u32, StoreError> {
        self.enter(Method::RecordFailure, Some(id))?;
        self.inner
            .record_failure(consumer, id, attempt, error)
            .await
    }

    async fn record_delivery(
        &self,
        consumer: &ConsumerName,
        id: &MessageId,
    ) -> Result<u32, StoreError> {
        self.enter(Method::NoteDelivery, Some(id))?;
        self.inner.record_delivery(consumer, id).await
    }

    async fn record_dead(
        &self,
        consumer: &ConsumerName,
        id: &MessageId,
        attempts: u32,
        reason: &str,
    ) -> Result<(), StoreError> {
        self.enter(Method::RecordDead, Some(id))?;
        self.inner.record_dead(consumer, id, attempts, reason).await
    }

    async fn revive_in(
        &self,
        tx: &mut S::Tx,
        consumer: &ConsumerName,
        id: &MessageId,
    ) -> Result<bool, StoreError> {
        self.enter(Method::Revive, Some(id))?;
        self.inner.revive_in(tx, consumer, id).await
    }

    async fn stats(
        &self,
        consumer: Option<&ConsumerName>,
    ) -> Result<Vec<ConsumerStats>, StoreError> {
        self.check()?;
        self.inner.stats(consumer).await
    }
}

#[async_trait]
impl<S: InboxAdmin> InboxAdmin for FlakyStore<S> {
    async fn migrate(&self) -> Result<(), StoreError> {
        self.check()?;
        self.inner.migrate().await
    }

    async fn dead_letters(
        &self,
        consumer: Option<&ConsumerName>,
        limit: u32,
    ) -> Result<Vec<DeadLetter>, StoreError> {
        self.check()?;
        self.inner.dead_letters(consumer, limit).await
    }

    async fn cleanup_with_progress(
        &self,
        older_than: Duration,
        pace: CleanupPace,
        progress: &(dyn Fn(u64) + Send + Sync),
    ) -> Result<CleanupReport, StoreError> {
        self.check()?;
        self.inner
            .cleanup_with_progress(older_than, pace, progress)
            .await
    }

    async fn count_expired(&self, older_than: Duration) -> Result<u64, StoreError> {
        self.check()?;
        self.inner.count_expired(older_than).await
    }
}

/// The outbox's store methods, with faults on those a relay or a producer calls in its loop;
/// the operator's pass through (failing only while the database is off).
#[async_trait]
impl<S: OutboxStore> OutboxStore for FlakyStore<S> {
    async fn insert_outbox(
        &self,
        tx: &mut S::Tx,
        destination: &str,
        message_id: &str,
        message: &OutgoingMessage,
        ordering_key: Option<&str>,
    ) -> Result<(i64, bool), StoreError> {
        self.enter(Method::InsertOutbox, None)?;
        self.inner
            .insert_outbox(tx, destination, message_id, message, ordering_key)
            .await
    }

    async fn commit_outbox(
        &self,
        tx: S::Tx,
        staged: &[Staged],
    ) -> Result<Vec<(i64, bool)>, StoreError> {
        self.commit_with(Method::CommitOutbox, tx, |tx| {
            self.inner.commit_outbox(tx, staged)
        })
        .await
    }

    async fn claim_outbox(&self, limit: u32, lease: Duration) -> Result<OutboxBatch, StoreError> {
        self.enter(Method::ClaimOutbox, None)?;
        self.inner.claim_outbox(limit, lease).await
    }

    async fn outbox_pending_stats(&self) -> Result<Vec<OutboxStats>, StoreError> {
        self.enter(Method::OutboxPendingStats, None)?;
        self.inner.outbox_pending_stats().await
    }

    async fn outbox_kept(&self) -> Result<Vec<(String, u64)>, StoreError> {
        self.check()?;
        self.inner.outbox_kept().await
    }

    async fn outbox_dead(&self, limit: u32) -> Result<Vec<OutboxDeadRow>, StoreError> {
        self.check()?;
        self.inner.outbox_dead(limit).await
    }

    async fn outbox_retry(&self, ids: Option<&[i64]>) -> Result<u64, StoreError> {
        self.check()?;
        self.inner.outbox_retry(ids).await
    }

    async fn outbox_skip(&self, ids: &[i64]) -> Result<u64, StoreError> {
        self.check()?;
        self.inner.outbox_skip(ids).await
    }

    async fn outbox_cleanup(&self, older_than: Duration, limit: u32) -> Result<u64, StoreError> {
        self.enter(Method::OutboxCleanup, None)?;
        self.inner.outbox_cleanup(older_than, limit).await
    }

    async fn signal_relays(&self) -> Result<(), StoreError> {
        self.check()?;
        self.inner.signal_relays().await
    }

    async fn relay_signals(&self) -> Result<Option<BoxStream<'static, ()>>, StoreError> {
        self.check()?;
        self.inner.relay_signals().await
    }
}
