//! The account's durable reader of a NATS server's advisory capture across operator versions:
//! the reader of the legacy name is the checkpoint the renamed one continues from, and a reader
//! an earlier version made is brought to the account's ack wait in place, keeping its position.
//! On a nats-server of the test's own; no operator runs.

use std::time::Duration;

use settle_testkit::operator::{NatsServer, poll};

/// Up to ten messages of `reader`, waiting at most 2 s for them.
async fn fetch_ten(
    reader: &async_nats::jetstream::consumer::PullConsumer,
) -> async_nats::jetstream::consumer::pull::Batch {
    reader
        .fetch()
        .max_messages(10)
        .expires(Duration::from_secs(2))
        .messages()
        .await
        .expect("fetch")
}

/// `n` max-deliveries advisories published into the capture, as the server would: their
/// subject and capture sequences.
async fn publish_advisories(js: &async_nats::jetstream::Context, n: u32) -> (String, Vec<u64>) {
    let subject = settle::backend::nats::advisory::MAX_DELIVERIES.replace('>', "S.C");
    let mut published = Vec::new();
    for i in 1..=n {
        let ack = js
            .publish(subject.clone(), format!("{{\"n\":{i}}}").into())
            .await
            .expect("publish")
            .await
            .expect("captured");
        published.push(ack.sequence);
    }
    (subject, published)
}

/// The upgrade to unambiguous reader names: the legacy reader is the checkpoint. The new reader
/// delivers from just after what the legacy one acknowledged (what it had delivered without an
/// acknowledgement comes again, as after any restart), the legacy reader is deleted (the keeper
/// does it 10 minutes into its session), and doing it again changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_renamed_advisory_reader_continues_after_what_the_legacy_one_acknowledged() {
    use async_nats::jetstream::AckKind;
    use futures::StreamExt;
    use settle::backend::nats::capture;
    use settle_operator::account::nats::{legacy_reader_name, reader_name};

    let server = NatsServer::start(&[]);
    let client = async_nats::connect(server.url()).await.expect("connect");
    let js = async_nats::jetstream::new(client);
    let (legacy, new) = (
        legacy_reader_name("team", "a-nats"),
        reader_name("team", "a-nats"),
    );
    let reader = capture::open(&js, &legacy, 1 << 20, 1)
        .await
        .expect("the legacy reader");
    // Five advisories in the capture (as the server would publish them).
    let (subject, published) = publish_advisories(&js, 5).await;
    // The legacy reader took four and acknowledged up to the second of ours only (and the
    // consumer-created advisory of its own making before them).
    let acked = published[1];
    let mut batch = reader
        .fetch()
        .max_messages(4)
        .messages()
        .await
        .expect("fetch");
    for _ in 0..4 {
        let m = batch.next().await.expect("a message").expect("delivered");
        if m.info().expect("info").stream_sequence <= acked {
            m.ack_with(AckKind::Ack).await.expect("ack");
        }
    }
    drop(batch);
    poll(
        "the legacy reader's acknowledgements",
        Duration::from_secs(10),
        || {
            let mut r = reader.clone();
            async move {
                match r.info().await.map(|i| i.ack_floor.stream_sequence) {
                    Ok(floor) if floor == acked => Ok(()),
                    other => Err(format!("{other:?}")),
                }
            }
        },
    )
    .await;

    capture::take_over_reader(&js, &legacy, &new)
        .await
        .expect("take over");
    capture::drop_reader(&js, &legacy)
        .await
        .expect("drop the legacy reader");
    let stream = js
        .get_stream(capture::CAPTURE_STREAM)
        .await
        .expect("the capture");
    assert!(
        stream.consumer_info(&legacy).await.is_err(),
        "the legacy reader is still there"
    );
    let renamed = capture::open(&js, &new, 1 << 20, 1)
        .await
        .expect("the new reader");
    let mut batch = fetch_ten(&renamed).await;
    let mut got = Vec::new();
    while let Some(m) = batch.next().await {
        let m = m.expect("delivered");
        // The capture also keeps the consumer-created advisories of the readers themselves.
        if m.subject.as_str() == subject {
            got.push(m.info().expect("info").stream_sequence);
        }
        m.ack_with(AckKind::Ack).await.expect("ack");
    }
    assert_eq!(
        got,
        published[2..].to_vec(),
        "the new reader starts after the legacy one's acknowledgements"
    );
    // Again (a restart after the rename): nothing is made, the new reader keeps its place.
    capture::take_over_reader(&js, &legacy, &new)
        .await
        .expect("take over again");
    capture::drop_reader(&js, &legacy)
        .await
        .expect("drop again");
    assert!(stream.consumer_info(&legacy).await.is_err());
    let info = renamed
        .clone()
        .info()
        .await
        .expect("the new reader's info")
        .clone();
    assert!(
        info.ack_floor.stream_sequence >= published[4],
        "the new reader lost its place: {info:?}"
    );
}

/// A reader made by an earlier version (an advisory unacknowledged for 120 s before it came
/// again) is brought to the account's ack wait in place: its position stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_earlier_versions_reader_gets_the_short_ack_wait_and_keeps_its_place() {
    use async_nats::jetstream::consumer;
    use futures::StreamExt;
    use settle::backend::nats::capture;

    let server = NatsServer::start(&[]);
    let client = async_nats::connect(server.url()).await.expect("connect");
    let js = async_nats::jetstream::new(client);
    let name = settle_operator::account::nats::reader_name("team", "old-nats");
    let first = capture::open(&js, &name, 1 << 20, 1)
        .await
        .expect("the reader");
    let stream = js
        .get_stream(capture::CAPTURE_STREAM)
        .await
        .expect("the capture");
    // As the earlier version made it.
    let config = first.cached_info().config.clone();
    stream
        .update_consumer(consumer::Config {
            ack_wait: Duration::from_secs(120),
            ..config
        })
        .await
        .expect("the earlier version's ack wait");
    publish_advisories(&js, 3).await;
    let mut batch = fetch_ten(&first).await;
    while let Some(m) = batch.next().await {
        m.expect("delivered").double_ack().await.expect("ack");
    }
    drop(batch);
    let before = stream.consumer_info(&name).await.expect("info");
    assert_eq!(before.config.ack_wait, Duration::from_secs(120));

    let mut reader = capture::open(&js, &name, 1 << 20, 1)
        .await
        .expect("the reader again");
    let after = reader.info().await.expect("info").clone();
    assert_eq!(after.config.ack_wait, capture::READER_ACK_WAIT);
    assert_eq!(
        after.ack_floor.stream_sequence, before.ack_floor.stream_sequence,
        "the reader kept its place"
    );
    assert!(before.ack_floor.stream_sequence >= 3, "{before:?}");
    assert_eq!(after.config.deliver_policy, before.config.deliver_policy);
}
