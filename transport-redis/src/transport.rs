//! The transport: connections, consumer groups, the reading loop, and the [`Transport`]
//! implementation.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::AtomicUsize;
use std::time::Duration;

use async_trait::async_trait;
use futures::StreamExt;
use inbox_core::{
    Capabilities, Delivery, DeliveryStream, OutgoingMessage, Subscription, Transport,
    TransportError,
};
use redis::aio::{ConnectionManager, ConnectionManagerConfig, MultiplexedConnection};
use redis::{AsyncConnectionConfig, Client, Value};
use tokio::time::Instant;

use crate::delivery::{Place, RedisDelivery, RedisLetter};
use crate::error::transport_error;
use crate::wire::{self, Entry};
use crate::{RedisConfig, Trim};

/// A Redis server (7.0 or later: its `XAUTOCLAIM` removes deleted entries from the pending list)
/// reached through a `redis://` or `rediss://` URL.
///
/// Commands share one connection that reconnects by itself; each subscription reads on a
/// connection of its own (`XREADGROUP … BLOCK` holds its connection), and a subscription whose
/// connection breaks ends with an error, after which the consumer subscribes again.
pub struct RedisTransport {
    /// The server's address, without credentials (for logs and `Debug`).
    server: String,
    pub(crate) config: RedisConfig,
    client: Client,
    pub(crate) conn: ConnectionManager,
    /// This process's consumer name in every group: `inbox-<pid>-<random>`.
    instance: String,
    pub(crate) unsettled: Arc<AtomicUsize>,
}

impl fmt::Debug for RedisTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisTransport")
            .field("server", &self.server)
            .field("config", &self.config)
            .field("instance", &self.instance)
            .finish()
    }
}

impl RedisTransport {
    /// Connects to `url` (`redis://[:password@]host:port[/db]`, `rediss://` for TLS). Fails
    /// when the server does not answer.
    pub async fn connect(
        url: impl Into<String>,
        config: RedisConfig,
    ) -> Result<Self, TransportError> {
        let url = url.into();
        // The URL is not quoted: a password can also sit in its query (`?pass=`).
        let client = Client::open(url.as_str()).map_err(|e| {
            TransportError::Config(format!(
                "invalid Redis URL: {}",
                e.to_string().replace(&url, "<url>")
            ))
        })?;
        Self::connect_with_client(client, config).await
    }

    /// Connects with a client of your own: TLS with client certificates
    /// (`redis::Client::build_with_tls`), or other connection settings redis-rs offers.
    pub async fn connect_with_client(
        client: Client,
        config: RedisConfig,
    ) -> Result<Self, TransportError> {
        config.check()?;
        let info = client.get_connection_info();
        let shown = info.addr().to_string();
        let conn = ConnectionManager::new_with_config(
            client.clone(),
            ConnectionManagerConfig::new()
                .set_response_timeout(Some(config.response_timeout))
                .set_connection_timeout(Some(config.response_timeout))
                .set_max_delay(Duration::from_secs(5)),
        )
        .await
        .map_err(|e| {
            TransportError::Disconnected(format!("cannot connect to Redis at {shown}: {e}").into())
        })?;
        tracing::info!(server = %shown, "connected to Redis");
        let instance = format!(
            "inbox-{}-{}",
            std::process::id(),
            &uuid::Uuid::new_v4().simple().to_string()[..8]
        );
        Ok(Self {
            server: shown,
            config,
            client,
            conn,
            instance,
            unsettled: Arc::default(),
        })
    }

    /// This process's consumer name in its groups.
    pub fn instance(&self) -> &str {
        &self.instance
    }

    /// Removes the entries of `stream` that every consumer group on it has acknowledged
    /// (`XTRIM … MINID`, up to the oldest entry any group has pending or not yet read), and
    /// returns how many went. What [`Trim::Acknowledged`] runs periodically; an operator's
    /// one-off. Nothing goes from a stream with no group.
    pub async fn trim_acknowledged(&self, stream: &str) -> Result<u64, TransportError> {
        trim_acknowledged(&mut self.conn.clone(), stream).await
    }

    /// `XGROUP CREATE <source> <consumer> 0 MKSTREAM`: the group reads the stream from its
    /// beginning, so nothing written before the consumer first runs is skipped.
    async fn declare_group(&self, source: &str, group: &str) -> Result<(), TransportError> {
        let created: redis::RedisResult<Value> = redis::cmd("XGROUP")
            .arg("CREATE")
            .arg(source)
            .arg(group)
            .arg("0")
            .arg("MKSTREAM")
            .query_async(&mut self.conn.clone())
            .await;
        match created {
            Ok(_) => Ok(()),
            Err(e) if e.code() == Some("BUSYGROUP") => Ok(()),
            Err(e) => Err(transport_error(e)),
        }
    }

    /// The entries of `stream` up to its last one at the call, oldest first.
    pub(crate) async fn read_stream(
        &self,
        stream: &str,
    ) -> Result<
        futures::stream::BoxStream<'static, Result<RedisLetter, TransportError>>,
        TransportError,
    > {
        let mut conn = self.conn.clone();
        // The last entry now: letters added during the read are left for the next one.
        let last: Value = redis::cmd("XREVRANGE")
            .arg(stream)
            .arg("+")
            .arg("-")
            .arg("COUNT")
            .arg(1)
            .query_async(&mut conn)
            .await
            .map_err(transport_error)?;
        let Some(last) = wire::entries(&last).pop().map(|e| e.id) else {
            return Ok(futures::stream::empty().boxed());
        };
        let stream = stream.to_owned();
        let pages = futures::stream::unfold(Some("-".to_owned()), move |from| {
            let (mut conn, stream, last) = (conn.clone(), stream.clone(), last.clone());
            async move {
                let from = from?;
                let page: Result<Value, _> = redis::cmd("XRANGE")
                    .arg(&stream)
                    .arg(&from)
                    .arg(&last)
                    .arg("COUNT")
                    .arg(100)
                    .query_async(&mut conn)
                    .await;
                match page {
                    Err(e) => Some((vec![Err(transport_error(e))], None)),
                    Ok(page) => {
                        let entries = wire::entries(&page);
                        let next = match entries.last() {
                            Some(e) if e.id != last && entries.len() == 100 => {
                                Some(format!("({}", e.id))
                            }
                            _ => None,
                        };
                        let letters = entries
                            .into_iter()
                            .map(|entry| {
                                Ok(RedisLetter {
                                    stream: stream.clone(),
                                    entry,
                                    conn: conn.clone(),
                                })
                            })
                            .collect();
                        Some((letters, next))
                    }
                }
            }
        });
        Ok(pages.flat_map(futures::stream::iter).boxed())
    }
}

/// A subscription's reading loop: new entries with `XREADGROUP`, entries idle past the
/// visibility timeout (crashed instances', handed-back ones) with `XAUTOCLAIM`, and every so
/// often the group's housekeeping.
struct Reader {
    reading: MultiplexedConnection,
    conn: ConnectionManager,
    place: Place,
    prefetch: usize,
    config: RedisConfig,
    unsettled: Arc<AtomicUsize>,
    /// Read or claimed, not yet taken by the engine: deliveries already, so their idle time is
    /// kept from the moment they were read, and a dropped stream hands them back.
    ready: VecDeque<RedisDelivery>,
    cursor: String,
    next_claim: Instant,
    next_housekeeping: Instant,
    next_trim: Option<Instant>,
}

impl Reader {
    async fn next(&mut self) -> Result<Box<dyn Delivery>, TransportError> {
        loop {
            if let Some(delivery) = self.ready.pop_front() {
                return Ok(Box::new(delivery));
            }
            let now = Instant::now();
            if now >= self.next_housekeeping {
                // Twice per idle limit, at most once a minute.
                self.next_housekeeping = now
                    + (self.config.forget_idle_consumers / 2)
                        .clamp(self.config.claim_interval, Duration::from_secs(60));
                self.forget_idle_consumers().await;
            }
            if let Some(at) = self.next_trim
                && now >= at
            {
                if let Trim::Acknowledged { every } = self.config.trim {
                    self.next_trim = Some(now + every);
                }
                self.trim().await;
            }
            if now >= self.next_claim {
                self.claim().await?;
                // A pending list longer than one call: the scan goes on at once until it is
                // through.
                if self.cursor == "0-0" {
                    self.next_claim = Instant::now() + self.config.claim_interval;
                }
                continue;
            }
            let block = self
                .config
                .block
                .min(self.next_claim.saturating_duration_since(now))
                .max(Duration::from_millis(1));
            let reply: Value = redis::cmd("XREADGROUP")
                .arg("GROUP")
                .arg(&*self.place.group)
                .arg(&*self.place.consumer)
                .arg("COUNT")
                .arg(self.prefetch)
                .arg("BLOCK")
                .arg(block.as_millis() as u64)
                .arg("STREAMS")
                .arg(&*self.place.stream)
                .arg(">")
                .query_async(&mut self.reading)
                .await
                .map_err(transport_error)?;
            for entry in wire::read_reply(&reply) {
                let delivery = self.delivery(entry, Some(1));
                self.ready.push_back(delivery);
            }
        }
    }

    fn delivery(&self, entry: Entry, delivered: Option<u32>) -> RedisDelivery {
        RedisDelivery::new(
            entry,
            delivered,
            self.place.clone(),
            self.conn.clone(),
            &self.config,
            &self.unsettled,
        )
    }

    /// `XAUTOCLAIM`s entries idle past the visibility timeout, with their delivery counts from
    /// `XPENDING`. Returns how many it claimed.
    async fn claim(&mut self) -> Result<usize, TransportError> {
        let reply: Value = redis::cmd("XAUTOCLAIM")
            .arg(&*self.place.stream)
            .arg(&*self.place.group)
            .arg(&*self.place.consumer)
            .arg(self.config.visibility_timeout.as_millis() as u64)
            .arg(&self.cursor)
            .arg("COUNT")
            .arg(self.prefetch)
            .query_async(&mut self.conn)
            .await
            .map_err(transport_error)?;
        let (cursor, claimed) = wire::autoclaim_reply(&reply);
        self.cursor = cursor;
        if claimed.is_empty() {
            return Ok(0);
        }
        // Claimed, the entries are ours: delivered even when their counts cannot be read (the
        // count is then unknown, not made up).
        let counts = match self.delivery_counts(&claimed).await {
            Ok(counts) => counts,
            Err(e) => {
                tracing::debug!(error = %e, "delivery counts not read");
                HashMap::new()
            }
        };
        let found = claimed.len();
        for entry in claimed {
            let delivered = counts.get(&entry.id).copied();
            let delivery = self.delivery(entry, delivered);
            self.ready.push_back(delivery);
        }
        Ok(found)
    }

    /// The delivery counts of `entries`, one `XPENDING <stream> <group> <id> <id> 1` each, in
    /// one round trip.
    async fn delivery_counts(
        &mut self,
        entries: &[Entry],
    ) -> Result<HashMap<String, u32>, TransportError> {
        let mut pipe = redis::pipe();
        for entry in entries {
            pipe.cmd("XPENDING")
                .arg(&*self.place.stream)
                .arg(&*self.place.group)
                .arg(&entry.id)
                .arg(&entry.id)
                .arg(1);
        }
        let replies: Vec<Value> = pipe
            .query_async(&mut self.conn)
            .await
            .map_err(transport_error)?;
        let mut counts = HashMap::new();
        for reply in replies {
            if let Value::Array(rows) = reply
                && let Some(Value::Array(fields)) = rows.first()
                && let (Some(id), Some(Value::Int(n))) =
                    (fields.first().and_then(as_text), fields.get(3))
            {
                counts.insert(id, u32::try_from(*n).unwrap_or(u32::MAX));
            }
        }
        Ok(counts)
    }

    /// Removes other consumers of the group that have nothing pending and have been idle longer
    /// than [`RedisConfig::forget_idle_consumers`]: crashed instances, once their entries were
    /// claimed. In one script, so a consumer that reads between the look and the removal keeps
    /// what it read. Best effort: a failure waits for the next round.
    async fn forget_idle_consumers(&mut self) {
        let removed: redis::RedisResult<Vec<Value>> = redis::Script::new(FORGET_IDLE)
            .key(&*self.place.stream)
            .arg(&*self.place.group)
            .arg(&*self.place.consumer)
            .arg(self.config.forget_idle_consumers.as_millis() as u64)
            .invoke_async(&mut self.conn)
            .await;
        match removed {
            Ok(names) => {
                for name in names.iter().filter_map(as_text) {
                    tracing::info!(stream = %self.place.stream, group = %self.place.group, consumer = %name, "removed an idle consumer with nothing pending (a crashed instance)");
                }
            }
            Err(e) => tracing::debug!(error = %e, "idle consumers not looked at"),
        }
    }

    /// Trims acknowledged entries; best effort (a failure waits for the next round).
    async fn trim(&mut self) {
        match trim_acknowledged(&mut self.conn, &self.place.stream).await {
            Ok(0) => {}
            Ok(n) => {
                tracing::debug!(stream = %self.place.stream, trimmed = n, "acknowledged entries trimmed")
            }
            Err(e) => tracing::debug!(stream = %self.place.stream, error = %e, "trimming failed"),
        }
    }
}

/// Removes the group's consumers other than `ARGV[2]` with nothing pending, idle at least
/// `ARGV[3]` ms; returns their names.
const FORGET_IDLE: &str = r"
local removed = {}
for _, consumer in ipairs(redis.call('XINFO', 'CONSUMERS', KEYS[1], ARGV[1])) do
  local fields = {}
  for i = 1, #consumer, 2 do fields[consumer[i]] = consumer[i + 1] end
  if fields['name'] ~= ARGV[2] and fields['pending'] == 0 and fields['idle'] >= tonumber(ARGV[3]) then
    redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], fields['name'])
    table.insert(removed, fields['name'])
  end
end
return removed
";

/// `XTRIM <stream> MINID <floor>`, the floor being the oldest entry any group has pending or not
/// yet read (its last delivered id, or its oldest pending one); all in one script, so a group
/// created or moved meanwhile is not trimmed under. Returns how many entries went.
const TRIM_ACKNOWLEDGED: &str = r"
local function parse(id)
  local ms, seq = string.match(id, '^(%d+)-(%d+)$')
  return tonumber(ms), tonumber(seq)
end
local floor, floor_ms, floor_seq
local function lower(id)
  local ms, seq = parse(id)
  if floor == nil or ms < floor_ms or (ms == floor_ms and seq < floor_seq) then
    floor, floor_ms, floor_seq = id, ms, seq
  end
end
local groups = redis.call('XINFO', 'GROUPS', KEYS[1])
if #groups == 0 then return 0 end
for _, group in ipairs(groups) do
  local fields = {}
  for i = 1, #group, 2 do fields[group[i]] = group[i + 1] end
  lower(fields['last-delivered-id'])
  if fields['pending'] > 0 then
    local summary = redis.call('XPENDING', KEYS[1], fields['name'])
    if summary[2] then lower(summary[2]) end
  end
end
if floor_ms == 0 and floor_seq == 0 then return 0 end
return redis.call('XTRIM', KEYS[1], 'MINID', floor)
";

/// Trims what every group acknowledged ([`TRIM_ACKNOWLEDGED`]); returns how many entries went.
/// Nothing goes when the stream has no group.
pub(crate) async fn trim_acknowledged(
    conn: &mut ConnectionManager,
    stream: &str,
) -> Result<u64, TransportError> {
    let trimmed: i64 = redis::Script::new(TRIM_ACKNOWLEDGED)
        .key(stream)
        .invoke_async(conn)
        .await
        .map_err(transport_error)?;
    Ok(u64::try_from(trimmed).unwrap_or(0))
}

fn as_text(value: &Value) -> Option<String> {
    match value {
        Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
        Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    }
}

#[async_trait]
impl Transport for RedisTransport {
    fn name(&self) -> &'static str {
        "redis"
    }

    /// Handing back makes an entry claimable again; the pending-entries list counts deliveries;
    /// the entry id is the record's position. No order is kept.
    fn capabilities(&self) -> Capabilities {
        Capabilities::basic()
            .with_delivery_count(true)
            .with_coordinates(true)
    }

    async fn declare(&self, subscription: &Subscription) -> Result<(), TransportError> {
        self.declare_group(&subscription.source, subscription.consumer.as_str())
            .await
    }

    async fn subscribe(
        &self,
        subscription: &Subscription,
    ) -> Result<DeliveryStream, TransportError> {
        let group = subscription.consumer.as_str();
        self.declare_group(&subscription.source, group).await?;
        let reading = self
            .client
            .get_multiplexed_async_connection_with_config(
                &AsyncConnectionConfig::new()
                    .set_connection_timeout(Some(self.config.response_timeout))
                    .set_response_timeout(Some(self.config.block + self.config.response_timeout)),
            )
            .await
            .map_err(transport_error)?;
        let now = Instant::now();
        let reader = Reader {
            reading,
            conn: self.conn.clone(),
            place: Place {
                stream: subscription.source.as_str().into(),
                group: group.into(),
                consumer: self.instance.as_str().into(),
            },
            prefetch: usize::from(subscription.prefetch.max(1)),
            config: self.config.clone(),
            unsettled: Arc::clone(&self.unsettled),
            ready: VecDeque::new(),
            cursor: "0-0".to_owned(),
            // Entries this group left pending (a crashed instance's) are claimed first.
            next_claim: now,
            next_housekeeping: now,
            next_trim: match self.config.trim {
                Trim::Never => None,
                Trim::Acknowledged { .. } => Some(now),
            },
        };
        // The first error ends the stream: the consumer subscribes again with backoff, on a
        // new reading connection.
        let deliveries = futures::stream::unfold(Some(reader), |reader| async move {
            let mut reader = reader?;
            match reader.next().await {
                Ok(delivery) => Some((Ok(delivery), Some(reader))),
                Err(e) => Some((Err(e), None)),
            }
        });
        Ok(deliveries.boxed())
    }

    /// The destination stream's entries at the call, oldest first. Acking one deletes it
    /// (`XDEL`); dropping or nacking it leaves it. Two replays at once both read every letter:
    /// the inbox lets only one of them revive each message.
    async fn read_dead_letters(&self, destination: &str) -> Result<DeliveryStream, TransportError> {
        let letters = self.read_stream(destination).await?;
        Ok(letters
            .map(|letter| letter.map(|letter| Box::new(letter) as Box<dyn Delivery>))
            .boxed())
    }

    /// `XADD <destination> * message-id <id> payload <body> [<header> <value>]…`; done when the
    /// server replied with the entry id (what that means for durability is the server's
    /// `appendfsync`: see the README).
    async fn publish(
        &self,
        destination: &str,
        message: OutgoingMessage,
    ) -> Result<(), TransportError> {
        let mut command = redis::cmd("XADD");
        command.arg(destination).arg("*");
        for (name, value) in wire::fields(&message) {
            command.arg(&name[..]).arg(&value[..]);
        }
        let mut conn = self.conn.clone();
        let mut sent: redis::RedisResult<Value> = command.query_async(&mut conn).await;
        // The shared connection broke (a server restart): the manager reconnects on the next
        // command. One more try; should the first have been written after all, the copy is a
        // duplicate the inbox discards.
        if let Err(e) = &sent
            && (e.is_io_error() || e.is_connection_dropped())
        {
            tracing::debug!(error = %e, destination, "publish failed on a broken connection; one more try");
            sent = command.query_async(&mut conn).await;
        }
        sent.map_err(|e| match transport_error(e) {
            TransportError::Disconnected(e) => TransportError::NotConfirmed(e),
            other => other,
        })?;
        Ok(())
    }
}
