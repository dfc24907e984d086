//! A short fault campaign (docs/guide/chaos.md) per broker with a fixed seed: two operators
//! with leader election, applications on the `model` handler, messages with ids, eight faults
//! drawn from the seed; at rest status equals what the handlers' own files say they did, and no
//! counter ever stepped down. `make chaos` runs long ones with any seed. A suite of its own, so
//! it runs beside the account suite rather than after it; its campaigns one at a time.

use settle_testkit::chaos::{self, Broker, Campaign};
use std::time::Duration;

/// Held for a whole campaign: one at a time, so the suite adds one operator pair and its
/// applications to the machine's load, not three.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The campaign of seed 377 on `broker`, every discrepancy a failure: on every broker scaled
/// down, the consumer or queue deleted on the broker, paused, the leading operator SIGKILLed,
/// then SIGTERMed, the Subscription deleted and applied again, the broker down (NATS and
/// RabbitMQ: a node of the campaign's own SIGKILLed and started again; SQS: unreachable), the
/// Subscription deleted and applied again. On RabbitMQ the node comes back running nothing for
/// the queue made just before the kill, which the operator must say (semantics R14); on SQS it
/// found an instance counting a new object's deliveries for the deleted one (docs/guide/chaos.md).
async fn short_campaign(broker: Broker) {
    let _one = ONE_AT_A_TIME.lock().await;
    let report = chaos::run(
        broker,
        &Campaign {
            seed: 377,
            faults: 8,
            // The schedule it drew when it found those defects, before later kinds of fault.
            kinds: 14,
            messages: 150,
            every: Duration::from_secs(4),
        },
        None,
    )
    .await;
    report.assert_none_found(broker);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn nats_a_short_campaign_of_a_fixed_seed_finds_no_discrepancy() {
    short_campaign(Broker::Nats).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rabbitmq_a_short_campaign_of_a_fixed_seed_finds_no_discrepancy() {
    short_campaign(Broker::Rabbitmq).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqs_a_short_campaign_of_a_fixed_seed_finds_no_discrepancy() {
    short_campaign(Broker::Sqs).await;
}
