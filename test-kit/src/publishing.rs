//! A transport wrapper for the outbox scenarios: records every publish the broker confirmed, in
//! order, and injects the publish-side faults of the world — a broker that is down, a message it
//! refuses, a confirmation lost after the broker took the message, a relay that stalls (or dies)
//! right after its publish, publishes held in flight.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use inbox::transport::{Capabilities, DeliveryStream, Subscription};
use inbox::{OutgoingMessage, Transport, TransportError};

/// One confirmed publish.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Published {
    /// Where to.
    pub destination: String,
    /// The message id.
    pub message_id: String,
    /// The ordering key, as text.
    pub key: Option<String>,
}

/// See the [module](self) docs. Faults are off until a setter turns them on.
#[derive(Debug)]
pub struct Publishing {
    inner: Arc<dyn Transport>,
    log: Mutex<Vec<Published>>,
    down: AtomicBool,
    refused: Mutex<HashSet<String>>,
    lose_confirm: Mutex<HashSet<String>>,
    stall_after: AtomicUsize,
    stalled: AtomicUsize,
    gate: tokio::sync::watch::Sender<bool>,
    at_gate: AtomicUsize,
    no_route: Mutex<HashSet<String>>,
    in_flight: Mutex<std::collections::HashMap<String, usize>>,
    most_in_flight_per_key: AtomicUsize,
}

impl Publishing {
    /// Wraps `inner`.
    pub fn new(inner: Arc<dyn Transport>) -> Arc<Self> {
        Arc::new(Self {
            inner,
            log: Mutex::default(),
            down: AtomicBool::new(false),
            refused: Mutex::default(),
            lose_confirm: Mutex::default(),
            stall_after: AtomicUsize::new(0),
            stalled: AtomicUsize::new(0),
            gate: tokio::sync::watch::Sender::new(true),
            at_gate: AtomicUsize::new(0),
            no_route: Mutex::default(),
            in_flight: Mutex::default(),
            most_in_flight_per_key: AtomicUsize::new(0),
        })
    }

    /// Confirmed publishes so far, in the order they were confirmed.
    pub fn log(&self) -> Vec<Published> {
        self.log.lock().unwrap().clone()
    }

    /// Confirmed publishes of `message_id`.
    pub fn count(&self, message_id: &str) -> usize {
        self.log
            .lock()
            .unwrap()
            .iter()
            .filter(|p| p.message_id == message_id)
            .count()
    }

    /// The broker is down (`Disconnected`) or back.
    pub fn set_down(&self, down: bool) {
        self.down.store(down, Ordering::SeqCst);
    }

    /// The broker refuses these ids (permanent: `Refused`), until [`allow`](Self::allow)ed.
    pub fn refuse(&self, ids: &[&str]) {
        let mut refused = self.refused.lock().unwrap();
        refused.extend(ids.iter().map(|s| (*s).to_owned()));
    }

    /// Takes ids out of the refused set.
    pub fn allow(&self, ids: &[&str]) {
        let mut refused = self.refused.lock().unwrap();
        for id in ids {
            refused.remove(*id);
        }
    }

    /// The first publish of each of these ids reaches the broker, but its confirmation is lost.
    pub fn lose_confirm(&self, ids: &[&str]) {
        let mut lose = self.lose_confirm.lock().unwrap();
        lose.extend(ids.iter().map(|s| (*s).to_owned()));
    }

    /// The next `n` publishes reach the broker and then never return: the relay stalls (or is
    /// killed) between its publish and its mark.
    pub fn stall_after_publish(&self, n: usize) {
        self.stall_after.store(n, Ordering::SeqCst);
    }

    /// Publishes stalled so far.
    pub fn stalled(&self) -> usize {
        self.stalled.load(Ordering::SeqCst)
    }

    /// Holds publishes before the broker (`false`) or lets them through (`true`).
    pub fn set_gate_open(&self, open: bool) {
        self.gate.send_replace(open);
    }

    /// Publishes that reached a closed gate so far.
    pub fn at_gate(&self) -> usize {
        self.at_gate.load(Ordering::SeqCst)
    }

    /// The broker has no route for these ids (`NoRoute`, transient), for ever.
    pub fn no_route(&self, ids: &[&str]) {
        let mut no_route = self.no_route.lock().unwrap();
        no_route.extend(ids.iter().map(|s| (*s).to_owned()));
    }

    /// The most publishes of one ordering key that were in flight at once so far.
    pub fn most_in_flight_per_key(&self) -> usize {
        self.most_in_flight_per_key.load(Ordering::SeqCst)
    }

    fn take_stall(&self) -> bool {
        self.stall_after
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
    }
}

#[async_trait]
impl Transport for Publishing {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
    async fn declare(&self, subscription: &Subscription) -> Result<(), TransportError> {
        self.inner.declare(subscription).await
    }
    async fn subscribe(
        &self,
        subscription: &Subscription,
    ) -> Result<DeliveryStream, TransportError> {
        self.inner.subscribe(subscription).await
    }
    async fn publish(
        &self,
        destination: &str,
        message: OutgoingMessage,
    ) -> Result<(), TransportError> {
        let id = message.message_id.clone().unwrap_or_default();
        if self.down.load(Ordering::SeqCst) {
            return Err(TransportError::Disconnected(
                "broker down (injected)".into(),
            ));
        }
        if self.no_route.lock().unwrap().contains(&id) {
            return Err(TransportError::NoRoute("no queue bound (injected)".into()));
        }
        if self.refused.lock().unwrap().contains(&id) {
            return Err(TransportError::Refused(
                "message too large (injected)".into(),
            ));
        }
        let key = message
            .key
            .as_ref()
            .map(|k| String::from_utf8_lossy(k).into_owned());
        let _in_flight = key.as_ref().map(|key| InFlight::enter(self, key));
        let mut gate = self.gate.subscribe();
        if !*gate.borrow_and_update() {
            self.at_gate.fetch_add(1, Ordering::SeqCst);
            let _ = gate.wait_for(|open| *open).await;
        }
        self.inner.publish(destination, message).await?;
        self.log.lock().unwrap().push(Published {
            destination: destination.to_owned(),
            message_id: id.clone(),
            key,
        });
        if self.take_stall() {
            self.stalled.fetch_add(1, Ordering::SeqCst);
            std::future::pending::<()>().await;
        }
        if self.lose_confirm.lock().unwrap().remove(&id) {
            return Err(TransportError::NotConfirmed(
                "confirmation lost (injected)".into(),
            ));
        }
        Ok(())
    }
    async fn drained(&self) {
        self.inner.drained().await
    }
}

/// One publish of a key in flight, from before the broker until it returns (or is dropped).
struct InFlight<'a> {
    publishing: &'a Publishing,
    key: String,
}

impl<'a> InFlight<'a> {
    fn enter(publishing: &'a Publishing, key: &str) -> Self {
        let mut in_flight = publishing.in_flight.lock().unwrap();
        let n = in_flight.entry(key.to_owned()).or_default();
        *n += 1;
        publishing
            .most_in_flight_per_key
            .fetch_max(*n, Ordering::SeqCst);
        Self {
            publishing,
            key: key.to_owned(),
        }
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        let mut in_flight = self.publishing.in_flight.lock().unwrap();
        if let Some(n) = in_flight.get_mut(&self.key) {
            *n -= 1;
        }
    }
}
