//! Where the real services are: an environment variable, else a container when a Docker engine is
//! reachable, else a loud failure that says what to set.

use std::sync::OnceLock;

/// Whether a Docker engine looks reachable (testcontainers' own checks are slower to fail).
fn docker_reachable() -> bool {
    std::env::var_os("DOCKER_HOST").is_some()
        || std::path::Path::new("/var/run/docker.sock").exists()
}

/// `var`'s value, else the address of a container started once per test process, else a panic
/// that says what to set.
fn locate(
    cell: &'static OnceLock<String>,
    var: &str,
    example: &str,
    start: fn() -> String,
) -> String {
    cell.get_or_init(|| {
        if let Ok(value) = std::env::var(var) {
            return value;
        }
        if !docker_reachable() {
            panic!(
                "{var} is not set and no Docker engine is reachable for testcontainers. \
                 Set {var} (for example {var}={example}) or run scripts/test, which starts the \
                 services."
            );
        }
        start()
    })
    .clone()
}

/// The PostgreSQL URL for the tests.
pub fn postgres_url() -> String {
    static URL: OnceLock<String> = OnceLock::new();
    locate(
        &URL,
        "DATABASE_URL",
        "postgres://postgres@127.0.0.1:5432/test",
        containers::postgres,
    )
}

/// The MySQL / MariaDB URL for the tests.
pub fn mysql_url() -> String {
    static URL: OnceLock<String> = OnceLock::new();
    locate(
        &URL,
        "MYSQL_URL",
        "mysql://root@127.0.0.1:3306/test",
        containers::mysql,
    )
}

/// The AMQP URL for the tests.
pub fn amqp_url() -> String {
    static URL: OnceLock<String> = OnceLock::new();
    locate(
        &URL,
        "AMQP_URL",
        "amqp://guest:guest@127.0.0.1:5672/%2f",
        containers::rabbitmq,
    )
}

/// The Kafka bootstrap servers for the tests.
pub fn kafka_brokers() -> String {
    static BROKERS: OnceLock<String> = OnceLock::new();
    locate(
        &BROKERS,
        "KAFKA_BROKERS",
        "127.0.0.1:9092",
        containers::kafka,
    )
}

/// The NATS URL for the tests (a server with JetStream).
pub fn nats_url() -> String {
    static URL: OnceLock<String> = OnceLock::new();
    locate(&URL, "NATS_URL", "nats://127.0.0.1:4222", containers::nats)
}

/// The Redis URL for the tests.
pub fn redis_url() -> String {
    static URL: OnceLock<String> = OnceLock::new();
    locate(
        &URL,
        "REDIS_URL",
        "redis://127.0.0.1:6379",
        containers::redis,
    )
}

mod containers {
    use testcontainers_modules::kafka::apache::{KAFKA_PORT, Kafka};
    use testcontainers_modules::mysql::Mysql;
    use testcontainers_modules::postgres::Postgres;
    use testcontainers_modules::rabbitmq::RabbitMq;
    use testcontainers_modules::testcontainers::core::ContainerPort;
    use testcontainers_modules::testcontainers::runners::SyncRunner;
    use testcontainers_modules::testcontainers::{ContainerRequest, Image};

    /// Starts `image` and returns its host port for `port`. The container is leaked on purpose:
    /// it lives as long as the test binary (testcontainers' reaper removes it afterwards).
    fn start<I: Image>(
        image: impl Into<ContainerRequest<I>> + Send,
        what: &str,
        port: impl Into<ContainerPort>,
    ) -> u16 {
        let container = image
            .start()
            .unwrap_or_else(|e| panic!("starting a {what} container with testcontainers: {e}"));
        let host_port = container
            .get_host_port_ipv4(port)
            .unwrap_or_else(|e| panic!("the {what} container's port: {e}"));
        std::mem::forget(container);
        host_port
    }

    pub fn postgres() -> String {
        let port = start(Postgres::default(), "PostgreSQL", 5432);
        format!("postgres://postgres:postgres@127.0.0.1:{port}/postgres")
    }

    /// MySQL 8 (the module's image; root with no password).
    pub fn mysql() -> String {
        let port = start(Mysql::default(), "MySQL", 3306);
        format!("mysql://root@127.0.0.1:{port}/test")
    }

    pub fn rabbitmq() -> String {
        let port = start(RabbitMq::default(), "RabbitMQ", 5672);
        format!("amqp://guest:guest@127.0.0.1:{port}/%2f")
    }

    /// NATS with JetStream on.
    pub fn nats() -> String {
        use testcontainers_modules::nats::{Nats, NatsServerCmd};
        use testcontainers_modules::testcontainers::ImageExt;
        let image = Nats::default().with_cmd(&NatsServerCmd::default().with_jetstream());
        let port = start(image, "NATS", 4222);
        format!("nats://127.0.0.1:{port}")
    }

    pub fn redis() -> String {
        let port = start(
            testcontainers_modules::redis::Redis::default(),
            "Redis",
            6379,
        );
        format!("redis://127.0.0.1:{port}")
    }

    pub fn kafka() -> String {
        let port = start(Kafka::default(), "Kafka", KAFKA_PORT);
        format!("127.0.0.1:{port}")
    }
}
