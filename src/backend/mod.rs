//! Backends: the brokers a subscription can run on, and what each can honour.
//!
//! `capabilities` is the one table of what each backend kind can do; admission, the runtime and
//! the README all read it. This module must not decide policy (that is `admission`).

mod capabilities;
pub mod memory;
pub mod nats;

pub use capabilities::{BackendKind, capabilities_of};
