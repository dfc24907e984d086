//! The NATS account scene ([`Scene`]: [`super::Base`] on a stream of the test's own), a second
//! Subscription on its own stream ([`Other`]), and publishing to a stream.

use super::app::App;
use super::base::{AccountScene, Base, OPERATOR_FLAGS};
use crate::operator::{Operator, TestStream};
use crate::subs::{apply, backend_yaml, wait_ready};
use crate::{install_crds, namespace};

/// Everything one NATS scenario needs: [`Base`] on a stream of the test's own.
pub struct Scene {
    pub base: Base,
    pub stream: TestStream,
    pub manifest_text: String,
    pub nats_url: String,
}

impl std::ops::Deref for Scene {
    type Target = Base;
    fn deref(&self) -> &Base {
        &self.base
    }
}

impl std::ops::DerefMut for Scene {
    fn deref_mut(&mut self) -> &mut Base {
        &mut self.base
    }
}

impl Scene {
    pub async fn new(test: &str, spec: &str) -> Scene {
        Scene::with_flags(test, spec, &OPERATOR_FLAGS).await
    }

    /// A scene whose operator runs with `flags`.
    pub async fn with_flags(test: &str, spec: &str, flags: &[&str]) -> Scene {
        Scene::build(test, spec, flags, &[], None).await
    }

    /// A scene whose operator runs with `flags` and the variables `op_env`, on the nats-server
    /// at `nats_url` (default: the environment's).
    pub async fn build(
        test: &str,
        spec: &str,
        flags: &[&str],
        op_env: &[(&str, &str)],
        nats_url: Option<String>,
    ) -> Scene {
        let nats_url = nats_url.unwrap_or_else(|| crate::env().nats_url);
        Scene::build_on(test, spec, flags, op_env, &nats_url, 1).await
    }

    /// As [`Scene::build`], on the servers `nats_url` (comma-separated: a JetStream cluster),
    /// the stream with `replicas`.
    pub async fn build_on(
        test: &str,
        spec: &str,
        flags: &[&str],
        op_env: &[(&str, &str)],
        nats_url: &str,
        replicas: usize,
    ) -> Scene {
        install_crds();
        let ns = namespace(test);
        let nats_url = nats_url.to_string();
        let stream = TestStream::replicated(&nats_url, test, replicas).await;
        let op = Operator::spawn_env(test, &ns, flags, op_env);
        op.wait_ready();
        apply(&ns, &backend_yaml("nats", &nats_url));
        let manifest_text = format!(
            "apiVersion: messaging.settle.dev/v1alpha1\nkind: Subscription\nmetadata: {{name: orders, namespace: {ns}}}\nspec:\n  backendRef: {{name: nats}}\n  pattern: \"{}.>\"\n{spec}",
            stream.prefix
        );
        let base = Base::subscribe(test, ns, op, flags, &manifest_text).await;
        Scene {
            base,
            stream,
            manifest_text,
            nats_url,
        }
    }

    pub fn app(&self, handler: &str) -> App {
        self.app_with(handler, &[])
    }

    /// Another Subscription `name` in the scene's namespace, on a stream of its own.
    pub async fn another(&self, name: &str, spec: &str) -> Other {
        let stream = TestStream::new(&self.nats_url, &format!("{}-{name}", self.test)).await;
        let text = format!(
            "apiVersion: messaging.settle.dev/v1alpha1\nkind: Subscription\nmetadata: {{name: {name}, namespace: {}}}\nspec:\n  backendRef: {{name: nats}}\n  pattern: \"{}.>\"\n{spec}",
            self.ns, stream.prefix
        );
        apply(&self.ns, &text);
        wait_ready(&self.api, name).await;
        let manifest = crate::root().join(format!(
            "target/account-{}-{name}-{}.yaml",
            self.test,
            std::process::id()
        ));
        std::fs::write(&manifest, &text).expect("manifest");
        Other { manifest, stream }
    }

    /// An application on another Subscription's manifest.
    pub fn app_on(&self, other: &Other, handler: &str) -> App {
        App::start(
            &[("SETTLE_NATS_URL", self.nats_url.as_str())],
            &other.manifest,
            handler,
        )
    }

    pub fn app_with(&self, handler: &str, env: &[(&str, &str)]) -> App {
        let mut all = vec![("SETTLE_NATS_URL", self.nats_url.as_str())];
        all.extend_from_slice(env);
        App::start(&all, &self.manifest, handler)
    }

    /// The Go runtime's application (`clients/go/cmd/account-app`) with `handler`.
    pub fn app_go(&self, handler: &str) -> App {
        App::start_go(
            &[("SETTLE_NATS_URL", self.nats_url.as_str())],
            &self.manifest,
            handler,
        )
    }

    pub async fn publish(&self, bodies: impl IntoIterator<Item = String>) {
        publish_to(&self.stream, bodies).await;
    }

    pub async fn finish(self) {
        self.base.finish();
        self.stream.delete().await;
    }
}

/// Publishes `bodies` to `stream` (`<prefix>.m<i>`), each stored before the next.
pub async fn publish_to(stream: &TestStream, bodies: impl IntoIterator<Item = String>) {
    for (i, body) in bodies.into_iter().enumerate() {
        stream
            .js
            .publish(format!("{}.m{i}", stream.prefix), body.into())
            .await
            .expect("publish")
            .await
            .expect("the stream stored it");
    }
}

/// A second Subscription of a scene, on its own stream.
pub struct Other {
    pub manifest: std::path::PathBuf,
    pub stream: TestStream,
}

impl Other {
    pub async fn publish(&self, bodies: impl IntoIterator<Item = String>) {
        publish_to(&self.stream, bodies).await;
    }

    pub async fn finish(self) {
        let _ = std::fs::remove_file(&self.manifest);
        self.stream.delete().await;
    }
}

impl AccountScene for Scene {
    fn app(&self, handler: &str) -> App {
        Scene::app(self, handler)
    }

    async fn publish(&self, bodies: Vec<String>) {
        Scene::publish(self, bodies).await;
    }
}
