//! What tests inspect on a transport: counts the engine never needs. Import the trait to call
//! them; they are kept off the transport's own API.

use std::sync::atomic::Ordering;

use inbox_core::TransportError;
use lapin::options::QueueDeclareOptions;
use lapin::types::FieldTable;

use crate::connection::{broker_error, short};
use crate::{RabbitMqTransport, queue_name};

/// Inspection of a [`RabbitMqTransport`] for tests.
#[async_trait::async_trait]
pub trait Inspect {
    /// Connections opened so far (more than one means it reconnected).
    fn connections_opened(&self) -> usize;
    /// Deliveries handed out by this transport and not yet acked or nacked.
    fn unsettled(&self) -> usize;
    /// Messages ready in a consumer's queue (not counting unacknowledged ones).
    async fn ready(&self, source: &str, consumer: &str) -> Result<u32, TransportError>;
}

#[async_trait::async_trait]
impl Inspect for RabbitMqTransport {
    fn connections_opened(&self) -> usize {
        self.connections.load(Ordering::SeqCst)
    }

    fn unsettled(&self) -> usize {
        self.unsettled.load(Ordering::SeqCst)
    }

    async fn ready(&self, source: &str, consumer: &str) -> Result<u32, TransportError> {
        let connection = self.connection().await?;
        let channel = self.open_channel(&connection).await?;
        let queue = channel
            .queue_declare(
                short(&queue_name(source, consumer))?,
                QueueDeclareOptions {
                    passive: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .map_err(broker_error)?;
        let _ = channel.close(200, "inspected".into()).await;
        Ok(queue.message_count())
    }
}
