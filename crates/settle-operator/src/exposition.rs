//! Prometheus text (format 0.0.4) for series kept as one row per object, written straight from
//! the rows when scraped: a Subscription's counters and gauges (the account) and its Ready flag
//! (the controllers). A registry gathers every series into a `prometheus::proto::Metric` with
//! its labels as owned strings before encoding it, about half a kilobyte a series: at 18 series a
//! Subscription, a scrape of 1,000 built some 10 MiB the allocator then kept (issue: scale). The
//! operator's `/metrics` writes the registry's families, then every [`Table`] of [`Tables`].
//!
//! It sits at the bottom beside `api` and imports nothing of the crate, so the account and the
//! controllers, siblings, write one format. It must not keep anything between scrapes.

use std::fmt::{Display, Write};
use std::sync::{Arc, Mutex, PoisonError};

use prometheus::{Registry, TextEncoder};

/// What the metrics port writes: the registry's families, then every table's.
#[derive(Clone, Default)]
pub struct Exposition {
    pub registry: Registry,
    pub tables: Tables,
}

impl Exposition {
    /// The text of one scrape.
    pub fn text(&self) -> Result<String, prometheus::Error> {
        let mut out = TextEncoder::new().encode_to_string(&self.registry.gather())?;
        self.tables.write(&mut out);
        Ok(out)
    }
}

/// Series kept one row per object, written at each scrape.
pub trait Table: Send + Sync {
    /// Appends its families (each with HELP and TYPE; a family with no series is left out, as a
    /// registry leaves it out).
    fn write(&self, out: &mut String);
    /// About how many series [`Table::write`] appends (to size the scrape's buffer once).
    fn series(&self) -> usize;
}

/// The tables the metrics port writes after the registry's families.
#[derive(Clone, Default)]
pub struct Tables(Arc<Mutex<Vec<Arc<dyn Table>>>>);

impl Tables {
    pub fn add(&self, table: Arc<dyn Table>) {
        self.list().push(table);
    }

    /// Every table's families, appended to `out`.
    pub fn write(&self, out: &mut String) {
        let tables = self.list().clone();
        // A series is about a hundred bytes; one allocation instead of a doubling per megabyte.
        out.reserve(tables.iter().map(|t| t.series()).sum::<usize>() * 100);
        for t in tables {
            t.write(out);
        }
    }

    fn list(&self) -> std::sync::MutexGuard<'_, Vec<Arc<dyn Table>>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A family's type, as its TYPE line says it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
}

/// One family: HELP and TYPE, then one line per series (label values in `labels`' order). Writes
/// nothing when `series` is empty.
pub fn family<'a, const N: usize, V: Display>(
    out: &mut String,
    name: &str,
    help: &str,
    kind: Kind,
    labels: [&str; N],
    series: impl IntoIterator<Item = ([&'a str; N], V)>,
) {
    let mut series = series.into_iter().peekable();
    if series.peek().is_none() {
        return;
    }
    let kind = match kind {
        Kind::Counter => "counter",
        Kind::Gauge => "gauge",
    };
    out.push_str("# HELP ");
    out.push_str(name);
    out.push(' ');
    escape(out, help, false);
    out.push_str("\n# TYPE ");
    out.push_str(name);
    out.push(' ');
    out.push_str(kind);
    out.push('\n');
    for (values, value) in series {
        out.push_str(name);
        let mut separator = '{';
        for (label, v) in labels.iter().zip(values) {
            out.push(separator);
            out.push_str(label);
            out.push_str("=\"");
            escape(out, v, true);
            out.push('"');
            separator = ',';
        }
        if N > 0 {
            out.push('}');
        }
        // Writing to a String cannot fail.
        let _ = writeln!(out, " {value}");
    }
}

/// `\` as `\\`, a newline as `\n`, and in a label value `"` as `\"`.
fn escape(out: &mut String, text: &str, quote: bool) {
    for c in text.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '"' if quote => out.push_str("\\\""),
            c => out.push(c),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus::{Encoder, IntCounterVec, IntGaugeVec, Opts};

    /// What a registry writes for the same series, byte for byte.
    #[test]
    fn a_family_is_written_as_the_registry_writes_it() {
        let r = Registry::new();
        let help = "Attempts settled \\ Ack,\nsaid \"twice\".";
        let c = IntCounterVec::new(
            Opts::new("settle_x_total", help),
            &["namespace", "subscription"],
        )
        .expect("metric");
        r.register(Box::new(c.clone())).expect("registers");
        c.with_label_values(&["shop", "or\"d\\e\nrs"]).inc_by(30);
        let g =
            IntGaugeVec::new(Opts::new("settle_y", "A gauge."), &["namespace"]).expect("metric");
        r.register(Box::new(g.clone())).expect("registers");
        g.with_label_values(&["shop"]).set(-4);
        let mut want = Vec::new();
        TextEncoder::new()
            .encode(&r.gather(), &mut want)
            .expect("encodes");

        let mut out = String::new();
        family(
            &mut out,
            "settle_x_total",
            help,
            Kind::Counter,
            ["namespace", "subscription"],
            [(["shop", "or\"d\\e\nrs"], 30u64)],
        );
        family(
            &mut out,
            "settle_y",
            "A gauge.",
            Kind::Gauge,
            ["namespace"],
            [(["shop"], -4i64)],
        );
        assert_eq!(out, String::from_utf8(want).expect("utf-8"));
    }

    #[test]
    fn a_family_without_series_is_left_out_and_tables_follow_the_registry_in_turn() {
        struct One(&'static str);
        impl Table for One {
            fn write(&self, out: &mut String) {
                family(out, self.0, "A.", Kind::Gauge, ["l"], [(["x"], 1)]);
                family(
                    out,
                    "b",
                    "B.",
                    Kind::Gauge,
                    ["l"],
                    Vec::<([&str; 1], u8)>::new(),
                );
            }
            fn series(&self) -> usize {
                1
            }
        }
        let e = Exposition::default();
        e.tables.add(Arc::new(One("a")));
        e.tables.add(Arc::new(One("c")));
        let out = e.text().expect("encodes");
        let (a, c) = (
            "# HELP a A.\n# TYPE a gauge\na{l=\"x\"} 1\n",
            "# HELP c A.\n# TYPE c gauge\nc{l=\"x\"} 1\n",
        );
        assert_eq!(out, format!("{a}{c}"));
    }
}
