//! A subscription's poll loop: it feeds the delivery stream and stores the offsets that
//! settlements free.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use inbox_core::{Delivery, Headers, Offsets, StoreError, TransportError};
use rdkafka::consumer::{CommitMode, Consumer};
use rdkafka::{Message, Offset, TopicPartitionList};
use tokio::sync::mpsc;

use crate::delivery::{KafkaDelivery, Settlement, headers_of};
use crate::error::{ClientError, consumer_error};
use crate::guard::{Guard, Orphans, Sample};
use crate::tracker::{KafkaConsumer, Start, Tracker};

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
    (ordered, guard, offsets): (bool, Option<Guard>, Option<Offsets>),
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
    // Offsets mode: a partition's first record since its assignment, held while the offset
    // kept for the partition is read.
    let mut starting: Option<Starting> = None;
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
            _ = checks.tick(), if guard.is_some() && streaming && !ending && checking.is_none() && starting.is_none() => {
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
            started = async { (&mut starting.as_mut().expect("checked").kept).await }, if starting.is_some() => {
                let Starting { record, rebalances, .. } = starting.take().expect("checked");
                // A rebalance since the lookup: the record is dropped, and read again wherever
                // the partition's new assignment starts (looked up again then). Likewise once the
                // stream is ending (its error must not be overwritten): read again after it.
                if tracker.rebalances() != rebalances || ending {
                    continue;
                }
                let start = match start_at(&consumer, &record, started) {
                    Ok(start) => start,
                    Err(e) => {
                        ending = true;
                        pending = Some(Err(e));
                        continue;
                    }
                };
                if tracker.start(&record.topic, record.partition, start, rebalances) && start == Start::Open {
                    pending = Some(Ok(deliver(record, &tracker, ordered, &settle, &unsettled, &mut outstanding)));
                }
            }
            next = consumer.recv(), if streaming && !ending && pending.is_none() && starting.is_none() => {
                let item = match next {
                    Ok(message) => {
                        if let Some(guard) = &guard {
                            guard.received();
                        }
                        let record = Record {
                            topic: message.topic().to_owned(),
                            partition: message.partition(),
                            offset: message.offset(),
                            payload: message.payload().unwrap_or_default().to_vec(),
                            headers: headers_of(&message),
                        };
                        if let Some(offsets) = &offsets {
                            match tracker.admits(&record.topic, record.partition, record.offset) {
                                Some(true) => {}
                                Some(false) => continue,
                                None => {
                                    starting = Some(Starting {
                                        rebalances: tracker.rebalances(),
                                        kept: tokio::spawn(look_up(Arc::clone(&offsets.0), Arc::clone(&consumer), &record)),
                                        record,
                                    });
                                    continue;
                                }
                            }
                        }
                        Ok(deliver(record, &tracker, ordered, &settle, &unsettled, &mut outstanding))
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
    // A lookup still running is of no use now. Aborted while this loop still holds the client,
    // so the client is not dropped on an async thread; a watermark request in flight holds it
    // until that request times out (5 s).
    if let Some(Starting { kept, .. }) = starting {
        kept.abort();
        let _ = kept.await;
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

/// A record as read, before it is delivered.
struct Record {
    topic: String,
    partition: i32,
    offset: i64,
    payload: Vec<u8>,
    headers: Headers,
}

/// Offsets mode: a partition's first record since its assignment, and the lookup of the offset
/// kept for its partition.
struct Starting {
    record: Record,
    rebalances: usize,
    kept: tokio::task::JoinHandle<Result<Kept, StoreError>>,
}

/// The offset kept for a partition, and, where it is ahead of the record read, where the
/// partition's log ends (when the broker said).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Kept {
    next: Option<i64>,
    end: Option<i64>,
}

/// Reads the offset kept for `record`'s partition; when it is ahead of the record, also asks the
/// broker where the partition ends (off the async threads: the client blocks).
fn look_up(
    source: Arc<dyn inbox_core::OffsetSource>,
    consumer: Arc<KafkaConsumer>,
    record: &Record,
) -> impl std::future::Future<Output = Result<Kept, StoreError>> + Send + 'static {
    let (topic, partition, offset) = (record.topic.clone(), record.partition, record.offset);
    async move {
        let next = source.next_offset(&topic, partition).await?;
        let end = match next {
            Some(next) if next > offset => {
                let asked = topic.clone();
                let watermarks = tokio::task::spawn_blocking(move || {
                    consumer.fetch_watermarks(&asked, partition, Duration::from_secs(5))
                })
                .await
                .map_err(|e| e.to_string())
                .and_then(|answer| answer.map_err(|e| e.to_string()));
                match watermarks {
                    Ok((_, high)) => Some(high),
                    Err(error) => {
                        tracing::warn!(%error, topic, partition, next, "the partition's end is unknown: whether the kept offset is past it is not checked");
                        None
                    }
                }
            }
            _ => None,
        };
        Ok(Kept { next, end })
    }
}

/// Registers `record` with the tracker and makes it a delivery.
fn deliver(
    record: Record,
    tracker: &Tracker,
    ordered: bool,
    settle: &mpsc::UnboundedSender<Settlement>,
    unsettled: &Arc<AtomicUsize>,
    outstanding: &mut usize,
) -> Box<dyn Delivery> {
    let (generation, first) = tracker.delivered(&record.topic, record.partition, record.offset);
    *outstanding += 1;
    unsettled.fetch_add(1, Ordering::SeqCst);
    Box::new(KafkaDelivery {
        ordering_key: ordered.then(|| format!("{}/{}", record.topic, record.partition)),
        topic: record.topic,
        partition: record.partition,
        offset: record.offset,
        generation,
        payload: record.payload,
        headers: record.headers,
        maybe_redelivered: first,
        settle: Some(settle.clone()),
        unsettled: Arc::clone(unsettled),
    })
}

/// Offsets mode: where a partition starts, given its first record since the assignment and the
/// offset kept for it; seeks there when that is another record. The database, not the broker,
/// is the truth of what was consumed: a kept offset ahead of the broker's skips what was handled
/// and not yet committed to the broker, one behind it goes back (the broker's offsets were moved
/// by hand, or the database restored from a backup). A kept offset past the partition's end
/// belongs to another log — the topic deleted and created again, another cluster — and would
/// take every record up to it for a copy: an error, which stops the consumer.
fn start_at(
    consumer: &KafkaConsumer,
    record: &Record,
    kept: Result<Result<Kept, StoreError>, tokio::task::JoinError>,
) -> Result<Start, TransportError> {
    let (topic, partition, offset) = (record.topic.as_str(), record.partition, record.offset);
    let next = match kept
        .map_err(|e| e.to_string())
        .and_then(|read| read.map_err(|e| e.to_string()))
    {
        Ok(Kept {
            next: Some(next),
            end: Some(end),
        }) if next > end => {
            return Err(TransportError::Config(format!(
                "the offset kept in inbox_offsets for {topic}/{partition} is {next}, past the \
                 partition's end ({end}): the topic was deleted and created again, this is \
                 another cluster, or the broker lost records (a log truncated by an unclean \
                 leader election); delete this consumer's rows of {topic} in inbox_offsets to \
                 start at the broker's offsets"
            )));
        }
        Ok(Kept {
            next: Some(next), ..
        }) if next != offset => next,
        Ok(_) => return Ok(Start::Open),
        Err(error) => {
            // The claim still tells copies by their offsets; only the seek is lost.
            tracing::warn!(%error, topic, partition, "could not read the kept offset; starting at the broker's");
            return Ok(Start::Open);
        }
    };
    if next < offset {
        tracing::warn!(
            topic,
            partition,
            broker = offset,
            kept = next,
            "the kept offset is behind the broker's; going back to it"
        );
    } else {
        tracing::info!(
            topic,
            partition,
            broker = offset,
            kept = next,
            "starting at the kept offset"
        );
    }
    // Asynchronous (no timeout): records fetched before the seek are discarded by the client,
    // and any before `next` that still come are skipped.
    match consumer.seek(topic, partition, Offset::Offset(next), Duration::ZERO) {
        Ok(()) => {
            // The broker learns the position too (committed with the next auto-commit), so
            // that lag dashboards show none for records handled before.
            let mut list = TopicPartitionList::new();
            if list
                .add_partition_offset(topic, partition, Offset::Offset(next))
                .is_ok()
                && let Err(e) = consumer.store_offsets(&list)
            {
                tracing::debug!(error = %e, topic, partition, "kept offset not stored");
            }
            Ok(Start::At(next))
        }
        Err(e) if next > offset => {
            tracing::warn!(error = %e, topic, partition, "seek failed; skipping the records before the kept offset instead");
            Ok(Start::At(next))
        }
        Err(e) => {
            // Never lost: the broker's position is past records already handled.
            tracing::warn!(error = %e, topic, partition, "seek back failed; starting at the broker's offset");
            Ok(Start::Open)
        }
    }
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
