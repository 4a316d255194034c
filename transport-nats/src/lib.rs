//! The NATS JetStream transport of `inbox`, on async-nats.
//!
//! The mapping (see the README's NATS section for the wire format):
//! - a source is a NATS subject, used literally; the stream that holds it is found
//!   (`stream_by_subject`: a stream of the application's, perhaps on a wildcard) or created
//!   when a consumer declares or subscribes, or on the first publish, listening on exactly that
//!   subject — so consumers of `parcels` never read `parcels.dead-letter`. Names:
//!   [`stream_name`], [`durable_name`];
//! - each (source, consumer name) has a durable pull consumer with explicit acks on that stream,
//!   filtered to the subject, reading from the stream's beginning; the server's delivery limit
//!   (`max_deliver`, [`NatsConfig::max_deliver`]) stays above the engine's own, so the engine
//!   dead-letters what it can see, and the server stops only what the client cannot parse;
//! - a delivery is acked after the commit and the ack confirmed by the server (a lost ack is
//!   reported); handing back is a nak with [`NatsConfig::redelivery_delay`]; while a delivery is
//!   unsettled the transport sends in-progress acks every third of the ack wait, so a long
//!   handler keeps it; the delivery count is JetStream's;
//! - a dead-letter destination (`<source>.dead-letter`) is a subject with a stream of its own; a
//!   replay reads it and deletes what it replayed.
//!
//! The message id travels in the `message-id` header and in `Nats-Msg-Id` (JetStream's duplicate
//! window drops a producer's retry); a delivery's id is `message-id`, else `Nats-Msg-Id`. Dead
//! letters and replays get a fresh `Nats-Msg-Id`, so the window never swallows them.
//!
//! The client reconnects by itself; a delivery stream that breaks ends with an error and the
//! consumer subscribes again.
#![forbid(unsafe_code)]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod config;
mod delivery;
mod error;
mod headers;
mod names;
#[cfg(feature = "test-util")]
#[cfg_attr(docsrs, doc(cfg(feature = "test-util")))]
pub mod testing;
mod transport;

/// The NATS client this transport is built on, for its connect options (TLS, credentials).
pub use async_nats;
pub use config::{NatsConfig, Retention};
pub use delivery::{NatsDelivery, NatsLetter};
pub use names::{durable_name, stream_name};
pub use transport::{NatsTransport, redact};
