//! The account's status writer on the real API server: a patch made for an object is written
//! to that object only. Subscription `orders` is deleted and applied again while the writer's
//! cache still holds the first object (as it does for a moment after any delete and apply, and
//! as a patch waiting its turn in the budget does for longer); the first object's patch is then
//! refused by the version it carries, read again, found to be for another object, and not
//! written: the new object's status never shows the old one's account.

use settle_testkit as common;

use std::time::Duration;

use common::subs::{apply, sub_yaml_on, subs};
use kube::api::DeleteParams;
use kube::runtime::reflector;
use kube::runtime::watcher::Event;
use settle_operator::account::writer::{Write, Writer};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_patch_made_for_an_object_deleted_and_made_again_is_not_written_to_the_new_one() {
    common::install_crds();
    let ns = common::namespace("account-writer");
    let spec =
        "  pattern: \"writer.>\"\n  mode: AtLeastOnce\n  durableName: orders\n  maxDeliver: 3\n";
    apply(&ns, &sub_yaml_on("nats", "orders", spec));
    let api = subs(&ns).await;
    let first = api.get("orders").await.expect("the first object");
    let (cache, mut cache_writer) = reflector::store();
    cache_writer.apply_watcher_event(&Event::Apply(first.clone()));
    let registry = prometheus::Registry::new();
    let metrics =
        settle_operator::account::Metrics::new(&registry, &Default::default()).expect("metrics");
    let writer = Writer::start(common::kube_client().await, metrics.clone(), 20, cache);
    let patch = |exhausted: u64, uid: Option<String>| Write {
        namespace: ns.clone(),
        name: "orders".into(),
        uid,
        urgent: true,
        body: serde_json::json!({
            "apiVersion": "messaging.settle.dev/v1alpha1",
            "kind": "Subscription",
            "status": {"stats": {"exhausted": exhausted}},
        }),
    };
    let exhausted = || async {
        api.get("orders")
            .await
            .ok()
            .and_then(|s| s.status?.stats)
            .map(|s| s.counters.exhausted)
    };
    // Written to the object it was made for.
    writer.send(patch(7, first.metadata.uid.clone()));
    common::operator::poll(
        "the first object's patch written",
        Duration::from_secs(10),
        || async {
            match exhausted().await {
                Some(7) => Ok(()),
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await;

    // Deleted and made again; the writer's cache still holds the first object.
    api.delete("orders", &DeleteParams::default())
        .await
        .expect("delete");
    common::subs::wait_gone(&api, "orders", Duration::from_secs(30)).await;
    apply(&ns, &sub_yaml_on("nats", "orders", spec));
    let second = api.get("orders").await.expect("the second object");
    assert_ne!(second.metadata.uid, first.metadata.uid);
    let other_object = || metrics.writes.with_label_values(&["other_object"]).get();
    writer.send(patch(900, first.metadata.uid.clone()));
    common::operator::poll(
        "the stale patch judged",
        Duration::from_secs(10),
        || async {
            if other_object() == 1 {
                Ok(())
            } else {
                Err(format!("other_object {}", other_object()))
            }
        },
    )
    .await;
    assert_eq!(
        exhausted().await,
        None,
        "the first object's account was written to the second"
    );
    assert_eq!(metrics.writes.with_label_values(&["conflict"]).get(), 1);
    common::kubectl_ok(&["delete", "namespace", &ns, "--wait=false"], None);
}
