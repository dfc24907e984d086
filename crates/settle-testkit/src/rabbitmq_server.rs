//! A RabbitMQ node of a test's own (with its management plugin and its own epmd), configured as
//! `hack/env.sh` configures the environment's, on free ports with a store that survives a
//! restart: a fault campaign SIGKILLs or SIGTERMs it and starts it again, which the
//! environment's node, shared by every other test, must never be.
//!
//! It must not know what a test does with the node.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::rabbitmq::management_once;

/// A RabbitMQ node; killed (with its epmd) when dropped.
pub struct RabbitServer {
    dir: tempfile::TempDir,
    node: String,
    pub amqp_port: u16,
    pub management_port: u16,
    dist_port: u16,
    epmd_port: u16,
    epmd: Child,
    server: Option<Child>,
}

/// `hack/tools.sh path rabbitmq`: the `rabbitmq-server` the environment runs.
fn rabbitmq_server() -> PathBuf {
    let out = Command::new(super::root().join("hack/tools.sh"))
        .args(["path", "rabbitmq"])
        .output()
        .expect("run hack/tools.sh path rabbitmq");
    assert!(out.status.success(), "hack/tools.sh path rabbitmq failed");
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
}

impl RabbitServer {
    /// A node started and serving (AMQP and the management API), within 120 s.
    pub fn start() -> RabbitServer {
        let dir = tempfile::tempdir().expect("a directory for RabbitMQ");
        let (amqp_port, management_port, dist_port, epmd_port) = (
            super::free_port(),
            super::free_port(),
            super::free_port(),
            super::free_port(),
        );
        std::fs::create_dir_all(dir.path().join("log")).expect("log dir");
        std::fs::write(
            dir.path().join("rabbitmq.conf"),
            format!(
                "listeners.tcp.1 = 127.0.0.1:{amqp_port}\nmanagement.tcp.ip = 127.0.0.1\nmanagement.tcp.port = {management_port}\nlog.console = true\nlog.console.level = info\nlog.file = false\n"
            ),
        )
        .expect("rabbitmq.conf");
        std::fs::write(
            dir.path().join("enabled_plugins"),
            "[rabbitmq_management].\n",
        )
        .expect("enabled_plugins");
        std::fs::write(dir.path().join("rabbitmq-env.conf"), "").expect("rabbitmq-env.conf");
        let epmd = Command::new("epmd")
            .args(["-port", &epmd_port.to_string(), "-address", "127.0.0.1"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start epmd");
        let mut s = RabbitServer {
            node: format!("settle-chaos-{amqp_port}@localhost"),
            dir,
            amqp_port,
            management_port,
            dist_port,
            epmd_port,
            epmd,
            server: None,
        };
        s.resume();
        s
    }

    /// `amqp://guest:guest@127.0.0.1:<port>/%2f`.
    pub fn url(&self) -> String {
        format!("amqp://guest:guest@127.0.0.1:{}/%2f", self.amqp_port)
    }

    /// `http://127.0.0.1:<port>`: its management API.
    pub fn management_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.management_port)
    }

    /// Signal `sig` (`KILL`, or `TERM`: it shuts down on its own) to the node's process group,
    /// and waits up to 60 s for it to exit (then SIGKILL). Its store is kept.
    pub fn stop(&mut self, sig: &str) {
        let Some(mut child) = self.server.take() else {
            return;
        };
        let group = format!("-{}", child.id());
        let _ = Command::new("kill")
            .args([&format!("-{sig}"), "--", &group])
            .stderr(Stdio::null())
            .status();
        // The script is reaped first: a zombie still counts in its group.
        let deadline = Instant::now() + Duration::from_secs(60);
        while Instant::now() < deadline
            && (matches!(child.try_wait(), Ok(None)) || group_alive(&group))
        {
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = Command::new("kill")
            .args(["-KILL", "--", &group])
            .stderr(Stdio::null())
            .status();
        let _ = child.wait();
    }

    /// Stops the node where it is (SIGSTOP to its process group): its connections stay open and
    /// nothing on them is answered, as a node cut off, until [`RabbitServer::thaw`].
    pub fn freeze(&self) {
        self.signal_group("STOP");
    }

    /// Lets a frozen node run on (SIGCONT).
    pub fn thaw(&self) {
        self.signal_group("CONT");
    }

    fn signal_group(&self, sig: &str) {
        if let Some(child) = &self.server {
            let _ = Command::new("kill")
                .args([&format!("-{sig}"), "--", &format!("-{}", child.id())])
                .stderr(Stdio::null())
                .status();
        }
    }

    /// Starts it again on the same ports and store; returns once it serves.
    pub fn resume(&mut self) {
        let d = self.dir.path();
        let mut cmd = Command::new(rabbitmq_server());
        cmd.env("HOME", d)
            .env("RABBITMQ_NODENAME", &self.node)
            .env("RABBITMQ_CONF_ENV_FILE", d.join("rabbitmq-env.conf"))
            .env("RABBITMQ_CONFIG_FILE", d.join("rabbitmq.conf"))
            .env("RABBITMQ_ADVANCED_CONFIG_FILE", d.join("advanced.config"))
            .env("RABBITMQ_ENABLED_PLUGINS_FILE", d.join("enabled_plugins"))
            .env("RABBITMQ_MNESIA_BASE", d.join("mnesia"))
            .env("RABBITMQ_LOG_BASE", d.join("log"))
            .env("RABBITMQ_PID_FILE", d.join("rabbitmq.pid"))
            .env("RABBITMQ_DIST_PORT", self.dist_port.to_string())
            .env("ERL_EPMD_PORT", self.epmd_port.to_string())
            .env("ERL_CRASH_DUMP", d.join("erl_crash.dump"))
            // As the environment's: Erlang's schedulers spinning while idle take CPU from the
            // other processes of a 2-core machine.
            .env(
                "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS",
                "-kernel inet_dist_use_interface {127,0,0,1} +sbwt none +sbwtdcpu none +sbwtdio none",
            )
            .stdout(Stdio::null())
            .stderr(
                std::fs::File::create(d.join("log/console.log"))
                    .map_or_else(|_| Stdio::null(), Stdio::from),
            );
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        self.server = Some(cmd.spawn().expect("start rabbitmq-server"));
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let amqp = std::net::TcpStream::connect(("127.0.0.1", self.amqp_port)).is_ok();
            if amqp && self.serves() {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "RabbitMQ on port {} did not serve within 120 s; see {}",
                self.amqp_port,
                d.join("log/console.log").display()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Whether its management API answers.
    fn serves(&self) -> bool {
        management_once(&self.management_url(), "GET", "/api/overview", "")
            .is_ok_and(|(status, _)| status == 200)
    }
}

/// Whether a process of group `group` (`-<pgid>`) is alive.
fn group_alive(group: &str) -> bool {
    Command::new("kill")
        .args(["-0", "--", group])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

impl Drop for RabbitServer {
    fn drop(&mut self) {
        self.thaw(); // a frozen node takes no SIGTERM, and its script none either
        self.stop("KILL");
        let _ = self.epmd.kill();
        let _ = self.epmd.wait();
    }
}
