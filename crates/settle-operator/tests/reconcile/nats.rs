//! The Subscription controller against the real API server and a real nats-server, `settle
//! operator` running as a process: a Subscription becomes exactly the mapped consumer (every
//! field read back over the NATS API), edits apply in place to the same consumer, an
//! unresolvable stream and a spec that slipped past admission are reported and make no consumer,
//! and deletion removes the consumer (or keeps it, with `deletionPolicy: Retain`) without ever
//! blocking, also when the Backend is deleted first: it stays until the consumer is deleted.

use settle_testkit as common;

use std::time::Duration;

use async_nats::jetstream::consumer::{AckPolicy, DeliverPolicy};
use common::operator::{Operator, TestStream, condition};
use common::subs::{
    apply, backend_yaml, backends, sub_yaml, subs, wait_condition, wait_event, wait_gone,
    wait_ready,
};
use common::{install_crds, kubectl_ok, namespace};
use kube::api::{DeleteParams, Patch, PatchParams};
use settle::api::ConsumerRef;
use settle::backend::nats::mapping;
use settle::policy::{BackendKind, BackendView, ResolvedPolicy, capabilities_of, validate};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscription_becomes_exactly_the_mapped_consumer_and_edits_apply_in_place() {
    install_crds();
    let ns = namespace("rec-map");
    let env = common::env();
    let stream = TestStream::new(&env.nats_url, "map").await;
    let _op = Operator::start("map", &ns);
    apply(&ns, &backend_yaml("nats", &env.nats_url));
    let api = subs(&ns).await;

    apply(
        &ns,
        &sub_yaml(
            "orders",
            &format!(
                "  pattern: \"{}.>\"\n  mode: AtLeastOnce\n  durableName: orders\n  maxDeliver: 5\n  ackWait: 10s\n  maxInFlight: 7\n",
                stream.prefix
            ),
        ),
    );
    let sub = wait_ready(&api, "orders").await;
    let st = sub.status.clone().expect("status");
    assert_eq!(
        st.consumer,
        Some(ConsumerRef {
            stream: stream.name.clone(),
            name: "orders".into()
        })
    );
    assert_eq!(
        condition(&st.conditions, "Accepted").map(|c| (c.0, c.1)),
        Some(("True".into(), "Valid".into()))
    );
    assert!(
        sub.metadata
            .finalizers
            .as_ref()
            .is_some_and(|f| f.iter().any(|f| f == "messaging.settle.dev/consumer")),
        "the finalizer guards the consumer: {:?}",
        sub.metadata.finalizers
    );

    // Every field over the NATS API: the mapping's config, after the server's defaults.
    let info = stream
        .consumer("orders")
        .await
        .expect("the consumer exists");
    let want = mapping::desired(
        &ns,
        "orders",
        &stream.name,
        &ResolvedPolicy::resolve(&sub.spec.policy),
    )
    .for_object(sub.metadata.uid.as_deref(), sub.spec.deletion_policy);
    let live = mapping::normalise(&stream.name, "orders", &info.config);
    assert_eq!(live, want, "the live consumer is exactly the mapped one");
    assert_eq!(
        live.owner_uid(),
        sub.metadata.uid.as_deref(),
        "marked with the object it was made for"
    );
    let c = &info.config;
    assert_eq!(c.durable_name.as_deref(), Some("orders"));
    assert_eq!(c.ack_policy, AckPolicy::Explicit);
    assert_eq!(c.deliver_policy, DeliverPolicy::All);
    assert_eq!(c.ack_wait, Duration::from_secs(10));
    assert_eq!(c.max_deliver, 5);
    assert_eq!(c.max_ack_pending, 7);
    assert_eq!(c.filter_subject, format!("{}.>", stream.prefix));
    assert!(c.backoff.is_empty(), "never a backoff list");
    assert_eq!(
        c.metadata.get(mapping::OWNER_KEY).map(String::as_str),
        Some(format!("{ns}/orders").as_str())
    );
    let created = info.created;
    let note = wait_event(&ns, "orders", "Created").await;
    assert!(note.contains("orders"), "{note}");

    // Edits change the same consumer in place.
    let patch = serde_json::json!({"spec": {
        "maxDeliver": 9, "ackWait": "20s", "maxInFlight": 3,
        "backoff": {"initial": "1s", "max": "10s"},
    }});
    api.patch("orders", &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .expect("edit");
    let sub = wait_ready(&api, "orders").await;
    assert_eq!(sub.metadata.generation, Some(2));
    let info = stream.consumer("orders").await.expect("still there");
    assert_eq!(info.config.max_deliver, 9);
    assert_eq!(info.config.ack_wait, Duration::from_secs(20));
    assert_eq!(info.config.max_ack_pending, 3);
    assert!(
        info.config.backoff.is_empty(),
        "the backoff schedule is paced by the runtime's delayed naks, never a consumer backoff list"
    );
    assert_eq!(info.created, created, "the same consumer, changed in place");
    let note = wait_event(&ns, "orders", "Updated").await;
    assert!(note.contains("max_deliver"), "{note}");

    // AtMostOnce without a durable name: a stable derived name, no acks.
    apply(
        &ns,
        &sub_yaml(
            "metrics",
            &format!("  pattern: \"{}.metrics.>\"\n", stream.prefix),
        ),
    );
    let sub = wait_ready(&api, "metrics").await;
    let name = format!("settle_{ns}_metrics");
    assert_eq!(
        sub.status.and_then(|s| s.consumer).map(|c| c.name),
        Some(name.clone())
    );
    let info = stream.consumer(&name).await.expect("the derived consumer");
    assert_eq!(info.config.ack_policy, AckPolicy::None);
    assert_eq!(info.config.deliver_policy, DeliverPolicy::New);

    kubectl_ok(&["delete", "subscriptions", "--all", "-n", &ns], None);
    assert_eq!(stream.consumer_names().await, Vec::<String>::new());
    stream.delete().await;
    kubectl_ok(&["delete", "namespace", &ns, "--wait=false"], None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unresolvable_stream_and_a_spec_that_slipped_past_admission_make_no_consumer() {
    install_crds();
    let ns = namespace("rec-refuse");
    let env = common::env();
    let stream = TestStream::new(&env.nats_url, "refuse").await;
    let _op = Operator::start("refuse", &ns);
    apply(&ns, &backend_yaml("nats", &env.nats_url));
    let api = subs(&ns).await;
    let long = Duration::from_secs(60);

    // A named stream that does not exist, and a pattern no stream carries.
    apply(
        &ns,
        &sub_yaml(
            "named",
            "  pattern: nothing.here.>\n  stream: NO_SUCH_STREAM\n",
        ),
    );
    let s = wait_condition(&api, "named", "Ready", "False", "StreamNotFound", long).await;
    let (_, _, m) = condition(&s.status.expect("status").conditions, "Ready").expect("Ready");
    assert!(
        m.contains("NO_SUCH_STREAM") && m.contains("spec.stream"),
        "{m}"
    );
    apply(
        &ns,
        &sub_yaml("unowned", "  pattern: nothing.carries.this.>\n"),
    );
    wait_condition(&api, "unowned", "Ready", "False", "StreamNotFound", long).await;
    wait_event(&ns, "named", "StreamNotFound").await;

    // No webhook is registered for this namespace: a spec admission refuses gets in, and the
    // controller refuses it the same way, before touching the broker.
    let spec = format!(
        "  pattern: \"{}.>\"\n  backoff: {{initial: 1s, max: 1m}}\n",
        stream.prefix
    );
    apply(&ns, &sub_yaml("slipped", &spec));
    let s = wait_condition(&api, "slipped", "Accepted", "False", "Invalid", long).await;
    let verdict = validate(
        &s.spec,
        None,
        BackendView::Known {
            name: "nats",
            capabilities: &capabilities_of(BackendKind::Nats),
        },
    );
    let st = s.status.expect("status");
    let (_, _, m) = condition(&st.conditions, "Accepted").expect("Accepted");
    assert_eq!(m, verdict.error_text(), "the same message as admission");
    let (rs, rr, _) = condition(&st.conditions, "Ready").expect("Ready");
    assert_eq!((rs.as_str(), rr.as_str()), ("False", "NotAccepted"));
    assert_eq!(st.consumer, None);
    wait_event(&ns, "slipped", "InvalidSpec").await;
    assert_eq!(
        stream.consumer_names().await,
        Vec::<String>::new(),
        "no consumer for a refused spec"
    );

    // Fixing the spec makes the consumer.
    apply(
        &ns,
        &sub_yaml("slipped", &format!("  pattern: \"{}.>\"\n", stream.prefix)),
    );
    wait_ready(&api, "slipped").await;
    assert_eq!(
        stream.consumer_names().await,
        vec![format!("settle_{ns}_slipped")]
    );
    kubectl_ok(&["delete", "subscriptions", "--all", "-n", &ns], None);
    stream.delete().await;
    kubectl_ok(&["delete", "namespace", &ns, "--wait=false"], None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_a_subscription_deletes_its_consumer_unless_retained_and_never_blocks() {
    install_crds();
    let ns = namespace("rec-delete");
    let env = common::env();
    let stream = TestStream::new(&env.nats_url, "delete").await;
    let _op = Operator::start("delete", &ns);
    apply(&ns, &backend_yaml("nats", &env.nats_url));
    let api = subs(&ns).await;
    let alo = |durable: &str, extra: &str| {
        format!(
            "  pattern: \"{}.{durable}.>\"\n  mode: AtLeastOnce\n  durableName: {durable}\n{extra}",
            stream.prefix
        )
    };
    apply(&ns, &sub_yaml("gone", &alo("gone", "")));
    apply(
        &ns,
        &sub_yaml("kept", &alo("kept", "  deletionPolicy: Retain\n")),
    );
    wait_ready(&api, "gone").await;
    wait_ready(&api, "kept").await;
    assert_eq!(stream.consumer_names().await, vec!["gone", "kept"]);

    // Delete: the consumer goes first, then the finalizer, then the object.
    api.delete("gone", &DeleteParams::default())
        .await
        .expect("delete");
    wait_gone(&api, "gone", Duration::from_secs(30)).await;
    assert_eq!(stream.consumer("gone").await.map(|i| i.name), None);

    // Retain: the object goes, the consumer stays.
    api.delete("kept", &DeleteParams::default())
        .await
        .expect("delete");
    wait_gone(&api, "kept", Duration::from_secs(30)).await;
    assert!(
        stream.consumer("kept").await.is_some(),
        "a retained consumer stays"
    );
    let old = stream
        .consumer("kept")
        .await
        .and_then(|i| i.config.metadata.get("settle.dev/uid").cloned())
        .expect("marked with its object's UID");
    // A new object of that name: the kept consumer is not its own until the adopt annotation
    // names the old UID (docs/semantics.md R8).
    apply(&ns, &sub_yaml("kept", &alo("kept", "")));
    let s = common::subs::wait_condition(
        &api,
        "kept",
        "Ready",
        "False",
        "ConsumerConflict",
        Duration::from_secs(30),
    )
    .await;
    let new = s.metadata.uid.clone().expect("a UID");
    let (_, _, m) =
        common::operator::condition(&s.status.expect("status").conditions, "Ready").expect("Ready");
    assert!(m.contains(&format!("settle.dev/adopt: \"{old}\"")), "{m}");
    kubectl_ok(
        &[
            "annotate",
            "subscription",
            "kept",
            "-n",
            &ns,
            &format!("settle.dev/adopt={old}"),
        ],
        None,
    );
    wait_ready(&api, "kept").await;
    common::subs::wait_event(&ns, "kept", "Adopted").await;
    assert_eq!(
        stream.consumer("kept").await.and_then(|i| i
            .config
            .metadata
            .get("settle.dev/uid")
            .cloned()),
        Some(new),
        "now marked as the new object's"
    );
    api.delete("kept", &DeleteParams::default())
        .await
        .expect("delete");
    wait_gone(&api, "kept", Duration::from_secs(30)).await;
    assert!(
        stream.consumer("kept").await.is_none(),
        "the adopted consumer goes with its new object"
    );

    // The Backend deleted first: it stays (its finalizer) while the Subscription still has a
    // consumer to delete, the Subscription's deletion deletes it, then the Backend goes.
    apply(&ns, &sub_yaml("orphan", &alo("orphan", "")));
    wait_ready(&api, "orphan").await;
    let b_api = backends(&ns).await;
    b_api
        .delete("nats", &DeleteParams::default())
        .await
        .expect("delete the Backend");
    // Past two of its checks (every 2 s), it is still there, deleting, and so is the consumer.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let b = b_api.get("nats").await.expect("the Backend stays");
    assert!(b.metadata.deletion_timestamp.is_some());
    assert!(stream.consumer("orphan").await.is_some());
    api.delete("orphan", &DeleteParams::default())
        .await
        .expect("delete");
    wait_gone(&api, "orphan", Duration::from_secs(30)).await;
    assert_eq!(
        stream.consumer("orphan").await.map(|i| i.name),
        None,
        "deleted through the deleting Backend's connection"
    );
    common::operator::poll(
        "the Backend to be gone once no Subscription needs it",
        Duration::from_secs(30),
        || async {
            match b_api.get_opt("nats").await {
                Ok(None) => Ok(()),
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await;

    stream.delete().await;
    kubectl_ok(&["delete", "namespace", &ns, "--wait=false"], None);
}

/// How many of `seen` show Ready=True, and how many Ready=False `BrokerLimit` naming the limit.
fn tally(seen: &common::subs::Readiness, stream: &str) -> (usize, usize) {
    let ready = seen
        .iter()
        .filter(|(_, c)| c.as_ref().is_some_and(|c| c.0 == "True"))
        .count();
    let limited = seen
        .iter()
        .filter(|(_, c)| {
            c.as_ref().is_some_and(|(s, r, m)| {
                s == "False"
                    && r == "BrokerLimit"
                    && m.contains(&format!("the stream {stream} allows at most 3 consumers"))
                    && m.contains("max_consumers")
            })
        })
        .count();
    (ready, limited)
}

#[tokio::test]
async fn a_stream_at_its_consumer_limit_costs_the_broker_next_to_nothing_and_a_freed_slot_is_taken_at_once()
 {
    install_crds();
    let ns = namespace("rec-limit");
    let env = common::env();
    let stream = TestStream::with_max_consumers(&env.nats_url, "limit", 3).await;
    let op = Operator::start("limit", &ns);
    apply(&ns, &backend_yaml("nats", &env.nats_url));
    let api = subs(&ns).await;
    let names: Vec<String> = (0..6).map(|i| format!("s{i}")).collect();
    for n in &names {
        apply(
            &ns,
            &sub_yaml(
                n,
                &format!(
                    "  pattern: \"{}.{n}.>\"\n  stream: {}\n  mode: AtLeastOnce\n  durableName: {n}\n",
                    stream.prefix, stream.name
                ),
            ),
        );
    }
    // Three get the stream's three consumers; three say which limit refused them.
    let name = stream.name.clone();
    common::subs::wait_readiness(
        &api,
        &names,
        "3 Subscriptions Ready and 3 refused by the stream's limit",
        Duration::from_secs(60),
        |seen| tally(seen, &name) == (3, 3),
    )
    .await;
    assert_eq!(stream.consumer_names().await.len(), 3);

    // While the limit holds, the refused three barely call the broker: one of them asks after
    // a growing delay (1 s doubling, with jitter; past its first quick tries, at most three in
    // the next 20 s, three calls each), where each used to retry on its own (45 calls in 20 s).
    tokio::time::sleep(Duration::from_secs(5)).await;
    let before = op.consumer_api_calls();
    tokio::time::sleep(Duration::from_secs(20)).await;
    let during = op.consumer_api_calls() - before;
    eprintln!("consumer API calls over 20 s at the limit: {during}");
    assert!(
        during <= 10.0,
        "{during} consumer API calls in 20 s against a stream at its limit"
    );
    assert_eq!(
        tally(&common::subs::readiness(&api, &names).await, &name),
        (3, 3)
    );

    // A Ready one goes: its slot is taken by one refused Subscription at once.
    let seen = common::subs::readiness(&api, &names).await;
    let (gone, _) = seen
        .iter()
        .find(|(_, c)| c.as_ref().is_some_and(|c| c.0 == "True"))
        .expect("a Ready Subscription");
    let gone = gone.clone();
    api.delete(&gone, &DeleteParams::default())
        .await
        .expect("delete");
    wait_gone(&api, &gone, Duration::from_secs(30)).await;
    let rest: Vec<String> = names.iter().filter(|n| **n != gone).cloned().collect();
    common::subs::wait_readiness(
        &api,
        &rest,
        "a refused Subscription to take the freed slot",
        Duration::from_secs(5),
        |seen| tally(seen, &name) == (3, 2),
    )
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        tally(&common::subs::readiness(&api, &rest).await, &name),
        (3, 2)
    );
    assert_eq!(stream.consumer_names().await.len(), 3);

    // The stream's limit raised: the two still refused get theirs at once (its update's
    // advisory opens the gate), not after the gate's delay.
    let mut config = stream
        .js
        .get_stream(&stream.name)
        .await
        .expect("the stream")
        .cached_info()
        .config
        .clone();
    config.max_consumers = 10;
    stream
        .js
        .update_stream(config)
        .await
        .expect("raise max_consumers");
    common::subs::wait_readiness(
        &api,
        &rest,
        "the refused two to get a consumer once the limit is raised",
        Duration::from_secs(5),
        |seen| tally(seen, &name) == (5, 0),
    )
    .await;
    assert_eq!(stream.consumer_names().await.len(), 5);

    stream.delete().await;
    kubectl_ok(&["delete", "namespace", &ns, "--wait=false"], None);
}
