//! The Lease record, as a replica reads and writes it: what to do with it ([`decide`]) and the
//! record each write carries ([`take`], [`renew`], [`release`]). Pure: no I/O, no clock of its
//! own (the caller passes `now` and how long the record stood unchanged).

use std::time::Duration;

use k8s_openapi::api::coordination::v1::LeaseSpec;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;

use super::LEASE_DURATION;

/// What a replica should do with the Lease as it reads it now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    /// It is ours: renew it.
    Renew,
    /// It has no holder, or its holder let it expire: take it.
    Take,
    /// Another replica holds it: wait. It may be taken once the record has stood unchanged for
    /// `expires_in` more.
    Wait {
        holder: String,
        expires_in: Duration,
    },
}

/// How long a record written by `spec`'s holder keeps it taken: its `leaseDurationSeconds`, or
/// [`LEASE_DURATION`] when a writer left that out.
pub fn lease_duration(spec: &LeaseSpec) -> Duration {
    match spec.lease_duration_seconds {
        Some(s) => Duration::from_secs(u64::try_from(s).unwrap_or(0)),
        None => LEASE_DURATION,
    }
}

/// The holder named by `spec`, if any (an empty `holderIdentity` is no holder).
pub fn holder(spec: &LeaseSpec) -> Option<&str> {
    spec.holder_identity.as_deref().filter(|h| !h.is_empty())
}

/// The decision for replica `me`, reading `spec`, whose record (resourceVersion) this replica
/// has seen unchanged for `unchanged_for`.
pub fn decide(me: &str, spec: &LeaseSpec, unchanged_for: Duration) -> Decision {
    match holder(spec) {
        None => Decision::Take,
        Some(h) if h == me => Decision::Renew,
        Some(h) => {
            let duration = lease_duration(spec);
            if unchanged_for >= duration {
                Decision::Take
            } else {
                Decision::Wait {
                    holder: h.to_string(),
                    expires_in: duration - unchanged_for,
                }
            }
        }
    }
}

/// The record `me` writes to take the Lease: holder, acquire and renew times; one more transition
/// unless `me` held it already.
pub fn take(me: &str, previous: &LeaseSpec, now: Timestamp) -> LeaseSpec {
    let transitions = previous.lease_transitions.unwrap_or(0);
    let was_mine = holder(previous) == Some(me);
    LeaseSpec {
        holder_identity: Some(me.to_string()),
        acquire_time: Some(MicroTime(now)),
        renew_time: Some(MicroTime(now)),
        lease_duration_seconds: Some(duration_seconds(LEASE_DURATION)),
        lease_transitions: Some(if was_mine {
            transitions
        } else {
            transitions + 1
        }),
        ..previous.clone()
    }
}

/// The record the holder writes to renew: only the renew time and the duration change.
pub fn renew(previous: &LeaseSpec, now: Timestamp) -> LeaseSpec {
    LeaseSpec {
        renew_time: Some(MicroTime(now)),
        lease_duration_seconds: Some(duration_seconds(LEASE_DURATION)),
        ..previous.clone()
    }
}

/// The record the holder writes on shutdown: no holder, so the next reader takes it.
pub fn release(previous: &LeaseSpec) -> LeaseSpec {
    LeaseSpec {
        holder_identity: None,
        acquire_time: None,
        renew_time: None,
        ..previous.clone()
    }
}

fn duration_seconds(d: Duration) -> i32 {
    i32::try_from(d.as_secs()).unwrap_or(i32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn held(holder: Option<&str>, seconds: Option<i32>) -> LeaseSpec {
        LeaseSpec {
            holder_identity: holder.map(str::to_string),
            lease_duration_seconds: seconds,
            ..LeaseSpec::default()
        }
    }

    fn wait(holder: &str, secs: u64) -> Decision {
        Decision::Wait {
            holder: holder.to_string(),
            expires_in: Duration::from_secs(secs),
        }
    }

    #[test]
    fn decisions_for_every_kind_of_record() {
        let s = Duration::from_secs;
        let ms = Duration::from_millis;
        // (what the record says, how long it has stood unchanged, what replica "a" does)
        let cases: Vec<(LeaseSpec, Duration, Decision)> = vec![
            // No holder: free, however fresh.
            (held(None, Some(10)), s(0), Decision::Take),
            (held(None, None), s(0), Decision::Take),
            (held(Some(""), Some(10)), s(0), Decision::Take),
            (LeaseSpec::default(), s(100), Decision::Take),
            // Ours: renew, whatever its age (nobody else may have written it).
            (held(Some("a"), Some(10)), s(0), Decision::Renew),
            (held(Some("a"), Some(10)), s(9), Decision::Renew),
            (held(Some("a"), Some(10)), s(3600), Decision::Renew),
            (held(Some("a"), None), s(0), Decision::Renew),
            (held(Some("a"), Some(0)), s(0), Decision::Renew),
            // Someone else's, fresh: wait for the rest of its duration.
            (held(Some("b"), Some(10)), s(0), wait("b", 10)),
            (held(Some("b"), Some(10)), s(4), wait("b", 6)),
            (
                held(Some("b"), Some(10)),
                ms(9_999),
                Decision::Wait {
                    holder: "b".into(),
                    expires_in: ms(1),
                },
            ),
            (held(Some("b"), Some(15)), s(10), wait("b", 5)),
            (held(Some("b"), Some(3600)), s(60), wait("b", 3540)),
            // Someone else's, expired: exactly at, and past, its duration.
            (held(Some("b"), Some(10)), s(10), Decision::Take),
            (held(Some("b"), Some(10)), s(11), Decision::Take),
            (held(Some("b"), Some(1)), s(1), Decision::Take),
            // A writer that left the duration out: ours applies.
            (held(Some("b"), None), s(9), wait("b", 1)),
            (held(Some("b"), None), LEASE_DURATION, Decision::Take),
            // Zero or negative durations expire at once.
            (held(Some("b"), Some(0)), s(0), Decision::Take),
            (held(Some("b"), Some(-5)), s(0), Decision::Take),
            // Identities compare exactly: a prefix or another case is someone else.
            (held(Some("a-1"), Some(10)), s(0), wait("a-1", 10)),
            (held(Some("A"), Some(10)), s(0), wait("A", 10)),
            (held(Some(" a"), Some(10)), s(0), wait(" a", 10)),
        ];
        for (spec, unchanged_for, want) in cases {
            assert_eq!(
                decide("a", &spec, unchanged_for),
                want,
                "record {spec:?} unchanged for {unchanged_for:?}"
            );
        }
    }

    fn any_spec() -> impl Strategy<Value = LeaseSpec> {
        (
            prop::option::of(prop_oneof![
                Just(String::new()),
                Just("me".to_string()),
                "[a-z]{1,6}"
            ]),
            prop::option::of(-5i32..120),
            prop::option::of(0i32..50),
        )
            .prop_map(|(holder, seconds, transitions)| LeaseSpec {
                holder_identity: holder,
                lease_duration_seconds: seconds,
                lease_transitions: transitions,
                ..LeaseSpec::default()
            })
    }

    proptest! {
        #[test]
        fn another_holders_record_is_never_taken_before_its_duration(
            spec in any_spec(), millis in 0u64..200_000,
        ) {
            let unchanged_for = Duration::from_millis(millis);
            let decision = decide("me", &spec, unchanged_for);
            match holder(&spec) {
                None => prop_assert_eq!(decision, Decision::Take),
                Some("me") => prop_assert_eq!(decision, Decision::Renew),
                Some(other) => {
                    let duration = lease_duration(&spec);
                    if unchanged_for < duration {
                        prop_assert_eq!(decision, Decision::Wait {
                            holder: other.to_string(),
                            expires_in: duration - unchanged_for,
                        });
                    } else {
                        prop_assert_eq!(decision, Decision::Take);
                    }
                }
            }
        }

        #[test]
        fn waiting_longer_never_turns_take_back_into_wait(
            spec in any_spec(), a in 0u64..200_000, b in 0u64..200_000,
        ) {
            let (early, late) = (a.min(b), a.max(b));
            let early = decide("me", &spec, Duration::from_millis(early));
            let late = decide("me", &spec, Duration::from_millis(late));
            if early == Decision::Take {
                prop_assert_eq!(late, Decision::Take);
            }
        }

        #[test]
        fn taking_names_me_and_counts_a_transition_unless_it_was_mine(spec in any_spec()) {
            let now = Timestamp::from_second(1_800_000_000).unwrap();
            let taken = take("me", &spec, now);
            prop_assert_eq!(taken.holder_identity.as_deref(), Some("me"));
            prop_assert_eq!(&taken.acquire_time, &Some(MicroTime(now)));
            prop_assert_eq!(&taken.renew_time, &Some(MicroTime(now)));
            prop_assert_eq!(taken.lease_duration_seconds, Some(10));
            let before = spec.lease_transitions.unwrap_or(0);
            let want = if holder(&spec) == Some("me") { before } else { before + 1 };
            prop_assert_eq!(taken.lease_transitions, Some(want));
            // And the result is ours to renew at once.
            prop_assert_eq!(decide("me", &taken, Duration::ZERO), Decision::Renew);
            prop_assert_eq!(decide("other", &taken, Duration::ZERO), wait("me", 10));
        }

        #[test]
        fn a_released_record_is_free_for_anyone_at_once(spec in any_spec(), who in "[a-z]{1,6}") {
            let released = release(&spec);
            prop_assert_eq!(holder(&released), None);
            prop_assert_eq!(decide(&who, &released, Duration::ZERO), Decision::Take);
            prop_assert_eq!(released.lease_transitions, spec.lease_transitions);
            prop_assert_eq!(released.lease_duration_seconds, spec.lease_duration_seconds);
        }
    }

    #[test]
    fn renewing_moves_only_the_renew_time() {
        let acquired = Timestamp::from_second(1_800_000_000).unwrap();
        let later = Timestamp::from_second(1_800_000_042).unwrap();
        let spec = LeaseSpec {
            holder_identity: Some("me".into()),
            acquire_time: Some(MicroTime(acquired)),
            renew_time: Some(MicroTime(acquired)),
            lease_duration_seconds: Some(10),
            lease_transitions: Some(7),
            preferred_holder: Some("someone".into()),
            strategy: Some("OldestEmulationVersion".into()),
        };
        let renewed = renew(&spec, later);
        assert_eq!(
            renewed,
            LeaseSpec {
                renew_time: Some(MicroTime(later)),
                ..spec.clone()
            }
        );
        // Taking it again while ours keeps the count; from someone else it adds one, and the
        // fields this module does not own survive.
        assert_eq!(take("me", &spec, later).lease_transitions, Some(7));
        let stolen = take("thief", &spec, later);
        assert_eq!(stolen.lease_transitions, Some(8));
        assert_eq!(stolen.preferred_holder.as_deref(), Some("someone"));
        assert_eq!(stolen.strategy.as_deref(), Some("OldestEmulationVersion"));
        // Released: no holder, no times; the count and duration stay.
        let released = release(&spec);
        assert_eq!(
            released,
            LeaseSpec {
                holder_identity: None,
                acquire_time: None,
                renew_time: None,
                ..spec
            }
        );
    }
}
