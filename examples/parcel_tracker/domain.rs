//! The parcel domain: the event, the two consumers' handlers and their tables, and the report.

#[cfg(feature = "mysql")]
use inbox::MySqlTx;
#[cfg(feature = "postgres")]
use inbox::PgTx;
use inbox::{
    BatchError, HandlerError, InboxStore, Message, OutgoingMessage, SqliteTx, Transport,
    TransportError, async_trait,
};
use serde::{Deserialize, Serialize};

pub const NOTIFICATION: &str = "notification";
pub const CARRIER_ASSIGNMENT: &str = "carrier-assignment";

/// What the producer publishes: JSON on the wire; its id travels in the AMQP `message_id`
/// property or the Kafka header `message-id`, not in the payload.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ParcelCreatedEvent {
    pub parcel_id: uuid::Uuid,
    pub tracking_number: String,
    pub destination: String,
}

impl ParcelCreatedEvent {
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("an event serializes")
    }
}

const DESTINATIONS: [&str; 6] = ["Amsterdam", "Berlin", "Lisbon", "Oslo", "Prague", "Vienna"];
const CARRIERS: [&str; 4] = ["DHL", "DPD", "GLS", "PostNL"];

pub fn sample_event(n: usize) -> ParcelCreatedEvent {
    ParcelCreatedEvent {
        parcel_id: uuid::Uuid::new_v4(),
        tracking_number: format!("TRK{n:08}"),
        destination: DESTINATIONS[n % DESTINATIONS.len()].to_owned(),
    }
}

/// Publishes `count` events; every `1/duplicates`-th one twice with the same id, as a producer
/// retrying after a lost publisher confirm would. Returns the messages sent.
pub async fn publish_events(
    transport: &dyn Transport,
    source: &str,
    count: usize,
    duplicates: f64,
    _seed: u64,
) -> Result<u64, TransportError> {
    let every = if duplicates > 0.0 {
        (1.0 / duplicates).round().max(1.0) as usize
    } else {
        usize::MAX
    };
    let mut sent = 0;
    for n in 0..count {
        let event = sample_event(n);
        let message = OutgoingMessage::new(uuid::Uuid::new_v4().to_string(), event.to_json())
            .with_key(event.parcel_id.to_string());
        let copies = if n % every == every - 1 { 2 } else { 1 };
        for _ in 0..copies {
            transport.publish(source, message.clone()).await?;
            sent += 1;
        }
    }
    Ok(sent)
}

/// Which SQL the demo's own statements are written in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dialect {
    Postgres,
    MySql,
    Sqlite,
}

/// `sql` (written with `$1, $2, …` in order) in `dialect`: MySQL's placeholders are `?`.
pub fn sql(sql: &'static str, dialect: Dialect) -> std::borrow::Cow<'static, str> {
    if dialect != Dialect::MySql {
        return sql.into();
    }
    let mut out = String::with_capacity(sql.len());
    let mut chars = sql.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '$' && chars.peek().is_some_and(char::is_ascii_digit) {
            while chars.peek().is_some_and(char::is_ascii_digit) {
                chars.next();
            }
            out.push('?');
        } else {
            out.push(c);
        }
    }
    out.into()
}

/// `INSERT … VALUES` of `rows` rows of `columns` placeholders each, in `dialect`: a batch
/// handler's one statement.
fn insert_rows(head: &str, columns: usize, rows: usize, dialect: Dialect) -> String {
    let mut out = String::from(head);
    for row in 0..rows {
        out.push_str(if row == 0 { " VALUES (" } else { ", (" });
        for column in 0..columns {
            if column > 0 {
                out.push_str(", ");
            }
            match dialect {
                Dialect::MySql => out.push('?'),
                _ => out.push_str(&format!("${}", row * columns + column + 1)),
            }
        }
        out.push(')');
    }
    out
}

/// Inserts `$rows` (four `String`s each) with `$head` in one statement through `$tx`.
macro_rules! insert_all {
    ($tx:expr, $head:expr, $rows:expr, $dialect:expr) => {{
        let rows: Vec<[String; 4]> = $rows;
        let statement = insert_rows($head, 4, rows.len(), $dialect);
        let mut query = sqlx::query(&statement);
        for value in rows.into_iter().flatten() {
            query = query.bind(value);
        }
        query.execute(&mut **$tx).await?;
        Ok(())
    }};
}

/// Each message's event; a message whose payload does not decode fails the batch, naming it.
fn events(messages: &[Message<'_>]) -> Result<Vec<ParcelCreatedEvent>, BatchError> {
    messages
        .iter()
        .map(|m| m.json().map_err(|e| BatchError::message(m.id, e)))
        .collect()
}

/// The demo's own tables (an application would keep these in its own migrations). A booking has
/// its own id and a non-unique `parcel_id`: a double booking would show as two rows. `parcels` is
/// the producer's table; `parcel_requests` remembers the API's idempotency keys.
pub fn table_statements(dialect: Dialect) -> Vec<String> {
    if dialect == Dialect::MySql {
        // Keys must be sized on MySQL, and MySQL 8 has no CREATE INDEX IF NOT EXISTS.
        let table = "ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_unicode_ci";
        return vec![
            format!("CREATE TABLE IF NOT EXISTS notifications (
                id VARCHAR(64) PRIMARY KEY, parcel_id VARCHAR(64) NOT NULL, tracking_number TEXT NOT NULL,
                text TEXT NOT NULL, KEY notifications_parcel (parcel_id)) {table}"),
            format!("CREATE TABLE IF NOT EXISTS carrier_bookings (
                id VARCHAR(64) PRIMARY KEY, parcel_id VARCHAR(64) NOT NULL, carrier TEXT NOT NULL,
                destination TEXT NOT NULL, KEY carrier_bookings_parcel (parcel_id)) {table}"),
            format!("CREATE TABLE IF NOT EXISTS parcels (
                id VARCHAR(64) PRIMARY KEY, tracking_number TEXT NOT NULL, destination TEXT NOT NULL,
                created_at DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6)) {table}"),
            format!("CREATE TABLE IF NOT EXISTS parcel_requests (
                idempotency_key VARCHAR(255) PRIMARY KEY, parcel_id VARCHAR(64) NOT NULL,
                fingerprint VARCHAR(128) NOT NULL,
                created_at DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6)) {table}"),
        ];
    }
    let now = if dialect == Dialect::Postgres {
        "TIMESTAMPTZ NOT NULL DEFAULT now()"
    } else {
        "TEXT NOT NULL DEFAULT CURRENT_TIMESTAMP"
    };
    vec![
        "CREATE TABLE IF NOT EXISTS notifications (
            id TEXT PRIMARY KEY, parcel_id TEXT NOT NULL, tracking_number TEXT NOT NULL, text TEXT NOT NULL)".to_owned(),
        "CREATE INDEX IF NOT EXISTS notifications_parcel ON notifications (parcel_id)".to_owned(),
        "CREATE TABLE IF NOT EXISTS carrier_bookings (
            id TEXT PRIMARY KEY, parcel_id TEXT NOT NULL, carrier TEXT NOT NULL, destination TEXT NOT NULL)".to_owned(),
        "CREATE INDEX IF NOT EXISTS carrier_bookings_parcel ON carrier_bookings (parcel_id)".to_owned(),
        format!("CREATE TABLE IF NOT EXISTS parcels (
            id TEXT PRIMARY KEY, tracking_number TEXT NOT NULL, destination TEXT NOT NULL, created_at {now})"),
        format!("CREATE TABLE IF NOT EXISTS parcel_requests (
            idempotency_key TEXT PRIMARY KEY, parcel_id TEXT NOT NULL, fingerprint TEXT NOT NULL, created_at {now})"),
    ]
}

/// Parcels whose every effect happened exactly once: one notification and one booking.
pub const COMPLETE_PARCEL_IDS: &str = "SELECT n.parcel_id FROM
       (SELECT parcel_id FROM notifications GROUP BY parcel_id HAVING count(*) = 1) n
     JOIN (SELECT parcel_id FROM carrier_bookings GROUP BY parcel_id HAVING count(*) = 1) b
       ON n.parcel_id = b.parcel_id";

/// Sends the customer a notification (here: writes it to `notifications`).
pub struct Notification;

/// Books a carrier slot (here: writes it to `carrier_bookings`). The carrier's API is flaky: about
/// one event in twenty fails on its first attempt and succeeds on the retry.
#[derive(Default)]
pub struct CarrierAssignment;

fn flaky(event: &ParcelCreatedEvent, attempt: u32) -> bool {
    attempt == 1
        && event
            .parcel_id
            .as_bytes()
            .iter()
            .map(|b| u32::from(*b))
            .sum::<u32>()
            % 20
            == 0
}

fn carrier_for(event: &ParcelCreatedEvent) -> &'static str {
    CARRIERS[event.destination.len() % CARRIERS.len()]
}

/// The same handlers for every store: the SQL is the same but for MySQL's placeholders, and the
/// transaction type differs.
macro_rules! handlers_for {
    ($tx:ty, $dialect:expr) => {
        #[async_trait]
        impl inbox::Handler<$tx> for Notification {
            async fn handle(&self, message: &Message<'_>, tx: &mut $tx) -> Result<(), HandlerError> {
                let event: ParcelCreatedEvent = message.json()?;
                sqlx::query(&sql("INSERT INTO notifications (id, parcel_id, tracking_number, text) VALUES ($1, $2, $3, $4)", $dialect))
                    .bind(uuid::Uuid::new_v4().to_string())
                    .bind(event.parcel_id.to_string())
                    .bind(&event.tracking_number)
                    .bind(format!("Your parcel {} is on its way to {}", event.tracking_number, event.destination))
                    .execute(&mut **tx)
                    .await?;
                Ok(())
            }
        }

        #[async_trait]
        impl inbox::Handler<$tx> for CarrierAssignment {
            async fn handle(&self, message: &Message<'_>, tx: &mut $tx) -> Result<(), HandlerError> {
                let event: ParcelCreatedEvent = message.json()?;
                if flaky(&event, message.attempt) {
                    return Err(HandlerError::transient("carrier API timed out"));
                }
                sqlx::query(&sql("INSERT INTO carrier_bookings (id, parcel_id, carrier, destination) VALUES ($1, $2, $3, $4)", $dialect))
                    .bind(uuid::Uuid::new_v4().to_string())
                    .bind(event.parcel_id.to_string())
                    .bind(carrier_for(&event))
                    .bind(&event.destination)
                    .execute(&mut **tx)
                    .await?;
                Ok(())
            }
        }
    };
}

/// The batch forms (`consume --handler batch`): each batch's rows in one statement.
macro_rules! batch_handlers_for {
    ($tx:ty, $dialect:expr) => {
        #[async_trait]
        impl inbox::BatchHandler<$tx> for Notification {
            async fn handle_batch(
                &self,
                messages: &[Message<'_>],
                tx: &mut $tx,
            ) -> Result<(), BatchError> {
                let rows = events(messages)?
                    .into_iter()
                    .map(|event| {
                        let text = format!(
                            "Your parcel {} is on its way to {}",
                            event.tracking_number, event.destination
                        );
                        [
                            uuid::Uuid::new_v4().to_string(),
                            event.parcel_id.to_string(),
                            event.tracking_number,
                            text,
                        ]
                    })
                    .collect();
                insert_all!(
                    tx,
                    "INSERT INTO notifications (id, parcel_id, tracking_number, text)",
                    rows,
                    $dialect
                )
            }
        }

        #[async_trait]
        impl inbox::BatchHandler<$tx> for CarrierAssignment {
            async fn handle_batch(
                &self,
                messages: &[Message<'_>],
                tx: &mut $tx,
            ) -> Result<(), BatchError> {
                let events = events(messages)?;
                for (message, event) in messages.iter().zip(&events) {
                    if flaky(event, message.attempt) {
                        return Err(BatchError::message(
                            message.id,
                            HandlerError::transient("carrier API timed out"),
                        ));
                    }
                }
                let rows = events
                    .iter()
                    .map(|event| {
                        [
                            uuid::Uuid::new_v4().to_string(),
                            event.parcel_id.to_string(),
                            carrier_for(event).to_owned(),
                            event.destination.clone(),
                        ]
                    })
                    .collect();
                insert_all!(
                    tx,
                    "INSERT INTO carrier_bookings (id, parcel_id, carrier, destination)",
                    rows,
                    $dialect
                )
            }
        }
    };
}

#[cfg(feature = "postgres")]
handlers_for!(PgTx, Dialect::Postgres);
#[cfg(feature = "postgres")]
batch_handlers_for!(PgTx, Dialect::Postgres);
#[cfg(feature = "mysql")]
batch_handlers_for!(MySqlTx, Dialect::MySql);
batch_handlers_for!(SqliteTx, Dialect::Sqlite);
#[cfg(feature = "mysql")]
handlers_for!(MySqlTx, Dialect::MySql);
handlers_for!(SqliteTx, Dialect::Sqlite);

/// What the database says the consumers did.
#[derive(Debug, Serialize)]
pub struct Report {
    pub notifications: u64,
    pub bookings: u64,
    pub parcels_seen: u64,
    pub parcels_complete: u64,
    pub double_notifications: u64,
    pub double_bookings: u64,
    /// Parcels in the producer's `parcels` table (created through the outbox).
    pub parcels_created: u64,
    /// Of those, the ones with exactly one notification and one booking.
    pub created_parcels_complete: u64,
    pub consumers: Vec<ConsumerCounts>,
}

#[derive(Debug, Serialize)]
pub struct ConsumerCounts {
    pub consumer: String,
    pub processed: u64,
    pub failing: u64,
    pub dead_lettered: u64,
}

impl Report {
    pub async fn read<'e, E, S>(
        store: &S,
        executor: E,
    ) -> Result<Self, Box<dyn std::error::Error + Send + Sync>>
    where
        E: sqlx::Executor<'e> + Copy,
        i64: sqlx::Type<E::Database> + for<'r> sqlx::Decode<'r, E::Database>,
        usize: sqlx::ColumnIndex<<E::Database as sqlx::Database>::Row>,
        for<'q> <E::Database as sqlx::Database>::Arguments<'q>:
            sqlx::IntoArguments<'q, E::Database>,
        S: InboxStore,
    {
        let count = |sql: &'static str| async move {
            let n: i64 = sqlx::query_scalar(sql).fetch_one(executor).await?;
            Ok::<u64, sqlx::Error>(n.max(0) as u64)
        };
        let consumers = store
            .stats(None)
            .await?
            .into_iter()
            .map(|s| ConsumerCounts {
                consumer: s.consumer,
                processed: s.processed,
                failing: s.failing,
                dead_lettered: s.dead,
            })
            .collect();
        Ok(Self {
            notifications: count("SELECT count(*) FROM notifications").await?,
            bookings: count("SELECT count(*) FROM carrier_bookings").await?,
            parcels_seen: count(
                "SELECT count(*) FROM (SELECT parcel_id FROM notifications UNION SELECT parcel_id FROM carrier_bookings) p",
            )
            .await?,
            parcels_complete: count(
                "SELECT count(*) FROM (SELECT n.parcel_id FROM
                   (SELECT parcel_id FROM notifications GROUP BY parcel_id HAVING count(*) = 1) n
                 JOIN (SELECT parcel_id FROM carrier_bookings GROUP BY parcel_id HAVING count(*) = 1) b
                   ON n.parcel_id = b.parcel_id) c",
            )
            .await?,
            parcels_created: 0,
            created_parcels_complete: 0,
            double_notifications: count(
                "SELECT count(*) FROM (SELECT parcel_id FROM notifications GROUP BY parcel_id HAVING count(*) > 1) d",
            )
            .await?,
            double_bookings: count(
                "SELECT count(*) FROM (SELECT parcel_id FROM carrier_bookings GROUP BY parcel_id HAVING count(*) > 1) d",
            )
            .await?,
            consumers,
        })
    }

    /// Every parcel seen has exactly one notification and one booking.
    pub fn consistent(&self) -> bool {
        self.double_notifications == 0
            && self.double_bookings == 0
            && self.parcels_complete == self.parcels_seen
            && self.created_parcels_complete == self.parcels_created
    }

    /// With `created` (the producer's parcel ids) and `complete` (the consumers' complete ones).
    pub fn with_parcels(
        mut self,
        created: &std::collections::HashSet<String>,
        complete: &std::collections::HashSet<String>,
    ) -> Self {
        self.parcels_created = created.len() as u64;
        self.created_parcels_complete = created.intersection(complete).count() as u64;
        self
    }

    pub fn table(&self) -> String {
        let mut out = String::new();
        let mut line =
            |label: &str, value: String| out.push_str(&format!("{label:<48}{value:>12}\n"));
        line("parcels created", self.parcels_created.to_string());
        line(
            "created parcels with one notification + one booking",
            self.created_parcels_complete.to_string(),
        );
        line("notifications", self.notifications.to_string());
        line("carrier bookings", self.bookings.to_string());
        line("parcels seen", self.parcels_seen.to_string());
        line(
            "parcels with one notification + one booking",
            self.parcels_complete.to_string(),
        );
        line(
            "parcels notified twice or more",
            self.double_notifications.to_string(),
        );
        line(
            "parcels booked twice or more",
            self.double_bookings.to_string(),
        );
        for c in &self.consumers {
            line(
                &format!("inbox {}: processed / failing / dead", c.consumer),
                format!("{} / {} / {}", c.processed, c.failing, c.dead_lettered),
            );
        }
        out
    }
}
