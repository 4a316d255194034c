//! The project's test kit (not published): the conformance suite — every scenario written once,
//! as a plain async function over a broker factory and a database, and run on every (transport,
//! store) pair by [`conformance_suite!`] — with the broker and store factories it runs on, the
//! fault-injecting wrappers ([`flaky`] for the store, [`wrappers`] for transports), and the demo-process runner ([`demo`]) that the
//! cross-client tests and the crash harness share.
//!
//! The integration tests in `tests/` use it as `use inbox_test_kit as conformance;`. How to add
//! a scenario, a transport or a store: `docs/design.md`, "Contributing".

pub mod demo;
pub mod flaky;
pub mod hostile;
pub mod kafka;
pub mod memory;
pub mod metrics;
pub mod nats;
pub mod publishing;
pub mod rabbitmq;
pub mod redis;
pub mod scenarios;
pub mod services;
pub mod stores;
pub mod world;
pub mod wrappers;

pub use scenarios::*;
pub use world::{Hook, Running, Scenario, Script, TestHandler, refusing};
pub use wrappers::{CrashBeforeFirstAck, RefuseFirstPublishes};

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use inbox::memory::Faults;
use inbox::{ConsumerName, OutgoingMessage, Transport};

pub use stores::TestDb;

tokio::task_local! {
    /// Set by `conformance_suite!(…, batched)`: the scenarios' consumers run in batch mode.
    pub static BATCHED: bool;
    /// Set by `conformance_suite!(…, whole_batches)`: in batch mode, the test handler handles
    /// each batch in one call (a `BatchHandler`), not one message per savepoint.
    pub static WHOLE_BATCHES: bool;
    /// Set by `conformance_suite!(…, dedup = …)` and `offsets_suite!`: how the scenarios'
    /// consumers tell copies from new messages.
    pub static DEDUP: inbox::Dedup;
}

/// How this scenario's consumers dedup (default: by id).
pub fn dedup() -> inbox::Dedup {
    DEDUP.try_with(|d| *d).unwrap_or_default()
}

#[doc(hidden)]
pub use inbox::Dedup as __Dedup;

/// The suite macro's modes: batch mode, and whole batches (given alone: batch mode only).
#[doc(hidden)]
pub fn modes(modes: impl Into<Modes>) -> (bool, bool) {
    let Modes(batched, whole) = modes.into();
    (batched, whole)
}

#[doc(hidden)]
pub struct Modes(bool, bool);

impl From<bool> for Modes {
    fn from(batched: bool) -> Self {
        Modes(batched, false)
    }
}

impl From<(bool, bool)> for Modes {
    fn from((batched, whole): (bool, bool)) -> Self {
        Modes(batched, whole)
    }
}

/// Whether this scenario's consumers run in batch mode.
pub fn batched() -> bool {
    BATCHED.try_with(|b| *b).unwrap_or(false)
}

/// The most calls more than per message a batch handler may make with one message in the
/// suite's batches of 16: the failing batch and its two whole retries, then up to four
/// halvings before the message is alone — and once more, in the few scenarios that run it
/// again after a fallback.
pub const WHOLE_BATCH_EXTRA_CALLS: u32 = 8;

/// Whether this scenario's test handler is a batch handler (in batch mode).
pub fn whole_batches() -> bool {
    WHOLE_BATCHES.try_with(|w| *w).unwrap_or(false)
}

/// How long any scenario waits for a condition before it fails.
pub const DEADLINE: Duration = Duration::from_secs(60);

/// A broker prepared for one scenario.
#[async_trait]
pub trait TestBroker: Send + Sync {
    /// A transport on this broker (instances may share it).
    fn transport(&self) -> Arc<dyn Transport>;
    /// Declares what a publish before the first subscription needs (queues, groups).
    async fn prepare(&self, source: &str, consumers: &[&ConsumerName]);
    /// `Ok` when nothing waits and nothing is unacknowledged for these consumers.
    async fn settled(&self, source: &str, consumers: &[&ConsumerName]) -> Result<(), String>;
    /// Everything published to `destination` so far.
    async fn published(&self, destination: &str) -> Vec<OutgoingMessage>;
    /// Broker connections opened so far (more than one: the transport reconnected).
    fn connections_opened(&self) -> usize {
        1
    }
}

/// Makes a fresh broker per scenario.
#[async_trait]
pub trait BrokerFactory: Send + Sync {
    /// For test names and messages.
    fn name(&self) -> &'static str;
    /// Whether [`start`](Self::start) honours injected faults.
    fn injects_faults(&self) -> bool;
    /// A broker; `faults` where supported.
    async fn start(&self, faults: Faults) -> Box<dyn TestBroker>;
}

/// Runs `script` with `python3 -c` and `args` (a third-party client: PyPI's confluent-kafka,
/// pika, nats-py, redis); panics unless it exits 0, naming `client` and quoting its stderr.
pub async fn python(client: &str, script: &str, args: &[&str]) {
    let output = tokio::process::Command::new("python3")
        .arg("-c")
        .arg(script)
        .args(args)
        .kill_on_drop(true)
        .output()
        .await
        .expect("python3 runs");
    assert!(
        output.status.success(),
        "{client} (scripts/test installs it): {}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// [`TestBroker::settled`] for a broker that tells what each consumer has left (`pending`: not
/// yet delivered or not yet acked) beside the deliveries its transport has out (`unsettled`).
pub async fn settled_by_pending<F, Fut>(
    consumers: &[&ConsumerName],
    unsettled: usize,
    mut pending: F,
) -> Result<(), String>
where
    F: FnMut(String) -> Fut,
    Fut: std::future::Future<Output = Result<u64, inbox::TransportError>>,
{
    let mut left = Vec::new();
    for consumer in consumers {
        match pending(consumer.as_str().to_owned())
            .await
            .map_err(|e| e.to_string())?
        {
            0 => {}
            n => left.push(format!("{consumer}: {n} pending or unacked")),
        }
    }
    if unsettled > 0 {
        left.push(format!("{unsettled} deliveries unsettled"));
    }
    if left.is_empty() {
        Ok(())
    } else {
        Err(left.join("; "))
    }
}

/// Declares `consumers` of `source` on `transport` (streams, groups, durables), so that nothing
/// published before they first subscribe is missed.
pub async fn declare_consumers(
    transport: &dyn Transport,
    source: &str,
    consumers: &[&ConsumerName],
) {
    for consumer in consumers {
        let subscription = inbox::transport::Subscription::new(source, (*consumer).clone(), 1);
        transport
            .declare(&subscription)
            .await
            .expect("declare the consumer");
    }
}

/// Logs to the test output, filtered by `TEST_LOG` (for example `TEST_LOG=inbox_core=debug`).
pub fn init_tracing() {
    let filter =
        tracing_subscriber::EnvFilter::try_from_env("TEST_LOG").unwrap_or_else(|_| "off".into());
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_test_writer()
        .try_init();
}

/// Polls `check` until it returns `Ok`, failing with its last message at the deadline.
pub async fn eventually<F, Fut>(what: &str, check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<(), String>>,
{
    eventually_within(what, DEADLINE, check).await;
}

/// [`eventually`] with a deadline of its own.
pub async fn eventually_within<F, Fut>(what: &str, limit: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<(), String>>,
{
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        // A check that hangs (a broker call with no answer) fails at the deadline too.
        let last = match tokio::time::timeout_at(deadline, check()).await {
            Ok(Ok(())) => return,
            Ok(Err(e)) => e,
            Err(_) => "the last check did not return".to_owned(),
        };
        if tokio::time::Instant::now() >= deadline {
            panic!("{what}: not reached within {limit:?}: {last}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Generates one `#[tokio::test]` per outbox scenario for a (broker factory, database) pair.
#[macro_export]
macro_rules! outbox_suite {
    ($module:ident, $brokers:expr, $db:expr) => {
        mod $module {
            #[allow(unused_imports)]
            use super::*;
            $crate::conformance_suite!(@tests $brokers, $db, false, Ids;
                outbox_publishes_committed_rows_once,
                outbox_relays_share_the_work,
                outbox_relay_dies_between_publish_and_mark,
                outbox_keeps_key_order_under_out_of_order_commits,
                outbox_poison_row_holds_back_only_its_key,
                outbox_broker_outage_then_back,
                outbox_shutdown_drains_the_batch,
                outbox_retention_keeps_then_deletes,
                outbox_consume_transform_produce,
            );
        }
    };
}

/// Generates one `#[tokio::test]` per scenario for a (broker factory, database) pair.
#[macro_export]
macro_rules! conformance_suite {
    ($module:ident, $brokers:expr, $db:expr) => {
        $crate::conformance_suite!($module, $brokers, $db, batched = false);
    };
    ($module:ident, $brokers:expr, $db:expr, batched = $batched:expr) => {
        $crate::conformance_suite!($module, $brokers, $db, batched = $batched, whole = false);
    };
    // Batch mode with a batch handler: each batch handled in one call.
    ($module:ident, $brokers:expr, $db:expr, whole_batches) => {
        $crate::conformance_suite!($module, $brokers, $db, batched = true, whole = true);
    };
    ($module:ident, $brokers:expr, $db:expr, batched = $batched:expr, whole = $whole:expr) => {
        $crate::conformance_suite!(
            $module, $brokers, $db, batched = $batched, whole = $whole, dedup = Ids
        );
    };
    // Offsets mode with ids (`Dedup::OffsetsAndIds`): every scenario, producer duplicates too.
    ($module:ident, $brokers:expr, $db:expr, dedup = $dedup:ident) => {
        $crate::conformance_suite!(
            $module, $brokers, $db, batched = false, whole = false, dedup = $dedup
        );
    };
    (
        $module:ident, $brokers:expr, $db:expr,
        batched = $batched:expr, whole = $whole:expr, dedup = $dedup:ident
    ) => {
        mod $module {
            #[allow(unused_imports)]
            use super::*;
            $crate::conformance_suite!(@tests $brokers, $db, ($batched, $whole), $dedup;
                exactly_once_under_duplicates,
                crash_before_ack_leaves_one_effect,
                killed_and_restarted,
                concurrent_duplicates_never_commit_twice,
                failing_handler_is_retried_then_succeeds,
                two_consumers_each_handle_once,
                invalid_ids_are_dead_lettered,
                poison_messages_are_dead_lettered,
                shutdown_drains_in_flight,
                hostile_values_are_bound_parameters,
                cleanup_keeps_dead_letters,
                migrations_coexist_with_the_application,
                an_instance_joins_mid_stream,
                crash_looping_message_is_dead_lettered,
                dead_letters_are_replayed,
                store_outage_pauses_deliveries,
                swallowed_database_errors_lose_nothing,
                error_texts_with_nul_are_stored,
                store_faults_neither_wedge_nor_stop,
                dead_letters_the_broker_refuses_wait,
                store_bookkeeping_answers,
                store_keeps_offsets_monotone,
                producer_duplicates_by_dedup_mode,
            );
        }
    };
    (@tests $brokers:expr, $db:expr, $batched:expr, $dedup:ident; $($scenario:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $scenario() {
                $crate::init_tracing();
                let db = std::sync::Arc::new($db.await);
                let (batched, whole): (bool, bool) = $crate::modes($batched);
                let brokers = $brokers;
                let scenario = $crate::WHOLE_BATCHES.scope(whole, $crate::$scenario(&brokers, &db));
                $crate::DEDUP
                    .scope(
                        $crate::__Dedup::$dedup,
                        $crate::BATCHED.scope(batched, scenario),
                    )
                    .await;
            }
        )*
    };
}

/// The scenarios that hold in offsets mode alone (`Dedup::Offsets`), on a transport with log
/// positions: all but those whose producer sends a message twice, which offsets alone do not
/// catch (`producer_duplicates_by_dedup_mode` shows it).
#[macro_export]
macro_rules! offsets_suite {
    ($module:ident, $brokers:expr, $db:expr) => {
        $crate::offsets_suite!($module, $brokers, $db, batched = false, whole = false);
    };
    ($module:ident, $brokers:expr, $db:expr, batched = $batched:expr, whole = $whole:expr) => {
        mod $module {
            #[allow(unused_imports)]
            use super::*;
            $crate::conformance_suite!(@tests $brokers, $db, ($batched, $whole), Offsets;
                crash_before_ack_leaves_one_effect,
                killed_and_restarted,
                failing_handler_is_retried_then_succeeds,
                invalid_ids_are_dead_lettered,
                shutdown_drains_in_flight,
                an_instance_joins_mid_stream,
                crash_looping_message_is_dead_lettered,
                swallowed_database_errors_lose_nothing,
                error_texts_with_nul_are_stored,
                store_faults_neither_wedge_nor_stop,
                dead_letters_the_broker_refuses_wait,
                producer_duplicates_by_dedup_mode,
            );
        }
    };
}
