//! The environment's Kubernetes node (`hack/env.sh up --node`, hack/node.sh) is the real one and
//! keeps to its bounds: it is Ready, its API server and the environment's say the pinned release
//! (the version stamp kubectl and Helm read), every socket its components listen on is on
//! 127.0.0.1 or the bridge address, and a second node on the same machine is refused with a
//! message that names the one running, without touching it.
//!
//! The pod suite (crates/settle-e2e/tests/pods.rs) runs Settle on this node; these tests check the node itself.

use settle_testkit as common;

use std::collections::BTreeSet;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

use common::node::Node;

fn node() -> Node {
    Node::from_env()
}

/// The node's state directory: the kubeconfig is `<state>/cp/kubeconfig`.
fn node_state() -> PathBuf {
    node()
        .kubeconfig
        .parent()
        .and_then(Path::parent)
        .expect("the node's kubeconfig lies in <state>/cp/")
        .to_path_buf()
}

fn pinned_release() -> String {
    std::fs::read_to_string(common::root().join("hack/controlplane/VERSION"))
        .expect("hack/controlplane/VERSION")
        .trim()
        .to_string()
}

#[test]
fn the_node_is_ready_on_the_bridge_and_both_api_servers_say_the_pinned_release() {
    let n = node();
    let (node_ip, name) = (n.ip.clone(), n.name.clone());
    let node = n.get_json(&["get", "node", &name]);
    let ready = node["status"]["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|c| c["type"] == "Ready");
    assert_eq!(
        ready.map(|c| c["status"].clone()),
        Some(Value::from("True")),
        "{node}"
    );
    let addresses = &node["status"]["addresses"];
    assert!(
        addresses
            .as_array()
            .into_iter()
            .flatten()
            .any(|a| a["type"] == "InternalIP" && a["address"] == node_ip.as_str()),
        "the API server reaches the kubelet by this InternalIP, never by a name: {addresses}"
    );
    assert_eq!(
        node["status"]["nodeInfo"]["kubeletVersion"],
        pinned_release().as_str(),
        "the kubelet is the pinned release, stamped"
    );

    // Pods reach the API server through the `kubernetes` Service: its endpoint is the bridge.
    let slices = n.get_json(&[
        "get",
        "endpointslices",
        "-n",
        "default",
        "-l",
        "kubernetes.io/service-name=kubernetes",
    ]);
    let endpoints: Vec<&Value> = slices["items"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|s| s["endpoints"].as_array().into_iter().flatten())
        .flat_map(|e| e["addresses"].as_array().into_iter().flatten())
        .collect();
    assert_eq!(endpoints, vec![&Value::from(node_ip)], "{slices}");

    let version: Value = serde_json::from_str(&n.kubectl_ok(&["get", "--raw", "/version"], None))
        .expect("/version as JSON");
    assert_eq!(
        version["gitVersion"],
        pinned_release().as_str(),
        "{version}"
    );
    let env_version: Value =
        serde_json::from_str(&common::kubectl_ok(&["get", "--raw", "/version"], None))
            .expect("/version as JSON");
    assert_eq!(
        env_version["gitVersion"],
        pinned_release().as_str(),
        "the environment's API server is stamped too: {env_version}"
    );
}

/// Listening TCP sockets (address, port) by socket inode, from /proc/net/tcp and tcp6.
fn listening_sockets() -> Vec<(String, String, u16)> {
    let mut out = Vec::new();
    for (table, v6) in [("/proc/net/tcp", false), ("/proc/net/tcp6", true)] {
        let Ok(text) = std::fs::read_to_string(table) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() < 10 || f[3] != "0A" {
                continue;
            }
            let Some((addr, port)) = f[1].split_once(':') else {
                continue;
            };
            let port = u16::from_str_radix(port, 16).unwrap_or(0);
            let addr = if v6 {
                format!("[{addr}]")
            } else {
                let n = u32::from_str_radix(addr, 16).unwrap_or(0);
                Ipv4Addr::from(n.to_le_bytes()).to_string()
            };
            out.push((format!("socket:[{}]", f[9]), addr, port));
        }
    }
    out
}

/// The session id of a process (hack/lib.sh's spawn starts each component in its own session).
fn session_of(pid: &str) -> Option<String> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = stat.rsplit_once(')')?.1;
    rest.split_whitespace().nth(3).map(str::to_string)
}

#[test]
fn every_socket_the_node_listens_on_is_on_loopback_or_the_bridge() {
    let node_ip = node().ip;
    let state = node_state();
    let sessions: BTreeSet<String> = std::fs::read_dir(&state)
        .expect("the node's state directory")
        .filter_map(|e| e.ok())
        .filter(|e| e.path().extension().is_some_and(|x| x == "pid"))
        .filter_map(|e| std::fs::read_to_string(e.path()).ok())
        .map(|p| p.trim().to_string())
        .collect();
    assert!(
        sessions.len() >= 6,
        "containerd, kube-apiserver+etcd, kube-controller-manager, kube-scheduler, kubelet and kube-proxy have pid files in {}: {sessions:?}",
        state.display()
    );
    let sockets = listening_sockets();
    let mut seen = Vec::new();
    for pid in std::fs::read_dir("/proc")
        .expect("/proc")
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|p| p.chars().all(|c| c.is_ascii_digit()))
    {
        if !session_of(&pid).is_some_and(|s| sessions.contains(&s)) {
            continue;
        }
        let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
        let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
            continue;
        };
        for fd in fds.filter_map(|e| e.ok()) {
            let Ok(target) = std::fs::read_link(fd.path()) else {
                continue;
            };
            let target = target.to_string_lossy();
            for (inode, addr, port) in &sockets {
                if *inode == target {
                    seen.push((comm.trim().to_string(), addr.clone(), *port));
                }
            }
        }
    }
    assert!(
        seen.iter().any(|(_, a, _)| *a == node_ip),
        "the API server and the kubelet listen on the bridge: {seen:?}"
    );
    let elsewhere: Vec<_> = seen
        .iter()
        .filter(|(_, a, _)| *a != "127.0.0.1" && *a != node_ip)
        .collect();
    assert!(
        elsewhere.is_empty(),
        "every listener is on 127.0.0.1 or {node_ip}; these are not: {elsewhere:?}"
    );
}

#[test]
fn a_second_node_on_the_machine_is_refused_and_the_running_one_is_untouched() {
    let other = tempfile::tempdir().expect("a temporary directory");
    let out = Command::new(common::root().join("hack/node.sh"))
        .arg("up")
        .env("SETTLE_ENV_DIR", other.path())
        .output()
        .expect("run hack/node.sh");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "a second node started: {stderr}");
    let owner = node_state();
    assert!(
        stderr.contains(&format!(
            "a Settle node already runs on this machine (state {})",
            owner.display()
        )),
        "the refusal names the running node: {stderr}"
    );
    assert!(
        stderr.contains("hack/env.sh down"),
        "the refusal says how to stop it: {stderr}"
    );
    assert!(
        !other.path().join("node/containerd.pid").exists(),
        "nothing was started for the second node"
    );
    // The running node still answers and is Ready.
    let n = node();
    let ready = n.kubectl_ok(
        &[
            "get",
            "node",
            &n.name,
            "-o",
            "jsonpath={.status.conditions[?(@.type==\"Ready\")].status}",
        ],
        None,
    );
    assert_eq!(ready.trim(), "True");
}
