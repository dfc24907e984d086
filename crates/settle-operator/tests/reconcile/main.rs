//! The controllers on the real API server and the real brokers, `settle operator` running as a
//! process: one test binary (`cargo test -p settle-operator --test reconcile`), a module per
//! broker and subject, so every test's name starts with the broker it runs on (`-- nats_faults::`
//! runs one module).
//!
//! | module | broker | what |
//! |---|---|---|
//! | [`deletion`] | every broker | the Backend's Secret, then the Backend, then its Subscriptions deleted: Delete objects go, Retain ones stay |
//! | [`nats`] | NATS JetStream | the Subscription controller: consumers made, updated in place, refused, deleted |
//! | [`nats_backend`] | NATS JetStream | the Backend controller: Ready, Unreachable, AuthFailed, Secrets |
//! | [`nats_faults`] | NATS JetStream | consumers deleted or edited on the broker, a broker stopped, deletes while it is down |
//! | [`nats_leader`] | NATS JetStream | two operators and their Lease: one reconciles, the other takes over |
//! | [`nats_runtime`] | NATS JetStream | the runtime example bound to the consumer the operator made |
//! | [`rabbitmq`] | RabbitMQ | queues, bindings, marks, adoption, the vhost's limits |
//! | [`rabbitmq_connection`] | RabbitMQ | the AMQP connection: without the management API, closed by the broker, closed again and again |
//! | [`sqs`] | SQS (ElasticMQ) | queues, tags, dead-letter queues, deletion |
//!
//! The Backend controller's faults, the Lease and the runtime example are the same code on every
//! broker (the controller's broker step is the only broker-specific part, and `rabbitmq` and
//! `sqs` cover theirs), so they run on NATS only.

mod deletion;
mod nats;
mod nats_backend;
mod nats_faults;
mod nats_leader;
mod nats_runtime;
mod rabbitmq;
mod rabbitmq_connection;
mod sqs;
