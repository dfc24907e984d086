//! What a broker object of a Subscription is ([`ObjectKind`]: a JetStream consumer, a RabbitMQ
//! queue, an SQS queue) and whose an existing one is ([`Holder`]): the words every broker step's
//! outcome is made of, and the sentences a person reads in `Ready` for each kind (ready, differs
//! where the broker cannot change it, not this Subscription's).
//!
//! Pure: no I/O. It must not decide what a step does, nor which reason a condition carries
//! ([`super::subscription`] does).

use settle::api::ConsumerRef;

/// The annotation by which a Subscription takes over the queues an earlier object of its name
/// left behind (a queue or a kept consumer): its value is that object's UID (docs/semantics.md
/// J8, R8, Q7).
pub const ADOPT_ANNOTATION: &str = "settle.dev/adopt";

/// What a broker object of a Subscription is. With it goes a [`ConsumerRef`], as status shows
/// it: a consumer's stream, a RabbitMQ queue's exchange, `sqs` for an SQS queue; and its name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ObjectKind {
    /// A JetStream consumer on its stream.
    Consumer,
    /// A RabbitMQ quorum queue, bound on an exchange.
    RabbitmqQueue,
    /// An SQS queue (or its dead-letter queue).
    SqsQueue,
}

/// Whose a broker object Settle leaves alone is (docs/semantics.md J8, R8, Q7), and so the way
/// out.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Holder {
    /// Another Subscription (`namespace/name`, its owner mark, argument or tag).
    Other(String),
    /// No Subscription: it carries no owner mark, so Settle did not make it.
    Unmarked,
    /// RabbitMQ without the management API: the queue exists and no mark says Settle made it
    /// for this object; its owner argument cannot be read.
    Unproven,
    /// An earlier object of this Subscription's name (`owner`, the `namespace/name` both have;
    /// `uid`, that object's UID) made it and left it behind or kept it.
    Earlier { owner: String, uid: String },
    /// No Subscription's (no owner mark), and `spec.adopt: IfCompatible` could not take it over.
    Unadoptable(Unadoptable),
}

/// Why `spec.adopt: IfCompatible` did not take over a consumer or queue Settle did not make
/// (docs/semantics.md J9, R13, Q11).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Unadoptable {
    /// It differs from what the spec maps to where the broker cannot change it in place: each
    /// difference, naming the broker's field, the spec's, and both values.
    Differs(Vec<String>),
    /// The operator's `--adopt-namespaces` does not list the Subscription's namespace.
    NamespaceNotAllowed(String),
}

impl ObjectKind {
    /// Whether the broker announces a change of it (JetStream's advisories): if not, a wrong
    /// one is looked at again on the drift interval.
    pub fn announced(self) -> bool {
        matches!(self, ObjectKind::Consumer)
    }

    /// `Ready=True`: it exists and matches the spec.
    pub fn ready_message(self, o: &ConsumerRef) -> String {
        match self {
            ObjectKind::Consumer => format!(
                "consumer {} on stream {} matches the spec",
                o.name, o.stream
            ),
            ObjectKind::RabbitmqQueue => format!(
                "rabbitmq queue {} bound on exchange {} matches the spec",
                o.name, o.stream
            ),
            ObjectKind::SqsQueue => format!("SQS queue {} matches the spec", o.name),
        }
    }

    /// `Paused=True`: the broker holds the pause `pause` (semantics W2–W4).
    pub fn paused_message(self, o: &ConsumerRef, pause: settle::policy::Pause) -> String {
        let until = pause.until_text();
        let how = match self {
            ObjectKind::Consumer => format!(
                "consumer {} on stream {} is paused on the server {until}",
                o.name, o.stream
            ),
            ObjectKind::RabbitmqQueue => format!(
                "queue {} is paused {until}: the marker exchange settle.paused.{} is there, and every \
                 application stops consuming within its pause poll interval (SETTLE_PAUSE_POLL_INTERVAL, 5s unless set)",
                o.name, o.name
            ),
            ObjectKind::SqsQueue => format!(
                "SQS queue {} is paused {until}: it is tagged settle-paused, and every application stops \
                 receiving within its pause poll interval (SETTLE_PAUSE_POLL_INTERVAL, 5s unless set)",
                o.name
            ),
        };
        format!(
            "{how}. Nothing is offered to handlers; messages wait on the broker and the account keeps \
             counting (deliveries taken before the pause finish). Resume: kubectl settle resume NAME"
        )
    }

    /// `ImmutableField`: it differs where the broker cannot change it in place (`fields`: each
    /// difference, naming the broker's field and the spec's), and the way out.
    pub fn immutable_message(self, o: &ConsumerRef, fields: &[String]) -> String {
        let fields = fields.join("; ");
        match self {
            ObjectKind::Consumer => format!(
                "consumer {} on stream {} differs where JetStream cannot change it in place ({fields}); \
                 Settle leaves it as it is: delete the consumer (nats consumer rm {} {}) and Settle makes it again \
                 (its unsettled messages are redelivered from the stream), or recreate the Subscription",
                o.name, o.stream, o.stream, o.name,
            ),
            ObjectKind::RabbitmqQueue | ObjectKind::SqsQueue => format!(
                "queue {} differs where {} cannot change it in place ({fields}); Settle leaves it as it is: \
                 delete the queue (its messages go with it) and Settle makes it again, or give the \
                 Subscription another durableName",
                o.name,
                if self == ObjectKind::SqsQueue {
                    "SQS"
                } else {
                    "RabbitMQ"
                },
            ),
        }
    }

    /// The broker's name, as a sentence says it.
    fn broker(self) -> &'static str {
        match self {
            ObjectKind::Consumer => "JetStream",
            ObjectKind::RabbitmqQueue => "RabbitMQ",
            ObjectKind::SqsQueue => "SQS",
        }
    }

    /// What a taken-over object keeps.
    fn keeps(self) -> &'static str {
        match self {
            ObjectKind::Consumer => "its position",
            ObjectKind::RabbitmqQueue | ObjectKind::SqsQueue => "the messages it holds",
        }
    }

    /// `ConsumerConflict`: it is not this Subscription object's, whose it is, and the way out.
    pub fn conflict_message(self, o: &ConsumerRef, owner: &Holder) -> String {
        let (what, noun) = match self {
            ObjectKind::Consumer => (
                format!("consumer {} on stream {}", o.name, o.stream),
                "consumer",
            ),
            ObjectKind::RabbitmqQueue => (format!("rabbitmq queue {}", o.name), "queue"),
            ObjectKind::SqsQueue => (format!("sqs queue {}", o.name), "queue"),
        };
        let (broker, keeps) = (self.broker(), self.keeps());
        match owner {
            Holder::Other(other) => {
                format!("{what} belongs to Subscription {other}: choose another durableName")
            }
            Holder::Unmarked => format!(
                "{what} exists and Settle did not make it: choose another durableName; \
                 or set spec.adopt: IfCompatible to take it over with {keeps} (it must equal this spec \
                 where {broker} cannot change it in place); or delete that {noun} so Settle can make its own"
            ),
            Holder::Unadoptable(Unadoptable::Differs(fields)) => format!(
                "{what} exists and Settle did not make it; spec.adopt IfCompatible takes it over only \
                 when it equals this spec where {broker} cannot change it in place, and it differs ({}). \
                 It is left as it is: change the spec to match it, or delete that {noun} so Settle can \
                 make its own, or choose another durableName",
                fields.join("; ")
            ),
            Holder::Unadoptable(Unadoptable::NamespaceNotAllowed(ns)) => format!(
                "{what} exists and Settle did not make it; spec.adopt is IfCompatible, but the operator \
                 takes over what it did not make only for the namespaces its --adopt-namespaces lists, \
                 and {ns} is not among them (on a broker namespaces share, a durableName can name \
                 another team's {noun}): ask the cluster's admin to add {ns}, or choose another durableName"
            ),
            Holder::Unproven => format!(
                "{what} exists and nothing shows Settle made it for this Subscription \
                 (without the Backend's spec.rabbitmq.managementUrl its owner argument cannot be read, \
                 nor, for spec.adopt, its arguments compared): it is neither bound nor deleted. Choose \
                 another durableName, or set spec.rabbitmq.managementUrl on the Backend so Settle can \
                 read whose queue it is"
            ),
            // A kept consumer has its position: taken over with it.
            Holder::Earlier { owner, uid } if self == ObjectKind::Consumer => format!(
                "{what} belongs to Subscription {owner} (an earlier object of this name, uid {uid}, kept by \
                 its deletionPolicy Retain; to take it over with its position, annotate this Subscription \
                 {ADOPT_ANNOTATION}: \"{uid}\"): choose another durableName"
            ),
            Holder::Earlier { uid, .. } => format!(
                "{what} was made for an earlier Subscription of this name (uid {uid}) \
                 and left behind (deletionPolicy Retain, or deleted while no operator ran): it is \
                 neither used nor deleted. To take it over with what it holds, annotate this \
                 Subscription {ADOPT_ANNOTATION}: \"{uid}\"; or choose another durableName"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(stream: &str, name: &str) -> ConsumerRef {
        ConsumerRef {
            stream: stream.into(),
            name: name.into(),
        }
    }

    fn earlier() -> Holder {
        Holder::Earlier {
            owner: "shop/orders".into(),
            uid: "u-0".into(),
        }
    }

    // Long on purpose: a table, one row per kind and holder, each sentence word for word.
    /// Every sentence, word for word (users and alerts read these): as status showed it before
    /// the outcomes of the three brokers were made one, with the way to adopt (`spec.adopt`)
    /// added where Settle did not make the object.
    #[test]
    fn every_kind_says_what_it_said_before() {
        use ObjectKind::{Consumer, RabbitmqQueue, SqsQueue};
        let (c, q, s) = (
            at("ORDERS", "orders"),
            at("amq.topic", "orders"),
            at("sqs", "orders-dlq"),
        );
        let other = Holder::Other("other/orders".into());
        let cases = [
            (
                Consumer.ready_message(&c),
                "consumer orders on stream ORDERS matches the spec",
            ),
            (
                RabbitmqQueue.ready_message(&q),
                "rabbitmq queue orders bound on exchange amq.topic matches the spec",
            ),
            (
                SqsQueue.ready_message(&at("sqs", "orders")),
                "SQS queue orders matches the spec",
            ),
            (
                Consumer.immutable_message(
                    &c,
                    &[
                        "ack_policy (spec.mode): wants Explicit, the consumer has None".into(),
                        "deliver_policy: wants All, the consumer has New".into(),
                    ],
                ),
                "consumer orders on stream ORDERS differs where JetStream cannot change it in place (ack_policy (spec.mode): wants Explicit, the consumer has None; deliver_policy: wants All, the consumer has New); Settle leaves it as it is: delete the consumer (nats consumer rm ORDERS orders) and Settle makes it again (its unsettled messages are redelivered from the stream), or recreate the Subscription",
            ),
            (
                RabbitmqQueue.immutable_message(
                    &q,
                    &[
                        "x-delivery-limit (spec.maxDeliver): wants 4, the queue has 9".into(),
                        "x-b".into(),
                    ],
                ),
                "queue orders differs where RabbitMQ cannot change it in place (x-delivery-limit (spec.maxDeliver): wants 4, the queue has 9; x-b); Settle leaves it as it is: delete the queue (its messages go with it) and Settle makes it again, or give the Subscription another durableName",
            ),
            (
                Consumer.conflict_message(&c, &other),
                "consumer orders on stream ORDERS belongs to Subscription other/orders: choose another durableName",
            ),
            (
                Consumer.conflict_message(&c, &Holder::Unmarked),
                "consumer orders on stream ORDERS exists and Settle did not make it: choose another durableName; or set spec.adopt: IfCompatible to take it over with its position (it must equal this spec where JetStream cannot change it in place); or delete that consumer so Settle can make its own",
            ),
            (
                Consumer.conflict_message(&c, &earlier()),
                "consumer orders on stream ORDERS belongs to Subscription shop/orders (an earlier object of this name, uid u-0, kept by its deletionPolicy Retain; to take it over with its position, annotate this Subscription settle.dev/adopt: \"u-0\"): choose another durableName",
            ),
            (
                RabbitmqQueue.conflict_message(&q, &other),
                "rabbitmq queue orders belongs to Subscription other/orders: choose another durableName",
            ),
            (
                RabbitmqQueue.conflict_message(&q, &Holder::Unmarked),
                "rabbitmq queue orders exists and Settle did not make it: choose another durableName; or set spec.adopt: IfCompatible to take it over with the messages it holds (it must equal this spec where RabbitMQ cannot change it in place); or delete that queue so Settle can make its own",
            ),
            (
                RabbitmqQueue.conflict_message(&q, &Holder::Unproven),
                "rabbitmq queue orders exists and nothing shows Settle made it for this Subscription (without the Backend's spec.rabbitmq.managementUrl its owner argument cannot be read, nor, for spec.adopt, its arguments compared): it is neither bound nor deleted. Choose another durableName, or set spec.rabbitmq.managementUrl on the Backend so Settle can read whose queue it is",
            ),
            (
                RabbitmqQueue.conflict_message(&q, &earlier()),
                "rabbitmq queue orders was made for an earlier Subscription of this name (uid u-0) and left behind (deletionPolicy Retain, or deleted while no operator ran): it is neither used nor deleted. To take it over with what it holds, annotate this Subscription settle.dev/adopt: \"u-0\"; or choose another durableName",
            ),
            (
                SqsQueue.conflict_message(&s, &other),
                "sqs queue orders-dlq belongs to Subscription other/orders: choose another durableName",
            ),
            (
                SqsQueue.conflict_message(&s, &Holder::Unmarked),
                "sqs queue orders-dlq exists and Settle did not make it: choose another durableName; or set spec.adopt: IfCompatible to take it over with the messages it holds (it must equal this spec where SQS cannot change it in place); or delete that queue so Settle can make its own",
            ),
            (
                SqsQueue.conflict_message(&s, &earlier()),
                "sqs queue orders-dlq was made for an earlier Subscription of this name (uid u-0) and left behind (deletionPolicy Retain, or deleted while no operator ran): it is neither used nor deleted. To take it over with what it holds, annotate this Subscription settle.dev/adopt: \"u-0\"; or choose another durableName",
            ),
            (
                Consumer.conflict_message(
                    &c,
                    &Holder::Unadoptable(Unadoptable::Differs(vec![
                        "ack_policy (spec.mode): wants Explicit, the consumer has All".into(),
                        "deliver_policy (spec.durableName): wants All, the consumer has New".into(),
                    ])),
                ),
                "consumer orders on stream ORDERS exists and Settle did not make it; spec.adopt IfCompatible takes it over only when it equals this spec where JetStream cannot change it in place, and it differs (ack_policy (spec.mode): wants Explicit, the consumer has All; deliver_policy (spec.durableName): wants All, the consumer has New). It is left as it is: change the spec to match it, or delete that consumer so Settle can make its own, or choose another durableName",
            ),
            (
                RabbitmqQueue.conflict_message(
                    &q,
                    &Holder::Unadoptable(Unadoptable::NamespaceNotAllowed("shop".into())),
                ),
                "rabbitmq queue orders exists and Settle did not make it; spec.adopt is IfCompatible, but the operator takes over what it did not make only for the namespaces its --adopt-namespaces lists, and shop is not among them (on a broker namespaces share, a durableName can name another team's queue): ask the cluster's admin to add shop, or choose another durableName",
            ),
        ];
        for (got, want) in cases {
            assert_eq!(got, want);
        }
    }

    #[test]
    fn only_a_consumer_is_announced_by_its_broker() {
        assert!(ObjectKind::Consumer.announced());
        assert!(!ObjectKind::RabbitmqQueue.announced());
        assert!(!ObjectKind::SqsQueue.announced());
    }
}
