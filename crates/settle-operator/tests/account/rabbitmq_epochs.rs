//! A new Subscription object on RabbitMQ (the scenarios every broker runs, `common::account`): a
//! takeover with `settle.dev/adopt` counted on the new object without a restart and without the
//! old one's history, and a delete and apply across slow handlers that leaves the new object
//! balanced; and RabbitMQ's own case, a dead letter of the object before a takeover read only
//! after it, which counts for nobody (semantics C15, R10).

use settle_testkit as common;

use std::time::Duration;

use common::account::OPERATOR_FLAGS;
use common::operator::{Operator, poll};
use common::subs::{apply, delete_by_hand, wait_ready};
use lapin::options::{BasicGetOptions, BasicRejectOptions};

use super::rabbitmq::Scene;

/// A takeover under a running application (the scenario every broker runs): the new object
/// counts the new messages without a restart, and none of the old one's history.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_on_rabbitmq_under_a_running_application_counts_on_the_new_object_without_history()
 {
    let scene = Scene::new("acctrq-takeover").await;
    common::account::takeover_under_a_running_app_scenario(&scene).await;
    scene.finish().await;
}

/// Delete and apply on RabbitMQ while five slow handlers run: their completions stay the old
/// object's, and the new one balances at rest (I1).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delete_and_apply_on_rabbitmq_across_slow_handlers_leaves_the_new_object_balanced() {
    let scene = Scene::build(
        "acctrq-recreate-slow",
        false,
        common::account::SLOW_SPEC,
        &OPERATOR_FLAGS,
    )
    .await;
    common::account::recreate_under_slow_handlers_scenario(&scene).await;
    scene.finish().await;
}

/// The queue dead-letters a message while no operator runs, its Subscription goes (its
/// finalizer taken off by hand: the queue stays) and is applied again taking the queue over:
/// the copy the operator then reads names the queue the new object owns, but is from before it
/// was made, so it counts for nobody (`earlier_object`), and the new object's `exhausted`
/// stays 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_of_the_object_before_a_takeover_on_rabbitmq_counts_for_nobody() {
    let mut scene = Scene::with_dead_letters("acctrq-earlier").await;
    scene
        .wait_stats(
            "the account's first status",
            Duration::from_secs(60),
            |_| true,
        )
        .await;
    let old = scene.api.get("orders").await.expect("get").metadata.uid;
    let old = old.expect("a uid");
    scene.op.kill9();

    // The one message rejected on its queue by hand: the dead-letter exchange copies it.
    scene.publish(1).await;
    let ch = scene.amqp.create_channel().await.expect("channel");
    let got = poll(
        "the message on the queue",
        Duration::from_secs(30),
        || async {
            let got = ch
                .basic_get(scene.tag.as_str().into(), BasicGetOptions { no_ack: false })
                .await
                .map_err(|e| e.to_string())?;
            got.ok_or_else(|| "not yet".to_string())
        },
    )
    .await;
    ch.basic_reject(
        got.delivery.delivery_tag,
        BasicRejectOptions { requeue: false },
    )
    .await
    .expect("reject");
    let _ = ch.close(200, "rejected".into()).await;
    scene.dead_letters(1).await;

    delete_by_hand(&scene.ns, "orders");
    // Past the second the copy is dated by: the new object is made in a later one.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let text = std::fs::read_to_string(&scene.manifest).expect("manifest");
    let adopting = text.replacen(
        "metadata: {name: orders,",
        &format!("metadata: {{annotations: {{settle.dev/adopt: \"{old}\"}}, name: orders,"),
        1,
    );
    assert_ne!(adopting, text, "the manifest names its object as expected");
    apply(&scene.ns, &adopting);
    scene.op = Operator::start_with(&scene.test, &scene.ns, &OPERATOR_FLAGS);
    let sub = wait_ready(&scene.api, "orders").await;
    assert_ne!(
        sub.metadata.uid.as_deref(),
        Some(old.as_str()),
        "a new object"
    );
    poll(
        "the copy read, as an earlier object's",
        Duration::from_secs(60),
        || async {
            match scene.dead_letter_metric("earlier_object") {
                1.0 => Ok(()),
                n => Err(format!(
                    "{n} earlier_object, {} counted",
                    scene.dead_letter_metric("counted")
                )),
            }
        },
    )
    .await;
    let s = scene
        .wait_stats("the new object's account", Duration::from_secs(60), |_| {
            true
        })
        .await;
    assert_eq!(
        s.exhausted, 0,
        "the earlier object's loss is not this one's: {s:?}"
    );
    assert_eq!(scene.dead_letter_metric("counted"), 0.0);
    scene.finish().await;
}
