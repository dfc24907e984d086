//! NATS's own controller, NACK, for the migration test: its CRDs installed in the environment's
//! API server, and its `jetstream-controller` (built by `hack/tools.sh build nack` from the
//! module pinned in `tests/nack/go.mod`) run against one namespace, killed when dropped.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::controlplane::tool;
use super::{env, kubectl_ok, path_str, process, root};

/// Installs NACK's CRDs (`jetstream.nats.io`: Stream, Consumer, Account, ...) and waits until
/// they are Established.
pub fn install_nack_crds() {
    let crds = tool("nack-crds");
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
    for crd in ["streams", "consumers", "accounts"] {
        let crd = format!("crd/{crd}.jetstream.nats.io");
        process::poll_until(
            &format!("{crd} Established"),
            Duration::from_secs(60),
            || {
                kubectl_ok(
                    &[
                        "get",
                        &crd,
                        "-o",
                        "jsonpath={.status.conditions[?(@.type==\"Established\")].status}",
                    ],
                    None,
                ) == "True"
            },
        );
    }
}

/// NACK's controller, reconciling namespace `ns`, connecting as each resource's `servers` say
/// (`--crd-connect`).
pub struct Nack {
    child: Option<Child>,
    pub log: std::path::PathBuf,
}

impl Nack {
    pub fn start(test: &str, ns: &str) -> Nack {
        let bin = tool("nack");
        let log = root().join(format!("target/nack-{test}-{}.log", std::process::id()));
        let child = Command::new(&bin)
            .arg(format!("--kubeconfig={}", env().kubeconfig.display()))
            .arg(format!("--namespace={ns}"))
            .arg("--crd-connect")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("NACK's log"))
            .spawn()
            .unwrap_or_else(|e| panic!("run {}: {e}", bin.display()));
        Nack {
            child: Some(child),
            log,
        }
    }

    /// Stops the controller (SIGKILL: as a scaled-down Deployment leaves things, mid-work or not).
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Nack {
    fn drop(&mut self) {
        self.stop();
    }
}
