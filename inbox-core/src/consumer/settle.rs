//! The last step of every path: ack what the inbox holds an outcome for, or hand it back.

use super::Run;
use super::delivery::Outcome;
use super::tally::Event;
use crate::id::MessageId;
use crate::store::InboxStore;
use crate::transport::{AckToken, Delivery};

impl<S: InboxStore, H> Run<S, H> {
    /// The message's transaction committed: the after-commit hook, then the ack.
    pub(super) async fn settle_processed(
        &self,
        delivery: Box<dyn Delivery>,
        id: &MessageId,
    ) -> Outcome {
        if let Some(hook) = &self.settings.after_commit.0 {
            hook(id).await;
        }
        self.ack(delivery).await;
        self.count(Event::Processed);
        Outcome::Processed
    }

    /// A copy of a message done or dead-lettered before (or a replay for another consumer):
    /// acked and discarded.
    pub(super) async fn settle_duplicate(&self, delivery: Box<dyn Delivery>) -> Outcome {
        self.ack(delivery).await;
        self.count(Event::Duplicate);
        Outcome::Duplicate
    }

    /// Acks; the token proves the inbox already holds the outcome. A lost ack is not an error for
    /// the message: the broker redelivers and the inbox discards the copy.
    pub(super) async fn ack(&self, delivery: Box<dyn Delivery>) {
        if let Err(e) = delivery.ack(AckToken::new()).await {
            self.count(Event::AckLost);
            if let Some(n) = self.lost_acks.due() {
                tracing::warn!(error = %e, lost = n, "ack lost; the broker will redeliver and the inbox will discard the copy");
            }
        }
    }

    /// Gives the delivery back to the broker unsettled.
    pub(super) async fn hand_back(&self, delivery: Box<dyn Delivery>) -> Outcome {
        if let Err(e) = delivery.nack(true).await {
            tracing::warn!(error = %e, "nack failed; the broker redelivers on its own");
        }
        Outcome::HandedBack
    }
}
