//! Batch mode with a [`BatchHandler`]: the claimed messages handled in one call, in one
//! transaction with no savepoints. A batch that fails is rolled back; a failure the batch owns (a
//! permanent error, one naming a message, a panic, the handler timeout) is isolated by running
//! the parts before and after the named message — or the two halves — as batches of their own,
//! down to single messages. A single message goes the per-message way (a batch of one, through
//! the same handler), which counts its attempt if it fails, retries it or dead-letters it; on an
//! ordered transport it is tried alone first, so that an innocent one does not hold back its
//! partition. Its batch-mates never use up an attempt. A transient error that names no message
//! (a deadlock, a lost connection) is the infrastructure's: the whole batch is tried again after
//! a pause, twice, then its messages go the per-message way.

use std::collections::{HashSet, VecDeque};
use std::ops::Range;

use super::Run;
use super::batch::Fate;
use super::decision::{self, Facts, OnClaim};
use super::delivery::Guarded;
use crate::error::{BatchError, ErrorKind, StoreError, error_chain, store_unavailable};
use crate::handler::{BatchHandler, Handler};
use crate::id::MessageId;
use crate::message::Message;
use crate::store::InboxStore;
use crate::transport::Delivery;

/// Whole-batch retries of a transient failure that names no message, before the per-message way.
const WHOLE_RETRIES: u32 = 2;

/// How one batch's transaction ended.
enum Ended {
    /// Committed (or nothing to handle): these fates, by entry.
    Settled(Vec<(usize, Fate)>),
    /// Rolled back: run these parts, in order, as batches of their own.
    Split(Vec<Range<usize>>),
}

/// Why a batch call failed.
struct BatchFailure {
    kind: ErrorKind,
    reason: String,
    /// The message the error named: its position in the call.
    named: Option<usize>,
    /// The database was unreachable.
    store_down: bool,
    /// The handler panicked or timed out: likely one message's doing, so isolated like a
    /// permanent error.
    panicked: bool,
}

impl<S: InboxStore, H: Handler<S::Tx>> Run<S, H> {
    /// The fates of `entries`, handled by `handler` in as few transactions as their failures
    /// allow. An error: a store failure that ended a transaction (the caller sends every entry
    /// not yet committed the per-message way, which finds what did commit).
    pub(super) async fn whole_batches(
        &self,
        handler: &dyn BatchHandler<S::Tx>,
        entries: &[(Box<dyn Delivery>, MessageId)],
    ) -> Result<Vec<Fate>, StoreError> {
        let mut fates: Vec<Option<Fate>> = entries.iter().map(|_| None).collect();
        let ordered = self.transport.capabilities().ordered;
        // Keys with a message that waits (ordered transports): their later messages wait too.
        let mut waiting: HashSet<String> = HashSet::new();
        let mut parts: VecDeque<Range<usize>> = VecDeque::new();
        parts.push_back(0..entries.len());
        while let Some(part) = parts.pop_front() {
            if part.len() == 1 && !ordered {
                // Split down to one message: the per-message way handles it (a batch of one
                // through the same handler), and counts an attempt if it fails on its own. On an
                // ordered transport it is tried here first, in a transaction of its own, so that
                // an innocent one does not hold back the rest of its partition.
                fates[part.start] = Some(Fate::Later);
                waiting.extend(self.key_of(&*entries[part.start].0));
                continue;
            }
            match self.whole_batch(handler, entries, part, &waiting).await? {
                Ended::Settled(settled) => {
                    for (i, fate) in settled {
                        if matches!(fate, Fate::Later) {
                            waiting.extend(self.key_of(&*entries[i].0));
                        }
                        fates[i] = Some(fate);
                    }
                }
                Ended::Split(split) => {
                    for part in split.into_iter().rev() {
                        parts.push_front(part);
                    }
                }
            }
        }
        Ok(fates
            .into_iter()
            .map(|f| f.unwrap_or(Fate::Later))
            .collect())
    }

    /// The ordering key that holds later messages back, on an ordered transport.
    fn key_of(&self, delivery: &dyn Delivery) -> Option<String> {
        if self.transport.capabilities().ordered {
            delivery.ordering_key().map(str::to_owned)
        } else {
            None
        }
    }

    /// One transaction over `part` of `entries`: claim, decide, handle the claimed ones in one
    /// call, commit — or roll back and say how to go on.
    async fn whole_batch(
        &self,
        handler: &dyn BatchHandler<S::Tx>,
        entries: &[(Box<dyn Delivery>, MessageId)],
        part: Range<usize>,
        waiting: &HashSet<String>,
    ) -> Result<Ended, StoreError> {
        let mut tries = 0;
        let mut pause = self.settings.retry.delays();
        loop {
            let mut tx = self.store.begin().await?;
            let ids: Vec<MessageId> = entries[part.clone()]
                .iter()
                .map(|(_, id)| id.clone())
                .collect();
            let (claims, offsets) = self
                .metrics
                .time_claim(self.claim_entries(&mut tx, &entries[part.clone()], &ids, waiting))
                .await?;
            self.store_outage.succeeded();
            let mut settled = Vec::with_capacity(part.len());
            let mut handle: Vec<(usize, u32)> = Vec::new();
            // Keys held back in this transaction: by an earlier part, or by a message here that
            // goes the per-message way.
            let mut held = waiting.clone();
            for (i, claim) in part.clone().zip(claims) {
                let (delivery, id) = &entries[i];
                let key = self.key_of(&**delivery);
                // Redeliveries are not batched, so no inbox count of unfinished deliveries applies.
                let facts = Facts {
                    payload_len: delivery.payload().len(),
                    delivery_count: delivery.delivery_count(),
                    unfinished: None,
                };
                let blocked = key.as_ref().is_some_and(|k| held.contains(k));
                match decision::on_claim(claim, facts, self.limits()) {
                    OnClaim::Duplicate => settled.push((i, Fate::Duplicate)),
                    OnClaim::Handle { attempt } if !blocked => handle.push((i, attempt)),
                    // The per-message way dead-letters an exhausted one with its reason.
                    OnClaim::Handle { .. } | OnClaim::GiveUp { .. } => {
                        self.store
                            .release_claim(&mut tx, &self.name, id, None)
                            .await?;
                        held.extend(key);
                        settled.push((i, Fate::Later));
                    }
                }
            }
            // What this transaction leaves for the per-message way: its partition's offset
            // stops there.
            let unfinished: Vec<&dyn Delivery> = settled
                .iter()
                .filter(|(_, fate)| matches!(fate, Fate::Later))
                .map(|&(i, _)| &*entries[i].0)
                .collect();
            if handle.is_empty() {
                self.settle_batch_offsets(&mut tx, &offsets, unfinished.into_iter())
                    .await?;
                self.store.commit(tx).await?;
                return Ok(Ended::Settled(settled));
            }
            let messages: Vec<Message<'_>> = handle
                .iter()
                .map(|&(i, attempt)| self.message(&entries[i].1, &*entries[i].0, attempt))
                .collect();
            let result = self.call_batch(handler, &messages, &mut tx).await;
            let failure = match result {
                Ok(()) => {
                    self.settle_batch_offsets(&mut tx, &offsets, unfinished.into_iter())
                        .await?;
                    self.store.commit(tx).await?;
                    settled.extend(handle.iter().map(|&(i, _)| (i, Fate::Handled)));
                    return Ok(Ended::Settled(settled));
                }
                Err(failure) => failure,
            };
            let _ = self.store.rollback(tx).await;
            if failure.store_down {
                return Err(StoreError::Unavailable(failure.reason.into()));
            }
            // Rolled back: the copies stay copies; everything else goes the per-message way.
            let one_by_one = |mut settled: Vec<(usize, Fate)>| {
                for fate in &mut settled {
                    if !matches!(fate.1, Fate::Duplicate) {
                        fate.1 = Fate::Later;
                    }
                }
                settled.extend(handle.iter().map(|&(i, _)| (i, Fate::Later)));
                Ended::Settled(settled)
            };
            if handle.len() == 1 {
                // Failed on its own: the per-message way runs it again, counts the attempt,
                // retries or dead-letters it. Its key's later messages wait for it.
                tracing::debug!(message_id = %entries[handle[0].0].1, error = %failure.reason, "batch of one failed; the message goes the per-message way");
                return Ok(one_by_one(settled));
            }
            let named = failure.named.map(|position| handle[position].0);
            let owned = failure.kind == ErrorKind::Permanent || named.is_some() || failure.panicked;
            if !owned && tries < WHOLE_RETRIES {
                tries += 1;
                tracing::debug!(error = %failure.reason, tries, size = handle.len(), "batch failed as a whole; trying it again");
                let delay = pause.next().unwrap_or(self.settings.retry.max_delay);
                if !super::run::sleep_unless_stopped(delay, &self.stop).await {
                    return Ok(one_by_one(settled));
                }
                continue;
            }
            if !owned {
                tracing::warn!(error = %failure.reason, size = handle.len(), "batch failed as a whole {} times; handling its messages one by one", tries + 1);
                return Ok(one_by_one(settled));
            }
            tracing::debug!(error = %failure.reason, size = handle.len(), named = named.map(|n| entries[n].1.as_str()), "batch failed; isolating the failing message");
            self.count(super::tally::Event::BatchSplit);
            return Ok(Ended::Split(split(part, named)));
        }
    }

    /// Runs `handler` on `messages`, bounded by the handler timeout; a panic is a failure.
    async fn call_batch(
        &self,
        handler: &dyn BatchHandler<S::Tx>,
        messages: &[Message<'_>],
        tx: &mut S::Tx,
    ) -> Result<(), BatchFailure> {
        // A panic, or the timeout (likely one message that hangs): isolated, not retried whole.
        let isolate = |reason: String| BatchFailure {
            kind: ErrorKind::Transient,
            reason,
            named: None,
            store_down: false,
            panicked: true,
        };
        match self.guarded(handler.handle_batch(messages, tx)).await {
            Guarded::Returned(Ok(())) => Ok(()),
            Guarded::Returned(Err(e)) => Err(self.batch_failure(messages, e)),
            Guarded::Panicked(text) => Err(isolate(format!("batch handler panicked: {text}"))),
            Guarded::TimedOut(limit) => {
                Err(isolate(format!("batch handler timed out after {limit:?}")))
            }
        }
    }

    /// The failure `error` reports; `named` is a position in `messages`.
    fn batch_failure(&self, messages: &[Message<'_>], error: BatchError) -> BatchFailure {
        let named = error
            .message_id()
            .and_then(|id| messages.iter().position(|m| m.id == id));
        let kind = error.kind();
        let error = error.into_handler_error();
        BatchFailure {
            kind,
            reason: error_chain(error.inner()),
            named,
            store_down: store_unavailable(error.inner()),
            panicked: false,
        }
    }
}

/// The parts to run after a failure the batch owns: before the named entry, the named one
/// alone, and after it; without a name, the two halves. In order, so that an ordered
/// transport's messages keep theirs.
fn split(part: Range<usize>, named: Option<usize>) -> Vec<Range<usize>> {
    let parts = match named {
        Some(n) => vec![part.start..n, n..n + 1, n + 1..part.end],
        None => {
            let mid = part.start + part.len() / 2;
            vec![part.start..mid, mid..part.end]
        }
    };
    parts.into_iter().filter(|p| !p.is_empty()).collect()
}

#[cfg(test)]
mod tests {
    use super::split;

    #[test]
    fn halves_and_the_named_one_alone() {
        assert_eq!(split(0..4, None), vec![0..2, 2..4]);
        assert_eq!(split(3..4, None), vec![3..4]);
        assert_eq!(split(0..5, Some(0)), vec![0..1, 1..5]);
        assert_eq!(split(0..5, Some(2)), vec![0..2, 2..3, 3..5]);
        assert_eq!(split(0..5, Some(4)), vec![0..4, 4..5]);
    }
}
