//! A RabbitMQ account scene for scenarios written once for every broker (`account.rs`'s
//! [`AccountScene`]): a namespace, a RabbitMQ Backend on the environment's broker (with its
//! management API), the operator, Subscription `orders` on a routing key and quorum queue of the
//! test's own, the application (`examples/account_app.rs`) on RabbitMQ, and messages published
//! to `amq.topic` with publisher confirms.

use super::account::{AccountScene, App, Base};
use super::operator::Operator;
use super::rabbitmq::{env_backend_yaml, publish_topic};
use super::subs::{apply, backends, wait_backend};
use super::{install_crds, namespace};

pub struct RabbitScene {
    pub base: Base,
    /// The routing-key prefix and queue name of the test's own.
    pub tag: String,
    pub amqp: lapin::Connection,
    pub app_env: Vec<(String, String)>,
}

impl std::ops::Deref for RabbitScene {
    type Target = Base;
    fn deref(&self) -> &Base {
        &self.base
    }
}

impl std::ops::DerefMut for RabbitScene {
    fn deref_mut(&mut self) -> &mut Base {
        &mut self.base
    }
}

impl RabbitScene {
    /// Subscription `orders` (durableName the tag) with `policy` after it, the operator with
    /// `flags`, and `app_env` for every application.
    pub async fn new(
        test: &str,
        policy: &str,
        flags: &[&str],
        app_env: &[(&str, &str)],
    ) -> RabbitScene {
        install_crds();
        let ns = namespace(test);
        let env = super::env();
        let tag = format!("{}{}", test.replace('-', ""), std::process::id());
        let op = Operator::start_with(test, &ns, flags);
        apply(&ns, &env_backend_yaml("rabbit", ""));
        wait_backend(&backends(&ns).await, "rabbit", "True", "Connected").await;
        let manifest_text = format!(
            "apiVersion: messaging.settle.dev/v1alpha1\nkind: Subscription\nmetadata: {{name: orders, namespace: {ns}}}\nspec:\n  backendRef: {{name: rabbit}}\n  pattern: \"{tag}.>\"\n  durableName: {tag}\n{policy}"
        );
        let base = Base::subscribe(test, ns, op, flags, &manifest_text).await;
        let amqp =
            lapin::Connection::connect(&env.rabbitmq_url, lapin::ConnectionProperties::default())
                .await
                .expect("connect to RabbitMQ");
        let mut all = vec![("SETTLE_RABBITMQ_URL".to_string(), env.rabbitmq_url.clone())];
        all.extend(app_env.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        RabbitScene {
            base,
            tag,
            amqp,
            app_env: all,
        }
    }

    pub fn app(&self, handler: &str) -> App {
        let env: Vec<(&str, &str)> = self
            .app_env
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        App::start(&env, &self.manifest, handler)
    }

    /// Publishes `bodies` to `amq.topic` on this test's routing keys.
    pub async fn publish(&self, bodies: Vec<String>) {
        let keys = (1..).map(|i| format!("{}.m{i}", self.tag));
        publish_topic(&self.amqp, keys.zip(bodies)).await;
    }

    pub fn finish(self) {
        self.base.finish();
    }
}

impl AccountScene for RabbitScene {
    fn app(&self, handler: &str) -> App {
        RabbitScene::app(self, handler)
    }

    async fn publish(&self, bodies: Vec<String>) {
        RabbitScene::publish(self, bodies).await;
    }
}
