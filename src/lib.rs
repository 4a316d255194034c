#![doc = include_str!("lib.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]

// What an application names: the consumer, its handler and messages, ids, policies, errors.
pub use inbox_core::{
    AfterCommit, BatchError, BatchHandler, Batched, Batching, BoxError, CancellationToken, Cleanup,
    CleanupPace, CleanupReport, Consumer, ConsumerError, ConsumerName, ConsumerReport,
    DEFAULT_ID_HEADER, Dedup, ErrorKind, Handler, HandlerError, Headers, IdStrategy, InboxAdmin,
    InboxStore, InvalidName, MAX_CONSUMER_NAME_BYTES, MAX_MESSAGE_ID_BYTES, Message, MessageId,
    OutgoingMessage, RetryPolicy, StoreError, TRACEPARENT, TraceParent, Transport, TransportError,
    async_trait, error_chain, redact_url,
};

#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub use inbox_core::{PgTx, PostgresStore};

#[cfg(feature = "mysql")]
#[cfg_attr(docsrs, doc(cfg(feature = "mysql")))]
pub use inbox_core::{MySqlStore, MySqlTx};

#[cfg(feature = "sqlite")]
#[cfg_attr(docsrs, doc(cfg(feature = "sqlite")))]
pub use inbox_core::{SqliteStore, SqliteTx};

/// Dead letters: where they go, the headers they carry, and replaying them (an operator's act;
/// see [`replay`](dead_letter::replay)).
pub mod dead_letter {
    pub use inbox_core::dead_letter_headers as headers;
    pub use inbox_core::default_dead_letter_destination as default_destination;
    pub use inbox_core::replay::{
        Replay, ReplayError, ReplayReport, replay_dead_letters as replay,
    };
}

pub use inbox_core::metrics;

/// The producer's half: write outgoing messages in your transaction, publish them with a relay.
pub use inbox_core::outbox;

/// For implementing a transport: what a broker's crate implements besides
/// [`Transport`], and what the engine hands it.
pub mod transport {
    pub use inbox_core::{
        AckToken, Capabilities, Delivery, DeliveryStream, LogPosition, OffsetSource, Offsets,
        Subscription,
    };
}

/// For implementing or inspecting a store: besides [`InboxStore`], what a
/// claim returns and what operators read.
pub mod store {
    #[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
    #[cfg_attr(
        docsrs,
        doc(cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite")))
    )]
    pub use inbox_core::store::release_clean;
    pub use inbox_core::store::{Claim, ConsumerStats, DeadLetter, MAX_ERROR_CHARS, OffsetClaim};
}

/// The in-process broker: at-least-once semantics and deterministic fault injection.
#[cfg(feature = "memory")]
#[cfg_attr(docsrs, doc(cfg(feature = "memory")))]
pub use inbox_transport_memory as memory;

/// The RabbitMQ transport (lapin).
#[cfg(feature = "rabbitmq")]
#[cfg_attr(docsrs, doc(cfg(feature = "rabbitmq")))]
pub use inbox_transport_rabbitmq as rabbitmq;

/// The Kafka transport (rdkafka).
#[cfg(feature = "kafka")]
#[cfg_attr(docsrs, doc(cfg(feature = "kafka")))]
pub use inbox_transport_kafka as kafka;

/// The NATS JetStream transport (async-nats).
#[cfg(feature = "nats")]
#[cfg_attr(docsrs, doc(cfg(feature = "nats")))]
pub use inbox_transport_nats as nats;

/// The Redis Streams transport (redis-rs).
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub use inbox_transport_redis as redis;

/// The README's examples, compiled and run as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeExamples;
