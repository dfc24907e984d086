//! The account's test scene, shared by its suites: an application built on the `settle`
//! library (`examples/account_app.rs`) as a process, a Subscription with its stream, backend and
//! operator, and a watcher that polls `status.stats` and checks that no counter ever steps down
//! (per Subscription object: a Subscription deleted and applied again starts a new run).

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kube::Api;
use settle::api::{ConsumerStats, Subscription, SubscriptionStatus};
use settle_operator::account::ledger::dominates;

use super::operator::{Operator, TestStream, poll};
use super::subs::{apply, backend_yaml, subs, wait_ready};
use super::{install_crds, kubectl_ok, namespace};

/// The test application, killed when dropped; its stdout lines are collected, its log kept
/// beside the test's.
pub struct App {
    child: Child,
    lines: Arc<Mutex<Vec<String>>>,
    log: std::path::PathBuf,
}

static APPS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

impl App {
    /// `account_app` with `handler`, reporting every 100 ms, and the variables `env`, which pick
    /// the broker (`SETTLE_NATS_URL`, `SETTLE_RABBITMQ_URL` or `SETTLE_SQS_ENDPOINT`: none is
    /// inherited).
    pub fn start(env: &[(&str, &str)], manifest: &std::path::Path, handler: &str) -> App {
        let bin = super::example("account_app");
        let log = super::root().join(format!(
            "target/account-app-{}-{}.log",
            std::process::id(),
            APPS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ));
        let mut child = Command::new(&bin)
            .env_remove("SETTLE_NATS_URL")
            .env_remove("SETTLE_RABBITMQ_URL")
            .env_remove("SETTLE_SQS_ENDPOINT")
            .envs(env.iter().copied())
            .env("SETTLE_SUBSCRIPTION_FILE", manifest)
            .env("SETTLE_APP_HANDLER", handler)
            .env("SETTLE_REPORT_INTERVAL", "100ms")
            .env("RUST_LOG", "info")
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).expect("the application's log"))
            .spawn()
            .unwrap_or_else(|e| panic!("run {}: {e}", bin.display()));
        let lines = Arc::new(Mutex::new(Vec::<String>::new()));
        let out = child.stdout.take().expect("stdout");
        let sink = lines.clone();
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines().map_while(Result::ok) {
                sink.lock().expect("lines").push(l);
            }
        });
        App { child, lines, log }
    }

    /// Every line printed so far that starts with `prefix`.
    pub fn lines(&self, prefix: &str) -> Vec<String> {
        self.lines
            .lock()
            .expect("lines")
            .iter()
            .filter(|l| l.starts_with(prefix))
            .cloned()
            .collect()
    }

    pub fn count(&self, prefix: &str) -> usize {
        self.lines
            .lock()
            .expect("lines")
            .iter()
            .filter(|l| l.starts_with(prefix))
            .count()
    }

    /// Waits until at least `n` lines start with `prefix`.
    pub async fn wait_count(&self, prefix: &str, n: usize, limit: Duration) {
        poll(
            &format!(
                "the application to print {n} {prefix:?} line(s) (its log: {})",
                self.log.display()
            ),
            limit,
            || async {
                match self.count(prefix) {
                    c if c >= n => Ok(()),
                    c => Err(format!("{c} so far")),
                }
            },
        )
        .await;
    }

    pub async fn wait_ready(&self) {
        // A minute: on a loaded machine a RabbitMQ application can take a while to subscribe.
        self.wait_count("ready", 1, Duration::from_secs(60)).await;
    }

    /// SIGKILL: nothing is flushed, nothing is closed.
    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM, as Kubernetes stops a pod: the application closes its bus gracefully.
    pub fn sigterm(&self) {
        super::process::sigterm(&self.child);
    }

    /// Waits for the process to exit by itself; true when it said `closed` (a graceful stop).
    pub fn wait_exit(&mut self, limit: Duration) -> bool {
        let start = Instant::now();
        while start.elapsed() < limit {
            if let Ok(Some(_)) = self.child.try_wait() {
                // Let the reader thread take the last lines.
                std::thread::sleep(Duration::from_millis(100));
                return self.count("closed") == 1;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("the application was still running {limit:?} after SIGTERM");
    }
}

impl Drop for App {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// What the watcher saw: `(uid, counters)` of every status polled, in order.
pub type Seen = Arc<Mutex<Vec<(String, ConsumerStats)>>>;

/// Polls Subscription `name`'s `status.stats` every 100 ms until aborted.
pub fn watch(api: &Api<Subscription>, name: &str) -> (Seen, tokio::task::JoinHandle<()>) {
    let seen: Seen = Arc::default();
    let (api, out, name) = (api.clone(), seen.clone(), name.to_string());
    let task = tokio::spawn(async move {
        loop {
            if let Ok(s) = api.get(&name).await
                && let Some(stats) = s.status.and_then(|st| st.stats)
            {
                let uid = s.metadata.uid.unwrap_or_default();
                out.lock().expect("seen").push((uid, stats.counters));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    (seen, task)
}

/// No counter went down between two statuses of the same object.
pub fn assert_never_decreased(seen: &Seen) {
    let seen = seen.lock().expect("seen");
    assert!(!seen.is_empty(), "the watcher saw no status at all");
    for pair in seen.windows(2) {
        if pair[0].0 == pair[1].0 {
            assert!(
                dominates(&pair[1].1, &pair[0].1),
                "a counter went down in status: {:?} then {:?}",
                pair[0].1,
                pair[1].1
            );
        }
    }
}

/// As [`assert_never_decreased`], where the watcher may have seen no status stats at all.
pub fn assert_never_decreased_or_empty(seen: &Seen) {
    if !seen.lock().expect("seen").is_empty() {
        assert_never_decreased(seen);
    }
}

/// Subscription `name`'s counters in status, `None` while status has none (or it cannot be
/// read).
pub async fn reported_in(api: &Api<Subscription>, name: &str) -> Option<ConsumerStats> {
    api.get(name)
        .await
        .ok()
        .and_then(|s| s.status)
        .and_then(|s| s.stats)
        .map(|s| s.counters)
}

/// Subscription `name`'s counters in status (zero while status has none).
pub async fn stats_in(api: &Api<Subscription>, name: &str) -> ConsumerStats {
    reported_in(api, name).await.unwrap_or_default()
}

/// The operator flags of the account scenes: no leader election, status written every second.
pub const OPERATOR_FLAGS: [&str; 3] = ["--leader-election=false", "--stats-interval", "1s"];

/// What every broker's account scene holds: the test's name and namespace, the operator and
/// its flags (for a restart), Subscription `orders` (its manifest also on disk for the
/// application), and the watcher of its status. A broker's scene derefs to it, so
/// `scene.ns`, `scene.op` and `scene.stats()` read the same on every broker.
pub struct Base {
    pub test: String,
    pub ns: String,
    pub manifest: std::path::PathBuf,
    pub api: Api<Subscription>,
    pub op: Operator,
    pub flags: Vec<String>,
    pub seen: Seen,
    watcher: tokio::task::JoinHandle<()>,
}

impl Base {
    /// Applies Subscription `orders` (`manifest_text`) in `ns`, where `op` runs with `flags`,
    /// waits until it is Ready, writes the manifest where the application reads it, and starts
    /// watching its status.
    pub async fn subscribe(
        test: &str,
        ns: String,
        op: Operator,
        flags: &[&str],
        manifest_text: &str,
    ) -> Base {
        apply(&ns, manifest_text);
        let api = subs(&ns).await;
        wait_ready(&api, "orders").await;
        let manifest =
            super::root().join(format!("target/account-{test}-{}.yaml", std::process::id()));
        std::fs::write(&manifest, manifest_text).expect("manifest");
        let (seen, watcher) = watch(&api, "orders");
        Base {
            test: test.to_string(),
            ns,
            manifest,
            api,
            op,
            flags: flags.iter().map(|f| f.to_string()).collect(),
            seen,
            watcher,
        }
    }

    /// The operator again, with the scene's flags (after a kill).
    pub fn restart_operator(&mut self) {
        let flags: Vec<&str> = self.flags.iter().map(String::as_str).collect();
        self.op = Operator::start_with(&self.test, &self.ns, &flags);
    }

    /// Subscription `name`'s counters in status, `None` while status has none.
    pub async fn reported_of(&self, name: &str) -> Option<ConsumerStats> {
        reported_in(&self.api, name).await
    }

    /// Subscription `orders`' counters in status, `None` while status has none.
    pub async fn reported(&self) -> Option<ConsumerStats> {
        self.reported_of("orders").await
    }

    /// Subscription `name`'s counters in status (zero while status has none).
    pub async fn stats_of(&self, name: &str) -> ConsumerStats {
        stats_in(&self.api, name).await
    }

    /// The Subscription now.
    pub async fn sub(&self) -> Subscription {
        self.api.get("orders").await.expect("get the Subscription")
    }

    pub async fn stats(&self) -> ConsumerStats {
        self.stats_of("orders").await
    }

    /// Waits until status shows `want(stats)`.
    pub async fn wait_stats(
        &self,
        what: &str,
        limit: Duration,
        want: impl Fn(&ConsumerStats) -> bool,
    ) -> ConsumerStats {
        wait_until(what, limit, || self.stats(), want).await
    }

    /// Waits until status shows `want(stats)`, then that it stays so for 3 s (nothing more
    /// arrives), and returns it.
    pub async fn settled(
        &self,
        what: &str,
        limit: Duration,
        want: impl Fn(&ConsumerStats) -> bool,
    ) -> ConsumerStats {
        settled_at(what, limit, || self.stats(), want).await
    }

    /// Deletes Subscription `orders` and waits at most `limit` until it is gone.
    pub async fn delete_orders(&self, limit: Duration) {
        kubectl_ok(
            &[
                "delete",
                "subscription",
                "orders",
                "-n",
                &self.ns,
                "--wait=false",
            ],
            None,
        );
        super::subs::wait_gone(&self.api, "orders", limit).await;
    }

    /// The counters never went down in any status observed.
    pub fn assert_never_decreased(&self) {
        assert_never_decreased(&self.seen);
    }

    /// Stops watching, removes the manifest, deletes the namespace (not waiting).
    pub fn finish(self) {
        self.watcher.abort();
        let _ = std::fs::remove_file(&self.manifest);
        kubectl_ok(&["delete", "namespace", &self.ns, "--wait=false"], None);
    }
}

/// Everything one NATS scenario needs: [`Base`] on a stream of the test's own.
pub struct Scene {
    pub base: Base,
    pub stream: TestStream,
    pub manifest_text: String,
    pub nats_url: String,
}

impl std::ops::Deref for Scene {
    type Target = Base;
    fn deref(&self) -> &Base {
        &self.base
    }
}

impl std::ops::DerefMut for Scene {
    fn deref_mut(&mut self) -> &mut Base {
        &mut self.base
    }
}

impl Scene {
    pub async fn new(test: &str, spec: &str) -> Scene {
        Scene::with_flags(test, spec, &OPERATOR_FLAGS).await
    }

    /// A scene whose operator runs with `flags`.
    pub async fn with_flags(test: &str, spec: &str, flags: &[&str]) -> Scene {
        Scene::build(test, spec, flags, &[], None).await
    }

    /// A scene whose operator runs with `flags` and the variables `op_env`, on the nats-server
    /// at `nats_url` (default: the environment's).
    pub async fn build(
        test: &str,
        spec: &str,
        flags: &[&str],
        op_env: &[(&str, &str)],
        nats_url: Option<String>,
    ) -> Scene {
        let nats_url = nats_url.unwrap_or_else(|| super::env().nats_url);
        Scene::build_on(test, spec, flags, op_env, &nats_url, 1).await
    }

    /// As [`Scene::build`], on the servers `nats_url` (comma-separated: a JetStream cluster),
    /// the stream with `replicas`.
    pub async fn build_on(
        test: &str,
        spec: &str,
        flags: &[&str],
        op_env: &[(&str, &str)],
        nats_url: &str,
        replicas: usize,
    ) -> Scene {
        install_crds();
        let ns = namespace(test);
        let nats_url = nats_url.to_string();
        let stream = TestStream::replicated(&nats_url, test, replicas).await;
        let op = Operator::spawn_env(test, &ns, flags, op_env);
        op.wait_ready();
        apply(&ns, &backend_yaml("nats", &nats_url));
        let manifest_text = format!(
            "apiVersion: messaging.settle.dev/v1alpha1\nkind: Subscription\nmetadata: {{name: orders, namespace: {ns}}}\nspec:\n  backendRef: {{name: nats}}\n  pattern: \"{}.>\"\n{spec}",
            stream.prefix
        );
        let base = Base::subscribe(test, ns, op, flags, &manifest_text).await;
        Scene {
            base,
            stream,
            manifest_text,
            nats_url,
        }
    }

    pub fn app(&self, handler: &str) -> App {
        self.app_with(handler, &[])
    }

    /// Another Subscription `name` in the scene's namespace, on a stream of its own.
    pub async fn another(&self, name: &str, spec: &str) -> Other {
        let stream = TestStream::new(&self.nats_url, &format!("{}-{name}", self.test)).await;
        let text = format!(
            "apiVersion: messaging.settle.dev/v1alpha1\nkind: Subscription\nmetadata: {{name: {name}, namespace: {}}}\nspec:\n  backendRef: {{name: nats}}\n  pattern: \"{}.>\"\n{spec}",
            self.ns, stream.prefix
        );
        apply(&self.ns, &text);
        wait_ready(&self.api, name).await;
        let manifest = super::root().join(format!(
            "target/account-{}-{name}-{}.yaml",
            self.test,
            std::process::id()
        ));
        std::fs::write(&manifest, &text).expect("manifest");
        Other { manifest, stream }
    }

    /// An application on another Subscription's manifest.
    pub fn app_on(&self, other: &Other, handler: &str) -> App {
        App::start(
            &[("SETTLE_NATS_URL", self.nats_url.as_str())],
            &other.manifest,
            handler,
        )
    }

    pub fn app_with(&self, handler: &str, env: &[(&str, &str)]) -> App {
        let mut all = vec![("SETTLE_NATS_URL", self.nats_url.as_str())];
        all.extend_from_slice(env);
        App::start(&all, &self.manifest, handler)
    }

    pub async fn publish(&self, bodies: impl IntoIterator<Item = String>) {
        publish_to(&self.stream, bodies).await;
    }

    pub async fn finish(self) {
        self.base.finish();
        self.stream.delete().await;
    }
}

/// Publishes `bodies` to `stream` (`<prefix>.m<i>`), each stored before the next.
pub async fn publish_to(stream: &TestStream, bodies: impl IntoIterator<Item = String>) {
    for (i, body) in bodies.into_iter().enumerate() {
        stream
            .js
            .publish(format!("{}.m{i}", stream.prefix), body.into())
            .await
            .expect("publish")
            .await
            .expect("the stream stored it");
    }
}

/// A second Subscription of a scene, on its own stream.
pub struct Other {
    pub manifest: std::path::PathBuf,
    pub stream: TestStream,
}

impl Other {
    pub async fn publish(&self, bodies: impl IntoIterator<Item = String>) {
        publish_to(&self.stream, bodies).await;
    }

    pub async fn finish(self) {
        let _ = std::fs::remove_file(&self.manifest);
        self.stream.delete().await;
    }
}

pub fn bodies(n: usize) -> Vec<String> {
    (1..=n).map(|i| i.to_string()).collect()
}

/// Always-nack's Subscription: AtLeastOnce, three attempts.
pub const NACK_SPEC: &str = "  mode: AtLeastOnce\n  durableName: orders\n  maxDeliver: 3\n";

/// Waits until the operator has counted at least `n` reports of `outcome` in
/// `settle_account_reports_total` (a report dropped for that reason).
pub async fn wait_dropped(op: &Operator, outcome: &str, n: f64) {
    poll(
        &format!("settle_account_reports_total{{outcome=\"{outcome}\"}} to reach {n}"),
        Duration::from_secs(30),
        || async {
            match op.metric("settle_account_reports_total", &[("outcome", outcome)]) {
                v if v >= n => Ok(()),
                v => Err(format!("{v}")),
            }
        },
    )
    .await;
}

/// A victim's report `real` (its JSON) with `edits` applied: a forgery of it.
pub fn forged(real: &serde_json::Value, edits: &[(&str, serde_json::Value)]) -> Vec<u8> {
    let mut v = real.clone();
    for (path, value) in edits {
        let mut at = &mut v;
        for part in path.split('.') {
            at = &mut at[part];
        }
        *at = value.clone();
    }
    serde_json::to_vec(&v).expect("a report serialises")
}

/// What a broker's account scene offers the scenarios written once for every broker (the NATS
/// [`Scene`], `super::sqs::SqsScene`, RabbitMQ's in `account_rabbitmq.rs`): an application,
/// messages, and its [`Base`] (status, the operator), which it derefs to.
pub trait AccountScene: std::ops::DerefMut<Target = Base> {
    /// An application with `handler` on the scene's Subscription `orders`.
    fn app(&self, handler: &str) -> App;
    /// Publishes `bodies` to the Subscription, each stored before the next.
    fn publish(&self, bodies: Vec<String>) -> impl std::future::Future<Output = ()>;

    /// Replaces a running application by a new instance, as the broker's rollout would: it is
    /// killed (SIGKILL), and a new one that nacks started. SQS stops it gracefully instead (a
    /// SIGKILLed one's open long poll can spend an attempt unseen, semantics Q6, which a test of
    /// its own covers).
    fn replace_app(&self, mut app: App) -> impl std::future::Future<Output = App> {
        app.kill9();
        std::future::ready(self.app("nack"))
    }
}

/// What may happen halfway through the always-nack scenario.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Halfway {
    Nothing,
    /// The operator SIGKILLed, the second half published while it is down, then started again.
    OperatorKilled,
    /// The application replaced by a new instance ([`AccountScene::replace_app`]).
    AppRestarted,
    /// Both: the operator SIGKILLed and the application replaced, so the first instance's counts
    /// live only in what the operator saved; the second half published while it is down.
    OperatorKilledAppReplaced,
}

/// Always nack, maxDeliver 3, 10 messages in two halves, with `halfway` between them: the final
/// account is the same whatever happened (exhausted 10, nacked 30, delivered 30, offered 30),
/// settled, balanced, and no status observed ever went down. Returns it.
pub async fn always_nack_scenario<S: AccountScene>(
    scene: &mut S,
    halfway: Halfway,
) -> ConsumerStats {
    let mut app = scene.app("nack");
    app.wait_ready().await;
    scene.publish(bodies(5)).await;
    wait_for(scene, "the first five messages exhausted in status", |s| {
        s.exhausted == 5 && s.settlement.nacked == 15
    })
    .await;
    let down = matches!(
        halfway,
        Halfway::OperatorKilled | Halfway::OperatorKilledAppReplaced
    );
    if down {
        scene.op.kill9();
    }
    if matches!(
        halfway,
        Halfway::AppRestarted | Halfway::OperatorKilledAppReplaced
    ) {
        app = scene.replace_app(app).await;
        app.wait_ready().await;
    }
    scene.publish(bodies(5)).await;
    if down {
        // Reports and losses while the operator is down wait on the broker.
        tokio::time::sleep(Duration::from_secs(2)).await;
        scene.restart_operator();
    }
    let s = wait_for(scene, "all ten messages exhausted in status", |s| {
        s.exhausted >= 10 && s.settlement.nacked >= 30 && s.delivered >= 30
    })
    .await;
    // Settle a little longer: nothing more may arrive.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let s2 = scene.stats().await;
    assert_eq!(s, s2, "the account kept moving after the work was done");
    assert_eq!(s.exhausted, 10, "{halfway:?}: {s:?}");
    assert_eq!(s.settlement.nacked, 30, "{halfway:?}: {s:?}");
    assert_eq!(s.delivered, 30, "{halfway:?}: {s:?}");
    assert_eq!(s.offered, 30, "{halfway:?}: {s:?}");
    assert_eq!(s.settlement.acked, 0, "{halfway:?}: {s:?}");
    assert!(
        s.balanced(),
        "offered == delivered + released + lost: {s:?}"
    );
    scene.assert_never_decreased();
    drop(app);
    s
}

/// What every broker shows a user after [`always_nack_scenario`] ran with [`Halfway::Nothing`]:
/// `Exhausting` True (MessagesExhausted), its message saying ten messages ran out of attempts;
/// `kubectl describe` with the counts and the condition; ten exhausted on /metrics. Returns the
/// status and that message, for what each broker asserts of its own.
pub async fn assert_always_nack_shown(base: &Base) -> (SubscriptionStatus, String) {
    let st = base.sub().await.status.expect("status");
    let (status, reason, message) =
        super::operator::condition(&st.conditions, "Exhausting").expect("an Exhausting condition");
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("True", "MessagesExhausted"),
        "{message}"
    );
    assert!(
        message.starts_with("10 message(s) ran out of attempts"),
        "{message}"
    );
    let described = kubectl_ok(
        &["describe", "subscription", "orders", "-n", &base.ns],
        None,
    );
    let flat: String = described.split_whitespace().collect::<Vec<_>>().join(" ");
    for want in [
        "Delivered: 30",
        "Exhausted: 10",
        "Nacked: 30",
        "Type: Exhausting",
        "Reason: MessagesExhausted",
    ] {
        assert!(
            flat.contains(want),
            "kubectl describe lacks {want:?}:\n{described}"
        );
    }
    // The same numbers at full resolution on /metrics.
    let labels = [("namespace", base.ns.as_str()), ("subscription", "orders")];
    assert_eq!(
        base.op
            .metric("settle_subscription_exhausted_total", &labels),
        10.0,
        "settle_subscription_exhausted_total"
    );
    (st, message)
}

/// How long [`held_last_attempts_scenario`] waits on a broker, and what counts the exhausted.
pub struct Patience {
    /// For the four last attempts to be held, and then for them to be counted exhausted.
    pub limit: Duration,
    /// How long nothing more may arrive once they are.
    pub quiet: Duration,
    /// Where the exhausted are counted from, as the wait names it.
    pub from: &'static str,
}

/// An application that nacks twice, then holds the last attempt (maxDeliver 3), dies (SIGKILL)
/// holding four: the runtime never counts them. The broker finds their attempts spent when the
/// replacement (started as a Deployment would) next takes from it, and the operator counts each
/// exhausted once: exhausted 4, nacked 8, delivered 8, and no status observed ever went down.
/// Returns the replacement and the final counts.
pub async fn held_last_attempts_scenario<S: AccountScene>(
    scene: &S,
    patience: Patience,
) -> (App, ConsumerStats) {
    let mut app = scene.app("nack-then-hold");
    app.wait_ready().await;
    scene.publish(bodies(4)).await;
    poll(
        "the application to hold four last attempts",
        patience.limit,
        || async {
            match app.count("held") {
                4 => Ok(()),
                n => Err(format!("{n} held")),
            }
        },
    )
    .await;
    scene
        .wait_stats(
            "the first two attempts' nacks in status",
            Duration::from_secs(30),
            |s| s.settlement.nacked == 8,
        )
        .await;
    app.kill9();
    let replacement = scene.app("nack-then-hold");
    replacement.wait_ready().await;
    let s = scene
        .wait_stats(
            &format!("four messages exhausted, from {}", patience.from),
            patience.limit,
            |s| s.exhausted >= 4,
        )
        .await;
    tokio::time::sleep(patience.quiet).await;
    let later = scene.stats().await;
    assert_eq!(
        later.exhausted, 4,
        "counted once each: {s:?} then {later:?}"
    );
    assert_eq!(later.settlement.nacked, 8);
    assert_eq!(
        later.delivered, 8,
        "the held attempts never returned: {later:?}"
    );
    scene.assert_never_decreased();
    (replacement, later)
}

/// The stall window the stall scenario's operator runs with, as `--stall-window` gives it.
pub const STALL_WINDOW: &str = "3s";

/// The stall scenario's operator flags: `--stall-window` beside a scene's own `flags`.
pub fn stall_flags(flags: &[&'static str]) -> Vec<&'static str> {
    let mut all = flags.to_vec();
    all.extend(["--stall-window", STALL_WINDOW]);
    all
}

/// The stall scenario's policy: ackWait 1s, so three ackWaits are within [`STALL_WINDOW`] and
/// the window is the flag's.
pub const STALL_SPEC: &str = "  mode: AtLeastOnce\n  ackWait: 1s\n";

/// Waits until the scene's Subscription shows `Stalled` with `status`; returns its reason and
/// message.
pub async fn wait_stalled<S: AccountScene>(scene: &S, status: &str) -> (String, String) {
    poll(
        &format!("Stalled={status}"),
        Duration::from_secs(60),
        || async {
            let sub = scene.api.get("orders").await.map_err(|e| e.to_string())?;
            let conditions = sub.status.map(|s| s.conditions).unwrap_or_default();
            match super::operator::condition(&conditions, "Stalled") {
                Some((s, reason, message)) if s == status => Ok((reason, message)),
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await
}

/// A handler that blocks forever with three messages pending (semantics C22): once
/// `--stall-window` passed without a handler returning, `Stalled` is True (reason
/// `NothingDelivered`), its message names the three messages and the window, and
/// `settle_subscription_stalled` reads 1; the blocked application replaced by one that acks,
/// the three are acked and `Stalled` turns False, the gauge 0. Delivered stays 0 while blocked,
/// and no status observed ever went down.
pub async fn stalled_scenario<S: AccountScene>(scene: &S) {
    let held = scene.app("hold");
    held.wait_ready().await;
    scene.publish(bodies(3)).await;
    // All three handed to handlers that never return.
    held.wait_count("held", 3, Duration::from_secs(60)).await;
    let (reason, message) = wait_stalled(scene, "True").await;
    println!("Stalled=True ({reason}): {message}");
    assert_eq!(reason, "NothingDelivered", "{message}");
    assert!(
        message.starts_with("3 message(s) pending, nothing delivered since "),
        "the message names what is pending: {message}"
    );
    assert!(
        message.contains(&format!("(window {STALL_WINDOW})")),
        "the message names the window: {message}"
    );
    let labels = [("namespace", scene.ns.as_str()), ("subscription", "orders")];
    assert_eq!(
        scene.op.metric("settle_subscription_stalled", &labels),
        1.0,
        "settle_subscription_stalled while Stalled=True"
    );
    assert_eq!(
        scene.stats().await.delivered,
        0,
        "no handler returned while they were held"
    );

    // Unblocked: the holder goes (SIGKILL), an application that acks takes the three.
    drop(held);
    let acking = scene.app("ack");
    acking.wait_ready().await;
    wait_for(scene, "the three messages acked in status", |s| {
        s.settlement.acked >= 3
    })
    .await;
    let (reason, message) = wait_stalled(scene, "False").await;
    println!("Stalled=False ({reason}): {message}");
    assert!(
        matches!(reason.as_str(), "Delivering" | "NothingPending"),
        "{reason}: {message}"
    );
    poll(
        "settle_subscription_stalled to read 0",
        Duration::from_secs(30),
        || async {
            let v = scene.op.metric("settle_subscription_stalled", &labels);
            if v == 0.0 {
                Ok(())
            } else {
                Err(format!("{v}"))
            }
        },
    )
    .await;
    scene.assert_never_decreased();
}

/// Waits until a scene's status shows `want(stats)`; returns it.
pub async fn wait_for<S: AccountScene>(
    scene: &S,
    what: &str,
    want: impl Fn(&ConsumerStats) -> bool,
) -> ConsumerStats {
    wait_until(what, Duration::from_secs(90), || scene.stats(), want).await
}

/// Waits until `stats()` (a Subscription's counters in status, read anew each time) shows
/// `want`, and returns what it showed.
pub async fn wait_until<F, Fut>(
    what: &str,
    limit: Duration,
    stats: F,
    want: impl Fn(&ConsumerStats) -> bool,
) -> ConsumerStats
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = ConsumerStats>,
{
    poll(what, limit, || async {
        let s = stats().await;
        if want(&s) {
            Ok(s)
        } else {
            Err(format!("{s:?}"))
        }
    })
    .await
}

/// Waits until `stats()` shows `want`, then until two reads 3 s apart agree (nothing more
/// arrives), all within `limit`, and returns what they showed.
///
/// A read can catch the account between two reports of one attempt: a handler settles before it
/// returns, so status may show it acked and not yet delivered (C2 counts on return). The next
/// read moves on from it; what the caller asserts is the value that stays, so a late count is
/// still seen (it makes the value that stays wrong), and one that keeps coming fails here.
pub async fn settled_at<F, Fut>(
    what: &str,
    limit: Duration,
    stats: F,
    want: impl Fn(&ConsumerStats) -> bool,
) -> ConsumerStats
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = ConsumerStats>,
{
    let deadline = Instant::now() + limit;
    let mut s = wait_until(what, limit, &stats, &want).await;
    loop {
        tokio::time::sleep(Duration::from_secs(3)).await;
        let again = stats().await;
        if again == s {
            return again;
        }
        assert!(
            Instant::now() < deadline,
            "the account kept moving after the work was done ({what}): {s:?}, then {again:?}"
        );
        s = again;
    }
}

impl AccountScene for Scene {
    fn app(&self, handler: &str) -> App {
        Scene::app(self, handler)
    }

    async fn publish(&self, bodies: Vec<String>) {
        Scene::publish(self, bodies).await;
    }
}

/// A runtime's stats report (its documented wire format, docs/stats-report.md) for the
/// AtLeastOnce Subscription `sub` (durable name `durable`) in `ns`, from `instance`: the key it
/// is put at in the NATS bucket `settle-stats`, and its body. The bench and the budget test put
/// them as that many application instances would.
pub fn report_of(
    ns: &str,
    sub: &str,
    durable: &str,
    instance: &str,
    sequence: u64,
    stats: ConsumerStats,
) -> (String, Vec<u8>) {
    let report = settle::bus::report::StatsReport {
        version: settle::bus::report::REPORT_VERSION,
        namespace: ns.to_string(),
        subscription: sub.to_string(),
        subscription_uid: None,
        durable_name: Some(durable.to_string()),
        instance: instance.to_string(),
        backend: "nats".into(),
        mode: settle::api::Mode::AtLeastOnce,
        started_at_ms: 0,
        reported_at_ms: 0,
        sequence,
        stats,
        runtime: Default::default(),
    };
    let body = serde_json::to_vec(&report).expect("a report serialises");
    (report.key(), body)
}
