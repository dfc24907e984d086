//! Migrating from NACK with messages in flight: NACK's own controller (built from its Go module,
//! `hack/tools.sh build nack`) makes the consumers from its Consumer resources; an application
//! fetches some messages and never acknowledges them while others wait; NACK is stopped;
//! `settle import nack --from-cluster` writes the Subscriptions (the same as
//! `kubectl settle import nack -f` on the exported YAML); applied, Settle's operator takes over
//! the very consumers (their creation time kept) and the `settle` runtime consumes: every message
//! is acked exactly once by a handler, the only redeliveries are the fetched-and-unacked ones,
//! once each after their ackWait ran out, and status counts exactly that.

use settle_testkit as common;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::consumer::PullConsumer;
use futures::StreamExt;
use settle::api::Subscription;
use settle::backend::nats::NatsBroker;
use settle::bus::{Bus, Subscriber, handler};

use common::account::{OPERATOR_FLAGS, wait_until};
use common::nack::{Nack, install_nack_crds};
use common::operator::{Operator, TestStream, poll};
use common::subs::{subs, wait_event, wait_ready};
use common::{env, install_crds, kubectl, kubectl_ok, namespace};

/// Messages published for each consumer, and how many of them an application fetches and
/// leaves unacknowledged before the move.
const PUBLISHED: usize = 20;
const IN_FLIGHT: usize = 5;
/// The consumers' ackWait: what the fetched messages wait out before they come back.
const ACK_WAIT: &str = "4s";

/// The NACK resources: two Consumers with acks Settle can take over as they are, one left to
/// NACK's defaults (no acks: taken over as AtMostOnce, flagged unsafe), and one with acks left to
/// NACK's default ackWait (1ns), which the import flags and holds back.
fn nack_resources(ns: &str, stream: &TestStream, nats: &str) -> String {
    let consumer = |name: &str, extra: &str| {
        format!(
            "---\napiVersion: jetstream.nats.io/v1beta2\nkind: Consumer\nmetadata: {{name: {name}, namespace: {ns}}}\nspec:\n  servers: [\"{nats}\"]\n  streamName: {stream}\n  durableName: {name}\n  filterSubject: \"{prefix}.{name}.>\"\n  ackPolicy: explicit\n  maxDeliver: 5\n{extra}",
            stream = stream.name,
            prefix = stream.prefix
        )
    };
    [
        consumer(
            "orders",
            &format!("  ackWait: {ACK_WAIT}\n  maxAckPending: 100\n"),
        ),
        consumer(
            "audit",
            &format!("  ackWait: {ACK_WAIT}\n  preventDelete: true\n"),
        ),
        consumer("fast", ""),
        consumer("tail", "").replace("  ackPolicy: explicit\n  maxDeliver: 5\n", ""),
    ]
    .concat()
}

#[tokio::test(flavor = "multi_thread")]
async fn consumers_nack_made_move_to_settle_with_their_messages_in_flight() {
    install_crds();
    install_nack_crds();
    let test = "nack-migration";
    let ns = namespace(test);
    let e = env();
    // The stream is NATS's, made beside NACK (Streams stay where they are; Settle never makes one).
    let stream = TestStream::new(&e.nats_url, test).await;

    // 1. NACK makes the consumers from its resources.
    let mut nack = Nack::start(test, &ns);
    kubectl_ok(
        &["apply", "-f", "-"],
        Some(&nack_resources(&ns, &stream, &e.nats_url)),
    );
    let mut created = BTreeMap::new();
    for name in ["orders", "audit", "fast", "tail"] {
        let info = poll(
            &format!(
                "NACK to make consumer {name} (its log: {})",
                nack.log.display()
            ),
            Duration::from_secs(60),
            || async { stream.consumer(name).await.ok_or("not yet".to_string()) },
        )
        .await;
        assert!(
            info.config
                .metadata
                .keys()
                .all(|k| !k.starts_with("settle.dev/")),
            "NACK's consumer carries no Settle mark: {:?}",
            info.config.metadata
        );
        created.insert(name, info.created);
    }
    assert_eq!(
        stream.consumer("fast").await.expect("fast").config.ack_wait,
        Duration::from_nanos(1),
        "NACK's default ackWait is 1ns"
    );

    // 2. Messages: some fetched by an application and never acknowledged, the rest waiting.
    let mut fetched_before: BTreeMap<&str, Vec<String>> = BTreeMap::new();
    for name in ["orders", "audit"] {
        for i in 0..PUBLISHED {
            stream
                .js
                .publish(
                    format!("{}.{name}.m{i}", stream.prefix),
                    format!("{name}-{i}").into(),
                )
                .await
                .expect("publish")
                .await
                .expect("stored");
        }
        let consumer: PullConsumer = stream
            .js
            .get_stream(&stream.name)
            .await
            .expect("stream")
            .get_consumer(name)
            .await
            .expect("consumer");
        let mut batch = consumer
            .fetch()
            .max_messages(IN_FLIGHT)
            .messages()
            .await
            .expect("fetch");
        let mut bodies = Vec::new();
        while let Some(m) = batch.next().await {
            bodies.push(String::from_utf8_lossy(&m.expect("message").payload).to_string());
        }
        assert_eq!(bodies.len(), IN_FLIGHT, "{name}: fetched");
        fetched_before.insert(name, bodies);
        let info = stream.consumer(name).await.expect("consumer");
        assert_eq!(
            (info.num_ack_pending, info.num_pending),
            (IN_FLIGHT, (PUBLISHED - IN_FLIGHT) as u64),
            "{name}: in flight and waiting before the move"
        );
    }

    // 3. NACK stops; the import reads its resources from the cluster.
    nack.stop();
    let settle = env!("CARGO_BIN_EXE_settle");
    let out = std::process::Command::new(settle)
        .args(["import", "nack", "--from-cluster", "-n", &ns])
        .env("KUBECONFIG", &e.kubeconfig)
        .output()
        .expect("run settle import nack");
    let (yaml, report) = (
        String::from_utf8_lossy(&out.stdout).to_string(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    );
    println!(
        "settle import nack --from-cluster -n {ns}\n--- stderr ---\n{report}--- stdout ---\n{yaml}"
    );
    assert_eq!(
        out.status.code(),
        Some(1),
        "exit 1: one Consumer would change behaviour\n{report}"
    );
    assert!(
        report.contains(&format!("NACK Consumer {ns}/fast -> Subscription {ns}/fast (consumer {}/fast): NOT WRITTEN: it would change behaviour", stream.name))
            && report.contains("change  spec.ackWait: 1ns (NACK's default"),
        "the unsafe default is flagged and held back:\n{report}"
    );
    assert!(
        report.contains(&format!(
            "NACK Consumer {ns}/tail -> Subscription {ns}/tail (consumer {}/tail): written",
            stream.name
        )) && report.contains("unsafe  spec.ackPolicy: none (NACK's default"),
        "NACK's default ackPolicy is carried over as AtMostOnce and flagged:\n{report}"
    );
    assert!(
        report
            .contains("4 NACK Consumers: 3 written, 1 not written (changes behaviour), 0 refused"),
        "{report}"
    );
    // The same from the exported YAML, through the kubectl plugin.
    let exported = kubectl_ok(
        &[
            "get",
            "consumers.jetstream.nats.io,streams.jetstream.nats.io",
            "-n",
            &ns,
            "-o",
            "yaml",
        ],
        None,
    );
    let plugin = std::process::Command::new(common::bin("kubectl-settle"))
        .args(["import", "nack", "-n", &ns, "-f", "-"])
        .env("KUBECONFIG", &e.kubeconfig)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run kubectl-settle");
    {
        use std::io::Write;
        let mut stdin = plugin.stdin.as_ref().expect("stdin");
        stdin
            .write_all(exported.as_bytes())
            .expect("write the export");
    }
    let plugin = plugin.wait_with_output().expect("kubectl-settle output");
    assert_eq!(plugin.status.code(), Some(1));
    assert_eq!(
        String::from_utf8_lossy(&plugin.stdout),
        yaml,
        "kubectl settle import nack -f on the export writes what --from-cluster does"
    );

    // 4. Settle's operator takes the consumers over: Ready, the same consumers.
    let mut flags = OPERATOR_FLAGS.to_vec();
    flags.extend(["--adopt-namespaces", ns.as_str()]);
    let op = Operator::start_with(test, &ns, &flags);
    let applied = kubectl(&["apply", "-f", "-"], Some(&yaml));
    assert!(
        applied.status.success(),
        "the import's output applies as it is: {}",
        String::from_utf8_lossy(&applied.stderr)
    );
    let api = subs(&ns).await;
    let mut specs = BTreeMap::new();
    for name in ["orders", "audit", "tail"] {
        let sub = wait_ready(&api, name).await;
        let info = stream
            .consumer(name)
            .await
            .expect("the consumer is still there");
        assert_eq!(
            info.created, created[name],
            "{name}: the consumer NACK made, taken over (not made again)"
        );
        assert_eq!(
            info.config
                .metadata
                .get("settle.dev/subscription")
                .map(String::as_str),
            Some(format!("{ns}/{name}").as_str()),
            "{name}: marked as Settle's"
        );
        let said = wait_event(&ns, name, "Adopted").await;
        assert!(said.contains("the same consumer"), "{name}: {said}");
        println!("{name}: Event Adopted: {said}");
        specs.insert(name, sub);
    }
    assert!(
        api.get_opt("fast").await.expect("get fast").is_none(),
        "the held-back Subscription was not applied"
    );
    assert_eq!(
        specs.remove("tail").expect("tail").spec.policy.mode,
        settle::api::Mode::AtMostOnce,
        "ackPolicy none, taken over as AtMostOnce"
    );
    assert_eq!(
        specs["audit"].spec.deletion_policy,
        settle::api::DeletionPolicy::Retain,
        "preventDelete: true became Retain"
    );

    // 5. The settle runtime consumes: every message acked once; the fetched ones come back once.
    let seen: Arc<Mutex<Vec<(String, String, u32)>>> = Arc::default();
    let broker = NatsBroker::connect(&e.nats_url).await.expect("connect");
    let bus = Bus::builder(broker)
        .namespace(ns.clone())
        .report_interval(Duration::from_millis(200))
        .build();
    for (name, sub) in &specs {
        let seen = seen.clone();
        let name = name.to_string();
        let sub: &Subscription = sub;
        bus.subscribe(Subscriber::from_resource(
            name.clone(),
            &sub.spec,
            handler(move |d| {
                let seen = seen.clone();
                let name = name.clone();
                async move {
                    let body = String::from_utf8_lossy(d.payload()).to_string();
                    seen.lock().expect("seen").push((name, body, d.attempt()));
                    Ok::<(), settle::bus::HandlerError>(d.ack().await?)
                }
            }),
        ))
        .await
        .expect("subscribe");
    }
    for name in ["orders", "audit"] {
        wait_until(
            &format!("{name}: every message acked in status"),
            Duration::from_secs(60),
            || async {
                api.get(name)
                    .await
                    .ok()
                    .and_then(|s| s.status)
                    .and_then(|s| s.stats)
                    .map(|s| s.counters)
                    .unwrap_or_default()
            },
            |c| c.settlement.acked >= PUBLISHED as u64,
        )
        .await;
    }
    bus.close().await;

    let seen = seen.lock().expect("seen").clone();
    for name in ["orders", "audit"] {
        let mine: Vec<&(String, String, u32)> = seen.iter().filter(|(n, ..)| n == name).collect();
        let mut bodies: Vec<&str> = mine.iter().map(|(_, b, _)| b.as_str()).collect();
        bodies.sort();
        let mut want: Vec<String> = (0..PUBLISHED).map(|i| format!("{name}-{i}")).collect();
        want.sort();
        assert_eq!(
            bodies, want,
            "{name}: each message handled and acked exactly once, none lost"
        );
        for (_, body, attempt) in &mine {
            let was_in_flight = fetched_before[name].contains(body);
            assert_eq!(
                *attempt,
                if was_in_flight { 2 } else { 1 },
                "{name}: {body}: only what was in flight comes back, once, after its ackWait"
            );
        }
        let stats = api
            .get(name)
            .await
            .expect("get")
            .status
            .and_then(|s| s.stats)
            .expect("stats");
        let c = &stats.counters;
        assert_eq!(
            (
                c.offered,
                c.delivered,
                c.settlement.acked,
                c.settlement.nacked,
                c.settlement.silent,
                c.exhausted,
                c.stranded
            ),
            (
                PUBLISHED as u64,
                PUBLISHED as u64,
                PUBLISHED as u64,
                0,
                0,
                0,
                0
            ),
            "{name}: the account counts exactly what the handlers did: {c:?}"
        );
        let info = stream.consumer(name).await.expect("consumer");
        assert_eq!(
            (info.num_ack_pending, info.num_pending),
            (0, 0),
            "{name}: nothing left"
        );
        assert_eq!(
            info.created, created[name],
            "{name}: still the same consumer"
        );
        println!(
            "{name}: {} messages acked once each, {} of them (in flight at the move) as attempt 2; status {c:?}",
            bodies.len(),
            fetched_before[name].len()
        );
    }

    // 6. What the import held back, accepted with --allow-changes: the same consumer, its unsafe
    // 1ns ackWait brought to Settle's 30s in place.
    let out = std::process::Command::new(settle)
        .args([
            "import",
            "nack",
            "--from-cluster",
            "-n",
            &ns,
            "--allow-changes",
        ])
        .env("KUBECONFIG", &e.kubeconfig)
        .output()
        .expect("run settle import nack --allow-changes");
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    kubectl_ok(
        &["apply", "-f", "-"],
        Some(&String::from_utf8_lossy(&out.stdout)),
    );
    wait_ready(&api, "fast").await;
    let fast = stream.consumer("fast").await.expect("fast");
    assert_eq!(
        (fast.created, fast.config.ack_wait),
        (created["fast"], Duration::from_secs(30)),
        "fast: taken over, its ackWait changed in place"
    );

    // 7. NACK's resources go; with its controller stopped, the consumers stay Settle's.
    kubectl_ok(
        &["delete", "consumers.jetstream.nats.io", "--all", "-n", &ns],
        None,
    );
    for name in ["orders", "audit", "fast", "tail"] {
        assert_eq!(
            stream.consumer(name).await.map(|i| i.created),
            Some(created[name]),
            "{name}: still there after NACK's Consumer resource is deleted"
        );
    }

    drop(op);
    kubectl_ok(&["delete", "namespace", &ns, "--wait=false"], None);
    stream.delete().await;
}

/// `settle import nack -f`, offline: what it writes, where, and its exit status.
#[test]
fn import_from_files_says_in_its_exit_status_what_it_wrote() {
    let dir = tempfile::tempdir().expect("temp dir");
    let consumer = |name: &str, extra: &str| {
        format!(
            "---\napiVersion: jetstream.nats.io/v1beta2\nkind: Consumer\nmetadata: {{name: {name}, namespace: shop}}\nspec:\n  servers: [\"nats://nats.messaging:4222\"]\n  streamName: ORDERS\n  durableName: {name}\n  filterSubject: orders.{name}\n  ackPolicy: explicit\n  ackWait: 30s\n{extra}"
        )
    };
    let run = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_settle"))
            .args(["import", "nack"])
            .args(args)
            .env_remove("KUBECONFIG")
            .output()
            .expect("run settle import nack");
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).to_string(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    };
    let clean = dir.path().join("clean.yaml");
    std::fs::write(&clean, consumer("orders", "")).expect("write");
    let out_dir = dir.path().join("out");
    let (code, stdout, stderr) = run(&[
        "-f",
        common::path_str(&clean),
        "-o",
        common::path_str(&out_dir),
    ]);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(stdout.is_empty(), "-o writes files, not stdout: {stdout}");
    let written = std::fs::read_to_string(out_dir.join("shop.yaml")).expect("out/shop.yaml");
    assert!(
        written.contains("kind: Subscription") && written.contains("adopt: IfCompatible"),
        "{written}"
    );
    assert!(stderr.contains("wrote "), "{stderr}");

    let changed = dir.path().join("changed.yaml");
    std::fs::write(
        &changed,
        consumer("orders", "") + &consumer("late", "  deliverPolicy: new\n"),
    )
    .expect("write");
    let (code, stdout, stderr) = run(&["-f", common::path_str(&changed)]);
    assert_eq!(code, Some(1), "a change without --allow-changes: {stderr}");
    assert!(
        stderr.contains("change  spec.deliverPolicy: new"),
        "{stderr}"
    );
    assert_eq!(
        stdout.matches("\nkind: Subscription").count(),
        1,
        "only orders is written:\n{stdout}"
    );
    let (code, stdout, _) = run(&["-f", common::path_str(&changed), "--allow-changes"]);
    assert_eq!(code, Some(0));
    assert_eq!(
        stdout.matches("\nkind: Subscription").count(),
        2,
        "{stdout}"
    );

    let (code, _, stderr) = run(&["-f", common::path_str(&dir.path().join("missing.yaml"))]);
    assert_eq!(code, Some(2), "{stderr}");
}
