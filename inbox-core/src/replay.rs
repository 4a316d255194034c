//! The operator's replay of dead-lettered messages.
//!
//! Dedup alone never hands a dead-lettered message to the handler again: its row is marked dead.
//! A replay is the explicit act that does: for each chosen message it reads the dead letter back
//! from the dead-letter destination, clears the dead mark (with a fresh attempt budget) in a
//! transaction, publishes the original message — payload, id and headers, without the
//! `x-inbox-*` ones — to the source named in the dead letter, commits, and only then removes the
//! dead letter (where the broker can remove single messages).
//!
//! A copy consumed while the transaction is open waits on the row lock and then finds the message
//! free to handle. If the publish fails, the transaction rolls back: the message stays dead and
//! its dead letter stays where it was. The source fans out to every consumer of it: the copy
//! carries [`REPLAY_FOR`](crate::dead_letter_headers::REPLAY_FOR), so the others discard it
//! unhandled — even when cleanup has removed their own record of the message.

use std::collections::BTreeSet;

use futures::StreamExt;

use crate::consumer::dead_letter_headers as h;
use crate::error::{ErrorKind, StoreError, TransportError};
use crate::id::{ConsumerName, MessageId};
use crate::message::{Headers, OutgoingMessage};
use crate::store::InboxAdmin;
use crate::transport::{AckToken, Delivery, Transport};

/// Which dead-lettered messages to replay.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Replay {
    /// These message ids.
    Ids(Vec<MessageId>),
    /// Every message the consumer has dead-lettered.
    All,
}

/// Why a replay stopped. What was replayed before stays replayed; running it again goes on.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ReplayError {
    /// The inbox store failed.
    #[error("inbox store: {0}")]
    Store(#[from] StoreError),
    /// The broker failed (reading the dead letters, or publishing to the source).
    #[error("broker: {0}")]
    Transport(#[from] TransportError),
    /// A dead letter of this consumer carries an id that is not valid (permanent).
    #[error("dead letter with an invalid message id: {0}")]
    InvalidLetter(String),
}

impl ReplayError {
    /// Whether running the replay again may succeed.
    pub fn kind(&self) -> ErrorKind {
        match self {
            ReplayError::Store(e) => e.kind(),
            ReplayError::Transport(e) => e.kind(),
            ReplayError::InvalidLetter(_) => ErrorKind::Permanent,
        }
    }
}

/// What a replay did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ReplayReport {
    /// Published to their source again, dead mark cleared.
    pub replayed: Vec<String>,
    /// Dead in the inbox table, but no dead letter of this consumer with that id was found in
    /// the destination.
    pub missing: Vec<String>,
    /// Asked for, but not dead-lettered (processed, unknown, or replayed already).
    pub not_dead: Vec<String>,
    /// Dead letters read from the destination (of every consumer).
    pub read: u64,
}

/// Replays dead-lettered messages of `consumer` from `dead_letter_destination` (the consumer's
/// dead-letter destination, by default `"<source>.dead-letter"`). See the [module](self) docs.
///
pub async fn replay_dead_letters<S: InboxAdmin>(
    transport: &dyn Transport,
    store: &S,
    consumer: &ConsumerName,
    dead_letter_destination: &str,
    which: Replay,
) -> Result<ReplayReport, ReplayError> {
    let mut report = ReplayReport::default();
    let dead: BTreeSet<String> = store
        .dead_letters(Some(consumer), u32::MAX)
        .await?
        .into_iter()
        .map(|d| d.message_id)
        .collect();
    let mut wanted: BTreeSet<String> = match which {
        Replay::All => dead,
        Replay::Ids(ids) => {
            let mut wanted = BTreeSet::new();
            for id in ids {
                if dead.contains(id.as_str()) {
                    wanted.insert(id.as_str().to_owned());
                } else {
                    report.not_dead.push(id.as_str().to_owned());
                }
            }
            wanted
        }
    };
    if wanted.is_empty() {
        return Ok(report);
    }
    let mut letters = transport.read_dead_letters(dead_letter_destination).await?;
    // Letters that are not ours to replay go back when we are done, not at once: handed back
    // now, a queue would deliver them to us again before the rest.
    let mut others: Vec<Box<dyn Delivery>> = Vec::new();
    let result = async {
        while let Some(letter) = letters.next().await {
            let letter = letter?;
            report.read += 1;
            let headers = letter.headers();
            let id = headers.get_str(h::MESSAGE_ID).map(str::to_owned);
            let ours = headers.get_str(h::CONSUMER) == Some(consumer.as_str());
            let source = headers.get_str(h::SOURCE).map(str::to_owned);
            let (Some(id), Some(source), true) = (id, source, ours) else {
                others.push(letter);
                continue;
            };
            if !wanted.contains(&id) {
                if report.replayed.contains(&id) {
                    // Another copy of a letter replayed just now (a dead letter is published
                    // again when marking it dead failed): it is served.
                    let _ = letter.ack(AckToken::new()).await;
                } else {
                    others.push(letter);
                }
                continue;
            }
            let message_id = MessageId::new(id.clone())
                .map_err(|e| ReplayError::InvalidLetter(format!("{id:?}: {e}")))?;
            let mut tx = store.begin().await?;
            if !store.revive_in(&mut tx, consumer, &message_id).await? {
                // Replayed by someone else since we looked.
                let _ = store.rollback(tx).await;
                wanted.remove(&id);
                report.not_dead.push(id);
                others.push(letter);
                continue;
            }
            let mut headers = original_headers(letter.headers());
            headers.insert(h::REPLAY_FOR, consumer.as_str().to_owned());
            let original = OutgoingMessage {
                message_id: Some(id.clone()),
                payload: bytes::Bytes::copy_from_slice(letter.payload()),
                headers,
                key: None,
            };
            if let Err(e) = transport.publish(&source, original).await {
                let _ = store.rollback(tx).await;
                return Err(ReplayError::Transport(e));
            }
            store.commit(tx).await?;
            tracing::info!(consumer = %consumer, message_id = %id, source, "dead letter replayed");
            if let Err(e) = letter.ack(AckToken::new()).await {
                tracing::warn!(error = %e, message_id = %id, "replayed, but the dead letter could not be removed");
            }
            wanted.remove(&id);
            report.replayed.push(id);
            if wanted.is_empty() {
                break;
            }
        }
        Ok(())
    }
    .await;
    // Stop consuming first, so that what is handed back is not pushed to us again.
    drop(letters);
    for letter in others {
        let _ = letter.nack(true).await;
    }
    result?;
    report.missing = wanted.into_iter().collect();
    Ok(report)
}

/// The headers a dead letter carried, without the ones the dead-lettering added.
fn original_headers(headers: &Headers) -> Headers {
    headers
        .iter()
        .filter(|(name, _)| !name.starts_with("x-inbox-"))
        .map(|(name, value)| (name.to_owned(), bytes::Bytes::copy_from_slice(value)))
        .collect()
}
