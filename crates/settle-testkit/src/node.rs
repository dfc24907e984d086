//! For the pod suite (`crates/settle-e2e/tests/pods.rs`): the real node `hack/env.sh up --node` runs (its own
//! kube-apiserver on the bridge address, a kubelet on containerd), found from `node.env`; the
//! images `hack/image.sh` builds, imported into the node's containerd; helm and kubectl on the
//! node's kubeconfig; nats-servers of the suite's own on the bridge address, where pods reach them.
//!
//! It never starts or stops the node, and never touches the shared (non-node) environment: every
//! command here names the node's kubeconfig.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use super::controlplane::{get_json_at, kubectl_at, kubectl_ok_at};
use super::install::{helm, helm_run};
use super::root;

/// The node, as `node.env` describes it.
#[derive(Clone, Debug)]
pub struct Node {
    /// Admin kubeconfig of the node's own API server (https://10.244.0.1:PORT).
    pub kubeconfig: PathBuf,
    /// The bridge address: the host as pods see it, where the suite's brokers listen.
    pub ip: String,
    pub name: String,
    /// A `ctr` binary and the node's containerd socket.
    pub ctr: PathBuf,
    pub containerd: PathBuf,
    /// The nats-server binary (`SETTLE_NATS_SERVER`).
    pub nats_server: PathBuf,
}

/// `key` from the process environment, else from `$SETTLE_ENV_DIR/settle.env` or `node.env`.
fn env_value(key: &str, files: &[String]) -> Option<String> {
    if let Ok(v) = std::env::var(key) {
        return Some(v).filter(|v| !v.is_empty());
    }
    files.iter().find_map(|text| {
        text.lines()
            .map(|l| l.trim().strip_prefix("export ").unwrap_or(l.trim()))
            .filter_map(|l| l.split_once('='))
            .find(|(k, _)| *k == key)
            .map(|(_, v)| v.trim_matches(['"', '\'']).to_string())
            .filter(|v| !v.is_empty())
    })
}

impl Node {
    /// The node from the environment; fails (never skips) with how to start it when it is not
    /// there.
    pub fn from_env() -> Node {
        let dir = std::env::var_os("SETTLE_ENV_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| root().join("target/env"));
        let files: Vec<String> = ["settle.env", "node.env"]
            .iter()
            .filter_map(|f| std::fs::read_to_string(dir.join(f)).ok())
            .collect();
        let get = |key: &str| -> String {
            env_value(key, &files).unwrap_or_else(|| {
                panic!(
                    "{key} is not set and neither {0}/settle.env nor {0}/node.env defines it: the pod suite needs the real node; \
                     start the environment with it (`hack/env.sh up --node`, which `make test` does) and `source {0}/settle.env`",
                    dir.display()
                )
            })
        };
        let node = Node {
            kubeconfig: PathBuf::from(get("SETTLE_NODE_KUBECONFIG")),
            ip: get("SETTLE_NODE_IP"),
            name: get("SETTLE_NODE_NAME"),
            ctr: PathBuf::from(get("SETTLE_NODE_CTR")),
            containerd: PathBuf::from(get("SETTLE_NODE_CONTAINERD")),
            nats_server: PathBuf::from(get("SETTLE_NATS_SERVER")),
        };
        assert!(
            node.kubeconfig.is_file(),
            "SETTLE_NODE_KUBECONFIG={} is not a file: is the node up (`hack/env.sh status`)?",
            node.kubeconfig.display()
        );
        node
    }

    pub fn kubectl(&self, args: &[&str], stdin: Option<&str>) -> Output {
        kubectl_at(&self.kubeconfig, args, stdin)
    }

    /// kubectl that must succeed; returns stdout.
    pub fn kubectl_ok(&self, args: &[&str], stdin: Option<&str>) -> String {
        kubectl_ok_at(&self.kubeconfig, args, stdin)
    }

    /// `kubectl get ARGS -o json`.
    pub fn get_json(&self, args: &[&str]) -> Value {
        get_json_at(&self.kubeconfig, args)
    }

    /// Applies `yaml` (kubectl apply -f -) in `ns`.
    pub fn apply(&self, ns: &str, yaml: &str) -> String {
        self.kubectl_ok(&["apply", "-n", ns, "-f", "-"], Some(yaml))
    }

    /// The pinned helm on the node's kubeconfig; must succeed.
    pub fn helm(&self, args: &[&str]) -> String {
        helm(Some(&self.kubeconfig), args)
    }

    /// The pinned helm on the node's kubeconfig, whatever it answers.
    pub fn helm_run(&self, args: &[&str]) -> Output {
        helm_run(Some(&self.kubeconfig), args)
    }

    /// A kube client for the node's API server.
    pub async fn client(&self) -> kube::Client {
        let kubeconfig = kube::config::Kubeconfig::read_from(&self.kubeconfig)
            .expect("read the node kubeconfig");
        let config = kube::Config::from_custom_kubeconfig(
            kubeconfig,
            &kube::config::KubeConfigOptions::default(),
        )
        .await
        .expect("the node kubeconfig is valid");
        kube::Client::try_from(config).expect("client")
    }

    fn ctr(&self, args: &[&str]) -> Output {
        Command::new(&self.ctr)
            .arg("--address")
            .arg(&self.containerd)
            .args(["-n", "k8s.io"])
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("run {}: {e}", self.ctr.display()))
    }

    fn ctr_ok(&self, args: &[&str]) -> String {
        let out = self.ctr(args);
        assert!(
            out.status.success(),
            "ctr {args:?} failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Imports an OCI archive into the node's containerd (namespace k8s.io, where the kubelet
    /// looks); importing the same archive again changes nothing.
    pub fn import_image(&self, archive: &Path) {
        assert!(
            archive.is_file(),
            "no image archive at {}: build it with `make image`",
            archive.display()
        );
        self.ctr_ok(&["images", "import", super::path_str(archive)]);
    }

    /// Whether the node's containerd has image `reference`.
    pub fn has_image(&self, reference: &str) -> bool {
        self.ctr_ok(&["images", "ls", "-q"])
            .lines()
            .any(|l| l.trim() == reference)
    }

    /// Gives image `from` a second name `to` on the node (same digest): a new tag for an upgrade.
    pub fn tag_image(&self, from: &str, to: &str) {
        if self.has_image(to) {
            let _ = self.ctr(&["images", "rm", to]);
        }
        self.ctr_ok(&["images", "tag", from, to]);
    }

    /// Removes image `reference` from the node, if it is there.
    pub fn remove_image(&self, reference: &str) {
        if self.has_image(reference) {
            let _ = self.ctr(&["images", "rm", reference]);
        }
    }

    /// Waits until Deployment `ns/name` has rolled out (`kubectl rollout status`).
    pub fn wait_rollout(&self, ns: &str, name: &str, limit: Duration) {
        let timeout = format!("--timeout={}s", limit.as_secs());
        self.kubectl_ok(
            &[
                "rollout",
                "status",
                &format!("deployment/{name}"),
                "-n",
                ns,
                &timeout,
            ],
            None,
        );
    }

    /// `kubectl get pods -o wide` in `ns`, as printed.
    pub fn pods_wide(&self, ns: &str) -> String {
        self.kubectl_ok(&["get", "pods", "-n", ns, "-o", "wide"], None)
    }

    /// Deletes namespace `ns` and waits until it is gone. Subscriptions the operator can no longer
    /// release (it is not running) have their finalizer taken off by hand after `grace`.
    /// Deletes namespace `ns` and waits until it is gone, within `limit`, taking nothing off by
    /// hand: whatever holds it (a finalizer) fails the test.
    pub fn delete_namespace_unaided(&self, ns: &str, limit: Duration) {
        self.kubectl_ok(&["delete", "namespace", ns, "--wait=false"], None);
        let start = Instant::now();
        while self
            .kubectl(&["get", "namespace", ns], None)
            .status
            .success()
        {
            assert!(
                start.elapsed() < limit,
                "namespace {ns} still exists {:?} after its deletion: {}",
                start.elapsed(),
                self.kubectl_ok(
                    &["get", "subscriptions,backends", "-n", ns, "-o", "yaml"],
                    None
                )
            );
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    pub fn delete_namespace(&self, ns: &str, grace: Duration) {
        if !self
            .kubectl(&["get", "namespace", ns], None)
            .status
            .success()
        {
            return;
        }
        let _ = self.kubectl(&["delete", "namespace", ns, "--wait=false"], None);
        let start = Instant::now();
        let mut stripped = false;
        while self
            .kubectl(&["get", "namespace", ns], None)
            .status
            .success()
        {
            if !stripped && start.elapsed() > grace {
                self.strip_finalizers(ns);
                stripped = true;
            }
            assert!(
                start.elapsed() < grace + Duration::from_secs(120),
                "namespace {ns} still exists {:?} after its deletion",
                start.elapsed()
            );
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// Takes the finalizers off every Subscription in `ns` (what was on the broker stays).
    pub fn strip_finalizers(&self, ns: &str) {
        let out = self.kubectl(&["get", "subscriptions", "-n", ns, "-o", "name"], None);
        for name in String::from_utf8_lossy(&out.stdout).lines() {
            let _ = self.kubectl(&super::subs::no_finalizers(name, ns), None);
        }
    }
}

/// The image reference an OCI archive names (its index's `io.containerd.image.name`).
pub fn archive_reference(archive: &Path) -> String {
    let out = Command::new("tar")
        .arg("-xOf")
        .arg(archive)
        .arg("index.json")
        .output()
        .expect("run tar");
    assert!(
        out.status.success(),
        "{} holds no index.json: {}",
        archive.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let index: Value = serde_json::from_slice(&out.stdout).expect("index.json is JSON");
    index["manifests"]
        .as_array()
        .into_iter()
        .flatten()
        .find_map(|m| m["annotations"]["io.containerd.image.name"].as_str())
        .unwrap_or_else(|| {
            panic!(
                "{}: no io.containerd.image.name in {index}",
                archive.display()
            )
        })
        .to_string()
}

/// A nats-server of the suite's own with JetStream, listening on the node's bridge address (where
/// pods reach it) on a free port; killed when dropped.
pub struct BridgeNats {
    child: Child,
    pub ip: String,
    pub port: u16,
    _store: tempfile::TempDir,
    pub log: PathBuf,
}

impl BridgeNats {
    /// Starts it with `extra` arguments (e.g. `--tls ...`); a port taken before the server bound
    /// it is tried again with another.
    pub fn start(node: &Node, what: &str, extra: &[&str]) -> BridgeNats {
        for attempt in 1..=3 {
            let port = std::net::TcpListener::bind((node.ip.as_str(), 0))
                .and_then(|l| l.local_addr())
                .unwrap_or_else(|e| panic!("bind a free port on {}: {e}", node.ip))
                .port();
            let store = tempfile::tempdir().expect("store dir");
            let log = root().join(format!(
                "target/pods-nats-{what}-{}.log",
                std::process::id()
            ));
            let _ = std::fs::create_dir_all(root().join("target"));
            let file = std::fs::File::create(&log).expect("nats-server log");
            let mut child = Command::new(&node.nats_server)
                .args(["-a", &node.ip, "-p", &port.to_string(), "-js", "-sd"])
                .arg(store.path())
                .args(extra)
                .stdin(Stdio::null())
                .stdout(file.try_clone().expect("log"))
                .stderr(file)
                .spawn()
                .unwrap_or_else(|e| panic!("start {}: {e}", node.nats_server.display()));
            let deadline = Instant::now() + Duration::from_secs(20);
            loop {
                if let Ok(Some(status)) = child.try_wait() {
                    let text = std::fs::read_to_string(&log).unwrap_or_default();
                    if attempt < 3 && text.contains("address already in use") {
                        break;
                    }
                    panic!("nats-server ({what}) exited ({status}): {text}");
                }
                if std::net::TcpStream::connect((node.ip.as_str(), port)).is_ok() {
                    return BridgeNats {
                        child,
                        ip: node.ip.clone(),
                        port,
                        _store: store,
                        log,
                    };
                }
                assert!(
                    Instant::now() < deadline,
                    "nats-server ({what}) on {}:{port} did not listen within 20s",
                    node.ip
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        unreachable!("the loop returns or panics")
    }

    pub fn url(&self) -> String {
        format!("nats://{}:{}", self.ip, self.port)
    }
}

impl Drop for BridgeNats {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `kubectl logs -f` of one pod, collected until the pod's container ends (or this is dropped).
pub struct LogFollower {
    child: Child,
    lines: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
    reader: Option<std::thread::JoinHandle<()>>,
}

impl LogFollower {
    pub fn start(node: &Node, ns: &str, pod: &str) -> LogFollower {
        use std::io::BufRead;
        let mut child = Command::new("kubectl")
            .arg("--kubeconfig")
            .arg(&node.kubeconfig)
            .args(["logs", "-f", "-n", ns, pod])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("kubectl logs -f");
        let out = child.stdout.take().expect("stdout");
        let lines = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let sink = lines.clone();
        let reader = std::thread::spawn(move || {
            for l in std::io::BufReader::new(out).lines().map_while(Result::ok) {
                sink.lock().expect("lines").push(l);
            }
        });
        LogFollower {
            child,
            lines,
            reader: Some(reader),
        }
    }

    /// Waits (up to `limit`) until the log stream ends, then returns every line.
    pub fn finish(mut self, limit: Duration) -> Vec<String> {
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
        self.lines.lock().expect("lines").clone()
    }
}

impl Drop for LogFollower {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
