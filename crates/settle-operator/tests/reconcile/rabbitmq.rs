//! The controllers on a real RabbitMQ (3.10, management plugin on), `settle operator` running as
//! a process against the real API server: a rabbitmq Backend is Ready with the broker's version
//! and its kind's capabilities (wrong credentials in its Secret: AuthFailed, until the Secret is
//! fixed, with no restart; a closed port: Unreachable); a Subscription becomes exactly
//! the mapped quorum queue and binding (read back over the management API, not through Settle);
//! a queue deleted on the broker comes back (Event Recreated), a changed pattern re-binds the
//! same queue in place, a changed maxDeliver is reported ImmutableField with the field named; a
//! queue of another Subscription is a conflict and left alone; deleting the Subscription deletes
//! its queue, unless it is retained. The runtime built from the same resource consumes from the
//! operator's queue, and again once the operator has made a deleted queue again. With and without
//! the management API, a same-named queue Settle did not make for this object (another
//! application's, or an earlier object's left by Retain) is neither bound nor deleted, unless the
//! `settle.dev/adopt` annotation names the earlier object's UID.

use settle_testkit as common;

use std::time::Duration;

use common::operator::{Operator, condition, poll};
use common::rabbitmq::{bindings, env_backend_yaml, management, queue, rabbitmq_backend_yaml};
use common::subs::{
    apply, backends, sub_yaml_on, subs, wait_backend, wait_condition, wait_event, wait_gone,
    wait_ready,
};
use common::{install_crds, kubectl_ok, namespace};
use kube::api::DeleteParams;
use serde_json::Value;
use settle::api::ConsumerRef;
use settle::policy::{BackendKind, capabilities_of};

pub(crate) fn delete_queue(name: &str) {
    let (status, body) = management("DELETE", &format!("/api/queues/%2f/{name}"));
    assert!(
        status == 204 || status == 404,
        "DELETE queue {name}: {status} {body}"
    );
}

pub(crate) async fn wait_queue(
    name: &str,
    what: &str,
    f: impl Fn(&Option<Value>) -> bool,
) -> Option<Value> {
    poll(what, Duration::from_secs(30), || async {
        let q = queue(name);
        if f(&q) { Ok(q) } else { Err(format!("{q:?}")) }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rabbitmq_subscription_becomes_the_mapped_quorum_queue_and_is_repaired_and_deleted() {
    install_crds();
    let ns = namespace("rec-rabbit");
    let env = common::env();
    let op = Operator::start_with(
        "rabbitmq",
        &ns,
        &["--leader-election=false", "--drift-interval", "1s"],
    );
    let tag = format!("rec{}", std::process::id());

    // The Backend: Ready with the broker's version and the kind's capabilities.
    apply(&ns, &env_backend_yaml("rabbit", ""));
    let b = wait_backend(&backends(&ns).await, "rabbit", "True", "Connected").await;
    let st = b.status.expect("status");
    let version = st.server_version.clone().expect("a version");
    assert!(version.starts_with("3."), "{version}");
    assert_eq!(
        st.capabilities,
        Some(capabilities_of(BackendKind::Rabbitmq))
    );
    // Wrong credentials in the Secret are told apart; the fixed Secret is picked up.
    let bare = env.rabbitmq_url.replace("guest:guest@", "");
    assert_ne!(bare, env.rabbitmq_url, "the URL carries guest:guest");
    let secret = |password: &str| {
        format!(
            "apiVersion: v1\nkind: Secret\nmetadata: {{name: rabbit-creds, labels: {{settle.dev/backend-credentials: \"true\"}}}}\nstringData: {{username: guest, password: {password}}}\n"
        )
    };
    apply(&ns, &secret("wrong"));
    apply(
        &ns,
        &format!(
            "{}    credentialsSecretRef: {{name: rabbit-creds}}\n",
            rabbitmq_backend_yaml("secured", &bare, &env.rabbitmq_management_url, "")
        ),
    );
    wait_backend(&backends(&ns).await, "secured", "False", "AuthFailed").await;
    apply(&ns, &secret("guest"));
    wait_backend(
        &backends(&ns).await,
        "secured",
        "True",
        "PlaintextCredentials",
    )
    .await;
    // A closed port is Unreachable, and names the field to check.
    let closed = format!("amqp://guest:guest@127.0.0.1:{}/%2f", common::free_port());
    apply(
        &ns,
        &rabbitmq_backend_yaml("closed", &closed, &env.rabbitmq_management_url, ""),
    );
    let b = wait_backend(&backends(&ns).await, "closed", "False", "Unreachable").await;
    let (_, _, m) = condition(&b.status.expect("status").conditions, "Ready").expect("Ready");
    assert!(
        m.contains("spec.rabbitmq.urls") && !m.contains("guest:guest"),
        "{m}"
    );

    // A Subscription: exactly the mapped quorum queue and binding.
    let api = subs(&ns).await;
    let durable = format!("{tag}-orders");
    let spec = |pattern: &str, max: u32, extra: &str| {
        format!(
            "  pattern: \"{pattern}\"\n  mode: AtLeastOnce\n  durableName: {durable}\n  maxDeliver: {max}\n{extra}"
        )
    };
    apply(
        &ns,
        &sub_yaml_on("rabbit", "orders", &spec(&format!("{tag}.orders.>"), 3, "")),
    );
    let sub = wait_ready(&api, "orders").await;
    assert_eq!(
        sub.status.clone().and_then(|s| s.consumer),
        Some(ConsumerRef {
            stream: "amq.topic".into(),
            name: durable.clone()
        }),
        "status.consumer: the exchange and the queue"
    );
    let q = queue(&durable).expect("the queue exists");
    assert_eq!(q["durable"], true);
    assert_eq!(q["type"], "quorum");
    let args = &q["arguments"];
    assert_eq!(args["x-queue-type"], "quorum");
    assert_eq!(args["x-delivery-limit"], 2, "maxDeliver 3 is a limit of 2");
    assert_eq!(args["x-settle-subscription"], format!("{ns}/orders"));
    assert_eq!(
        bindings(&durable),
        vec![("amq.topic".to_string(), format!("{tag}.orders.#"))]
    );
    let note = wait_event(&ns, "orders", "Created").await;
    assert!(note.contains(&durable), "{note}");
    let ready = [("namespace", ns.as_str()), ("subscription", "orders")];
    assert_eq!(op.metric("settle_subscription_ready", &ready), 1.0);
    let series =
        format!("settle_subscription_ready{{namespace=\"{ns}\",subscription=\"orders\"}} 1");
    assert!(op.get("/metrics").unwrap_or_default().contains(&series));

    // Deleted on the broker: made again, and said so.
    delete_queue(&durable);
    wait_queue(&durable, "the queue to be made again", |q| q.is_some()).await;
    let note = wait_event(&ns, "orders", "Recreated").await;
    assert!(note.contains(&durable), "{note}");
    assert_eq!(bindings(&durable).len(), 1, "bound again too");

    // The gauges the account reads: two messages waiting, none unacknowledged.
    {
        use settle::bus::Broker;
        let publisher = settle::backend::rabbitmq::RabbitBroker::connect(&env.rabbitmq_url)
            .await
            .expect("connect");
        for body in ["a", "b"] {
            publisher
                .publish(
                    format!("{tag}.orders.created"),
                    vec![],
                    bytes::Bytes::from(body),
                )
                .await
                .expect("publish");
        }
        let m = settle::backend::rabbitmq::management::Management::new(
            &env.rabbitmq_management_url,
            "guest",
            "guest",
            None,
        )
        .expect("management client");
        poll(
            "the gauges to show two ready",
            Duration::from_secs(30),
            || async {
                let g = settle::backend::rabbitmq::management::queue_gauges(&m, "/", &durable)
                    .await
                    .map_err(|e| e.to_string())?;
                if g == Some((2, 0)) {
                    Ok(())
                } else {
                    Err(format!("{g:?}"))
                }
            },
        )
        .await;
    }

    // A changed pattern: the same queue, re-bound in place.
    apply(
        &ns,
        &sub_yaml_on(
            "rabbit",
            "orders",
            &spec(&format!("{tag}.*.created"), 3, ""),
        ),
    );
    poll(
        "the binding to follow the pattern",
        Duration::from_secs(30),
        || async {
            let b = bindings(&durable);
            if b == vec![("amq.topic".to_string(), format!("{tag}.*.created"))] {
                Ok(())
            } else {
                Err(format!("{b:?}"))
            }
        },
    )
    .await;
    wait_event(&ns, "orders", "Updated").await;

    // A changed maxDeliver: RabbitMQ cannot change x-delivery-limit in place; said, not ignored.
    apply(
        &ns,
        &sub_yaml_on(
            "rabbit",
            "orders",
            &spec(&format!("{tag}.*.created"), 5, ""),
        ),
    );
    let s = wait_condition(
        &api,
        "orders",
        "Ready",
        "False",
        "ImmutableField",
        Duration::from_secs(30),
    )
    .await;
    let (_, _, m) = condition(&s.status.expect("status").conditions, "Ready").expect("Ready");
    assert!(m.contains("x-delivery-limit (spec.maxDeliver)"), "{m}");
    assert_eq!(
        queue(&durable).expect("kept")["arguments"]["x-delivery-limit"],
        2
    );
    // Deleting the queue on the broker lets Settle make it with the new limit.
    delete_queue(&durable);
    wait_ready(&api, "orders").await;
    assert_eq!(
        queue(&durable).expect("made")["arguments"]["x-delivery-limit"],
        4
    );

    // A second Subscription naming the same queue: a conflict, the queue left alone.
    apply(
        &ns,
        &sub_yaml_on("rabbit", "thief", &spec(&format!("{tag}.*.created"), 5, "")),
    );
    let s = wait_condition(
        &api,
        "thief",
        "Ready",
        "False",
        "ConsumerConflict",
        Duration::from_secs(30),
    )
    .await;
    let (_, _, m) = condition(&s.status.expect("status").conditions, "Ready").expect("Ready");
    assert!(m.contains(&format!("{ns}/orders")), "{m}");
    api.delete("thief", &DeleteParams::default())
        .await
        .expect("delete");
    wait_gone(&api, "thief", Duration::from_secs(30)).await;
    assert!(
        queue(&durable).is_some(),
        "another's queue is never deleted"
    );

    // Deleting the Subscription deletes its queue.
    api.delete("orders", &DeleteParams::default())
        .await
        .expect("delete");
    wait_gone(&api, "orders", Duration::from_secs(30)).await;
    assert!(
        queue(&durable).is_none(),
        "the queue went with the Subscription"
    );
    assert!(
        !op.get("/metrics").unwrap_or_default().contains(&series),
        "the ready gauge goes with the Subscription"
    );

    // Retain keeps it.
    let kept = format!("{tag}-kept");
    apply(
        &ns,
        &sub_yaml_on(
            "rabbit",
            "kept",
            &format!(
                "  pattern: \"{tag}.kept.>\"\n  mode: AtLeastOnce\n  durableName: {kept}\n  deletionPolicy: Retain\n"
            ),
        ),
    );
    wait_ready(&api, "kept").await;
    api.delete("kept", &DeleteParams::default())
        .await
        .expect("delete");
    wait_gone(&api, "kept", Duration::from_secs(30)).await;
    assert!(queue(&kept).is_some(), "a retained queue stays");
    delete_queue(&kept);

    // spec.stream means nothing on RabbitMQ: not accepted, said, nothing made.
    apply(
        &ns,
        &sub_yaml_on(
            "rabbit",
            "streamed",
            &format!("  pattern: \"{tag}.streamed.>\"\n  stream: ORDERS\n"),
        ),
    );
    let s = wait_condition(
        &api,
        "streamed",
        "Accepted",
        "False",
        "Invalid",
        Duration::from_secs(30),
    )
    .await;
    let (_, _, m) = condition(&s.status.expect("status").conditions, "Accepted").expect("Accepted");
    assert!(m.contains("spec.stream"), "{m}");
    assert!(
        queue(&format!("settle_{ns}_streamed")).is_none(),
        "nothing made"
    );

    // The derived name under AtMostOnce.
    apply(
        &ns,
        &sub_yaml_on(
            "rabbit",
            "audit",
            &format!("  pattern: \"{tag}.audit.>\"\n"),
        ),
    );
    let sub = wait_ready(&api, "audit").await;
    let derived = format!("settle_{ns}_audit");
    assert_eq!(
        sub.status.and_then(|s| s.consumer).map(|c| c.name),
        Some(derived.clone())
    );
    assert!(queue(&derived).is_some());
    kubectl_ok(&["delete", "subscriptions", "--all", "-n", &ns], None);
    assert!(queue(&derived).is_none(), "deleted with its Subscription");
    kubectl_ok(&["delete", "namespace", &ns, "--wait=false"], None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_runtime_consumes_from_the_operators_queue_and_again_after_it_is_made_again() {
    use std::sync::{Arc, Mutex};

    use settle::api::Subscription;
    use settle::backend::rabbitmq::RabbitBroker;
    use settle::bus::{Bus, Delivery, HandlerError, Subscriber, handler};

    install_crds();
    let ns = namespace("rec-rabbit-rt");
    let env = common::env();
    let _op = Operator::start_with(
        "rabbitmq-runtime",
        &ns,
        &["--leader-election=false", "--drift-interval", "1s"],
    );
    let tag = format!("rt{}", std::process::id());
    apply(&ns, &env_backend_yaml("rabbit", ""));
    let durable = format!("{tag}-jobs");
    apply(
        &ns,
        &sub_yaml_on(
            "rabbit",
            "jobs",
            &format!(
                "  pattern: \"{tag}.jobs.*\"\n  mode: AtLeastOnce\n  durableName: {durable}\n  maxDeliver: 3\n"
            ),
        ),
    );
    let api = subs(&ns).await;
    let sub: Subscription = wait_ready(&api, "jobs").await;

    // The runtime from the same resource: it binds to the operator's queue, declaring nothing.
    let bus = Bus::builder(
        RabbitBroker::connect(&env.rabbitmq_url)
            .await
            .expect("connect"),
    )
    .without_reports()
    .namespace(&ns)
    .build();
    let seen = Arc::new(Mutex::new(Vec::<String>::new()));
    let s = seen.clone();
    bus.subscribe(Subscriber::from_resource(
        "jobs",
        &sub.spec,
        handler(move |d: Delivery| {
            let s = s.clone();
            async move {
                s.lock()
                    .unwrap()
                    .push(String::from_utf8_lossy(d.payload()).into_owned());
                d.ack().await?;
                Ok::<(), HandlerError>(())
            }
        }),
    ))
    .await
    .expect("bound to the operator's queue");
    bus.publish(&format!("{tag}.jobs.a"), "one".to_string())
        .await
        .expect("publish");
    poll(
        "the first message handled",
        Duration::from_secs(30),
        || async {
            let v = seen.lock().unwrap().clone();
            if v == ["one"] {
                Ok(())
            } else {
                Err(format!("{v:?}"))
            }
        },
    )
    .await;

    // Deleted on the broker: the operator makes it again, the runtime consumes from it again.
    delete_queue(&durable);
    wait_event(&ns, "jobs", "Recreated").await;
    poll(
        "a message on the queue made again to be handled",
        Duration::from_secs(60),
        || async {
            // Published until handled: one sent before the runtime is back is lost with nothing bound.
            bus.publish(&format!("{tag}.jobs.b"), "two".to_string())
                .await
                .map_err(|e| e.to_string())?;
            tokio::time::sleep(Duration::from_millis(400)).await;
            let v = seen.lock().unwrap().clone();
            if v.iter().any(|m| m == "two") {
                Ok(())
            } else {
                Err(format!("{v:?}"))
            }
        },
    )
    .await;
    bus.close().await;
    kubectl_ok(&["delete", "subscriptions", "--all", "-n", &ns], None);
    assert!(queue(&durable).is_none());
    kubectl_ok(&["delete", "namespace", &ns, "--wait=false"], None);
}

/// The account reads a managed queue's gauges from the management API into status: messages
/// ready as `pending`, unacknowledged as `ackPending`. Counters appear once the runtime reports
/// (crates/settle-operator/tests/account/rabbitmq.rs); with no runtime running none is written, so none reads as a
/// false zero.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_queues_gauges_reach_status_and_no_counter_is_invented() {
    use lapin::options::BasicPublishOptions;
    install_crds();
    let ns = namespace("acct-rabbit");
    let env = common::env();
    let _op = Operator::start_with(
        "acct-rabbit",
        &ns,
        &["--leader-election=false", "--stats-interval", "1s"],
    );
    apply(&ns, &env_backend_yaml("rabbit", ""));
    wait_backend(&backends(&ns).await, "rabbit", "True", "Connected").await;
    let tag = format!("gauge{}", std::process::id());
    apply(
        &ns,
        &sub_yaml_on(
            "rabbit",
            "gauged",
            &format!(
                "  pattern: \"{tag}.>\"\n  mode: AtLeastOnce\n  durableName: {tag}\n  maxDeliver: 3\n"
            ),
        ),
    );
    let api = subs(&ns).await;
    wait_ready(&api, "gauged").await;

    let conn =
        lapin::Connection::connect(&env.rabbitmq_url, lapin::ConnectionProperties::default())
            .await
            .expect("connect");
    let ch = conn.create_channel().await.expect("channel");
    for i in 0..3 {
        ch.basic_publish(
            "amq.topic".into(),
            format!("{tag}.m{i}").as_str().into(),
            BasicPublishOptions::default(),
            b"x",
            lapin::BasicProperties::default(),
        )
        .await
        .expect("publish")
        .await
        .expect("confirmed");
    }
    poll(
        "status.stats.pending 3 from the management API",
        Duration::from_secs(60),
        || async {
            let s = api.get("gauged").await.map_err(|e| e.to_string())?;
            let st = s.status.and_then(|s| s.stats).ok_or("no stats yet")?;
            if (st.pending, st.ack_pending) == (3, 0) {
                Ok(())
            } else {
                Err(format!(
                    "pending {} ackPending {}",
                    st.pending, st.ack_pending
                ))
            }
        },
    )
    .await;
    let raw = kubectl_ok(
        &[
            "get",
            "subscription",
            "gauged",
            "-n",
            &ns,
            "-o",
            "jsonpath={.status.stats}",
        ],
        None,
    );
    let stats: Value = serde_json::from_str(&raw).expect("stats JSON");
    assert_eq!(
        stats.as_object().map(|o| {
            let mut k: Vec<&String> = o.keys().collect();
            k.sort();
            k
        }),
        Some(vec![&"ackPending".to_string(), &"pending".to_string()]),
        "only the gauges: {raw}"
    );
    let _ = conn.close(0, "done".into()).await;
    kubectl_ok(&["delete", "namespace", &ns, "--wait=false"], None);
}

/// Queue `name`'s message count as the management API shows it (its stats lag a few seconds).
async fn wait_messages(name: &str, n: u64) {
    wait_queue(name, &format!("queue {name} to show {n} messages"), |q| {
        q.as_ref().and_then(|q| q["messages"].as_u64()) == Some(n)
    })
    .await;
}

/// Ownership (docs/semantics.md R8), with and without the management API: another application's
/// quorum queue of the same name, holding 3 messages, is neither bound nor deleted (Ready=False
/// ConsumerConflict naming the way out, a Warning Event), and still holds its 3 messages after
/// `kubectl delete` of the Subscription; a queue an earlier object of the same name left
/// (deletionPolicy Retain) is not taken by the new object until the `settle.dev/adopt`
/// annotation names the old UID, and then is, with what it holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queue_settle_did_not_make_for_this_object_is_never_bound_or_deleted_unless_adopted() {
    install_crds();
    let ns = namespace("rec-rabbit-own");
    let env = common::env();
    let op = Operator::start_with(
        "rabbitmq-own",
        &ns,
        &["--leader-election=false", "--drift-interval", "1s"],
    );
    let tag = format!("own{}", std::process::id());
    apply(
        &ns,
        &format!(
            "apiVersion: messaging.settle.dev/v1alpha1\nkind: Backend\nmetadata: {{name: plain}}\nspec:\n  rabbitmq:\n    urls: [\"{}\"]\n",
            env.rabbitmq_url
        ),
    );
    apply(&ns, &env_backend_yaml("managed", ""));
    let backends_api = backends(&ns).await;
    wait_backend(&backends_api, "plain", "True", "Connected").await;
    wait_backend(&backends_api, "managed", "True", "Connected").await;
    let api = subs(&ns).await;

    for (backend, fix) in [
        ("plain", "spec.rabbitmq.managementUrl"),
        ("managed", "Settle did not make it"),
    ] {
        // Another application's quorum queue, with 3 messages, named as the durableName.
        let foreign = format!("{tag}-{backend}-foreign");
        common::rabbitmq::foreign_queue(&foreign, 3);
        wait_messages(&foreign, 3).await;
        let thief = format!("thief-{backend}");
        apply(
            &ns,
            &sub_yaml_on(
                backend,
                &thief,
                &format!(
                    "  pattern: \"{tag}.{backend}.>\"\n  mode: AtLeastOnce\n  durableName: {foreign}\n"
                ),
            ),
        );
        let s = wait_condition(
            &api,
            &thief,
            "Ready",
            "False",
            "ConsumerConflict",
            Duration::from_secs(30),
        )
        .await;
        let (_, _, m) = condition(&s.status.expect("status").conditions, "Ready").expect("Ready");
        assert!(m.contains(fix) && m.contains("another durableName"), "{m}");
        let note = wait_event(&ns, &thief, "ConsumerConflict").await;
        assert!(note.contains(&foreign), "{note}");
        assert_eq!(bindings(&foreign), vec![], "never bound to the pattern");
        assert_eq!(
            queue(&foreign).expect("there")["arguments"]
                .get("x-settle-subscription")
                .cloned(),
            None,
            "never marked"
        );
        kubectl_ok(&["delete", "subscription", &thief, "-n", &ns], None);
        wait_gone(&api, &thief, Duration::from_secs(30)).await;
        let q = queue(&foreign).expect("another's queue is never deleted");
        assert_eq!(q["messages"], 3, "with its messages");
        assert_eq!(bindings(&foreign), vec![]);
        delete_queue(&foreign);

        // An earlier object's leftover: not taken without the annotation, taken with it.
        let kept = format!("{tag}-{backend}-kept");
        let name = format!("kept-{backend}");
        let spec = |extra: &str| {
            format!(
                "  pattern: \"{tag}.{backend}.kept.>\"\n  mode: AtLeastOnce\n  durableName: {kept}\n{extra}"
            )
        };
        apply(
            &ns,
            &sub_yaml_on(backend, &name, &spec("  deletionPolicy: Retain\n")),
        );
        let old = wait_ready(&api, &name).await.metadata.uid.expect("a UID");
        if backend == "managed" {
            assert_eq!(
                queue(&kept).expect("made")["arguments"]["x-settle-object"],
                old.as_str(),
                "the queue carries its object's UID"
            );
        }
        common::rabbitmq::put_messages(&kept, 2);
        api.delete(&name, &DeleteParams::default())
            .await
            .expect("delete");
        wait_gone(&api, &name, Duration::from_secs(30)).await;
        wait_messages(&kept, 2).await;

        apply(&ns, &sub_yaml_on(backend, &name, &spec("")));
        let s = wait_condition(
            &api,
            &name,
            "Ready",
            "False",
            "ConsumerConflict",
            Duration::from_secs(30),
        )
        .await;
        let new = s.metadata.uid.clone().expect("a UID");
        assert_ne!(new, old, "a new object");
        let (_, _, m) = condition(&s.status.expect("status").conditions, "Ready").expect("Ready");
        assert!(
            m.contains(&format!("settle.dev/adopt: \"{old}\"")),
            "the condition says what to write: {m}"
        );
        assert_eq!(queue(&kept).expect("kept")["messages"], 2);

        kubectl_ok(
            &[
                "annotate",
                "subscription",
                &name,
                "-n",
                &ns,
                &format!("settle.dev/adopt={old}"),
            ],
            None,
        );
        let s = wait_ready(&api, &name).await;
        assert_eq!(
            s.status.and_then(|s| s.consumer).map(|c| c.name),
            Some(kept.clone())
        );
        let note = wait_event(&ns, &name, "Adopted").await;
        assert!(note.contains(&old) && note.contains(&kept), "{note}");
        assert!(op.metric("settle_consumer_operations_total", &[("op", "adopt")]) >= 1.0);
        assert_eq!(
            bindings(&kept),
            vec![("amq.topic".to_string(), format!("{tag}.{backend}.kept.#"))]
        );
        assert_eq!(
            queue(&kept).expect("taken over")["messages"],
            2,
            "with what it holds"
        );
        // Now this object's: deleted with it.
        api.delete(&name, &DeleteParams::default())
            .await
            .expect("delete");
        wait_gone(&api, &name, Duration::from_secs(30)).await;
        assert!(queue(&kept).is_none(), "the adopted queue went with it");
    }
    kubectl_ok(&["delete", "namespace", &ns, "--wait=false"], None);
}

#[tokio::test]
async fn a_vhost_at_its_queue_limit_costs_the_broker_next_to_nothing_and_a_freed_place_is_taken_at_once()
 {
    install_crds();
    let ns = namespace("rec-rabbit-limit");
    let op = Operator::start_with(
        "rabbitmq-limit",
        &ns,
        &["--leader-election=false", "--drift-interval", "10m"],
    );
    let tag = format!("lim{}", std::process::id());
    let vhost =
        common::rabbitmq::LimitedVhost::create(&format!("settle-limit-{}", std::process::id()));
    apply(
        &ns,
        &env_backend_yaml("rabbit", &format!("    vhost: {}\n", vhost.0)),
    );
    wait_backend(&backends(&ns).await, "rabbit", "True", "Connected").await;
    let api = subs(&ns).await;
    let spec = |n: &str| {
        format!("  pattern: \"{tag}.{n}.>\"\n  mode: AtLeastOnce\n  durableName: {tag}-{n}\n")
    };
    let names: Vec<String> = (0..5).map(|i| format!("q{i}")).collect();
    for n in &names[..2] {
        apply(&ns, &sub_yaml_on("rabbit", n, &spec(n)));
        wait_condition(
            &api,
            n,
            "Ready",
            "True",
            "ConsumerReady",
            Duration::from_secs(60),
        )
        .await;
    }
    // No room for another queue in the vhost, once the two Ready ones hold all theirs (five
    // each: the queue, its object mark and the account's report, ledger and index queues, made
    // with it; waited for until the count stands still).
    let mut queues = vhost.queues();
    let mut still = 0;
    let settling = std::time::Instant::now();
    while still < 3 && settling.elapsed() < Duration::from_secs(30) {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let now = vhost.queues();
        still = if now == queues { still + 1 } else { 0 };
        queues = now;
    }
    vhost.limit(queues);
    for n in &names[2..] {
        apply(&ns, &sub_yaml_on("rabbit", n, &spec(n)));
    }
    let refused = |seen: &common::subs::Readiness| {
        seen.iter()
            .filter(|(_, c)| {
                c.as_ref().is_some_and(|(s, r, m)| {
                    s == "False"
                        && r == "BrokerLimit"
                        && m.contains(&format!(
                            "the vhost {} allows at most {queues} queues (max-queues)",
                            vhost.0
                        ))
                })
            })
            .count()
    };
    let ready = |seen: &common::subs::Readiness| {
        seen.iter()
            .filter(|(_, c)| c.as_ref().is_some_and(|c| c.0 == "True"))
            .count()
    };
    common::subs::wait_readiness(
        &api,
        &names,
        "2 Subscriptions Ready and 3 refused by the vhost's limit",
        Duration::from_secs(60),
        |seen| (ready(seen), refused(seen)) == (2, 3),
    )
    .await;

    // While the limit holds, the refused three barely call the broker.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let calls = || {
        let text = op.get("/metrics").unwrap_or_default();
        text.lines()
            .filter(|l| l.starts_with("settle_consumer_api_calls_total{"))
            .map(str::to_string)
            .collect::<Vec<_>>()
    };
    let (before, listed) = (op.metric("settle_consumer_api_calls_total", &[]), calls());
    tokio::time::sleep(Duration::from_secs(20)).await;
    let during = op.metric("settle_consumer_api_calls_total", &[]) - before;
    eprintln!(
        "RabbitMQ calls over 20 s at the vhost's limit: {during}\n  before: {listed:?}\n  after: {:?}",
        calls()
    );
    assert!(
        during <= 10.0,
        "{during} RabbitMQ calls in 20 s against a vhost at its limit"
    );

    // Room for two queues, fewer than a Subscription needs: the next probe declares two of its
    // account queues, is refused the third, and takes back what it declared, so a refused
    // Subscription holds no place another could take.
    vhost.limit(queues + 2);
    let took_back = || {
        op.metric(
            "settle_consumer_api_calls_total",
            &[("call", "account.take_back")],
        )
    };
    let probing = std::time::Instant::now();
    while took_back() < 2.0 {
        assert!(
            probing.elapsed() < Duration::from_secs(90),
            "no probe took back its account queues in 90 s"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(
        vhost.queues(),
        queues,
        "a refused Subscription holds no account queue"
    );
    common::subs::wait_readiness(
        &api,
        &names,
        "still 2 Subscriptions Ready and 3 refused",
        Duration::from_secs(5),
        |seen| {
            let limited = seen
                .iter()
                .filter(|(_, c)| {
                    c.as_ref()
                        .is_some_and(|(s, r, _)| s == "False" && r == "BrokerLimit")
                })
                .count();
            (ready(seen), limited) == (2, 3)
        },
    )
    .await;
    vhost.limit(queues);

    // A Ready one goes (its five queues): one refused Subscription takes the places, all five,
    // and no other finds one the first's account then lacks (CI once saw two Ready here: the
    // second took the places the first's account queues were to have).
    api.delete("q0", &DeleteParams::default())
        .await
        .expect("delete");
    wait_gone(&api, "q0", Duration::from_secs(30)).await;
    let rest = &names[1..];
    common::subs::wait_readiness(
        &api,
        rest,
        "a refused Subscription to take the freed place",
        Duration::from_secs(10),
        |seen| (ready(seen), refused(seen)) == (2, 2),
    )
    .await;
    // And it stays so once the deleted one's account is dropped: the vhost is full again.
    tokio::time::sleep(Duration::from_secs(3)).await;
    common::subs::wait_readiness(
        &api,
        rest,
        "still one Subscription in the freed place",
        Duration::from_secs(5),
        |seen| (ready(seen), refused(seen)) == (2, 2),
    )
    .await;
    assert_eq!(
        vhost.queues(),
        queues,
        "the vhost holds as many queues as its limit"
    );
    for n in rest {
        let _ = api.delete(n, &DeleteParams::default()).await;
    }
    for n in rest {
        wait_gone(&api, n, Duration::from_secs(30)).await;
    }
    kubectl_ok(&["delete", "namespace", &ns, "--wait=false"], None);
}

/// A bind whose queue was deleted after its declare is `Gone` (looked at again with the queue
/// kept in status, so its making again is said Recreated), never a refusal; a bind to an
/// exchange that does not exist stays a refusal (a Backend's mistake, not a race).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bind_to_a_deleted_queue_is_gone_and_to_a_missing_exchange_refused() {
    use settle::backend::rabbitmq::admin::{self, AdminError};
    use settle::backend::rabbitmq::mapping::Binding;
    let env = common::env();
    let conn = lapin::Connection::connect(&env.rabbitmq_url, Default::default())
        .await
        .expect("connect to RabbitMQ");
    let name = format!("gone{}", std::process::id());
    let to = |exchange: &str| Binding {
        exchange: exchange.to_string(),
        routing_key: "gone.#".to_string(),
    };
    match admin::bind(&conn, &name, &to("amq.topic")).await {
        Err(AdminError::Gone(q)) => assert_eq!(q, name),
        other => panic!("a bind of a missing queue: {other:?}"),
    }
    let ch = conn.create_channel().await.expect("a channel");
    ch.queue_declare(
        name.as_str().into(),
        lapin::options::QueueDeclareOptions {
            auto_delete: true,
            ..Default::default()
        },
        Default::default(),
    )
    .await
    .expect("declare");
    let missing = format!("{name}-no-such-exchange");
    match admin::bind(&conn, &name, &to(&missing)).await {
        Err(e @ AdminError::Refused { .. }) => assert!(e.to_string().contains(&missing), "{e}"),
        other => panic!("a bind to a missing exchange: {other:?}"),
    }
    delete_queue(&name);
}
