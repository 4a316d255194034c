//! Tests of the broker's behaviour as consumers see it: redelivery, groups, and seeded faults.

use futures::StreamExt;
use inbox_core::{AckToken, ConsumerName, OutgoingMessage, Subscription, Transport};

use super::*;

fn sub(topic: &str, group: &str) -> Subscription {
    Subscription::new(topic, ConsumerName::new(group).unwrap(), 10)
}

#[tokio::test]
async fn nack_and_drop_redeliver_ack_settles() {
    let broker = MemoryBroker::new();
    let mut stream = broker.subscribe(&sub("t", "g")).await.unwrap();
    broker
        .publish("t", OutgoingMessage::new("a", "1"))
        .await
        .unwrap();

    let first = stream.next().await.unwrap().unwrap();
    assert!(!first.redelivered());
    first.nack(true).await.unwrap();
    let second = stream.next().await.unwrap().unwrap();
    assert!(second.redelivered());
    assert_eq!(second.delivery_count(), Some(2));
    drop(second);
    let third = stream.next().await.unwrap().unwrap();
    assert_eq!(third.delivery_count(), Some(3));
    third.ack(AckToken::for_transport_tests()).await.unwrap();
    assert_eq!(broker.backlog("t", "g"), (0, 0));
    assert_eq!(broker.stats().requeued, 2);
}

#[tokio::test]
async fn groups_fan_out_and_instances_compete() {
    let broker = MemoryBroker::new();
    let mut a1 = broker.subscribe(&sub("t", "a")).await.unwrap();
    let mut a2 = broker.subscribe(&sub("t", "a")).await.unwrap();
    for i in 0..2 {
        broker
            .publish("t", OutgoingMessage::new(format!("m{i}"), "x"))
            .await
            .unwrap();
    }
    // A group created later still gets everything.
    let mut b = broker.subscribe(&sub("t", "b")).await.unwrap();
    let x = a1.next().await.unwrap().unwrap();
    let y = a2.next().await.unwrap().unwrap();
    assert_ne!(x.broker_message_id(), y.broker_message_id());
    assert_eq!(broker.backlog("t", "a"), (0, 2));
    for _ in 0..2 {
        b.next()
            .await
            .unwrap()
            .unwrap()
            .ack(AckToken::for_transport_tests())
            .await
            .unwrap();
    }
    assert_eq!(broker.backlog("t", "b"), (0, 0));
}

async fn run_schedule(seed: u64) -> (Vec<String>, BrokerStats) {
    let faults = Faults::seeded(seed)
        .duplicate_publish(0.3)
        .lose_ack(0.3)
        .concurrent_copy(0.3)
        .reorder(0.5);
    let broker = MemoryBroker::with_faults(faults);
    let mut stream = broker.subscribe(&sub("t", "g")).await.unwrap();
    for i in 0..50 {
        broker
            .publish("t", OutgoingMessage::new(format!("m{i}"), "x"))
            .await
            .unwrap();
    }
    let mut seen = Vec::new();
    while broker.backlog("t", "g") != (0, 0) {
        let d = stream.next().await.unwrap().unwrap();
        seen.push(String::from_utf8(d.broker_message_id().unwrap().to_vec()).unwrap());
        d.ack(AckToken::for_transport_tests()).await.unwrap();
    }
    (seen, broker.stats())
}

#[tokio::test]
async fn faults_are_deterministic_from_the_seed() {
    let (a, stats_a) = run_schedule(7).await;
    let (b, stats_b) = run_schedule(7).await;
    assert_eq!(a, b);
    assert_eq!(stats_a, stats_b);
    assert!(stats_a.injected_duplicates > 0 && stats_a.injected_lost_acks > 0);
    assert!(stats_a.injected_concurrent_copies > 0 && stats_a.injected_reorders > 0);
    let (c, _) = run_schedule(8).await;
    assert_ne!(a, c);
    // Every message got through at least once.
    for i in 0..50 {
        assert!(a.contains(&format!("m{i}")));
    }
}
