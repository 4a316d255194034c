//! The outbox's metrics as a Prometheus scrape shows them: published, failed and dead counters and
//! the commit-to-confirm latency by destination and transport; the relay's gauges of pending rows,
//! dead rows, blocked keys and lag, which go back to zero once the destination has nothing
//! pending (a gauge left at its last value would keep an alert firing). A test binary of its own:
//! it installs the process's recorder.

use std::sync::Arc;
use std::time::Duration;

use inbox::memory::Faults;
use inbox::outbox::{Outbox, OutboxStore};
use inbox::{CancellationToken, InboxStore, OutgoingMessage, Transport};
use inbox_test_kit::publishing::Publishing;
use inbox_test_kit::stores::Sqlite;
use inbox_test_kit::{Scenario, eventually};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

/// The value of `metric` for `destination` in a scrape (counters and gauges), summed over its
/// other labels; `None` if the scrape has no such line.
fn scraped(handle: &PrometheusHandle, metric: &str, destination: &str) -> Option<f64> {
    let label = format!("destination=\"{destination}\"");
    let values: Vec<f64> = handle
        .render()
        .lines()
        .filter(|line| {
            line.strip_prefix(metric)
                .is_some_and(|rest| rest.starts_with('{') && rest.contains(&label))
        })
        .filter_map(|line| line.rsplit(' ').next()?.parse().ok())
        .collect();
    (!values.is_empty()).then(|| values.iter().sum())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outbox_counters_and_gauges_through_a_dead_row_and_its_skip() {
    use inbox::metrics::outbox as m;

    let recorder = PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    metrics::set_global_recorder(recorder).expect("the only recorder of this test binary");

    let db = Arc::new(Sqlite);
    let s = Scenario::new(&inbox_test_kit::memory::Memory, &db, Faults::none()).await;
    s.broker.prepare(&s.source, &[&s.name("sink")]).await;
    let transport = Publishing::new(s.broker.transport());
    let outbox = Outbox::new(s.store.clone());
    // p1 is refused (dead at once) and holds back p2, of its key; the rest go out.
    let ids = ["p1", "p2", "q1", "u1", "u2"].map(|n| format!("{}-{n}", s.run));
    transport.refuse(&[&ids[0]]);
    for (id, key) in ids
        .iter()
        .zip([Some("kp"), Some("kp"), Some("kq"), None, None])
    {
        let mut message = OutgoingMessage::new(id.clone(), "{}");
        if let Some(key) = key {
            message = message.with_key(key.to_owned());
        }
        let mut tx = s.store.begin().await.unwrap();
        outbox.send(&mut tx, &s.source, message).await.unwrap();
        outbox.commit(tx).await.unwrap();
    }
    let relay = outbox
        .relay(Arc::clone(&transport) as Arc<dyn Transport>)
        .poll_interval(Duration::from_millis(20))
        .stats_interval(Duration::from_millis(20));
    let stop = CancellationToken::new();
    let running = tokio::spawn({
        let stop = stop.clone();
        async move { relay.run(stop).await }
    });
    let gauges = || {
        [
            m::PENDING,
            m::DEAD_ROWS,
            m::BLOCKED_KEYS,
            m::OLDEST_PENDING_SECONDS,
        ]
        .map(|name| scraped(&handle, name, &s.source))
    };
    eventually("the dead row and its blocked key in the gauges", || async {
        match gauges() {
            [Some(2.0), Some(1.0), Some(1.0), Some(oldest)] if oldest > 0.0 => Ok(()),
            other => Err(format!("(pending, dead, blocked, oldest) = {other:?}")),
        }
    })
    .await;
    let dead = s.store.outbox_dead(10).await.unwrap();
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(s.store.outbox_skip(&[dead[0].id]).await.unwrap(), 1);
    outbox.wake();
    eventually("p2 published, and every gauge back to zero", || async {
        match (transport.count(&ids[1]), gauges()) {
            (1, [Some(0.0), Some(0.0), Some(0.0), Some(0.0)]) => Ok(()),
            other => Err(format!("(p2 published, gauges) = {other:?}")),
        }
    })
    .await;
    stop.cancel();
    running.await.unwrap().unwrap();
    let counted = [m::PUBLISHED, m::FAILED, m::DEAD]
        .map(|name| scraped(&handle, name, &s.source).unwrap_or(0.0));
    assert_eq!(counted, [4.0, 1.0, 1.0], "published, failed, dead");
    assert_eq!(
        scraped(
            &handle,
            &format!("{}_count", m::COMMIT_TO_CONFIRM_SECONDS),
            &s.source
        ),
        Some(4.0),
        "one commit-to-confirm latency per published row"
    );
    assert!(handle.render().contains("transport=\"memory\""));
}
