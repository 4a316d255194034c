//! Transport wrappers that make faults on any broker: a consumer crash between commit and ack as
//! the broker sees it, and a broker that will not take a dead letter at first.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use futures::StreamExt;
use inbox::dead_letter::headers as dead_letter_headers;
use inbox::transport::{AckToken, Capabilities, Delivery, DeliveryStream, Subscription};
use inbox::{Headers, OutgoingMessage, Transport, TransportError};

/// Wraps a transport so that the first ack of each message is replaced by a requeue: from the
/// broker's side exactly what a consumer crash between commit and ack looks like.
#[derive(Debug)]
pub struct CrashBeforeFirstAck {
    inner: Arc<dyn Transport>,
    seen: Arc<Mutex<HashSet<Vec<u8>>>>,
    /// Acks replaced by a requeue so far.
    pub crashes: Arc<AtomicUsize>,
}

impl CrashBeforeFirstAck {
    /// Wraps `inner`.
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
    async fn declare(&self, subscription: &Subscription) -> Result<(), TransportError> {
        self.inner.declare(subscription).await
    }
    async fn drained(&self) {
        self.inner.drained().await
    }
}

/// Wraps a transport so that the first publishes of each message to one destination fail: the
/// first refused (what a dead letter over the broker's size limit gets), the next not confirmed
/// (a broker busy or briefly away). A message is told by its dead-letter header `message-id`,
/// else its own id. Everything else passes through.
#[derive(Debug)]
pub struct RefuseFirstPublishes {
    inner: Arc<dyn Transport>,
    destination: String,
    per_message: u32,
    tries: Mutex<HashMap<String, u32>>,
    refused: AtomicUsize,
    failed: AtomicUsize,
}

impl RefuseFirstPublishes {
    /// The first `per_message` publishes of each message to `destination` fail.
    pub fn new(inner: Arc<dyn Transport>, destination: String, per_message: u32) -> Self {
        Self {
            inner,
            destination,
            per_message,
            tries: Mutex::default(),
            refused: AtomicUsize::new(0),
            failed: AtomicUsize::new(0),
        }
    }

    /// Publishes failed so far by injection.
    pub fn refused(&self) -> usize {
        self.refused.load(Ordering::SeqCst)
    }

    /// Publishes to the destination that the broker itself failed so far.
    pub fn failed(&self) -> usize {
        self.failed.load(Ordering::SeqCst)
    }
}

#[async_trait]
impl Transport for RefuseFirstPublishes {
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
        if destination != self.destination {
            return self.inner.publish(destination, message).await;
        }
        let key = message
            .headers
            .get_str(dead_letter_headers::MESSAGE_ID)
            .map(str::to_owned)
            .or_else(|| message.message_id.clone())
            .unwrap_or_default();
        let try_number = {
            let mut tries = self.tries.lock().unwrap();
            let n = tries.entry(key).or_default();
            *n += 1;
            *n
        };
        if try_number > self.per_message {
            let published = self.inner.publish(destination, message).await;
            if published.is_err() {
                self.failed.fetch_add(1, Ordering::SeqCst);
            }
            return published;
        }
        self.refused.fetch_add(1, Ordering::SeqCst);
        let error = match try_number {
            1 => TransportError::Refused("message too large (injected)".into()),
            _ => TransportError::NotConfirmed("no confirm (injected)".into()),
        };
        Err(error)
    }
    async fn drained(&self) {
        self.inner.drained().await
    }
}
