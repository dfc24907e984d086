//! A broker's refusal because one of its limits is reached ([`BrokerLimit`]): a create that
//! retrying will not help until a consumer or queue goes, or the limit is raised. Each says which
//! limit, where it is set and what to change; [`LimitScope`] says what else it holds back (the
//! other creates on one stream, or on the whole Backend).
//!
//! Typed here, beside each broker's error (`nats::admin::NatsError::Limit`,
//! `rabbitmq::admin::AdminError::Limit`), so no controller reads a broker's words. It must not
//! decide when to retry (the controllers' gate does).

/// Whose setting a stream's consumer limit is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SetBy {
    /// The stream's own `max_consumers`.
    Stream,
    /// The account's JetStream limit `max_consumers` (per stream, lower than the stream's own).
    Account,
    /// Not known (the stream could not be read after the refusal).
    Unknown,
}

/// A limit the broker named when it refused to make a consumer or queue.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum BrokerLimit {
    /// JetStream error 10026: the stream holds as many consumers as it (or its account) allows.
    #[error("{}", consumers(stream, *max, *set_by))]
    StreamConsumers {
        stream: String,
        /// The limit, when it could be read.
        max: Option<i64>,
        set_by: SetBy,
    },
    /// JetStream errors 10002, 10023, 10028, 10047: the account or server has no resources
    /// left (storage, memory, or the account's resource limits).
    #[error(
        "the NATS account or server has no JetStream resources left for another consumer ({description}, error code {code}); raise the account's JetStream limits (max_memory, max_storage) or free resources on the server"
    )]
    Resources { code: u64, description: String },
    /// RabbitMQ: the vhost holds as many queues as its `max-queues` limit allows.
    #[error("{}", vhost_queues(vhost, *max))]
    VhostQueues { vhost: String, max: Option<i64> },
    /// RabbitMQ: the cluster holds as many queues as its `cluster_queue_limit` allows.
    #[error(
        "the RabbitMQ cluster allows no more queues (cluster_queue_limit{}); raise it in rabbitmq.conf or delete unused queues",
        max.map(|m| format!(" = {m}")).unwrap_or_default()
    )]
    ClusterQueues { max: Option<i64> },
}

/// What a refusal holds back: the creates on one stream, or every create on the Backend.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum LimitScope {
    Stream(String),
    Backend,
}

/// Every [`BrokerLimit::label`].
pub const LABELS: [&str; 4] = [
    "max_consumers",
    "jetstream_resources",
    "max_queues",
    "cluster_queue_limit",
];

impl BrokerLimit {
    pub fn scope(&self) -> LimitScope {
        match self {
            BrokerLimit::StreamConsumers { stream, .. } => LimitScope::Stream(stream.clone()),
            _ => LimitScope::Backend,
        }
    }

    /// The limit's name, as metrics label it.
    pub fn label(&self) -> &'static str {
        match self {
            BrokerLimit::StreamConsumers { .. } => "max_consumers",
            BrokerLimit::Resources { .. } => "jetstream_resources",
            BrokerLimit::VhostQueues { .. } => "max_queues",
            BrokerLimit::ClusterQueues { .. } => "cluster_queue_limit",
        }
    }

    /// What frees a place at once, as status says it.
    pub fn freed_by(&self) -> &'static str {
        match self {
            BrokerLimit::StreamConsumers { .. } => {
                "when a consumer on this stream is deleted or the stream changes"
            }
            BrokerLimit::Resources { .. } => {
                "when a consumer on this Backend is deleted or the Backend changes"
            }
            BrokerLimit::VhostQueues { .. } | BrokerLimit::ClusterQueues { .. } => {
                "when a queue of this Backend is deleted or the Backend changes"
            }
        }
    }
}

fn consumers(stream: &str, max: Option<i64>, set_by: SetBy) -> String {
    let spread = "or spread Subscriptions over streams";
    match (set_by, max) {
        (SetBy::Stream, Some(m)) => format!(
            "the stream {stream} allows at most {m} consumers (max_consumers); raise it on the stream (nats stream edit {stream} --max-consumers) {spread}"
        ),
        (SetBy::Account, Some(m)) => format!(
            "the account's JetStream limits allow at most {m} consumers per stream (max_consumers), and stream {stream} has them; raise the account's limit {spread}"
        ),
        _ => format!(
            "the stream {stream} holds as many consumers as it or its account allows (max_consumers); raise the stream's or the account's limit {spread}"
        ),
    }
}

fn vhost_queues(vhost: &str, max: Option<i64>) -> String {
    let at_most = max.map(|m| format!(" at most {m}")).unwrap_or_default();
    format!(
        "the vhost {vhost} allows{at_most} queues (max-queues); raise it (rabbitmqctl set_vhost_limits -p {vhost} '{{\"max-queues\": N}}') or delete unused queues"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_limit_names_itself_and_what_to_change() {
        let s = BrokerLimit::StreamConsumers {
            stream: "ORDERS".into(),
            max: Some(1000),
            set_by: SetBy::Stream,
        };
        assert!(
            s.to_string().starts_with(
                "the stream ORDERS allows at most 1000 consumers (max_consumers); raise it"
            ),
            "{s}"
        );
        assert_eq!(s.scope(), LimitScope::Stream("ORDERS".into()));
        let a = BrokerLimit::StreamConsumers {
            stream: "ORDERS".into(),
            max: Some(10),
            set_by: SetBy::Account,
        };
        assert!(
            a.to_string()
                .contains("account's JetStream limits allow at most 10"),
            "{a}"
        );
        let v = BrokerLimit::VhostQueues {
            vhost: "shop".into(),
            max: Some(5),
        };
        assert!(
            v.to_string()
                .contains("vhost shop allows at most 5 queues (max-queues)"),
            "{v}"
        );
        assert_eq!(v.scope(), LimitScope::Backend);
        for l in [s, a, v] {
            assert!(l.to_string().contains("raise"), "{l}");
        }
    }
}
