//! One delivery, start to end: the algorithm itself.

use std::panic::AssertUnwindSafe;

use futures::FutureExt;
use tracing::{Instrument, field};

use super::Run;
use super::dead_letter::dead_letter_headers;
use super::decision::{self, AfterFailure, Facts, Limits, OnClaim, Then};
use super::run::{next_delay, sleep_unless_stopped};
use super::tally::Event;
use crate::error::{
    ConsumerError, ErrorKind, HandlerError, StoreError, error_chain, store_unavailable,
};
use crate::handler::Handler;
use crate::id::MessageId;
use crate::message::Message;
use crate::store::InboxStore;
use crate::trace::{TRACEPARENT, TraceParent};
use crate::transport::Delivery;

/// Why an attempt failed, with what that means for the message.
pub(super) struct Failure {
    pub(super) kind: ErrorKind,
    pub(super) reason: String,
    /// The database was unreachable: the outage, not the message, made the attempt fail.
    pub(super) store_down: bool,
}

impl Failure {
    fn transient(reason: impl Into<String>) -> Self {
        Self {
            kind: ErrorKind::Transient,
            reason: reason.into(),
            store_down: false,
        }
    }
}

impl From<HandlerError> for Failure {
    fn from(e: HandlerError) -> Self {
        Self {
            kind: e.kind(),
            reason: error_chain(e.inner()),
            store_down: store_unavailable(e.inner()),
        }
    }
}

fn panic_text(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "non-text panic payload".to_owned())
}

/// How one delivery ended, for the span and the logs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Outcome {
    Processed,
    Duplicate,
    DeadLettered,
    Requeued,
    /// Shutdown came while the message waited for a retry: handed back to the broker.
    HandedBack,
}

impl Outcome {
    fn as_str(self) -> &'static str {
        match self {
            Outcome::Processed => "processed",
            Outcome::Duplicate => "duplicate",
            Outcome::DeadLettered => "dead_lettered",
            Outcome::Requeued => "requeued",
            Outcome::HandedBack => "handed_back",
        }
    }
}

impl<S: InboxStore, H: Handler<S::Tx>> Run<S, H> {
    /// Takes one delivery to its end (acked, dead-lettered, handed back) in its span; how it
    /// ended. Errors are fatal to the run: a store that fails permanently before a claim.
    pub(super) async fn settle_delivery(
        &self,
        delivery: Box<dyn Delivery>,
    ) -> Result<Outcome, ConsumerError> {
        let span = tracing::info_span!(
            "inbox.delivery",
            consumer = %self.name,
            transport = self.transport.name(),
            message_id = field::Empty,
            attempt = field::Empty,
            outcome = field::Empty,
            trace_id = field::Empty,
            parent_span_id = field::Empty,
        );
        if let Some(parent) = delivery
            .headers()
            .get_str(TRACEPARENT)
            .and_then(TraceParent::parse)
        {
            span.record("trace_id", parent.trace_id);
            span.record("parent_span_id", parent.span_id);
        }
        async {
            self.count(Event::Delivery);
            let outcome = self.claim_and_handle(delivery).await?;
            tracing::Span::current().record("outcome", outcome.as_str());
            tracing::debug!(outcome = outcome.as_str(), "delivery settled");
            Ok(outcome)
        }
        .instrument(span)
        .await
    }

    /// A replay meant for another consumer of the same source (see
    /// [`dead_letter_headers::REPLAY_FOR`]).
    pub(super) fn replayed_for_another(&self, delivery: &dyn Delivery) -> bool {
        delivery
            .headers()
            .get(dead_letter_headers::REPLAY_FOR)
            .is_some_and(|target| target != self.name.as_str().as_bytes())
    }

    pub(super) fn limits(&self) -> Limits<'_> {
        Limits {
            max_payload_bytes: self.settings.max_payload_bytes,
            retry: &self.settings.retry,
        }
    }

    /// The algorithm: claim, decide, handle, commit, ack — or record the failure and retry,
    /// requeue or dead-letter.
    async fn claim_and_handle(
        &self,
        delivery: Box<dyn Delivery>,
    ) -> Result<Outcome, ConsumerError> {
        let span = tracing::Span::current();
        let id = match self.settings.id_strategy.extract(&*delivery) {
            Ok(id) => id,
            Err(invalid) => {
                span.record("message_id", "<invalid>");
                let reason = format!("invalid message id: {invalid}");
                return Ok(self.dead_letter_unclaimed(delivery, None, 0, reason).await);
            }
        };
        span.record("message_id", id.as_str());
        if self.replayed_for_another(&*delivery) {
            return Ok(self.settle_duplicate(delivery).await);
        }
        // Where the broker counts no deliveries, a delivery that may be a redelivery is counted
        // in the inbox row first, committed: if the consumer dies on the message, the count
        // survives the crash, and a message it keeps dying on is dead-lettered instead of looping
        // for ever.
        let mut unfinished = None;
        if delivery.delivery_count().is_none() && delivery.redelivered() {
            // In offsets mode a copy of a record handled before is known by its offset: it
            // needs no row (which nothing would ever finish).
            if self.consumed_before(&*delivery).await {
                return Ok(self.settle_duplicate(delivery).await);
            }
            match self
                .retry_store(|| self.store.record_delivery(&self.name, &id))
                .await
            {
                Ok(Some(n)) => unfinished = Some(n),
                Ok(None) => return Ok(self.hand_back(delivery).await),
                Err(e) => {
                    tracing::warn!(error = %e, "could not count the delivery; handling it uncounted")
                }
            }
        }
        let facts = Facts {
            payload_len: delivery.payload().len(),
            delivery_count: delivery.delivery_count(),
            unfinished,
        };
        let mut retry_delays = self.settings.retry.delays();
        let mut dead_letter_delays = self.settings.reconnect.delays();
        let mut retried_here = 0u32;
        // No sign of an earlier delivery: the store may claim with the BEGIN, in one trip.
        let mut unseen = !delivery.redelivered() && unfinished.is_none();
        loop {
            let claimed = self
                .metrics
                .time_claim(self.begin_and_claim(&*delivery, &id, unseen))
                .await;
            // A second try finds the first one's row (or its failure recorded).
            unseen = false;
            let (mut tx, claim) = match claimed {
                Ok(claimed) => claimed,
                Err(e) => {
                    if self.wait_out_store_error(e, &mut retry_delays).await? {
                        continue;
                    }
                    return Ok(self.hand_back(delivery).await);
                }
            };
            self.store_outage.succeeded();
            let attempt = match decision::on_claim(claim, facts, self.limits()) {
                OnClaim::Duplicate => {
                    let _ = self.store.rollback(tx).await;
                    return Ok(self.settle_duplicate(delivery).await);
                }
                OnClaim::GiveUp { attempts, reason } => {
                    if self
                        .dead_letter_claimed(tx, &*delivery, &id, attempts, &reason)
                        .await
                    {
                        self.ack(delivery).await;
                        self.count_dead_letter(&reason);
                        return Ok(Outcome::DeadLettered);
                    }
                    // Not settled (the dead letter or its mark failed): the message stays here
                    // and is tried again, never handed back — on Kafka a handed-back record is
                    // skipped.
                    if sleep_unless_stopped(next_delay(&mut dead_letter_delays), &self.stop).await {
                        continue;
                    }
                    return Ok(self.hand_back(delivery).await);
                }
                OnClaim::Handle { attempt } => attempt,
            };
            span.record("attempt", attempt);

            let failure = match self.run_handler(&id, &*delivery, attempt, &mut tx).await {
                Ok(()) => match self.store.commit(tx).await {
                    Ok(()) => return Ok(self.settle_processed(delivery, &id).await),
                    Err(e @ StoreError::Aborted(_)) => Failure {
                        kind: e.kind(),
                        reason: format!(
                            "the handler returned Ok, but a statement in its transaction had failed (an error swallowed?), so nothing was committed: {}",
                            error_chain(&e)
                        ),
                        store_down: false,
                    },
                    // The commit may or may not have happened: retry; a redelivery finds the row
                    // if it did.
                    Err(e) => Failure {
                        kind: e.kind(),
                        reason: format!("commit failed (outcome unknown): {}", error_chain(&e)),
                        store_down: matches!(e, StoreError::Unavailable(_)),
                    },
                },
                Err(failure) => {
                    let _ = self.store.rollback(tx).await;
                    failure
                }
            };
            self.count(Event::Failed);
            let next = decision::after_failure(
                failure.kind,
                attempt,
                retried_here,
                self.transport.capabilities().requeue,
                &self.settings.retry,
            );
            let then = match next {
                AfterFailure::DeadLetter => {
                    tracing::warn!(error = %failure.reason, "permanent failure; dead-lettering");
                    return Ok(self
                        .dead_letter_unclaimed(delivery, Some(&id), attempt, failure.reason)
                        .await);
                }
                AfterFailure::Record(then) => then,
            };
            self.log_attempt_failed(&failure, attempt, None);
            let recorded = self
                .retry_store(|| {
                    self.store
                        .record_failure(&self.name, &id, attempt, &failure.reason)
                })
                .await;
            match recorded {
                Ok(Some(_)) => {}
                Ok(None) => return Ok(self.hand_back(delivery).await),
                Err(e) => {
                    // Uncounted, a failure could repeat for ever: the message goes to the
                    // dead-letter destination instead, and the consumer goes on.
                    let reason = format!(
                        "{}; the failure could not be recorded: {}",
                        failure.reason,
                        error_chain(&e)
                    );
                    return Ok(self
                        .dead_letter_unclaimed(delivery, Some(&id), attempt, reason)
                        .await);
                }
            }
            match then {
                // The next claim sees the limit reached and dead-letters under the row lock.
                Then::ClaimAgain => continue,
                Then::RetryHere => {
                    retried_here += 1;
                    self.count(Event::Retried);
                    if sleep_unless_stopped(next_delay(&mut retry_delays), &self.stop).await {
                        continue;
                    }
                    return Ok(self.hand_back(delivery).await);
                }
                Then::Requeue => {
                    if let Err(e) = delivery.nack(true).await {
                        tracing::warn!(error = %e, "nack failed; the broker redelivers on its own");
                    }
                    self.count(Event::Requeued);
                    return Ok(Outcome::Requeued);
                }
            }
        }
    }

    /// An attempt's failure in the log: a warning of its own, unless the database was
    /// unreachable — then the outage is what failed, and its gate reports all such failures
    /// once per interval instead of once per message in flight.
    /// `in_batch`: the message's id, which a batch's span does not carry.
    pub(super) fn log_attempt_failed(
        &self,
        failure: &Failure,
        attempt: u32,
        in_batch: Option<&MessageId>,
    ) {
        let message_id = in_batch.map(MessageId::as_str);
        if failure.store_down {
            tracing::debug!(message_id, attempt, error = %failure.reason, "attempt failed: store unavailable");
            self.store_outage.note(&failure.reason);
        } else {
            tracing::warn!(message_id, attempt, error = %failure.reason, "attempt failed");
        }
    }

    /// The message `delivery` carries, as the handler sees it.
    pub(super) fn message<'a>(
        &'a self,
        id: &'a MessageId,
        delivery: &'a dyn Delivery,
        attempt: u32,
    ) -> Message<'a> {
        Message {
            id,
            consumer: &self.name,
            source: &self.source,
            payload: delivery.payload(),
            headers: delivery.headers(),
            attempt,
            redelivered: delivery.redelivered(),
        }
    }

    /// Runs `handler`, timed, under the handler timeout, with panics caught.
    pub(super) async fn guarded<T>(
        &self,
        handler: impl std::future::Future<Output = T>,
    ) -> Guarded<T> {
        let handled = AssertUnwindSafe(handler).catch_unwind();
        let handled = self.metrics.time_handle(async {
            match self.settings.handler_timeout {
                Some(limit) => tokio::time::timeout(limit, handled)
                    .await
                    .map_err(|_| limit),
                None => Ok(handled.await),
            }
        });
        match handled.await {
            Ok(Ok(out)) => Guarded::Returned(out),
            Ok(Err(panic)) => Guarded::Panicked(panic_text(&*panic)),
            Err(limit) => Guarded::TimedOut(limit),
        }
    }

    /// Runs the handler on the message in `tx`, timed, under the handler timeout, with panics
    /// caught.
    pub(super) async fn run_handler(
        &self,
        id: &MessageId,
        delivery: &dyn Delivery,
        attempt: u32,
        tx: &mut S::Tx,
    ) -> Result<(), Failure> {
        let message = self.message(id, delivery, attempt);
        match self.guarded(self.handler.handle(&message, tx)).await {
            Guarded::Returned(Ok(())) => Ok(()),
            Guarded::Returned(Err(e)) => Err(e.into()),
            Guarded::Panicked(text) => Err(Failure::transient(format!("handler panicked: {text}"))),
            Guarded::TimedOut(limit) => Err(Failure::transient(format!(
                "handler timed out after {limit:?}"
            ))),
        }
    }
}

/// How a guarded handler call ended.
pub(super) enum Guarded<T> {
    /// It returned.
    Returned(T),
    /// It panicked, with this text.
    Panicked(String),
    /// It ran past the handler timeout.
    TimedOut(std::time::Duration),
}
