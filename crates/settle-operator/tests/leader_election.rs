//! Leader election against the real API server: contenders started in this process by the
//! library (`settle_operator::operator::leader::start`), then `settle operator` processes killed and
//! stopped for real. Each test contends for a Lease of its own in a namespace of its own.
//!
//! Takeover times are printed (`cargo test --test leader_election -- --nocapture`); the one
//! bound asserted is the product's promise: a standby leads within 15 s of the leader's death.

use settle_testkit as common;

use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::Api;
use kube::api::PostParams;
use prometheus::Registry;
use settle_operator::operator::leader::{
    self, LEASE_DURATION, LeaderError, Leadership, LeaseConfig,
};

use common::free_port;
use common::partition::Partition;

/// The promise: a standby leads within this long of the leader's death.
const TAKEOVER: Duration = Duration::from_secs(15);

struct Contender {
    identity: String,
    leadership: Leadership,
    registry: Registry,
}

impl Contender {
    fn start(client: &kube::Client, ns: &str, lease: &str, identity: &str) -> Contender {
        let registry = Registry::new();
        let leadership = leader::start(
            client.clone(),
            LeaseConfig::new(ns, lease, identity),
            &registry,
        )
        .expect("leader election starts");
        Contender {
            identity: identity.to_string(),
            leadership,
            registry,
        }
    }

    fn leads(&self) -> bool {
        self.leadership.is_leader()
    }

    /// The `settle_leader` gauge this contender registered.
    fn gauge(&self) -> f64 {
        self.registry
            .gather()
            .into_iter()
            .find(|m| m.name() == "settle_leader")
            .map(|m| m.get_metric()[0].get_gauge().value())
            .expect("settle_leader is registered")
    }
}

/// Polls `done` every 50 ms until it holds; panics after `limit` saying what it waited for.
/// Returns how long it took.
async fn poll(what: &str, limit: Duration, mut done: impl FnMut() -> bool) -> Duration {
    let start = Instant::now();
    loop {
        if done() {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < limit,
            "waited {limit:?} for {what}, in vain"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Samples for `span` that exactly one of `contenders` leads, every 50 ms.
async fn exactly_one_leads_throughout(contenders: &[&Contender], span: Duration) {
    let start = Instant::now();
    while start.elapsed() < span {
        let leaders: Vec<&str> = contenders
            .iter()
            .filter(|c| c.leads())
            .map(|c| c.identity.as_str())
            .collect();
        assert_eq!(
            leaders.len(),
            1,
            "leaders at {:?}: {leaders:?}",
            start.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn spec(client: &kube::Client, ns: &str, name: &str) -> LeaseSpec {
    Api::<Lease>::namespaced(client.clone(), ns)
        .get(name)
        .await
        .expect("the Lease exists")
        .spec
        .unwrap_or_default()
}

#[tokio::test]
async fn of_two_contenders_exactly_one_leads_and_the_lease_names_it() {
    let client = common::kube_client().await;
    let ns = common::namespace("leader-two");
    let a = Contender::start(&client, &ns, "two", "a");
    let b = Contender::start(&client, &ns, "two", "b");
    poll("one of two contenders to lead", TAKEOVER, || {
        a.leads() || b.leads()
    })
    .await;
    exactly_one_leads_throughout(&[&a, &b], Duration::from_secs(5)).await;
    let (leader, standby) = if a.leads() { (&a, &b) } else { (&b, &a) };
    assert_eq!(leader.gauge(), 1.0);
    assert_eq!(standby.gauge(), 0.0);
    let spec = spec(&client, &ns, "two").await;
    assert_eq!(
        spec.holder_identity.as_deref(),
        Some(leader.identity.as_str())
    );
    assert_eq!(
        spec.lease_transitions,
        Some(0),
        "created by its first holder"
    );
    assert_eq!(
        spec.lease_duration_seconds,
        Some(LEASE_DURATION.as_secs() as i32)
    );
    assert!(spec.renew_time.is_some() && spec.acquire_time.is_some());
    // Renewals move the renew time and nothing else.
    let start = Instant::now();
    let renewed = loop {
        let now = self::spec(&client, &ns, "two").await;
        if now.renew_time != spec.renew_time {
            break now;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "waited 10s for a renewal"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(
        LeaseSpec {
            renew_time: spec.renew_time.clone(),
            ..renewed
        },
        spec
    );
    drop((a, b));
    common::kubectl_ok(&["delete", "namespace", &ns, "--wait=false"], None);
}

#[tokio::test]
async fn a_standby_leads_within_15s_of_the_leaders_death() {
    let client = common::kube_client().await;
    let ns = common::namespace("leader-death");
    let a = Contender::start(&client, &ns, "death", "a");
    poll("the first contender to lead", TAKEOVER, || a.leads()).await;
    let b = Contender::start(&client, &ns, "death", "b");
    // While a renews, b stands by.
    exactly_one_leads_throughout(&[&a, &b], Duration::from_secs(4)).await;
    assert!(a.leads());

    // a dies: dropped without releasing, its renewals stop at once.
    drop(a);
    let took = poll("the standby to take over", TAKEOVER, || b.leads()).await;
    println!(
        "takeover after the leader's death: {:.1}s (lease {}s)",
        took.as_secs_f64(),
        LEASE_DURATION.as_secs()
    );
    assert_eq!(b.gauge(), 1.0);
    let spec = spec(&client, &ns, "death").await;
    assert_eq!(spec.holder_identity.as_deref(), Some("b"));
    assert_eq!(spec.lease_transitions, Some(1));

    b.leadership.release().await;
    let spec = self::spec(&client, &ns, "death").await;
    assert_eq!(spec.holder_identity, None, "released on shutdown");
    common::kubectl_ok(&["delete", "namespace", &ns, "--wait=false"], None);
}

#[tokio::test]
async fn a_released_lease_goes_to_the_standby_without_waiting_for_expiry() {
    let client = common::kube_client().await;
    let ns = common::namespace("leader-release");
    let a = Contender::start(&client, &ns, "release", "a");
    poll("the first contender to lead", TAKEOVER, || a.leads()).await;
    let b = Contender::start(&client, &ns, "release", "b");
    exactly_one_leads_throughout(&[&a, &b], Duration::from_secs(2)).await;

    let mut a_gate = a.leadership.gate();
    let a_registry = a.registry.clone();
    let released = Instant::now();
    a.leadership.release().await;
    // a stopped leading before it cleared the holder, and said so.
    assert!(!a_gate.is_leader());
    a_gate.lost().await;
    let gauge = a_registry
        .gather()
        .into_iter()
        .find(|m| m.name() == "settle_leader")
        .map(|m| m.get_metric()[0].get_gauge().value());
    assert_eq!(gauge, Some(0.0));
    let holder = spec(&client, &ns, "release").await.holder_identity;
    assert!(
        holder.is_none() || holder.as_deref() == Some("b"),
        "right after the release the Lease is free or b's: {holder:?}"
    );
    let took = poll("the standby to take the released Lease", TAKEOVER, || {
        b.leads()
    })
    .await;
    let since_release = released.elapsed();
    println!(
        "takeover after a release: {:.2}s (from the release call: {:.2}s)",
        took.as_secs_f64(),
        since_release.as_secs_f64()
    );
    assert!(
        since_release < LEASE_DURATION,
        "b took {since_release:?}: it waited for the Lease to expire instead of taking the released one"
    );
    drop(b);
    common::kubectl_ok(&["delete", "namespace", &ns, "--wait=false"], None);
}

#[tokio::test]
async fn a_leader_that_finds_another_holder_steps_down_then_takes_the_expired_lease_back() {
    let client = common::kube_client().await;
    let ns = common::namespace("leader-intruder");
    let a = Contender::start(&client, &ns, "intruder", "a");
    poll("the contender to lead", TAKEOVER, || a.leads()).await;
    let mut gate = a.leadership.gate();

    // Someone else writes itself in as holder (guarded by the version it read, like a replica).
    let api = Api::<Lease>::namespaced(client.clone(), &ns);
    let start = Instant::now();
    loop {
        let mut lease = api.get("intruder").await.expect("the Lease exists");
        let now = MicroTime(Timestamp::now());
        lease.spec = Some(LeaseSpec {
            holder_identity: Some("intruder".into()),
            acquire_time: Some(now.clone()),
            renew_time: Some(now),
            ..lease.spec.unwrap_or_default()
        });
        match api
            .replace("intruder", &PostParams::default(), &lease)
            .await
        {
            Ok(_) => break,
            Err(kube::Error::Api(s)) if s.code == 409 => {
                assert!(
                    start.elapsed() < Duration::from_secs(10),
                    "could not write the intruder in for 10s"
                );
            }
            Err(e) => panic!("writing the intruder in: {e}"),
        }
    }
    let stepped_down = Instant::now();
    tokio::time::timeout(Duration::from_secs(10), gate.lost())
        .await
        .expect("the leader noticed within 10s that it lost the Lease");
    println!(
        "stepped down {:.2}s after the Lease was taken from it",
        stepped_down.elapsed().as_secs_f64()
    );
    assert_eq!(a.gauge(), 0.0);

    // The intruder never renews: once its record has stood for its duration, a takes it back.
    let took = poll(
        "the contender to take the expired Lease back",
        TAKEOVER,
        || a.leads(),
    )
    .await;
    println!(
        "took the intruder's expired Lease back after {:.1}s",
        took.as_secs_f64()
    );
    let spec = spec(&client, &ns, "intruder").await;
    assert_eq!(spec.holder_identity.as_deref(), Some("a"));
    assert_eq!(spec.lease_transitions, Some(1));
    drop(a);
    common::kubectl_ok(&["delete", "namespace", &ns, "--wait=false"], None);
}

#[tokio::test]
async fn of_many_contenders_one_leads_and_after_its_death_exactly_one_other() {
    let client = common::kube_client().await;
    let ns = common::namespace("leader-many");
    let mut contenders: Vec<Contender> = (0..6)
        .map(|i| Contender::start(&client, &ns, "many", &format!("c{i}")))
        .collect();
    poll("one of six contenders to lead", TAKEOVER, || {
        contenders.iter().any(Contender::leads)
    })
    .await;
    exactly_one_leads_throughout(
        &contenders.iter().collect::<Vec<_>>(),
        Duration::from_secs(3),
    )
    .await;
    let first = contenders
        .iter()
        .position(Contender::leads)
        .expect("one leads");
    let dead = contenders.remove(first);
    drop(dead);
    // Until someone takes over, nobody leads twice over; then exactly one.
    let start = Instant::now();
    loop {
        let leaders = contenders.iter().filter(|c| c.leads()).count();
        assert!(leaders <= 1, "{leaders} lead at once");
        if leaders == 1 {
            break;
        }
        assert!(
            start.elapsed() < TAKEOVER,
            "waited {TAKEOVER:?} for one of five standbys to take over"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    println!(
        "one of five standbys took over {:.1}s after the leader's death",
        start.elapsed().as_secs_f64()
    );
    exactly_one_leads_throughout(
        &contenders.iter().collect::<Vec<_>>(),
        Duration::from_secs(3),
    )
    .await;
    let holder = spec(&client, &ns, "many").await.holder_identity;
    let leader = contenders.iter().find(|c| c.leads()).expect("one leads");
    assert_eq!(holder.as_deref(), Some(leader.identity.as_str()));
    drop(contenders);
    common::kubectl_ok(&["delete", "namespace", &ns, "--wait=false"], None);
}

#[tokio::test]
async fn without_rights_on_leases_election_stops_with_an_error_saying_what_to_grant() {
    let ns = common::namespace("leader-forbidden");
    let env = common::env();
    let kubeconfig = kube::config::Kubeconfig::read_from(&env.kubeconfig).expect("read kubeconfig");
    let mut config = kube::Config::from_custom_kubeconfig(
        kubeconfig,
        &kube::config::KubeConfigOptions::default(),
    )
    .await
    .expect("kubeconfig is valid");
    // A ServiceAccount granted nothing.
    config.auth_info.impersonate = Some(format!("system:serviceaccount:{ns}:nobody"));
    let client = kube::Client::try_from(config).expect("client");
    let mut c = Contender::start(&client, &ns, "forbidden", "a");
    let error = tokio::time::timeout(Duration::from_secs(30), c.leadership.ended())
        .await
        .expect("leader election stopped within 30s");
    assert!(matches!(error, LeaderError::Forbidden { .. }), "{error:?}");
    let message = error.to_string();
    assert!(
        message.contains(&format!(
            "grant get, create and update on leases (apiGroup coordination.k8s.io) in namespace {ns}"
        )),
        "{message}"
    );
    assert!(!c.leads());
    assert_eq!(c.gauge(), 0.0);
    common::kubectl_ok(&["delete", "namespace", &ns, "--wait=false"], None);
}

#[tokio::test]
async fn a_leader_cut_off_from_the_api_server_stops_leading_before_a_standby_takes_over() {
    let direct = common::kube_client().await;
    let ns = common::namespace("leader-partition");
    let partition = Partition::to_api_server().await;
    let cut_off = partition.client().await;
    let a = Contender::start(&cut_off, &ns, "partition", "a");
    poll(
        "the contender behind the forwarder to lead",
        TAKEOVER,
        || a.leads(),
    )
    .await;
    let b = Contender::start(&direct, &ns, "partition", "b");
    exactly_one_leads_throughout(&[&a, &b], Duration::from_secs(3)).await;
    assert!(a.leads());

    // Every byte between a and the API server stops: its renewals hang.
    partition.pause(true);
    let start = Instant::now();
    let mut a_stopped = None;
    let b_took = loop {
        let (a_leads, b_leads) = (a.leads(), b.leads());
        assert!(
            !(a_leads && b_leads),
            "both lead {:?} after the partition",
            start.elapsed()
        );
        if !a_leads && a_stopped.is_none() {
            a_stopped = Some(start.elapsed());
        }
        if b_leads {
            break start.elapsed();
        }
        assert!(
            start.elapsed() < TAKEOVER,
            "waited {TAKEOVER:?} for the standby to take over from a leader cut off"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let a_stopped = a_stopped.expect("a stopped leading before b took over");
    println!(
        "cut off: a stopped leading after {:.1}s, b took over after {:.1}s",
        a_stopped.as_secs_f64(),
        b_took.as_secs_f64()
    );
    assert_eq!(a.gauge(), 0.0);
    assert_eq!(b.gauge(), 1.0);

    // The partition heals: a finds b's record and stays a standby.
    partition.pause(false);
    exactly_one_leads_throughout(&[&a, &b], Duration::from_secs(4)).await;
    assert!(b.leads());
    assert_eq!(
        spec(&direct, &ns, "partition")
            .await
            .holder_identity
            .as_deref(),
        Some("b")
    );
    drop((a, b));
    common::kubectl_ok(&["delete", "namespace", &ns, "--wait=false"], None);
}

// ---- `settle operator` processes

/// A `settle operator` process; killed when dropped, so a failed assertion leaves nothing running.
struct Operator {
    name: String,
    child: Child,
    metrics_port: u16,
    log: PathBuf,
}

impl Operator {
    /// Starts an operator named `name` (its POD_NAME, so its holder identity) with `extra` args.
    fn start(name: &str, ns: &str, extra: &[&str], env: &[(&str, &str)]) -> Operator {
        let test_env = common::env();
        let metrics_port = free_port();
        let log = common::root().join(format!("target/leader-election-{ns}-{name}.log"));
        let child = Command::new(env!("CARGO_BIN_EXE_settle"))
            .args(["operator", "--log-format", "text"])
            .args(["--webhook-addr", &format!("127.0.0.1:{}", free_port())])
            .args(["--metrics-addr", &format!("127.0.0.1:{metrics_port}")])
            .args(["--probe-addr", "127.0.0.1:0"])
            .args(["--namespace", ns, "--webhook-secret", "settle-leader-tls"])
            .args(["--webhook-configuration", "", "--webhook-ips", "127.0.0.1"])
            // Its controllers reconcile only its own namespace, never another test's objects.
            .args(["--watch-namespaces", ns])
            // The Lease is released at the signal either way; nothing routes reviews here.
            .args(["--shutdown-delay", "0s"])
            .args(extra)
            .env("KUBECONFIG", &test_env.kubeconfig)
            .env("POD_NAME", name)
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("log file"))
            .spawn()
            .expect("start settle operator");
        let op = Operator {
            name: name.to_string(),
            child,
            metrics_port,
            log,
        };
        let start = Instant::now();
        while op
            .get("/readyz")
            .is_none_or(|r| !r.starts_with("HTTP/1.1 200"))
        {
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "operator {name} not ready after 30s; see {}",
                op.log.display()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        op
    }

    fn get(&self, path: &str) -> Option<String> {
        common::http_get(self.metrics_port, path)
    }

    /// What `settle_leader` reads on /metrics, if the process answers.
    fn leader_gauge(&self) -> Option<f64> {
        let metrics = self.get("/metrics")?;
        metrics
            .lines()
            .find_map(|l| l.strip_prefix("settle_leader "))
            .and_then(|v| v.trim().parse().ok())
    }

    fn sigterm(&self) {
        common::process::sigterm(&self.child);
    }

    fn wait_exit(&mut self, limit: Duration) -> ExitStatus {
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return status;
            }
            assert!(
                start.elapsed() < limit,
                "operator {} still running {limit:?} after SIGTERM; see {}",
                self.name,
                self.log.display()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Operator {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Polls until `op` reports `settle_leader` = `want`; returns how long it took.
fn wait_gauge(op: &Operator, want: f64, limit: Duration) -> Duration {
    let start = Instant::now();
    loop {
        if op.leader_gauge() == Some(want) {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < limit,
            "waited {limit:?} for operator {} to report settle_leader {want}; it reports {:?}; see {}",
            op.name,
            op.leader_gauge(),
            op.log.display()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn lease_holder(ns: &str, name: &str) -> String {
    common::kubectl_ok(
        &[
            "get",
            "lease",
            name,
            "-n",
            ns,
            "-o",
            "jsonpath={.spec.holderIdentity}",
        ],
        None,
    )
}

#[test]
fn two_operators_one_leads_a_sigkill_hands_over_within_15s_and_a_sigterm_releases_the_lease() {
    common::install_crds();
    let ns = common::namespace("leader-procs");
    let lease = ["--lease-name", "settle-e2e"];
    let a = Operator::start("op-a", &ns, &lease, &[]);
    let b = Operator::start("op-b", &ns, &lease, &[]);

    // Exactly one reports 1, the other 0.
    let start = Instant::now();
    let (leader, standby) = loop {
        match (a.leader_gauge(), b.leader_gauge()) {
            (Some(1.0), Some(0.0)) => break (a, b),
            (Some(0.0), Some(1.0)) => break (b, a),
            (x, y) => assert!(
                start.elapsed() < Duration::from_secs(30),
                "waited 30s for exactly one operator to lead: op-a {x:?}, op-b {y:?}"
            ),
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(lease_holder(&ns, "settle-e2e"), leader.name);
    // And it stays that way while both run.
    for _ in 0..20 {
        assert_eq!(leader.leader_gauge(), Some(1.0));
        assert_eq!(standby.leader_gauge(), Some(0.0));
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        leader.log_text().contains("became the leader"),
        "the leader logs its transition: {}",
        leader.log_text()
    );

    // SIGKILL the leader: the standby reports 1 within 15 s.
    let killed = leader.name.clone();
    drop(leader);
    let took = wait_gauge(&standby, 1.0, TAKEOVER);
    println!(
        "operator {} took over {:.1}s after {killed} was SIGKILLed",
        standby.name,
        took.as_secs_f64()
    );
    assert_eq!(lease_holder(&ns, "settle-e2e"), standby.name);

    // A third joins as standby; SIGTERM the leader: it clears the holder before it exits.
    let c = Operator::start("op-c", &ns, &lease, &[]);
    wait_gauge(&c, 0.0, Duration::from_secs(10));
    let mut leader = standby;
    let terminated = Instant::now();
    leader.sigterm();
    let status = leader.wait_exit(Duration::from_secs(20));
    assert!(
        status.success(),
        "SIGTERM ends the operator cleanly: {status:?}"
    );
    let holder = lease_holder(&ns, "settle-e2e");
    assert!(
        holder.is_empty() || holder == c.name,
        "after {} exited the Lease is free or op-c's, not {holder:?}",
        leader.name
    );
    let log = leader.log_text();
    assert!(log.contains("released the Lease"), "{log}");
    wait_gauge(&c, 1.0, TAKEOVER);
    let since = terminated.elapsed();
    println!(
        "op-c took over {:.2}s after {} got SIGTERM",
        since.as_secs_f64(),
        leader.name
    );
    assert!(
        since < LEASE_DURATION,
        "op-c took {since:?}: it waited for expiry, so the Lease was not released"
    );
    assert_eq!(lease_holder(&ns, "settle-e2e"), c.name);
    drop(c);
    common::kubectl_ok(&["delete", "namespace", &ns, "--wait=false"], None);
}

#[test]
fn with_leader_election_off_the_operator_leads_alone_and_writes_no_lease() {
    common::install_crds();
    let ns = common::namespace("leader-off");
    let op = Operator::start(
        "op-alone",
        &ns,
        &["--lease-name", "unused"],
        &[("SETTLE_LEADER_ELECTION", "false")],
    );
    wait_gauge(&op, 1.0, Duration::from_secs(10));
    let out = common::kubectl(&["get", "lease", "unused", "-n", &ns], None);
    assert!(!out.status.success(), "no Lease was written");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("NotFound"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    drop(op);
    common::kubectl_ok(&["delete", "namespace", &ns, "--wait=false"], None);
}
