//! The counter arithmetic of the ledger, counter by counter over a [`ConsumerStats`]: sums,
//! maxima, growth, a lost source's offset made whole (I1), a folded life's credit absorbed, and
//! the stable key of a broker's message id.
//!
//! Pure: it must not know what a report or a source is (that is [`super::Account`]).

use settle::api::{ConsumerStats, Mode, Settlement};

/// `s` with its identity made whole by raising the short side: more outcomes than offers raise
/// offered; more offers than outcomes (attempts in flight when status was written, whose end was
/// lost with the source) count given up, Released (Lost under AtMostOnce), as a dead instance's
/// do (C16). Nothing goes down.
pub(super) fn balance(s: &ConsumerStats, mode: Mode) -> ConsumerStats {
    let mut s = *s;
    let ended = s
        .delivered
        .saturating_add(s.released)
        .saturating_add(s.lost);
    if ended > s.offered {
        s.offered = ended;
    } else if s.offered > ended {
        let gap = s.offered - ended;
        if mode == Mode::AtMostOnce {
            s.lost = s.lost.saturating_add(gap);
        } else {
            s.released = s.released.saturating_add(gap);
        }
    }
    s
}

/// Takes up to `credit` attempts out of what a folded life's growth says ended (delivered, then
/// released, then lost): those were counted given up at the fold. Returns the credit left.
pub(super) fn absorb(grown: &mut ConsumerStats, credit: u64) -> u64 {
    let mut left = credit;
    for n in [&mut grown.delivered, &mut grown.released, &mut grown.lost] {
        let take = left.min(*n);
        *n -= take;
        left -= take;
    }
    left
}

/// Applies `f` to every counter pair.
fn zip(a: &ConsumerStats, b: &ConsumerStats, f: impl Fn(u64, u64) -> u64) -> ConsumerStats {
    ConsumerStats {
        offered: f(a.offered, b.offered),
        delivered: f(a.delivered, b.delivered),
        released: f(a.released, b.released),
        lost: f(a.lost, b.lost),
        settlement: Settlement {
            acked: f(a.settlement.acked, b.settlement.acked),
            nacked: f(a.settlement.nacked, b.settlement.nacked),
            silent: f(a.settlement.silent, b.settlement.silent),
            refused: f(a.settlement.refused, b.settlement.refused),
        },
        exhausted: f(a.exhausted, b.exhausted),
        stranded: f(a.stranded, b.stranded),
        lease_expired: f(a.lease_expired, b.lease_expired),
        delay_shortened: f(a.delay_shortened, b.delay_shortened),
        foreign_conflicts: f(a.foreign_conflicts, b.foreign_conflicts),
    }
}

pub(super) fn add(a: &ConsumerStats, b: &ConsumerStats) -> ConsumerStats {
    zip(a, b, u64::saturating_add)
}

pub(super) fn max(a: &ConsumerStats, b: &ConsumerStats) -> ConsumerStats {
    zip(a, b, u64::max)
}

/// How much `to` grew past `from`, per counter (zero where it did not).
pub(super) fn growth(from: &ConsumerStats, to: &ConsumerStats) -> ConsumerStats {
    zip(to, from, u64::saturating_sub)
}

/// A broker's message id as the ledger remembers it: FNV-1a over its bytes, stable across
/// operator versions and restarts (the ledger is persisted), unlike `std`'s hasher.
pub fn message_key(id: &str) -> u64 {
    id.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Every counter of `a` is at least that of `b`.
pub fn dominates(a: &ConsumerStats, b: &ConsumerStats) -> bool {
    max(a, b) == *a
}
