//! The transport: its state, its public methods, and the [`Transport`] implementation.

use std::collections::HashSet;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};

use async_trait::async_trait;
use futures::StreamExt;
use inbox_core::{
    Capabilities, DeliveryStream, OutgoingMessage, Subscription, Transport, TransportError,
};
use lapin::options::QueueDeclareOptions;
use lapin::types::FieldTable;
use tokio::sync::Mutex;

use crate::config::check_consumer_name;
use crate::connection::{Link, broker_error, redact, short};
use crate::consume::StreamGuard;
use crate::headers::from_field_table;
use crate::{QueueType, RabbitMqConfig, queue_name};

/// How long a dead-letter read waits for the next letter before it ends short of the count the
/// queue held when it began: another reader (a second replay) may have taken the rest.
const DEAD_LETTER_IDLE: std::time::Duration = std::time::Duration::from_secs(10);

/// `stream`'s first `count` items, ending early once none has come for `idle`.
fn until_idle(stream: DeliveryStream, count: usize, idle: std::time::Duration) -> DeliveryStream {
    Box::pin(futures::stream::unfold(
        (stream, count),
        move |(mut stream, left)| async move {
            if left == 0 {
                return None;
            }
            match tokio::time::timeout(idle, stream.next()).await {
                Ok(Some(item)) => Some((item, (stream, left - 1))),
                Ok(None) => None,
                Err(_) => {
                    tracing::debug!(
                        left,
                        "no dead letter for {idle:?}: another reader has the rest"
                    );
                    None
                }
            }
        },
    ))
}

/// A RabbitMQ broker reached through an AMQP URL (`amqp://` or `amqps://`).
pub struct RabbitMqTransport {
    pub(crate) uri: String,
    pub(crate) config: RabbitMqConfig,
    pub(crate) link: Mutex<Link>,
    pub(crate) unsettled: Arc<AtomicUsize>,
    pub(crate) connections: AtomicUsize,
    /// Acks to go with a prefetch of 1 (see [`CAREFUL_ACKS`](crate::consume::CAREFUL_ACKS)).
    pub(crate) careful: Arc<AtomicU32>,
    /// Queues already warned about (declared earlier with other arguments).
    pub(crate) warned: std::sync::Mutex<HashSet<String>>,
}

impl fmt::Debug for RabbitMqTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RabbitMqTransport")
            .field("uri", &redact(&self.uri))
            .field("config", &self.config)
            .finish()
    }
}

impl RabbitMqTransport {
    /// A transport for `uri` (for example `amqp://guest:guest@127.0.0.1:5672/%2f`). Connects
    /// lazily, on the first subscribe or publish, and again after the connection is lost.
    pub fn new(uri: impl Into<String>, config: RabbitMqConfig) -> Self {
        Self {
            uri: uri.into(),
            config,
            link: Mutex::new(Link::default()),
            unsettled: Arc::default(),
            connections: AtomicUsize::new(0),
            careful: Arc::default(),
            warned: std::sync::Mutex::default(),
        }
    }

    /// Connects now, to fail early on a wrong URL or credentials.
    pub async fn connect(
        uri: impl Into<String>,
        config: RabbitMqConfig,
    ) -> Result<Self, TransportError> {
        let transport = Self::new(uri, config);
        transport.connection().await?;
        Ok(transport)
    }

    /// Declares the source exchange and the consumer's queue, so that messages published from now
    /// on are kept for that consumer even before it subscribes.
    pub async fn declare_consumer_queue(
        &self,
        source: &str,
        consumer: &str,
    ) -> Result<(), TransportError> {
        check_consumer_name(consumer)?;
        self.declare_consumer(source, consumer).await
    }

    /// Reads up to `max` messages of `queue` and leaves them there (they go back to the queue,
    /// marked redelivered, when the reading channel closes): for looking at a dead-letter queue.
    pub async fn peek_messages(
        &self,
        queue: &str,
        max: usize,
    ) -> Result<Vec<OutgoingMessage>, TransportError> {
        self.get_messages(queue, max, false).await
    }

    async fn get_messages(
        &self,
        queue: &str,
        max: usize,
        remove: bool,
    ) -> Result<Vec<OutgoingMessage>, TransportError> {
        let connection = self.connection().await?;
        let channel = self.open_channel(&connection).await?;
        let mut taken = Vec::new();
        while taken.len() < max {
            let Some(message) = channel
                .basic_get(
                    short(queue)?,
                    lapin::options::BasicGetOptions { no_ack: remove },
                )
                .await
                .map_err(broker_error)?
            else {
                break;
            };
            let delivery = &message.delivery;
            let headers =
                from_field_table(&delivery.properties.headers().clone().unwrap_or_default());
            taken.push(OutgoingMessage {
                message_id: delivery
                    .properties
                    .message_id()
                    .as_ref()
                    .map(|id| id.as_str().to_owned()),
                payload: delivery.data.clone().into(),
                headers,
                key: None,
            });
        }
        // Closing the channel returns what was read without removing it.
        let _ = channel.close(200, "read".into()).await;
        Ok(taken)
    }
}

#[async_trait]
impl Transport for RabbitMqTransport {
    fn name(&self) -> &'static str {
        "rabbitmq"
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::basic().with_delivery_count(self.config.queue_type == QueueType::Quorum)
    }

    async fn declare(&self, subscription: &Subscription) -> Result<(), TransportError> {
        self.declare_consumer_queue(&subscription.source, subscription.consumer.as_str())
            .await
    }

    async fn subscribe(
        &self,
        subscription: &Subscription,
    ) -> Result<DeliveryStream, TransportError> {
        let consumer = subscription.consumer.as_str();
        check_consumer_name(consumer)?;
        let source = &subscription.source;
        self.declare_consumer(source, consumer).await?;
        if let Some(dead_letter) = &subscription.dead_letter {
            self.declare_dead_letter(dead_letter).await?;
        }
        let connection = self.connection().await?;
        let guard = StreamGuard::new(self.open_channel(&connection).await?);
        let queue = queue_name(source, consumer);
        let prefetch = if self.careful.load(Ordering::SeqCst) > 0 {
            tracing::info!(queue = %queue, "consuming one message at a time after an unparsable delivery");
            1
        } else {
            subscription.prefetch.max(1)
        };
        self.consume(guard, &queue, prefetch).await
    }

    /// The dead-letter queue of the same name, consumed with no prefetch limit; the stream ends
    /// after as many deliveries as the queue held ready, or once none has come for 10 s (another
    /// reader took the rest: a replay then reports fewer letters read, and a second run finds
    /// them).
    async fn read_dead_letters(&self, destination: &str) -> Result<DeliveryStream, TransportError> {
        self.declare_dead_letter(destination).await?;
        let connection = self.connection().await?;
        let guard = StreamGuard::new(self.open_channel(&connection).await?);
        let channel = &guard.0.channel;
        let ready = channel
            .queue_declare(
                short(destination)?,
                QueueDeclareOptions {
                    passive: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .map_err(broker_error)?
            .message_count();
        // No prefetch limit: a replay holds the letters that are not its own unacknowledged
        // until it is done, so a window would stall once it is full of them. (The letters are in
        // memory at once: the price of reading a queue that other consumers share.)
        let stream = self.consume(guard, destination, 0).await?;
        Ok(until_idle(stream, ready as usize, DEAD_LETTER_IDLE))
    }

    async fn publish(
        &self,
        destination: &str,
        message: OutgoingMessage,
    ) -> Result<(), TransportError> {
        match self.publish_once(destination, &message).await {
            // (No route is not the channel's fault: a fresh one would be refused the same way.)
            Err(e) if e.is_transient() && !matches!(e, TransportError::NoRoute(_)) => {
                // The channel or connection may have died since the last publish: one fresh try.
                tracing::debug!(error = %e, "publish failed; retrying on a fresh channel");
                self.publish_once(destination, &message).await
            }
            other => other,
        }
    }
}
