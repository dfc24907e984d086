//! The fault campaign (docs/guide/chaos.md): a Subscription on the real API server and broker,
//! the operator as two processes with leader election, applications on the `settle` runtime
//! whose handler answers each attempt by a rule drawn from the seed (the example's `model`
//! handler) and writes every answer to a file, a publisher that gives every message an id, and
//! faults on a schedule drawn from the seed. At rest the checker compares status with what the
//! handlers' files say they did: the ground truth does not come from Settle.
//!
//! [`faults`] holds the faults (an application stopped, SIGKILLed, scaled; the leading
//! operator SIGKILLed, SIGTERMed or cut off from the API server; the Subscription paused,
//! edited, deleted and applied again; its consumer or queue, or its report source, deleted on
//! the broker; the Backend's credentials rotated; the broker SIGKILLed or SIGTERMed, or SQS
//! unreachable, a cluster's server paused; the campaign's own API server restarted), the
//! schedule and how each is done; [`answers`] what the handlers did and the rules each answer
//! keeps (S2, B3, B5); [`model`] the checker of status against it (every counter exact but
//! what a SIGKILL allows, C16, a lost report source, C17, and an ack sent in an outage, J3; of
//! the object at rest, whose account starts when it was applied, C15); [`conditions`] the
//! conditions and their causes; [`broker`] what differs between NATS (one server or the
//! cluster), RabbitMQ and SQS, [`outages`] how each is taken down, [`reports`] how each loses
//! its report source and [`credentials`] how the Backend's credentials are rotated on each.
//! This file runs a campaign: sets it up, runs the schedule, waits for rest, judges, and
//! cleans up.
//!
//! It must not decide what Settle should count beyond what the semantics say for these faults,
//! nor read Settle's counters to build its model.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kube::Api;
use settle::api::Subscription;

use crate::account::stats_in;
use crate::subs::{apply, subs, wait_ready};

mod answers;
mod broker;
mod conditions;
mod credentials;
mod faults;
mod model;
mod outages;
mod publisher;
mod reports;
use crate::controlplane::ControlPlane;
pub use answers::{Answer, Model, kept};
pub use broker::Broker;
use broker::Target;
use faults::{Apps, Done, Operators, World};
pub use faults::{Fault, schedule};
pub use model::{
    Earlier, KILL_WINDOW, Kill, MAX_DELIVER, Outages, Unreported, above, check, last_of_each,
    stepped_down,
};

/// The operators' `--loss-window`: a report source lost is said (`Accounted=False
/// SourceLost`) for this long after the loss was found (C17), and the campaign waits for
/// `Accounted=True` again before it judges, so it is short.
const LOSS_WINDOW: &str = "30s";

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

/// A campaign: the seed, how many faults, how many messages.
pub struct Campaign {
    pub seed: u64,
    pub faults: usize,
    /// How many kinds of fault the schedule draws from: the first of [`Fault::ALL`], where
    /// each new kind is added last, so a seed draws the schedule it drew when there were this
    /// many (a seed kept as a regression case keeps its meaning); [`Fault::KINDS`] for all.
    pub kinds: usize,
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

    /// Prints it, and fails naming every discrepancy of the campaign on `broker` (a test's
    /// verdict).
    pub fn assert_none_found(&self, broker: Broker) {
        self.print();
        assert!(
            self.discrepancies.is_empty(),
            "the campaign on {} found discrepancies:\n{}",
            broker.name(),
            self.discrepancies.join("\n")
        );
    }
}

/// Runs campaign `c` on the environment's `broker`, and on `control_plane` when given (the
/// campaign's own, which it may then restart: every API server this process reaches is that
/// one from now on) rather than the environment's API server.
pub async fn run(broker: Broker, c: &Campaign, control_plane: Option<ControlPlane>) -> Report {
    if let Some(cp) = &control_plane {
        crate::use_kubeconfig(cp.kubeconfig.clone());
    }
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
            "--loss-window",
            LOSS_WINDOW,
        ]
        .iter()
        .chain(broker.operator_flags())
        .map(ToString::to_string)
        .collect(),
        ns: ns.clone(),
        started: 0,
    };
    ops.spawn().await;
    ops.spawn().await;
    ops.leader().await;
    let (mut target, fields, app_env, access) = Target::make(broker, &ns).await;
    let manifest_text = format!(
        "apiVersion: messaging.settle.dev/v1alpha1\nkind: Subscription\nmetadata: {{name: orders, namespace: {ns}}}\nspec:\n{fields}  mode: AtLeastOnce\n  maxDeliver: {MAX_DELIVER}\n"
    );
    apply(&ns, &manifest_text);
    let api: Api<Subscription> = subs(&ns).await;
    let first_uid = wait_ready(&api, "orders")
        .await
        .metadata
        .uid
        .unwrap_or_default();
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
    let watched = conditions::watch(&api, t0);
    let changes = watched.changes.clone();

    let mut draw = Draw::new(c.seed);
    let plan = schedule(
        &mut draw,
        (c.faults, c.kinds),
        c.every,
        broker,
        control_plane.is_some(),
    );
    let span = plan.last().map_or(c.every, |(at, _)| *at) + c.every;
    let published = Arc::new(tokio::sync::Mutex::new(0));
    let publisher = {
        let (send, n, published) = (target.publisher(), c.messages, published.clone());
        let pace = span / u32::try_from(n.max(1)).unwrap_or(u32::MAX);
        tokio::spawn(async move {
            for id in 1..=n {
                let mut last = published.lock().await;
                send.send(id).await;
                *last = id;
                drop(last);
                tokio::time::sleep(pace).await;
            }
        })
    };
    let mut lines = Vec::new();
    let mut w = World {
        apps,
        ops,
        api: api.clone(),
        target,
        done: Done {
            t0,
            kills: Vec::new(),
            stops: Vec::new(),
            outages: Vec::new(),
            ack_outages: Vec::new(),
            api_outages: Vec::new(),
            recreated: Vec::new(),
            consumer_deleted: Vec::new(),
            reports_deleted: Vec::new(),
            found: Vec::new(),
        },
        control_plane,
        published,
        manifest: manifest_text,
        access,
    };
    for (at, fault) in plan {
        tokio::time::sleep_until((t0 + at).into()).await;
        let what = faults::inject(fault, &mut draw, &mut w).await;
        lines.push(format!(
            "{:>6.1} s  {fault:?}: {what}",
            t0.elapsed().as_secs_f64()
        ));
    }
    let World {
        mut apps,
        ops,
        target,
        done,
        control_plane,
        access,
        ..
    } = w;
    publisher.await.expect("the publisher ran");
    let t0_ms = settle::bus::report::now_ms()
        .saturating_sub(u64::try_from(t0.elapsed().as_millis()).unwrap_or(0));
    let ms = |d: Duration| t0_ms + u64::try_from(d.as_millis()).unwrap_or(0);
    // The object at rest is the last one made: its account starts when it was applied (C15).
    // Its last consumer (made again after a deletion on the broker, or with the object) owes
    // every message its broker still held, or those published after it.
    let from_ms = done.recreated.last().map_or(0, |r| ms(r.applied));
    let gone: Vec<(u64, u64)> = done
        .consumer_deleted
        .iter()
        .filter(|d| ms(d.deleted) >= from_ms)
        .map(|d| (ms(d.deleted), ms(d.back)))
        .collect();
    let first_id = done
        .recreated
        .iter()
        .map(|r| (r.applied, r.first_id))
        .chain(done.consumer_deleted.iter().map(|d| (d.back, d.first_id)))
        .max()
        .map_or(1, |(_, id)| id);
    let owed = if broker.offers_stored() {
        c.messages
    } else {
        c.messages + 1 - first_id
    };
    // At rest: every message acknowledged or out of attempts, and status still. A NATS
    // consumer made again late offers every message afresh, which takes longer.
    let consumer_made_again = !done.recreated.is_empty() || !done.consumer_deleted.is_empty();
    let wait = if consumer_made_again && broker.offers_stored() {
        600
    } else {
        180
    };
    let deadline = Instant::now() + Duration::from_secs(wait);
    let mut last = None;
    loop {
        let s = stats_in(&api, "orders").await;
        let m = Model::read(&apps.files).between(from_ms, u64::MAX);
        let m = Earlier::of(&m, &gone, &[]).last.unwrap_or(m);
        let resolved = m.acked_ids.len() as u64 + s.exhausted >= owed;
        // Balanced too: a SIGKILLed instance's unfinished attempts are Released once it is
        // folded (`--fold-after`, `Broker::operator_flags`); and the conditions back from the last outage.
        let settled = changes
            .lock()
            .is_ok_and(|c| conditions::settled(&c, s.stranded > 0));
        if resolved
            && settled
            && s.balanced()
            && last.as_ref() == Some(&s)
            && !target.reports_waiting().await
        {
            break;
        }
        if Instant::now() > deadline {
            break;
        }
        last = Some(s);
        tokio::time::sleep(Duration::from_secs(3)).await;
    }
    // Stopped gracefully, each application's last report is in; status is read once still,
    // with no report waiting to be counted.
    while !apps.running.is_empty() {
        apps.stop(0);
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut s = stats_in(&api, "orders").await;
    loop {
        tokio::time::sleep(Duration::from_secs(3)).await;
        let again = stats_in(&api, "orders").await;
        if (again == s && !target.reports_waiting().await) || Instant::now() > deadline {
            s = again;
            break;
        }
        s = again;
    }
    watched.task.abort();
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
    let all = Model::read(&apps.files);
    let model = all.between(from_ms, u64::MAX);
    let mut allowed = Vec::new();
    let ms_of = |o: &[(Duration, Duration)]| -> Vec<(u64, u64)> {
        o.iter().map(|(a, b)| (ms(*a), ms(*b))).collect()
    };
    let outages = Outages {
        broker: ms_of(&done.outages),
        acks: ms_of(&done.ack_outages),
    };
    let earlier = Earlier::of(&model, &gone, &outages.acks);
    let missing = unreported(&done, |at| watched.written_before(at), &changes, broker, ms);
    let mut discrepancies = check(&model, owed, &s, &missing, &outages, &earlier, &mut allowed);
    if !broker.offers_stored() {
        let last_made = earlier.last.as_ref().unwrap_or(&model);
        discrepancies.extend(
            last_made
                .answers
                .iter()
                .filter(|a| a.id < first_id)
                .map(|a| format!("message {} of a deleted queue was offered again from the queue made after it (attempt {})", a.id, a.attempt)),
        );
    }
    // Each object's answers keep their rules, and each earlier object's last status counts no
    // more than its handlers answered.
    let bounds: Vec<u64> = std::iter::once(0)
        .chain(done.recreated.iter().map(|r| ms(r.applied)))
        .chain(std::iter::once(u64::MAX))
        .collect();
    let grace = u64::try_from(conditions::OUTAGE_GRACE.as_millis()).unwrap_or(u64::MAX);
    // Each consumer's: one made again numbers its attempts afresh (B5 compares an attempt with
    // the next of the same consumer).
    let mut consumers: Vec<u64> = bounds
        .iter()
        .copied()
        .chain(done.consumer_deleted.iter().map(|d| ms(d.back)))
        .collect();
    consumers.sort_unstable();
    for b in consumers.windows(2) {
        discrepancies.extend(kept(
            &all.between(b[0], b[1]),
            broker.delays(),
            &outages,
            grace,
        ));
    }
    discrepancies.extend(stepped_down(&watched.seen));
    discrepancies.extend(done.found.iter().cloned());
    // (An object deleted before its status was ever written has nothing to judge.)
    let objects = last_of_each(&watched.seen);
    let uids: Vec<&String> = std::iter::once(&first_uid)
        .chain(done.recreated.iter().map(|r| &r.uid))
        .collect();
    for (uid, b) in uids.iter().zip(bounds.windows(2)).rev().skip(1) {
        if let Some((_, last)) = objects.iter().find(|(u, _)| u == *uid) {
            discrepancies.extend(
                above(last, &all.between(b[0], b[1]))
                    .into_iter()
                    .map(|d| format!("the earlier object {uid}: {d}")),
            );
        }
    }
    // A condition may change while the broker or the API server is down (the operator finds
    // the consumer unreachable; it writes nothing, then catches up); a settlement fails only
    // while the broker is.
    let any_outage: Vec<(Duration, Duration)> = done
        .outages
        .iter()
        .chain(&done.api_outages)
        .copied()
        .collect();
    // Exhausting needs a message one of the objects let run out.
    let ran_out = owed.saturating_sub(model.acked_ids.len() as u64)
        + earlier.exhausted.1
        + all
            .between(0, from_ms)
            .answers
            .iter()
            .filter(|a| a.attempt >= MAX_DELIVER && a.answer != "ack")
            .count() as u64;
    // A consumer gone (with its Subscription, or deleted on the broker) is not Ready until it
    // is made again; one deleted on the broker strands the declines sent to it (C8).
    let stranded: Vec<(Duration, Duration)> = done
        .consumer_deleted
        .iter()
        .map(|d| (d.deleted, d.back + conditions::OUTAGE_GRACE))
        .collect();
    let made_again: Vec<(Duration, Duration)> = done
        .recreated
        .iter()
        .map(|r| (r.deleted, r.ready))
        .chain(stranded.iter().copied())
        .collect();
    // A report source deleted may be said missing or lost until a while after it is back.
    let sources_lost: Vec<(Duration, Duration)> = done
        .reports_deleted
        .iter()
        .map(|(deleted, back)| (*deleted, *back + conditions::OUTAGE_GRACE))
        .collect();
    discrepancies.extend(conditions::uncaused(
        &changes,
        ran_out,
        &any_outage,
        &made_again,
        (&stranded, s.stranded),
        &sources_lost,
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
        "{} seed {} ({} kinds): {} faults, {} messages, {} attempts ({} acked, {} nacked, {} silent), {} exhausted, {} discrepancies, {:.0} s; status at rest {:?}",
        broker.name(),
        c.seed,
        c.kinds,
        faults,
        c.messages,
        all.attempts,
        all.acked,
        all.nacked,
        all.silent,
        s.exhausted,
        discrepancies.len(),
        t0.elapsed().as_secs_f64(),
        s
    );
    crate::kubectl_ok(&["delete", "namespace", &ns, "--wait=false"], None);
    drop(ops);
    let _ = std::fs::remove_file(&manifest);
    target.remove().await;
    access.remove();
    drop(control_plane);
    Report {
        lines,
        summary,
        allowed,
        discrepancies,
    }
}

/// What the account may not have counted, by the semantics: each SIGKILLed instance's last
/// answers (C16); and for each report source deleted on the broker, what an instance SIGKILLed
/// or stopped (SIGTERM) before it answered since the status last written before the deletion
/// (its last reports may not have been read, and it never reports again), and on NATS, where
/// the loss is found and counting goes on from status, what any instance answered from then
/// until the loss was found (C17), when it was (when it was found while `Accounted` still said
/// an earlier loss, by 15 s after reports were back).
/// `written_before` is when status was last written before a time; `ms` turns a time since the
/// start into unix ms.
fn unreported(
    done: &Done,
    written_before: impl Fn(Duration) -> Duration,
    changes: &[conditions::Change],
    broker: Broker,
    ms: impl Fn(Duration) -> u64,
) -> Vec<Unreported> {
    let window = u64::try_from(KILL_WINDOW.as_millis()).unwrap_or(u64::MAX);
    let mut missing: Vec<Unreported> = done.kills.iter().map(Kill::unreported).collect();
    for (deleted, back) in &done.reports_deleted {
        let (at, written) = (
            ms(*deleted),
            ms(written_before(*deleted)).saturating_sub(window),
        );
        missing.extend(
            done.kills
                .iter()
                .chain(&done.stops)
                .filter(|k| k.at_ms <= at)
                .map(|k| Unreported {
                    file: Some(k.file),
                    from_ms: written.min(k.at_ms.saturating_sub(window)),
                    to_ms: k.at_ms,
                }),
        );
        // When the loss was found: `Accounted` turned SourceLost after the deletion, by the
        // time the keeper had read the bucket made again; or, already SourceLost for an
        // earlier loss (said for the loss window after the last), at most by then.
        let until = *back + conditions::OUTAGE_GRACE;
        let accounted = |c: &&conditions::Change| c.type_ == "Accounted";
        let already = changes
            .iter()
            .filter(accounted)
            .take_while(|c| c.at <= *deleted)
            .last()
            .is_some_and(|c| c.reason == "SourceLost");
        let found = changes
            .iter()
            .filter(accounted)
            .find(|c| c.at >= *deleted && c.at <= until && c.reason == "SourceLost")
            .map(|c| c.at)
            .or(already.then_some(until));
        if let (true, Some(found)) = (broker.offers_stored(), found) {
            missing.push(Unreported {
                file: None,
                from_ms: written,
                to_ms: ms(found),
            });
        }
    }
    missing
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SQS seed 1796681179252396803: an application scaled down (SIGTERM) before the report
    /// queue was deleted, its last report unread by an operator just SIGKILLed; what it
    /// answered since the status written before the deletion may be missing, as for a kill.
    #[test]
    fn a_report_source_deleted_after_a_stop_may_lose_the_stopped_instances_last_answers() {
        let done = Done {
            t0: Instant::now(),
            kills: vec![Kill {
                file: 3,
                at_ms: 132_700,
            }],
            stops: vec![Kill {
                file: 4,
                at_ms: 137_500,
            }],
            outages: Vec::new(),
            ack_outages: Vec::new(),
            api_outages: Vec::new(),
            recreated: Vec::new(),
            consumer_deleted: Vec::new(),
            reports_deleted: vec![(
                Duration::from_millis(147_700),
                Duration::from_millis(153_900),
            )],
            found: Vec::new(),
        };
        let ms = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
        let missing = unreported(
            &done,
            |_| Duration::from_millis(136_000),
            &[],
            Broker::Sqs,
            ms,
        );
        // Each instance's own window: the kill's, then for the deletion the killed one's and
        // the stopped one's, from the status written before it (less the report interval's
        // margin) to when each went.
        assert!(missing.contains(&Unreported {
            file: Some(4),
            from_ms: 134_500,
            to_ms: 137_500
        }));
        assert!(missing.contains(&Unreported {
            file: Some(3),
            from_ms: 131_200,
            to_ms: 132_700
        }));
        // A stop after the deletion loses nothing: its last report went to the queue made again.
        let later = Done {
            stops: vec![Kill {
                file: 4,
                at_ms: 150_000,
            }],
            kills: Vec::new(),
            ..done
        };
        assert!(unreported(&later, |_| Duration::ZERO, &[], Broker::Sqs, ms).is_empty());
    }

    #[test]
    fn a_seed_draws_the_same_schedule_and_another_a_different_one() {
        let every = Duration::from_secs(5);
        let draw = |seed, kinds| {
            schedule(
                &mut Draw::new(seed),
                (10, kinds),
                every,
                Broker::Nats,
                false,
            )
        };
        let (a, b, c) = (
            draw(7, Fault::KINDS),
            draw(7, Fault::KINDS),
            draw(8, Fault::KINDS),
        );
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert!(a.windows(2).all(|w| w[0].0 < w[1].0), "in order: {a:?}");
    }
}
