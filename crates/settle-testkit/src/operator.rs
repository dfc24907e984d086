//! For the controller tests: `settle operator` as a real process against the environment's API
//! server, a nats-server of a test's own (for faults: stopped, restarted, with credentials), a
//! private stream on the shared nats-server, metrics scraped from the operator, and one `poll`
//! with a deadline and a message. Every process is killed on drop.

use std::future::Future;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;

use super::free_port;

/// Polls `f` every 100 ms until it returns `Some`; panics after `limit` saying what it waited for
/// and what it saw last (`f`'s `Err`).
pub async fn poll<T, F, Fut>(what: &str, limit: Duration, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, String>>,
{
    let start = Instant::now();
    let mut last: String;
    loop {
        match f().await {
            Ok(v) => return v,
            Err(seen) => last = seen,
        }
        assert!(
            start.elapsed() < limit,
            "waited {limit:?} for {what}, in vain; last seen: {last}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `settle operator` running as a process; killed when dropped.
pub struct Operator {
    child: Child,
    /// Run under `SETTLE_OPERATOR_WRAPPER`, in a process group of its own.
    wrapped: bool,
    pub metrics_port: u16,
    pub log: PathBuf,
}

static OPERATORS: AtomicUsize = AtomicUsize::new(0);

impl Operator {
    /// An operator reconciling only `watch` (comma-separated), without leader election, webhook
    /// certificate kept in `watch`'s first namespace, no webhook configuration to patch.
    pub fn start(test: &str, watch: &str) -> Operator {
        Operator::start_with(test, watch, &["--leader-election=false"])
    }

    /// As [`Operator::start`], with `extra` flags (which may turn leader election back on).
    pub fn start_with(test: &str, watch: &str, extra: &[&str]) -> Operator {
        let wrapper = std::env::var("SETTLE_OPERATOR_WRAPPER").unwrap_or_default();
        Operator::start_under(test, watch, extra, &wrapper)
    }

    /// As [`Operator::start_with`], never under `SETTLE_OPERATOR_WRAPPER` (a benchmark's
    /// operator after the profiled one, which would write over its profile).
    pub fn start_unwrapped(test: &str, watch: &str, extra: &[&str]) -> Operator {
        Operator::start_under(test, watch, extra, "")
    }

    fn start_under(test: &str, watch: &str, extra: &[&str], wrapper: &str) -> Operator {
        // A port picked free can be taken by another process before the operator binds it
        // (CI saw another test's probe port answer this one's /readyz while this operator had
        // stopped): start again, on new ports.
        for _ in 0..3 {
            let op = Operator::spawn_under(test, watch, extra, &[], wrapper);
            if op.ready_or_port_taken() {
                return op;
            }
        }
        panic!("settle operator ({test}) found its ports taken three times in a row");
    }

    /// Starts the process without waiting for it to be ready.
    pub fn spawn(test: &str, watch: &str, extra: &[&str]) -> Operator {
        Operator::spawn_env(test, watch, extra, &[])
    }

    pub fn spawn_env(test: &str, watch: &str, extra: &[&str], env: &[(&str, &str)]) -> Operator {
        let wrapper = std::env::var("SETTLE_OPERATOR_WRAPPER").unwrap_or_default();
        Operator::spawn_under(test, watch, extra, env, &wrapper)
    }

    fn spawn_under(
        test: &str,
        watch: &str,
        extra: &[&str],
        env: &[(&str, &str)],
        wrapper: &str,
    ) -> Operator {
        let e = super::env();
        let metrics_port = free_port();
        let n = OPERATORS.fetch_add(1, Ordering::Relaxed);
        let log = super::root().join(format!(
            "target/reconcile-{test}-{}-{n}.log",
            std::process::id()
        ));
        let home = watch.split(',').next().unwrap_or("default");
        // A profiler to run the operator under (`SETTLE_OPERATOR_WRAPPER="heaptrack -o
        // target/heap"`, for a benchmark): its words, then the binary. The pid is then the
        // wrapper's.
        let mut words = wrapper.split_whitespace();
        let binary = operator_binary();
        let mut cmd = match words.next() {
            Some(program) => {
                let mut c = Command::new(program);
                c.args(words).arg(&binary);
                // A group of its own, killed whole: killing the wrapper alone had left the
                // operator under it running, measured beside the next benchmark's.
                std::os::unix::process::CommandExt::process_group(&mut c, 0);
                c
            }
            None => Command::new(&binary),
        };
        cmd.args(["operator", "--log-format", "text"]);
        // The defaults, each unless `extra` sets it.
        let webhook_addr = format!("127.0.0.1:{}", free_port());
        let metrics_addr = format!("127.0.0.1:{metrics_port}");
        let defaults = [
            ("--webhook-addr", webhook_addr.as_str()),
            ("--metrics-addr", metrics_addr.as_str()),
            ("--probe-addr", "127.0.0.1:0"),
            ("--namespace", home),
            ("--webhook-secret", "settle-reconcile-tls"),
            ("--webhook-configuration", ""),
            ("--webhook-ips", "127.0.0.1"),
            ("--watch-namespaces", watch),
            // Stopped by the tests, not by a rolling update: nothing routes reviews to it.
            ("--shutdown-delay", "0s"),
        ];
        for (flag, value) in defaults {
            if !extra.contains(&flag) {
                cmd.args([flag, value]);
            }
        }
        cmd.args(extra)
            .env("KUBECONFIG", &e.kubeconfig)
            .env(
                "RUST_LOG",
                std::env::var("SETTLE_TEST_OPERATOR_LOG")
                    .unwrap_or_else(|_| "info,settle=debug".into()),
            )
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("log file"));
        for (k, v) in env {
            cmd.env(k, v);
        }
        let child = cmd.spawn().expect("start settle operator");
        Operator {
            child,
            wrapped: !wrapper.trim().is_empty(),
            metrics_port,
            log,
        }
    }

    pub fn get(&self, path: &str) -> Option<String> {
        super::http_get(self.metrics_port, path)
    }

    pub fn wait_ready(&self) {
        assert!(
            self.ready_or_port_taken(),
            "settle operator could not listen: a port it was given is taken; see {}",
            self.log.display()
        );
    }

    /// Waits until this process says it listens and its /readyz answers 200 (true), or it says
    /// a port it was given is taken (false). The log is read first: an answer on the port alone
    /// could come from another process that took it.
    fn ready_or_port_taken(&self) -> bool {
        let deadline = Instant::now() + Duration::from_secs(60);
        while Instant::now() < deadline {
            let log = std::fs::read_to_string(&self.log).unwrap_or_default();
            if log.contains("Address already in use") {
                return false;
            }
            if log.contains("metrics and health listening")
                && self
                    .get("/readyz")
                    .is_some_and(|r| r.starts_with("HTTP/1.1 200"))
            {
                return true;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!(
            "settle operator not ready after 60s; see {}",
            self.log.display()
        );
    }

    /// The sum of every series of metric `name` whose labels include `labels`.
    pub fn metric(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        let text = self.get("/metrics").unwrap_or_default();
        metric_sum(&text, name, labels)
    }

    /// The JetStream consumer API calls the Subscription controller made so far
    /// (`settle_consumer_api_calls_total`: stream, info, create, update, delete).
    pub fn consumer_api_calls(&self) -> f64 {
        let text = self.get("/metrics").unwrap_or_default();
        ["stream", "info", "create", "update", "delete"]
            .iter()
            .map(|call| metric_sum(&text, "settle_consumer_api_calls_total", &[("call", call)]))
            .sum()
    }

    /// Whether `/metrics` exports metric `name` at all: [`Operator::metric`] reads a missing one
    /// as 0, so an assertion that something stayed at 0 checks this first.
    pub fn exports(&self, name: &str) -> bool {
        let text = self.get("/metrics").unwrap_or_default();
        metric_exported(&text, name)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Whether the process still runs.
    pub fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// SIGKILL: no chance to release anything.
    /// SIGTERM: the operator releases its Lease and ends its term.
    pub fn sigterm(&self) {
        super::process::sigterm(&self.child);
    }

    pub fn kill9(&mut self) {
        if self.wrapped {
            // The operator first, then a while for the wrapper to finish (a profiler writes
            // what it recorded, up to this moment: the live heap at rest), then the group.
            let group = self.child.id().to_string();
            let _ = Command::new("pkill")
                .args(["-KILL", "-g", &group, "-x", "settle"])
                .status();
            let deadline = Instant::now() + Duration::from_secs(60);
            while self.alive() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(200));
            }
            let _ = Command::new("kill")
                .args(["-KILL", "--", &format!("-{group}")])
                .status();
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The operator binary to run: this build's, or `SETTLE_OPERATOR_BIN` (for a benchmark of the
/// binary as shipped, `cargo build --release --bin settle`, copied aside: the benches' own build
/// of it has the dev-dependencies' features unified in, so its code differs).
fn operator_binary() -> std::path::PathBuf {
    std::env::var_os("SETTLE_OPERATOR_BIN")
        .filter(|p| !p.is_empty())
        .map_or_else(|| super::bin("settle"), Into::into)
}

impl Drop for Operator {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// The sum of every series of `name` in Prometheus text whose labels include `labels`.
pub fn metric_sum(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let (metric, rest) = match series.split_once('{') {
                Some((m, r)) => (m, r.trim_end_matches('}')),
                None => (series, ""),
            };
            if metric != name {
                return None;
            }
            let ok = labels
                .iter()
                .all(|(k, v)| rest.split(',').any(|kv| kv == format!("{k}=\"{v}\"")));
            ok.then(|| value.parse::<f64>().ok()).flatten()
        })
        .sum()
}

/// Whether Prometheus text `text` has at least one series of `name`.
pub fn metric_exported(text: &str, name: &str) -> bool {
    text.lines().filter(|l| !l.starts_with('#')).any(|l| {
        let series = l.split([' ', '{']).next().unwrap_or_default();
        series == name
    })
}

/// A nats-server of a test's own, on a free port, with a store that survives a restart;
/// killed when dropped.
pub struct NatsServer {
    child: Option<Child>,
    pub port: u16,
    store: tempfile::TempDir,
    args: Vec<String>,
}

impl NatsServer {
    pub fn start(extra: &[&str]) -> NatsServer {
        let mut s = NatsServer {
            child: None,
            port: free_port(),
            store: tempfile::tempdir().expect("store dir"),
            args: extra.iter().map(|s| s.to_string()).collect(),
        };
        s.resume();
        s
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// The server's process id while it runs (to signal it: `-HUP` reloads its configuration).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Stops the server (SIGKILL: its store is kept).
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Stops the server with SIGTERM (it shuts down on its own: JetStream's store is flushed,
    /// clients are disconnected), waiting up to 30 s for it to exit, then SIGKILL.
    pub fn terminate(&mut self) {
        if let Some(mut c) = self.child.take() {
            crate::process::signal(&c, "TERM");
            let deadline = Instant::now() + Duration::from_secs(30);
            while matches!(c.try_wait(), Ok(None)) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts it again: same port, same store.
    pub fn resume(&mut self) {
        let bin = super::env().nats_server;
        let child = Command::new(&bin)
            .args(["-a", "127.0.0.1", "-p", &self.port.to_string(), "-js"])
            .arg("-sd")
            .arg(self.store.path())
            .args(&self.args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("start {}: {e}", bin.display()));
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "nats-server on port {} did not listen within 20s",
                self.port
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.stop();
    }
}

static STREAMS: AtomicUsize = AtomicUsize::new(0);

/// A client of `url` (one URL or a comma-separated list), as the user a `nats://user:password@`
/// URL names (the client reads none from the URL itself).
pub async fn nats_client(url: &str) -> async_nats::Client {
    let mut user = None;
    let servers: Vec<String> = url
        .split(',')
        .map(|server| match server.split_once("://") {
            Some((scheme, rest)) => match rest.split_once('@') {
                Some((info, host)) => {
                    if user.is_none() {
                        user = info
                            .split_once(':')
                            .map(|(u, p)| (u.to_string(), p.to_string()));
                    }
                    format!("{scheme}://{host}")
                }
                None => server.to_string(),
            },
            None => server.to_string(),
        })
        .collect();
    let mut options = async_nats::ConnectOptions::new();
    if let Some((u, p)) = user {
        options = options.user_and_password(u, p);
    }
    options
        .connect(servers)
        .await
        .unwrap_or_else(|e| panic!("connect to {url}: {e}"))
}

/// A stream of a test's own (memory storage) on a server, for subjects `<prefix>.>`.
pub struct TestStream {
    pub js: async_nats::jetstream::Context,
    pub name: String,
    pub prefix: String,
}

impl TestStream {
    pub async fn new(url: &str, test: &str) -> TestStream {
        TestStream::make(url, test, 1, 0).await
    }

    /// A stream of `replicas` (on a JetStream cluster, `url` a comma-separated list).
    pub async fn replicated(url: &str, test: &str, replicas: usize) -> TestStream {
        TestStream::make(url, test, replicas, 0).await
    }

    /// A stream as [`TestStream::new`] makes, that allows at most `max_consumers` consumers
    /// (`0`: no limit of its own).
    pub async fn with_max_consumers(url: &str, test: &str, max_consumers: i32) -> TestStream {
        TestStream::make(url, test, 1, max_consumers).await
    }

    async fn make(url: &str, test: &str, replicas: usize, max_consumers: i32) -> TestStream {
        let js = async_nats::jetstream::new(nats_client(url).await);
        let tag = format!(
            "{}_{}_{}",
            test.replace('-', "_"),
            std::process::id(),
            STREAMS.fetch_add(1, Ordering::Relaxed)
        );
        let name = format!("REC_{}", tag.to_uppercase());
        let prefix = format!("rec.{tag}");
        js.create_stream(async_nats::jetstream::stream::Config {
            name: name.clone(),
            subjects: vec![format!("{prefix}.>")],
            storage: async_nats::jetstream::stream::StorageType::File,
            num_replicas: replicas,
            max_consumers,
            ..Default::default()
        })
        .await
        .expect("create stream");
        TestStream { js, name, prefix }
    }

    /// The consumer's info, `None` when it does not exist.
    pub async fn consumer(&self, name: &str) -> Option<async_nats::jetstream::consumer::Info> {
        settle::backend::nats::admin::consumer_info(&self.js, &self.name, name)
            .await
            .expect("consumer info")
    }

    /// Every consumer's name on the stream.
    pub async fn consumer_names(&self) -> Vec<String> {
        use futures::TryStreamExt;
        let stream = self.js.get_stream(&self.name).await.expect("stream");
        let mut names: Vec<String> = stream
            .consumer_names()
            .try_collect()
            .await
            .expect("consumer names");
        names.sort();
        names
    }

    pub async fn delete(self) {
        let _ = self.js.delete_stream(&self.name).await;
    }
}

/// The condition of `type_`, as `(status, reason, message)`.
pub fn condition(conditions: &[Condition], type_: &str) -> Option<(String, String, String)> {
    conditions
        .iter()
        .find(|c| c.type_ == type_)
        .map(|c| (c.status.clone(), c.reason.clone(), c.message.clone()))
}
