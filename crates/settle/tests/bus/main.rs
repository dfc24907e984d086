//! The handler runtime (`settle::bus`) on every broker it drives, one test binary with a module
//! per broker: `memory` (in process, Tokio's paused clock), `nats` (a real nats-server with
//! JetStream), `rabbitmq` (a real RabbitMQ 3.10) and `sqs` (ElasticMQ). Every test's name starts
//! with its broker's module (`nats::…`), so `cargo test --test bus -- nats::` runs one broker.
//! The real brokers come from the environment (`make env-up`, or `make test`); those modules
//! never skip.
//!
//! The scenes every broker runs are written once in `settle_testkit::bus` against `BusScene`;
//! each module runs them on its broker and goes on to assert what that broker shows on the wire
//! or in its queues. Which scene runs where (the semantics rule in brackets):
//!
//! | scene                                                     | memory | nats | rabbitmq | sqs |
//! |-----------------------------------------------------------|--------|------|----------|-----|
//! | `refused_without_a_durable_name` (M3)                     | yes    | yes  | yes      | yes |
//! | `always_nack_until_exhausted` (M2, C7)                    | yes    | yes  | yes      | yes |
//! | `at_most_once_nacks_bring_nothing_back` (M1)              | yes    | yes  | yes      | yes |
//! | `a_slow_handler_keeps_its_message` (H1, H4)               | yes    | yes  | yes (1)  | yes |
//! | `released_at_close_comes_back` (C3)                       | yes    | yes  | yes      | yes |
//! | `a_masstransit_envelope_contradicted_by_a_header_…` (C11) | yes    | yes  | yes      | yes |
//! | `a_forgotten_ack_with_prefetch_one_never_stalls` (P3)     | yes    | yes  | yes      | yes |
//!
//! (1) RabbitMQ has no per-subscription ack timeout (its capability `ackTimeout` is
//! `BrokerWide`: it never hands a message on while the channel that received it lives), so no
//! slow-handler setting does anything there; the scene runs with them set anyway, to show they
//! change nothing, as on memory (whose `ackTimeout` is `Never`).
//!
//! No test here changes process-wide state (environment variables, the default Prometheus
//! registry, set-once globals): each real-broker test works in a stream, exchange or queue prefix
//! of its own, so the tests of all four modules run in parallel in one process.

mod memory;
mod nats;
mod rabbitmq;
mod sqs;
