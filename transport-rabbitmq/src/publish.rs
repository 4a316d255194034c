//! Publishing a message, with publisher confirms and the `mandatory` flag.

use inbox_core::{DEFAULT_ID_HEADER, OutgoingMessage, TransportError};
use lapin::options::BasicPublishOptions;
use lapin::types::{AMQPValue, ShortString};
use lapin::{BasicProperties, Confirmation};

use crate::RabbitMqTransport;
use crate::connection::{broker_error, short};
use crate::headers::to_field_table;

impl RabbitMqTransport {
    pub(crate) async fn publish_once(
        &self,
        destination: &str,
        message: &OutgoingMessage,
    ) -> Result<(), TransportError> {
        let channel = self.publisher().await?;
        let needs_declare = !self.link.lock().await.declared.contains(destination);
        if needs_declare {
            self.declare_exchange(&channel, destination).await?;
            self.link
                .lock()
                .await
                .declared
                .insert(destination.to_owned());
        }
        let mut headers = to_field_table(&message.headers);
        let mut properties = BasicProperties::default().with_delivery_mode(2);
        if let Some(id) = &message.message_id {
            match ShortString::try_new(id.as_str()) {
                Ok(id) => properties = properties.with_message_id(id),
                Err(_) => {
                    headers.insert(
                        DEFAULT_ID_HEADER.into(),
                        AMQPValue::LongString(id.as_bytes().into()),
                    );
                }
            }
        }
        let properties = properties.with_headers(headers);
        let publish = async {
            channel
                .basic_publish(
                    short(destination)?,
                    "".into(),
                    BasicPublishOptions {
                        mandatory: true,
                        ..BasicPublishOptions::default()
                    },
                    &message.payload,
                    properties,
                )
                .await
                .map_err(broker_error)?
                .await
                .map_err(broker_error)
        };
        let timeout = self.config.publish_timeout;
        let confirm = tokio::time::timeout(timeout, publish)
            .await
            .map_err(|_| {
                TransportError::NotConfirmed(
                    format!("no confirm for the publish to {destination:?} within {timeout:?} (a broker resource alarm blocks publishers)").into(),
                )
            })??;
        match confirm {
            Confirmation::Ack(None) => Ok(()),
            Confirmation::Ack(Some(_returned)) => Err(TransportError::NoRoute(
                format!("no queue is bound to exchange {destination:?}: declare the consumer's queue before publishing").into(),
            )),
            Confirmation::Nack(_) => Err(TransportError::NotConfirmed(
                format!("the broker nacked the publish to {destination:?}").into(),
            )),
            Confirmation::NotRequested => Err(TransportError::NotConfirmed("publisher confirms are off".into())),
        }
    }
}
