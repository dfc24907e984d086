//! The broker's gauges of SQS Subscriptions: one loop per such Backend reads each managed queue's
//! counts (visible and not visible; the reader also serves RabbitMQ's ready and unacknowledged,
//! which a RabbitMQ Backend's keeper, `rabbit`, reads beside its counters) once per stats interval, spread over the interval, and hands the
//! writer `status.stats.pending` and `.ackPending` when they changed, at most once per interval.
//!
//! Only the gauges: that runtime does not report their counters to the operator yet, so this loop
//! writes no counter and no condition. It must not count anything.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::runtime::reflector::Store;

use super::Config;
use super::show;
use super::writer::Writer;
use crate::api::Subscription;
use crate::backend::QueueGauges;

/// How often the loop reads what is due and decides what to write.
const TICK: Duration = Duration::from_secs(1);

/// A Subscription, by namespace and name.
type SubKey = (String, String);

#[derive(Default)]
struct Seen {
    gauges: Option<(u64, u64)>,
    read_at: Option<Instant>,
    last_write: Option<Instant>,
}

pub struct GaugeKeeper {
    backend: SubKey,
    reader: QueueGauges,
    subs: Store<Subscription>,
    writer: Writer,
    config: Config,
}

impl GaugeKeeper {
    pub fn new(
        backend: SubKey,
        reader: QueueGauges,
        subs: Store<Subscription>,
        writer: Writer,
        config: Config,
    ) -> GaugeKeeper {
        GaugeKeeper {
            backend,
            reader,
            subs,
            writer,
            config,
        }
    }

    /// Runs until aborted.
    pub async fn run(self) {
        let mut seen: HashMap<SubKey, Seen> = HashMap::new();
        let mut tick = tokio::time::interval(TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let interval = self.config.stats_interval;
        loop {
            tick.tick().await;
            let members: Vec<_> = self
                .subs
                .state()
                .into_iter()
                .filter(|s| {
                    s.namespace().as_deref() == Some(self.backend.0.as_str())
                        && s.spec.backend_ref.name == self.backend.1
                })
                .collect();
            seen.retain(|k, _| members.iter().any(|s| s.name_any() == k.1));
            let mut budget = show::gauge_budget(members.len(), interval, TICK);
            let stamp = Time(Timestamp::now());
            for sub in members {
                let Some(queue) = sub.status.as_ref().and_then(|s| s.consumer.as_ref()) else {
                    continue;
                };
                let key = (self.backend.0.clone(), sub.name_any());
                let entry = seen.entry(key.clone()).or_default();
                if budget > 0 && entry.read_at.is_none_or(|t| t.elapsed() >= interval) {
                    budget -= 1;
                    entry.read_at = Some(Instant::now());
                    match self.reader.read(&queue.name).await {
                        Ok(g) => entry.gauges = Some(g.unwrap_or((0, 0))),
                        Err(e) => {
                            tracing::debug!(subscription = %format!("{}/{}", key.0, key.1), error = %e, "cannot read the queue's gauges")
                        }
                    }
                }
                let Some(gauges) = entry.gauges else {
                    continue;
                };
                show::show_gauges(
                    &self.writer,
                    interval,
                    &key,
                    &sub,
                    gauges,
                    &mut entry.last_write,
                    &stamp,
                );
            }
        }
    }
}
