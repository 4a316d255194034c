//! What a broker must offer: deliveries that can be acked and nacked, and publishing.

use std::fmt;
use std::sync::Arc;

use async_trait::async_trait;
use futures::stream::BoxStream;

use crate::error::{StoreError, TransportError};
use crate::id::ConsumerName;
use crate::message::{Headers, OutgoingMessage};

/// Proof that a delivery may be acknowledged.
///
/// Only the consumer engine in this crate can make one, and it does so only after the inbox
/// transaction that recorded the message committed, after it found the message already done or
/// dead-lettered, or after the message was dead-lettered. [`Delivery::ack`] takes it by value, so
/// code that tries to ack before the commit does not compile.
#[derive(Debug)]
#[must_use = "an AckToken exists to be spent on Delivery::ack"]
pub struct AckToken {
    _private: (),
}

impl AckToken {
    pub(crate) fn new() -> Self {
        Self { _private: () }
    }

    /// A token for a transport's own tests, which exercise ack without an engine and a database.
    #[cfg(feature = "test-util")]
    pub fn for_transport_tests() -> Self {
        Self::new()
    }
}

/// One delivery of a message by a broker. The same message may be delivered many times.
#[async_trait]
pub trait Delivery: Send + Sync + fmt::Debug {
    /// The payload.
    fn payload(&self) -> &[u8];
    /// The headers.
    fn headers(&self) -> &Headers;
    /// The broker's own message id property, if the protocol has one and it is set
    /// (AMQP `message_id`).
    fn broker_message_id(&self) -> Option<&[u8]>;
    /// Whether the broker says it delivered this message before.
    fn redelivered(&self) -> bool;
    /// How often the broker delivered this message, this time included, where it counts
    /// (RabbitMQ quorum queues' `x-delivery-count` + 1). Feeds the attempt limit.
    fn delivery_count(&self) -> Option<u32> {
        None
    }
    /// The record's position, where the broker has one (Kafka `topic/partition/offset`).
    fn coordinates(&self) -> Option<String> {
        None
    }
    /// The record's place in a partitioned log (Kafka), which offsets mode
    /// ([`Dedup::Offsets`](crate::Dedup)) dedups by. `None` where the broker has no such log.
    fn log_position(&self) -> Option<LogPosition<'_>> {
        None
    }
    /// Deliveries with the same key are handled one after another, in delivery order (Kafka:
    /// the partition). `None`: no order to keep.
    fn ordering_key(&self) -> Option<&str> {
        None
    }
    /// Acknowledges the delivery. Needs the [`AckToken`] that only a commit yields.
    ///
    /// An error means the broker may redeliver: the inbox will discard that copy.
    async fn ack(self: Box<Self>, token: AckToken) -> Result<(), TransportError>;
    /// Hands the delivery back. With `requeue`, the broker delivers it again (to any instance).
    async fn nack(self: Box<Self>, requeue: bool) -> Result<(), TransportError>;
}

/// What a transport can do, so the engine (and the conformance suite) adapt to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Capabilities {
    /// A nack with requeue makes the broker redeliver (RabbitMQ, memory). Without it (Kafka),
    /// failures are retried in place.
    pub requeue: bool,
    /// Deliveries carry a delivery count.
    pub delivery_count: bool,
    /// Deliveries carry coordinates usable as ids.
    pub coordinates: bool,
    /// Deliveries carry ordering keys (Kafka partitions): one key's deliveries are handled one
    /// at a time, in order.
    pub ordered: bool,
    /// Header values may be any bytes (AMQP, Kafka). Without it (NATS: headers are text), a
    /// message with a header value that is not UTF-8 cannot be published.
    pub binary_headers: bool,
    /// Deliveries carry [log positions](Delivery::log_position), and a subscription with
    /// [`Subscription::offsets`] starts each partition it is assigned at the offset kept there
    /// (Kafka): what offsets mode needs.
    pub log_positions: bool,
}

impl Capabilities {
    /// Capabilities of a broker with requeue and nothing else.
    pub const fn basic() -> Self {
        Self {
            requeue: true,
            delivery_count: false,
            coordinates: false,
            ordered: false,
            binary_headers: true,
            log_positions: false,
        }
    }

    /// Sets `requeue`.
    pub const fn with_requeue(mut self, yes: bool) -> Self {
        self.requeue = yes;
        self
    }

    /// Sets `delivery_count`.
    pub const fn with_delivery_count(mut self, yes: bool) -> Self {
        self.delivery_count = yes;
        self
    }

    /// Sets `coordinates`.
    pub const fn with_coordinates(mut self, yes: bool) -> Self {
        self.coordinates = yes;
        self
    }

    /// Sets `ordered`.
    pub const fn with_ordered(mut self, yes: bool) -> Self {
        self.ordered = yes;
        self
    }

    /// Sets `log_positions`.
    pub const fn with_log_positions(mut self, yes: bool) -> Self {
        self.log_positions = yes;
        self
    }

    /// Sets `binary_headers`.
    pub const fn with_binary_headers(mut self, yes: bool) -> Self {
        self.binary_headers = yes;
        self
    }
}

/// What a consumer subscribes to.
///
/// `source` is a topic (Kafka topic, RabbitMQ exchange, memory topic). Every consumer name gets
/// every message of the source once (its own queue or consumer group); instances that share a
/// consumer name compete for the messages.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct Subscription {
    /// The topic to consume.
    pub source: String,
    /// The consumer: the group whose instances compete.
    pub consumer: ConsumerName,
    /// How many unacknowledged deliveries the broker may hand this instance at once.
    pub prefetch: u16,
    /// Where this consumer's dead letters go, so the transport can declare it up front.
    pub dead_letter: Option<String>,
    /// How often the engine lets a message be delivered before it dead-letters it
    /// ([`RetryPolicy::max_deliveries`](crate::RetryPolicy)): a broker's own delivery limit
    /// must stay above it, or the broker would stop delivering a message without a dead letter.
    pub max_deliveries: Option<u32>,
    /// Offsets mode: where the consumer keeps the next offset of each partition it reads. A
    /// transport with [`Capabilities::log_positions`] starts a partition it is assigned there
    /// rather than at the broker's committed offset.
    pub offsets: Option<Offsets>,
}

/// A record's place in a partitioned log: topic, partition, offset.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct LogPosition<'a> {
    /// The topic.
    pub topic: &'a str,
    /// The partition.
    pub partition: i32,
    /// The record's offset.
    pub offset: i64,
}

impl<'a> LogPosition<'a> {
    /// The record at `offset` of `topic`'s `partition`.
    pub fn new(topic: &'a str, partition: i32, offset: i64) -> Self {
        Self {
            topic,
            partition,
            offset,
        }
    }
}

/// Reads the next offset a consumer keeps for a partition (offsets mode): what a transport
/// seeks to when it is assigned the partition.
#[async_trait]
pub trait OffsetSource: Send + Sync {
    /// The offset of the next record to handle in `topic`'s `partition`; `None` when nothing is
    /// kept for it (the broker's committed offset then decides).
    async fn next_offset(&self, topic: &str, partition: i32) -> Result<Option<i64>, StoreError>;
}

/// A shared [`OffsetSource`], as a [`Subscription`] carries it.
#[derive(Clone)]
pub struct Offsets(pub Arc<dyn OffsetSource>);

impl fmt::Debug for Offsets {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Offsets(..)")
    }
}

impl PartialEq for Offsets {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Subscription {
    /// A subscription with the given prefetch.
    pub fn new(source: impl Into<String>, consumer: ConsumerName, prefetch: u16) -> Self {
        Self {
            source: source.into(),
            consumer,
            prefetch,
            dead_letter: None,
            max_deliveries: None,
            offsets: None,
        }
    }

    /// Sets the dead-letter destination.
    pub fn with_dead_letter(mut self, destination: impl Into<String>) -> Self {
        self.dead_letter = Some(destination.into());
        self
    }

    /// Sets the engine's delivery limit.
    pub fn with_max_deliveries(mut self, limit: u32) -> Self {
        self.max_deliveries = Some(limit);
        self
    }
}

/// The deliveries of one subscription. Ends (or yields an error) when the connection is lost; the
/// consumer then subscribes again.
pub type DeliveryStream = BoxStream<'static, Result<Box<dyn Delivery>, TransportError>>;

/// A message broker: subscribe to a source, publish to a destination.
#[async_trait]
pub trait Transport: Send + Sync + fmt::Debug {
    /// A short name for logs and metrics labels (`memory`, `rabbitmq`, `kafka`).
    fn name(&self) -> &'static str;
    /// What this broker can do.
    fn capabilities(&self) -> Capabilities;
    /// Makes sure that messages published to the subscription's source from now on are kept for
    /// its consumer, even before it subscribes (declares queues, consumer groups).
    async fn declare(&self, subscription: &Subscription) -> Result<(), TransportError> {
        let _ = subscription;
        Ok(())
    }
    /// Starts consuming.
    async fn subscribe(
        &self,
        subscription: &Subscription,
    ) -> Result<DeliveryStream, TransportError>;
    /// Publishes one message and returns once the broker has it (publisher confirms where the
    /// broker has them).
    async fn publish(
        &self,
        destination: &str,
        message: OutgoingMessage,
    ) -> Result<(), TransportError>;
    /// Reads a dead-letter destination, for an operator's [replay](mod@crate::replay): a stream of
    /// the messages it holds, which ends once everything it held at the call was delivered (or
    /// sooner, where another reader shares the destination and takes some of them).
    /// Acking a delivery removes it from the destination where the broker can remove single
    /// messages (a Kafka log keeps it); dropping or nacking it leaves it there.
    async fn read_dead_letters(&self, destination: &str) -> Result<DeliveryStream, TransportError> {
        let _ = destination;
        Err(TransportError::Unsupported("reading dead letters"))
    }
    /// Waits until subscriptions whose streams were dropped are done with the broker (Kafka: the
    /// last stored offsets committed, the group left). [`Consumer::run`](crate::Consumer::run)
    /// awaits it before it returns, so that an application exiting right after `run` loses
    /// nothing it had settled.
    async fn drained(&self) {}
}
