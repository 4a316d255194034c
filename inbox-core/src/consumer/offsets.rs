//! Offsets mode ([`Dedup::Offsets`](super::Dedup)): a partition's records are told new or copy
//! by the partition's next offset kept in the database, moved in the handler's transaction.

use std::sync::Arc;

use async_trait::async_trait;

use super::{Inner, Run};
use crate::error::{ConsumerError, StoreError, TransportError};
use crate::handler::Handler;
use crate::id::MessageId;
use crate::store::{Claim, InboxStore, OffsetClaim};
use crate::transport::{Delivery, LogPosition, OffsetSource, Offsets};

/// The consumer's kept offsets, as its subscription hands them to the transport.
struct KeptOffsets<S: InboxStore, H>(Arc<Inner<S, H>>);

#[async_trait]
impl<S: InboxStore, H: Send + Sync + 'static> OffsetSource for KeptOffsets<S, H> {
    async fn next_offset(&self, topic: &str, partition: i32) -> Result<Option<i64>, StoreError> {
        self.0
            .store
            .next_offset(&self.0.name, topic, partition)
            .await
    }
}

/// One partition's records in a batch transaction, and what the claim of their offsets found.
struct Part {
    topic: String,
    partition: i32,
    first: i64,
    last: i64,
    found: OffsetClaim,
}

/// The offsets a batch transaction claimed, per partition.
#[derive(Default)]
pub(super) struct BatchOffsets(Vec<Part>);

impl BatchOffsets {
    /// Whether the record at `position` was handled before (a copy).
    pub(super) fn consumed(&self, position: Option<LogPosition<'_>>) -> bool {
        let Some(p) = position else { return false };
        self.0.iter().any(|part| {
            part.topic == p.topic
                && part.partition == p.partition
                && matches!(part.found, OffsetClaim::Consumed { next } if p.offset < next)
        })
    }
}

impl<S: InboxStore, H: Handler<S::Tx>> Run<S, H> {
    /// What the subscription carries in offsets mode; an error where the transport cannot
    /// keep it (no log positions, or partitions not handled in order).
    pub(super) fn subscription_offsets(&self) -> Result<Option<Offsets>, ConsumerError> {
        if !self.settings.dedup.offsets() {
            return Ok(None);
        }
        let capabilities = self.transport.capabilities();
        if !capabilities.log_positions || !capabilities.ordered {
            return Err(ConsumerError::Transport(TransportError::Unsupported(
                "offsets mode: the transport must give log positions and keep each partition in order (Kafka, ordered)",
            )));
        }
        Ok(Some(Offsets(Arc::new(KeptOffsets(Arc::clone(
            &self.consumer,
        ))))))
    }
}

impl<S: InboxStore, H> Run<S, H> {
    /// Offsets mode is configured, and this delivery has an offset to keep.
    pub(super) fn kept_position<'d>(&self, delivery: &'d dyn Delivery) -> Option<LogPosition<'d>> {
        if self.settings.dedup.offsets() {
            delivery.log_position()
        } else {
            None
        }
    }

    /// Begins the message's transaction and claims it, by id, by offset, or both.
    pub(super) async fn begin_and_claim(
        &self,
        delivery: &dyn Delivery,
        id: &MessageId,
        unseen: bool,
    ) -> Result<(S::Tx, Claim), StoreError> {
        let Some(position) = self.kept_position(delivery) else {
            return self.store.begin_and_claim(&self.name, id, unseen).await;
        };
        let offset = position.offset;
        // One lock order per mode, so that two owners of a partition (a rebalance) never wait
        // for each other in a circle: with ids, the id row before the offset (as in batches);
        // offsets alone, the offset before the id row (as for a dead mark).
        if !self.settings.dedup.ids() {
            let (mut tx, found) = self
                .store
                .begin_and_claim_offset(&self.name, position.topic, position.partition, offset)
                .await?;
            if !matches!(found, OffsetClaim::New) {
                return Ok((tx, Claim::Done));
            }
            if unseen {
                // Nothing seen before: the offset is the whole claim.
                let fresh = Claim::Claimed {
                    attempts: 0,
                    last_error: None,
                };
                return Ok((tx, fresh));
            }
            // A sign of an earlier delivery: its id row too, where its failed attempts and a
            // crash-loop count are kept.
            return match self.store.claim(&mut tx, &self.name, id).await {
                Ok(claim) => Ok((tx, claim)),
                Err(e) => {
                    let _ = self.store.rollback(tx).await;
                    Err(e)
                }
            };
        }
        let (mut tx, claim) = self.store.begin_and_claim(&self.name, id, unseen).await?;
        if !matches!(claim, Claim::Claimed { .. }) {
            return Ok((tx, claim));
        }
        let found = self
            .store
            .claim_offsets(
                &mut tx,
                &self.name,
                position.topic,
                position.partition,
                (offset, offset),
            )
            .await;
        match found {
            Ok(OffsetClaim::Consumed { .. }) => Ok((tx, Claim::Done)),
            Ok(_) => Ok((tx, claim)),
            Err(e) => {
                let _ = self.store.rollback(tx).await;
                Err(e)
            }
        }
    }

    /// Offsets mode: whether the partition's kept offset is past this record (a read, no lock:
    /// the claim decides; this only spares a copy the bookkeeping of a possible redelivery).
    pub(super) async fn consumed_before(&self, delivery: &dyn Delivery) -> bool {
        let Some(p) = self.kept_position(delivery) else {
            return false;
        };
        matches!(
            self.store.next_offset(&self.name, p.topic, p.partition).await,
            Ok(Some(next)) if next > p.offset
        )
    }

    /// Offsets alone: gives the message an id row in `tx` before its dead mark is recorded there
    /// (no row was written when it was claimed by offset).
    pub(super) async fn ensure_id_row(
        &self,
        tx: &mut S::Tx,
        delivery: &dyn Delivery,
        id: &MessageId,
    ) -> Result<(), StoreError> {
        if self.kept_position(delivery).is_some() && !self.settings.dedup.ids() {
            self.store.claim(tx, &self.name, id).await?;
        }
        Ok(())
    }

    /// Moves the partition's offset past a record settled outside a claim's transaction (a
    /// dead letter published after a rollback, bad input), so that it is not read again.
    pub(super) async fn advance_past(&self, delivery: &dyn Delivery) {
        let Some(p) = self.kept_position(delivery) else {
            return;
        };
        let advanced = self
            .retry_store(|| async {
                let mut tx = self.store.begin().await?;
                let claimed = self
                    .store
                    .claim_offsets(
                        &mut tx,
                        &self.name,
                        p.topic,
                        p.partition,
                        (p.offset, p.offset),
                    )
                    .await;
                match claimed {
                    Ok(_) => self.store.commit(tx).await,
                    Err(e) => {
                        let _ = self.store.rollback(tx).await;
                        Err(e)
                    }
                }
            })
            .await;
        if let Err(e) = advanced {
            // Read again after a restart, the record finds its dead mark and is skipped.
            tracing::warn!(error = %e, "could not move the kept offset past a dead-lettered record");
        }
    }

    /// Claims, in a batch transaction, the offsets of `deliveries`, a range per partition.
    pub(super) async fn claim_batch_offsets<'d>(
        &self,
        tx: &mut S::Tx,
        deliveries: impl Iterator<Item = &'d dyn Delivery>,
    ) -> Result<BatchOffsets, StoreError> {
        let mut parts: Vec<Part> = Vec::new();
        for p in deliveries.filter_map(|d| self.kept_position(d)) {
            match parts
                .iter_mut()
                .find(|part| part.topic == p.topic && part.partition == p.partition)
            {
                Some(part) => {
                    part.first = part.first.min(p.offset);
                    part.last = part.last.max(p.offset);
                }
                None => parts.push(Part {
                    topic: p.topic.to_owned(),
                    partition: p.partition,
                    first: p.offset,
                    last: p.offset,
                    found: OffsetClaim::New,
                }),
            }
        }
        for part in &mut parts {
            part.found = self
                .store
                .claim_offsets(
                    tx,
                    &self.name,
                    &part.topic,
                    part.partition,
                    (part.first, part.last),
                )
                .await?;
        }
        Ok(BatchOffsets(parts))
    }

    /// Before a batch transaction commits: each partition's next offset becomes its first record
    /// the transaction did not finish (`unfinished`: handed on to the per-message way), or one
    /// past its last record. Never before what the claim found.
    pub(super) async fn settle_batch_offsets<'d>(
        &self,
        tx: &mut S::Tx,
        offsets: &BatchOffsets,
        unfinished: impl Iterator<Item = &'d dyn Delivery>,
    ) -> Result<(), StoreError> {
        let unfinished: Vec<LogPosition<'d>> =
            unfinished.filter_map(|d| self.kept_position(d)).collect();
        for part in &offsets.0 {
            let held = unfinished
                .iter()
                .filter(|p| p.topic == part.topic && p.partition == part.partition)
                .map(|p| p.offset)
                .min();
            let wanted = held.unwrap_or(part.last.saturating_add(1));
            // Where the claim left the offset, and where it goes.
            let (now, next) = match part.found {
                OffsetClaim::New => (part.last.saturating_add(1), wanted),
                OffsetClaim::Consumed { next } => (next, wanted.max(next)),
            };
            if next != now {
                self.store
                    .set_next_offset(tx, &self.name, &part.topic, part.partition, next)
                    .await?;
            }
        }
        Ok(())
    }
}
