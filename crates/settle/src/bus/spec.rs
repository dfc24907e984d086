//! What an application subscribes with: `Subscriber { name, policy, handler }`, where the
//! policy is the CRD's own `api::DeliveryPolicy` (no field is copied by hand), and the handler.
//!
//! No rule about what a backend can honour lives here (that is `policy::validate_runtime`), nor
//! any default (that is `policy::ResolvedPolicy`).

use std::fmt;
use std::future::Future;
use std::sync::Arc;

use futures::future::BoxFuture;

use crate::api::{self, DeliveryPolicy};

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

/// Who creates and keeps a subscription's consumer on the broker.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ConsumerOwner {
    /// This runtime: it creates the consumer when missing and brings it in line with the policy
    /// (a subscription defined in code, with no operator).
    #[default]
    Runtime,
    /// The operator, from the Subscription resource: the runtime binds to the consumer it made,
    /// waits (logging why) while it does not exist, and never creates one itself, so deleting
    /// the Subscription leaves no consumer behind a running application.
    Operator,
}

/// One subscription of an application: a name, the CRD's delivery policy, where its consumer
/// comes from, and the handler.
#[derive(Clone)]
pub struct Subscriber {
    /// The subscription's name (the Subscription resource's name; `bus.stats(name)` reads it back).
    pub name: String,
    /// The delivery policy, the very type of `Subscription.spec`.
    pub policy: DeliveryPolicy,
    /// The stream to consume from (JetStream); `None`: the one stream whose subjects cover the pattern.
    pub stream: Option<String>,
    /// Who creates the broker's consumer.
    pub owner: ConsumerOwner,
    /// The handler.
    pub handler: Handler,
}

impl Subscriber {
    /// A subscription defined in code: the runtime creates and keeps its own consumer.
    pub fn new(name: impl Into<String>, policy: DeliveryPolicy, handler: Handler) -> Self {
        Subscriber {
            name: name.into(),
            policy,
            stream: None,
            owner: ConsumerOwner::Runtime,
            handler,
        }
    }

    /// From a Subscription resource: same name, policy and stream; the operator owns the
    /// consumer, and the runtime binds to it.
    pub fn from_resource(
        name: impl Into<String>,
        spec: &api::SubscriptionSpec,
        handler: Handler,
    ) -> Self {
        Subscriber {
            stream: spec.stream.clone(),
            owner: ConsumerOwner::Operator,
            ..Subscriber::new(name, spec.policy.clone(), handler)
        }
    }

    /// Consume from this stream instead of the one found by the pattern.
    pub fn with_stream(mut self, stream: impl Into<String>) -> Self {
        self.stream = Some(stream.into());
        self
    }
}

impl fmt::Debug for Subscriber {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Subscriber")
            .field("name", &self.name)
            .field("policy", &self.policy)
            .field("stream", &self.stream)
            .field("owner", &self.owner)
            .finish_non_exhaustive()
    }
}
