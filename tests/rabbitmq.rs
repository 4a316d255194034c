//! The conformance suite on a real RabbitMQ (`AMQP_URL`) with PostgreSQL, plus what only a real
//! server can show: the server force-closing the connections mid-stream, and messages published
//! by another client (`rabbitmqadmin`) handled exactly once by the demo's consumers.

use inbox_test_kit::{self as conformance, conformance_suite};

use std::sync::Arc;

use conformance::rabbitmq::RabbitMq;
use conformance::stores::Postgres;
use conformance::{Running, Scenario, Script, eventually};
use inbox::memory::Faults;
use inbox::rabbitmq::QueueType;
use inbox::rabbitmq::testing::Inspect as _;

conformance_suite!(
    rabbitmq_postgres,
    RabbitMq::new(QueueType::Classic),
    async { conformance::stores::Postgres }
);
conformance_suite!(
    rabbitmq_quorum_postgres,
    RabbitMq::new(QueueType::Quorum),
    async { conformance::stores::Postgres }
);
// Batch mode: a prefetch window claimed in one statement, acked after one commit.
// `killed_and_restarted` here once caught a leak: an instance aborted while it was subscribing
// (basic.consume already at the broker, the stream not yet returned) left its channel open, and
// the broker held a prefetch window of messages on it for ever. The channel is now owned by a
// guard from its creation.
conformance_suite!(
    rabbitmq_postgres_batched,
    RabbitMq::new(QueueType::Classic),
    async { conformance::stores::Postgres },
    batched = true
);
// Batch mode with a batch handler: each batch handled in one call, failures isolated by
// splitting the batch.
conformance_suite!(
    rabbitmq_postgres_whole_batches,
    RabbitMq::new(QueueType::Classic),
    async { conformance::stores::Postgres },
    whole_batches
);

conformance::outbox_suite!(
    outbox_rabbitmq_postgres,
    RabbitMq::new(QueueType::Classic),
    async { conformance::stores::Postgres }
);
conformance::outbox_suite!(
    outbox_rabbitmq_sqlite,
    RabbitMq::new(QueueType::Quorum),
    async { conformance::stores::Sqlite }
);

async fn rabbitmqctl(args: &[&str]) -> String {
    let output = tokio::process::Command::new("rabbitmqctl")
        .args(args)
        .output()
        .await
        .expect(
            "rabbitmqctl runs (scripts/test needs the RabbitMQ server's tools on this machine)",
        );
    let text = String::from_utf8_lossy(&output.stdout).into_owned()
        + &String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success() || text.contains("already exists"),
        "rabbitmqctl {args:?}: {text}"
    );
    text
}

/// One column of `rabbitmqctl list_queues` for `queue` (None: no such queue).
async fn queue_column(queue: &str, column: &str) -> Option<String> {
    let listed = rabbitmqctl(&["list_queues", "-q", "--no-table-headers", "name", column]).await;
    listed
        .lines()
        .find_map(|line| line.strip_prefix(&format!("{queue}\t")))
        .map(|value| value.trim().to_owned())
}

/// A vhost of its own, so that closing all its connections touches no other test.
async fn private_vhost(name: &str) -> String {
    rabbitmqctl(&["add_vhost", name]).await;
    rabbitmqctl(&["set_permissions", "-p", name, "guest", ".*", ".*", ".*"]).await;
    let base = conformance::services::amqp_url();
    let authority_end = base[base.find("://").unwrap() + 3..]
        .find('/')
        .map(|i| i + base.find("://").unwrap() + 3);
    let root = authority_end.map_or(base.as_str(), |end| &base[..end]);
    format!("{root}/{name}")
}

/// `rabbitmqctl close_all_connections` twice while two instances consume: they notice, reconnect
/// with backoff, and every message still has exactly one effect.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn server_closes_all_connections_mid_stream() {
    conformance::init_tracing();
    let vhost = "inbox-close-test";
    let brokers = RabbitMq {
        url: Some(private_vhost(vhost).await),
        ..RabbitMq::new(QueueType::Classic)
    };
    let db = Arc::new(Postgres);
    let s = Scenario::new(&brokers, &db, Faults::none()).await;
    let name = s.name("closed");
    s.broker.prepare(&s.source, &[&name]).await;
    let ids: Vec<String> = (0..300).map(|i| s.id(i)).collect();
    for (i, id) in ids.iter().enumerate() {
        s.publish(id, i).await;
        if i % 5 == 0 {
            s.publish(id, i).await;
        }
    }
    // Handlers wait while the gate is shut, so that some are surely in flight at each close.
    let (gate, _) = tokio::sync::watch::channel(true);
    let gate = Arc::new(gate);
    let script = Arc::new(Script {
        hook: Some({
            let gate = Arc::clone(&gate);
            Arc::new(move |_, _| {
                let mut open = gate.subscribe();
                Box::pin(async move {
                    let _ = open.wait_for(|open| *open).await;
                    Ok(())
                })
            })
        }),
        ..Script::default()
    });
    let consumer = s.consumer(&name, &script);
    let running = Running::start(&consumer, 2);
    for target in [60, 150] {
        s.wait_for_effects(target).await;
        gate.send_replace(false);
        let waiting = consumer.report().deliveries
            - consumer.report().processed
            - consumer.report().duplicates_discarded;
        let handled: i64 = s.effects().await.values().sum();
        let said = rabbitmqctl(&[
            "close_all_connections",
            "-p",
            vhost,
            "inbox test: server-side close",
        ])
        .await;
        gate.send_replace(true);
        println!(
            "closed at {handled} effects with about {waiting} deliveries in flight: {}",
            said.trim()
        );
        let before = s.broker.connections_opened();
        eventually("the transport reconnects", || async {
            match s.broker.connections_opened() {
                n if n > before => Ok(()),
                n => Err(format!("{n} connections opened")),
            }
        })
        .await;
    }
    s.wait_for(&[&name], ids.len()).await;
    running.stop().await;
    s.assert_exactly_once(&[&name], &ids).await;
    let report = consumer.report();
    assert_eq!(report.processed, ids.len() as u64, "{report:?}");
    assert!(report.duplicates_discarded >= 60, "{report:?}");
    assert!(
        s.broker.connections_opened() >= 3,
        "reconnected after each close"
    );
    assert!(
        report.ack_failures > 0 && report.deliveries > 360,
        "in-flight messages lost their acks and came back: {report:?}"
    );
    println!("server-side close: {report:?}");
}

/// An ack on a delivery whose connection the server closed is reported as lost, never as
/// success; the message comes back to the next subscriber.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ack_after_the_connection_died_is_reported_lost() {
    use futures::StreamExt;
    use inbox::transport::Subscription;
    use inbox::{ConsumerName, OutgoingMessage, Transport, TransportError};

    let vhost = "inbox-ack-lost-test";
    let brokers = RabbitMq {
        url: Some(private_vhost(vhost).await),
        ..RabbitMq::new(QueueType::Classic)
    };
    let broker = brokers.start_rabbit().await;
    let transport = broker.transport.clone();
    let source = format!("ack-lost.{}", uuid::Uuid::new_v4().simple());
    let consumer = ConsumerName::new("c").unwrap();
    transport
        .declare_consumer_queue(&source, "c")
        .await
        .unwrap();
    transport
        .publish(&source, OutgoingMessage::new("m-1", "x"))
        .await
        .unwrap();
    let subscription = Subscription::new(source.clone(), consumer.clone(), 1);
    let mut stream = transport.subscribe(&subscription).await.unwrap();
    let delivery = stream.next().await.unwrap().unwrap();
    assert_eq!(delivery.broker_message_id(), Some(&b"m-1"[..]));

    rabbitmqctl(&["close_all_connections", "-p", vhost, "inbox test: ack lost"]).await;
    // The stream learns of it first.
    let ended = tokio::time::timeout(conformance::DEADLINE, stream.next())
        .await
        .expect("the stream notices");
    assert!(matches!(ended, None | Some(Err(_))), "{ended:?}");
    let acked = delivery
        .ack(inbox::transport::AckToken::for_transport_tests())
        .await;
    assert!(
        matches!(acked, Err(TransportError::AckLost(_))),
        "{acked:?}"
    );

    let mut again = transport.subscribe(&subscription).await.unwrap();
    let redelivered = again.next().await.unwrap().unwrap();
    assert_eq!(redelivered.broker_message_id(), Some(&b"m-1"[..]));
    assert!(redelivered.redelivered());
    redelivered.nack(false).await.unwrap();
}

/// Waits until the demo's consumers declared their queues on `source`.
async fn demo_queues_declared(transport: &inbox::rabbitmq::RabbitMqTransport, source: &str) {
    eventually("the demo declared its queues", || async {
        for consumer in ["notification", "carrier-assignment"] {
            transport
                .ready(source, consumer)
                .await
                .map_err(|e| e.to_string())?;
        }
        Ok(())
    })
    .await;
}

/// The demo's consumers with their batch handlers (`consume --handler batch`: one multi-row
/// INSERT per batch; the carrier's flaky first attempts fail a batch naming their message, which
/// is isolated) handle every event once, copies discarded, and drain on SIGTERM.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demos_batch_handlers_handle_each_event_once() {
    use conformance::demo::DemoConsumer;
    use inbox::rabbitmq::RabbitMqTransport;

    let source = format!("parcels-{}", uuid::Uuid::new_v4().simple());
    let amqp = conformance::services::amqp_url();
    let env = [("AMQP_URL", amqp.clone())];
    let demo = DemoConsumer::start_with(
        "rabbitmq",
        &source,
        &env,
        &["--handler", "batch", "--batch", "50", "--batch-wait", "20"],
    )
    .await;
    let transport = RabbitMqTransport::connect(amqp, Default::default())
        .await
        .unwrap();
    demo_queues_declared(&transport, &source).await;
    let events = 400;
    let publish = conformance::demo::spawn(
        &[
            "publish",
            "--transport",
            "rabbitmq",
            "--source",
            &source,
            "--count",
            &events.to_string(),
            "--duplicates",
            "0.1",
        ],
        &env,
        "warn",
    );
    let output = publish.wait_with_output().await.unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(output.status.success(), "{stdout}");
    let published: u64 = stdout
        .split_whitespace()
        .nth(1)
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("published N messages: {stdout}"));
    demo.wait_for_effects(events).await;
    // Ready and unacknowledged (the demo's own in-flight copies), as the broker counts them.
    eventually("the copies settled", || async {
        let listed = tokio::process::Command::new("rabbitmqadmin")
            .args(["-f", "tsv", "-q", "list", "queues", "name", "messages"])
            .output()
            .await
            .map_err(|e| e.to_string())?;
        let left: u64 = String::from_utf8_lossy(&listed.stdout)
            .lines()
            .filter(|line| line.starts_with(&format!("{source}.")))
            .filter_map(|line| line.split('\t').nth(1)?.parse::<u64>().ok())
            .sum();
        if listed.status.success() && left == 0 {
            Ok(())
        } else {
            Err(format!("{left} in the queues"))
        }
    })
    .await;
    demo.stop_exactly_once(events as u64, published - events as u64)
        .await;
}

/// The demo's consumers, as a separate process, handle messages that `rabbitmqadmin` (not our
/// code) published — duplicates included — exactly once, and drain on SIGTERM.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_clients_messages_are_handled_once_by_the_demo() {
    use conformance::demo::DemoConsumer;
    use inbox::rabbitmq::RabbitMqTransport;

    let source = format!("parcels-{}", uuid::Uuid::new_v4().simple());
    let amqp = conformance::services::amqp_url();
    let demo = DemoConsumer::start("rabbitmq", &source, &[("AMQP_URL", amqp.clone())]).await;
    let transport = RabbitMqTransport::connect(amqp, Default::default())
        .await
        .unwrap();
    demo_queues_declared(&transport, &source).await;

    let (events, duplicated) = (20, 5);
    for n in 0..events {
        let payload = format!(
            r#"{{"parcel_id":"{}","tracking_number":"TRK-ADMIN-{n}","destination":"Oslo"}}"#,
            uuid::Uuid::new_v4()
        );
        let properties = format!(r#"{{"message_id":"admin-{source}-{n}","delivery_mode":2}}"#);
        for _ in 0..if n < duplicated { 2 } else { 1 } {
            let published = tokio::process::Command::new("rabbitmqadmin")
                .args([
                    "publish",
                    &format!("exchange={source}"),
                    "routing_key=",
                    &format!("payload={payload}"),
                    &format!("properties={properties}"),
                ])
                .output()
                .await
                .expect("rabbitmqadmin runs (scripts/test enables the management plugin)");
            assert!(
                published.status.success(),
                "rabbitmqadmin publish: {}",
                String::from_utf8_lossy(&published.stderr)
            );
        }
    }

    demo.wait_for_effects(events).await;
    eventually("the duplicates settled", || async {
        let mut left = 0;
        for consumer in ["notification", "carrier-assignment"] {
            left += transport
                .ready(&source, consumer)
                .await
                .map_err(|e| e.to_string())?;
        }
        if left == 0 {
            Ok(())
        } else {
            Err(format!("{left} ready"))
        }
    })
    .await;
    demo.stop_exactly_once(events as u64, duplicated as u64)
        .await;
}

/// The loop from the API call to the consumers' commits, as separate processes: the demo's HTTP
/// API (`serve`) creates parcels with their events in the outbox, a `relay` publishes them, the
/// demo's consumers (on a database of their own) handle them. Clients' retries with an
/// `Idempotency-Key`, one of them concurrent, create nothing twice; bad requests are refused
/// with a one-line reason and write nothing; then `report --parcels-database --expect` agrees.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_api_relay_and_consumers_handle_each_parcel_once() {
    use conformance::demo::{self, DemoConsumer, http};
    use tokio::io::AsyncBufReadExt;

    let source = format!("parcels-{}", uuid::Uuid::new_v4().simple());
    let env = [("AMQP_URL", conformance::services::amqp_url())];
    let producer_db = conformance::stores::Postgres::fresh_url().await;
    let mut serve = demo::spawn(
        &[
            "serve",
            "--database",
            &producer_db,
            "--addr",
            "127.0.0.1:0",
            "--source",
            &source,
        ],
        &[],
        "warn",
    );
    let relay = demo::spawn(
        &[
            "relay",
            "--transport",
            "rabbitmq",
            "--database",
            &producer_db,
            "--source",
            &source,
        ],
        &env,
        "warn",
    );
    let consumers = DemoConsumer::start("rabbitmq", &source, &env).await;
    let mut stdout = tokio::io::BufReader::new(serve.stdout.take().unwrap()).lines();
    let line = tokio::time::timeout(conformance::DEADLINE, stdout.next_line())
        .await
        .expect("serve says where it listens")
        .unwrap()
        .expect("a line");
    let addr = line
        .strip_prefix("listening on http://")
        .unwrap_or_else(|| panic!("{line}"))
        .to_owned();
    let json = [("Content-Type", "application/json")];

    let health = http(&addr, "GET", "/health", &[], "").await;
    assert_eq!((health.status, health.body.as_str()), (200, "ok\n"));
    for (body, status) in [
        (r#"{"tracking_number": "TRK"#, 400),
        ("not json", 400),
        ("[]", 422),
        (r#"{"tracking_number": 5, "destination": "Oslo"}"#, 422),
        (r#"{"tracking_number": "TRK-1"}"#, 422),
        (r#"{"tracking_number": "", "destination": "Oslo"}"#, 422),
    ] {
        let answer = http(&addr, "POST", "/parcels", &json, body).await;
        assert_eq!(answer.status, status, "{body}: {answer:?}");
        assert_eq!(
            answer.body.trim_end().lines().count(),
            1,
            "one line: {answer:?}"
        );
    }

    let parcels = 30;
    let body = |n: usize| format!(r#"{{"tracking_number": "TRK-API-{n}", "destination": "Oslo"}}"#);
    let mut ids = std::collections::HashSet::new();
    for n in 0..parcels {
        let key = format!("{source}-{n}");
        let headers = [json[0], ("Idempotency-Key", key.as_str())];
        let first = http(&addr, "POST", "/parcels", &headers, &body(n)).await;
        assert_eq!(first.status, 201, "{first:?}");
        let id: serde_json::Value = serde_json::from_str(&first.body).unwrap();
        assert!(ids.insert(id["parcel_id"].as_str().unwrap().to_owned()));
        if n % 5 == 0 {
            // The client's retry: the same parcel, nothing written.
            let again = http(&addr, "POST", "/parcels", &headers, &body(n)).await;
            assert_eq!((again.status, &again.body), (201, &first.body), "{again:?}");
            assert_eq!(again.header("idempotent-replayed"), Some("true"));
            // The same key for another request is refused.
            let other = http(&addr, "POST", "/parcels", &headers, &body(n + 1000)).await;
            assert_eq!(other.status, 422, "{other:?}");
        }
    }
    // Two copies of one request at once: one parcel.
    let headers = [json[0], ("Idempotency-Key", "concurrent")];
    let same = body(parcels);
    let (a, b) = tokio::join!(
        http(&addr, "POST", "/parcels", &headers, &same),
        http(&addr, "POST", "/parcels", &headers, &same),
    );
    assert_eq!((a.status, b.status), (201, 201), "{a:?} {b:?}");
    assert_eq!(a.body, b.body);
    // Without a key, each request is a parcel.
    let plain = http(&addr, "POST", "/parcels", &json, &body(parcels + 1)).await;
    assert_eq!(plain.status, 201, "{plain:?}");
    let created = parcels as u64 + 2;

    consumers.wait_for_effects(created as i64).await;
    demo::terminate(&serve).await;
    demo::terminate(&relay).await;
    for (name, child) in [("serve", serve), ("relay", relay)] {
        let output = tokio::time::timeout(conformance::DEADLINE, child.wait_with_output())
            .await
            .unwrap_or_else(|_| panic!("{name} exits after SIGTERM"))
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            output.status.success(),
            "{name} exits 0 after SIGTERM: {stderr}"
        );
        if name == "relay" {
            assert!(stderr.contains("relay: batches"), "{stderr}");
        }
    }
    let database = consumers.database.clone();
    let stderr = consumers.stop().await;
    let report = tokio::process::Command::new(demo::binary())
        .args([
            "report",
            "--database",
            &database,
            "--parcels-database",
            &producer_db,
        ])
        .args(["--expect", &created.to_string(), "--json"])
        .output()
        .await
        .unwrap();
    let text = String::from_utf8_lossy(&report.stdout);
    assert!(
        report.status.success(),
        "report --expect {created}: {text} {stderr}"
    );
    let report: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(report["parcels_created"], created, "{report}");
    assert_eq!(report["created_parcels_complete"], created, "{report}");
}

/// Sets RabbitMQ's `consumer_timeout` (and the channel tick that checks it) for the channels
/// opened from now on, and puts the defaults back when dropped. It is server-wide (RabbitMQ 3.10
/// has no per-queue `x-consumer-timeout`; 3.12 does): the test that uses it runs alone.
struct ConsumerTimeout;

impl ConsumerTimeout {
    async fn set(timeout_ms: u64, tick_ms: u64) -> Self {
        rabbitmqctl(&[
            "eval",
            &format!("application:set_env(rabbit, consumer_timeout, {timeout_ms})."),
        ])
        .await;
        rabbitmqctl(&[
            "eval",
            &format!("application:set_env(rabbit, channel_tick_interval, {tick_ms})."),
        ])
        .await;
        Self
    }
}

impl Drop for ConsumerTimeout {
    fn drop(&mut self) {
        for setting in [
            "application:set_env(rabbit, consumer_timeout, 1800000).",
            "application:set_env(rabbit, channel_tick_interval, 60000).",
        ] {
            let _ = std::process::Command::new("rabbitmqctl")
                .args(["eval", setting])
                .output();
        }
    }
}

/// RabbitMQ closes a consumer's channel (406 PRECONDITION_FAILED) when a delivery stays unacked
/// longer than `consumer_timeout` — as every in-flight delivery does through a database outage
/// longer than that (30 min by default). The consumer must subscribe again, not stop: the
/// outage ends, every message is handled once, and `run` is still running. Changes a
/// server-wide setting, so it runs alone (the `_alone` suffix: scripts/test runs those last, one
/// at a time).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn consumer_timeout_during_a_database_outage_alone() {
    use conformance::flaky::FlakyStore;
    use inbox::{Consumer, RetryPolicy};
    use std::time::Duration;

    conformance::init_tracing();
    let _timeout = ConsumerTimeout::set(1500, 250).await;
    let db = Arc::new(Postgres);
    let s = Scenario::new(&RabbitMq::new(QueueType::Classic), &db, Faults::none()).await;
    let name = s.name("timeout");
    s.broker.prepare(&s.source, &[&name]).await;
    let store = FlakyStore::new(s.store.clone());
    let consumer = Consumer::new(
        name.clone(),
        s.source.clone(),
        s.broker.transport(),
        store.clone(),
        s.handler(&Arc::new(Script::default())),
    )
    .concurrency(4)
    .reconnect_backoff(
        RetryPolicy::default().with_delays(Duration::from_millis(10), Duration::from_millis(200)),
    );
    let ids: Vec<String> = (0..40).map(|i| s.id(i)).collect();
    let running = Running::start(&consumer, 1);
    for (i, id) in ids[..10].iter().enumerate() {
        s.publish(id, i).await;
    }
    s.wait_for(&[&name], 10).await;
    store.set_down(true);
    for (i, id) in ids.iter().enumerate().skip(10) {
        s.publish(id, i).await;
    }
    // Deliveries wait unacked in the outage gate well past the consumer timeout.
    eventually("deliveries held through the outage", || async {
        match store.refused() {
            n if n >= 4 => Ok(()),
            n => Err(format!("{n} refused calls")),
        }
    })
    .await;
    let queue = inbox::rabbitmq::queue_name(&s.source, name.as_str());
    eventually(
        "the broker closed the consumer's channel (consumer timeout)",
        || async {
            match queue_column(&queue, "consumers").await.as_deref() {
                Some("0") => Ok(()),
                other => Err(format!("consumers on {queue}: {other:?}")),
            }
        },
    )
    .await;
    store.set_down(false);
    s.wait_for(&[&name], ids.len()).await;
    assert!(running.is_running(), "the consumer is still running");
    running.stop().await;
    s.assert_exactly_once(&[&name], &ids).await;
    let report = consumer.report();
    assert!(
        report.ack_failures > 0,
        "the broker closed the channel under the held deliveries (their acks were lost): {report:?}"
    );
}

/// A transport whose queues expire unused after 10 minutes (tests' queues leave nothing behind).
async fn expiring_queues() -> inbox::rabbitmq::RabbitMqTransport {
    use inbox::rabbitmq::{RabbitMqConfig, RabbitMqTransport};

    RabbitMqTransport::connect(
        conformance::services::amqp_url(),
        RabbitMqConfig::default().queue_expires(std::time::Duration::from_secs(600)),
    )
    .await
    .unwrap()
}

/// Two readers of one dead-letter queue at once (two operators replaying): each counts the
/// letters ready when it begins, and the broker shares them out between the two, so neither gets
/// its count — each must end anyway, not wait for letters the other holds (review #26). Every
/// round starts both reads together, so that both count before either consumes.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_readers_of_one_dead_letter_queue_both_end() {
    use futures::StreamExt;
    use inbox::Transport as _;

    let transport = expiring_queues().await;
    let destination = format!("readers-{}.dead-letter", uuid::Uuid::new_v4().simple());
    // The first read declares the queue.
    drop(transport.read_dead_letters(&destination).await.unwrap());
    // Rounds in which a reader counted letters the other took: it ends only by waiting out its
    // idle time (10 s) — what the test is about.
    let mut outwaited = 0;
    for round in 0..2 {
        for i in 0..20 {
            transport
                .publish(
                    &destination,
                    inbox::OutgoingMessage::new(format!("letter-{round}-{i}"), "{}"),
                )
                .await
                .unwrap();
        }
        let (a, b) = tokio::join!(
            transport.read_dead_letters(&destination),
            transport.read_dead_letters(&destination)
        );
        let read = async {
            // Each reader holds what it gets (a replay holds letters that are not its own),
            // then both hand them back when the other is done too.
            let (a, b) = tokio::join!(
                a.unwrap().collect::<Vec<_>>(),
                b.unwrap().collect::<Vec<_>>()
            );
            (a, b)
        };
        let began = std::time::Instant::now();
        let (a, b) = tokio::time::timeout(conformance::DEADLINE, read)
            .await
            .unwrap_or_else(|_| panic!("round {round}: a reader waited for ever"));
        assert_eq!(
            a.len() + b.len(),
            20,
            "round {round}: every letter read once"
        );
        if began.elapsed() >= std::time::Duration::from_secs(5) {
            outwaited += 1;
        }
        // Acked, so that the next round starts from an empty queue.
        for letter in a.into_iter().chain(b) {
            letter
                .unwrap()
                .ack(inbox::transport::AckToken::for_transport_tests())
                .await
                .unwrap();
        }
    }
    println!("rounds in which a reader counted letters the other took: {outwaited} of 2");
    assert!(
        outwaited > 0,
        "the readers never counted the same letters: the test proved nothing"
    );
}

/// A subscription that ends while another on the same connection holds a delivery: the held
/// delivery's ack still goes out. (lapin cancels a dropped consumer in the background and takes a
/// failure of that cancel — as when the channel's close overtakes it — for an error of the whole
/// connection, which voids every other channel's acks; seen as a dead-letter reader's lost acks.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_subscription_ending_leaves_the_other_subscriptions_acks_alone() {
    use futures::StreamExt;
    use inbox::Transport as _;

    let transport = expiring_queues().await;
    let run = uuid::Uuid::new_v4().simple();
    let (held, empty) = (
        format!("held-{run}.dead-letter"),
        format!("empty-{run}.dead-letter"),
    );
    drop(transport.read_dead_letters(&held).await.unwrap());
    drop(transport.read_dead_letters(&empty).await.unwrap());
    for round in 0..20 {
        transport
            .publish(
                &held,
                inbox::OutgoingMessage::new(format!("held-{round}"), "{}"),
            )
            .await
            .unwrap();
        let mut letters = transport.read_dead_letters(&held).await.unwrap();
        let letter = tokio::time::timeout(conformance::DEADLINE, letters.next())
            .await
            .expect("the held letter arrives")
            .expect("one letter")
            .unwrap();
        // Subscriptions that end at once, beside the one that holds a delivery, many at a time
        // (the race is narrow).
        futures::future::join_all((0..100).map(|_| async {
            drop(transport.read_dead_letters(&empty).await.unwrap());
        }))
        .await;
        letter
            .ack(inbox::transport::AckToken::for_transport_tests())
            .await
            .unwrap_or_else(|e| panic!("round {round}: the held letter's ack was lost: {e}"));
    }
}

/// RabbitMQ's memory alarm, raised by a watermark no broker stays under; dropping the guard
/// sets the default watermark (0.4) back, which clears it.
struct MemoryAlarm;

impl MemoryAlarm {
    async fn raise() -> Self {
        let alarm = Self;
        rabbitmqctl(&["set_vm_memory_high_watermark", "0.0000001"]).await;
        eventually("the memory alarm is raised", || async {
            let alarms = rabbitmqctl(&["eval", "rabbit_alarm:get_alarms()."]).await;
            if alarms.contains("memory") {
                Ok(())
            } else {
                Err(alarms)
            }
        })
        .await;
        alarm
    }
}

impl Drop for MemoryAlarm {
    fn drop(&mut self) {
        let _ = std::process::Command::new("rabbitmqctl")
            .args(["set_vm_memory_high_watermark", "0.4"])
            .output();
    }
}

/// Under a memory alarm RabbitMQ blocks every connection that publishes and confirms nothing
/// (review #9). A message that fails permanently cannot get its dead letter out: it waits with
/// its consumer (each publish gives up after `publish_timeout`) without holding anything else up
/// — the messages beside it are handled and acked, since the consumers' connection is not the
/// publisher's — and shutdown drains within a deadline. After the alarm, the next run
/// dead-letters it. Changes a server-wide setting, so it runs alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_memory_alarm_holds_back_only_the_dead_letter_alone() {
    use conformance::{RefuseFirstPublishes, TestDb as _};
    use std::collections::HashSet;
    use std::time::Duration;

    conformance::init_tracing();
    let db = Arc::new(Postgres);
    let mut rabbit = RabbitMq::new(QueueType::Classic);
    rabbit.config = rabbit.config.publish_timeout(Duration::from_secs(2));
    let s = Scenario::new(&rabbit, &db, Faults::none()).await;
    let name = s.name("alarm");
    s.broker.prepare(&s.source, &[&name]).await;
    let broken = s.id(0);
    let good: Vec<String> = (1..=20).map(|i| s.id(i)).collect();
    s.publish(&broken, 0).await;
    for (i, id) in good.iter().enumerate() {
        s.publish(id, i + 1).await;
    }
    let observed = Arc::new(RefuseFirstPublishes::new(
        s.broker.transport(),
        s.dead_letter_destination(),
        0,
    ));
    let script = Arc::new(Script {
        permanent: HashSet::from([broken.clone()]),
        ..Script::default()
    });
    let consumer = s.consumer_on(observed.clone(), &name, &script);

    let alarm = MemoryAlarm::raise().await;
    let running = Running::start(&consumer, 1);
    s.wait_for_effects(good.len() as i64).await;
    eventually(
        "the dead letter's publish timed out under the alarm",
        || async {
            match observed.failed() {
                0 => Err("no failed publish yet".to_owned()),
                _ => Ok(()),
            }
        },
    )
    .await;
    let queue = inbox::rabbitmq::queue_name(&s.source, name.as_str());
    eventually(
        "the others acked: one message left, unacknowledged",
        || async {
            let ready = queue_column(&queue, "messages_ready").await;
            let unacked = queue_column(&queue, "messages_unacknowledged").await;
            match (ready.as_deref(), unacked.as_deref()) {
                (Some("0"), Some("1")) => Ok(()),
                other => Err(format!("ready, unacknowledged: {other:?}")),
            }
        },
    )
    .await;
    tokio::time::timeout(Duration::from_secs(30), running.stop())
        .await
        .expect("the consumer drains under the alarm");
    let row = s.db.row(&s.store, &name, &broken).await;
    assert!(
        !row.is_some_and(|r| r.dead),
        "not marked dead before its letter is out"
    );

    drop(alarm);
    let running = Running::start(&consumer, 1);
    s.dead_letters_of(&[&broken]).await;
    eventually("settled", || async {
        s.broker.settled(&s.source, &[&name]).await
    })
    .await;
    running.stop().await;
    s.assert_exactly_once(&[&name], &good).await;
    let row =
        s.db.row(&s.store, &name, &broken)
            .await
            .expect("a dead row");
    assert!(row.dead, "{row:?}");
}

/// A message whose AMQP `message_id` is not UTF-8 — pika publishes it; lapin (and so our own
/// publisher) cannot even represent it — kills the consuming connection at every delivery: lapin
/// refuses the frame. On a quorum queue the broker counts those deliveries and, past the
/// transport's delivery limit, moves the message to the consumer's quarantine queue. The
/// messages before and after it are handled once each (one at a time after the first failure,
/// so that none of them is counted with it), and the consumer never stops.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_unparsable_message_goes_to_quarantine() {
    use inbox::RetryPolicy;
    use inbox::rabbitmq::quarantine_name;
    use std::time::Duration;

    conformance::init_tracing();
    let brokers = RabbitMq {
        config: RabbitMq::new(QueueType::Quorum)
            .config
            .delivery_limit(Some(3)),
        url: None,
    };
    let db = Arc::new(Postgres);
    let s = Scenario::new(&brokers, &db, Faults::none()).await;
    let name = s.name("unparsable");
    s.broker.prepare(&s.source, &[&name]).await;
    let (before, after) = (s.id(0), s.id(1));
    s.publish(&before, 0).await;
    let url = conformance::services::amqp_url();
    tokio::time::timeout(
        conformance::DEADLINE,
        conformance::python(
            "pika publish",
            r#"
import sys, pika
connection = pika.BlockingConnection(pika.URLParameters(sys.argv[1]))
channel = connection.channel()
channel.confirm_delivery()
channel.basic_publish(sys.argv[2], "", b'{"n": 9}',
    pika.BasicProperties(message_id=b"\xff\xfe-not-utf8", delivery_mode=2), mandatory=True)
connection.close()
"#,
            &[&url, &s.source],
        ),
    )
    .await
    .expect("the pika publish returns");
    s.publish(&after, 1).await;
    let consumer = s.consumer(&name, &Arc::new(Script::default())).retry(
        RetryPolicy::default()
            .with_max_deliveries(2)
            .with_delays(Duration::from_millis(5), Duration::from_millis(40)),
    );
    let running = Running::start(&consumer, 1);
    s.wait_for(&[&name], 2).await;
    let quarantine = quarantine_name(&s.source, name.as_str());
    eventually("the unparsable message in quarantine", || async {
        match queue_column(&quarantine, "messages").await.as_deref() {
            Some("1") => Ok(()),
            other => Err(format!("{quarantine}: {other:?}")),
        }
    })
    .await;
    assert!(running.is_running(), "the consumer is still running");
    running.stop().await;
    s.assert_exactly_once(&[&name], &[before, after]).await;
}

/// A consumer queue that exists with other arguments (declared by an older version without the
/// quarantine) cannot be redeclared — RabbitMQ refuses with 406 — and its arguments cannot change
/// in place: the transport uses it as it is, with a warning naming the policy that adds what it
/// lacks, instead of failing the subscription.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queue_declared_with_other_arguments_is_used_as_it_is() {
    use inbox::transport::Subscription;
    use inbox::{ConsumerName, Transport};

    let source = format!("inequivalent.{}", uuid::Uuid::new_v4().simple());
    let older = RabbitMq {
        config: RabbitMq::new(QueueType::Quorum).config.delivery_limit(None),
        url: None,
    }
    .start_rabbit()
    .await;
    older
        .transport
        .declare_consumer_queue(&source, "c")
        .await
        .unwrap();
    let newer = RabbitMq::new(QueueType::Quorum).start_rabbit().await;
    newer
        .transport
        .declare_consumer_queue(&source, "c")
        .await
        .expect("the existing queue is used as it is");
    let subscription = Subscription::new(source.clone(), ConsumerName::new("c").unwrap(), 1);
    let stream = newer.transport.subscribe(&subscription).await;
    assert!(stream.is_ok(), "{:?}", stream.err());
}

/// Hostile input published by pika (another client, which can send what ours cannot) to the
/// demo's consumers on quorum queues, running as a separate process: every bad id and payload is
/// dead-lettered once per consumer with its reason, the message lapin cannot parse goes to each
/// consumer's quarantine queue, the valid ones are handled once, and the process drains on
/// SIGTERM with exit 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_input_from_another_client() {
    use conformance::demo::DemoConsumer;
    use conformance::hostile;
    use inbox::rabbitmq::{RabbitMqConfig, RabbitMqTransport, quarantine_name};

    let url = conformance::services::amqp_url();
    let source = format!("hostile-{}", uuid::Uuid::new_v4().simple());
    let run = uuid::Uuid::new_v4().simple().to_string()[..8].to_owned();
    // The demo's own queue arguments, declared before anything is published.
    // (A delivery limit of 3 rather than 25: each unparsable delivery costs a reconnection, at a
    // backoff that grows to 5 s.)
    let transport = RabbitMqTransport::new(
        url.clone(),
        RabbitMqConfig::default()
            .queue_type(QueueType::Quorum)
            .delivery_limit(Some(3)),
    );
    for consumer in ["notification", "carrier-assignment"] {
        transport
            .declare_consumer_queue(&source, consumer)
            .await
            .unwrap();
    }
    let demo = DemoConsumer::start(
        "rabbitmq",
        &source,
        &[
            ("AMQP_URL", url.clone()),
            ("RABBITMQ_QUEUE_TYPE", "quorum".to_owned()),
            ("RABBITMQ_DELIVERY_LIMIT", "3".to_owned()),
        ],
    )
    .await;
    hostile::publish_all("amqp", &url, &source, &run).await;
    let dead_letter = inbox::dead_letter::default_destination(&source);
    hostile::assert_settled(&demo, &run, || async {
        transport
            .peek_messages(&dead_letter, 1000)
            .await
            .unwrap_or_default()
    })
    .await;
    hostile::publish_unparsable(&url, &source, &run).await;
    for consumer in ["notification", "carrier-assignment"] {
        let quarantine = quarantine_name(&source, consumer);
        eventually(
            "the unparsable message in each consumer's quarantine",
            || async {
                match queue_column(&quarantine, "messages").await.as_deref() {
                    Some("1") => Ok(()),
                    other => Err(format!("{quarantine}: {other:?}")),
                }
            },
        )
        .await;
    }
    let letters = transport.peek_messages(&dead_letter, 1000).await.unwrap();
    assert_eq!(
        letters.len(),
        2 * (hostile::BAD_IDS.len() + hostile::BAD_PAYLOADS.len()),
        "no dead letter more"
    );
    demo.stop().await;
}

/// A batch handler's failures isolated by splitting (see the scenario).
mod whole_batch_splitting {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn on_postgres() {
        conformance::init_tracing();
        let db = std::sync::Arc::new(async { conformance::stores::Postgres }.await);
        conformance::whole_batches_isolate_the_failing_message(
            &RabbitMq::new(QueueType::Classic),
            &db,
        )
        .await;
    }
}
