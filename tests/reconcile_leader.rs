//! Two `settle operator` processes contending for one Lease: exactly one reconciles (its metrics
//! count reconciles, the other's count none, sampled while the leader is busy, and both export
//! them), and when it is SIGKILLed the other reconciles a new Subscription within 15 s.

mod common;

use std::time::{Duration, Instant};

use common::operator::{Operator, TestStream, poll};
use common::subs::{apply, backend_yaml, sub_yaml, subs, wait_ready};
use common::{install_crds, kubectl_ok, namespace};

/// The product's promise: a standby leads (and so reconciles) within this long of the leader's death.
const TAKEOVER: Duration = Duration::from_secs(15);

/// The counters of work that a replica which does not lead must keep at 0, and must export (a
/// missing metric reads as 0 too).
const WORK: [&str; 4] = [
    "settle_reconcile_total",
    "settle_consumer_operations_total",
    "settle_status_writes_total",
    "settle_account_status_writes_total",
];

fn reconciles(op: &Operator) -> f64 {
    op.metric("settle_reconcile_total", &[("controller", "subscription")])
}

/// Every counter of [`WORK`], asserting that `op` exports each.
fn work(op: &Operator, who: &str) -> [f64; 4] {
    WORK.map(|name| {
        assert!(op.exports(name), "the {who} does not export {name} at all");
        op.metric(name, &[])
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn of_two_operators_exactly_one_reconciles_and_the_other_takes_over_within_15s() {
    install_crds();
    let ns = namespace("rec-leader");
    let env = common::env();
    let stream = TestStream::new(&env.nats_url, "leader").await;
    let flags = ["--leader-election=true", "--lease-name", "rec-leader"];
    let a = Operator::spawn_env("leader-a", &ns, &flags, &[("POD_NAME", "a")]);
    let b = Operator::spawn_env("leader-b", &ns, &flags, &[("POD_NAME", "b")]);
    a.wait_ready();
    b.wait_ready();
    apply(&ns, &backend_yaml("nats", &env.nats_url));
    let api = subs(&ns).await;
    let spec = |name: &str| {
        sub_yaml(
            name,
            &format!(
                "  pattern: \"{}.{name}.>\"\n  mode: AtLeastOnce\n  durableName: {name}\n",
                stream.prefix
            ),
        )
    };
    apply(&ns, &spec("first"));
    wait_ready(&api, "first").await;

    let gauge = |op: &Operator| op.metric("settle_leader", &[]);
    let (mut leader, standby) = if gauge(&a) == 1.0 { (a, b) } else { (b, a) };
    assert_eq!(gauge(&leader), 1.0, "one of them leads");
    assert_eq!(gauge(&standby), 0.0);
    assert!(reconciles(&leader) >= 1.0, "the leader reconciled");
    assert_eq!(reconciles(&standby), 0.0, "the standby reconciled nothing");
    assert_eq!(
        standby.metric("settle_consumer_operations_total", &[]),
        0.0,
        "the standby touched no consumer"
    );
    // Both export the counters (so the standby's 0 is a 0), and the standby's stay at 0 at
    // every sample while the leader reconciles five more Subscriptions.
    work(&leader, "leader");
    let busy_from = reconciles(&leader);
    for i in 0..5 {
        apply(&ns, &spec(&format!("busy{i}")));
    }
    let sampling = Instant::now();
    let mut samples = 0;
    while sampling.elapsed() < Duration::from_secs(5) {
        assert_eq!(
            work(&standby, "standby"),
            [0.0; 4],
            "sample {samples}: the standby did work ({WORK:?})"
        );
        samples += 1;
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    for i in 0..5 {
        wait_ready(&api, &format!("busy{i}")).await;
    }
    assert!(
        reconciles(&leader) >= busy_from + 5.0,
        "the leader was busy while the standby was sampled: {busy_from} then {}",
        reconciles(&leader)
    );
    assert!(samples >= 5, "{samples} samples");
    assert_eq!(work(&standby, "standby"), [0.0; 4], "after the busy spell");

    leader.kill9();
    let killed = Instant::now();
    apply(&ns, &spec("second"));
    wait_ready_within(&api, "second", TAKEOVER.saturating_sub(killed.elapsed())).await;
    println!(
        "a new Subscription Ready {:?} after the leader's SIGKILL",
        killed.elapsed()
    );
    assert!(
        reconciles(&standby) >= 1.0,
        "the former standby reconciles now"
    );
    assert_eq!(gauge(&standby), 1.0);

    kubectl_ok(&["delete", "subscriptions", "--all", "-n", &ns], None);
    stream.delete().await;
    kubectl_ok(&["delete", "namespace", &ns, "--wait=false"], None);
}

async fn wait_ready_within(
    api: &kube::Api<settle::api::Subscription>,
    name: &str,
    limit: Duration,
) {
    poll(
        &format!("Subscription {name} to be Ready within the takeover promise"),
        limit,
        || async {
            let s = api.get(name).await.map_err(|e| e.to_string())?;
            let ready = s
                .status
                .as_ref()
                .and_then(|st| common::operator::condition(&st.conditions, "Ready"));
            match ready {
                Some((st, ..)) if st == "True" => Ok(()),
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await;
    wait_ready(api, name).await;
}
