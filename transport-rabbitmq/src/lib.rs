//! The RabbitMQ transport of `inbox`, on lapin.
//!
//! Topology, declared on subscribe (durable, idempotent):
//! - a source is a durable **fanout exchange** of that name;
//! - each consumer has a durable queue `<source>.<consumer>` bound to it (classic, or quorum with
//!   [`QueueType::Quorum`], whose `x-delivery-count` feeds the attempt limit), so every consumer
//!   gets every message and the instances of one consumer compete;
//! - a dead-letter destination is a fanout exchange with a durable queue of the same name.
//!
//! Consuming uses manual acks only, with `basic.qos` set before `basic.consume`. Publishing uses
//! publisher confirms and the `mandatory` flag, so a message that no queue would keep is an error,
//! not a silent loss. A message's id travels in the AMQP `message_id` property (an id too long for
//! it, over 255 bytes, goes in the `message-id` header instead).
//!
//! A lost connection ends the delivery stream with an error; the consumer subscribes again, and
//! this transport reconnects. Acks lapin reports as not delivered (a poisoned channel, an acker
//! already used) are returned as [`TransportError::AckLost`], never as success.
#![forbid(unsafe_code)]

use std::collections::HashSet;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};

use async_trait::async_trait;
use futures::StreamExt;
use inbox_core::{
    AckToken, Capabilities, DEFAULT_ID_HEADER, Delivery, DeliveryStream, Headers, OutgoingMessage,
    Subscription, Transport, TransportError,
};
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{
    BasicProperties, Channel, Confirmation, Connection, ConnectionProperties, ExchangeKind,
};
use tokio::sync::Mutex;

/// The queue type of consumer queues.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum QueueType {
    /// Classic queues.
    #[default]
    Classic,
    /// Quorum queues: replicated, and they count deliveries (`x-delivery-count`).
    Quorum,
}

/// How the transport names and declares things.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RabbitMqConfig {
    /// The type of the consumer queues this transport declares.
    pub queue_type: QueueType,
    /// The connection name the broker shows (management UI, `rabbitmqctl list_connections`).
    pub connection_name: String,
    /// Delete declared queues after they have been unused this long (`x-expires`); for
    /// short-lived consumers and tests. `None`: keep them.
    pub queue_expires: Option<std::time::Duration>,
    /// Quorum queues only: how often the broker may deliver a message of a consumer's queue
    /// before it moves it to the consumer's quarantine queue `<source>.<consumer>.quarantine`
    /// (`x-delivery-limit`, with that queue as its dead-letter target; default 25). The engine
    /// dead-letters a message itself once the count passes its own `max_deliveries` (20 by
    /// default: keep it below this), so the broker's limit only takes out what the engine never
    /// sees: a message lapin cannot parse (a non-UTF-8 `message_id`, say), whose every delivery
    /// kills the connection. `None`: no limit (RabbitMQ 4 then applies its default of 20 and,
    /// without a dead-letter target, drops the message).
    pub delivery_limit: Option<u32>,
    /// How long a publish may wait for the broker's confirm (default 30 s) before it fails as
    /// [`TransportError::NotConfirmed`]. A broker under a memory or disk alarm blocks publishing
    /// connections and never confirms; the dead-letter publish that waits holds its message's
    /// inbox transaction meanwhile.
    pub publish_timeout: std::time::Duration,
}

impl Default for RabbitMqConfig {
    fn default() -> Self {
        Self {
            queue_type: QueueType::Classic,
            connection_name: "inbox".to_owned(),
            queue_expires: None,
            delivery_limit: Some(25),
            publish_timeout: std::time::Duration::from_secs(30),
        }
    }
}

impl RabbitMqConfig {
    /// Sets the queue type.
    pub fn queue_type(mut self, queue_type: QueueType) -> Self {
        self.queue_type = queue_type;
        self
    }

    /// Sets the connection name.
    pub fn connection_name(mut self, name: impl Into<String>) -> Self {
        self.connection_name = name.into();
        self
    }

    /// Sets `queue_expires`.
    pub fn queue_expires(mut self, after: std::time::Duration) -> Self {
        self.queue_expires = Some(after);
        self
    }

    /// Sets `delivery_limit`.
    pub fn delivery_limit(mut self, limit: Option<u32>) -> Self {
        self.delivery_limit = limit;
        self
    }

    /// Sets `publish_timeout`.
    pub fn publish_timeout(mut self, timeout: std::time::Duration) -> Self {
        self.publish_timeout = timeout;
        self
    }
}

/// The queue a consumer reads: `<source>.<consumer>`.
pub fn queue_name(source: &str, consumer: &str) -> String {
    format!("{source}.{consumer}")
}

/// Where a quorum consumer queue's broker-side dead letters go: `<queue>.quarantine`.
pub fn quarantine_name(source: &str, consumer: &str) -> String {
    format!("{}.quarantine", queue_name(source, consumer))
}

/// After a delivery lapin could not parse killed the connection, this many acks go by with a
/// prefetch of 1, so that the broker's delivery limit counts the unparsable message alone and not
/// the good ones that arrived in the same window.
const CAREFUL_ACKS: u32 = 8;

/// Consumer names this transport can give a queue of their own. A dot would make two
/// (source, consumer) pairs share a queue — `a.b` + `c` and `a` + `b.c` both read `a.b.c`, so
/// each message would reach only one of the two consumers — and `dead-letter` would read the
/// source's dead-letter queue.
fn check_consumer_name(consumer: &str) -> Result<(), TransportError> {
    if consumer.contains('.') {
        return Err(TransportError::Config(format!(
            "consumer name {consumer:?} contains '.': on RabbitMQ the queue is \"<source>.<consumer>\", and a dot would let two consumers share one queue; use '-' or '_'"
        )));
    }
    if consumer == "dead-letter" || consumer == "quarantine" {
        return Err(TransportError::Config(format!(
            "consumer name {consumer:?} is reserved: its queue would be a dead-letter or quarantine queue"
        )));
    }
    Ok(())
}

/// Connection state, replaced when a connection dies. Publishing has a connection of its own
/// (RabbitMQ blocks a publishing connection under a memory or disk alarm, and a connection that
/// a consumer's frame kills should not take the publisher with it), subscriptions share the other.
#[derive(Default)]
struct Link {
    connection: Option<Arc<Connection>>,
    publishing: Option<Arc<Connection>>,
    publisher: Option<Channel>,
    declared: HashSet<String>,
}

/// A RabbitMQ broker reached through an AMQP URL (`amqp://` or `amqps://`).
pub struct RabbitMqTransport {
    uri: String,
    config: RabbitMqConfig,
    link: Mutex<Link>,
    unsettled: Arc<AtomicUsize>,
    connections: AtomicUsize,
    /// Acks to go with a prefetch of 1 (see [`CAREFUL_ACKS`]).
    careful: Arc<AtomicU32>,
    /// Queues already warned about (declared earlier with other arguments).
    warned: std::sync::Mutex<HashSet<String>>,
}

impl fmt::Debug for RabbitMqTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RabbitMqTransport")
            .field("uri", &redact(&self.uri))
            .field("config", &self.config)
            .finish()
    }
}

/// The URL without its password, for logs and errors. Also for malformed ones: in
/// `amqp:user:pw@host` (no `//`) everything between the scheme and the last `@` may be secret.
pub fn redact(uri: &str) -> String {
    let Some(at) = uri.rfind('@') else {
        return uri.to_owned();
    };
    let start = match (uri.find("://"), uri.find(':')) {
        (Some(scheme), _) => scheme + 3,
        (None, Some(colon)) => colon + 1,
        (None, None) => 0,
    };
    if at < start {
        return uri.to_owned();
    }
    match uri[start..at].split_once(':') {
        Some((user, _)) => format!("{}{user}:***{}", &uri[..start], &uri[at..]),
        None if uri.find("://").is_some() => uri.to_owned(),
        None => format!("{}***{}", &uri[..start], &uri[at..]),
    }
}

fn short(value: &str) -> Result<ShortString, TransportError> {
    ShortString::try_new(value).map_err(|e| TransportError::Config(format!("{value:?}: {e}")))
}

/// The broker refused a declare because the queue exists with other arguments.
fn inequivalent(error: &lapin::Error) -> bool {
    matches!(error.kind(), lapin::ErrorKind::ProtocolError(amqp)
        if matches!(amqp.kind(), AMQPErrorKind::Soft(AMQPSoftError::PRECONDITIONFAILED))
            && amqp.get_message().as_str().contains("inequivalent arg"))
}

/// Maps a lapin error: refusals by the broker (missing or mismatched queues and exchanges,
/// access) are permanent; everything else is a connection problem.
fn broker_error(error: lapin::Error) -> TransportError {
    if let lapin::ErrorKind::ProtocolError(amqp) = error.kind()
        && let AMQPErrorKind::Soft(
            AMQPSoftError::ACCESSREFUSED
            | AMQPSoftError::NOTFOUND
            | AMQPSoftError::PRECONDITIONFAILED,
        ) = amqp.kind()
    {
        return TransportError::Refused(Box::new(error));
    }
    TransportError::Disconnected(Box::new(error))
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
        let channel = connection.create_channel().await.map_err(broker_error)?;
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

    async fn connection(&self) -> Result<Arc<Connection>, TransportError> {
        let mut link = self.link.lock().await;
        if let Some(connection) = &link.connection
            && connection.status().connected()
        {
            return Ok(Arc::clone(connection));
        }
        link.connection = None;
        let connection = self.open("consume").await?;
        link.connection = Some(Arc::clone(&connection));
        Ok(connection)
    }

    /// Opens a connection. A URL that does not parse is a configuration error (permanent), said
    /// without the URL's text: lapin's message would quote it whole, password and all.
    async fn open(&self, role: &str) -> Result<Arc<Connection>, TransportError> {
        if let Err(e) = self.uri.parse::<lapin::uri::AMQPUri>() {
            let reason = if e.contains(&self.uri) {
                "invalid AMQP URL".to_owned()
            } else {
                e
            };
            return Err(TransportError::Config(format!(
                "{reason}: {} (expected amqp://user:password@host:port/vhost)",
                redact(&self.uri)
            )));
        }
        let properties = ConnectionProperties::default().with_connection_name(
            format!("{} ({role})", self.config.connection_name)
                .as_str()
                .into(),
        );
        let connection = Connection::connect(&self.uri, properties)
            .await
            .map_err(|e| {
                let text = e.to_string().replace(&self.uri, &redact(&self.uri));
                tracing::warn!(uri = %redact(&self.uri), error = %text, "cannot connect to RabbitMQ");
                TransportError::Disconnected(text.into())
            })?;
        self.connections.fetch_add(1, Ordering::SeqCst);
        tracing::info!(uri = %redact(&self.uri), role, "connected to RabbitMQ");
        Ok(Arc::new(connection))
    }

    async fn declare_exchange(&self, channel: &Channel, name: &str) -> Result<(), TransportError> {
        channel
            .exchange_declare(
                short(name)?,
                ExchangeKind::Fanout,
                ExchangeDeclareOptions {
                    durable: true,
                    ..ExchangeDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .map_err(broker_error)
    }

    /// Declares `queue` with `arguments` and binds it to `exchange`, on channels of its own. A
    /// queue that exists with other arguments (declared by an older version, or with another
    /// queue type) is used as it is, with a warning that says how to bring it in line: a queue's
    /// arguments cannot change in place, but a policy can add what it lacks.
    async fn declare_queue(
        &self,
        queue: &str,
        exchange: &str,
        arguments: FieldTable,
    ) -> Result<(), TransportError> {
        let connection = self.connection().await?;
        let channel = connection.create_channel().await.map_err(broker_error)?;
        let declared = channel
            .queue_declare(
                short(queue)?,
                QueueDeclareOptions {
                    durable: true,
                    ..QueueDeclareOptions::default()
                },
                arguments.clone(),
            )
            .await;
        let channel = match declared {
            Ok(_) => channel,
            Err(e) if inequivalent(&e) => {
                // The broker closed that channel; the queue is there.
                self.warn_inequivalent(queue, &arguments);
                connection.create_channel().await.map_err(broker_error)?
            }
            Err(e) => return Err(broker_error(e)),
        };
        let bound = channel
            .queue_bind(
                short(queue)?,
                short(exchange)?,
                "".into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(broker_error);
        let _ = channel.close(200, "declared".into()).await;
        bound
    }

    fn warn_inequivalent(&self, queue: &str, arguments: &FieldTable) {
        if !self
            .warned
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(queue.to_owned())
        {
            return;
        }
        let wanted: Vec<String> = arguments
            .inner()
            .iter()
            .map(|(k, v)| {
                format!(
                    "{}={}",
                    k.as_str(),
                    String::from_utf8_lossy(&amqp_to_bytes(v))
                )
            })
            .collect();
        let policy = match arguments.inner().get("x-delivery-limit") {
            Some(limit) => format!(
                "; a policy adds the quarantine: rabbitmqctl set_policy inbox-{queue} '^{}$' '{{\"delivery-limit\":{},\"dead-letter-exchange\":\"\",\"dead-letter-routing-key\":\"{queue}.quarantine\",\"dead-letter-strategy\":\"at-least-once\",\"overflow\":\"reject-publish\"}}' --apply-to queues",
                queue.replace('.', "\\."),
                String::from_utf8_lossy(&amqp_to_bytes(limit)),
            ),
            None => String::new(),
        };
        tracing::warn!(
            queue,
            wanted = %wanted.join(", "),
            "queue exists with other arguments; using it as it is{policy}"
        );
    }

    /// The arguments of a consumer's queue.
    fn consumer_queue_arguments(&self, source: &str, consumer: &str) -> FieldTable {
        let mut arguments = self.expiring();
        if self.config.queue_type == QueueType::Quorum {
            arguments.insert(
                "x-queue-type".into(),
                AMQPValue::LongString("quorum".into()),
            );
            if let Some(limit) = self.config.delivery_limit {
                let quarantine = quarantine_name(source, consumer);
                arguments.insert(
                    "x-delivery-limit".into(),
                    AMQPValue::LongLongInt(limit.into()),
                );
                arguments.insert(
                    "x-dead-letter-exchange".into(),
                    AMQPValue::LongString("".into()),
                );
                arguments.insert(
                    "x-dead-letter-routing-key".into(),
                    AMQPValue::LongString(quarantine.as_str().into()),
                );
                arguments.insert(
                    "x-dead-letter-strategy".into(),
                    AMQPValue::LongString("at-least-once".into()),
                );
                // Required by at-least-once dead-lettering (with no length limit it does nothing).
                arguments.insert(
                    "x-overflow".into(),
                    AMQPValue::LongString("reject-publish".into()),
                );
            }
        }
        arguments
    }

    /// `x-expires` where the configuration asks for it.
    fn expiring(&self) -> FieldTable {
        let mut arguments = FieldTable::default();
        if let Some(after) = self.config.queue_expires {
            let ms = i64::try_from(after.as_millis()).unwrap_or(i64::MAX).max(1);
            arguments.insert("x-expires".into(), AMQPValue::LongLongInt(ms));
        }
        arguments
    }

    /// The source exchange, the consumer's quarantine queue (quorum queues with a delivery
    /// limit) and the consumer's queue.
    async fn declare_consumer(&self, source: &str, consumer: &str) -> Result<(), TransportError> {
        self.declare_exchange_alone(source).await?;
        if self.config.queue_type == QueueType::Quorum && self.config.delivery_limit.is_some() {
            // Bound to nothing: only the broker's dead-lettering routes to it (through the
            // default exchange), and it must exist before the first message goes there.
            let quarantine = quarantine_name(source, consumer);
            let connection = self.connection().await?;
            let channel = connection.create_channel().await.map_err(broker_error)?;
            let declared = channel
                .queue_declare(
                    short(&quarantine)?,
                    QueueDeclareOptions {
                        durable: true,
                        ..QueueDeclareOptions::default()
                    },
                    self.expiring(),
                )
                .await;
            let _ = channel.close(200, "declared".into()).await;
            match declared {
                Ok(_) => {}
                Err(e) if inequivalent(&e) => {}
                Err(e) => return Err(broker_error(e)),
            }
        }
        self.declare_queue(
            &queue_name(source, consumer),
            source,
            self.consumer_queue_arguments(source, consumer),
        )
        .await
    }

    /// A fanout exchange with a durable queue of the same name (dead-letter destinations).
    async fn declare_dead_letter(&self, destination: &str) -> Result<(), TransportError> {
        self.declare_exchange_alone(destination).await?;
        self.declare_queue(destination, destination, self.expiring())
            .await
    }

    async fn declare_exchange_alone(&self, name: &str) -> Result<(), TransportError> {
        let connection = self.connection().await?;
        let channel = connection.create_channel().await.map_err(broker_error)?;
        let declared = self.declare_exchange(&channel, name).await;
        let _ = channel.close(200, "declared".into()).await;
        declared
    }

    /// The confirming publisher channel, on the publishing connection.
    async fn publisher(&self) -> Result<Channel, TransportError> {
        let mut link = self.link.lock().await;
        if let Some(channel) = &link.publisher
            && channel.status().connected()
        {
            return Ok(channel.clone());
        }
        let connection = match &link.publishing {
            Some(connection) if connection.status().connected() => Arc::clone(connection),
            _ => {
                link.publishing = None;
                let connection = self.open("publish").await?;
                link.publishing = Some(Arc::clone(&connection));
                connection
            }
        };
        let channel = connection.create_channel().await.map_err(broker_error)?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(broker_error)?;
        link.publisher = Some(channel.clone());
        link.declared.clear();
        Ok(channel)
    }

    async fn publish_once(
        &self,
        destination: &str,
        message: &OutgoingMessage,
    ) -> Result<(), TransportError> {
        let channel = self.publisher().await?;
        let needs_declare = !self.link.lock().await.declared.contains(destination);
        if needs_declare {
            self.declare_exchange(&channel, destination).await?;
            self.link
                .lock()
                .await
                .declared
                .insert(destination.to_owned());
        }
        let mut headers = to_field_table(&message.headers);
        let mut properties = BasicProperties::default().with_delivery_mode(2);
        if let Some(id) = &message.message_id {
            match ShortString::try_new(id.as_str()) {
                Ok(id) => properties = properties.with_message_id(id),
                Err(_) => {
                    headers.insert(
                        DEFAULT_ID_HEADER.into(),
                        AMQPValue::LongString(id.as_bytes().into()),
                    );
                }
            }
        }
        let properties = properties.with_headers(headers);
        let publish = async {
            channel
                .basic_publish(
                    short(destination)?,
                    "".into(),
                    BasicPublishOptions {
                        mandatory: true,
                        ..BasicPublishOptions::default()
                    },
                    &message.payload,
                    properties,
                )
                .await
                .map_err(broker_error)?
                .await
                .map_err(broker_error)
        };
        let timeout = self.config.publish_timeout;
        let confirm = tokio::time::timeout(timeout, publish)
            .await
            .map_err(|_| {
                TransportError::NotConfirmed(
                    format!("no confirm for the publish to {destination:?} within {timeout:?} (a broker resource alarm blocks publishers)").into(),
                )
            })??;
        match confirm {
            Confirmation::Ack(None) => Ok(()),
            Confirmation::Ack(Some(_returned)) => Err(TransportError::Refused(
                format!("no queue is bound to exchange {destination:?}: declare the consumer's queue before publishing").into(),
            )),
            Confirmation::Nack(_) => Err(TransportError::NotConfirmed(
                format!("the broker nacked the publish to {destination:?}").into(),
            )),
            Confirmation::NotRequested => Err(TransportError::NotConfirmed("publisher confirms are off".into())),
        }
    }
}

fn to_field_table(headers: &Headers) -> FieldTable {
    let mut table = FieldTable::default();
    for (name, value) in headers.iter() {
        if let Ok(name) = ShortString::try_new(name) {
            table.insert(name, AMQPValue::LongString(value.into()));
        }
    }
    table
}

fn from_field_table(table: &FieldTable) -> Headers {
    table
        .inner()
        .iter()
        .map(|(name, value)| (name.as_str().to_owned(), amqp_to_bytes(value)))
        .collect()
}

fn amqp_to_bytes(value: &AMQPValue) -> Vec<u8> {
    match value {
        AMQPValue::LongString(s) => s.as_bytes().to_vec(),
        AMQPValue::ShortString(s) => s.as_str().as_bytes().to_vec(),
        AMQPValue::ByteArray(b) => b.as_slice().to_vec(),
        AMQPValue::Boolean(b) => b.to_string().into_bytes(),
        AMQPValue::ShortShortInt(n) => n.to_string().into_bytes(),
        AMQPValue::ShortShortUInt(n) => n.to_string().into_bytes(),
        AMQPValue::ShortInt(n) => n.to_string().into_bytes(),
        AMQPValue::ShortUInt(n) => n.to_string().into_bytes(),
        AMQPValue::LongInt(n) => n.to_string().into_bytes(),
        AMQPValue::LongUInt(n) => n.to_string().into_bytes(),
        AMQPValue::LongLongInt(n) => n.to_string().into_bytes(),
        AMQPValue::Timestamp(n) => n.to_string().into_bytes(),
        AMQPValue::Float(n) => n.to_string().into_bytes(),
        AMQPValue::Double(n) => n.to_string().into_bytes(),
        other => format!("{other:?}").into_bytes(),
    }
}

/// Headers the broker sets on a delivery, about this delivery: not part of the message, so not
/// handed to the handler nor carried into a dead letter (a replayed letter with a stale
/// `x-delivery-count` would be dead-lettered again at once on a quorum queue).
fn broker_owned(name: &str) -> bool {
    matches!(name, "x-delivery-count" | "x-acquired-count" | "x-death")
        || name.starts_with("x-first-death-")
        || name.starts_with("x-last-death-")
}

fn amqp_to_u32(value: &AMQPValue) -> Option<u32> {
    std::str::from_utf8(&amqp_to_bytes(value))
        .ok()?
        .parse()
        .ok()
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
        let guard = StreamGuard::new(connection.create_channel().await.map_err(broker_error)?);
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
    /// after as many deliveries as the queue held ready.
    async fn read_dead_letters(&self, destination: &str) -> Result<DeliveryStream, TransportError> {
        self.declare_dead_letter(destination).await?;
        let connection = self.connection().await?;
        let guard = StreamGuard::new(connection.create_channel().await.map_err(broker_error)?);
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
        Ok(Box::pin(stream.take(ready as usize)))
    }

    async fn publish(
        &self,
        destination: &str,
        message: OutgoingMessage,
    ) -> Result<(), TransportError> {
        match self.publish_once(destination, &message).await {
            Err(e) if e.is_transient() => {
                // The channel or connection may have died since the last publish: one fresh try.
                tracing::debug!(error = %e, "publish failed; retrying on a fresh channel");
                self.publish_once(destination, &message).await
            }
            other => other,
        }
    }
}

impl RabbitMqTransport {
    /// Consumes `queue` on the guarded channel (0: no prefetch limit).
    async fn consume(
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
        let stream = deliveries.map(move |next| match next {
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

/// One subscription's channel. It is closed once the delivery stream is gone and every delivery
/// from it is settled, so that the broker requeues at once what it had pushed to this consumer
/// and no one will handle (the prefetched rest).
struct ConsumerChannel {
    channel: Channel,
    outstanding: AtomicUsize,
    stream_gone: AtomicBool,
    closed: AtomicBool,
}

impl ConsumerChannel {
    fn release(self: &Arc<Self>) {
        if self.outstanding.fetch_sub(1, Ordering::SeqCst) == 1
            && self.stream_gone.load(Ordering::SeqCst)
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
struct StreamGuard(Arc<ConsumerChannel>);

impl StreamGuard {
    fn new(channel: Channel) -> Self {
        Self(Arc::new(ConsumerChannel {
            channel,
            outstanding: AtomicUsize::new(0),
            stream_gone: AtomicBool::new(false),
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
        if outstanding == 0 {
            self.0.close();
        }
    }
}

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
    fn new(
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

/// What tests inspect on a transport: counts the engine never needs. Import the trait to call
/// them; they are kept off the transport's own API.
pub mod testing {
    use std::sync::atomic::Ordering;

    use inbox_core::TransportError;
    use lapin::options::QueueDeclareOptions;
    use lapin::types::FieldTable;

    use super::{RabbitMqTransport, broker_error, queue_name, short};

    /// Inspection of a [`RabbitMqTransport`] for tests.
    #[async_trait::async_trait]
    pub trait Inspect {
        /// Connections opened so far (more than one means it reconnected).
        fn connections_opened(&self) -> usize;
        /// Deliveries handed out by this transport and not yet acked or nacked.
        fn unsettled(&self) -> usize;
        /// Messages ready in a consumer's queue (not counting unacknowledged ones).
        async fn ready(&self, source: &str, consumer: &str) -> Result<u32, TransportError>;
    }

    #[async_trait::async_trait]
    impl Inspect for RabbitMqTransport {
        fn connections_opened(&self) -> usize {
            self.connections.load(Ordering::SeqCst)
        }

        fn unsettled(&self) -> usize {
            self.unsettled.load(Ordering::SeqCst)
        }

        async fn ready(&self, source: &str, consumer: &str) -> Result<u32, TransportError> {
            let connection = self.connection().await?;
            let channel = connection.create_channel().await.map_err(broker_error)?;
            let queue = channel
                .queue_declare(
                    short(&queue_name(source, consumer))?,
                    QueueDeclareOptions {
                        passive: true,
                        ..QueueDeclareOptions::default()
                    },
                    FieldTable::default(),
                )
                .await
                .map_err(broker_error)?;
            let _ = channel.close(200, "inspected".into()).await;
            Ok(queue.message_count())
        }
    }
}

#[cfg(test)]
mod tests {
    use lapin::types::LongString;

    use super::*;

    #[test]
    fn passwords_are_redacted() {
        assert_eq!(
            redact("amqp://guest:secret@host:5672/%2f"),
            "amqp://guest:***@host:5672/%2f"
        );
        assert_eq!(redact("amqp://host:5672"), "amqp://host:5672");
        // Malformed (no `//`): what stands between the scheme and the last `@` is hidden.
        assert_eq!(
            redact("amqp:guest:s3cret@rabbit/%2f"),
            "amqp:guest:***@rabbit/%2f"
        );
        assert_eq!(redact("amqp:s3cret@rabbit"), "amqp:***@rabbit");
        assert_eq!(
            redact("amqp://gu:est:s3c@ret@host/%2f"),
            "amqp://gu:***@host/%2f"
        );
    }

    #[test]
    fn consumer_names_that_would_share_a_queue_are_refused() {
        assert!(check_consumer_name("carrier-assignment").is_ok());
        assert!(check_consumer_name("eu.notification").is_err());
        assert!(check_consumer_name("dead-letter").is_err());
    }

    #[test]
    fn broker_headers_are_not_the_message() {
        for name in [
            "x-delivery-count",
            "x-death",
            "x-first-death-reason",
            "x-acquired-count",
        ] {
            assert!(broker_owned(name), "{name}");
        }
        for name in ["message-id", "x-inbox-reason", "traceparent"] {
            assert!(!broker_owned(name), "{name}");
        }
    }

    #[test]
    fn header_values_become_bytes() {
        assert_eq!(amqp_to_bytes(&AMQPValue::LongLongInt(7)), b"7");
        assert_eq!(
            amqp_to_bytes(&AMQPValue::LongString(LongString::from("x"))),
            b"x"
        );
        assert_eq!(amqp_to_u32(&AMQPValue::LongLongInt(3)), Some(3));
    }
}
