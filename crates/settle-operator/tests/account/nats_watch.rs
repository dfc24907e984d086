//! A report watch the broker keeps heartbeating but never feeds (seen on a JetStream cluster
//! when the watch was made while a server was down or paused: status then froze for good while
//! the applications' reports piled up in the bucket) is noticed and made again. On a
//! nats-server of the test's own (its report bucket empty until the application reports), the
//! operator's watch consumer is swapped, before any report, for one on the same deliver subject
//! that heartbeats and delivers nothing: the client library sees a live consumer, so only the
//! keeper's own check can tell. A message is published every second throughout (the
//! application's report is replaced all along); its counts still reach status while that goes
//! on, and the stall is counted in `settle_account_report_watch_stalls_total`. A report bucket
//! deleted and made again under the watch is watched afresh too.

use settle_testkit as common;

use std::time::Duration;

use async_nats::jetstream::consumer::{DeliverPolicy, push};
use common::account::{NACK_SPEC, OPERATOR_FLAGS, Scene};
use common::operator::{NatsServer, poll};
use futures::TryStreamExt;
use settle::bus::report::REPORT_BUCKET;

/// The always-nack scene on a nats-server of the test's own (its report bucket can be deleted
/// and made again without touching another test's), kept running as long as the scene.
async fn on_a_server_of_its_own(test: &str) -> (NatsServer, Scene) {
    let nats = NatsServer::start(&[]);
    let scene = Scene::build(test, NACK_SPEC, &OPERATOR_FLAGS, &[], Some(nats.url())).await;
    (nats, scene)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_a_report_watch_that_heartbeats_and_delivers_nothing_is_made_again() {
    let (_nats, scene) = on_a_server_of_its_own("watch-stall").await;
    let js = &scene.stream.js;
    let stream_name = format!("KV_{REPORT_BUCKET}");
    // The keeper's watch: the report bucket's one push consumer.
    let watch = poll(
        "the keeper's report watch",
        Duration::from_secs(30),
        || async {
            let stream = js
                .get_stream(&stream_name)
                .await
                .map_err(|e| e.to_string())?;
            let infos: Vec<_> = stream
                .consumers()
                .try_collect()
                .await
                .map_err(|e| e.to_string())?;
            infos
                .into_iter()
                .find(|c| c.config.deliver_subject.is_some())
                .ok_or_else(|| "no push consumer on the report bucket yet".to_string())
        },
    )
    .await;
    let deliver = watch.config.deliver_subject.clone().unwrap_or_default();
    assert_eq!(
        watch.delivered.consumer_sequence, 0,
        "no report yet: {watch:?}"
    );
    let stream = js
        .get_stream(&stream_name)
        .await
        .expect("the bucket's stream");
    stream
        .delete_consumer(&watch.name)
        .await
        .expect("the keeper's watch deleted");
    stream
        .create_consumer(push::Config {
            deliver_subject: deliver,
            description: Some("heartbeats only".into()),
            filter_subject: format!("$KV.{REPORT_BUCKET}.never-written"),
            deliver_policy: DeliverPolicy::New,
            idle_heartbeat: Duration::from_secs(5),
            flow_control: true,
            memory_storage: true,
            num_replicas: 1,
            ..Default::default()
        })
        .await
        .expect("a consumer that heartbeats on the watch's subject");

    let app = scene.app("nack");
    app.wait_ready().await;
    // A message a second throughout: the application's report key is replaced all along, so
    // the stall must be seen while reports keep coming, not only once they stop.
    let publisher = {
        let (js, prefix) = (js.clone(), scene.stream.prefix.clone());
        tokio::spawn(async move {
            for i in 0.. {
                if let Ok(ack) = js
                    .publish(format!("{prefix}.m{i}"), i.to_string().into())
                    .await
                {
                    let _ = ack.await;
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        })
    };
    scene
        .wait_stats(
            "reports counted through a new watch while they keep coming",
            Duration::from_secs(60),
            |s| s.exhausted >= 2,
        )
        .await;
    publisher.abort();
    let s = scene
        .settled(
            "every message published counted",
            Duration::from_secs(60),
            |s| s.exhausted * 3 == s.settlement.nacked && s.delivered == s.settlement.nacked,
        )
        .await;
    assert!(s.exhausted >= 2, "{s:?}");
    assert!(
        scene
            .op
            .metric("settle_account_report_watch_stalls_total", &[])
            >= 1.0,
        "the stall is counted"
    );
    scene.assert_never_decreased();
    drop(app);
    scene.finish().await;
}

/// The report bucket deleted on the broker and made again at once (as a runtime starting then
/// makes it) under the keeper's watch. On the cluster the fault campaign saw the watch's
/// consumer made again on the new bucket from the revision after the last it delivered, which
/// the new bucket, numbering from 1, reaches only after as many reports: status froze for good.
/// On one server the watch mostly ends by itself instead; either way the keeper now sees the
/// bucket is not the one it opened the watch on, watches it afresh (counted with the stalls),
/// and counting goes on (semantics C17). The old bucket's revisions are raised first
/// (deletions of a key of no namespace, which count nothing) so a new bucket could not catch
/// up within the test.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_a_report_bucket_made_again_under_the_watch_is_watched_afresh() {
    let (_nats, scene) = on_a_server_of_its_own("watch-again").await;
    let js = &scene.stream.js;
    let app = scene.app("nack");
    app.wait_ready().await;
    scene.publish((0..2).map(|i| format!("before {i}"))).await;
    scene
        .wait_stats("two exhausted before", Duration::from_secs(60), |s| {
            s.exhausted >= 2
        })
        .await;
    let reports = js
        .get_key_value(REPORT_BUCKET)
        .await
        .expect("the report bucket");
    for _ in 0..500 {
        reports
            .delete("nobody.none.none")
            .await
            .expect("a revision that counts nothing");
    }
    // Delivered to the watch before the bucket goes.
    tokio::time::sleep(Duration::from_secs(2)).await;
    js.delete_key_value(REPORT_BUCKET)
        .await
        .expect("the report bucket deleted");
    js.create_key_value(async_nats::jetstream::kv::Config {
        bucket: REPORT_BUCKET.into(),
        history: 1,
        ..Default::default()
    })
    .await
    .expect("the report bucket made again at once");
    scene.publish((0..2).map(|i| format!("after {i}"))).await;
    let s = scene
        .settled(
            "the two published after counted too",
            Duration::from_secs(60),
            |s| s.exhausted >= 4 && s.exhausted * 3 == s.settlement.nacked,
        )
        .await;
    assert_eq!(s.exhausted, 4, "{s:?}");
    assert!(
        scene
            .op
            .metric("settle_account_report_watch_stalls_total", &[])
            >= 1.0,
        "the watch made again is counted"
    );
    scene.assert_never_decreased();
    drop(app);
    scene.finish().await;
}
