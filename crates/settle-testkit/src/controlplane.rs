//! A control plane of a test's own: the pinned kube-apiserver + etcd that `hack/tools.sh` builds,
//! started empty on free 127.0.0.1 ports for a test that must not see what other tests created
//! (Settle's CRDs above all), and killed with its state removed when dropped.
//!
//! It must not be used where the shared environment would do: each one costs a few seconds and a
//! few hundred MiB.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use super::{free_port, root};

/// The cached binary of a pinned tool (`hack/tools.sh path NAME`); fails, naming the command
/// that builds it, when it is missing.
pub fn tool(name: &str) -> PathBuf {
    let out = Command::new(root().join("hack/tools.sh"))
        .args(["path", name])
        .output()
        .expect("run hack/tools.sh");
    assert!(
        out.status.success(),
        "hack/tools.sh path {name}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let path = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    assert!(
        path.is_file(),
        "{name} is not built at {}: run `hack/tools.sh build` (or `make tools`) with the same CARGO_TARGET_DIR",
        path.display()
    );
    path
}

/// [`kubectl_at`] that must succeed; returns stdout.
pub fn kubectl_ok_at(kubeconfig: &Path, args: &[&str], stdin: Option<&str>) -> String {
    let out = kubectl_at(kubeconfig, args, stdin);
    assert!(
        out.status.success(),
        "kubectl --kubeconfig {} {args:?} failed: {}{}",
        kubeconfig.display(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `kubectl get ARGS -o json` against the API server of `kubeconfig`, which must succeed.
pub fn get_json_at(kubeconfig: &Path, args: &[&str]) -> serde_json::Value {
    let mut all = args.to_vec();
    all.extend(["-o", "json"]);
    serde_json::from_str(&kubectl_ok_at(kubeconfig, &all, None)).expect("kubectl -o json")
}

/// Runs real kubectl against the API server of `kubeconfig`.
pub fn kubectl_at(kubeconfig: &Path, args: &[&str], stdin: Option<&str>) -> Output {
    use std::io::Write;
    let mut child = Command::new("kubectl")
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .args(args)
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("kubectl must be on PATH");
    if let Some(input) = stdin {
        child
            .stdin
            .take()
            .expect("stdin")
            .write_all(input.as_bytes())
            .expect("write stdin");
    }
    child.wait_with_output().expect("kubectl ran")
}

pub struct ControlPlane {
    child: Child,
    dir: PathBuf,
    /// The API server's, etcd's client and etcd's peer port.
    ports: [u16; 3],
    pub kubeconfig: PathBuf,
}

/// `settle-controlplane` on `dir` and `ports`, its output appended to `dir/controlplane.log`.
fn spawn(dir: &Path, ports: [u16; 3]) -> Child {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join("controlplane.log"))
        .expect("log file");
    Command::new(tool("controlplane"))
        .arg("-dir")
        .arg(dir)
        .args(["-apiserver-port", &ports[0].to_string()])
        .args(["-etcd-port", &ports[1].to_string()])
        .args(["-etcd-peer-port", &ports[2].to_string()])
        .stdin(Stdio::null())
        .stdout(log.try_clone().expect("log file"))
        .stderr(log)
        .spawn()
        .expect("start settle-controlplane")
}

impl ControlPlane {
    /// Starts an empty control plane and waits (up to 3 minutes on a loaded machine) until it
    /// serves the `default` namespace. `name` labels its state directory under target/.
    pub fn start(name: &str) -> ControlPlane {
        // A port picked here may be taken by someone else before the server binds it: try again
        // with new ports when that is why it exited.
        for attempt in 1..=3 {
            let dir = root().join(format!("target/{name}-cp-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).expect("create the control plane's directory");
            let ports = [free_port(), free_port(), free_port()];
            let mut cp = ControlPlane {
                child: spawn(&dir, ports),
                kubeconfig: dir.join("kubeconfig"),
                dir,
                ports,
            };
            match cp.wait_ready(Duration::from_secs(180)) {
                Ok(()) => return cp,
                Err(why) => {
                    let log = cp.log_text();
                    if attempt < 3 && log.contains("address already in use") {
                        continue; // dropped: killed and removed
                    }
                    cp.fail(&why);
                }
            }
        }
        unreachable!("the loop returns or panics")
    }

    /// SIGKILL: the API server and etcd stop at once, as a control plane node that crashed. Its
    /// state stays on disk for [`ControlPlane::start_again`].
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Started again on its state and ports (the same certificates, the same objects), once
    /// it serves again.
    pub fn start_again(&mut self) {
        self.child = spawn(&self.dir, self.ports);
        if let Err(why) = self.wait_ready(Duration::from_secs(180)) {
            self.fail(&why);
        }
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(self.dir.join("controlplane.log")).unwrap_or_default()
    }

    fn fail(&self, why: &str) -> ! {
        let log = self.log_text();
        let tail: Vec<&str> = log.lines().rev().take(30).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        panic!(
            "control plane in {} {why}; last lines of its log:\n{}",
            self.dir.display(),
            tail.join("\n")
        );
    }

    fn wait_ready(&mut self, limit: Duration) -> Result<(), String> {
        let deadline = Instant::now() + limit;
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(format!("exited ({status}) before it was ready"));
            }
            // The API server answers /readyz before its bootstrap objects exist: wait for `default`.
            if self.kubeconfig.is_file()
                && self
                    .kubectl(&["get", "--raw=/readyz"], None)
                    .status
                    .success()
                && self
                    .kubectl(&["get", "namespace", "default", "-o", "name"], None)
                    .status
                    .success()
            {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(format!("was not ready after {}s", limit.as_secs()));
            }
            std::thread::sleep(Duration::from_millis(500));
        }
    }

    pub fn kubectl(&self, args: &[&str], stdin: Option<&str>) -> Output {
        kubectl_at(&self.kubeconfig, args, stdin)
    }

    /// kubectl that must succeed; returns stdout.
    pub fn kubectl_ok(&self, args: &[&str], stdin: Option<&str>) -> String {
        kubectl_ok_at(&self.kubeconfig, args, stdin)
    }

    /// `kubectl get ARGS -o json`.
    pub fn get_json(&self, args: &[&str]) -> serde_json::Value {
        get_json_at(&self.kubeconfig, args)
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        // Keep the log of a failed test; otherwise leave nothing behind.
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}
