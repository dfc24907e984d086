//! Settle as pods on the real node (`hack/env.sh up --node`): installed with `helm install` as a
//! user does, then operated through day two. One flow, in the order a platform team lives it,
//! because every step stands on the install before it:
//!
//! 1. the images `hack/image.sh build` makes (or brings up to date: a no-op after `make image`),
//!    imported into the node's containerd; brokers of the suite's own on the bridge address (a
//!    plain nats-server with JetStream, and one over TLS);
//! 2. `helm install --wait` of charts/settle with the chart's default image: 2 replicas Ready on
//!    the node; the webhook registered by `service:` with the operator's own CA;
//! 3. an invalid Subscription denied through that webhook; a Backend and Subscriptions whose
//!    consumers the operator pod makes; a NATS Backend over TLS with its CA from a Secret Ready on
//!    the chart's read-only root filesystem; the example application as a pod, its counters in
//!    status, and the Go runtime's example beside it on the same Subscription, one account;
//! 4. the leader pod deleted: the other replica leads within the Lease's bound and reconciles,
//!    and no `kubectl apply` is refused meanwhile; evictions respect the PodDisruptionBudget;
//! 5. `helm upgrade` to a new image under traffic (a prober publishing and the application
//!    consuming): every message acked, nothing lost, no admission refused;
//! 6. `kubectl rollout restart` of the application under traffic: the account holds, and the
//!    application's graceful stop ran;
//! 7. `kubectl delete namespace` of the team: every consumer of its Subscriptions is deleted, in
//!    whatever order the namespace controller deletes its Backends and Subscriptions;
//! 8. `helm uninstall`: nothing of the release is left but the CRDs.
//!
//! It prints the figures of the run (pods, failover time, prober counts, durations). Without the
//! node it fails, saying how to start it. It leaves the node as it found it (and cleans what an
//! interrupted run left before it starts).

use settle_testkit as common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::image::image_archive;
use common::node::{BridgeNats, LogFollower, Node, archive_reference};
use common::operator::{condition, poll};
use common::subs::{backend_yaml, nats_backend_yaml, nats_tls, sub_yaml_on};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use serde_json::{Value, json};
use settle::api::{Backend, ConsumerStats, Subscription};

const RELEASE: &str = "settle";
const SYSTEM: &str = "settle-system";
/// The namespace of the team's Backends, Subscriptions and application.
const TEAM: &str = "pods-team";
const LEASE: &str = "settle-operator";
const WEBHOOK: &str = "subscriptions.messaging.settle.dev";
const SELECTOR: &str = "app.kubernetes.io/name=settle,app.kubernetes.io/instance=settle";

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn settle_installs_with_helm_on_a_real_node_and_lives_through_day_two() {
    let started = Instant::now();
    let node = Node::from_env();
    step("clean what an interrupted run left");
    clean(&node);

    step("images into the node's containerd, brokers on the bridge");
    let operator_archive = image_archive("settle");
    let example_archive = image_archive("example");
    let go_archive = image_archive("example-go");
    let operator_image = archive_reference(&operator_archive);
    let example_image = archive_reference(&example_archive);
    let go_image = archive_reference(&go_archive);
    let chart_default = chart_default_image();
    assert_eq!(
        operator_image, chart_default,
        "the operator image is the chart's default image"
    );
    node.import_image(&operator_archive);
    node.import_image(&example_archive);
    node.import_image(&go_archive);
    assert!(
        node.has_image(&operator_image)
            && node.has_image(&example_image)
            && node.has_image(&go_image)
    );
    let nats = BridgeNats::start(&node, "plain", &[]);
    let tls_dir = tempfile::tempdir().expect("tempdir");
    let (ca_pem, tls_args) = common::nats_tls_files(tls_dir.path(), &node.ip);
    let tls_args: Vec<&str> = tls_args.iter().map(String::as_str).collect();
    let tls_nats = BridgeNats::start(&node, "tls", &tls_args);
    let js = async_nats::jetstream::new(
        async_nats::connect(nats.url())
            .await
            .unwrap_or_else(|e| panic!("connect to {}: {e}", nats.url())),
    );
    for (stream, subjects) in [("ORDERS", "orders.>"), ("PROBER", "prober.>")] {
        js.create_stream(async_nats::jetstream::stream::Config {
            name: stream.into(),
            subjects: vec![subjects.into()],
            storage: async_nats::jetstream::stream::StorageType::File,
            duplicate_window: Duration::from_secs(600),
            ..Default::default()
        })
        .await
        .expect("create stream");
    }

    let mut figures = Figures::default();
    let client = node.client().await;
    install(&node, &mut figures);
    webhook_by_service_with_the_operators_ca(&node);
    invalid_subscription_denied_through_the_service(&node);
    consumers_made_by_the_operator_pod(&node, &client, &js, &nats).await;
    tls_backend_ready_on_a_read_only_root(&node, &client, &tls_nats, &ca_pem).await;
    let prober = Arc::new(Prober::new(&node, &client, &js, &nats, &example_image).await);
    prober.go_beside_rust(&node, &nats, &go_image).await;
    leader_failover(&node, &client, &js, &mut figures).await;
    evictions_respect_the_pdb(&node, &client).await;
    upgrade_under_traffic(&node, &prober, &operator_image, &mut figures).await;
    app_rollout_restart_under_traffic(&node, &prober, &mut figures).await;
    namespace_deletion_deletes_the_consumers(&node, &js).await;
    uninstall_leaves_only_the_crds(&node, &mut figures);
    node.remove_image(&upgrade_image(&operator_image));
    figures.suite = started.elapsed();
    figures.print();
}

// ---- The steps ---------------------------------------------------------------------------------

fn install(node: &Node, figures: &mut Figures) {
    step("helm install --wait");
    // watchNamespaces needs the namespace first (the operator gets a Role there for Secrets).
    node.kubectl_ok(&["create", "namespace", TEAM], None);
    let chart = common::install::chart();
    let allowed = format!("backends.allowedBrokerHosts={{{}}}", node.ip);
    let watch = format!("watchNamespaces={{{TEAM}}}");
    let t = Instant::now();
    let out = node.helm(&[
        "install",
        RELEASE,
        &chart,
        "-n",
        SYSTEM,
        "--create-namespace",
        "--wait",
        "--timeout",
        "180s",
        "--set",
        &allowed,
        "--set",
        &watch,
    ]);
    figures.install = t.elapsed();
    assert!(!out.contains("WARNING"), "{out}");
    let deployment = node.get_json(&["get", "deployment", RELEASE, "-n", SYSTEM]);
    assert_eq!(
        deployment["status"]["readyReplicas"], 2,
        "{}",
        deployment["status"]
    );
    assert_eq!(
        deployment["spec"]["template"]["spec"]["containers"][0]["image"],
        chart_default_image()
    );
    let pods = node.get_json(&["get", "pods", "-n", SYSTEM, "-l", SELECTOR]);
    let pods = pods["items"].as_array().expect("items");
    assert_eq!(pods.len(), 2, "two operator pods");
    for p in pods {
        assert_eq!(p["status"]["phase"], "Running", "{}", p["metadata"]["name"]);
        assert_eq!(p["spec"]["nodeName"], node.name.as_str());
    }
    figures.pods = node.pods_wide(SYSTEM);
    println!("{}", figures.pods);
}

fn webhook_by_service_with_the_operators_ca(node: &Node) {
    step("the webhook: by service, with the operator's own CA");
    let secret = node.get_json(&["get", "secret", "settle-webhook-tls", "-n", SYSTEM]);
    let ca = secret["data"]["ca.crt"]
        .as_str()
        .expect("the operator's Secret holds ca.crt")
        .to_string();
    // The operator patches the caBundle once its certificate is in the Secret.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let vwc = node.get_json(&["get", "validatingwebhookconfiguration", RELEASE]);
        let hooks = vwc["webhooks"].as_array().expect("webhooks").clone();
        assert_eq!(hooks.len(), 2);
        for hook in &hooks {
            let cc = &hook["clientConfig"];
            assert!(cc.get("url").is_none(), "registered by url: {cc}");
            assert_eq!(cc["service"]["name"], "settle-webhook", "{cc}");
            assert_eq!(cc["service"]["namespace"], SYSTEM, "{cc}");
            assert_eq!(cc["service"]["path"], "/validate", "{cc}");
        }
        // And the mutating webhook of the same name, served by the same Service at /mutate.
        let mwc = node.get_json(&["get", "mutatingwebhookconfiguration", RELEASE]);
        let mutating = mwc["webhooks"].as_array().expect("webhooks").clone();
        assert_eq!(mutating.len(), 1);
        assert_eq!(
            mutating[0]["clientConfig"]["service"]["path"], "/mutate",
            "{mwc}"
        );
        if hooks
            .iter()
            .chain(&mutating)
            .all(|h| h["clientConfig"]["caBundle"] == ca)
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the caBundle is not the CA in Secret settle-webhook-tls after 60s: {hooks:?}"
        );
        std::thread::sleep(Duration::from_millis(250));
    }
}

fn invalid_subscription_denied_through_the_service(node: &Node) {
    step("an invalid Subscription denied by the pods' webhook");
    let out = node.kubectl(
        &["apply", "-n", TEAM, "-f", "-"],
        Some(&sub_yaml(
            "invalid",
            "nats",
            "orders.>",
            "  mode: AtLeastOnce\n",
        )),
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "an invalid Subscription was admitted"
    );
    let denied = format!(
        "admission webhook \"{WEBHOOK}\" denied the request: spec.durableName: required under mode AtLeastOnce, on every backend: set spec.durableName to a stable name (for example the Subscription's name) so redeliveries survive a restart\n"
    );
    assert!(
        stderr.ends_with(&denied),
        "wanted\n  {denied}got\n  {stderr}"
    );
}

async fn consumers_made_by_the_operator_pod(
    node: &Node,
    client: &kube::Client,
    js: &async_nats::jetstream::Context,
    nats: &BridgeNats,
) {
    step("a Backend and Subscriptions: consumers made by the operator pod");
    node.apply(TEAM, &backend_yaml("nats", &nats.url()));
    let backends: Api<Backend> = Api::namespaced(client.clone(), TEAM);
    wait_backend(&backends, "nats", "True", "Connected").await;
    node.apply(
        TEAM,
        &sub_yaml(
            "orders",
            "nats",
            "orders.placed.>",
            "  mode: AtLeastOnce\n  durableName: orders\n  maxDeliver: 5\n",
        ),
    );
    node.apply(TEAM, &sub_yaml("audit", "nats", "orders.>", ""));
    let subs: Api<Subscription> = Api::namespaced(client.clone(), TEAM);
    for name in ["orders", "audit"] {
        assert_consumer(&subs, js, name).await;
    }
}

async fn tls_backend_ready_on_a_read_only_root(
    node: &Node,
    client: &kube::Client,
    tls_nats: &BridgeNats,
    ca_pem: &str,
) {
    step("a NATS Backend over TLS, CA from a Secret, read-only root filesystem");
    let deployment = node.get_json(&["get", "deployment", RELEASE, "-n", SYSTEM]);
    assert_eq!(
        deployment["spec"]["template"]["spec"]["containers"][0]["securityContext"]["readOnlyRootFilesystem"],
        true,
        "the chart's read-only root filesystem"
    );
    let secret = json!({
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "nats-ca", "labels": {"settle.dev/backend-credentials": "true"}},
        "stringData": {"ca.crt": ca_pem},
    });
    node.apply(TEAM, &secret.to_string());
    let url = format!("tls://{}:{}", tls_nats.ip, tls_nats.port);
    node.apply(
        TEAM,
        &nats_backend_yaml("nats-tls", &url, &nats_tls("nats-ca")),
    );
    let backends: Api<Backend> = Api::namespaced(client.clone(), TEAM);
    let b = wait_backend(&backends, "nats-tls", "True", "Connected").await;
    assert!(
        b.status
            .and_then(|s| s.server_version)
            .is_some_and(|v| v.starts_with("2.")),
        "serverVersion is the TLS server's"
    );
}

/// The example application as a pod on Subscription `prober`, and what publishes to it.
struct Prober {
    subs: Api<Subscription>,
    js: async_nats::jetstream::Context,
    /// Messages stored by the stream so far (each once, by its Nats-Msg-Id).
    published: Arc<AtomicU64>,
}

impl Prober {
    async fn new(
        node: &Node,
        client: &kube::Client,
        js: &async_nats::jetstream::Context,
        nats: &BridgeNats,
        image: &str,
    ) -> Prober {
        step("the example application as a pod: its counters in status");
        let manifest = format!(
            "apiVersion: messaging.settle.dev/v1alpha1\nkind: Subscription\nmetadata: {{name: prober, namespace: {TEAM}}}\nspec:\n  backendRef: {{name: nats}}\n  pattern: \"prober.>\"\n  mode: AtLeastOnce\n  durableName: prober\n  maxDeliver: 5\n"
        );
        node.apply(TEAM, &manifest);
        let subs: Api<Subscription> = Api::namespaced(client.clone(), TEAM);
        assert_consumer(&subs, js, "prober").await;
        let config_map = json!({
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "prober-subscription"},
            "data": {"subscription.yaml": manifest},
        });
        node.apply(TEAM, &config_map.to_string());
        node.apply(TEAM, &app_deployment(image, &nats.url()).to_string());
        node.wait_rollout(TEAM, "prober-app", Duration::from_secs(120));
        let prober = Prober {
            subs,
            js: js.clone(),
            published: Arc::new(AtomicU64::new(0)),
        };
        let stop = Arc::new(AtomicBool::new(false));
        stop.store(true, Ordering::SeqCst);
        // Fifty messages, then the stream is idle: status shows each delivered and acked once.
        prober.publish_until(stop, 50).await;
        let want = prober.published();
        let s = prober.settled(want).await;
        assert_eq!(s.delivered, want, "{s:?}");
        prober
    }

    /// The Go runtime's application as a second pod on Subscription `prober`, beside the Rust
    /// one: both consume the same queue, and status stays one exact account.
    async fn go_beside_rust(&self, node: &Node, nats: &BridgeNats, image: &str) {
        step("the Go runtime's application beside the Rust one: one account");
        let mut app = app_deployment(image, &nats.url());
        app["metadata"]["name"] = json!("prober-app-go");
        app["metadata"]["labels"]["app"] = json!("prober-app-go");
        app["spec"]["selector"]["matchLabels"]["app"] = json!("prober-app-go");
        app["spec"]["template"]["metadata"]["labels"]["app"] = json!("prober-app-go");
        app["spec"]["template"]["spec"]["containers"][0]["env"][2]["value"] = json!("ack");
        node.apply(TEAM, &app.to_string());
        node.wait_rollout(TEAM, "prober-app-go", Duration::from_secs(120));
        let stop = Arc::new(AtomicBool::new(true));
        self.publish_until(stop, 100).await;
        let want = self.published();
        let s = self.settled(want).await;
        assert_eq!(s.delivered, want, "{s:?}");
        let acked_by_go = node
            .kubectl_ok(&["logs", "-n", TEAM, "deploy/prober-app-go"], None)
            .lines()
            .filter(|l| l.starts_with("acked "))
            .count();
        println!("  the Go application acked {acked_by_go} of the last 100");
        assert!(
            acked_by_go > 0,
            "the Go application served the Subscription too"
        );
    }

    fn published(&self) -> u64 {
        self.published.load(Ordering::SeqCst)
    }

    /// Publishes `prober.m<i>` with `Nats-Msg-Id: p-<i>`, one every 10 ms, at least `at_least`
    /// messages and then until `stop`; a publish whose answer was lost is sent again with the
    /// same id, so the stream stores each message once. Returns when it stopped.
    async fn publish_until(&self, stop: Arc<AtomicBool>, at_least: u64) {
        let start = self.published();
        loop {
            let done = self.published() - start;
            if done >= at_least && stop.load(Ordering::SeqCst) {
                return;
            }
            let i = self.published() + 1;
            let mut headers = async_nats::HeaderMap::new();
            headers.insert("Nats-Msg-Id", format!("p-{i}").as_str());
            let sent = match self
                .js
                .publish_with_headers(format!("prober.m{i}"), headers, format!("m-{i}").into())
                .await
            {
                Ok(ack) => ack.await.map_err(|e| e.to_string()),
                Err(e) => Err(e.to_string()),
            };
            match sent {
                // New, or a duplicate: stored by an earlier try whose answer was lost (only a
                // stored message is counted, so either way it is counted once, here).
                Ok(_) => {
                    self.published.fetch_add(1, Ordering::SeqCst);
                }
                Err(e) => {
                    eprintln!("publish p-{i} again: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// A publisher running in the background until the returned flag is set.
    fn start(self: &Arc<Self>) -> (Arc<AtomicBool>, tokio::task::JoinHandle<()>) {
        let stop = Arc::new(AtomicBool::new(false));
        let (me, flag) = (self.clone(), stop.clone());
        let task = tokio::spawn(async move { me.publish_until(flag, 1).await });
        (stop, task)
    }

    async fn stats(&self) -> ConsumerStats {
        common::account::stats_in(&self.subs, "prober").await
    }

    /// Waits until status shows `want` messages acked and nothing lost, exhausted or stranded,
    /// and that it stays so.
    async fn settled(&self, want: u64) -> ConsumerStats {
        let s = common::account::settled_at(
            &format!("prober's status to show {want} acked"),
            Duration::from_secs(180),
            || self.stats(),
            |s| s.settlement.acked >= want,
        )
        .await;
        assert_eq!(s.settlement.acked, want, "acked once each: {s:?}");
        assert_eq!(s.lost, 0, "{s:?}");
        assert_eq!(s.exhausted, 0, "{s:?}");
        assert_eq!(s.stranded, 0, "{s:?}");
        assert!(
            s.balanced(),
            "offered == delivered + released + lost: {s:?}"
        );
        s
    }
}

async fn leader_failover(
    node: &Node,
    client: &kube::Client,
    js: &async_nats::jetstream::Context,
    figures: &mut Figures,
) {
    step(
        "the leader pod deleted: another replica leads and reconciles, the survivor stays Ready, no apply refused",
    );
    let leases: Api<Lease> = Api::namespaced(client.clone(), SYSTEM);
    let lease = leases.get(LEASE).await.expect("the operator's Lease");
    let spec = lease.spec.clone().unwrap_or_default();
    let leader = spec.holder_identity.clone().expect("a holder");
    let bound =
        Duration::from_secs(u64::try_from(spec.lease_duration_seconds.unwrap_or(15)).unwrap_or(15));
    let pods = operator_pods(node);
    assert!(
        pods.contains(&leader),
        "the Lease's holder {leader} is one of {pods:?}"
    );
    let applier = Applier::start(node.clone(), "churn");
    // Let the loop run against the steady install first.
    applier.wait_applied(3);
    let t = Instant::now();
    let deleted_at = k8s_openapi::jiff::Timestamp::now();
    node.kubectl_ok(
        &["delete", "pod", &leader, "-n", SYSTEM, "--wait=false"],
        None,
    );
    let new_leader = poll(
        "another replica to hold the Lease",
        bound + Duration::from_secs(30),
        || async {
            let l = leases.get(LEASE).await.map_err(|e| e.to_string())?;
            match l.spec.and_then(|s| s.holder_identity) {
                Some(h) if !h.is_empty() && h != leader => Ok(h),
                other => Err(format!("holder {other:?}")),
            }
        },
    )
    .await;
    figures.failover = t.elapsed();
    println!(
        "leader {leader} deleted; {new_leader} leads after {:?}",
        figures.failover
    );
    assert!(
        figures.failover <= bound + Duration::from_secs(2),
        "the Lease moved after {:?}, past its bound ({bound:?} + 2 s of retries)",
        figures.failover
    );
    // The new leader reconciles: a Subscription applied now gets its consumer.
    node.apply(
        TEAM,
        &sub_yaml(
            "after-failover",
            "nats",
            "orders.after.>",
            "  mode: AtLeastOnce\n  durableName: after-failover\n",
        ),
    );
    let subs: Api<Subscription> = Api::namespaced(client.clone(), TEAM);
    assert_consumer(&subs, js, "after-failover").await;
    // The replica that survived the deletion stayed in the webhook's Service throughout: its
    // Ready condition has not changed since before the failover. It is usually the new leader
    // (taking the Lease and syncing the controllers' caches must not make it unready), but the
    // Deployment's replacement pod may start and take the released Lease first; either way the
    // survivor answered admission all along.
    let pod_api: Api<Pod> = Api::namespaced(client.clone(), SYSTEM);
    for survivor in pods.iter().filter(|p| **p != leader) {
        let pod = pod_api
            .get(survivor)
            .await
            .expect("the surviving replica's pod");
        let ready = pod
            .status
            .and_then(|s| s.conditions)
            .and_then(|c| c.into_iter().find(|c| c.type_ == "Ready"))
            .expect("a Ready condition");
        assert_eq!(ready.status, "True", "{survivor}: {ready:?}");
        let changed = ready
            .last_transition_time
            .clone()
            .expect("lastTransitionTime")
            .0;
        assert!(
            changed <= deleted_at,
            "{survivor} (the new leader is {new_leader}) changed readiness at {changed} during the failover (leader deleted at {deleted_at}): {ready:?}"
        );
    }
    node.wait_rollout(SYSTEM, RELEASE, Duration::from_secs(120));
    let (applied, refused) = applier.stop();
    println!(
        "during the failover: {applied} applies, {} refused",
        refused.len()
    );
    assert!(
        refused.is_empty(),
        "applies refused during the failover: {refused:#?}"
    );
    figures.failover_applies = applied;
}

async fn evictions_respect_the_pdb(node: &Node, client: &kube::Client) {
    step("evictions through the Eviction API respect the PodDisruptionBudget");
    let pdb = node.get_json(&["get", "poddisruptionbudget", RELEASE, "-n", SYSTEM]);
    assert_eq!(pdb["spec"]["maxUnavailable"], 1, "{}", pdb["spec"]);
    // Both replicas Ready, and the disruption controller has counted them so: the budget allows
    // one disruption. Held for 2 s, so a status written before the failover's replacement was
    // counted is not taken for the present one.
    let pods: Api<Pod> = Api::namespaced(client.clone(), SYSTEM);
    let mut since: Option<Instant> = None;
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let pdb = node.get_json(&["get", "poddisruptionbudget", RELEASE, "-n", SYSTEM]);
        let names = operator_pods(node);
        let mut ready = 0;
        for n in &names {
            if pod_ready(&pods, n).await {
                ready += 1;
            }
        }
        let ok = ready == 2
            && names.len() == 2
            && pdb["status"]["disruptionsAllowed"] == 1
            && pdb["status"]["currentHealthy"] == 2
            && pdb["status"]["observedGeneration"] == pdb["metadata"]["generation"];
        match (ok, since) {
            (true, Some(t)) if t.elapsed() >= Duration::from_secs(2) => break,
            (true, None) => since = Some(Instant::now()),
            (true, Some(_)) => {}
            (false, _) => since = None,
        }
        assert!(
            Instant::now() < deadline,
            "the PDB never allowed one disruption with both replicas Ready: {} ({ready} Ready of {names:?})",
            pdb["status"]
        );
        std::thread::sleep(Duration::from_millis(250));
    }
    let names = operator_pods(node);
    assert_eq!(names.len(), 2, "{names:?}");
    evict(node, &names[0])
        .unwrap_or_else(|e| panic!("the first eviction ({}) is allowed: {e}", names[0]));
    let after = node.get_json(&["get", "poddisruptionbudget", RELEASE, "-n", SYSTEM]);
    let other_ready = pod_ready(&pods, &names[1]).await;
    // One replica is gone and its successor not yet Ready: the budget allows no other. (Asked
    // once, with kubectl: the kube client retries a 429 until the budget allows it.)
    match evict(node, &names[1]) {
        Err(e) if e.contains("(TooManyRequests)") => {
            println!("second eviction refused: {e}");
            assert!(e.contains("disruption budget"), "{e}");
        }
        other => panic!(
            "the second eviction ({}, Ready: {other_ready}) was not refused with 429: {other:?}; the PDB after the first: {}",
            names[1], after["status"]
        ),
    }
    node.wait_rollout(SYSTEM, RELEASE, Duration::from_secs(120));
    let deployment = node.get_json(&["get", "deployment", RELEASE, "-n", SYSTEM]);
    assert_eq!(deployment["status"]["readyReplicas"], 2);
    assert!(
        !operator_pods(node).contains(&names[0]),
        "the evicted pod is gone"
    );
}

async fn upgrade_under_traffic(
    node: &Node,
    prober: &Arc<Prober>,
    operator_image: &str,
    figures: &mut Figures,
) {
    step("helm upgrade to a new image under traffic");
    let new_image = upgrade_image(operator_image);
    node.tag_image(operator_image, &new_image);
    let tag = new_image
        .rsplit_once(':')
        .map(|(_, t)| t)
        .expect("a tag")
        .to_string();
    let before = prober.published();
    let old_pods = operator_pods(node);
    let (stop, publisher) = prober.start();
    let applier = Applier::start(node.clone(), "churn");
    applier.wait_applied(3);
    let t = Instant::now();
    let chart = common::install::chart();
    let set = format!("image.tag={tag}");
    let upgrade = {
        let node = node.clone();
        tokio::task::spawn_blocking(move || {
            node.helm(&[
                "upgrade",
                RELEASE,
                &chart,
                "-n",
                SYSTEM,
                "--reuse-values",
                "--set",
                &set,
                "--wait",
                "--timeout",
                "300s",
            ])
        })
    };
    upgrade.await.expect("helm upgrade ran");
    figures.upgrade = t.elapsed();
    let deployment = node.get_json(&["get", "deployment", RELEASE, "-n", SYSTEM]);
    assert_eq!(
        deployment["spec"]["template"]["spec"]["containers"][0]["image"],
        new_image.as_str()
    );
    node.wait_rollout(SYSTEM, RELEASE, Duration::from_secs(120));
    let now = operator_pods(node);
    assert!(
        now.iter().all(|p| !old_pods.contains(p)),
        "every replica was replaced: before {old_pods:?}, now {now:?}"
    );
    stop.store(true, Ordering::SeqCst);
    publisher.await.expect("publisher");
    let (applied, refused) = applier.stop();
    let published = prober.published();
    let s = prober.settled(published).await;
    figures.upgrade_published = published - before;
    figures.upgrade_acked = s.settlement.acked;
    figures.upgrade_lost = s.lost + s.exhausted;
    figures.upgrade_applies = applied;
    figures.upgrade_refused = refused.len();
    println!(
        "upgrade prober: published {} during the rollout ({published} in all), acked {} in all, lost {}, exhausted {}; {applied} applies, {} refused",
        published - before,
        s.settlement.acked,
        s.lost,
        s.exhausted,
        refused.len()
    );
    assert!(
        published > before,
        "the prober published during the rollout"
    );
    assert!(
        refused.is_empty(),
        "applies refused during the upgrade: {refused:#?}"
    );
}

async fn app_rollout_restart_under_traffic(
    node: &Node,
    prober: &Arc<Prober>,
    figures: &mut Figures,
) {
    step("kubectl rollout restart of the application under traffic");
    let old = app_pods(node);
    assert_eq!(old.len(), 1, "{old:?}");
    let follower = LogFollower::start(node, TEAM, &old[0]);
    let before = prober.published();
    let (stop, publisher) = prober.start();
    // Some traffic before the restart, and all through it.
    let mid = before + 20;
    poll("the prober to publish", Duration::from_secs(60), || async {
        if prober.published() >= mid {
            Ok(())
        } else {
            Err(format!("{}", prober.published()))
        }
    })
    .await;
    node.kubectl_ok(
        &["rollout", "restart", "deployment/prober-app", "-n", TEAM],
        None,
    );
    node.wait_rollout(TEAM, "prober-app", Duration::from_secs(180));
    let lines = follower.finish(Duration::from_secs(60));
    stop.store(true, Ordering::SeqCst);
    publisher.await.expect("publisher");
    assert!(
        lines.iter().any(|l| l == "closed"),
        "the old application pod's graceful stop did not finish (no `closed`): {lines:?}"
    );
    let published = prober.published();
    let s = prober.settled(published).await;
    figures.restart_published = published - before;
    println!(
        "app restart: published {} during it ({published} in all), acked {}, lost {}",
        published - before,
        s.settlement.acked,
        s.lost
    );
}

/// `kubectl delete namespace` of the team, its Backends and Subscriptions (all `Delete`) with it,
/// in whatever order the real namespace controller takes: the Backends stay until their
/// Subscriptions deleted their consumers, so no consumer is left on the broker, and no finalizer
/// had to be taken off by hand.
async fn namespace_deletion_deletes_the_consumers(
    node: &Node,
    js: &async_nats::jetstream::Context,
) {
    step("kubectl delete namespace: every consumer of its Subscriptions goes with it");
    let consumers = || async {
        let mut all = Vec::new();
        for stream in ["ORDERS", "PROBER"] {
            let s = js.get_stream(stream).await.expect("stream");
            let names: Vec<String> = futures::TryStreamExt::try_collect(s.consumer_names())
                .await
                .expect("consumer names");
            all.extend(names.into_iter().map(|n| format!("{stream}/{n}")));
        }
        all.sort();
        all
    };
    let before = consumers().await;
    assert!(
        !before.is_empty(),
        "the team's Subscriptions have consumers"
    );
    let t = Instant::now();
    // Far shorter than the grace after which the test kit would strip finalizers by hand.
    node.delete_namespace_unaided(TEAM, Duration::from_secs(120));
    println!(
        "namespace {TEAM} deleted in {:?}; consumers before: {before:?}",
        t.elapsed()
    );
    assert_eq!(
        consumers().await,
        Vec::<String>::new(),
        "left on the broker"
    );
}

fn uninstall_leaves_only_the_crds(node: &Node, figures: &mut Figures) {
    step("helm uninstall: nothing of the release is left but the CRDs");
    let t = Instant::now();
    node.helm(&[
        "uninstall",
        RELEASE,
        "-n",
        SYSTEM,
        "--wait",
        "--timeout",
        "120s",
    ]);
    figures.uninstall = t.elapsed();
    // Its pods stop, and the garbage collector deletes what the release's objects owned (the
    // Lease and the certificate Secret, owned by the ServiceAccount), shortly after.
    let deadline = Instant::now() + Duration::from_secs(90);
    let mut left = release_leftovers(node);
    while !left.is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(500));
        left = release_leftovers(node);
    }
    println!("left by the release after uninstall: {left:?}");
    assert!(left.is_empty(), "helm uninstall left: {left:#?}");
    for crd in [
        "crd/subscriptions.messaging.settle.dev",
        "crd/backends.messaging.settle.dev",
    ] {
        node.kubectl_ok(&["get", crd], None);
    }
    node.delete_namespace(SYSTEM, Duration::from_secs(30));
}

// ---- Helpers -----------------------------------------------------------------------------------

fn step(what: &str) {
    println!("== {what}");
}

/// What a run measured, printed at its end for the closing note.
#[derive(Default)]
struct Figures {
    pods: String,
    install: Duration,
    failover: Duration,
    failover_applies: usize,
    upgrade: Duration,
    upgrade_published: u64,
    upgrade_acked: u64,
    upgrade_lost: u64,
    upgrade_applies: usize,
    upgrade_refused: usize,
    restart_published: u64,
    uninstall: Duration,
    suite: Duration,
}

impl Figures {
    fn print(&self) {
        println!("== figures");
        println!(
            "kubectl get pods -n {SYSTEM} -o wide (after install):\n{}",
            self.pods
        );
        println!("helm install --wait: {:?}", self.install);
        println!(
            "leader failover (pod deleted -> Lease held by another): {:?}; {} applies meanwhile, 0 refused",
            self.failover, self.failover_applies
        );
        println!(
            "helm upgrade --wait under traffic: {:?}; prober published {}, acked {} (in all), lost {}; {} applies, {} refused",
            self.upgrade,
            self.upgrade_published,
            self.upgrade_acked,
            self.upgrade_lost,
            self.upgrade_applies,
            self.upgrade_refused
        );
        println!(
            "app rollout restart: {} published during it, all acked",
            self.restart_published
        );
        println!("helm uninstall --wait: {:?}", self.uninstall);
        println!("pod suite: {:?}", self.suite);
    }
}

/// The chart's default image: `image.repository` and the chart's appVersion.
fn chart_default_image() -> String {
    let root = common::root();
    let values = std::fs::read_to_string(root.join("charts/settle/values.yaml")).expect("values");
    let values: Value = serde_yaml::from_str(&values).expect("values.yaml");
    let chart = std::fs::read_to_string(root.join("charts/settle/Chart.yaml")).expect("Chart.yaml");
    let chart: Value = serde_yaml::from_str(&chart).expect("Chart.yaml");
    format!(
        "{}:{}",
        values["image"]["repository"]
            .as_str()
            .expect("image.repository"),
        chart["appVersion"].as_str().expect("appVersion")
    )
}

/// The same image under another tag, for the upgrade.
fn upgrade_image(image: &str) -> String {
    format!("{image}-upgrade")
}

/// Leaves the node as an install never happened: the team's namespace (finalizers taken off if
/// no operator is left to), the release, its namespace, and a webhook configuration left behind.
fn clean(node: &Node) {
    node.delete_namespace(TEAM, Duration::from_secs(20));
    if node
        .helm_run(&["status", RELEASE, "-n", SYSTEM])
        .status
        .success()
    {
        node.helm(&["uninstall", RELEASE, "-n", SYSTEM, "--wait"]);
    }
    let _ = node.kubectl(
        &[
            "delete",
            "validatingwebhookconfiguration,mutatingwebhookconfiguration",
            RELEASE,
            "--ignore-not-found",
        ],
        None,
    );
    node.delete_namespace(SYSTEM, Duration::from_secs(20));
}

/// Names of the release's objects still in the cluster (CRDs excepted), as `kind/name`.
fn release_leftovers(node: &Node) -> Vec<String> {
    let mut left = Vec::new();
    let names = |args: &[&str]| -> Vec<String> {
        let out = node.kubectl(args, None);
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(str::to_string)
            .filter(|l| !l.is_empty())
            .collect()
    };
    // Everything in the release's namespace but what Kubernetes puts in every namespace.
    left.extend(
        names(&[
            "get",
            "deployments,replicasets,pods,services,endpointslices,serviceaccounts,roles,rolebindings,leases,secrets,configmaps,poddisruptionbudgets",
            "-n",
            SYSTEM,
            "-o",
            "name",
        ])
        .into_iter()
        .filter(|n| {
            n != "serviceaccount/default" && n != "configmap/kube-root-ca.crt"
        }),
    );
    // Cluster-wide: by the release's label and by its name.
    left.extend(names(&[
        "get",
        "validatingwebhookconfigurations,mutatingwebhookconfigurations,clusterroles,clusterrolebindings",
        "-l",
        "app.kubernetes.io/instance=settle",
        "-o",
        "name",
    ]));
    for kind in [
        "validatingwebhookconfiguration",
        "mutatingwebhookconfiguration",
        "clusterrole",
        "clusterrolebinding",
    ] {
        if node.kubectl(&["get", kind, RELEASE], None).status.success() {
            left.push(format!("{kind}/{RELEASE}"));
        }
    }
    // Per-namespace Secrets Roles in the watched namespace (deleted with it above, checked anyway).
    left.extend(names(&[
        "get",
        "roles,rolebindings",
        "-A",
        "-l",
        "app.kubernetes.io/instance=settle",
        "-o",
        "name",
    ]));
    left.sort();
    left.dedup();
    left
}

/// The operator pods' names, sorted.
fn operator_pods(node: &Node) -> Vec<String> {
    pod_names(node, SYSTEM, SELECTOR)
}

fn app_pods(node: &Node) -> Vec<String> {
    pod_names(node, TEAM, "app=prober-app")
}

/// Pods of `selector` in `ns` that are not being deleted.
fn pod_names(node: &Node, ns: &str, selector: &str) -> Vec<String> {
    let pods = node.get_json(&["get", "pods", "-n", ns, "-l", selector]);
    let mut names: Vec<String> = pods["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|p| p["metadata"]["deletionTimestamp"].is_null())
        .filter_map(|p| p["metadata"]["name"].as_str().map(str::to_string))
        .collect();
    names.sort();
    names
}

/// Subscription `name` on `backend` for `pattern`, then `spec` (indented two spaces).
fn sub_yaml(name: &str, backend: &str, pattern: &str, spec: &str) -> String {
    sub_yaml_on(backend, name, &format!("  pattern: \"{pattern}\"\n{spec}"))
}

/// The example application's Deployment: one replica on Subscription `prober` (its manifest
/// from the ConfigMap), acking what it gets, with the chart's securityContext.
fn app_deployment(image: &str, nats_url: &str) -> Value {
    json!({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "prober-app", "labels": {"app": "prober-app"}},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": "prober-app"}},
            "template": {
                "metadata": {"labels": {"app": "prober-app"}},
                "spec": {
                    "terminationGracePeriodSeconds": 30,
                    "securityContext": {
                        "runAsNonRoot": true, "runAsUser": 65532, "runAsGroup": 65532,
                        "seccompProfile": {"type": "RuntimeDefault"}
                    },
                    "containers": [{
                        "name": "app",
                        "image": image,
                        "imagePullPolicy": "IfNotPresent",
                        "env": [
                            {"name": "SETTLE_NATS_URL", "value": nats_url},
                            {"name": "SETTLE_SUBSCRIPTION_FILE", "value": "/etc/settle/subscription.yaml"},
                            {"name": "SETTLE_APP_HANDLER", "value": "demo"},
                            {"name": "RUST_LOG", "value": "info"}
                        ],
                        "volumeMounts": [{"name": "subscription", "mountPath": "/etc/settle", "readOnly": true}],
                        "securityContext": {
                            "allowPrivilegeEscalation": false,
                            "readOnlyRootFilesystem": true,
                            "capabilities": {"drop": ["ALL"]}
                        },
                        "resources": {
                            "requests": {"cpu": "20m", "memory": "32Mi"},
                            "limits": {"cpu": "1", "memory": "128Mi"}
                        }
                    }],
                    "volumes": [{"name": "subscription", "configMap": {"name": "prober-subscription"}}]
                }
            }
        }
    })
}

/// The pods' operator connects from a pod on a shared node: more time than the local one's 60 s.
async fn wait_backend(api: &Api<Backend>, name: &str, status: &str, reason: &str) -> Backend {
    common::subs::wait_backend_within(api, name, status, reason, Duration::from_secs(90)).await
}

/// Waits until Subscription `name` is Ready with a consumer in status, and that consumer is on the
/// broker (asked of JetStream itself).
async fn assert_consumer(api: &Api<Subscription>, js: &async_nats::jetstream::Context, name: &str) {
    let consumer = poll(
        &format!("Subscription {name} to be Ready with its consumer"),
        Duration::from_secs(90),
        || async {
            let (s, st) = common::subs::sub_status(api, name).await?;
            let (cs, cr, m) = condition(&st.conditions, "Ready").ok_or("no Ready yet")?;
            match st.consumer {
                Some(c) if cs == "True" && st.observed_generation == s.metadata.generation => Ok(c),
                _ => Err(format!("Ready={cs} {cr}: {m}")),
            }
        },
    )
    .await;
    let info = settle::backend::nats::admin::consumer_info(js, &consumer.stream, &consumer.name)
        .await
        .expect("consumer info");
    assert!(
        info.is_some(),
        "Subscription {name}'s consumer {}/{} is not on the server",
        consumer.stream,
        consumer.name
    );
}

/// One policy/v1 Eviction of operator pod `name`, as `kubectl drain` sends it; the API server's
/// refusal as kubectl prints it (`Error from server (TooManyRequests): ...`).
fn evict(node: &Node, name: &str) -> Result<(), String> {
    let eviction = json!({
        "apiVersion": "policy/v1",
        "kind": "Eviction",
        "metadata": {"name": name, "namespace": SYSTEM},
    });
    let path = format!("/api/v1/namespaces/{SYSTEM}/pods/{name}/eviction");
    let out = node.kubectl(
        &["create", "--raw", &path, "-f", "-"],
        Some(&eviction.to_string()),
    );
    if out.status.success() {
        Ok(())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).trim().to_string())
    }
}

/// Whether pod `name` has condition Ready=True now.
async fn pod_ready(pods: &Api<Pod>, name: &str) -> bool {
    pods.get_opt(name)
        .await
        .ok()
        .flatten()
        .and_then(|p| p.status)
        .and_then(|s| s.conditions)
        .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// `kubectl apply` of valid Subscriptions in loops (three at once, each on a Subscription of its
/// own, each apply with another spec so it reaches the webhook), counting the refusals: the
/// webhook fails closed, so a replica the API server still calls after it stopped answering
/// refuses the apply.
struct Applier {
    stop: Arc<AtomicBool>,
    applied: Arc<AtomicU64>,
    threads: Vec<std::thread::JoinHandle<Vec<String>>>,
}

/// How many apply loops run at once.
const APPLY_LOOPS: usize = 3;

impl Applier {
    fn start(node: Node, name: &'static str) -> Applier {
        let stop = Arc::new(AtomicBool::new(false));
        let applied = Arc::new(AtomicU64::new(0));
        let threads = (0..APPLY_LOOPS)
            .map(|loop_| {
                let (node, flag, count) = (node.clone(), stop.clone(), applied.clone());
                std::thread::spawn(move || {
                    let sub = format!("{name}-{loop_}");
                    let mut refused = Vec::new();
                    let mut i: u64 = 0;
                    while !flag.load(Ordering::SeqCst) {
                        i += 1;
                        let spec = format!(
                            "  mode: AtLeastOnce\n  durableName: {sub}\n  maxInFlight: {}\n",
                            1 + i % 200
                        );
                        let out = node.kubectl(
                            &["apply", "-n", TEAM, "-f", "-"],
                            Some(&sub_yaml(&sub, "nats", &format!("orders.{sub}.>"), &spec)),
                        );
                        count.fetch_add(1, Ordering::SeqCst);
                        if !out.status.success() {
                            refused.push(format!(
                                "{sub} apply {i}: {}",
                                String::from_utf8_lossy(&out.stderr).trim()
                            ));
                        }
                    }
                    refused
                })
            })
            .collect();
        Applier {
            stop,
            applied,
            threads,
        }
    }

    fn wait_applied(&self, n: u64) {
        common::process::poll_until(&format!("{n} applies"), Duration::from_secs(60), || {
            self.applied.load(Ordering::SeqCst) >= n
        });
    }

    /// Stops the loops; how many applies ran, and each refusal.
    fn stop(self) -> (usize, Vec<String>) {
        self.stop.store(true, Ordering::SeqCst);
        let refused = self
            .threads
            .into_iter()
            .flat_map(|t| t.join().expect("applier"))
            .collect();
        (
            usize::try_from(self.applied.load(Ordering::SeqCst)).unwrap_or(usize::MAX),
            refused,
        )
    }
}
