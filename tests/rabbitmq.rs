//! The conformance suite on a real RabbitMQ (`AMQP_URL`) with PostgreSQL, plus what only a real
//! server can show: the server closing every connection mid-stream.
#![cfg(feature = "rabbitmq")]

mod conformance;

use conformance::rabbitmq::RabbitMq;
use inbox::rabbitmq::{QueueType, RabbitMqConfig};

conformance_suite!(
    rabbitmq_postgres,
    RabbitMq {
        config: RabbitMqConfig::default()
    },
    async { conformance::stores::Postgres }
);
conformance_suite!(
    rabbitmq_quorum_postgres,
    RabbitMq {
        config: RabbitMqConfig::default().queue_type(QueueType::Quorum)
    },
    async { conformance::stores::Postgres }
);
