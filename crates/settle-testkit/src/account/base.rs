//! What every broker's account scene holds ([`Base`]: namespace, operator, Subscription `orders`,
//! its watcher) and what a broker's scene offers the scenarios written once ([`AccountScene`]).

use std::time::Duration;

use kube::Api;
use settle::api::{ConsumerStats, Subscription};

use super::app::App;
use super::wait::{settled_at, wait_until};
use super::watch::{Seen, assert_never_decreased, reported_in, stats_in, watch};
use crate::kubectl_ok;
use crate::operator::Operator;
use crate::subs::{apply, subs, wait_ready};

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
            crate::root().join(format!("target/account-{test}-{}.yaml", std::process::id()));
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
        crate::subs::wait_gone(&self.api, "orders", limit).await;
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

/// What a broker's account scene offers the scenarios written once for every broker (the NATS
/// [`Scene`](super::Scene), `crate::sqs::SqsScene`, RabbitMQ's in `account_rabbitmq.rs`): an
/// application, messages, and its [`Base`] (status, the operator), which it derefs to.
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
