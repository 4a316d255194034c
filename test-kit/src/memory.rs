//! The in-memory broker as the suite's reference broker factory.

use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use inbox::memory::{Faults, MemoryBroker};
use inbox::{ConsumerName, OutgoingMessage, Transport};

use crate::{BrokerFactory, TestBroker};

/// A fresh in-process broker per scenario, honouring injected faults.
pub struct Memory;

/// Hands out one broker made by the test itself (to install an observer on it first).
pub struct Existing(pub Mutex<Option<MemoryBroker>>);

#[async_trait]
impl BrokerFactory for Existing {
    fn name(&self) -> &'static str {
        "memory"
    }
    fn injects_faults(&self) -> bool {
        true
    }
    async fn start(&self, _faults: Faults) -> Box<dyn TestBroker> {
        let broker = self
            .0
            .lock()
            .unwrap()
            .take()
            .expect("one scenario per broker");
        Box::new(MemoryTestBroker(broker))
    }
}

struct MemoryTestBroker(MemoryBroker);

#[async_trait]
impl TestBroker for MemoryTestBroker {
    fn transport(&self) -> Arc<dyn Transport> {
        Arc::new(self.0.clone())
    }
    async fn prepare(&self, source: &str, consumers: &[&ConsumerName]) {
        for consumer in consumers {
            self.0.declare_group(source, consumer.as_str());
        }
    }
    async fn settled(&self, source: &str, consumers: &[&ConsumerName]) -> Result<(), String> {
        let left: Vec<String> = consumers
            .iter()
            .filter_map(|c| match self.0.backlog(source, c.as_str()) {
                (0, 0) => None,
                (ready, in_flight) => Some(format!("{c}: {ready} ready, {in_flight} unacked")),
            })
            .collect();
        if left.is_empty() {
            Ok(())
        } else {
            Err(left.join("; "))
        }
    }
    async fn published(&self, destination: &str) -> Vec<OutgoingMessage> {
        self.0.messages(destination)
    }
}

#[async_trait]
impl BrokerFactory for Memory {
    fn name(&self) -> &'static str {
        "memory"
    }
    fn injects_faults(&self) -> bool {
        true
    }
    async fn start(&self, faults: Faults) -> Box<dyn TestBroker> {
        Box::new(MemoryTestBroker(MemoryBroker::with_faults(faults)))
    }
}
