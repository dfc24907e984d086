//! A [`Migration`] as what the user reads: YAML manifests with every finding as a comment above
//! its object (one text per namespace), and the same findings as lines for stderr.
//!
//! A Subscription that would change behaviour is written only with `--allow-changes`; without
//! it, it appears commented out, so applying the output never applies it by accident. A refused
//! one appears as its findings only. Pure: no I/O.

use std::collections::BTreeMap;

use kube::Resource;
use serde_yaml::{Mapping, Value};

use super::{BackendPlan, Migration, Severity, SubscriptionPlan};
use settle::api::{Backend, Subscription};

/// The width comments are wrapped to.
const WIDTH: usize = 100;

/// The manifests, one text per namespace (in namespace order).
pub fn manifests(m: &Migration, allow_changes: bool) -> BTreeMap<String, String> {
    let mut out: BTreeMap<String, String> = BTreeMap::new();
    for b in &m.backends {
        out.entry(b.namespace.clone())
            .or_default()
            .push_str(&backend(b));
    }
    for s in &m.subscriptions {
        out.entry(s.namespace.clone())
            .or_default()
            .push_str(&subscription(s, allow_changes));
    }
    let head: String = m
        .notes
        .iter()
        .flat_map(|n| wrap(n, "# "))
        .map(|l| l + "\n")
        .collect();
    for text in out.values_mut() {
        *text = format!(
            "# Made by `settle import nack` from NACK's resources: review it, then kubectl apply it.\n{head}{text}"
        );
    }
    out
}

fn backend(b: &BackendPlan) -> String {
    let mut text = String::from("---\n");
    let written = !b.refused();
    text.push_str(&comment(&format!(
        "{}Backend {}/{}, from {}.",
        if written {
            ""
        } else {
            "NOT WRITTEN (refused): "
        },
        b.namespace,
        b.name,
        b.from
    )));
    if !b.steps.is_empty() {
        text.push_str(
            "# Before you apply it, make the Secret it names (Settle reads only a labelled one):\n",
        );
        for s in &b.steps {
            text.push_str(&format!("#   {}\n", one_line(s)));
        }
    }
    for f in &b.findings {
        text.push_str(&comment_indented(&f.to_string()));
    }
    if written {
        text.push_str(&object(
            &Backend::api_version(&()),
            &Backend::kind(&()),
            &b.namespace,
            &b.name,
            serde_yaml::to_value(&b.spec).unwrap_or(Value::Null),
        ));
    }
    text
}

fn subscription(s: &SubscriptionPlan, allow_changes: bool) -> String {
    let mut text = String::from("---\n");
    let state = match (s.written(allow_changes), s.worst()) {
        (true, _) => "",
        (false, Severity::Change) => {
            "NOT WRITTEN (it would change behaviour; --allow-changes writes it): "
        }
        (false, _) => "NOT WRITTEN (refused): ",
    };
    text.push_str(&comment(&format!(
        "{state}Subscription {}/{}, from NACK Consumer {}/{} (the JetStream consumer {}).",
        s.namespace, s.name, s.namespace, s.name, s.consumer
    )));
    for f in &s.findings {
        text.push_str(&comment_indented(&f.to_string()));
    }
    let Some(spec) = &s.spec else { return text };
    if s.worst() == Severity::Refused {
        return text;
    }
    let spec = serde_yaml::to_value(spec).unwrap_or(Value::Null);
    let body = object(
        &Subscription::api_version(&()),
        &Subscription::kind(&()),
        &s.namespace,
        &s.name,
        spec,
    );
    if s.written(allow_changes) {
        text.push_str(&body);
    } else {
        for line in body.lines() {
            text.push_str(&format!("# {line}\n"));
        }
    }
    text
}

fn object(api_version: &str, kind: &str, namespace: &str, name: &str, spec: Value) -> String {
    let mut metadata = Mapping::new();
    metadata.insert("name".into(), name.into());
    metadata.insert("namespace".into(), namespace.into());
    let mut o = Mapping::new();
    o.insert("apiVersion".into(), api_version.into());
    o.insert("kind".into(), kind.into());
    o.insert("metadata".into(), Value::Mapping(metadata));
    o.insert("spec".into(), spec);
    serde_yaml::to_string(&Value::Mapping(o)).unwrap_or_default()
}

/// `text` as one line: a character that ends a line for YAML or a terminal (a control character,
/// U+2028, U+2029) escaped, so a comment line stays one comment and a printed line one line. The
/// values in it are the tenant's.
fn one_line(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if c.is_control() || c == '\u{2028}' || c == '\u{2029}' {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

fn comment(text: &str) -> String {
    wrap(text, "# ").into_iter().map(|l| l + "\n").collect()
}

/// A finding under its object: indented, its continuation lines further in.
fn comment_indented(text: &str) -> String {
    hanging(text, "#   ", "#           ")
        .into_iter()
        .map(|l| l + "\n")
        .collect()
}

/// `text` in lines of at most [`WIDTH`] characters (longer words stay whole), each prefixed.
fn wrap(text: &str, prefix: &str) -> Vec<String> {
    hanging(text, prefix, prefix)
}

/// As [`wrap`], the first line prefixed `first` and the others `rest`.
fn hanging(text: &str, first: &str, rest: &str) -> Vec<String> {
    let mut lines = Vec::new();
    let mut prefix = first;
    let mut line = String::from(prefix);
    for word in text.split_whitespace() {
        if line.len() > prefix.len() && line.len() + 1 + word.len() > WIDTH {
            prefix = rest;
            lines.push(std::mem::replace(&mut line, String::from(prefix)));
        }
        if line.len() > prefix.len() {
            line.push(' ');
        }
        line.push_str(word);
    }
    lines.push(line);
    lines
}

/// The findings for stderr: one block per Subscription and Backend, the notes, and a count.
pub fn report(m: &Migration, allow_changes: bool) -> String {
    let mut out = String::new();
    for b in &m.backends {
        out.push_str(&format!(
            "Backend {}/{} (from {}): {}\n",
            b.namespace,
            b.name,
            b.from,
            if b.refused() { "refused" } else { "written" }
        ));
        for s in &b.steps {
            out.push_str(&format!("  first: {}\n", one_line(s)));
        }
        for f in &b.findings {
            out.push_str(&format!("  {}\n", one_line(&f.to_string())));
        }
    }
    let (mut written, mut held, mut refused) = (0, 0, 0);
    for s in &m.subscriptions {
        let state = if s.written(allow_changes) {
            written += 1;
            "written"
        } else if s.worst() == Severity::Change {
            held += 1;
            "NOT WRITTEN: it would change behaviour (--allow-changes writes it)"
        } else {
            refused += 1;
            "NOT WRITTEN: refused"
        };
        out.push_str(&format!(
            "NACK Consumer {}/{} -> Subscription {}/{} (consumer {}): {state}\n",
            s.namespace, s.name, s.namespace, s.name, s.consumer
        ));
        for f in &s.findings {
            out.push_str(&format!("  {}\n", one_line(&f.to_string())));
        }
    }
    for n in &m.notes {
        out.push_str(&format!("note: {n}\n"));
    }
    out.push_str(&format!(
        "{} NACK Consumers: {written} written, {held} not written (changes behaviour), {refused} refused\n",
        m.subscriptions.len()
    ));
    out
}
