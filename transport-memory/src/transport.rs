//! The [`Transport`] implementation: subscriptions, dead-letter replay, and publishing with
//! injected duplicates.

use std::sync::Arc;

use async_trait::async_trait;
use futures::stream;
use inbox_core::{
    Capabilities, Delivery, DeliveryStream, OutgoingMessage, Subscription, Transport,
    TransportError,
};

use crate::broker::MemoryBroker;
use crate::faults::DUPLICATE;
use crate::state::{Envelope, Pending};

/// The group that reads dead-letter topics for a replay.
const REPLAY_GROUP: &str = "inbox-replay";

#[async_trait]
impl Transport for MemoryBroker {
    fn name(&self) -> &'static str {
        "memory"
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::basic().with_delivery_count(true)
    }

    async fn subscribe(
        &self,
        subscription: &Subscription,
    ) -> Result<DeliveryStream, TransportError> {
        let topic = subscription.source.clone();
        let group = subscription.consumer.as_str().to_owned();
        self.declare_group(&topic, &group);
        let broker = self.clone();
        let deliveries = stream::unfold(
            (broker, topic, group),
            |(broker, topic, group)| async move {
                let delivery = broker.next_delivery(&topic, &group).await;
                let boxed: Box<dyn Delivery> = Box::new(delivery);
                Some((Ok(boxed), (broker, topic, group)))
            },
        );
        Ok(Box::pin(deliveries))
    }

    /// The dead-letter topic through a group of its own (`inbox-replay`), which starts at the
    /// topic's beginning; the stream ends when nothing is waiting for that group.
    async fn read_dead_letters(&self, destination: &str) -> Result<DeliveryStream, TransportError> {
        let topic = destination.to_owned();
        self.declare_group(&topic, REPLAY_GROUP);
        let deliveries = stream::unfold((self.clone(), topic), |(broker, topic)| async move {
            let delivery = broker.dispatch(&topic, REPLAY_GROUP)?;
            let boxed: Box<dyn Delivery> = Box::new(delivery);
            Some((Ok(boxed), (broker, topic)))
        });
        Ok(Box::pin(deliveries))
    }

    async fn publish(
        &self,
        destination: &str,
        message: OutgoingMessage,
    ) -> Result<(), TransportError> {
        let mut state = self.shared.lock();
        let seq = state.next_seq;
        let p = state.faults.duplicate_publish;
        let copies = if state.roll(DUPLICATE, p, seq) {
            state.stats.injected_duplicates += 1;
            2
        } else {
            1
        };
        let OutgoingMessage {
            message_id,
            payload,
            headers,
            ..
        } = message;
        for _ in 0..copies {
            let envelope = Arc::new(Envelope {
                seq: state.next_seq,
                message_id: message_id.clone(),
                payload: payload.clone(),
                headers: headers.clone(),
            });
            state.next_seq += 1;
            state.stats.published += 1;
            let topic = state.topic(destination);
            topic.log.push(Arc::clone(&envelope));
            for group in topic.groups.values_mut() {
                group.ready.push_back(Pending {
                    envelope: Arc::clone(&envelope),
                    deliveries: 0,
                });
            }
        }
        drop(state);
        self.shared.changed.notify_waiters();
        Ok(())
    }
}
