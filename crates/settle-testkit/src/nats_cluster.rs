//! The environment's JetStream cluster (`hack/env.sh up --nats-cluster`: three nats-servers,
//! settle-c1..c3, each from its config file `$SETTLE_NATS_CLUSTER_DIR/cN.conf`): where it is,
//! which server leads a stream or a consumer, a server SIGKILLed and started again with the same
//! config and store, or paused (SIGSTOP) and resumed, and publishing that waits out an election.
//!
//! Every server a test stops is started (or resumed) again when its guard drops, also when the
//! test fails, and with the environment's pid file, so `hack/env.sh down` stops it.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use async_nats::jetstream;

use super::operator::poll;
use super::setting;

/// The cluster's servers, in order c1, c2, c3.
pub const SERVERS: [&str; 3] = ["settle-c1", "settle-c2", "settle-c3"];

/// Where the cluster is.
#[derive(Clone, Debug)]
pub struct Cluster {
    /// Each server's client URL.
    pub urls: Vec<String>,
    /// Each server's monitoring endpoint (`http://127.0.0.1:PORT`).
    pub monitors: Vec<String>,
    /// `cN.conf`, `cN.pid`, `cN.log` and the stores `cN/`.
    pub dir: PathBuf,
    pub nats_server: PathBuf,
}

/// The environment's cluster; fails saying how to start it when it is not there.
pub fn cluster() -> Cluster {
    let get = |key: &str| match setting(key) {
        (Some(v), _) => v,
        (None, file) => panic!(
            "{key} is not set and {} does not define it: start the environment with \
             `hack/env.sh up --nats-cluster` (make test does)",
            file.display()
        ),
    };
    let list = |key: &str| get(key).split(',').map(str::to_string).collect();
    Cluster {
        urls: list("SETTLE_NATS_CLUSTER_URLS"),
        monitors: list("SETTLE_NATS_CLUSTER_MONITOR_URLS"),
        dir: PathBuf::from(get("SETTLE_NATS_CLUSTER_DIR")),
        nats_server: PathBuf::from(get("SETTLE_NATS_SERVER")),
    }
}

/// The index (0..3) of server `name` (`settle-c2` → 1).
pub fn index_of(name: &str) -> usize {
    SERVERS
        .iter()
        .position(|s| *s == name)
        .unwrap_or_else(|| panic!("{name} is not a server of the cluster"))
}

/// `kill -SIG -- -PGID`: the server's process group (it runs alone in its session).
fn signal(sig: &str, pgid: u32) {
    let status = Command::new("kill")
        .args([sig, "--", &format!("-{pgid}")])
        .status()
        .expect("run kill");
    assert!(status.success(), "kill {sig} -{pgid}");
}

/// Whether process `pid` runs (a zombie does not).
fn running(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        s.rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| state != "Z" && state != "X")
    })
}

impl Cluster {
    /// Every URL, comma-separated (a Backend's servers, an application's `SETTLE_NATS_URL`).
    pub fn url_list(&self) -> String {
        self.urls.join(",")
    }

    fn file(&self, i: usize, ext: &str) -> PathBuf {
        self.dir.join(format!("c{}.{ext}", i + 1))
    }

    /// Server `i`'s pid (its process group), from its pid file.
    pub fn pid(&self, i: usize) -> u32 {
        let path = self.file(i, "pid");
        std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
            .trim()
            .parse()
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    }

    /// A client of every server (it reconnects to whichever runs).
    pub async fn js(&self) -> jetstream::Context {
        let client = async_nats::connect(self.urls.as_slice())
            .await
            .unwrap_or_else(|e| panic!("connect to the cluster {}: {e}", self.url_list()));
        jetstream::new(client)
    }

    /// A client of every server but `i` (one a test pauses: a client connected to it would
    /// wait, as any would, until its pings go unanswered).
    pub async fn js_without(&self, i: usize) -> jetstream::Context {
        let others: Vec<&String> = (0..3).filter(|&j| j != i).map(|j| &self.urls[j]).collect();
        let client = async_nats::connect(others.iter().map(|u| u.as_str()).collect::<Vec<_>>())
            .await
            .unwrap_or_else(|e| panic!("connect to {others:?}: {e}"));
        jetstream::new(client)
    }

    /// SIGKILL server `i`; it is started again (same config, same store) when the guard is
    /// restarted or dropped.
    pub fn kill(&self, i: usize) -> Killed {
        self.kill_with(i, "KILL")
    }

    /// Signal `sig` (`KILL`, or `TERM`: it shuts down on its own) to server `i`, waiting up
    /// to 30 s for it to exit; started again as [`Cluster::kill`]'s.
    pub fn kill_with(&self, i: usize, sig: &str) -> Killed {
        let pid = self.pid(i);
        signal(&format!("-{sig}"), pid);
        let deadline = Instant::now() + Duration::from_secs(30);
        while running(pid) {
            assert!(
                Instant::now() < deadline,
                "{} still runs 30 s after SIG{sig}",
                SERVERS[i]
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        eprintln!("{} SIG{sig}ed (pid {pid})", SERVERS[i]);
        Killed {
            cluster: self.clone(),
            i,
            done: false,
        }
    }

    /// SIGSTOP server `i` (its connections stay open and silent, as a node cut off by a
    /// partition); resumed (SIGCONT) when the guard is resumed or dropped.
    pub fn pause(&self, i: usize) -> Paused {
        signal("-STOP", self.pid(i));
        eprintln!("{} paused (SIGSTOP)", SERVERS[i]);
        Paused {
            cluster: self.clone(),
            i,
            done: false,
        }
    }

    /// Starts server `i` from its config (its pid file and log the environment's).
    fn start(&self, i: usize) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.file(i, "log"))
            .expect("the server's log");
        // As hack/lib.sh's spawn: a session of its own, its pid written from inside. It
        // outlives the test (the environment's `down` stops it); reaped here if it dies first.
        let mut child = Command::new("setsid")
            .args(["sh", "-c", "echo $$ >\"$0\"; exec \"$@\""])
            .arg(self.file(i, "pid"))
            .arg(&self.nats_server)
            .arg("-c")
            .arg(self.file(i, "conf"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("start nats-server");
        std::thread::spawn(move || child.wait());
        eprintln!("{} started again", SERVERS[i]);
    }

    /// `GET path` on server `i`'s monitoring port.
    fn monitor(&self, i: usize, path: &str) -> Option<String> {
        let port = self.monitors[i]
            .rsplit_once(':')
            .and_then(|(_, p)| p.parse::<u16>().ok())?;
        super::http_get(port, path)
    }

    /// Whether server `i` answers its full health check: JetStream on, current with the meta
    /// group, and every stream and consumer it holds a replica of caught up (a server started
    /// again answers `js-enabled-only` long before it is).
    pub fn healthy(&self, i: usize) -> bool {
        self.monitor(i, "/healthz")
            .is_some_and(|r| r.starts_with("HTTP/1.1 200"))
    }

    /// What is wrong with the meta group, as its leader sees it (`/jsz`'s `meta_cluster`): no
    /// leader, fewer than three peers, or a peer offline or behind. The meta leader places new
    /// streams: an R3 stream made while it counts a peer offline is refused ("no suitable
    /// peers for placement").
    fn meta_trouble(&self) -> Option<String> {
        let body = |i: usize| -> Option<serde_json::Value> {
            let r = self.monitor(i, "/jsz")?;
            let json = &r[r.find('{')?..=r.rfind('}')?];
            serde_json::from_str(json).ok()
        };
        for (i, server) in SERVERS.iter().enumerate() {
            let Some(jsz) = body(i) else { continue };
            let meta = &jsz["meta_cluster"];
            if meta["leader"].as_str() != Some(*server) {
                continue;
            }
            let peers = meta["replicas"].as_array().cloned().unwrap_or_default();
            let behind: Vec<String> = peers
                .iter()
                .filter(|p| {
                    !p["current"].as_bool().unwrap_or(false)
                        || p["offline"].as_bool().unwrap_or(false)
                })
                .map(|p| p["name"].as_str().unwrap_or("?").to_string())
                .collect();
            return if peers.len() != 2 {
                Some(format!(
                    "meta leader {server} sees {} other peers",
                    peers.len()
                ))
            } else if !behind.is_empty() {
                Some(format!(
                    "meta leader {server} sees {behind:?} offline or behind"
                ))
            } else {
                None
            };
        }
        Some("no server says it leads the meta group".into())
    }

    /// Waits until every server runs, answers its full health check and the meta leader sees
    /// the other two current (a server started again may still be catching up its streams, or
    /// be counted offline by the leader).
    pub async fn wait_healthy(&self) {
        poll(
            "every server of the cluster healthy",
            Duration::from_secs(90),
            || async {
                let sick: Vec<&str> = (0..3)
                    .filter(|&i| !self.healthy(i))
                    .map(|i| SERVERS[i])
                    .collect();
                if !sick.is_empty() {
                    return Err(format!("not healthy: {sick:?}"));
                }
                match self.meta_trouble() {
                    Some(trouble) => Err(trouble),
                    None => Ok(()),
                }
            },
        )
        .await;
    }

    /// Waits until `stream` has a leader and its two other replicas are current and online
    /// (a stream just brought from one replica to three is copying its data: its leader
    /// killed then, the other two cannot elect one). Returns the leader.
    pub async fn wait_stream_replicated(js: &jetstream::Context, stream: &str) -> String {
        poll(
            &format!("stream {stream} led, with two current replicas"),
            Duration::from_secs(60),
            || async {
                let mut s = js.get_stream(stream).await.map_err(|e| e.to_string())?;
                let info = s.info().await.map_err(|e| e.to_string())?;
                let cluster = info.cluster.clone().ok_or("no cluster info")?;
                let leader = cluster.leader.clone().filter(|l| !l.is_empty());
                let current = cluster
                    .replicas
                    .iter()
                    .filter(|p| p.current && !p.offline)
                    .count();
                match leader {
                    Some(l) if info.config.num_replicas == 3 && current == 2 => Ok(l),
                    _ => Err(format!(
                        "{} replicas configured, leader {leader:?}, replicas {:?}",
                        info.config.num_replicas, cluster.replicas
                    )),
                }
            },
        )
        .await
    }

    /// The server that leads consumer `name` of `stream` (by `$JS.API.CONSUMER.INFO`'s
    /// `cluster.leader`), `None` while it has none or nobody answers.
    pub async fn consumer_leader(
        js: &jetstream::Context,
        stream: &str,
        name: &str,
    ) -> Option<String> {
        settle::backend::nats::admin::consumer_info(js, stream, name)
            .await
            .ok()
            .flatten()
            .and_then(|i| i.cluster)
            .and_then(|c| c.leader)
            .filter(|l| !l.is_empty())
    }

    /// The server that leads stream `stream`, `None` while it has none or nobody answers.
    pub async fn stream_leader(js: &jetstream::Context, stream: &str) -> Option<String> {
        let mut s = js.get_stream(stream).await.ok()?;
        s.info()
            .await
            .ok()
            .and_then(|i| i.cluster.clone())
            .and_then(|c| c.leader)
            .filter(|l| !l.is_empty())
    }

    /// Waits until consumer `name` of `stream` has a leader other than `not` (`""`: any);
    /// returns it.
    pub async fn wait_consumer_leader(
        js: &jetstream::Context,
        stream: &str,
        name: &str,
        not: &str,
    ) -> String {
        poll(
            &format!("consumer {name} to have a leader other than {not}"),
            Duration::from_secs(60),
            || async {
                match Cluster::consumer_leader(js, stream, name).await {
                    Some(l) if l != not => Ok(l),
                    other => Err(format!("{other:?}")),
                }
            },
        )
        .await
    }

    /// Has `stream`'s leader step down (`$JS.API.STREAM.LEADER.STEPDOWN`) and waits until
    /// another leads it with both other replicas current; returns the new leader. A request
    /// that changed nothing in 5 s (lost, or answered by nobody while the cluster settled) is
    /// sent again; after 60 s without a new leader it panics with the last answer.
    pub async fn step_down_stream(js: &jetstream::Context, stream: &str, leader: &str) -> String {
        let start = Instant::now();
        loop {
            let answer: Result<jetstream::response::Response<serde_json::Value>, _> = js
                .request(
                    format!("STREAM.LEADER.STEPDOWN.{stream}"),
                    &serde_json::json!({}),
                )
                .await;
            if let Ok(jetstream::response::Response::Err { error }) = &answer {
                panic!("stepping {stream}'s leader {leader} down: {error}");
            }
            let asked = Instant::now();
            while asked.elapsed() < Duration::from_secs(5) {
                match Cluster::stream_leader(js, stream).await {
                    Some(l) if l != leader => {
                        return Cluster::wait_stream_replicated(js, stream).await;
                    }
                    _ => tokio::time::sleep(Duration::from_millis(100)).await,
                }
            }
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "waited 60s for stream {stream} to have a leader other than {leader} after \
                 asking it to step down, in vain; last answer: {answer:?}"
            );
        }
    }

    /// Waits until `stream` has a leader other than `not`; returns it.
    pub async fn wait_stream_leader(js: &jetstream::Context, stream: &str, not: &str) -> String {
        poll(
            &format!("stream {stream} to have a leader other than {not}"),
            Duration::from_secs(60),
            || async {
                match Cluster::stream_leader(js, stream).await {
                    Some(l) if l != not => Ok(l),
                    other => Err(format!("{other:?}")),
                }
            },
        )
        .await
    }
}

/// A server SIGKILLed; started again by [`Killed::restart`] or on drop.
pub struct Killed {
    cluster: Cluster,
    i: usize,
    done: bool,
}

impl Killed {
    pub fn restart(mut self) {
        self.done = true;
        self.cluster.start(self.i);
    }
}

impl Drop for Killed {
    fn drop(&mut self) {
        if !self.done {
            self.cluster.start(self.i);
        }
    }
}

/// A server paused; resumed by [`Paused::resume`] or on drop.
pub struct Paused {
    cluster: Cluster,
    i: usize,
    done: bool,
}

impl Paused {
    pub fn resume(mut self) {
        self.done = true;
        signal("-CONT", self.cluster.pid(self.i));
        eprintln!("{} resumed (SIGCONT)", SERVERS[self.i]);
    }
}

impl Drop for Paused {
    fn drop(&mut self) {
        if !self.done {
            signal("-CONT", self.cluster.pid(self.i));
        }
    }
}

/// Publishes `bodies` to `<prefix>.m<body>` on `js`, each stored before the next, each with a
/// message id (the stream's duplicate window drops a second copy), trying again while the
/// stream has no leader or its answer is lost.
pub async fn publish_through(js: &jetstream::Context, prefix: &str, bodies: &[String]) {
    for body in bodies {
        let subject = format!("{prefix}.m{body}");
        poll(
            &format!("message {body} stored"),
            Duration::from_secs(60),
            || async {
                let mut headers = async_nats::HeaderMap::new();
                headers.insert("Nats-Msg-Id", body.as_str());
                let ack = js
                    .publish_with_headers(subject.clone(), headers, body.clone().into())
                    .await
                    .map_err(|e| e.to_string())?;
                ack.await.map(|_| ()).map_err(|e| e.to_string())
            },
        )
        .await;
    }
}
