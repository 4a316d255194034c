//! One scenario's world: the test handler and its script, a fresh broker and store, names
//! unique to the run, and consumers started and stopped.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use futures::future::BoxFuture;
use inbox::memory::Faults;
use inbox::{
    CancellationToken, Consumer, ConsumerError, ConsumerName, ConsumerReport, Handler,
    HandlerError, InboxStore, Message, OutgoingMessage, RetryPolicy, Transport,
};
use tokio::task::JoinHandle;

use crate::scenarios::reasons_by_id;
use crate::{BrokerFactory, DEADLINE, TestBroker, TestDb, eventually};

/// An async hook run by the test handler before it writes the effect: (message id, call number).
pub type Hook =
    Arc<dyn Fn(String, u32) -> BoxFuture<'static, Result<(), HandlerError>> + Send + Sync>;

/// A hook that fails permanently (`"bug #17 refuses <id>"`) for the ids in `broken`, until they
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
    /// See [`swallow_always`](Self::swallow_always).
    pub swallow_once: HashSet<String>,
    /// These ids write their effect and then fail transiently, on their first call.
    pub fail_after_write_once: HashSet<String>,
    /// Scripted error texts carry a NUL character (as a decoder's error may, quoting a payload).
    pub nul_in_errors: bool,
    /// Runs before the effect is written.
    pub hook: Option<Hook>,
    /// Handler calls per id (see [`calls`](Self::calls)).
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
    pub(crate) run: String,
    pub(crate) script: Arc<Script>,
    pub(crate) db: Arc<D>,
    /// Handles batches in one call (`conformance_suite!(…, whole_batches)`).
    pub(crate) whole: bool,
}

/// As a batch handler: the messages in order, through the same script; the first failure fails
/// the batch — naming its message when it is transient, naming none when it is permanent (so
/// that both the consumer's ways of isolating it are exercised).
#[async_trait]
impl<D: TestDb> inbox::BatchHandler<<D::Store as InboxStore>::Tx> for TestHandler<D> {
    async fn handle_batch(
        &self,
        messages: &[Message<'_>],
        tx: &mut <D::Store as InboxStore>::Tx,
    ) -> Result<(), inbox::BatchError> {
        for message in messages {
            if let Err(e) = Handler::handle(self, message, tx).await {
                return Err(match e.kind() {
                    inbox::ErrorKind::Transient => inbox::BatchError::message(message.id, e),
                    _ => e.into(),
                });
            }
        }
        Ok(())
    }
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

    fn as_batch_handler(&self) -> Option<&dyn inbox::BatchHandler<<D::Store as InboxStore>::Tx>> {
        if self.whole { Some(self) } else { None }
    }
}

/// One scenario's world: a fresh broker, a migrated store, and names unique to this run.
pub struct Scenario<D: TestDb> {
    /// The database.
    pub db: Arc<D>,
    /// A migrated store on a database of its own.
    pub store: D::Store,
    /// A fresh broker.
    pub broker: Box<dyn TestBroker>,
    /// This run's unique tag, in every name and id.
    pub run: String,
    /// The source the scenario publishes to.
    pub source: String,
}

impl<D: TestDb> Scenario<D> {
    /// A fresh world, with `faults` where the broker injects them.
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
            whole: crate::whole_batches(),
        }
    }

    /// The same, on a given transport (for wrapped transports).
    pub fn consumer_on(
        &self,
        transport: Arc<dyn Transport>,
        name: &ConsumerName,
        script: &Arc<Script>,
    ) -> Consumer<D::Store, TestHandler<D>> {
        let handler = self.handler(script);
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
        )
        .dedup(crate::dedup());
        if crate::batched() {
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

    /// Publishes `message` as it is to the source.
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
    /// Runs `instances` instances of `consumer`, sharing one stop token.
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

    /// The stop token the instances share.
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
