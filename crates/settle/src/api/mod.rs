//! The API of group `messaging.settle.dev`, version `v1alpha1`: the `Backend` and
//! `Subscription` resources and the wire types they share with the runtime (durations,
//! ConsumerStats, Capabilities).
//!
//! Types, their schemas (which become `kubectl explain` text and the API server's own CEL
//! checks) and nothing else: no I/O, no policy decisions.

mod backend;
pub mod condition;
mod duration;
mod stats;
mod subscription;

pub use backend::{
    AckTimeout, Backend, BackendSpec, BackendStatus, Capabilities, MemoryBackendSpec,
    NatsBackendSpec, NatsTlsSpec, RabbitmqBackendSpec, RabbitmqTlsSpec, SecretRef, SqsBackendSpec,
};
pub use duration::{Duration, DurationError};
pub use stats::{ConsumerStats, Settlement};
pub use subscription::{
    Adopt, BackendRef, Backoff, ConsumerRef, DeletionPolicy, DeliveryPolicy, Mode, Shape,
    SlowHandler, Subscription, SubscriptionSpec, SubscriptionStats, SubscriptionStatus,
};

/// The API group.
pub const GROUP: &str = "messaging.settle.dev";

/// The finalizer that makes deleting a Subscription delete its consumer first. The controller
/// puts it on; the mutating webhook puts it on at admission already, so a new Subscription costs
/// no write for it (docs/semantics.md A14).
pub const FINALIZER: &str = "messaging.settle.dev/consumer";

/// The finalizer that keeps a Backend (and its broker connection) while Subscriptions that name
/// it still have consumers to delete, for at most the operator's `--backend-deletion-grace`
/// (docs/guide/reconcile.md, "Deletion").
pub const BACKEND_FINALIZER: &str = "messaging.settle.dev/backend";

/// The CustomResourceDefinitions, as `settle crds` prints them and `crds/` holds them.
pub fn crds_yaml() -> Result<String, serde_yaml::Error> {
    use kube::CustomResourceExt;
    let mut out = String::new();
    for crd in [Backend::crd(), Subscription::crd()] {
        let mut value =
            serde_json::to_value(&crd).map_err(<serde_yaml::Error as serde::ser::Error>::custom)?;
        tidy_schema(&mut value);
        out.push_str("---\n");
        out.push_str(&serde_yaml::to_string(&value)?);
    }
    Ok(out)
}

/// Makes the generated schema read well and load cleanly: doc comments are wrapped at ~100
/// columns in the source, so single line breaks become spaces (`kubectl explain` wraps again);
/// and unsigned formats the API server does not know become `int64` with a minimum of 0.
fn tidy_schema(v: &mut serde_json::Value) {
    use serde_json::Value;
    match v {
        Value::Object(map) => {
            if let Some(Value::String(d)) = map.get_mut("description") {
                *d = d
                    .split("\n\n")
                    .map(|p| p.split('\n').map(str::trim).collect::<Vec<_>>().join(" "))
                    .collect::<Vec<_>>()
                    .join("\n\n");
            }
            if matches!(map.get("format"), Some(Value::String(f)) if f.starts_with("uint")) {
                map.insert("format".into(), Value::String("int64".into()));
                map.entry("minimum").or_insert(Value::from(0));
            }
            map.values_mut().for_each(tidy_schema);
        }
        Value::Array(items) => items.iter_mut().for_each(tidy_schema),
        _ => {}
    }
}
