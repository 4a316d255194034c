//! The conformance suite on Redis Streams (`REDIS_URL`) with PostgreSQL, plus what only a real
//! server can show: entries written by another client, a handler that outlasts the visibility
//! timeout, and trimming that never removes an unacknowledged entry.

use inbox_test_kit::{self as conformance, conformance_suite};

use std::time::Duration;

use conformance::redis::Redis;
use futures::StreamExt;
use inbox::redis::testing::Inspect as _;
use inbox::redis::{RedisConfig, RedisTransport};
use inbox::transport::{AckToken, Subscription};
use inbox::{ConsumerName, OutgoingMessage, Transport as _};

conformance_suite!(redis_postgres, Redis::new(), async {
    conformance::stores::Postgres
});
// Batch mode: a read's entries claimed in one statement, acked after one commit.
conformance_suite!(
    redis_postgres_batched,
    Redis::new(),
    async { conformance::stores::Postgres },
    batched = true
);
// Batch mode with a batch handler: each batch handled in one call, failures isolated by
// splitting the batch.
conformance_suite!(
    redis_postgres_whole_batches,
    Redis::new(),
    async { conformance::stores::Postgres },
    whole_batches
);

conformance::outbox_suite!(outbox_redis_postgres, Redis::new(), async {
    conformance::stores::Postgres
});

/// Writes the demo's events with PyPI's `redis` (not our code) in the documented wire format,
/// `XADD <stream> * message-id <id> payload <body>`, the first `duplicated` twice. Panics unless
/// every write succeeded.
async fn write_with_redis_py(url: &str, stream: &str, events: usize, duplicated: usize) {
    let script = r#"
import json, sys, uuid
import redis
url, stream, events, duplicated = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
r = redis.Redis.from_url(url)
for n in range(events):
    payload = json.dumps({"parcel_id": str(uuid.uuid4()), "tracking_number": f"TRK-PY-{n}", "destination": "Oslo"})
    for _ in range(2 if n < duplicated else 1):
        r.xadd(stream, {"message-id": f"py-{stream}-{n}", "payload": payload, "tenant": "acme"})
"#;
    let counts = [events, duplicated].map(|n| n.to_string());
    conformance::python(
        "redis-py writer",
        script,
        &[url, stream, &counts[0], &counts[1]],
    )
    .await;
}

/// Entries written by PyPI's `redis` (not our code), some twice with the same `message-id`, are
/// handled exactly once by the demo's consumers running as a separate process that drains on
/// SIGTERM.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_clients_entries_are_handled_once_by_the_demo() {
    use conformance::demo::DemoConsumer;

    let url = conformance::services::redis_url();
    let broker = Redis::new().start_redis().await;
    let source = format!("parcels-{}", uuid::Uuid::new_v4().simple());
    let consumers = conformance::demo::consumers();
    conformance::declare_consumers(&*broker.transport, &source, &[&consumers[0], &consumers[1]])
        .await;
    let demo = DemoConsumer::start("redis", &source, &[("REDIS_URL", url.clone())]).await;
    let (events, duplicated) = (30usize, 10usize);
    write_with_redis_py(&url, &source, events, duplicated).await;
    demo.wait_for_effects(events as i64).await;
    conformance::demo::eventually_acked(|consumer| {
        let (transport, source) = (&broker.transport, &source);
        async move { transport.pending(source, &consumer).await }
    })
    .await;
    demo.stop_exactly_once(events as u64, duplicated as u64)
        .await;
}

async fn transport(config: RedisConfig) -> RedisTransport {
    RedisTransport::connect(conformance::services::redis_url(), config)
        .await
        .expect("connect to REDIS_URL")
}

/// A delivery held three times as long as the visibility timeout is not claimed by another
/// instance: its idle time is reset while it is in progress. Once it is dropped unsettled, the
/// other instance claims it at once, counted as a second delivery.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_in_progress_outlives_the_visibility_timeout() {
    let visibility = Duration::from_secs(2);
    let config = RedisConfig::default()
        .visibility_timeout(visibility)
        .claim_interval(Duration::from_millis(50))
        .block(Duration::from_millis(100));
    // Two processes' worth of instances: consumers of their own in the group.
    let (one, two) = (transport(config.clone()).await, transport(config).await);
    let source = format!("slow-{}", uuid::Uuid::new_v4().simple());
    let subscription = Subscription::new(source.clone(), ConsumerName::new("slow").unwrap(), 1);
    let mut first = one.subscribe(&subscription).await.unwrap();
    one.publish(&source, OutgoingMessage::new("slow-1", "{}"))
        .await
        .unwrap();
    let held = first
        .next()
        .await
        .expect("a delivery")
        .expect("not an error");
    assert_eq!(held.delivery_count(), Some(1));
    let mut second = two.subscribe(&subscription).await.unwrap();
    // The other instance claims every 50 ms for three visibility timeouts: nothing may come.
    // This wait is the fault under test, not a synchronisation.
    let quiet = tokio::time::timeout(3 * visibility, second.next()).await;
    assert!(
        quiet.is_err(),
        "claimed while in progress: {:?}",
        quiet.map(|d| d.map(|d| d.map(|d| d.delivery_count())))
    );
    drop(held);
    // Within half the visibility timeout: the hand-back, not the timeout, makes it claimable.
    let again = tokio::time::timeout(visibility / 2, second.next())
        .await
        .expect("claimable at once after the hand-back")
        .expect("a delivery")
        .expect("not an error");
    assert_eq!(again.delivery_count(), Some(2));
    // Counted by the server, not guessed: a third delivery says 3.
    drop(again);
    let third = tokio::time::timeout(visibility / 2, second.next())
        .await
        .expect("claimable at once after the hand-back")
        .expect("a delivery")
        .expect("not an error");
    assert_eq!(third.delivery_count(), Some(3));
    third.ack(AckToken::for_transport_tests()).await.unwrap();
    conformance::eventually("acked", || async {
        match two.pending(&source, "slow").await {
            Ok(0) => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
}

/// Trimming removes what every group has acked and nothing else: not an entry one group holds
/// pending, not one it has not read yet.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trimming_never_removes_an_unacknowledged_entry() {
    let transport = transport(RedisConfig::default().block(Duration::from_millis(100))).await;
    let source = format!("trim-{}", uuid::Uuid::new_v4().simple());
    let (fast, slow) = (
        Subscription::new(source.clone(), ConsumerName::new("fast").unwrap(), 100),
        Subscription::new(source.clone(), ConsumerName::new("slow").unwrap(), 1),
    );
    transport.declare(&fast).await.unwrap();
    transport.declare(&slow).await.unwrap();
    assert_eq!(transport.trim_acknowledged(&source).await.unwrap(), 0);
    for n in 0..200 {
        transport
            .publish(&source, OutgoingMessage::new(format!("m-{n}"), "{}"))
            .await
            .unwrap();
    }
    // The fast group acks everything; the slow one reads two entries, acks the second and
    // keeps the first pending: its last delivered entry is past the pending one.
    let mut fast_stream = transport.subscribe(&fast).await.unwrap();
    for _ in 0..200 {
        let delivery = fast_stream.next().await.unwrap().unwrap();
        delivery.ack(AckToken::for_transport_tests()).await.unwrap();
    }
    drop(fast_stream);
    let mut slow_stream = transport.subscribe(&slow).await.unwrap();
    let held = slow_stream.next().await.unwrap().unwrap();
    let second = slow_stream.next().await.unwrap().unwrap();
    second.ack(AckToken::for_transport_tests()).await.unwrap();
    assert_eq!(
        transport.trim_acknowledged(&source).await.unwrap(),
        0,
        "the pending first entry bounds it"
    );
    held.ack(AckToken::for_transport_tests()).await.unwrap();
    drop(slow_stream);
    assert_eq!(
        transport.trim_acknowledged(&source).await.unwrap(),
        1,
        "the first goes; the second (last delivered) and 198 unread stay"
    );
    // The slow group reads and acks 100 more: the second and 99 of those go (its last delivered
    // entry stays), the rest not.
    let mut slow_stream = transport.subscribe(&slow).await.unwrap();
    for _ in 0..100 {
        let delivery = slow_stream.next().await.unwrap().unwrap();
        delivery.ack(AckToken::for_transport_tests()).await.unwrap();
    }
    drop(slow_stream);
    assert_eq!(transport.trim_acknowledged(&source).await.unwrap(), 100);
    assert_eq!(transport.messages(&source).await.unwrap().len(), 99);
    assert_eq!(transport.pending(&source, "slow").await.unwrap(), 98);
    assert_eq!(transport.pending(&source, "fast").await.unwrap(), 0);
}

/// A crashed instance's consumer leaves the group once another instance has claimed its entry
/// and it stayed idle past the limit; the survivor stays and handles the entry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_instance_is_removed_from_its_group_once_its_entries_are_claimed() {
    let mut config = RedisConfig::default()
        .visibility_timeout(Duration::from_secs(1))
        .claim_interval(Duration::from_millis(50))
        .block(Duration::from_millis(100));
    // Below the setter's floor of a minute, for the test (the field is public; the transport
    // only checks that it is not below the visibility timeout).
    config.forget_idle_consumers = Duration::from_secs(1);
    let survivor = transport(config).await;
    let source = format!("forget-{}", uuid::Uuid::new_v4().simple());
    let subscription = Subscription::new(source.clone(), ConsumerName::new("c").unwrap(), 1);
    survivor.declare(&subscription).await.unwrap();
    survivor
        .publish(&source, OutgoingMessage::new("m-1", "{}"))
        .await
        .unwrap();
    // The crashed instance: a consumer of the group that read the entry and was killed (no
    // keep-alive, no hand-back; a transport in this process would still keep it alive).
    let mut conn = inbox::redis::redis::Client::open(conformance::services::redis_url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let _: inbox::redis::redis::Value = inbox::redis::redis::cmd("XREADGROUP")
        .arg("GROUP")
        .arg("c")
        .arg("inbox-crashed")
        .arg("COUNT")
        .arg(1)
        .arg("STREAMS")
        .arg(&source)
        .arg(">")
        .query_async(&mut conn)
        .await
        .unwrap();
    let consumers = || async {
        let mut conn = inbox::redis::redis::Client::open(conformance::services::redis_url())
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap();
        let reply: inbox::redis::redis::Value = inbox::redis::redis::cmd("XINFO")
            .arg("CONSUMERS")
            .arg(&source)
            .arg("c")
            .query_async(&mut conn)
            .await
            .unwrap();
        match reply {
            inbox::redis::redis::Value::Array(consumers) => consumers.len(),
            other => panic!("{other:?}"),
        }
    };
    assert_eq!(consumers().await, 1);
    let mut stream = survivor.subscribe(&subscription).await.unwrap();
    let claimed = tokio::time::timeout(conformance::DEADLINE, stream.next())
        .await
        .expect("claimed after the visibility timeout")
        .unwrap()
        .unwrap();
    assert_eq!(claimed.delivery_count(), Some(2));
    // The survivor's reader looks for idle consumers twice a second while it waits.
    let poll = async {
        conformance::eventually("the crashed instance removed", || async {
            match consumers().await {
                1 => Ok(()),
                n => Err(format!("{n} consumers")),
            }
        })
        .await
    };
    tokio::select! {
        () = poll => {}
        next = stream.next() => panic!("nothing else to deliver: {:?}", next.map(|d| d.map(|d| d.delivery_count()))),
    }
    claimed.ack(AckToken::for_transport_tests()).await.unwrap();
    assert_eq!(survivor.pending(&source, "c").await.unwrap(), 0);
}
