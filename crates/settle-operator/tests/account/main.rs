//! The delivery account end to end on the real API server and the real brokers: `settle
//! operator` and an application on the `settle` library as processes, messages on the broker,
//! `status.stats` read back. One test binary (`cargo test -p settle-operator --test account`), a
//! module per broker and subject, so every test's name starts with the broker it runs on.
//!
//! | module | broker | what |
//! |---|---|---|
//! | [`nats`] | NATS JetStream | every counter, conditions, `kubectl describe` |
//! | [`nats_epochs`] | NATS JetStream | a new object under running applications: a takeover, a delete and apply across slow handlers |
//! | [`nats_deletion`] | NATS JetStream | a namespace deleted at once leaves nothing of the account; a deleted Backend's sweep |
//! | [`nats_life`] | NATS JetStream | delete and apply, applications stopped and killed, operator restarts and leader changes, lost sources |
//! | [`nats_fold`] | NATS JetStream | a folded instance's report kept until its fold is saved |
//! | [`writer`] | (none) | the status writer writes a patch to the object it was made for only |
//! | [`nats_budget`] | NATS JetStream | the cluster-wide status write budget |
//! | [`nats_flood`] | NATS JetStream | a tenant flooding the report bucket |
//! | [`nats_reader`] | NATS JetStream | the capture reader kept across operator versions (renamed, ack wait brought in place) |
//! | [`nats_rotate`] | NATS JetStream | a Backend's credentials rotated and its consent withdrawn: the account follows |
//! | [`nats_runtimes`] | NATS JetStream | one Subscription served by the Rust and the Go runtime at once: one exact account |
//! | [`nats_watch`] | NATS JetStream | a report watch the broker heartbeats and never feeds is made again |
//! | [`tenants`] | NATS JetStream and RabbitMQ | reports bound to their writer, replies to their inbox: no tenant forges another's account or reads its deliveries |
//! | [`nats_accounts`] | NATS JetStream | a NATS account per tenant: nothing shared, a full report bucket said |
//! | [`matrix`], [`matrix_nats`], [`matrix_rabbitmq`], [`matrix_sqs`] | each | the tenant attack matrix: every attack another tenant can try, tried, and `docs/guide/tenant-matrix.md` checked against it |
//! | [`rabbitmq`] | RabbitMQ | report queues, snapshots, dead-letter copies, operator kills |
//! | [`rabbitmq_deletion`] | RabbitMQ | a namespace deleted at once leaves none of the account's queues |
//! | [`rabbitmq_epochs`] | RabbitMQ | a new object under running applications; an earlier object's dead letter read after a takeover |
//! | [`sqs`] | SQS (ElasticMQ) | report queues, the ledger queue, the dead-letter queue |
//!
//! The budget and the flood bounds are the account's own, the same for every broker's keeper, so
//! they run on NATS only; `tenants` runs where a broker lets tenants share it.

mod matrix;
mod matrix_nats;
mod matrix_rabbitmq;
mod matrix_sqs;
mod nats;
mod nats_accounts;
mod nats_budget;
mod nats_deletion;
mod nats_epochs;
mod nats_flood;
mod nats_fold;
mod nats_life;
mod nats_reader;
mod nats_rotate;
mod nats_runtimes;
mod nats_watch;
mod rabbitmq;
mod rabbitmq_deletion;
mod rabbitmq_epochs;
mod sqs;
mod tenants;
mod writer;
