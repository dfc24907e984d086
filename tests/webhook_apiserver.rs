//! The webhook server as the real API server calls it: registered by `url:` + `caBundle` (scoped
//! by namespaceSelector to one throwaway namespace, so no other test is affected), with Backends
//! from a real reflector store (`StoreLookup`). Pins that the API server accepts the answers:
//! denials reach kubectl with the exact message, `--dry-run=server` gets the same verdict,
//! warnings show in kubectl's output, immutable updates are refused, and with the webhook down
//! Subscriptions fail closed while other resources are untouched.
//!
//! The full table of manifests belongs to the issue's end-to-end test; this one checks the wiring.
#![cfg(feature = "operator")]

mod common;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::process::Output;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use kube::Api;
use kube::runtime::{WatchStreamExt, reflector, watcher};
use settle::admission::certs::{self, CertResolver, Sans};
use settle::admission::webhook::{Server, StoreLookup, WebhookConfig};
use settle::api::Backend;

const HOOK: &str = "subscriptions.webhook-test.settle.dev";

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn apply(ns: &str, yaml: &str, extra: &[&str]) -> Output {
    let mut args = vec!["-n", ns, "apply", "-f", "-"];
    args.extend_from_slice(extra);
    common::kubectl(&args, Some(yaml))
}

fn subscription(name: &str, spec: &str) -> String {
    format!(
        "apiVersion: messaging.settle.dev/v1alpha1\nkind: Subscription\nmetadata:\n  name: {name}\nspec:\n  backendRef: {{name: nats}}\n  pattern: \"orders.>\"\n{spec}"
    )
}

/// Deletes the throwaway webhook configuration and namespace even when the test fails.
struct Cleanup {
    vwc: String,
    ns: String,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        let _ = common::kubectl(
            &[
                "delete",
                "validatingwebhookconfiguration",
                &self.vwc,
                "--ignore-not-found",
            ],
            None,
        );
        let _ = common::kubectl(
            &[
                "delete",
                "namespace",
                &self.ns,
                "--wait=false",
                "--ignore-not-found",
            ],
            None,
        );
    }
}

const DURABLE: &str = "spec.durableName: required under mode AtLeastOnce, on every backend: set spec.durableName to a stable name \
     (for example the Subscription's name) so redeliveries survive a restart";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_server_calls_the_webhook_and_honours_its_answers() {
    common::install_crds();
    let ns = common::namespace("webhook-apiserver");
    let vwc = ns.clone();
    let _cleanup = Cleanup {
        vwc: vwc.clone(),
        ns: ns.clone(),
    };
    common::kubectl_ok(
        &[
            "label",
            "namespace",
            &ns,
            &format!("settle-webhook-test={ns}"),
        ],
        None,
    );
    common::kubectl_ok(
        &["-n", &ns, "apply", "-f", "-"],
        Some(
            "apiVersion: messaging.settle.dev/v1alpha1\nkind: Backend\nmetadata:\n  name: nats\nspec:\n  nats:\n    servers: [\"nats://127.0.0.1:4222\"]\n",
        ),
    );

    // Backends as the operator sees them: a reflector store, misses confirmed by a GET.
    let client = common::kube_client().await;
    let (store, writer) = reflector::store::<Backend>();
    let watch = reflector(
        writer,
        watcher(
            Api::<Backend>::namespaced(client.clone(), &ns),
            watcher::Config::default(),
        ),
    )
    .applied_objects()
    .for_each(|_| async {});
    let watch_task = tokio::spawn(watch);

    let sans = Sans {
        dns_names: vec![],
        ip_addresses: vec![IpAddr::V4(Ipv4Addr::LOCALHOST)],
    };
    let bundle = certs::issue_for(&sans, Duration::from_secs(3600)).expect("issue");
    let resolver = Arc::new(
        CertResolver::from_pem(bundle.cert_pem.as_bytes(), bundle.key_pem.as_bytes())
            .expect("resolver"),
    );
    let registry = prometheus::Registry::new();
    let server = Server::bind(
        WebhookConfig::new(SocketAddr::from((Ipv4Addr::LOCALHOST, 0))),
        Arc::new(StoreLookup::new(store, client.clone())),
        resolver,
        &registry,
    )
    .await
    .expect("bind");
    let port = server.local_addr().expect("addr").port();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(server.run(async {
        let _ = stopped.await;
    }));

    let ca_bundle = k8s_openapi::ByteString(bundle.ca_pem.clone().into_bytes());
    let ca_b64 = serde_json::to_value(&ca_bundle).expect("base64");
    let ca_b64 = ca_b64.as_str().expect("a string");
    common::kubectl_ok(
        &["apply", "-f", "-"],
        Some(&format!(
            r#"apiVersion: admissionregistration.k8s.io/v1
kind: ValidatingWebhookConfiguration
metadata:
  name: {vwc}
webhooks:
  - name: {HOOK}
    admissionReviewVersions: ["v1"]
    sideEffects: None
    failurePolicy: Fail
    timeoutSeconds: 5
    namespaceSelector:
      matchLabels: {{settle-webhook-test: "{ns}"}}
    rules:
      - apiGroups: ["messaging.settle.dev"]
        apiVersions: ["v1alpha1"]
        operations: ["CREATE", "UPDATE"]
        resources: ["subscriptions"]
        scope: Namespaced
    clientConfig:
      url: https://127.0.0.1:{port}/validate
      caBundle: {ca_b64}
"#
        )),
    );

    // The API server picks the configuration up asynchronously: wait until it asks us.
    let bad = subscription("bad", "  mode: AtLeastOnce\n");
    let denial = format!("admission webhook \"{HOOK}\" denied the request: {DURABLE}");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let out = apply(&ns, &bad, &["--dry-run=server"]);
        if text(&out).contains(&denial) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the API server never asked the webhook; last answer: {}",
            text(&out)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // A denial, for real and in dry run, with the exact message. (Another Settle webhook
    // registered cluster-wide by someone else's run may answer first, with the same message, so
    // the webhook's name is not pinned here; the loop above proved this one answers.)
    for extra in [&[][..], &["--dry-run=server"][..]] {
        let out = apply(&ns, &bad, extra);
        assert!(!out.status.success(), "{extra:?}: {}", text(&out));
        assert!(
            text(&out).contains(&format!("denied the request: {DURABLE}")),
            "{extra:?}: {}",
            text(&out)
        );
    }
    assert!(
        !common::kubectl(&["-n", &ns, "get", "subscription", "bad"], None)
            .status
            .success(),
        "a denied Subscription must not be stored"
    );

    // Warnings appear in kubectl's output; the Subscription is stored.
    let out = apply(&ns, &subscription("warned", "  maxDeliver: 5\n"), &[]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains(
            "Warning: spec.maxDeliver: has no effect under mode AtMostOnce (nothing is acknowledged or redelivered); remove it, or set spec.mode: AtLeastOnce"
        ),
        "{}",
        text(&out)
    );

    // A Backend that does not exist: admitted, with a warning.
    let out = apply(
        &ns,
        &subscription("ghost", "").replace("name: nats", "name: ghost"),
        &[],
    );
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains(
            "Warning: spec.backendRef.name: Backend \"ghost\" does not exist in this namespace yet"
        ),
        "{}",
        text(&out)
    );

    // A Backend created a moment ago (maybe not in the store yet) is found, not reported missing.
    common::kubectl_ok(
        &["-n", &ns, "apply", "-f", "-"],
        Some(
            "apiVersion: messaging.settle.dev/v1alpha1\nkind: Backend\nmetadata:\n  name: fresh\nspec:\n  memory: {}\n",
        ),
    );
    let out = apply(
        &ns,
        &subscription("fresh", "").replace("name: nats", "name: fresh"),
        &[],
    );
    assert!(out.status.success(), "{}", text(&out));
    assert!(!text(&out).contains("does not exist"), "{}", text(&out));

    // Immutable fields: refused on update, naming the field and the way out.
    let v1 = subscription("orders", "  mode: AtLeastOnce\n  durableName: orders\n");
    let out = apply(&ns, &v1, &[]);
    assert!(out.status.success(), "{}", text(&out));
    let out = apply(
        &ns,
        &v1.replace("durableName: orders", "durableName: orders-v2"),
        &[],
    );
    assert!(!out.status.success());
    assert!(
        text(&out).contains(
            "denied the request: spec.durableName: cannot change from \"orders\" to \"orders-v2\": the broker cannot change a \
             consumer's durable name in place. Delete this Subscription and create it again with the new value"
        ),
        "{}",
        text(&out)
    );

    // The webhook down: Subscriptions fail closed, other resources are untouched.
    let _ = stop.send(());
    tokio::time::timeout(Duration::from_secs(15), running)
        .await
        .expect("stops")
        .expect("joins")
        .expect("ran");
    let out = apply(&ns, &subscription("while-down", ""), &[]);
    assert!(!out.status.success(), "must fail closed: {}", text(&out));
    assert!(
        text(&out).contains(&format!("failed calling webhook \"{HOOK}\"")),
        "{}",
        text(&out)
    );
    common::kubectl_ok(
        &[
            "-n",
            &ns,
            "create",
            "configmap",
            "unaffected",
            "--from-literal=a=b",
        ],
        None,
    );

    watch_task.abort();
}
