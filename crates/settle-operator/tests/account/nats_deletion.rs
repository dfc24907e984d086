//! What the account keeps on a NATS server for a namespace goes with it: its Subscriptions and
//! Backend deleted at once (as the namespace controller does) leave neither ledger nor report,
//! and a deleted Backend's sweep (`account::nats::drop_backend`) removes exactly what belonged
//! to its namespace's gone Subscriptions, and its reader of the capture.

use settle_testkit as common;

use std::time::Duration;

use async_nats::jetstream;
use futures::StreamExt;

use common::account::{NACK_SPEC, Scene, bodies};
use common::operator::poll;

/// Every key under a namespace in one of the account's buckets.
async fn keys_under(js: &jetstream::Context, bucket: &str, ns: &str) -> Vec<String> {
    let Ok(store) = js.get_key_value(bucket).await else {
        return Vec::new();
    };
    let Ok(keys) = store.keys().await else {
        return Vec::new();
    };
    let prefix = format!("{ns}.");
    keys.filter_map(|k| async move { k.ok() })
        .filter(|k| std::future::ready(k.starts_with(&prefix)))
        .collect()
        .await
}

/// A namespace's Subscriptions and Backend deleted at once, as the namespace controller does
/// (the application gone with its pods): the Backend waits for the Subscription, and once it
/// goes nothing of the account is left under the namespace, neither ledger nor report.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_namespace_deleted_at_once_leaves_no_ledger_nor_report_on_the_broker() {
    let scene = Scene::new("acct-ns-gone", NACK_SPEC).await;
    let mut app = scene.app("nack");
    app.wait_ready().await;
    scene.publish(bodies(2)).await;
    scene
        .wait_stats("two messages exhausted", Duration::from_secs(60), |s| {
            s.exhausted == 2
        })
        .await;
    let client = async_nats::connect(common::env().nats_url)
        .await
        .expect("connect");
    let js = jetstream::new(client);
    let (ledgers, reports) = (
        settle::backend::nats::capture::ACCOUNT_BUCKET,
        settle::bus::report::REPORT_BUCKET,
    );
    poll(
        "the namespace's ledger and report on the broker",
        Duration::from_secs(30),
        || async {
            let (l, r) = (
                keys_under(&js, ledgers, &scene.ns).await,
                keys_under(&js, reports, &scene.ns).await,
            );
            if !l.is_empty() && !r.is_empty() {
                Ok(())
            } else {
                Err(format!("ledgers {l:?}, reports {r:?}"))
            }
        },
    )
    .await;
    app.kill9();
    common::subs::delete_all_at_once(&scene.ns);
    poll(
        "nothing of the account left under the namespace",
        Duration::from_secs(60),
        || async {
            let (l, r) = (
                keys_under(&js, ledgers, &scene.ns).await,
                keys_under(&js, reports, &scene.ns).await,
            );
            if l.is_empty() && r.is_empty() {
                Ok(())
            } else {
                Err(format!("ledgers {l:?}, reports {r:?}"))
            }
        },
    )
    .await;
    scene.finish().await;
}

/// What a deleted NATS Backend's account leaves is removed through the connection its keeper
/// ran on (`account::nats::drop_backend`, run 5 s after the Backend is gone): the ledgers and
/// reports of its namespace's Subscriptions that are gone (a namespace deleted at once can take
/// the keeper before its round drops them) and its reader of the capture; those of a
/// Subscription still there, and of other namespaces, stay. On a nats-server of the test's own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_backends_account_leaves_nothing_of_its_gone_subscriptions() {
    use kube::runtime::{reflector, watcher};
    use settle::backend::nats::capture;

    let server = common::operator::NatsServer::start(&[]);
    let client = async_nats::connect(server.url()).await.expect("connect");
    let js = jetstream::new(client.clone());
    let ledgers = capture::ledgers(&js, 1).await.expect("the ledger bucket");
    let reports = capture::reports(&js, Default::default(), 1)
        .await
        .expect("the report bucket");
    let reader = settle_operator::account::nats::reader_name("team", "b");
    capture::open(&js, &reader, 1 << 20, 1)
        .await
        .expect("the Backend's reader");
    for (ns, sub) in [("team", "gone"), ("team", "kept"), ("other", "gone")] {
        ledgers
            .put(format!("{ns}.{sub}.ledger"), "{}".into())
            .await
            .expect("a ledger");
        reports
            .put(
                settle::bus::report::report_key(ns, sub, "pod-1"),
                "{}".into(),
            )
            .await
            .expect("a report");
    }
    // The cache holds team/kept only.
    let mut writer = reflector::store::Writer::<settle::api::Subscription>::default();
    let kept: settle::api::Subscription = serde_json::from_value(serde_json::json!({
        "apiVersion": "messaging.settle.dev/v1alpha1",
        "kind": "Subscription",
        "metadata": {"name": "kept", "namespace": "team"},
        "spec": {"backendRef": {"name": "b"}, "pattern": "x.>"},
    }))
    .expect("a Subscription");
    writer.apply_watcher_event(&watcher::Event::Apply(kept));
    settle_operator::account::nats::drop_backend(client, writer.as_reader(), "team", "b").await;

    let left = |store: async_nats::jetstream::kv::Store| async move {
        let keys: Vec<String> = store
            .keys()
            .await
            .expect("keys")
            .filter_map(|k| async move { k.ok() })
            .collect()
            .await;
        let mut keys = keys;
        keys.sort();
        keys
    };
    assert_eq!(
        left(ledgers).await,
        ["other.gone.ledger", "team.kept.ledger"],
        "the gone Subscription's ledger removed, the rest kept"
    );
    assert_eq!(
        left(reports).await,
        ["other.gone.pod-1", "team.kept.pod-1"],
        "the gone Subscription's report removed, the rest kept"
    );
    assert!(
        js.get_stream(capture::CAPTURE_STREAM)
            .await
            .expect("the capture")
            .consumer_info(&reader)
            .await
            .is_err(),
        "the Backend's reader of the capture deleted"
    );
}

/// A Backend deleted while no operator ran leaves its reader of the capture; the next keeper of
/// its namespace deletes it (`account::nats::drop_gone_readers`, run as a keeper starts) and
/// keeps its live Backends' readers and other namespaces'. On a nats-server of the test's own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_capture_readers_of_backends_deleted_while_no_operator_ran_are_deleted() {
    use settle::backend::nats::capture;
    use settle_operator::account::nats::{drop_gone_readers, reader_name};

    let server = common::operator::NatsServer::start(&[]);
    let client = async_nats::connect(server.url()).await.expect("connect");
    let js = jetstream::new(client.clone());
    let readers = [
        reader_name("team", "live"),
        reader_name("team", "gone"),
        reader_name("team", &"long".repeat(80)),
        reader_name("team-b", "gone"),
    ];
    for r in &readers {
        capture::open(&js, r, 1 << 20, 1).await.expect("a reader");
    }
    drop_gone_readers(
        client,
        "team".into(),
        [reader_name("team", "live")].into_iter().collect(),
    )
    .await;
    let mut left: Vec<String> = js
        .get_stream(capture::CAPTURE_STREAM)
        .await
        .expect("the capture")
        .consumer_names()
        .filter_map(|n| async move { n.ok() })
        .collect()
        .await;
    left.sort();
    let mut want = vec![readers[0].clone(), readers[3].clone()];
    want.sort();
    assert_eq!(left, want, "only team's gone Backends' readers deleted");
}
