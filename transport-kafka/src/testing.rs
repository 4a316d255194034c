//! What tests inspect on a transport: counts the engine never needs. Import the trait to call
//! them; they are kept off the transport's own API.

use std::sync::atomic::Ordering;

use super::KafkaTransport;

/// Inspection of a [`KafkaTransport`] for tests.
pub trait Inspect {
    /// Deliveries handed out and not yet acked or nacked.
    fn unsettled(&self) -> usize;
}

impl Inspect for KafkaTransport {
    fn unsettled(&self) -> usize {
        self.unsettled.load(Ordering::SeqCst)
    }
}
