//! Pause (`spec.paused`, `spec.pausedUntil`; docs/semantics.md W1–W6) on the real API
//! server and each real broker: `settle operator` as a process, the test application
//! (`examples/account_app.rs`) as another, and one scenario (`common::pause::pause_scenario`)
//! on NATS JetStream, RabbitMQ and SQS (ElasticMQ): paused, nothing delivered for 10 s while
//! messages wait, `Paused=True` and no `Stalled`; resumed, all delivered once. On NATS also: a
//! consumer resumed by hand on the server is paused again by the operator, and a Subscription
//! made paused has its consumer paused from its first moment, until the time it names.

use settle_testkit as common;

use std::time::Duration;

use common::account::Scene;
use common::operator::poll;
use common::pause::{
    PAUSE_SPEC, POLL, flags, patch_spec, pause_scenario, recreate_while_paused_scenario, wait_shown,
};
use common::rabbit_scene::RabbitScene;
use common::sqs::SqsScene;

const POLL_ENV: (&str, &str) = ("SETTLE_PAUSE_POLL_INTERVAL", POLL);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paused_on_nats_nothing_is_delivered_until_resumed_then_all_once() {
    let scene = Scene::with_flags(
        "pause-nats",
        &format!("  durableName: orders\n{PAUSE_SPEC}"),
        &flags(),
    )
    .await;
    let app = scene.app_with("ack", &[POLL_ENV]);
    pause_scenario(&scene, &app).await;
    drop(app);
    scene.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paused_on_rabbitmq_nothing_is_delivered_until_resumed_then_all_once() {
    let scene = RabbitScene::new("pause-rabbit", PAUSE_SPEC, &flags(), &[POLL_ENV]).await;
    let app = scene.app("ack");
    pause_scenario(&scene, &app).await;
    // Resumed: the paused marker gone, the running one there (the applications' checks answer
    // without a refusal); both go with the Subscription.
    use settle::backend::rabbitmq::pause::{paused_marker, running_marker};
    let exchange = |name: &str| {
        common::rabbitmq::management(
            "GET",
            &format!("/api/exchanges/%2f/{}", common::rabbitmq::encode(name)),
        )
        .0
    };
    let (paused, running) = (paused_marker(&scene.tag), running_marker(&scene.tag));
    assert_eq!(exchange(&paused), 404, "{paused} outlived the pause");
    assert_eq!(exchange(&running), 200, "{running} while it runs");
    drop(app);
    scene.delete_orders(Duration::from_secs(60)).await;
    assert_eq!(
        exchange(&running),
        404,
        "{running} outlived the Subscription"
    );
    scene.finish();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paused_on_sqs_nothing_is_delivered_until_resumed_then_all_once() {
    let scene = SqsScene::with_flags("pause-sqs", PAUSE_SPEC, &[POLL_ENV], &flags()).await;
    let app = scene.app("ack");
    pause_scenario(&scene, &app).await;
    drop(app);
    scene.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleted_while_paused_on_nats_and_applied_again_the_new_object_counts_every_delivery() {
    let scene = Scene::with_flags(
        "pause-recreate-nats",
        &format!("  durableName: orders\n{PAUSE_SPEC}"),
        &flags(),
    )
    .await;
    let app = scene.app_with("ack", &[POLL_ENV]);
    recreate_while_paused_scenario(&scene, &app).await;
    drop(app);
    scene.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleted_while_paused_on_rabbitmq_and_applied_again_the_new_object_counts_every_delivery() {
    let scene = RabbitScene::new("pause-recreate-rabbit", PAUSE_SPEC, &flags(), &[POLL_ENV]).await;
    let app = scene.app("ack");
    recreate_while_paused_scenario(&scene, &app).await;
    drop(app);
    scene.finish();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleted_while_paused_on_sqs_and_applied_again_the_new_object_counts_every_delivery() {
    let scene = SqsScene::with_flags("pause-recreate-sqs", PAUSE_SPEC, &[POLL_ENV], &flags()).await;
    let app = scene.app("ack");
    recreate_while_paused_scenario(&scene, &app).await;
    drop(app);
    scene.finish().await;
}

/// The consumer's pause as the server reports it: `(paused, pause_until)`.
async fn live_pause(scene: &Scene) -> (bool, Option<String>) {
    let info: serde_json::Value = scene
        .stream
        .js
        .request(
            format!("CONSUMER.INFO.{}.orders", scene.stream.name),
            &serde_json::json!({}),
        )
        .await
        .expect("CONSUMER.INFO");
    (
        info["paused"].as_bool().unwrap_or(false),
        info["config"]["pause_until"].as_str().map(str::to_string),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nats_consumer_resumed_by_hand_is_paused_again_and_a_time_ends_the_pause() {
    let scene = Scene::with_flags("pause-drift", "  durableName: orders\n", &flags()).await;
    patch_spec(&scene.ns, serde_json::json!({"paused": true}));
    wait_shown(&scene, "Paused", "True").await;
    let (paused, until) = live_pause(&scene).await;
    assert!(paused, "paused on the server");
    assert_eq!(
        until.as_deref(),
        Some("9999-01-01T00:00:00Z"),
        "an indefinite pause is sent as the year 9999"
    );

    // Someone resumes it on the server (`nats consumer resume`): the operator sees the API
    // call and pauses it again.
    let resumed: serde_json::Value = scene
        .stream
        .js
        .request(
            format!("CONSUMER.PAUSE.{}.orders", scene.stream.name),
            &serde_json::json!({}),
        )
        .await
        .expect("CONSUMER.PAUSE");
    assert_eq!(resumed["paused"], false, "resumed by hand: {resumed}");
    poll(
        "the operator to pause the consumer again",
        Duration::from_secs(30),
        || async {
            match live_pause(&scene).await {
                (true, Some(u)) if u == "9999-01-01T00:00:00Z" => Ok(()),
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await;
    common::subs::wait_event(&scene.ns, "orders", "Paused").await;

    // Paused until a time a few seconds ahead: the server holds it until then, and status
    // turns Paused=False by itself when it passes.
    let until = k8s_openapi::jiff::Timestamp::now()
        .checked_add(k8s_openapi::jiff::SignedDuration::from_secs(6))
        .expect("a time");
    let until = k8s_openapi::jiff::Timestamp::from_second(until.as_second()).expect("whole");
    patch_spec(
        &scene.ns,
        serde_json::json!({"paused": true, "pausedUntil": until.to_string()}),
    );
    poll(
        "the consumer paused until the new time",
        Duration::from_secs(30),
        || async {
            match live_pause(&scene).await {
                (true, Some(u))
                    if u.parse::<k8s_openapi::jiff::Timestamp>().ok() == Some(until) =>
                {
                    Ok(())
                }
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await;
    let (_, message) = wait_shown(&scene, "Paused", "True").await;
    assert!(
        message.contains(&format!("until {until} (spec.pausedUntil)")),
        "{message}"
    );
    let (reason, _) = wait_shown(&scene, "Paused", "False").await;
    assert_eq!(reason, "NotPaused");
    assert!(
        !live_pause(&scene).await.0,
        "the server resumed it at its time"
    );
    scene.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nats_subscription_made_paused_has_its_consumer_paused_from_the_start() {
    let scene = Scene::with_flags(
        "pause-made",
        "  durableName: orders\n  paused: true\n",
        &flags(),
    )
    .await;
    let (paused, _) = live_pause(&scene).await;
    assert!(paused, "made paused");
    let (reason, _) = wait_shown(&scene, "Paused", "True").await;
    assert_eq!(reason, "PausedBySpec");
    let ops = scene
        .op
        .metric("settle_consumer_operations_total", &[("op", "pause")]);
    assert_eq!(
        ops, 0.0,
        "made paused in its create: no pause call after it"
    );
    scene.finish().await;
}
