//! A delivery policy with every default filled in (`ResolvedPolicy`), the defaults themselves,
//! and the backoff schedule.
//!
//! Defaults are decided here once, for the runtime, the consumer mapping and the admission
//! rules alike. It must not judge a policy (that is `rules`) nor know a broker.

use std::time::Duration;

use crate::api::{self, DeliveryPolicy, Mode, SlowHandler};

/// Default of `maxProcessingTime`: five minutes (semantics H1).
pub const DEFAULT_MAX_PROCESSING_TIME: Duration = Duration::from_secs(300);
/// Default of `ackWait` (the broker's usual 30s).
pub const DEFAULT_ACK_WAIT: Duration = Duration::from_secs(30);
/// Default of `maxInFlight`: 250, RabbitMQ's prefetch default (throughput-oriented; use 1 for
/// expensive, unevenly sized work; semantics P2).
pub const DEFAULT_MAX_IN_FLIGHT: usize = 250;

/// The backoff schedule (semantics B2): after the decline of attempt `attempt` (1-based), wait
/// initial × multiplier^(attempt-1), capped at max (1s, 2s, 4s … 1m).
pub fn schedule_delay(initial: Duration, max: Duration, multiplier: f64, attempt: u32) -> Duration {
    let exp = attempt.saturating_sub(1).min(1024) as i32;
    let secs = initial.as_secs_f64() * multiplier.powi(exp);
    if !secs.is_finite() || secs >= max.as_secs_f64() {
        return max;
    }
    Duration::try_from_secs_f64(secs).map_or(max, |d| d.min(max))
}

/// A delivery policy with every default filled in, as the runtime, the backends and the
/// consumer mapping use it.
#[derive(Clone, Debug, PartialEq)]
pub struct ResolvedPolicy {
    pub pattern: String,
    pub mode: Mode,
    pub durable_name: Option<String>,
    /// Attempts per message, the first included; `None` is unlimited.
    pub max_deliver: Option<u32>,
    pub backoff: Option<Schedule>,
    pub max_nack_delay: Option<Duration>,
    pub slow_handler: SlowHandler,
    pub ack_wait: Duration,
    pub max_processing_time: Duration,
    pub max_in_flight: usize,
}

/// The redelivery schedule: `initial`, then × `multiplier` per decline, capped at `max`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Schedule {
    pub initial: Duration,
    pub max: Duration,
    pub multiplier: f64,
}

impl Schedule {
    /// The wait after the decline of attempt `attempt` (1-based): initial × multiplier^(attempt-1), capped at max.
    pub fn delay_after(&self, attempt: u32) -> Duration {
        schedule_delay(self.initial, self.max, self.multiplier, attempt)
    }
}

impl From<&api::Backoff> for Schedule {
    fn from(b: &api::Backoff) -> Schedule {
        Schedule {
            initial: b.initial.get(),
            max: b.max.get(),
            multiplier: b.multiplier,
        }
    }
}

impl ResolvedPolicy {
    /// Fills in the defaults of `p`. Does not judge it (see `validate_policy`).
    pub fn resolve(p: &DeliveryPolicy) -> ResolvedPolicy {
        ResolvedPolicy {
            pattern: p.pattern.clone(),
            mode: p.mode,
            durable_name: p.durable_name.clone().filter(|d| !d.is_empty()),
            max_deliver: p
                .max_deliver
                .and_then(|m| u32::try_from(m).ok())
                .filter(|m| *m > 0),
            backoff: p.backoff.as_ref().map(Schedule::from),
            max_nack_delay: p.max_nack_delay.map(api::Duration::get),
            slow_handler: p.slow_handler.unwrap_or_default(),
            ack_wait: p.ack_wait.map_or(DEFAULT_ACK_WAIT, api::Duration::get),
            max_processing_time: p
                .max_processing_time
                .map_or(DEFAULT_MAX_PROCESSING_TIME, api::Duration::get),
            max_in_flight: p
                .max_in_flight
                .and_then(|m| usize::try_from(m).ok())
                .filter(|m| *m > 0)
                .unwrap_or(DEFAULT_MAX_IN_FLIGHT),
        }
    }

    pub fn at_least_once(&self) -> bool {
        self.mode == Mode::AtLeastOnce
    }

    /// The longest delay `nack_after` accepts: maxNackDelay, else the schedule's max, else none
    /// (semantics B3).
    pub fn nack_ceiling(&self) -> Option<Duration> {
        self.max_nack_delay.or(self.backoff.map(|b| b.max))
    }

    /// The wait before the next attempt after a Nack or silence on `attempt`: the schedule, or
    /// at once without one.
    pub fn decline_delay(&self, attempt: u32) -> Duration {
        self.backoff
            .map_or(Duration::ZERO, |b| b.delay_after(attempt))
    }
}
