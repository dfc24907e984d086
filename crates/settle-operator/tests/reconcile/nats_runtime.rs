//! The runtime example (`examples/orders.rs`) run from a Subscription resource: it binds to the
//! consumer `settle operator` made for it and consumes; deleting the Subscription while the app
//! runs leaves no consumer behind (the app never makes one back).

use settle_testkit as common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::operator::{Operator, TestStream, poll};
use common::subs::{apply, backend_yaml, subs, wait_gone, wait_ready};
use common::{example, install_crds, kubectl_ok, namespace};
use kube::api::DeleteParams;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_example_consumes_from_the_operators_consumer_and_leaves_none_behind_when_deleted() {
    install_crds();
    let ns = namespace("rec-runtime");
    let env = common::env();
    let stream = TestStream::new(&env.nats_url, "runtime").await;
    let _op = Operator::start("runtime", &ns);
    apply(&ns, &backend_yaml("nats", &env.nats_url));
    let manifest = format!(
        "apiVersion: messaging.settle.dev/v1alpha1\nkind: Subscription\nmetadata: {{name: orders, namespace: {ns}}}\nspec:\n  backendRef: {{name: nats}}\n  pattern: \"{}.>\"\n  mode: AtLeastOnce\n  durableName: orders\n  maxDeliver: 3\n  backoff: {{initial: 100ms, max: 1s}}\n  maxNackDelay: 10s\n",
        stream.prefix
    );
    apply(&ns, &manifest);
    let api = subs(&ns).await;
    wait_ready(&api, "orders").await;
    let file = common::root().join(format!(
        "target/reconcile-runtime-{}.yaml",
        std::process::id()
    ));
    std::fs::write(&file, &manifest).expect("manifest");

    let bin = example("orders");
    let mut app = Command::new(&bin)
        .env("SETTLE_NATS_URL", &env.nats_url)
        .env("SETTLE_SUBSCRIPTION_FILE", &file)
        .env("SETTLE_RUN_FOR", "12s")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("run {}: {e}", bin.display()));
    let lines = Arc::new(Mutex::new(Vec::<String>::new()));
    let reader = {
        let lines = lines.clone();
        let out = app.stdout.take().expect("stdout");
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines().map_while(Result::ok) {
                lines.lock().expect("lines").push(l);
            }
        })
    };
    struct Kill(std::process::Child);
    impl Drop for Kill {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let mut app = Kill(app);

    poll(
        "the example to process orders 1 and 2",
        Duration::from_secs(30),
        || async {
            let seen = lines.lock().expect("lines").clone();
            let all = seen.join("\n");
            if all.contains("order 1 processed") && all.contains("order 2 processed on attempt 2") {
                Ok(())
            } else {
                Err(all)
            }
        },
    )
    .await;

    // Deleted while the app runs: the consumer goes, and the app does not bring it back.
    api.delete("orders", &DeleteParams::default())
        .await
        .expect("delete");
    wait_gone(&api, "orders", Duration::from_secs(30)).await;
    assert!(
        stream.consumer("orders").await.is_none(),
        "deleted with the Subscription"
    );
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert!(
        matches!(app.0.try_wait(), Ok(None)),
        "the app still runs while this is checked"
    );
    assert_eq!(
        stream.consumer_names().await,
        Vec::<String>::new(),
        "a running app left or made a consumer after its Subscription was deleted"
    );
    let status = app.0.wait().expect("the app ends");
    reader.join().expect("reader");
    assert!(
        status.success(),
        "the example failed: {:?}",
        lines.lock().expect("lines")
    );
    let _ = std::fs::remove_file(&file);
    stream.delete().await;
    kubectl_ok(&["delete", "namespace", &ns, "--wait=false"], None);
}
