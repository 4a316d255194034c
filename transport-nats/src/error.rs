//! What async-nats' errors mean for the engine: transient (the server is restarting, a request
//! timed out, the connection is gone) or permanent (the server refused the request itself).

use std::fmt;

use async_nats::jetstream::Error as ApiError;
use async_nats::jetstream::context::{
    ConsumerInfoErrorKind, CreateStreamErrorKind, GetStreamByNameErrorKind, GetStreamErrorKind,
    PublishError, PublishErrorKind, RequestErrorKind,
};
use async_nats::jetstream::stream::{
    ConsumerErrorKind, DeleteMessageErrorKind, LastRawMessageErrorKind,
};
use inbox_core::TransportError;

/// An error kind of async-nats that may carry the JetStream API's own answer.
pub(crate) trait Kind:
    Clone + fmt::Debug + fmt::Display + PartialEq + Send + Sync + 'static
{
    /// The API's answer, when the server gave one.
    fn answer(&self) -> Option<&ApiError> {
        None
    }
    /// A mistake in the request itself (a name or subject the client refused to send).
    fn invalid(&self) -> bool {
        false
    }
}

/// `Kind` for an error kind: `answer` from its `JetStream(_)` variant where it has one, `invalid`
/// for the variants listed.
macro_rules! kind {
    ($kind:ty, answer, invalid: $($invalid:ident)|*) => {
        impl Kind for $kind {
            fn answer(&self) -> Option<&ApiError> {
                match self {
                    Self::JetStream(e) => Some(e),
                    _ => None,
                }
            }
            fn invalid(&self) -> bool {
                matches!(self, $(Self::$invalid)|*)
            }
        }
    };
    ($kind:ty, invalid: $($invalid:ident)|*) => {
        impl Kind for $kind {
            fn invalid(&self) -> bool {
                matches!(self, $(Self::$invalid)|*)
            }
        }
    };
}

kind!(CreateStreamErrorKind, answer, invalid: EmptyStreamName | InvalidStreamName | DomainAndExternalSet);
kind!(GetStreamErrorKind, answer, invalid: EmptyName | InvalidStreamName);
kind!(GetStreamByNameErrorKind, answer, invalid: InvalidSubject);
kind!(ConsumerErrorKind, answer, invalid: InvalidConsumerType | InvalidName);
kind!(LastRawMessageErrorKind, answer, invalid: InvalidSubject);
kind!(ConsumerInfoErrorKind, answer, invalid: InvalidName);
kind!(RequestErrorKind, invalid: InvalidSubject);

impl Kind for DeleteMessageErrorKind {
    fn answer(&self) -> Option<&ApiError> {
        match self {
            Self::JetStream(e) => Some(e),
            _ => None,
        }
    }
}

impl Kind for async_nats::jetstream::consumer::StreamErrorKind {}

/// A JetStream API call's error. The server's own answer decides: 5xx (no leader yet, JetStream
/// starting, resources short) passes, anything else it says is a refusal. No answer at all (a
/// timeout, no responders while the server restarts, a lost connection) is transient.
pub(crate) fn api<K: Kind>(error: async_nats::error::Error<K>) -> TransportError {
    let kind = error.kind();
    let permanent = kind.invalid() || kind.answer().is_some_and(|answer| answer.code() < 500);
    if permanent {
        TransportError::Refused(Box::new(error))
    } else {
        TransportError::Disconnected(Box::new(error))
    }
}

/// A publish's error: no stream for the subject is a missing route; too large a message a
/// refusal; no ack (a timeout, a lost connection) unconfirmed.
pub(crate) fn publish_error(error: PublishError) -> TransportError {
    match error.kind() {
        PublishErrorKind::StreamNotFound => TransportError::NoRoute(Box::new(error)),
        PublishErrorKind::MaxPayloadExceeded => TransportError::Refused(Box::new(error)),
        _ => TransportError::NotConfirmed(Box::new(error)),
    }
}
