//! The campaign's publisher: one message per id, its body the id, each sent until the broker
//! has taken it (NATS: stored, the id as the message id so none is stored twice; RabbitMQ:
//! confirmed, a refusal sent again; SQS: sent).
//!
//! It must not decide when to publish (the campaign paces it, and a fault holds it).

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::message::PublishMessage;

/// Sends one message per id.
pub(crate) enum Publisher {
    Nats(Box<async_nats::jetstream::Context>, String),
    Rabbitmq(Arc<tokio::sync::Mutex<lapin::Connection>>, String),
    Sqs(aws_sdk_sqs::Client, String),
}

impl Publisher {
    pub(crate) async fn send(&self, id: u64) {
        match self {
            Publisher::Nats(js, prefix) => {
                // Until the stream stores it, through a broker restart; the id as the message
                // id, so one stored whose acknowledgement was lost is not stored twice.
                let deadline = std::time::Instant::now() + Duration::from_secs(60);
                loop {
                    let message = PublishMessage::build()
                        .message_id(id.to_string())
                        .payload(id.to_string().into());
                    let stored = match js.send_publish(format!("{prefix}.m{id}"), message).await {
                        Ok(ack) => ack.await.map(|_| ()).map_err(|e| e.to_string()),
                        Err(e) => Err(e.to_string()),
                    };
                    match stored {
                        Ok(()) => break,
                        Err(e) if std::time::Instant::now() > deadline => {
                            panic!("message {id} not stored within 60 s: {e}")
                        }
                        Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
                    }
                }
            }
            Publisher::Rabbitmq(amqp, tag) => {
                // Until the broker takes it: a quorum queue refuses (basic.nack) for a moment
                // after the node restarts, and a refused message was not enqueued.
                let amqp = amqp.lock().await;
                let deadline = std::time::Instant::now() + Duration::from_secs(60);
                loop {
                    match publish_confirmed(&amqp, &format!("{tag}.m{id}"), &id.to_string()).await {
                        Ok(()) => break,
                        Err(e) if std::time::Instant::now() > deadline => {
                            panic!("message {id} not taken within 60 s: {e}")
                        }
                        Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
                    }
                }
            }
            Publisher::Sqs(client, url) => {
                client
                    .send_message()
                    .queue_url(url)
                    .message_body(id.to_string())
                    .send()
                    .await
                    .expect("send");
            }
        }
    }
}

/// Publishes `body` to `amq.topic` with routing key `key` on a channel of its own, and waits
/// for the broker's confirm: an error when it refused the message or the channel failed.
async fn publish_confirmed(conn: &lapin::Connection, key: &str, body: &str) -> Result<(), String> {
    use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
    let ch = conn.create_channel().await.map_err(|e| e.to_string())?;
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .map_err(|e| e.to_string())?;
    let confirm = ch
        .basic_publish(
            "amq.topic".into(),
            key.into(),
            BasicPublishOptions::default(),
            body.as_bytes(),
            lapin::BasicProperties::default(),
        )
        .await
        .map_err(|e| e.to_string())?
        .await
        .map_err(|e| e.to_string())?;
    let _ = ch.close(200, "published".into()).await;
    if confirm.is_ack() {
        Ok(())
    } else {
        Err("the broker refused it (basic.nack)".into())
    }
}
