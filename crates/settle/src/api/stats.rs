//! ConsumerStats: the delivery account (docs/semantics.md C1–C14, I1–I3), as it travels on the
//! wire (the runtime's stats report) and sits in `Subscription.status.stats`.
//!
//! Only the shape and the meaning of each counter live here; who counts what lives in `bus/`
//! (the runtime) and `account/` (the operator). Every counter is cumulative and never decreases.

use schemars::{JsonSchema, Schema};
use serde::{Deserialize, Serialize};

/// No counter has a schema default: the API server must not fill in a zero nobody counted (a
/// backend whose runtime does not report shows only the gauges it has).
fn no_defaults(schema: &mut Schema) {
    if let Some(props) = schema
        .get_mut("properties")
        .and_then(serde_json::Value::as_object_mut)
    {
        for p in props.values_mut() {
            if let Some(o) = p.as_object_mut() {
                o.remove("default");
            }
        }
    }
}

/// How handlers settled their deliveries. Acked, Nacked and Silent partition Delivered;
/// Refused is a different axis (a settlement the backend could not perform).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(transform = no_defaults)]
pub struct Settlement {
    /// Deliveries the handler accepted (Ack).
    #[serde(default)]
    pub acked: u64,
    /// Deliveries the handler declined (Nack or NackAfter).
    #[serde(default)]
    pub nacked: u64,
    /// Deliveries whose handler returned without settling (or panicked): silence is not consent.
    #[serde(default)]
    pub silent: u64,
    /// Settlements the backend could not perform (for example a nack after the consumer was retired).
    #[serde(default)]
    pub refused: u64,
}

/// The cumulative account of one subscription (semantics C1–C11). At rest (semantics I1),
/// offered == delivered + released + lost.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(transform = no_defaults)]
pub struct ConsumerStats {
    /// Attempts the backend handed to the runtime.
    #[serde(default)]
    pub offered: u64,
    /// Attempts whose handler returned (settled or silent). Attempt grain.
    #[serde(default)]
    pub delivered: u64,
    /// Attempts given up before a handler returned, owed back by the backend. Attempt grain.
    #[serde(default)]
    pub released: u64,
    /// Attempts offered and never delivered nor released (under AtMostOnce, dropped on shutdown).
    #[serde(default)]
    pub lost: u64,
    /// How handlers settled what was delivered.
    #[serde(default)]
    pub settlement: Settlement,
    /// Messages that ran out of attempts (MaxDeliver): real data loss, message grain.
    #[serde(default)]
    pub exhausted: u64,
    /// Messages declined whose backend could not be asked to try again. Message grain.
    #[serde(default)]
    pub stranded: u64,
    /// Attempts handed on at MaxProcessingTime while the handler may still have been running.
    #[serde(default)]
    pub lease_expired: u64,
    /// Declines redelivered sooner than their delay asked, because the backend could not hold them that long.
    #[serde(default)]
    pub delay_shortened: u64,
    /// Attempts whose transport header contradicted the event's envelope.
    #[serde(default)]
    pub foreign_conflicts: u64,
}

impl ConsumerStats {
    /// The identity at rest (semantics I1): offered == delivered + released + lost.
    pub fn balanced(&self) -> bool {
        self.offered == self.delivered + self.released + self.lost
    }

    /// What grew since `base`, per counter (zero where it did not).
    pub fn since(&self, base: &ConsumerStats) -> ConsumerStats {
        let d = |a: u64, b: u64| a.saturating_sub(b);
        ConsumerStats {
            offered: d(self.offered, base.offered),
            delivered: d(self.delivered, base.delivered),
            released: d(self.released, base.released),
            lost: d(self.lost, base.lost),
            settlement: Settlement {
                acked: d(self.settlement.acked, base.settlement.acked),
                nacked: d(self.settlement.nacked, base.settlement.nacked),
                silent: d(self.settlement.silent, base.settlement.silent),
                refused: d(self.settlement.refused, base.settlement.refused),
            },
            exhausted: d(self.exhausted, base.exhausted),
            stranded: d(self.stranded, base.stranded),
            lease_expired: d(self.lease_expired, base.lease_expired),
            delay_shortened: d(self.delay_shortened, base.delay_shortened),
            foreign_conflicts: d(self.foreign_conflicts, base.foreign_conflicts),
        }
    }
}
