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
#![cfg_attr(docsrs, feature(doc_cfg))]

mod config;
mod delivery;
mod error;
mod guard;
mod poll;
#[cfg(feature = "test-util")]
#[cfg_attr(docsrs, doc(cfg(feature = "test-util")))]
pub mod testing;
mod topics;
mod tracker;
mod transport;

pub use config::KafkaConfig;
pub use delivery::KafkaDelivery;
pub use transport::{KafkaTransport, group_id};
