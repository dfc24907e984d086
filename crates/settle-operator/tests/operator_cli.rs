//! `settle operator` as docs/reference/flags.md describes it: every flag in its table with the
//! env fallback and default the built binary's `--help` really prints (and no flag the table
//! leaves out; crates/settle-operator/tests/reference.rs makes that page from clap, this checks it against the binary),
//! one env fallback exercised for real, and `/healthz` / `/readyz` (on the probe port) before
//! and after the Backend cache syncs.

use settle_testkit as common;

use std::collections::BTreeMap;
use std::net::{TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::free_port;
use common::process::{Killed, poll_until};

/// One row of the flag reference's table: its env variable and default (None: "none").
#[derive(Debug, PartialEq)]
struct Flag {
    env: String,
    default: Option<String>,
}

fn backticked(cell: &str) -> Vec<String> {
    cell.split('`')
        .skip(1)
        .step_by(2)
        .map(str::to_string)
        .collect()
}

/// docs/reference/flags.md's `| flag | env | default | description |` table, by flag: one flag
/// and one env variable a row, the default backticked or `none`.
fn reference_flags() -> BTreeMap<String, Flag> {
    let path = common::root().join("docs/reference/flags.md");
    let page = std::fs::read_to_string(&path).expect("docs/reference/flags.md");
    let table = page
        .split("| flag | env | default | description |")
        .nth(1)
        .expect("docs/reference/flags.md has a `| flag | env | default | description |` table");
    let mut out = BTreeMap::new();
    for line in table.lines().skip(2) {
        if !line.starts_with('|') {
            break;
        }
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        let (flags, envs, default) = (backticked(cells[1]), backticked(cells[2]), cells[3]);
        assert_eq!(
            (flags.len(), envs.len()),
            (1, 1),
            "one flag and one env a row: {line}"
        );
        let default = default
            .starts_with('`')
            .then(|| backticked(default)[0].clone());
        out.insert(
            flags[0].clone(),
            Flag {
                env: envs[0].clone(),
                default,
            },
        );
    }
    assert!(out.len() >= 10, "the flag table was found: {out:?}");
    out
}

/// `settle operator --help`, by flag: `[env: NAME=]` and `[default: X]` as clap prints them.
fn help_flags() -> BTreeMap<String, Flag> {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_settle"));
    cmd.args(["operator", "--help"]);
    // A variable set in the test's own environment would show as the value: clear them all.
    for (k, _) in std::env::vars() {
        if k.starts_with("SETTLE_") {
            cmd.env_remove(k);
        }
    }
    let out = cmd.output().expect("settle operator --help");
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout).into_owned();
    let mut out = BTreeMap::new();
    let mut current: Option<String> = None;
    for line in help.lines() {
        let t = line.trim_start();
        if t.starts_with("--") || t.starts_with("-h, --") {
            let name = t
                .trim_start_matches("-h, ")
                .split([' ', '['])
                .next()
                .expect("a flag name");
            current = (name != "--help").then(|| name.to_string());
            continue;
        }
        let Some(flag) = &current else { continue };
        let bracket = |key: &str| {
            t.split(&format!("[{key}: "))
                .nth(1)
                .map(|rest| rest.split(']').next().expect("closing bracket").to_string())
        };
        if let Some(env) = bracket("env") {
            out.insert(
                flag.clone(),
                Flag {
                    env: env.trim_end_matches('=').to_string(),
                    default: bracket("default"),
                },
            );
        }
    }
    out
}

#[test]
fn every_operator_flag_has_the_env_fallback_and_default_the_flag_reference_gives() {
    let reference = reference_flags();
    let help = help_flags();
    assert_eq!(
        help.keys().collect::<Vec<_>>(),
        reference.keys().collect::<Vec<_>>(),
        "docs/reference/flags.md and `settle operator --help` list the same flags (with an env \
         fallback each)"
    );
    for (flag, want) in &reference {
        assert_eq!(
            &help[flag], want,
            "{flag}: docs/reference/flags.md vs --help"
        );
    }
}

/// GET `path` on 127.0.0.1:`port`: (status code, body), or None while nothing answers.
fn get(port: u16, path: &str) -> Option<(u16, String)> {
    let out = common::http_get(port, path)?;
    let code = out.split(' ').nth(1)?.parse().ok()?;
    let body = out.split("\r\n\r\n").nth(1).unwrap_or_default().to_string();
    Some((code, body))
}

/// A port on 127.0.0.1 that is ours from now on but where nothing listens yet: a connection to
/// it is refused, and no other process (tests run in parallel) can take it before `forward`.
fn held_port() -> (socket2::Socket, u16) {
    use socket2::{Domain, Socket, Type};
    let socket = Socket::new(Domain::IPV4, Type::STREAM, None).expect("a TCP socket");
    let any: std::net::SocketAddr = "127.0.0.1:0".parse().expect("an address");
    socket
        .bind(&any.into())
        .expect("bind a free port on 127.0.0.1");
    let port = socket
        .local_addr()
        .expect("the bound address")
        .as_socket()
        .expect("an IP address")
        .port();
    (socket, port)
}

/// Listens on the `held` port and forwards every connection to `upstream`, from now on
/// (threads; they end with the test process).
fn forward(held: socket2::Socket, upstream: String) {
    held.listen(128).expect("listen on the held port");
    let listener: TcpListener = held.into();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(down) = conn else { continue };
            let Ok(up) = TcpStream::connect(&upstream) else {
                continue;
            };
            let (mut d2, mut u2) = (
                down.try_clone().expect("clone"),
                up.try_clone().expect("clone"),
            );
            let (mut d1, mut u1) = (down, up);
            std::thread::spawn(move || {
                let _ = std::io::copy(&mut d1, &mut u1);
                let _ = u1.shutdown(std::net::Shutdown::Write);
            });
            std::thread::spawn(move || {
                let _ = std::io::copy(&mut u2, &mut d2);
                let _ = d2.shutdown(std::net::Shutdown::Write);
            });
        }
    });
}

#[test]
fn healthz_answers_at_once_and_readyz_only_after_the_backend_cache_synced() {
    // The environment's API server, reached through a port where nothing listens yet: the
    // operator starts against an API server that does not answer.
    common::install_crds();
    let env = common::env();
    let kubeconfig = std::fs::read_to_string(&env.kubeconfig).expect("read the kubeconfig");
    let upstream = kubeconfig
        .lines()
        .find_map(|l| l.trim().strip_prefix("server: https://"))
        .expect("the kubeconfig names its server")
        .to_string();
    let (api_socket, api_port) = held_port();
    let dir = tempfile::tempdir().expect("tempdir");
    let late = dir.path().join("kubeconfig");
    std::fs::write(
        &late,
        kubeconfig.replace(
            &format!("server: https://{upstream}"),
            &format!("server: https://127.0.0.1:{api_port}"),
        ),
    )
    .expect("write the kubeconfig");

    // Certificates from files and no leader election: nothing else needs the API server first.
    let bundle = settle_operator::admission::certs::issue_for(
        &settle_operator::admission::certs::Sans {
            dns_names: vec![],
            ip_addresses: vec!["127.0.0.1".parse().expect("ip")],
        },
        Duration::from_secs(3600),
    )
    .expect("issue a certificate");
    let (cert, key) = (dir.path().join("tls.crt"), dir.path().join("tls.key"));
    std::fs::write(&cert, &bundle.cert_pem).expect("write tls.crt");
    std::fs::write(&key, &bundle.key_pem).expect("write tls.key");

    let metrics_port = free_port();
    let probe_port = free_port();
    // Under target/, so a failed run leaves its log behind.
    let log_path = common::root().join(format!("target/operator-cli-{}.log", std::process::id()));
    let log = std::fs::File::create(&log_path).expect("log file");
    let mut operator = Killed::spawn(
        "settle operator",
        Command::new(env!("CARGO_BIN_EXE_settle"))
            .args(["operator", "--log-format", "text"])
            .args(["--webhook-addr", &format!("127.0.0.1:{}", free_port())])
            .arg("--tls-cert-file")
            .arg(&cert)
            .arg("--tls-key-file")
            .arg(&key)
            .args(["--leader-election=false"])
            // Its controllers watch a namespace of their own, empty: test binaries run side by
            // side, and an operator watching every namespace would reconcile theirs too.
            .args([
                "--watch-namespaces",
                &format!("operator-cli-{}-unwatched", std::process::id()),
            ])
            // The metrics address only by its env fallback: the flag's default (0.0.0.0:8080)
            // would not answer on this port.
            .env("SETTLE_METRICS_ADDR", format!("127.0.0.1:{metrics_port}"))
            // The probes' own port, also by its env fallback (the kubelet's, apart from scrapes).
            .env("SETTLE_PROBE_ADDR", format!("127.0.0.1:{probe_port}"))
            .env("KUBECONFIG", &late)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log),
    );
    let log_tail = || std::fs::read_to_string(&log_path).unwrap_or_default();

    poll_until(
        "/healthz on the port SETTLE_PROBE_ADDR names",
        Duration::from_secs(60),
        || {
            operator.assert_running();
            get(probe_port, "/healthz").is_some()
        },
    );
    assert_eq!(
        get(probe_port, "/healthz"),
        Some((200, "ok\n".into())),
        "{}",
        log_tail()
    );
    // Not ready while the API server does not answer: asked several times over two seconds.
    for _ in 0..10 {
        assert_eq!(
            get(probe_port, "/readyz"),
            Some((503, "the Backend cache has not synced yet\n".into())),
            "{}",
            log_tail()
        );
        std::thread::sleep(Duration::from_millis(200));
    }

    // The API server becomes reachable: ready once the Backend watch has listed.
    forward(api_socket, upstream);
    poll_until(
        &format!(
            "/readyz to answer 200 once the API server is reachable (log: {})",
            log_path.display()
        ),
        Duration::from_secs(90),
        || {
            operator.assert_running();
            get(probe_port, "/readyz").is_some_and(|(code, _)| code == 200)
        },
    );
    assert_eq!(get(probe_port, "/readyz"), Some((200, "ok\n".into())));
    assert_eq!(get(probe_port, "/healthz"), Some((200, "ok\n".into())));
    // The metrics port still answers the probes' paths, for scripts that look there; its
    // /readyz also waits for the leader's controllers, which sync right after.
    poll_until(
        "/readyz on the metrics port once the controllers synced too",
        Duration::from_secs(60),
        || get(metrics_port, "/readyz") == Some((200, "ok\n".into())),
    );
    drop(operator);
    let _ = std::fs::remove_file(&log_path);
}

/// Test binaries run side by side on one API server: an operator a test starts that watched
/// every namespace would reconcile the other suites' objects (and connect to the brokers their
/// Backends name). Every place that starts `settle operator` for a test names the namespaces its
/// controllers watch.
#[test]
fn every_operator_a_test_starts_watches_only_namespaces_it_names() {
    let root = common::root();
    let mut files = Vec::new();
    let mut dirs = vec![root.join("crates")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir)
            .expect("read a source folder")
            .flatten()
        {
            let path = entry.path();
            if path.is_dir() && !path.ends_with("target") {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs")
                && (path.components().any(|c| c.as_os_str() == "tests")
                    || path.starts_with(root.join("crates/settle-testkit")))
            {
                files.push(path);
            }
        }
    }
    // Built here, so that this file's own text does not match.
    let start = format!("[{:?}, {:?}", "operator", "--log-format");
    let starters: Vec<_> = files
        .iter()
        .filter(|p| std::fs::read_to_string(p).is_ok_and(|t| t.contains(&start)))
        .collect();
    assert!(starters.len() >= 5, "found {starters:?}");
    // The flag within the lines that build the command (the next 25).
    for path in starters {
        let text = std::fs::read_to_string(path).expect("read");
        let lines: Vec<&str> = text.lines().collect();
        for (i, _) in lines.iter().enumerate().filter(|(_, l)| l.contains(&start)) {
            assert!(
                lines[i..(i + 25).min(lines.len())]
                    .iter()
                    .any(|l| l.contains("\"--watch-namespaces\"")),
                "{}:{} starts `settle operator` without --watch-namespaces",
                path.display(),
                i + 1
            );
        }
    }
}
