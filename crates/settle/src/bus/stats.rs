//! The runtime's side of the account: lock-free, never-decreasing counters per subscription,
//! read back as `api::ConsumerStats` (docs/semantics.md C1–C14).
//!
//! Only `fetch_add`: nothing here may ever lower a counter or decide what a counter means (the
//! settle path and the bus decide when to count; `api::stats` documents each counter).

use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};

use crate::api::{ConsumerStats, Settlement};

/// One counter. Only goes up.
#[derive(Debug, Default)]
pub(crate) struct Counter(AtomicU64);

impl Counter {
    pub(crate) fn inc(&self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }
    pub(crate) fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// The live counters of one subscription in this process.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub offered: Counter,
    pub delivered: Counter,
    pub released: Counter,
    pub lost: Counter,
    pub acked: Counter,
    pub nacked: Counter,
    pub silent: Counter,
    pub refused: Counter,
    pub exhausted: Counter,
    pub stranded: Counter,
    pub lease_expired: Counter,
    pub delay_shortened: Counter,
    pub foreign_conflicts: Counter,
    pub handler_errors: Counter,
    pub panics: Counter,
}

impl Counters {
    /// The ConsumerStats, as of now.
    pub(crate) fn snapshot(&self) -> ConsumerStats {
        ConsumerStats {
            offered: self.offered.get(),
            delivered: self.delivered.get(),
            released: self.released.get(),
            lost: self.lost.get(),
            settlement: Settlement {
                acked: self.acked.get(),
                nacked: self.nacked.get(),
                silent: self.silent.get(),
                refused: self.refused.get(),
            },
            exhausted: self.exhausted.get(),
            stranded: self.stranded.get(),
            lease_expired: self.lease_expired.get(),
            delay_shortened: self.delay_shortened.get(),
            foreign_conflicts: self.foreign_conflicts.get(),
        }
    }

    pub(crate) fn runtime(&self) -> RuntimeStats {
        RuntimeStats {
            handler_errors: self.handler_errors.get(),
            panics: self.panics.get(),
        }
    }
}

impl RuntimeStats {
    /// What grew since `base`.
    pub(crate) fn since(&self, base: &RuntimeStats) -> RuntimeStats {
        RuntimeStats {
            handler_errors: self.handler_errors.saturating_sub(base.handler_errors),
            panics: self.panics.saturating_sub(base.panics),
        }
    }
}

/// What the runtime counts beside ConsumerStats: outcomes of the handler itself, which never
/// decide settlement (semantics S3, S5, C13).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RuntimeStats {
    /// Handler runs that returned an error (settlement unaffected).
    #[serde(default)]
    pub handler_errors: u64,
    /// Handler runs that panicked (contained; the delivery was treated as silence).
    #[serde(default)]
    pub panics: u64,
}
