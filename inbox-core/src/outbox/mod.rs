//! The producer's half: a transactional outbox and its relay.
//!
//! A message is written to `outbox_messages` in the same transaction as the business change that
//! caused it ([`Outbox::send`]); a [`Relay`] publishes it after that transaction commits and marks
//! it published. A committed row is published at least once, a rolled-back one never; with the
//! inbox on the consumer (the same message id), the effect is exactly once from the producer's
//! commit to the consumer's.
//!
//! **Order.** Rows with the same ordering key ([`OutgoingMessage::key`]) are published in the
//! order their transactions wrote them, one in flight per key, even when those transactions commit
//! out of order; a row that keeps failing holds back the later rows of its key only. Rows without
//! a key are published as soon as they are seen. The relay promises publish order; handling in
//! order also needs a transport that keeps it (Kafka, by key).
//!
//! ```no_run
//! # #[cfg(feature = "postgres")]
//! # async fn f(transport: std::sync::Arc<dyn inbox_core::Transport>) -> Result<(), Box<dyn std::error::Error>> {
//! use inbox_core::{CancellationToken, InboxStore, OutgoingMessage, PostgresStore};
//! use inbox_core::outbox::Outbox;
//!
//! let store = PostgresStore::connect("postgres://localhost/app", 8).await?;
//! let outbox = Outbox::new(store.clone());
//!
//! // A transaction whose messages are written as it commits (see `OutboxTx`).
//! let mut tx = outbox.begin().await?;
//! sqlx::query("INSERT INTO parcels (id) VALUES ('p-1')").execute(&mut **tx).await?;
//! tx.send("parcels", OutgoingMessage::new("parcel-created-p-1", "{}").with_key("p-1"))?;
//! tx.commit().await?; // writes the row, commits, then wakes the relays at once
//!
//! // Or written at once, into any transaction of the store (a consumer's, say).
//! let mut tx = store.begin().await?;
//! outbox
//!     .send(&mut tx, "parcels", OutgoingMessage::new("parcel-created-p-2", "{}").with_key("p-2"))
//!     .await?;
//! outbox.commit(tx).await?; // commits, then wakes the relays
//!
//! let stop = CancellationToken::new();
//! outbox.relay(transport).run(stop).await?;
//! # Ok(()) }
//! ```

mod codec;
#[cfg(feature = "mysql")]
mod mysql;
#[cfg(feature = "postgres")]
mod postgres;
mod relay;
#[cfg(feature = "sqlite")]
mod sqlite;

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use async_trait::async_trait;
use futures::stream::BoxStream;

use crate::consumer::AfterCommit;
use crate::error::StoreError;
use crate::message::OutgoingMessage;
use crate::store::InboxStore;
use crate::transport::Transport;

pub use relay::{Relay, RelayError, RelayReport};

/// What [`Outbox::send`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Sent {
    /// The row's id in `outbox_messages` (what `inbox outbox dead retry|skip` take).
    pub row_id: i64,
    /// The message id: the caller's, or the fresh UUIDv7 given to it.
    pub message_id: String,
    /// False when a row for `(destination, message id)` existed already (sent twice, or a
    /// retry of the caller): nothing was written.
    pub written: bool,
}

/// A row the relay claimed, to publish.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct OutboxRow {
    /// The row id.
    pub id: i64,
    /// Where to publish.
    pub destination: String,
    /// The message, with its id, headers (the `traceparent` included) and key.
    pub message: OutgoingMessage,
    /// Failed publishes so far.
    pub attempts: u32,
    /// Of those, the ones that found no route.
    pub no_routes: u32,
    /// How long ago the row was written, by the database's clock at the claim.
    pub age: Duration,
}

/// A failed publish, as the relay records it.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct PublishFailure {
    /// The row id.
    pub id: i64,
    /// The reason, kept in `last_error`.
    pub error: String,
    /// Not tried again before this delay.
    pub retry_after: Duration,
    /// Marked dead: not tried again unless an operator retries it.
    pub dead: bool,
    /// The broker had no route for it (counted apart: see `Relay::max_no_route_attempts`).
    pub no_route: bool,
}

impl PublishFailure {
    /// A failure of row `id` (not a no-route one).
    pub fn new(id: i64, error: impl Into<String>, retry_after: Duration, dead: bool) -> Self {
        Self {
            id,
            error: error.into(),
            retry_after,
            dead,
            no_route: false,
        }
    }
}

/// The rows one relay batch claimed: publish them, then [`finish`](Self::finish) the batch.
#[non_exhaustive]
pub struct OutboxBatch {
    /// The rows, in id order.
    pub rows: Vec<OutboxRow>,
    claim: Box<dyn BatchClaim>,
    claimed_at: std::time::Instant,
}

impl std::fmt::Debug for OutboxBatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OutboxBatch")
            .field("rows", &self.rows.len())
            .finish_non_exhaustive()
    }
}

impl OutboxBatch {
    /// `rows`, held by `claim` (a store's own way of ending the claim), whose lease starts now.
    pub fn new(rows: Vec<OutboxRow>, claim: Box<dyn BatchClaim>) -> Self {
        Self {
            rows,
            claim,
            claimed_at: std::time::Instant::now(),
        }
    }

    /// The lease started at `at` (by this process's clock; no later than the database's start
    /// of it), not when the batch was built.
    pub fn claimed_at(mut self, at: std::time::Instant) -> Self {
        self.claimed_at = at;
        self
    }

    /// When the lease started: the relay stops waiting for this batch's confirms a tenth of
    /// the lease before it ends.
    pub fn lease_started(&self) -> std::time::Instant {
        self.claimed_at
    }

    /// A batch of no rows (nothing was claimed).
    pub fn empty() -> Self {
        Self::new(Vec::new(), Box::new(Nothing))
    }

    /// The rows and the claim, to finish apart.
    pub fn into_parts(self) -> (Vec<OutboxRow>, Box<dyn BatchClaim>) {
        (self.rows, self.claim)
    }

    /// Ends the claim: marks the rows `published` published (deletes them unless `keep`) and
    /// records `failures`, releasing those rows. Returns how many rows it marked: fewer than
    /// `published.len()` when the lease had lapsed and another relay took them (fencing: that
    /// relay publishes them again, and the consumer's inbox discards the copy).
    pub async fn finish(
        self,
        published: &[i64],
        failures: &[PublishFailure],
        keep: bool,
    ) -> Result<u64, StoreError> {
        self.claim.finish(published, failures, keep).await
    }
}

/// How a store ends one batch's claim; see [`OutboxBatch::finish`].
#[async_trait]
pub trait BatchClaim: Send {
    /// Marks `published`, records `failures`, and releases the claim. Returns how many rows it
    /// marked published.
    async fn finish(
        self: Box<Self>,
        published: &[i64],
        failures: &[PublishFailure],
        keep: bool,
    ) -> Result<u64, StoreError>;
}

/// The claim of an empty batch.
struct Nothing;

#[async_trait]
impl BatchClaim for Nothing {
    async fn finish(
        self: Box<Self>,
        _: &[i64],
        _: &[PublishFailure],
        _: bool,
    ) -> Result<u64, StoreError> {
        Ok(0)
    }
}

/// The claim of a store that names a lease token in every statement of the batch (MySQL,
/// SQLite): a statement of a batch whose lease lapsed finds no row with its token.
#[cfg(any(feature = "mysql", feature = "sqlite"))]
#[async_trait]
trait TokenLeases: Send + Sync + 'static {
    /// Marks rows of batch `token` published (deleted unless `keep`) in one statement. Returns
    /// how many it marked.
    async fn mark_leased(&self, token: &str, ids: &[i64], keep: bool) -> Result<u64, StoreError>;

    /// Records failed publishes of batch `token` and releases those rows.
    async fn fail_leased(&self, token: &str, failures: &[PublishFailure])
    -> Result<(), StoreError>;
}

/// A batch of `rows` claimed under `token`.
#[cfg(any(feature = "mysql", feature = "sqlite"))]
fn leased<S: TokenLeases + Clone>(
    store: &S,
    token: &str,
    rows: Vec<OutboxRow>,
    started: std::time::Instant,
) -> OutboxBatch {
    let claim = Leased {
        store: store.clone(),
        token: token.to_owned(),
    };
    OutboxBatch::new(rows, Box::new(claim)).claimed_at(started)
}

#[cfg(any(feature = "mysql", feature = "sqlite"))]
struct Leased<S> {
    store: S,
    token: String,
}

#[cfg(any(feature = "mysql", feature = "sqlite"))]
#[async_trait]
impl<S: TokenLeases> BatchClaim for Leased<S> {
    async fn finish(
        self: Box<Self>,
        published: &[i64],
        failures: &[PublishFailure],
        keep: bool,
    ) -> Result<u64, StoreError> {
        let mut marked = 0;
        if !published.is_empty() {
            // A conflict (InnoDB reports deadlocks between the mark's `DELETE` and concurrent
            // claims) is retried at once a few times: the mark is idempotent, and giving up
            // would leave the rows to be published again once their lease lapses.
            let mut tries = 0;
            marked = loop {
                match self.store.mark_leased(&self.token, published, keep).await {
                    Err(StoreError::Conflict(e)) if tries < 5 => {
                        tries += 1;
                        tracing::debug!(error = %e, tries, "outbox mark: conflict; trying again");
                        tokio::time::sleep(Duration::from_millis(5 * tries)).await;
                    }
                    other => break other?,
                }
            };
        }
        if !failures.is_empty() {
            self.store.fail_leased(&self.token, failures).await?;
        }
        Ok(marked)
    }
}

/// Counts for one destination, as `inbox outbox stats` shows them.
#[derive(Debug, Clone, PartialEq, Default, serde::Serialize)]
#[non_exhaustive]
pub struct OutboxStats {
    /// The destination.
    pub destination: String,
    /// Rows not published yet (dead ones included).
    pub pending: u64,
    /// Pending rows with failed publishes, not dead.
    pub failing: u64,
    /// Dead rows.
    pub dead: u64,
    /// Ordering keys held back by a dead or failing row at their head.
    pub blocked_keys: u64,
    /// Published rows kept for the retention window.
    pub published_kept: u64,
    /// Age of the oldest pending row that is not dead, in seconds: the relay's lag.
    pub oldest_pending_seconds: Option<f64>,
}

/// A dead row, as `inbox outbox dead list` shows it.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[non_exhaustive]
pub struct OutboxDeadRow {
    /// The row id.
    pub id: i64,
    /// The destination.
    pub destination: String,
    /// The message id.
    pub message_id: String,
    /// The ordering key, if any (its later rows wait for this one).
    pub ordering_key: Option<String>,
    /// Publishes tried.
    pub attempts: u32,
    /// Why it is dead.
    pub last_error: Option<String>,
    /// Seconds since it was written.
    pub age_seconds: f64,
}

/// The `outbox_messages` table: what [`Outbox`] and [`Relay`] need of a store. Implemented by
/// the PostgreSQL, MySQL / MariaDB and SQLite stores; the schema comes with
/// [`InboxAdmin::migrate`](crate::InboxAdmin::migrate).
///
/// A relay batch's claim lasts until its lease lapses: after that, another relay may claim the
/// rows, and the old batch can neither mark them published nor record a failure on them
/// (fencing). PostgreSQL holds the claimed rows' locks in a transaction the database ends once
/// its session has been idle for the lease (the batch's publishes are that idle time); MySQL
/// and SQLite name a lease token in every statement of the batch.
#[async_trait]
pub trait OutboxStore: InboxStore + Clone {
    /// Writes `message` to `destination` in `tx`. The caller has validated it; the id is set.
    async fn insert_outbox(
        &self,
        tx: &mut Self::Tx,
        destination: &str,
        message_id: &str,
        message: &OutgoingMessage,
        ordering_key: Option<&str>,
    ) -> Result<(i64, bool), StoreError>;

    /// Writes `staged` in `tx`, then commits it: what [`OutboxTx::commit`] does. Returns each
    /// row's id and whether it was written, in `staged`'s order. A store whose commit first
    /// checks that the transaction is still live (PostgreSQL) may let the writes prove it.
    async fn commit_outbox(
        &self,
        mut tx: Self::Tx,
        staged: &[Staged],
    ) -> Result<Vec<(i64, bool)>, StoreError> {
        match insert_staged(self, &mut tx, staged).await {
            Ok(written) => {
                self.commit(tx).await?;
                Ok(written)
            }
            Err(e) => {
                let _ = self.rollback(tx).await;
                Err(e)
            }
        }
    }

    /// Claims up to `limit` publishable rows for `lease`, in one statement: pending, due, not
    /// claimed by another batch, and each the first pending row of its key. Ordered by id.
    async fn claim_outbox(&self, limit: u32, lease: Duration) -> Result<OutboxBatch, StoreError>;

    /// Counts per destination, published rows kept for retention included: what `inbox outbox
    /// stats` shows, sorted by destination (by bytes). Counting the kept rows reads all of them;
    /// a loop wants [`outbox_pending_stats`](Self::outbox_pending_stats). Two statements: a row
    /// published between them may be counted as pending and kept, or as neither.
    async fn outbox_stats(&self) -> Result<Vec<OutboxStats>, StoreError> {
        let mut stats = self.outbox_pending_stats().await?;
        for (destination, kept) in self.outbox_kept().await? {
            match stats.iter_mut().find(|s| s.destination == destination) {
                Some(s) => s.published_kept = kept,
                None => stats.push(OutboxStats {
                    destination,
                    published_kept: kept,
                    ..OutboxStats::default()
                }),
            }
        }
        // By bytes, the same on every store whatever the database's collation.
        stats.sort_by(|a, b| a.destination.cmp(&b.destination));
        Ok(stats)
    }

    /// Counts per destination of the rows not published yet (`published_kept` is 0; a
    /// destination with none has no entry): what a relay samples for its gauges. Read by the
    /// indexes of pending and dead rows, so that its cost follows the backlog, not the published
    /// rows kept for retention.
    async fn outbox_pending_stats(&self) -> Result<Vec<OutboxStats>, StoreError>;

    /// Published rows kept for retention, per destination.
    async fn outbox_kept(&self) -> Result<Vec<(String, u64)>, StoreError>;

    /// Dead rows, oldest first.
    async fn outbox_dead(&self, limit: u32) -> Result<Vec<OutboxDeadRow>, StoreError>;

    /// Makes dead rows publishable again with a fresh attempt budget (`None`: all of them).
    /// Returns how many.
    async fn outbox_retry(&self, ids: Option<&[i64]>) -> Result<u64, StoreError>;

    /// Deletes dead or failing rows (a failing row has failed publishes; transient failures are
    /// retried for ever) without publishing them, releasing their keys. Returns how many.
    async fn outbox_skip(&self, ids: &[i64]) -> Result<u64, StoreError>;

    /// Deletes up to `limit` published rows older than `older_than`. Returns how many.
    async fn outbox_cleanup(&self, older_than: Duration, limit: u32) -> Result<u64, StoreError>;

    /// Tells relays in other processes that rows committed (PostgreSQL: `NOTIFY`, sent outside
    /// any user transaction). Stores without such a signal do nothing; relays there poll.
    async fn signal_relays(&self) -> Result<(), StoreError> {
        Ok(())
    }

    /// The signals of [`signal_relays`](Self::signal_relays) from any process, where the store
    /// has them. `None`: poll.
    async fn relay_signals(&self) -> Result<Option<BoxStream<'static, ()>>, StoreError> {
        Ok(None)
    }
}

/// A message [`OutboxTx::send`] staged, written when the transaction commits.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Staged {
    /// Where to publish.
    pub destination: String,
    /// The message id: the caller's, or the fresh UUIDv7 given to it.
    pub message_id: String,
    /// The message.
    pub message: OutgoingMessage,
}

/// The order in which `staged` is written: by destination and key (a stable sort: each key's
/// rows in the order they were staged).
pub(crate) fn staged_order(staged: &[Staged]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..staged.len()).collect();
    order.sort_by(|&a, &b| {
        let key = |i: usize| (&staged[i].destination, staged[i].message.key.as_deref());
        key(a).cmp(&key(b))
    });
    order
}

/// Writes `staged` in `tx`, each key's rows in the order they were staged; rows of different
/// keys sorted by key, so that two transactions sending to the same keys lock them in one order
/// and cannot deadlock. Returns what was written, in `staged`'s order.
pub(crate) async fn insert_staged<S: OutboxStore>(
    store: &S,
    tx: &mut S::Tx,
    staged: &[Staged],
) -> Result<Vec<(i64, bool)>, StoreError> {
    let mut written = vec![(0, false); staged.len()];
    for i in staged_order(staged) {
        let row = &staged[i];
        let key = codec::ordering_key(&row.message)?;
        written[i] = store
            .insert_outbox(tx, &row.destination, &row.message_id, &row.message, key)
            .await?;
    }
    Ok(written)
}

/// A transaction whose outgoing messages are written as it commits; from [`Outbox::begin`].
///
/// The cheaper way to send from a transaction the application owns: the rows are written just
/// before the `COMMIT`, so an ordering key is locked only for that moment (writers of a hot key
/// wait on each other less), and on PostgreSQL the write also proves the transaction live, which
/// [`Outbox::commit`] checks with a statement of its own (one round trip fewer). Run your own
/// statements through it (`&mut **tx` is the connection). What [`send`](Self::send) stages is
/// validated at once; whether a message was new (not sent before under its id) is known at the
/// commit. Dropped without [`commit`](Self::commit), it rolls back and writes nothing.
///
/// Staged messages are the transaction's last writes: a savepoint you roll back to yourself
/// does not take back what was staged after it, and a message written at once with
/// [`Outbox::send`] into the same transaction gets an earlier row id (so, on the same key, an
/// earlier publish) than one staged before it — use one way per transaction. On SQLite a write
/// transaction holds the database's lock from its start whichever way it sends.
pub struct OutboxTx<S: OutboxStore> {
    outbox: Outbox<S>,
    tx: S::Tx,
    staged: Vec<Staged>,
}

impl<S: OutboxStore> std::fmt::Debug for OutboxTx<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OutboxTx")
            .field("staged", &self.staged.len())
            .finish_non_exhaustive()
    }
}

impl<S: OutboxStore> std::ops::Deref for OutboxTx<S> {
    type Target = S::Tx;

    fn deref(&self) -> &S::Tx {
        &self.tx
    }
}

impl<S: OutboxStore> std::ops::DerefMut for OutboxTx<S> {
    fn deref_mut(&mut self) -> &mut S::Tx {
        &mut self.tx
    }
}

impl<S: OutboxStore> OutboxTx<S> {
    /// Stages `message` to `destination`, to be written when the transaction commits; returns
    /// its message id (the caller's, or a fresh UUIDv7). The same rules as [`Outbox::send`]:
    /// `(destination, message id)` is unique, `message.key` is the ordering key.
    pub fn send(
        &mut self,
        destination: &str,
        message: OutgoingMessage,
    ) -> Result<String, StoreError> {
        let message_id = checked(destination, &message)?;
        self.staged.push(Staged {
            destination: destination.to_owned(),
            message_id: message_id.clone(),
            message,
        });
        Ok(message_id)
    }

    /// Writes the staged messages and commits, then wakes the relays. Returns what each
    /// [`send`](Self::send) wrote, in order. On an error the transaction is rolled back, except
    /// when the error is the lost reply to the `COMMIT` itself (as with any commit). A conflict
    /// (a deadlock: two transactions sending to keys whose locks collide, or writing the same
    /// message id at once) is transient: run the transaction again.
    pub async fn commit(self) -> Result<Vec<Sent>, StoreError> {
        let OutboxTx { outbox, tx, staged } = self;
        let written = outbox.store.commit_outbox(tx, &staged).await?;
        if !staged.is_empty() {
            outbox.wake();
        }
        Ok(staged
            .into_iter()
            .zip(written)
            .map(|(row, (row_id, written))| Sent {
                row_id,
                message_id: row.message_id,
                written,
            })
            .collect())
    }

    /// Rolls back: nothing staged is written.
    pub async fn rollback(self) -> Result<(), StoreError> {
        self.outbox.store.rollback(self.tx).await
    }
}

/// The message id `message` is sent under, once `destination`, the id and the key are valid.
fn checked(destination: &str, message: &OutgoingMessage) -> Result<String, StoreError> {
    let message_id = match &message.message_id {
        Some(id) => crate::id::MessageId::new(id.as_str())
            .map_err(|e| StoreError::Invalid(e.to_string()))?
            .as_str()
            .to_owned(),
        None => uuid::Uuid::now_v7().to_string(),
    };
    codec::check_destination(destination)?;
    codec::ordering_key(message)?;
    Ok(message_id)
}

/// Writes outgoing messages in the caller's transaction and wakes the relays after commits.
///
/// Cloning gives another handle on the same outbox (one wake-up for all of them).
#[derive(Clone)]
pub struct Outbox<S> {
    store: S,
    shared: Arc<Shared>,
}

struct Shared {
    /// Relays of this process wait here.
    local: tokio::sync::Notify,
    /// Signals for relays of other processes, coalesced: a full channel is a signal on its way.
    remote: OnceLock<tokio::sync::mpsc::Sender<()>>,
    signal_other_processes: bool,
}

impl<S> std::fmt::Debug for Outbox<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Outbox").finish_non_exhaustive()
    }
}

impl<S: OutboxStore> Outbox<S> {
    /// An outbox on `store`, which signals relays in other processes after the commits it makes
    /// (see [`signal_other_processes`](Self::signal_other_processes)).
    pub fn new(store: S) -> Self {
        Self::with_signals(store, true)
    }

    /// Whether commits made through this outbox also wake relays in other processes (PostgreSQL:
    /// one `NOTIFY` per burst of commits, sent on a pooled connection after the commit, never
    /// inside it). Off: only this process's relays wake at once; others find the rows when they
    /// poll.
    pub fn signal_other_processes(self, yes: bool) -> Self {
        Self::with_signals(self.store, yes)
    }

    fn with_signals(store: S, yes: bool) -> Self {
        Self {
            store,
            shared: Arc::new(Shared {
                local: tokio::sync::Notify::new(),
                remote: OnceLock::new(),
                signal_other_processes: yes,
            }),
        }
    }

    /// The store.
    pub fn store(&self) -> &S {
        &self.store
    }

    /// Begins a transaction whose messages are written as it commits: see [`OutboxTx`].
    pub async fn begin(&self) -> Result<OutboxTx<S>, StoreError> {
        Ok(OutboxTx {
            outbox: self.clone(),
            tx: self.store.begin().await?,
            staged: Vec::new(),
        })
    }

    /// Writes `message` to `destination` in `tx`, to be published once `tx` commits.
    ///
    /// The message id is `message.message_id`, or a fresh UUIDv7. `(destination, message id)` is
    /// unique: sending the same message again — in the same transaction, or in a retry of the
    /// caller's — writes nothing and returns [`Sent::written`] false. `message.key` is the
    /// ordering key (UTF-8, at most 255 bytes): rows of one key are published in the order they
    /// were written. A `traceparent` header, if the caller set one, is kept in its own column
    /// too, so the trace continues at the consumer. (The outbox does not read an OpenTelemetry
    /// context itself: set the header from your tracing layer's current span.)
    ///
    /// Writers of one key take a lock on it until they commit (that is what keeps the order when
    /// transactions commit out of order), so a hot key serialises its writers, and transactions
    /// that send to several keys should send to them in one order to avoid deadlocks.
    pub async fn send(
        &self,
        tx: &mut S::Tx,
        destination: &str,
        message: OutgoingMessage,
    ) -> Result<Sent, StoreError> {
        let message_id = checked(destination, &message)?;
        let key = codec::ordering_key(&message)?;
        let (row_id, written) = self
            .store
            .insert_outbox(tx, destination, &message_id, &message, key)
            .await?;
        Ok(Sent {
            row_id,
            message_id,
            written,
        })
    }

    /// Commits `tx` and wakes the relays.
    pub async fn commit(&self, tx: S::Tx) -> Result<(), StoreError> {
        self.store.commit(tx).await?;
        self.wake();
        Ok(())
    }

    /// Wakes the relays: call it after committing a transaction that sent messages, where the
    /// commit was not made by [`commit`](Self::commit) or by a consumer given
    /// [`after_commit`](Self::after_commit). Cheap, and coalesced.
    pub fn wake(&self) {
        self.wake_local();
        if self.shared.signal_other_processes {
            let sender = self.shared.remote.get_or_init(|| self.spawn_signaller());
            // Full: a signal is already on its way, and it will cover this commit too.
            let _ = sender.try_send(());
        }
    }

    /// A hook for [`Consumer::after_commit`](crate::Consumer::after_commit), so that messages a
    /// handler sends through its inbox transaction (consume, transform, produce) are published
    /// as soon as the consumer commits.
    pub fn after_commit(&self) -> AfterCommit {
        let outbox = self.clone();
        Arc::new(move |_| {
            outbox.wake();
            Box::pin(async {})
        })
    }

    /// A relay publishing this outbox's rows through `transport`.
    pub fn relay(&self, transport: Arc<dyn Transport>) -> Relay<S> {
        Relay::new(self.clone(), transport)
    }

    /// Wakes this process's relays only (no signal to other processes).
    pub(crate) fn wake_local(&self) {
        self.shared.local.notify_waiters();
        self.shared.local.notify_one();
    }

    pub(crate) async fn woken(&self) {
        self.shared.local.notified().await;
    }

    fn spawn_signaller(&self) -> tokio::sync::mpsc::Sender<()> {
        let (sender, mut signals) = tokio::sync::mpsc::channel::<()>(1);
        let store = self.store.clone();
        // Ends when every handle on this outbox is gone (the channel closes).
        tokio::spawn(async move {
            while signals.recv().await.is_some() {
                if let Err(e) = store.signal_relays().await {
                    tracing::debug!(error = %e, "could not signal other relays; they will poll");
                }
            }
        });
        sender
    }
}

#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
use codec::decode_headers;

/// A claimed row from the columns both stores return.
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
#[allow(clippy::too_many_arguments)]
fn row(
    id: i64,
    destination: String,
    message_id: String,
    ordering_key: Option<String>,
    payload: Vec<u8>,
    headers: &str,
    (attempts, no_routes): (i64, i64),
    age_seconds: f64,
) -> OutboxRow {
    OutboxRow {
        id,
        destination,
        message: OutgoingMessage {
            message_id: Some(message_id),
            payload: payload.into(),
            headers: decode_headers(headers),
            key: ordering_key.map(Into::into),
        },
        attempts: u32::try_from(attempts.max(0)).unwrap_or(u32::MAX),
        no_routes: u32::try_from(no_routes.max(0)).unwrap_or(u32::MAX),
        age: Duration::from_secs_f64(age_seconds.max(0.0)),
    }
}

/// Stats from one row of the stats query: destination, pending, failing, dead, blocked keys,
/// published kept, age of the oldest pending.
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
fn stats(
    (destination, pending, failing, dead, blocked, kept, oldest): (
        String,
        i64,
        i64,
        i64,
        i64,
        i64,
        Option<f64>,
    ),
) -> OutboxStats {
    let count = |n: i64| u64::try_from(n).unwrap_or(0);
    OutboxStats {
        destination,
        pending: count(pending),
        failing: count(failing),
        dead: count(dead),
        blocked_keys: count(blocked),
        published_kept: count(kept),
        oldest_pending_seconds: oldest.map(|s| s.max(0.0)),
    }
}

/// `outbox_kept` on PostgreSQL and SQLite: by the partial index of published rows.
#[cfg(any(feature = "postgres", feature = "sqlite"))]
const KEPT: &str = "SELECT destination, count(*) FROM outbox_messages
WHERE published_at IS NOT NULL GROUP BY destination";

/// `outbox_kept`'s rows.
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
fn kept(rows: Vec<(String, i64)>) -> Vec<(String, u64)> {
    rows.into_iter()
        .map(|(destination, n)| (destination, u64::try_from(n).unwrap_or(0)))
        .collect()
}

#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
fn dead_row(
    id: i64,
    destination: String,
    message_id: String,
    ordering_key: Option<String>,
    attempts: i64,
    last_error: Option<String>,
    age_seconds: f64,
) -> OutboxDeadRow {
    OutboxDeadRow {
        id,
        destination,
        message_id,
        ordering_key,
        attempts: u32::try_from(attempts.max(0)).unwrap_or(u32::MAX),
        last_error,
        age_seconds: age_seconds.max(0.0),
    }
}
