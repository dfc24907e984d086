//! What an install of Settle must look like, shared by the tests of the Helm chart, the kustomize
//! bases and the webhook: the shipped webhook configuration's shape, the operator's RBAC as the
//! README states it (asked of the real API server with `kubectl auth can-i`), and kube-score's
//! verdict on rendered manifests.
//!
//! It renders (the pinned helm's `helm template`) but installs nothing: each test does that its
//! own way, on an API server of its choosing.
//!
//! The files: `helm` (the chart, helm, rendering), `webhook` (the shipped webhook
//! configurations), `rbac` (the operator's RBAC), `kube_score` (kube-score's verdict), `values`
//! (comparing JSON values).

mod helm;
mod kube_score;
mod rbac;
mod values;
mod webhook;

pub use helm::*;
pub use kube_score::*;
pub use rbac::*;
pub use values::*;
pub use webhook::*;
