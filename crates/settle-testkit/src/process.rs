//! Processes a test starts and waits for: each is killed (and reaped) when its guard drops, so a
//! failed assertion or a panic leaves nothing running; and every wait is a poll with a deadline
//! and a message saying what it waited for.

use std::process::{Child, Command};
use std::time::{Duration, Instant};

/// A spawned process, killed when dropped.
pub struct Killed {
    pub child: Child,
    what: String,
}

impl Killed {
    /// Spawns `cmd`; `what` names it in panics.
    pub fn spawn(what: &str, cmd: &mut Command) -> Killed {
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("start {what} ({cmd:?}): {e}"));
        Killed {
            child,
            what: what.to_string(),
        }
    }

    /// Fails the test, naming the process, if it has already exited.
    pub fn assert_running(&mut self) {
        if let Ok(Some(status)) = self.child.try_wait() {
            panic!("{} exited early: {status}", self.what);
        }
    }

    /// Kills it now and waits until it is gone.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Killed {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Sends `child` SIGTERM (`kill -TERM`), as Kubernetes stops a pod; it must be delivered.
pub fn sigterm(child: &Child) {
    signal(child, "TERM");
}

/// Sends `child` the signal `name` (`kill -<name>`: `TERM`, `STOP`, `CONT`); it must be
/// delivered.
pub fn signal(child: &Child, name: &str) {
    let status = Command::new("kill")
        .args([&format!("-{name}"), &child.id().to_string()])
        .status()
        .expect("run kill");
    assert!(status.success(), "kill -{name} {}", child.id());
}

/// Polls `ok` every 100 ms until it holds; panics with `what` after `limit`.
pub fn poll_until(what: &str, limit: Duration, mut ok: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !ok() {
        assert!(
            Instant::now() < deadline,
            "timed out after {limit:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The async twin of [`poll_until`].
pub async fn poll_until_async<F: std::future::Future<Output = bool>>(
    what: &str,
    limit: Duration,
    mut ok: impl FnMut() -> F,
) {
    let deadline = Instant::now() + limit;
    while !ok().await {
        assert!(
            Instant::now() < deadline,
            "timed out after {limit:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Takes off `cmd` the variables cargo sets for a test process (`CARGO_PKG_NAME`,
/// `CARGO_MANIFEST_DIR`, `OUT_DIR`, …), for a command that runs cargo itself (`hack/image.sh`,
/// `make demo`). Cargo compares the variables a build script watches with its own environment:
/// ring's (through the cc crate) watches these, so a cargo started from a test rebuilt ring and
/// every TLS crate above it, and the next ordinary build rebuilt them again.
pub fn without_cargo_test_env(cmd: &mut Command) -> &mut Command {
    for (name, _) in std::env::vars_os() {
        let Some(name) = name.to_str() else { continue };
        let set_by_cargo = name == "CARGO"
            || name == "OUT_DIR"
            || name == "CARGO_PRIMARY_PACKAGE"
            || name == "CARGO_TARGET_TMPDIR"
            || name == "CARGO_RUSTC_CURRENT_DIR"
            || [
                "CARGO_PKG_",
                "CARGO_MANIFEST_",
                "CARGO_CRATE_",
                "CARGO_BIN_",
                "CARGO_CFG_",
            ]
            .iter()
            .any(|p| name.starts_with(p));
        if set_by_cargo {
            cmd.env_remove(name);
        }
    }
    cmd
}
