//! The producer's half: a parcel and its `ParcelCreatedEvent` written in one transaction (the
//! outbox), from the command line (`produce`) or an HTTP API (`serve`), and the relay that
//! publishes the events (`relay`).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
#[cfg(feature = "mysql")]
use inbox::MySqlStore;
#[cfg(feature = "postgres")]
use inbox::PostgresStore;
use inbox::outbox::{Outbox, OutboxStore};
use inbox::transport::{Capabilities, DeliveryStream, Subscription};
use inbox::{
    CancellationToken, OutgoingMessage, SqliteStore, StoreError, Transport, TransportError,
    async_trait,
};
use serde::Deserialize;

use crate::domain::{Dialect, ParcelCreatedEvent, sql};

type Error = Box<dyn std::error::Error + Send + Sync>;

/// What `POST /parcels` takes, and what `produce` makes up.
#[derive(Debug, Clone, Deserialize)]
pub struct NewParcel {
    pub tracking_number: String,
    pub destination: String,
}

impl NewParcel {
    /// Why the API refuses it, if it does.
    fn invalid(&self) -> Option<&'static str> {
        let bad = |s: &str, max: usize| s.trim().is_empty() || s.len() > max || s.contains('\0');
        if bad(&self.tracking_number, 64) {
            Some("tracking_number must be 1 to 64 bytes of text")
        } else if bad(&self.destination, 128) {
            Some("destination must be 1 to 128 bytes of text")
        } else {
            None
        }
    }

    /// What an idempotent retry must repeat exactly.
    fn fingerprint(&self) -> String {
        serde_json::json!([self.tracking_number, self.destination]).to_string()
    }
}

/// A parcel the producer created, or found created by an earlier request with the same
/// idempotency key.
pub struct Created {
    pub parcel_id: uuid::Uuid,
    pub replayed: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum CreateError {
    #[error("this Idempotency-Key was used for a different request")]
    KeyReused,
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl From<sqlx::Error> for CreateError {
    fn from(e: sqlx::Error) -> Self {
        Self::Store(e.into())
    }
}

/// The parcel writes, for either database.
#[async_trait]
pub trait ParcelStore: OutboxStore + Send + Sync + 'static {
    /// In one transaction: the parcel, its event in the outbox (ordering key: the parcel id) and,
    /// with an idempotency key, the key. A second request with the same key returns the first's
    /// parcel and writes nothing; a concurrent one waits for the first to commit.
    async fn create_parcel(
        &self,
        outbox: &Outbox<Self>,
        source: &str,
        parcel: &NewParcel,
        idempotency_key: Option<&str>,
    ) -> Result<Created, CreateError>;

    /// The database answers.
    async fn ping(&self) -> Result<(), StoreError>;
}

/// `create_parcel` and `ping` for one store. `$written` tells from the result of the
/// `parcel_requests` insert whether it wrote the row.
macro_rules! parcel_store_for {
    ($store:ty, $dialect:expr, written = $written:expr) => {
        #[async_trait]
        impl ParcelStore for $store {
            async fn create_parcel(
                &self,
                outbox: &Outbox<Self>,
                source: &str,
                parcel: &NewParcel,
                idempotency_key: Option<&str>,
            ) -> Result<Created, CreateError> {
                let parcel_id = uuid::Uuid::new_v4();
                // Its messages are written as it commits (the key's lock held only then).
                let mut tx = outbox.begin().await?;
                if let Some(key) = idempotency_key {
                    let fingerprint = parcel.fingerprint();
                    let insert = if $dialect == Dialect::MySql {
                        // No ON CONFLICT DO NOTHING; and with sqlx's CLIENT_FOUND_ROWS the
                        // affected rows are 1 either way: the duplicate path reports through
                        // LAST_INSERT_ID instead.
                        "INSERT INTO parcel_requests (idempotency_key, parcel_id, fingerprint)
                         VALUES (?, ?, ?)
                         ON DUPLICATE KEY UPDATE idempotency_key = IF(LAST_INSERT_ID(1), idempotency_key, idempotency_key)"
                    } else {
                        "INSERT INTO parcel_requests (idempotency_key, parcel_id, fingerprint)
                         VALUES ($1, $2, $3) ON CONFLICT (idempotency_key) DO NOTHING"
                    };
                    let result = sqlx::query(insert)
                        .bind(key)
                        .bind(parcel_id.to_string())
                        .bind(&fingerprint)
                        .execute(&mut **tx)
                        .await?;
                    if !($written)(&result) {
                        // An earlier request with this key committed (a concurrent one made this
                        // insert wait until it did): answer with its parcel.
                        tx.rollback().await?;
                        let (id, first): (String, String) = sqlx::query_as(&sql(
                            "SELECT parcel_id, fingerprint FROM parcel_requests WHERE idempotency_key = $1",
                            $dialect,
                        ))
                        .bind(key)
                        .fetch_one(self.pool())
                        .await?;
                        if first != fingerprint {
                            return Err(CreateError::KeyReused);
                        }
                        let parcel_id = id.parse().map_err(|e| {
                            StoreError::Invalid(format!("parcel_requests.parcel_id: {e}"))
                        })?;
                        return Ok(Created { parcel_id, replayed: true });
                    }
                }
                sqlx::query(&sql("INSERT INTO parcels (id, tracking_number, destination) VALUES ($1, $2, $3)", $dialect))
                    .bind(parcel_id.to_string())
                    .bind(&parcel.tracking_number)
                    .bind(&parcel.destination)
                    .execute(&mut **tx)
                    .await?;
                let event = ParcelCreatedEvent {
                    parcel_id,
                    tracking_number: parcel.tracking_number.clone(),
                    destination: parcel.destination.clone(),
                };
                let message =
                    OutgoingMessage::new(format!("parcel-created-{parcel_id}"), event.to_json())
                        .with_key(parcel_id.to_string());
                tx.send(source, message)?;
                // Writes the outbox row, commits, then wakes the relays (in this process at once;
                // in others by NOTIFY on PostgreSQL, sent after the commit).
                tx.commit().await?;
                Ok(Created { parcel_id, replayed: false })
            }

            async fn ping(&self) -> Result<(), StoreError> {
                sqlx::query("SELECT 1")
                    .execute(self.pool())
                    .await?;
                Ok(())
            }
        }
    };
}

#[cfg(feature = "postgres")]
parcel_store_for!(
    PostgresStore,
    Dialect::Postgres,
    written = |r: &sqlx::postgres::PgQueryResult| r.rows_affected() > 0
);
#[cfg(feature = "mysql")]
parcel_store_for!(
    MySqlStore,
    Dialect::MySql,
    written = |r: &sqlx::mysql::MySqlQueryResult| r.last_insert_id() == 0
);
parcel_store_for!(
    SqliteStore,
    Dialect::Sqlite,
    written = |r: &sqlx::sqlite::SqliteQueryResult| r.rows_affected() > 0
);

/// `produce`: `count` parcels, each in its own transaction with its event, eight at a time or
/// paced to `rate` per second.
pub async fn produce<S: ParcelStore>(
    outbox: Outbox<S>,
    source: &str,
    count: usize,
    rate: Option<f64>,
) -> Result<u64, Error> {
    use futures::StreamExt;
    // Paced by the clock, not by the writes: parcel n is due n / rate seconds after the start.
    let pace = rate.map(|r| Duration::from_secs_f64(1.0 / r.max(0.001)));
    let start = tokio::time::Instant::now();
    let parcels = futures::stream::iter(0..count).then(move |n| async move {
        if let Some(every) = pace {
            tokio::time::sleep_until(start + every.mul_f64(n as f64)).await;
        }
        n
    });
    let outbox = &outbox;
    let mut created = 0;
    let writes = parcels
        .map(|n| async move {
            let event = crate::domain::sample_event(n);
            let parcel = NewParcel {
                tracking_number: event.tracking_number,
                destination: event.destination,
            };
            outbox
                .store()
                .create_parcel(outbox, source, &parcel, None)
                .await
        })
        .buffer_unordered(8);
    let mut writes = std::pin::pin!(writes);
    while let Some(written) = writes.next().await {
        written?;
        created += 1;
    }
    Ok(created)
}

struct Api<S> {
    outbox: Outbox<S>,
    source: String,
}

/// `serve`: the HTTP API until `stop`. Prints `listening on http://ADDR` once bound.
pub async fn serve<S: ParcelStore>(
    store: S,
    source: String,
    addr: SocketAddr,
    stop: CancellationToken,
) -> Result<(), Error> {
    use std::io::Write;
    let listener = tokio::net::TcpListener::bind(addr).await?;
    println!("listening on http://{}", listener.local_addr()?);
    std::io::stdout().flush()?;
    let api = Arc::new(Api {
        outbox: Outbox::new(store),
        source,
    });
    let app = Router::new()
        .route("/parcels", post(create_parcel::<S>))
        .route("/health", get(health::<S>))
        .with_state(api);
    axum::serve(listener, app)
        .with_graceful_shutdown(stop.cancelled_owned())
        .await?;
    Ok(())
}

/// `POST /parcels`: `201 {"parcel_id": …}`; a retry with the same `Idempotency-Key` gets the
/// same answer (and `Idempotent-Replayed: true`) without a second parcel.
async fn create_parcel<S: ParcelStore>(
    State(api): State<Arc<Api<S>>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    // The body is parsed here rather than by axum's `Json`, to tell bad JSON (400) from JSON
    // of the wrong shape (422) with a reason of one line, whatever the content type says.
    let parcel: NewParcel = match serde_json::from_slice(&body) {
        Ok(parcel) => parcel,
        Err(e) if e.is_data() => return refuse(StatusCode::UNPROCESSABLE_ENTITY, &e.to_string()),
        Err(e) => return refuse(StatusCode::BAD_REQUEST, &format!("not JSON: {e}")),
    };
    if let Some(reason) = parcel.invalid() {
        return refuse(StatusCode::UNPROCESSABLE_ENTITY, reason);
    }
    let key = match headers.get("idempotency-key").map(|v| v.to_str()) {
        None => None,
        Some(Ok(key)) if !key.is_empty() && key.len() <= 255 => Some(key),
        Some(_) => {
            return refuse(
                StatusCode::BAD_REQUEST,
                "Idempotency-Key must be 1 to 255 visible ASCII characters",
            );
        }
    };
    match api
        .outbox
        .store()
        .create_parcel(&api.outbox, &api.source, &parcel, key)
        .await
    {
        Ok(created) => {
            let body = axum::Json(serde_json::json!({ "parcel_id": created.parcel_id }));
            if created.replayed {
                (StatusCode::CREATED, [("idempotent-replayed", "true")], body).into_response()
            } else {
                (StatusCode::CREATED, body).into_response()
            }
        }
        Err(CreateError::KeyReused) => refuse(
            StatusCode::UNPROCESSABLE_ENTITY,
            &CreateError::KeyReused.to_string(),
        ),
        Err(CreateError::Store(e)) => {
            tracing::error!(error = %inbox::error_chain(&e), "could not create a parcel");
            if e.is_transient() {
                refuse(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "the database is unavailable; retry",
                )
            } else {
                refuse(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "the parcel could not be written",
                )
            }
        }
    }
}

/// A refusal: its status and a reason on one line.
fn refuse(status: StatusCode, reason: &str) -> Response {
    let line: String = reason
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .take(300)
        .collect();
    (status, format!("{line}\n")).into_response()
}

/// `GET /health`: 200 when the database answers, 503 otherwise.
async fn health<S: ParcelStore>(State(api): State<Arc<Api<S>>>) -> Response {
    match api.outbox.store().ping().await {
        Ok(()) => (StatusCode::OK, "ok\n").into_response(),
        Err(_) => refuse(
            StatusCode::SERVICE_UNAVAILABLE,
            "the database is unavailable",
        ),
    }
}

/// The relay's transport, with the crash harness's fault: after a publish the broker confirmed,
/// a fraction of publishes stall for ever (after `stalled after publish: <id>` on stderr when
/// `announce`), so that a SIGKILL — or the demo's abort — lands between publish and mark.
#[derive(Debug)]
pub struct StallAfterPublish {
    inner: Arc<dyn Transport>,
    fraction: f64,
    announce: bool,
    /// Notified at each stall.
    pub stalled: Arc<tokio::sync::Notify>,
    /// Publishes the broker confirmed.
    pub published: Arc<AtomicU64>,
    dice: std::sync::Mutex<u64>,
}

impl StallAfterPublish {
    pub fn new(inner: Arc<dyn Transport>, fraction: f64, seed: u64, announce: bool) -> Self {
        Self {
            inner,
            fraction,
            announce,
            stalled: Arc::new(tokio::sync::Notify::new()),
            published: Arc::new(AtomicU64::new(0)),
            dice: std::sync::Mutex::new(splitmix64(seed).max(1)),
        }
    }

    /// Counts into `published` (shared by the relays a run starts one after another).
    pub fn counting_into(mut self, published: Arc<AtomicU64>) -> Self {
        self.published = published;
        self
    }

    fn roll(&self) -> f64 {
        let mut x = self.dice.lock().expect("not poisoned");
        // xorshift64
        *x ^= *x << 13;
        *x ^= *x >> 7;
        *x ^= *x << 17;
        (*x >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Spreads a small seed over all 64 bits: xorshift's first outputs from a seed like 42 are tiny,
/// and every first publish would stall.
fn splitmix64(seed: u64) -> u64 {
    let mut z = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[async_trait]
impl Transport for StallAfterPublish {
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
        self.inner.publish(destination, message).await?;
        self.published.fetch_add(1, Ordering::SeqCst);
        if self.fraction > 0.0 && self.roll() < self.fraction {
            if self.announce {
                eprintln!("stalled after publish: {id}");
            }
            self.stalled.notify_one();
            std::future::pending::<()>().await;
        }
        Ok(())
    }
    async fn read_dead_letters(&self, destination: &str) -> Result<DeliveryStream, TransportError> {
        self.inner.read_dead_letters(destination).await
    }
    async fn drained(&self) {
        self.inner.drained().await
    }
}

/// `relay`: declares the consumers' topology for `source`, then publishes every pending row (to
/// the destination stored in it) until `stop`; prints what it did on stderr.
pub async fn relay<S: ParcelStore>(
    store: S,
    transport: Arc<dyn Transport>,
    lease: Duration,
    stop: CancellationToken,
) -> Result<(), Error> {
    let relay = Outbox::new(store).relay(transport).lease(lease);
    let report = relay.run(stop).await?;
    eprintln!(
        "relay: batches {} published {} failed {} dead {} fenced {}",
        report.batches, report.published, report.failed, report.dead, report.fenced
    );
    Ok(())
}

/// The demo's relay, crashing: each crash (a publish confirmed, then the relay aborted before it
/// marks its batch) leaves rows that the next relay publishes again once their lease lapses, and
/// the consumers' inboxes discard the copies. Returns the crashes.
pub async fn crashing_relay<S: ParcelStore>(
    outbox: Outbox<S>,
    broker: Arc<dyn Transport>,
    seed: u64,
    published: Arc<AtomicU64>,
    stop: CancellationToken,
) -> Result<u64, Error> {
    let mut crashes = 0;
    for incarnation in 0u64.. {
        let transport =
            StallAfterPublish::new(Arc::clone(&broker), 0.01, seed ^ incarnation, false)
                .counting_into(Arc::clone(&published));
        let stalled = Arc::clone(&transport.stalled);
        // Small batches, one at a time: a stall aborts everything in flight, so with the
        // defaults (500 rows, two batches) almost no batch would get through a 1 % stall.
        let relay = outbox
            .relay(Arc::new(transport))
            .batch_size(100)
            .concurrency(1)
            .lease(Duration::from_millis(300));
        let relay_stop = stop.child_token();
        let mut running = {
            let relay_stop = relay_stop.clone();
            tokio::spawn(async move { relay.run(relay_stop).await })
        };
        tokio::select! {
            () = stalled.notified() => {
                running.abort();
                crashes += 1;
            }
            done = &mut running => {
                done??;
                break;
            }
        }
    }
    Ok(crashes)
}
