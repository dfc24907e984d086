//! Reports held for Subscriptions not in the cache yet (applied, and the application reported
//! first): each NATS keeper holds its own in an [`EarlyHold`], charged against one
//! [`EarlyBudget`] for the whole process (`--max-early-report-bytes`, and at most
//! [`EARLY_REPORTS`] reports), so a tenant who multiplies Backends does not multiply what the
//! operator holds. It must not read or count reports (the keepers do).

use std::collections::HashMap;
use std::sync::Mutex;

/// Reports held at most, over every keeper of the process.
pub const EARLY_REPORTS: usize = 10_000;

/// What every keeper of the process holds early, in bytes and reports, against the bounds.
#[derive(Debug)]
pub struct EarlyBudget {
    max_bytes: usize,
    max_reports: usize,
    held: Mutex<(usize, usize)>,
}

impl EarlyBudget {
    pub fn new(max_bytes: usize, max_reports: usize) -> EarlyBudget {
        EarlyBudget {
            max_bytes,
            max_reports,
            held: Mutex::new((0, 0)),
        }
    }

    /// The bytes held now, over every keeper.
    pub fn held_bytes(&self) -> usize {
        self.lock().0
    }

    /// One more report of `bytes`, if the process's budget allows it.
    fn take(&self, bytes: usize) -> bool {
        let mut held = self.lock();
        let fits = held.0.saturating_add(bytes) <= self.max_bytes && held.1 < self.max_reports;
        if fits {
            held.0 += bytes;
            held.1 += 1;
        }
        fits
    }

    /// `reports` reports of `bytes` bytes in all let go.
    fn give_back(&self, bytes: usize, reports: usize) {
        let mut held = self.lock();
        held.0 = held.0.saturating_sub(bytes);
        held.1 = held.1.saturating_sub(reports);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, (usize, usize)> {
        self.held
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// One keeper's early reports by key, each charged to the process's budget until it leaves
/// (taken back to be tried again, or the hold dropped with its session).
pub struct EarlyHold<T> {
    budget: std::sync::Arc<EarlyBudget>,
    held: HashMap<String, (T, usize)>,
}

impl<T> EarlyHold<T> {
    pub fn new(budget: std::sync::Arc<EarlyBudget>) -> EarlyHold<T> {
        EarlyHold {
            budget,
            held: HashMap::new(),
        }
    }

    /// Holds `value` of `bytes` under `key`, in place of the one held there, when the process's
    /// budget allows; `false`: not held (dropped, and the one held there before with it).
    pub fn hold(&mut self, key: String, value: T, bytes: usize) -> bool {
        if let Some((_, old)) = self.held.remove(&key) {
            self.budget.give_back(old, 1);
        }
        if !self.budget.take(bytes) {
            return false;
        }
        self.held.insert(key, (value, bytes));
        true
    }

    /// Every report held, handed back (and its bytes to the budget).
    pub fn take_all(&mut self) -> Vec<T> {
        let (bytes, n) = self
            .held
            .values()
            .fold((0, 0), |(b, n), (_, v)| (b + v, n + 1));
        self.budget.give_back(bytes, n);
        self.held.drain().map(|(_, (value, _))| value).collect()
    }
}

impl<T> Drop for EarlyHold<T> {
    fn drop(&mut self) {
        self.take_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn every_hold_of_the_process_shares_one_budget_and_gives_it_back() {
        let budget = Arc::new(EarlyBudget::new(100, 3));
        let mut a = EarlyHold::new(budget.clone());
        let mut b = EarlyHold::new(budget.clone());
        assert!(a.hold("x".into(), 1, 60));
        assert!(
            !b.hold("y".into(), 2, 50),
            "60 + 50 is past 100, whoever holds it"
        );
        assert!(b.hold("y".into(), 2, 40));
        assert_eq!(budget.held_bytes(), 100);
        // The same key again: in place, its old bytes given back first.
        assert!(a.hold("x".into(), 3, 30));
        assert_eq!(budget.held_bytes(), 70);
        assert!(a.hold("z".into(), 4, 1));
        assert!(!b.hold("w".into(), 5, 1), "three reports at most");
        assert_eq!(a.take_all().len(), 2);
        assert_eq!(budget.held_bytes(), 40);
        drop(b);
        assert_eq!(
            budget.held_bytes(),
            0,
            "a hold dropped with its session gives all back"
        );
        assert!(a.hold("v".into(), 6, 100));
    }
}
