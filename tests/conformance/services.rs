//! Where the real services are: an environment variable, else a container when a Docker engine is
//! reachable, else a loud failure that says what to set.

use std::sync::OnceLock;

/// Whether a Docker engine looks reachable (testcontainers' own checks are slower to fail).
fn docker_reachable() -> bool {
    std::env::var_os("DOCKER_HOST").is_some()
        || std::path::Path::new("/var/run/docker.sock").exists()
}

fn missing(var: &str, example: &str) -> ! {
    panic!(
        "{var} is not set and no Docker engine is reachable for testcontainers. \
         Set {var} (for example {var}={example}) or run scripts/test, which starts the services."
    )
}

/// The PostgreSQL URL for the tests.
pub fn postgres_url() -> String {
    static URL: OnceLock<String> = OnceLock::new();
    URL.get_or_init(|| {
        if let Ok(url) = std::env::var("DATABASE_URL") {
            return url;
        }
        if !docker_reachable() {
            missing("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test");
        }
        containers::postgres()
    })
    .clone()
}

mod containers {
    use testcontainers_modules::kafka::apache::Kafka;
    use testcontainers_modules::postgres::Postgres;
    use testcontainers_modules::rabbitmq::RabbitMq;
    use testcontainers_modules::testcontainers::runners::SyncRunner;

    /// Starts PostgreSQL in a container kept for the life of the test process.
    pub fn postgres() -> String {
        let container = Postgres::default()
            .start()
            .expect("starting a PostgreSQL container with testcontainers");
        let port = container
            .get_host_port_ipv4(5432)
            .expect("the PostgreSQL container's port");
        // Leaked on purpose: the container lives as long as the test binary (testcontainers'
        // reaper removes it afterwards).
        std::mem::forget(container);
        format!("postgres://postgres:postgres@127.0.0.1:{port}/postgres")
    }

    /// Starts Kafka (KRaft) in a container kept for the life of the test process.
    pub fn kafka() -> String {
        let container = Kafka::default()
            .start()
            .expect("starting a Kafka container with testcontainers");
        let port = container
            .get_host_port_ipv4(testcontainers_modules::kafka::apache::KAFKA_PORT)
            .expect("the Kafka container's port");
        std::mem::forget(container);
        format!("127.0.0.1:{port}")
    }

    /// Starts RabbitMQ in a container kept for the life of the test process.
    pub fn rabbitmq() -> String {
        let container = RabbitMq::default()
            .start()
            .expect("starting a RabbitMQ container with testcontainers");
        let port = container
            .get_host_port_ipv4(5672)
            .expect("the RabbitMQ container's port");
        std::mem::forget(container);
        format!("amqp://guest:guest@127.0.0.1:{port}/%2f")
    }
}

/// The AMQP URL for the tests.
pub fn amqp_url() -> String {
    static URL: OnceLock<String> = OnceLock::new();
    URL.get_or_init(|| {
        if let Ok(url) = std::env::var("AMQP_URL") {
            return url;
        }
        if !docker_reachable() {
            missing("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f");
        }
        containers::rabbitmq()
    })
    .clone()
}

/// The Kafka bootstrap servers for the tests.
pub fn kafka_brokers() -> String {
    static BROKERS: OnceLock<String> = OnceLock::new();
    BROKERS
        .get_or_init(|| {
            if let Ok(brokers) = std::env::var("KAFKA_BROKERS") {
                return brokers;
            }
            if !docker_reachable() {
                missing("KAFKA_BROKERS", "127.0.0.1:9092");
            }
            containers::kafka()
        })
        .clone()
}
