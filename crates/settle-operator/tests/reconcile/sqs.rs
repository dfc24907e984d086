//! The controllers on a real SQS-compatible server (ElasticMQ), `settle operator` running as a
//! process against the real API server: an sqs Backend with its credentials in a Secret is Ready
//! with its kind's capabilities (maxRedeliveryDelay 12h); a Subscription becomes exactly the
//! mapped queue and dead-letter queue (read back with the AWS SDK, not through Settle), tagged
//! with their owner; a queue deleted on the server comes back (Event Recreated); attribute drift
//! is repaired in place; a queue of that name Settle did not make is a conflict and left alone,
//! and an earlier object's leftovers are taken only by the `settle.dev/adopt` annotation;
//! deleting the Subscription deletes its queue and its empty dead-letter queue, and keeps a
//! dead-letter queue that holds messages. The runtime built from the same resource consumes from
//! the operator's queue, and a message it declines maxDeliver times reaches the operator's
//! dead-letter queue.

use settle_testkit as common;

use std::time::Duration;

use aws_sdk_sqs::Client;
use aws_sdk_sqs::types::QueueAttributeName;
use common::operator::poll;
use common::sqs::{attributes, broker, client, sqs_backend, tags, url};
use common::subs::{
    apply, backends, sub_yaml_on, subs, wait_backend, wait_event, wait_gone, wait_ready,
};
use common::{install_crds, kubectl_ok, namespace};
use kube::api::DeleteParams;
use settle::api::ConsumerRef;
use settle::policy::{BackendKind, capabilities_of};

async fn wait_exists(c: &Client, name: &str, exists: bool) {
    poll(
        &format!(
            "queue {name} to {}",
            if exists { "exist" } else { "be gone" }
        ),
        Duration::from_secs(30),
        || async {
            if url(c, name).await.is_some() == exists {
                Ok(())
            } else {
                Err(format!("exists: {}", !exists))
            }
        },
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_sqs_subscription_becomes_the_mapped_queue_and_dead_letter_queue_and_is_repaired_and_deleted()
 {
    install_crds();
    let ns = namespace("rec-sqs");
    let _op = common::operator::Operator::start_with(
        "sqs",
        &ns,
        &["--leader-election=false", "--drift-interval", "1s"],
    );
    let c = client().await;
    let prefix = format!("rec{}-", std::process::id());

    sqs_backend(&ns, &prefix);
    let b = wait_backend(&backends(&ns).await, "sqs", "True", "PlaintextCredentials").await;
    let caps = b.status.and_then(|s| s.capabilities).expect("capabilities");
    assert_eq!(caps, capabilities_of(BackendKind::Sqs));
    assert_eq!(
        caps.max_redelivery_delay.map(|d| d.get()),
        Some(Duration::from_secs(12 * 3600))
    );

    // The queue and its dead-letter queue, with the mapped attributes and the owner tag.
    let api = subs(&ns).await;
    apply(
        &ns,
        &sub_yaml_on(
            "sqs",
            "orders",
            "  pattern: orders\n  mode: AtLeastOnce\n  durableName: orders\n  maxDeliver: 4\n  ackWait: 45s\n",
        ),
    );
    let sub = wait_ready(&api, "orders").await;
    let name = format!("{prefix}orders");
    let dlq = format!("{name}-dlq");
    assert_eq!(
        sub.status.and_then(|s| s.consumer),
        Some(ConsumerRef {
            stream: "sqs".into(),
            name: name.clone()
        })
    );
    let a = attributes(&c, &name).await;
    assert_eq!(a["VisibilityTimeout"], "45", "ackWait");
    let redrive: serde_json::Value = serde_json::from_str(&a["RedrivePolicy"]).expect("JSON");
    assert_eq!(
        redrive["maxReceiveCount"].to_string().trim_matches('"'),
        "4",
        "maxDeliver"
    );
    assert!(
        redrive["deadLetterTargetArn"]
            .as_str()
            .is_some_and(|arn| arn.ends_with(&dlq)),
        "{redrive}"
    );
    let owner = format!("{ns}/orders");
    assert_eq!(
        tags(&c, &name).await.get("settle-subscription"),
        Some(&owner)
    );
    assert_eq!(
        tags(&c, &dlq).await.get("settle-subscription"),
        Some(&owner)
    );
    wait_event(&ns, "orders", "Created").await;

    // Deleted on the server: made again.
    let u = url(&c, &name).await.expect("url");
    c.delete_queue().queue_url(u).send().await.expect("delete");
    let note = wait_event(&ns, "orders", "Recreated").await;
    assert!(note.contains(&name), "{note}");
    wait_exists(&c, &name, true).await;
    assert_eq!(attributes(&c, &name).await["VisibilityTimeout"], "45");

    // Attribute drift: repaired in place.
    let u = url(&c, &name).await.expect("url");
    c.set_queue_attributes()
        .queue_url(&u)
        .attributes(QueueAttributeName::VisibilityTimeout, "5")
        .send()
        .await
        .expect("set");
    poll(
        "VisibilityTimeout back to 45",
        Duration::from_secs(30),
        || async {
            let v = attributes(&c, &name).await["VisibilityTimeout"].clone();
            if v == "45" { Ok(()) } else { Err(v) }
        },
    )
    .await;
    wait_event(&ns, "orders", "Updated").await;

    // Delete: the queue and its empty dead-letter queue go.
    api.delete("orders", &DeleteParams::default())
        .await
        .expect("delete");
    wait_gone(&api, "orders", Duration::from_secs(30)).await;
    wait_exists(&c, &name, false).await;
    wait_exists(&c, &dlq, false).await;

    // A queue of that name Settle did not make: a conflict, left alone, kept at deletion.
    let taken = format!("{prefix}taken");
    let u = c
        .create_queue()
        .queue_name(&taken)
        .send()
        .await
        .expect("create")
        .queue_url
        .expect("url");
    apply(
        &ns,
        &sub_yaml_on(
            "sqs",
            "taken",
            "  pattern: taken\n  mode: AtLeastOnce\n  durableName: taken\n",
        ),
    );
    let s = common::subs::wait_condition(
        &api,
        "taken",
        "Ready",
        "False",
        "ConsumerConflict",
        Duration::from_secs(30),
    )
    .await;
    let (_, _, m) =
        common::operator::condition(&s.status.expect("status").conditions, "Ready").expect("Ready");
    assert!(m.contains("Settle did not make it"), "{m}");
    assert!(tags(&c, &taken).await.is_empty(), "not tagged by Settle");
    api.delete("taken", &DeleteParams::default())
        .await
        .expect("delete");
    wait_gone(&api, "taken", Duration::from_secs(30)).await;
    assert!(
        url(&c, &taken).await.is_some(),
        "another's queue is never deleted"
    );
    c.delete_queue()
        .queue_url(u)
        .send()
        .await
        .expect("clean up");

    // A dead-letter queue holding messages is kept.
    apply(
        &ns,
        &sub_yaml_on(
            "sqs",
            "jobs",
            "  pattern: jobs\n  mode: AtLeastOnce\n  durableName: jobs\n  maxDeliver: 2\n",
        ),
    );
    wait_ready(&api, "jobs").await;
    let jobs_dlq = format!("{prefix}jobs-dlq");
    let u = url(&c, &jobs_dlq).await.expect("the dead-letter queue");
    c.send_message()
        .queue_url(&u)
        .message_body("exhausted")
        .send()
        .await
        .expect("send");
    api.delete("jobs", &DeleteParams::default())
        .await
        .expect("delete");
    wait_gone(&api, "jobs", Duration::from_secs(30)).await;
    wait_exists(&c, &format!("{prefix}jobs"), false).await;
    assert!(
        url(&c, &jobs_dlq).await.is_some(),
        "a dead-letter queue holding messages is kept"
    );
    let note = wait_event(&ns, "jobs", "Deleted").await;
    assert!(note.contains("kept its dead-letter queue"), "{note}");
    c.delete_queue()
        .queue_url(u)
        .send()
        .await
        .expect("clean up");

    // An earlier object's leftovers (deletionPolicy Retain), queue and dead-letter queue: not
    // taken by a new object of the same name until the adopt annotation names the old UID
    // (docs/semantics.md Q7); then taken, tagged with the new UID, and deleted with it.
    let spec = |extra: &str| {
        format!(
            "  pattern: left\n  mode: AtLeastOnce\n  durableName: left\n  maxDeliver: 2\n{extra}"
        )
    };
    apply(
        &ns,
        &sub_yaml_on("sqs", "left", &spec("  deletionPolicy: Retain\n")),
    );
    let old = wait_ready(&api, "left").await.metadata.uid.expect("a UID");
    let left = format!("{prefix}left");
    let left_dlq = format!("{left}-dlq");
    for q in [&left, &left_dlq] {
        let t = tags(&c, q).await;
        assert_eq!(t.get("settle-object"), Some(&old), "{q}: {t:?}");
        assert_eq!(t.get("settle-subscription"), Some(&format!("{ns}/left")));
    }
    let u = url(&c, &left).await.expect("url");
    c.send_message()
        .queue_url(&u)
        .message_body("kept")
        .send()
        .await
        .expect("send");
    api.delete("left", &DeleteParams::default())
        .await
        .expect("delete");
    wait_gone(&api, "left", Duration::from_secs(30)).await;
    apply(&ns, &sub_yaml_on("sqs", "left", &spec("")));
    let s = common::subs::wait_condition(
        &api,
        "left",
        "Ready",
        "False",
        "ConsumerConflict",
        Duration::from_secs(30),
    )
    .await;
    let new = s.metadata.uid.clone().expect("a UID");
    assert_ne!(new, old);
    let (_, _, m) =
        common::operator::condition(&s.status.expect("status").conditions, "Ready").expect("Ready");
    assert!(m.contains(&format!("settle.dev/adopt: \"{old}\"")), "{m}");
    assert_eq!(
        tags(&c, &left).await.get("settle-object"),
        Some(&old),
        "not taken"
    );
    kubectl_ok(
        &[
            "annotate",
            "subscription",
            "left",
            "-n",
            &ns,
            &format!("settle.dev/adopt={old}"),
        ],
        None,
    );
    wait_ready(&api, "left").await;
    let note = wait_event(&ns, "left", "Adopted").await;
    assert!(note.contains(&old), "{note}");
    for q in [&left, &left_dlq] {
        assert_eq!(tags(&c, q).await.get("settle-object"), Some(&new), "{q}");
    }
    let a = attributes(&c, &left).await;
    assert_eq!(
        a["ApproximateNumberOfMessages"], "1",
        "taken over with what it holds"
    );
    api.delete("left", &DeleteParams::default())
        .await
        .expect("delete");
    wait_gone(&api, "left", Duration::from_secs(30)).await;
    wait_exists(&c, &left, false).await;
    wait_exists(&c, &left_dlq, false).await;
    kubectl_ok(&["delete", "namespace", &ns, "--wait=false"], None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_runtime_consumes_from_the_operators_queue_and_an_exhausted_message_reaches_its_dead_letter_queue()
 {
    use std::sync::{Arc, Mutex};

    use settle::bus::{Bus, Delivery, HandlerError, Subscriber, handler};

    install_crds();
    let ns = namespace("rec-sqs-rt");
    let _op = common::operator::Operator::start_with(
        "sqs-runtime",
        &ns,
        &["--leader-election=false", "--drift-interval", "1s"],
    );
    let prefix = format!("rt{}-", std::process::id());
    sqs_backend(&ns, &prefix);
    apply(
        &ns,
        &sub_yaml_on(
            "sqs",
            "billing",
            "  pattern: billing\n  mode: AtLeastOnce\n  durableName: billing\n  maxDeliver: 2\n  ackWait: 1s\n",
        ),
    );
    let api = subs(&ns).await;
    let sub = wait_ready(&api, "billing").await;

    // The runtime from the same resource binds to the operator's queue.
    let c = client().await;
    let broker = broker(&prefix).await.with_long_poll(Duration::from_secs(1));
    let bus = Bus::builder(broker).without_reports().build();
    let seen = Arc::new(Mutex::new(Vec::<(String, u32)>::new()));
    let s = seen.clone();
    bus.subscribe(Subscriber::from_resource(
        "billing",
        &sub.spec,
        handler(move |d: Delivery| {
            let s = s.clone();
            async move {
                let body = String::from_utf8_lossy(d.payload()).into_owned();
                s.lock().unwrap().push((body.clone(), d.attempt()));
                if body == "bad" {
                    d.nack().await?;
                } else {
                    d.ack().await?;
                }
                Ok::<(), HandlerError>(())
            }
        }),
    ))
    .await
    .expect("bound to the operator's queue");
    bus.publish("billing", "good".to_string())
        .await
        .expect("publish");
    bus.publish("billing", "bad".to_string())
        .await
        .expect("publish");

    // maxDeliver 2: the bad one is tried twice, then the redrive moves it to the dead-letter
    // queue the operator made.
    let dlq = format!("{prefix}billing-dlq");
    poll(
        "the declined message in the dead-letter queue",
        Duration::from_secs(60),
        || async {
            let a = attributes(&c, &dlq).await;
            let n = a
                .get("ApproximateNumberOfMessages")
                .cloned()
                .unwrap_or_default();
            if n == "1" {
                Ok(())
            } else {
                Err(format!(
                    "dead-letter queue holds {n}; handled {:?}",
                    seen.lock().unwrap()
                ))
            }
        },
    )
    .await;
    let handled = seen.lock().unwrap().clone();
    assert!(handled.contains(&("good".to_string(), 1)), "{handled:?}");
    let bad: Vec<u32> = handled
        .iter()
        .filter(|(b, _)| b == "bad")
        .map(|(_, a)| *a)
        .collect();
    assert_eq!(bad, [1, 2], "tried maxDeliver times");
    // The gauges the account reads. The operator's own look at the dead-letter queue hides its
    // messages for a moment (and shows them again), so the one message is either visible or
    // in flight, and visible once the look is over.
    poll(
        "the dead-letter queue's gauges at one visible message",
        Duration::from_secs(30),
        || async {
            let g = settle::backend::sqs::admin::queue_gauges(&c, &dlq)
                .await
                .map_err(|e| e.to_string())?;
            match g {
                Some((1, 0)) => Ok(()),
                Some((0, 1)) => Err("the one message is in flight".to_string()),
                other => panic!("the dead-letter queue holds one message, read {other:?}"),
            }
        },
    )
    .await;
    assert_eq!(
        settle::backend::sqs::admin::queue_gauges(&c, &format!("{prefix}billing"))
            .await
            .expect("gauges"),
        Some((0, 0))
    );
    assert_eq!(
        settle::backend::sqs::admin::queue_gauges(&c, &format!("{prefix}nothing"))
            .await
            .expect("gauges"),
        None
    );
    bus.close().await;

    // Deleting the Subscription keeps the dead-letter queue that holds the exhausted message.
    api.delete("billing", &DeleteParams::default())
        .await
        .expect("delete");
    wait_gone(&api, "billing", Duration::from_secs(30)).await;
    wait_exists(&c, &format!("{prefix}billing"), false).await;
    let u = url(&c, &dlq).await.expect("kept");
    c.delete_queue()
        .queue_url(u)
        .send()
        .await
        .expect("clean up");
    kubectl_ok(&["delete", "namespace", &ns, "--wait=false"], None);
}
