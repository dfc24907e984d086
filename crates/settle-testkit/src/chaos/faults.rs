//! The faults a campaign injects: what each is, the schedule drawn from the seed, and how each
//! is done to the applications, the operators (killed, stopped, cut off from the API server),
//! the Subscription (paused, edited, deleted and applied again), its consumer or queue and its
//! report source (deleted on the broker), the Backend's credentials (rotated), the broker or
//! the API server.
//!
//! It must not judge what happened (that is [`super::model`] and [`super::conditions`]).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kube::Api;
use kube::api::{Patch, PatchParams};
use settle::api::Subscription;

use super::broker::{Broker, Target};
use super::credentials::Access;
use super::outages::{AckLoss, Hit};
use super::{Draw, Kill};
use crate::account::App;
use crate::controlplane::ControlPlane;
use crate::operator::Operator;
use crate::partition::Partition;
use crate::subs::{apply, wait_ready};

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
    /// The broker down under load for a few seconds: SIGKILLed or SIGTERMed (drawn) and
    /// started again on its store (NATS: the campaign's own nats-server; the cluster: one of
    /// its servers; RabbitMQ: the campaign's own node); SQS, a service rather than a process,
    /// unreachable (every connection to it held, no byte passing).
    BrokerDown,
    /// A server of the cluster paused (SIGSTOP) for a few seconds, as a node cut off by a
    /// partition, then resumed.
    NodePaused,
    /// The API server and its etcd SIGKILLed, and started again on their state a few seconds
    /// later (only on a control plane of the campaign's own).
    ApiServerRestarted,
    /// The leading operator cut off from the API server (its connections held open, no byte
    /// passing either way) for a few to 25 seconds, then joined again: past its renew deadline
    /// it stops leading and the other takes over, and what it had sent waits in the partition.
    LeaderPartitioned,
    /// The Subscription deleted (its consumer or queue with it) while its applications run,
    /// and applied again a few seconds later as a new object, which takes over what the old
    /// one kept (`settle.dev/adopt`: an SQS dead-letter queue holding Exhausted messages). No
    /// message is published meanwhile, so none is sent to a queue that is not there.
    Recreated,
    /// The Subscription's consumer (NATS) or queue (RabbitMQ, SQS: with the messages it holds)
    /// deleted on the broker behind the operator's back, under load; the operator makes it
    /// again (NATS: from the advisory, within about a second; RabbitMQ and SQS: at its next
    /// drift check). No message is published until it is back.
    ConsumerDeleted,
    /// The account's report source deleted on the broker under load ([`super::reports`]):
    /// NATS, the report bucket; RabbitMQ, the instances' report queues; SQS, the report queue.
    /// Running instances report again (reports are cumulative); what a SIGKILLed one reported
    /// and the account had not read is gone.
    ReportsDeleted,
    /// The Backend's credentials rotated under load ([`super::credentials`]): its Secret moved
    /// to another user, and the old user revoked on the broker once no connection uses it
    /// (SQS: the Secret's keys changed, nothing to revoke; not on the cluster, which has no
    /// users).
    CredentialsRotated,
}

impl Fault {
    /// Every kind, each new one added last (a campaign of the first `kinds` draws what it
    /// drew before the later ones came: [`super::Campaign::kinds`]).
    pub const ALL: [Fault; 16] = [
        Fault::AppReplaced,
        Fault::AppScaledUp,
        Fault::AppScaledDown,
        Fault::LeaderKilled,
        Fault::LeaderStopped,
        Fault::Paused,
        Fault::Edited,
        Fault::AppKilled,
        Fault::BrokerDown,
        Fault::NodePaused,
        Fault::ApiServerRestarted,
        Fault::LeaderPartitioned,
        Fault::Recreated,
        Fault::ConsumerDeleted,
        Fault::ReportsDeleted,
        Fault::CredentialsRotated,
    ];
    /// How many kinds there are.
    pub const KINDS: usize = Fault::ALL.len();

    /// Whether the campaign can inject it on `broker`, with a control plane of its own or
    /// not: a node to pause only the cluster has; the API server it restarts only when it is
    /// the campaign's own (the environment's serves every other test).
    fn on(self, broker: Broker, own_api_server: bool) -> bool {
        match self {
            Fault::NodePaused => broker == Broker::NatsCluster,
            Fault::CredentialsRotated => broker != Broker::NatsCluster,
            Fault::ApiServerRestarted => own_api_server,
            _ => true,
        }
    }
}

/// Subscription `orders` deleted (waiting for its finalizer: its consumer or queue gone),
/// `manifest` applied again `gap` s later with `settle.dev/adopt` naming the old object, and
/// Ready; the publisher held throughout (`published`).
async fn recreate(
    api: &Api<Subscription>,
    manifest: &str,
    published: &tokio::sync::Mutex<u64>,
    target: &mut Target,
    t0: Instant,
    gap: u64,
) -> Recreation {
    let held = published.lock().await;
    let first_id = *held + 1;
    let old = api.get("orders").await.expect("the Subscription");
    let (ns, uid) = (
        old.metadata.namespace.unwrap_or_default(),
        old.metadata.uid.unwrap_or_default(),
    );
    let deleted = t0.elapsed();
    crate::kubectl_ok(
        &[
            "delete",
            "subscription",
            "orders",
            "-n",
            &ns,
            "--wait=true",
            "--timeout=120s",
        ],
        None,
    );
    tokio::time::sleep(Duration::from_secs(gap)).await;
    let applied = t0.elapsed();
    let adopting = manifest.replacen(
        "metadata: {name: orders,",
        &format!("metadata: {{annotations: {{settle.dev/adopt: \"{uid}\"}}, name: orders,"),
        1,
    );
    apply(&ns, &adopting);
    let made = wait_ready(api, "orders").await;
    target.ready().await;
    let ready = t0.elapsed();
    drop(held);
    Recreation {
        deleted,
        applied,
        ready,
        first_id,
        uid: made.metadata.uid.unwrap_or_default(),
    }
}

/// RabbitMQ back from a kill (at `down`) running nothing for the Subscription's queue: the
/// product must say so (`Ready=False QueueUnavailable`, within 60 s), and the campaign then
/// does what the condition tells a person: deletes the queue on the broker (what it held is
/// lost; counted as a deletion from the kill), and waits for the operator to make it again.
async fn replace_dead_queue(
    api: &Api<Subscription>,
    target: &Target,
    done: &mut Done,
    down: Duration,
    first_id: u64,
) -> String {
    let deadline = Instant::now() + Duration::from_secs(60);
    let said = loop {
        let unavailable = api.get("orders").await.ok().is_some_and(|s| {
            s.status.unwrap_or_default().conditions.iter().any(|c| {
                c.type_ == "Ready" && c.status == "False" && c.reason == "QueueUnavailable"
            })
        });
        if unavailable || Instant::now() > deadline {
            break unavailable;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    if !said {
        done.found.push(format!(
            "the queue ran nothing after the broker was back at {:.1} s, and Ready never said QueueUnavailable within 60 s",
            down.as_secs_f64()
        ));
    }
    let gone = Instant::now();
    let (what, _) = target.delete_consumer().await;
    done.consumer_deleted.push(Deletion {
        deleted: down,
        back: done.t0.elapsed(),
        first_id,
    });
    format!(
        "Ready=False QueueUnavailable {}; {what} deleted on the broker as it says, made again {:.1} s later",
        if said { "said" } else { "NOT said" },
        gone.elapsed().as_secs_f64()
    )
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

/// `n` faults drawn from `draw` among the first `kinds` of [`Fault::ALL`] that `broker` takes
/// (the API server restarted among them with `own_api_server`), one every `every` (give or
/// take a third of it), the first after `every`.
pub fn schedule(
    draw: &mut Draw,
    (n, kinds): (usize, usize),
    every: Duration,
    broker: Broker,
    own_api_server: bool,
) -> Vec<(Duration, Fault)> {
    let kinds: Vec<Fault> = Fault::ALL
        .into_iter()
        .take(kinds)
        .filter(|f| f.on(broker, own_api_server))
        .collect();
    let third = u64::try_from(every.as_millis() / 3).unwrap_or(1).max(1);
    (0..n)
        .map(|i| {
            let jitter = Duration::from_millis(draw.below(2 * third));
            let at = every * u32::try_from(i + 1).unwrap_or(u32::MAX) + jitter
                - Duration::from_millis(third);
            let fault = kinds[usize::try_from(draw.below(kinds.len() as u64)).unwrap_or(0)];
            (at, fault)
        })
        .collect()
}

/// The campaign's applications, each with its answers' file.
pub(super) struct Apps {
    /// Each running instance, with the index of its answers' file.
    pub(super) running: Vec<(App, usize)>,
    pub(super) files: Vec<PathBuf>,
    pub(super) env: Vec<(String, String)>,
    pub(super) manifest: PathBuf,
    /// The broker's name, in the answers' file names.
    pub(super) tag: &'static str,
}

impl Apps {
    pub(super) async fn start(&mut self) {
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
    pub(super) fn kill(&mut self, i: usize) -> Kill {
        let (mut app, file) = self.running.remove(i);
        let at_ms = settle::bus::report::now_ms();
        app.kill9();
        Kill { file, at_ms }
    }

    /// Instance `i` stopped (SIGTERM): it sends its last report as it exits; when (unix ms).
    pub(super) fn stop(&mut self, i: usize) -> Kill {
        let (mut app, file) = self.running.remove(i);
        let at_ms = settle::bus::report::now_ms();
        app.sigterm();
        assert!(
            app.wait_exit(Duration::from_secs(60)),
            "an application's graceful stop"
        );
        Kill { file, at_ms }
    }
}

/// The operators: the one that leads, and the one that stands by; each reaches the API server
/// through a partition of its own, so one can be cut off alone.
pub(super) struct Operators {
    pub(super) all: Vec<(Operator, Partition)>,
    pub(super) flags: Vec<String>,
    pub(super) ns: String,
    pub(super) started: usize,
}

impl Operators {
    pub(super) async fn spawn(&mut self) {
        self.started += 1;
        let flags: Vec<&str> = self.flags.iter().map(String::as_str).collect();
        let name = format!("chaos-op-{}", self.started);
        let link = Partition::to_api_server().await;
        let kubeconfig = link.kubeconfig(&name);
        let kubeconfig = kubeconfig.to_string_lossy();
        let op = Operator::spawn_env(
            &name,
            &self.ns,
            &flags,
            &[("POD_NAME", name.as_str()), ("KUBECONFIG", &kubeconfig)],
        );
        self.all.push((op, link));
    }

    /// The leader's index, once one leads.
    pub(super) async fn leader(&self) -> usize {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(i) = self
                .all
                .iter()
                .position(|(o, _)| o.metric("settle_leader", &[]) == 1.0)
            {
                return i;
            }
            assert!(Instant::now() < deadline, "no operator leads within 60 s");
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
}

/// What the faults did that the checker needs: the applications SIGKILLed or stopped, when
/// the broker was down, when an ack may have been lost, and when the API server was down
/// (since the campaign's start).
pub(super) struct Done {
    pub(super) t0: Instant,
    pub(super) kills: Vec<Kill>,
    /// The applications stopped with SIGTERM, and when: their last report, sent as they exit,
    /// goes if the report source is deleted before the account read it.
    pub(super) stops: Vec<Kill>,
    pub(super) outages: Vec<(Duration, Duration)>,
    /// From a second before a fault hit a server that may lose acks until it could no longer
    /// ([`AckLoss`]): an ack sent then may be lost (J3).
    pub(super) ack_outages: Vec<(Duration, Duration)>,
    pub(super) api_outages: Vec<(Duration, Duration)>,
    /// Each time the Subscription was deleted and applied again.
    pub(super) recreated: Vec<Recreation>,
    /// Each time its consumer or queue was deleted on the broker.
    pub(super) consumer_deleted: Vec<Deletion>,
    /// Each time its report source was deleted on the broker: from then until a report was
    /// there again.
    pub(super) reports_deleted: Vec<(Duration, Duration)>,
    /// What a fault found the product not doing (each a discrepancy).
    pub(super) found: Vec<String>,
}

/// The consumer or queue deleted on the broker: from then until the operator had made it
/// again (since the campaign's start), and the first message published after.
#[derive(Clone, Copy, Debug)]
pub(super) struct Deletion {
    pub(super) deleted: Duration,
    pub(super) back: Duration,
    pub(super) first_id: u64,
}

/// The Subscription deleted and applied again: from its deletion until the new object was
/// Ready (since the campaign's start), and the first message published after (the one the
/// publisher sent next).
#[derive(Clone, Debug)]
pub(super) struct Recreation {
    pub(super) deleted: Duration,
    pub(super) applied: Duration,
    pub(super) ready: Duration,
    pub(super) first_id: u64,
    /// The new object's UID.
    pub(super) uid: String,
}

impl Done {
    /// The broker hit at `down` (since the start) and whole again now.
    fn broker_down(&mut self, down: Duration, hit: &Hit) {
        let back = self.t0.elapsed();
        self.outages.push((down, back));
        let from = down.saturating_sub(Duration::from_secs(1));
        match hit.acks_lost {
            AckLoss::None => {}
            AckLoss::UntilWhole => self.ack_outages.push((from, back)),
            AckLoss::For(held) => self.ack_outages.push((from, (down + held).min(back))),
        }
    }
}

/// What the faults act on.
pub(super) struct World {
    pub(super) apps: Apps,
    pub(super) ops: Operators,
    pub(super) api: Api<Subscription>,
    pub(super) target: Target,
    pub(super) done: Done,
    /// The campaign's own control plane, when it runs on one.
    pub(super) control_plane: Option<ControlPlane>,
    /// Held by the publisher while it sends a message, and then the last id it sent; a fault
    /// holds it to stop publishing.
    pub(super) published: Arc<tokio::sync::Mutex<u64>>,
    /// The Subscription's manifest, as applied at the start.
    pub(super) manifest: String,
    /// The broker's users, for a rotation of the Backend's credentials.
    pub(super) access: Access,
}

/// Injects `fault` into `w`; says what was done.
pub(super) async fn inject(fault: Fault, draw: &mut Draw, w: &mut World) -> String {
    let World {
        apps,
        ops,
        api,
        target,
        done,
        control_plane,
        published,
        manifest,
        access,
    } = w;
    match fault {
        Fault::AppReplaced => {
            let i = usize::try_from(draw.below(apps.running.len() as u64)).unwrap_or(0);
            done.stops.push(apps.stop(i));
            apps.start().await;
            format!("application {i} stopped (SIGTERM) and another started")
        }
        Fault::AppScaledUp if apps.running.len() < 4 => {
            apps.start().await;
            format!("scaled up to {}", apps.running.len())
        }
        Fault::AppScaledDown if apps.running.len() > 1 => {
            let i = usize::try_from(draw.below(apps.running.len() as u64)).unwrap_or(0);
            done.stops.push(apps.stop(i));
            format!("scaled down to {}", apps.running.len())
        }
        Fault::AppScaledUp | Fault::AppScaledDown => "scaling left as it is (at its bound)".into(),
        Fault::BrokerDown => {
            let secs = 1 + draw.below(4);
            let graceful = draw.below(2) == 1;
            // RabbitMQ may come back with the queue dead: nothing is published until it is
            // known to run, or has been made again.
            let held = if target.broker() == Broker::Rabbitmq {
                Some(published.lock().await)
            } else {
                None
            };
            let down = done.t0.elapsed();
            let hit = target
                .kill_broker(Duration::from_secs(secs), graceful, draw)
                .await;
            done.broker_down(down, &hit);
            if !hit.dead_queue {
                return hit.what;
            }
            let first_id = held.as_deref().map_or(1, |last| last + 1);
            let said = replace_dead_queue(api, target, done, down, first_id).await;
            format!("{}; {said}", hit.what)
        }
        Fault::ApiServerRestarted => {
            let Some(cp) = control_plane.as_mut() else {
                return "the API server left running (it is the environment's)".into();
            };
            let secs = 1 + draw.below(4);
            let down = done.t0.elapsed();
            cp.kill();
            tokio::time::sleep(Duration::from_secs(secs)).await;
            tokio::task::block_in_place(|| cp.start_again());
            let back = done.t0.elapsed();
            done.api_outages.push((down, back));
            format!(
                "the API server and etcd SIGKILLed, started again {secs} s later, serving {:.1} s after the kill",
                (back - down).as_secs_f64()
            )
        }
        Fault::NodePaused => {
            let secs = 3 + draw.below(8);
            let down = done.t0.elapsed();
            let hit = target
                .pause_node(Duration::from_secs(secs), draw.below(2))
                .await;
            done.broker_down(down, &hit);
            hit.what
        }
        Fault::AppKilled => {
            let i = usize::try_from(draw.below(apps.running.len() as u64)).unwrap_or(0);
            done.kills.push(apps.kill(i));
            apps.start().await;
            format!("application {i} SIGKILLed and another started")
        }
        Fault::Paused => {
            let secs = 2 + draw.below(4);
            patch_spec(api, serde_json::json!({ "paused": true })).await;
            tokio::time::sleep(Duration::from_secs(secs)).await;
            patch_spec(
                api,
                serde_json::json!({ "paused": null, "pausedUntil": null }),
            )
            .await;
            format!("paused for {secs} s, then resumed")
        }
        Fault::Edited => {
            let n = 2 + draw.below(63);
            patch_spec(api, serde_json::json!({ "maxInFlight": n })).await;
            format!("maxInFlight set to {n}")
        }
        Fault::LeaderPartitioned => {
            let secs = 3 + draw.below(23);
            let i = ops.leader().await;
            let (leader, link) = &ops.all[i];
            link.pause(true);
            tokio::time::sleep(Duration::from_secs(secs)).await;
            let leads = leader.metric("settle_leader", &[]) == 1.0;
            link.pause(false);
            format!(
                "the leading operator cut off from the API server for {secs} s, then joined again ({})",
                if leads {
                    "it still led at the end"
                } else {
                    "it had stopped leading"
                }
            )
        }
        Fault::Recreated => {
            let gap = target.broker().recreate_after().as_secs() + draw.below(4);
            let r = recreate(api, manifest, published, target, done.t0, gap).await;
            let line = format!(
                "the Subscription deleted ({:.1} s), applied again {gap} s later as a new object, Ready {:.1} s after that; publishing from message {}",
                (r.applied - r.deleted).as_secs_f64() - gap as f64,
                (r.ready - r.applied).as_secs_f64(),
                r.first_id
            );
            done.recreated.push(r);
            line
        }
        Fault::ConsumerDeleted => {
            let held = published.lock().await;
            let first_id = *held + 1;
            let deleted = done.t0.elapsed();
            let (what, ago) = target.delete_consumer().await;
            let back = done.t0.elapsed().saturating_sub(ago).max(deleted);
            drop(held);
            done.consumer_deleted.push(Deletion {
                deleted,
                back,
                first_id,
            });
            format!(
                "{what} deleted on the broker, made again {:.1} s later; publishing from message {first_id}",
                (back - deleted).as_secs_f64()
            )
        }
        Fault::CredentialsRotated => access.rotate(target, &ops.ns).await,
        Fault::ReportsDeleted => {
            let deleted = done.t0.elapsed();
            let what = target.delete_reports(&ops.ns).await;
            let back = done.t0.elapsed();
            done.reports_deleted.push((deleted, back));
            format!(
                "{what} deleted on the broker, reports there again {:.1} s later",
                (back - deleted).as_secs_f64()
            )
        }
        Fault::LeaderKilled | Fault::LeaderStopped => {
            let i = ops.leader().await;
            let (mut leader, _link) = ops.all.remove(i);
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
            ops.spawn().await;
            format!(
                "the leading operator {}, and started again",
                if fault == Fault::LeaderKilled {
                    "SIGKILLed"
                } else {
                    "SIGTERMed"
                }
            )
        }
    }
}
