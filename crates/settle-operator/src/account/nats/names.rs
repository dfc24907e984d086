//! The names a NATS keeper keeps things under: a Subscription's key in the ledger bucket, and
//! the Backend's durable reader of the advisory capture (one per Backend, never two alike, and
//! the legacy name it takes over on upgrade).
//!
//! Pure: it must not talk to the broker.

use super::SubKey;
use settle::bus::report::report_key;

/// A Subscription's key in the ledger bucket.
pub(super) fn ledger_key(key: &SubKey) -> String {
    report_key(&key.0, &key.1, "ledger")
}

/// The longest name the keeper gives a durable reader (NATS allows 255 characters; the name is
/// also a directory on the server's disk).
const MAX_READER_NAME: usize = 255;

/// The durable reader of Backend `namespace/backend` in the capture: one name per Backend,
/// never two Backends' alike. A namespace is a DNS label (`a-z 0-9 -`), so the first `_` ends
/// it; a Backend's name is a DNS subdomain whose dots (which a NATS name may not hold) become
/// `_`, never two in a row (a subdomain has no empty label). A name too long for NATS keeps
/// the namespace and replaces the Backend's name by `__` and a hash of it, which no Backend
/// name can spell (`__`).
pub fn reader_name(namespace: &str, backend: &str) -> String {
    // Anything a NATS name may not hold (never in a Kubernetes name) is mapped as dots are.
    let clean = |s: &str| s.replace(['.', '*', '>', ' ', '/', '\\'], "_");
    let name = format!("settle-account_{}_{}", clean(namespace), clean(backend));
    if name.len() <= MAX_READER_NAME {
        return name;
    }
    format!(
        "settle-account_{}__{:016x}",
        clean(namespace),
        fnv1a(format!("{namespace}/{backend}").as_bytes())
    )
}

/// The reader's name before names were unambiguous (`team`/`a-nats` and `team-a`/`nats` gave
/// the same one): read once on upgrade, to start the new reader where it stopped.
pub fn legacy_reader_name(namespace: &str, backend: &str) -> String {
    let clean = |s: &str| s.replace(['.', '*', '>', ' '], "_");
    format!("settle-account-{}-{}", clean(namespace), clean(backend))
}

/// FNV-1a, 64 bits: a stable hash (the name must be the same in every operator version).
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}

#[cfg(test)]
mod reader_tests {
    use super::*;

    #[test]
    fn two_backends_whose_legacy_reader_names_met_get_distinct_readers() {
        // The two pairs the legacy name could not tell apart, and one with dots.
        assert_eq!(
            legacy_reader_name("team", "a-nats"),
            legacy_reader_name("team-a", "nats")
        );
        assert_ne!(reader_name("team", "a-nats"), reader_name("team-a", "nats"));
        assert_eq!(reader_name("team-a", "nats"), "settle-account_team-a_nats");
        assert_ne!(reader_name("team", "a.nats"), reader_name("team", "a-nats"));
        assert_ne!(
            reader_name("team-a", "b.nats"),
            reader_name("team", "a-b.nats")
        );
    }

    #[test]
    fn a_reader_name_fits_nats_whatever_the_backend_name() {
        let long = format!("{}.{}", "b".repeat(200), "c".repeat(52));
        let other = format!("{}.{}", "b".repeat(200), "d".repeat(52));
        let ns = "n".repeat(63);
        for backend in [long.as_str(), other.as_str(), "nats", "a.b.c"] {
            let name = reader_name(&ns, backend);
            assert!(name.len() <= MAX_READER_NAME, "{name}");
            assert!(
                !name.contains(['.', '*', '>', ' ', '/', '\\']),
                "{name} is not a NATS name"
            );
        }
        assert_ne!(reader_name(&ns, &long), reader_name(&ns, &other));
        // The hashed form cannot be any short name's: no Backend name maps to `__`.
        assert!(reader_name(&ns, &long).contains("__"));
        assert!(!reader_name(&ns, "a.b.c").contains("__"));
    }
}
