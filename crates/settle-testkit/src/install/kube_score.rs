//! kube-score's verdict on rendered manifests.

use std::collections::BTreeSet;
use std::io::Write;
use std::process::{Command, Stdio};

use serde_json::{Value, json};

use super::helm::docs;
use crate::controlplane::tool;

/// kube-score's verdict on rendered manifests.
pub struct KubeScore {
    /// CRITICAL findings that nothing declines: `Kind/name: check-id: summary`.
    pub critical: Vec<String>,
    /// WARNING findings, for the record.
    pub warnings: Vec<String>,
    /// Checks declined by `kube-score/ignore` annotations that would otherwise be CRITICAL.
    pub declined: BTreeSet<String>,
    /// Every check id named by a `kube-score/ignore` annotation.
    pub annotated: BTreeSet<String>,
}

fn run_kube_score(manifests: &str, extra: &[&str]) -> Vec<Value> {
    let mut child = Command::new(tool("kube-score"))
        .args([
            "score",
            "--output-format",
            "json",
            "--kubernetes-version",
            "v1.36",
        ])
        .args(extra)
        .arg("-")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start kube-score");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(manifests.as_bytes())
        .expect("write manifests to kube-score");
    let out = child.wait_with_output().expect("kube-score ran");
    // It exits 1 when it finds something critical; the JSON says what.
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "kube-score printed no JSON ({e}): {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

fn criticals(report: &[Value]) -> Vec<(String, String)> {
    let mut found = Vec::new();
    for object in report {
        for check in object["checks"].as_array().into_iter().flatten() {
            if check["skipped"] != json!(true) && check["grade"] == json!(1) {
                let summaries: Vec<&str> = check["comments"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|c| c["summary"].as_str())
                    .collect();
                found.push((
                    check["check"]["id"].as_str().unwrap_or("?").to_string(),
                    format!(
                        "{}: {}: {}",
                        object["object_name"].as_str().unwrap_or("?"),
                        check["check"]["id"].as_str().unwrap_or("?"),
                        summaries.join("; ")
                    ),
                ));
            }
        }
    }
    found
}

pub fn kube_score(manifests: &str) -> KubeScore {
    let report = run_kube_score(manifests, &[]);
    let critical: Vec<(String, String)> = criticals(&report);
    let mut warnings = Vec::new();
    for object in &report {
        for check in object["checks"].as_array().into_iter().flatten() {
            if check["skipped"] != json!(true) && check["grade"] == json!(5) {
                warnings.push(format!(
                    "{}: {}",
                    object["object_name"].as_str().unwrap_or("?"),
                    check["check"]["id"]
                ));
            }
        }
    }
    let undeclined = run_kube_score(manifests, &["--disable-ignore-checks-annotations"]);
    let declined = criticals(&undeclined)
        .into_iter()
        .map(|(id, _)| id)
        .filter(|id| !critical.iter().any(|(c, _)| c == id))
        .collect();
    let annotated = docs(manifests)
        .iter()
        .filter_map(|d| {
            d["metadata"]["annotations"]["kube-score/ignore"]
                .as_str()
                .map(str::to_string)
        })
        .flat_map(|s| {
            s.split(',')
                .map(|id| id.trim().to_string())
                .collect::<Vec<_>>()
        })
        .collect();
    KubeScore {
        critical: critical.into_iter().map(|(_, line)| line).collect(),
        warnings,
        declined,
        annotated,
    }
}
