//! Topics: creating them, a consumer group's lag, reading a topic from the start, and a
//! topic's partitions.

use std::collections::HashMap;
use std::time::Duration;

use inbox_core::{DEFAULT_ID_HEADER, OutgoingMessage, TransportError};
use rdkafka::admin::{AdminOptions, NewTopic, TopicReplication};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::RDKafkaErrorCode;
use rdkafka::{Message, Offset, TopicPartitionList};

use crate::delivery::headers_of;
use crate::error::transient;
use crate::transport::{KafkaTransport, group_id};

impl KafkaTransport {
    /// Creates the topics that do not exist yet (the broker may not create them on first use).
    pub async fn create_topics(&self, names: &[&str]) -> Result<(), TransportError> {
        self.create(names, None).await
    }

    /// Creates topics, with a record size limit of their own where given (dead-letter topics:
    /// a dead letter is its message plus the `x-inbox-*` headers, so it must be allowed to be a
    /// little larger than what the source accepts, or it could never be published).
    pub(crate) async fn create(
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
