//! One leadership term of the controllers: the caches and their watches (Backends, Subscriptions,
//! the Secrets Backends name), both controllers, the readiness they sync, and the handles the
//! account is given for the term ([`Term`]), until the term is told to stop.
//!
//! It must not decide anything a reconcile decides (that is `backend` and `subscription`), nor
//! outlive its term: every task it starts ends with it.

use super::*;

/// What of a Backend its Subscriptions depend on: its generation and its Ready status.
type BackendSeen = (Option<i64>, Option<String>);

// About a hundred lines on purpose: the term's wiring in the order it starts (caches, watches,
// both controllers, the sync, the account's handles, the stop); each part with logic of its own
// is a function below, and splitting the wiring further would only pass its streams around.
/// One leadership term: both controllers, the Secret watch, until `stop`.
pub(super) async fn run_term(
    client: Client,
    config: &Config,
    metrics: Metrics,
    readiness: Readiness,
    beside: Option<TermHook>,
    stop: oneshot::Receiver<()>,
) {
    let namespaces = &config.watch_namespaces;
    let (sub_store, sub_writer) = reflector::store::<Subscription>();
    let (backend_store, backend_writer) = reflector::store::<Backend>();
    let (sub_tx, sub_rx) = mpsc::unbounded::<ObjectRef<Subscription>>();
    let (backend_tx, backend_rx) = mpsc::unbounded::<ObjectRef<Backend>>();
    let conns = Connections::new(
        format!("settle-operator {}", config.identity),
        sub_store.clone(),
        sub_tx.clone(),
        backend_tx.clone(),
        metrics.clone(),
    );
    let ctx = context(
        &client,
        config,
        &conns,
        (&backend_store, &sub_store),
        &metrics,
    );

    // Backends: a deleted one's connection is dropped; a change of its spec or of its Ready
    // status reconciles its Subscriptions.
    let seen: Arc<Mutex<HashMap<connections::Key, BackendSeen>>> = Arc::default();
    let backend_events = {
        let conns = conns.clone();
        watch::<Backend>(&client, namespaces)
            .reflect(backend_writer)
            .inspect_ok(move |ev| backend_seen(&conns, &seen, ev))
            .applied_objects()
            .predicate_filter(backend_predicate, Default::default())
    };
    let secret_task = AbortOnDrop(secret_watch(
        &client,
        namespaces,
        backend_store.clone(),
        backend_tx.clone(),
    ));

    let (stop_backends, stop_subs, stop_beside) = {
        let shared = stop.map(|_| ()).shared();
        (shared.clone(), shared.clone(), shared)
    };

    let backends = Controller::for_stream(backend_events, backend_store.clone())
        .reconcile_on(backend_rx)
        .with_config(ControllerConfig::default().concurrency(4))
        .graceful_shutdown_on(stop_backends)
        .run(backend::reconcile, backend_error_policy, ctx.clone())
        .for_each(|r| count(&metrics, metrics::BACKEND, r));

    let sub_events = watch::<Subscription>(&client, namespaces)
        .reflect(sub_writer)
        .applied_objects()
        .predicate_filter(subscription_predicate, Default::default());
    let subscriptions = Controller::for_stream(sub_events, sub_store.clone())
        .reconcile_on(sub_rx)
        .reconcile_on(resync_walk(sub_store.clone(), config.resync))
        .with_config(ControllerConfig::default().concurrency(config.concurrency.max(1)))
        .graceful_shutdown_on(stop_subs)
        .run(
            subscription::reconcile,
            subscription::error_policy,
            ctx.clone(),
        )
        .for_each(|r| count(&metrics, metrics::SUBSCRIPTION, r));

    let synced = {
        let (b, s) = (backend_store.clone(), sub_store.clone());
        let readiness = readiness.clone();
        async move {
            super::cache_ready(&b).await;
            super::cache_ready(&s).await;
            tracing::info!("controller caches synced");
            readiness.set(true);
            futures::future::pending::<()>().await;
        }
    };
    let beside = beside.map(|hook| {
        AbortOnDrop(tokio::spawn(hook(handles(
            &client,
            &sub_store,
            &backend_store,
            &conns,
        ))))
    });
    // The term's end stops the account at once: it writes no status once this replica may no
    // longer lead, while in-flight reconciles finish. Dropped with the term (also when the
    // caller gives up waiting for it), both tasks are aborted, never left running.
    let beside = async move {
        stop_beside.await;
        drop(beside);
        futures::future::pending::<()>().await;
    };
    tokio::select! {
        _ = futures::future::join(backends, subscriptions) => {},
        () = synced => {},
        () = beside => {},
    }
    drop(secret_task);
    drop(sub_tx);
    drop(backend_tx);
}

/// The context every reconcile of the term shares.
fn context(
    client: &Client,
    config: &Config,
    conns: &Arc<Connections>,
    (backends, subs): (&Store<Backend>, &Store<Subscription>),
    metrics: &Metrics,
) -> Arc<Ctx> {
    Arc::new(Ctx {
        client: client.clone(),
        conns: conns.clone(),
        backends: backends.clone(),
        subs: subs.clone(),
        metrics: metrics.clone(),
        recorder: Recorder::new(
            client.clone(),
            Reporter {
                controller: "settle-operator".into(),
                instance: Some(config.identity.clone()),
            },
        ),
        resync: config.resync,
        drift: config.drift,
        backend_deletion_grace: config.backend_deletion_grace,
        max_backends_per_namespace: config.max_backends_per_namespace,
        backend_rules: config.backend_rules.clone(),
        dead_letter_copy_max_length: config.dead_letter_copy_max_length,
        adopt_namespaces: config.adopt_namespaces.clone(),
        failures: Mutex::default(),
    })
}

/// A Backend watch event: a deleted Backend's connection and gate are dropped; a change of its
/// generation or of its Ready status reconciles its Subscriptions.
fn backend_seen(
    conns: &Connections,
    seen: &Mutex<HashMap<connections::Key, BackendSeen>>,
    ev: &watcher::Event<Backend>,
) {
    match ev {
        watcher::Event::Delete(b) => {
            let key = (b.namespace().unwrap_or_default(), b.name_any());
            conns.remove(&key);
            lock(seen).remove(&key);
            conns.gates.drop_backend(&key);
            conns.trigger_all(&key);
        }
        watcher::Event::Apply(b) | watcher::Event::InitApply(b) => {
            let key = (b.namespace().unwrap_or_default(), b.name_any());
            let ready = b
                .status
                .as_ref()
                .and_then(|s| conditions::find(&s.conditions, conditions::types::READY))
                .map(|c| c.status.clone());
            let now = (b.metadata.generation, ready);
            let changed = lock(seen).insert(key.clone(), now.clone()) != Some(now);
            if changed {
                conns.gates.drop_backend(&key);
                conns.trigger_all(&key);
            }
        }
        _ => {}
    }
}

/// Secrets: a change reconciles the Backends that name it (a rotated credential is picked up).
fn secret_watch(
    client: &Client,
    namespaces: &[String],
    backends: Store<Backend>,
    tx: mpsc::UnboundedSender<ObjectRef<Backend>>,
) -> tokio::task::JoinHandle<()> {
    let apis: Vec<Api<PartialObjectMeta<Secret>>> = if namespaces.is_empty() {
        vec![Api::all(client.clone())]
    } else {
        namespaces
            .iter()
            .map(|ns| Api::namespaced(client.clone(), ns))
            .collect()
    };
    let streams = apis.into_iter().map(|api| {
        watcher(api, watcher::Config::default().any_semantic())
            .default_backoff()
            .modify(lean)
            .touched_objects()
            .boxed()
    });
    let mut all = futures::stream::select_all(streams);
    tokio::spawn(async move {
        while let Some(item) = all.next().await {
            match item {
                Ok(secret) => {
                    let ns = secret.namespace().unwrap_or_default();
                    let state = backends.state();
                    for b in index::backends_naming_secret(
                        state.iter().map(AsRef::as_ref),
                        &ns,
                        &secret.name_any(),
                    ) {
                        let _ = tx.unbounded_send(ObjectRef::from_obj(b));
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "Secret watch failed (a changed Secret is then picked up at the next resync); retrying")
                }
            }
        }
    })
}

/// What the account is handed for the term: the client, the caches, and lookups of each
/// Backend's live connection (NATS client, RabbitMQ AMQP connection, queue gauges) and of the
/// limit gates it frees places in.
fn handles(
    client: &Client,
    subscriptions: &Store<Subscription>,
    backends: &Store<Backend>,
    conns: &Arc<Connections>,
) -> Term {
    Term {
        client: client.clone(),
        subscriptions: subscriptions.clone(),
        backends: backends.clone(),
        nats: {
            let lookup = conns.clone();
            Arc::new(
                move |ns: &str, name: &str| match up(&lookup, ns, name)?.as_ref() {
                    connections::Conn::Nats(n) => Some((n.client.clone(), n.serial)),
                    _ => None,
                },
            )
        },
        rabbitmq: {
            let lookup = conns.clone();
            Arc::new(move |ns: &str, name: &str| {
                let found = up(&lookup, ns, name);
                Box::pin(async move {
                    let found = found?;
                    let connections::Conn::Rabbitmq(r) = found.as_ref() else {
                        return None;
                    };
                    r.connection().await.ok()
                })
            })
        },
        freed: {
            let lookup = conns.clone();
            Arc::new(move |ns: &str, name: &str| {
                lookup
                    .gates
                    .freed(&(ns.to_string(), name.to_string()), None);
            })
        },
        queues: {
            let lookup = conns.clone();
            Arc::new(
                move |ns: &str, name: &str| match up(&lookup, ns, name)?.as_ref() {
                    connections::Conn::Rabbitmq(r) => {
                        r.management
                            .clone()
                            .map(|management| QueueGauges::Rabbitmq {
                                management: Box::new(management),
                                vhost: r.vhost.clone(),
                            })
                    }
                    connections::Conn::Sqs(s) => Some(QueueGauges::Sqs(s.broker.client().clone())),
                    connections::Conn::Nats(_) => None,
                },
            )
        },
    }
}

/// Backend `ns/name`'s connection, when it is up.
fn up(lookup: &Connections, ns: &str, name: &str) -> Option<Arc<connections::Conn>> {
    match lookup.get(&(ns.to_string(), name.to_string())) {
        connections::Lookup::Up(c) => Some(c),
        _ => None,
    }
}

/// A task that ends when its handle is dropped (a plain `JoinHandle` detaches it).
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}
