//! The conformance suite: every scenario is written once, as a plain async function over a broker
//! factory and a database, and run on every (transport, store) pair by
//! [`conformance_suite!`](crate::conformance_suite).
#![allow(dead_code)]

// Loudly, rather than a test binary that compiles to nothing.
#[cfg(all(
    any(feature = "rabbitmq", feature = "kafka"),
    not(feature = "test-util")
))]
compile_error!("the RabbitMQ and Kafka tests inspect the transports: add --features test-util");

#[cfg(any(feature = "rabbitmq", feature = "kafka"))]
pub mod demo;
pub mod flaky;
#[cfg(any(feature = "rabbitmq", feature = "kafka"))]
pub mod hostile;
#[cfg(feature = "kafka")]
pub mod kafka;
pub mod memory;
#[cfg(feature = "rabbitmq")]
pub mod rabbitmq;
pub mod services;
pub mod stores;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use futures::StreamExt;
use futures::future::BoxFuture;
use inbox::dead_letter::headers as dead_letter_headers;
use inbox::memory::Faults;
use inbox::transport::{AckToken, Capabilities, Delivery, DeliveryStream, Subscription};
use inbox::{
    CancellationToken, Consumer, ConsumerError, ConsumerName, ConsumerReport, Handler,
    HandlerError, Headers, InboxAdmin, InboxStore, Message, OutgoingMessage, RetryPolicy,
    Transport, TransportError,
};
use tokio::task::JoinHandle;

pub use stores::TestDb;

tokio::task_local! {
    /// Set by `conformance_suite!(…, batched)`: the scenarios' consumers run in batch mode.
    pub static BATCHED: bool;
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

/// An async hook run by the test handler before it writes the effect: (message id, call number).
pub type Hook =
    Arc<dyn Fn(String, u32) -> BoxFuture<'static, Result<(), HandlerError>> + Send + Sync>;

/// A hook that fails permanently ("bug #17 refuses <id>") for the ids in `broken`, until they
/// are taken out of it (the fix is deployed).
pub fn refusing(broken: &Arc<Mutex<HashSet<String>>>) -> Hook {
    let broken = Arc::clone(broken);
    Arc::new(move |id: String, _call: u32| {
        let refused = broken.lock().unwrap().contains(&id);
        Box::pin(async move {
            if refused {
                Err(HandlerError::permanent(format!("bug #17 refuses {id}")))
            } else {
                Ok(())
            }
        })
    })
}

/// What the test handler does, per message id.
#[derive(Default)]
pub struct Script {
    /// Every message fails transiently on its first N calls.
    pub fail_first: u32,
    /// These ids always fail transiently.
    pub always_fail: HashSet<String>,
    /// These ids fail permanently.
    pub permanent: HashSet<String>,
    /// These ids panic on their first call.
    pub panic_once: HashSet<String>,
    /// Decode the payload as JSON `{"n": <number>, "kind"?: "a"}` first.
    pub decode_json: bool,
    /// These ids write their effect, then run a statement the database refuses, swallow its
    /// error and return Ok — on every call (`swallow_always`) or on the first only.
    pub swallow_always: HashSet<String>,
    pub swallow_once: HashSet<String>,
    /// These ids write their effect and then fail transiently, on their first call.
    pub fail_after_write_once: HashSet<String>,
    /// Scripted error texts carry a NUL character (as a decoder's error may, quoting a payload).
    pub nul_in_errors: bool,
    /// Runs before the effect is written.
    pub hook: Option<Hook>,
    pub calls: Mutex<HashMap<String, u32>>,
}

impl Script {
    /// Handler calls per id so far.
    pub fn calls(&self, id: &str) -> u32 {
        self.calls.lock().unwrap().get(id).copied().unwrap_or(0)
    }
}

#[derive(serde::Deserialize)]
#[allow(dead_code)]
struct Payload {
    n: u64,
    kind: Option<Kind>,
}

#[derive(serde::Deserialize)]
#[serde(rename_all = "lowercase")]
enum Kind {
    A,
}

/// The handler every scenario uses: writes one effect row per handled message, in the inbox
/// transaction, after doing what its [`Script`] says.
pub struct TestHandler<D: TestDb> {
    run: String,
    script: Arc<Script>,
    db: Arc<D>,
}

#[async_trait]
impl<D: TestDb> Handler<<D::Store as InboxStore>::Tx> for TestHandler<D> {
    async fn handle(
        &self,
        message: &Message<'_>,
        tx: &mut <D::Store as InboxStore>::Tx,
    ) -> Result<(), HandlerError> {
        let id = message.id.as_str().to_owned();
        let call = {
            let mut calls = self.script.calls.lock().unwrap();
            let n = calls.entry(id.clone()).or_default();
            *n += 1;
            *n
        };
        if self.script.decode_json {
            let _: Payload = message.json()?;
        }
        let nul = if self.script.nul_in_errors { "\0" } else { "" };
        if self.script.permanent.contains(&id) {
            return Err(HandlerError::permanent(format!(
                "{id} can never succeed{nul}"
            )));
        }
        if self.script.always_fail.contains(&id) {
            return Err(HandlerError::transient(format!(
                "{id} fails every time (call {call}){nul}"
            )));
        }
        if call <= self.script.fail_first {
            return Err(HandlerError::transient(format!(
                "scripted failure {call} of {id}{nul}"
            )));
        }
        if call == 1 && self.script.panic_once.contains(&id) {
            panic!("scripted panic in {id}");
        }
        if let Some(hook) = &self.script.hook {
            hook(id.clone(), call).await?;
        }
        self.db
            .write_effect(tx, &self.run, message.consumer.as_str(), &id)
            .await
            .map_err(HandlerError::from)?;
        let swallow = self.script.swallow_always.contains(&id)
            || (call == 1 && self.script.swallow_once.contains(&id));
        if swallow {
            // The "idempotent insert" anti-pattern: an error caught and ignored.
            let _ = self.db.failing_statement(tx).await;
        }
        if call == 1 && self.script.fail_after_write_once.contains(&id) {
            return Err(HandlerError::transient(format!(
                "{id} failed after writing its effect"
            )));
        }
        Ok(())
    }
}

/// One scenario's world: a fresh broker, a migrated store, and names unique to this run.
pub struct Scenario<D: TestDb> {
    pub db: Arc<D>,
    pub store: D::Store,
    pub broker: Box<dyn TestBroker>,
    pub run: String,
    pub source: String,
}

impl<D: TestDb> Scenario<D> {
    pub async fn new(brokers: &dyn BrokerFactory, db: &Arc<D>, faults: Faults) -> Self {
        let run = uuid::Uuid::new_v4().simple().to_string()[..12].to_owned();
        let store = db.store().await;
        let broker = brokers.start(faults).await;
        Self {
            db: Arc::clone(db),
            store,
            broker,
            source: format!("conformance.{run}"),
            run,
        }
    }

    /// A consumer name unique to this run.
    pub fn name(&self, base: &str) -> ConsumerName {
        ConsumerName::new(format!("{base}-{}", self.run)).unwrap()
    }

    /// A message id unique to this run.
    pub fn id(&self, i: usize) -> String {
        format!("{}-m{i}", self.run)
    }

    /// The dead-letter destination of this run's source.
    pub fn dead_letter_destination(&self) -> String {
        inbox::dead_letter::default_destination(&self.source)
    }

    /// A consumer with fast retries, ready to run.
    pub fn consumer(
        &self,
        name: &ConsumerName,
        script: &Arc<Script>,
    ) -> Consumer<D::Store, TestHandler<D>> {
        self.consumer_on(self.broker.transport(), name, script)
    }

    /// The test handler for this scenario, for consumers built by hand.
    pub fn handler(&self, script: &Arc<Script>) -> TestHandler<D> {
        TestHandler {
            run: self.run.clone(),
            script: Arc::clone(script),
            db: Arc::clone(&self.db),
        }
    }

    /// The same, on a given transport (for wrapped transports).
    pub fn consumer_on(
        &self,
        transport: Arc<dyn Transport>,
        name: &ConsumerName,
        script: &Arc<Script>,
    ) -> Consumer<D::Store, TestHandler<D>> {
        let handler = TestHandler {
            run: self.run.clone(),
            script: Arc::clone(script),
            db: Arc::clone(&self.db),
        };
        let consumer = Consumer::new(
            name.clone(),
            self.source.clone(),
            transport,
            self.store.clone(),
            handler,
        )
        .concurrency(4)
        .retry(
            RetryPolicy::default()
                .with_max_attempts(4)
                .with_in_process_retries(1)
                .with_delays(Duration::from_millis(5), Duration::from_millis(40)),
        )
        .reconnect_backoff(
            RetryPolicy::default()
                .with_delays(Duration::from_millis(10), Duration::from_millis(200)),
        );
        if BATCHED.try_with(|b| *b).unwrap_or(false) {
            consumer.batch(inbox::Batching::new(16, Duration::from_millis(5)))
        } else {
            consumer
        }
    }

    /// Publishes a JSON payload `{"n": i}` under `id` to the source.
    pub async fn publish(&self, id: &str, n: usize) {
        self.publish_raw(OutgoingMessage::new(id, format!(r#"{{"n":{n}}}"#)))
            .await;
    }

    pub async fn publish_raw(&self, message: OutgoingMessage) {
        self.broker
            .transport()
            .publish(&self.source, message)
            .await
            .expect("publish");
    }

    /// Effect rows per (consumer, message id) of this run.
    pub async fn effects(&self) -> HashMap<(String, String), i64> {
        self.db.effects(&self.store, &self.run).await
    }

    /// The dead letters of this run's source, once at least `n` can be read. (Some brokers show a
    /// topic's end a little after the publish was confirmed, and a read may come back short.)
    pub async fn dead_letters(&self, n: usize) -> Vec<OutgoingMessage> {
        let read = Mutex::new(Vec::new());
        eventually("dead letters readable", || async {
            let letters = self.broker.published(&self.dead_letter_destination()).await;
            let count = letters.len();
            *read.lock().unwrap() = letters;
            if count >= n {
                Ok(())
            } else {
                Err(format!("{count} of {n} dead letters"))
            }
        })
        .await;
        read.into_inner().unwrap()
    }

    /// Waits until a dead letter of each of `ids` is readable; returns every letter read (an id
    /// may have more than one: a dead mark that failed after the publish is tried again).
    pub async fn dead_letters_of(&self, ids: &[&str]) -> Vec<OutgoingMessage> {
        let read = Mutex::new(Vec::new());
        eventually("dead letters readable", || async {
            let letters = self.broker.published(&self.dead_letter_destination()).await;
            let named = reasons_by_id(&letters);
            let missing: Vec<&&str> = ids.iter().filter(|id| !named.contains_key(**id)).collect();
            *read.lock().unwrap() = letters;
            if missing.is_empty() {
                Ok(())
            } else {
                Err(format!("no dead letter yet of {missing:?}"))
            }
        })
        .await;
        read.into_inner().unwrap()
    }

    /// Waits until at least `target` effects exist.
    pub async fn wait_for_effects(&self, target: i64) {
        eventually("progress", || async {
            let total: i64 = self.effects().await.values().sum();
            if total >= target {
                Ok(())
            } else {
                Err(format!("{total} < {target} effects"))
            }
        })
        .await;
    }

    /// Waits until `expected` effects exist (counting duplicates) and the broker is settled.
    pub async fn wait_for(&self, consumers: &[&ConsumerName], expected: usize) {
        eventually("all messages handled and settled", || async {
            let total: i64 = self.effects().await.values().sum();
            if (total as usize) < expected {
                return Err(format!("{total} of {expected} effects"));
            }
            self.broker.settled(&self.source, consumers).await
        })
        .await;
    }

    /// Asserts exactly one effect for every (consumer, id) given, and nothing else.
    pub async fn assert_exactly_once(&self, consumers: &[&ConsumerName], ids: &[String]) {
        let effects = self.effects().await;
        let mut problems = Vec::new();
        for consumer in consumers {
            for id in ids {
                let n = effects
                    .get(&(consumer.to_string(), id.clone()))
                    .copied()
                    .unwrap_or(0);
                if n != 1 {
                    problems.push(format!("{consumer}/{id}: {n} effects"));
                }
            }
        }
        let expected = consumers.len() * ids.len();
        if effects.len() != expected {
            problems.push(format!(
                "{} distinct effects, expected {expected}",
                effects.len()
            ));
        }
        assert!(problems.is_empty(), "exactly-once violated: {problems:?}");
    }
}

/// Consumer instances running in the background.
pub struct Running {
    token: CancellationToken,
    handles: Vec<JoinHandle<Result<ConsumerReport, ConsumerError>>>,
}

impl Running {
    pub fn start<S: InboxStore, H: Handler<S::Tx>>(
        consumer: &Consumer<S, H>,
        instances: usize,
    ) -> Self {
        let token = CancellationToken::new();
        let handles = (0..instances)
            .map(|_| {
                let consumer = consumer.clone();
                let token = token.clone();
                tokio::spawn(async move { consumer.run(token).await })
            })
            .collect();
        Self { token, handles }
    }

    /// No instance has returned (with an error or otherwise).
    pub fn is_running(&self) -> bool {
        self.handles.iter().all(|h| !h.is_finished())
    }

    pub fn token(&self) -> &CancellationToken {
        &self.token
    }

    /// Cancels and waits for a clean drain.
    pub async fn stop(self) {
        self.token.cancel();
        for handle in self.handles {
            let result = tokio::time::timeout(DEADLINE, handle)
                .await
                .expect("the consumer drains within the deadline")
                .expect("the consumer task does not panic");
            result.expect("the consumer stops without error");
        }
    }

    /// Kills the instances like a crash: no drain, no acks for what was in flight.
    pub async fn abort(self) {
        for handle in self.handles {
            handle.abort();
            let _ = handle.await;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Transport wrappers the scenarios use to make faults on any broker.

/// Wraps a transport so that the first ack of each message is replaced by a requeue: from the
/// broker's side exactly what a consumer crash between commit and ack looks like.
#[derive(Debug)]
pub struct CrashBeforeFirstAck {
    inner: Arc<dyn Transport>,
    seen: Arc<Mutex<HashSet<Vec<u8>>>>,
    pub crashes: Arc<AtomicUsize>,
}

impl CrashBeforeFirstAck {
    pub fn new(inner: Arc<dyn Transport>) -> Self {
        Self {
            inner,
            seen: Arc::default(),
            crashes: Arc::default(),
        }
    }
}

#[derive(Debug)]
struct CrashingDelivery {
    inner: Box<dyn Delivery>,
    seen: Arc<Mutex<HashSet<Vec<u8>>>>,
    crashes: Arc<AtomicUsize>,
}

#[async_trait]
impl Delivery for CrashingDelivery {
    fn payload(&self) -> &[u8] {
        self.inner.payload()
    }
    fn headers(&self) -> &Headers {
        self.inner.headers()
    }
    fn broker_message_id(&self) -> Option<&[u8]> {
        self.inner.broker_message_id()
    }
    fn redelivered(&self) -> bool {
        self.inner.redelivered()
    }
    fn delivery_count(&self) -> Option<u32> {
        self.inner.delivery_count()
    }
    fn coordinates(&self) -> Option<String> {
        self.inner.coordinates()
    }
    fn ordering_key(&self) -> Option<&str> {
        self.inner.ordering_key()
    }
    async fn ack(self: Box<Self>, token: AckToken) -> Result<(), TransportError> {
        let key = self
            .inner
            .broker_message_id()
            .map(<[u8]>::to_vec)
            .or_else(|| self.inner.headers().get("message-id").map(<[u8]>::to_vec))
            .unwrap_or_default();
        if self.seen.lock().unwrap().insert(key) {
            self.crashes.fetch_add(1, Ordering::SeqCst);
            drop(token);
            return self.inner.nack(true).await;
        }
        self.inner.ack(token).await
    }
    async fn nack(self: Box<Self>, requeue: bool) -> Result<(), TransportError> {
        self.inner.nack(requeue).await
    }
}

#[async_trait]
impl Transport for CrashBeforeFirstAck {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
    async fn subscribe(
        &self,
        subscription: &Subscription,
    ) -> Result<DeliveryStream, TransportError> {
        let seen = Arc::clone(&self.seen);
        let crashes = Arc::clone(&self.crashes);
        let stream = self.inner.subscribe(subscription).await?;
        Ok(Box::pin(stream.map(move |item| {
            item.map(|inner| {
                Box::new(CrashingDelivery {
                    inner,
                    seen: Arc::clone(&seen),
                    crashes: Arc::clone(&crashes),
                }) as Box<dyn Delivery>
            })
        })))
    }
    async fn publish(
        &self,
        destination: &str,
        message: OutgoingMessage,
    ) -> Result<(), TransportError> {
        self.inner.publish(destination, message).await
    }
}

// ---------------------------------------------------------------------------------------------
// The scenarios.

fn faults_or_none(brokers: &dyn BrokerFactory, faults: Faults) -> Faults {
    if brokers.injects_faults() {
        faults
    } else {
        Faults::none()
    }
}

/// Duplicates from the producer (and, where the broker injects them, duplicate publishes, lost
/// acks, concurrent copies and reordering): every message has exactly one effect.
pub async fn exactly_once_under_duplicates<D: TestDb>(brokers: &dyn BrokerFactory, db: &Arc<D>) {
    let faults = Faults::seeded(11)
        .duplicate_publish(0.3)
        .lose_ack(0.2)
        .concurrent_copy(0.2)
        .reorder(0.3);
    let s = Scenario::new(brokers, db, faults_or_none(brokers, faults)).await;
    let name = s.name("dedup");
    s.broker.prepare(&s.source, &[&name]).await;
    let ids: Vec<String> = (0..120).map(|i| s.id(i)).collect();
    let mut producer_duplicates = 0;
    for (i, id) in ids.iter().enumerate() {
        s.publish(id, i).await;
        if i % 3 == 0 {
            s.publish(id, i).await;
            producer_duplicates += 1;
        }
    }
    let script = Arc::new(Script::default());
    let consumer = s.consumer(&name, &script);
    let running = Running::start(&consumer, 2);
    s.wait_for(&[&name], ids.len()).await;
    running.stop().await;
    s.assert_exactly_once(&[&name], &ids).await;
    let report = consumer.report();
    assert_eq!(report.processed, ids.len() as u64, "{report:?}");
    assert!(
        report.duplicates_discarded >= producer_duplicates,
        "{report:?}"
    );
    assert_eq!(report.failed, 0, "{report:?}");
}

/// The consumer "crashes" between commit and ack for every message: each comes back and is
/// discarded as a duplicate; one effect each.
pub async fn crash_before_ack_leaves_one_effect<D: TestDb>(
    brokers: &dyn BrokerFactory,
    db: &Arc<D>,
) {
    let s = Scenario::new(brokers, db, Faults::none()).await;
    let name = s.name("crash");
    s.broker.prepare(&s.source, &[&name]).await;
    let ids: Vec<String> = (0..40).map(|i| s.id(i)).collect();
    for (i, id) in ids.iter().enumerate() {
        s.publish(id, i).await;
    }
    let crashing = Arc::new(CrashBeforeFirstAck::new(s.broker.transport()));
    let script = Arc::new(Script::default());
    let consumer = s.consumer_on(crashing.clone(), &name, &script);
    let mut running = Running::start(&consumer, 1);
    if !crashing.capabilities().requeue {
        // Without requeue (Kafka) a message comes back only from the last committed offset:
        // after a restart, as after a real crash.
        eventually("every message handled once", || async {
            match consumer.report().processed {
                n if n == ids.len() as u64 => Ok(()),
                n => Err(format!("{n} processed")),
            }
        })
        .await;
        running.stop().await;
        running = Running::start(&consumer, 1);
    }
    eventually(
        "every message redelivered after its commit and discarded",
        || async {
            let report = consumer.report();
            if report.duplicates_discarded < ids.len() as u64 {
                return Err(format!("{report:?}"));
            }
            s.broker.settled(&s.source, &[&name]).await
        },
    )
    .await;
    running.stop().await;
    s.assert_exactly_once(&[&name], &ids).await;
    assert_eq!(crashing.crashes.load(Ordering::SeqCst), ids.len());
    assert_eq!(consumer.report().processed, ids.len() as u64);
}

/// Consumer instances killed mid-stream (no drain) and restarted: nothing lost, nothing doubled.
pub async fn killed_and_restarted<D: TestDb>(brokers: &dyn BrokerFactory, db: &Arc<D>) {
    let s = Scenario::new(brokers, db, Faults::none()).await;
    let name = s.name("killed");
    s.broker.prepare(&s.source, &[&name]).await;
    let ids: Vec<String> = (0..150).map(|i| s.id(i)).collect();
    for (i, id) in ids.iter().enumerate() {
        s.publish(id, i).await;
    }
    let script = Arc::new(Script {
        hook: Some(Arc::new(|_, _| {
            Box::pin(async {
                tokio::task::yield_now().await;
                Ok(())
            })
        })),
        ..Script::default()
    });
    let consumer = s.consumer(&name, &script);
    for round in 1..=5 {
        let running = Running::start(&consumer, 2);
        let target = (ids.len() * round / 6) as i64;
        s.wait_for_effects(target).await;
        running.abort().await;
    }
    let running = Running::start(&consumer, 2);
    s.wait_for(&[&name], ids.len()).await;
    running.stop().await;
    s.assert_exactly_once(&[&name], &ids).await;
}

/// Several instances get copies of the same messages at the same moment: no double commit.
pub async fn concurrent_duplicates_never_commit_twice<D: TestDb>(
    brokers: &dyn BrokerFactory,
    db: &Arc<D>,
) {
    let faults = Faults::seeded(5).concurrent_copy(0.5).max_per_message(2);
    let s = Scenario::new(brokers, db, faults_or_none(brokers, faults)).await;
    let name = s.name("concurrent");
    s.broker.prepare(&s.source, &[&name]).await;
    let ids: Vec<String> = (0..60).map(|i| s.id(i)).collect();
    for (i, id) in ids.iter().enumerate() {
        for _ in 0..3 {
            s.publish(id, i).await;
        }
    }
    let script = Arc::new(Script {
        // Widen the window between claim and commit.
        hook: Some(Arc::new(|_, _| {
            Box::pin(async {
                for _ in 0..5 {
                    tokio::task::yield_now().await;
                }
                Ok(())
            })
        })),
        ..Script::default()
    });
    let consumer = s.consumer(&name, &script);
    let running = Running::start(&consumer, 4);
    s.wait_for(&[&name], ids.len()).await;
    eventually("all copies settled", || async {
        let report = consumer.report();
        if report.duplicates_discarded >= 2 * ids.len() as u64 {
            Ok(())
        } else {
            Err(format!("{report:?}"))
        }
    })
    .await;
    running.stop().await;
    s.assert_exactly_once(&[&name], &ids).await;
    let report = consumer.report();
    assert_eq!(report.processed, ids.len() as u64, "{report:?}");
    assert_eq!(
        report.failed, 0,
        "a concurrent copy waits instead of failing: {report:?}"
    );
}

/// A handler that fails twice per message, then succeeds: retried in process and through the
/// broker, one effect each, the attempts recorded.
pub async fn failing_handler_is_retried_then_succeeds<D: TestDb>(
    brokers: &dyn BrokerFactory,
    db: &Arc<D>,
) {
    let s = Scenario::new(brokers, db, Faults::none()).await;
    let name = s.name("retry");
    s.broker.prepare(&s.source, &[&name]).await;
    let ids: Vec<String> = (0..20).map(|i| s.id(i)).collect();
    for (i, id) in ids.iter().enumerate() {
        s.publish(id, i).await;
    }
    let script = Arc::new(Script {
        fail_first: 2,
        panic_once: HashSet::from([ids[0].clone()]),
        ..Script::default()
    });
    let consumer = s.consumer(&name, &script);
    let running = Running::start(&consumer, 1);
    s.wait_for(&[&name], ids.len()).await;
    running.stop().await;
    s.assert_exactly_once(&[&name], &ids).await;
    let report = consumer.report();
    assert_eq!(report.failed, 2 * ids.len() as u64, "{report:?}");
    assert_eq!(report.dead_lettered, 0, "{report:?}");
    for id in &ids {
        assert_eq!(script.calls(id), 3, "{id}");
        let row = s.db.row(&s.store, &name, id).await.expect("row");
        assert!(row.processed && !row.dead, "{row:?}");
        assert_eq!(row.attempts, 2, "{id}: {row:?}");
    }
}

/// Two consumers of one source each handle every message once, independently.
pub async fn two_consumers_each_handle_once<D: TestDb>(brokers: &dyn BrokerFactory, db: &Arc<D>) {
    let s = Scenario::new(brokers, db, Faults::none()).await;
    let (a, b) = (s.name("notification"), s.name("carrier-assignment"));
    s.broker.prepare(&s.source, &[&a, &b]).await;
    let ids: Vec<String> = (0..30).map(|i| s.id(i)).collect();
    for (i, id) in ids.iter().enumerate() {
        s.publish(id, i).await;
        s.publish(id, i).await;
    }
    let script = Arc::new(Script::default());
    let (ca, cb) = (s.consumer(&a, &script), s.consumer(&b, &script));
    let (ra, rb) = (Running::start(&ca, 1), Running::start(&cb, 1));
    s.wait_for(&[&a, &b], 2 * ids.len()).await;
    ra.stop().await;
    rb.stop().await;
    s.assert_exactly_once(&[&a, &b], &ids).await;
    assert_eq!(ca.report().processed, ids.len() as u64);
    assert_eq!(cb.report().processed, ids.len() as u64);
}

fn header<'m>(message: &'m OutgoingMessage, name: &str) -> &'m str {
    message.headers.get_str(name).unwrap_or("")
}

/// Each dead letter's reason, by message id.
fn reasons_by_id(dead: &[OutgoingMessage]) -> HashMap<String, String> {
    dead.iter()
        .map(|m| {
            (
                header(m, dead_letter_headers::MESSAGE_ID).to_owned(),
                header(m, dead_letter_headers::REASON).to_owned(),
            )
        })
        .collect()
}

/// Missing, empty, over-long and non-UTF-8 ids are dead-lettered with their reason; the consumer
/// keeps going.
pub async fn invalid_ids_are_dead_lettered<D: TestDb>(brokers: &dyn BrokerFactory, db: &Arc<D>) {
    let s = Scenario::new(brokers, db, Faults::none()).await;
    let name = s.name("ids");
    s.broker.prepare(&s.source, &[&name]).await;
    let script = Arc::new(Script::default());
    let consumer = s.consumer(&name, &script);
    let running = Running::start(&consumer, 1);
    let before = s.id(0);
    s.publish(&before, 0).await;
    let bad = [
        (
            OutgoingMessage {
                payload: "{}".into(),
                ..OutgoingMessage::default()
            },
            "no message id",
        ),
        (OutgoingMessage::new("", "{}"), "is empty"),
        (OutgoingMessage::new("x".repeat(256), "{}"), "256 bytes"),
        (
            OutgoingMessage {
                payload: "{}".into(),
                ..OutgoingMessage::default()
            }
            .with_header("message-id", vec![0xff, 0xfe]),
            "UTF-8",
        ),
        (
            OutgoingMessage::new("nul\u{0}id", "{}"),
            "control character",
        ),
    ];
    for (message, _) in &bad {
        s.publish_raw(message.clone()).await;
    }
    let after = s.id(1);
    s.publish(&after, 1).await;
    s.wait_for(&[&name], 2).await;
    running.stop().await;
    s.assert_exactly_once(&[&name], &[before, after]).await;
    let dead = s.dead_letters(bad.len()).await;
    assert_eq!(dead.len(), bad.len(), "{dead:?}");
    for letter in &dead {
        assert_eq!(header(letter, dead_letter_headers::CONSUMER), name.as_str());
        assert_eq!(header(letter, dead_letter_headers::SOURCE), s.source);
    }
    for (_, why) in &bad {
        let reasons: Vec<&str> = dead
            .iter()
            .map(|l| header(l, dead_letter_headers::REASON))
            .collect();
        assert!(
            reasons.iter().any(|r| r.contains(why)),
            "no dead letter says {why:?}: {reasons:?}"
        );
    }
    assert_eq!(consumer.report().dead_lettered, bad.len() as u64);
}

/// Poison messages: one failing for ever is dead-lettered after the attempt limit, one failing
/// permanently at once, one with a payload that does not decode, one too large. The rest pass.
pub async fn poison_messages_are_dead_lettered<D: TestDb>(
    brokers: &dyn BrokerFactory,
    db: &Arc<D>,
) {
    let s = Scenario::new(brokers, db, Faults::none()).await;
    let name = s.name("poison");
    s.broker.prepare(&s.source, &[&name]).await;
    let (forever, permanent, garbage, huge) = (s.id(100), s.id(101), s.id(102), s.id(103));
    let (empty, wrong_shape) = (s.id(104), s.id(105));
    let good: Vec<String> = (0..10).map(|i| s.id(i)).collect();
    for (i, id) in good.iter().enumerate() {
        s.publish(id, i).await;
    }
    s.publish(&forever, 0).await;
    s.publish(&permanent, 0).await;
    s.publish_raw(OutgoingMessage::new(garbage.clone(), "not json {"))
        .await;
    s.publish_raw(OutgoingMessage::new(
        huge.clone(),
        format!(r#"{{"n":1,"pad":"{}"}}"#, "x".repeat(4096)),
    ))
    .await;
    s.publish_raw(OutgoingMessage::new(empty.clone(), "")).await;
    s.publish_raw(OutgoingMessage::new(
        wrong_shape.clone(),
        r#"{"parcel_id": 7}"#,
    ))
    .await;
    let script = Arc::new(Script {
        always_fail: HashSet::from([forever.clone()]),
        permanent: HashSet::from([permanent.clone()]),
        decode_json: true,
        ..Script::default()
    });
    let consumer = s.consumer(&name, &script).max_payload_bytes(1024);
    let running = Running::start(&consumer, 2);
    s.wait_for(&[&name], good.len()).await;
    s.dead_letters(6).await;
    eventually("settled", || async {
        s.broker.settled(&s.source, &[&name]).await
    })
    .await;
    running.stop().await;
    s.assert_exactly_once(&[&name], &good).await;

    assert_eq!(
        script.calls(&forever),
        4,
        "tried max_attempts times, then never again"
    );
    assert_eq!(script.calls(&permanent), 1);
    assert_eq!(
        script.calls(&huge),
        0,
        "too large: never handed to the handler"
    );
    let dead = s.dead_letters(6).await;
    assert_eq!(dead.len(), 6, "{dead:?}");
    let by_id: HashMap<&str, &OutgoingMessage> = dead
        .iter()
        .map(|m| (header(m, dead_letter_headers::MESSAGE_ID), m))
        .collect();
    let reasons = reasons_by_id(&dead);
    let reason = |id: &str| reasons[id].clone();
    assert!(
        reason(&forever).contains("gave up after 4 attempts"),
        "{}",
        reason(&forever)
    );
    assert!(
        reason(&forever).contains("fails every time"),
        "{}",
        reason(&forever)
    );
    assert_eq!(
        header(by_id[forever.as_str()], dead_letter_headers::ATTEMPTS),
        "4"
    );
    assert!(
        reason(&permanent).contains("can never succeed"),
        "{}",
        reason(&permanent)
    );
    assert!(
        reason(&garbage).contains("not the expected JSON"),
        "{}",
        reason(&garbage)
    );
    assert!(
        reason(&huge).contains("exceeds the limit of 1024 bytes"),
        "{}",
        reason(&huge)
    );
    assert!(
        reason(&empty).contains("empty payload"),
        "{}",
        reason(&empty)
    );
    assert!(
        reason(&wrong_shape).contains("missing field `n`"),
        "{}",
        reason(&wrong_shape)
    );
    assert_eq!(
        by_id[garbage.as_str()].payload.as_ref(),
        b"not json {",
        "the original payload travels"
    );
    for id in [&forever, &permanent, &garbage, &huge, &empty, &wrong_shape] {
        let row = s.db.row(&s.store, &name, id).await.expect("a dead row");
        assert!(row.dead && !row.processed, "{id}: {row:?}");
        assert!(row.last_error.is_some(), "{id}: {row:?}");
    }
    let stats = s.store.stats(Some(&name)).await.unwrap();
    assert_eq!(stats.len(), 1);
    assert_eq!(
        (stats[0].processed, stats[0].dead, stats[0].failing),
        (10, 6, 0),
        "{stats:?}"
    );

    // A later copy of a dead message is discarded, not handled again. (As many instances as
    // before: tansu 0.6 does not complete a group's rebalance when fewer members come back after
    // all left — see the README's notes on tansu.)
    let running = Running::start(&consumer, 2);
    s.publish(&permanent, 0).await;
    eventually("the copy is discarded", || async {
        s.broker.settled(&s.source, &[&name]).await?;
        if consumer.report().duplicates_discarded >= 1 {
            Ok(())
        } else {
            Err("not yet".into())
        }
    })
    .await;
    running.stop().await;
    assert_eq!(script.calls(&permanent), 1);

    // The operator's replay: clear the mark; the next delivery is handled (and fails again).
    assert!(
        s.store
            .revive(&name, &inbox::MessageId::new(permanent.clone()).unwrap())
            .await
            .unwrap()
    );
    let row = s.db.row(&s.store, &name, &permanent).await.unwrap();
    assert!(!row.dead && !row.processed, "{row:?}");
}

/// The operator's replay: dead letters are read back from the dead-letter destination, the dead
/// mark is cleared and the message published to its source again, and then it is handled once —
/// by the consumer that gave up on it, while every other consumer of the source discards the copy.
pub async fn dead_letters_are_replayed<D: TestDb>(brokers: &dyn BrokerFactory, db: &Arc<D>) {
    use inbox::dead_letter::{Replay, replay};

    let s = Scenario::new(brokers, db, Faults::none()).await;
    let (name, other) = (s.name("replayed"), s.name("bystander"));
    s.broker.prepare(&s.source, &[&name, &other]).await;
    let ids: Vec<String> = (0..8).map(|i| s.id(i)).collect();
    let (a, b) = (ids[6].clone(), ids[7].clone());
    // A bug makes the handler refuse a and b, until the fix is deployed.
    let broken = Arc::new(Mutex::new(HashSet::from([a.clone(), b.clone()])));
    let script = Arc::new(Script {
        hook: Some(refusing(&broken)),
        ..Script::default()
    });
    let consumer = s.consumer(&name, &script);
    let bystander = s.consumer(&other, &Arc::new(Script::default()));
    let running = Running::start(&consumer, 1);
    let running_other = Running::start(&bystander, 1);
    for (i, id) in ids.iter().enumerate() {
        s.publish(id, i).await;
    }
    s.wait_for(&[&name, &other], 6 + 8).await;
    eventually("a and b dead", || async {
        let dead = s.store.dead_letters(Some(&name), 100).await.unwrap();
        if dead.len() == 2 {
            Ok(())
        } else {
            Err(format!("{dead:?}"))
        }
    })
    .await;
    broken.lock().unwrap().clear();

    let transport = s.broker.transport();
    let destination = s.dead_letter_destination();
    let id_of = |id: &str| inbox::MessageId::new(id.to_owned()).unwrap();
    // A broker may show a just-published dead letter a moment late: the replay then says it is
    // missing, and running it again is safe.
    let first = Mutex::new(None);
    eventually("a replayed", || async {
        let report = replay(
            &*transport,
            &s.store,
            &name,
            &destination,
            Replay::Ids(vec![id_of(&a)]),
        )
        .await
        .map_err(|e| e.to_string())?;
        let done = report.replayed == vec![a.clone()];
        *first.lock().unwrap() = Some(report.clone());
        if done {
            Ok(())
        } else {
            Err(format!("{report:?}"))
        }
    })
    .await;
    let first = first.into_inner().unwrap().unwrap();
    assert!(
        first.not_dead.is_empty() && first.missing.is_empty(),
        "{first:?}"
    );
    eventually("a handled", || async {
        let n = s
            .effects()
            .await
            .get(&(name.to_string(), a.clone()))
            .copied();
        if n == Some(1) {
            Ok(())
        } else {
            Err(format!("{n:?}"))
        }
    })
    .await;

    // Asking again for a (now processed) and for an id never seen replays nothing.
    let again = replay(
        &*transport,
        &s.store,
        &name,
        &destination,
        Replay::Ids(vec![id_of(&a), id_of("never-seen")]),
    )
    .await
    .unwrap();
    assert!(again.replayed.is_empty(), "{again:?}");
    assert_eq!(again.not_dead, vec![a.clone(), "never-seen".to_owned()]);

    // Retention passes before b's replay: the bystander's record of b is cleaned up, and only
    // the replay's addressee keeps it from handling b a second time.
    let cleaned = s.store.cleanup(Duration::ZERO, 1000).await.unwrap();
    assert!(cleaned.deleted >= 8, "{cleaned:?}");
    assert!(
        s.db.row(&s.store, &other, &b).await.is_none(),
        "the bystander's row of b is gone"
    );
    let all = replay(&*transport, &s.store, &name, &destination, Replay::All)
        .await
        .unwrap();
    assert_eq!(all.replayed, vec![b.clone()], "{all:?}");
    s.wait_for(&[&name, &other], 16).await;
    eventually("the bystander discarded both copies", || async {
        let n = bystander.report().duplicates_discarded;
        if n >= 2 {
            Ok(())
        } else {
            Err(format!("{n} duplicates"))
        }
    })
    .await;
    running.stop().await;
    running_other.stop().await;
    s.assert_exactly_once(&[&name, &other], &ids).await;
    assert_eq!(
        script.calls(&a),
        2,
        "refused once, handled once after the replay"
    );
    assert_eq!(script.calls(&b), 2);
    let stats = s.store.stats(Some(&name)).await.unwrap();
    // Processed rows were cleaned up before b's replay: b's is the one left.
    assert_eq!((stats[0].processed, stats[0].dead), (1, 0), "{stats:?}");
    let nothing_left = replay(&*transport, &s.store, &name, &destination, Replay::All)
        .await
        .unwrap();
    assert_eq!(nothing_left, inbox::dead_letter::ReplayReport::default());
}

/// The database goes away: the consumer stops taking deliveries, one task probes with backoff
/// (not one per message, not a hot loop), and it resumes by itself when the database is back.
pub async fn store_outage_pauses_deliveries<D: TestDb>(brokers: &dyn BrokerFactory, db: &Arc<D>) {
    use flaky::FlakyStore;
    use std::time::Instant;

    let s = Scenario::new(brokers, db, Faults::none()).await;
    let name = s.name("outage");
    s.broker.prepare(&s.source, &[&name]).await;
    let store = FlakyStore::new(s.store.clone());
    let handler = TestHandler {
        run: s.run.clone(),
        script: Arc::new(Script::default()),
        db: Arc::clone(&s.db),
    };
    let (min_delay, max_delay) = (Duration::from_millis(10), Duration::from_millis(200));
    let concurrency = 4;
    let consumer = Consumer::new(
        name.clone(),
        s.source.clone(),
        s.broker.transport(),
        store.clone(),
        handler,
    )
    .concurrency(concurrency)
    .reconnect_backoff(RetryPolicy::default().with_delays(min_delay, max_delay));
    let ids: Vec<String> = (0..40).map(|i| s.id(i)).collect();
    let running = Running::start(&consumer, 1);
    for (i, id) in ids[..10].iter().enumerate() {
        s.publish(id, i).await;
    }
    s.wait_for(&[&name], 10).await;
    let before = consumer.report().deliveries;

    store.set_down(true);
    let down_at = Instant::now();
    for (i, id) in ids.iter().enumerate().skip(10) {
        s.publish(id, i).await;
    }
    eventually("the consumer probing the dead store", || async {
        match store.refused() {
            n if n >= 12 => Ok(()),
            n => Err(format!("{n} refused calls")),
        }
    })
    .await;
    let (elapsed, refused) = (down_at.elapsed(), store.refused());
    let taken = consumer.report().deliveries - before;
    assert!(
        taken <= concurrency as u64,
        "no new deliveries while the store is down, beyond one per handler slot: {taken}"
    );
    // Each delivery in flight fails once and then waits; after that only the one prober calls,
    // at backoff delays of at least 10, 20, 40, ... 200 ms (jitter only adds).
    let mut probes = 0u64;
    let mut at = Duration::ZERO;
    let mut delay = min_delay;
    while at <= elapsed {
        probes += 1;
        at += delay;
        delay = (delay * 2).min(max_delay);
    }
    assert!(
        refused <= taken + probes + 1,
        "{refused} store calls in {elapsed:?} while down: more than {taken} in flight + {probes} probes"
    );

    store.set_down(false);
    s.wait_for(&[&name], ids.len()).await;
    running.stop().await;
    s.assert_exactly_once(&[&name], &ids).await;
}

/// Shutdown: stop taking deliveries, let in-flight handlers finish and commit and ack, return.
/// A restart then handles the rest, each once.
pub async fn shutdown_drains_in_flight<D: TestDb>(brokers: &dyn BrokerFactory, db: &Arc<D>) {
    let s = Scenario::new(brokers, db, Faults::none()).await;
    let name = s.name("drain");
    s.broker.prepare(&s.source, &[&name]).await;
    let ids: Vec<String> = (0..12).map(|i| s.id(i)).collect();
    for (i, id) in ids.iter().enumerate() {
        s.publish(id, i).await;
    }
    let entered = Arc::new(AtomicUsize::new(0));
    let release = Arc::new(tokio::sync::Semaphore::new(0));
    let script = Arc::new(Script {
        hook: Some({
            let (entered, release) = (Arc::clone(&entered), Arc::clone(&release));
            Arc::new(move |_, _| {
                let (entered, release) = (Arc::clone(&entered), Arc::clone(&release));
                Box::pin(async move {
                    entered.fetch_add(1, Ordering::SeqCst);
                    release.acquire().await.unwrap().forget();
                    Ok(())
                })
            })
        }),
        ..Script::default()
    });
    let consumer = s.consumer(&name, &script).concurrency(3).prefetch(3);
    let running = Running::start(&consumer, 1);
    // A single-writer database lets one handler in at a time; the others wait in BEGIN. An
    // ordered transport queues a partition's deliveries behind the one in its handler.
    let ordered = s.broker.transport().capabilities().ordered;
    let in_handler = if D::CONCURRENT_WRITERS { 3 } else { 1 };
    // In batch mode the deliveries of a batch are counted when it commits.
    let batched = BATCHED.try_with(|b| *b).unwrap_or(false);
    eventually("handlers in flight", || async {
        let (entered, taken) = (entered.load(Ordering::SeqCst), consumer.report().deliveries);
        let ready = if batched {
            entered >= 1
        } else if ordered {
            entered >= 1 && entered as u64 == taken
        } else {
            entered == in_handler && taken == 3
        };
        if ready {
            Ok(())
        } else {
            Err(format!(
                "{entered} in the handler, {taken} deliveries taken"
            ))
        }
    })
    .await;
    running.token().cancel();
    release.add_permits(1000);
    running.stop().await;
    let handled: i64 = s.effects().await.values().sum();
    let report = consumer.report();
    assert_eq!(
        handled as u64, report.processed,
        "what was handled was committed: {report:?}"
    );
    assert_eq!(
        report.deliveries, report.processed,
        "every delivery taken in finished; none after the stop: {report:?}"
    );
    assert_eq!(
        entered.load(Ordering::SeqCst) as u64,
        report.processed,
        "{report:?}"
    );
    if !ordered && !batched {
        assert_eq!(
            report.processed, 3,
            "exactly the in-flight messages were finished"
        );
    }

    let running = Running::start(&consumer, 1);
    s.wait_for(&[&name], ids.len()).await;
    running.stop().await;
    s.assert_exactly_once(&[&name], &ids).await;
}

/// Quotes, semicolons and SQL keywords in consumer names and ids are just text.
pub async fn hostile_values_are_bound_parameters<D: TestDb>(
    brokers: &dyn BrokerFactory,
    db: &Arc<D>,
) {
    let s = Scenario::new(brokers, db, Faults::none()).await;
    let name = ConsumerName::new(format!(
        "o'brien\"; DROP TABLE inbox_messages; -- {}",
        s.run
    ))
    .unwrap();
    s.broker.prepare(&s.source, &[&name]).await;
    let ids: Vec<String> = [
        "'); DELETE FROM inbox_messages; --",
        "\" OR 1=1 --",
        "%_\\ LIKE 'x'",
        "Robert'); DROP TABLE conformance_effects;--",
        "$1 $2 ? :name @p",
    ]
    .iter()
    .map(|v| format!("{v} {}", s.run))
    .collect();
    for (i, id) in ids.iter().enumerate() {
        s.publish(id, i).await;
        s.publish(id, i).await;
    }
    let script = Arc::new(Script::default());
    let consumer = s.consumer(&name, &script);
    let running = Running::start(&consumer, 1);
    s.wait_for(&[&name], ids.len()).await;
    running.stop().await;
    s.assert_exactly_once(&[&name], &ids).await;
    for id in &ids {
        let row =
            s.db.row(&s.store, &name, id)
                .await
                .expect("stored verbatim");
        assert!(row.processed);
    }
}

/// Cleanup deletes processed rows in batches and keeps dead-lettered ones.
pub async fn cleanup_keeps_dead_letters<D: TestDb>(brokers: &dyn BrokerFactory, db: &Arc<D>) {
    let s = Scenario::new(brokers, db, Faults::none()).await;
    let name = s.name("cleanup");
    s.broker.prepare(&s.source, &[&name]).await;
    let ids: Vec<String> = (0..25).map(|i| s.id(i)).collect();
    for (i, id) in ids.iter().enumerate() {
        s.publish(id, i).await;
    }
    let script = Arc::new(Script {
        permanent: HashSet::from([ids[0].clone()]),
        ..Script::default()
    });
    let consumer = s.consumer(&name, &script);
    let running = Running::start(&consumer, 1);
    s.wait_for(&[&name], ids.len() - 1).await;
    running.stop().await;
    // Each scenario has a database of its own: the counts are exactly ours.
    let report = s
        .store
        .cleanup(Duration::from_secs(3600), 10)
        .await
        .unwrap();
    assert!(!report.skipped_locked);
    let stats = s.store.stats(Some(&name)).await.unwrap();
    assert_eq!(
        stats[0].rows, 25,
        "nothing is younger than an hour ago: {report:?}"
    );
    let report = s.store.cleanup(Duration::ZERO, 10).await.unwrap();
    assert!(report.deleted == 24 && report.batches == 3, "{report:?}");
    let stats = s.store.stats(Some(&name)).await.unwrap();
    assert_eq!(
        (stats[0].rows, stats[0].dead),
        (1, 1),
        "only the dead row is left: {stats:?}"
    );
}

/// Our migrations are idempotent and keep out of the application's own sqlx migrations.
pub async fn migrations_coexist_with_the_application<D: TestDb>(
    _brokers: &dyn BrokerFactory,
    db: &Arc<D>,
) {
    let store = db.store().await;
    store.migrate().await.expect("migrating again is a no-op");
    db.check_app_migrations_coexist().await;
}

/// A second instance joins while the first consumes (a rebalance on Kafka): it gets work, and
/// every message still has exactly one effect.
pub async fn an_instance_joins_mid_stream<D: TestDb>(brokers: &dyn BrokerFactory, db: &Arc<D>) {
    let s = Scenario::new(brokers, db, Faults::none()).await;
    let name = s.name("joined");
    s.broker.prepare(&s.source, &[&name]).await;
    let ids: Vec<String> = (0..600).map(|i| s.id(i)).collect();
    for (i, id) in ids.iter().enumerate() {
        s.publish(id, i).await;
    }
    // Handlers that take a while, so that the stream is not over before the join takes effect.
    let slow: Hook = Arc::new(|_, _| {
        Box::pin(async {
            tokio::time::sleep(Duration::from_millis(20)).await;
            Ok(())
        })
    });
    let script = Arc::new(Script {
        hook: Some(slow),
        ..Script::default()
    });
    let first = s.consumer(&name, &script);
    let second = s.consumer(&name, &script);
    let running_first = Running::start(&first, 1);
    s.wait_for_effects(50).await;
    let running_second = Running::start(&second, 1);
    s.wait_for(&[&name], ids.len()).await;
    running_first.stop().await;
    running_second.stop().await;
    s.assert_exactly_once(&[&name], &ids).await;
    assert!(
        second.report().processed > 0,
        "the joining instance got work: {:?}",
        second.report()
    );
    assert_eq!(
        first.report().processed + second.report().processed,
        ids.len() as u64
    );
}

/// A message the consumer dies on (no failure is ever recorded) is dead-lettered once its
/// delivery count passes `max_deliveries` — the broker's where it counts deliveries, otherwise
/// the inbox's own count of deliveries that may be redeliveries (AMQP's `redelivered`, the first
/// record of a Kafka partition after an assignment); the others are unaffected.
pub async fn crash_looping_message_is_dead_lettered<D: TestDb>(
    brokers: &dyn BrokerFactory,
    db: &Arc<D>,
) {
    let s = Scenario::new(brokers, db, Faults::none()).await;
    let name = s.name("crashloop");
    s.broker.prepare(&s.source, &[&name]).await;
    let (poison, fine) = (s.id(0), s.id(1));
    // Batch-mates that arrive with the poison: a crash must not take them to the dead-letter
    // queue with it (in batch mode they shared its transaction until redeliveries were taken
    // out of batches). Not on SQLite: there the stuck handler holds the database's one write
    // lock, so nothing else commits until the crash, and every crash redelivers them too.
    // Nor on an ordered transport, where those of the poison's partition wait behind it.
    let ordered = s.broker.transport().capabilities().ordered;
    let mates: Vec<String> = if D::CONCURRENT_WRITERS && !ordered {
        (10..16).map(|i| s.id(i)).collect()
    } else {
        Vec::new()
    };
    s.publish(&poison, 0).await;
    for (i, id) in mates.iter().enumerate() {
        s.publish(id, i).await;
    }
    let entered = Arc::new(AtomicUsize::new(0));
    let fixed = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let script = Arc::new(Script {
        hook: Some({
            let (entered, poison, fixed) =
                (Arc::clone(&entered), poison.clone(), Arc::clone(&fixed));
            Arc::new(move |id, _| {
                let (entered, is_poison) = (Arc::clone(&entered), id == poison);
                let crash = is_poison && !fixed.load(Ordering::SeqCst);
                Box::pin(async move {
                    if crash {
                        entered.fetch_add(1, Ordering::SeqCst);
                        // Never returns: the "process" dies here.
                        std::future::pending::<()>().await;
                    }
                    Ok(())
                })
            })
        }),
        ..Script::default()
    });
    let max_deliveries = 3;
    let consumer = s.consumer(&name, &script).retry(
        RetryPolicy::default()
            .with_max_deliveries(max_deliveries)
            .with_delays(Duration::from_millis(5), Duration::from_millis(40)),
    );
    // Crash whenever the handler is stuck in it, until the broker's count passes the limit. (A
    // broker may count more than one delivery per crash: RabbitMQ counts every return to the
    // queue, and an aborted consumer may return it twice.)
    let dead_letters = || async { s.broker.published(&s.dead_letter_destination()).await.len() };
    let mut crashes = 0;
    // (Where the count is the inbox's, the first delivery may not count: it is no redelivery.)
    while dead_letters().await == 0 {
        assert!(
            crashes <= max_deliveries as usize + 1,
            "still not dead-lettered after {crashes} crashes"
        );
        let running = Running::start(&consumer, 1);
        // Stuck in the poison message (after the batch-mates are handled, except in a first
        // batch, which shares the poison's transaction), or done with it.
        let batched = BATCHED.try_with(|b| *b).unwrap_or(false);
        eventually("stuck in the poison message, or done with it", || async {
            let mates_done = s.effects().await.len() >= mates.len();
            let stuck = entered.load(Ordering::SeqCst) > crashes
                && (mates_done || (batched && crashes == 0));
            if stuck || dead_letters().await > 0 {
                Ok(())
            } else {
                Err(format!("waiting; batch-mates handled: {mates_done}"))
            }
        })
        .await;
        running.abort().await;
        crashes = entered.load(Ordering::SeqCst);
    }
    let running = Running::start(&consumer, 1);
    s.publish(&fine, 1).await;
    s.wait_for(&[&name], 1 + mates.len()).await;
    eventually("the poison message dead-lettered", || async {
        match s.broker.published(&s.dead_letter_destination()).await.len() {
            0 => Err("no dead letter yet".to_owned()),
            _ => Ok(()),
        }
    })
    .await;
    running.stop().await;
    let entered = entered.load(Ordering::SeqCst);
    assert!(
        (1..=max_deliveries as usize + 1).contains(&entered),
        "handed to the handler {entered} times, then never again"
    );
    let mut all = mates.clone();
    all.push(fine);
    s.assert_exactly_once(&[&name], &all).await;
    let dead = s.broker.published(&s.dead_letter_destination()).await;
    // (A crash between publishing the dead letter and marking it may publish a second copy.)
    assert!(
        dead.iter()
            .all(|d| header(d, dead_letter_headers::MESSAGE_ID) == poison),
        "only the poison is dead-lettered: {dead:?}"
    );
    let reason = header(&dead[0], dead_letter_headers::REASON);
    assert!(reason.contains("without an outcome"), "{reason}");
    let row =
        s.db.row(&s.store, &name, &poison)
            .await
            .expect("a dead row");
    assert!(row.dead, "{row:?}");

    // The bug is fixed and the letter replayed: handled once. (The dead letter must not carry
    // the broker's delivery count of the crash loop: a quorum queue would see it as delivered 21
    // times and dead-letter it again at once.)
    fixed.store(true, Ordering::SeqCst);
    let running = Running::start(&consumer, 1);
    eventually("the crash-looped letter replayed", || async {
        let report = inbox::dead_letter::replay(
            &*s.broker.transport(),
            &s.store,
            &name,
            &s.dead_letter_destination(),
            inbox::dead_letter::Replay::Ids(vec![inbox::MessageId::new(poison.clone()).unwrap()]),
        )
        .await
        .map_err(|e| e.to_string())?;
        if report.replayed == vec![poison.clone()] {
            Ok(())
        } else {
            Err(format!("{report:?}"))
        }
    })
    .await;
    s.wait_for(&[&name], all.len() + 1).await;
    running.stop().await;
    all.push(poison);
    s.assert_exactly_once(&[&name], &all).await;
}

/// A handler that writes its effect, then swallows the error of a statement the database refused,
/// returns Ok. On PostgreSQL that transaction is aborted: its COMMIT reports success and rolls
/// back, so acking would lose the message. Nothing may be lost: every message ends with exactly
/// one effect or exactly one dead letter — on PostgreSQL the swallowing ones are retried and then
/// dead-lettered with the reason, on SQLite (where a failed statement aborts nothing) they commit.
/// In batch mode the swallowing messages sit in the middle and at the end of the batch.
pub async fn swallowed_database_errors_lose_nothing<D: TestDb>(
    brokers: &dyn BrokerFactory,
    db: &Arc<D>,
) {
    let s = Scenario::new(brokers, db, Faults::none()).await;
    let name = s.name("swallow");
    s.broker.prepare(&s.source, &[&name]).await;
    let ids: Vec<String> = (0..8).map(|i| s.id(i)).collect();
    let swallowers = HashSet::from([ids[2].clone(), ids[7].clone()]);
    for (i, id) in ids.iter().enumerate() {
        s.publish(id, i).await;
    }
    let script = Arc::new(Script {
        swallow_always: swallowers.clone(),
        ..Script::default()
    });
    let consumer = s.consumer(&name, &script);
    let running = Running::start(&consumer, 1);
    let good: Vec<String> = if D::FAILED_STATEMENT_ABORTS {
        ids.iter()
            .filter(|id| !swallowers.contains(*id))
            .cloned()
            .collect()
    } else {
        ids.clone()
    };
    s.wait_for(&[&name], good.len()).await;
    if D::FAILED_STATEMENT_ABORTS {
        s.dead_letters(swallowers.len()).await;
    }
    eventually("settled", || async {
        s.broker.settled(&s.source, &[&name]).await
    })
    .await;
    running.stop().await;
    s.assert_exactly_once(&[&name], &good).await;
    let dead = s.broker.published(&s.dead_letter_destination()).await;
    if !D::FAILED_STATEMENT_ABORTS {
        assert!(dead.is_empty(), "{dead:?}");
        return;
    }
    let dead_ids: HashSet<&str> = dead
        .iter()
        .map(|m| header(m, dead_letter_headers::MESSAGE_ID))
        .collect();
    assert_eq!(
        dead_ids,
        swallowers.iter().map(String::as_str).collect(),
        "each swallowing message dead-lettered once: {dead:?}"
    );
    assert_eq!(dead.len(), swallowers.len(), "{dead:?}");
    for letter in &dead {
        let reason = header(letter, dead_letter_headers::REASON);
        assert!(reason.contains("nothing was committed"), "{reason}");
    }
    for id in &swallowers {
        let row = s.db.row(&s.store, &name, id).await.expect("a dead row");
        assert!(row.dead && !row.processed, "{id}: {row:?}");
        // In batch mode the batch's own try comes first; it counts against no message.
        let batched = BATCHED.try_with(|b| *b).unwrap_or(false);
        let calls = script.calls(id);
        assert!(
            calls == 4 || (batched && calls == 5),
            "{id}: retried up to max_attempts, {calls} calls"
        );
    }
}

/// Error texts with a NUL in them (a decoder quoting a crafted payload, a handler's own message)
/// are stored, not refused: PostgreSQL's `text` cannot hold NUL, and a bookkeeping write the
/// database refuses must never stop the consumer. A transient failure is retried and succeeds, a
/// permanent one and an undecodable payload are dead-lettered, and a good message after them is
/// handled by the same running consumer.
pub async fn error_texts_with_nul_are_stored<D: TestDb>(brokers: &dyn BrokerFactory, db: &Arc<D>) {
    let s = Scenario::new(brokers, db, Faults::none()).await;
    let name = s.name("nul");
    s.broker.prepare(&s.source, &[&name]).await;
    let (flaky, broken, crafted, after) = (s.id(0), s.id(1), s.id(2), s.id(3));
    s.publish(&flaky, 0).await;
    s.publish(&broken, 1).await;
    // serde quotes an unknown enum variant verbatim: the NUL reaches the error text.
    s.publish_raw(OutgoingMessage::new(
        crafted.clone(),
        "{\"n\":2,\"kind\":\"\\u0000nul\"}",
    ))
    .await;
    let script = Arc::new(Script {
        permanent: HashSet::from([broken.clone()]),
        decode_json: true,
        nul_in_errors: true,
        hook: Some({
            let flaky = flaky.clone();
            Arc::new(move |id: String, call: u32| {
                let fail = id == flaky && call == 1;
                Box::pin(async move {
                    if fail {
                        Err(HandlerError::transient("upstream said \0 no"))
                    } else {
                        Ok(())
                    }
                })
            })
        }),
        ..Script::default()
    });
    let consumer = s.consumer(&name, &script);
    let running = Running::start(&consumer, 1);
    s.dead_letters(2).await;
    s.publish(&after, 3).await;
    s.wait_for(&[&name], 2).await;
    assert!(running.is_running(), "the consumer is still running");
    running.stop().await;
    s.assert_exactly_once(&[&name], &[flaky.clone(), after])
        .await;
    let row = s.db.row(&s.store, &name, &broken).await.expect("a row");
    assert!(row.dead, "{row:?}");
    let stored = row.last_error.unwrap_or_default();
    assert!(
        stored.contains("can never succeed\u{fffd}"),
        "NUL stored as U+FFFD: {stored:?}"
    );
    let row = s.db.row(&s.store, &name, &crafted).await.expect("a row");
    assert!(row.dead, "{row:?}");
    assert!(
        row.last_error.unwrap_or_default().contains('\u{fffd}'),
        "the decoder's text, NUL replaced"
    );
    let row = s.db.row(&s.store, &name, &flaky).await.expect("a row");
    assert!(row.processed && row.attempts == 1, "{row:?}");
}

/// Faults as fine as the world's, aimed at one store method: a failure whose recording loses its
/// connection (the outage gate must reopen by itself — it once stayed shut with nobody probing),
/// a failure the table refuses to record (the message is dead-lettered instead of retried
/// uncounted for ever), a dead mark the table refuses (the dead letter is out: the consumer goes
/// on), a dead mark whose connection is lost (tried again), and commits applied whose reply is
/// lost (the retry finds them done: no second effect). The consumer never stops, and good
/// messages published afterwards are handled.
pub async fn store_faults_neither_wedge_nor_stop<D: TestDb>(
    brokers: &dyn BrokerFactory,
    db: &Arc<D>,
) {
    use flaky::{Fault, FlakyStore, Method};

    let s = Scenario::new(brokers, db, Faults::none()).await;
    let name = s.name("faults");
    s.broker.prepare(&s.source, &[&name]).await;
    let store = FlakyStore::new(s.store.clone());
    let (gate, uncounted, unmarked) = (s.id(100), s.id(101), s.id(102));
    store.inject(Method::RecordFailure, Some(&gate), Fault::Unavailable, 2);
    store.inject(Method::MarkDeadClaimed, Some(&gate), Fault::Unavailable, 1);
    store.inject(Method::RecordFailure, Some(&uncounted), Fault::Refused, 1);
    store.inject(Method::RecordDead, Some(&unmarked), Fault::Refused, 1);
    // In batch mode its mark is refused first (the batch then goes message by message).
    store.inject(Method::MarkDeadClaimed, Some(&unmarked), Fault::Refused, 1);
    store.inject(Method::Commit, None, Fault::CommitAppliedReplyLost, 3);
    let script = Arc::new(Script {
        always_fail: HashSet::from([gate.clone(), uncounted.clone()]),
        permanent: HashSet::from([unmarked.clone()]),
        ..Script::default()
    });
    let consumer = Consumer::new(
        name.clone(),
        s.source.clone(),
        s.broker.transport(),
        store.clone(),
        s.handler(&script),
    )
    .concurrency(4)
    .retry(
        RetryPolicy::default()
            .with_max_attempts(4)
            .with_in_process_retries(0)
            .with_delays(Duration::from_millis(5), Duration::from_millis(40)),
    )
    .reconnect_backoff(
        RetryPolicy::default().with_delays(Duration::from_millis(10), Duration::from_millis(200)),
    );
    let consumer = if BATCHED.try_with(|b| *b).unwrap_or(false) {
        consumer.batch(inbox::Batching::new(16, Duration::from_millis(5)))
    } else {
        consumer
    };
    let good: Vec<String> = (0..15).map(|i| s.id(i)).collect();
    for (i, id) in good[..10].iter().enumerate() {
        s.publish(id, i).await;
    }
    for id in [&gate, &uncounted, &unmarked] {
        s.publish(id, 0).await;
    }
    let running = Running::start(&consumer, 1);
    s.wait_for(&[&name], 10).await;
    let dead = s.dead_letters_of(&[&gate, &uncounted, &unmarked]).await;
    for (i, id) in good.iter().enumerate().skip(10) {
        s.publish(id, i).await;
    }
    s.wait_for(&[&name], good.len()).await;
    assert!(running.is_running(), "the consumer is still running");
    running.stop().await;
    s.assert_exactly_once(&[&name], &good).await;

    let reasons = reasons_by_id(&dead);
    let reason = |id: &str| reasons[id].clone();
    assert!(
        reason(&gate).contains("gave up after 4 attempts"),
        "{}",
        reason(&gate)
    );
    assert!(
        reason(&uncounted).contains("could not be recorded"),
        "{}",
        reason(&uncounted)
    );
    assert!(
        reason(&unmarked).contains("can never succeed"),
        "{}",
        reason(&unmarked)
    );
    let fired = store.fired();
    for expected in [
        (Method::RecordFailure, Fault::Unavailable),
        (Method::MarkDeadClaimed, Fault::Unavailable),
        (Method::RecordFailure, Fault::Refused),
        (Method::RecordDead, Fault::Refused),
        (Method::Commit, Fault::CommitAppliedReplyLost),
    ] {
        assert!(
            fired.contains(&expected),
            "{expected:?} never fired: {fired:?}"
        );
    }
    let row = s.db.row(&s.store, &name, &gate).await.expect("a row");
    assert!(row.dead, "{row:?}");
}

/// Generates one `#[tokio::test]` per scenario for a (broker factory, database) pair.
#[macro_export]
macro_rules! conformance_suite {
    ($module:ident, $brokers:expr, $db:expr) => {
        $crate::conformance_suite!($module, $brokers, $db, batched = false);
    };
    ($module:ident, $brokers:expr, $db:expr, batched = $batched:expr) => {
        mod $module {
            #[allow(unused_imports)]
            use super::*;
            $crate::conformance_suite!(@tests $brokers, $db, $batched;
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
            );
        }
    };
    (@tests $brokers:expr, $db:expr, $batched:expr; $($scenario:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $scenario() {
                $crate::conformance::init_tracing();
                let db = std::sync::Arc::new($db.await);
                $crate::conformance::BATCHED
                    .scope($batched, $crate::conformance::$scenario(&$brokers, &db))
                    .await;
            }
        )*
    };
}
