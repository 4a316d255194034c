//! What tests inspect on a transport: counts the engine never needs. Import the trait to call
//! them; they are kept off the transport's own API.

use std::sync::atomic::Ordering;

use futures::TryStreamExt;
use inbox_core::{OutgoingMessage, TransportError};
use redis::Value;

use crate::RedisTransport;
use crate::error::transport_error;

/// Inspection of a [`RedisTransport`] for tests.
#[async_trait::async_trait]
pub trait Inspect {
    /// Deliveries handed out by this transport and not yet acked or handed back.
    fn unsettled(&self) -> usize;
    /// Entries of `source` the group `consumer` has not acked: pending (delivered, unacked) and
    /// not yet read.
    async fn pending(&self, source: &str, consumer: &str) -> Result<u64, TransportError>;
    /// Every entry of `stream`, left there.
    async fn messages(&self, stream: &str) -> Result<Vec<OutgoingMessage>, TransportError>;
}

#[async_trait::async_trait]
impl Inspect for RedisTransport {
    fn unsettled(&self) -> usize {
        self.unsettled.load(Ordering::SeqCst)
    }

    async fn pending(&self, source: &str, consumer: &str) -> Result<u64, TransportError> {
        let mut conn = self.conn.clone();
        let groups: Value = redis::cmd("XINFO")
            .arg("GROUPS")
            .arg(source)
            .query_async(&mut conn)
            .await
            .map_err(transport_error)?;
        let Value::Array(groups) = groups else {
            return Err(TransportError::Refused("XINFO GROUPS: not an array".into()));
        };
        for group in groups {
            let Value::Array(flat) = group else { continue };
            let field = |name: &str| {
                flat.chunks_exact(2)
                    .find(|p| matches!(&p[0], Value::BulkString(b) if b == name.as_bytes()))
                    .map(|p| p[1].clone())
            };
            let is_it =
                matches!(field("name"), Some(Value::BulkString(b)) if b == consumer.as_bytes());
            if !is_it {
                continue;
            }
            let pending = match field("pending") {
                Some(Value::Int(n)) => n as u64,
                _ => 0,
            };
            let last = match field("last-delivered-id") {
                Some(Value::BulkString(b)) => String::from_utf8_lossy(&b).into_owned(),
                _ => "0-0".to_owned(),
            };
            // Not yet read: the entries after the group's last delivered one.
            let unread: Value = redis::cmd("XRANGE")
                .arg(source)
                .arg(format!("({last}"))
                .arg("+")
                .query_async(&mut conn)
                .await
                .map_err(transport_error)?;
            let unread = match unread {
                Value::Array(entries) => entries.len() as u64,
                _ => 0,
            };
            return Ok(pending + unread);
        }
        Err(TransportError::Refused(
            format!("no consumer group {consumer:?} on {source:?}").into(),
        ))
    }

    async fn messages(&self, stream: &str) -> Result<Vec<OutgoingMessage>, TransportError> {
        let letters: Vec<_> = self.read_stream(stream).await?.try_collect().await?;
        Ok(letters
            .into_iter()
            .map(|letter| OutgoingMessage {
                message_id: letter
                    .entry
                    .headers
                    .get_str("message-id")
                    .map(str::to_owned),
                payload: letter.entry.payload,
                headers: letter.entry.headers,
                key: None,
            })
            .collect())
    }
}
