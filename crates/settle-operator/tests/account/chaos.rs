//! A short fault campaign (docs/guide/chaos.md) per broker with a fixed seed: two operators
//! with leader election, applications on the `model` handler, messages with ids, five faults
//! drawn from the seed; at rest status equals what the handlers' own files say they did, and no
//! counter ever stepped down. `make chaos` runs long ones with any seed.

use settle_testkit::chaos::{self, Broker, Campaign};
use std::time::Duration;

/// The campaign of seed 294 on `broker` (its five faults of five kinds: an application
/// replaced, the leader SIGTERMed, paused and resumed, maxInFlight edited, the leader
/// SIGKILLed), every discrepancy a failure.
async fn short_campaign(broker: Broker) {
    let report = chaos::run(
        broker,
        &Campaign {
            seed: 294,
            faults: 5,
            messages: 150,
            every: Duration::from_secs(6),
        },
    )
    .await;
    for line in &report.lines {
        println!("{line}");
    }
    println!("{}", report.summary);
    assert!(
        report.discrepancies.is_empty(),
        "the campaign on {} found discrepancies:\n{}",
        broker.name(),
        report.discrepancies.join("\n")
    );
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
