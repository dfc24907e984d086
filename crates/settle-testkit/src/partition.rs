//! A network partition between a client and a server (the environment's API server, a broker): a
//! TCP forwarder that can be made to hang (it holds its connections but passes no bytes either
//! way) or to close every connection a moment after it opens, and that counts the connections it
//! accepted; for the API server, a kube client and a kubeconfig file that go through it. The
//! leader tests cut a leader off with it; the RabbitMQ connection tests drop a broker connection
//! again and again.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// A TCP forwarder to a server; stops forwarding when dropped.
pub struct Partition {
    pub port: u16,
    paused: Arc<AtomicBool>,
    /// While not 0: every connection is closed this many milliseconds after it opened.
    cut_after_ms: Arc<AtomicU64>,
    accepted: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl Partition {
    /// A forwarder to the environment's API server.
    pub async fn to_api_server() -> Partition {
        Partition::to(api_server_addr()).await
    }

    pub async fn to(upstream: std::net::SocketAddr) -> Partition {
        let listener = super::listen();
        listener
            .set_nonblocking(true)
            .expect("a non-blocking forwarder");
        let listener = tokio::net::TcpListener::from_std(listener).expect("a tokio forwarder");
        let port = listener.local_addr().expect("addr").port();
        let paused = Arc::new(AtomicBool::new(false));
        let cut_after_ms = Arc::new(AtomicU64::new(0));
        let accepted = Arc::new(AtomicUsize::new(0));
        let (flag, cut, count) = (paused.clone(), cut_after_ms.clone(), accepted.clone());
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                count.fetch_add(1, Ordering::SeqCst);
                let (flag, cut) = (flag.clone(), cut.clone());
                tokio::spawn(async move {
                    let opened = Instant::now();
                    let Ok(server) = tokio::net::TcpStream::connect(upstream).await else {
                        return;
                    };
                    let (cr, cw) = client.into_split();
                    let (sr, sw) = server.into_split();
                    let up = pump(cr, sw, flag.clone());
                    let down = pump(sr, cw, flag);
                    let cut_off = async {
                        loop {
                            let ms = cut.load(Ordering::SeqCst);
                            if ms > 0 && opened.elapsed() >= Duration::from_millis(ms) {
                                return;
                            }
                            tokio::time::sleep(Duration::from_millis(20)).await;
                        }
                    };
                    // Returning drops both sockets: the connection closes both ways.
                    tokio::select! {
                        _ = async { tokio::join!(up, down) } => {}
                        () = cut_off => {}
                    }
                });
            }
        });
        Partition {
            port,
            paused,
            cut_after_ms,
            accepted,
            task,
        }
    }

    /// `Some(d)`: from now on every connection, open or new, is closed `d` after it opened;
    /// `None`: they stay open again.
    pub fn cut_after(&self, after: Option<Duration>) {
        let ms = after.map_or(0, |d| {
            u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
        });
        self.cut_after_ms.store(ms, Ordering::SeqCst);
    }

    /// How many connections it accepted so far.
    pub fn accepted(&self) -> usize {
        self.accepted.load(Ordering::SeqCst)
    }

    /// `true`: every byte either way stops (connections stay open); `false`: they flow again.
    pub fn pause(&self, on: bool) {
        self.paused.store(on, Ordering::SeqCst);
    }

    /// The environment's kubeconfig, its server replaced by this forwarder (for a process).
    pub fn kubeconfig(&self, name: &str) -> PathBuf {
        let env = super::env();
        let text = std::fs::read_to_string(&env.kubeconfig).expect("read kubeconfig");
        let direct = format!("https://{}", api_server_addr());
        assert!(text.contains(&direct), "the kubeconfig names {direct}");
        let through = text.replace(&direct, &format!("https://127.0.0.1:{}", self.port));
        let path = super::root().join(format!(
            "target/kubeconfig-{name}-{}.yaml",
            std::process::id()
        ));
        std::fs::write(&path, through).expect("write the kubeconfig");
        path
    }

    /// A client for the API server that goes through this forwarder.
    pub async fn client(&self) -> kube::Client {
        let env = super::env();
        let mut kubeconfig =
            kube::config::Kubeconfig::read_from(&env.kubeconfig).expect("read kubeconfig");
        for named in &mut kubeconfig.clusters {
            if let Some(cluster) = named.cluster.as_mut() {
                cluster.server = Some(format!("https://127.0.0.1:{}", self.port));
            }
        }
        super::kube_client_of(kubeconfig).await
    }
}

impl Drop for Partition {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    paused: Arc<AtomicBool>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        while paused.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        while paused.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

/// The API server's address, from the environment's kubeconfig.
pub fn api_server_addr() -> std::net::SocketAddr {
    let env = super::env();
    let kubeconfig = kube::config::Kubeconfig::read_from(&env.kubeconfig).expect("read kubeconfig");
    let server = kubeconfig.clusters[0]
        .cluster
        .as_ref()
        .and_then(|c| c.server.clone())
        .expect("the kubeconfig names a server");
    let hostport = server
        .trim_start_matches("https://")
        .trim_end_matches('/')
        .to_string();
    hostport.parse().expect("the server is an IP:port")
}
