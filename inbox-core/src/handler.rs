//! The user's code: a handler that writes its effects through the inbox transaction.

use std::sync::Arc;

use async_trait::async_trait;

use crate::error::HandlerError;
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
}

#[async_trait]
impl<Tx: Send + 'static, H: Handler<Tx> + ?Sized> Handler<Tx> for Arc<H> {
    async fn handle(&self, message: &Message<'_>, tx: &mut Tx) -> Result<(), HandlerError> {
        (**self).handle(message, tx).await
    }
}
