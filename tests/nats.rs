//! The conformance suite on NATS JetStream (`NATS_URL`) with PostgreSQL, plus what only a real
//! server can show: the wire format other clients publish in, the duplicate window, and a
//! handler that outlasts the ack wait.

use inbox_test_kit::{self as conformance, conformance_suite};

use conformance::nats::Nats;

conformance_suite!(nats_postgres, Nats::new(), async {
    conformance::stores::Postgres
});
// Batch mode: a pull batch claimed in one statement, acked after one commit.
conformance_suite!(
    nats_postgres_batched,
    Nats::new(),
    async { conformance::stores::Postgres },
    batched = true
);
// Batch mode with a batch handler: each batch handled in one call, failures isolated by
// splitting the batch.
conformance_suite!(
    nats_postgres_whole_batches,
    Nats::new(),
    async { conformance::stores::Postgres },
    whole_batches
);

conformance::outbox_suite!(outbox_nats_postgres, Nats::new(), async {
    conformance::stores::Postgres
});

/// Publishes the demo's events with PyPI's `nats-py` (not our code) to `subject`: the first
/// `duplicated` twice with only a `message-id` header (both copies stored: the inbox must
/// discard one), the rest with only `Nats-Msg-Id`, the last `window` of those twice with the same
/// `Nats-Msg-Id` (JetStream's duplicate window drops the second: the script checks the ack says
/// so). Panics unless every publish was acknowledged.
async fn publish_with_nats_py(
    url: &str,
    subject: &str,
    events: usize,
    duplicated: usize,
    window: usize,
) {
    let script = r#"
import asyncio, json, sys, uuid
import nats
url, subject, events, duplicated, window = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
async def main():
    nc = await nats.connect(url)
    js = nc.jetstream()
    for n in range(events):
        payload = json.dumps({"parcel_id": str(uuid.uuid4()), "tracking_number": f"TRK-PY-{n}", "destination": "Oslo"}).encode()
        mid = f"py-{subject}-{n}"
        if n < duplicated:
            for _ in range(2):
                await js.publish(subject, payload, headers={"message-id": mid})
        else:
            ack = await js.publish(subject, payload, headers={"Nats-Msg-Id": mid})
            assert not ack.duplicate, ack
            if n >= events - window:
                again = await js.publish(subject, payload, headers={"Nats-Msg-Id": mid})
                assert again.duplicate, f"JetStream stored a copy within the window: {again}"
    await nc.close()
asyncio.run(main())
"#;
    let counts = [events, duplicated, window].map(|n| n.to_string());
    conformance::python(
        "nats-py publisher",
        script,
        &[url, subject, &counts[0], &counts[1], &counts[2]],
    )
    .await;
}

/// Messages published by PyPI's `nats-py` (not our code), with ids in `message-id` or only in
/// `Nats-Msg-Id`, some twice, are handled exactly once by the demo's consumers running as a
/// separate process that drains on SIGTERM.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_clients_messages_are_handled_once_by_the_demo() {
    use conformance::demo::DemoConsumer;
    use inbox::nats::testing::Inspect as _;

    let url = conformance::services::nats_url();
    let broker = Nats::new().start_nats().await;
    let source = format!("parcels-{}", uuid::Uuid::new_v4().simple());
    // The stream and both durable consumers first, so nothing published before the demo
    // subscribes is missed by either.
    let consumers = conformance::demo::consumers();
    conformance::declare_consumers(&*broker.transport, &source, &[&consumers[0], &consumers[1]])
        .await;
    let demo = DemoConsumer::start("nats", &source, &[("NATS_URL", url.clone())]).await;
    let (events, duplicated, window) = (30usize, 10usize, 10usize);
    publish_with_nats_py(&url, &source, events, duplicated, window).await;
    demo.wait_for_effects(events as i64).await;
    conformance::demo::eventually_acked(|consumer| {
        let (transport, source) = (&broker.transport, &source);
        async move { transport.pending(source, &consumer).await }
    })
    .await;
    demo.stop_exactly_once(events as u64, duplicated as u64)
        .await;
}

/// A delivery held three times as long as the ack wait is not handed to another instance: the
/// transport keeps it alive with in-progress acks. Once it is dropped unsettled, an instance gets
/// it at once (within half the ack wait), counted as a second delivery.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_in_progress_outlives_the_ack_wait() {
    use futures::StreamExt;
    use inbox::nats::testing::Inspect as _;
    use inbox::nats::{NatsConfig, NatsTransport};
    use inbox::transport::Subscription;
    use std::time::Duration;

    let ack_wait = Duration::from_secs(2);
    let transport = NatsTransport::connect(
        conformance::services::nats_url(),
        NatsConfig::default()
            .ack_wait(ack_wait)
            .max_age(Some(Duration::from_secs(600))),
    )
    .await
    .unwrap();
    let source = format!("slow-{}", uuid::Uuid::new_v4().simple());
    let subscription =
        Subscription::new(source.clone(), inbox::ConsumerName::new("slow").unwrap(), 1);
    let mut first = inbox::Transport::subscribe(&transport, &subscription)
        .await
        .unwrap();
    let mut second = inbox::Transport::subscribe(&transport, &subscription)
        .await
        .unwrap();
    inbox::Transport::publish(
        &transport,
        &source,
        inbox::OutgoingMessage::new("slow-1", "{}"),
    )
    .await
    .unwrap();
    let held = tokio::select! {
        d = first.next() => d,
        d = second.next() => d,
    }
    .expect("a delivery")
    .expect("not an error");
    assert_eq!(held.delivery_count(), Some(1));
    // Both streams are polled for three ack waits: nothing may come (the held one is in
    // progress). This wait is the fault under test, not a synchronisation.
    let quiet = tokio::time::timeout(3 * ack_wait, async {
        tokio::select! {
            d = first.next() => d.map(|d| d.map(|d| d.delivery_count())),
            d = second.next() => d.map(|d| d.map(|d| d.delivery_count())),
        }
    })
    .await;
    assert!(quiet.is_err(), "redelivered while in progress: {quiet:?}");
    assert_eq!(transport.pending(&source, "slow").await.unwrap(), 1);
    drop(held);
    // Within half the ack wait: the nak of the drop, not the ack wait's expiry, brings it back.
    let again = tokio::time::timeout(ack_wait / 2, async {
        tokio::select! {
            d = first.next() => d,
            d = second.next() => d,
        }
    })
    .await
    .expect("handed back at once")
    .expect("a delivery")
    .expect("not an error");
    assert_eq!(again.delivery_count(), Some(2));
    assert!(again.redelivered());
    again
        .ack(inbox::transport::AckToken::for_transport_tests())
        .await
        .unwrap();
    conformance::eventually("acked", || async {
        match transport.pending(&source, "slow").await {
            Ok(0) => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
}

/// With deduplication on (the default), JetStream's duplicate window drops a producer's second
/// publish of an ordinary message — but never a dead letter or a replay carrying an id it has
/// seen: two consumers' dead letters of one message and a replay are all kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_duplicate_window_drops_retries_but_not_dead_letters_or_replays() {
    use inbox::dead_letter::headers as h;
    use inbox::nats::testing::Inspect as _;
    use inbox::nats::{NatsConfig, NatsTransport};
    use inbox::{OutgoingMessage, Transport as _};

    let transport = NatsTransport::connect(
        conformance::services::nats_url(),
        NatsConfig::default().max_age(Some(std::time::Duration::from_secs(600))),
    )
    .await
    .unwrap();
    let source = format!("window-{}", uuid::Uuid::new_v4().simple());
    let dead_letter = inbox::dead_letter::default_destination(&source);
    let message = OutgoingMessage::new("m-1", "{}");
    transport.publish(&source, message.clone()).await.unwrap();
    transport.publish(&source, message.clone()).await.unwrap();
    for consumer in ["a", "b"] {
        let letter = message
            .clone()
            .with_header(h::REASON, "permanent handler error: no")
            .with_header(h::CONSUMER, consumer);
        transport.publish(&dead_letter, letter).await.unwrap();
    }
    let replay = message.clone().with_header(h::REPLAY_FOR, "a");
    transport.publish(&source, replay).await.unwrap();

    let on_source = transport.messages(&source).await.unwrap();
    assert_eq!(on_source.len(), 2, "the message once, and its replay");
    assert!(
        on_source
            .iter()
            .all(|m| m.message_id.as_deref() == Some("m-1"))
    );
    let letters = transport.messages(&dead_letter).await.unwrap();
    assert_eq!(letters.len(), 2, "both consumers' dead letters");
}
