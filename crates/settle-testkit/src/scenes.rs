//! The shared conformance scenes (`conformance/scenes.json`, the file the Go runtime's
//! `settle.dev/messaging/conformance` runs too), run on the Rust runtime through a
//! [`BusScene`]: each scene's subscription, messages and handler answers, and what the account
//! must then say. How a scene reads: `conformance/README.md`.
//!
//! It must not know any broker: what differs per broker is the scene's [`BusScene`], and what
//! a broker shows instead is the file's `on` entry.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Deserialize;
use settle::api::{self, ConsumerStats, DeliveryPolicy, Mode, SlowHandler};
use settle::bus::{Bus, Delivery, RuntimeStats, SettleError, Subscriber, handler};
use tokio::time::Instant;

use crate::bus::{BusScene, Message};

/// The scenes file.
#[derive(Debug, Deserialize)]
pub struct File {
    pub version: u32,
    pub scenes: Vec<Scene>,
}

/// One scene.
#[derive(Clone, Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Scene {
    pub name: String,
    #[serde(default)]
    pub rules: Vec<String>,
    #[serde(default)]
    pub requires: Option<String>,
    pub spec: Spec,
    pub messages: usize,
    pub answers: Answers,
    #[serde(default)]
    pub body: BTreeMap<String, String>,
    #[serde(default)]
    pub headers: BTreeMap<String, BTreeMap<String, String>>,
    #[serde(default)]
    pub close_when_offered: Option<u64>,
    #[serde(default)]
    pub close_grace: Option<api::Duration>,
    pub expect: Expect,
    #[serde(default)]
    pub then: Option<Phase>,
    #[serde(default)]
    pub on: BTreeMap<String, Difference>,
}

/// The subscription's policy as the scene gives it.
#[derive(Clone, Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Spec {
    pub mode: Mode,
    #[serde(default)]
    pub max_deliver: Option<i64>,
    #[serde(default)]
    pub max_nack_delay: Option<api::Duration>,
    #[serde(default)]
    pub ack_wait: Option<api::Duration>,
    #[serde(default)]
    pub max_processing_time: Option<api::Duration>,
    #[serde(default)]
    pub slow_handler: Option<SlowHandler>,
}

/// What the handler does, by attempt (the last repeats).
#[derive(Clone, Debug, Default, Deserialize)]
pub struct Answers {
    #[serde(default)]
    pub all: Vec<String>,
    #[serde(default)]
    pub even: Option<Vec<String>>,
    #[serde(default)]
    pub odd: Option<Vec<String>>,
    #[serde(default)]
    pub each: Option<Vec<Vec<String>>>,
}

/// What the account must say.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Expect {
    #[serde(default)]
    pub stats: Option<ConsumerStats>,
    #[serde(default)]
    pub runtime: RuntimeStats,
    #[serde(default)]
    pub attempts: Option<Vec<Vec<u32>>>,
    #[serde(default)]
    pub already_settled: usize,
    #[serde(default)]
    pub gaps_at_least: Option<api::Duration>,
}

/// A second bus after the first closed.
#[derive(Clone, Debug, Deserialize)]
pub struct Phase {
    pub expect: Expect,
}

/// What a broker shows instead, and why.
#[derive(Clone, Debug, Deserialize)]
pub struct Difference {
    pub why: String,
    pub expect: Expect,
    #[serde(default)]
    pub then: Option<Phase>,
}

/// Reads the scenes file at the workspace's root.
pub fn load() -> File {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../conformance/scenes.json");
    let raw = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    let file: File =
        serde_json::from_str(&raw).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(
        file.version,
        1,
        "{}: this runner reads version 1",
        path.display()
    );
    file
}

/// What one phase of a scene showed.
#[derive(Debug, Default)]
pub struct Outcome {
    pub stats: ConsumerStats,
    pub runtime: RuntimeStats,
    pub attempts: Vec<Vec<u32>>,
    pub gaps: Vec<Duration>,
    pub already_settled: usize,
}

#[derive(Default)]
struct Seen {
    attempts: BTreeMap<usize, Vec<(u32, Instant)>>,
    already: usize,
}

impl Scene {
    fn policy<S: BusScene>(&self, scope: &S, name: &str) -> DeliveryPolicy {
        let mut p = scope.alo(name);
        p.mode = self.spec.mode;
        p.max_deliver = self.spec.max_deliver;
        p.max_nack_delay = self.spec.max_nack_delay;
        p.ack_wait = self.spec.ack_wait;
        p.max_processing_time = self.spec.max_processing_time;
        p.slow_handler = self.spec.slow_handler;
        p
    }

    fn answer(&self, id: usize, attempt: u32) -> String {
        let a = &self.answers;
        let list = match (&a.each, id % 2) {
            (Some(each), _) if id < each.len() => &each[id],
            (_, 0) if a.even.is_some() => a.even.as_ref().unwrap_or(&a.all),
            (_, 1) if a.odd.is_some() => a.odd.as_ref().unwrap_or(&a.all),
            _ => &a.all,
        };
        let i = (attempt as usize).min(list.len()).saturating_sub(1);
        list.get(i).cloned().unwrap_or_else(|| "silent".into())
    }

    fn parity(id: usize) -> &'static str {
        if id.is_multiple_of(2) { "even" } else { "odd" }
    }

    fn message(&self, id: usize) -> (String, Vec<(String, String)>) {
        let body = self
            .body
            .get(Scene::parity(id))
            .cloned()
            .unwrap_or_else(|| format!("{{\"id\":{id}}}"));
        let headers = self
            .headers
            .get(Scene::parity(id))
            .map(|h| h.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
            .unwrap_or_default();
        (body, headers)
    }

    /// The expectations on `broker`: the scene's, or its `on` entry's.
    pub fn expected(&self, broker: &str) -> Vec<Expect> {
        let (first, then) = match self.on.get(broker) {
            Some(d) => (d.expect.clone(), d.then.clone().or(self.then.clone())),
            None => (self.expect.clone(), self.then.clone()),
        };
        std::iter::once(first)
            .chain(then.map(|p| p.expect))
            .collect()
    }

    fn subscriber(&self, name: &str, policy: DeliveryPolicy, seen: Arc<Mutex<Seen>>) -> Subscriber {
        let scene = Arc::new(self.clone());
        Subscriber::new(
            name,
            policy,
            handler(move |d: Delivery| {
                let (scene, seen) = (Arc::clone(&scene), Arc::clone(&seen));
                async move { scene.handle(d, &seen).await }
            }),
        )
    }

    async fn handle(
        &self,
        d: Delivery,
        seen: &Mutex<Seen>,
    ) -> Result<(), settle::bus::HandlerError> {
        #[derive(Deserialize)]
        struct Id {
            id: usize,
        }
        let id = d.decode::<Id>()?.id;
        seen.lock()
            .unwrap()
            .attempts
            .entry(id)
            .or_default()
            .push((d.attempt(), Instant::now()));
        let mut ret: Result<(), settle::bus::HandlerError> = Ok(());
        for step in self.answer(id, d.attempt()).split('+') {
            let r = match step {
                "ack" => d.ack().await,
                "nack" => d.nack().await,
                "silent" => Ok(()),
                "error" => {
                    ret = Err("the scene's handler returns an error".into());
                    Ok(())
                }
                "panic" => panic!("the scene's handler panics"),
                s if s.starts_with("nackAfter:") => d.nack_after(duration(&s[10..])).await,
                s if s.starts_with("sleep:") => {
                    tokio::time::sleep(duration(&s[6..])).await;
                    Ok(())
                }
                other => panic!("scenes.json: unknown answer {other:?}"),
            };
            if matches!(r, Err(SettleError::AlreadySettled)) {
                seen.lock().unwrap().already += 1;
            }
        }
        ret
    }
}

fn duration(s: &str) -> Duration {
    s.parse::<api::Duration>()
        .unwrap_or_else(|e| panic!("scenes.json: {s:?} is not a duration: {e}"))
        .get()
}

/// Runs `scene` on `scope` (a scope of its own: its subjects carry only this scene's
/// messages): each phase's outcome.
pub async fn run<S: BusScene>(scope: &S, scene: &Scene, want: &[Expect]) -> Vec<Outcome> {
    let name = "scene";
    let policy = scene.policy(scope, name);
    let mut out = Vec::new();
    for (phase, expect) in want.iter().enumerate() {
        let seen = Arc::new(Mutex::new(Seen::default()));
        let mut builder = scope.builder().await;
        if let Some(grace) = scene.close_grace {
            builder = builder.close_grace(grace.get());
        }
        let bus = builder.build();
        bus.subscribe(scene.subscriber(name, policy.clone(), Arc::clone(&seen)))
            .await
            .unwrap_or_else(|e| panic!("{}: subscribe: {e}", scene.name));
        if phase == 0 {
            for id in 0..scene.messages {
                let (body, headers) = scene.message(id);
                scope
                    .send(
                        &bus,
                        Message {
                            name,
                            n: id,
                            headers,
                            body: &body,
                        },
                    )
                    .await;
            }
        }
        let close_at = if phase == 0 {
            scene.close_when_offered
        } else {
            None
        };
        let target = expect.stats.map_or(1, |s| s.offered);
        settle_down(&bus, name, target, close_at, &scene.name).await;
        bus.close().await;
        let stats = bus.stats(name).unwrap_or_default();
        let runtime = bus.runtime_stats(name).unwrap_or_default();
        let seen = seen.lock().unwrap();
        let mut o = Outcome {
            stats,
            runtime,
            already_settled: seen.already,
            ..Outcome::default()
        };
        for id in 0..scene.messages {
            let a = seen.attempts.get(&id).cloned().unwrap_or_default();
            o.attempts.push(a.iter().map(|x| x.0).collect());
            o.gaps.extend(a.windows(2).map(|w| w[1].1 - w[0].1));
        }
        out.push(o);
    }
    out
}

/// Waits until the phase is over: `close_at` offered, or `target` offered and every attempt
/// finished, then a second with nothing new.
async fn settle_down(bus: &Bus, name: &str, target: u64, close_at: Option<u64>, scene: &str) {
    let deadline = Instant::now() + Duration::from_secs(90);
    let mut last = ConsumerStats::default();
    let mut quiet_since: Option<Instant> = None;
    loop {
        let st = bus.stats(name).unwrap_or_default();
        match close_at {
            Some(n) if st.offered >= n => return,
            Some(_) => {}
            None if st.offered >= target && st.delivered + st.released + st.lost == st.offered => {
                match quiet_since {
                    Some(t) if st == last => {
                        if t.elapsed() >= Duration::from_secs(1) {
                            return;
                        }
                    }
                    _ => (quiet_since, last) = (Some(Instant::now()), st),
                }
            }
            None => {}
        }
        assert!(
            Instant::now() < deadline,
            "{scene}: timed out waiting for {target} attempts offered and finished: {st:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// How an outcome differs from what was expected (empty when it does not).
pub fn check(got: &Outcome, want: &Expect) -> Vec<String> {
    let mut d = Vec::new();
    if let Some(s) = &want.stats
        && got.stats != *s
    {
        d.push(format!("stats {:?}, want {s:?}", got.stats));
    }
    if got.runtime != want.runtime {
        d.push(format!(
            "runtime {:?}, want {:?}",
            got.runtime, want.runtime
        ));
    }
    if let Some(a) = &want.attempts
        && &got.attempts != a
    {
        d.push(format!("attempts {:?}, want {a:?}", got.attempts));
    }
    if got.already_settled != want.already_settled {
        d.push(format!(
            "alreadySettled {}, want {}",
            got.already_settled, want.already_settled
        ));
    }
    if let Some(floor) = want.gaps_at_least {
        for g in &got.gaps {
            if *g < floor.get() {
                d.push(format!(
                    "a redelivery came {g:?} after the attempt before it, before its delay of {floor}"
                ));
            }
        }
    }
    d
}

/// How many scenes the file holds (a suite makes a scope for each).
pub fn count() -> usize {
    load().scenes.len()
}

/// Runs scene `n` on `scopes[n]` (a scope of its own each: its subjects carry only that
/// scene's messages), every scene side by side; panics naming every scene that differs from
/// what the file expects on `broker`. Returns how many scenes ran (a scene that needs
/// `delaysRedelivery` runs only where the backend declares it).
pub async fn run_all<S: BusScene>(broker: &str, delays_redelivery: bool, scopes: &[S]) -> usize {
    let file = load();
    assert_eq!(scopes.len(), file.scenes.len(), "one scope per scene");
    let runs = file.scenes.iter().zip(scopes).map(|(scene, s)| async move {
        if scene.requires.as_deref() == Some("delaysRedelivery") && !delays_redelivery {
            return (false, Vec::new());
        }
        let want = scene.expected(broker);
        let got = run(s, scene, &want).await;
        let mut failures = Vec::new();
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            for d in check(g, w) {
                failures.push(format!(
                    "{} on {broker}, phase {} (rules {}): {d}",
                    scene.name,
                    i + 1,
                    scene.rules.join(", ")
                ));
            }
        }
        (true, failures)
    });
    let results = futures::future::join_all(runs).await;
    let ran = results.iter().filter(|r| r.0).count();
    let failures: Vec<String> = results.into_iter().flat_map(|r| r.1).collect();
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    ran
}
