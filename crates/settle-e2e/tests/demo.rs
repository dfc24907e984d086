//! `make demo` from start to end, as a newcomer runs it: in an environment of its own (its own
//! kube-apiserver+etcd, nats-server, RabbitMQ and ElasticMQ, started by the demo itself), then
//! stopped with `hack/env.sh down`, which must leave nothing behind.

use settle_testkit as common;

use std::path::PathBuf;
use std::process::Command;

/// Stops the demo's environment however the test ends.
struct Down(PathBuf);

impl Drop for Down {
    fn drop(&mut self) {
        let _ = Command::new("bash")
            .args(["hack/env.sh", "down"])
            .current_dir(common::root())
            .env("SETTLE_ENV_DIR", &self.0)
            .output();
    }
}

#[test]
fn make_demo_tells_the_whole_story_and_env_down_stops_it() {
    let root = common::root();
    let dir = root.join(format!("target/demo-test-{}", std::process::id()));
    let down = Down(dir.clone());
    // The demo runs cargo: without the variables cargo set for this test, or it rebuilds the
    // TLS crates (common::process::without_cargo_test_env).
    let out = common::process::without_cargo_test_env(&mut Command::new("make"))
        .arg("demo")
        .current_dir(root)
        .env("SETTLE_ENV_DIR", &dir)
        // The demo writes and reads its own environment's kubeconfig.
        .env_remove("KUBECONFIG")
        .output()
        .expect("run make demo");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "make demo failed ({}):\n{stdout}\n{stderr}",
        out.status
    );
    // kubectl writes refusals to stderr.
    let flat: String = format!("{stdout}\n{stderr}")
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ");
    for (what, want) in [
        ("the consumers listed from NATS", "DEMO orders explicit 5"),
        (
            "an admission refusal naming the field",
            "denied the request",
        ),
        (
            "kubectl get subscriptions with the account's columns",
            "DELIVERED EXHAUSTED STRANDED",
        ),
        (
            "the account reached status",
            "exhausted/acked/silent/nacked: 20/280/10/100",
        ),
        (
            "the SQS Subscription's account reached status",
            "invoices exhausted/acked/silent/nacked: 3/27/3/9",
        ),
        (
            "kubectl describe of the SQS Subscription: Exhausted",
            "Exhausted: 3",
        ),
        ("kubectl describe: Exhausted", "Exhausted: 20"),
        ("kubectl describe: Acked", "Acked: 280"),
        ("kubectl describe: Nacked", "Nacked: 100"),
        ("kubectl describe: Silent", "Silent: 10"),
        ("kubectl describe: Delivered", "Delivered: 390"),
        ("the Exhausting condition", "Type: Exhausting"),
        ("its reason", "Reason: MessagesExhausted"),
        (
            "the metrics",
            "settle_subscription_exhausted_total{namespace=\"settle-demo\",subscription=\"orders\"} 20",
        ),
        (
            "kubectl settle status: the header",
            "NAME BACKEND READY DELIVERED ACKED NACKED SILENT EXHAUSTED STRANDED",
        ),
        (
            "kubectl settle status: the NATS Subscription's account",
            "orders nats True 390 280 100 10 20 0",
        ),
        ("what is still running", "Still running"),
        ("how to stop it", "make env-down"),
    ] {
        assert!(
            flat.contains(want),
            "the demo's output lacks {what} ({want:?}):\n{stdout}"
        );
    }

    // `kubectl settle status` runs once both accounts are whole: the SQS Subscription's row shows
    // the counts the demo waited for (acked, nacked, silent, exhausted, stranded), after them.
    let sqs_reached = stdout
        .find("invoices exhausted/acked/silent/nacked: 3/27/3/9")
        .expect("the SQS account reached status");
    let row = stdout[sqs_reached..]
        .lines()
        .find(|l| l.starts_with("invoices ") && l.contains(" sqs "))
        .unwrap_or_else(|| {
            panic!("kubectl settle status shows no invoices row after the SQS account was whole:\n{stdout}")
        });
    let cells: Vec<&str> = row.split_whitespace().collect();
    assert_eq!(
        cells.get(4..9),
        Some(&["27", "9", "3", "3", "0"][..]),
        "kubectl settle status's invoices row (ACKED NACKED SILENT EXHAUSTED STRANDED): {row}"
    );

    drop(down);
    assert!(
        !dir.exists(),
        "hack/env.sh down removes the demo's environment directory"
    );
}
