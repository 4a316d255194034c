//! Deliveries from a durable consumer (acked after the commit, kept alive while in progress), and
//! dead letters read from a stream for a replay.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use async_nats::jetstream::{self, AckKind};
use async_trait::async_trait;
use inbox_core::{AckToken, Delivery, Headers, TransportError};

use crate::headers::{from_header_map, nats_id};

/// A message from a durable pull consumer. Until it is settled, a task tells the server every
/// third of the ack wait that it is still in progress (`+WPI`), so a long handler, or a wait for
/// the database to come back, does not see it redelivered to another instance. Dropped unsettled,
/// it is handed back (nak) at once.
pub struct NatsDelivery {
    message: Arc<jetstream::Message>,
    headers: Headers,
    /// `message-id` header, else `Nats-Msg-Id`.
    id: Option<String>,
    delivered: u32,
    coordinates: Option<String>,
    keep_alive: tokio::task::JoinHandle<()>,
    unsettled: Arc<AtomicUsize>,
    redelivery_delay: Duration,
    timeout: Duration,
    settled: bool,
}

impl fmt::Debug for NatsDelivery {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatsDelivery")
            .field("subject", &self.message.subject.as_str())
            .field("coordinates", &self.coordinates)
            .field("message_id", &self.id)
            .field("delivered", &self.delivered)
            .finish()
    }
}

impl NatsDelivery {
    pub(crate) fn new(
        message: jetstream::Message,
        keep_alive_every: Duration,
        redelivery_delay: Duration,
        timeout: Duration,
        unsettled: &Arc<AtomicUsize>,
    ) -> Self {
        let (delivered, coordinates) = match message.info() {
            Ok(info) => (
                u32::try_from(info.delivered.max(1)).unwrap_or(u32::MAX),
                Some(format!("{}/{}", info.stream, info.stream_sequence)),
            ),
            // Not a JetStream delivery (cannot happen on a pull consumer): counted as a first.
            Err(_) => (1, None),
        };
        let headers = message
            .headers
            .as_ref()
            .map(from_header_map)
            .unwrap_or_default();
        let id = nats_id(message.headers.as_ref());
        let message = Arc::new(message);
        let keep_alive = tokio::spawn({
            let message = Arc::clone(&message);
            async move {
                let mut every = tokio::time::interval(keep_alive_every);
                every.tick().await;
                loop {
                    every.tick().await;
                    // A lost one is not fatal: the next may get through, and at worst the server
                    // redelivers and the inbox discards the copy.
                    if let Err(e) = message.ack_with(AckKind::Progress).await {
                        tracing::debug!(error = %e, "in-progress ack not sent");
                    }
                }
            }
        });
        unsettled.fetch_add(1, Ordering::SeqCst);
        Self {
            message,
            headers,
            id,
            delivered,
            coordinates,
            keep_alive,
            unsettled: Arc::clone(unsettled),
            redelivery_delay,
            timeout,
            settled: false,
        }
    }

    fn settle(&mut self) {
        if !self.settled {
            self.settled = true;
            self.keep_alive.abort();
            self.unsettled.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

#[async_trait]
impl Delivery for NatsDelivery {
    fn payload(&self) -> &[u8] {
        &self.message.payload
    }

    fn headers(&self) -> &Headers {
        &self.headers
    }

    fn broker_message_id(&self) -> Option<&[u8]> {
        self.id.as_deref().map(str::as_bytes)
    }

    fn redelivered(&self) -> bool {
        self.delivered > 1
    }

    fn delivery_count(&self) -> Option<u32> {
        Some(self.delivered)
    }

    fn coordinates(&self) -> Option<String> {
        self.coordinates.clone()
    }

    /// Acks and waits for the server to confirm it (a "double ack"): an ack lost on the way is
    /// reported, not assumed.
    async fn ack(mut self: Box<Self>, _token: AckToken) -> Result<(), TransportError> {
        self.keep_alive.abort();
        let Some(reply) = self.message.reply.clone() else {
            self.settle();
            return Err(TransportError::AckLost("not a JetStream delivery".into()));
        };
        let client = &self.message.context.client();
        let confirmed =
            tokio::time::timeout(self.timeout, client.request(reply, AckKind::Ack.into())).await;
        self.settle();
        match confirmed {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(TransportError::AckLost(Box::new(e))),
            Err(_) => Err(TransportError::AckLost(
                format!(
                    "the server did not confirm the ack within {:?}",
                    self.timeout
                )
                .into(),
            )),
        }
    }

    /// Naks with the configured redelivery delay.
    async fn nack(mut self: Box<Self>, requeue: bool) -> Result<(), TransportError> {
        // Without requeue the message must still not be lost: it comes back after the ack wait.
        let kind = if requeue {
            AckKind::Nak(Some(self.redelivery_delay).filter(|d| !d.is_zero()))
        } else {
            AckKind::Progress
        };
        self.keep_alive.abort();
        let sent = self.message.ack_with(kind).await;
        self.settle();
        sent.map_err(TransportError::AckLost)
    }
}

impl Drop for NatsDelivery {
    fn drop(&mut self) {
        if self.settled {
            return;
        }
        self.settle();
        // Handed back at once, so another instance gets it without waiting out the ack wait.
        let message = Arc::clone(&self.message);
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            drop(runtime.spawn(async move {
                let _ = message.ack_with(AckKind::Nak(None)).await;
            }));
        }
    }
}

/// A dead letter read from its stream for a replay. Acking it deletes it from the stream;
/// dropping or nacking it leaves it there.
pub struct NatsLetter {
    pub(crate) stream: jetstream::stream::Stream,
    pub(crate) sequence: u64,
    pub(crate) payload: bytes::Bytes,
    pub(crate) headers: Headers,
    pub(crate) id: Option<String>,
}

impl fmt::Debug for NatsLetter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatsLetter")
            .field("stream", &self.stream.cached_info().config.name)
            .field("sequence", &self.sequence)
            .field("message_id", &self.id)
            .finish()
    }
}

#[async_trait]
impl Delivery for NatsLetter {
    fn payload(&self) -> &[u8] {
        &self.payload
    }

    fn headers(&self) -> &Headers {
        &self.headers
    }

    fn broker_message_id(&self) -> Option<&[u8]> {
        self.id.as_deref().map(str::as_bytes)
    }

    fn redelivered(&self) -> bool {
        false
    }

    fn coordinates(&self) -> Option<String> {
        Some(format!(
            "{}/{}",
            self.stream.cached_info().config.name,
            self.sequence
        ))
    }

    async fn ack(self: Box<Self>, _token: AckToken) -> Result<(), TransportError> {
        match self.stream.delete_message(self.sequence).await {
            Ok(_) => Ok(()),
            Err(e) => Err(TransportError::AckLost(Box::new(e))),
        }
    }

    async fn nack(self: Box<Self>, _requeue: bool) -> Result<(), TransportError> {
        Ok(())
    }
}
