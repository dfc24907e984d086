//! The controllers through faults, against the real API server and real nats-servers, `settle
//! operator` running as a process: a consumer deleted or edited on the broker is restored (and an
//! Event says so), a broker stopped for 10 s is re-converged with no operator restart, a
//! Subscription deleted while the broker is down waits and then completes, an operator killed
//! midway through 200 Subscriptions converges them all after a restart with no duplicate or orphan
//! consumer, a steady state costs no consumer update and no status write (the controllers' nor
//! the account's), the resync looks at every Ready Subscription once an interval, and a deleted
//! Backend whose broker is cut off goes after its grace, saying what its Subscriptions leave.

use settle_testkit as common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::operator::{NatsServer, Operator, TestStream, condition, poll};
use common::subs::{
    apply, backend_yaml, sub_yaml, subs, wait_condition, wait_event, wait_gone, wait_ready,
};
use common::{install_crds, kubectl_ok, namespace};
use kube::api::{DeleteParams, ListParams};
use settle::backend::nats::{admin, mapping};
use settle::policy::ResolvedPolicy;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_deleted_or_edited_on_the_broker_is_restored_and_an_event_says_so() {
    install_crds();
    let ns = namespace("rec-drift");
    let env = common::env();
    let stream = TestStream::new(&env.nats_url, "drift").await;
    let op = Operator::start("drift", &ns);
    apply(&ns, &backend_yaml("nats", &env.nats_url));
    let api = subs(&ns).await;
    apply(
        &ns,
        &sub_yaml(
            "orders",
            &format!(
                "  pattern: \"{}.>\"\n  mode: AtLeastOnce\n  durableName: orders\n  maxDeliver: 5\n",
                stream.prefix
            ),
        ),
    );
    let sub = wait_ready(&api, "orders").await;
    let first = stream.consumer("orders").await.expect("made").created;

    // Deleted with a NATS client: made again, and an Event says so.
    let start = Instant::now();
    admin::delete_consumer(&stream.js, &stream.name, "orders")
        .await
        .expect("delete on the broker");
    poll(
        "the consumer to be recreated",
        Duration::from_secs(30),
        || async {
            match stream.consumer("orders").await {
                Some(i) if i.created != first => Ok(()),
                other => Err(format!("{:?}", other.map(|i| i.created))),
            }
        },
    )
    .await;
    println!("recreated {:?} after its deletion", start.elapsed());
    let note = wait_event(&ns, "orders", "Recreated").await;
    assert!(note.contains("missing from the broker"), "{note}");
    assert_eq!(
        op.metric("settle_consumer_operations_total", &[("op", "recreate")]),
        1.0
    );

    // Edited with a NATS client: put back.
    let mut edited = mapping::desired(
        &ns,
        "orders",
        &stream.name,
        &ResolvedPolicy::resolve(&sub.spec.policy),
    );
    edited.max_deliver = 99;
    edited.max_ack_pending = 3;
    let start = Instant::now();
    admin::update_consumer(&stream.js, &edited)
        .await
        .expect("edit on the broker");
    poll("the edit to be undone", Duration::from_secs(30), || async {
        let c = stream.consumer("orders").await.ok_or("gone")?.config;
        if c.max_deliver == 5 && c.max_ack_pending == 250 {
            Ok(())
        } else {
            Err(format!(
                "max_deliver {}, max_ack_pending {}",
                c.max_deliver, c.max_ack_pending
            ))
        }
    })
    .await;
    println!("edit undone {:?} after it was made", start.elapsed());
    wait_event(&ns, "orders", "Updated").await;

    kubectl_ok(&["delete", "subscriptions", "--all", "-n", &ns], None);
    stream.delete().await;
    kubectl_ok(&["delete", "namespace", &ns, "--wait=false"], None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_stopped_for_ten_seconds_is_reconverged_and_a_deletion_waits_for_it() {
    install_crds();
    let ns = namespace("rec-restart");
    let mut server = NatsServer::start(&[]);
    let stream = TestStream::new(&server.url(), "restart").await;
    let mut op = Operator::start("restart", &ns);
    let pid = op.pid();
    apply(&ns, &backend_yaml("nats", &server.url()));
    let api = subs(&ns).await;
    for name in ["orders", "doomed"] {
        apply(
            &ns,
            &sub_yaml(
                name,
                &format!(
                    "  pattern: \"{}.{name}.>\"\n  mode: AtLeastOnce\n  durableName: {name}\n",
                    stream.prefix
                ),
            ),
        );
        wait_ready(&api, name).await;
    }

    // Down for 10 s: Ready goes False (Unreachable); a deletion waits.
    server.stop();
    let down = Instant::now();
    wait_condition(
        &api,
        "orders",
        "Ready",
        "False",
        "Unreachable",
        Duration::from_secs(30),
    )
    .await;
    api.delete("doomed", &DeleteParams::default())
        .await
        .expect("delete");
    tokio::time::sleep(Duration::from_secs(10).saturating_sub(down.elapsed())).await;
    let waiting = api.get_opt("doomed").await.expect("get");
    assert!(
        waiting.is_some_and(|s| s.metadata.deletion_timestamp.is_some()),
        "a deletion waits while the broker is down"
    );

    // Back, same port and store: Ready again, the deletion completes, the same operator process.
    server.resume();
    let back = Instant::now();
    wait_ready(&api, "orders").await;
    println!(
        "Ready again {:?} after the broker came back",
        back.elapsed()
    );
    wait_gone(&api, "doomed", Duration::from_secs(60)).await;
    // A fresh client: the test's own one may still be reconnecting.
    let again = TestStream {
        js: async_nats::jetstream::new(async_nats::connect(server.url()).await.expect("connect")),
        name: stream.name.clone(),
        prefix: String::new(),
    };
    assert_eq!(
        again.consumer_names().await,
        vec!["orders"],
        "the deleted one's consumer is gone"
    );
    assert!(op.alive(), "the operator was not restarted");
    assert_eq!(op.pid(), pid);
    kubectl_ok(&["delete", "subscriptions", "--all", "-n", &ns], None);
    kubectl_ok(&["delete", "namespace", &ns, "--wait=false"], None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_killed_midway_through_200_subscriptions_converges_them_all_after_a_restart() {
    install_crds();
    let ns = namespace("rec-kill");
    let env = common::env();
    let stream = TestStream::new(&env.nats_url, "kill").await;
    let mut op = Operator::start("kill", &ns);
    apply(&ns, &backend_yaml("nats", &env.nats_url));
    const N: usize = 200;
    let mut all = String::new();
    for i in 0..N {
        all.push_str("---\n");
        all.push_str(&sub_yaml(
            &format!("s{i}"),
            &format!(
                "  pattern: \"{}.s{i}.>\"\n  mode: AtLeastOnce\n  durableName: d{i}\n",
                stream.prefix
            ),
        ));
    }
    let file = common::root().join(format!("target/reconcile-kill-{}.yaml", std::process::id()));
    std::fs::write(&file, &all).expect("write manifests");
    let kubectl = Command::new("kubectl")
        .arg("--kubeconfig")
        .arg(&env.kubeconfig)
        .args(["apply", "-n", &ns, "-f"])
        .arg(&file)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("kubectl apply");

    // Killed once some consumers exist and while the apply still runs.
    poll(
        "the operator to create some consumers",
        Duration::from_secs(60),
        || async {
            let n = op.metric("settle_consumer_operations_total", &[("op", "create")]);
            if n >= 20.0 {
                Ok(())
            } else {
                Err(format!("{n} created"))
            }
        },
    )
    .await;
    op.kill9();
    let made_before = stream.consumer_names().await.len();
    println!("killed after {made_before} consumers");
    let out = kubectl.wait_with_output().expect("kubectl ran");
    assert!(
        out.status.success(),
        "kubectl apply: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        made_before < N,
        "the kill came midway ({made_before} of {N} made)"
    );

    let _op = Operator::start("kill-again", &ns);
    let api = subs(&ns).await;
    poll(
        "all 200 Subscriptions to be Ready",
        Duration::from_secs(180),
        || async {
            let list = api
                .list(&ListParams::default())
                .await
                .map_err(|e| e.to_string())?;
            let ready = list
                .items
                .iter()
                .filter(|s| {
                    s.status
                        .as_ref()
                        .and_then(|st| condition(&st.conditions, "Ready"))
                        .is_some_and(|c| c.0 == "True")
                })
                .count();
            if ready == N {
                Ok(())
            } else {
                Err(format!("{ready} of {} Ready", list.items.len()))
            }
        },
    )
    .await;
    let mut want: Vec<String> = (0..N).map(|i| format!("d{i}")).collect();
    want.sort();
    assert_eq!(
        stream.consumer_names().await,
        want,
        "exactly one consumer per Subscription"
    );
    let _ = std::fs::remove_file(&file);
    kubectl_ok(
        &[
            "delete",
            "subscriptions",
            "--all",
            "-n",
            &ns,
            "--wait=false",
        ],
        None,
    );
    stream.delete().await;
    kubectl_ok(&["delete", "namespace", &ns, "--wait=false"], None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_steady_state_costs_no_consumer_update_and_no_status_write_for_a_minute() {
    install_crds();
    let ns = namespace("rec-steady");
    let env = common::env();
    let stream = TestStream::new(&env.nats_url, "steady").await;
    let op = Operator::start("steady", &ns);
    apply(&ns, &backend_yaml("nats", &env.nats_url));
    let api = subs(&ns).await;
    for i in 0..20 {
        apply(
            &ns,
            &sub_yaml(
                &format!("s{i}"),
                &format!(
                    "  pattern: \"{}.s{i}.>\"\n  mode: AtLeastOnce\n  durableName: d{i}\n  maxDeliver: 3\n",
                    stream.prefix
                ),
            ),
        );
    }
    for i in 0..20 {
        wait_ready(&api, &format!("s{i}")).await;
    }
    // The account shows each Subscription once (its first stats), then only what changes.
    poll(
        "the account to show every Subscription's stats in status",
        Duration::from_secs(40),
        || async {
            let list = api
                .list(&ListParams::default())
                .await
                .map_err(|e| e.to_string())?;
            let shown = list
                .items
                .iter()
                .filter(|s| s.status.as_ref().is_some_and(|st| st.stats.is_some()))
                .count();
            if shown == 20 {
                Ok(())
            } else {
                Err(format!("{shown} of 20"))
            }
        },
    )
    .await;
    // Let the last triggers (advisories, the Backend's status) run out.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let snapshot = || {
        assert!(
            op.exports("settle_account_status_writes_total"),
            "the operator exports the account's status writes"
        );
        (
            op.metric("settle_consumer_operations_total", &[]),
            op.metric("settle_status_writes_total", &[]),
            op.metric("settle_reconcile_total", &[]),
            op.metric("settle_account_status_writes_total", &[]),
        )
    };
    let before = snapshot();
    assert_eq!(before.0, 20.0, "one create per Subscription");
    assert!(
        before.3 >= 20.0,
        "the account wrote each Subscription's stats: {before:?}"
    );
    tokio::time::sleep(Duration::from_secs(60)).await;
    let after = snapshot();
    println!(
        "steady minute: before {before:?}, after {after:?} (ops, status writes, reconciles, account writes)"
    );
    assert_eq!(
        after.0, before.0,
        "no consumer operation in a steady minute"
    );
    assert_eq!(after.1, before.1, "no status write in a steady minute");
    assert_eq!(
        after.3, before.3,
        "no status write of the account in a steady minute (it writes only what changed)"
    );
    kubectl_ok(&["delete", "subscriptions", "--all", "-n", &ns], None);
    stream.delete().await;
    kubectl_ok(&["delete", "namespace", &ns, "--wait=false"], None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_ready_subscription_is_looked_at_again_each_resync_interval_at_no_cost() {
    install_crds();
    let ns = namespace("rec-resync");
    let env = common::env();
    let stream = TestStream::new(&env.nats_url, "resync").await;
    let op = Operator::start_with(
        "resync",
        &ns,
        &["--leader-election=false", "--resync-interval", "3s"],
    );
    apply(&ns, &backend_yaml("nats", &env.nats_url));
    let api = subs(&ns).await;
    let n = 10;
    for i in 0..n {
        apply(
            &ns,
            &sub_yaml(
                &format!("s{i}"),
                &format!("  pattern: \"{}.s{i}.>\"\n", stream.prefix),
            ),
        );
    }
    for i in 0..n {
        wait_ready(&api, &format!("s{i}")).await;
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    let snapshot = || {
        (
            op.metric(
                "settle_reconcile_total",
                &[("controller", "subscription"), ("result", "ok")],
            ),
            op.metric("settle_consumer_operations_total", &[]),
            op.metric(
                "settle_status_writes_total",
                &[("controller", "subscription")],
            ),
        )
    };
    let before = snapshot();
    // Three intervals: each Ready Subscription looked at about three times (one walk may be
    // cut at either end), spread over each interval, not requeued one by one.
    tokio::time::sleep(Duration::from_secs(9)).await;
    let after = snapshot();
    let looks = after.0 - before.0;
    println!("resync: {looks} reconciles of {n} Ready Subscriptions in 9 s (interval 3 s)");
    assert!(
        looks >= (2 * n) as f64 && looks <= (4 * n) as f64,
        "each of {n} Subscriptions about three times in three intervals, not {looks}"
    );
    assert_eq!(
        after.1, before.1,
        "a resync of a converged consumer changes nothing"
    );
    assert_eq!(after.2, before.2, "and writes no status");
    kubectl_ok(&["delete", "subscriptions", "--all", "-n", &ns], None);
    stream.delete().await;
    kubectl_ok(&["delete", "namespace", &ns, "--wait=false"], None);
}

/// A consumer deleted on the broker before the status naming it reached the controller (here:
/// the API server refuses that status, a ValidatingAdmissionPolicy) is made again and said
/// `Recreated`, not `Created`: the connection remembers what it made in the last 30 s, so a
/// loss is never hidden behind a first making.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_deleted_before_its_status_named_it_is_said_recreated() {
    install_crds();
    let ns = namespace("rec-early-drift");
    let env = common::env();
    let stream = TestStream::new(&env.nats_url, "early-drift").await;
    let _op = Operator::start("early-drift", &ns);
    apply(&ns, &backend_yaml("nats", &env.nats_url));
    let _gate = common::subs::StatusGate::close(&ns, "orders").await;
    apply(
        &ns,
        &sub_yaml(
            "orders",
            &format!(
                "  pattern: \"{}.>\"\n  mode: AtLeastOnce\n  durableName: orders\n  maxDeliver: 5\n",
                stream.prefix
            ),
        ),
    );
    let first = poll("the consumer made", Duration::from_secs(30), || async {
        stream
            .consumer("orders")
            .await
            .map(|i| i.created)
            .ok_or_else(|| "not yet".to_string())
    })
    .await;
    let api = subs(&ns).await;
    let status = api
        .get("orders")
        .await
        .expect("get")
        .status
        .unwrap_or_default();
    assert!(
        status.consumer.is_none(),
        "the gate keeps the consumer out of status: {status:?}"
    );
    admin::delete_consumer(&stream.js, &stream.name, "orders")
        .await
        .expect("delete on the broker");
    poll(
        "the consumer made again",
        Duration::from_secs(30),
        || async {
            match stream.consumer("orders").await {
                Some(i) if i.created != first => Ok(()),
                other => Err(format!("{:?}", other.map(|i| i.created))),
            }
        },
    )
    .await;
    let note = wait_event(&ns, "orders", "Recreated").await;
    assert!(note.contains("missing from the broker"), "{note}");
    kubectl_ok(&["delete", "namespace", &ns, "--wait=false"], None);
}

/// A deleted Backend whose broker stopped answering waits for its Subscriptions at most
/// `--backend-deletion-grace`; then it goes with a Warning naming them, and each of them says
/// what it leaves on the broker (Event `LeftOnBroker`, `settle_consumers_left_total`): no
/// deletion blocks for good, and nothing is left unsaid.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_backend_whose_broker_is_cut_off_goes_after_its_grace_saying_what_is_left() {
    install_crds();
    let ns = namespace("rec-grace");
    let env = common::env();
    let stream = TestStream::new(&env.nats_url, "grace").await;
    let upstream = env
        .nats_url
        .trim_start_matches("nats://")
        .parse()
        .expect("host:port");
    let cut = common::partition::Partition::to(upstream).await;
    let op = Operator::start_with(
        "grace",
        &ns,
        &["--leader-election=false", "--backend-deletion-grace=5s"],
    );
    apply(
        &ns,
        &backend_yaml("nats", &format!("nats://127.0.0.1:{}", cut.port)),
    );
    let api = subs(&ns).await;
    apply(
        &ns,
        &sub_yaml(
            "stuck",
            &format!(
                "  pattern: \"{}.stuck.>\"\n  mode: AtLeastOnce\n  durableName: stuck\n",
                stream.prefix
            ),
        ),
    );
    wait_ready(&api, "stuck").await;

    // The broker stops answering the operator; the Subscription, then its Backend, are deleted.
    cut.pause(true);
    api.delete("stuck", &DeleteParams::default())
        .await
        .expect("delete the Subscription");
    common::subs::backends(&ns)
        .await
        .delete("nats", &DeleteParams::default())
        .await
        .expect("delete the Backend");
    let warning = wait_event(&ns, "nats", "DeletionGraceOver").await;
    assert!(
        warning.contains("within --backend-deletion-grace (5s)") && warning.contains("stuck"),
        "{warning}"
    );
    wait_gone(&api, "stuck", Duration::from_secs(60)).await;
    let left = wait_event(&ns, "stuck", "LeftOnBroker").await;
    assert!(
        left.contains("consumer stuck on stream") && left.contains("stays on the broker"),
        "{left}"
    );
    assert_eq!(op.metric("settle_consumers_left_total", &[]), 1.0);
    assert!(
        stream.consumer("stuck").await.is_some(),
        "the consumer is left, as said"
    );
    stream.delete().await;
    kubectl_ok(&["delete", "namespace", &ns, "--wait=false"], None);
}
