//! The conformance suite on a Kafka-API broker (`KAFKA_BROKERS`; tansu in `scripts/test`) with
//! PostgreSQL.
#![cfg(feature = "kafka")]

mod conformance;

use conformance::kafka::Kafka;

conformance_suite!(kafka_postgres, Kafka, async {
    conformance::stores::Postgres
});
