#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]

pub use inbox_core::*;

/// The in-process broker: at-least-once semantics and deterministic fault injection.
#[cfg(feature = "memory")]
pub use inbox_transport_memory as memory;

/// The RabbitMQ transport (lapin).
#[cfg(feature = "rabbitmq")]
pub use inbox_transport_rabbitmq as rabbitmq;

/// The Kafka transport (rdkafka).
#[cfg(feature = "kafka")]
pub use inbox_transport_kafka as kafka;
