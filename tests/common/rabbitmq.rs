//! RabbitMQ's management API as the tests read it, never through Settle: one raw call (HTTP/1.0,
//! user guest) to the environment's management URL, a queue by name, a queue made as
//! another application would make it, and users of a test's own. What a test asserts
//! about a queue's arguments, bindings or messages is read back through here.
//!
//! It must not decide what a test expects (a status code, a body): callers assert that.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use serde_json::Value;

/// One management API call, `method` on `path` (`/api/queues/%2f/NAME`): (status, body). Status
/// 0 when the answer has no status line.
pub fn management(method: &str, path: &str) -> (u16, String) {
    management_with(method, path, "")
}

/// [`management`] with a JSON request body.
pub fn management_with(method: &str, path: &str, json: &str) -> (u16, String) {
    let base = super::env().rabbitmq_management_url;
    let addr = base.trim_start_matches("http://").trim_end_matches('/');
    let mut s = TcpStream::connect(addr).unwrap_or_else(|e| panic!("connect to {addr}: {e}"));
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("set a read timeout");
    let req = format!(
        "{method} {path} HTTP/1.0\r\nHost: {addr}\r\nAuthorization: Basic Z3Vlc3Q6Z3Vlc3Q=\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{json}",
        json.len()
    );
    s.write_all(req.as_bytes())
        .unwrap_or_else(|e| panic!("{method} {path}: send: {e}"));
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)
        .unwrap_or_else(|e| panic!("{method} {path}: read: {e}"));
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    (status, body.to_string())
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

/// A RabbitMQ user of a test's own on the default vhost, with `configure`, `write` and `read`
/// permission regexes; deleted when dropped.
pub struct User {
    pub name: String,
    pub password: String,
}

impl User {
    pub fn create(name: &str, configure: &str, write: &str, read: &str) -> User {
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
            &format!("/api/permissions/%2f/{name}"),
            &serde_json::json!({"configure": configure, "write": write, "read": read}).to_string(),
        );
        assert!(
            matches!(status, 201 | 204),
            "permissions of {name}: {status} {body}"
        );
        User {
            name: name.to_string(),
            password,
        }
    }

    /// The environment's AMQP URL, as this user.
    pub fn url(&self) -> String {
        let url = super::env().rabbitmq_url;
        let (scheme, rest) = url.split_once("://").expect("an AMQP URL");
        let host = rest.split_once('@').map_or(rest, |(_, h)| h);
        format!("{scheme}://{}:{}@{host}", self.name, self.password)
    }
}

impl Drop for User {
    fn drop(&mut self) {
        let _ = management("DELETE", &format!("/api/users/{}", self.name));
    }
}
