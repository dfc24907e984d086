//! The fault campaign (docs/guide/chaos.md) on the environment's real parts: `cargo bench -p
//! settle-operator --bench chaos -- --seed S --faults N --messages M [--kinds K]` after `cargo build
//! --profile bench -p settle-examples --example account_app` (`make chaos` does both; a seed
//! not given is drawn from the clock and printed). Prints one line per fault, the summary and
//! every discrepancy, and exits 1 when there is one. `--broker nats|nats-cluster|rabbitmq|sqs`
//! (nats when not given; nats-cluster is the environment's JetStream cluster, `hack/env.sh up
//! --nats-cluster`). The campaign runs on a control plane of its own, which it may restart
//! (`ApiServerRestarted`); `--shared-api-server` runs it on the environment's instead, without
//! that fault. `--kinds K` draws from the first K kinds of fault only (each new kind is added
//! last), so a seed printed before a kind was added draws the same schedule again.

use settle_testkit::chaos::{self, Broker, Campaign, Fault};
use settle_testkit::controlplane::ControlPlane;
use std::time::Duration;

/// `--name value` from the arguments.
fn flag(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

#[tokio::main(flavor = "multi_thread", worker_threads = 4)]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let name = flag(&args, "--broker").unwrap_or_else(|| "nats".into());
    let Some(broker) = Broker::parse(&name) else {
        eprintln!("--broker {name}: use nats, nats-cluster, rabbitmq or sqs");
        std::process::exit(2);
    };
    let seed = flag(&args, "--seed")
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(1)
        });
    let faults = flag(&args, "--faults")
        .and_then(|s| s.parse().ok())
        .unwrap_or(30);
    let messages = flag(&args, "--messages")
        .and_then(|s| s.parse().ok())
        .unwrap_or(40 * faults as u64);
    let kinds = flag(&args, "--kinds")
        .and_then(|s| s.parse().ok())
        .unwrap_or(Fault::KINDS);
    if !(1..=Fault::KINDS).contains(&kinds) {
        eprintln!(
            "--kinds {kinds}: between 1 and {} (the first kinds of fault, in the order they were added)",
            Fault::KINDS
        );
        std::process::exit(2);
    }
    let own = !args.iter().any(|a| a == "--shared-api-server");
    println!(
        "campaign on {}, seed {seed} over {kinds} kinds of fault, {faults} faults, {messages} messages, {} API server",
        broker.name(),
        if own { "its own" } else { "the environment's" }
    );
    let control_plane = own.then(|| tokio::task::block_in_place(|| ControlPlane::start("chaos")));
    let report = chaos::run(
        broker,
        &Campaign {
            seed,
            faults,
            kinds,
            messages,
            every: Duration::from_secs(6),
        },
        control_plane,
    )
    .await;
    report.print();
    for d in &report.discrepancies {
        println!("DISCREPANCY {d}");
    }
    if !report.discrepancies.is_empty() {
        std::process::exit(1);
    }
}
