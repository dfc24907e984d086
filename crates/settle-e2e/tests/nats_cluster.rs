//! Settle on a JetStream cluster (`hack/env.sh up --nats-cluster`: three nats-servers on
//! 127.0.0.1), R3 streams and consumers, the operator keeping its capture and buckets at three
//! replicas (`--account-replicas 3`), an application on the `settle` library as a process: the
//! consumer's leader SIGKILLed mid-flow (and started again), the server leading the advisory
//! capture SIGKILLed, a node paused (SIGSTOP) for 30 s. After each, the runtime went on
//! consuming, the operator went on repairing and counting, and status agrees exactly with what
//! the application's handlers saw (a leader change can redeliver: every redelivery a handler ran
//! is counted, and nothing else); `Stranding` stays False, no status ever steps down.
//!
//! The leader test also measures `restartCanSpendUnseenAttempt` (semantics K3): attempts the
//! server counted (a message's delivery count rose) that no handler saw, printed as
//! `unseen attempts: N over K leader kills`. `SETTLE_CLUSTER_KILLS` sets K (default 2).
//!
//! A short fault campaign (docs/guide/chaos.md) runs here too, on the cluster, with a fixed
//! seed: a server SIGKILLed, one paused and the leading operator cut off among the faults, status at rest equal to what the
//! handlers' own files say they did.
//!
//! The scenarios share the cluster's servers, so they run one at a time; every server a test
//! stops is started again by its guard, also when it fails.

use settle_testkit as common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use async_nats::jetstream;
use settle::api::ConsumerStats;
use settle::backend::nats::capture::CAPTURE_STREAM;
use settle::backend::nats::{admin, mapping};
use settle::policy::ResolvedPolicy;
use tokio::sync::Mutex;

use common::account::{App, Scene};
use common::nats_cluster::{Cluster, cluster, index_of, publish_through};
use common::operator::{condition, poll};

/// Held for a whole scenario (each test has its own runtime; a tokio lock is not poisoned by a
/// failed one).
static ONE_AT_A_TIME: Mutex<()> = Mutex::const_new(());

/// The account's operator flags, with its capture and buckets at three replicas.
const FLAGS: [&str; 5] = [
    "--leader-election=false",
    "--stats-interval",
    "1s",
    "--account-replicas",
    "3",
];

/// Declines come back after 200 ms; an attempt not acked is offered again after 2 s.
const NACK_FIRST_SPEC: &str = "  mode: AtLeastOnce\n  durableName: orders\n  maxDeliver: 5\n  ackWait: 2s\n  backoff: {initial: 200ms, max: 1s, multiplier: 2}\n";

/// A scene on the cluster: the stream R3 (its consumer inherits three replicas).
async fn scene(test: &str, spec: &str) -> (Cluster, Scene, jetstream::Context) {
    let cluster = cluster();
    cluster.wait_healthy().await;
    let scene = Scene::build_on(test, spec, &FLAGS, &[], &cluster.url_list(), 3).await;
    let js = cluster.js().await;
    (cluster, scene, js)
}

/// The messages `<tag>-0` … `<tag>-<n-1>`.
fn batch(tag: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{tag}-{i}")).collect()
}

/// Each message's attempts, as the handlers saw them (`seen <body> <attempt>` lines).
fn attempts_seen(app: &App) -> BTreeMap<String, Vec<u32>> {
    let mut seen: BTreeMap<String, Vec<u32>> = BTreeMap::new();
    for line in app.lines("seen ") {
        let mut parts = line.split_whitespace().skip(1);
        let (Some(body), Some(attempt)) = (parts.next(), parts.next()) else {
            continue;
        };
        let attempt = attempt.parse().expect("an attempt number");
        seen.entry(body.to_string()).or_default().push(attempt);
    }
    seen
}

/// Waits until the server holds nothing for the consumer (none pending, none unacknowledged)
/// and every message of `sent` was acked by a handler (an attempt after the first).
async fn wait_all_acked(scene: &Scene, js: &jetstream::Context, app: &App, sent: &[String]) {
    poll(
        "every message acked and nothing held on the server",
        Duration::from_secs(90),
        || async {
            let seen = attempts_seen(app);
            let unacked = sent
                .iter()
                .filter(|b| !seen.get(*b).is_some_and(|a| a.iter().any(|&n| n >= 2)))
                .count();
            let info = admin::consumer_info(js, &scene.stream.name, "orders")
                .await
                .map_err(|e| e.to_string())?
                .ok_or("no consumer")?;
            if unacked == 0 && info.num_pending == 0 && info.num_ack_pending == 0 {
                Ok(())
            } else {
                Err(format!(
                    "{unacked} not acked by a handler; server: {} pending, {} unacknowledged",
                    info.num_pending, info.num_ack_pending
                ))
            }
        },
    )
    .await;
}

/// Once every message of `sent` is acked: status shows exactly what the handlers saw (acked =
/// the attempts after the first, delivered = all, nothing given up, stranded or exhausted),
/// stays so, `Stranding` is False, no status stepped down. Every first attempt is nacked; a
/// decline the server did not confirm in time (a consumer between leaders answered late) is
/// also Refused (semantics C6: counted in both), never Stranded, and its message comes back.
/// Returns the counts and the attempts the server spent that no handler saw (a message seen at
/// attempts 1 and 3 had attempt 2 spent unseen).
async fn assert_exact(
    scene: &Scene,
    js: &jetstream::Context,
    app: &App,
    sent: &[String],
) -> (ConsumerStats, u64) {
    wait_all_acked(scene, js, app, sent).await;
    let seen = attempts_seen(app);
    let handled: u64 = seen.values().map(|a| a.len() as u64).sum();
    let firsts = seen.values().flatten().filter(|&&n| n == 1).count() as u64;
    let s = scene
        .settled(
            "status to show what the handlers saw",
            Duration::from_secs(60),
            |s| s.delivered == handled && s.settlement.acked + s.settlement.nacked == handled,
        )
        .await;
    assert_eq!(
        attempts_seen(app),
        seen,
        "no handler ran once all was acked"
    );
    assert_eq!(s.delivered, handled, "every handler's return: {s:?}");
    assert_eq!(
        s.settlement.nacked, firsts,
        "first attempts, each declined: {s:?}"
    );
    assert!(s.settlement.refused <= firsts, "{s:?}");
    assert_eq!(
        s.settlement.acked,
        handled - firsts,
        "later attempts: {s:?}"
    );
    assert_eq!(
        (s.stranded, s.exhausted, s.released, s.lost),
        (0, 0, 0, 0),
        "nothing stranded, exhausted or given up: {s:?}"
    );
    assert_eq!(s.offered, s.delivered, "{s:?}");
    assert!(
        s.balanced(),
        "offered == delivered + released + lost: {s:?}"
    );
    assert!(
        s.settlement.acked >= sent.len() as u64,
        "each message acked at least once: {s:?}"
    );
    let st = scene.sub().await.status.expect("status");
    let (status, reason, message) =
        condition(&st.conditions, "Stranding").expect("a Stranding condition");
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("False", "NoneStranded"),
        "{message}"
    );
    scene.assert_never_decreased();
    // A gap in a message's attempt numbers is an attempt spent unseen; a number seen twice, a
    // delivery the server sent again without counting it (a new leader behind the old one).
    let (mut unseen, mut repeated) = (0u64, 0u64);
    for a in seen.values() {
        let mut distinct = a.clone();
        distinct.sort_unstable();
        distinct.dedup();
        unseen += u64::from(*distinct.last().unwrap_or(&0)) - distinct.len() as u64;
        repeated += (a.len() - distinct.len()) as u64;
    }
    eprintln!(
        "{} messages: {handled} attempts handled ({} acks, {} of them again after an ack; {} declines refused), {unseen} spent unseen, {repeated} attempt numbers seen again; status {s:?}",
        sent.len(),
        s.settlement.acked,
        s.settlement.acked - sent.len() as u64,
        s.settlement.refused
    );
    (s, unseen)
}

/// An edit of the consumer on the broker is undone by the operator.
async fn drift_repaired(scene: &Scene, js: &jetstream::Context) {
    let sub = scene.sub().await;
    let mut edited = mapping::desired(
        &scene.ns,
        "orders",
        &scene.stream.name,
        &ResolvedPolicy::resolve(&sub.spec.policy),
    );
    edited.max_ack_pending = 3;
    poll(
        "the edit made on the broker",
        Duration::from_secs(30),
        || async {
            admin::update_consumer(js, &edited)
                .await
                .map_err(|e| e.to_string())
        },
    )
    .await;
    let start = Instant::now();
    poll("the edit to be undone", Duration::from_secs(30), || async {
        let info = admin::consumer_info(js, &scene.stream.name, "orders")
            .await
            .map_err(|e| e.to_string())?
            .ok_or("gone")?;
        match info.config.max_ack_pending {
            250 => Ok(()),
            n => Err(format!("max_ack_pending {n}")),
        }
    })
    .await;
    eprintln!("drift undone {:?} after the edit", start.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_consumer_leader_killed_mid_flow_loses_no_count_and_strands_nothing() {
    let _one = ONE_AT_A_TIME.lock().await;
    let (cluster, scene, js) = scene("cl-leader", NACK_FIRST_SPEC).await;
    let kills: usize = std::env::var("SETTLE_CLUSTER_KILLS")
        .ok()
        .and_then(|k| k.parse().ok())
        .unwrap_or(2);
    // Each handler takes a second: the declines of those running when the leader dies are sent
    // while the consumer has none (nobody answers them, or the answer comes late).
    let app = scene.app_with("nack-first", &[("SETTLE_APP_HANDLE_MS", "1000")]);
    app.wait_ready().await;
    let mut sent = Vec::new();
    for k in 0..kills {
        let messages = batch(&format!("k{k}"), 20);
        let before = app.count("seen ");
        publish_through(&js, &scene.stream.prefix, &messages[..10]).await;
        // Mid-flow: some handled, some waiting, declines coming back.
        app.wait_count("seen ", before + 5, Duration::from_secs(30))
            .await;
        let leader = Cluster::wait_consumer_leader(&js, &scene.stream.name, "orders", "").await;
        let down = cluster.kill(index_of(&leader));
        let killed = Instant::now();
        publish_through(&js, &scene.stream.prefix, &messages[10..]).await;
        let new = Cluster::wait_consumer_leader(&js, &scene.stream.name, "orders", &leader).await;
        eprintln!(
            "kill {k}: {leader} killed, {new} leads the consumer {:?} later",
            killed.elapsed()
        );
        if k == 0 {
            // The operator repairs drift while a server is down.
            drift_repaired(&scene, &js).await;
        }
        down.restart();
        cluster.wait_healthy().await;
        sent.extend(messages);
    }
    let (_, unseen) = assert_exact(&scene, &js, &app, &sent).await;
    eprintln!("unseen attempts: {unseen} over {kills} leader kills");
    assert_eq!(
        scene
            .sub()
            .await
            .status
            .and_then(|st| condition(&st.conditions, "Ready"))
            .map(|c| c.0),
        Some("True".to_string()),
        "the Subscription is Ready"
    );
    drop(app);
    scene.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_killed_under_the_capture_stream_loses_no_advisory() {
    let _one = ONE_AT_A_TIME.lock().await;
    let (cluster, scene, js) = scene(
        "cl-capture",
        "  mode: AtLeastOnce\n  durableName: orders\n  maxDeliver: 2\n  ackWait: 2s\n",
    )
    .await;
    // The server to kill leads the capture, and neither leads the consumer nor serves the
    // application: the consumer's leader emits the advisories, and one killed with it (or an
    // application reconnecting, its leases not extended meanwhile) would have the held attempts
    // expire while the capture had no leader (docs/semantics.md J10: what fires then is not
    // captured).
    let consumer_leader =
        Cluster::wait_consumer_leader(&js, &scene.stream.name, "orders", "").await;
    // The operator keeps the capture at three replicas; killed while the other two are still
    // copying it, no leader could be elected (the broker's, not the account's, limit).
    let mut leader = Cluster::wait_stream_replicated(&js, CAPTURE_STREAM).await;
    while leader == consumer_leader {
        leader = Cluster::step_down_stream(&js, CAPTURE_STREAM, &leader).await;
    }
    let elsewhere: Vec<String> = (0..cluster.urls.len())
        .filter(|&i| i != index_of(&leader))
        .map(|i| cluster.urls[i].clone())
        .collect();
    let mut app = scene.app_with(
        "nack-then-hold",
        &[("SETTLE_NATS_URL", elsewhere.join(",").as_str())],
    );
    app.wait_ready().await;
    let messages = batch("c", 4);
    publish_through(&js, &scene.stream.prefix, &messages).await;
    app.wait_count("held", 4, Duration::from_secs(40)).await;
    scene
        .wait_stats(
            "the four first attempts' nacks",
            Duration::from_secs(30),
            |s| s.settlement.nacked == 4,
        )
        .await;
    assert_eq!(
        Cluster::wait_stream_replicated(&js, CAPTURE_STREAM).await,
        leader,
        "the capture's leader moved meanwhile"
    );
    let down = cluster.kill(index_of(&leader));
    let new = Cluster::wait_stream_leader(&js, CAPTURE_STREAM, &leader).await;
    eprintln!("{leader} killed under the capture; {new} leads it, {consumer_leader} the consumer");
    // The holder dies with four last attempts: only the broker's advisories can count them,
    // emitted by the consumer's leader once their ack wait is up (nats-server 2.15; earlier
    // ones, at the next pull), into a capture one of whose servers is down. The replacement
    // shows that they never come back.
    app.kill9();
    let replacement = scene.app("nack-then-hold");
    replacement.wait_ready().await;
    let s = scene
        .wait_stats(
            "four messages exhausted, from the broker's advisories",
            Duration::from_secs(60),
            |s| s.exhausted >= 4,
        )
        .await;
    down.restart();
    cluster.wait_healthy().await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let later = scene.stats().await;
    assert_eq!(
        later.exhausted, 4,
        "each counted once: {s:?} then {later:?}"
    );
    assert_eq!(later.settlement.nacked, 4, "{later:?}");
    assert_eq!(
        later.delivered, 4,
        "the held attempts never returned: {later:?}"
    );
    assert_eq!(later.stranded, 0, "{later:?}");
    scene.assert_never_decreased();
    drop(replacement);
    scene.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_paused_for_thirty_seconds_converges_with_exact_counts() {
    let _one = ONE_AT_A_TIME.lock().await;
    let (cluster, scene, js) = scene("cl-pause", NACK_FIRST_SPEC).await;
    let app = scene.app("nack-first");
    app.wait_ready().await;
    let messages = batch("p", 20);
    publish_through(&js, &scene.stream.prefix, &messages[..10]).await;
    app.wait_count("seen ", 5, Duration::from_secs(30)).await;
    let leader = Cluster::wait_consumer_leader(&js, &scene.stream.name, "orders", "").await;
    // Cut off as a partition would: its connections stay open and silent. The test's own
    // client is one of the other two servers'; the application's and the operator's are
    // wherever they were.
    let js = cluster.js_without(index_of(&leader)).await;
    let paused = cluster.pause(index_of(&leader));
    let since = Instant::now();
    publish_through(&js, &scene.stream.prefix, &messages[10..]).await;
    let new = Cluster::wait_consumer_leader(&js, &scene.stream.name, "orders", &leader).await;
    eprintln!(
        "{leader} paused; {new} leads the consumer {:?} later",
        since.elapsed()
    );
    tokio::time::sleep(Duration::from_secs(30).saturating_sub(since.elapsed())).await;
    paused.resume();
    cluster.wait_healthy().await;
    let (_, unseen) = assert_exact(&scene, &js, &app, &messages).await;
    eprintln!("unseen attempts: {unseen} over a 30 s pause of the consumer's leader");
    drop(app);
    scene.finish().await;
}

/// The campaign of seed 214 on the cluster: the consumer deleted on the broker, an application
/// replaced, the Subscription deleted and applied again, the leading operator SIGTERMed, a
/// server paused, a server down twice; every discrepancy a failure.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_short_campaign_of_a_fixed_seed_on_the_cluster_finds_no_discrepancy() {
    let _one = ONE_AT_A_TIME.lock().await;
    let broker = common::chaos::Broker::NatsCluster;
    let report = common::chaos::run(
        broker,
        &common::chaos::Campaign {
            seed: 214,
            faults: 7,
            // The schedule it drew before later kinds of fault were added.
            kinds: 14,
            messages: 150,
            every: Duration::from_secs(5),
        },
        None,
    )
    .await;
    report.assert_none_found(broker);
}
