//! What a consumer does while a dependency is down: one task probes with backoff, the others
//! wait, no new deliveries are taken, and the log says so once per interval instead of once per
//! message.

use std::sync::Mutex;
use std::time::Duration;

use tokio::sync::watch;
// tokio's clock, so that tests can pause it.
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::retry::RetryPolicy;

/// The state of one dependency (the inbox store) as the tasks of one consumer see it.
pub(crate) struct Outage {
    what: &'static str,
    policy: RetryPolicy,
    log_every: Duration,
    state: Mutex<State>,
    up: watch::Sender<bool>,
    /// The prober's task was aborted mid-sleep: the waiters contend to probe instead.
    prober_gone: tokio::sync::Notify,
}

struct State {
    down_since: Option<Instant>,
    /// Failures since the outage began (each one a probe or an operation that was in flight).
    failures: u64,
    /// Failures not yet reported in a log line.
    unlogged: u64,
    /// The last warning about this dependency, kept across outages: a dependency that flaps
    /// (a server closing its connections one by one while it shuts down, or up and down again
    /// within seconds) is reported once per interval, not once per flap.
    last_log: Option<Instant>,
    /// This outage has been reported (else its end is not worth a line either).
    reported: bool,
    /// A task is sleeping before it probes again: the others wait for the outcome.
    probing: bool,
    delays: Box<dyn Iterator<Item = Duration> + Send>,
}

impl Outage {
    pub(crate) fn new(what: &'static str, policy: RetryPolicy, log_every: Duration) -> Self {
        let delays = Box::new(policy.delays());
        Self {
            what,
            policy,
            log_every,
            state: Mutex::new(State {
                down_since: None,
                failures: 0,
                unlogged: 0,
                last_log: None,
                reported: false,
                probing: false,
                delays,
            }),
            up: watch::Sender::new(true),
            prober_gone: tokio::sync::Notify::new(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether the dependency is believed up.
    pub(crate) fn is_up(&self) -> bool {
        *self.up.borrow()
    }

    /// Waits until the dependency is believed up. False when `stop` fired first.
    pub(crate) async fn wait_until_up(&self, stop: &CancellationToken) -> bool {
        let mut up = self.up.subscribe();
        tokio::select! {
            biased;
            () = stop.cancelled() => false,
            r = up.wait_for(|up| *up) => r.is_ok(),
        }
    }

    /// What the consumer's main loop waits on before it takes a delivery: the dependency up, or
    /// nobody probing it any more (the prober's task was aborted with a dropped `run`): then the
    /// next delivery's operation is the probe. False when `stop` fired first.
    pub(crate) async fn wait_for_recovery(&self, stop: &CancellationToken) -> bool {
        loop {
            tokio::select! {
                biased;
                () = stop.cancelled() => return false,
                r = self.wait_until_up(stop) => return r,
                () = tokio::time::sleep(self.policy.max_delay) => {
                    if !self.lock().probing {
                        return true;
                    }
                }
            }
        }
    }

    /// A transient failure: marks the dependency down, logs (at most once per interval), and
    /// waits — the first task to get here sleeps one backoff delay and then probes (its caller
    /// retries its operation); the others wait until an operation succeeds, or until the prober
    /// is gone without an outcome (its task aborted: then they contend to probe again). Returns
    /// false when `stop` fired first.
    pub(crate) async fn failed(
        &self,
        error: &(dyn std::fmt::Display + Sync),
        stop: &CancellationToken,
    ) -> bool {
        let delay = {
            let mut state = self.lock();
            self.count(&mut state, error);
            if state.probing {
                None
            } else {
                state.probing = true;
                Some(state.delays.next().unwrap_or(self.policy.max_delay))
            }
        };
        match delay {
            Some(delay) => {
                let mut probing = ProbeGuard {
                    outage: self,
                    finished: false,
                };
                let slept = tokio::select! {
                    biased;
                    () = stop.cancelled() => false,
                    () = tokio::time::sleep(delay) => true,
                };
                probing.finished = true;
                slept
            }
            None => {
                let gone = self.prober_gone.notified();
                tokio::select! {
                    biased;
                    r = self.wait_until_up(stop) => r,
                    () = gone => true,
                }
            }
        }
    }

    /// An operation succeeded: the dependency is up again.
    pub(crate) fn succeeded(&self) {
        if self.is_up() {
            return;
        }
        let mut state = self.lock();
        if let Some(since) = state.down_since.take() {
            if state.reported {
                tracing::info!(
                    down_for = ?since.elapsed(),
                    failures = state.failures,
                    "{} reachable again; taking deliveries", self.what
                );
            } else {
                tracing::debug!(
                    down_for = ?since.elapsed(),
                    failures = state.failures,
                    "{} reachable again after a failure within the log interval", self.what
                );
            }
        }
        state.failures = 0;
        state.unlogged = 0;
        state.reported = false;
        state.probing = false;
        state.delays = Box::new(self.policy.delays());
        drop(state);
        self.up.send_replace(true);
    }

    /// A failure of an operation that does not wait for the dependency (a handler's statement
    /// or a commit that failed with it): counted and reported like the others, once per
    /// interval. Whoever touches the dependency next probes it. True when it was logged.
    pub(crate) fn note(&self, error: &(dyn std::fmt::Display + Sync)) -> bool {
        let mut state = self.lock();
        self.count(&mut state, error)
    }

    /// Counts a failure; logs at the start of an outage and at most once per interval. True
    /// when it logged.
    fn count(&self, state: &mut State, error: &dyn std::fmt::Display) -> bool {
        state.failures += 1;
        state.unlogged += 1;
        let now = Instant::now();
        let due = state
            .last_log
            .is_none_or(|last| now.duration_since(last) >= self.log_every);
        let starts = state.down_since.is_none();
        if starts {
            state.down_since = Some(now);
            self.up.send_replace(false);
        }
        if !due {
            return false;
        }
        if starts {
            tracing::warn!(
                error = %error,
                "{} unavailable; pausing deliveries and retrying with backoff (up to {:?} apart)",
                self.what, self.policy.max_delay
            );
        } else {
            tracing::warn!(
                error = %error,
                down_for = ?state.down_since.map(|s| now.duration_since(s)).unwrap_or_default(),
                failures = state.failures,
                since_last_log = state.unlogged,
                "{} still unavailable", self.what
            );
        }
        state.unlogged = 0;
        state.last_log = Some(now);
        state.reported = true;
        true
    }
}

/// Clears `probing` when the prober's sleep ends, however it ends; dropped before it finished
/// (its task aborted), it wakes the waiters so that one of them probes instead.
struct ProbeGuard<'a> {
    outage: &'a Outage,
    finished: bool,
}

impl Drop for ProbeGuard<'_> {
    fn drop(&mut self) {
        self.outage.lock().probing = false;
        if !self.finished {
            self.outage.prober_gone.notify_waiters();
        }
    }
}

/// A warning that is logged at most once per interval, with the number of occurrences folded
/// into it (for per-message events that come in bursts, like acks lost with the connection).
pub(crate) struct Throttle {
    every: Duration,
    state: Mutex<(Option<Instant>, u64)>,
}

impl Throttle {
    pub(crate) fn new(every: Duration) -> Self {
        Self {
            every,
            state: Mutex::new((None, 0)),
        }
    }

    /// Counts one occurrence; returns how many to report when a line is due now.
    pub(crate) fn due(&self) -> Option<u64> {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        state.1 += 1;
        let now = Instant::now();
        if state
            .0
            .is_none_or(|last| now.duration_since(last) >= self.every)
        {
            let n = state.1;
            *state = (Some(now), 0);
            Some(n)
        } else {
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    #[tokio::test(start_paused = true)]
    async fn one_task_probes_the_others_wait() {
        let policy = RetryPolicy::default()
            .with_delays(Duration::from_secs(1), Duration::from_secs(8))
            .with_jitter(false);
        let outage = Arc::new(Outage::new("test store", policy, Duration::from_secs(10)));
        let stop = CancellationToken::new();
        assert!(outage.is_up());
        // The first failure makes a prober that sleeps one delay.
        let prober = {
            let (o, s) = (Arc::clone(&outage), stop.clone());
            tokio::spawn(async move { o.failed(&"down", &s).await })
        };
        tokio::task::yield_now().await;
        assert!(!outage.is_up());
        // A second failing task waits for recovery, not for a delay of its own.
        let waiter = {
            let (o, s) = (Arc::clone(&outage), stop.clone());
            tokio::spawn(async move { o.failed(&"down", &s).await })
        };
        assert!(prober.await.unwrap(), "the prober retries after its delay");
        tokio::time::sleep(Duration::from_secs(30)).await;
        assert!(!waiter.is_finished(), "waits while the store stays down");
        outage.succeeded();
        assert!(waiter.await.unwrap());
        assert!(outage.is_up());
    }

    #[tokio::test(start_paused = true)]
    async fn stop_ends_the_wait() {
        let outage = Outage::new(
            "test store",
            RetryPolicy::default(),
            Duration::from_secs(10),
        );
        let stop = CancellationToken::new();
        stop.cancel();
        assert!(!outage.failed(&"down", &stop).await);
        assert!(!outage.wait_until_up(&stop).await);
    }

    /// A prober whose task is aborted mid-sleep (a `run` future dropped by its caller) must not
    /// leave the gate shut with nobody to open it: a waiter takes over the probing, and the main
    /// loop's wait ends once nobody probes.
    #[tokio::test(start_paused = true)]
    async fn an_aborted_prober_does_not_wedge_the_gate() {
        let policy = RetryPolicy::default()
            .with_delays(Duration::from_secs(1), Duration::from_secs(4))
            .with_jitter(false);
        let outage = Arc::new(Outage::new("test store", policy, Duration::from_secs(10)));
        let stop = CancellationToken::new();
        let spawn_failed = || {
            let (o, s) = (Arc::clone(&outage), stop.clone());
            tokio::spawn(async move { o.failed(&"down", &s).await })
        };
        let prober = spawn_failed();
        tokio::task::yield_now().await;
        let waiter = spawn_failed();
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished());
        prober.abort();
        let _ = prober.await;
        assert!(
            waiter.await.unwrap(),
            "woken to probe in the prober's place"
        );
        // With nobody probing at all, the main loop's wait ends after the longest delay.
        assert!(!outage.is_up());
        let main_loop = {
            let (o, s) = (Arc::clone(&outage), stop.clone());
            tokio::spawn(async move { o.wait_for_recovery(&s).await })
        };
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert!(main_loop.is_finished(), "the main loop probes itself");
        assert!(main_loop.await.unwrap());
    }

    /// One line per interval however the failures come: from many tasks at once, or from a
    /// dependency that flaps (an operation succeeds on a connection the server has not closed
    /// yet, between failures on those it has).
    #[tokio::test(start_paused = true)]
    async fn flapping_is_reported_once_per_interval() {
        let outage = Outage::new(
            "test store",
            RetryPolicy::default(),
            Duration::from_secs(10),
        );
        assert!(outage.note(&"down"), "the start of an outage is reported");
        assert!(!outage.is_up());
        assert!(!outage.note(&"down"), "a second failure at once is not");
        outage.succeeded();
        assert!(outage.is_up());
        assert!(
            !outage.note(&"down again"),
            "an outage that starts within the interval is reported at its end"
        );
        assert!(!outage.is_up(), "but the gate closes at once");
        tokio::time::advance(Duration::from_secs(10)).await;
        assert!(outage.note(&"still down"), "the interval is up");
        outage.succeeded();
        tokio::time::advance(Duration::from_secs(10)).await;
        assert!(
            outage.note(&"down"),
            "a later outage is reported at its start"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn throttle_folds_bursts() {
        let throttle = Throttle::new(Duration::from_secs(10));
        assert_eq!(throttle.due(), Some(1));
        assert_eq!(throttle.due(), None);
        assert_eq!(throttle.due(), None);
        tokio::time::advance(Duration::from_secs(11)).await;
        assert_eq!(throttle.due(), Some(3), "the suppressed ones are counted");
    }
}
