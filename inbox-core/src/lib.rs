//! The core of `inbox`: exactly-once side effects over at-least-once brokers.
//!
//! Before a [`Handler`] runs, the [`Consumer`] records `(consumer, message id)` in the inbox
//! table in the same transaction as the handler's own writes, commits, and only then acks the
//! broker. A message seen before is acked and discarded. The claim is one statement, so two copies
//! of a message delivered at once to two instances never both commit: the second waits for the
//! first and then sees it done.
//!
//! This crate knows no broker: transports implement [`Transport`] and [`Delivery`]; stores
//! implement [`InboxStore`] (PostgreSQL and SQLite here, behind the `postgres` and `sqlite`
//! features).
#![forbid(unsafe_code)]

mod cleanup;
mod consumer;
mod error;
mod handler;
mod id;
mod message;
pub mod metrics;
mod outage;
pub mod outbox;
pub mod replay;
mod retry;
pub mod store;
mod trace;
mod transport;

pub use cleanup::Cleanup;
pub use consumer::{
    AfterCommit, Batching, Consumer, ConsumerReport, Dedup, dead_letter_headers,
    default_dead_letter_destination,
};
pub use error::{
    BatchError, BoxError, ConsumerError, ErrorKind, HandlerError, InvalidName, StoreError,
    TransportError, error_chain, redact_url,
};
pub use handler::{BatchHandler, Batched, Handler};
pub use id::{
    ConsumerName, DEFAULT_ID_HEADER, IdStrategy, MAX_CONSUMER_NAME_BYTES, MAX_MESSAGE_ID_BYTES,
    MessageId,
};
pub use message::{Headers, Message, OutgoingMessage};
pub use replay::{Replay, ReplayError, ReplayReport, replay_dead_letters};
pub use retry::RetryPolicy;
#[cfg(feature = "mysql")]
pub use store::mysql::{MySqlStore, MySqlTx};
#[cfg(feature = "postgres")]
pub use store::postgres::{PgTx, PostgresStore};
#[cfg(feature = "sqlite")]
pub use store::sqlite::{SqliteStore, SqliteTx};
pub use store::{
    Claim, CleanupPace, CleanupReport, ConsumerStats, DeadLetter, InboxAdmin, InboxStore,
    OffsetClaim,
};
pub use trace::{TRACEPARENT, TraceParent};
pub use transport::{
    AckToken, Capabilities, Delivery, DeliveryStream, LogPosition, OffsetSource, Offsets,
    Subscription, Transport,
};

/// Re-exported so handlers and transports name the same versions.
pub use async_trait::async_trait;
pub use tokio_util::sync::CancellationToken;
