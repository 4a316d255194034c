//! What the engine recorded through the `metrics` facade, read back by tests and the bench.

use std::sync::OnceLock;
use std::time::Duration;

use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};

/// The process's metrics recorder, installed on first use (nextest runs each test in a process
/// of its own; `cargo test` runs them in one, hence once).
pub fn snapshotter() -> &'static Snapshotter {
    static SNAPSHOTTER: OnceLock<Snapshotter> = OnceLock::new();
    SNAPSHOTTER.get_or_init(|| {
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        recorder
            .install()
            .expect("the only recorder of this process");
        snapshotter
    })
}

/// Claim latencies (`inbox_claim_seconds`) recorded for `consumer` since the last snapshot,
/// sorted. Taking a snapshot drains the other metrics' histograms too.
pub fn claim_latencies(consumer: &str) -> Vec<Duration> {
    let mut values: Vec<Duration> = snapshotter()
        .snapshot()
        .into_vec()
        .into_iter()
        .filter(|(key, ..)| {
            key.key().name() == inbox::metrics::CLAIM_SECONDS
                && key
                    .key()
                    .labels()
                    .any(|l| l.key() == "consumer" && l.value() == consumer)
        })
        .flat_map(|(.., value)| match value {
            DebugValue::Histogram(v) => v
                .into_iter()
                .map(|x| Duration::from_secs_f64(x.into_inner()))
                .collect(),
            _ => Vec::new(),
        })
        .collect();
    values.sort_unstable();
    values
}
