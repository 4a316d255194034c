//! The RabbitMQ transport of `inbox` (lapin).
//!
//! **Not implemented yet** — tracked by issue 3. This crate exists so that the facade's
//! `rabbitmq` feature and the workspace layout are in place; it offers no API until the
//! transport passes the conformance suite on a real RabbitMQ.
#![forbid(unsafe_code)]
