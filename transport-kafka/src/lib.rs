//! The Kafka transport of `inbox`, on rdkafka (bundled librdkafka).
//!
//! - A source is a topic; each consumer of it is a consumer group, [`group_id`]
//!   `<source>.<consumer>`, so every consumer gets every record and the instances of one consumer
//!   share the partitions. (The group is per source: a consumer name used for two sources, or by
//!   two services, must not share one group across topics, where a rebalance of one would
//!   disturb the other.)
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

/// How the transport connects and what it creates. Its `Debug` hides the values of `extra`
/// settings whose names suggest a secret (`sasl.password`, `ssl.key.password`, …).
#[derive(Clone, PartialEq, Eq)]
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

impl fmt::Debug for KafkaConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let extra: Vec<(&str, &str)> = self
            .extra
            .iter()
            .map(|(key, value)| {
                let secret = ["password", "secret", "key", "token", "jaas"]
                    .iter()
                    .any(|word| key.to_ascii_lowercase().contains(word));
                (key.as_str(), if secret { "***" } else { value.as_str() })
            })
            .collect();
        f.debug_struct("KafkaConfig")
            .field("brokers", &self.brokers)
            .field("partitions", &self.partitions)
            .field("replication", &self.replication)
            .field("commit_interval", &self.commit_interval)
            .field("session_timeout", &self.session_timeout)
            .field("ordered", &self.ordered)
            .field("extra", &extra)
            .finish()
    }
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
    /// Notes a delivered record; returns the assignment generation it belongs to, and whether it
    /// is its partition's first record since the assignment — the one a previous owner that died
    /// was most likely handling.
    fn delivered(&self, topic: &str, partition: i32, offset: i64) -> (usize, bool) {
        let mut partitions = self.partitions.lock().unwrap_or_else(|p| p.into_inner());
        let mut first = false;
        let lane = partitions
            .entry((topic.to_owned(), partition))
            .or_insert_with(|| {
                first = true;
                Lane {
                    generation: self.generation.fetch_add(1, Ordering::SeqCst),
                    pending: VecDeque::new(),
                }
            });
        lane.pending.push_back((offset, false));
        (lane.generation, first)
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

/// The record size limit of the dead-letter topics this transport creates, and of its producer.
const DEAD_LETTER_MAX_BYTES: usize = 4 * 1024 * 1024;

/// The consumer group of `consumer` on `source`: `<source>.<consumer>`.
pub fn group_id(source: &str, consumer: &str) -> String {
    format!("{source}.{consumer}")
}

/// A Kafka(-API) cluster.
pub struct KafkaTransport {
    config: KafkaConfig,
    producer: FutureProducer,
    admin: AdminClient<DefaultClientContext>,
    created: tokio::sync::Mutex<HashSet<String>>,
    unsettled: Arc<AtomicUsize>,
    /// Consumers of this transport still leaving their group.
    closing: Arc<tokio::sync::watch::Sender<usize>>,
    /// Poll loops whose delivery streams were dropped: `true` once they committed and closed.
    ending: Arc<Mutex<Vec<tokio::sync::watch::Receiver<bool>>>>,
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
        })
    }

    /// Creates the topics that do not exist yet (the broker may not create them on first use).
    pub async fn create_topics(&self, names: &[&str]) -> Result<(), TransportError> {
        self.create(names, None).await
    }

    /// Creates topics, with a record size limit of their own where given (dead-letter topics:
    /// a dead letter is its message plus the `x-inbox-*` headers, so it must be allowed to be a
    /// little larger than what the source accepts, or it could never be published).
    async fn create(
        &self,
        names: &[&str],
        max_message_bytes: Option<usize>,
    ) -> Result<(), TransportError> {
        let max_message_bytes = max_message_bytes.map(|n| n.to_string());
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
                let topic = NewTopic::new(
                    name,
                    self.config.partitions,
                    TopicReplication::Fixed(self.config.replication),
                );
                match &max_message_bytes {
                    Some(n) => topic.set("max.message.bytes", n),
                    None => topic,
                }
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

    /// [`lag`](Self::lag) of `consumer`'s group on `source` (see [`group_id`]).
    pub async fn consumer_lag(&self, source: &str, consumer: &str) -> Result<i64, TransportError> {
        self.lag(source, &group_id(source, consumer)).await
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
            if !ends.is_empty() {
                // Short of the end: saying so beats reporting the letters not read as missing.
                return Err(TransportError::Disconnected(
                    format!(
                        "{topic}: partitions {:?} not read to their end within 30 s",
                        ends.keys().collect::<Vec<_>>()
                    )
                    .into(),
                ));
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
/// rebalances are served while handlers run; it stores the offsets that settlements free; and
/// after the stream is dropped it waits for the deliveries still out, commits, and closes the
/// consumer off the async threads.
///
/// When the engine takes no more deliveries (every handler slot busy) the loop holds the one
/// record it has and stops polling until a slot frees; a rebalance waits that long. It does not
/// pause the partitions and poll on instead: on tansu 0.6, the broker the tests run on, fetching
/// never resumes after a pause — a plain confluent-kafka consumer shows the same.
///
/// Errors the client reports and recovers from by itself (a broker restarting, a connection
/// refused, a rebalance in progress) are logged and polling goes on with the same consumer and
/// group membership: ending the stream on them would make every instance leave and rejoin the
/// group at each broker blip. Only a fatal client error ends the stream (the engine subscribes
/// again with a fresh consumer), and an authorization error ends it for good.
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
    // Once an error that ends the stream is queued, nothing more is read.
    let mut ending = false;
    let mut client_errors = 0u64;
    let mut last_error_log: Option<std::time::Instant> = None;
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
            next = consumer.recv(), if streaming && !ending && pending.is_none() => {
                let item = match next {
                    Ok(message) => {
                        let (generation, first) = tracker.delivered(message.topic(), message.partition(), message.offset());
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
                            maybe_redelivered: first,
                            settle: Some(settle.clone()),
                            unsettled: Arc::clone(&unsettled),
                        }) as Box<dyn Delivery>)
                    }
                    Err(e) => match consumer_error(e) {
                        ClientError::Recovers(e) => {
                            client_errors += 1;
                            if last_error_log.is_none_or(|at| at.elapsed() >= Duration::from_secs(10)) {
                                tracing::warn!(error = %e, errors = client_errors, "kafka consumer error; the client recovers by itself, polling on");
                                last_error_log = Some(std::time::Instant::now());
                                client_errors = 0;
                            }
                            continue;
                        }
                        ClientError::Ends(e) => {
                            tracing::warn!(error = %e, "kafka consumer failed");
                            ending = true;
                            Err(e)
                        }
                    },
                };
                pending = Some(item);
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

/// What a consumer error means for the subscription.
enum ClientError {
    /// Logged; the client recovers by itself (reconnects, rejoins the group).
    Recovers(KafkaError),
    /// Ends the stream with this error: transient (a fresh consumer may work) or permanent.
    Ends(TransportError),
}

fn consumer_error(error: KafkaError) -> ClientError {
    match error.rdkafka_error_code() {
        Some(
            RDKafkaErrorCode::GroupAuthorizationFailed
            | RDKafkaErrorCode::TopicAuthorizationFailed
            | RDKafkaErrorCode::ClusterAuthorizationFailed
            | RDKafkaErrorCode::SaslAuthenticationFailed,
        ) => ClientError::Ends(TransportError::Refused(Box::new(error))),
        _ if matches!(error, KafkaError::MessageConsumptionFatal(_))
            || error.rdkafka_error_code() == Some(RDKafkaErrorCode::Fatal) =>
        {
            ClientError::Ends(transient(error))
        }
        _ => ClientError::Recovers(error),
    }
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

/// A record's headers. Of a key that appears more than once, the first value counts (as other
/// clients read it): a proxy that appends a second `message-id` does not change the dedup key.
fn headers_of(message: &BorrowedMessage<'_>) -> Headers {
    let mut headers = Headers::new();
    if let Some(list) = message.headers() {
        for header in list.iter() {
            if headers.get(header.key).is_none() {
                headers.insert(
                    header.key,
                    header.value.map(<[u8]>::to_vec).unwrap_or_default(),
                );
            }
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
        let polling = poll(
            consumer,
            tracker,
            sender,
            Arc::clone(&self.unsettled),
            Arc::clone(&self.closing),
            self.config.ordered,
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
    /// The partition's first record since the assignment: it may have been delivered before,
    /// to an owner that died on it (Kafka counts no deliveries).
    maybe_redelivered: bool,
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

    /// True for a partition's first record since the assignment: Kafka does not say whether
    /// a record was delivered before, and that is the one a previous owner may have died on.
    fn redelivered(&self) -> bool {
        self.maybe_redelivered
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

/// What tests inspect on a transport: counts the engine never needs. Import the trait to call
/// them; they are kept off the transport's own API.
pub mod testing {
    use std::sync::atomic::Ordering;

    use super::KafkaTransport;

    /// Inspection of a [`KafkaTransport`] for tests.
    pub trait Inspect {
        /// Deliveries handed out and not yet acked or nacked.
        fn unsettled(&self) -> usize;
    }

    impl Inspect for KafkaTransport {
        fn unsettled(&self) -> usize {
            self.unsettled.load(Ordering::SeqCst)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_in_extra_settings_are_not_printed() {
        let config = KafkaConfig::new("broker:9092")
            .set("security.protocol", "SASL_SSL")
            .set("sasl.password", "hunter2")
            .set("ssl.key.password", "s3cret");
        let printed = format!("{config:?}");
        assert!(
            !printed.contains("hunter2") && !printed.contains("s3cret"),
            "{printed}"
        );
        assert!(printed.contains("SASL_SSL"), "{printed}");
    }

    #[test]
    fn only_contiguous_progress_is_stored() {
        let tracker = Tracker::default();
        let (g, first) = tracker.delivered("t", 0, 10);
        assert!(first, "the first record since the assignment");
        assert!(!tracker.delivered("t", 0, 11).1);
        tracker.delivered("t", 0, 13); // offsets may have gaps
        assert_eq!(tracker.done("t", 0, 11, g), None, "10 is not done yet");
        assert_eq!(tracker.done("t", 0, 10, g), Some(12));
        assert_eq!(tracker.done("t", 0, 13, g), Some(14));
    }

    #[test]
    fn acks_from_before_a_rebalance_store_nothing() {
        let tracker = Tracker::default();
        let (old, _) = tracker.delivered("t", 1, 5);
        let mut list = TopicPartitionList::new();
        list.add_partition("t", 1);
        tracker.reset(&list);
        let (new, _) = tracker.delivered("t", 1, 5);
        assert_ne!(old, new);
        assert_eq!(tracker.done("t", 1, 5, old), None);
        assert_eq!(tracker.done("t", 1, 5, new), Some(6));
    }
}
