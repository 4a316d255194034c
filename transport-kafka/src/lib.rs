//! The Kafka transport of `inbox` (rdkafka).
//!
//! **Not implemented yet** — tracked by issue 4. This crate exists so that the facade's `kafka`
//! feature and the workspace layout are in place; it offers no API until the transport passes the
//! conformance suite on a real Kafka-API broker.
#![forbid(unsafe_code)]
