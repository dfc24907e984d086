//! A short fault campaign (docs/guide/chaos.md) on NATS with a fixed seed: two operators with
//! leader election, applications on the `model` handler, messages with ids, five faults drawn
//! from the seed; at rest status equals what the handlers' own files say they did, and no
//! counter ever stepped down. `make chaos` runs long ones with any seed.

use settle_testkit::chaos::{self, Campaign};
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn nats_a_short_campaign_of_a_fixed_seed_finds_no_discrepancy() {
    let report = chaos::nats(&Campaign {
        seed: 46,
        faults: 5,
        messages: 150,
        every: Duration::from_secs(6),
    })
    .await;
    for line in &report.lines {
        println!("{line}");
    }
    println!("{}", report.summary);
    assert!(
        report.discrepancies.is_empty(),
        "the campaign found discrepancies:\n{}",
        report.discrepancies.join("\n")
    );
}
