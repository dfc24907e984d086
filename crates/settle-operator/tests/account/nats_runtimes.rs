//! One Subscription served by applications on both runtimes at once: the Rust one
//! (`examples/account_app.rs`) and the Go one (`clients/go/cmd/account-app`), on NATS. Their
//! reports are one format, so the operator sums them into one account, exact to the attempt;
//! a Go instance stopped gracefully mid-run loses nothing either.

use settle_testkit as common;

use std::time::Duration;

use common::account::{NACK_SPEC, Scene, bodies};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_go_and_rust_instances_of_one_subscription_keep_one_exact_account() {
    let scene = Scene::new("acct-runtimes", NACK_SPEC).await;
    // Each declines a message's first attempt and acks its second: two attempts a message.
    let rust = scene.app("nack-first");
    let mut go = scene.app_go("nack-first");
    rust.wait_ready().await;
    go.wait_ready().await;
    scene.publish(bodies(40)).await;
    let seen = |rust: &common::account::App, go: &common::account::App| {
        rust.count("seen ") + go.count("seen ")
    };
    common::operator::poll(
        "80 attempts seen by the two",
        Duration::from_secs(60),
        || async {
            match seen(&rust, &go) {
                80 => Ok(()),
                n => Err(format!(
                    "{n} (Rust {}, Go {})",
                    rust.count("seen "),
                    go.count("seen ")
                )),
            }
        },
    )
    .await;
    let (by_rust, by_go) = (rust.count("seen "), go.count("seen "));
    println!("attempts handled: Rust {by_rust}, Go {by_go}");
    assert!(
        by_rust > 0 && by_go > 0,
        "both runtimes served: Rust {by_rust}, Go {by_go}"
    );

    // The Go instance stops gracefully (its last report confirmed); the Rust one goes on.
    go.sigterm();
    assert!(
        go.wait_exit(Duration::from_secs(30)),
        "the Go application stops on SIGTERM"
    );
    assert_eq!(go.count("closed"), 1, "it closed its bus");
    scene.publish(bodies(20)).await;
    rust.wait_count("seen ", by_rust + 40, Duration::from_secs(60))
        .await;

    let s = scene
        .settled(
            "one account of both runtimes",
            Duration::from_secs(60),
            |s| s.offered >= 120 && s.delivered >= 120,
        )
        .await;
    assert_eq!(s.offered, 120, "{s:?}");
    assert_eq!(s.delivered, 120, "{s:?}");
    assert_eq!(s.settlement.acked, 60, "{s:?}");
    assert_eq!(s.settlement.nacked, 60, "{s:?}");
    assert_eq!(
        s.settlement.silent + s.settlement.refused + s.released + s.lost,
        0,
        "{s:?}"
    );
    assert_eq!(s.exhausted, 0, "{s:?}");
    scene.assert_never_decreased();
    drop(rust);
    scene.finish().await;
}
