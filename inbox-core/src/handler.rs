//! The user's code: a handler that writes its effects through the inbox transaction.

use std::sync::Arc;

use async_trait::async_trait;

use crate::error::{BatchError, HandlerError};
use crate::message::Message;

/// Handles one message, writing its effects through `tx` — the same transaction that recorded
/// the message in the inbox. Commit and ack are the consumer's job: a handler cannot do either.
///
/// Side effects that do not go through `tx` (an HTTP call, an email) are not covered by the
/// exactly-once promise; put them behind an outbox written through `tx`.
///
/// ```
/// use inbox_core::{Handler, HandlerError, Message, SqliteTx};
///
/// struct CountParcels;
///
/// #[async_trait::async_trait]
/// impl Handler<SqliteTx> for CountParcels {
///     async fn handle(&self, message: &Message<'_>, tx: &mut SqliteTx) -> Result<(), HandlerError> {
///         sqlx::query("INSERT INTO parcels_seen (message_id) VALUES ($1)")
///             .bind(message.id.as_str())
///             .execute(&mut **tx)
///             .await?;
///         Ok(())
///     }
/// }
/// ```
#[async_trait]
pub trait Handler<Tx: Send + 'static>: Send + Sync + 'static {
    /// Handles `message`. `Ok` commits, a transient error retries, a permanent one dead-letters.
    async fn handle(&self, message: &Message<'_>, tx: &mut Tx) -> Result<(), HandlerError>;

    /// The whole-batch form of this handler, for batch mode
    /// ([`Consumer::batch`](crate::Consumer::batch)): `None` (the default) runs
    /// [`handle`](Self::handle) once per message, each in a savepoint of the batch's
    /// transaction. [`Batched`] returns its [`BatchHandler`].
    fn as_batch_handler(&self) -> Option<&dyn BatchHandler<Tx>> {
        None
    }
}

#[async_trait]
impl<Tx: Send + 'static, H: Handler<Tx> + ?Sized> Handler<Tx> for Arc<H> {
    async fn handle(&self, message: &Message<'_>, tx: &mut Tx) -> Result<(), HandlerError> {
        (**self).handle(message, tx).await
    }

    fn as_batch_handler(&self) -> Option<&dyn BatchHandler<Tx>> {
        (**self).as_batch_handler()
    }
}

/// Handles a whole batch of messages in one call, writing their effects through `tx` — e.g. all
/// their rows in one statement (`INSERT … SELECT * FROM unnest(…)`). Give it to a consumer
/// wrapped in [`Batched`], with [`Consumer::batch`](crate::Consumer::batch) on.
///
/// No savepoints: the batch commits or rolls back whole. When it fails, see [`BatchError`] for
/// how the consumer isolates the failing message; a message handled again after its batch-mate
/// failed sees its effects rolled back first. Outside batch mode, and for the messages that go
/// the per-message way (redeliveries, copies, retries), the batch has one message.
///
/// ```
/// use inbox_core::{BatchError, BatchHandler, Message, PgTx};
///
/// struct CountParcels;
///
/// #[async_trait::async_trait]
/// impl BatchHandler<PgTx> for CountParcels {
///     async fn handle_batch(&self, messages: &[Message<'_>], tx: &mut PgTx) -> Result<(), BatchError> {
///         let ids: Vec<&str> = messages.iter().map(|m| m.id.as_str()).collect();
///         sqlx::query("INSERT INTO parcels_seen (message_id) SELECT * FROM unnest($1::text[])")
///             .bind(&ids)
///             .execute(&mut **tx)
///             .await?;
///         Ok(())
///     }
/// }
/// ```
#[async_trait]
pub trait BatchHandler<Tx: Send + 'static>: Send + Sync + 'static {
    /// Handles `messages` (in delivery order). `Ok` commits them all.
    async fn handle_batch(&self, messages: &[Message<'_>], tx: &mut Tx) -> Result<(), BatchError>;
}

#[async_trait]
impl<Tx: Send + 'static, B: BatchHandler<Tx> + ?Sized> BatchHandler<Tx> for Arc<B> {
    async fn handle_batch(&self, messages: &[Message<'_>], tx: &mut Tx) -> Result<(), BatchError> {
        (**self).handle_batch(messages, tx).await
    }
}

/// A [`BatchHandler`] as a consumer's handler: whole batches in batch mode, batches of one
/// message otherwise.
#[derive(Debug, Clone)]
pub struct Batched<B>(pub B);

#[async_trait]
impl<Tx: Send + 'static, B: BatchHandler<Tx>> Handler<Tx> for Batched<B> {
    async fn handle(&self, message: &Message<'_>, tx: &mut Tx) -> Result<(), HandlerError> {
        self.0
            .handle_batch(std::slice::from_ref(message), tx)
            .await
            .map_err(BatchError::into_handler_error)
    }

    fn as_batch_handler(&self) -> Option<&dyn BatchHandler<Tx>> {
        Some(&self.0)
    }
}
