//! What tests inspect on a transport: counts the engine never needs. Import the trait to call
//! them; they are kept off the transport's own API.

use std::sync::atomic::Ordering;

use futures::TryStreamExt;
use inbox_core::{OutgoingMessage, TransportError};

use crate::error::api;
use crate::transport::StreamKind;
use crate::{NatsTransport, durable_name};

/// Inspection of a [`NatsTransport`] for tests.
#[async_trait::async_trait]
pub trait Inspect {
    /// Connections made so far (more than one means it reconnected).
    fn connections_opened(&self) -> usize;
    /// Deliveries handed out by this transport and not yet acked or nacked.
    fn unsettled(&self) -> usize;
    /// Messages of `source` a consumer has not acked yet: not yet delivered, and delivered but
    /// unacknowledged (by any instance).
    async fn pending(&self, source: &str, consumer: &str) -> Result<u64, TransportError>;
    /// Everything `destination`'s stream holds, left there.
    async fn messages(&self, destination: &str) -> Result<Vec<OutgoingMessage>, TransportError>;
}

#[async_trait::async_trait]
impl Inspect for NatsTransport {
    fn connections_opened(&self) -> usize {
        self.connections.load(Ordering::SeqCst)
    }

    fn unsettled(&self) -> usize {
        self.unsettled.load(Ordering::SeqCst)
    }

    async fn pending(&self, source: &str, consumer: &str) -> Result<u64, TransportError> {
        let stream = self.stream_for(source, StreamKind::Source).await?;
        let info = stream
            .consumer_info(durable_name(source, consumer)?)
            .await
            .map_err(api)?;
        Ok(info.num_pending + info.num_ack_pending as u64)
    }

    async fn messages(&self, destination: &str) -> Result<Vec<OutgoingMessage>, TransportError> {
        let letters: Vec<_> = self.read_stream(destination).await?.try_collect().await?;
        Ok(letters
            .into_iter()
            .map(|letter| OutgoingMessage {
                message_id: letter.id,
                payload: letter.payload,
                headers: letter.headers,
                key: None,
            })
            .collect())
    }
}
