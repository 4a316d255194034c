//! The transport's settings.

use std::time::Duration;

/// Whether and how the transport trims a source's stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Trim {
    /// Never: the stream keeps every entry (trim it yourself, or let a `MAXLEN` of your own
    /// producers do it — which may remove entries no consumer has acked yet).
    #[default]
    Never,
    /// Entries every consumer group has acknowledged are removed (`XTRIM … MINID`, up to the
    /// oldest entry any group has pending or not yet read), checked this often by each
    /// subscribed instance. Never removes an unacknowledged entry; a consumer group created
    /// later reads only what is left.
    Acknowledged {
        /// How often.
        every: Duration,
    },
}

/// How the transport reads, claims and keeps entries.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RedisConfig {
    /// An entry delivered to an instance and not acked for this long is claimed by another
    /// (`XAUTOCLAIM` min-idle-time; default 30 s): a crashed instance's entries come back to the
    /// survivors. A delivery still being handled is kept with `XCLAIM … JUSTID` every third of
    /// it, so a long handler does not lose it.
    pub visibility_timeout: Duration,
    /// How often an instance looks for entries idle past the visibility timeout (default 1 s).
    pub claim_interval: Duration,
    /// How long a handed-back entry waits before it is claimed again (default 100 ms; at most
    /// the visibility timeout).
    pub redelivery_delay: Duration,
    /// How long one `XREADGROUP` blocks waiting for new entries (default 2 s).
    pub block: Duration,
    /// How long any other command may wait for its reply (default 10 s).
    pub response_timeout: Duration,
    /// Consumers (instances) of a group with nothing pending, idle this long, are removed from
    /// the group (`XGROUP DELCONSUMER`; default 1 hour): crashed instances do not pile up.
    pub forget_idle_consumers: Duration,
    /// Trimming of source streams.
    pub trim: Trim,
}

impl Default for RedisConfig {
    fn default() -> Self {
        Self {
            visibility_timeout: Duration::from_secs(30),
            claim_interval: Duration::from_secs(1),
            redelivery_delay: Duration::from_millis(100),
            block: Duration::from_secs(2),
            response_timeout: Duration::from_secs(10),
            forget_idle_consumers: Duration::from_secs(3600),
            trim: Trim::Never,
        }
    }
}

impl RedisConfig {
    /// Sets the visibility timeout (at least 1 s).
    pub fn visibility_timeout(mut self, timeout: Duration) -> Self {
        self.visibility_timeout = timeout.max(Duration::from_secs(1));
        self
    }

    /// Sets how often idle entries are looked for (at least 10 ms).
    pub fn claim_interval(mut self, interval: Duration) -> Self {
        self.claim_interval = interval.max(Duration::from_millis(10));
        self
    }

    /// Sets the redelivery delay of a handed-back entry.
    pub fn redelivery_delay(mut self, delay: Duration) -> Self {
        self.redelivery_delay = delay;
        self
    }

    /// Sets how long a read blocks (at least 10 ms).
    pub fn block(mut self, block: Duration) -> Self {
        self.block = block.max(Duration::from_millis(10));
        self
    }

    /// Sets the response timeout of commands other than the blocking read (at least 100 ms).
    pub fn response_timeout(mut self, timeout: Duration) -> Self {
        self.response_timeout = timeout.max(Duration::from_millis(100));
        self
    }

    /// Sets after how long an idle consumer with nothing pending is removed from its group (at
    /// least a minute).
    pub fn forget_idle_consumers(mut self, after: Duration) -> Self {
        self.forget_idle_consumers = after.max(Duration::from_secs(60));
        self
    }

    /// Sets the trimming of source streams.
    pub fn trim(mut self, trim: Trim) -> Self {
        self.trim = trim;
        self
    }

    /// Refuses settings the transport cannot work with (the fields are public, so the setters'
    /// limits can be bypassed).
    pub(crate) fn check(&self) -> Result<(), inbox_core::TransportError> {
        let fine = self.visibility_timeout >= Duration::from_secs(1)
            && self.claim_interval >= Duration::from_millis(10)
            && self.block >= Duration::from_millis(10)
            && !self.response_timeout.is_zero()
            && self.forget_idle_consumers >= self.visibility_timeout;
        if fine {
            Ok(())
        } else {
            Err(inbox_core::TransportError::Config(format!(
                "RedisConfig out of range (visibility_timeout >= 1 s, claim_interval and block >= 10 ms, response_timeout > 0, forget_idle_consumers >= visibility_timeout): {self:?}"
            )))
        }
    }

    /// How often a delivery in progress resets its idle time.
    pub(crate) fn keep_alive_every(&self) -> Duration {
        self.visibility_timeout / 3
    }

    /// The idle time a handed-back entry is given: claimable after the redelivery delay.
    pub(crate) fn handed_back_idle(&self) -> Duration {
        self.visibility_timeout
            .saturating_sub(self.redelivery_delay.min(self.visibility_timeout))
    }
}
