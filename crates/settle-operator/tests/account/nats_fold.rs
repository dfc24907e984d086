//! A folded instance's report stays in the bucket while the ledger holding its fold cannot be
//! saved: the report is then the fold's only record on the broker, and removing it once the
//! loss window had passed would leave a restart nothing to count that instance from. On a
//! nats-server of the test's own, the ledger bucket's stream is sealed (every save refused)
//! before the killed application's instance is folded (`--fold-after 10s`), so the fold is the
//! change that cannot be saved (the Subscription says `Accounted=False LedgerNotSaved`); past
//! the loss window its report is still there.

use settle_testkit as common;

use std::time::Duration;

use common::account::{NACK_SPEC, Scene, bodies};
use common::operator::NatsServer;
use common::subs::wait_condition;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_folded_report_stays_while_the_ledger_holding_its_fold_is_not_saved() {
    let nats = NatsServer::start(&[]);
    let scene = Scene::build(
        "fold-unsaved",
        NACK_SPEC,
        &[
            "--leader-election=false",
            "--stats-interval",
            "1s",
            "--fold-after",
            "20s",
            "--loss-window",
            "5s",
        ],
        &[],
        Some(nats.url()),
    )
    .await;
    let mut app = scene.app("nack");
    app.wait_ready().await;
    scene.publish(bodies(2)).await;
    scene
        .settled("two messages exhausted", Duration::from_secs(60), |s| {
            s.exhausted == 2
        })
        .await;
    let reports = scene
        .stream
        .js
        .get_key_value("settle-stats")
        .await
        .expect("the report bucket");
    let prefix = format!("{}.orders.", scene.ns);
    let keys = || async {
        common::account::report_keys(&reports, &prefix)
            .await
            .expect("the bucket's keys")
    };
    let before = keys().await;
    assert_eq!(before.len(), 1, "the application's report: {before:?}");

    // Killed: no final report. The instance is folded 20 s after its last report (it reports
    // only what changed, so that was when the two were exhausted, a few seconds ago: under
    // the whole of `make test` those seconds once reached 10), and
    // every save of the ledger is refused from now on: the fold is the one change not saved,
    // so `LedgerNotSaved` below says the fold came after the seal.
    app.kill9();
    let js = &scene.stream.js;
    let mut ledger = js
        .get_stream(format!(
            "KV_{}",
            settle::backend::nats::capture::ACCOUNT_BUCKET
        ))
        .await
        .expect("the ledger bucket's stream");
    let mut sealed = ledger.info().await.expect("its config").config.clone();
    sealed.sealed = true;
    js.update_stream(&sealed)
        .await
        .expect("seal the ledger bucket");
    let said = wait_condition(
        &scene.api,
        "orders",
        "Accounted",
        "False",
        "LedgerNotSaved",
        Duration::from_secs(45),
    )
    .await;
    println!(
        "the Subscription says: {:?}",
        said.status
            .as_ref()
            .and_then(|s| s.conditions.iter().find(|c| c.type_ == "Accounted"))
            .map(|c| &c.message)
    );
    // More than the loss window (5 s) since the fold has passed: the report is still there.
    tokio::time::sleep(Duration::from_secs(13)).await;
    assert_eq!(
        keys().await,
        before,
        "the folded report was removed while its fold was never saved"
    );
    scene.finish().await;
}
