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
    let status = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .expect("run kill");
    assert!(status.success(), "kill -TERM {}", child.id());
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
