//! The fault campaign (docs/guide/chaos.md): a Subscription on the real API server and broker,
//! the operator as two processes with leader election, applications on the `settle` runtime
//! whose handler answers each attempt by a rule drawn from the seed (the example's `model`
//! handler) and writes every answer to a file, a publisher that gives every message an id, and
//! faults on a schedule drawn from the seed. At rest the checker compares status with what the
//! handlers' files say they did: the ground truth does not come from Settle.
//!
//! The faults so far: an application stopped (SIGTERM) and replaced, SIGKILLed and replaced,
//! scaled up, scaled down; the leading operator SIGKILLed or SIGTERMed and started again; the
//! Subscription paused and resumed, its `maxInFlight` edited. [`model`] holds what the
//! handlers did and the checker (every counter exact but what a SIGKILL allows, C16),
//! [`conditions`] the conditions and their causes, [`broker`] what differs between NATS,
//! RabbitMQ and SQS; this file draws the schedule and runs it.
//!
//! It must not decide what Settle should count beyond what the semantics say for these faults,
//! nor read Settle's counters to build its model.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use kube::Api;
use kube::api::{Patch, PatchParams};
use settle::api::Subscription;

use crate::account::{App, stats_in};
use crate::operator::Operator;
use crate::subs::{apply, subs, wait_ready};

mod broker;
mod conditions;
mod model;
pub use broker::Broker;
use broker::Target;
pub use model::{Answer, KILL_WINDOW, Kill, MAX_DELIVER, Model, check, stepped_down};

/// A stream of numbers from a seed (splitmix64): the same seed draws the same campaign.
pub struct Draw(u64);

impl Draw {
    pub fn new(seed: u64) -> Draw {
        Draw(seed)
    }

    pub fn number(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut x = self.0;
        x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        x ^ (x >> 31)
    }

    /// A number below `n` (0 when `n` is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.number().checked_rem(n).unwrap_or(0)
    }
}

/// A fault the campaign injects.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// One application stopped (SIGTERM: handlers in flight finish, the last report is
    /// confirmed) and another started in its place.
    AppReplaced,
    /// One more application instance.
    AppScaledUp,
    /// One application stopped (SIGTERM), if more than one runs.
    AppScaledDown,
    /// The leading operator SIGKILLed, and started again (it stands by).
    LeaderKilled,
    /// The leading operator SIGTERMed (it hands the Lease over), and started again.
    LeaderStopped,
    /// The Subscription paused (`spec.paused`) for a few seconds, then resumed.
    Paused,
    /// An editable field changed: `spec.maxInFlight` set to a drawn value.
    Edited,
    /// One application SIGKILLed mid-work (no last report) and another started in its place.
    AppKilled,
}

impl Fault {
    const ALL: [Fault; 8] = [
        Fault::AppReplaced,
        Fault::AppScaledUp,
        Fault::AppScaledDown,
        Fault::LeaderKilled,
        Fault::LeaderStopped,
        Fault::Paused,
        Fault::Edited,
        Fault::AppKilled,
    ];
}

/// A merge patch of the Subscription's spec.
async fn patch_spec(api: &Api<Subscription>, spec: serde_json::Value) {
    api.patch(
        "orders",
        &PatchParams::default(),
        &Patch::Merge(serde_json::json!({ "spec": spec })),
    )
    .await
    .expect("the Subscription patched");
}

/// `n` faults drawn from `draw`, one every `every` (give or take a third of it), the first
/// after `every`.
pub fn schedule(draw: &mut Draw, n: usize, every: Duration) -> Vec<(Duration, Fault)> {
    let third = u64::try_from(every.as_millis() / 3).unwrap_or(1).max(1);
    (0..n)
        .map(|i| {
            let jitter = Duration::from_millis(draw.below(2 * third));
            let at = every * u32::try_from(i + 1).unwrap_or(u32::MAX) + jitter
                - Duration::from_millis(third);
            let fault =
                Fault::ALL[usize::try_from(draw.below(Fault::ALL.len() as u64)).unwrap_or(0)];
            (at, fault)
        })
        .collect()
}

/// A campaign: the seed, how many faults, how many messages.
pub struct Campaign {
    pub seed: u64,
    pub faults: usize,
    pub messages: u64,
    /// How long between faults (about).
    pub every: Duration,
}

/// What a campaign did and found.
pub struct Report {
    /// One line per fault, with its time.
    pub lines: Vec<String>,
    pub summary: String,
    /// Each difference from the model a rule of the semantics allowed, and which.
    pub allowed: Vec<String>,
    pub discrepancies: Vec<String>,
}

impl Report {
    /// Prints the lines, the summary and each allowed difference.
    pub fn print(&self) {
        for line in &self.lines {
            println!("{line}");
        }
        println!("{}", self.summary);
        for a in &self.allowed {
            println!("allowed {a}");
        }
    }
}

/// The campaign's applications, each with its answers' file.
struct Apps {
    /// Each running instance, with the index of its answers' file.
    running: Vec<(App, usize)>,
    files: Vec<PathBuf>,
    env: Vec<(String, String)>,
    manifest: PathBuf,
    /// The broker's name, in the answers' file names.
    tag: &'static str,
}

impl Apps {
    async fn start(&mut self) {
        let file = crate::root().join(format!(
            "target/chaos-{}-{}-app-{}.log",
            self.tag,
            std::process::id(),
            self.files.len()
        ));
        let _ = std::fs::remove_file(&file);
        let mut env: Vec<(&str, &str)> = self
            .env
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        let path = file.to_string_lossy().to_string();
        env.push(("SETTLE_APP_MODEL_LOG", &path));
        let app = App::start(&env, &self.manifest, "model");
        app.wait_ready().await;
        self.files.push(file);
        self.running.push((app, self.files.len() - 1));
    }

    /// Instance `i` SIGKILLed: what it answered after its last report is never reported.
    fn kill(&mut self, i: usize) -> Kill {
        let (mut app, file) = self.running.remove(i);
        let at_ms = settle::bus::report::now_ms();
        app.kill9();
        Kill { file, at_ms }
    }

    fn stop(&mut self, i: usize) {
        let (mut app, _) = self.running.remove(i);
        app.sigterm();
        assert!(
            app.wait_exit(Duration::from_secs(60)),
            "an application's graceful stop"
        );
    }
}

/// The operators: the one that leads, and the one that stands by.
struct Operators {
    all: Vec<Operator>,
    flags: Vec<String>,
    ns: String,
    started: usize,
}

impl Operators {
    fn spawn(&mut self) {
        self.started += 1;
        let flags: Vec<&str> = self.flags.iter().map(String::as_str).collect();
        let name = format!("chaos-op-{}", self.started);
        self.all.push(Operator::spawn_env(
            &name,
            &self.ns,
            &flags,
            &[("POD_NAME", name.as_str())],
        ));
    }

    /// The leader's index, once one leads.
    async fn leader(&self) -> usize {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(i) = self
                .all
                .iter()
                .position(|o| o.metric("settle_leader", &[]) == 1.0)
            {
                return i;
            }
            assert!(Instant::now() < deadline, "no operator leads within 60 s");
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
}

/// Runs campaign `c` on the environment's `broker`.
pub async fn run(broker: Broker, c: &Campaign) -> Report {
    crate::install_crds();
    let ns = crate::namespace(&format!("chaos-{}", broker.name()));
    let mut ops = Operators {
        all: Vec::new(),
        flags: [
            "--leader-election=true",
            "--lease-name",
            &format!("chaos-{}-{}", broker.name(), std::process::id()),
            "--stats-interval",
            "1s",
            // A SIGKILLed instance is folded soon: its unfinished attempts then count as
            // Released, so I1 holds at rest (C16).
            "--fold-after",
            "5s",
        ]
        .iter()
        .map(ToString::to_string)
        .collect(),
        ns: ns.clone(),
        started: 0,
    };
    ops.spawn();
    ops.spawn();
    ops.leader().await;
    let (mut target, fields, app_env) = Target::make(broker, &ns).await;
    let manifest_text = format!(
        "apiVersion: messaging.settle.dev/v1alpha1\nkind: Subscription\nmetadata: {{name: orders, namespace: {ns}}}\nspec:\n{fields}  mode: AtLeastOnce\n  maxDeliver: {MAX_DELIVER}\n"
    );
    apply(&ns, &manifest_text);
    let api: Api<Subscription> = subs(&ns).await;
    wait_ready(&api, "orders").await;
    target.ready().await;
    let manifest = crate::root().join(format!(
        "target/chaos-{}-{}.yaml",
        broker.name(),
        std::process::id()
    ));
    std::fs::write(&manifest, &manifest_text).expect("the manifest");
    let mut env = app_env;
    env.push(("SETTLE_APP_MODEL_SEED".into(), c.seed.to_string()));
    // A pause of a few seconds is seen on RabbitMQ and SQS too (they poll for it).
    env.push(("SETTLE_PAUSE_POLL_INTERVAL".into(), "1s".into()));
    let mut apps = Apps {
        running: Vec::new(),
        files: Vec::new(),
        env,
        manifest: manifest.clone(),
        tag: broker.name(),
    };
    apps.start().await;
    apps.start().await;
    let t0 = Instant::now();
    let (seen, changes, watcher) = conditions::watch(&api, t0);

    let mut draw = Draw::new(c.seed);
    let plan = schedule(&mut draw, c.faults, c.every);
    let span = plan.last().map_or(c.every, |(at, _)| *at) + c.every;
    let publisher = {
        let (send, n) = (target.publisher(), c.messages);
        let pace = span / u32::try_from(n.max(1)).unwrap_or(u32::MAX);
        tokio::spawn(async move {
            for id in 1..=n {
                send.send(id).await;
                tokio::time::sleep(pace).await;
            }
        })
    };
    let (mut lines, mut kills) = (Vec::new(), Vec::new());
    for (at, fault) in plan {
        tokio::time::sleep_until((t0 + at).into()).await;
        let what = match fault {
            Fault::AppReplaced => {
                let i = usize::try_from(draw.below(apps.running.len() as u64)).unwrap_or(0);
                apps.stop(i);
                apps.start().await;
                format!("application {i} stopped (SIGTERM) and another started")
            }
            Fault::AppScaledUp if apps.running.len() < 4 => {
                apps.start().await;
                format!("scaled up to {}", apps.running.len())
            }
            Fault::AppScaledDown if apps.running.len() > 1 => {
                let i = usize::try_from(draw.below(apps.running.len() as u64)).unwrap_or(0);
                apps.stop(i);
                format!("scaled down to {}", apps.running.len())
            }
            Fault::AppScaledUp | Fault::AppScaledDown => {
                "scaling left as it is (at its bound)".into()
            }
            Fault::AppKilled => {
                let i = usize::try_from(draw.below(apps.running.len() as u64)).unwrap_or(0);
                kills.push(apps.kill(i));
                apps.start().await;
                format!("application {i} SIGKILLed and another started")
            }
            Fault::Paused => {
                let secs = 2 + draw.below(4);
                patch_spec(&api, serde_json::json!({ "paused": true })).await;
                tokio::time::sleep(Duration::from_secs(secs)).await;
                patch_spec(
                    &api,
                    serde_json::json!({ "paused": null, "pausedUntil": null }),
                )
                .await;
                format!("paused for {secs} s, then resumed")
            }
            Fault::Edited => {
                let n = 2 + draw.below(63);
                patch_spec(&api, serde_json::json!({ "maxInFlight": n })).await;
                format!("maxInFlight set to {n}")
            }
            Fault::LeaderKilled | Fault::LeaderStopped => {
                let i = ops.leader().await;
                let mut leader = ops.all.remove(i);
                if fault == Fault::LeaderKilled {
                    leader.kill9();
                } else {
                    leader.sigterm();
                    let deadline = Instant::now() + Duration::from_secs(30);
                    while leader.alive() && Instant::now() < deadline {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
                drop(leader);
                ops.spawn();
                format!(
                    "the leading operator {}, and started again",
                    if fault == Fault::LeaderKilled {
                        "SIGKILLed"
                    } else {
                        "SIGTERMed"
                    }
                )
            }
        };
        lines.push(format!(
            "{:>6.1} s  {fault:?}: {what}",
            t0.elapsed().as_secs_f64()
        ));
    }
    publisher.await.expect("the publisher ran");
    // At rest: every message acknowledged or out of attempts, and status still.
    let deadline = Instant::now() + Duration::from_secs(180);
    let mut last = None;
    loop {
        let s = stats_in(&api, "orders").await;
        let m = Model::read(&apps.files);
        let resolved = m.acked_ids.len() as u64 + s.exhausted >= c.messages;
        // Balanced too: a SIGKILLed instance's unfinished attempts are Released once it is
        // folded (`--fold-after 5s`).
        if resolved && s.balanced() && last.as_ref() == Some(&s) {
            break;
        }
        if Instant::now() > deadline {
            break;
        }
        last = Some(s);
        tokio::time::sleep(Duration::from_secs(3)).await;
    }
    // Stopped gracefully, each application's last report is in; status is read once still.
    while !apps.running.is_empty() {
        apps.stop(0);
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut s = stats_in(&api, "orders").await;
    loop {
        tokio::time::sleep(Duration::from_secs(3)).await;
        let again = stats_in(&api, "orders").await;
        if again == s || Instant::now() > deadline {
            s = again;
            break;
        }
        s = again;
    }
    watcher.abort();
    let faults = lines.len();
    let changes = changes.lock().map(|c| c.clone()).unwrap_or_default();
    for c in &changes {
        lines.push(format!(
            "{:>6.1} s  {}={} ({})",
            c.at.as_secs_f64(),
            c.type_,
            c.status,
            c.reason
        ));
    }
    lines.sort_by(|a, b| {
        let at = |l: &str| {
            l.split_whitespace()
                .next()
                .and_then(|t| t.parse::<f64>().ok())
        };
        at(a)
            .partial_cmp(&at(b))
            .unwrap_or(std::cmp::Ordering::Equal)
    });
    let model = Model::read(&apps.files);
    let mut allowed = Vec::new();
    let mut discrepancies = check(&model, c.messages, &s, &kills, &mut allowed);
    discrepancies.extend(stepped_down(&seen));
    discrepancies.extend(conditions::uncaused(
        &changes,
        c.messages - model.acked_ids.len() as u64,
    ));
    // The Subscription and the Backend deleted as the namespace controller would, the
    // operators still running: nothing of theirs may stay on the broker.
    crate::kubectl_ok(
        &[
            "delete",
            "subscriptions,backends",
            "--all",
            "-n",
            &ns,
            "--wait=true",
            "--timeout=120s",
        ],
        None,
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    let left = loop {
        let left = target.leftovers(&ns).await;
        if left.is_empty() || Instant::now() > deadline {
            break left;
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    };
    if !left.is_empty() {
        discrepancies.push(format!(
            "left on the broker 60 s after the Subscription and its Backend were deleted: {}",
            left.join(", ")
        ));
    }
    let summary = format!(
        "{} seed {}: {} faults, {} messages, {} attempts ({} acked, {} nacked, {} silent), {} exhausted, {} discrepancies, {:.0} s; status at rest {:?}",
        broker.name(),
        c.seed,
        faults,
        c.messages,
        model.attempts,
        model.acked,
        model.nacked,
        model.silent,
        s.exhausted,
        discrepancies.len(),
        t0.elapsed().as_secs_f64(),
        s
    );
    crate::kubectl_ok(&["delete", "namespace", &ns, "--wait=false"], None);
    drop(ops);
    let _ = std::fs::remove_file(&manifest);
    target.remove().await;
    Report {
        lines,
        summary,
        allowed,
        discrepancies,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seed_draws_the_same_schedule_and_another_a_different_one() {
        let a = schedule(&mut Draw::new(7), 10, Duration::from_secs(5));
        let b = schedule(&mut Draw::new(7), 10, Duration::from_secs(5));
        let c = schedule(&mut Draw::new(8), 10, Duration::from_secs(5));
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert!(a.windows(2).all(|w| w[0].0 < w[1].0), "in order: {a:?}");
    }
}
