//! The test application (`examples/account_app.rs`) as a process: started with a handler and
//! environment, its stdout lines collected, its log kept beside the test's, killed when dropped.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::operator::poll;

/// The test application, killed when dropped; its stdout lines are collected, its log kept
/// beside the test's.
pub struct App {
    child: Child,
    lines: Arc<Mutex<Vec<String>>>,
    /// The thread collecting stdout: it ends at the pipe's end, once the process has exited.
    reader: Option<std::thread::JoinHandle<()>>,
    log: std::path::PathBuf,
    /// The file whose making lets `ack-when-released` handlers finish ([`App::release`]).
    release: std::path::PathBuf,
}

static APPS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// `clients/go/cmd/account-app`, built once per test process into `target/go/account-app`
/// (`go build` is incremental: a second build of an unchanged tree takes a moment).
pub fn go_account_app() -> std::path::PathBuf {
    static BUILT: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    BUILT
        .get_or_init(|| {
            let out = crate::root().join("target/go/account-app");
            let status = Command::new("go")
                .args(["build", "-o"])
                .arg(&out)
                .arg("./cmd/account-app")
                .current_dir(crate::root().join("clients/go"))
                .status()
                .unwrap_or_else(|e| panic!("run go build (is Go installed?): {e}"));
            assert!(
                status.success(),
                "go build ./cmd/account-app in clients/go failed"
            );
            out
        })
        .clone()
}

impl App {
    /// `account_app` with `handler`, reporting every 100 ms, and the variables `env`, which pick
    /// the broker (`SETTLE_NATS_URL`, `SETTLE_RABBITMQ_URL` or `SETTLE_SQS_ENDPOINT`: none is
    /// inherited).
    pub fn start(env: &[(&str, &str)], manifest: &std::path::Path, handler: &str) -> App {
        App::start_bin(&crate::example("account_app"), env, manifest, handler)
    }

    /// The Go runtime's twin of `account_app` (`clients/go/cmd/account-app`: the same
    /// environment and lines; NATS only), built on first use.
    pub fn start_go(env: &[(&str, &str)], manifest: &std::path::Path, handler: &str) -> App {
        App::start_bin(&go_account_app(), env, manifest, handler)
    }

    fn start_bin(
        bin: &std::path::Path,
        env: &[(&str, &str)],
        manifest: &std::path::Path,
        handler: &str,
    ) -> App {
        let log = crate::root().join(format!(
            "target/account-app-{}-{}.log",
            std::process::id(),
            APPS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ));
        let release = log.with_extension("release");
        let _ = std::fs::remove_file(&release);
        let mut child = Command::new(bin)
            .env_remove("SETTLE_NATS_URL")
            .env_remove("SETTLE_RABBITMQ_URL")
            .env_remove("SETTLE_SQS_ENDPOINT")
            .envs(env.iter().copied())
            .env("SETTLE_SUBSCRIPTION_FILE", manifest)
            .env("SETTLE_APP_HANDLER", handler)
            .env("SETTLE_APP_RELEASE_FILE", &release)
            .env("SETTLE_REPORT_INTERVAL", "100ms")
            .env("RUST_LOG", "info")
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).expect("the application's log"))
            .spawn()
            .unwrap_or_else(|e| panic!("run {}: {e}", bin.display()));
        let lines = Arc::new(Mutex::new(Vec::<String>::new()));
        let out = child.stdout.take().expect("stdout");
        let sink = lines.clone();
        let reader = std::thread::spawn(move || {
            for l in BufReader::new(out).lines().map_while(Result::ok) {
                sink.lock().expect("lines").push(l);
            }
        });
        App {
            child,
            lines,
            reader: Some(reader),
            log,
            release,
        }
    }

    /// Every line printed so far that starts with `prefix`.
    pub fn lines(&self, prefix: &str) -> Vec<String> {
        self.lines
            .lock()
            .expect("lines")
            .iter()
            .filter(|l| l.starts_with(prefix))
            .cloned()
            .collect()
    }

    pub fn count(&self, prefix: &str) -> usize {
        self.lines
            .lock()
            .expect("lines")
            .iter()
            .filter(|l| l.starts_with(prefix))
            .count()
    }

    /// Waits until at least `n` lines start with `prefix`.
    pub async fn wait_count(&self, prefix: &str, n: usize, limit: Duration) {
        poll(
            &format!(
                "the application to print {n} {prefix:?} line(s) (its log: {})",
                self.log.display()
            ),
            limit,
            || async {
                match self.count(prefix) {
                    c if c >= n => Ok(()),
                    c => Err(format!("{c} so far")),
                }
            },
        )
        .await;
    }

    /// Waits until the application's own log (the runtime's, on stderr) has a line holding
    /// `needle`; returns that line.
    pub async fn wait_log(&self, needle: &str, limit: Duration) -> String {
        poll(
            &format!(
                "the application to log {needle:?} (its log: {})",
                self.log.display()
            ),
            limit,
            || async {
                let text = std::fs::read_to_string(&self.log).map_err(|e| e.to_string())?;
                text.lines()
                    .find(|l| l.contains(needle))
                    .map(str::to_string)
                    .ok_or_else(|| "not yet".to_string())
            },
        )
        .await
    }

    pub async fn wait_ready(&self) {
        // A minute: on a loaded machine a RabbitMQ application can take a while to subscribe.
        self.wait_count("ready", 1, Duration::from_secs(60)).await;
    }

    /// Lets its `ack-when-released` handlers finish: each prints `released <body>` and acks.
    pub fn release(&self) {
        std::fs::write(&self.release, b"").expect("the release file");
    }

    /// SIGKILL: nothing is flushed, nothing is closed.
    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM, as Kubernetes stops a pod: the application closes its bus gracefully.
    pub fn sigterm(&self) {
        crate::process::sigterm(&self.child);
    }

    /// SIGSTOP: the process does nothing, its connections stay open and silent, until
    /// [`App::resume`].
    pub fn pause(&self) {
        crate::process::signal(&self.child, "STOP");
    }

    /// SIGCONT after [`App::pause`].
    pub fn resume(&self) {
        crate::process::signal(&self.child, "CONT");
    }

    /// Waits for the process to exit by itself; true when it said `closed` (a graceful stop).
    pub fn wait_exit(&mut self, limit: Duration) -> bool {
        let start = Instant::now();
        while start.elapsed() < limit {
            if let Ok(Some(_)) = self.child.try_wait() {
                // Every line it printed is collected once its reader reaches the pipe's end (a
                // fixed 100 ms had missed `closed` on a loaded machine).
                if let Some(reader) = self.reader.take() {
                    let _ = reader.join();
                }
                return self.count("closed") == 1;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("the application was still running {limit:?} after SIGTERM");
    }
}

impl Drop for App {
    fn drop(&mut self) {
        self.kill9();
        let _ = std::fs::remove_file(&self.release);
    }
}
