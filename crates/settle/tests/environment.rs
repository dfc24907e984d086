//! The brokers of the environment are the real ones, reachable where the env file says: RabbitMQ
//! speaks AMQP 0-9-1 and its management API reports the 3.10 series, and ElasticMQ creates
//! queues whose URLs carry its real host and port and round-trips a message through one.
//!
//! Plain sockets and HTTP/1.0 on purpose: these tests check the environment, not a client
//! library, and must not depend on the broker crates the backends bring in.

use settle_testkit as common;

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

const IO_TIMEOUT: Duration = Duration::from_secs(10);

/// `host:port` of an `scheme://[user@]host:port[/path]` URL.
fn authority(url: &str) -> String {
    let rest = url
        .split_once("://")
        .map(|(_, r)| r)
        .unwrap_or_else(|| panic!("{url} has no scheme"));
    let hostport = rest.split('/').next().unwrap_or(rest);
    let hostport = hostport.rsplit_once('@').map_or(hostport, |(_, h)| h);
    assert!(
        hostport.starts_with("127.0.0.1:"),
        "{url}: the environment binds 127.0.0.1 only"
    );
    hostport.to_string()
}

fn connect(addr: &str) -> TcpStream {
    let stream = TcpStream::connect(addr).unwrap_or_else(|e| {
        panic!("connect to {addr}: {e} (is the environment up? `make env-up`)")
    });
    stream.set_read_timeout(Some(IO_TIMEOUT)).expect("timeout");
    stream.set_write_timeout(Some(IO_TIMEOUT)).expect("timeout");
    stream
}

/// One HTTP/1.0 exchange (the server closes, so the body is everything after the headers).
fn http(
    method: &str,
    base: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> (u16, String) {
    let addr = authority(base);
    let mut stream = connect(&addr);
    let mut req = format!(
        "{method} {path} HTTP/1.0\r\nHost: {addr}\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    stream.write_all(req.as_bytes()).expect("send request");
    stream.write_all(body).expect("send body");
    let mut raw = Vec::new();
    stream
        .read_to_end(&mut raw)
        .unwrap_or_else(|e| panic!("{method} {base}{path}: no complete answer: {e}"));
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = text
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("{method} {base}{path}: malformed answer {text:?}"));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("{method} {base}{path}: no status in {head:?}"));
    (status, body.to_string())
}

// --- RabbitMQ ------------------------------------------------------------------------------

/// A reader over an AMQP 0-9-1 method payload.
struct Amqp<'a>(&'a [u8]);

impl Amqp<'_> {
    fn take(&mut self, n: usize) -> &[u8] {
        assert!(self.0.len() >= n, "AMQP payload ends early");
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        head
    }
    fn u8(&mut self) -> u8 {
        self.take(1)[0]
    }
    fn u16(&mut self) -> u16 {
        u16::from_be_bytes(self.take(2).try_into().expect("2 bytes"))
    }
    fn u32(&mut self) -> u32 {
        u32::from_be_bytes(self.take(4).try_into().expect("4 bytes"))
    }
    fn short_str(&mut self) -> String {
        let n = self.u8() as usize;
        String::from_utf8_lossy(self.take(n)).into_owned()
    }
    fn long_str(&mut self) -> String {
        let n = self.u32() as usize;
        String::from_utf8_lossy(self.take(n)).into_owned()
    }
    /// A field table, values rendered as text (nested tables as `{..}`).
    fn table(&mut self) -> BTreeMap<String, String> {
        let n = self.u32() as usize;
        let mut inner = Amqp(self.take(n));
        let mut out = BTreeMap::new();
        while !inner.0.is_empty() {
            let key = inner.short_str();
            let value = match inner.u8() {
                b'S' => inner.long_str(),
                b't' => (inner.u8() != 0).to_string(),
                b'F' => format!("{:?}", inner.table()),
                b'I' => (inner.u32() as i32).to_string(),
                other => panic!(
                    "field {key}: unexpected AMQP field type {:?}",
                    other as char
                ),
            };
            out.insert(key, value);
        }
        out
    }
}

#[test]
fn rabbitmq_answers_the_amqp_0_9_1_header_with_connection_start() {
    let env = common::env();
    let mut stream = connect(&authority(&env.rabbitmq_url));
    stream
        .write_all(b"AMQP\x00\x00\x09\x01")
        .expect("send protocol header");

    let mut header = [0u8; 7];
    stream
        .read_exact(&mut header)
        .expect("a frame header in answer to the protocol header");
    assert_eq!(header[0], 1, "a method frame, got frame type {}", header[0]);
    assert_eq!(u16::from_be_bytes([header[1], header[2]]), 0, "channel 0");
    let size = u32::from_be_bytes([header[3], header[4], header[5], header[6]]) as usize;
    let mut payload = vec![0u8; size + 1];
    stream.read_exact(&mut payload).expect("the whole frame");
    assert_eq!(payload[size], 0xCE, "frame-end octet");

    let mut method = Amqp(&payload[..size]);
    assert_eq!(
        (method.u16(), method.u16()),
        (10, 10),
        "class 10 method 10 is Connection.Start"
    );
    assert_eq!((method.u8(), method.u8()), (0, 9), "protocol version 0-9");
    let server = method.table();
    assert_eq!(
        server.get("product").map(String::as_str),
        Some("RabbitMQ"),
        "{server:?}"
    );
    let version = server.get("version").cloned().unwrap_or_default();
    assert!(
        version.starts_with("3.10."),
        "RabbitMQ 3.10.x expected, got {version:?}"
    );
    let mechanisms = method.long_str();
    assert!(
        mechanisms.split(' ').any(|m| m == "PLAIN"),
        "PLAIN (user guest) offered: {mechanisms:?}"
    );
    assert!(method.0.len() > 4, "locales follow the mechanisms");
}

#[test]
fn rabbitmq_management_api_reports_3_10_and_the_amqp_listener_of_the_env_file() {
    let env = common::env();
    // guest:guest
    let auth = [("Authorization", "Basic Z3Vlc3Q6Z3Vlc3Q=")];
    let (status, body) = http(
        "GET",
        &env.rabbitmq_management_url,
        "/api/overview",
        &auth,
        b"",
    );
    assert_eq!(status, 200, "GET /api/overview: {body}");
    let overview: Value = serde_json::from_str(&body).expect("overview is JSON");
    let version = overview["rabbitmq_version"].as_str().unwrap_or_default();
    assert!(
        version.starts_with("3.10."),
        "RabbitMQ 3.10.x expected, got {version:?}"
    );
    let listeners = overview["listeners"].as_array().expect("listeners");
    let amqp_port: u64 = authority(&env.rabbitmq_url)
        .rsplit_once(':')
        .and_then(|(_, p)| p.parse().ok())
        .expect("port in SETTLE_RABBITMQ_URL");
    assert!(
        listeners.iter().any(|l| l["protocol"] == "amqp"
            && l["port"] == amqp_port
            && l["ip_address"] == "127.0.0.1"),
        "the node behind the management API listens for AMQP on 127.0.0.1:{amqp_port}: {listeners:?}"
    );
    // The management listener reports "::" as its address and the one it bound in its options.
    fn bound(l: &Value) -> Option<&str> {
        l["socket_opts"]["ip"].as_str().or(l["ip_address"].as_str())
    }
    assert!(
        listeners.iter().all(|l| bound(l) == Some("127.0.0.1")),
        "every listener on loopback only: {listeners:?}"
    );

    let (status, _) = http(
        "GET",
        &env.rabbitmq_management_url,
        "/api/overview",
        &[("Authorization", "Basic Z3Vlc3Q6d3Jvbmc=")], // guest:wrong
        b"",
    );
    assert_eq!(status, 401, "a wrong password is refused");
}

// --- ElasticMQ (SQS) -------------------------------------------------------------------------

/// One call of the SQS JSON protocol (the one current AWS SDKs speak).
fn sqs(endpoint: &str, action: &str, input: Value) -> Value {
    let target = format!("AmazonSQS.{action}");
    let (status, body) = http(
        "POST",
        endpoint,
        "/",
        &[
            ("Content-Type", "application/x-amz-json-1.0"),
            ("X-Amz-Target", &target),
        ],
        input.to_string().as_bytes(),
    );
    assert_eq!(status, 200, "{action} {input}: {body}");
    if body.trim().is_empty() {
        return Value::Null; // DeleteMessage, DeleteQueue: an empty 200
    }
    serde_json::from_str(&body).unwrap_or_else(|e| panic!("{action}: not JSON ({e}): {body}"))
}

#[test]
fn elasticmq_queue_urls_carry_the_real_port_and_a_message_comes_back() {
    let env = common::env();
    let endpoint = env.sqs_endpoint.trim_end_matches('/');
    let name = format!("settle-env-{}", std::process::id());

    let created = sqs(endpoint, "CreateQueue", json!({"QueueName": name}));
    let url = created["QueueUrl"].as_str().expect("QueueUrl").to_string();
    assert!(
        url.starts_with(&format!("{endpoint}/")) && url.ends_with(&format!("/{name}")),
        "the queue URL names the server's real host and port ({endpoint}), got {url}"
    );

    let body = format!("order {} \u{e9}t\u{e9} <&>", std::process::id());
    let sent = sqs(
        endpoint,
        "SendMessage",
        json!({"QueueUrl": url, "MessageBody": body}),
    );
    let id = sent["MessageId"].as_str().expect("MessageId").to_string();

    let deadline = Instant::now() + Duration::from_secs(20);
    let message = loop {
        let got = sqs(
            endpoint,
            "ReceiveMessage",
            json!({"QueueUrl": url, "MaxNumberOfMessages": 1, "WaitTimeSeconds": 1}),
        );
        if let Some(m) = got["Messages"].as_array().and_then(|m| m.first()) {
            break m.clone();
        }
        assert!(
            Instant::now() < deadline,
            "the message sent to {url} was not received within 20 s"
        );
    };
    assert_eq!(message["MessageId"], id.as_str());
    assert_eq!(
        message["Body"],
        body.as_str(),
        "the body comes back unchanged"
    );

    let handle = message["ReceiptHandle"].as_str().expect("ReceiptHandle");
    sqs(
        endpoint,
        "DeleteMessage",
        json!({"QueueUrl": url, "ReceiptHandle": handle}),
    );
    sqs(endpoint, "DeleteQueue", json!({"QueueUrl": url}));
    let listed = sqs(endpoint, "ListQueues", json!({"QueueNamePrefix": name}));
    let urls = listed["QueueUrls"].as_array().cloned().unwrap_or_default();
    assert!(urls.is_empty(), "{name} deleted, still listed: {urls:?}");
}
