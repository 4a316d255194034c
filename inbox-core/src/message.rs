//! Messages as the handler sees them, and as they are published.

use std::collections::BTreeMap;

use bytes::Bytes;
use serde::de::DeserializeOwned;

use crate::error::HandlerError;
use crate::id::{ConsumerName, MessageId};

/// Message headers: names to raw values. Transports map their broker's header types onto bytes
/// (AMQP strings as their bytes, numbers as decimal text).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Headers(BTreeMap<String, Bytes>);

impl Headers {
    /// No headers.
    pub fn new() -> Self {
        Self::default()
    }

    /// The raw value of a header.
    pub fn get(&self, name: &str) -> Option<&[u8]> {
        self.0.get(name).map(|v| v.as_ref())
    }

    /// The value of a header, if it is UTF-8 text.
    pub fn get_str(&self, name: &str) -> Option<&str> {
        self.get(name).and_then(|v| std::str::from_utf8(v).ok())
    }

    /// Sets a header, replacing an earlier value.
    pub fn insert(&mut self, name: impl Into<String>, value: impl Into<Bytes>) {
        self.0.insert(name.into(), value.into());
    }

    /// Builder form of [`insert`](Self::insert).
    pub fn with(mut self, name: impl Into<String>, value: impl Into<Bytes>) -> Self {
        self.insert(name, value);
        self
    }

    /// All headers, sorted by name.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &[u8])> {
        self.0.iter().map(|(k, v)| (k.as_str(), v.as_ref()))
    }

    /// The number of headers.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether there are no headers.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl<K: Into<String>, V: Into<Bytes>> FromIterator<(K, V)> for Headers {
    fn from_iter<T: IntoIterator<Item = (K, V)>>(iter: T) -> Self {
        Self(
            iter.into_iter()
                .map(|(k, v)| (k.into(), v.into()))
                .collect(),
        )
    }
}

/// A message as a [`Handler`](crate::Handler) receives it: read-only, and without the delivery,
/// so a handler cannot acknowledge anything.
#[derive(Debug)]
#[non_exhaustive]
pub struct Message<'a> {
    /// The message id: the dedup key together with the consumer.
    pub id: &'a MessageId,
    /// The consumer handling it.
    pub consumer: &'a ConsumerName,
    /// Where it was consumed from.
    pub source: &'a str,
    /// The payload as delivered.
    pub payload: &'a [u8],
    /// The headers as delivered.
    pub headers: &'a Headers,
    /// 1 for the first attempt; counts failed attempts across redeliveries and restarts.
    pub attempt: u32,
    /// Whether the broker says it delivered this message before.
    pub redelivered: bool,
}

impl Message<'_> {
    /// Decodes a JSON payload. A payload that does not decode is a permanent error: the message
    /// is dead-lettered with the decoder's reason.
    pub fn json<T: DeserializeOwned>(&self) -> Result<T, HandlerError> {
        if self.payload.is_empty() {
            return Err(HandlerError::permanent(
                "empty payload: expected a JSON document",
            ));
        }
        serde_json::from_slice(self.payload)
            .map_err(|e| HandlerError::permanent(format!("payload is not the expected JSON: {e}")))
    }
}

/// A message to publish.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OutgoingMessage {
    /// The message id. Transports put it where their consumers look for it (AMQP `message_id`,
    /// the Kafka header `message-id`).
    pub message_id: Option<String>,
    /// The payload.
    pub payload: Bytes,
    /// Headers.
    pub headers: Headers,
    /// Partition key, for transports that partition (Kafka); others ignore it.
    pub key: Option<Bytes>,
}

impl OutgoingMessage {
    /// A message with an id and a payload.
    pub fn new(message_id: impl Into<String>, payload: impl Into<Bytes>) -> Self {
        Self {
            message_id: Some(message_id.into()),
            payload: payload.into(),
            ..Self::default()
        }
    }

    /// Adds a header.
    pub fn with_header(mut self, name: impl Into<String>, value: impl Into<Bytes>) -> Self {
        self.headers.insert(name, value);
        self
    }

    /// Sets the partition key.
    pub fn with_key(mut self, key: impl Into<Bytes>) -> Self {
        self.key = Some(key.into());
        self
    }
}
