//! A network partition between a client and the environment's API server: a TCP forwarder that
//! can be made to hang (it holds its connections but passes no bytes either way), a kube client
//! and a kubeconfig file that go through it. The leader tests cut a leader off with it.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// A TCP forwarder to the API server; stops forwarding when dropped.
pub struct Partition {
    pub port: u16,
    paused: Arc<AtomicBool>,
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
        let flag = paused.clone();
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let flag = flag.clone();
                tokio::spawn(async move {
                    let Ok(server) = tokio::net::TcpStream::connect(upstream).await else {
                        return;
                    };
                    let (cr, cw) = client.into_split();
                    let (sr, sw) = server.into_split();
                    let up = pump(cr, sw, flag.clone());
                    let down = pump(sr, cw, flag);
                    let _ = tokio::join!(up, down);
                });
            }
        });
        Partition { port, paused, task }
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
