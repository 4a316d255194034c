//! Deliveries: [`KafkaDelivery`], a record of a subscription, which reports its [`Settlement`]
//! to the poll loop; and `LogRecord`, a record read back from a log.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use async_trait::async_trait;
use inbox_core::{AckToken, Delivery, Headers, LogPosition, OutgoingMessage, TransportError};
use rdkafka::Message;
use rdkafka::message::{BorrowedMessage, Headers as _};
use tokio::sync::mpsc;

/// What became of a delivery, reported to its subscription's poll loop.
pub(crate) enum Settlement {
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

/// A record's headers. Of a key that appears more than once, the first value counts (as other
/// clients read it): a proxy that appends a second `message-id` does not change the dedup key.
pub(crate) fn headers_of(message: &BorrowedMessage<'_>) -> Headers {
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

/// A record read back from a log (a dead-letter topic): settling it changes nothing.
#[derive(Debug)]
pub(crate) struct LogRecord(pub(crate) OutgoingMessage);

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
    pub(crate) topic: String,
    pub(crate) partition: i32,
    pub(crate) offset: i64,
    pub(crate) generation: usize,
    pub(crate) ordering_key: Option<String>,
    pub(crate) payload: Vec<u8>,
    pub(crate) headers: Headers,
    /// The partition's first record since the assignment: it may have been delivered before,
    /// to an owner that died on it (Kafka counts no deliveries).
    pub(crate) maybe_redelivered: bool,
    pub(crate) settle: Option<mpsc::UnboundedSender<Settlement>>,
    pub(crate) unsettled: Arc<AtomicUsize>,
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

    fn log_position(&self) -> Option<LogPosition<'_>> {
        Some(LogPosition::new(&self.topic, self.partition, self.offset))
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
