//! Errors. Every error says whether retrying can help ([`ErrorKind`]).

use std::fmt;

/// A boxed error from a driver or a user's code.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Whether an operation that failed may succeed when tried again.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// Retrying can help: a lost connection, a lock conflict, a broker that is restarting.
    Transient,
    /// Retrying cannot help: bad input, a missing table, a broken configuration.
    Permanent,
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ErrorKind::Transient => "transient",
            ErrorKind::Permanent => "permanent",
        })
    }
}

/// An error from an [`InboxStore`](crate::InboxStore).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The database could not be reached, or the connection broke (transient).
    #[error("database unavailable: {0}")]
    Unavailable(#[source] BoxError),
    /// A serialization failure, a deadlock or a busy database (transient).
    #[error("transaction conflict: {0}")]
    Conflict(#[source] BoxError),
    /// The database refused the statement for a reason retrying will not fix (permanent).
    #[error("database error: {0}")]
    Database(#[source] BoxError),
    /// The transaction was aborted by an earlier statement that failed — typically one the
    /// handler ran and whose error it swallowed — so it can only roll back (transient: the
    /// message is retried). On PostgreSQL a `COMMIT` of such a transaction reports success and
    /// rolls back; the store detects it before committing and returns this instead.
    #[error("transaction aborted by an earlier failed statement; nothing was committed: {0}")]
    Aborted(#[source] BoxError),
    /// The inbox schema could not be brought up to date (permanent).
    #[error("migration failed: {0}")]
    Migration(String),
    /// The caller's input cannot be stored (permanent): an outbox message with an empty or
    /// over-long id, destination or ordering key.
    #[error("invalid input: {0}")]
    Invalid(String),
    /// The store does not implement what was asked (permanent): a store of another crate without
    /// offsets mode, say.
    #[error("not supported by this store: {0}")]
    Unsupported(&'static str),
}

impl StoreError {
    /// Whether the operation may succeed when tried again.
    pub fn kind(&self) -> ErrorKind {
        match self {
            StoreError::Unavailable(_) | StoreError::Conflict(_) | StoreError::Aborted(_) => {
                ErrorKind::Transient
            }
            StoreError::Database(_)
            | StoreError::Migration(_)
            | StoreError::Invalid(_)
            | StoreError::Unsupported(_) => ErrorKind::Permanent,
        }
    }

    /// Shorthand for `kind() == ErrorKind::Transient`.
    pub fn is_transient(&self) -> bool {
        self.kind() == ErrorKind::Transient
    }
}

/// An error from a [`Transport`](crate::Transport) or a [`Delivery`](crate::Delivery).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TransportError {
    /// The connection or channel to the broker is gone (transient; the consumer resubscribes).
    #[error("broker connection lost: {0}")]
    Disconnected(#[source] BoxError),
    /// The broker has nowhere to put the message yet (transient): no queue bound to the RabbitMQ
    /// exchange, no such Kafka topic. It may appear once the consumers declare their queues,
    /// which is why the outbox relay retries it, within a limit of its own.
    #[error("no route for the message: {0}")]
    NoRoute(#[source] BoxError),
    /// A publish was not confirmed by the broker (transient).
    #[error("publish not confirmed: {0}")]
    NotConfirmed(#[source] BoxError),
    /// An acknowledgement did not reach the broker; it will redeliver and the inbox will discard
    /// the copy (transient).
    #[error("acknowledgement lost: {0}")]
    AckLost(#[source] BoxError),
    /// The broker refused the operation for a reason retrying will not fix (permanent).
    #[error("broker refused: {0}")]
    Refused(#[source] BoxError),
    /// The transport is configured wrongly (permanent).
    #[error("invalid transport configuration: {0}")]
    Config(String),
    /// This transport cannot do what was asked (permanent).
    #[error("not supported by this transport: {0}")]
    Unsupported(&'static str),
}

impl TransportError {
    /// Whether the operation may succeed when tried again.
    pub fn kind(&self) -> ErrorKind {
        match self {
            TransportError::Disconnected(_)
            | TransportError::NoRoute(_)
            | TransportError::NotConfirmed(_)
            | TransportError::AckLost(_) => ErrorKind::Transient,
            TransportError::Refused(_)
            | TransportError::Config(_)
            | TransportError::Unsupported(_) => ErrorKind::Permanent,
        }
    }

    /// Shorthand for `kind() == ErrorKind::Transient`.
    pub fn is_transient(&self) -> bool {
        self.kind() == ErrorKind::Transient
    }
}

/// What a [`Handler`](crate::Handler) returns when it cannot handle a message.
///
/// A transient error rolls the transaction back and retries the message; a permanent one rolls it
/// back and dead-letters the message at once. `?` works on `sqlx::Error` (classified: lost
/// connections, serialization failures and deadlocks are transient, the rest permanent) and on
/// `serde_json::Error` (permanent: the payload will not decode any better next time).
#[derive(Debug, thiserror::Error)]
#[error("{kind} handler error: {source}")]
pub struct HandlerError {
    kind: ErrorKind,
    #[source]
    source: BoxError,
}

impl HandlerError {
    /// A failure that may go away: retry the message.
    pub fn transient(error: impl Into<BoxError>) -> Self {
        Self {
            kind: ErrorKind::Transient,
            source: error.into(),
        }
    }

    /// A failure that will not go away: dead-letter the message now.
    pub fn permanent(error: impl Into<BoxError>) -> Self {
        Self {
            kind: ErrorKind::Permanent,
            source: error.into(),
        }
    }

    /// Whether retrying the message can help.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// The underlying error.
    pub fn inner(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
        &*self.source
    }
}

impl From<serde_json::Error> for HandlerError {
    fn from(error: serde_json::Error) -> Self {
        HandlerError::permanent(error)
    }
}

/// A store error in a handler (an outbox send, say) keeps its kind: transient retries the
/// message, permanent dead-letters it.
impl From<StoreError> for HandlerError {
    fn from(error: StoreError) -> Self {
        Self {
            kind: error.kind(),
            source: Box::new(error),
        }
    }
}

#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
impl From<sqlx::Error> for HandlerError {
    fn from(error: sqlx::Error) -> Self {
        let kind = crate::store::classify(&error);
        Self {
            kind,
            source: Box::new(error),
        }
    }
}

/// What a [`BatchHandler`](crate::BatchHandler) returns when it cannot handle its batch: a
/// [`HandlerError`], and the message it is about when the handler knows.
///
/// The batch's transaction is rolled back either way. An error that names a message, or a
/// permanent one, is the batch's to isolate: the consumer runs the messages before and after
/// the named one (or the two halves) as batches of their own, down to single messages, and only
/// a message that fails on its own uses up an attempt or is dead-lettered. A transient error
/// that names none (a deadlock, a lost connection) retries the whole batch. `?` works on what
/// converts into a [`HandlerError`].
#[derive(Debug, thiserror::Error)]
#[error("{error}")]
pub struct BatchError {
    #[source]
    error: HandlerError,
    message: Option<crate::id::MessageId>,
}

impl BatchError {
    /// `error`, about the message `id` of the batch.
    pub fn message(id: &crate::id::MessageId, error: impl Into<HandlerError>) -> Self {
        Self {
            error: error.into(),
            message: Some(id.clone()),
        }
    }

    /// The message the error is about, if the handler named one.
    pub fn message_id(&self) -> Option<&crate::id::MessageId> {
        self.message.as_ref()
    }

    /// Whether retrying can help.
    pub fn kind(&self) -> ErrorKind {
        self.error.kind()
    }

    /// The handler error.
    pub fn into_handler_error(self) -> HandlerError {
        self.error
    }
}

impl<E> From<E> for BatchError
where
    HandlerError: From<E>,
{
    fn from(error: E) -> Self {
        Self {
            error: error.into(),
            message: None,
        }
    }
}

/// Classified as the stores classify their own errors: a lost connection or a server going away
/// is [`Unavailable`](StoreError::Unavailable), a deadlock or serialization failure a
/// [`Conflict`](StoreError::Conflict), anything else permanent. For an application's own
/// statements in a transaction it also hands to the outbox or the inbox.
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
impl From<sqlx::Error> for StoreError {
    fn from(error: sqlx::Error) -> Self {
        crate::store::store_error(error)
    }
}

/// Why [`Consumer::run`](crate::Consumer::run) stopped with an error instead of draining cleanly.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConsumerError {
    /// The transport failed in a way retrying will not fix (for example a missing queue).
    #[error("transport failed permanently: {0}")]
    Transport(#[source] TransportError),
    /// The store failed in a way retrying will not fix (for example the inbox table is missing:
    /// run the migrations).
    #[error("inbox store failed permanently: {0}")]
    Store(#[source] StoreError),
    /// In offsets mode, a task of the consumer panicked (a bug in this library, or an
    /// [`after_commit`](crate::Consumer::after_commit) hook that panics): the consumer stops
    /// rather than let a partition's later records move its kept offset past the records that
    /// task held. Restarted, it reads them again.
    #[error("a consumer task panicked: {0}")]
    Panicked(String),
}

impl ConsumerError {
    /// Always permanent: transient failures are retried inside the consumer.
    pub fn kind(&self) -> ErrorKind {
        ErrorKind::Permanent
    }
}

/// An invalid consumer name or message id.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct InvalidName(pub(crate) String);

impl InvalidName {
    /// Permanent: the same input is invalid every time.
    pub fn kind(&self) -> ErrorKind {
        ErrorKind::Permanent
    }
}

/// An error and its sources on one line, each cause once: what `last_error`, a dead letter's
/// reason and the `inbox` command line's error line say.
pub fn error_chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(e) = source {
        let next = e.to_string();
        if !text.contains(&next) {
            text.push_str(": ");
            text.push_str(&next);
        }
        source = e.source();
    }
    text
}

/// The URL without its password, for logs and errors (every transport and the CLI use it). Also for malformed ones: in
/// `amqp:user:pw@host` (no `//`) everything between the scheme and the last `@` may be secret.
pub fn redact_url(uri: &str) -> String {
    let Some(at) = uri.rfind('@') else {
        return uri.to_owned();
    };
    let start = match (uri.find("://"), uri.find(':')) {
        (Some(scheme), _) => scheme + 3,
        (None, Some(colon)) => colon + 1,
        (None, None) => 0,
    };
    if at < start {
        return uri.to_owned();
    }
    match uri[start..at].split_once(':') {
        Some((user, _)) => format!("{}{user}:***{}", &uri[..start], &uri[at..]),
        None if uri.find("://").is_some() => uri.to_owned(),
        None => format!("{}***{}", &uri[..start], &uri[at..]),
    }
}

/// Whether `error` or one of its sources says the database is unreachable (a
/// [`StoreError::Unavailable`], or a sqlx error the stores would report as one): a handler's
/// statement or a commit that failed because of an outage, which the consumer reports once per
/// interval, not once per message.
pub(crate) fn store_unavailable(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(error);
    while let Some(e) = next {
        if let Some(store) = e.downcast_ref::<StoreError>() {
            return matches!(store, StoreError::Unavailable(_));
        }
        #[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
        if let Some(sql) = e.downcast_ref::<sqlx::Error>() {
            return crate::store::category(sql) == crate::store::Category::Unavailable;
        }
        next = e.source();
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_outage_is_recognised_through_a_handler_error() {
        let io = || std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "connection closed");
        let down = HandlerError::from(StoreError::Unavailable(Box::new(io())));
        assert!(store_unavailable(down.inner()));
        let conflict = HandlerError::from(StoreError::Conflict(Box::new(io())));
        assert!(!store_unavailable(conflict.inner()));
        assert!(!store_unavailable(HandlerError::transient(io()).inner()));
        #[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
        {
            assert!(store_unavailable(
                HandlerError::from(sqlx::Error::Io(io())).inner()
            ));
            assert!(store_unavailable(
                HandlerError::from(sqlx::Error::PoolTimedOut).inner()
            ));
            let not_found = HandlerError::from(sqlx::Error::RowNotFound);
            assert!(!store_unavailable(not_found.inner()));
        }
    }
}

#[cfg(test)]
mod redact_tests {
    use super::redact_url as redact;

    #[test]
    fn passwords_are_redacted() {
        assert_eq!(
            redact("amqp://guest:secret@host:5672/%2f"),
            "amqp://guest:***@host:5672/%2f"
        );
        assert_eq!(redact("amqp://host:5672"), "amqp://host:5672");
        // Malformed (no `//`): what stands between the scheme and the last `@` is hidden.
        assert_eq!(
            redact("amqp:guest:s3cret@rabbit/%2f"),
            "amqp:guest:***@rabbit/%2f"
        );
        assert_eq!(redact("amqp:s3cret@rabbit"), "amqp:***@rabbit");
        assert_eq!(
            redact("amqp://gu:est:s3c@ret@host/%2f"),
            "amqp://gu:***@host/%2f"
        );
    }
}
