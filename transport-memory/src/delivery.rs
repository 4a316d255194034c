//! A delivery from the broker, and how acking, nacking or dropping it settles the message.

use std::fmt;
use std::sync::Arc;

use async_trait::async_trait;
use inbox_core::{AckToken, Delivery, Headers, TransportError};

use crate::broker::{MemoryBroker, Settle};
use crate::state::Envelope;

/// A delivery from the [`MemoryBroker`]. Dropped unsettled, it is redelivered.
pub struct MemoryDelivery {
    pub(crate) broker: MemoryBroker,
    pub(crate) topic: String,
    pub(crate) group: String,
    pub(crate) tag: u64,
    pub(crate) envelope: Arc<Envelope>,
    pub(crate) deliveries: u32,
    pub(crate) settled: bool,
}

impl fmt::Debug for MemoryDelivery {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryDelivery")
            .field("topic", &self.topic)
            .field("group", &self.group)
            .field("tag", &self.tag)
            .field("message_id", &self.envelope.message_id)
            .field("deliveries", &self.deliveries)
            .finish()
    }
}

#[async_trait]
impl Delivery for MemoryDelivery {
    fn payload(&self) -> &[u8] {
        &self.envelope.payload
    }

    fn headers(&self) -> &Headers {
        &self.envelope.headers
    }

    fn broker_message_id(&self) -> Option<&[u8]> {
        self.envelope.message_id.as_deref().map(str::as_bytes)
    }

    fn redelivered(&self) -> bool {
        self.deliveries > 1
    }

    fn delivery_count(&self) -> Option<u32> {
        Some(self.deliveries)
    }

    fn coordinates(&self) -> Option<String> {
        Some(format!("{}/0/{}", self.topic, self.envelope.seq))
    }

    async fn ack(mut self: Box<Self>, _token: AckToken) -> Result<(), TransportError> {
        let observer = self
            .broker
            .shared
            .observer
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        if let Some(observer) = observer {
            observer
                .before_ack(
                    &self.topic,
                    &self.group,
                    self.envelope.message_id.as_deref(),
                )
                .await;
        }
        self.settled = true;
        self.broker
            .settle(&self.topic, &self.group, self.tag, Settle::Ack);
        Ok(())
    }

    async fn nack(mut self: Box<Self>, requeue: bool) -> Result<(), TransportError> {
        self.settled = true;
        let outcome = if requeue {
            Settle::Requeue
        } else {
            Settle::Discard
        };
        self.broker
            .settle(&self.topic, &self.group, self.tag, outcome);
        Ok(())
    }
}

impl Drop for MemoryDelivery {
    fn drop(&mut self) {
        if !self.settled {
            tracing::debug!(
                tag = self.tag,
                "memory delivery dropped unsettled; redelivering"
            );
            self.broker
                .settle(&self.topic, &self.group, self.tag, Settle::Requeue);
        }
    }
}
