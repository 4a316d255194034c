//! A subscription's poll loop: it feeds the delivery stream and stores the offsets that
//! settlements free.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use inbox_core::{Delivery, TransportError};
use rdkafka::consumer::{CommitMode, Consumer};
use rdkafka::{Message, Offset, TopicPartitionList};
use tokio::sync::mpsc;

use crate::delivery::{KafkaDelivery, Settlement, headers_of};
use crate::error::{ClientError, consumer_error};
use crate::guard::{Guard, Orphans, Sample};
use crate::tracker::{KafkaConsumer, Tracker};

pub(crate) type Item = Result<Box<dyn Delivery>, TransportError>;

/// A subscription's poll loop, the consumer's only owner. It polls on its own, so that
/// rebalances are served while handlers run; it stores the offsets that settlements free; and
/// after the stream is dropped it waits for the deliveries still out, commits, and closes the
/// consumer off the async threads.
///
/// When the engine takes no more deliveries (every handler slot busy) the loop holds the one
/// record it has and stops polling until a slot frees; a rebalance waits that long. It does not
/// pause the partitions and poll on instead: on tansu 0.6, the broker the tests run on, fetching
/// never resumes after a pause — a plain confluent-kafka consumer shows the same.
///
/// Errors the client reports and recovers from by itself (a broker restarting, a connection
/// refused, a rebalance in progress) are logged and polling goes on with the same consumer and
/// group membership: ending the stream on them would make every instance leave and rejoin the
/// group at each broker blip. Only a fatal client error ends the stream (the engine subscribes
/// again with a fresh consumer), and an authorization error ends it for good. The
/// [orphaned-partition guard](crate::guard), when on, also ends it, transiently, when this
/// consumer sits idle beside a backlog that no member of its group seems to read.
pub(crate) async fn poll(
    consumer: KafkaConsumer,
    topic: String,
    tracker: Arc<Tracker>,
    sender: mpsc::Sender<Item>,
    unsettled: Arc<AtomicUsize>,
    closing: Arc<tokio::sync::watch::Sender<usize>>,
    (ordered, guard): (bool, Option<Guard>),
) {
    let consumer = Arc::new(consumer);
    let mut orphans = Orphans::default();
    // Without a guard the ticks are never polled (their branch is off).
    let check_every = guard
        .as_ref()
        .map_or(Duration::from_secs(3600), |g| g.every);
    let mut checks =
        tokio::time::interval_at(tokio::time::Instant::now() + check_every, check_every);
    checks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut checking: Option<tokio::task::JoinHandle<rdkafka::error::KafkaResult<Vec<Sample>>>> =
        None;
    let (settle, mut settlements) = mpsc::unbounded_channel();
    let mut outstanding = 0usize;
    let mut pending: Option<Item> = None;
    let mut streaming = true;
    // Once an error that ends the stream is queued, nothing more is read.
    let mut ending = false;
    let mut client_errors = 0u64;
    let mut last_error_log: Option<std::time::Instant> = None;
    while streaming || outstanding > 0 {
        tokio::select! {
            Some(settlement) = settlements.recv() => {
                outstanding -= 1;
                if let Settlement::Done { topic, partition, offset, generation } = settlement {
                    store(&consumer, &tracker, &topic, partition, offset, generation);
                }
            }
            permit = sender.reserve(), if streaming && pending.is_some() => match permit {
                Ok(permit) => {
                    let item = pending.take().expect("checked");
                    // An error ends this stream: the consumer subscribes again with a new one.
                    streaming = item.is_ok();
                    permit.send(item);
                }
                Err(_) => {
                    streaming = false;
                    pending = None;
                }
            },
            () = sender.closed(), if streaming && pending.is_none() => streaming = false,
            _ = checks.tick(), if guard.is_some() && streaming && !ending && checking.is_none() => {
                if outstanding == 0 && pending.is_none() {
                    let (consumer, topic) = (Arc::clone(&consumer), topic.clone());
                    checking = Some(tokio::task::spawn_blocking(move || crate::guard::sample(&*consumer, &topic)));
                } else {
                    orphans.forget();
                }
            }
            sampled = async { checking.as_mut().expect("checked").await }, if checking.is_some() => {
                checking = None;
                match sampled {
                    Ok(Ok(samples)) if outstanding == 0 && pending.is_none() && !ending => {
                        let guard = guard.as_ref().expect("checks run with a guard");
                        let frozen = orphans.observe(&samples, guard.strikes());
                        if !frozen.is_empty() {
                            tracing::warn!(%topic, partitions = ?frozen, checks = guard.strikes() + 1, "partitions not assigned to this consumer kept their backlog and committed offset over several session timeouts while it sat idle; rejoining the group");
                            guard.fired();
                            ending = true;
                            pending = Some(Err(TransportError::Disconnected(
                                format!("partitions {frozen:?} of {topic} orphaned in the group; rejoining").into(),
                            )));
                        }
                    }
                    Ok(Ok(_)) => orphans.forget(),
                    Ok(Err(e)) => tracing::debug!(error = %e, "orphaned-partition check"),
                    Err(e) => tracing::debug!(error = %e, "orphaned-partition check"),
                }
            }
            next = consumer.recv(), if streaming && !ending && pending.is_none() => {
                let item = match next {
                    Ok(message) => {
                        if let Some(guard) = &guard {
                            guard.received();
                        }
                        let (generation, first) = tracker.delivered(message.topic(), message.partition(), message.offset());
                        outstanding += 1;
                        unsettled.fetch_add(1, Ordering::SeqCst);
                        Ok(Box::new(KafkaDelivery {
                            topic: message.topic().to_owned(),
                            partition: message.partition(),
                            offset: message.offset(),
                            generation,
                            ordering_key: ordered
                                .then(|| format!("{}/{}", message.topic(), message.partition())),
                            payload: message.payload().unwrap_or_default().to_vec(),
                            headers: headers_of(&message),
                            maybe_redelivered: first,
                            settle: Some(settle.clone()),
                            unsettled: Arc::clone(&unsettled),
                        }) as Box<dyn Delivery>)
                    }
                    Err(e) => match consumer_error(e) {
                        ClientError::Recovers(e) => {
                            client_errors += 1;
                            if last_error_log.is_none_or(|at| at.elapsed() >= Duration::from_secs(10)) {
                                tracing::warn!(error = %e, errors = client_errors, "kafka consumer error; the client recovers by itself, polling on");
                                last_error_log = Some(std::time::Instant::now());
                                client_errors = 0;
                            }
                            continue;
                        }
                        ClientError::Ends(e) => {
                            tracing::warn!(error = %e, "kafka consumer failed");
                            ending = true;
                            Err(e)
                        }
                    },
                };
                pending = Some(item);
            }
        }
    }
    // Closing blocks (commit, leave the group): not on the async threads. Counted as closing from
    // here, so that a new subscription waits for it; a check still running holds the consumer
    // until it returns (each of its requests times out after 5 s).
    closing.send_modify(|n| *n += 1);
    if let Some(check) = checking {
        let _ = check.await;
    }
    let closed = tokio::task::spawn_blocking(move || {
        if let Err(e) = consumer.commit_consumer_state(CommitMode::Sync) {
            tracing::debug!(error = %e, "final commit");
        }
        drop(consumer);
    });
    let _ = closed.await;
    closing.send_modify(|n| *n -= 1);
}

/// Stores the offset a done record frees, if the contiguous done prefix of its partition grew.
fn store(
    consumer: &KafkaConsumer,
    tracker: &Tracker,
    topic: &str,
    partition: i32,
    offset: i64,
    generation: usize,
) {
    let Some(next) = tracker.done(topic, partition, offset, generation) else {
        return;
    };
    // store_offsets stores exactly the offset given — the next record to read — unlike
    // store_offset, which adds one (rust-rdkafka PR #851).
    let mut list = TopicPartitionList::new();
    if list
        .add_partition_offset(topic, partition, Offset::Offset(next))
        .is_err()
    {
        return;
    }
    if let Err(e) = consumer.store_offsets(&list) {
        // The partition moved to another instance: it will deliver the record again and the
        // inbox will discard it.
        tracing::debug!(error = %e, topic, partition, "offset not stored");
    }
}
