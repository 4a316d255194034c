//! An in-process broker with real at-least-once semantics, for unit tests and demos.
//!
//! - **Topics and consumer groups.** A topic keeps every message published to it; each consumer
//!   name subscribing to it is a group that receives every message once (starting from the
//!   beginning, like Kafka's `earliest`), and the instances of a group compete for them.
//! - **At-least-once.** A delivery that is nacked with requeue, or dropped without being settled
//!   (a crashed consumer), is delivered again, flagged redelivered, with its delivery count.
//! - **Fault injection, deterministic from a seed** ([`Faults`]): duplicate publishes, acks that
//!   are lost after the consumer sent them (the message comes back), the same message handed to
//!   two consumers at once, and reordering. For one sequence of broker operations, a seed always
//!   makes the same decisions.
//!
//! ```
//! # async fn demo() -> Result<(), inbox_core::TransportError> {
//! use inbox_core::{OutgoingMessage, Transport};
//! use inbox_transport_memory::{Faults, MemoryBroker};
//!
//! let broker = MemoryBroker::with_faults(Faults::seeded(42).duplicate_publish(0.2).lose_ack(0.1));
//! broker.publish("parcels", OutgoingMessage::new("m-1", r#"{"n":1}"#)).await?;
//! # Ok(()) }
//! ```
#![forbid(unsafe_code)]

mod broker;
mod delivery;
mod faults;
mod state;
mod transport;

pub use broker::{AckObserver, BrokerStats, MemoryBroker};
pub use delivery::MemoryDelivery;
pub use faults::Faults;

#[cfg(test)]
mod tests;
