//! What the account keeps on RabbitMQ for a namespace goes with it: its Subscriptions and
//! Backend deleted at once (as the namespace controller does) leave none of the account's
//! queues (report, ledger, index, object mark, each instance's report queue). The keeper drops a
//! gone Subscription's at its next round; a Backend going at the same moment ends the keeper
//! first, so the Backend deletes its namespace's leftovers as it goes (through the management
//! API it lists them with). Here the keeper mostly wins that race: this scene pins the outcome,
//! and the fixed-seed RabbitMQ campaign (`tests/chaos.rs`) is where the Backend once won it.

use settle_testkit as common;

use std::time::Duration;

use common::operator::poll;
use common::rabbitmq::management_json;

use super::rabbitmq::Scene;

/// The account's queues of namespace `ns` on the broker.
fn account_queues_of(ns: &str) -> Vec<String> {
    let all = management_json("GET", "/api/queues/%2f?columns=name");
    let kinds = ["stats", "ledger", "instances", "object", "report"];
    all.as_array()
        .map(|qs| {
            qs.iter()
                .filter_map(|q| q["name"].as_str())
                .filter(|n| {
                    kinds
                        .iter()
                        .any(|k| n.starts_with(&format!("settle.{k}.{ns}.")))
                })
                .map(String::from)
                .collect()
        })
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_namespace_deleted_at_once_on_rabbitmq_leaves_none_of_the_accounts_queues() {
    let scene = Scene::new("acctrq-ns-gone").await;
    let mut app = scene.app();
    app.wait_ready().await;
    scene.publish(2).await;
    scene
        .wait_stats("two messages exhausted", Duration::from_secs(60), |s| {
            s.exhausted == 2
        })
        .await;
    let made = account_queues_of(&scene.ns);
    assert!(
        made.iter().any(|q| q.starts_with("settle.report."))
            && made.iter().any(|q| q.starts_with("settle.ledger.")),
        "the account's queues, an instance's report queue among them: {made:?}"
    );
    app.kill9();
    common::subs::delete_all_at_once(&scene.ns);
    poll(
        "none of the account's queues left for the namespace",
        Duration::from_secs(60),
        || async {
            match account_queues_of(&scene.ns) {
                left if left.is_empty() => Ok(()),
                left => Err(format!("{left:?}")),
            }
        },
    )
    .await;
    scene.finish().await;
}
