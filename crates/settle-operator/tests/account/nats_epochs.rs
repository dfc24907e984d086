//! A new Subscription object under running applications, on NATS (the scenarios every broker
//! runs, `common::account`): a takeover with `settle.dev/adopt` counted on the new object
//! without a restart and without the old one's history, and a delete and apply across slow
//! handlers that leaves the new object balanced (a delivery counts in the epoch it was offered
//! in).

use settle_testkit as common;

use common::account::{NACK_SPEC, Scene};

/// A takeover under a running application (the scenario every broker runs): the new object
/// counts the new messages without a restart, and none of the old one's history.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_under_a_running_application_counts_on_the_new_object_without_history() {
    let scene = Scene::new("acct-takeover", NACK_SPEC).await;
    common::account::takeover_under_a_running_app_scenario(&scene).await;
    scene.finish().await;
}

/// Delete and apply while five slow handlers run: their completions stay the old object's,
/// and the new one balances at rest (I1).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delete_and_apply_across_slow_handlers_leaves_the_new_object_balanced() {
    let scene = Scene::new(
        "acct-recreate-slow",
        &format!("  durableName: orders\n{}", common::account::SLOW_SPEC),
    )
    .await;
    common::account::recreate_under_slow_handlers_scenario(&scene).await;
    scene.finish().await;
}
