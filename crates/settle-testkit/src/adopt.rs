//! The adoption scenarios (docs/semantics.md J9, R13, Q11), written once and run on every broker
//! that supports them: a consumer or queue made by hand, as another application would, taken over
//! by a Subscription with `spec.adopt: IfCompatible` with its position (nothing redelivered but
//! what its own ack wait gave back, nothing lost, the account exact from the takeover on); one
//! that differs where the broker cannot change it in place refused with the fields named and
//! left untouched; and the tenancy rules: a namespace `--adopt-namespaces` does not list takes
//! nothing, and once taken, another namespace's Subscription of the same durableName cannot take
//! it again.
//!
//! A broker's part is a [`HandMade`]: how it makes the object by hand, publishes, hands messages
//! to a client that does not settle them, and what it shows of the object.

use std::collections::BTreeMap;
use std::future::Future;
use std::time::Duration;

use kube::Api;
use settle::api::{Subscription, SubscriptionStats};

use super::account::{App, assert_never_decreased, settled_at, stats_in, watch};
use super::operator::{Operator, condition, poll};
use super::subs::{apply, subs, wait_condition, wait_event, wait_gone, wait_ready};
use super::{install_crds, kubectl_ok, namespace};

/// What a broker shows of a hand-made object, the way an adoption must keep it and a refusal
/// must leave it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Look {
    /// What makes it the same object (a JetStream consumer's `created`, an SQS queue's
    /// `CreatedTimestamp`, a RabbitMQ queue's arguments).
    pub identity: String,
    /// Its whole config as the broker shows it.
    pub config: String,
    /// Messages waiting for a delivery.
    pub pending: u64,
    /// Messages handed out and not settled.
    pub unsettled: u64,
}

/// One broker's part of the adoption scenarios.
pub trait HandMade: Sized {
    /// The broker side of test `test` in namespace `ns`: its stream or queue name of its own,
    /// and the Backend `name` applied in `ns` (on the same broker, so namespaces share it).
    fn new(test: &str) -> impl Future<Output = Self>;
    /// Applies this broker's Backend, named as [`HandMade::spec`] refers to it, in `ns`.
    fn backend(&self, ns: &str);
    /// The Subscription's spec lines (indented two spaces): backendRef, pattern, mode,
    /// durableName and whatever else the object made by hand matches.
    fn spec(&self) -> String;
    /// The application's environment: which broker it runs on.
    fn app_env(&self) -> Vec<(&'static str, String)>;
    /// Makes the consumer or queue by hand: equal to what the mapping makes for
    /// [`HandMade::spec`] where the broker cannot change it in place (`compatible`), else
    /// differing there in [`HandMade::differing`].
    fn make(&mut self, compatible: bool) -> impl Future<Output = ()>;
    /// The fields an incompatible one differs in, as the refusal names them.
    fn differing(&self) -> &'static [&'static str];
    /// Publishes `n` messages; their bodies.
    fn publish(&mut self, n: usize) -> impl Future<Output = Vec<String>>;
    /// Hands `n` messages to a client of its own that never settles them; their bodies.
    fn hold(&mut self, n: usize) -> impl Future<Output = Vec<String>>;
    /// That client goes; what it held comes back (at once, or when its ack wait runs out).
    fn let_go(&mut self) -> impl Future<Output = ()>;
    /// What the broker shows of the object now; `None` when it is gone.
    fn look(&self) -> impl Future<Output = Option<Look>>;
    /// Removes what the test left on the broker.
    fn finish(self) -> impl Future<Output = ()>;
}

/// The operator's flags: no leader election, status every second, and `--adopt-namespaces`.
fn flags(allowed: &str) -> Vec<String> {
    [
        "--leader-election=false",
        "--stats-interval",
        "1s",
        "--drift-interval",
        "2s",
        "--adopt-namespaces",
        allowed,
    ]
    .map(str::to_string)
    .to_vec()
}

fn operator(test: &str, watch: &str, allowed: &str) -> Operator {
    let flags = flags(allowed);
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    Operator::start_with(test, watch, &flags)
}

/// Subscription `orders` in `ns` with `spec` and then `more` lines, applied; its manifest.
fn subscribe(ns: &str, spec: &str, more: &str) -> String {
    let text = format!(
        "apiVersion: messaging.settle.dev/v1alpha1\nkind: Subscription\nmetadata: {{name: orders, namespace: {ns}}}\nspec:\n{spec}{more}"
    );
    apply(ns, &text);
    text
}

/// Waits until `orders` is `Ready=False ConsumerConflict` with a message that contains every
/// one of `words`; returns the message.
async fn wait_conflict(api: &Api<Subscription>, words: &[&str]) -> String {
    wait_condition(
        api,
        "orders",
        "Ready",
        "False",
        "ConsumerConflict",
        Duration::from_secs(60),
    )
    .await;
    poll(
        &format!("the ConsumerConflict message to say {words:?}"),
        Duration::from_secs(30),
        || async {
            let s = api.get("orders").await.map_err(|e| e.to_string())?;
            let conditions = s.status.map(|s| s.conditions).unwrap_or_default();
            let (_, reason, message) = condition(&conditions, "Ready").ok_or("no Ready")?;
            if reason == "ConsumerConflict" && words.iter().all(|w| message.contains(w)) {
                Ok(message)
            } else {
                Err(format!("{reason}: {message}"))
            }
        },
    )
    .await
}

/// Waits until the broker shows the object with `pending` waiting and `unsettled` handed out
/// (its gauges may lag: RabbitMQ's management API refreshes them every few seconds).
async fn look_when<H: HandMade>(hand: &H, what: &str, pending: u64, unsettled: u64) -> Look {
    poll(what, Duration::from_secs(30), || async {
        match hand.look().await {
            Some(l) if l.pending == pending && l.unsettled == unsettled => Ok(l),
            other => Err(format!("{other:?}")),
        }
    })
    .await
}

/// `kubectl delete` of Subscription `orders` in `ns`, not waiting.
fn delete_orders(ns: &str) {
    kubectl_ok(
        &["delete", "subscription", "orders", "-n", ns, "--wait=false"],
        None,
    );
}

async fn gauges(api: &Api<Subscription>) -> Option<SubscriptionStats> {
    api.get("orders").await.ok()?.status?.stats
}

/// A hand-made consumer (or queue) with 150 messages, 100 of them handed to a client that does
/// not settle them, taken over by `adopt: IfCompatible`: Ready, an `Adopted` Event, the same
/// object with the same 50 waiting and 100 unsettled (status shows them in its gauges, and
/// counts nothing: they were delivered before the takeover). The client gone, an application
/// on the `settle` runtime that acks is handed each message exactly once: the 100 as their
/// second attempt (the first was the client's, given back), the 50 as their first; status counts
/// exactly 150 offered, delivered and acked. Deleting the Subscription deletes the object
/// (deletionPolicy Delete).
pub async fn adopted_with_its_position<H: HandMade>(test: &str) {
    install_crds();
    let ns = namespace(test);
    let mut hand = H::new(test).await;
    let op = operator(test, &ns, &ns);
    hand.backend(&ns);
    hand.make(true).await;
    let bodies = hand.publish(150).await;
    let held = hand.hold(100).await;
    assert_eq!(held.len(), 100);
    let before = look_when(&hand, "50 waiting and 100 held by hand", 50, 100).await;

    let text = subscribe(&ns, &hand.spec(), "  adopt: IfCompatible\n");
    let api = subs(&ns).await;
    wait_ready(&api, "orders").await;
    let note = wait_event(&ns, "orders", "Adopted").await;
    println!("Adopted: {note}");
    assert!(note.contains("which Settle did not make"), "{note}");
    let after = look_when(
        &hand,
        "nothing redelivered or lost by the takeover: 50 waiting, 100 held",
        50,
        100,
    )
    .await;
    assert_eq!(after.identity, before.identity, "the same object");
    let (seen, watcher) = watch(&api, "orders");
    // What was delivered before is the broker's, not the account's: in the gauges only.
    let shown = poll(
        "status to show the 50 pending and the 100 unsettled, and no count",
        Duration::from_secs(30),
        || async {
            match gauges(&api).await {
                Some(s) if s.pending == 50 && s.ack_pending == 100 => Ok(s),
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await;
    assert_eq!(shown.counters, Default::default(), "{shown:?}");

    // The hand-made client goes; an application on the runtime takes every message.
    hand.let_go().await;
    let manifest = super::root().join(format!("target/adopt-{test}-{}.yaml", std::process::id()));
    std::fs::write(&manifest, &text).expect("manifest");
    let env = hand.app_env();
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let app = App::start(&env, &manifest, "ack-seen");
    app.wait_ready().await;
    app.wait_count("seen", 150, Duration::from_secs(120)).await;
    let s = settled_at(
        "150 acked in status",
        Duration::from_secs(60),
        || stats_in(&api, "orders"),
        |s| s.settlement.acked >= 150,
    )
    .await;
    let mut attempts: BTreeMap<String, Vec<u32>> = BTreeMap::new();
    for line in app.lines("seen ") {
        let mut words = line.split_whitespace().skip(1);
        let (body, attempt) = (words.next(), words.next().and_then(|a| a.parse().ok()));
        if let (Some(body), Some(attempt)) = (body, attempt) {
            attempts.entry(body.to_string()).or_default().push(attempt);
        }
    }
    assert_eq!(
        attempts.keys().cloned().collect::<Vec<_>>(),
        {
            let mut b = bodies.clone();
            b.sort();
            b
        },
        "every message handed to the application"
    );
    for (body, seen) in &attempts {
        let want = if held.contains(body) { 2 } else { 1 };
        assert_eq!(
            seen,
            &vec![want],
            "message {body}: handed once, as attempt {want} (held before the takeover: {})",
            held.contains(body)
        );
    }
    assert_eq!(s.offered, 150, "{s:?}");
    assert_eq!(s.delivered, 150, "{s:?}");
    assert_eq!(s.settlement.acked, 150, "{s:?}");
    assert_eq!(
        (
            s.settlement.nacked,
            s.settlement.silent,
            s.released,
            s.exhausted
        ),
        (0, 0, 0, 0),
        "{s:?}"
    );
    assert!(s.balanced(), "{s:?}");
    poll("the gauges at rest", Duration::from_secs(30), || async {
        match gauges(&api).await {
            Some(g) if g.pending == 0 && g.ack_pending == 0 => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    watcher.abort();
    assert_never_decreased(&seen);
    drop(app);

    // Adopted, it is the Subscription's: deleted with it.
    delete_orders(&ns);
    wait_gone(&api, "orders", Duration::from_secs(60)).await;
    assert_eq!(hand.look().await, None, "deleted with its Subscription");
    let _ = std::fs::remove_file(&manifest);
    drop(op);
    hand.finish().await;
    kubectl_ok(&["delete", "namespace", &ns, "--wait=false"], None);
}

/// A hand-made consumer (or queue) that differs where the broker cannot change it in place:
/// with `adopt` unset, `ConsumerConflict` says `spec.adopt: IfCompatible` is the way to take one
/// over; with it, `ConsumerConflict` names each differing field, and what the broker holds is
/// exactly as before. Deleting the Subscription leaves it.
pub async fn an_incompatible_one_is_refused_and_left_untouched<H: HandMade>(test: &str) {
    install_crds();
    let ns = namespace(test);
    let mut hand = H::new(test).await;
    let _op = operator(test, &ns, &ns);
    hand.backend(&ns);
    hand.make(false).await;
    hand.publish(10).await;
    let before = look_when(&hand, "10 messages waiting", 10, 0).await;

    subscribe(&ns, &hand.spec(), "");
    let api = subs(&ns).await;
    let m = wait_conflict(
        &api,
        &["Settle did not make it", "spec.adopt: IfCompatible"],
    )
    .await;
    println!("adopt Never: {m}");
    // adopt changes on a live object: the next check reads it.
    subscribe(&ns, &hand.spec(), "  adopt: IfCompatible\n");
    let mut words = vec!["spec.adopt IfCompatible takes it over only when it equals this spec"];
    words.extend(hand.differing());
    let m = wait_conflict(&api, &words).await;
    println!("adopt IfCompatible: {m}");
    // Three more checks (drift every 2 s): nothing is done to it meanwhile either.
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert_eq!(hand.look().await, Some(before.clone()), "left untouched");
    assert!(
        !super::subs::events(&ns, "orders")
            .await
            .iter()
            .any(|(r, _)| r == "Adopted"),
        "nothing adopted"
    );
    delete_orders(&ns);
    wait_gone(&api, "orders", Duration::from_secs(60)).await;
    assert_eq!(hand.look().await, Some(before), "not its own: left");
    hand.finish().await;
    kubectl_ok(&["delete", "namespace", &ns, "--wait=false"], None);
}

/// Three namespaces on one broker, one hand-made object of one name. `outside` (not in
/// `--adopt-namespaces`) asks to adopt it: refused, saying the flag. `team-a` (listed) takes it
/// over. `team-b` (listed too) then asks for the same: refused, it belongs to team-a's
/// Subscription; its deletion leaves it. team-a's object stays Ready throughout.
pub async fn another_namespace_never_takes_it<H: HandMade>(test: &str) {
    install_crds();
    let outside = namespace(&format!("{test}-x"));
    let team_a = namespace(&format!("{test}-a"));
    let team_b = namespace(&format!("{test}-b"));
    let mut hand = H::new(test).await;
    let _op = operator(
        test,
        &format!("{outside},{team_a},{team_b}"),
        &format!("{team_a},{team_b}"),
    );
    for ns in [&outside, &team_a, &team_b] {
        hand.backend(ns);
    }
    hand.make(true).await;
    hand.publish(5).await;

    subscribe(&outside, &hand.spec(), "  adopt: IfCompatible\n");
    let api_x = subs(&outside).await;
    let m = wait_conflict(&api_x, &["--adopt-namespaces", &outside]).await;
    println!("outside: {m}");

    subscribe(&team_a, &hand.spec(), "  adopt: IfCompatible\n");
    let api_a = subs(&team_a).await;
    wait_ready(&api_a, "orders").await;
    wait_event(&team_a, "orders", "Adopted").await;
    let taken = hand.look().await.expect("there");

    subscribe(&team_b, &hand.spec(), "  adopt: IfCompatible\n");
    let api_b = subs(&team_b).await;
    let m = wait_conflict(
        &api_b,
        &[&format!("belongs to Subscription {team_a}/orders")],
    )
    .await;
    println!("team-b: {m}");
    delete_orders(&team_b);
    wait_gone(&api_b, "orders", Duration::from_secs(60)).await;
    assert_eq!(
        hand.look().await.map(|l| l.identity),
        Some(taken.identity),
        "another namespace's deletion leaves it"
    );
    wait_ready(&api_a, "orders").await;
    delete_orders(&team_a);
    wait_gone(&api_a, "orders", Duration::from_secs(60)).await;
    hand.finish().await;
    for ns in [&outside, &team_a, &team_b] {
        kubectl_ok(&["delete", "namespace", ns, "--wait=false"], None);
    }
}
