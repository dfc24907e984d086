//! What an application subscribes with: `SubscriptionSpec { name, policy, handler }`, where the
//! policy is the CRD's own `api::DeliveryPolicy` (no field is copied by hand), and `Policy`, the
//! same policy with every default filled in.
//!
//! No rule about what a backend can honour lives here (that is `admission::validate_policy`);
//! this module only resolves defaults and computes the backoff schedule.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;

use crate::api::{self, DeliveryPolicy, Mode, SlowHandler};

use super::Delivery;

/// What a handler may return: any error. It is counted and logged; it never settles.
pub type HandlerError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// A message handler: gets each delivery, settles it (or not), returns an outcome.
pub type Handler =
    Arc<dyn Fn(Delivery) -> BoxFuture<'static, Result<(), HandlerError>> + Send + Sync>;

/// Wraps an async closure as a [`Handler`].
pub fn handler<F, Fut, E>(f: F) -> Handler
where
    F: Fn(Delivery) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), E>> + Send + 'static,
    E: Into<HandlerError> + 'static,
{
    Arc::new(move |d| {
        let fut = f(d);
        Box::pin(async move { fut.await.map_err(Into::into) })
    })
}

pub use crate::api::{DEFAULT_ACK_WAIT, DEFAULT_MAX_IN_FLIGHT, DEFAULT_MAX_PROCESSING_TIME};

/// One subscription of an application: a name, the CRD's delivery policy, and the handler.
#[derive(Clone)]
pub struct SubscriptionSpec {
    /// The subscription's name (the Subscription resource's name; `bus.stats(name)` reads it back).
    pub name: String,
    /// The delivery policy, the very type of `Subscription.spec`.
    pub policy: DeliveryPolicy,
    /// The handler.
    pub handler: Handler,
}

impl SubscriptionSpec {
    pub fn new(name: impl Into<String>, policy: DeliveryPolicy, handler: Handler) -> Self {
        SubscriptionSpec {
            name: name.into(),
            policy,
            handler,
        }
    }

    /// From a Subscription resource's spec: same policy, same name.
    pub fn from_resource(
        name: impl Into<String>,
        spec: &api::SubscriptionSpec,
        handler: Handler,
    ) -> Self {
        SubscriptionSpec::new(name, spec.policy.clone(), handler)
    }
}

impl fmt::Debug for SubscriptionSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SubscriptionSpec")
            .field("name", &self.name)
            .field("policy", &self.policy)
            .finish_non_exhaustive()
    }
}

/// A delivery policy with every default filled in, as the runtime and the backends use it.
#[derive(Clone, Debug, PartialEq)]
pub struct Policy {
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
        crate::api::schedule_delay(self.initial, self.max, self.multiplier, attempt)
    }
}

impl Policy {
    /// Fills in the defaults of `p`. Does not judge it (see `admission::validate_policy`).
    pub fn resolve(p: &DeliveryPolicy) -> Policy {
        Policy {
            pattern: p.pattern.clone(),
            mode: p.mode,
            durable_name: p.durable_name.clone().filter(|d| !d.is_empty()),
            max_deliver: p
                .max_deliver
                .and_then(|m| u32::try_from(m).ok())
                .filter(|m| *m > 0),
            backoff: p.backoff.as_ref().map(|b| Schedule {
                initial: b.initial.get(),
                max: b.max.get(),
                multiplier: b.multiplier,
            }),
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
    /// (seed 000: "NackAfter is allowed up to MaxNackDelay, or the schedule's Max when that is unset").
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
