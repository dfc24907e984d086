//! `kubectl settle` as a process on the real API server: a namespace with a Backend and
//! Subscriptions whose status (counters, gauges, conditions) the test writes through the status
//! subresource, as the account and the controllers would; then the built `kubectl-settle`, and
//! once `kubectl settle` itself (kubectl finds the plugin on PATH), must show exactly that.

use settle_testkit as common;

use std::collections::HashMap;
use std::process::{Command, Output};
use std::sync::OnceLock;

use serde_json::{Value, json};

/// The scene every test reads (written once): its namespace.
fn scene() -> &'static str {
    static NS: OnceLock<String> = OnceLock::new();
    NS.get_or_init(|| {
        common::install_crds();
        let ns = common::namespace("plugin");
        common::subs::apply(
            &ns,
            "apiVersion: messaging.settle.dev/v1alpha1\nkind: Backend\nmetadata: {name: rabbit}\nspec:\n  rabbitmq:\n    urls: [\"amqp://rabbit.invalid:5672\"]\n",
        );
        status(&ns, "backend", "rabbit", json!({
            "serverVersion": "4.1.0",
            "conditions": [cond("Ready", "True", "Connected", "connected")],
        }));
        for (name, backend, extra) in [
            ("orders", "rabbit", "  mode: AtLeastOnce\n  durableName: orders\n"),
            // Backoff on RabbitMQ: the capability table says it cannot delay (K-rules).
            ("reports", "rabbit", "  mode: AtLeastOnce\n  durableName: reports\n  backoff: {initial: 1s, max: 1m}\n"),
            ("quiet", "rabbit", ""),
            ("lonely", "gone", ""),
        ] {
            common::subs::apply(
                &ns,
                &format!(
                    "apiVersion: messaging.settle.dev/v1alpha1\nkind: Subscription\nmetadata: {{name: {name}}}\nspec:\n  backendRef: {{name: {backend}}}\n  pattern: {name}.#\n{extra}"
                ),
            );
        }
        status(&ns, "subscription", "orders", json!({
            "stats": {
                "offered": 31, "delivered": 30, "released": 1, "lost": 0,
                "settlement": {"acked": 17, "nacked": 12, "silent": 1, "refused": 0},
                "exhausted": 10, "stranded": 2, "pending": 5, "ackPending": 3,
            },
            "statsUpdatedAt": "2026-12-01T10:00:00Z",
            "conditions": [
                cond("Accepted", "True", "Valid", "valid"),
                cond("Ready", "True", "ConsumerReady", "queue orders is bound"),
                cond("Exhausting", "True", "MessagesExhausted", "10 message(s) ran out of attempts (maxDeliver) in the last 15m"),
                cond("Stranding", "True", "MessagesStranded", "2 message(s) declined while the consumer was gone"),
                cond("Accounted", "True", "Kept", "kept"),
                cond("Stalled", "False", "Delivering", "delivering"),
            ],
        }));
        status(&ns, "subscription", "reports", json!({
            "conditions": [
                cond("Accepted", "False", "Invalid", "spec.backoff: this backend cannot delay redelivery; remove backoff"),
                cond("Ready", "False", "NotAccepted", "the spec is not accepted"),
            ],
        }));
        status(&ns, "subscription", "quiet", json!({
            "stats": {
                "offered": 4, "delivered": 4, "settlement": {"acked": 4},
                "exhausted": 0, "stranded": 0, "pending": 0, "ackPending": 0,
            },
            "conditions": [
                cond("Accepted", "True", "Valid", "valid"),
                cond("Ready", "True", "ConsumerReady", "ready"),
                cond("Exhausting", "False", "NoRecentLoss", "none"),
                cond("Stalled", "False", "NothingPending", "nothing pending"),
            ],
        }));
        status(&ns, "subscription", "lonely", json!({
            "conditions": [
                cond("Accepted", "True", "Valid", "valid"),
                cond("Ready", "False", "BackendNotFound", "Backend \"gone\" does not exist in this namespace"),
            ],
        }));
        ns
    })
}

fn cond(t: &str, status: &str, reason: &str, message: &str) -> Value {
    json!({"type": t, "status": status, "reason": reason, "message": message,
           "lastTransitionTime": "2026-12-01T09:00:00Z"})
}

/// Writes `status` on `kind/name` through the status subresource (a merge patch: each list
/// given replaces the one there).
fn status(ns: &str, kind: &str, name: &str, status: Value) {
    let patch = json!({ "status": status }).to_string();
    common::kubectl_ok(
        &[
            "patch",
            kind,
            name,
            "-n",
            ns,
            "--subresource=status",
            "--type=merge",
            "-p",
            &patch,
        ],
        None,
    );
}

/// The plugin binary, with the environment's kubeconfig and nothing else of ours set.
fn settle(args: &[&str]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kubectl-settle"));
    for var in [
        "KUBECTL_SETTLE_NAMESPACE",
        "KUBECTL_SETTLE_CONTEXT",
        "KUBECTL_SETTLE_KUBECONFIG",
    ] {
        cmd.env_remove(var);
    }
    cmd.env("KUBECONFIG", common::env().kubeconfig)
        .args(args)
        .output()
        .expect("run kubectl-settle")
}

fn settle_ok(args: &[&str]) -> String {
    let out = settle(args);
    assert!(
        out.status.success(),
        "kubectl-settle {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8 output")
}

/// The table as one map per row, column header → cell.
fn table(text: &str) -> Vec<HashMap<String, String>> {
    let mut lines = text.lines();
    let header: Vec<String> = lines
        .next()
        .expect("a header")
        .split_whitespace()
        .map(String::from)
        .collect();
    lines
        .map(|l| {
            let cells: Vec<&str> = l.split_whitespace().collect();
            assert_eq!(cells.len(), header.len(), "one cell per column: {l:?}");
            header
                .iter()
                .cloned()
                .zip(cells.into_iter().map(String::from))
                .collect()
        })
        .collect()
}

fn row<'a>(rows: &'a [HashMap<String, String>], name: &str) -> &'a HashMap<String, String> {
    rows.iter()
        .find(|r| r["NAME"] == name)
        .unwrap_or_else(|| panic!("a row for {name}: {rows:?}"))
}

fn cells(r: &HashMap<String, String>, columns: &[&str]) -> Vec<String> {
    columns.iter().map(|c| r[*c].clone()).collect()
}

const COUNTERS: [&str; 8] = [
    "DELIVERED",
    "ACKED",
    "NACKED",
    "SILENT",
    "EXHAUSTED",
    "STRANDED",
    "PENDING",
    "ACKPENDING",
];

#[test]
fn status_shows_each_subscriptions_counters_and_only_its_unhealthy_conditions() {
    let ns = scene();
    let text = settle_ok(&["status", "-n", ns]);
    let rows = table(&text);
    assert_eq!(
        rows.iter().map(|r| r["NAME"].as_str()).collect::<Vec<_>>(),
        ["lonely", "orders", "quiet", "reports"],
        "every Subscription of the namespace, sorted:\n{text}"
    );
    assert!(
        !text.contains("NAMESPACE"),
        "no namespace column without -A:\n{text}"
    );
    let orders = row(&rows, "orders");
    assert_eq!(
        cells(orders, &COUNTERS),
        ["30", "17", "12", "1", "10", "2", "5", "3"]
    );
    assert_eq!(cells(orders, &["BACKEND", "READY"]), ["rabbit", "True"]);
    assert_eq!(orders["CONDITIONS"], "Exhausting,Stranding");
    let quiet = row(&rows, "quiet");
    assert_eq!(
        cells(quiet, &COUNTERS),
        ["4", "4", "0", "0", "0", "0", "0", "0"]
    );
    assert_eq!(
        quiet["CONDITIONS"], "-",
        "a healthy Subscription shows no condition"
    );
    let reports = row(&rows, "reports");
    assert_eq!(
        cells(reports, &COUNTERS),
        ["-"; 8],
        "no stats yet: dashes, not zeros"
    );
    assert_eq!(reports["CONDITIONS"], "Accepted=False,Ready=False");

    let wide = table(&settle_ok(&["status", "-n", ns, "-o", "wide"]));
    assert_eq!(
        cells(
            row(&wide, "orders"),
            &[
                "KIND",
                "OFFERED",
                "RELEASED",
                "LOST",
                "REFUSED",
                "CONDITIONS"
            ]
        ),
        [
            "rabbitmq",
            "31",
            "1",
            "0",
            "0",
            "Exhausting:MessagesExhausted,Stranding:MessagesStranded"
        ]
    );
    assert_eq!(
        row(&wide, "lonely")["KIND"],
        "-",
        "its Backend does not exist"
    );
}

#[test]
fn status_json_is_one_array_with_the_documented_fields() {
    let ns = scene();
    let text = settle_ok(&["status", "-n", ns, "-o", "json"]);
    let rows: Vec<Value> = serde_json::from_str(&text).expect("-o json is one JSON array");
    assert_eq!(rows.len(), 4, "{text}");
    let orders = rows.iter().find(|r| r["name"] == "orders").expect("orders");
    for (field, want) in [
        ("namespace", json!(ns)),
        ("backend", json!("rabbit")),
        ("backendKind", json!("rabbitmq")),
        ("ready", json!("True")),
        ("offered", json!(31)),
        ("delivered", json!(30)),
        ("acked", json!(17)),
        ("nacked", json!(12)),
        ("silent", json!(1)),
        ("refused", json!(0)),
        ("released", json!(1)),
        ("lost", json!(0)),
        ("exhausted", json!(10)),
        ("stranded", json!(2)),
        ("pending", json!(5)),
        ("ackPending", json!(3)),
        ("statsUpdatedAt", json!("2026-12-01T10:00:00Z")),
    ] {
        assert_eq!(orders[field], want, "{field} in {orders}");
    }
    let types: Vec<&str> = orders["conditions"]
        .as_array()
        .expect("conditions")
        .iter()
        .map(|c| c["type"].as_str().expect("type"))
        .collect();
    assert_eq!(types, ["Exhausting", "Stranding"]);
    assert_eq!(orders["conditions"][0]["reason"], "MessagesExhausted");
    let reports = rows
        .iter()
        .find(|r| r["name"] == "reports")
        .expect("reports");
    assert_eq!(reports["delivered"], Value::Null, "no stats: null, not 0");
    assert_eq!(reports["ready"], "False");
}

#[test]
fn all_namespaces_adds_the_namespace_column_and_finds_this_scene() {
    let ns = scene();
    let rows = table(&settle_ok(&["status", "-A"]));
    let ours: Vec<&HashMap<String, String>> =
        rows.iter().filter(|r| r["NAMESPACE"] == ns).collect();
    assert_eq!(
        ours.len(),
        4,
        "all four of this scene among every namespace's"
    );
    let orders = ours.iter().find(|r| r["NAME"] == "orders").expect("orders");
    assert_eq!(
        cells(orders, &COUNTERS),
        ["30", "17", "12", "1", "10", "2", "5", "3"]
    );
}

#[test]
fn explain_names_the_failing_reason_its_fix_and_what_the_backend_can_honour() {
    let ns = scene();
    let reports = settle_ok(&["explain", "reports", "-n", ns]);
    for want in [
        &format!("Subscription {ns}/reports: not Accepted"),
        "Accepted=False (Invalid): spec.backoff: this backend cannot delay redelivery; remove backoff",
        "next: fix the field the message names",
        "Ready=False (NotAccepted)",
        // The capability table's row for RabbitMQ (the Backend's status has no capabilities).
        "from the rabbitmq row of the capability table",
        "delayed redelivery (backoff, maxNackDelay): no",
        "Backend Ready: True (Connected)",
        // policy::validate against that row refuses the same field.
        "refused: spec.backoff",
    ] {
        assert!(
            reports.contains(want),
            "explain reports must say {want:?}:\n{reports}"
        );
    }

    let lonely = settle_ok(&["explain", "lonely", "-n", ns]);
    for want in [
        &format!("Subscription {ns}/lonely: not Ready"),
        "Ready=False (BackendNotFound)",
        &format!("next: create Backend \"gone\" in namespace {ns}"),
        &format!("Backend \"gone\": not found in namespace {ns}"),
    ] {
        assert!(
            lonely.contains(want),
            "explain lonely must say {want:?}:\n{lonely}"
        );
    }

    let orders = settle_ok(&["explain", "orders", "-n", ns]);
    for want in [
        "Ready, with trouble: Exhausting, Stranding",
        "Exhausting (MessagesExhausted): 10 message(s) ran out of attempts",
        "exhausted 10   stranded 2",
        "pending 5   ackPending 3",
    ] {
        assert!(
            orders.contains(want),
            "explain orders must say {want:?}:\n{orders}"
        );
    }

    let quiet = settle_ok(&["explain", "quiet", "-n", ns]);
    assert!(
        quiet.starts_with(&format!("Subscription {ns}/quiet: healthy")),
        "{quiet}"
    );
    assert!(!quiet.contains("What is wrong"), "{quiet}");
}

#[test]
fn a_missing_subscription_is_a_clear_error_and_exit_status_1() {
    let ns = scene();
    let out = settle(&["explain", "nosuch", "-n", ns]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(out.stdout.is_empty());
    assert!(
        stderr.contains(&format!(
            "Subscription \"nosuch\" not found in namespace \"{ns}\""
        )),
        "{stderr}"
    );
}

#[test]
fn kubectl_runs_the_plugin_from_path_as_kubectl_settle() {
    let ns = scene();
    let bin = std::path::Path::new(env!("CARGO_BIN_EXE_kubectl-settle"));
    let dir = bin.parent().expect("the binary's directory");
    let path = std::env::join_paths(std::iter::once(dir.to_path_buf()).chain(
        std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default()),
    ))
    .expect("a PATH");
    let out = Command::new("kubectl")
        .env("PATH", path)
        .env("KUBECONFIG", common::env().kubeconfig)
        .env_remove("KUBECTL_SETTLE_NAMESPACE")
        .args(["settle", "status", "-n", ns])
        .output()
        .expect("kubectl must be on PATH");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "kubectl settle failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows = table(&text);
    assert_eq!(
        cells(row(&rows, "orders"), &COUNTERS),
        ["30", "17", "12", "1", "10", "2", "5", "3"]
    );
}

#[test]
fn the_krew_manifest_installs_this_binary_on_each_platform() {
    let manifest = std::fs::read_to_string(settle_testkit::root().join(".krew.yaml"))
        .expect("the krew manifest .krew.yaml at the repository's root");
    let bin = std::path::Path::new(env!("CARGO_BIN_EXE_kubectl-settle"))
        .file_name()
        .and_then(|n| n.to_str())
        .expect("the plugin binary's name");
    assert!(manifest.contains("kind: Plugin") && manifest.contains("  name: settle\n"));
    let platforms = manifest.matches("- selector:").count();
    assert!(platforms >= 1, "{manifest}");
    assert_eq!(
        manifest.matches(&format!("bin: {bin}\n")).count(),
        platforms,
        "every platform runs the binary cargo builds ({bin}):\n{manifest}"
    );
    assert_eq!(
        manifest.matches(&format!("/{bin}-linux-")).count(),
        platforms,
        "every platform's archive is named for the binary:\n{manifest}"
    );
}

/// Subscription `name`'s spec as the API server stores it.
fn spec_of(ns: &str, name: &str) -> Value {
    let text = common::kubectl_ok(&["get", "subscription", name, "-n", ns, "-o", "json"], None);
    serde_json::from_str::<Value>(&text).expect("json")["spec"].clone()
}

#[test]
fn pause_and_resume_patch_the_spec_and_nothing_else() {
    // A namespace of its own: the shared scene's Subscriptions keep their specs.
    common::install_crds();
    let ns = common::namespace("plugin-pause");
    common::subs::apply(
        &ns,
        "apiVersion: messaging.settle.dev/v1alpha1\nkind: Subscription\nmetadata: {name: orders}\nspec:\n  backendRef: {name: rabbit}\n  pattern: orders.#\n  mode: AtLeastOnce\n  durableName: orders\n",
    );
    let before = spec_of(&ns, "orders");

    let out = settle_ok(&["pause", "orders", "--for", "30m", "-n", &ns]);
    let spec = spec_of(&ns, "orders");
    assert_eq!(spec["paused"], true, "{spec}");
    let until: k8s_openapi::jiff::Timestamp = spec["pausedUntil"]
        .as_str()
        .expect("pausedUntil")
        .parse()
        .expect("RFC 3339");
    let left = until.duration_since(k8s_openapi::jiff::Timestamp::now());
    assert!(
        (1790..=1800).contains(&left.as_secs()),
        "--for 30m ends 30 minutes from now: {until} ({left:?})"
    );
    assert!(
        out.starts_with(&format!("Subscription {ns}/orders paused until {until}")),
        "{out}"
    );
    let mut others = spec.clone();
    let fields = others.as_object_mut().expect("an object");
    fields.remove("paused");
    fields.remove("pausedUntil");
    assert_eq!(others, before, "nothing else of the spec changed");

    // Paused again without a time: the time goes; with --until: that time.
    settle_ok(&["pause", "orders", "-n", &ns]);
    let spec = spec_of(&ns, "orders");
    assert_eq!(
        (spec["paused"].clone(), spec.get("pausedUntil")),
        (Value::Bool(true), None),
        "{spec}"
    );
    settle_ok(&[
        "pause",
        "orders",
        "--until",
        "2099-01-01T00:00:00Z",
        "-n",
        &ns,
    ]);
    assert_eq!(
        spec_of(&ns, "orders")["pausedUntil"],
        "2099-01-01T00:00:00Z"
    );

    // A time already passed is refused before anything is sent.
    let out = settle(&[
        "pause",
        "orders",
        "--until",
        "2020-01-01T00:00:00Z",
        "-n",
        &ns,
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("has passed already"), "{stderr}");
    assert_eq!(
        spec_of(&ns, "orders")["pausedUntil"],
        "2099-01-01T00:00:00Z"
    );

    let out = settle_ok(&["resume", "orders", "-n", &ns]);
    assert!(
        out.contains(&format!("Subscription {ns}/orders resumed")),
        "{out}"
    );
    assert_eq!(spec_of(&ns, "orders"), before, "resume removes both fields");

    // Another namespace's, or none: not found, exit status 1.
    let out = settle(&["resume", "orders", "-n", "default"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("not found in namespace \"default\""),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    common::kubectl_ok(&["delete", "namespace", &ns, "--wait=false"], None);
}
