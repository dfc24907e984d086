//! `settle check` as a CI pipeline runs it: a real process, real files, exit codes.

use std::process::Command;

fn settle_check(args: &[&str]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_settle"))
        .arg("check")
        .args(args)
        .output()
        .expect("settle runs");
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.code().expect("exit code"), text)
}

fn root() -> std::path::PathBuf {
    settle_testkit::root()
}

#[test]
fn samples_pass_on_the_backend_they_name() {
    let (code, out) = settle_check(&["-f", root().join("config/samples").to_str().unwrap()]);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("Subscription default/orders ok (backend: nats, Backend \"nats\" in input)"),
        "{out}"
    );
    // Two Backends and three Subscriptions.
    assert!(out.contains("Backend default/nats ok"), "{out}");
    assert!(out.contains("5 checked, 0 refused"), "{out}");
}

#[test]
fn rabbitmq_without_plugins_refuses_delays_and_exits_1() {
    let (code, out) = settle_check(&[
        "-f",
        root().join("config/samples").to_str().unwrap(),
        "--backend-kind",
        "rabbitmq",
    ]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("Subscription default/orders REFUSED (backend: rabbitmq, --backend-kind)"),
        "{out}"
    );
    assert!(
        out.contains("error: spec.backoff: this backend cannot delay a redelivery"),
        "{out}"
    );
    assert!(
        out.contains("error: spec.maxNackDelay: this backend cannot delay a redelivery"),
        "{out}"
    );
    // Settle drives RabbitMQ: no "not driven yet" warning.
    assert!(!out.contains("does not drive it yet"), "{out}");
    assert!(out.contains("5 checked, 1 refused"), "{out}");
}

#[test]
fn sqs_refuses_delays_longer_than_twelve_hours() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("long.yaml");
    std::fs::write(
        &f,
        "apiVersion: messaging.settle.dev/v1alpha1\nkind: Subscription\nmetadata: {name: slow, namespace: shop}\nspec:\n  backendRef: {name: q}\n  pattern: jobs\n  mode: AtLeastOnce\n  durableName: slow\n  maxNackDelay: 13h\n",
    )
    .unwrap();
    let (code, out) = settle_check(&["-f", f.to_str().unwrap(), "--backend-kind", "sqs"]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("error: spec.maxNackDelay: 13h0m0s is longer than this backend can hold a message back (12h0m0s): set it to 12h0m0s or less"), "{out}");
    let (code, out) = settle_check(&["-f", f.to_str().unwrap(), "--backend-kind", "nats"]);
    assert_eq!(code, 0, "{out}");
}

#[test]
fn a_stream_is_refused_on_rabbitmq_and_sqs_naming_the_field_and_admitted_on_nats() {
    // A15: the same words as the webhook's, from the same validate.
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("streamed.yaml");
    std::fs::write(
        &f,
        "apiVersion: messaging.settle.dev/v1alpha1\nkind: Subscription\nmetadata: {name: orders, namespace: shop}\nspec:\n  backendRef: {name: b}\n  pattern: orders\n  mode: AtLeastOnce\n  durableName: orders\n  stream: ORDERS\n",
    )
    .unwrap();
    for kind in ["rabbitmq", "sqs"] {
        let (code, out) = settle_check(&["-f", f.to_str().unwrap(), "--backend-kind", kind]);
        assert_eq!(code, 1, "{kind}: {out}");
        assert!(
            out.contains(&format!(
                "Subscription shop/orders REFUSED (backend: {kind}, --backend-kind)"
            )),
            "{kind}: {out}"
        );
        assert!(
            out.contains("error: spec.stream: \"ORDERS\" names a JetStream stream, and this backend has no named streams"),
            "{kind}: {out}"
        );
        assert!(out.contains("Remove spec.stream"), "{kind}: {out}");
    }
    let (code, out) = settle_check(&["-f", f.to_str().unwrap(), "--backend-kind", "nats"]);
    assert_eq!(code, 0, "{out}");
}

#[test]
fn backends_are_checked_with_the_labels_of_the_secrets_in_the_same_input() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("all.yaml"),
        "apiVersion: v1\nkind: Secret\nmetadata: {name: plain, namespace: a}\nstringData: {token: t}\n---\n\
         apiVersion: v1\nkind: Secret\nmetadata: {name: opted, namespace: a, labels: {settle.dev/backend-credentials: \"true\"}}\nstringData: {token: t}\n---\n\
         apiVersion: messaging.settle.dev/v1alpha1\nkind: Backend\nmetadata: {name: bad, namespace: a}\nspec: {nats: {servers: [\"tls://n:4222\"], credentialsSecretRef: {name: plain}}}\n---\n\
         apiVersion: messaging.settle.dev/v1alpha1\nkind: Backend\nmetadata: {name: good, namespace: a}\nspec: {nats: {servers: [\"tls://n:4222\"], credentialsSecretRef: {name: opted}}}\n---\n\
         apiVersion: messaging.settle.dev/v1alpha1\nkind: Backend\nmetadata: {name: url, namespace: a}\nspec: {rabbitmq: {urls: [\"amqp://u:hunter2@r:5672\"]}}\n",
    )
    .unwrap();
    let (code, out) = settle_check(&["-f", dir.path().to_str().unwrap()]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("Backend a/bad REFUSED"), "{out}");
    assert!(
        out.contains("error: spec.nats.credentialsSecretRef.name: Secret \"plain\" does not carry the label settle.dev/backend-credentials=true"),
        "{out}"
    );
    assert!(out.contains("Backend a/good ok"), "{out}");
    assert!(out.contains("Backend a/url REFUSED"), "{out}");
    assert!(
        out.contains("error: spec.rabbitmq.urls[0]: holds credentials"),
        "{out}"
    );
    assert!(!out.contains("hunter2"), "{out}");
    assert!(out.contains("3 checked, 2 refused"), "{out}");
}

#[test]
fn backend_in_the_same_input_decides_capabilities() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("all.yaml"),
        "apiVersion: messaging.settle.dev/v1alpha1\nkind: Backend\nmetadata: {name: mem, namespace: a}\nspec: {memory: {}}\n---\n\
         apiVersion: messaging.settle.dev/v1alpha1\nkind: Subscription\nmetadata: {name: s, namespace: a}\nspec:\n  backendRef: {name: mem}\n  pattern: x\n  mode: AtLeastOnce\n",
    )
    .unwrap();
    std::fs::write(
        dir.path().join("other.yml"),
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: unrelated}\n",
    )
    .unwrap();
    let (code, out) = settle_check(&["-f", dir.path().to_str().unwrap()]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("Subscription a/s REFUSED (backend: memory, Backend \"mem\" in input)"),
        "{out}"
    );
    assert!(
        out.contains("error: spec.durableName: required under mode AtLeastOnce, on every backend"),
        "{out}"
    );
    assert!(out.contains("2 checked, 1 refused"), "{out}");
}

#[test]
fn a_field_that_does_not_fit_is_refused_with_exit_1_naming_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("bad.yaml");
    std::fs::write(
        &f,
        "apiVersion: messaging.settle.dev/v1alpha1\nkind: Subscription\nmetadata: {name: x}\nspec:\n  backendRef: {name: nats}\n  pattern: a\n  ackWait: 30 seconds\n",
    )
    .unwrap();
    let (code, out) = settle_check(&["-f", f.to_str().unwrap()]);
    assert_eq!(code, 1, "readable YAML the API server would refuse: {out}");
    assert!(
        out.contains("error: spec.ackWait: \"30 seconds\" is not a duration"),
        "{out}"
    );
    assert!(out.contains("1 checked, 1 refused"), "{out}");
}

#[test]
fn input_that_is_not_valid_yaml_exits_2_after_reporting_everything_else() {
    // README: "2: the input could not be read". A syntax error is unreadable input, not a verdict
    // on a Subscription, and it wins over a refusal in the same run.
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("bad.yaml");
    std::fs::write(
        &f,
        "apiVersion: messaging.settle.dev/v1alpha1\nkind: Subscription\nmetadata: {name: x}\nspec:\n  backendRef: {name: nats}\n  pattern: a\n  ackWait: 30 seconds\n---\n: : bad\n",
    )
    .unwrap();
    std::fs::write(
        dir.path().join("good.yaml"),
        "apiVersion: messaging.settle.dev/v1alpha1\nkind: Subscription\nmetadata: {name: fine}\nspec:\n  backendRef: {name: nats}\n  pattern: a\n",
    )
    .unwrap();
    let (code, out) = settle_check(&["-f", dir.path().to_str().unwrap()]);
    assert_eq!(code, 2, "{out}");
    assert!(
        out.contains("error: spec.ackWait: \"30 seconds\" is not a duration"),
        "{out}"
    );
    assert!(
        out.contains(
            "not valid YAML, rest of file not read: did not find expected key at line 9 column 1"
        ),
        "{out}"
    );
    assert!(out.contains("Subscription default/fine ok"), "{out}");
    assert!(out.contains("3 checked, 2 refused"), "{out}");

    // The valid YAML alone: back to the verdicts' exit codes.
    std::fs::remove_file(&f).unwrap();
    let (code, out) = settle_check(&["-f", dir.path().to_str().unwrap()]);
    assert_eq!(code, 0, "{out}");
}

#[test]
fn paths_that_cannot_be_read_and_bad_flags_exit_2() {
    let (code, out) = settle_check(&["-f", "/nonexistent/settle"]);
    assert_eq!(code, 2, "{out}");
    assert!(
        out.contains("settle check: /nonexistent/settle: No such file or directory"),
        "{out}"
    );
    let (code, out) = settle_check(&["-f", "x.yaml", "--backend-kind", "kafka"]);
    assert_eq!(code, 2, "{out}");
    assert!(
        out.contains("unknown backend kind \"kafka\": expected one of nats, memory, sqs, rabbitmq"),
        "{out}"
    );
}

#[test]
fn an_empty_directory_exits_2_and_says_so() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("README.md"), "not a manifest").unwrap();
    let (code, out) = settle_check(&["-f", dir.path().to_str().unwrap()]);
    assert_eq!(code, 2, "{out}");
    assert!(
        out.contains(&format!(
            "settle check: {}: no .yaml or .yml files found",
            dir.path().display()
        )),
        "{out}"
    );
}

#[test]
fn yaml_without_settle_resources_exits_0_and_says_so() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("cm.yaml"),
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: unrelated}\n",
    )
    .unwrap();
    let (code, out) = settle_check(&["-f", dir.path().to_str().unwrap()]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("no Settle resources found"), "{out}");
    assert!(out.contains("0 checked, 0 refused"), "{out}");
}

#[test]
fn directories_are_searched_recursively() {
    let dir = tempfile::tempdir().unwrap();
    let deep = dir.path().join("team-a/prod/queues");
    std::fs::create_dir_all(&deep).unwrap();
    std::fs::write(
        deep.join("deep.yml"),
        "apiVersion: messaging.settle.dev/v1alpha1\nkind: Subscription\nmetadata: {name: deep, namespace: a}\nspec:\n  backendRef: {name: nats}\n  pattern: a\n  mode: AtLeastOnce\n",
    )
    .unwrap();
    let (code, out) = settle_check(&["-f", dir.path().to_str().unwrap()]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains(&format!(
            "{}#1: Subscription a/deep REFUSED",
            deep.join("deep.yml").display()
        )),
        "{out}"
    );
    assert!(out.contains("1 checked, 1 refused"), "{out}");
}

/// A Subscription whose Backend is not in the input: nats's capabilities, and it says so.
/// `maxNackDelay: 13h` tells nats (no limit) from sqs (12 h); a backoff tells it from rabbitmq.
const NO_BACKEND_IN_INPUT: &str = "apiVersion: messaging.settle.dev/v1alpha1\nkind: Subscription\nmetadata: {name: s, namespace: shop}\nspec:\n  backendRef: {name: elsewhere}\n  pattern: a\n  mode: AtLeastOnce\n  durableName: s\n  maxNackDelay: 13h\n  backoff: {initial: 1s, max: 1m}\n";

#[test]
fn the_default_backend_kind_is_nats() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("s.yaml");
    std::fs::write(&f, NO_BACKEND_IN_INPUT).unwrap();
    let (code, out) = settle_check(&["-f", f.to_str().unwrap()]);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("Subscription shop/s ok (backend: nats, Backend \"elsewhere\" not in input; assumed nats, pass --backend-kind to choose)"),
        "{out}"
    );
    for other in ["sqs", "rabbitmq"] {
        let (code, out) = settle_check(&["-f", f.to_str().unwrap(), "--backend-kind", other]);
        assert_eq!(code, 1, "{other} must refuse what nats admits: {out}");
    }
}

#[test]
fn settle_backend_kind_in_the_environment_stands_in_for_the_flag() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("s.yaml");
    std::fs::write(&f, NO_BACKEND_IN_INPUT).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_settle"))
        .args(["check", "-f", f.to_str().unwrap()])
        .env("SETTLE_BACKEND_KIND", "sqs")
        .output()
        .expect("settle runs");
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(
        text.contains("Subscription shop/s REFUSED (backend: sqs, --backend-kind)"),
        "{text}"
    );
    assert!(
        text.contains(
            "error: spec.maxNackDelay: 13h0m0s is longer than this backend can hold a message back"
        ),
        "{text}"
    );
}
