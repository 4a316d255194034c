//! The scenarios, by theme. Each is a plain async function over a broker factory and a
//! database, run on every (transport, store) pair by [`conformance_suite!`](crate::conformance_suite).

mod delivery;
mod failures;
mod outbox;
mod store;
mod whole;

pub use delivery::*;
pub use failures::*;
pub use outbox::*;
pub use store::*;
pub use whole::*;

use std::collections::HashMap;

use inbox::OutgoingMessage;
use inbox::dead_letter::headers as dead_letter_headers;
use inbox::memory::Faults;

use crate::BrokerFactory;

/// `faults` where the broker injects them; on a real broker the scenario runs without them, and
/// says so in the test's output (the faults a real broker shows come from the other scenarios).
pub(crate) fn faults_or_none(brokers: &dyn BrokerFactory, faults: Faults) -> Faults {
    if brokers.injects_faults() {
        faults
    } else {
        println!(
            "{}: injected broker faults not supported; running without them",
            brokers.name()
        );
        Faults::none()
    }
}

pub(crate) fn header<'m>(message: &'m OutgoingMessage, name: &str) -> &'m str {
    message.headers.get_str(name).unwrap_or("")
}

/// Each dead letter's reason, by message id.
pub(crate) fn reasons_by_id(dead: &[OutgoingMessage]) -> HashMap<String, String> {
    dead.iter()
        .map(|m| {
            (
                header(m, dead_letter_headers::MESSAGE_ID).to_owned(),
                header(m, dead_letter_headers::REASON).to_owned(),
            )
        })
        .collect()
}
