//! A delivery from RabbitMQ, and settling it: ack, nack, or the nack of its drop.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};

use async_trait::async_trait;
use inbox_core::{AckToken, Delivery, Headers, TransportError};
use lapin::options::{BasicAckOptions, BasicNackOptions};

use crate::consume::ConsumerChannel;
use crate::headers::{amqp_to_bytes, amqp_to_u32, broker_owned};

/// A delivery from RabbitMQ. Dropped unsettled, it is nacked with requeue.
pub struct RabbitDelivery {
    inner: Option<lapin::message::Delivery>,
    /// Keeps the channel open until the delivery is settled.
    subscription: Arc<ConsumerChannel>,
    headers: Headers,
    delivery_count: Option<u32>,
    unsettled: Arc<AtomicUsize>,
    /// The transport's careful-mode countdown, which acks bring down.
    careful: Arc<AtomicU32>,
    finished: bool,
}

impl fmt::Debug for RabbitDelivery {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RabbitDelivery")
            .field("delivery_tag", &self.inner.as_ref().map(|d| d.delivery_tag))
            .field(
                "message_id",
                &self
                    .inner
                    .as_ref()
                    .and_then(|d| d.properties.message_id().clone()),
            )
            .field("redelivered", &self.redelivered())
            .finish()
    }
}

impl RabbitDelivery {
    pub(crate) fn new(
        delivery: lapin::message::Delivery,
        subscription: &Arc<ConsumerChannel>,
        unsettled: &Arc<AtomicUsize>,
        counts_deliveries: bool,
        careful: &Arc<AtomicU32>,
    ) -> Self {
        let table = delivery.properties.headers().clone().unwrap_or_default();
        let headers = table
            .inner()
            .iter()
            .filter(|(name, _)| !broker_owned(name.as_str()))
            .map(|(name, value)| (name.as_str().to_owned(), amqp_to_bytes(value)))
            .collect();
        // Quorum queues count earlier deliveries in x-delivery-count. On a classic queue the
        // header can only be a publisher's (or a stale copy in a replayed dead letter): not
        // trusted.
        let delivery_count = if counts_deliveries {
            match table.inner().get("x-delivery-count").and_then(amqp_to_u32) {
                Some(earlier) => Some(earlier.saturating_add(1)),
                None if !delivery.redelivered => Some(1),
                None => None,
            }
        } else {
            None
        };
        unsettled.fetch_add(1, Ordering::SeqCst);
        subscription.outstanding.fetch_add(1, Ordering::SeqCst);
        Self {
            inner: Some(delivery),
            subscription: Arc::clone(subscription),
            headers,
            delivery_count,
            unsettled: Arc::clone(unsettled),
            careful: Arc::clone(careful),
            finished: false,
        }
    }

    fn take(&mut self) -> lapin::message::Delivery {
        self.inner.take().expect("a delivery is settled once")
    }

    /// After the ack or nack went out: counts it settled, and lets the channel close.
    fn finish(&mut self) {
        if !self.finished {
            self.finished = true;
            self.unsettled.fetch_sub(1, Ordering::SeqCst);
            self.subscription.release();
        }
    }
}

fn settled(result: lapin::Result<bool>, what: &str) -> Result<(), TransportError> {
    match result {
        Ok(true) => Ok(()),
        Ok(false) => Err(TransportError::AckLost(
            format!("{what} not sent: the channel is closed, the delivery was already settled, or the connection did not take it within {SETTLE_TIMEOUT:?}")
                .into(),
        )),
        Err(e) => Err(TransportError::AckLost(Box::new(e))),
    }
}

#[async_trait]
impl Delivery for RabbitDelivery {
    fn payload(&self) -> &[u8] {
        self.inner.as_ref().map_or(&[], |d| d.data.as_slice())
    }

    fn headers(&self) -> &Headers {
        &self.headers
    }

    fn broker_message_id(&self) -> Option<&[u8]> {
        self.inner
            .as_ref()?
            .properties
            .message_id()
            .as_ref()
            .map(|id| id.as_str().as_bytes())
    }

    fn redelivered(&self) -> bool {
        self.inner.as_ref().is_some_and(|d| d.redelivered)
    }

    fn delivery_count(&self) -> Option<u32> {
        self.delivery_count
    }

    async fn ack(mut self: Box<Self>, _token: AckToken) -> Result<(), TransportError> {
        let delivery = self.take();
        let result = bounded(delivery.acker.ack(BasicAckOptions::default())).await;
        self.finish();
        if matches!(result, Ok(true)) {
            let _ = self
                .careful
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
        }
        settled(result, "ack")
    }

    async fn nack(mut self: Box<Self>, requeue: bool) -> Result<(), TransportError> {
        let delivery = self.take();
        let result = bounded(delivery.acker.nack(BasicNackOptions {
            requeue,
            multiple: false,
        }))
        .await;
        self.finish();
        settled(result, "nack")
    }
}

/// How long an ack or nack may take to be written. On a connection that died without lapin
/// noticing yet, its promise would never resolve and the consumer could not drain; past this it
/// counts as lost (the broker redelivers the message when it drops the connection).
const SETTLE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

async fn bounded(
    settle: impl std::future::Future<Output = lapin::Result<bool>>,
) -> lapin::Result<bool> {
    // `Ok(false)`: not sent, which `settled` reports as a lost ack.
    tokio::time::timeout(SETTLE_TIMEOUT, settle)
        .await
        .unwrap_or(Ok(false))
}

impl Drop for RabbitDelivery {
    fn drop(&mut self) {
        if self.finished {
            return;
        }
        let Some(delivery) = self.inner.take() else {
            self.finish();
            return;
        };
        // Hand it back at once rather than when the channel closes; the channel stays open
        // until the nack went out.
        self.finished = true;
        let (unsettled, subscription) =
            (Arc::clone(&self.unsettled), Arc::clone(&self.subscription));
        let hand_back = async move {
            let _ = bounded(delivery.acker.nack(BasicNackOptions {
                requeue: true,
                multiple: false,
            }))
            .await;
            unsettled.fetch_sub(1, Ordering::SeqCst);
            subscription.release();
        };
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => drop(runtime.spawn(hand_back)),
            Err(_) => {
                self.unsettled.fetch_sub(1, Ordering::SeqCst);
                self.subscription.release();
            }
        }
    }
}
