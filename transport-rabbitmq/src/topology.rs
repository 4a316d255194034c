//! Declaring exchanges and queues: a source's exchange, a consumer's queue and quarantine queue,
//! a dead-letter destination.

use inbox_core::TransportError;
use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, ExchangeKind};

use crate::connection::{broker_error, short};
use crate::headers::amqp_to_bytes;
use crate::{QueueType, RabbitMqTransport, quarantine_name, queue_name};

/// The broker refused a declare because the queue exists with other arguments.
fn inequivalent(error: &lapin::Error) -> bool {
    matches!(error.kind(), lapin::ErrorKind::ProtocolError(amqp)
        if matches!(amqp.kind(), AMQPErrorKind::Soft(AMQPSoftError::PRECONDITIONFAILED))
            && amqp.get_message().as_str().contains("inequivalent arg"))
}

impl RabbitMqTransport {
    pub(crate) async fn declare_exchange(
        &self,
        channel: &Channel,
        name: &str,
    ) -> Result<(), TransportError> {
        channel
            .exchange_declare(
                short(name)?,
                ExchangeKind::Fanout,
                ExchangeDeclareOptions {
                    durable: true,
                    ..ExchangeDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .map_err(broker_error)
    }

    /// Declares `queue` with `arguments` and binds it to `exchange`, on channels of its own. A
    /// queue that exists with other arguments (declared by an older version, or with another
    /// queue type) is used as it is, with a warning that says how to bring it in line: a queue's
    /// arguments cannot change in place, but a policy can add what it lacks.
    async fn declare_queue(
        &self,
        queue: &str,
        exchange: &str,
        arguments: FieldTable,
    ) -> Result<(), TransportError> {
        let connection = self.connection().await?;
        let channel = self.open_channel(&connection).await?;
        let declared = channel
            .queue_declare(
                short(queue)?,
                QueueDeclareOptions {
                    durable: true,
                    ..QueueDeclareOptions::default()
                },
                arguments.clone(),
            )
            .await;
        let channel = match declared {
            Ok(_) => channel,
            Err(e) if inequivalent(&e) => {
                // The broker closed that channel; the queue is there.
                self.warn_inequivalent(queue, &arguments);
                self.open_channel(&connection).await?
            }
            Err(e) => return Err(broker_error(e)),
        };
        let bound = channel
            .queue_bind(
                short(queue)?,
                short(exchange)?,
                "".into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(broker_error);
        let _ = channel.close(200, "declared".into()).await;
        bound
    }

    fn warn_inequivalent(&self, queue: &str, arguments: &FieldTable) {
        if !self
            .warned
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(queue.to_owned())
        {
            return;
        }
        let wanted: Vec<String> = arguments
            .inner()
            .iter()
            .map(|(k, v)| {
                format!(
                    "{}={}",
                    k.as_str(),
                    String::from_utf8_lossy(&amqp_to_bytes(v))
                )
            })
            .collect();
        let policy = match arguments.inner().get("x-delivery-limit") {
            Some(limit) => format!(
                "; a policy adds the quarantine: rabbitmqctl set_policy inbox-{queue} '^{}$' '{{\"delivery-limit\":{},\"dead-letter-exchange\":\"\",\"dead-letter-routing-key\":\"{queue}.quarantine\",\"dead-letter-strategy\":\"at-least-once\",\"overflow\":\"reject-publish\"}}' --apply-to queues",
                queue.replace('.', "\\."),
                String::from_utf8_lossy(&amqp_to_bytes(limit)),
            ),
            None => String::new(),
        };
        tracing::warn!(
            queue,
            wanted = %wanted.join(", "),
            "queue exists with other arguments; using it as it is{policy}"
        );
    }

    /// The arguments of a consumer's queue.
    fn consumer_queue_arguments(&self, source: &str, consumer: &str) -> FieldTable {
        let mut arguments = self.expiring();
        if self.config.queue_type == QueueType::Quorum {
            arguments.insert(
                "x-queue-type".into(),
                AMQPValue::LongString("quorum".into()),
            );
            if let Some(limit) = self.config.delivery_limit {
                let quarantine = quarantine_name(source, consumer);
                arguments.insert(
                    "x-delivery-limit".into(),
                    AMQPValue::LongLongInt(limit.into()),
                );
                arguments.insert(
                    "x-dead-letter-exchange".into(),
                    AMQPValue::LongString("".into()),
                );
                arguments.insert(
                    "x-dead-letter-routing-key".into(),
                    AMQPValue::LongString(quarantine.as_str().into()),
                );
                arguments.insert(
                    "x-dead-letter-strategy".into(),
                    AMQPValue::LongString("at-least-once".into()),
                );
                // Required by at-least-once dead-lettering (with no length limit it does nothing).
                arguments.insert(
                    "x-overflow".into(),
                    AMQPValue::LongString("reject-publish".into()),
                );
            }
        }
        arguments
    }

    /// `x-expires` where the configuration asks for it.
    fn expiring(&self) -> FieldTable {
        let mut arguments = FieldTable::default();
        if let Some(after) = self.config.queue_expires {
            let ms = i64::try_from(after.as_millis()).unwrap_or(i64::MAX).max(1);
            arguments.insert("x-expires".into(), AMQPValue::LongLongInt(ms));
        }
        arguments
    }

    /// The source exchange, the consumer's quarantine queue (quorum queues with a delivery
    /// limit) and the consumer's queue.
    pub(crate) async fn declare_consumer(
        &self,
        source: &str,
        consumer: &str,
    ) -> Result<(), TransportError> {
        self.declare_exchange_alone(source).await?;
        if self.config.queue_type == QueueType::Quorum && self.config.delivery_limit.is_some() {
            // Bound to nothing: only the broker's dead-lettering routes to it (through the
            // default exchange), and it must exist before the first message goes there.
            let quarantine = quarantine_name(source, consumer);
            let connection = self.connection().await?;
            let channel = self.open_channel(&connection).await?;
            let declared = channel
                .queue_declare(
                    short(&quarantine)?,
                    QueueDeclareOptions {
                        durable: true,
                        ..QueueDeclareOptions::default()
                    },
                    self.expiring(),
                )
                .await;
            let _ = channel.close(200, "declared".into()).await;
            match declared {
                Ok(_) => {}
                Err(e) if inequivalent(&e) => {}
                Err(e) => return Err(broker_error(e)),
            }
        }
        self.declare_queue(
            &queue_name(source, consumer),
            source,
            self.consumer_queue_arguments(source, consumer),
        )
        .await
    }

    /// A fanout exchange with a durable queue of the same name (dead-letter destinations).
    pub(crate) async fn declare_dead_letter(
        &self,
        destination: &str,
    ) -> Result<(), TransportError> {
        self.declare_exchange_alone(destination).await?;
        self.declare_queue(destination, destination, self.expiring())
            .await
    }

    async fn declare_exchange_alone(&self, name: &str) -> Result<(), TransportError> {
        let connection = self.connection().await?;
        let channel = self.open_channel(&connection).await?;
        let declared = self.declare_exchange(&channel, name).await;
        let _ = channel.close(200, "declared".into()).await;
        declared
    }
}
