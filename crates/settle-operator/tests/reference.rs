//! The reference pages under docs/reference/ that are made from the code, so they cannot drift:
//!
//! - `flags.md`: every `settle operator` flag as clap has it (`OperatorArgs`): env fallback,
//!   default, help;
//! - `metrics.md`: every metric the operator (and the runtime, `settle_runtime_*`) exports, taken
//!   from the real metric sets registered in a registry, and from the source only for those that
//!   cannot be built here (private to the crate, or needing a cluster), cross-checked both ways
//!   against every `"settle_…"` name the source writes;
//! - `conditions.md`: every condition type and reason constant, with its writer and its doc
//!   comment, read from the source files that declare them and checked against the constants;
//! - `values.md`: every Helm value in charts/settle/values.schema.json, with its default from
//!   values.yaml.
//!
//! Each test renders its page and compares it with the file; when they differ it fails saying
//! to run `make reference`, which runs this suite with `SETTLE_WRITE_REFERENCE=1` so that each
//! test writes its page instead.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use clap::Args as _;
use prometheus::core::Collector;
use regex::Regex;
use settle_testkit as common;

/// Compares `page` with docs/reference/`name`, or writes it there under `make reference`.
fn check_page(name: &str, page: &str) {
    let path = common::root().join("docs/reference").join(name);
    if std::env::var_os("SETTLE_WRITE_REFERENCE").is_some_and(|v| v == "1") {
        std::fs::create_dir_all(path.parent().expect("a parent")).expect("docs/reference");
        std::fs::write(&path, page).expect("write the page");
        return;
    }
    let on_disk = std::fs::read_to_string(&path).unwrap_or_default();
    if on_disk != page {
        let first = on_disk
            .lines()
            .zip(page.lines())
            .position(|(a, b)| a != b)
            .unwrap_or_else(|| on_disk.lines().count().min(page.lines().count()));
        panic!(
            "docs/reference/{name} is not what the code says (first difference at line {}):\n  \
             on disk: {:?}\n  the code: {:?}\nrun `make reference` to regenerate it, and commit \
             the result",
            first + 1,
            on_disk.lines().nth(first).unwrap_or("<end of file>"),
            page.lines().nth(first).unwrap_or("<end of file>"),
        );
    }
}

/// The first line of every page.
fn generated(what: &str) -> String {
    format!(
        "<!-- Generated from the code by `make reference` (crates/settle-operator/tests/reference.rs). Do not edit by hand. -->\n\n# {what}\n\n"
    )
}

/// A Markdown table cell: one line, `|` escaped.
fn cell(text: &str) -> String {
    let one_line = text.split_whitespace().collect::<Vec<_>>().join(" ");
    if one_line.is_empty() {
        return "—".into();
    }
    // Outside code spans, what Markdown would read as a tag or emphasis is escaped; `|`
    // everywhere (a table splits on it before it reads code spans).
    one_line
        .split('`')
        .enumerate()
        .map(|(i, part)| {
            let part = part.replace('|', "\\|");
            if i % 2 == 1 {
                part
            } else {
                part.replace('*', "\\*")
                    .replace('<', "&lt;")
                    .replace('>', "&gt;")
            }
        })
        .collect::<Vec<_>>()
        .join("`")
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Every `.rs` file under `dir`, sorted.
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut dirs = vec![dir.to_path_buf()];
    while let Some(d) = dirs.pop() {
        for entry in std::fs::read_dir(&d).expect("read_dir") {
            let path = entry.expect("an entry").path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }
    out.sort();
    out
}

/// A source file without its tests (everything from the first `#[cfg(test)]`) and without its
/// comment lines.
fn code_of(text: &str) -> String {
    text.split("#[cfg(test)]")
        .next()
        .unwrap_or_default()
        .lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n")
}

fn relative(path: &Path) -> String {
    path.strip_prefix(common::root())
        .unwrap_or(path)
        .display()
        .to_string()
}

// ---------------------------------------------------------------------------------------------
// flags.md

/// `settle operator` as clap builds it from the real `OperatorArgs`.
fn operator_command() -> clap::Command {
    settle_operator::operator::OperatorArgs::augment_args(clap::Command::new("operator"))
}

/// Whether a default reads as a duration (`5s`, `500ms`, `1h`).
fn is_duration(text: &str) -> bool {
    Regex::new(r"^[0-9]+(ms|s|m|h)$")
        .expect("regex")
        .is_match(text)
}

fn render_flags() -> String {
    let cmd = operator_command();
    let mut page = generated("`settle operator` flags");
    page.push_str(
        "Every flag of `settle operator`, as `settle operator --help` prints it; run `make reference` to regenerate this page (it is made from `OperatorArgs` in crates/settle-operator/src/operator/args.rs). Every flag has an environment fallback, which the Helm chart sets. Durations are Kubernetes durations (`500ms`, `5s`, `1m`, `1h`) and must be above zero, unless the flag's help says what `0s` does. A list takes comma-separated values.\n\n",
    );
    page.push_str("| flag | env | default | description |\n|---|---|---|---|\n");
    for arg in cmd.get_arguments() {
        let Some(long) = arg.get_long() else { continue };
        if long == "help" {
            continue;
        }
        let env = arg
            .get_env()
            .unwrap_or_else(|| {
                panic!("--{long} has no environment fallback: give it `env = \"SETTLE_…\"`")
            })
            .to_string_lossy()
            .into_owned();
        let defaults: Vec<String> = arg
            .get_default_values()
            .iter()
            .map(|v| v.to_string_lossy().into_owned())
            .collect();
        let default = if defaults.is_empty() {
            "none".to_string()
        } else {
            format!("`{}`", defaults.join(","))
        };
        let mut help = arg
            .get_long_help()
            .or(arg.get_help())
            .map(|h| h.to_string())
            .unwrap_or_default();
        let possible: Vec<String> = arg
            .get_possible_values()
            .iter()
            .filter(|v| !v.is_hide_set())
            .map(|v| format!("`{}`", v.get_name()))
            .collect();
        // A bool's possible values (true, false) go without saying.
        if !possible.is_empty() && possible != ["`true`", "`false`"] {
            if !help.ends_with('.') {
                help.push('.');
            }
            help.push_str(&format!(" One of: {}.", possible.join(", ")));
        }
        page.push_str(&format!(
            "| `--{long}` | `{env}` | {default} | {} |\n",
            cell(&help)
        ));
    }
    page
}

#[test]
fn the_flags_page_is_what_clap_says() {
    check_page("flags.md", &render_flags());
}

#[test]
fn every_flag_has_an_env_fallback_and_a_zero_duration_is_described_where_it_is_taken() {
    let cmd = operator_command();
    let says_zero = Regex::new(r"(^|[^0-9.])0s\b").expect("regex");
    let mut durations = 0;
    for arg in cmd.get_arguments() {
        let Some(long) = arg.get_long() else { continue };
        if long == "help" {
            continue;
        }
        assert!(arg.get_env().is_some(), "--{long} has no env fallback");
        let Some(default) = arg.get_default_values().first() else {
            continue;
        };
        if !is_duration(&default.to_string_lossy()) {
            continue;
        }
        durations += 1;
        let help = arg.get_help().map(|h| h.to_string()).unwrap_or_default();
        let zero_taken = operator_command()
            .try_get_matches_from(["operator", &format!("--{long}=0s")])
            .is_ok();
        assert_eq!(
            zero_taken,
            says_zero.is_match(&help),
            "--{long}: `0s` is {} but its help {} what 0s does: {help}",
            if zero_taken { "taken" } else { "refused" },
            if zero_taken { "does not say" } else { "says" },
        );
    }
    assert!(
        durations >= 10,
        "the duration flags were found: {durations}"
    );
}

// ---------------------------------------------------------------------------------------------
// metrics.md

/// One metric family: what the page says of it.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Metric {
    kind: String,
    labels: BTreeSet<String>,
    help: String,
    group: Group,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Group {
    Webhook,
    Controllers,
    Account,
    Leader,
    Process,
    Runtime,
}

impl Group {
    const ALL: [Group; 6] = [
        Group::Webhook,
        Group::Controllers,
        Group::Account,
        Group::Leader,
        Group::Process,
        Group::Runtime,
    ];

    fn title(self) -> &'static str {
        match self {
            Group::Webhook => "Webhook (admission and its port)",
            Group::Controllers => "Controllers (Backends and Subscriptions)",
            Group::Account => "Account (the delivery account in status)",
            Group::Leader => "Leader election",
            Group::Process => "Process (memory, the metrics and probe ports)",
            Group::Runtime => {
                "Runtime (exported by the applications, on their own default registry)"
            }
        }
    }

    /// The subsystem a source file belongs to.
    fn of_file(path: &str) -> Group {
        if path.contains("/admission/webhook/") {
            Group::Webhook
        } else if path.contains("/reconcile/") {
            Group::Controllers
        } else if path.contains("/account/") {
            Group::Account
        } else if path.contains("/operator/leader/") {
            Group::Leader
        } else if path.contains("/operator/") || path.contains("/serve/") {
            Group::Process
        } else if path.ends_with("settle/src/backend/pause.rs") {
            Group::Runtime
        } else {
            panic!(
                "{path} makes metrics: say in crates/settle-operator/tests/reference.rs (Group::of_file) which subsystem it is"
            )
        }
    }
}

/// The files whose `"settle_…"` strings are metric names: the operator's source, and the
/// runtime's pause poller (the one metric-making file of the library).
fn metric_sources() -> Vec<PathBuf> {
    let root = common::root();
    let mut files = rust_files(&root.join("crates/settle-operator/src"));
    files.push(root.join("crates/settle/src/backend/pause.rs"));
    files
}

/// Prometheus text, parsed into families (HELP, TYPE, and the label names of their series;
/// a histogram's `le` left out).
fn parse_exposition(text: &str, group: Group, into: &mut BTreeMap<String, Metric>) {
    let label = Regex::new(r#"([a-zA-Z_][a-zA-Z0-9_]*)="(?:[^"\\]|\\.)*""#).expect("regex");
    let mut helps: BTreeMap<String, String> = BTreeMap::new();
    let mut found: BTreeMap<String, Metric> = BTreeMap::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, help) = rest.split_once(' ').unwrap_or((rest, ""));
            helps.insert(name.into(), help.replace("\\n", "\n").replace("\\\\", "\\"));
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').expect("TYPE name kind");
            found.insert(
                name.into(),
                Metric {
                    kind: kind.into(),
                    labels: BTreeSet::new(),
                    help: helps.get(name).cloned().unwrap_or_default(),
                    group,
                },
            );
        } else if !line.starts_with('#') && !line.is_empty() {
            let series = line.split(['{', ' ']).next().expect("a name");
            let family = ["", "_bucket", "_sum", "_count"]
                .iter()
                .find_map(|suffix| {
                    series
                        .strip_suffix(suffix)
                        .filter(|f| found.contains_key(*f))
                })
                .unwrap_or_else(|| panic!("a series without a TYPE line: {line}"))
                .to_string();
            let labels = line
                .split_once('{')
                .map(|(_, rest)| rest.rsplit_once('}').expect("closing brace").0)
                .unwrap_or_default();
            let m = found.get_mut(&family).expect("found");
            for c in label.captures_iter(labels) {
                if &c[1] != "le" {
                    m.labels.insert(c[1].to_string());
                }
            }
        }
    }
    for (name, metric) in found {
        merge(into, &name, metric, "a registry's scrape");
    }
}

/// Adds what one source says of `name`, which must agree with what another said of it.
fn merge(into: &mut BTreeMap<String, Metric>, name: &str, metric: Metric, source: &str) {
    if let Some(before) = into.get(name) {
        assert_eq!(
            before, &metric,
            "{name}: {source} disagrees with what was found before"
        );
    }
    into.insert(name.to_string(), metric);
}

/// A collector's families, even one with no series yet (which a registry's scrape leaves out).
fn from_collector(c: &dyn Collector, group: Group, into: &mut BTreeMap<String, Metric>) {
    for (desc, family) in c.desc().into_iter().zip(c.collect()) {
        let kind = match family.get_field_type() {
            prometheus::proto::MetricType::COUNTER => "counter",
            prometheus::proto::MetricType::GAUGE => "gauge",
            prometheus::proto::MetricType::HISTOGRAM => "histogram",
            other => panic!(
                "{}: a {other:?}: add it to crates/settle-operator/tests/reference.rs",
                desc.fq_name
            ),
        };
        let metric = Metric {
            kind: kind.into(),
            labels: desc.variable_labels.iter().cloned().collect(),
            help: desc.help.clone(),
            group,
        };
        merge(into, &desc.fq_name, metric, "a collector");
    }
}

/// Every metric the real metric sets make, built here as the operator builds them.
fn metrics_from_code() -> BTreeMap<String, Metric> {
    use settle_operator::exposition::Exposition;
    let mut out = BTreeMap::new();
    let text = |e: &Exposition| e.text().expect("the exposition encodes");

    // The controllers': one Subscription shown, so the per-Subscription table writes its family.
    let e = Exposition::default();
    let m = settle_operator::reconcile::Metrics::new(&e.registry, &e.tables).expect("registers");
    m.subscription_ready("reference", "page", true);
    parse_exposition(&text(&e), Group::Controllers, &mut out);
    for c in [
        &m.reconciles as &dyn Collector,
        &m.duration,
        &m.consumer_ops,
        &m.status_writes,
        &m.kube_requests,
        &m.js_calls,
        &m.triggers,
        &m.refusals_gated,
        &m.backend_gated,
    ] {
        from_collector(c, Group::Controllers, &mut out);
    }

    // The account's, with one Subscription shown and its Stalled flag.
    let e = Exposition::default();
    let m = settle_operator::account::Metrics::new(&e.registry, &e.tables).expect("registers");
    m.show(
        "reference",
        "page",
        Some("uid"),
        &settle::api::SubscriptionStats::default(),
        false,
    );
    m.stalled("reference", "page", false);
    parse_exposition(&text(&e), Group::Account, &mut out);
    for c in [
        &m.writes as &dyn Collector,
        &m.urgent_writes,
        &m.backlog,
        &m.deferred,
        &m.advisories,
        &m.reports,
        &m.saves,
        &m.capture_gap,
        &m.source_lost,
        &m.dead_letters,
        &m.gauge_calls,
    ] {
        from_collector(c, Group::Account, &mut out);
    }

    // The webhook's (its port's connection metrics included).
    let e = Exposition::default();
    settle_operator::admission::webhook::WebhookMetrics::register(&e.registry).expect("registers");
    parse_exposition(&text(&e), Group::Webhook, &mut out);

    // Every server's connection metrics, named as the source registers them.
    let call = Regex::new(r#"ConnectionMetrics::register\(\s*[^,]+,\s*"([a-z_]+)",\s*"([^"]*)""#)
        .expect("regex");
    let mut servers = 0;
    for file in metric_sources() {
        let code = code_of(&read(&file));
        for c in call.captures_iter(&code) {
            servers += 1;
            let e = Exposition::default();
            settle_operator::serve::ConnectionMetrics::register(&e.registry, &c[1], &c[2], true)
                .expect("registers");
            parse_exposition(&text(&e), Group::of_file(&relative(&file)), &mut out);
        }
    }
    assert!(
        servers >= 3,
        "the webhook, metrics and probe servers were found: {servers}"
    );

    // The leader gauge.
    let e = Exposition::default();
    let _leadership =
        settle_operator::operator::leader::Leadership::always(&e.registry).expect("registers");
    parse_exposition(&text(&e), Group::Leader, &mut out);

    // The runtime's, on the process's default registry once a pause was shown.
    settle::backend::pause::shown(settle::policy::BackendKind::Sqs, "reference", false);
    let runtime = prometheus::TextEncoder::new()
        .encode_to_string(&prometheus::default_registry().gather())
        .expect("encodes");
    let mut all = BTreeMap::new();
    parse_exposition(&runtime, Group::Runtime, &mut all);
    for (name, m) in all {
        if name.starts_with("settle_runtime_") {
            merge(&mut out, &name, m, "the default registry");
        }
    }
    out
}

/// One Rust string literal starting at `text[at]` (a `"`): its value and where it ends.
fn string_literal(text: &str, at: usize) -> Option<(String, usize)> {
    let bytes = text.as_bytes();
    if bytes.get(at) != Some(&b'"') {
        return None;
    }
    let mut out = String::new();
    let mut chars = text[at + 1..].char_indices();
    while let Some((i, c)) = chars.next() {
        match c {
            '"' => return Some((out, at + 1 + i + 1)),
            '\\' => match chars.next().map(|(_, c)| c) {
                Some('n') => out.push('\n'),
                Some('t') => out.push('\t'),
                Some('\n') => {
                    // A line continuation: the newline and the next line's indent are skipped.
                    let rest = &text[at + 1 + i + 2..];
                    let skip = rest.len() - rest.trim_start().len();
                    for _ in 0..rest[..skip].chars().count() {
                        chars.next();
                    }
                }
                Some(c) => out.push(c),
                None => return None,
            },
            c => out.push(c),
        }
    }
    None
}

/// Metrics made in the source with a literal name: `IntCounterVec::new(Opts::new("settle_…",
/// "help"), &["label"])` and the like. Read only for metrics that cannot be built in this test
/// (made in a private module, or only with a cluster), and checked against those that can.
fn metrics_from_source() -> BTreeMap<String, Metric> {
    let ctor = Regex::new(
        r"\b(IntCounterVec|IntCounter|IntGaugeVec|IntGauge|HistogramVec|Histogram|CounterVec|Counter|GaugeVec|Gauge)::(?:new|with_opts)\(\s*(?:(?:Histogram)?Opts::new\(\s*)?",
    )
    .expect("regex");
    let quoted = Regex::new(r#""([^"]*)""#).expect("regex");
    let mut out = BTreeMap::new();
    for file in metric_sources() {
        let code = code_of(&read(&file));
        for c in ctor.captures_iter(&code) {
            let at = c.get(0).expect("match").end();
            let Some((name, end)) = string_literal(&code, at) else {
                continue;
            };
            if !name.starts_with("settle_") {
                continue;
            }
            let rest = &code[end..];
            let help_at = end + rest.len() - rest.trim_start_matches([',', ' ', '\n']).len();
            let (help, end) = string_literal(&code, help_at)
                .unwrap_or_else(|| panic!("{name}: its help is not a literal"));
            let ty = &c[1];
            let labels = if ty.ends_with("Vec") {
                let rest = &code[end..];
                let open = rest
                    .find("&[")
                    .unwrap_or_else(|| panic!("{name}: no labels"));
                let close = rest[open..].find(']').expect("labels close") + open;
                quoted
                    .captures_iter(&rest[open..close])
                    .map(|q| q[1].to_string())
                    .collect()
            } else {
                BTreeSet::new()
            };
            let kind = if ty.contains("Counter") {
                "counter"
            } else if ty.contains("Gauge") {
                "gauge"
            } else {
                "histogram"
            };
            let metric = Metric {
                kind: kind.into(),
                labels,
                help,
                group: Group::of_file(&relative(&file)),
            };
            merge(&mut out, &name, metric, &relative(&file));
        }
    }
    out
}

/// Every metric name the source writes: its `"settle_…"` literals, and its templates
/// (`"settle_{name}_connections_open"`) as patterns.
fn names_in_source() -> (BTreeMap<String, String>, Vec<(String, Regex)>) {
    let literal = Regex::new(r#""(settle_[a-z0-9_]+)""#).expect("regex");
    let template = Regex::new(r#""(settle_[a-z0-9_]*\{[a-z_]+\}[a-z0-9_{}]*)""#).expect("regex");
    let hole = Regex::new(r"\{[a-z_]+\}").expect("regex");
    let (mut names, mut templates) = (BTreeMap::new(), Vec::new());
    for file in metric_sources() {
        let code = code_of(&read(&file));
        for c in literal.captures_iter(&code) {
            names.insert(c[1].to_string(), relative(&file));
        }
        for c in template.captures_iter(&code) {
            let pattern = format!("^{}$", hole.replace_all(&c[1], "[a-z0-9_]+"));
            templates.push((
                format!("{} ({})", &c[1], relative(&file)),
                Regex::new(&pattern).expect("a pattern"),
            ));
        }
    }
    (names, templates)
}

/// Every metric: from the code where it can be built, else from the source.
fn all_metrics() -> BTreeMap<String, Metric> {
    let mut metrics = metrics_from_code();
    let source = metrics_from_source();
    for (name, from_source) in source {
        match metrics.get(&name) {
            // The source reader agrees with the code wherever both see a metric.
            Some(built) => assert_eq!(
                built, &from_source,
                "{name}: read from the source differently than built"
            ),
            None => {
                metrics.insert(name, from_source);
            }
        }
    }
    metrics
}

fn render_metrics(metrics: &BTreeMap<String, Metric>) -> String {
    let mut page = generated("Metrics");
    page.push_str(&format!(
        "Every metric the operator exports on its metrics port (`/metrics`), and the ones the runtime exports from the applications, by subsystem: {} metrics. Run `make reference` to regenerate this page: it is made from the metric sets the code registers (crates/settle-operator/tests/reference.rs builds them). A series whose labels name a Subscription (`namespace`, `subscription`) exists while the Subscription does.\n",
        metrics.len()
    ));
    for group in Group::ALL {
        let rows: Vec<_> = metrics.iter().filter(|(_, m)| m.group == group).collect();
        if rows.is_empty() {
            continue;
        }
        page.push_str(&format!(
            "\n## {}\n\n| metric | type | labels | help |\n|---|---|---|---|\n",
            group.title()
        ));
        for (name, m) in rows {
            let labels = m
                .labels
                .iter()
                .map(|l| format!("`{l}`"))
                .collect::<Vec<_>>()
                .join(", ");
            page.push_str(&format!(
                "| `{name}` | {} | {} | {} |\n",
                m.kind,
                cell(&labels),
                cell(&m.help)
            ));
        }
    }
    page
}

#[test]
fn the_metrics_page_lists_every_metric_the_code_registers() {
    let metrics = all_metrics();
    let (names, templates) = names_in_source();
    for (name, file) in &names {
        assert!(
            metrics.contains_key(name),
            "{name} is named in {file} but neither built nor read as a metric: make it in a way \
             crates/settle-operator/tests/reference.rs finds (a metric set it builds, or a literal constructor)"
        );
    }
    for (pattern, re) in &templates {
        assert!(
            metrics.keys().any(|n| re.is_match(n)),
            "the template {pattern} names no metric found"
        );
    }
    for name in metrics.keys() {
        assert!(
            names.contains_key(name) || templates.iter().any(|(_, re)| re.is_match(name)),
            "{name} was found but the source does not name it"
        );
    }
    assert!(
        metrics.len() >= 40,
        "the metrics were found: {}",
        metrics.len()
    );
    check_page("metrics.md", &render_metrics(&metrics));
}

// ---------------------------------------------------------------------------------------------
// conditions.md

/// One `pub const NAME: &str = "Value";` with its doc comment.
#[derive(Debug)]
struct Constant {
    path: String,
    value: String,
    doc: String,
    /// Reasons: the condition it goes with (a section comment, or where the source sets it).
    condition: String,
    writer: &'static str,
}

/// The `pub const`s of `body` (lines), with the `///` lines above each and the last `// section`
/// comment before it.
fn constants(body: &[&str], prefix: &str, writer: &'static str) -> Vec<Constant> {
    let konst = Regex::new(r#"^pub const ([A-Z0-9_]+): &str = "([^"]*)";$"#).expect("regex");
    let (mut out, mut doc, mut section) = (Vec::new(), Vec::new(), String::new());
    for line in body {
        let t = line.trim();
        if let Some(d) = t.strip_prefix("///") {
            doc.push(d.trim().to_string());
        } else if let Some(s) = t.strip_prefix("//") {
            section = s.trim().to_string();
            doc.clear();
        } else if t.starts_with("pub const ") && t.contains(": &str") {
            let c = konst
                .captures(t)
                .unwrap_or_else(|| panic!("a constant on one line: {t}"));
            out.push(Constant {
                path: format!("{prefix}::{}", &c[1]),
                value: c[2].to_string(),
                doc: doc.join(" "),
                condition: section.clone(),
                writer,
            });
            doc.clear();
        } else {
            doc.clear();
        }
    }
    out
}

/// The lines of `pub mod NAME { … }` in `text` (its closing brace at the start of a line).
fn module<'a>(text: &'a str, name: &str) -> Option<Vec<&'a str>> {
    let mut lines = text.lines();
    lines.find(|l| *l == format!("pub mod {name} {{"))?;
    Some(lines.take_while(|l| *l != "}").collect())
}

/// (types, reasons), from every file that declares `pub mod types` or `pub mod reasons`.
fn conditions_from_source() -> (Vec<Constant>, Vec<Constant>) {
    let root = common::root();
    let want = Regex::new(
        r"Want::new\(\s*(?:types::)?([A-Z0-9_]+),\s*Status::([A-Za-z]+),\s*reasons::([A-Z0-9_]+)",
    )
    .expect("regex");
    let (mut types, mut reasons) = (Vec::new(), Vec::new());
    for file in rust_files(&root.join("crates/settle-operator/src")) {
        let text = read(&file);
        let code = text.split("#[cfg(test)]").next().unwrap_or_default();
        let (types_mod, reasons_mod) = (module(code, "types"), module(code, "reasons"));
        if types_mod.is_none() && reasons_mod.is_none() {
            continue;
        }
        let rel = relative(&file);
        let writer = if rel.contains("/reconcile/") {
            "controllers"
        } else if rel.contains("/account/") {
            "account"
        } else {
            panic!(
                "{rel} declares conditions: say in crates/settle-operator/tests/reference.rs which writer it is"
            )
        };
        let module_path = rel
            .trim_start_matches("crates/settle-operator/src/")
            .trim_end_matches(".rs")
            .replace('/', "::");
        // Where the file sets a condition: (type constant, status) by reason constant.
        let set: BTreeMap<String, (String, String)> = want
            .captures_iter(code)
            .map(|c| (c[3].to_string(), (c[1].to_string(), c[2].to_string())))
            .collect();
        let mut file_types = match &types_mod {
            Some(body) => constants(body, &format!("{module_path}::types"), writer),
            None => Vec::new(),
        };
        // A type declared at the top of the file (`stall::STALLED`): one a `Want::new` sets.
        let top: Vec<&str> = code.lines().filter(|l| !l.starts_with(' ')).collect();
        for c in constants(&top, &module_path, writer) {
            let konst = c.path.rsplit("::").next().expect("a name").to_string();
            if set.values().any(|(t, _)| *t == konst) {
                file_types.push(c);
            }
        }
        let type_value = |konst: &str| {
            file_types
                .iter()
                .find(|t| t.path.ends_with(&format!("::{konst}")))
                .map(|t| t.value.clone())
        };
        for mut r in constants(
            reasons_mod.as_deref().unwrap_or_default(),
            &format!("{module_path}::reasons"),
            writer,
        ) {
            let konst = r.path.rsplit("::").next().expect("a name").to_string();
            if let Some((t, status)) = set.get(&konst) {
                let t = type_value(t).unwrap_or_else(|| panic!("{rel}: {t} is not a type here"));
                r.condition = format!("{t}={status}");
            }
            reasons.push(r);
        }
        types.extend(file_types);
    }
    // The controllers' first, as a Subscription's status lists them.
    let rank = |c: &Constant| c.writer != "controllers";
    types.sort_by_key(rank);
    reasons.sort_by_key(rank);
    (types, reasons)
}

fn render_conditions(types: &[Constant], reasons: &[Constant]) -> String {
    let mut page = generated("Conditions");
    page.push_str(&format!(
        "Every condition type ({}) and reason ({}) Settle writes into a Subscription's or a Backend's `status.conditions`, with the writer that sets it: the controllers (`reconcile`) or the delivery account (`account`), each the owner of its own conditions. Run `make reference` to regenerate this page: it is made from the constants in crates/settle-operator/src (`pub mod types`, `pub mod reasons`) and their doc comments.\n\n",
        types.len(),
        reasons.len()
    ));
    page.push_str("## Types\n\n| type | writer | constant | meaning |\n|---|---|---|---|\n");
    for t in types {
        page.push_str(&format!(
            "| `{}` | {} | `{}` | {} |\n",
            t.value,
            t.writer,
            t.path,
            cell(&t.doc)
        ));
    }
    page.push_str(
        "\n## Reasons\n\nThe condition column names the condition a reason goes with (as the constants are grouped in the source) or, where the source sets it in one place, the condition and status it sets.\n\n| reason | writer | condition | constant | meaning |\n|---|---|---|---|---|\n",
    );
    for r in reasons {
        page.push_str(&format!(
            "| `{}` | {} | {} | `{}` | {} |\n",
            r.value,
            r.writer,
            cell(&r.condition),
            r.path,
            cell(&r.doc)
        ));
    }
    page
}

#[test]
fn the_conditions_page_lists_every_condition_and_reason_constant() {
    use settle_operator::account::{stall, status};
    use settle_operator::reconcile::conditions;
    let (types, reasons) = conditions_from_source();
    let type_values: BTreeSet<&str> = types.iter().map(|t| t.value.as_str()).collect();
    // The reader finds the constants the code has (a few, as the crate spells them).
    for t in [
        conditions::types::ACCEPTED,
        conditions::types::READY,
        conditions::types::PAUSED,
        status::types::EXHAUSTING,
        status::types::STRANDING,
        status::types::ACCOUNTED,
        stall::STALLED,
    ] {
        assert!(type_values.contains(t), "the type {t} was not found");
    }
    let reason_values: BTreeSet<&str> = reasons.iter().map(|r| r.value.as_str()).collect();
    for r in [
        conditions::reasons::CONSUMER_READY,
        conditions::reasons::BAD_CONFIG,
        status::reasons::REPORT_QUEUE_MISSING,
        status::reasons::KEPT,
        stall::reasons::NOTHING_DELIVERED,
    ] {
        assert!(reason_values.contains(r), "the reason {r} was not found");
    }
    check_page("conditions.md", &render_conditions(&types, &reasons));
}

// ---------------------------------------------------------------------------------------------
// values.md

/// A schema node's type, as a reader wants it.
fn schema_type(node: &serde_json::Value) -> String {
    if let Some(options) = node.get("enum").and_then(|e| e.as_array()) {
        let options: Vec<String> = options
            .iter()
            .map(|o| format!("`{}`", json_text(o)))
            .collect();
        return format!("one of {}", options.join(", "));
    }
    let base = match node.get("type") {
        Some(serde_json::Value::String(t)) => t.clone(),
        Some(serde_json::Value::Array(ts)) => ts
            .iter()
            .filter_map(|t| t.as_str())
            .collect::<Vec<_>>()
            .join(" or "),
        _ => "any".into(),
    };
    match node.get("items") {
        Some(items) if base == "array" => format!("array of {}", schema_type(items)),
        _ => base,
    }
}

/// A value as the page shows it: a string as is, anything else as compact JSON.
fn json_text(v: &serde_json::Value) -> String {
    match v {
        serde_json::Value::String(s) if !s.is_empty() => s.clone(),
        other => other.to_string(),
    }
}

/// Every value of the schema, flattened (`a.b.c`): an object with properties is a heading for
/// its own, not a value.
fn schema_values(path: &str, node: &serde_json::Value, out: &mut Vec<(String, serde_json::Value)>) {
    match node.get("properties").and_then(|p| p.as_object()) {
        Some(props) => {
            for (key, child) in props {
                let child_path = if path.is_empty() {
                    key.clone()
                } else {
                    format!("{path}.{key}")
                };
                schema_values(&child_path, child, out);
            }
        }
        None => out.push((path.to_string(), node.clone())),
    }
}

/// The leaves of values.yaml (`a.b.c`), with their values.
fn yaml_leaves(path: &str, v: &serde_json::Value, out: &mut BTreeMap<String, serde_json::Value>) {
    match v {
        serde_json::Value::Object(map) if !map.is_empty() => {
            for (k, child) in map {
                let p = if path.is_empty() {
                    k.clone()
                } else {
                    format!("{path}.{k}")
                };
                yaml_leaves(&p, child, out);
            }
        }
        other => {
            out.insert(path.to_string(), other.clone());
        }
    }
}

fn lookup<'a>(v: &'a serde_json::Value, path: &str) -> Option<&'a serde_json::Value> {
    path.split('.').try_fold(v, |v, key| v.get(key))
}

fn render_values() -> String {
    let chart = common::root().join("charts/settle");
    let schema: serde_json::Value =
        serde_json::from_str(&read(&chart.join("values.schema.json"))).expect("the schema");
    let values: serde_json::Value =
        serde_yaml::from_str(&read(&chart.join("values.yaml"))).expect("values.yaml");
    let mut rows = Vec::new();
    schema_values("", &schema, &mut rows);
    // Every value values.yaml sets is in the schema (the schema forbids others, but a page
    // that left one out would not say so).
    let mut leaves = BTreeMap::new();
    yaml_leaves("", &values, &mut leaves);
    for leaf in leaves.keys() {
        assert!(
            rows.iter().any(|(p, _)| leaf == p
                || leaf.starts_with(&format!("{p}."))
                || p.starts_with(&format!("{leaf}."))),
            "values.yaml sets {leaf}, which the schema does not describe"
        );
    }
    let mut page = generated("Helm values");
    page.push_str(&format!(
        "Every value of the `settle` chart ({}), as charts/settle/values.schema.json describes it, with its default from charts/settle/values.yaml; nested values are written `a.b.c` (`--set a.b.c=…`). Run `make reference` to regenerate this page.\n\n| value | type | default | description |\n|---|---|---|---|\n",
        rows.len()
    ));
    for (path, node) in &rows {
        let default = match lookup(&values, path) {
            Some(v) => format!("`{}`", json_text(v)),
            None => "not set".into(),
        };
        let description = node
            .get("description")
            .and_then(|d| d.as_str())
            .unwrap_or_default();
        page.push_str(&format!(
            "| `{path}` | {} | {} | {} |\n",
            cell(&schema_type(node)),
            cell(&default),
            cell(description)
        ));
    }
    page
}

#[test]
fn the_values_page_is_what_the_chart_schema_says() {
    check_page("values.md", &render_values());
}
