//! The metrics a run emits, read back through a recorder: processed, duplicates, failures,
//! retries and dead letters, labelled by consumer; and the sampled row gauges.

use inbox_test_kit as conformance;

use std::collections::HashSet;
use std::sync::Arc;

use conformance::stores::Sqlite;
use conformance::{Running, Scenario, Script};
use inbox::memory::Faults;
use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use metrics_util::{CompositeKey, MetricKind};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counters_after_a_run_with_duplicates_and_a_poison_message() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    recorder
        .install()
        .expect("the only recorder of this test binary");

    let db = Arc::new(Sqlite);
    let s = Scenario::new(&conformance::memory::Memory, &db, Faults::none()).await;
    let name = s.name("metrics");
    s.broker.prepare(&s.source, &[&name]).await;
    let ids: Vec<String> = (0..10).map(|i| s.id(i)).collect();
    for (i, id) in ids.iter().enumerate() {
        s.publish(id, i).await;
    }
    for id in &ids[..3] {
        s.publish(id, 0).await;
    }
    let poison = s.id(99);
    s.publish(&poison, 99).await;
    let script = Arc::new(Script {
        always_fail: HashSet::from([poison.clone()]),
        ..Script::default()
    });
    let consumer = s
        .consumer(&name, &script)
        .concurrency(1)
        .sample_stats_every(Some(std::time::Duration::from_millis(20)));
    let running = Running::start(&consumer, 1);
    s.wait_for(&[&name], ids.len()).await;
    conformance::eventually("the poison message dead-lettered", || async {
        if consumer.report().dead_lettered == 1 {
            Ok(())
        } else {
            Err(format!("{:?}", consumer.report()))
        }
    })
    .await;
    running.stop().await;

    // One snapshot: taking one drains the debugging recorder's counters.
    let snapshot = snapshotter.snapshot().into_vec();
    let counter = |metric: &str| -> u64 {
        snapshot
            .iter()
            .filter(|(key, ..)| is(key, metric, name.as_str()))
            .map(|(_, _, _, value)| match value {
                DebugValue::Counter(n) => *n,
                other => panic!("{metric} is not a counter: {other:?}"),
            })
            .sum()
    };
    assert_eq!(counter(inbox::metrics::PROCESSED), 10);
    assert_eq!(counter(inbox::metrics::DUPLICATES_DISCARDED), 3);
    assert_eq!(
        counter(inbox::metrics::FAILED),
        4,
        "max_attempts failed attempts"
    );
    assert_eq!(
        counter(inbox::metrics::RETRIED),
        2,
        "every failure but the last is retried (1 in process, then via the broker)"
    );
    assert_eq!(counter(inbox::metrics::DEAD_LETTERED), 1);
    let histograms: Vec<String> = snapshot
        .iter()
        .filter(|(key, ..)| {
            key.kind() == MetricKind::Histogram
                && is(key, inbox::metrics::CLAIM_SECONDS, name.as_str())
        })
        .map(|(key, ..)| key.key().name().to_owned())
        .collect();
    assert!(!histograms.is_empty(), "claim latency is recorded");

    // The gauges, sampled by a running instance: 10 processed rows and the dead one. (A
    // snapshot resets what it reads, so poll until a sample lands between two.)
    let running = Running::start(&consumer, 1);
    conformance::eventually("the row gauges sampled", || async {
        let snapshot = snapshotter.snapshot().into_vec();
        let gauge = |metric: &str| {
            snapshot
                .iter()
                .filter(|(key, ..)| is(key, metric, name.as_str()))
                .find_map(|(_, _, _, value)| match value {
                    DebugValue::Gauge(v) => Some(v.into_inner()),
                    _ => None,
                })
        };
        match (
            gauge(inbox::metrics::ROWS),
            gauge(inbox::metrics::DEAD_ROWS),
        ) {
            (Some(rows), Some(dead)) if rows == 11.0 && dead == 1.0 => Ok(()),
            other => Err(format!("(rows, dead) = {other:?}")),
        }
    })
    .await;
    running.stop().await;
}

fn is(key: &CompositeKey, metric: &str, consumer: &str) -> bool {
    key.key().name() == metric
        && key
            .key()
            .labels()
            .any(|l| l.key() == "consumer" && l.value() == consumer)
        && key
            .key()
            .labels()
            .any(|l| l.key() == "transport" && l.value() == "memory")
}
