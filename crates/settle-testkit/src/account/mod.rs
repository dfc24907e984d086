//! The account's test scene, shared by its suites: an application built on the `settle`
//! library (`examples/account_app.rs`) as a process, a Subscription with its stream, backend and
//! operator, and a watcher that polls `status.stats` and checks that no counter ever steps down
//! (per Subscription object: a Subscription deleted and applied again starts a new run).
//!
//! The files: `app` (the application process), `watch` (the status watcher and its checks),
//! `base` (what every broker's scene holds, and the scene trait), `scene` (the NATS scene),
//! `scenarios` (the scenarios written once for every broker), `wait` (waiting on status),
//! `reports` (stats reports: the wire format, forgeries, drops).

mod app;
mod base;
mod reports;
mod scenarios;
mod scene;
mod wait;
mod watch;

pub use app::*;
pub use base::*;
pub use reports::*;
pub use scenarios::*;
pub use scene::*;
pub use wait::*;
pub use watch::*;
