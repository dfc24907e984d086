//! The shape of what a Backend names (A16, A17): each broker URL's scheme, syntax and length,
//! no credentials in a URL, at most [`URLS_MAX`] URLs, an SQS region's name, a Secret name
//! Kubernetes can hold; and the URL parser the access rules read hosts and schemes with.
//!
//! Pure: it must not decide who may be used or where (that is [`super::access`]).

use crate::api::{NatsBackendSpec, RabbitmqBackendSpec, SqsBackendSpec};
use crate::policy::rules::Verdict;

/// The longest broker URL accepted (A16); the CRD schema says the same.
pub const URL_MAX: usize = 512;
/// The most URLs one Backend may list (A16); the CRD schema says the same.
pub const URLS_MAX: usize = 16;

pub(super) fn nats_urls(v: &mut Verdict, n: &NatsBackendSpec) {
    url_list(
        v,
        "spec.nats.servers",
        &n.servers,
        &["nats", "tls"],
        "nats://host:4222 (tls://host:4222 for TLS)",
        "spec.nats.credentialsSecretRef",
    );
}

pub(super) fn rabbitmq_urls(v: &mut Verdict, r: &RabbitmqBackendSpec) {
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

pub(super) fn sqs_settings(v: &mut Verdict, q: &SqsBackendSpec) {
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
pub(super) struct ParsedUrl<'a> {
    pub(super) scheme: &'a str,
    pub(super) host: &'a str,
    pub(super) userinfo: bool,
}

/// `scheme://[userinfo@]host[:port][/path][?query]`, with a host of letters, digits, `-`, `.`,
/// `_`, or an IPv6 literal in brackets.
pub(super) fn parse_url(url: &str) -> Result<ParsedUrl<'_>, String> {
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
pub(super) fn dns1123_subdomain(name: &str) -> Result<(), String> {
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
