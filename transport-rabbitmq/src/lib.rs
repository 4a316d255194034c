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
//!
//! [`TransportError::AckLost`]: inbox_core::TransportError::AckLost
#![forbid(unsafe_code)]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod config;
mod connection;
mod consume;
mod delivery;
mod headers;
mod publish;
#[cfg(feature = "test-util")]
#[cfg_attr(docsrs, doc(cfg(feature = "test-util")))]
pub mod testing;
mod topology;
mod transport;

pub use config::{QueueType, RabbitMqConfig, quarantine_name, queue_name};
pub use delivery::RabbitDelivery;
pub use inbox_core::redact_url as redact;
pub use transport::RabbitMqTransport;
