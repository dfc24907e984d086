//! RabbitMQ as the tests read it, never through Settle: one raw management API call (HTTP/1.0,
//! user guest) to the environment's management URL and one that must answer 200, a queue and
//! its bindings by name, a queue made as another application would make it, users and vhosts
//! (with a queue limit) of a test's own, and a RabbitMQ Backend's manifest. What a test asserts
//! about a queue's arguments, bindings or messages is read back through here.
//!
//! It must not decide what a test expects of Settle: the only statuses it asserts are those of
//! its own calls working (a read answering, a queue, user or vhost made); callers assert the rest.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use serde_json::Value;

/// One management API call, `method` on `path` (`/api/queues/%2f/NAME`): (status, body). Status
/// 0 when the answer has no status line.
pub fn management(method: &str, path: &str) -> (u16, String) {
    management_with(method, path, "")
}

/// [`management`] with a JSON request body. A GET that gets no answer within 10 s is asked
/// again, twice at most: the management API can take longer than that on a loaded machine (CI
/// saw a queue's GET time out), and a GET changes nothing.
pub fn management_with(method: &str, path: &str, json: &str) -> (u16, String) {
    management_at(&super::env().rabbitmq_management_url, method, path, json)
}

/// [`management_with`] on the management API at `base` (`http://127.0.0.1:<port>`; user
/// guest).
pub fn management_at(base: &str, method: &str, path: &str, json: &str) -> (u16, String) {
    let tries = if method == "GET" { 3 } else { 1 };
    for _ in 1..tries {
        if let Ok(answer) = management_once(base, method, path, json) {
            return answer;
        }
    }
    management_once(base, method, path, json)
        .unwrap_or_else(|e| panic!("{method} {path}: read: {e}"))
}

pub(crate) fn management_once(
    base: &str,
    method: &str,
    path: &str,
    json: &str,
) -> std::io::Result<(u16, String)> {
    let addr = base.trim_start_matches("http://").trim_end_matches('/');
    let mut s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("set a read timeout");
    let req = format!(
        "{method} {path} HTTP/1.0\r\nHost: {addr}\r\nAuthorization: Basic Z3Vlc3Q6Z3Vlc3Q=\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{json}",
        json.len()
    );
    s.write_all(req.as_bytes())
        .unwrap_or_else(|e| panic!("{method} {path}: send: {e}"));
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)?;
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    Ok((status, body.to_string()))
}

/// `s` as one segment of a management API path (`%` and `/` escaped).
pub fn encode(s: &str) -> String {
    s.replace('%', "%25").replace('/', "%2f")
}

/// A management API call that must answer 200: its body, parsed.
pub fn management_json(method: &str, path: &str) -> Value {
    let (status, body) = management(method, path);
    assert_eq!(status, 200, "{method} {path}: {body}");
    serde_json::from_str(&body).unwrap_or_else(|e| panic!("{method} {path}: {e}: {body}"))
}

/// Queue `name`'s bindings other than the default exchange's implicit one, as (exchange,
/// routing key), sorted.
pub fn bindings(name: &str) -> Vec<(String, String)> {
    let v = management_json("GET", &format!("/api/queues/%2f/{}/bindings", encode(name)));
    let mut out: Vec<(String, String)> = v
        .as_array()
        .expect("a list")
        .iter()
        .filter(|b| b["source"] != "")
        .map(|b| {
            (
                b["source"].as_str().unwrap_or_default().to_string(),
                b["routing_key"].as_str().unwrap_or_default().to_string(),
            )
        })
        .collect();
    out.sort();
    out
}

/// Publishes each `(routing key, body)` to `amq.topic` on a channel of `conn`'s own, each
/// confirmed by the broker (publisher confirms) before the next.
pub async fn publish_topic(
    conn: &lapin::Connection,
    messages: impl IntoIterator<Item = (String, String)>,
) {
    use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
    let ch = conn.create_channel().await.expect("channel");
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .expect("confirms");
    for (key, body) in messages {
        let confirm = ch
            .basic_publish(
                "amq.topic".into(),
                key.as_str().into(),
                BasicPublishOptions::default(),
                body.as_bytes(),
                lapin::BasicProperties::default(),
            )
            .await
            .expect("publish")
            .await
            .expect("confirmed");
        assert!(confirm.is_ack(), "the broker took the message to {key}");
    }
    let _ = ch.close(200, "published".into()).await;
}

/// [`rabbitmq_backend_yaml`] on the environment's RabbitMQ.
pub fn env_backend_yaml(name: &str, more: &str) -> String {
    let env = super::env();
    rabbitmq_backend_yaml(name, &env.rabbitmq_url, &env.rabbitmq_management_url, more)
}

/// A RabbitMQ Backend `name` on `url`, its management API at `management`, then `more` (lines
/// of `spec.rabbitmq`, indented four spaces).
pub fn rabbitmq_backend_yaml(name: &str, url: &str, management: &str, more: &str) -> String {
    format!(
        "apiVersion: messaging.settle.dev/v1alpha1\nkind: Backend\nmetadata: {{name: {name}}}\nspec:\n  rabbitmq:\n    urls: [\"{url}\"]\n    managementUrl: \"{management}\"\n{more}"
    )
}

/// Makes quorum queue `name` on the default vhost as another application would (no Settle
/// argument), holding `messages` messages.
pub fn foreign_queue(name: &str, messages: usize) {
    let (status, body) = management_with(
        "PUT",
        &format!("/api/queues/%2f/{name}"),
        r#"{"durable":true,"arguments":{"x-queue-type":"quorum"}}"#,
    );
    assert!(
        matches!(status, 201 | 204),
        "PUT queue {name}: {status} {body}"
    );
    put_messages(name, messages);
}

/// Puts `n` messages straight into queue `name` (the default exchange).
pub fn put_messages(name: &str, n: usize) {
    for i in 0..n {
        let (status, body) = management_with(
            "POST",
            "/api/exchanges/%2f/amq.default/publish",
            &format!(
                r#"{{"properties":{{"delivery_mode":2}},"routing_key":"{name}","payload":"m{i}","payload_encoding":"string"}}"#
            ),
        );
        assert!(
            status == 200 && body.contains(r#""routed":true"#),
            "publish to {name}: {status} {body}"
        );
    }
}

/// Queue `name` on the default vhost, `None` when it does not exist.
pub fn queue(name: &str) -> Option<Value> {
    let (status, body) = management("GET", &format!("/api/queues/%2f/{name}"));
    match status {
        200 => Some(serde_json::from_str(&body).expect("JSON")),
        404 => None,
        other => panic!("GET queue {name}: {other} {body}"),
    }
}

/// A RabbitMQ user of a test's own on one vhost, with `configure`, `write` and `read`
/// permission regexes; deleted when dropped.
pub struct User {
    pub name: String,
    pub password: String,
    /// The vhost its permissions are on, as the management API writes it (`%2f`: the default).
    pub vhost: String,
}

impl User {
    /// A user of the default vhost.
    pub fn create(name: &str, configure: &str, write: &str, read: &str) -> User {
        User::create_in("%2f", name, configure, write, read)
    }

    /// A user of `vhost` only (its name as the management API's paths take it).
    pub fn create_in(vhost: &str, name: &str, configure: &str, write: &str, read: &str) -> User {
        let password = format!("{name}-pw");
        let (status, body) = management_with(
            "PUT",
            &format!("/api/users/{name}"),
            &serde_json::json!({"password": password, "tags": ""}).to_string(),
        );
        assert!(
            matches!(status, 201 | 204),
            "create user {name}: {status} {body}"
        );
        let (status, body) = management_with(
            "PUT",
            &format!("/api/permissions/{vhost}/{name}"),
            &serde_json::json!({"configure": configure, "write": write, "read": read}).to_string(),
        );
        assert!(
            matches!(status, 201 | 204),
            "permissions of {name}: {status} {body}"
        );
        User {
            name: name.to_string(),
            password,
            vhost: vhost.to_string(),
        }
    }

    /// The environment's AMQP URL, as this user.
    pub fn url(&self) -> String {
        let url = super::env().rabbitmq_url;
        let (scheme, rest) = url.split_once("://").expect("an AMQP URL");
        let host = rest.split_once('@').map_or(rest, |(_, h)| h);
        format!("{scheme}://{}:{}@{host}", self.name, self.password)
    }

    /// The environment's AMQP URL, as this user, on `vhost`.
    pub fn url_on(&self, vhost: &str) -> String {
        vhost_url(&self.url(), vhost)
    }
}

impl Drop for User {
    fn drop(&mut self) {
        let _ = management("DELETE", &format!("/api/users/{}", self.name));
    }
}

/// `url` with its vhost (path) replaced by `vhost`.
pub fn vhost_url(url: &str, vhost: &str) -> String {
    let (scheme, rest) = url.split_once("://").expect("an AMQP URL");
    let authority = rest.split_once('/').map_or(rest, |(a, _)| a);
    format!("{scheme}://{authority}/{}", encode(vhost))
}

/// A vhost of one test's own (guest may use it), whose `max-queues` the test sets; deleted,
/// with its queues, when dropped. Its limit then holds back no other test's queues.
pub struct LimitedVhost(pub String);

impl LimitedVhost {
    pub fn create(name: &str) -> LimitedVhost {
        let (status, body) = management_with("PUT", &format!("/api/vhosts/{name}"), "{}");
        assert!(
            matches!(status, 201 | 204),
            "create vhost {name}: {status} {body}"
        );
        let (status, body) = management_with(
            "PUT",
            &format!("/api/permissions/{name}/guest"),
            &serde_json::json!({"configure": ".*", "write": ".*", "read": ".*"}).to_string(),
        );
        assert!(
            matches!(status, 201 | 204),
            "permissions on {name}: {status} {body}"
        );
        LimitedVhost(name.to_string())
    }

    /// How many queues it holds now.
    pub fn queues(&self) -> usize {
        management_json("GET", &format!("/api/queues/{}", self.0))
            .as_array()
            .map_or(0, Vec::len)
    }

    pub fn limit(&self, max: usize) {
        let (status, body) = management_with(
            "PUT",
            &format!("/api/vhost-limits/{}/max-queues", self.0),
            &serde_json::json!({ "value": max }).to_string(),
        );
        assert!(
            matches!(status, 201 | 204),
            "set max-queues: {status} {body}"
        );
    }
}

impl Drop for LimitedVhost {
    fn drop(&mut self) {
        let _ = management("DELETE", &format!("/api/vhosts/{}", self.0));
    }
}
