//! The chart and the pinned helm: running it, rendering the chart (`helm template`), and
//! splitting a rendered YAML stream into documents.

use std::path::Path;
use std::process::{Command, Output};

use serde::Deserialize;
use serde_json::Value;

use crate::controlplane::tool;
use crate::root;

/// The chart's folder.
pub fn chart() -> String {
    crate::path_str(&root().join("charts/settle")).to_string()
}

/// Runs the pinned helm, against `kubeconfig` if given, with its state under target/helm.
pub fn helm_run(kubeconfig: Option<&Path>, args: &[&str]) -> Output {
    let mut cmd = Command::new(tool("helm"));
    cmd.args(args)
        .env("HELM_CACHE_HOME", root().join("target/helm/cache"))
        .env("HELM_CONFIG_HOME", root().join("target/helm/config"))
        .env("HELM_DATA_HOME", root().join("target/helm/data"));
    match kubeconfig {
        Some(k) => cmd.env("KUBECONFIG", k),
        // helm template needs no cluster; make sure it does not find one.
        None => cmd.env("KUBECONFIG", root().join("target/helm/no-cluster")),
    };
    cmd.output().expect("helm runs")
}

/// helm that must succeed; returns stdout and stderr.
pub fn helm(kubeconfig: Option<&Path>, args: &[&str]) -> String {
    let out = helm_run(kubeconfig, args);
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "helm {args:?} failed:\n{text}");
    text
}

/// `helm template` of the chart as release `settle` in `settle-system` with `--set`s: what
/// `helm install settle charts/settle -n settle-system` would create (CRDs with `include_crds`).
pub fn render_chart(sets: &[&str], include_crds: bool) -> String {
    let chart = chart();
    let mut args = vec!["template", "settle", chart.as_str(), "-n", "settle-system"];
    if include_crds {
        args.push("--include-crds");
    }
    for s in sets {
        args.extend(["--set", s]);
    }
    helm(None, &args)
}

/// The documents of a multi-document YAML stream, as JSON values (empty documents skipped).
pub fn docs(yaml: &str) -> Vec<Value> {
    serde_yaml::Deserializer::from_str(yaml)
        .map(|doc| Value::deserialize(doc).expect("valid YAML"))
        .filter(|v| !v.is_null())
        .collect()
}
