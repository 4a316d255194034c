//! What the client's errors mean: how rdkafka errors map to [`TransportError`]s.

use inbox_core::TransportError;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};

pub(crate) fn transient(error: KafkaError) -> TransportError {
    TransportError::Disconnected(Box::new(error))
}

pub(crate) fn publish_error(error: KafkaError) -> TransportError {
    match error.rdkafka_error_code() {
        // The topic may be created yet (by the consumers' declare, or an operator).
        Some(RDKafkaErrorCode::UnknownTopicOrPartition | RDKafkaErrorCode::UnknownTopic) => {
            TransportError::NoRoute(Box::new(error))
        }
        Some(
            RDKafkaErrorCode::TopicAuthorizationFailed
            | RDKafkaErrorCode::MessageSizeTooLarge
            | RDKafkaErrorCode::InvalidMessage,
        ) => TransportError::Refused(Box::new(error)),
        _ => TransportError::NotConfirmed(Box::new(error)),
    }
}

/// What a consumer error means for the subscription.
pub(crate) enum ClientError {
    /// Logged; the client recovers by itself (reconnects, rejoins the group).
    Recovers(KafkaError),
    /// Ends the stream with this error: transient (a fresh consumer may work) or permanent.
    Ends(TransportError),
}

pub(crate) fn consumer_error(error: KafkaError) -> ClientError {
    match error.rdkafka_error_code() {
        Some(
            RDKafkaErrorCode::GroupAuthorizationFailed
            | RDKafkaErrorCode::TopicAuthorizationFailed
            | RDKafkaErrorCode::ClusterAuthorizationFailed
            | RDKafkaErrorCode::SaslAuthenticationFailed,
        ) => ClientError::Ends(TransportError::Refused(Box::new(error))),
        _ if matches!(error, KafkaError::MessageConsumptionFatal(_))
            || error.rdkafka_error_code() == Some(RDKafkaErrorCode::Fatal) =>
        {
            ClientError::Ends(transient(error))
        }
        _ => ClientError::Recovers(error),
    }
}
