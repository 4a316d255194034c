//! Consuming a queue: the delivery stream and the channel behind it.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::task::{Context, Poll};

use futures::{Stream, StreamExt};
use inbox_core::{Delivery, DeliveryStream, TransportError};
use lapin::Channel;
use lapin::options::{BasicCancelOptions, BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;

use crate::connection::{broker_error, short};
use crate::{QueueType, RabbitDelivery, RabbitMqTransport};

/// After a delivery lapin could not parse killed the connection, this many acks go by with a
/// prefetch of 1, so that the broker's delivery limit counts the unparsable message alone and not
/// the good ones that arrived in the same window.
pub(crate) const CAREFUL_ACKS: u32 = 8;

impl RabbitMqTransport {
    /// Consumes `queue` on the guarded channel (0: no prefetch limit).
    pub(crate) async fn consume(
        &self,
        guard: StreamGuard,
        queue: &str,
        prefetch: u16,
    ) -> Result<DeliveryStream, TransportError> {
        let channel = &guard.0.channel;
        // Prefetch must be set before consuming, or the broker may push the whole queue.
        channel
            .basic_qos(prefetch, BasicQosOptions::default())
            .await
            .map_err(broker_error)?;
        let deliveries = channel
            .basic_consume(
                short(queue)?,
                "".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(broker_error)?;
        tracing::debug!(
            queue,
            prefetch,
            channel = channel.id(),
            "consuming from RabbitMQ"
        );
        let unsettled = Arc::clone(&self.unsettled);
        let counts = self.config.queue_type == QueueType::Quorum;
        let careful = Arc::clone(&self.careful);
        let queue = queue.to_owned();
        let stream = CancelOnDrop::new(deliveries, &guard.0).map(move |next| match next {
            Ok(delivery) => Ok(Box::new(RabbitDelivery::new(
                delivery, &guard.0, &unsettled, counts, &careful,
            )) as Box<dyn Delivery>),
            // A frame lapin cannot parse — a short string (message_id, a header name, …) that is
            // not UTF-8 — kills the whole connection, and the broker redelivers that message
            // first. Only a quorum queue's delivery limit takes it out (to the quarantine
            // queue); until then, one message at a time, so that it alone is counted.
            Err(e) if matches!(e.kind(), lapin::ErrorKind::ParsingError(_)) => {
                careful.store(CAREFUL_ACKS, Ordering::SeqCst);
                tracing::error!(
                    queue = %queue,
                    error = %e,
                    "a delivery RabbitMQ sent could not be parsed (a non-UTF-8 message_id, type or header name?); the connection is lost and the broker will deliver it again. A quorum queue with a delivery limit moves it to its quarantine queue; a classic queue is stuck behind it until it is removed"
                );
                Err(TransportError::Disconnected(Box::new(e)))
            }
            // The channel of an established consumer was closed — by the connection dying, or by
            // the server: `consumer_timeout` (406) after deliveries stayed unacked through a long
            // database outage, a deleted queue (404). Subscribing again either works or reports
            // the refusal then; so it is never a reason for the consumer to stop.
            Err(e) => {
                tracing::warn!(queue = %queue, error = %e, "RabbitMQ consumer channel closed");
                Err(TransportError::Disconnected(Box::new(e)))
            }
        });
        Ok(Box::pin(stream))
    }
}

/// The lapin consumer of a delivery stream, cancelled by the stream itself when it ends.
///
/// lapin cancels a consumer that is dropped in the background, and takes a failure of that
/// cancel — as when the channel's close overtakes it — for an error of the whole connection,
/// which voids the acks of every other subscription on it (seen: a dead-letter reader's acks lost
/// when another reader's stream ended). So this cancels the consumer itself, drops it only once
/// the cancel is answered, and only then lets the channel close.
struct CancelOnDrop {
    consumer: Option<lapin::Consumer>,
    subscription: Arc<ConsumerChannel>,
}

impl CancelOnDrop {
    fn new(consumer: lapin::Consumer, subscription: &Arc<ConsumerChannel>) -> Self {
        subscription.cancelled.store(false, Ordering::SeqCst);
        Self {
            consumer: Some(consumer),
            subscription: Arc::clone(subscription),
        }
    }
}

impl Stream for CancelOnDrop {
    type Item = lapin::Result<lapin::message::Delivery>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        match self.consumer.as_mut() {
            Some(consumer) => consumer.poll_next_unpin(cx),
            None => Poll::Ready(None),
        }
    }
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        let Some(consumer) = self.consumer.take() else {
            return;
        };
        let subscription = Arc::clone(&self.subscription);
        let cancel = async move {
            let cancelled = tokio::time::timeout(
                CANCEL_TIMEOUT,
                subscription
                    .channel
                    .basic_cancel(consumer.tag(), BasicCancelOptions::default()),
            )
            .await;
            if !matches!(cancelled, Ok(Ok(()))) {
                // The channel or connection is gone already (its close says why), or the cancel
                // was not answered: the close ends the consumer either way.
                tracing::debug!(
                    channel = subscription.channel.id(),
                    "consumer cancel not confirmed"
                );
            }
            drop(consumer);
            subscription.cancelled.store(true, Ordering::SeqCst);
            subscription.close_when_done();
        };
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => drop(runtime.spawn(cancel)),
            // No runtime: our close cannot start, and lapin's own close of the channel waits for
            // its cancel's answer (its copy of the consumer holds the channel until then).
            Err(_) => {
                drop(cancel);
                self.subscription.cancelled.store(true, Ordering::SeqCst);
            }
        }
    }
}

/// How long a consumer's cancel may take before its channel is closed anyway.
const CANCEL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// One subscription's channel. It is closed once the delivery stream is gone, its consumer
/// cancelled and every delivery from it settled, so that the broker requeues at once what it had
/// pushed to this consumer and no one will handle (the prefetched rest).
pub(crate) struct ConsumerChannel {
    pub(crate) channel: Channel,
    pub(crate) outstanding: AtomicUsize,
    stream_gone: AtomicBool,
    /// No consumer on the channel is left to cancel (true until one is subscribed).
    cancelled: AtomicBool,
    closed: AtomicBool,
}

impl ConsumerChannel {
    pub(crate) fn release(self: &Arc<Self>) {
        self.outstanding.fetch_sub(1, Ordering::SeqCst);
        self.close_when_done();
    }

    /// Each of the three conditions is set before this is called, so whichever is met last
    /// closes the channel.
    fn close_when_done(self: &Arc<Self>) {
        if self.stream_gone.load(Ordering::SeqCst)
            && self.cancelled.load(Ordering::SeqCst)
            && self.outstanding.load(Ordering::SeqCst) == 0
        {
            self.close();
        }
    }

    fn close(self: &Arc<Self>) {
        if self.closed.swap(true, Ordering::SeqCst) {
            return;
        }
        let channel = self.channel.clone();
        let id = channel.id();
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => drop(runtime.spawn(async move {
                match channel.close(200, "subscription ended".into()).await {
                    Ok(()) => tracing::debug!(channel = id, "consumer channel closed"),
                    Err(e) => tracing::warn!(channel = id, error = %e, "closing a consumer channel failed"),
                }
            })),
            Err(_) => tracing::warn!(channel = id, "no runtime to close a consumer channel on"),
        }
    }
}

/// Owned by the delivery stream: its drop starts the channel's close. It owns the channel from
/// its creation, so a subscribe that fails or is cancelled half-way (say, after `basic.consume`
/// reached the broker but before the stream was returned) closes the channel too — otherwise
/// the broker would keep pushing up to a prefetch window of messages to a consumer no one reads,
/// and hold them unacknowledged for as long as the connection lives.
pub(crate) struct StreamGuard(pub(crate) Arc<ConsumerChannel>);

impl StreamGuard {
    pub(crate) fn new(channel: Channel) -> Self {
        Self(Arc::new(ConsumerChannel {
            channel,
            outstanding: AtomicUsize::new(0),
            stream_gone: AtomicBool::new(false),
            cancelled: AtomicBool::new(true),
            closed: AtomicBool::new(false),
        }))
    }
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        self.0.stream_gone.store(true, Ordering::SeqCst);
        let outstanding = self.0.outstanding.load(Ordering::SeqCst);
        tracing::debug!(
            channel = self.0.channel.id(),
            outstanding,
            "delivery stream dropped"
        );
        self.0.close_when_done();
    }
}
