//! Store errors met on the way: which stop the consumer, which are one write's conflict, and which
//! are an outage to wait out behind the shared gate.

use std::time::Duration;

use super::Run;
use super::run::{next_delay, sleep_unless_stopped};
use crate::error::{ConsumerError, StoreError};
use crate::store::InboxStore;

impl<S: InboxStore, H> Run<S, H> {
    /// A store error on the way to a claim. Permanent ones stop the consumer: before a claim
    /// they are the schema's or the configuration's (a missing table), not one message's.
    /// Conflicts (a deadlock, a serialization failure, a busy SQLite) are retried after a short
    /// backoff: they are what concurrent copies do, not an outage. Anything else transient is an
    /// outage: one task probes with backoff, the others wait for it. Returns false when shutdown
    /// came first.
    pub(super) async fn wait_out_store_error(
        &self,
        error: StoreError,
        retry_delays: &mut impl Iterator<Item = Duration>,
    ) -> Result<bool, ConsumerError> {
        if !error.is_transient() {
            tracing::error!(error = %error, "inbox store failed permanently; stopping the consumer");
            self.stop.cancel();
            return Err(ConsumerError::Store(error));
        }
        if matches!(error, StoreError::Conflict(_) | StoreError::Aborted(_)) {
            tracing::debug!(error = %error, "claim conflicted; retrying");
            return Ok(sleep_unless_stopped(next_delay(retry_delays), &self.stop).await);
        }
        Ok(self.store_outage.failed(&error, &self.stop).await)
    }

    /// Runs a bookkeeping write in its own transaction until it succeeds, waiting out transient
    /// errors through the outage gate. `Ok(None)`: shutdown came first; `Err`: a permanent
    /// error, which belongs to this message (the claim worked, so the schema is fine).
    pub(super) async fn retry_store<T, F, Fut>(&self, mut write: F) -> Result<Option<T>, StoreError>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T, StoreError>>,
    {
        let mut conflicts = self.settings.retry.delays();
        loop {
            match write().await {
                Ok(value) => {
                    self.store_outage.succeeded();
                    return Ok(Some(value));
                }
                // A deadlock or serialization failure is this write's, not an outage.
                Err(StoreError::Conflict(_)) => {
                    if !sleep_unless_stopped(next_delay(&mut conflicts), &self.stop).await {
                        return Ok(None);
                    }
                }
                Err(e) if e.is_transient() => {
                    if !self.store_outage.failed(&e, &self.stop).await {
                        return Ok(None);
                    }
                }
                Err(e) => return Err(e),
            }
        }
    }
}
