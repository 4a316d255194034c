//! A transport wrapper that makes, on any broker, what a consumer crash between commit and ack
//! looks like from the broker's side.

use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use futures::StreamExt;
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
}
