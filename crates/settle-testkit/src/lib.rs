//! Shared by the integration tests: finds the environment `hack/env.sh up` started (real
//! kube-apiserver + etcd, nats-server, RabbitMQ, ElasticMQ) and runs real `kubectl` against it;
//! a free port, one plain HTTP GET on a local port, and the example binaries beside the test.
//!
//! Tests that need the environment fail (never skip) with a message saying how to start it.
#![allow(dead_code)]

pub mod account;
pub mod adopt;
pub mod bus;
pub mod chaos;
pub mod controlplane;
pub mod image;
pub mod install;
pub mod measure;
pub mod nack;
pub mod nats_cluster;
pub mod node;
pub mod operator;
pub mod partition;
pub mod pause;
pub mod process;
pub mod rabbit_scene;
pub mod rabbitmq;
pub mod rabbitmq_server;
pub mod scenes;
pub mod sqs;
pub mod subs;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Output;

/// Where the environment is.
#[derive(Clone, Debug)]
pub struct Env {
    pub kubeconfig: PathBuf,
    pub nats_url: String,
    pub nats_server: PathBuf,
    pub helm: PathBuf,
    /// `amqp://guest:guest@127.0.0.1:<port>/%2f`: RabbitMQ's AMQP 0-9-1 listener, default vhost.
    pub rabbitmq_url: String,
    /// `http://127.0.0.1:<port>`: RabbitMQ's management API (user guest, password guest).
    pub rabbitmq_management_url: String,
    /// `http://127.0.0.1:<port>`: ElasticMQ's SQS endpoint (any region and credentials).
    pub sqs_endpoint: String,
}

/// The repository's root (this crate is `crates/settle-testkit`): where `crds/`, `charts/`,
/// `hack/` and `target/` are.
pub fn root() -> PathBuf {
    let kit = Path::new(env!("CARGO_MANIFEST_DIR"));
    kit.parent()
        .and_then(Path::parent)
        .expect("crates/settle-testkit sits two levels under the root")
        .to_path_buf()
}

/// `target/<profile>` of the running test or bench (`target/<profile>/deps/<test>-<hash>`).
fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test path");
    exe.parent()
        .and_then(|deps| deps.parent())
        .expect("target/<profile>")
        .to_path_buf()
}

/// The example binary `cargo test` built beside the running test.
pub fn example(name: &str) -> std::path::PathBuf {
    profile_dir().join("examples").join(name)
}

/// A binary of the workspace (`settle`, `kubectl-settle`) of the running test's build. A suite
/// in the binary's own crate has it built by cargo; any other is run after a build of the whole
/// workspace (`make test`, or `cargo test --workspace`), and is told so when it is missing.
pub fn bin(name: &str) -> PathBuf {
    let path = profile_dir().join(name);
    assert!(
        path.exists(),
        "{} is not built: run `cargo build --workspace` (or `make test`) first",
        path.display()
    );
    path
}

/// `--tls` arguments for a nats-server a test starts: a CA of its own and a certificate for
/// `ip`, written into `dir`; returns the CA (PEM) and the arguments.
pub fn nats_tls_files(dir: &Path, ip: &str) -> (String, Vec<String>) {
    let bundle = settle_operator::admission::certs::issue_for(
        &settle_operator::admission::certs::Sans {
            dns_names: vec![],
            ip_addresses: vec![ip.parse().expect("an IP address")],
        },
        std::time::Duration::from_secs(3600),
    )
    .expect("issue a certificate");
    let (cert, key) = (dir.join("server.crt"), dir.join("server.key"));
    std::fs::write(&cert, &bundle.cert_pem).expect("write server.crt");
    std::fs::write(&key, &bundle.key_pem).expect("write server.key");
    let path = |p: &Path| p.to_str().expect("utf-8 path").to_string();
    (
        bundle.ca_pem,
        vec![
            "--tls".into(),
            "--tlscert".into(),
            path(&cert),
            "--tlskey".into(),
            path(&key),
        ],
    )
}

/// A TCP port on 127.0.0.1 that was free a moment ago, for a process a test starts. Someone
/// else can take it before that process binds it; the environment's own servers never trust a
/// chosen port (README, Ports), and a test that starts its own server fails loudly if it is taken.
pub fn free_port() -> u16 {
    // A port is free once its listener is dropped, so two calls in a row may be handed the same
    // one (seen: an operator's webhook and metrics ports both 38771, the second bind refused).
    // No port is handed out twice in one process.
    let listener = listen();
    listener.local_addr().expect("a bound address").port()
}

/// A listener on 127.0.0.1 whose port this process never handed out before, neither here nor by
/// [`free_port`]. A listener bound to port 0 can be given a port an earlier `free_port` handed out
/// and dropped; whatever the test meant for that port (a webhook, a metrics endpoint) then reaches
/// this listener instead (seen: a trap recording another test's connections).
pub fn listen() -> std::net::TcpListener {
    static GIVEN: std::sync::Mutex<std::collections::BTreeSet<u16>> =
        std::sync::Mutex::new(std::collections::BTreeSet::new());
    loop {
        let listener =
            std::net::TcpListener::bind("127.0.0.1:0").expect("bind a free port on 127.0.0.1");
        let port = listener.local_addr().expect("a bound address").port();
        let mut given = GIVEN
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if given.insert(port) {
            return listener;
        }
    }
}

/// One `GET path` (HTTP/1.1, `Connection: close`) on 127.0.0.1:`port`, waiting at most 5 s for
/// the answer: all of it (status line, headers, body), or `None` while nothing answers.
pub fn http_get(port: u16, path: &str) -> Option<String> {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(std::time::Duration::from_secs(5)))
        .ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut out = String::new();
    std::io::Read::read_to_string(&mut s, &mut out).ok()?;
    Some(out)
}

/// The environment's variable `key`, from the process environment (`source
/// target/env/settle.env`; `make test` exports it) or, failing that, from
/// `$SETTLE_ENV_DIR/settle.env` (default `target/env`); `None` where neither has it. Also the
/// file it looked in.
pub fn setting(key: &str) -> (Option<String>, PathBuf) {
    let dir = std::env::var_os("SETTLE_ENV_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join("target/env"));
    let file = dir.join("settle.env");
    if let Ok(v) = std::env::var(key) {
        return (Some(v), file);
    }
    let from_file = std::fs::read_to_string(&file).unwrap_or_default();
    let found = from_file
        .lines()
        .filter_map(|l| l.strip_prefix("export "))
        .filter_map(|l| l.split_once('='))
        .find(|(k, _)| *k == key)
        .map(|(_, v)| v.to_string());
    (found, file)
}

/// The API server this process's tests and campaigns use instead of the environment's, once
/// [`use_kubeconfig`] named one.
static KUBECONFIG_OVERRIDE: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();

/// From now on every API server this process reaches ([`env`]'s `kubeconfig`: kubectl, kube
/// clients, operators started) is the one `kubeconfig` names: a fault campaign on a control
/// plane of its own, which it may restart. Once per process; panics if another was named.
pub fn use_kubeconfig(kubeconfig: PathBuf) {
    let set = KUBECONFIG_OVERRIDE.get_or_init(|| kubeconfig.clone());
    assert_eq!(
        set,
        &kubeconfig,
        "this process already uses the API server of {}",
        set.display()
    );
}

/// The environment (see [`setting`]).
pub fn env() -> Env {
    let get = |key: &str| -> String {
        match setting(key) {
            (Some(v), _) => v,
            (None, file) => panic!(
                "{key} is not set and {} does not define it: start the environment with `make env-up` (or run `make test`)",
                file.display()
            ),
        }
    };
    Env {
        kubeconfig: KUBECONFIG_OVERRIDE
            .get()
            .cloned()
            .unwrap_or_else(|| PathBuf::from(get("KUBECONFIG"))),
        nats_url: get("SETTLE_NATS_URL"),
        nats_server: PathBuf::from(get("SETTLE_NATS_SERVER")),
        helm: PathBuf::from(get("SETTLE_HELM")),
        rabbitmq_url: get("SETTLE_RABBITMQ_URL"),
        rabbitmq_management_url: get("SETTLE_RABBITMQ_MANAGEMENT_URL"),
        sqs_endpoint: get("SETTLE_SQS_ENDPOINT"),
    }
}

/// Runs real kubectl against the environment's API server, with `stdin` piped in if given.
pub fn kubectl(args: &[&str], stdin: Option<&str>) -> Output {
    controlplane::kubectl_at(&env().kubeconfig, args, stdin)
}

/// kubectl that must succeed; returns stdout.
pub fn kubectl_ok(args: &[&str], stdin: Option<&str>) -> String {
    controlplane::kubectl_ok_at(&env().kubeconfig, args, stdin)
}

/// A ValidatingWebhookConfiguration `configuration` (fails closed) for the Subscriptions of the
/// namespaces labelled `label=value`, at an operator's webhook on 127.0.0.1:`port` (port 1:
/// nowhere yet). An operator started with `--webhook-configuration <configuration>` writes its CA
/// into `caBundle`.
pub fn register_subscription_webhook(configuration: &str, label: &str, value: &str, port: u16) {
    let vwc = format!(
        "apiVersion: admissionregistration.k8s.io/v1\nkind: ValidatingWebhookConfiguration\nmetadata: {{name: {configuration}}}\nwebhooks:\n\
         - name: subscriptions.messaging.settle.dev\n  admissionReviewVersions: [v1]\n  sideEffects: None\n  failurePolicy: Fail\n  timeoutSeconds: 10\n\
         \x20 namespaceSelector: {{matchLabels: {{{label}: \"{value}\"}}}}\n\
         \x20 rules: [{{apiGroups: [messaging.settle.dev], apiVersions: [v1alpha1], operations: [CREATE, UPDATE], resources: [subscriptions]}}]\n\
         \x20 clientConfig: {{url: \"https://127.0.0.1:{port}/validate\"}}\n"
    );
    kubectl_ok(&["apply", "-f", "-"], Some(&vwc));
}

/// A kube client for the environment's API server.
pub async fn kube_client() -> kube::Client {
    let kubeconfig =
        kube::config::Kubeconfig::read_from(&env().kubeconfig).expect("read kubeconfig");
    kube_client_of(kubeconfig).await
}

/// A kube client for the API server `kubeconfig` names (its current context).
pub async fn kube_client_of(kubeconfig: kube::config::Kubeconfig) -> kube::Client {
    let config = kube::Config::from_custom_kubeconfig(
        kubeconfig,
        &kube::config::KubeConfigOptions::default(),
    )
    .await
    .expect("kubeconfig is valid");
    kube::Client::try_from(config).expect("client")
}

/// The environment's kubeconfig, acting as `user` (impersonated: `as`), written to
/// `target/kubeconfig-as-<tag>-<pid>.yaml` for a process to use.
pub fn kubeconfig_as(user: &str, tag: &str) -> PathBuf {
    let mut kubeconfig =
        kube::config::Kubeconfig::read_from(&env().kubeconfig).expect("read kubeconfig");
    for named in &mut kubeconfig.auth_infos {
        if let Some(auth) = named.auth_info.as_mut() {
            auth.impersonate = Some(user.to_string());
        }
    }
    let path = root().join(format!(
        "target/kubeconfig-as-{tag}-{}.yaml",
        std::process::id()
    ));
    let text = serde_yaml::to_string(&kubeconfig).expect("a kubeconfig serializes");
    std::fs::write(&path, text).expect("write the kubeconfig");
    path
}

/// Installs Settle's CRDs (idempotent) and waits until they are served.
pub fn install_crds() {
    let crds = root().join("crds/settle.yaml");
    kubectl_ok(
        &[
            "apply",
            "--server-side",
            "--force-conflicts",
            "-f",
            path_str(&crds),
        ],
        None,
    );
    wait_crds_established(|args| kubectl_ok(args, None));
}

/// Waits until Settle's CRDs are Established, asking with `kubectl` through `get`. Polled, not
/// `kubectl wait --for=condition`: that fails at once ("accessor error: <nil> is of the type
/// <nil>") on a CRD created a moment ago whose conditions are still null.
pub fn wait_crds_established(get: impl Fn(&[&str]) -> String) {
    for crd in [
        "crd/backends.messaging.settle.dev",
        "crd/subscriptions.messaging.settle.dev",
    ] {
        process::poll_until(
            &format!("{crd} Established"),
            std::time::Duration::from_secs(60),
            || {
                get(&[
                    "get",
                    crd,
                    "-o",
                    "jsonpath={.status.conditions[?(@.type==\"Established\")].status}",
                ])
                .trim()
                    == "True"
            },
        );
    }
}

/// A fresh namespace for one test, so tests can share the API server.
pub fn namespace(name: &str) -> String {
    let ns = format!("{name}-{}", std::process::id());
    kubectl_ok(&["create", "namespace", &ns], None);
    ns
}

pub fn path_str(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

/// The label a Secret must carry before a Backend may use it (docs/semantics.md A18).
pub const BACKEND_SECRET_LABEL: &str = "settle.dev/backend-credentials=true";

/// Opts Secret `namespace/name` in for Backends: labels it `settle.dev/backend-credentials=true`.
pub fn label_backend_secret(namespace: &str, name: &str) {
    kubectl_ok(
        &[
            "label",
            "secret",
            name,
            "-n",
            namespace,
            BACKEND_SECRET_LABEL,
            "--overwrite",
        ],
        None,
    );
}
