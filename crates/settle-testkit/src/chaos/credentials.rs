//! The Backend's credentials rotated under load (the campaign's `CredentialsRotated` fault).
//! The operators reach the broker as a user of their own, named in the Backend's Secret, which
//! takes turns between two users ([`USERS`]); the applications and the campaign's own clients
//! are other users, which a rotation leaves alone. A rotation admits the other user on the
//! broker, points the Secret at it, waits until no connection of the broker uses the old user
//! (the operators connected again with the new Secret), and then revokes the old one: on NATS
//! the server's configuration reloaded without it (SIGHUP), on RabbitMQ the user deleted.
//! ElasticMQ checks no credentials: on SQS the Secret's keys change and nothing is revoked.
//! The environment's NATS cluster serves other tests, without users: no rotation there.
//!
//! It must not judge what a rotation costs (nothing, by the semantics: the checker holds every
//! counter exact and every condition caused across it).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use super::broker::Target;
use crate::rabbitmq::management_at;
use crate::subs::apply;

/// The two users the operators' Secret takes turns naming.
pub(super) const USERS: [&str; 2] = ["settle-a", "settle-b"];

/// The Secret the Backend's `credentialsSecretRef` names.
pub(super) const SECRET: &str = "broker-creds";

/// How long the operators may take to connect again with the new Secret.
const MOVED_WITHIN: Duration = Duration::from_secs(60);

/// How the campaign's broker is reached, and which of [`USERS`] the Secret names now.
pub(super) struct Access {
    pub(super) kind: Kind,
    pub(super) user: usize,
}

pub(super) enum Kind {
    /// The campaign's own nats-server: its configuration file and monitoring port.
    Nats {
        config: PathBuf,
        monitor: u16,
    },
    /// The campaign's own node: its management API.
    Rabbitmq {
        management: String,
    },
    Sqs,
    /// The environment's cluster: no users.
    None,
}

/// A nats-server configuration admitting `admin` (the campaign's clients), `app` (the
/// applications) and `operators` of [`USERS`], each with the password `<user>-pw`.
pub(super) fn nats_config(operators: &[&str]) -> String {
    let users: Vec<String> = ["admin", "app"]
        .iter()
        .chain(operators)
        .map(|u| format!("    {{user: {u}, password: {u}-pw}}"))
        .collect();
    format!(
        "authorization {{\n  users: [\n{}\n  ]\n}}\n",
        users.join("\n")
    )
}

/// The Backend's Secret in `ns`, naming `user` as `kind` wants it.
pub(super) fn secret(ns: &str, kind: &Kind, user: &str) {
    let data = match kind {
        Kind::Nats { .. } => format!("  user: {user}\n  password: {user}-pw\n"),
        Kind::Rabbitmq { .. } => format!("  username: {user}\n  password: {user}-pw\n"),
        Kind::Sqs | Kind::None => {
            format!("  accessKeyId: {user}\n  secretAccessKey: {user}-key\n")
        }
    };
    apply(
        ns,
        &format!(
            "apiVersion: v1\nkind: Secret\nmetadata:\n  name: {SECRET}\n  labels: {{settle.dev/backend-credentials: \"true\"}}\nstringData:\n{data}"
        ),
    );
}

/// RabbitMQ user `user` made (or its password set again), administrator of vhost `/`.
pub(super) fn rabbitmq_user(management: &str, user: &str) {
    let (status, body) = management_at(
        management,
        "PUT",
        &format!("/api/users/{user}"),
        &format!(r#"{{"password":"{user}-pw","tags":"administrator"}}"#),
    );
    assert!(matches!(status, 201 | 204), "user {user}: {status} {body}");
    let (status, body) = management_at(
        management,
        "PUT",
        &format!("/api/permissions/%2f/{user}"),
        r#"{"configure":".*","write":".*","read":".*"}"#,
    );
    assert!(
        matches!(status, 201 | 204),
        "permissions of {user}: {status} {body}"
    );
}

impl Access {
    /// Removes what it kept on the machine (the nats-server's configuration file).
    pub(super) fn remove(self) {
        if let Kind::Nats { config, .. } = self.kind {
            let _ = std::fs::remove_file(config);
        }
    }

    /// Rotates the Backend's credentials in `ns` on `target`; says what was done.
    pub(super) async fn rotate(&mut self, target: &Target, ns: &str) -> String {
        let (old, new) = (USERS[self.user], USERS[1 - self.user]);
        let started = Instant::now();
        match &self.kind {
            Kind::None => return "credentials left as they are (the cluster has no users)".into(),
            Kind::Sqs => {
                secret(ns, &self.kind, new);
                self.user = 1 - self.user;
                return format!(
                    "the Backend's Secret moved from key {old} to {new} (ElasticMQ checks none: nothing revoked)"
                );
            }
            Kind::Nats { config, .. } => {
                std::fs::write(config, nats_config(&[old, new])).expect("the configuration");
                target.reload_nats();
            }
            Kind::Rabbitmq { management } => rabbitmq_user(management, new),
        }
        secret(ns, &self.kind, new);
        let deadline = Instant::now() + MOVED_WITHIN;
        loop {
            let users = self.connected();
            if !users.iter().any(|u| u == old) && users.iter().any(|u| u == new) {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the operators still connect as {old}, or not as {new}, {} s after the Secret moved: {users:?}",
                MOVED_WITHIN.as_secs()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let moved = started.elapsed();
        match &self.kind {
            Kind::Nats { config, .. } => {
                std::fs::write(config, nats_config(&[new])).expect("the configuration");
                target.reload_nats();
            }
            Kind::Rabbitmq { management } => {
                let (status, body) =
                    management_at(management, "DELETE", &format!("/api/users/{old}"), "");
                assert!(
                    matches!(status, 200 | 204),
                    "user {old} deleted: {status} {body}"
                );
            }
            Kind::Sqs | Kind::None => {}
        }
        self.user = 1 - self.user;
        format!(
            "the Backend's Secret moved from user {old} to {new}, no connection as {old} {:.1} s later, {old} then revoked on the broker",
            moved.as_secs_f64()
        )
    }

    /// The user of each client connection of the broker.
    fn connected(&self) -> Vec<String> {
        match &self.kind {
            Kind::Nats { monitor, .. } => {
                // HTTP/1.0, so a long answer is not chunked.
                let (status, body) = management_at(
                    &format!("http://127.0.0.1:{monitor}"),
                    "GET",
                    "/connz?auth=1&limit=1000",
                    "",
                );
                if status != 200 {
                    return Vec::new();
                }
                let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
                v["connections"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|c| c["authorized_user"].as_str().map(str::to_string))
                    .collect()
            }
            Kind::Rabbitmq { management } => {
                let (status, body) =
                    management_at(management, "GET", "/api/connections?columns=user", "");
                if status != 200 {
                    return Vec::new();
                }
                serde_json::from_str::<Vec<serde_json::Value>>(&body)
                    .unwrap_or_default()
                    .iter()
                    .filter_map(|c| c["user"].as_str().map(str::to_string))
                    .collect()
            }
            Kind::Sqs | Kind::None => Vec::new(),
        }
    }
}

impl Target {
    /// The campaign's nats-server reloads its configuration (SIGHUP).
    fn reload_nats(&self) {
        let Target::Nats(_, server) = self else {
            return;
        };
        if let Some(pid) = server.pid() {
            let _ = std::process::Command::new("kill")
                .args(["-HUP", &pid.to_string()])
                .status();
        }
    }
}
