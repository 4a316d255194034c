//! Consumer names, message ids, and the strategies that find a delivery's id.

use std::fmt;

use sha2::{Digest, Sha256};

use crate::error::InvalidName;
use crate::transport::Delivery;

/// The longest message id accepted, in bytes (the inbox table's bound).
pub const MAX_MESSAGE_ID_BYTES: usize = 255;
/// The longest consumer name accepted, in bytes.
pub const MAX_CONSUMER_NAME_BYTES: usize = 100;

fn check_text(what: &str, value: &str, max: usize) -> Result<(), InvalidName> {
    if value.is_empty() {
        return Err(InvalidName(format!("{what} is empty")));
    }
    if value.len() > max {
        return Err(InvalidName(format!(
            "{what} is {} bytes long, the limit is {max}",
            value.len()
        )));
    }
    if let Some(c) = value.chars().find(|c| c.is_control()) {
        return Err(InvalidName(format!(
            "{what} contains the control character {:?}",
            c
        )));
    }
    Ok(())
}

/// The stable name of a consumer: the dedup scope is `(consumer, message id)`.
///
/// Renaming a consumer makes it a new consumer that has seen nothing, so pick the name once.
/// 1 to 100 bytes, no control characters, no leading or trailing whitespace. Anything else —
/// quotes, semicolons, SQL keywords — is just text: every value reaches the database as a bound
/// parameter.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConsumerName(String);

impl ConsumerName {
    /// Validates a consumer name.
    ///
    /// ```
    /// use inbox_core::ConsumerName;
    /// assert!(ConsumerName::new("carrier-assignment").is_ok());
    /// assert!(ConsumerName::new("").is_err());
    /// assert!(ConsumerName::new(" padded ").is_err());
    /// ```
    pub fn new(name: impl Into<String>) -> Result<Self, InvalidName> {
        let name = name.into();
        check_text("consumer name", &name, MAX_CONSUMER_NAME_BYTES)?;
        if name.trim() != name {
            return Err(InvalidName(format!(
                "consumer name {name:?} has leading or trailing whitespace"
            )));
        }
        Ok(Self(name))
    }

    /// The name as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for ConsumerName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl TryFrom<&str> for ConsumerName {
    type Error = InvalidName;
    fn try_from(value: &str) -> Result<Self, Self::Error> {
        Self::new(value)
    }
}

/// A validated message id: 1 to 255 bytes of UTF-8 without control characters.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MessageId(String);

impl MessageId {
    /// Validates a message id given as text.
    ///
    /// ```
    /// use inbox_core::MessageId;
    /// assert!(MessageId::new("7c1e9a4e-parcel-created").is_ok());
    /// assert!(MessageId::new("").is_err());
    /// assert!(MessageId::new("x".repeat(256)).is_err());
    /// ```
    pub fn new(id: impl Into<String>) -> Result<Self, InvalidName> {
        let id = id.into();
        check_text("message id", &id, MAX_MESSAGE_ID_BYTES)?;
        Ok(Self(id))
    }

    /// Validates a message id given as bytes (a header value, a broker property).
    pub fn from_bytes(id: &[u8]) -> Result<Self, InvalidName> {
        let text = std::str::from_utf8(id).map_err(|e| {
            InvalidName(format!(
                "message id is not valid UTF-8 ({e}); first bytes: {:02x?}",
                &id[..id.len().min(16)]
            ))
        })?;
        Self::new(text)
    }

    /// The id as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for MessageId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Where a delivery's message id comes from.
///
/// The id must be the producer's: the same for every copy of one message, different for
/// different messages. A delivery whose id is missing or invalid is dead-lettered with the
/// reason; it is never given a random id (which would make every redelivery look new).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum IdStrategy {
    /// The broker's message id property (AMQP `message_id`); nothing else.
    BrokerId,
    /// The named header only (Kafka's convention: `message-id`).
    Header(String),
    /// The broker's id property, and when it is absent the named header. The default, with
    /// header `message-id`.
    BrokerIdOrHeader(String),
    /// Opt-in: the SHA-256 of the payload, hex-encoded. Two different messages with the same
    /// bytes are then one message — choose it only when that is what you mean.
    ContentHash,
    /// Opt-in: the record's coordinates (Kafka `topic/partition/offset`). Stable across
    /// redeliveries of one record, not across producer retries.
    Coordinates,
}

impl Default for IdStrategy {
    fn default() -> Self {
        IdStrategy::BrokerIdOrHeader(DEFAULT_ID_HEADER.to_owned())
    }
}

/// The header the default strategy falls back to.
pub const DEFAULT_ID_HEADER: &str = "message-id";

impl IdStrategy {
    /// Finds and validates the id of a delivery, or says why there is none.
    pub fn extract(&self, delivery: &dyn Delivery) -> Result<MessageId, InvalidName> {
        let from_header = |name: &str| delivery.headers().get(name).map(MessageId::from_bytes);
        let found = match self {
            IdStrategy::BrokerId => delivery.broker_message_id().map(MessageId::from_bytes),
            IdStrategy::Header(name) => from_header(name),
            // An empty id property counts as absent when the header is there: some clients
            // send "" for "not set".
            IdStrategy::BrokerIdOrHeader(name) => match delivery.broker_message_id() {
                Some(id) if !id.is_empty() => Some(MessageId::from_bytes(id)),
                property => from_header(name).or_else(|| property.map(MessageId::from_bytes)),
            },
            IdStrategy::ContentHash => {
                let digest = Sha256::digest(delivery.payload());
                let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
                Some(MessageId::new(hex))
            }
            IdStrategy::Coordinates => delivery.coordinates().map(MessageId::new),
        };
        found.unwrap_or_else(|| Err(InvalidName(format!("no message id ({})", self.describe()))))
    }

    fn describe(&self) -> String {
        match self {
            IdStrategy::BrokerId => "the broker's message id property is not set".to_owned(),
            IdStrategy::Header(name) => format!("header {name:?} is not set"),
            IdStrategy::BrokerIdOrHeader(name) => {
                format!("neither the broker's message id property nor header {name:?} is set")
            }
            IdStrategy::ContentHash => "content hash unavailable".to_owned(),
            IdStrategy::Coordinates => "the transport gives no record coordinates".to_owned(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn message_id_limits() {
        assert!(MessageId::new("a".repeat(255)).is_ok());
        let err = MessageId::new("a".repeat(256)).unwrap_err();
        assert!(err.to_string().contains("256 bytes"), "{err}");
        assert!(MessageId::new("nul\0inside").is_err());
        assert!(
            MessageId::from_bytes(&[0xff, 0xfe])
                .unwrap_err()
                .to_string()
                .contains("UTF-8")
        );
        // SQL is just text to us.
        assert!(MessageId::new("'; DROP TABLE inbox_messages; --").is_ok());
    }

    /// Just enough of a delivery to extract ids from.
    #[derive(Debug, Default)]
    struct Fake {
        broker_id: Option<Vec<u8>>,
        headers: crate::Headers,
        payload: Vec<u8>,
        coordinates: Option<String>,
    }

    #[async_trait::async_trait]
    impl Delivery for Fake {
        fn payload(&self) -> &[u8] {
            &self.payload
        }
        fn headers(&self) -> &crate::Headers {
            &self.headers
        }
        fn broker_message_id(&self) -> Option<&[u8]> {
            self.broker_id.as_deref()
        }
        fn redelivered(&self) -> bool {
            false
        }
        fn coordinates(&self) -> Option<String> {
            self.coordinates.clone()
        }
        async fn ack(self: Box<Self>, _: crate::AckToken) -> Result<(), crate::TransportError> {
            Ok(())
        }
        async fn nack(self: Box<Self>, _: bool) -> Result<(), crate::TransportError> {
            Ok(())
        }
    }

    #[test]
    fn strategies_find_the_producers_id_or_say_why_not() {
        let with_header = Fake {
            headers: crate::Headers::new().with("message-id", "from-header"),
            ..Fake::default()
        };
        let both = Fake {
            broker_id: Some(b"from-broker".to_vec()),
            ..with_header
        };
        let id = |strategy: &IdStrategy, d: &Fake| strategy.extract(d).map(|id| id.to_string());
        assert_eq!(id(&IdStrategy::default(), &both).unwrap(), "from-broker");
        let header_only = Fake {
            headers: crate::Headers::new().with("message-id", "from-header"),
            ..Fake::default()
        };
        assert_eq!(
            id(&IdStrategy::default(), &header_only).unwrap(),
            "from-header"
        );
        // An empty id property falls back to the header; with no header it is an empty id.
        let empty_property = Fake {
            broker_id: Some(Vec::new()),
            headers: crate::Headers::new().with("message-id", "from-header"),
            ..Fake::default()
        };
        assert_eq!(
            id(&IdStrategy::default(), &empty_property).unwrap(),
            "from-header"
        );
        let only_empty = Fake {
            broker_id: Some(Vec::new()),
            ..Fake::default()
        };
        assert!(
            id(&IdStrategy::default(), &only_empty)
                .unwrap_err()
                .to_string()
                .contains("empty")
        );
        assert!(
            id(&IdStrategy::BrokerId, &header_only)
                .unwrap_err()
                .to_string()
                .contains("not set")
        );
        assert_eq!(
            id(&IdStrategy::Header("message-id".into()), &both).unwrap(),
            "from-header"
        );

        let hashed = |payload: &[u8]| {
            id(
                &IdStrategy::ContentHash,
                &Fake {
                    payload: payload.to_vec(),
                    ..Fake::default()
                },
            )
        };
        assert_eq!(hashed(b"same").unwrap(), hashed(b"same").unwrap());
        assert_ne!(hashed(b"same").unwrap(), hashed(b"other").unwrap());
        assert_eq!(hashed(b"").unwrap().len(), 64);

        let at = Fake {
            coordinates: Some("parcels/2/17".into()),
            ..Fake::default()
        };
        assert_eq!(id(&IdStrategy::Coordinates, &at).unwrap(), "parcels/2/17");
        assert!(id(&IdStrategy::Coordinates, &Fake::default()).is_err());
    }

    #[test]
    fn consumer_name_rules() {
        assert!(ConsumerName::new("notification").is_ok());
        assert!(ConsumerName::new("x".repeat(101)).is_err());
        assert!(ConsumerName::new("tab\tname").is_err());
        assert!(ConsumerName::new("\"quoted\"; SELECT 1").is_ok());
    }
}
