//! `settle operator` processes and their Lease: of two, exactly one reconciles (its metrics count
//! reconciles, the other's count none, sampled while the leader is busy), and when it is
//! SIGKILLed the other takes over and reconciles a new Subscription (how long that took is
//! printed: on a quiet machine about 10 s, the Lease's 10 s plus a second; the bound of the
//! takeover itself is tested in `leader_election.rs`); a leader whose Lease is taken
//! from it while it runs stops reconciling and stops writing the account to status, and resumes
//! both once the Lease is free again; so does one cut off from the API server in the middle of a
//! reconcile while another takes its Lease, once the partition heals.

use settle_testkit as common;

use std::time::{Duration, Instant};

use common::account::{NACK_SPEC, Scene, bodies};
use common::operator::{Operator, TestStream, poll};
use common::partition::Partition;
use common::subs::{apply, backend_yaml, sub_yaml, subs, wait_ready};
use common::{install_crds, kubectl_ok, namespace};
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::Api;
use kube::api::PostParams;

/// How long the test waits for the standby to take over and make a new Subscription Ready: far
/// past the 12 s the takeover takes at most, so that a loaded machine does not fail it; the
/// figure itself is printed, not asserted.
const TAKEOVER_WAIT: Duration = Duration::from_secs(60);

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
async fn of_two_operators_exactly_one_reconciles_and_the_other_takes_over_when_it_is_killed() {
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
    // Exactly one leads. A leader whose renewals the API server leaves unanswered for 6 s steps
    // down and takes the Lease again (seen under the whole of `make test`): wait that out.
    let deadline = Instant::now() + Duration::from_secs(30);
    let a_leads = loop {
        let (ga, gb) = (gauge(&a), gauge(&b));
        if ga + gb == 1.0 {
            break ga == 1.0;
        }
        assert!(
            Instant::now() < deadline,
            "exactly one of them leads within 30 s: a {ga}, b {gb}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    let (mut leader, standby) = if a_leads { (a, b) } else { (b, a) };
    assert_eq!(gauge(&leader), 1.0, "one of them leads");
    assert_eq!(gauge(&standby), 0.0);
    // A reconcile is counted when the controller hands its result on, which is after the
    // status it wrote (the `Ready` waited for above) is visible: waited for, not read once.
    let deadline = Instant::now() + Duration::from_secs(10);
    while reconciles(&leader) < 1.0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
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
    wait_ready_within(&api, "second", TAKEOVER_WAIT).await;
    println!(
        "a new Subscription Ready {:?} after the leader's SIGKILL",
        killed.elapsed()
    );
    // The status patch that made it Ready comes before the reconcile ends and is counted.
    poll(
        "the former standby to count its reconcile and lead",
        Duration::from_secs(10),
        || async {
            let (n, lead) = (reconciles(&standby), gauge(&standby));
            if n >= 1.0 && lead == 1.0 {
                Ok(())
            } else {
                Err(format!("settle_reconcile_total {n}, settle_leader {lead}"))
            }
        },
    )
    .await;

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
        &format!("Subscription {name} to be Ready after the takeover"),
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

/// How long the intruder's record holds the Lease (its `leaseDurationSeconds`): the operator may
/// take it back only once the record has stood unchanged this long by its own clock.
const INTRUDER_HOLDS: Duration = Duration::from_secs(15);

/// Writes `holder` into Lease `name` as a replica would: a replace guarded by the version read.
async fn take_lease(api: &Api<Lease>, name: &str, holder: &str, holds: Duration) {
    let start = Instant::now();
    loop {
        let mut lease = api.get(name).await.expect("the operator's Lease exists");
        let now = MicroTime(Timestamp::now());
        lease.spec = Some(LeaseSpec {
            holder_identity: Some(holder.into()),
            acquire_time: Some(now.clone()),
            renew_time: Some(now),
            lease_duration_seconds: Some(i32::try_from(holds.as_secs()).expect("seconds")),
            ..lease.spec.unwrap_or_default()
        });
        match api.replace(name, &PostParams::default(), &lease).await {
            Ok(_) => return,
            Err(kube::Error::Api(s)) if s.code == 409 => assert!(
                start.elapsed() < Duration::from_secs(10),
                "could not write {holder} into the Lease for 10s"
            ),
            Err(e) => panic!("writing {holder} into the Lease: {e}"),
        }
    }
}

/// What a leader's work shows: its counters, and the account's part of `orders`'s status.
#[derive(Debug, PartialEq)]
struct Work {
    reconciles: f64,
    consumer_ops: f64,
    status_writes: f64,
    account_writes: f64,
    stats: Option<settle::api::SubscriptionStats>,
    stats_updated_at: Option<String>,
}

async fn work_of(scene: &Scene) -> Work {
    let op = &scene.op;
    let [reconciles, consumer_ops, status_writes, account_writes] = work(op, "operator");
    let status = scene.sub().await.status.unwrap_or_default();
    Work {
        reconciles,
        consumer_ops,
        status_writes,
        account_writes,
        stats: status.stats,
        stats_updated_at: status.stats_updated_at.map(|t| t.0.to_string()),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_whose_lease_is_taken_stops_reconciling_and_writing_status_until_it_is_free_again()
{
    let lease = format!("rec-lost-{}", std::process::id());
    let flags = [
        "--leader-election=true",
        "--lease-name",
        lease.as_str(),
        "--stats-interval",
        "1s",
    ];
    let scene = Scene::build("rec-lost", NACK_SPEC, &flags, &[("POD_NAME", "op")], None).await;
    let leads = || scene.op.metric("settle_leader", &[]);
    assert_eq!(leads(), 1.0, "the only operator leads");
    let app = scene.app("nack");
    app.wait_ready().await;
    scene.publish(bodies(5)).await;
    scene
        .settled("five exhausted", Duration::from_secs(40), |s| {
            s.exhausted == 5 && s.settlement.nacked == 15 && s.delivered == 15
        })
        .await;
    assert!(
        scene
            .op
            .metric("settle_account_status_writes_total", &[("result", "ok")])
            >= 1.0,
        "the account wrote status while leading"
    );

    // An intruder takes the Lease, as another replica would.
    let leases: Api<Lease> = Api::namespaced(common::kube_client().await, &scene.ns);
    take_lease(&leases, &lease, "intruder", INTRUDER_HOLDS).await;
    let taken = Instant::now();
    poll(
        "the operator to step down after its Lease was taken",
        Duration::from_secs(10),
        || async {
            let v = leads();
            if v == 0.0 {
                Ok(())
            } else {
                Err(format!("settle_leader {v}"))
            }
        },
    )
    .await;
    println!(
        "stepped down {:.1}s after the Lease was taken",
        taken.elapsed().as_secs_f64()
    );
    // In-flight reconciles may finish; nothing starts after that.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let before = work_of(&scene).await;

    // Meanwhile: a new Subscription, and five more messages the application declines (the
    // account's counters would change: 15 more nacks, 5 more exhausted).
    let during = TestStream::new(&common::env().nats_url, "rec-lost-during").await;
    apply(
        &scene.ns,
        &sub_yaml(
            "during",
            &format!(
                "  pattern: \"{}.>\"\n  mode: AtLeastOnce\n  durableName: during\n",
                during.prefix
            ),
        ),
    );
    scene.publish(bodies(5)).await;
    // The intruder renews its record once, now, so the watch below covers the operator's whole
    // wait however long the steps above took on a loaded machine (they once left 4.9 s of it).
    // Watch until shortly before the operator could take that record back (it may do so
    // INTRUDER_HOLDS after it first read it, which was after `renewed`).
    take_lease(&leases, &lease, "intruder", INTRUDER_HOLDS).await;
    let renewed = Instant::now();
    let watch_until = renewed + INTRUDER_HOLDS - Duration::from_secs(2);
    let (mut samples, first) = (0, Instant::now());
    while Instant::now() < watch_until {
        assert_eq!(
            leads(),
            0.0,
            "the operator led again before the intruder's Lease expired"
        );
        let now = work_of(&scene).await;
        assert_eq!(
            now, before,
            "sample {samples}: the operator worked (reconciled, or wrote status) without the Lease"
        );
        samples += 1;
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    // What matters is how long the operator was seen idle, not how many looks a loaded machine
    // could take meanwhile (each one asks the API server and the metrics endpoint).
    let watched = first.elapsed();
    assert!(
        samples >= 2 && watched >= Duration::from_secs(5),
        "{samples} samples over {watched:?}: the watch must cover most of the intruder's hold"
    );
    let api = &scene.api;
    let d = api.get("during").await.expect("get during");
    assert!(
        d.status
            .is_none_or(|s| s.observed_generation.is_none() && s.conditions.is_empty()),
        "a Subscription applied while the operator did not lead got a status"
    );
    assert!(
        during.consumer("during").await.is_none(),
        "a Subscription applied while the operator did not lead got a consumer"
    );
    assert_eq!(
        scene.stats().await,
        before.stats.clone().map(|s| s.counters).unwrap_or_default(),
        "the account's counters in status moved without the Lease"
    );

    // The intruder never renews: the operator takes its expired record back and resumes both.
    poll(
        "the operator to take the intruder's expired Lease back",
        INTRUDER_HOLDS + Duration::from_secs(10),
        || async {
            let v = leads();
            if v == 1.0 {
                Ok(())
            } else {
                Err(format!("settle_leader {v}"))
            }
        },
    )
    .await;
    println!(
        "led again {:.1}s after the Lease was taken",
        taken.elapsed().as_secs_f64()
    );
    wait_ready(api, "during").await;
    assert!(
        during.consumer("during").await.is_some(),
        "the Subscription applied meanwhile has its consumer"
    );
    let s = scene
        .settled(
            "all ten exhausted once the operator leads again",
            Duration::from_secs(60),
            |s| s.exhausted >= 10 && s.settlement.nacked >= 30,
        )
        .await;
    assert_eq!((s.exhausted, s.settlement.nacked), (10, 30), "{s:?}");
    let after = work_of(&scene).await;
    assert!(after.reconciles > before.reconciles, "{after:?}");
    assert!(after.account_writes > before.account_writes, "{after:?}");
    let spec = leases
        .get(&lease)
        .await
        .expect("the Lease")
        .spec
        .unwrap_or_default();
    assert_eq!(spec.holder_identity.as_deref(), Some("op"));
    scene.assert_never_decreased();
    drop(app);
    kubectl_ok(&["delete", "subscriptions", "--all", "-n", &scene.ns], None);
    during.delete().await;
    scene.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_cut_off_mid_reconcile_whose_lease_is_taken_writes_no_status_after_the_partition_heals()
 {
    // The operator reaches the API server only through a forwarder the test can make hang.
    let partition = Partition::to_api_server().await;
    let kubeconfig = partition.kubeconfig("rec-cut");
    let kubeconfig = kubeconfig.to_str().expect("a UTF-8 path");
    let lease = format!("rec-cut-{}", std::process::id());
    let flags = [
        "--leader-election=true",
        "--lease-name",
        lease.as_str(),
        "--stats-interval",
        "1s",
    ];
    let env = [("POD_NAME", "op"), ("KUBECONFIG", kubeconfig)];
    let scene = Scene::build("rec-cut", NACK_SPEC, &flags, &env, None).await;
    let leads = || scene.op.metric("settle_leader", &[]);
    assert_eq!(leads(), 1.0, "the only operator leads");
    let app = scene.app("nack");
    app.wait_ready().await;
    scene.publish(bodies(5)).await;
    scene
        .settled("five exhausted", Duration::from_secs(40), |s| {
            s.exhausted == 5 && s.settlement.nacked == 15 && s.delivered == 15
        })
        .await;
    let drift = TestStream::new(&common::env().nats_url, "rec-cut-drift").await;
    apply(
        &scene.ns,
        &sub_yaml(
            "drift",
            &format!(
                "  pattern: \"{}.>\"\n  mode: AtLeastOnce\n  durableName: drift\n",
                drift.prefix
            ),
        ),
    );
    wait_ready(&scene.api, "drift").await;

    // Cut off; an intruder takes the Lease (the test's own client reaches the API server); a
    // consumer deleted on the broker starts a reconcile that hangs on its status write.
    partition.pause(true);
    let leases: Api<Lease> = Api::namespaced(common::kube_client().await, &scene.ns);
    take_lease(&leases, &lease, "intruder", INTRUDER_HOLDS).await;
    settle::backend::nats::admin::delete_consumer(&drift.js, &drift.name, "drift")
        .await
        .expect("delete the consumer on the broker");
    let cut = Instant::now();
    poll(
        "the operator cut off to step down",
        Duration::from_secs(10),
        || async {
            let v = leads();
            if v == 0.0 {
                Ok(())
            } else {
                Err(format!("settle_leader {v}"))
            }
        },
    )
    .await;
    println!(
        "stepped down {:.1}s after the partition",
        cut.elapsed().as_secs_f64()
    );
    let before = work_of(&scene).await;
    // Longer than the operator waits for in-flight reconciles (10 s) at the end of a term.
    tokio::time::sleep(Duration::from_secs(12)).await;
    assert_eq!(work_of(&scene).await, before, "work while cut off");

    // The partition heals while the intruder's record stands: five more messages are nacked,
    // and nothing of the former term may write them to status.
    partition.pause(false);
    let healed = Instant::now();
    scene.publish(bodies(5)).await;
    let mut samples = 0;
    while healed.elapsed() < Duration::from_secs(10) {
        assert_eq!(
            leads(),
            0.0,
            "the operator led again while the intruder holds the Lease"
        );
        assert_eq!(
            work_of(&scene).await,
            before,
            "sample {samples}: the operator worked (reconciled, or wrote status) after the partition healed, without the Lease"
        );
        samples += 1;
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert!(samples >= 5, "{samples} samples");

    // The record expires: the operator leads and accounts again, and repairs the consumer.
    poll(
        "the operator to take the intruder's expired Lease",
        INTRUDER_HOLDS + Duration::from_secs(10),
        || async {
            let v = leads();
            if v == 1.0 {
                Ok(())
            } else {
                Err(format!("settle_leader {v}"))
            }
        },
    )
    .await;
    let s = scene
        .settled(
            "all ten exhausted once the operator leads again",
            Duration::from_secs(60),
            |s| s.exhausted >= 10 && s.settlement.nacked >= 30,
        )
        .await;
    assert_eq!((s.exhausted, s.settlement.nacked), (10, 30), "{s:?}");
    poll(
        "the consumer deleted on the broker to be made again",
        Duration::from_secs(30),
        || async {
            match drift.consumer("drift").await {
                Some(_) => Ok(()),
                None => Err("none".to_string()),
            }
        },
    )
    .await;
    scene.assert_never_decreased();
    drop(app);
    kubectl_ok(&["delete", "subscriptions", "--all", "-n", &scene.ns], None);
    drift.delete().await;
    let _ = std::fs::remove_file(kubeconfig);
    scene.finish().await;
}
