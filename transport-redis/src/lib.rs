//! The Redis Streams transport of `inbox`, on redis-rs.
//!
//! The mapping (see the README's Redis section for the wire format and what the server's
//! persistence settings mean):
//! - a source is a stream (its key); each consumer name is a consumer group on it, created from
//!   the stream's beginning (`XGROUP CREATE <source> <consumer> 0 MKSTREAM`), so nothing written
//!   before a consumer first runs is skipped; each process is a consumer of its own in the group
//!   ([`RedisTransport::instance`]), and consumers with nothing pending, idle for an hour, are
//!   removed (crashed instances);
//! - new entries are read with `XREADGROUP … BLOCK`, on a connection per subscription; entries
//!   idle past the visibility timeout — a crashed instance's, a handed-back one — are claimed with
//!   `XAUTOCLAIM`, their delivery counts read from `XPENDING`; an entry is acked (`XACK`) after
//!   the commit; while it is unsettled its idle time is reset every third of the visibility
//!   timeout (`XCLAIM … JUSTID`, only while this instance owns it), so no other instance claims it
//!   from under a long handler;
//! - dead letters are entries of the stream `<source>.dead-letter`; a replay reads it and
//!   deletes what it replayed;
//! - trimming is off by default; [`Trim::Acknowledged`] removes what every group has acked.
#![forbid(unsafe_code)]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod config;
mod delivery;
mod error;
#[cfg(feature = "test-util")]
#[cfg_attr(docsrs, doc(cfg(feature = "test-util")))]
pub mod testing;
mod transport;
mod wire;

pub use config::{RedisConfig, Trim};
pub use delivery::{RedisDelivery, RedisLetter};
/// The Redis client this transport is built on.
pub use redis;
pub use transport::RedisTransport;
pub use wire::PAYLOAD_FIELD;
