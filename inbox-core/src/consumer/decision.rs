//! The decisions of the algorithm, without I/O: given what the claim found and what the delivery
//! shows, what happens to it; given a failed attempt, what comes next. The per-message and the
//! batch path both act on these, so a rule is written once.

use crate::error::ErrorKind;
use crate::retry::RetryPolicy;
use crate::store::Claim;

/// What a delivery shows of itself that the decisions need.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Facts {
    /// The payload's size in bytes.
    pub(super) payload_len: usize,
    /// Deliveries of the message as the broker counts them, where it does.
    pub(super) delivery_count: Option<u32>,
    /// Deliveries without an outcome as the inbox counted them, where the broker does not.
    pub(super) unfinished: Option<u32>,
}

/// The limits a consumer sets.
#[derive(Debug, Clone, Copy)]
pub(super) struct Limits<'a> {
    pub(super) max_payload_bytes: usize,
    pub(super) retry: &'a RetryPolicy,
}

/// What to do with a delivery once its claim is known.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum OnClaim {
    /// The message was done or dead-lettered before: ack the copy and discard it.
    Duplicate,
    /// Dead-letter it unhandled (under the claim, so that a redelivered copy is a duplicate, not
    /// a second dead letter).
    GiveUp {
        /// Failed attempts recorded so far.
        attempts: u32,
        /// Why.
        reason: String,
    },
    /// Run the handler; this is attempt number `attempt` (from 1).
    Handle {
        /// The attempt about to be made.
        attempt: u32,
    },
}

/// Decides what a claim means for a delivery.
pub(super) fn on_claim(claim: Claim, facts: Facts, limits: Limits<'_>) -> OnClaim {
    let (attempts, last_error) = match claim {
        Claim::Done | Claim::Dead => return OnClaim::Duplicate,
        Claim::Claimed {
            attempts,
            last_error,
        } => (attempts, last_error),
    };
    let attempt = attempts.saturating_add(1);
    let policy = limits.retry;
    if facts.payload_len > limits.max_payload_bytes {
        let reason = format!(
            "payload of {} bytes exceeds the limit of {} bytes",
            facts.payload_len, limits.max_payload_bytes
        );
        return OnClaim::GiveUp { attempts, reason };
    }
    if attempt > policy.max_attempts {
        let reason = format!(
            "gave up after {attempts} attempts; last error: {}",
            last_error.as_deref().unwrap_or("none recorded")
        );
        return OnClaim::GiveUp { attempts, reason };
    }
    // Deliveries that never reached an outcome (the consumer died on them) count against a
    // separate, larger limit: a message that crashes the process is poison too, but a crash of
    // the process alone must not dead-letter its prefetched rest.
    if let Some(n) = facts.delivery_count.filter(|&n| n > policy.max_deliveries) {
        let reason = format!(
            "delivered {n} times without an outcome ({attempts} failures recorded): the consumer may be crashing on it"
        );
        return OnClaim::GiveUp { attempts, reason };
    }
    if let Some(n) = facts.unfinished.filter(|&n| n > policy.max_deliveries) {
        let reason = format!(
            "delivered {n} times without an outcome, as counted in the inbox ({attempts} failures recorded): the consumer may be crashing on it"
        );
        return OnClaim::GiveUp { attempts, reason };
    }
    OnClaim::Handle { attempt }
}

/// What comes after a failed attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum AfterFailure {
    /// A permanent failure: dead-letter it now (no failure is recorded; the dead mark is).
    DeadLetter,
    /// Record the failure in its own transaction (it counts across redeliveries and restarts),
    /// then go on as this says.
    Record(Then),
}

/// What follows a recorded failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Then {
    /// Claim again: the attempt limit is reached, and the claim gives up on the message under
    /// the row lock.
    ClaimAgain,
    /// Try again in process after a backoff.
    RetryHere,
    /// Hand it back to the broker for redelivery.
    Requeue,
}

/// Decides what follows a failed attempt.
///
/// `retried_here`: in-process retries made so far; `can_requeue`: whether the broker can take a
/// message back for redelivery (where it cannot, every retry is in process).
pub(super) fn after_failure(
    kind: ErrorKind,
    attempt: u32,
    retried_here: u32,
    can_requeue: bool,
    policy: &RetryPolicy,
) -> AfterFailure {
    if kind == ErrorKind::Permanent {
        AfterFailure::DeadLetter
    } else if attempt >= policy.max_attempts {
        AfterFailure::Record(Then::ClaimAgain)
    } else if retried_here < policy.in_process_retries || !can_requeue {
        AfterFailure::Record(Then::RetryHere)
    } else {
        AfterFailure::Record(Then::Requeue)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> RetryPolicy {
        RetryPolicy::default()
            .with_max_attempts(3)
            .with_max_deliveries(10)
            .with_in_process_retries(1)
    }

    fn claimed(attempts: u32) -> Claim {
        Claim::Claimed {
            attempts,
            last_error: (attempts > 0).then(|| "boom".to_owned()),
        }
    }

    fn decide(claim: Claim, facts: Facts) -> OnClaim {
        let retry = policy();
        on_claim(
            claim,
            facts,
            Limits {
                max_payload_bytes: 100,
                retry: &retry,
            },
        )
    }

    fn gives_up(outcome: OnClaim, saying: &str) {
        match outcome {
            OnClaim::GiveUp { reason, .. } => assert!(reason.contains(saying), "{reason}"),
            other => panic!("expected to give up ({saying}), got {other:?}"),
        }
    }

    #[test]
    fn a_message_done_or_dead_before_is_a_duplicate_whatever_the_delivery_shows() {
        let huge = Facts {
            payload_len: 1_000,
            delivery_count: Some(99),
            unfinished: Some(99),
        };
        assert_eq!(decide(Claim::Done, huge), OnClaim::Duplicate);
        assert_eq!(decide(Claim::Dead, huge), OnClaim::Duplicate);
    }

    #[test]
    fn attempts_are_numbered_from_the_recorded_failures() {
        assert_eq!(
            decide(claimed(0), Facts::default()),
            OnClaim::Handle { attempt: 1 }
        );
        assert_eq!(
            decide(claimed(2), Facts::default()),
            OnClaim::Handle { attempt: 3 }
        );
    }

    #[test]
    fn past_the_attempt_limit_it_gives_up_with_the_last_error() {
        gives_up(
            decide(claimed(3), Facts::default()),
            "gave up after 3 attempts; last error: boom",
        );
    }

    #[test]
    fn an_oversized_payload_gives_up_on_the_first_claim() {
        let facts = Facts {
            payload_len: 101,
            ..Facts::default()
        };
        gives_up(decide(claimed(0), facts), "payload of 101 bytes");
        let at_limit = Facts {
            payload_len: 100,
            ..Facts::default()
        };
        assert_eq!(decide(claimed(0), at_limit), OnClaim::Handle { attempt: 1 });
    }

    #[test]
    fn deliveries_without_an_outcome_count_against_their_own_limit() {
        for (count, unfinished, saying) in [
            (
                Some(11),
                None,
                "delivered 11 times without an outcome (0 failures",
            ),
            (None, Some(11), "as counted in the inbox"),
        ] {
            let facts = Facts {
                payload_len: 1,
                delivery_count: count,
                unfinished,
            };
            gives_up(decide(claimed(0), facts), saying);
        }
        let at_limit = Facts {
            payload_len: 1,
            delivery_count: Some(10),
            unfinished: Some(10),
        };
        assert_eq!(decide(claimed(0), at_limit), OnClaim::Handle { attempt: 1 });
    }

    #[test]
    fn a_permanent_failure_is_dead_lettered_at_once() {
        let p = policy();
        assert_eq!(
            after_failure(ErrorKind::Permanent, 1, 0, true, &p),
            AfterFailure::DeadLetter
        );
    }

    #[test]
    fn transient_failures_retry_here_then_requeue_then_claim_again_at_the_limit() {
        let p = policy();
        assert_eq!(
            after_failure(ErrorKind::Transient, 1, 0, true, &p),
            AfterFailure::Record(Then::RetryHere)
        );
        assert_eq!(
            after_failure(ErrorKind::Transient, 2, 1, true, &p),
            AfterFailure::Record(Then::Requeue)
        );
        assert_eq!(
            after_failure(ErrorKind::Transient, 3, 0, true, &p),
            AfterFailure::Record(Then::ClaimAgain)
        );
    }

    #[test]
    fn a_broker_that_cannot_requeue_retries_in_process() {
        let p = policy();
        assert_eq!(
            after_failure(ErrorKind::Transient, 2, 5, false, &p),
            AfterFailure::Record(Then::RetryHere)
        );
    }
}
