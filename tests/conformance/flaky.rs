//! A store that can be switched off: every call fails as the database going away would
//! (transient `Unavailable`), and the calls made while it is off are counted. It also counts the
//! transactions begun.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use inbox::store::{CleanupReport, ConsumerStats, DeadLetter};
use inbox::{Claim, ConsumerName, InboxStore, MessageId, StoreError};

#[derive(Clone)]
pub struct FlakyStore<S> {
    inner: S,
    down: Arc<AtomicBool>,
    refused: Arc<AtomicU64>,
    begun: Arc<AtomicU64>,
}

impl<S> FlakyStore<S> {
    pub fn new(inner: S) -> Self {
        Self {
            inner,
            down: Arc::default(),
            refused: Arc::default(),
            begun: Arc::default(),
        }
    }

    pub fn set_down(&self, down: bool) {
        self.down.store(down, Ordering::SeqCst);
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
}

#[async_trait]
impl<S: InboxStore> InboxStore for FlakyStore<S> {
    type Tx = S::Tx;

    async fn migrate(&self) -> Result<(), StoreError> {
        self.check()?;
        self.inner.migrate().await
    }
    async fn begin(&self) -> Result<S::Tx, StoreError> {
        self.check()?;
        self.begun.fetch_add(1, Ordering::SeqCst);
        self.inner.begin().await
    }
    async fn claim(
        &self,
        tx: &mut S::Tx,
        consumer: &ConsumerName,
        id: &MessageId,
    ) -> Result<Claim, StoreError> {
        self.check()?;
        self.inner.claim(tx, consumer, id).await
    }
    async fn claim_batch(
        &self,
        tx: &mut S::Tx,
        consumer: &ConsumerName,
        ids: &[MessageId],
    ) -> Result<Vec<Claim>, StoreError> {
        self.check()?;
        self.inner.claim_batch(tx, consumer, ids).await
    }
    async fn savepoint(&self, tx: &mut S::Tx) -> Result<(), StoreError> {
        self.check()?;
        self.inner.savepoint(tx).await
    }
    async fn rollback_to_savepoint(&self, tx: &mut S::Tx) -> Result<(), StoreError> {
        self.check()?;
        self.inner.rollback_to_savepoint(tx).await
    }
    async fn release_savepoint(&self, tx: &mut S::Tx) -> Result<(), StoreError> {
        self.check()?;
        self.inner.release_savepoint(tx).await
    }
    async fn release_claim(
        &self,
        tx: &mut S::Tx,
        consumer: &ConsumerName,
        id: &MessageId,
        failure: Option<(u32, &str)>,
    ) -> Result<(), StoreError> {
        self.check()?;
        self.inner.release_claim(tx, consumer, id, failure).await
    }
    async fn mark_dead_claimed(
        &self,
        tx: &mut S::Tx,
        consumer: &ConsumerName,
        id: &MessageId,
        attempts: u32,
        reason: &str,
    ) -> Result<(), StoreError> {
        self.check()?;
        self.inner
            .mark_dead_claimed(tx, consumer, id, attempts, reason)
            .await
    }
    async fn commit(&self, tx: S::Tx) -> Result<(), StoreError> {
        self.check()?;
        self.inner.commit(tx).await
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
        self.check()?;
        self.inner
            .record_failure(consumer, id, attempt, error)
            .await
    }
    async fn record_dead(
        &self,
        consumer: &ConsumerName,
        id: &MessageId,
        attempts: u32,
        reason: &str,
    ) -> Result<(), StoreError> {
        self.check()?;
        self.inner.record_dead(consumer, id, attempts, reason).await
    }
    async fn revive(
        &self,
        tx: &mut S::Tx,
        consumer: &ConsumerName,
        id: &MessageId,
    ) -> Result<bool, StoreError> {
        self.check()?;
        self.inner.revive(tx, consumer, id).await
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
        batch_size: u32,
        progress: &(dyn Fn(u64) + Send + Sync),
    ) -> Result<CleanupReport, StoreError> {
        self.check()?;
        self.inner
            .cleanup_with_progress(older_than, batch_size, progress)
            .await
    }
    async fn count_expired(&self, older_than: Duration) -> Result<u64, StoreError> {
        self.check()?;
        self.inner.count_expired(older_than).await
    }
    async fn stats(
        &self,
        consumer: Option<&ConsumerName>,
    ) -> Result<Vec<ConsumerStats>, StoreError> {
        self.check()?;
        self.inner.stats(consumer).await
    }
}
