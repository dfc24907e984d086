//! THE Subscription → SQS queue mapping (docs/semantics.md Q1): `desired` builds the queue and
//! its dead-letter queue from a resolved policy, `diff` compares a live queue's attributes with
//! it. The runtime uses it for a code-defined subscription's own queue; the operator uses the same
//! function for a Subscription's queue.
//!
//! Pure: no client, no clock. It must not talk to SQS (that is `super::api`).

use std::collections::BTreeMap;
use std::fmt;

use crate::policy::ResolvedPolicy;

use super::hold::{HOLD_LIMIT, ceil_secs};

/// The longest queue name SQS accepts.
pub const NAME_MAX: usize = 80;
/// Appended to a queue's name to name its dead-letter queue.
pub const DLQ_SUFFIX: &str = "-dlq";
/// SQS's largest `maxReceiveCount` in a redrive policy.
pub const MAX_RECEIVE_COUNT: u32 = 1000;
/// How long a dead-letter queue keeps what it holds: SQS's longest, 14 days.
pub const DLQ_RETENTION_SECS: u32 = 14 * 24 * 3600;

/// The queue attribute names the mapping sets, as SQS spells them.
pub const VISIBILITY_TIMEOUT: &str = "VisibilityTimeout";
pub const REDRIVE_POLICY: &str = "RedrivePolicy";
pub const MESSAGE_RETENTION_PERIOD: &str = "MessageRetentionPeriod";

/// A queue as a subscription needs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QueueSpec {
    /// `<prefix><durableName>` (or `<prefix><pattern>` without a durableName: equal under the
    /// admission rules).
    pub name: String,
    /// VisibilityTimeout: ackWait in whole seconds, rounded up, at most the hold limit.
    pub visibility_timeout_secs: u32,
    /// Under AtLeastOnce with maxDeliver: the dead-letter queue the redrive moves a message to
    /// after maxDeliver receives (where Exhausted messages go).
    pub redrive: Option<Redrive>,
}

/// The redrive policy of a queue.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Redrive {
    /// `<name>-dlq`.
    pub dead_letter_queue: String,
    /// maxDeliver.
    pub max_receive_count: u32,
}

/// A subscription that cannot have a queue.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum QueueError {
    #[error(
        "queue name {name:?} is not a valid SQS queue name (at most {NAME_MAX} characters with the {DLQ_SUFFIX} of its \
         dead-letter queue; letters, digits, '-' and '_'): use a shorter durableName or queue prefix"
    )]
    Name { name: String },
    #[error(
        "maxDeliver {0} is more than SQS's largest maxReceiveCount ({MAX_RECEIVE_COUNT}): set spec.maxDeliver to {MAX_RECEIVE_COUNT} or less"
    )]
    MaxDeliver(u32),
}

fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= NAME_MAX
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
}

/// The queue of a subscription: named from the Backend's queue prefix and the durableName (the
/// pattern without one), hiding a received message for ackWait, and, with maxDeliver under
/// AtLeastOnce, redriving it to `<name>-dlq` after maxDeliver receives.
pub fn desired(prefix: &str, policy: &ResolvedPolicy) -> Result<QueueSpec, QueueError> {
    let base = policy.durable_name.as_deref().unwrap_or(&policy.pattern);
    let name = format!("{prefix}{base}");
    let redrive = match policy.max_deliver.filter(|_| policy.at_least_once()) {
        Some(m) if m > MAX_RECEIVE_COUNT => return Err(QueueError::MaxDeliver(m)),
        Some(m) => Some(Redrive {
            dead_letter_queue: format!("{name}{DLQ_SUFFIX}"),
            max_receive_count: m,
        }),
        None => None,
    };
    let longest = redrive
        .as_ref()
        .map_or(name.as_str(), |r| &r.dead_letter_queue);
    if !valid_name(&name) || !valid_name(longest) {
        return Err(QueueError::Name { name });
    }
    Ok(QueueSpec {
        name,
        visibility_timeout_secs: visibility_secs(policy.ack_wait),
        redrive,
    })
}

/// ackWait as a visibility timeout: whole seconds, rounded up, between 1 s and the hold limit.
pub fn visibility_secs(ack_wait: std::time::Duration) -> u32 {
    let s = ceil_secs(ack_wait).clamp(1, HOLD_LIMIT.as_secs());
    u32::try_from(s).unwrap_or(u32::MAX)
}

/// The RedrivePolicy attribute's JSON, for a dead-letter queue of this ARN.
pub fn redrive_policy_json(dead_letter_arn: &str, max_receive_count: u32) -> String {
    serde_json::json!({
        "deadLetterTargetArn": dead_letter_arn,
        "maxReceiveCount": max_receive_count,
    })
    .to_string()
}

/// The attributes of the main queue, given its dead-letter queue's ARN (when it has one).
pub fn attributes(spec: &QueueSpec, dead_letter_arn: Option<&str>) -> BTreeMap<String, String> {
    let mut a = BTreeMap::new();
    a.insert(
        VISIBILITY_TIMEOUT.to_string(),
        spec.visibility_timeout_secs.to_string(),
    );
    if let (Some(r), Some(arn)) = (&spec.redrive, dead_letter_arn) {
        a.insert(
            REDRIVE_POLICY.to_string(),
            redrive_policy_json(arn, r.max_receive_count),
        );
    }
    a
}

/// The attributes of a dead-letter queue.
pub fn dead_letter_attributes() -> BTreeMap<String, String> {
    BTreeMap::from([(
        MESSAGE_RETENTION_PERIOD.to_string(),
        DLQ_RETENTION_SECS.to_string(),
    )])
}

/// One attribute that differs between the mapping and the live queue.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Change {
    pub attribute: &'static str,
    pub want: String,
    pub have: String,
}

impl fmt::Display for Change {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} is {}, want {}", self.attribute, self.have, self.want)
    }
}

/// What differs between `want` and a live queue's attributes (as GetQueueAttributes returns
/// them). Every attribute the mapping sets can be changed in place (SetQueueAttributes); the
/// dead-letter queue is compared by name, the last part of its ARN.
pub fn diff(want: &QueueSpec, live: &BTreeMap<String, String>) -> Vec<Change> {
    let mut out = Vec::new();
    let have_vt = live.get(VISIBILITY_TIMEOUT).cloned().unwrap_or_default();
    if have_vt != want.visibility_timeout_secs.to_string() {
        out.push(Change {
            attribute: VISIBILITY_TIMEOUT,
            want: want.visibility_timeout_secs.to_string(),
            have: or_unset(have_vt),
        });
    }
    let have = live
        .get(REDRIVE_POLICY)
        .filter(|s| !s.is_empty())
        .and_then(|s| parse_redrive(s));
    let show = |r: &Option<Redrive>| match r {
        Some(r) => format!(
            "{{dead-letter queue {}, maxReceiveCount {}}}",
            r.dead_letter_queue, r.max_receive_count
        ),
        None => "unset".to_string(),
    };
    if have != want.redrive {
        out.push(Change {
            attribute: REDRIVE_POLICY,
            want: show(&want.redrive),
            have: show(&have),
        });
    }
    out
}

fn or_unset(s: String) -> String {
    if s.is_empty() { "unset".to_string() } else { s }
}

/// A RedrivePolicy attribute as a `Redrive` (the queue name from the ARN's last part).
pub fn parse_redrive(json: &str) -> Option<Redrive> {
    let v: serde_json::Value = serde_json::from_str(json).ok()?;
    let arn = v.get("deadLetterTargetArn")?.as_str()?;
    let count = match v.get("maxReceiveCount")? {
        serde_json::Value::Number(n) => n.as_u64()?,
        serde_json::Value::String(s) => s.parse().ok()?,
        _ => return None,
    };
    Some(Redrive {
        dead_letter_queue: arn.rsplit(':').next()?.to_string(),
        max_receive_count: u32::try_from(count).ok()?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::{self, DeliveryPolicy, Mode};

    fn policy(yaml: &str) -> ResolvedPolicy {
        let p: DeliveryPolicy = serde_yaml::from_str(yaml).expect("row policy parses");
        ResolvedPolicy::resolve(&p)
    }

    #[test]
    fn desired_table() {
        // (policy, prefix, expected)
        let long = format!(
            "pattern: {n}\nmode: AtLeastOnce\ndurableName: {n}\nmaxDeliver: 2\n",
            n = "a".repeat(77)
        );
        let rows: Vec<(&str, &str, Result<QueueSpec, QueueError>)> = vec![
            (
                "pattern: orders\nmode: AtLeastOnce\ndurableName: orders\nmaxDeliver: 5\nackWait: 30s\n",
                "shop-",
                Ok(QueueSpec {
                    name: "shop-orders".into(),
                    visibility_timeout_secs: 30,
                    redrive: Some(Redrive {
                        dead_letter_queue: "shop-orders-dlq".into(),
                        max_receive_count: 5,
                    }),
                }),
            ),
            // Defaults: ackWait 30s; no maxDeliver, no dead-letter queue.
            (
                "pattern: jobs\nmode: AtLeastOnce\ndurableName: jobs\n",
                "",
                Ok(QueueSpec {
                    name: "jobs".into(),
                    visibility_timeout_secs: 30,
                    redrive: None,
                }),
            ),
            // Sub-second ackWait rounds up; AtMostOnce has no redrive, and is named by the pattern.
            (
                "pattern: audit\nackWait: 1500ms\nmaxDeliver: 3\n",
                "p_",
                Ok(QueueSpec {
                    name: "p_audit".into(),
                    visibility_timeout_secs: 2,
                    redrive: None,
                }),
            ),
            // ackWait above the hold limit is held to it.
            (
                "pattern: slow\nmode: AtLeastOnce\ndurableName: slow\nackWait: 13h\n",
                "",
                Ok(QueueSpec {
                    name: "slow".into(),
                    visibility_timeout_secs: 43_200,
                    redrive: None,
                }),
            ),
            (
                "pattern: big\nmode: AtLeastOnce\ndurableName: big\nmaxDeliver: 1001\n",
                "",
                Err(QueueError::MaxDeliver(1001)),
            ),
            // The dead-letter queue's name must fit too.
            (
                &long,
                "",
                Err(QueueError::Name {
                    name: "a".repeat(77),
                }),
            ),
            (
                "pattern: x\nmode: AtLeastOnce\ndurableName: x\n",
                "bad.prefix-",
                Err(QueueError::Name {
                    name: "bad.prefix-x".into(),
                }),
            ),
        ];
        for (yaml, prefix, want) in rows {
            assert_eq!(desired(prefix, &policy(yaml)), want, "{yaml}");
        }
    }

    #[test]
    fn attributes_carry_the_redrive_with_the_arn() {
        let spec = desired(
            "",
            &ResolvedPolicy::resolve(&DeliveryPolicy {
                pattern: "o".into(),
                mode: Mode::AtLeastOnce,
                durable_name: Some("o".into()),
                max_deliver: Some(3),
                ack_wait: Some(api::Duration::from_secs(1)),
                ..DeliveryPolicy::default()
            }),
        )
        .expect("valid");
        let a = attributes(&spec, Some("arn:aws:sqs:elasticmq:000000000000:o-dlq"));
        assert_eq!(a[VISIBILITY_TIMEOUT], "1");
        assert_eq!(
            parse_redrive(&a[REDRIVE_POLICY]),
            Some(Redrive {
                dead_letter_queue: "o-dlq".into(),
                max_receive_count: 3
            })
        );
        assert!(diff(&spec, &a).is_empty(), "{:?}", diff(&spec, &a));
    }

    #[test]
    fn diff_table() {
        let want = QueueSpec {
            name: "o".into(),
            visibility_timeout_secs: 30,
            redrive: Some(Redrive {
                dead_letter_queue: "o-dlq".into(),
                max_receive_count: 5,
            }),
        };
        let live = |vt: Option<&str>, rp: Option<&str>| {
            let mut m = BTreeMap::new();
            if let Some(v) = vt {
                m.insert(VISIBILITY_TIMEOUT.to_string(), v.to_string());
            }
            if let Some(r) = rp {
                m.insert(REDRIVE_POLICY.to_string(), r.to_string());
            }
            m
        };
        let good = r#"{"deadLetterTargetArn":"arn:aws:sqs:us-east-1:1:o-dlq","maxReceiveCount":5}"#;
        // (live, attributes that differ)
        let rows: Vec<(BTreeMap<String, String>, Vec<&str>)> = vec![
            (live(Some("30"), Some(good)), vec![]),
            // SQS (not ElasticMQ) returns maxReceiveCount as a string.
            (
                live(
                    Some("30"),
                    Some(
                        r#"{"deadLetterTargetArn":"arn:aws:sqs:us-east-1:1:o-dlq","maxReceiveCount":"5"}"#,
                    ),
                ),
                vec![],
            ),
            (live(Some("31"), Some(good)), vec![VISIBILITY_TIMEOUT]),
            (live(None, Some(good)), vec![VISIBILITY_TIMEOUT]),
            (live(Some("30"), None), vec![REDRIVE_POLICY]),
            (live(Some("30"), Some("")), vec![REDRIVE_POLICY]),
            (
                live(
                    Some("30"),
                    Some(
                        r#"{"deadLetterTargetArn":"arn:aws:sqs:us-east-1:1:other","maxReceiveCount":5}"#,
                    ),
                ),
                vec![REDRIVE_POLICY],
            ),
            (
                live(
                    Some("30"),
                    Some(
                        r#"{"deadLetterTargetArn":"arn:aws:sqs:us-east-1:1:o-dlq","maxReceiveCount":4}"#,
                    ),
                ),
                vec![REDRIVE_POLICY],
            ),
            (
                live(Some("1"), None),
                vec![VISIBILITY_TIMEOUT, REDRIVE_POLICY],
            ),
        ];
        for (l, changed) in rows {
            let got: Vec<&str> = diff(&want, &l).iter().map(|c| c.attribute).collect();
            assert_eq!(got, changed, "{l:?}");
        }
        // A queue without redrive that has one gets it removed.
        let plain = QueueSpec {
            redrive: None,
            ..want.clone()
        };
        let d = diff(&plain, &live(Some("30"), Some(good)));
        assert_eq!(d.len(), 1);
        assert_eq!(
            d[0].to_string(),
            "RedrivePolicy is {dead-letter queue o-dlq, maxReceiveCount 5}, want unset"
        );
    }
}
