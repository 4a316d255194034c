//! The Kafka transport of `inbox`, on rdkafka (bundled librdkafka).
//!
//! - A source is a topic; a consumer name is a consumer group, so every consumer gets every
//!   record and the instances of one consumer share the partitions.
//! - Offsets: auto commit of **stored** offsets only (`enable.auto.offset.store=false`). An offset
//!   is stored only after the inbox transaction of its record committed (the ack), and only
//!   contiguously per partition: the committed offset never passes a record that is not done or
//!   dead-lettered. Records of one partition are handled in order (their ordering key is the
//!   partition); partitions run concurrently.
//! - Kafka has no per-record nack: a transient failure is retried in place (the partition waits)
//!   until the attempt limit, then the record goes to the dead-letter topic and the partition
//!   moves on. A record handed back unsettled (at shutdown) blocks its partition's offset, so it
//!   is consumed again after a restart or rebalance; the inbox discards what was already done.
//! - Rebalance: on revoke, what is done has been stored and is committed; in-flight work of the
//!   revoked partitions is abandoned (its offsets are not stored: the new owner gets those
//!   records and the inbox discards copies already done). A store rejected because the partition
//!   moved is not an error.
//! - Ids travel in the header `message-id`; with the coordinates strategy,
//!   `topic/partition/offset` can serve instead.
#![forbid(unsafe_code)]

use std::collections::{HashMap, HashSet, VecDeque};
use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use inbox_core::{
    AckToken, Capabilities, DEFAULT_ID_HEADER, Delivery, DeliveryStream, Headers, OutgoingMessage,
    Subscription, Transport, TransportError,
};
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{
    BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance, StreamConsumer,
};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{BorrowedMessage, Header, Headers as _, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{ClientContext, Message, Offset, TopicPartitionList};
use tokio::sync::mpsc;

/// How the transport connects and what it creates.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct KafkaConfig {
    /// `bootstrap.servers`.
    pub brokers: String,
    /// Partitions of the topics this transport creates (sources and dead-letter topics).
    pub partitions: i32,
    /// Replication factor of the topics this transport creates.
    pub replication: i32,
    /// How often stored offsets are committed (`auto.commit.interval.ms`).
    pub commit_interval: Duration,
    /// The consumers' `session.timeout.ms`: how long a vanished instance keeps its partitions.
    /// `None`: librdkafka's default (45 s).
    pub session_timeout: Option<Duration>,
    /// Handle each partition's records one after another, in order (default). Off: records are
    /// handled concurrently whatever their partition; offsets are still stored contiguously.
    pub ordered: bool,
    /// Extra client settings, applied last (for example `security.protocol`).
    pub extra: Vec<(String, String)>,
}

impl KafkaConfig {
    /// Defaults for `brokers`: 3 partitions, replication 1, commits every second.
    pub fn new(brokers: impl Into<String>) -> Self {
        Self {
            brokers: brokers.into(),
            partitions: 3,
            replication: 1,
            commit_interval: Duration::from_secs(1),
            session_timeout: None,
            ordered: true,
            extra: Vec::new(),
        }
    }

    /// Sets the partitions of created topics.
    pub fn partitions(mut self, n: i32) -> Self {
        self.partitions = n.max(1);
        self
    }

    /// Sets the commit interval.
    pub fn commit_interval(mut self, every: Duration) -> Self {
        self.commit_interval = every;
        self
    }

    /// Sets `ordered`.
    pub fn ordered(mut self, ordered: bool) -> Self {
        self.ordered = ordered;
        self
    }

    /// Sets the consumers' session timeout.
    pub fn session_timeout(mut self, timeout: Duration) -> Self {
        self.session_timeout = Some(timeout);
        self
    }

    /// Adds a client setting.
    pub fn set(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.extra.push((key.into(), value.into()));
        self
    }

    fn client(&self) -> ClientConfig {
        let mut config = ClientConfig::new();
        config.set("bootstrap.servers", &self.brokers);
        for (key, value) in &self.extra {
            config.set(key, value);
        }
        config
    }
}

fn transient(error: KafkaError) -> TransportError {
    TransportError::Disconnected(Box::new(error))
}

fn publish_error(error: KafkaError) -> TransportError {
    match error.rdkafka_error_code() {
        Some(
            RDKafkaErrorCode::UnknownTopicOrPartition
            | RDKafkaErrorCode::UnknownTopic
            | RDKafkaErrorCode::TopicAuthorizationFailed
            | RDKafkaErrorCode::MessageSizeTooLarge
            | RDKafkaErrorCode::InvalidMessage,
        ) => TransportError::Refused(Box::new(error)),
        _ => TransportError::NotConfirmed(Box::new(error)),
    }
}

/// Which records of which partitions are done, so that only contiguous progress is stored.
#[derive(Default)]
struct Tracker {
    partitions: Mutex<HashMap<(String, i32), Lane>>,
    generation: AtomicUsize,
}

/// One partition's records in delivery order, since its assignment.
struct Lane {
    generation: usize,
    pending: VecDeque<(i64, bool)>,
}

impl Tracker {
    /// Notes a delivered record; returns the assignment generation it belongs to.
    fn delivered(&self, topic: &str, partition: i32, offset: i64) -> usize {
        let mut partitions = self.partitions.lock().unwrap_or_else(|p| p.into_inner());
        let lane = partitions
            .entry((topic.to_owned(), partition))
            .or_insert_with(|| Lane {
                generation: self.generation.fetch_add(1, Ordering::SeqCst),
                pending: VecDeque::new(),
            });
        lane.pending.push_back((offset, false));
        lane.generation
    }

    /// Marks a record done; returns the offset to store (the next record to read) when the
    /// contiguous done prefix grew.
    fn done(&self, topic: &str, partition: i32, offset: i64, generation: usize) -> Option<i64> {
        let mut partitions = self.partitions.lock().unwrap_or_else(|p| p.into_inner());
        let lane = partitions.get_mut(&(topic.to_owned(), partition))?;
        if lane.generation != generation {
            return None; // The partition was revoked since: its new owner decides.
        }
        if let Some(entry) = lane.pending.iter_mut().find(|(o, _)| *o == offset) {
            entry.1 = true;
        }
        let mut next = None;
        while let Some(&(o, true)) = lane.pending.front() {
            lane.pending.pop_front();
            next = Some(o + 1);
        }
        next
    }

    /// Forgets partitions (revoked or newly assigned): records still in flight for them are
    /// abandoned.
    fn reset(&self, list: &TopicPartitionList) {
        let mut partitions = self.partitions.lock().unwrap_or_else(|p| p.into_inner());
        for element in list.elements() {
            partitions.remove(&(element.topic().to_owned(), element.partition()));
        }
    }
}

/// Resets the tracker on rebalances.
struct Context {
    tracker: Arc<Tracker>,
}

impl ClientContext for Context {}

impl ConsumerContext for Context {
    fn pre_rebalance(&self, _consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Revoke(list) = rebalance {
            tracing::info!(
                partitions = list.count(),
                "partitions revoked; abandoning their in-flight records"
            );
            self.tracker.reset(list);
        }
    }

    fn post_rebalance(&self, _consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Assign(list) = rebalance {
            tracing::info!(partitions = list.count(), "partitions assigned");
            self.tracker.reset(list);
        }
    }
}

type KafkaConsumer = StreamConsumer<Context>;

/// A Kafka(-API) cluster.
pub struct KafkaTransport {
    config: KafkaConfig,
    producer: FutureProducer,
    admin: AdminClient<DefaultClientContext>,
    created: tokio::sync::Mutex<HashSet<String>>,
    unsettled: Arc<AtomicUsize>,
    /// Consumers of this transport still leaving their group.
    closing: Arc<tokio::sync::watch::Sender<usize>>,
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
        })
    }

    /// Deliveries handed out and not yet acked or nacked.
    pub fn unsettled(&self) -> usize {
        self.unsettled.load(Ordering::SeqCst)
    }

    /// Creates the topics that do not exist yet (the broker may not create them on first use).
    pub async fn create_topics(&self, names: &[&str]) -> Result<(), TransportError> {
        let mut created = self.created.lock().await;
        let missing: Vec<&str> = names
            .iter()
            .copied()
            .filter(|n| !created.contains(*n))
            .collect();
        if missing.is_empty() {
            return Ok(());
        }
        let topics: Vec<NewTopic<'_>> = missing
            .iter()
            .map(|name| {
                NewTopic::new(
                    name,
                    self.config.partitions,
                    TopicReplication::Fixed(self.config.replication),
                )
            })
            .collect();
        let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
        let results = self
            .admin
            .create_topics(&topics, &options)
            .await
            .map_err(transient)?;
        for result in results {
            match result {
                Ok(name) => {
                    created.insert(name);
                }
                Err((name, RDKafkaErrorCode::TopicAlreadyExists)) => {
                    created.insert(name);
                }
                Err((name, code)) => {
                    return Err(TransportError::Refused(
                        format!("cannot create topic {name:?}: {code}").into(),
                    ));
                }
            }
        }
        Ok(())
    }

    /// How many records of `topic` the consumer group `group` has not committed yet (records
    /// after its committed offset, or all of them when it has none), summed over partitions.
    pub async fn lag(&self, topic: &str, group: &str) -> Result<i64, TransportError> {
        let consumer = self.inspector(group)?;
        let topic = topic.to_owned();
        tokio::task::spawn_blocking(move || {
            let timeout = Duration::from_secs(10);
            let mut list = TopicPartitionList::new();
            for partition in partitions(&consumer, &topic)? {
                list.add_partition(&topic, partition);
            }
            let committed = consumer
                .committed_offsets(list, timeout)
                .map_err(transient)?;
            let mut lag = 0;
            for element in committed.elements() {
                let (low, high) = consumer
                    .fetch_watermarks(&topic, element.partition(), timeout)
                    .map_err(transient)?;
                let position = match element.offset() {
                    Offset::Offset(o) => o,
                    _ => low,
                };
                lag += (high - position).max(0);
            }
            Ok(lag)
        })
        .await
        .map_err(|e| TransportError::Disconnected(Box::new(e)))?
    }

    /// Every record in `topic`, from the beginning to the current end (for reading a dead-letter
    /// topic).
    pub async fn read_topic(&self, topic: &str) -> Result<Vec<OutgoingMessage>, TransportError> {
        let consumer = self.inspector("inbox-reader")?;
        let topic = topic.to_owned();
        tokio::task::spawn_blocking(move || {
            let timeout = Duration::from_secs(10);
            let mut list = TopicPartitionList::new();
            let mut ends = HashMap::new();
            for partition in partitions(&consumer, &topic)? {
                let (low, high) = consumer
                    .fetch_watermarks(&topic, partition, timeout)
                    .map_err(transient)?;
                // Every partition, even one that looks empty: a broker may report a high
                // watermark behind its last record (tansu 0.6 does), so the end is also found by
                // a quiet spell after the watermarks are reached.
                list.add_partition_offset(&topic, partition, Offset::Offset(low))
                    .map_err(transient)?;
                if high > low {
                    ends.insert(partition, high);
                }
            }
            let mut records = Vec::new();
            consumer.assign(&list).map_err(transient)?;
            let deadline = std::time::Instant::now() + Duration::from_secs(30);
            let quiet = Duration::from_millis(750);
            let mut last_record = std::time::Instant::now();
            while std::time::Instant::now() < deadline
                && (!ends.is_empty() || last_record.elapsed() < quiet)
            {
                let Some(next) = consumer.poll(Duration::from_millis(100)) else {
                    continue;
                };
                last_record = std::time::Instant::now();
                let message = next.map_err(transient)?;
                let headers = headers_of(&message);
                records.push(OutgoingMessage {
                    message_id: headers.get_str(DEFAULT_ID_HEADER).map(str::to_owned),
                    payload: message.payload().unwrap_or_default().to_vec().into(),
                    headers,
                    key: message.key().map(|k| k.to_vec().into()),
                });
                if ends
                    .get(&message.partition())
                    .is_some_and(|end| message.offset() + 1 >= *end)
                {
                    ends.remove(&message.partition());
                }
            }
            Ok(records)
        })
        .await
        .map_err(|e| TransportError::Disconnected(Box::new(e)))?
    }

    /// A consumer for looking at a group or a topic without joining anything.
    fn inspector(&self, group: &str) -> Result<BaseConsumer, TransportError> {
        self.config
            .client()
            .set("group.id", group)
            .set("enable.auto.commit", "false")
            .create()
            .map_err(|e| TransportError::Config(e.to_string()))
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

/// The partitions of `topic` (blocking).
fn partitions(consumer: &BaseConsumer, topic: &str) -> Result<Vec<i32>, TransportError> {
    let metadata = consumer
        .fetch_metadata(Some(topic), Duration::from_secs(10))
        .map_err(transient)?;
    Ok(metadata
        .topics()
        .iter()
        .flat_map(|t| t.partitions().iter().map(|p| p.id()))
        .collect())
}

/// What became of a delivery, reported to its subscription's poll loop.
enum Settlement {
    /// Done (committed or dead-lettered): its offset may be stored.
    Done {
        topic: String,
        partition: i32,
        offset: i64,
        generation: usize,
    },
    /// Handed back or dropped: its offset must not be stored.
    Abandoned,
}

type Item = Result<Box<dyn Delivery>, TransportError>;

/// A subscription's poll loop, the consumer's only owner. It polls on its own, so that
/// rebalances are served while handlers run (a poll interval exceeded — handlers slower than
/// `max.poll.interval.ms` — comes out as a stream error); it stores the offsets that settlements
/// free; and after the stream is dropped it waits for the deliveries still out, commits, and
/// closes the consumer off the async threads.
async fn poll(
    consumer: KafkaConsumer,
    tracker: Arc<Tracker>,
    sender: mpsc::Sender<Item>,
    unsettled: Arc<AtomicUsize>,
    closing: Arc<tokio::sync::watch::Sender<usize>>,
    ordered: bool,
) {
    let (settle, mut settlements) = mpsc::unbounded_channel();
    let mut outstanding = 0usize;
    let mut pending: Option<Item> = None;
    let mut streaming = true;
    while streaming || outstanding > 0 {
        tokio::select! {
            Some(settlement) = settlements.recv() => {
                outstanding -= 1;
                if let Settlement::Done { topic, partition, offset, generation } = settlement {
                    store(&consumer, &tracker, &topic, partition, offset, generation);
                }
            }
            permit = sender.reserve(), if streaming && pending.is_some() => match permit {
                Ok(permit) => {
                    let item = pending.take().expect("checked");
                    // An error ends this stream: the consumer subscribes again with a new one.
                    streaming = item.is_ok();
                    permit.send(item);
                }
                Err(_) => {
                    streaming = false;
                    pending = None;
                }
            },
            () = sender.closed(), if streaming && pending.is_none() => streaming = false,
            next = consumer.recv(), if streaming && pending.is_none() => {
                pending = Some(match next {
                    Ok(message) => {
                        let generation = tracker.delivered(message.topic(), message.partition(), message.offset());
                        outstanding += 1;
                        unsettled.fetch_add(1, Ordering::SeqCst);
                        Ok(Box::new(KafkaDelivery {
                            topic: message.topic().to_owned(),
                            partition: message.partition(),
                            offset: message.offset(),
                            generation,
                            ordering_key: ordered
                                .then(|| format!("{}/{}", message.topic(), message.partition())),
                            payload: message.payload().unwrap_or_default().to_vec(),
                            headers: headers_of(&message),
                            settle: Some(settle.clone()),
                            unsettled: Arc::clone(&unsettled),
                        }) as Box<dyn Delivery>)
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "kafka consumer error");
                        Err(transient(e))
                    }
                });
            }
        }
    }
    // Closing blocks (commit, leave the group): not on the async threads.
    closing.send_modify(|n| *n += 1);
    let closed = tokio::task::spawn_blocking(move || {
        if let Err(e) = consumer.commit_consumer_state(CommitMode::Sync) {
            tracing::debug!(error = %e, "final commit");
        }
        drop(consumer);
    });
    let _ = closed.await;
    closing.send_modify(|n| *n -= 1);
}

/// Stores the offset a done record frees, if the contiguous done prefix of its partition grew.
fn store(
    consumer: &KafkaConsumer,
    tracker: &Tracker,
    topic: &str,
    partition: i32,
    offset: i64,
    generation: usize,
) {
    let Some(next) = tracker.done(topic, partition, offset, generation) else {
        return;
    };
    // store_offsets stores exactly the offset given — the next record to read — unlike
    // store_offset, which adds one (rust-rdkafka PR #851).
    let mut list = TopicPartitionList::new();
    if list
        .add_partition_offset(topic, partition, Offset::Offset(next))
        .is_err()
    {
        return;
    }
    if let Err(e) = consumer.store_offsets(&list) {
        // The partition moved to another instance: it will deliver the record again and the
        // inbox will discard it.
        tracing::debug!(error = %e, topic, partition, "offset not stored");
    }
}

fn headers_of(message: &BorrowedMessage<'_>) -> Headers {
    let mut headers = Headers::new();
    if let Some(list) = message.headers() {
        for header in list.iter() {
            headers.insert(
                header.key,
                header.value.map(<[u8]>::to_vec).unwrap_or_default(),
            );
        }
    }
    headers
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
    }

    async fn declare(&self, subscription: &Subscription) -> Result<(), TransportError> {
        // A new group reads from the earliest offset, so the topic is all it takes.
        self.create_topics(&[&subscription.source]).await
    }

    async fn subscribe(
        &self,
        subscription: &Subscription,
    ) -> Result<DeliveryStream, TransportError> {
        let mut topics = vec![subscription.source.as_str()];
        if let Some(dead_letter) = &subscription.dead_letter {
            topics.push(dead_letter);
        }
        self.create_topics(&topics).await?;
        // A consumer of this process that is still leaving the group would make the group
        // rebalance again as soon as this one joins (and some brokers wait for it): let it go first.
        let mut closing = self.closing.subscribe();
        let _ = tokio::time::timeout(Duration::from_secs(30), closing.wait_for(|n| *n == 0)).await;
        let tracker = Arc::new(Tracker::default());
        let consumer = self.consumer(subscription.consumer.as_str(), &tracker)?;
        consumer
            .subscribe(&[&subscription.source])
            .map_err(transient)?;
        let (sender, receiver) = mpsc::channel(usize::from(subscription.prefetch.max(1)));
        tokio::spawn(poll(
            consumer,
            tracker,
            sender,
            Arc::clone(&self.unsettled),
            Arc::clone(&self.closing),
            self.config.ordered,
        ));
        Ok(Box::pin(futures::stream::unfold(
            receiver,
            |mut receiver| async move { receiver.recv().await.map(|item| (item, receiver)) },
        )))
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

/// A record read back from a log (a dead-letter topic): settling it changes nothing.
#[derive(Debug)]
struct LogRecord(OutgoingMessage);

#[async_trait]
impl Delivery for LogRecord {
    fn payload(&self) -> &[u8] {
        &self.0.payload
    }

    fn headers(&self) -> &Headers {
        &self.0.headers
    }

    fn broker_message_id(&self) -> Option<&[u8]> {
        None
    }

    fn redelivered(&self) -> bool {
        false
    }

    async fn ack(self: Box<Self>, _token: AckToken) -> Result<(), TransportError> {
        Ok(())
    }

    async fn nack(self: Box<Self>, _requeue: bool) -> Result<(), TransportError> {
        Ok(())
    }
}

/// A record from Kafka. Acking frees its offset to be stored once every earlier record of its
/// partition is done; dropping or nacking it leaves the partition's offset where it is.
pub struct KafkaDelivery {
    topic: String,
    partition: i32,
    offset: i64,
    generation: usize,
    ordering_key: Option<String>,
    payload: Vec<u8>,
    headers: Headers,
    settle: Option<mpsc::UnboundedSender<Settlement>>,
    unsettled: Arc<AtomicUsize>,
}

impl fmt::Debug for KafkaDelivery {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "KafkaDelivery({}/{}/{})",
            self.topic, self.partition, self.offset
        )
    }
}

impl KafkaDelivery {
    fn settle(&mut self, settlement: Settlement) {
        if let Some(settle) = self.settle.take() {
            self.unsettled.fetch_sub(1, Ordering::SeqCst);
            // The poll loop outlives every delivery it handed out; a failed send means it is gone.
            let _ = settle.send(settlement);
        }
    }
}

#[async_trait]
impl Delivery for KafkaDelivery {
    fn payload(&self) -> &[u8] {
        &self.payload
    }

    fn headers(&self) -> &Headers {
        &self.headers
    }

    fn broker_message_id(&self) -> Option<&[u8]> {
        None
    }

    fn redelivered(&self) -> bool {
        false
    }

    fn coordinates(&self) -> Option<String> {
        Some(format!("{}/{}/{}", self.topic, self.partition, self.offset))
    }

    fn ordering_key(&self) -> Option<&str> {
        self.ordering_key.as_deref()
    }

    async fn ack(mut self: Box<Self>, _token: AckToken) -> Result<(), TransportError> {
        let settlement = Settlement::Done {
            topic: self.topic.clone(),
            partition: self.partition,
            offset: self.offset,
            generation: self.generation,
        };
        self.settle(settlement);
        Ok(())
    }

    async fn nack(mut self: Box<Self>, _requeue: bool) -> Result<(), TransportError> {
        self.settle(Settlement::Abandoned);
        Ok(())
    }
}

impl Drop for KafkaDelivery {
    fn drop(&mut self) {
        self.settle(Settlement::Abandoned);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_contiguous_progress_is_stored() {
        let tracker = Tracker::default();
        let g = tracker.delivered("t", 0, 10);
        tracker.delivered("t", 0, 11);
        tracker.delivered("t", 0, 13); // offsets may have gaps
        assert_eq!(tracker.done("t", 0, 11, g), None, "10 is not done yet");
        assert_eq!(tracker.done("t", 0, 10, g), Some(12));
        assert_eq!(tracker.done("t", 0, 13, g), Some(14));
    }

    #[test]
    fn acks_from_before_a_rebalance_store_nothing() {
        let tracker = Tracker::default();
        let old = tracker.delivered("t", 1, 5);
        let mut list = TopicPartitionList::new();
        list.add_partition("t", 1);
        tracker.reset(&list);
        let new = tracker.delivered("t", 1, 5);
        assert_ne!(old, new);
        assert_eq!(tracker.done("t", 1, 5, old), None);
        assert_eq!(tracker.done("t", 1, 5, new), Some(6));
    }
}
