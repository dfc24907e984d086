//! The broker down under load (the campaign's `BrokerDown` and `NodePaused` faults): NATS and
//! RabbitMQ SIGKILLed or SIGTERMed and started again on their store (on the cluster one of its
//! servers, drawn), a cluster's server paused, SQS made unreachable; each says which server it
//! hit and whether that one led the consumer (an ack sent then may be lost, semantics J3), and
//! whether RabbitMQ came back running the Subscription's queue.
//!
//! It must not decide when a fault happens nor judge what it cost: the campaign does.

use std::time::Duration;

use super::broker::{Target, amqp_connect};
use crate::nats_cluster::{Cluster, SERVERS};
use crate::operator::TestStream;
use crate::rabbitmq::management_at;
use crate::rabbitmq_server::RabbitServer;

impl Target {
    /// The broker down for `down`: SIGKILLed, or SIGTERMed (`graceful`: it shuts down on its
    /// own), and started again on its store (on the cluster one of its servers, drawn: only
    /// there is a server drawn); SQS, a service, unreachable instead.
    pub(super) async fn kill_broker(
        &mut self,
        down: Duration,
        graceful: bool,
        draw: &mut super::Draw,
    ) -> Hit {
        let secs = down.as_secs();
        let signal = if graceful { "TERM" } else { "KILL" };
        let sig = format!("SIG{signal}ed");
        match self {
            Target::Nats(_, server) => {
                tokio::task::block_in_place(|| {
                    if graceful {
                        server.terminate();
                    } else {
                        server.stop();
                    }
                });
                tokio::time::sleep(down).await;
                server.resume();
                Hit {
                    what: format!("the broker {sig}, and started again {secs} s later"),
                    acks_lost: AckLoss::UntilWhole,
                    dead_queue: false,
                }
            }
            Target::NatsCluster(stream, cluster) => {
                let i = usize::try_from(draw.below(3)).unwrap_or(0);
                let led = leads(stream).await;
                let killed = tokio::task::block_in_place(|| cluster.kill_with(i, signal));
                tokio::time::sleep(down).await;
                killed.restart();
                let back = healthy_again(cluster).await;
                led.hit(
                    i,
                    down,
                    &format!("{sig}, started again {secs} s later, every server healthy {back}"),
                )
            }
            Target::Rabbitmq {
                amqp, server, tag, ..
            } => {
                let mut publishing = amqp.lock().await;
                tokio::task::block_in_place(|| server.stop(signal));
                tokio::time::sleep(down).await;
                let started = std::time::Instant::now();
                tokio::task::block_in_place(|| server.resume());
                *publishing = amqp_connect(&server.url()).await;
                let serving = started.elapsed().as_secs_f64();
                let dead_queue = !queue_runs(server, tag).await;
                Hit {
                    what: format!(
                        "the broker {sig}, and started again {secs} s later, serving {serving:.1} s after that{}",
                        if dead_queue {
                            ", but running nothing for the Subscription's queue"
                        } else {
                            ""
                        }
                    ),
                    acks_lost: AckLoss::UntilWhole,
                    dead_queue,
                }
            }
            Target::Sqs { link, .. } => {
                link.pause(true);
                tokio::time::sleep(down).await;
                link.pause(false);
                Hit {
                    what: format!("SQS unreachable for {secs} s (every connection held)"),
                    // An SQS delete answers: an ack that returned was taken, one that did
                    // not failed (and is unsure on its own).
                    acks_lost: AckLoss::None,
                    dead_queue: false,
                }
            }
        }
    }

    /// A cluster server paused (SIGSTOP: its connections open and silent, as a node cut off)
    /// for `down`, then resumed: `which` (modulo two) of the two the campaign's publisher is
    /// not connected to (its client would wait out its pings, a minute or more, while the
    /// operators and applications take the fault).
    pub(super) async fn pause_node(&mut self, down: Duration, which: u64) -> Hit {
        let Target::NatsCluster(stream, cluster) = self else {
            panic!("only the cluster has a node to pause")
        };
        let publishing = stream.js.client().server_info().server_name;
        let others: Vec<usize> = (0..3).filter(|&j| SERVERS[j] != publishing).collect();
        let i = others[usize::try_from(which).unwrap_or(0) % others.len()];
        let led = leads(stream).await;
        let paused = cluster.pause(i);
        tokio::time::sleep(down).await;
        paused.resume();
        let back = healthy_again(cluster).await;
        led.hit(
            i,
            down,
            &format!(
                "paused (SIGSTOP) for {} s, then resumed, every server healthy {back}",
                down.as_secs()
            ),
        )
    }
}

/// Waits until every server of the cluster is healthy again, which ends the outage (a server
/// back catches up its streams first, and the next one lost meanwhile would cost the quorum);
/// says how long after it was back (`N s later`).
async fn healthy_again(cluster: &Cluster) -> String {
    let back = std::time::Instant::now();
    cluster.wait_healthy().await;
    format!("{:.1} s later", back.elapsed().as_secs_f64())
}

/// What a fault on the broker did: said in a line, and when an ack sent around it may have been
/// lost (semantics J3).
pub(super) struct Hit {
    pub(super) what: String,
    pub(super) acks_lost: AckLoss,
    /// RabbitMQ came back listing the Subscription's queue but running nothing for it (a
    /// quorum queue made just before the node was SIGKILLed can stay so).
    pub(super) dead_queue: bool,
}

/// When an ack sent around a fault may have been lost (J3), from a second before it hit.
pub(super) enum AckLoss {
    /// None: an SQS delete answers (one that returned was taken, one that did not failed).
    None,
    /// Until the broker is whole again: the only server, or the cluster's server leading the
    /// consumer (until another leads it, an ack sent is lost).
    UntilWhole,
    /// For as long as the server hit was down or paused, and a second more: on the cluster a
    /// server that did not lead the consumer still carries the acks of the applications
    /// connected to it; killed, it loses what it had not passed on, until they see it gone;
    /// paused, it passes them on when it resumes, after ackWait, when the message was offered
    /// again and may have run out. The campaign does not know which server each application
    /// uses, so every ack of that time is unsure.
    For(Duration),
}

/// Which servers led the campaign's stream and its consumer when a fault hit one.
struct Leaders {
    stream: Option<String>,
    consumer: Option<String>,
}

impl Leaders {
    /// Server `i` hit for `down`, as `done` says: `settle-cN (what it led) <done>`, and when
    /// its acks may have been lost: until the cluster is whole when it led the consumer (or
    /// nobody knew who did), else while it was down.
    fn hit(&self, i: usize, down: Duration, done: &str) -> Hit {
        let server = SERVERS[i];
        let of = |l: &Option<String>| l.as_deref() == Some(server);
        let led = match (of(&self.stream), of(&self.consumer)) {
            (true, true) => "leading the stream and the consumer",
            (true, false) => "leading the stream",
            (false, true) => "leading the consumer",
            (false, false) => "a follower",
        };
        Hit {
            what: format!("{server} ({led}) {done}"),
            acks_lost: if self.consumer.as_deref().is_none_or(|l| l == server) {
                AckLoss::UntilWhole
            } else {
                AckLoss::For(down + Duration::from_secs(1))
            },
            dead_queue: false,
        }
    }
}

async fn leads(stream: &TestStream) -> Leaders {
    Leaders {
        stream: Cluster::stream_leader(&stream.js, &stream.name).await,
        consumer: Cluster::consumer_leader(&stream.js, &stream.name, "orders").await,
    }
}

/// Whether RabbitMQ runs queue `queue` once it is back: its management API shows it with a
/// state within 25 s (RabbitMQ's statistics come every 5 s; a queue nothing runs shows none).
async fn queue_runs(server: &RabbitServer, queue: &str) -> bool {
    let deadline = std::time::Instant::now() + Duration::from_secs(25);
    loop {
        let (status, body) = management_at(
            &server.management_url(),
            "GET",
            &format!("/api/queues/%2f/{queue}"),
            "",
        );
        let state = serde_json::from_str::<serde_json::Value>(&body)
            .ok()
            .and_then(|q| q.get("state").cloned());
        if status != 200 || state.is_some() || std::time::Instant::now() > deadline {
            return status != 200 || state.is_some_and(|s| s == "running");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}
