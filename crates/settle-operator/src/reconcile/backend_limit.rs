//! How many Backends of one namespace the operator connects: the oldest
//! `--max-backends-per-namespace` (by creation time, then name). A further one makes no
//! connection, account keeper or memory; its `Ready=False BackendLimit` says why and what to do,
//! and `settle_backends_over_limit{namespace}` counts them. So a tenant who multiplies Backends
//! multiplies status lines, not the operator's connections and memory.
//!
//! It must not connect, read Secrets or write status: it only says whether a Backend is within
//! the bound.

use kube::ResourceExt;

use super::Ctx;
use settle::api::Backend;

/// `Some(message)` when `b` is beyond its namespace's bound.
pub fn beyond(ctx: &Ctx, b: &Backend) -> Option<String> {
    let ns = b.namespace()?;
    let limit = usize::from(ctx.max_backends_per_namespace);
    let mut here: Vec<(Option<i128>, String)> = ctx
        .backends
        .state()
        .iter()
        .filter(|x| x.namespace().as_deref() == Some(ns.as_str()))
        .map(|x| {
            (
                x.creation_timestamp().map(|t| t.0.as_nanosecond()),
                x.name_any(),
            )
        })
        .collect();
    here.sort();
    let over = here.len().saturating_sub(limit);
    let gauge = &ctx.metrics.backends_over_limit;
    if over == 0 {
        let _ = gauge.remove_label_values(&[&ns]);
    } else {
        gauge
            .with_label_values(&[&ns])
            .set(i64::try_from(over).unwrap_or(i64::MAX));
    }
    let name = b.name_any();
    let position = here.iter().position(|(_, n)| *n == name)?;
    (position >= limit).then(|| {
        format!(
            "namespace {ns} has {} Backends and this operator connects the oldest {limit} of a \
             namespace (--max-backends-per-namespace): this one is not connected; delete a Backend \
             of this namespace you no longer use, or ask the installer to raise the bound",
            here.len()
        )
    })
}
