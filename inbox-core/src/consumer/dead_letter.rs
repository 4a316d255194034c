//! Dead-lettering: the letter's headers, publishing it until it is out, and marking the message
//! dead — in the claim's transaction when there is one, in its own otherwise.

use super::Run;
use super::delivery::Outcome;
use super::run::{next_delay, sleep_unless_stopped};
use super::tally::Event;
use crate::error::TransportError;
use crate::id::MessageId;
use crate::message::OutgoingMessage;
use crate::store::InboxStore;
use crate::transport::Delivery;

/// Headers a dead letter carries besides the original ones.
pub mod dead_letter_headers {
    /// Why the message was dead-lettered.
    pub const REASON: &str = "x-inbox-reason";
    /// The consumer that gave up on it.
    pub const CONSUMER: &str = "x-inbox-consumer";
    /// Attempts made.
    pub const ATTEMPTS: &str = "x-inbox-attempts";
    /// The source it was consumed from (where a replay publishes it again).
    pub const SOURCE: &str = "x-inbox-source";
    /// The message id, when it had a valid one.
    pub const MESSAGE_ID: &str = "x-inbox-message-id";
    /// The record's coordinates, where the transport has them.
    pub const COORDINATES: &str = "x-inbox-coordinates";
    /// On a replayed message: the one consumer it is replayed for. A replay is published to the
    /// source, which every consumer of it reads; the others discard the copy unhandled — also
    /// once their own row of it is gone to cleanup, when the inbox could no longer tell.
    pub const REPLAY_FOR: &str = "x-inbox-replay-for";
}

/// Where a consumer of `source` publishes dead letters unless told otherwise
/// ([`Consumer::dead_letter_to`](super::Consumer::dead_letter_to)): `"<source>.dead-letter"`.
///
/// ```
/// assert_eq!(inbox_core::default_dead_letter_destination("parcels"), "parcels.dead-letter");
/// ```
pub fn default_dead_letter_destination(source: &str) -> String {
    format!("{source}.dead-letter")
}

impl<S: InboxStore, H> Run<S, H> {
    /// Dead-letters a claimed message: publish, mark dead in the claim's transaction, commit.
    /// True when the message may be acked: the dead letter is published and, unless the table
    /// refused it for good, marked. False: try again (nothing is marked; a second attempt may
    /// publish a second copy of the dead letter, which a replay discards).
    ///
    /// The letter is published before the mark commits, not after: a mark committed with the
    /// publish failing would make every redelivery a "duplicate" with no dead letter anywhere.
    pub(super) async fn dead_letter_claimed(
        &self,
        mut tx: S::Tx,
        delivery: &dyn Delivery,
        id: &MessageId,
        attempts: u32,
        reason: &str,
    ) -> bool {
        if let Err(e) = self
            .publish_dead_letter(delivery, Some(id), attempts, reason)
            .await
        {
            let _ = self.store.rollback(tx).await;
            self.dead_letter_publish_failed(&e);
            return false;
        }
        let marked = async {
            self.ensure_id_row(&mut tx, delivery, id).await?;
            self.store
                .record_dead_in(&mut tx, &self.name, id, attempts, reason)
                .await?;
            self.store.commit(tx).await
        };
        match marked.await {
            Ok(()) => true,
            Err(e) if e.is_transient() => {
                tracing::warn!(error = %e, "could not mark the message dead; trying again");
                false
            }
            Err(e) => {
                tracing::error!(error = %e, "dead letter published, but the inbox table refused the dead mark");
                true
            }
        }
    }

    /// Dead-letters a message with no claim held: publish (until it is out), record it dead in
    /// its own transaction when it has an id (a message without a valid id has no row), ack.
    pub(super) async fn dead_letter_unclaimed(
        &self,
        delivery: Box<dyn Delivery>,
        id: Option<&MessageId>,
        attempts: u32,
        reason: String,
    ) -> Outcome {
        if !self
            .publish_dead_letter_until_done(&*delivery, id, attempts, &reason)
            .await
        {
            return self.hand_back(delivery).await;
        }
        if let Some(id) = id {
            match self
                .retry_store(|| self.store.record_dead(&self.name, id, attempts, &reason))
                .await
            {
                Ok(Some(())) => {}
                // The message is safe in the dead-letter destination; only the table misses the
                // mark.
                Ok(None) => {
                    tracing::warn!("dead letter published; shutdown came before the dead mark")
                }
                Err(e) => {
                    tracing::error!(error = %e, "dead letter published, but the inbox table refused the dead mark")
                }
            }
        }
        self.advance_past(&*delivery).await;
        self.ack(delivery).await;
        self.count_dead_letter(&reason);
        Outcome::DeadLettered
    }

    pub(super) fn count_dead_letter(&self, reason: &str) {
        tracing::warn!(reason, "message dead-lettered");
        self.count(Event::DeadLettered);
    }

    /// Publishes a dead letter, retrying with backoff until it is out. False: shutdown came
    /// first. The message stays with this task meanwhile instead of going back to the broker:
    /// a broker that redelivers would only bring it back to the same failure, and one that
    /// cannot (Kafka) would skip it.
    async fn publish_dead_letter_until_done(
        &self,
        delivery: &dyn Delivery,
        id: Option<&MessageId>,
        attempts: u32,
        reason: &str,
    ) -> bool {
        let mut delays = self.settings.reconnect.delays();
        loop {
            match self
                .publish_dead_letter(delivery, id, attempts, reason)
                .await
            {
                Ok(()) => return true,
                Err(e) => self.dead_letter_publish_failed(&e),
            }
            if !sleep_unless_stopped(next_delay(&mut delays), &self.stop).await {
                return false;
            }
        }
    }

    fn dead_letter_publish_failed(&self, error: &TransportError) {
        if let Some(n) = self.dead_letter_failures.due() {
            tracing::error!(error = %error, failures = n, "could not publish a dead letter; the message waits and is tried again");
        }
    }

    /// Publishes the delivery, with its headers and ours, to the dead-letter destination.
    pub(super) async fn publish_dead_letter(
        &self,
        delivery: &dyn Delivery,
        id: Option<&MessageId>,
        attempts: u32,
        reason: &str,
    ) -> Result<(), TransportError> {
        use dead_letter_headers as h;
        let mut headers = delivery.headers().clone();
        headers.insert(h::REASON, reason.to_owned());
        headers.insert(h::CONSUMER, self.name.as_str().to_owned());
        headers.insert(h::ATTEMPTS, attempts.to_string());
        headers.insert(h::SOURCE, self.source.clone());
        if let Some(id) = id {
            headers.insert(h::MESSAGE_ID, id.as_str().to_owned());
        }
        if let Some(coordinates) = delivery.coordinates() {
            headers.insert(h::COORDINATES, coordinates);
        }
        let message = OutgoingMessage {
            message_id: delivery
                .broker_message_id()
                .and_then(|raw| std::str::from_utf8(raw).ok())
                .map(str::to_owned),
            payload: bytes::Bytes::copy_from_slice(delivery.payload()),
            headers,
            key: None,
        };
        self.transport
            .publish(&self.dead_letter_destination(), message)
            .await
    }
}
