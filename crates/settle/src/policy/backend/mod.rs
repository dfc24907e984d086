//! The Backend rules (docs/semantics.md A16–A21): `validate_backend(spec, old, namespace,
//! secrets, rules) -> Verdict` for the webhook and `settle check`, and `backend_access`, the part
//! the controller re-checks before it reads a Secret into a connection or connects at all: the
//! Secret opt-in label, the broker host allow-list and SQS pod identity.
//!
//! A Backend is a confused deputy's lever: the operator reads the Secrets it names and sends them
//! to the hosts it names, with the operator's own rights. So a Secret is usable only when it
//! carries [`CREDENTIALS_LABEL`] (its owner opted in), a host only when the installer's
//! allow-list matches it, and the operator pod's own cloud identity (SQS without a Secret) only
//! in the namespaces the installer listed.
//!
//! It must stay pure like the rest of `policy`: no I/O, no Kubernetes or broker client. What a
//! Secret carries is asked through the caller's `secrets` function. Every error names the field
//! and the fix.
//!
//! - [`access`]: whom the operator acts for and where it connects (A18–A21): the Secret opt-in
//!   label, the broker host allow-list, SQS pod identity, credentials sent unencrypted.
//! - [`urls`]: the shape of what a Backend names (A16, A17): URLs and Secret names.

mod access;
#[cfg(test)]
mod tests;
mod urls;

use super::rules::Verdict;
use crate::api::BackendSpec;
use access::access_rules;
pub use access::{
    BackendRules, CREDENTIALS_LABEL, CREDENTIALS_LABEL_VALUE, HostPattern, SecretView,
    plaintext_with_credentials,
};
pub use urls::{URL_MAX, URLS_MAX};
use urls::{dns1123_subdomain, nats_urls, rabbitmq_urls, sqs_settings};

/// Every Secret a Backend names: (field, name).
pub fn secrets_named(spec: &BackendSpec) -> Vec<(&'static str, &str)> {
    let mut out = Vec::new();
    if let Some(n) = &spec.nats {
        if let Some(r) = &n.credentials_secret_ref {
            out.push(("spec.nats.credentialsSecretRef.name", r.name.as_str()));
        }
        if let Some(r) = n.tls.as_ref().and_then(|t| t.ca_secret_ref.as_ref()) {
            out.push(("spec.nats.tls.caSecretRef.name", r.name.as_str()));
        }
    }
    if let Some(r) = &spec.rabbitmq {
        if let Some(s) = &r.credentials_secret_ref {
            out.push(("spec.rabbitmq.credentialsSecretRef.name", s.name.as_str()));
        }
        if let Some(s) = r.tls.as_ref().and_then(|t| t.ca_secret_ref.as_ref()) {
            out.push(("spec.rabbitmq.tls.caSecretRef.name", s.name.as_str()));
        }
    }
    if let Some(q) = &spec.sqs
        && let Some(s) = &q.credentials_secret_ref
    {
        out.push(("spec.sqs.credentialsSecretRef.name", s.name.as_str()));
    }
    out
}

/// A14 for Backends: an update that leaves the spec as it was is admitted without judging it.
pub fn backend_unchanged(spec: &BackendSpec, old: Option<&BackendSpec>) -> bool {
    old.is_some_and(|old| old == spec)
}

/// The Backend admission rules (A16–A21) for a create (`old` is `None`) or an update. `secrets`
/// tells what each named Secret is; `namespace` is the Backend's.
pub fn validate_backend(
    spec: &BackendSpec,
    old: Option<&BackendSpec>,
    namespace: &str,
    secrets: &dyn Fn(&str) -> SecretView,
    rules: &BackendRules,
) -> Verdict {
    let mut v = Verdict::default();
    if backend_unchanged(spec, old) {
        return v;
    }
    let kinds = [
        spec.nats.is_some(),
        spec.rabbitmq.is_some(),
        spec.sqs.is_some(),
        spec.memory.is_some(),
    ];
    if kinds.iter().filter(|k| **k).count() != 1 {
        v.error(
            "spec",
            "exactly one backend kind must be set: nats, rabbitmq, sqs or memory",
        );
        return v;
    }
    if let Some(old) = old {
        let was = [
            old.nats.is_some(),
            old.rabbitmq.is_some(),
            old.sqs.is_some(),
            old.memory.is_some(),
        ];
        if was != kinds {
            v.error(
                "spec",
                "the backend kind (nats, rabbitmq, sqs, memory) cannot change; delete the Backend and create a new one",
            );
        }
    }
    if let Some(n) = &spec.nats {
        nats_urls(&mut v, n);
    }
    if let Some(r) = &spec.rabbitmq {
        rabbitmq_urls(&mut v, r);
    }
    if let Some(q) = &spec.sqs {
        sqs_settings(&mut v, q);
    }
    for (field, name) in secrets_named(spec) {
        if let Err(why) = dns1123_subdomain(name) {
            v.error(field, format!("{name:?} is not a Secret name: {why}"));
        }
    }
    access_rules(&mut v, spec, namespace, secrets, rules, true);
    for (field, message) in plaintext_with_credentials(spec) {
        v.warn(&field, message);
    }
    v
}

/// What the controller re-checks before it reads a Secret into a connection or connects (A18–A20):
/// every named Secret carries the opt-in label, every broker host is allowed, and SQS without a
/// Secret runs only where pod identity is allowed. A Secret that is missing or cannot be read is
/// not an error here (the controller says so as SecretMissing).
pub fn backend_access(
    spec: &BackendSpec,
    namespace: &str,
    secrets: &dyn Fn(&str) -> SecretView,
    rules: &BackendRules,
) -> Verdict {
    let mut v = Verdict::default();
    access_rules(&mut v, spec, namespace, secrets, rules, false);
    v
}
