//! The webhook's certificates: judging a stored bundle (pure), the file source reloading a
//! mounted certificate, and, against the real API server, the self-managed source: the Secret is
//! created, caBundle patched, the bundle reused on a second start, rotated when near expiry or
//! when the SANs change (keeping the old CA in caBundle), a foreign Secret never overwritten, and
//! the background task rotating and swapping the served certificate without a restart.
//!
//! Uses a throwaway namespace and a throwaway ValidatingWebhookConfiguration that matches nothing
//! (so no other test's requests are affected).

use settle_testkit as common;

use std::net::{IpAddr, Ipv4Addr};
use std::time::{Duration, Instant, SystemTime};

use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingWebhookConfiguration, WebhookClientConfig,
};
use k8s_openapi::api::core::v1::Secret;
use kube::Api;
use kube::api::{DeleteParams, PostParams};
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;
use settle_operator::admission::certs::{
    self, Assessment, CertError, CertSource, FileCertConfig, Sans, SecretOutcome,
    SelfManagedConfig, assess, ensure_secret, issue, issue_for, patch_ca_bundle,
};

fn sans() -> Sans {
    Sans {
        dns_names: vec!["settle-webhook.settle-system.svc".into()],
        ip_addresses: vec![IpAddr::V4(Ipv4Addr::LOCALHOST)],
    }
}

fn der(pem: &str) -> CertificateDer<'static> {
    CertificateDer::from_pem_slice(pem.as_bytes()).expect("PEM certificate")
}

/// A bundle with a one-hour lifetime of which `left` remains.
fn aged(left: Duration) -> certs::CertBundle {
    let now = SystemTime::now();
    let not_after = now + left;
    issue(&sans(), not_after - Duration::from_secs(3600), not_after).expect("issue")
}

#[test]
fn assess_reuses_only_a_fresh_matching_bundle() {
    let now = SystemTime::now();
    assert_eq!(
        assess(&aged(Duration::from_secs(50 * 60)), &sans(), now),
        Assessment::Reuse
    );
    // Less than a third of the lifetime left.
    let Assessment::Rotate(why) = assess(&aged(Duration::from_secs(15 * 60)), &sans(), now) else {
        panic!("must rotate")
    };
    assert!(
        why.contains("less than a third of its lifetime is left"),
        "{why}"
    );
    // A SAN the configuration asks for and the certificate lacks.
    let mut more = sans();
    more.dns_names.push("settle-webhook.other.svc".into());
    let Assessment::Rotate(why) = assess(
        &issue_for(&sans(), Duration::from_secs(3600)).unwrap(),
        &more,
        now,
    ) else {
        panic!("must rotate")
    };
    assert_eq!(why, "tls.crt does not name settle-webhook.other.svc");
    let mut ip = sans();
    ip.ip_addresses.push(IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1)));
    assert!(matches!(
        assess(
            &issue_for(&sans(), Duration::from_secs(3600)).unwrap(),
            &ip,
            now
        ),
        Assessment::Rotate(_)
    ));
    // A key that does not fit, and a CA that did not issue the certificate.
    let (a, b) = (
        issue_for(&sans(), Duration::from_secs(3600)).unwrap(),
        issue_for(&sans(), Duration::from_secs(3600)).unwrap(),
    );
    let mismatched = certs::CertBundle {
        key_pem: b.key_pem.clone(),
        ..a.clone()
    };
    assert!(
        matches!(assess(&mismatched, &sans(), now), Assessment::Rotate(w) if w.contains("unusable"))
    );
    let foreign_ca = certs::CertBundle {
        ca_pem: b.ca_pem,
        ..a
    };
    assert_eq!(
        assess(&foreign_ca, &sans(), now),
        Assessment::Rotate("tls.crt was not issued by ca.crt".into())
    );
    // Garbage.
    let garbage = certs::CertBundle {
        ca_pem: "x".into(),
        cert_pem: "y".into(),
        key_pem: "z".into(),
    };
    assert!(matches!(
        assess(&garbage, &sans(), now),
        Assessment::Rotate(_)
    ));
}

/// What the code under test logged (`tracing`), to see that a background task did its work.
#[derive(Clone, Default)]
struct Logs(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl Logs {
    fn contains(&self, text: &str) -> bool {
        String::from_utf8_lossy(&self.0.lock().unwrap()).contains(text)
    }
}

impl std::io::Write for Logs {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Logs {
    type Writer = Logs;
    fn make_writer(&'a self) -> Logs {
        self.clone()
    }
}

async fn wait_for(what: &str, timeout: Duration, mut ok: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !ok().await {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn file_source_reloads_changed_files_and_keeps_serving_on_garbage() {
    // The poller runs on this (current-thread) runtime, so a thread-local subscriber sees it.
    let logs = Logs::default();
    let _guard = tracing::subscriber::set_default(
        tracing_subscriber::fmt()
            .with_ansi(false)
            .with_writer(logs.clone())
            .finish(),
    );
    let dir = tempfile::tempdir().expect("tempdir");
    let (cert_path, key_path) = (dir.path().join("tls.crt"), dir.path().join("tls.key"));
    let first = issue_for(&sans(), Duration::from_secs(3600)).unwrap();
    std::fs::write(&cert_path, &first.cert_pem).unwrap();
    std::fs::write(&key_path, &first.key_pem).unwrap();
    let mut config = FileCertConfig::new(&cert_path, &key_path);
    config.poll_interval = Duration::from_millis(50);
    let serving = certs::start(CertSource::Files(config))
        .await
        .expect("start from files");
    assert_eq!(serving.resolver.leaf_der(), Some(der(&first.cert_pem)));

    // Garbage in the files: the poller reads it, refuses it, and the old certificate stays.
    // Waiting for its warning proves the poller ran over the garbage (a sleep would pass with
    // a poller that never ran).
    std::fs::write(&cert_path, "not a certificate").unwrap();
    let warned = logs.clone();
    wait_for(
        "the poller's warning that the changed files are not usable",
        Duration::from_secs(10),
        async || warned.contains("the changed webhook certificate files are not usable"),
    )
    .await;
    assert_eq!(serving.resolver.leaf_der(), Some(der(&first.cert_pem)));

    // A new certificate (cert-manager renewed it): served without a restart.
    let second = issue_for(&sans(), Duration::from_secs(3600)).unwrap();
    std::fs::write(&key_path, &second.key_pem).unwrap();
    std::fs::write(&cert_path, &second.cert_pem).unwrap();
    let resolver = serving.resolver.clone();
    wait_for(
        "the renewed certificate",
        Duration::from_secs(5),
        async || resolver.leaf_der() == Some(der(&second.cert_pem)),
    )
    .await;
    serving.task.abort();

    // Missing files: the webhook cannot start, and says which file.
    let err = certs::start(CertSource::Files(FileCertConfig::new(
        dir.path().join("nope.crt"),
        &key_path,
    )))
    .await
    .err()
    .expect("must fail");
    assert!(
        matches!(&err, CertError::File { path, .. } if path.ends_with("nope.crt")),
        "{err}"
    );
}

fn vwc_yaml(name: &str) -> String {
    // Matches a group no one serves, and only in a namespace that does not exist: inert.
    format!(
        r#"apiVersion: admissionregistration.k8s.io/v1
kind: ValidatingWebhookConfiguration
metadata:
  name: {name}
webhooks:
{hooks}"#,
        hooks = ["one", "two"]
            .iter()
            .map(|h| format!(
                r#"  - name: {h}.certs-test.settle.dev
    admissionReviewVersions: ["v1"]
    sideEffects: None
    failurePolicy: Ignore
    namespaceSelector:
      matchLabels: {{settle-certs-test: "{name}"}}
    rules:
      - apiGroups: ["certs-test.settle.dev"]
        apiVersions: ["v1"]
        operations: ["CREATE"]
        resources: ["nothings"]
    clientConfig:
      url: https://127.0.0.1:1/validate
"#
            ))
            .collect::<String>()
    )
}

async fn ca_bundles(client: &kube::Client, name: &str) -> Vec<String> {
    let vwc = Api::<ValidatingWebhookConfiguration>::all(client.clone())
        .get(name)
        .await
        .expect("get VWC");
    bundles(
        vwc.webhooks
            .unwrap_or_default()
            .into_iter()
            .map(|w| w.client_config),
    )
}

async fn mutating_ca_bundles(client: &kube::Client, name: &str) -> Vec<String> {
    let mwc = Api::<MutatingWebhookConfiguration>::all(client.clone())
        .get(name)
        .await
        .expect("get MWC");
    bundles(
        mwc.webhooks
            .unwrap_or_default()
            .into_iter()
            .map(|w| w.client_config),
    )
}

/// Each webhook's caBundle, as text.
fn bundles(configs: impl Iterator<Item = WebhookClientConfig>) -> Vec<String> {
    configs
        .map(|c| String::from_utf8(c.ca_bundle.map(|b| b.0).unwrap_or_default()).expect("utf-8"))
        .collect()
}

async fn stored(client: &kube::Client, ns: &str, name: &str) -> Secret {
    Api::<Secret>::namespaced(client.clone(), ns)
        .get(name)
        .await
        .expect("get Secret")
}

fn key(secret: &Secret, k: &str) -> String {
    String::from_utf8(
        secret
            .data
            .as_ref()
            .and_then(|d| d.get(k))
            .map(|b| b.0.clone())
            .unwrap_or_default(),
    )
    .expect("utf-8")
}

#[tokio::test]
async fn self_managed_creates_reuses_rotates_and_patches_ca_bundle() {
    let ns = common::namespace("webhook-certs");
    let vwc_name = ns.clone();
    common::kubectl_ok(&["apply", "-f", "-"], Some(&vwc_yaml(&vwc_name)));
    // And a MutatingWebhookConfiguration of the same name: patched alike.
    let mwc = vwc_yaml(&vwc_name).replace(
        "kind: ValidatingWebhookConfiguration",
        "kind: MutatingWebhookConfiguration",
    );
    common::kubectl_ok(&["apply", "-f", "-"], Some(&mwc));
    let client = common::kube_client().await;

    let mut config = SelfManagedConfig::new(&ns, "settle-webhook-tls", sans());
    config.webhook_configuration = Some(vwc_name.clone());
    config.validity = Duration::from_secs(3600);

    // First start: created, stored under the three keys, caBundle patched on the two webhooks of
    // each configuration.
    let (created, outcome, previous) = ensure_secret(&client, &config).await.expect("ensure");
    assert_eq!(
        (outcome, previous.as_deref()),
        (SecretOutcome::Created, None)
    );
    let secret = stored(&client, &ns, "settle-webhook-tls").await;
    assert_eq!(secret.type_.as_deref(), Some("kubernetes.io/tls"));
    assert_eq!(
        (
            key(&secret, "ca.crt"),
            key(&secret, "tls.crt"),
            key(&secret, "tls.key")
        ),
        (
            created.ca_pem.clone(),
            created.cert_pem.clone(),
            created.key_pem.clone()
        )
    );
    assert_eq!(
        patch_ca_bundle(&client, &vwc_name, &created.ca_pem, None)
            .await
            .expect("patch"),
        4
    );
    assert_eq!(
        ca_bundles(&client, &vwc_name).await,
        vec![created.ca_pem.clone(), created.ca_pem.clone()]
    );
    assert_eq!(
        mutating_ca_bundles(&client, &vwc_name).await,
        vec![created.ca_pem.clone(), created.ca_pem.clone()]
    );
    // Nothing to patch the second time.
    assert_eq!(
        patch_ca_bundle(&client, &vwc_name, &created.ca_pem, None)
            .await
            .expect("patch"),
        0
    );

    // Second start (a restart): the same certificate is served and nothing is rewritten.
    let rv = secret.metadata.resource_version.clone();
    let serving = certs::start(CertSource::SelfManaged {
        client: client.clone(),
        config: config.clone(),
    })
    .await
    .expect("start");
    assert_eq!(serving.resolver.leaf_der(), Some(der(&created.cert_pem)));
    assert_eq!(
        stored(&client, &ns, "settle-webhook-tls")
            .await
            .metadata
            .resource_version,
        rv
    );
    serving.task.abort();

    // Near expiry: rotated to a new CA, and caBundle trusts both while the old one lives.
    let old = aged(Duration::from_secs(10 * 60));
    let mut near = stored(&client, &ns, "settle-webhook-tls").await;
    near.data = Some(
        [
            ("ca.crt", &old.ca_pem),
            ("tls.crt", &old.cert_pem),
            ("tls.key", &old.key_pem),
        ]
        .into_iter()
        .map(|(k, v)| {
            (
                k.to_string(),
                k8s_openapi::ByteString(v.clone().into_bytes()),
            )
        })
        .collect(),
    );
    Api::<Secret>::namespaced(client.clone(), &ns)
        .replace("settle-webhook-tls", &PostParams::default(), &near)
        .await
        .expect("age the Secret");
    let (rotated, outcome, previous) = ensure_secret(&client, &config).await.expect("ensure");
    assert_eq!(outcome, SecretOutcome::Rotated);
    assert_eq!(previous.as_deref(), Some(old.ca_pem.as_str()));
    assert_ne!(rotated.ca_pem, old.ca_pem);
    assert_eq!(
        key(&stored(&client, &ns, "settle-webhook-tls").await, "tls.crt"),
        rotated.cert_pem
    );
    assert_eq!(
        patch_ca_bundle(&client, &vwc_name, &rotated.ca_pem, previous.as_deref())
            .await
            .expect("patch"),
        4
    );
    let mut bundles = ca_bundles(&client, &vwc_name).await;
    bundles.extend(mutating_ca_bundles(&client, &vwc_name).await);
    assert_eq!(bundles.len(), 4, "every webhook carries a caBundle");
    for bundle in bundles {
        assert_eq!(bundle, format!("{}{}", rotated.ca_pem, old.ca_pem));
    }

    // The SANs change (the Service moved): rotated.
    let mut moved = config.clone();
    moved
        .sans
        .dns_names
        .push("settle-webhook.elsewhere.svc".into());
    let (_, outcome, _) = ensure_secret(&client, &moved).await.expect("ensure");
    assert_eq!(outcome, SecretOutcome::Rotated);

    // A Secret Settle did not make is never overwritten.
    common::kubectl_ok(
        &[
            "-n",
            &ns,
            "create",
            "secret",
            "generic",
            "someone-elses",
            "--from-literal=tls.crt=theirs",
        ],
        None,
    );
    let foreign = SelfManagedConfig::new(&ns, "someone-elses", sans());
    let err = ensure_secret(&client, &foreign)
        .await
        .expect_err("foreign Secret");
    assert!(matches!(err, CertError::ForeignSecret { .. }), "{err}");
    assert_eq!(
        key(&stored(&client, &ns, "someone-elses").await, "tls.crt"),
        "theirs"
    );

    // The background task: when the stored bundle nears expiry, it rotates, patches caBundle and
    // swaps the served certificate, without a restart.
    let mut fast = moved.clone();
    fast.check_interval = Duration::from_secs(1);
    let serving = certs::start(CertSource::SelfManaged {
        client: client.clone(),
        config: fast.clone(),
    })
    .await
    .expect("start");
    let first_leaf = serving.resolver.leaf_der();
    let old = aged(Duration::from_secs(5 * 60));
    let mut near = stored(&client, &ns, "settle-webhook-tls").await;
    near.data = Some(
        [
            ("ca.crt", &old.ca_pem),
            ("tls.crt", &old.cert_pem),
            ("tls.key", &old.key_pem),
        ]
        .into_iter()
        .map(|(k, v)| {
            (
                k.to_string(),
                k8s_openapi::ByteString(v.clone().into_bytes()),
            )
        })
        .collect(),
    );
    Api::<Secret>::namespaced(client.clone(), &ns)
        .replace("settle-webhook-tls", &PostParams::default(), &near)
        .await
        .expect("age the Secret");
    let resolver = serving.resolver.clone();
    let (c, n) = (client.clone(), ns.clone());
    wait_for(
        "the background rotation",
        Duration::from_secs(20),
        async || {
            let now_stored = key(&stored(&c, &n, "settle-webhook-tls").await, "tls.crt");
            now_stored != old.cert_pem
                && resolver.leaf_der().is_some_and(|l| l == der(&now_stored))
                && resolver.leaf_der() != first_leaf
        },
    )
    .await;
    let current_ca = key(&stored(&client, &ns, "settle-webhook-tls").await, "ca.crt");
    let bundles = ca_bundles(&client, &vwc_name).await;
    assert_eq!(bundles.len(), 2, "both webhooks carry a caBundle");
    assert!(
        bundles.iter().all(|b| b.starts_with(&current_ca)),
        "every caBundle trusts the rotated CA first: {bundles:?}"
    );
    serving.task.abort();

    let _ = Api::<ValidatingWebhookConfiguration>::all(client.clone())
        .delete(&vwc_name, &DeleteParams::default())
        .await;
    let _ = Api::<MutatingWebhookConfiguration>::all(client.clone())
        .delete(&vwc_name, &DeleteParams::default())
        .await;
    common::kubectl_ok(&["delete", "namespace", &ns, "--wait=false"], None);
}
