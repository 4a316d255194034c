//! Batch mode (see [`Consumer::batch`](super::Consumer::batch)): one claim statement, one
//! transaction with a savepoint per message, one commit, then the acks. Whatever is unusual —
//! bad input, a copy of a batch-mate, a redelivery, a failure — goes the per-message way after
//! the commit, so the per-message path keeps the last word on every hard case.

use std::collections::HashSet;

use futures::StreamExt;
use tracing::{Instrument, field};

use super::Run;
use super::decision::{self, Facts, OnClaim};
use super::delivery::Outcome;
use super::offsets::BatchOffsets;
use super::tally::Event;
use crate::error::{ConsumerError, ErrorKind, StoreError};
use crate::handler::Handler;
use crate::id::MessageId;
use crate::store::{Claim, InboxStore};
use crate::transport::Delivery;

/// What a batch's transaction did with one of its messages.
pub(super) enum Fate {
    /// Handled; committed with the batch.
    Handled,
    /// Done or dead-lettered before.
    Duplicate,
    /// Failed permanently; the dead letter is published and the row marked dead in the batch.
    DeadLettered(String),
    /// Not handled in the batch (failed, exhausted, or behind a failed one of its key): the
    /// per-message way after the commit.
    Later,
}

impl<S: InboxStore, H: Handler<S::Tx>> Run<S, H> {
    /// Takes a batch of deliveries to their ends.
    pub(super) async fn settle_batch(
        &self,
        deliveries: Vec<Box<dyn Delivery>>,
    ) -> Result<(), ConsumerError> {
        let span = tracing::info_span!(
            "inbox.batch",
            consumer = %self.name,
            transport = self.transport.name(),
            size = deliveries.len(),
            processed = field::Empty,
            duplicates = field::Empty,
            later = field::Empty,
        );
        async {
            // Bad input and copies of a message already in the batch go the per-message way. So
            // do redeliveries: if the process died in the batch they came in, the message it
            // died on is among them, and alone it cannot take batch-mates down with it when its
            // delivery count runs out.
            let mut entries: Vec<(Box<dyn Delivery>, MessageId)> = Vec::new();
            let mut later: Vec<Box<dyn Delivery>> = Vec::new();
            let mut ids = Vec::new();
            let mut seen = HashSet::new();
            let mut held_keys = HashSet::new();
            for delivery in deliveries {
                // Offsets mode keeps a partition's offset where its first unfinished record is:
                // whatever goes the per-message way holds back the later records of its key, so
                // that none of them commits before it.
                let by_offset = self.kept_position(&*delivery).is_some();
                let id = match self.settings.id_strategy.extract(&*delivery) {
                    Ok(id)
                        if delivery.payload().len() <= self.settings.max_payload_bytes
                            && !self.replayed_for_another(&*delivery) =>
                    {
                        Some(id)
                    }
                    _ if by_offset => None,
                    _ => {
                        self.settle_delivery(delivery).await?;
                        continue;
                    }
                };
                let held = delivery
                    .ordering_key()
                    .is_some_and(|k| held_keys.contains(k));
                let hold = match &id {
                    Some(id) if !delivery.redelivered() && !held => {
                        if seen.insert(id.clone()) {
                            ids.push(id.clone());
                            entries.push((delivery, id.clone()));
                            continue;
                        }
                        by_offset
                    }
                    _ => true,
                };
                if hold {
                    // Later messages of its key follow it, in order.
                    held_keys.extend(delivery.ordering_key().map(str::to_owned));
                }
                later.push(delivery);
            }
            if entries.is_empty() {
                return self.settle_one_by_one(later).await;
            }
            let fates = match self.handler.as_batch_handler() {
                Some(handler) => self.whole_batches(handler, &entries).await,
                None => self.batch_transaction(&entries, &ids).await,
            };
            let fates = match fates {
                Ok(fates) => fates,
                Err(e) => {
                    // The batch's transaction is gone (rolled back, or its commit's outcome is
                    // unknown): every message goes the per-message way, which waits out an
                    // outage and finds what did commit.
                    if matches!(e, StoreError::Unavailable(_)) {
                        tracing::debug!(error = %e, "batch failed; handling its messages one by one");
                        self.store_outage.note(&e);
                    } else {
                        tracing::warn!(error = %e, "batch failed; handling its messages one by one");
                    }
                    self.count(Event::BatchFallback);
                    let all = entries.into_iter().map(|(d, _)| d).chain(later).collect();
                    return self.settle_one_by_one(all).await;
                }
            };
            let (mut processed, mut duplicates) = (0u64, 0u64);
            let mut deferred = Vec::new();
            for ((delivery, id), fate) in entries.into_iter().zip(fates) {
                match fate {
                    Fate::Handled => {
                        self.count(Event::Delivery);
                        self.settle_processed(delivery, &id).await;
                        processed += 1;
                    }
                    Fate::Duplicate => {
                        self.count(Event::Delivery);
                        self.settle_duplicate(delivery).await;
                        duplicates += 1;
                    }
                    Fate::DeadLettered(reason) => {
                        self.count(Event::Delivery);
                        self.ack(delivery).await;
                        self.count_dead_letter(&reason);
                    }
                    // Counted when the per-message way takes it.
                    Fate::Later => deferred.push(delivery),
                }
            }
            deferred.extend(later);
            let current = tracing::Span::current();
            current.record("processed", processed);
            current.record("duplicates", duplicates);
            current.record("later", deferred.len());
            self.settle_one_by_one(deferred).await
        }
        .instrument(span)
        .await
    }

    /// The per-message way: on an ordered transport one after another, in order; otherwise up
    /// to `concurrency` at once, so that one that hangs (the message a crash loop is about)
    /// does not hold the others back.
    async fn settle_one_by_one(
        &self,
        deliveries: Vec<Box<dyn Delivery>>,
    ) -> Result<(), ConsumerError> {
        if self.transport.capabilities().ordered {
            // A message handed back (shutdown came while it waited for a retry) takes the later
            // messages of its key with it: none may be handled before it.
            let mut handed_back: HashSet<String> = HashSet::new();
            for delivery in deliveries {
                let key = delivery.ordering_key().map(str::to_owned);
                if key.as_ref().is_some_and(|k| handed_back.contains(k)) {
                    self.hand_back(delivery).await;
                    continue;
                }
                if let Outcome::HandedBack = self.settle_delivery(delivery).await? {
                    handed_back.extend(key);
                }
            }
            return Ok(());
        }
        // A plain loop over `FuturesUnordered` rather than `buffer_unordered` with a closure,
        // whose higher-ranked lifetimes the spawned batch task's future cannot satisfy.
        let mut waiting = deliveries.into_iter();
        let mut running = futures::stream::FuturesUnordered::new();
        for delivery in waiting.by_ref().take(self.settings.concurrency) {
            running.push(self.settle_delivery(delivery));
        }
        let mut first_error = None;
        while let Some(result) = running.next().await {
            if let Err(e) = result.map(drop) {
                first_error.get_or_insert(e);
            }
            if let Some(delivery) = waiting.next() {
                running.push(self.settle_delivery(delivery));
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// The batch's transaction: claim all, handle each claimed one in a savepoint, commit.
    async fn batch_transaction(
        &self,
        entries: &[(Box<dyn Delivery>, MessageId)],
        ids: &[MessageId],
    ) -> Result<Vec<Fate>, StoreError> {
        let mut tx = self.store.begin().await?;
        let (claims, offsets) = self
            .metrics
            .time_claim(self.claim_entries(&mut tx, entries, ids, &HashSet::new()))
            .await?;
        self.store_outage.succeeded();
        let ordered = self.transport.capabilities().ordered;
        // Keys with a message that waits: their later messages wait too (ordered transports).
        let mut waiting: HashSet<String> = HashSet::new();
        let mut fates = Vec::with_capacity(entries.len());
        for ((delivery, id), claim) in entries.iter().zip(claims) {
            let key = if ordered {
                delivery.ordering_key().map(str::to_owned)
            } else {
                None
            };
            // Redeliveries are not batched, so no inbox count of unfinished deliveries applies.
            let facts = Facts {
                payload_len: delivery.payload().len(),
                delivery_count: delivery.delivery_count(),
                unfinished: None,
            };
            let blocked = key.as_ref().is_some_and(|k| waiting.contains(k));
            let attempt = match decision::on_claim(claim, facts, self.limits()) {
                OnClaim::Duplicate => {
                    fates.push(Fate::Duplicate);
                    continue;
                }
                OnClaim::Handle { attempt } if !blocked => attempt,
                // The per-message way dead-letters an exhausted one with its reason.
                OnClaim::Handle { .. } | OnClaim::GiveUp { .. } => {
                    self.store
                        .release_claim(&mut tx, &self.name, id, None)
                        .await?;
                    waiting.extend(key);
                    fates.push(Fate::Later);
                    continue;
                }
            };
            self.store.savepoint(&mut tx).await?;
            match self.run_handler(id, &**delivery, attempt, &mut tx).await {
                Ok(()) => {
                    self.store.release_savepoint(&mut tx).await?;
                    fates.push(Fate::Handled);
                }
                Err(failure) => {
                    self.store.rollback_to_savepoint(&mut tx).await?;
                    self.count(Event::Failed);
                    self.log_attempt_failed(&failure, attempt, Some(id));
                    if failure.kind == ErrorKind::Permanent
                        && self
                            .publish_dead_letter(&**delivery, Some(id), attempt, &failure.reason)
                            .await
                            .is_ok()
                    {
                        self.ensure_id_row(&mut tx, &**delivery, id).await?;
                        self.store
                            .record_dead_in(&mut tx, &self.name, id, attempt, &failure.reason)
                            .await?;
                        fates.push(Fate::DeadLettered(failure.reason));
                        continue;
                    }
                    self.store
                        .release_claim(&mut tx, &self.name, id, Some((attempt, &failure.reason)))
                        .await?;
                    waiting.extend(key);
                    fates.push(Fate::Later);
                }
            }
        }
        let unfinished = entries
            .iter()
            .zip(&fates)
            .filter(|(_, fate)| matches!(fate, Fate::Later))
            .map(|((delivery, _), _)| &**delivery);
        self.settle_batch_offsets(&mut tx, &offsets, unfinished)
            .await?;
        self.store.commit(tx).await?;
        Ok(fates)
    }

    /// A batch transaction's claims: of the ids (one statement), of the offsets (one statement a
    /// partition), or both; a message is new only if every claim says so. The offsets of keys in
    /// `waiting` are not claimed: an earlier record of theirs is unfinished, and their offset
    /// stays at it.
    pub(super) async fn claim_entries(
        &self,
        tx: &mut S::Tx,
        entries: &[(Box<dyn Delivery>, MessageId)],
        ids: &[MessageId],
        waiting: &HashSet<String>,
    ) -> Result<(Vec<Claim>, BatchOffsets), StoreError> {
        let by_offset = |(delivery, _): &(Box<dyn Delivery>, MessageId)| {
            self.kept_position(&**delivery).is_some()
        };
        let mut claims = if self.settings.dedup.ids() || !entries.iter().all(by_offset) {
            self.store.claim_batch(tx, &self.name, ids).await?
        } else {
            vec![
                Claim::Claimed {
                    attempts: 0,
                    last_error: None,
                };
                entries.len()
            ]
        };
        let offsets = self
            .claim_batch_offsets(
                tx,
                entries
                    .iter()
                    .map(|(d, _)| &**d)
                    .filter(|d| d.ordering_key().is_none_or(|k| !waiting.contains(k))),
            )
            .await?;
        for ((delivery, _), claim) in entries.iter().zip(&mut claims) {
            if offsets.consumed(delivery.log_position()) {
                *claim = Claim::Done;
            }
        }
        Ok((claims, offsets))
    }
}
