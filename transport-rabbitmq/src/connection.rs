//! Connections: opening them, the state that holds them, and what lapin's errors mean.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use inbox_core::TransportError;
use lapin::options::ConfirmSelectOptions;
use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
use lapin::types::ShortString;
use lapin::{Channel, Connection, ConnectionProperties};

use crate::RabbitMqTransport;
pub(crate) use inbox_core::redact_url as redact;

/// Connection state, replaced when a connection dies. Publishing has a connection of its own
/// (RabbitMQ blocks a publishing connection under a memory or disk alarm, and a connection that
/// a consumer's frame kills should not take the publisher with it), subscriptions share the other.
#[derive(Default)]
pub(crate) struct Link {
    connection: Option<Arc<Connection>>,
    publishing: Option<Arc<Connection>>,
    publisher: Option<Channel>,
    pub(crate) declared: HashSet<String>,
}

pub(crate) fn short(value: &str) -> Result<ShortString, TransportError> {
    ShortString::try_new(value).map_err(|e| TransportError::Config(format!("{value:?}: {e}")))
}

/// Maps a lapin error: refusals by the broker (missing or mismatched queues and exchanges,
/// access) are permanent; everything else is a connection problem.
pub(crate) fn broker_error(error: lapin::Error) -> TransportError {
    if let lapin::ErrorKind::ProtocolError(amqp) = error.kind()
        && let AMQPErrorKind::Soft(
            AMQPSoftError::ACCESSREFUSED
            | AMQPSoftError::NOTFOUND
            | AMQPSoftError::PRECONDITIONFAILED,
        ) = amqp.kind()
    {
        return TransportError::Refused(Box::new(error));
    }
    TransportError::Disconnected(Box::new(error))
}

/// How long the broker may take to open a channel before its connection is taken for dead. After
/// a frame lapin cannot parse (a non-UTF-8 `message_id`) its connection can still look connected
/// while no channel asked of it ever opens: without a limit the consumer's next subscribe, and
/// everything else on that connection, waited for ever.
const CHANNEL_OPEN: Duration = Duration::from_secs(10);

fn channel_not_opened() -> TransportError {
    TransportError::Disconnected(
        format!(
            "the broker did not open a channel within {} s; reconnecting",
            CHANNEL_OPEN.as_secs()
        )
        .into(),
    )
}

impl RabbitMqTransport {
    /// A new channel on `connection` (the consuming one), within [`CHANNEL_OPEN`]; past it the
    /// connection is dropped, so that the next call opens another.
    pub(crate) async fn open_channel(
        &self,
        connection: &Arc<Connection>,
    ) -> Result<Channel, TransportError> {
        match tokio::time::timeout(CHANNEL_OPEN, connection.create_channel()).await {
            Ok(channel) => channel.map_err(broker_error),
            Err(_) => {
                let mut link = self.link.lock().await;
                if link
                    .connection
                    .as_ref()
                    .is_some_and(|c| Arc::ptr_eq(c, connection))
                {
                    link.connection = None;
                }
                Err(channel_not_opened())
            }
        }
    }

    pub(crate) async fn connection(&self) -> Result<Arc<Connection>, TransportError> {
        let mut link = self.link.lock().await;
        if let Some(connection) = &link.connection
            && connection.status().connected()
        {
            return Ok(Arc::clone(connection));
        }
        link.connection = None;
        let connection = self.open("consume").await?;
        link.connection = Some(Arc::clone(&connection));
        Ok(connection)
    }

    /// Opens a connection. A URL that does not parse is a configuration error (permanent), said
    /// without the URL's text: lapin's message would quote it whole, password and all.
    async fn open(&self, role: &str) -> Result<Arc<Connection>, TransportError> {
        if let Err(e) = self.uri.parse::<lapin::uri::AMQPUri>() {
            let reason = if e.contains(&self.uri) {
                "invalid AMQP URL".to_owned()
            } else {
                e
            };
            return Err(TransportError::Config(format!(
                "{reason}: {} (expected amqp://user:password@host:port/vhost)",
                redact(&self.uri)
            )));
        }
        let properties = ConnectionProperties::default().with_connection_name(
            format!("{} ({role})", self.config.connection_name)
                .as_str()
                .into(),
        );
        let connection = Connection::connect(&self.uri, properties)
            .await
            .map_err(|e| {
                let text = e.to_string().replace(&self.uri, &redact(&self.uri));
                tracing::warn!(uri = %redact(&self.uri), error = %text, "cannot connect to RabbitMQ");
                TransportError::Disconnected(text.into())
            })?;
        self.connections.fetch_add(1, Ordering::SeqCst);
        tracing::info!(uri = %redact(&self.uri), role, "connected to RabbitMQ");
        Ok(Arc::new(connection))
    }

    /// The confirming publisher channel, on the publishing connection.
    pub(crate) async fn publisher(&self) -> Result<Channel, TransportError> {
        let mut link = self.link.lock().await;
        if let Some(channel) = &link.publisher
            && channel.status().connected()
        {
            return Ok(channel.clone());
        }
        let connection = match &link.publishing {
            Some(connection) if connection.status().connected() => Arc::clone(connection),
            _ => {
                link.publishing = None;
                let connection = self.open("publish").await?;
                link.publishing = Some(Arc::clone(&connection));
                connection
            }
        };
        let channel = match tokio::time::timeout(CHANNEL_OPEN, connection.create_channel()).await {
            Ok(channel) => channel.map_err(broker_error)?,
            Err(_) => {
                link.publishing = None;
                return Err(channel_not_opened());
            }
        };
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(broker_error)?;
        link.publisher = Some(channel.clone());
        link.declared.clear();
        Ok(channel)
    }
}
