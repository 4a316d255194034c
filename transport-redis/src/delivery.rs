//! Deliveries from a consumer group (acked after the commit, kept from being claimed while in
//! progress), and dead letters read from a stream for a replay.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use inbox_core::{AckToken, Delivery, Headers, TransportError};
use redis::aio::ConnectionManager;

use crate::wire::Entry;

/// Resets the idle time of an entry — or gives it an idle time, with `IDLE` — only while this
/// consumer still owns it: an instance whose entry another one claimed (after the visibility
/// timeout) must not claim it back. `XCLAIM … JUSTID` leaves the delivery count alone.
const TOUCH: &str = r"
local pending = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1)
if pending[1] == nil or pending[1][2] ~= ARGV[2] then
  return 0
end
if ARGV[4] == '' then
  redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[3], 'JUSTID')
else
  redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[3], 'IDLE', ARGV[4], 'JUSTID')
end
return 1
";

/// Where a delivery sits: stream, group, this instance's consumer name.
#[derive(Clone)]
pub(crate) struct Place {
    pub(crate) stream: Arc<str>,
    pub(crate) group: Arc<str>,
    pub(crate) consumer: Arc<str>,
}

impl Place {
    /// Touches `id` (see [`TOUCH`]); `idle`: the idle time to give it instead of zero.
    pub(crate) async fn touch(
        &self,
        conn: &mut ConnectionManager,
        id: &str,
        idle: Option<Duration>,
    ) -> redis::RedisResult<bool> {
        let idle = idle.map(|d| d.as_millis().to_string()).unwrap_or_default();
        redis::Script::new(TOUCH)
            .key(&*self.stream)
            .arg(&*self.group)
            .arg(&*self.consumer)
            .arg(id)
            .arg(idle)
            .invoke_async(conn)
            .await
    }
}

/// An entry delivered to this instance. Until it is settled, a task resets its idle time every
/// third of the visibility timeout, so no other instance claims it while a long handler runs, or
/// while the engine waits for the database to come back. Dropped unsettled, it is handed back:
/// claimable by any instance at once.
pub struct RedisDelivery {
    entry: Entry,
    place: Place,
    conn: ConnectionManager,
    /// From `XPENDING` for a claimed entry (unknown when it could not be read); 1 for a new one.
    delivered: Option<u32>,
    keep_alive: tokio::task::JoinHandle<()>,
    unsettled: Arc<AtomicUsize>,
    handed_back_idle: Duration,
    visibility: Duration,
    settled: bool,
}

impl fmt::Debug for RedisDelivery {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisDelivery")
            .field("stream", &&*self.place.stream)
            .field("entry", &self.entry.id)
            .field("delivered", &self.delivered)
            .finish()
    }
}

impl RedisDelivery {
    pub(crate) fn new(
        entry: Entry,
        delivered: Option<u32>,
        place: Place,
        conn: ConnectionManager,
        config: &crate::RedisConfig,
        unsettled: &Arc<AtomicUsize>,
    ) -> Self {
        let keep_alive = tokio::spawn({
            let (place, mut conn, id) = (place.clone(), conn.clone(), entry.id.clone());
            let every = config.keep_alive_every();
            async move {
                let mut ticks = tokio::time::interval(every);
                ticks.tick().await;
                loop {
                    ticks.tick().await;
                    match place.touch(&mut conn, &id, None).await {
                        Ok(true) => {}
                        // Claimed by another instance: nothing left to keep.
                        Ok(false) => break,
                        // The next one may get through; at worst the entry is claimed and the
                        // inbox discards the copy.
                        Err(e) => tracing::debug!(error = %e, entry = %id, "keep-alive not sent"),
                    }
                }
            }
        });
        unsettled.fetch_add(1, Ordering::SeqCst);
        Self {
            entry,
            place,
            conn,
            delivered,
            keep_alive,
            unsettled: Arc::clone(unsettled),
            handed_back_idle: config.handed_back_idle(),
            visibility: config.visibility_timeout,
            settled: false,
        }
    }

    fn settle(&mut self) {
        if !self.settled {
            self.settled = true;
            self.keep_alive.abort();
            self.unsettled.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

#[async_trait]
impl Delivery for RedisDelivery {
    fn payload(&self) -> &[u8] {
        &self.entry.payload
    }

    fn headers(&self) -> &Headers {
        &self.entry.headers
    }

    /// None: the id is the entry's `message-id` field, a header.
    fn broker_message_id(&self) -> Option<&[u8]> {
        None
    }

    fn redelivered(&self) -> bool {
        self.delivered != Some(1)
    }

    fn delivery_count(&self) -> Option<u32> {
        self.delivered
    }

    fn coordinates(&self) -> Option<String> {
        Some(format!("{}/{}", self.place.stream, self.entry.id))
    }

    /// `XACK`. A reply of 0 (another instance claimed and acked the entry meanwhile) is no
    /// error: the entry is settled either way.
    async fn ack(mut self: Box<Self>, _token: AckToken) -> Result<(), TransportError> {
        self.keep_alive.abort();
        let acked: redis::RedisResult<i64> = redis::cmd("XACK")
            .arg(&*self.place.stream)
            .arg(&*self.place.group)
            .arg(&self.entry.id)
            .query_async(&mut self.conn)
            .await;
        self.settle();
        acked
            .map(drop)
            .map_err(|e| TransportError::AckLost(Box::new(e)))
    }

    /// Leaves the entry pending with an idle time that makes it claimable after the redelivery
    /// delay (by any instance, this one included).
    async fn nack(mut self: Box<Self>, requeue: bool) -> Result<(), TransportError> {
        self.keep_alive.abort();
        // Without requeue it must still not be lost: claimable after the visibility timeout.
        let idle = if requeue {
            self.handed_back_idle
        } else {
            Duration::ZERO
        };
        let (place, id) = (self.place.clone(), self.entry.id.clone());
        let result = place.touch(&mut self.conn, &id, Some(idle)).await;
        self.settle();
        result
            .map(drop)
            .map_err(|e| TransportError::AckLost(Box::new(e)))
    }
}

impl Drop for RedisDelivery {
    fn drop(&mut self) {
        if self.settled {
            return;
        }
        self.settle();
        let (place, mut conn, id, idle) = (
            self.place.clone(),
            self.conn.clone(),
            self.entry.id.clone(),
            self.visibility,
        );
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            drop(runtime.spawn(async move {
                let _ = place.touch(&mut conn, &id, Some(idle)).await;
            }));
        }
    }
}

/// A dead letter read from its stream for a replay. Acking it deletes it (`XDEL`); dropping or
/// nacking it leaves it there.
pub struct RedisLetter {
    pub(crate) stream: String,
    pub(crate) entry: Entry,
    pub(crate) conn: ConnectionManager,
}

impl fmt::Debug for RedisLetter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisLetter")
            .field("stream", &self.stream)
            .field("entry", &self.entry.id)
            .finish()
    }
}

#[async_trait]
impl Delivery for RedisLetter {
    fn payload(&self) -> &[u8] {
        &self.entry.payload
    }

    fn headers(&self) -> &Headers {
        &self.entry.headers
    }

    fn broker_message_id(&self) -> Option<&[u8]> {
        None
    }

    fn redelivered(&self) -> bool {
        false
    }

    fn coordinates(&self) -> Option<String> {
        Some(format!("{}/{}", self.stream, self.entry.id))
    }

    async fn ack(mut self: Box<Self>, _token: AckToken) -> Result<(), TransportError> {
        let deleted: redis::RedisResult<i64> = redis::cmd("XDEL")
            .arg(&self.stream)
            .arg(&self.entry.id)
            .query_async(&mut self.conn)
            .await;
        deleted
            .map(drop)
            .map_err(|e| TransportError::AckLost(Box::new(e)))
    }

    async fn nack(self: Box<Self>, _requeue: bool) -> Result<(), TransportError> {
        Ok(())
    }
}
