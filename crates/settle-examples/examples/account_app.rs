//! An application on the handler runtime whose handler behaves as told, for the account's tests
//! and the demo: it binds to the consumer `settle operator` made for a Subscription and reports
//! its counters to the operator, as any application built on `settle` does.
//!
//! - `SETTLE_NATS_URL`: the broker is NATS; without it, `SETTLE_RABBITMQ_URL`: RabbitMQ
//!   (publishing to and binding on `amq.topic`, a Backend's default exchange); without either,
//!   `SETTLE_SQS_ENDPOINT`: SQS at that endpoint (ElasticMQ; any region and credentials), with
//!   the queue prefix `SETTLE_SQS_QUEUE_PREFIX` (default none) and, when set,
//!   `SETTLE_SQS_HOLD_LIMIT` in place of SQS's 12 hours (a test's). NATS first, so an
//!   environment file that names them all (hack/env.sh's) keeps the NATS demo on NATS.
//! - `SETTLE_SUBSCRIPTION_FILE`: the Subscription manifest (with its namespace), as applied to
//!   the cluster.
//! - `SETTLE_APP_HANDLER`:
//!   - `nack`: declines every attempt (the last one is Exhausted), after `SETTLE_APP_HANDLE_MS`
//!     (default 0) ms;
//!   - `ack-even-silent-odd`: acks messages whose body is an even number, returns without
//!     settling on odd ones (counted Silent; they come back under AtLeastOnce);
//!   - `nack-then-hold`: declines every attempt but the last, which it holds without ever
//!     returning (kill the process then: no handler saw that attempt end);
//!   - `demo`: acks orders, declines a body containing `bad` (Exhausted at maxDeliver), returns
//!     silently once on a body containing `slow`.
//!   - `slow-ack`: acks every message after `SETTLE_APP_HANDLE_MS` (default 1000) ms of work;
//!   - `ack-when-released`: works on every message until the file `SETTLE_APP_RELEASE_FILE`
//!     exists, then prints `released <body>` and acks it (handlers held across a delete and
//!     apply for as long as the test needs, not for a time it has to guess); after
//!     `SETTLE_APP_HANDLE_MS` (default 300000) ms without it, it prints `unreleased <body>` and
//!     acks anyway, so a test that never releases fails saying so.
//!   - `hold`: holds every attempt without ever returning (a handler blocked forever: the
//!     Subscription stalls);
//!   - `ack`: acks every message at once, printing `acked <body>`.
//!   - `ack-seen`: acks every message at once, printing `seen <body> <attempt>` as each attempt
//!     starts (the adoption tests count deliveries by it).
//!   - `nack-first`: declines a message's first attempt and acks every later one, after
//!     `SETTLE_APP_HANDLE_MS` (default 0) ms, printing `seen <body> <attempt>` as each attempt
//!     starts (the cluster tests count attempts by it).
//!   - `model`: the fault campaign's handler (`docs/guide/chaos.md`). A body is a message id;
//!     the answer to each attempt is drawn from (`SETTLE_APP_MODEL_SEED`, id, attempt) by
//!     [`model_answer`]: an ack (at once, beside a returned error, followed by a second
//!     settlement, or after working past ackWait), a nack (at once or with a delay) or silence
//!     (with or without a returned error). Each answer is appended to the file
//!     `SETTLE_APP_MODEL_LOG` as a line `<id> <attempt> <answer> <unix ms>` just before it is
//!     sent (so a settlement the broker got is never missing from the file, even when the
//!     process is killed right after), and once it returned `<id> <attempt> done <unix ms>`
//!     (`failed` for a settlement that returned an error); `no-delay` when `nack_after` was
//!     refused for want of a ceiling (then it nacks), `settled-twice` when a second settlement
//!     was not refused: the campaign's checker knows what the handlers did, and when, without
//!     asking Settle.
//! - `SETTLE_REPORT_INTERVAL` (default `200ms`): how often counters are reported.
//! - `SETTLE_RUN_FOR` (default: until stopped): how long to consume before closing.
//!
//! SIGTERM or Ctrl-C is the graceful stop (`settle::bus::stop_signal`, then `Bus::close`):
//! handlers in flight finish, the last report is confirmed, then it prints `closed` and exits.
//! It prints `ready` once subscribed, `held <body>` when it starts holding an attempt (a last
//! one under `nack-then-hold`, every one under `hold`),
//! `working <body>` when a `slow-ack` or `ack-when-released` handler starts, and `paused` / `resumed` when the runtime
//! stops and starts fetching for the operator's pause (RabbitMQ, SQS; `SETTLE_PAUSE_POLL_INTERVAL`
//! sets how often it looks).

use settle::api;
use settle::backend::nats::NatsBroker;
use settle::backend::rabbitmq::RabbitBroker;
use settle::backend::sqs::{SqsBroker, SqsCredentials, SqsSettings};
use settle::bus::{Broker, Bus, Delivery, HandlerError, SettleError, Subscriber, handler};

/// The model handler's answer to attempt `attempt` of message `id`, each attempt drawn on its
/// own (so a message may be declined, then acked): about 40% `ack`, 5% `ack-error` (acks, then
/// returns an error: still acked, S3), 5% `ack-twice` (acks, then nacks: the nack is refused,
/// S2), 5% `slow-ack` (works 3 s, past a 2 s ackWait, then acks: the lease is extended, H1),
/// 15% `nack`, 10% `nack-after` (declines with a delay of 200 to 1,500 ms, B3), 15% `silent`
/// and 5% `silent-error` (returns an error without settling: silent, S3).
pub fn model_answer(seed: u64, id: u64, attempt: u32) -> &'static str {
    match model_draw(seed, id, attempt) % 100 {
        0..40 => "ack",
        40..45 => "ack-error",
        45..50 => "ack-twice",
        50..55 => "slow-ack",
        55..70 => "nack",
        70..80 => "nack-after",
        80..95 => "silent",
        _ => "silent-error",
    }
}

/// The delay a `nack-after` answer asks for: 200 to 1,500 ms, drawn like the answer.
pub fn model_delay(seed: u64, id: u64, attempt: u32) -> std::time::Duration {
    std::time::Duration::from_millis(200 + (model_draw(seed, id, attempt) >> 8) % 1301)
}

fn model_draw(seed: u64, id: u64, attempt: u32) -> u64 {
    let mut x = seed ^ id.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ u64::from(attempt) << 48;
    // splitmix64's finaliser: every input bit reaches every output bit.
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// Where the model handler writes what it answered.
struct ModelLog(std::sync::Mutex<std::fs::File>);

impl ModelLog {
    fn open() -> Result<ModelLog, Box<dyn std::error::Error>> {
        let path = std::env::var("SETTLE_APP_MODEL_LOG")
            .map_err(|_| "the model handler needs SETTLE_APP_MODEL_LOG, a file to append to")?;
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(|e| format!("{path}: {e}"))?;
        Ok(ModelLog(std::sync::Mutex::new(file)))
    }

    /// One line, written at once (a process killed after it keeps it).
    fn said(&self, id: u64, attempt: u32, answer: &str) {
        use std::io::Write;
        if let Ok(mut f) = self.0.lock() {
            let ms = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis());
            let _ = f.write_all(format!("{id} {attempt} {answer} {ms}\n").as_bytes());
        }
    }
}

#[derive(Clone, Copy)]
enum Behaviour {
    Nack(u64),
    AckEvenSilentOdd,
    NackThenHold,
    Demo,
    SlowAck(u64),
    AckWhenReleased(u64),
    Hold,
    Ack,
    AckSeen,
    NackFirst(u64),
    Model(u64),
}

async fn handle(
    d: Delivery,
    how: Behaviour,
    max_deliver: u32,
    log: Option<&ModelLog>,
) -> Result<(), HandlerError> {
    let body = String::from_utf8_lossy(d.payload()).to_string();
    match how {
        Behaviour::Model(seed) => {
            let id: u64 = body.trim().parse().unwrap_or(0);
            let attempt = d.attempt();
            let answer = model_answer(seed, id, attempt);
            let said = |what: &str| {
                if let Some(log) = log {
                    log.said(id, attempt, what);
                }
            };
            let delay = model_delay(seed, id, attempt);
            said(&if answer == "nack-after" {
                format!("nack-after-{}ms", delay.as_millis())
            } else {
                answer.to_string()
            });
            let sent = match answer {
                "ack" | "ack-error" | "ack-twice" => d.ack().await,
                "slow-ack" => {
                    tokio::time::sleep(std::time::Duration::from_secs(3)).await;
                    d.ack().await
                }
                "nack" => d.nack().await,
                "nack-after" => match d.nack_after(delay).await {
                    // No ceiling (a backend that cannot hold a message back): nothing was
                    // recorded, so the handler can still decline (B3).
                    Err(SettleError::NoDelayAllowed(_)) => {
                        said("no-delay");
                        d.nack().await
                    }
                    other => other,
                },
                _ => Ok(()),
            };
            said(if sent.is_ok() { "done" } else { "failed" });
            if answer == "ack-twice" && !matches!(d.nack().await, Err(SettleError::AlreadySettled))
            {
                said("settled-twice");
            }
            if answer.ends_with("-error") {
                return Err(format!("the model handler's {answer} for message {id}").into());
            }
            Ok(sent?)
        }
        Behaviour::Nack(ms) => {
            if ms > 0 {
                tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
            }
            Ok(d.nack().await?)
        }
        Behaviour::AckEvenSilentOdd => {
            let n: u64 = body.trim().parse().unwrap_or(1);
            if n.is_multiple_of(2) {
                d.ack().await?;
            }
            Ok(())
        }
        Behaviour::NackThenHold => {
            if d.attempt() < max_deliver {
                return Ok(d.nack().await?);
            }
            println!("held {body}");
            std::future::pending::<()>().await;
            Ok(())
        }
        Behaviour::Hold => {
            println!("held {body}");
            std::future::pending::<()>().await;
            Ok(())
        }
        Behaviour::Ack => {
            d.ack().await?;
            println!("acked {body}");
            Ok(())
        }
        Behaviour::AckSeen => {
            println!("seen {body} {}", d.attempt());
            Ok(d.ack().await?)
        }
        Behaviour::NackFirst(ms) => {
            println!("seen {body} {}", d.attempt());
            if ms > 0 {
                tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
            }
            if d.attempt() == 1 {
                Ok(d.nack().await?)
            } else {
                Ok(d.ack().await?)
            }
        }
        Behaviour::SlowAck(ms) => {
            println!("working {body}");
            tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
            Ok(d.ack().await?)
        }
        Behaviour::AckWhenReleased(ms) => {
            println!("working {body}");
            let released = released(std::time::Duration::from_millis(ms)).await;
            println!(
                "{} {body}",
                if released { "released" } else { "unreleased" }
            );
            Ok(d.ack().await?)
        }
        Behaviour::Demo => {
            if body.contains("bad") {
                Ok(d.nack().await?)
            } else if body.contains("slow") && d.attempt() == 1 {
                Ok(())
            } else {
                Ok(d.ack().await?)
            }
        }
    }
}

/// Whether the file `SETTLE_APP_RELEASE_FILE` came to exist within `limit` (looked for every
/// 100 ms).
async fn released(limit: std::time::Duration) -> bool {
    let Some(file) = std::env::var_os("SETTLE_APP_RELEASE_FILE") else {
        tokio::time::sleep(limit).await;
        return false;
    };
    let until = tokio::time::Instant::now() + limit;
    while tokio::time::Instant::now() < until {
        if std::path::Path::new(&file).exists() {
            return true;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    false
}

/// `SETTLE_APP_HANDLE_MS`, else `default`.
fn handle_ms(default: u64) -> u64 {
    std::env::var("SETTLE_APP_HANDLE_MS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // The runtime's own log on stderr (RUST_LOG), for the tests' application logs.
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .init();
    let path = std::env::var("SETTLE_SUBSCRIPTION_FILE")
        .map_err(|_| "set SETTLE_SUBSCRIPTION_FILE to a Subscription manifest")?;
    let how = match std::env::var("SETTLE_APP_HANDLER").as_deref() {
        Ok("nack") => Behaviour::Nack(handle_ms(0)),
        Ok("nack-slow") => Behaviour::Nack(handle_ms(6000)),
        Ok("ack-even-silent-odd") => Behaviour::AckEvenSilentOdd,
        Ok("nack-then-hold") => Behaviour::NackThenHold,
        Ok("demo") => Behaviour::Demo,
        Ok("slow-ack") => Behaviour::SlowAck(handle_ms(1000)),
        Ok("ack-when-released") => Behaviour::AckWhenReleased(handle_ms(300_000)),
        Ok("hold") => Behaviour::Hold,
        Ok("ack") => Behaviour::Ack,
        Ok("ack-seen") => Behaviour::AckSeen,
        Ok("nack-first") => Behaviour::NackFirst(handle_ms(0)),
        Ok("model") => Behaviour::Model(
            std::env::var("SETTLE_APP_MODEL_SEED")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(0),
        ),
        other => {
            return Err(format!(
                "SETTLE_APP_HANDLER={other:?}: use nack, nack-slow, ack-even-silent-odd, nack-then-hold, slow-ack, ack-when-released, hold, ack, ack-seen, nack-first, model or demo"
            )
            .into());
        }
    };
    let report: api::Duration = std::env::var("SETTLE_REPORT_INTERVAL")
        .unwrap_or_else(|_| "200ms".into())
        .parse()?;
    let text = std::fs::read_to_string(&path).map_err(|e| format!("{path}: {e}"))?;
    let sub: api::Subscription = serde_yaml::from_str(&text).map_err(|e| format!("{path}: {e}"))?;
    let name = sub
        .metadata
        .name
        .clone()
        .ok_or("the manifest has no metadata.name")?;
    let ns = sub
        .metadata
        .namespace
        .clone()
        .ok_or("the manifest has no metadata.namespace")?;
    match std::env::var("SETTLE_NATS_URL") {
        Ok(url) => {
            let broker = NatsBroker::connect_in(&url, &ns).await?;
            run(broker, ns, name, sub, how, report).await
        }
        Err(_) => match std::env::var("SETTLE_RABBITMQ_URL") {
            Ok(url) => {
                run(
                    RabbitBroker::connect(&url).await?,
                    ns,
                    name,
                    sub,
                    how,
                    report,
                )
                .await
            }
            Err(_) => {
                let endpoint = std::env::var("SETTLE_SQS_ENDPOINT").map_err(
                    |_| "set SETTLE_NATS_URL, SETTLE_RABBITMQ_URL or SETTLE_SQS_ENDPOINT",
                )?;
                let mut broker = SqsBroker::connect(SqsSettings {
                    region: Some("elasticmq".into()),
                    endpoint: Some(endpoint),
                    credentials: SqsCredentials::Static {
                        access_key_id: "test".into(),
                        secret_access_key: "test".into(),
                    },
                    queue_prefix: std::env::var("SETTLE_SQS_QUEUE_PREFIX").unwrap_or_default(),
                })
                .await?
                .with_long_poll(std::time::Duration::from_secs(1));
                if let Ok(limit) = std::env::var("SETTLE_SQS_HOLD_LIMIT") {
                    broker = broker.with_hold_limit(limit.parse::<api::Duration>()?.get());
                }
                run(broker, ns, name, sub, how, report).await
            }
        },
    }
}

async fn run(
    broker: impl Broker,
    ns: String,
    name: String,
    sub: api::Subscription,
    how: Behaviour,
    report: api::Duration,
) -> Result<(), Box<dyn std::error::Error>> {
    let max_deliver = settle::policy::ResolvedPolicy::resolve(&sub.spec.policy)
        .max_deliver
        .unwrap_or(u32::MAX);
    let log = match how {
        Behaviour::Model(_) => Some(std::sync::Arc::new(ModelLog::open()?)),
        _ => None,
    };
    let bus = Bus::builder(broker)
        .namespace(ns)
        .report_interval(report.get())
        .build();
    bus.subscribe(Subscriber::from_resource(
        &name,
        &sub.spec,
        handler(move |d| {
            let log = log.clone();
            async move { handle(d, how, max_deliver, log.as_deref()).await }
        }),
    ))
    .await?;
    println!("ready");
    // RabbitMQ and SQS stop fetching while the operator says the Subscription is paused: the
    // tests wait for these lines before they publish.
    if let Some(mut paused) = bus.paused(&name) {
        tokio::spawn(async move {
            while paused.changed().await.is_ok() {
                let now = *paused.borrow_and_update();
                println!("{}", if now { "paused" } else { "resumed" });
            }
        });
    }
    let run_for = match std::env::var("SETTLE_RUN_FOR") {
        Ok(t) => Some(t.parse::<api::Duration>()?.get()),
        Err(_) => None,
    };
    tokio::select! {
        _ = settle::bus::stop_signal() => {}
        _ = async {
            match run_for {
                Some(t) => tokio::time::sleep(t).await,
                None => std::future::pending::<()>().await,
            }
        } => {}
    }
    bus.close().await;
    println!("closed");
    Ok(())
}

#[cfg(test)]
mod tests {
    /// The Go app (clients/go/cmd/account-app, `TestTheDrawIsTheRustAppsDraw`) holds these
    /// same values, so Go and Rust instances answer alike in one campaign.
    #[test]
    fn the_draw_is_the_one_the_go_app_holds() {
        assert_eq!(super::model_draw(0, 0, 0), 0);
        assert_eq!(super::model_draw(377, 1, 1), 5_850_652_464_473_074_940);
        assert_eq!(
            super::model_draw(1_796_666_591_402_080_080, 1199, 4),
            6_708_470_482_063_311_030
        );
    }
}
