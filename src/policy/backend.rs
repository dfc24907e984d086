//! The Backend rules (docs/semantics.md A16–A21): `validate_backend(spec, old, namespace,
//! secrets, rules) -> Verdict` for the webhook and `settle check`, and `backend_access`, the part
//! the controller re-checks before it reads a Secret into a connection or connects at all: the
//! Secret opt-in label, the broker host allow-list and SQS pod identity.
//!
//! A Backend is a confused deputy's lever: the operator reads the Secrets it names and sends them
//! to the hosts it names, with the operator's own rights. So a Secret is usable only when it
//! carries [`CREDENTIALS_LABEL`] (its owner opted in), a host only when the installer's
//! allow-list matches it, and the operator pod's own cloud identity (SQS without a Secret) only
//! in the namespaces the installer listed.
//!
//! It must stay pure like the rest of `policy`: no I/O, no Kubernetes or broker client. What a
//! Secret carries is asked through the caller's `secrets` function. Every error names the field
//! and the fix.

use std::fmt;
use std::str::FromStr;

use super::rules::Verdict;
use crate::api::{BackendSpec, NatsBackendSpec, RabbitmqBackendSpec, SqsBackendSpec};

/// The label a Secret must carry, with value [`CREDENTIALS_LABEL_VALUE`], before a Backend may
/// use it (A18).
pub const CREDENTIALS_LABEL: &str = "settle.dev/backend-credentials";
/// The value [`CREDENTIALS_LABEL`] must have.
pub const CREDENTIALS_LABEL_VALUE: &str = "true";
/// The longest broker URL accepted (A16); the CRD schema says the same.
pub const URL_MAX: usize = 512;
/// The most URLs one Backend may list (A16); the CRD schema says the same.
pub const URLS_MAX: usize = 16;

/// What the installer allows Backends (operator flags `--allowed-broker-hosts` and
/// `--sqs-pod-identity-namespaces`). The default allows any host and pod identity nowhere.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BackendRules {
    /// Host patterns a broker URL's host must match (A19); empty: any host.
    pub allowed_hosts: Vec<HostPattern>,
    /// Namespaces whose SQS Backends may run without a Secret, as the operator pod's own cloud
    /// identity (A20); empty: none.
    pub pod_identity_namespaces: Vec<String>,
}

/// One allowed host: `nats.messaging.svc` exactly, or `*.example.com` (any host ending in
/// `.example.com`, not `example.com` itself). Compared without case.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostPattern(String);

impl FromStr for HostPattern {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let p = s.trim().to_ascii_lowercase();
        let rest = p.strip_prefix("*.").unwrap_or(&p);
        let ok = !rest.is_empty()
            && rest.len() <= 253
            && rest
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | ':' | '[' | ']'));
        if ok {
            Ok(HostPattern(p))
        } else {
            Err(format!(
                "{s:?} is not a host pattern: give a host (nats.messaging.svc, 10.0.0.7) or `*.` and a domain (*.messaging.svc)"
            ))
        }
    }
}

impl fmt::Display for HostPattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl HostPattern {
    pub fn matches(&self, host: &str) -> bool {
        let host = host.to_ascii_lowercase();
        match self.0.strip_prefix("*.") {
            Some(domain) => host
                .strip_suffix(domain)
                .is_some_and(|head| head.len() > 1 && head.ends_with('.')),
            None => host == self.0,
        }
    }
}

/// What the API server holds under a Secret name a Backend gives, as far as the caller knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SecretView {
    /// It exists and carries the opt-in label.
    Labelled,
    /// It exists without the opt-in label: never used.
    Unlabelled,
    /// No Secret of that name (yet).
    Missing,
    /// It could not be read (the operator may not read Secrets in this namespace).
    Unknown,
}

/// Every Secret a Backend names: (field, name).
pub fn secrets_named(spec: &BackendSpec) -> Vec<(&'static str, &str)> {
    let mut out = Vec::new();
    if let Some(n) = &spec.nats {
        if let Some(r) = &n.credentials_secret_ref {
            out.push(("spec.nats.credentialsSecretRef.name", r.name.as_str()));
        }
        if let Some(r) = n.tls.as_ref().and_then(|t| t.ca_secret_ref.as_ref()) {
            out.push(("spec.nats.tls.caSecretRef.name", r.name.as_str()));
        }
    }
    if let Some(r) = &spec.rabbitmq {
        if let Some(s) = &r.credentials_secret_ref {
            out.push(("spec.rabbitmq.credentialsSecretRef.name", s.name.as_str()));
        }
        if let Some(s) = r.tls.as_ref().and_then(|t| t.ca_secret_ref.as_ref()) {
            out.push(("spec.rabbitmq.tls.caSecretRef.name", s.name.as_str()));
        }
    }
    if let Some(q) = &spec.sqs
        && let Some(s) = &q.credentials_secret_ref
    {
        out.push(("spec.sqs.credentialsSecretRef.name", s.name.as_str()));
    }
    out
}

/// A14 for Backends: an update that leaves the spec as it was is admitted without judging it.
pub fn backend_unchanged(spec: &BackendSpec, old: Option<&BackendSpec>) -> bool {
    old.is_some_and(|old| old == spec)
}

/// The Backend admission rules (A16–A21) for a create (`old` is `None`) or an update. `secrets`
/// tells what each named Secret is; `namespace` is the Backend's.
pub fn validate_backend(
    spec: &BackendSpec,
    old: Option<&BackendSpec>,
    namespace: &str,
    secrets: &dyn Fn(&str) -> SecretView,
    rules: &BackendRules,
) -> Verdict {
    let mut v = Verdict::default();
    if backend_unchanged(spec, old) {
        return v;
    }
    let kinds = [
        spec.nats.is_some(),
        spec.rabbitmq.is_some(),
        spec.sqs.is_some(),
        spec.memory.is_some(),
    ];
    if kinds.iter().filter(|k| **k).count() != 1 {
        v.error(
            "spec",
            "exactly one backend kind must be set: nats, rabbitmq, sqs or memory",
        );
        return v;
    }
    if let Some(old) = old {
        let was = [
            old.nats.is_some(),
            old.rabbitmq.is_some(),
            old.sqs.is_some(),
            old.memory.is_some(),
        ];
        if was != kinds {
            v.error(
                "spec",
                "the backend kind (nats, rabbitmq, sqs, memory) cannot change; delete the Backend and create a new one",
            );
        }
    }
    if let Some(n) = &spec.nats {
        nats_urls(&mut v, n);
    }
    if let Some(r) = &spec.rabbitmq {
        rabbitmq_urls(&mut v, r);
    }
    if let Some(q) = &spec.sqs {
        sqs_settings(&mut v, q);
    }
    for (field, name) in secrets_named(spec) {
        if let Err(why) = dns1123_subdomain(name) {
            v.error(field, format!("{name:?} is not a Secret name: {why}"));
        }
    }
    access_rules(&mut v, spec, namespace, secrets, rules, true);
    for (field, message) in plaintext_with_credentials(spec) {
        v.warn(&field, message);
    }
    v
}

/// What the controller re-checks before it reads a Secret into a connection or connects (A18–A20):
/// every named Secret carries the opt-in label, every broker host is allowed, and SQS without a
/// Secret runs only where pod identity is allowed. A Secret that is missing or cannot be read is
/// not an error here (the controller says so as SecretMissing).
pub fn backend_access(
    spec: &BackendSpec,
    namespace: &str,
    secrets: &dyn Fn(&str) -> SecretView,
    rules: &BackendRules,
) -> Verdict {
    let mut v = Verdict::default();
    access_rules(&mut v, spec, namespace, secrets, rules, false);
    v
}

fn access_rules(
    v: &mut Verdict,
    spec: &BackendSpec,
    namespace: &str,
    secrets: &dyn Fn(&str) -> SecretView,
    rules: &BackendRules,
    at_admission: bool,
) {
    // A18: a Secret is used only if its owner opted in.
    for (field, name) in secrets_named(spec) {
        if dns1123_subdomain(name).is_err() {
            continue;
        }
        let label = format!("{CREDENTIALS_LABEL}={CREDENTIALS_LABEL_VALUE}");
        match secrets(name) {
            SecretView::Labelled => {}
            SecretView::Unlabelled => v.error(
                field,
                format!(
                    "Secret {name:?} does not carry the label {label}, which a Secret needs before a Backend may use it \
                     (Settle never reads or sends an unlabelled Secret): if this Secret is meant for this Backend, run \
                     `kubectl label secret {name} -n {namespace} {label}`"
                ),
            ),
            SecretView::Missing if at_admission => v.warn(
                field,
                format!(
                    "Secret {name:?} does not exist in namespace {namespace} yet; create it with the label {label}, \
                     until then the Backend is not Ready"
                ),
            ),
            SecretView::Unknown if at_admission => v.warn(
                field,
                format!(
                    "Secret {name:?} could not be read to check its label {label}; the operator checks it again before using it"
                ),
            ),
            SecretView::Missing | SecretView::Unknown => {}
        }
    }

    // A19: broker hosts only from the installer's allow-list.
    if !rules.allowed_hosts.is_empty() {
        let allowed = rules
            .allowed_hosts
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(", ");
        for (field, host) in hosts_named(spec) {
            match host {
                Some(host) if rules.allowed_hosts.iter().any(|p| p.matches(&host)) => {}
                Some(host) => v.error(
                    &field,
                    format!(
                        "host {host:?} is not among the broker hosts this installation allows ({allowed}, the operator's \
                         --allowed-broker-hosts): point the Backend at an allowed broker, or ask the installer to allow this one"
                    ),
                ),
                None => v.error(
                    &field,
                    format!(
                        "names no host to check against the broker hosts this installation allows ({allowed}): set it \
                         explicitly"
                    ),
                ),
            }
        }
    }

    // A20: the operator pod's own cloud identity only where the installer allowed it.
    if let Some(q) = &spec.sqs
        && q.credentials_secret_ref.is_none()
        && !rules.pod_identity_namespaces.iter().any(|n| n == namespace)
    {
        v.error(
            "spec.sqs.credentialsSecretRef",
            format!(
                "required in namespace {namespace}: without it the Backend would run as the operator pod's own cloud \
                 identity, which this installation allows only in the namespaces listed in the operator's \
                 --sqs-pod-identity-namespaces ({}). Set credentialsSecretRef to a Secret with keys accessKeyId and \
                 secretAccessKey and the label {CREDENTIALS_LABEL}={CREDENTIALS_LABEL_VALUE}",
                if rules.pod_identity_namespaces.is_empty() {
                    "none".to_string()
                } else {
                    rules.pod_identity_namespaces.join(", ")
                }
            ),
        );
    }
}

/// Every broker host a Backend makes the operator connect to: (field, host). `None`: the host
/// cannot be told from the spec (an unparsable URL, or SQS in the pod's own region).
fn hosts_named(spec: &BackendSpec) -> Vec<(String, Option<String>)> {
    let mut out = Vec::new();
    let host = |u: &str| parse_url(u).ok().map(|p| p.host.to_string());
    if let Some(n) = &spec.nats {
        for (i, s) in n.servers.iter().enumerate() {
            out.push((format!("spec.nats.servers[{i}]"), host(s)));
        }
    }
    if let Some(r) = &spec.rabbitmq {
        for (i, u) in r.urls.iter().enumerate() {
            out.push((format!("spec.rabbitmq.urls[{i}]"), host(u)));
        }
        if let Some(m) = &r.management_url {
            out.push(("spec.rabbitmq.managementUrl".into(), host(m)));
        }
    }
    if let Some(q) = &spec.sqs {
        match (&q.endpoint, &q.region) {
            (Some(e), _) => out.push(("spec.sqs.endpoint".into(), host(e))),
            (None, Some(r)) => out.push((
                "spec.sqs.region".into(),
                Some(format!("sqs.{r}.amazonaws.com")),
            )),
            (None, None) => out.push(("spec.sqs.region".into(), None)),
        }
    }
    out
}

/// A21: where credentials would travel unencrypted: (field, warning). Not a refusal (local
/// development uses it); the controller also says it in Ready's reason and a Warning Event.
pub fn plaintext_with_credentials(spec: &BackendSpec) -> Vec<(String, String)> {
    let scheme = |u: &str| parse_url(u).ok().map(|p| p.scheme.to_ascii_lowercase());
    let mut out = Vec::new();
    let say = |what: &str, fix: &str| {
        format!(
            "sends the credentials Secret's {what} unencrypted: anyone on the path can read them; {fix} \
             (admitted, for local development)"
        )
    };
    if let Some(n) = &spec.nats
        && n.credentials_secret_ref.is_some()
        && n.tls
            .as_ref()
            .and_then(|t| t.ca_secret_ref.as_ref())
            .is_none()
    {
        for (i, s) in n.servers.iter().enumerate() {
            if scheme(s).as_deref() == Some("nats") {
                out.push((
                    format!("spec.nats.servers[{i}]"),
                    say(
                        "credentials",
                        "use tls:// (or set spec.nats.tls.caSecretRef)",
                    ),
                ));
            }
        }
    }
    if let Some(r) = &spec.rabbitmq
        && r.credentials_secret_ref.is_some()
    {
        for (i, u) in r.urls.iter().enumerate() {
            if scheme(u).as_deref() == Some("amqp") {
                out.push((
                    format!("spec.rabbitmq.urls[{i}]"),
                    say("username and password", "use amqps://"),
                ));
            }
        }
        if let Some(m) = &r.management_url
            && scheme(m).as_deref() == Some("http")
        {
            out.push((
                "spec.rabbitmq.managementUrl".into(),
                say("username and password", "use https://"),
            ));
        }
    }
    if let Some(q) = &spec.sqs
        && q.credentials_secret_ref.is_some()
        && let Some(e) = &q.endpoint
        && scheme(e).as_deref() == Some("http")
    {
        out.push((
            "spec.sqs.endpoint".into(),
            say("signed requests", "use https://"),
        ));
    }
    out
}

fn nats_urls(v: &mut Verdict, n: &NatsBackendSpec) {
    url_list(
        v,
        "spec.nats.servers",
        &n.servers,
        &["nats", "tls"],
        "nats://host:4222 (tls://host:4222 for TLS)",
        "spec.nats.credentialsSecretRef",
    );
}

fn rabbitmq_urls(v: &mut Verdict, r: &RabbitmqBackendSpec) {
    url_list(
        v,
        "spec.rabbitmq.urls",
        &r.urls,
        &["amqp", "amqps"],
        "amqp://host:5672 (amqps://host:5671 for TLS)",
        "spec.rabbitmq.credentialsSecretRef",
    );
    if let Some(m) = &r.management_url {
        one_url(
            v,
            "spec.rabbitmq.managementUrl",
            m,
            &["http", "https"],
            "http://host:15672 (https:// for TLS)",
            "spec.rabbitmq.credentialsSecretRef (the management API uses the same credentials)",
        );
    }
}

fn sqs_settings(v: &mut Verdict, q: &SqsBackendSpec) {
    if let Some(e) = &q.endpoint {
        one_url(
            v,
            "spec.sqs.endpoint",
            e,
            &["http", "https"],
            "https://sqs.eu-west-1.amazonaws.com or http://elasticmq:9324",
            "spec.sqs.credentialsSecretRef",
        );
    }
    if let Some(r) = &q.region
        && (r.len() > 32
            || !r
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-'))
    {
        v.error(
            "spec.sqs.region",
            format!(
                "{r:?} is not a region name: at most 32 lowercase letters, digits and '-', e.g. eu-west-1"
            ),
        );
    }
}

fn url_list(
    v: &mut Verdict,
    field: &str,
    urls: &[String],
    schemes: &[&str],
    example: &str,
    secret_field: &str,
) {
    if urls.is_empty() {
        v.error(field, format!("needs at least one URL, e.g. {example}"));
    }
    if urls.len() > URLS_MAX {
        v.error(
            field,
            format!(
                "lists {} URLs, more than {URLS_MAX}: keep at most {URLS_MAX} (the client learns the rest of a cluster from the servers)",
                urls.len()
            ),
        );
    }
    for (i, u) in urls.iter().enumerate().take(URLS_MAX) {
        one_url(
            v,
            &format!("{field}[{i}]"),
            u,
            schemes,
            example,
            secret_field,
        );
    }
}

/// A16, A17: one URL's scheme, syntax and length, and no credentials in it.
fn one_url(
    v: &mut Verdict,
    field: &str,
    url: &str,
    schemes: &[&str],
    example: &str,
    secret_field: &str,
) {
    if url.len() > URL_MAX {
        v.error(
            field,
            format!(
                "is {} characters long, more than {URL_MAX}: give a URL like {example}",
                url.len()
            ),
        );
        return;
    }
    let parsed = match parse_url(url) {
        Ok(p) => p,
        Err(why) => {
            v.error(
                field,
                format!("is not a URL ({why}): give one like {example}"),
            );
            return;
        }
    };
    if parsed.userinfo {
        // The URL is not repeated: it holds a password.
        v.error(
            field,
            format!(
                "holds credentials (user:password@): remove them from the URL and put them in a labelled Secret named by {secret_field}"
            ),
        );
    }
    let scheme = parsed.scheme.to_ascii_lowercase();
    if !schemes.contains(&scheme.as_str()) {
        v.error(
            field,
            format!(
                "has scheme {scheme:?}, and this backend takes {}: give a URL like {example}",
                schemes
                    .iter()
                    .map(|s| format!("{s}://"))
                    .collect::<Vec<_>>()
                    .join(" or ")
            ),
        );
    }
}

/// The parts of a URL the rules need.
#[derive(Debug, PartialEq, Eq)]
struct ParsedUrl<'a> {
    scheme: &'a str,
    host: &'a str,
    userinfo: bool,
}

/// `scheme://[userinfo@]host[:port][/path][?query]`, with a host of letters, digits, `-`, `.`,
/// `_`, or an IPv6 literal in brackets.
fn parse_url(url: &str) -> Result<ParsedUrl<'_>, String> {
    let Some((scheme, rest)) = url.split_once("://") else {
        return Err("it has no scheme://".into());
    };
    if scheme.is_empty()
        || !scheme
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'))
    {
        return Err(format!("{scheme:?} is not a scheme"));
    }
    if url.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err("it holds whitespace or control characters".into());
    }
    let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
    let (userinfo, hostport) = match authority.rsplit_once('@') {
        Some((_, h)) => (true, h),
        None => (false, authority),
    };
    let (host, port) = if let Some(v6) = hostport.strip_prefix('[') {
        let Some((inside, after)) = v6.split_once(']') else {
            return Err("an IPv6 host has no closing ']'".into());
        };
        if inside.is_empty() || !inside.chars().all(|c| c.is_ascii_hexdigit() || c == ':') {
            return Err(format!("[{inside}] is not an IPv6 address"));
        }
        (&hostport[..inside.len() + 2], after.strip_prefix(':'))
    } else {
        match hostport.split_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (hostport, None),
        }
    };
    if host.is_empty() {
        return Err("it names no host".into());
    }
    if !host.starts_with('[')
        && !host
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_'))
    {
        return Err(format!("{host:?} is not a host name"));
    }
    if let Some(p) = port
        && p.parse::<u16>().map_or(true, |p| p == 0)
    {
        return Err(format!("{p:?} is not a port (1 to 65535)"));
    }
    Ok(ParsedUrl {
        scheme,
        host,
        userinfo,
    })
}

/// A Kubernetes object name (DNS-1123 subdomain): at most 253 lowercase letters, digits, `-`
/// and `.`, starting and ending with a letter or digit.
fn dns1123_subdomain(name: &str) -> Result<(), String> {
    let ok_char = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit();
    if name.is_empty() || name.len() > 253 {
        return Err("a Secret name has 1 to 253 characters".into());
    }
    let valid = name.split('.').all(|label| {
        !label.is_empty()
            && label.chars().all(|c| ok_char(c) || c == '-')
            && label.starts_with(ok_char)
            && label.ends_with(ok_char)
    });
    if valid {
        Ok(())
    } else {
        Err(
            "a Secret name is lowercase letters, digits, '-' and '.', starting and ending with a letter or digit"
                .into(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::{MemoryBackendSpec, NatsTlsSpec, SecretRef};

    fn labelled(_: &str) -> SecretView {
        SecretView::Labelled
    }

    fn nats(servers: &[&str], secret: Option<&str>) -> BackendSpec {
        BackendSpec {
            nats: Some(NatsBackendSpec {
                servers: servers.iter().map(ToString::to_string).collect(),
                credentials_secret_ref: secret.map(|n| SecretRef { name: n.into() }),
                tls: None,
            }),
            ..BackendSpec::default()
        }
    }

    fn rabbit(urls: &[&str], management: Option<&str>, secret: Option<&str>) -> BackendSpec {
        BackendSpec {
            rabbitmq: Some(RabbitmqBackendSpec {
                urls: urls.iter().map(ToString::to_string).collect(),
                management_url: management.map(Into::into),
                credentials_secret_ref: secret.map(|n| SecretRef { name: n.into() }),
                ..RabbitmqBackendSpec::default()
            }),
            ..BackendSpec::default()
        }
    }

    fn sqs(endpoint: Option<&str>, region: Option<&str>, secret: Option<&str>) -> BackendSpec {
        BackendSpec {
            sqs: Some(SqsBackendSpec {
                endpoint: endpoint.map(Into::into),
                region: region.map(Into::into),
                credentials_secret_ref: secret.map(|n| SecretRef { name: n.into() }),
                queue_prefix: None,
            }),
            ..BackendSpec::default()
        }
    }

    fn errors(v: &Verdict) -> Vec<String> {
        v.errors.iter().map(ToString::to_string).collect()
    }

    #[test]
    fn good_backends_of_every_kind_pass() {
        let rules = BackendRules::default();
        let cases = [
            nats(&["tls://nats.messaging:4222", "nats://10.0.0.7:4222"], None),
            nats(&["tls://[::1]:4222"], Some("nats-creds")),
            rabbit(
                &["amqps://rabbit.messaging:5671/%2f"],
                Some("https://rabbit.messaging:15672"),
                Some("rabbit"),
            ),
            sqs(
                Some("https://sqs.eu-west-1.amazonaws.com"),
                None,
                Some("aws"),
            ),
            BackendSpec {
                memory: Some(MemoryBackendSpec {}),
                ..BackendSpec::default()
            },
        ];
        for spec in cases {
            let v = validate_backend(&spec, None, "team-a", &labelled, &rules);
            assert!(v.allowed(), "{spec:?}: {:?}", errors(&v));
            assert!(v.warnings.is_empty(), "{spec:?}: {:?}", v.warnings);
        }
    }

    #[test]
    fn urls_are_checked_per_kind_and_never_repeat_a_password() {
        let rules = BackendRules::default();
        let cases: &[(BackendSpec, &str, &str)] = &[
            (
                nats(&["amqp://nats:4222"], None),
                "spec.nats.servers[0]",
                "has scheme \"amqp\", and this backend takes nats:// or tls://",
            ),
            (
                nats(&["nats.messaging:4222"], None),
                "spec.nats.servers[0]",
                "it has no scheme://",
            ),
            (
                nats(&["nats://nats:99999"], None),
                "spec.nats.servers[0]",
                "is not a port",
            ),
            (
                nats(&["nats://"], None),
                "spec.nats.servers[0]",
                "names no host",
            ),
            (
                rabbit(&["http://rabbit:5672"], None, None),
                "spec.rabbitmq.urls[0]",
                "takes amqp:// or amqps://",
            ),
            (
                rabbit(&["amqp://rabbit:5672"], Some("amqp://rabbit:15672"), None),
                "spec.rabbitmq.managementUrl",
                "takes http:// or https://",
            ),
            (
                sqs(Some("ftp://sqs"), None, Some("aws")),
                "spec.sqs.endpoint",
                "takes http:// or https://",
            ),
            (
                sqs(None, Some("EU West"), Some("aws")),
                "spec.sqs.region",
                "is not a region name",
            ),
            (
                nats(&[&format!("nats://{}:4222", "a".repeat(600))], None),
                "spec.nats.servers[0]",
                "more than 512",
            ),
        ];
        for (spec, field, says) in cases {
            let e = errors(&validate_backend(spec, None, "ns", &labelled, &rules));
            assert!(
                e.iter().any(|e| e.starts_with(field) && e.contains(says)),
                "{spec:?}: wanted {field}: …{says}…, got {e:?}"
            );
        }
        let spec = rabbit(&["amqp://guest:s3cr3t@rabbit:5672/%2f"], None, None);
        let e = errors(&validate_backend(&spec, None, "ns", &labelled, &rules));
        assert!(
            e.iter().any(
                |e| e.starts_with("spec.rabbitmq.urls[0]: holds credentials")
                    && e.contains("spec.rabbitmq.credentialsSecretRef")
            ),
            "{e:?}"
        );
        assert!(!e.iter().any(|e| e.contains("s3cr3t")), "{e:?}");
        let many: Vec<String> = (0..17).map(|i| format!("nats://n{i}:4222")).collect();
        let many: Vec<&str> = many.iter().map(String::as_str).collect();
        let e = errors(&validate_backend(
            &nats(&many, None),
            None,
            "ns",
            &labelled,
            &rules,
        ));
        assert!(
            e.iter()
                .any(|e| e.starts_with("spec.nats.servers: lists 17 URLs")),
            "{e:?}"
        );
    }

    #[test]
    fn secret_names_must_be_dns_names() {
        let e = errors(&validate_backend(
            &nats(&["nats://n:4222"], Some("Bad_Name")),
            None,
            "ns",
            &labelled,
            &BackendRules::default(),
        ));
        assert_eq!(e.len(), 1, "{e:?}");
        assert!(
            e[0].starts_with(
                "spec.nats.credentialsSecretRef.name: \"Bad_Name\" is not a Secret name"
            ),
            "{e:?}"
        );
    }

    #[test]
    fn an_unlabelled_secret_is_refused_naming_the_field_and_the_label() {
        let mut spec = nats(&["tls://n:4222"], Some("creds"));
        if let Some(n) = spec.nats.as_mut() {
            n.tls = Some(NatsTlsSpec {
                ca_secret_ref: Some(SecretRef { name: "ca".into() }),
            });
        }
        let views = |name: &str| match name {
            "creds" => SecretView::Unlabelled,
            _ => SecretView::Missing,
        };
        let rules = BackendRules::default();
        let v = validate_backend(&spec, None, "team-a", &views, &rules);
        let e = errors(&v);
        assert_eq!(e.len(), 1, "{e:?}");
        assert!(e[0].starts_with("spec.nats.credentialsSecretRef.name: Secret \"creds\" does not carry the label settle.dev/backend-credentials=true"), "{e:?}");
        assert!(
            e[0].contains(
                "kubectl label secret creds -n team-a settle.dev/backend-credentials=true"
            ),
            "{e:?}"
        );
        assert_eq!(
            v.warnings.len(),
            1,
            "the missing CA is a warning: {:?}",
            v.warnings
        );
        assert_eq!(v.warnings[0].field, "spec.nats.tls.caSecretRef.name");
        // The controller refuses the unlabelled one too, and says nothing of the missing one.
        let c = backend_access(&spec, "team-a", &views, &rules);
        assert_eq!(errors(&c), e);
        assert!(c.warnings.is_empty());
    }

    #[test]
    fn hosts_outside_the_allow_list_are_refused() {
        let rules = BackendRules {
            allowed_hosts: vec![
                "*.messaging.svc".parse().unwrap(),
                "10.0.0.7".parse().unwrap(),
            ],
            ..BackendRules::default()
        };
        let ok = [
            nats(&["nats://nats.messaging.svc:4222", "nats://10.0.0.7"], None),
            nats(&["nats://A.B.Messaging.SVC:4222"], None),
        ];
        for spec in ok {
            assert!(
                backend_access(&spec, "ns", &labelled, &rules).allowed(),
                "{spec:?}"
            );
        }
        let refused = [
            (
                nats(&["nats://messaging.svc:4222"], None),
                "spec.nats.servers[0]",
            ),
            (
                nats(&["nats://evil.example:4222"], None),
                "spec.nats.servers[0]",
            ),
            (
                rabbit(
                    &["amqp://x.messaging.svc"],
                    Some("http://metadata.internal"),
                    None,
                ),
                "spec.rabbitmq.managementUrl",
            ),
            (sqs(None, Some("eu-west-1"), Some("aws")), "spec.sqs.region"),
            (sqs(None, None, Some("aws")), "spec.sqs.region"),
        ];
        for (spec, field) in refused {
            let e = errors(&backend_access(&spec, "ns", &labelled, &rules));
            assert_eq!(e.len(), 1, "{spec:?}: {e:?}");
            assert!(
                e[0].starts_with(field) && e[0].contains("--allowed-broker-hosts")
                    || e[0].contains("names no host"),
                "{e:?}"
            );
        }
        assert!("".parse::<HostPattern>().is_err());
        assert!("*.".parse::<HostPattern>().is_err());
        assert!("a/b".parse::<HostPattern>().is_err());
    }

    #[test]
    fn sqs_pod_identity_only_where_the_installer_allows_it() {
        let spec = sqs(None, Some("eu-west-1"), None);
        let none = BackendRules::default();
        let e = errors(&backend_access(&spec, "team-a", &labelled, &none));
        assert_eq!(e.len(), 1, "{e:?}");
        assert!(
            e[0].starts_with("spec.sqs.credentialsSecretRef: required in namespace team-a"),
            "{e:?}"
        );
        assert!(
            e[0].contains("--sqs-pod-identity-namespaces (none)"),
            "{e:?}"
        );
        let listed = BackendRules {
            pod_identity_namespaces: vec!["platform".into()],
            ..BackendRules::default()
        };
        assert!(backend_access(&spec, "platform", &labelled, &listed).allowed());
        assert!(!backend_access(&spec, "team-a", &labelled, &listed).allowed());
        // With a Secret, any namespace.
        let with = sqs(None, Some("eu-west-1"), Some("aws"));
        assert!(backend_access(&with, "team-a", &labelled, &none).allowed());
    }

    #[test]
    fn plaintext_with_credentials_is_a_warning_not_a_refusal() {
        let rules = BackendRules::default();
        for (spec, field) in [
            (nats(&["nats://n:4222"], Some("c")), "spec.nats.servers[0]"),
            (
                rabbit(&["amqp://r:5672"], None, Some("c")),
                "spec.rabbitmq.urls[0]",
            ),
            (
                rabbit(&["amqps://r:5671"], Some("http://r:15672"), Some("c")),
                "spec.rabbitmq.managementUrl",
            ),
            (
                sqs(Some("http://e:9324"), None, Some("c")),
                "spec.sqs.endpoint",
            ),
        ] {
            let v = validate_backend(&spec, None, "ns", &labelled, &rules);
            assert!(v.allowed(), "{:?}", errors(&v));
            assert_eq!(v.warnings.len(), 1, "{spec:?}: {:?}", v.warnings);
            assert_eq!(v.warnings[0].field, field);
            assert!(v.warnings[0].message.contains("unencrypted"));
        }
        // Without credentials, or over TLS, nothing to say.
        assert!(plaintext_with_credentials(&nats(&["nats://n:4222"], None)).is_empty());
        assert!(plaintext_with_credentials(&nats(&["tls://n:4222"], Some("c"))).is_empty());
    }

    #[test]
    fn an_unchanged_spec_or_a_kind_change() {
        let rules = BackendRules::default();
        let old = nats(&["nats://guest:pw@n:4222"], None);
        // A14: unchanged (even one that would be refused now) is admitted.
        assert!(validate_backend(&old, Some(&old), "ns", &labelled, &rules).allowed());
        let new = rabbit(&["amqp://r:5672"], None, None);
        let e = errors(&validate_backend(&new, Some(&old), "ns", &labelled, &rules));
        assert!(
            e.iter()
                .any(|e| e.starts_with("spec: the backend kind") && e.contains("cannot change")),
            "{e:?}"
        );
    }
}
