//! The transport: the connection, streams and durable consumers, and the [`Transport`]
//! implementation.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use async_nats::jetstream::consumer::{self, AckPolicy, DeliverPolicy, pull};
use async_nats::jetstream::context::{CreateStreamErrorKind, GetStreamByNameErrorKind};
use async_nats::jetstream::stream::{self, RetentionPolicy, StorageType};
use async_nats::jetstream::{self, Context};
use async_nats::{Client, ConnectOptions, Event};
use async_trait::async_trait;
use futures::StreamExt;
use inbox_core::{
    Capabilities, Delivery, DeliveryStream, OutgoingMessage, Subscription, Transport,
    TransportError, dead_letter_headers,
};

use crate::delivery::{NatsDelivery, NatsLetter};
use crate::error::{api, publish_error};
use crate::headers::{from_header_map, nats_id, to_header_map};
use crate::names::{check_subject, durable_name, stream_name};
use crate::{NatsConfig, Retention};

/// How long a pull request waits on the server before the client asks again, and the idle
/// heartbeat within it: a server that stops answering is noticed after two missed heartbeats.
const PULL_EXPIRES: Duration = Duration::from_secs(30);
const PULL_HEARTBEAT: Duration = Duration::from_secs(5);

/// A NATS server (or cluster) with JetStream, reached through a `nats://` or `tls://` URL.
///
/// The client reconnects by itself after the connection is lost; a delivery stream that breaks
/// meanwhile ends with an error, and the consumer subscribes again.
pub struct NatsTransport {
    url: String,
    pub(crate) config: NatsConfig,
    pub(crate) client: Client,
    pub(crate) jetstream: Context,
    /// Which stream holds each subject published to or consumed from so far.
    streams: std::sync::Mutex<HashMap<String, String>>,
    pub(crate) unsettled: Arc<AtomicUsize>,
    pub(crate) connections: Arc<AtomicUsize>,
}

impl fmt::Debug for NatsTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatsTransport")
            .field("url", &redact(&self.url))
            .field("config", &self.config)
            .field("connections", &self.connections.load(Ordering::Relaxed))
            .finish()
    }
}

/// The URL without its password, or without its token (`nats://TOKEN@host`: a user name alone
/// is a token in NATS URLs).
pub fn redact(url: &str) -> String {
    url.split(',').map(redact_one).collect::<Vec<_>>().join(",")
}

fn redact_one(url: &str) -> String {
    let (clean, credentials) = split_credentials(url);
    match credentials {
        None => clean,
        Some(Credentials::Token(_)) => with_userinfo(&clean, "***"),
        Some(Credentials::User(user, _)) => with_userinfo(&clean, &format!("{user}:***")),
    }
}

/// Credentials taken out of a URL, handed to the client as options: async-nats logs the
/// servers' addresses at debug level with whatever they hold.
enum Credentials {
    User(String, String),
    Token(String),
}

/// `url` without its user information, and what it held. Also for `tok@host:4222` (no scheme).
fn split_credentials(url: &str) -> (String, Option<Credentials>) {
    let url = url.trim();
    let start = url.find("://").map_or(0, |i| i + 3);
    let authority_end = url[start..].find('/').map_or(url.len(), |i| start + i);
    let Some(at) = url[start..authority_end].rfind('@').map(|i| start + i) else {
        return (url.to_owned(), None);
    };
    let userinfo = &url[start..at];
    let clean = format!("{}{}", &url[..start], &url[at + 1..]);
    let credentials = match userinfo.split_once(':') {
        Some((user, password)) => {
            Credentials::User(percent_decoded(user), percent_decoded(password))
        }
        None => Credentials::Token(percent_decoded(userinfo)),
    };
    (clean, Some(credentials))
}

fn with_userinfo(clean: &str, userinfo: &str) -> String {
    let start = clean.find("://").map_or(0, |i| i + 3);
    format!("{}{userinfo}@{}", &clean[..start], &clean[start..])
}

fn percent_decoded(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%'
            && let Some(byte) = text
                .get(i + 1..i + 3)
                .and_then(|hex| u8::from_str_radix(hex, 16).ok())
        {
            out.push(byte);
            i += 3;
            continue;
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

impl NatsTransport {
    /// Connects to `url` (for example `nats://127.0.0.1:4222`; several servers separated by
    /// commas). Fails when no server answers.
    pub async fn connect(
        url: impl Into<String>,
        config: NatsConfig,
    ) -> Result<Self, TransportError> {
        Self::connect_with_options(url, ConnectOptions::new(), config).await
    }

    /// Connects with the client's own options: TLS (`require_tls`, `add_root_certificates`,
    /// `add_client_certificate`), credentials (`credentials_file`, `nkey`, `user_and_password`),
    /// reconnect policy. The connection name, the request timeout
    /// ([`NatsConfig::request_timeout`]) and the event callback are the transport's. A user and
    /// password, or a token, in the URL are taken out of it and passed as options, so the client
    /// never logs them.
    pub async fn connect_with_options(
        url: impl Into<String>,
        mut options: ConnectOptions,
        config: NatsConfig,
    ) -> Result<Self, TransportError> {
        let url = url.into();
        if config.ack_wait < Duration::from_secs(1) || config.request_timeout.is_zero() {
            return Err(TransportError::Config(format!(
                "ack_wait must be at least 1 s and request_timeout above zero (got {:?}, {:?})",
                config.ack_wait, config.request_timeout
            )));
        }
        let mut servers = Vec::new();
        for one in url.split(',') {
            let (clean, credentials) = split_credentials(one);
            options = match credentials {
                Some(Credentials::User(user, password)) => {
                    options.user_and_password(user, password)
                }
                Some(Credentials::Token(token)) => options.token(token),
                None => options,
            };
            servers.push(clean);
        }
        let servers = servers.join(",");
        let connections = Arc::new(AtomicUsize::new(0));
        let counted = Arc::clone(&connections);
        let shown = redact(&url);
        let options = options
            .name(&config.connection_name)
            .request_timeout(Some(config.request_timeout))
            .event_callback(move |event| {
                let counted = Arc::clone(&counted);
                let shown = shown.clone();
                async move {
                    match event {
                        Event::Connected => {
                            if counted.fetch_add(1, Ordering::SeqCst) > 0 {
                                tracing::info!(url = %shown, "reconnected to NATS");
                            }
                        }
                        Event::Disconnected => {
                            tracing::warn!(url = %shown, "NATS connection lost; reconnecting")
                        }
                        other => tracing::debug!(url = %shown, event = %other, "NATS client event"),
                    }
                }
            });
        let client = options.connect(servers.as_str()).await.map_err(|e| {
            TransportError::Disconnected(
                format!(
                    "cannot connect to NATS at {}: {}",
                    redact(&url),
                    e.to_string().replace(&url, &redact(&url))
                )
                .into(),
            )
        })?;
        tracing::info!(url = %redact(&url), "connected to NATS");
        let mut jetstream = jetstream::new(client.clone());
        jetstream.set_timeout(config.request_timeout);
        Ok(Self {
            url,
            config,
            client,
            jetstream,
            streams: std::sync::Mutex::default(),
            unsettled: Arc::default(),
            connections,
        })
    }

    /// The underlying client, for what this crate does not cover.
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// The stream that holds `subject`: one already capturing it (the application's own, perhaps
    /// on a wildcard), else one this transport creates for exactly that subject.
    pub(crate) async fn stream_for(
        &self,
        subject: &str,
        kind: StreamKind,
    ) -> Result<stream::Stream, TransportError> {
        check_subject(subject)?;
        let known = self
            .streams
            .lock()
            .expect("not poisoned")
            .get(subject)
            .cloned();
        if let Some(name) = known {
            match self.jetstream.get_stream(&name).await {
                Ok(stream) => return Ok(stream),
                // Deleted since: looked up (or created) again below.
                Err(e) => tracing::debug!(stream = %name, error = %e, "stream gone"),
            }
            self.streams.lock().expect("not poisoned").remove(subject);
        }
        let stream = self.find_or_create_stream(subject, kind).await?;
        self.streams
            .lock()
            .expect("not poisoned")
            .insert(subject.to_owned(), stream.cached_info().config.name.clone());
        Ok(stream)
    }

    /// Whether a stream for `subject` is known (looked up or created) without asking the server:
    /// for publishing, which finds out from a missing-stream answer when it was deleted since.
    async fn ensure_stream(&self, subject: &str, kind: StreamKind) -> Result<(), TransportError> {
        if self
            .streams
            .lock()
            .expect("not poisoned")
            .contains_key(subject)
        {
            return Ok(());
        }
        self.stream_for(subject, kind).await.map(drop)
    }

    async fn find_or_create_stream(
        &self,
        subject: &str,
        kind: StreamKind,
    ) -> Result<stream::Stream, TransportError> {
        let mut last = None;
        for attempt in 0..3u32 {
            if attempt > 0 {
                tokio::time::sleep(Duration::from_millis(50 << attempt)).await;
            }
            match self.jetstream.stream_by_subject(subject).await {
                Ok(name) => return self.jetstream.get_stream(&name).await.map_err(api),
                Err(e) if e.kind() == GetStreamByNameErrorKind::NotFound => {}
                Err(e) => return Err(api(e)),
            }
            // Dead letters are kept until replayed or removed by an operator, whatever the
            // sources' retention: on an interest stream with no consumer the server would
            // confirm a dead letter and store nothing.
            let (retention, max_age) = match kind {
                StreamKind::Source => (
                    match self.config.retention {
                        Retention::Limits => RetentionPolicy::Limits,
                        Retention::Interest => RetentionPolicy::Interest,
                    },
                    self.config.max_age.unwrap_or_default(),
                ),
                StreamKind::DeadLetters => (RetentionPolicy::Limits, Duration::ZERO),
            };
            let config = stream::Config {
                name: stream_name(subject)?,
                subjects: vec![subject.to_owned()],
                retention,
                storage: StorageType::File,
                max_age,
                num_replicas: self.config.replicas,
                description: Some(format!("inbox: messages published to {subject}")),
                ..stream::Config::default()
            };
            match self.jetstream.create_stream(config).await {
                Ok(stream) => {
                    tracing::info!(subject, stream = %stream.cached_info().config.name, "created a JetStream stream");
                    return Ok(stream);
                }
                // Another instance created it (or a stream for an overlapping subject) meanwhile:
                // look it up again.
                Err(e) if created_meanwhile(&e) => {
                    tracing::debug!(subject, error = %e, "stream not created; looking it up again");
                    last = Some(e);
                }
                Err(e) => return Err(api(e)),
            }
        }
        Err(last.map_or_else(
            || TransportError::Refused(format!("no stream for {subject:?}").into()),
            api,
        ))
    }

    /// The durable pull consumer of `consumer` on `source`'s stream, created if missing. One
    /// that exists is used as it is — the server cannot change most settings in place — after
    /// checking what the promise needs: a pull consumer with explicit acks on exactly `source`;
    /// other differences are logged.
    async fn durable(
        &self,
        source: &str,
        consumer: &str,
        max_deliveries: Option<u32>,
    ) -> Result<consumer::Consumer<pull::Config>, TransportError> {
        let stream = self.stream_for(source, StreamKind::Source).await?;
        let name = durable_name(source, consumer)?;
        // Above the engine's own limit, whatever the setting: past the server's, JetStream stops
        // delivering a message without a dead letter.
        let max_deliver = match (self.config.max_deliver, max_deliveries) {
            (None, _) => -1,
            (Some(limit), Some(engine)) if limit <= i64::from(engine) => {
                tracing::warn!(
                    max_deliver = limit,
                    max_deliveries = engine,
                    "NatsConfig::max_deliver is not above the consumer's max_deliveries; using max_deliveries + 5"
                );
                i64::from(engine) + 5
            }
            (Some(limit), _) => limit,
        };
        let config = pull::Config {
            durable_name: Some(name.clone()),
            description: Some(format!("inbox consumer {consumer:?} of {source}")),
            filter_subject: source.to_owned(),
            deliver_policy: DeliverPolicy::All,
            ack_policy: AckPolicy::Explicit,
            ack_wait: self.config.ack_wait,
            max_deliver,
            max_ack_pending: self.config.max_ack_pending,
            inactive_threshold: self.config.inactive_threshold.unwrap_or_default(),
            ..pull::Config::default()
        };
        let durable: consumer::Consumer<pull::Config> = stream
            .get_or_create_consumer(&name, config.clone())
            .await
            .map_err(api)?;
        let found = &durable.cached_info().config;
        if found.ack_policy != AckPolicy::Explicit || found.filter_subject != source {
            return Err(TransportError::Config(format!(
                "the durable consumer {name:?} on stream {:?} exists with ack policy {:?} and filter {:?}; inbox needs explicit acks on exactly {source:?}",
                durable.cached_info().stream_name,
                found.ack_policy,
                found.filter_subject
            )));
        }
        if found.ack_wait != config.ack_wait
            || found.max_deliver != config.max_deliver
            || found.max_ack_pending != config.max_ack_pending
        {
            tracing::warn!(
                durable = %name,
                ack_wait = ?found.ack_wait,
                max_deliver = found.max_deliver,
                max_ack_pending = found.max_ack_pending,
                "the durable consumer exists with other settings than configured; it is used as it is (delete it to apply the new ones)"
            );
        }
        Ok(durable)
    }

    /// Reads the messages `destination` holds, oldest first, without consuming them: for a replay
    /// and for looking at a dead-letter destination.
    pub(crate) async fn read_stream(
        &self,
        destination: &str,
    ) -> Result<
        futures::stream::BoxStream<'static, Result<NatsLetter, TransportError>>,
        TransportError,
    > {
        let mut stream = self
            .stream_for(destination, StreamKind::DeadLetters)
            .await?;
        let state = stream.info().await.map_err(api)?.state.clone();
        let subject = destination.to_owned();
        // Sequence by sequence up to the last one at the call; deleted ones and other subjects'
        // messages (a stream of the application's that captures more) are skipped.
        let letters = futures::stream::unfold(
            (stream, state.first_sequence.max(1), state.last_sequence),
            move |(stream, next, last)| {
                let subject = subject.clone();
                async move {
                    let mut sequence = next;
                    while sequence <= last {
                        match stream.get_raw_message(sequence).await {
                            Ok(message) if message.subject.as_str() == subject => {
                                let letter = NatsLetter {
                                    stream: stream.clone(),
                                    sequence,
                                    id: nats_id(Some(&message.headers)),
                                    headers: from_header_map(&message.headers),
                                    payload: message.payload,
                                };
                                return Some((Ok(letter), (stream, sequence + 1, last)));
                            }
                            Ok(_) => {}
                            Err(e)
                                if e.kind() == stream::LastRawMessageErrorKind::NoMessageFound => {}
                            Err(e) => {
                                return Some((Err(api(e)), (stream, last + 1, last)));
                            }
                        }
                        sequence += 1;
                    }
                    None
                }
            },
        );
        Ok(letters.boxed())
    }

    /// Logs the server's advisory when one of the consumer's messages reaches `max_deliver`: the
    /// server will not deliver it again, and the operator should know where it is. Stops when
    /// the returned guard is dropped.
    async fn watch_delivery_limit(
        &self,
        consumer: &consumer::Consumer<pull::Config>,
    ) -> AbortOnDrop {
        let info = consumer.cached_info();
        let subject = format!(
            "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{}.{}",
            info.stream_name, info.name
        );
        let subscriber = self.client.subscribe(subject).await;
        let (stream, name) = (info.stream_name.clone(), info.name.clone());
        AbortOnDrop(tokio::spawn(async move {
            let Ok(mut advisories) = subscriber else {
                return;
            };
            while let Some(advisory) = advisories.next().await {
                tracing::error!(
                    stream,
                    consumer = name,
                    advisory = %String::from_utf8_lossy(&advisory.payload),
                    "a message reached the server's delivery limit (max_deliver) and will not be delivered again; it stays in the stream at the advisory's stream_seq"
                );
            }
        }))
    }

    async fn publish_once(
        &self,
        destination: &str,
        message: &OutgoingMessage,
    ) -> Result<(), TransportError> {
        let headers = to_header_map(message, self.config.deduplicate)?;
        let kind = if message.headers.get(dead_letter_headers::REASON).is_some() {
            StreamKind::DeadLetters
        } else {
            StreamKind::Source
        };
        self.ensure_stream(destination, kind).await?;
        let ack = self
            .jetstream
            .publish_with_headers(destination.to_owned(), headers, message.payload.clone())
            .await
            .map_err(publish_error)?;
        let ack = ack.await.map_err(publish_error)?;
        if ack.duplicate {
            tracing::debug!(destination, message_id = ?message.message_id, "JetStream kept an earlier copy (duplicate window)");
        }
        Ok(())
    }
}

/// What a stream holds, which decides how it is created.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StreamKind {
    /// A source: the configured retention and age.
    Source,
    /// Dead letters: kept until replayed or removed by an operator.
    DeadLetters,
}

/// The server refused to create a stream because one by that name, or one for an overlapping
/// subject, exists: created by another instance meanwhile (10058 name in use, 10065 subjects
/// overlap).
fn created_meanwhile(error: &async_nats::jetstream::context::CreateStreamError) -> bool {
    matches!(error.kind(), CreateStreamErrorKind::JetStream(answer)
        if matches!(answer.error_code().0, 10058 | 10065))
}

/// Aborts its task when dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[async_trait]
impl Transport for NatsTransport {
    fn name(&self) -> &'static str {
        "nats"
    }

    /// Naks requeue; JetStream counts deliveries; the stream sequence is the record's position.
    /// No order is kept: a pull consumer hands out many messages at once. Headers are text.
    fn capabilities(&self) -> Capabilities {
        Capabilities::basic()
            .with_delivery_count(true)
            .with_coordinates(true)
            .with_binary_headers(false)
    }

    async fn declare(&self, subscription: &Subscription) -> Result<(), TransportError> {
        self.durable(
            &subscription.source,
            subscription.consumer.as_str(),
            subscription.max_deliveries,
        )
        .await?;
        if let Some(dead_letter) = &subscription.dead_letter {
            self.stream_for(dead_letter, StreamKind::DeadLetters)
                .await?;
        }
        Ok(())
    }

    async fn subscribe(
        &self,
        subscription: &Subscription,
    ) -> Result<DeliveryStream, TransportError> {
        let consumer = self
            .durable(
                &subscription.source,
                subscription.consumer.as_str(),
                subscription.max_deliveries,
            )
            .await?;
        if let Some(dead_letter) = &subscription.dead_letter {
            self.stream_for(dead_letter, StreamKind::DeadLetters)
                .await?;
        }
        // Within the durable's own request limit, where it has one.
        let server_batch = usize::try_from(consumer.cached_info().config.max_batch)
            .ok()
            .filter(|&n| n > 0)
            .unwrap_or(usize::MAX);
        let messages = consumer
            .stream()
            .max_messages_per_batch(usize::from(subscription.prefetch.max(1)).min(server_batch))
            .expires(PULL_EXPIRES)
            .heartbeat(PULL_HEARTBEAT)
            .messages()
            .await
            .map_err(api)?;
        // The server's ack wait, not the configured one: a durable that existed before keeps
        // its own.
        let (keep_alive, delay, timeout) = (
            (consumer.cached_info().config.ack_wait / 3).max(Duration::from_millis(100)),
            self.config.redelivery_delay,
            self.config.request_timeout,
        );
        let watch = self.watch_delivery_limit(&consumer).await;
        let unsettled = Arc::clone(&self.unsettled);
        // The first error ends the stream: the consumer subscribes again (with backoff), which
        // also recreates a stream or consumer deleted meanwhile.
        let deliveries = futures::stream::unfold(Some(messages), move |messages| {
            let unsettled = Arc::clone(&unsettled);
            // Captured, the advisory watch lives as long as the stream.
            let _ = &watch;
            async move {
                let mut messages = messages?;
                match messages.next().await? {
                    Ok(message) => {
                        let delivery: Box<dyn Delivery> = Box::new(NatsDelivery::new(
                            message, keep_alive, delay, timeout, &unsettled,
                        ));
                        Some((Ok(delivery), Some(messages)))
                    }
                    Err(e) => Some((Err(TransportError::Disconnected(Box::new(e))), None)),
                }
            }
        });
        Ok(deliveries.boxed())
    }

    /// The messages the destination's stream holds at the call, oldest first. Acking one deletes
    /// it from the stream; dropping or nacking it leaves it there. Two replays at once both read
    /// every letter: the inbox lets only one of them revive each message.
    async fn read_dead_letters(&self, destination: &str) -> Result<DeliveryStream, TransportError> {
        let letters = self.read_stream(destination).await?;
        Ok(letters
            .map(|letter| letter.map(|letter| Box::new(letter) as Box<dyn Delivery>))
            .boxed())
    }

    /// Publishes to the subject `destination` (creating a stream for it if none holds it) and
    /// waits for JetStream's ack.
    async fn publish(
        &self,
        destination: &str,
        message: OutgoingMessage,
    ) -> Result<(), TransportError> {
        match self.publish_once(destination, &message).await {
            // The stream was deleted since it was looked up: forget it, create it, try again.
            Err(TransportError::NoRoute(e)) => {
                tracing::debug!(destination, error = %e, "no stream for the subject; creating it");
                self.streams
                    .lock()
                    .expect("not poisoned")
                    .remove(destination);
                self.publish_once(destination, &message).await
            }
            other => other,
        }
    }

    /// Waits until what the client buffered (naks of deliveries dropped at shutdown, acks) has
    /// been written to the server.
    async fn drained(&self) {
        if let Err(e) = self.client.flush().await {
            tracing::debug!(error = %e, "NATS client not flushed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_are_taken_out_of_urls() {
        let (clean, credentials) = split_credentials("nats://me:p%40ss@host:4222");
        assert_eq!(clean, "nats://host:4222");
        assert!(matches!(credentials, Some(Credentials::User(u, p)) if u == "me" && p == "p@ss"));
        let (clean, credentials) = split_credentials("tok@host:4222");
        assert_eq!(clean, "host:4222");
        assert!(matches!(credentials, Some(Credentials::Token(t)) if t == "tok"));
        assert!(split_credentials("nats://host:4222").1.is_none());
        assert_eq!(redact("s3cret@host:4222"), "***@host:4222");
    }

    #[test]
    fn tokens_and_passwords_are_redacted() {
        assert_eq!(redact("nats://s3cret@host:4222"), "nats://***@host:4222");
        assert_eq!(
            redact("nats://me:s3cret@host:4222"),
            "nats://me:***@host:4222"
        );
        assert_eq!(redact("nats://host:4222"), "nats://host:4222");
        assert_eq!(
            redact("tls://a:b@one:4222,tls://tok@two:4222"),
            "tls://a:***@one:4222,tls://***@two:4222"
        );
    }
}
