//! What a consumer is configured with; the setters are on [`Consumer`](super::Consumer).

use std::sync::Arc;
use std::time::Duration;

use crate::id::{IdStrategy, MessageId};
use crate::retry::RetryPolicy;

/// Settings of a consumer; see the setters on [`Consumer`](super::Consumer).
#[derive(Debug, Clone)]
pub(super) struct Settings {
    pub(super) concurrency: usize,
    pub(super) prefetch: Option<u16>,
    pub(super) id_strategy: IdStrategy,
    pub(super) retry: RetryPolicy,
    pub(super) dead_letter_destination: Option<String>,
    pub(super) max_payload_bytes: usize,
    pub(super) handler_timeout: Option<Duration>,
    pub(super) reconnect: RetryPolicy,
    pub(super) after_commit: Hook,
    pub(super) batch: Option<Batching>,
    pub(super) stats_interval: Option<Duration>,
    pub(super) drain_timeout: Option<Duration>,
    pub(super) dedup: Dedup,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            concurrency: 8,
            prefetch: None,
            id_strategy: IdStrategy::default(),
            retry: RetryPolicy::default(),
            dead_letter_destination: None,
            max_payload_bytes: 1024 * 1024,
            handler_timeout: None,
            reconnect: RetryPolicy::default()
                .with_delays(Duration::from_millis(100), Duration::from_secs(5)),
            after_commit: Hook::default(),
            batch: None,
            stats_interval: Some(Duration::from_secs(30)),
            drain_timeout: None,
            dedup: Dedup::default(),
        }
    }
}

/// How a consumer tells a copy from a new message. See [`Consumer::dedup`](super::Consumer::dedup).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Dedup {
    /// By message id (the default, on every transport): a row per `(consumer, message id)` in
    /// `inbox_messages`, written with the handler's writes. Catches every copy, whatever made
    /// it: a redelivery, a lost ack, a producer that sent the message twice.
    #[default]
    Ids,
    /// By log offset (Kafka): per partition, the offset of the next record to handle, kept in
    /// `inbox_offsets` and written with the handler's writes; no row per message. Catches every
    /// redelivery of a record, but NOT a producer that sent the same message twice: that is two
    /// records at two offsets, and both are handled.
    Offsets,
    /// Both: the offset and the message id. Catches producer duplicates too, at the cost of the
    /// row per message.
    OffsetsAndIds,
}

impl Dedup {
    /// Whether the offsets are kept.
    pub(super) fn offsets(self) -> bool {
        matches!(self, Dedup::Offsets | Dedup::OffsetsAndIds)
    }

    /// Whether every message gets an id row.
    pub(super) fn ids(self) -> bool {
        matches!(self, Dedup::Ids | Dedup::OffsetsAndIds)
    }
}

/// Batch mode: deliveries that arrive together are claimed in one statement and handled in one
/// transaction, a savepoint per message, with one commit for all of them. See
/// [`Consumer::batch`](super::Consumer::batch).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Batching {
    /// The most deliveries in one transaction.
    pub max_size: usize,
    /// How long to wait for more deliveries once one is there. What is already waiting is taken
    /// at once, so at low rates a message waits at most this long.
    pub max_wait: Duration,
}

impl Batching {
    /// Up to `max_size` deliveries (at least 1), waiting at most `max_wait` to fill a batch.
    pub fn new(max_size: usize, max_wait: Duration) -> Self {
        Self {
            max_size: max_size.max(1),
            max_wait,
        }
    }
}

impl Default for Batching {
    /// 100 deliveries, 5 ms.
    fn default() -> Self {
        Self::new(100, Duration::from_millis(5))
    }
}

/// See [`Consumer::after_commit`](super::Consumer::after_commit).
pub type AfterCommit =
    Arc<dyn Fn(&MessageId) -> futures::future::BoxFuture<'static, ()> + Send + Sync>;

/// The optional hook, printable.
#[derive(Clone, Default)]
pub(super) struct Hook(pub(super) Option<AfterCommit>);

impl std::fmt::Debug for Hook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "Some(<hook>)"
        } else {
            "None"
        })
    }
}
