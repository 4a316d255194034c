//! [`KafkaTransport`]: its clients, the consumers of its subscriptions, and its [`Transport`]
//! implementation.

use std::collections::HashSet;
use std::fmt;
use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use inbox_core::{
    Capabilities, DEFAULT_ID_HEADER, Delivery, DeliveryStream, OutgoingMessage, Subscription,
    Transport, TransportError,
};
use rdkafka::admin::AdminClient;
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::Consumer;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use tokio::sync::mpsc;

use crate::config::KafkaConfig;
use crate::delivery::LogRecord;
use crate::error::{publish_error, transient};
use crate::guard::Guard;
use crate::poll::{Item, poll};
use crate::tracker::{Context, KafkaConsumer, Tracker};

/// The record size limit of the dead-letter topics this transport creates, and of its producer.
const DEAD_LETTER_MAX_BYTES: usize = 4 * 1024 * 1024;

/// The consumer group of `consumer` on `source`: `<source>.<consumer>`.
pub fn group_id(source: &str, consumer: &str) -> String {
    format!("{source}.{consumer}")
}

/// A Kafka(-API) cluster.
pub struct KafkaTransport {
    pub(crate) config: KafkaConfig,
    producer: FutureProducer,
    pub(crate) admin: AdminClient<DefaultClientContext>,
    pub(crate) created: tokio::sync::Mutex<HashSet<String>>,
    pub(crate) unsettled: Arc<AtomicUsize>,
    /// Consumers of this transport still leaving their group.
    closing: Arc<tokio::sync::watch::Sender<usize>>,
    /// Poll loops whose delivery streams were dropped: `true` once they committed and closed.
    ending: Arc<Mutex<Vec<tokio::sync::watch::Receiver<bool>>>>,
    /// Per group: how often its orphaned-partition guard fired since a record last arrived.
    rejoins: Mutex<std::collections::HashMap<String, Arc<std::sync::atomic::AtomicU32>>>,
}

impl fmt::Debug for KafkaTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KafkaTransport")
            .field("brokers", &self.config.brokers)
            .finish()
    }
}

impl KafkaTransport {
    /// A transport on `config.brokers`, with an idempotent producer.
    pub fn new(config: KafkaConfig) -> Result<Self, TransportError> {
        let producer: FutureProducer = config
            .client()
            // Room for a dead letter of the largest message a broker takes by default (1 MiB)
            // plus its headers: the client's own default (1,000,000 bytes) is smaller than that.
            .set("message.max.bytes", DEAD_LETTER_MAX_BYTES.to_string())
            .set("enable.idempotence", "true")
            .set("acks", "all")
            .set("message.timeout.ms", "30000")
            .create()
            .map_err(|e| TransportError::Config(e.to_string()))?;
        let admin = config
            .client()
            .create()
            .map_err(|e| TransportError::Config(e.to_string()))?;
        Ok(Self {
            config,
            producer,
            admin,
            created: tokio::sync::Mutex::default(),
            unsettled: Arc::default(),
            closing: Arc::new(tokio::sync::watch::Sender::new(0)),
            ending: Arc::default(),
            rejoins: Mutex::default(),
        })
    }

    fn consumer(
        &self,
        group: &str,
        tracker: &Arc<Tracker>,
    ) -> Result<KafkaConsumer, TransportError> {
        let mut config = self.config.client();
        config
            .set("group.id", group)
            .set("enable.auto.commit", "true")
            // Offsets are stored by acks only, after the inbox commit.
            .set("enable.auto.offset.store", "false")
            .set(
                "auto.commit.interval.ms",
                self.config.commit_interval.as_millis().to_string(),
            )
            .set("auto.offset.reset", "earliest")
            .set("enable.partition.eof", "false");
        if let Some(timeout) = self.config.session_timeout {
            config.set("session.timeout.ms", timeout.as_millis().to_string());
            // A sixth of the session (Kafka asks for at most a third): members learn of a
            // rebalance sooner. (A third made a newly joined instance of the suite wait so long
            // for partitions that the first had finished; a sixth makes tansu 0.6's orphaned
            // assignments likelier, which the guard is for: see the guard module.)
            config.set(
                "heartbeat.interval.ms",
                (timeout.as_millis() / 6).max(100).to_string(),
            );
        }
        for (key, value) in &self.config.extra {
            config.set(key, value);
        }
        config
            .create_with_context(Context {
                tracker: Arc::clone(tracker),
            })
            .map_err(|e| TransportError::Config(e.to_string()))
    }
}

#[async_trait]
impl Transport for KafkaTransport {
    fn name(&self) -> &'static str {
        "kafka"
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::basic()
            .with_requeue(false)
            .with_coordinates(true)
            .with_ordered(self.config.ordered)
            .with_log_positions(true)
    }

    /// Waits (up to 30 s) for the consumers of ended subscriptions to commit their last stored
    /// offsets and leave their groups.
    async fn drained(&self) {
        let ended: Vec<_> =
            std::mem::take(&mut *self.ending.lock().unwrap_or_else(|p| p.into_inner()));
        let all = futures::future::join_all(ended.into_iter().map(|mut closed| async move {
            let _ = closed.wait_for(|closed| *closed).await;
        }));
        if tokio::time::timeout(Duration::from_secs(30), all)
            .await
            .is_err()
        {
            tracing::warn!("kafka consumers did not finish closing within 30 s");
        }
    }

    async fn declare(&self, subscription: &Subscription) -> Result<(), TransportError> {
        // A new group reads from the earliest offset, so the topic is all it takes.
        self.create_topics(&[&subscription.source]).await
    }

    async fn subscribe(
        &self,
        subscription: &Subscription,
    ) -> Result<DeliveryStream, TransportError> {
        self.create_topics(&[&subscription.source]).await?;
        if let Some(dead_letter) = &subscription.dead_letter {
            self.create(&[dead_letter], Some(DEAD_LETTER_MAX_BYTES))
                .await?;
        }
        // A consumer of this process that is still leaving the group would make the group
        // rebalance again as soon as this one joins (and some brokers wait for it): let it go first.
        let mut closing = self.closing.subscribe();
        let _ = tokio::time::timeout(Duration::from_secs(30), closing.wait_for(|n| *n == 0)).await;
        let tracker = Arc::new(Tracker::default());
        let group = group_id(&subscription.source, subscription.consumer.as_str());
        let consumer = self.consumer(&group, &tracker)?;
        consumer
            .subscribe(&[&subscription.source])
            .map_err(transient)?;
        let (sender, receiver) = mpsc::channel(usize::from(subscription.prefetch.max(1)));
        let (closed, closed_rx) = tokio::sync::watch::channel(false);
        let guard = self.config.orphan_guard.then(|| Guard {
            every: crate::guard::check_interval(self.config.session_timeout),
            rejoins: Arc::clone(
                self.rejoins
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .entry(group.clone())
                    .or_default(),
            ),
        });
        let polling = poll(
            consumer,
            subscription.source.clone(),
            tracker,
            sender,
            Arc::clone(&self.unsettled),
            Arc::clone(&self.closing),
            (self.config.ordered, guard, subscription.offsets.clone()),
        );
        tokio::spawn(async move {
            polling.await;
            closed.send_replace(true);
        });
        Ok(Box::pin(Ended {
            deliveries: Box::pin(futures::stream::unfold(
                receiver,
                |mut receiver| async move { receiver.recv().await.map(|item| (item, receiver)) },
            )),
            closed: Some(closed_rx),
            ending: Arc::clone(&self.ending),
        }))
    }

    /// The whole dead-letter topic, up to its end at the call, read without joining a group.
    /// A log keeps its records: acking a delivery does not remove it (a replayed message's row is
    /// no longer dead, so a later replay skips it).
    async fn read_dead_letters(&self, destination: &str) -> Result<DeliveryStream, TransportError> {
        self.create_topics(&[destination]).await?;
        let records = self.read_topic(destination).await?;
        Ok(Box::pin(futures::stream::iter(records.into_iter().map(
            |record| Ok(Box::new(LogRecord(record)) as Box<dyn Delivery>),
        ))))
    }

    async fn publish(
        &self,
        destination: &str,
        message: OutgoingMessage,
    ) -> Result<(), TransportError> {
        let mut headers = OwnedHeaders::new();
        if let Some(id) = &message.message_id {
            headers = headers.insert(Header {
                key: DEFAULT_ID_HEADER,
                value: Some(id.as_bytes()),
            });
        }
        for (name, value) in message.headers.iter() {
            if message.message_id.is_some() && name == DEFAULT_ID_HEADER {
                continue;
            }
            headers = headers.insert(Header {
                key: name,
                value: Some(value),
            });
        }
        let mut record = FutureRecord::to(destination)
            .payload(message.payload.as_ref())
            .headers(headers);
        if let Some(key) = &message.key {
            record = record.key(key.as_ref());
        }
        self.producer
            .send(record, Duration::from_secs(30))
            .await
            .map(drop)
            .map_err(|(e, _)| publish_error(e))
    }
}

/// A subscription's delivery stream. Dropped, it leaves its poll loop's end to be awaited by
/// [`Transport::drained`].
struct Ended {
    deliveries: DeliveryStream,
    closed: Option<tokio::sync::watch::Receiver<bool>>,
    ending: Arc<Mutex<Vec<tokio::sync::watch::Receiver<bool>>>>,
}

impl futures::Stream for Ended {
    type Item = Item;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Item>> {
        self.deliveries.as_mut().poll_next(cx)
    }
}

impl Drop for Ended {
    fn drop(&mut self) {
        if let Some(closed) = self.closed.take() {
            self.ending
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(closed);
        }
    }
}
