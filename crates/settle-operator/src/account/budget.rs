//! The cluster-wide status budget of the account: which waiting status patch goes out next, and
//! when one may. A [`Queue`] holds at most one patch per Subscription (the newest: a newer one
//! replaces the waiting one, as it carries the whole account), urgent ones (a loss, a
//! condition flipping) before the rest but never more than [`URGENT_RUN`] in a row while
//! others wait; within each class the namespaces take turns (one patch of each namespace that
//! has one waiting, in the order they first waited), and a namespace's patches go in the order
//! they first waited; a [`Bucket`] gives out `--status-writes-per-second` tokens with a small
//! burst. So however many Subscriptions one namespace makes urgent, another namespace's patch
//! waits for at most one of each other namespace's per turn, not for all of them.
//!
//! Pure: no I/O, and time comes in as an argument (Tokio's `Instant`, so tests run it on the
//! paused clock). It must not decide whether a patch is urgent (the keepers' `show` does, from
//! what the Subscription shows) nor look inside a patch.

use std::collections::{HashMap, HashSet, VecDeque};
use std::hash::Hash;
use std::time::Duration;

use tokio::time::Instant;

/// One waiting patch.
struct Waiting<V> {
    body: V,
    urgent: bool,
    /// When the Subscription's first waiting patch arrived (kept when a newer replaces it).
    since: Instant,
}

/// What became of a patch handed to [`Queue::push`].
#[derive(Debug, PartialEq, Eq)]
pub enum Pushed {
    /// The Subscription had nothing waiting: it joins the end of its class.
    Queued,
    /// It replaced the Subscription's waiting patch, which will never be sent (the newer one
    /// carries everything it did); the place in line is kept, or moved ahead if now urgent.
    Coalesced,
}

/// Urgent patches written in a row at most while other patches wait: then one other goes, so
/// the others get at least a quarter of the budget however many Subscriptions are urgent (200
/// losing messages at once had stopped every other status, `/lag` with it).
pub const URGENT_RUN: u32 = 3;

/// What a key takes turns by: a Subscription's namespace.
pub trait Turns {
    type Group: Clone + Eq + Hash;
    fn group(&self) -> Self::Group;
}

impl Turns for (String, String) {
    type Group = String;
    fn group(&self) -> String {
        self.0.clone()
    }
}

/// Test keys: `"ns/name"` takes turns as `ns`; a key without `/` is in one group with the others.
#[cfg(test)]
impl Turns for &'static str {
    type Group = &'static str;
    fn group(&self) -> &'static str {
        self.split_once('/').map_or("", |(g, _)| g)
    }
}

/// Test keys in one group.
#[cfg(test)]
impl Turns for usize {
    type Group = u8;
    fn group(&self) -> u8 {
        0
    }
}

/// Test keys in one group.
#[cfg(test)]
impl Turns for String {
    type Group = u8;
    fn group(&self) -> u8 {
        0
    }
}

/// One class's waiting keys: the groups in turn, each group's keys in the order they came.
struct Line<K: Turns> {
    groups: HashMap<K::Group, VecDeque<K>>,
    turns: VecDeque<K::Group>,
}

impl<K: Turns> Default for Line<K> {
    fn default() -> Self {
        Line {
            groups: HashMap::new(),
            turns: VecDeque::new(),
        }
    }
}

impl<K: Turns + Clone + Eq + Hash> Line<K> {
    fn push_back(&mut self, key: K) {
        let g = key.group();
        let keys = self.groups.entry(g.clone()).or_default();
        if keys.is_empty() {
            self.turns.push_back(g);
        }
        keys.push_back(key);
    }

    fn remove(&mut self, key: &K) {
        let g = key.group();
        let Some(keys) = self.groups.get_mut(&g) else {
            return;
        };
        if let Some(i) = keys.iter().position(|k| k == key) {
            keys.remove(i);
        }
        if keys.is_empty() {
            self.groups.remove(&g);
            self.turns.retain(|t| *t != g);
        }
    }

    /// Whether a key not in `busy` waits.
    fn any(&self, busy: &HashSet<K>) -> bool {
        // At most the writes in flight are skipped (a handful).
        self.groups
            .values()
            .any(|keys| keys.iter().any(|k| !busy.contains(k)))
    }

    /// The first key not in `busy` of the first group in turn that has one; that group then goes
    /// to the back of the turns.
    fn pop(&mut self, busy: &HashSet<K>) -> Option<K> {
        let (turn, i) = self.turns.iter().enumerate().find_map(|(t, g)| {
            let keys = self.groups.get(g)?;
            keys.iter().position(|k| !busy.contains(k)).map(|i| (t, i))
        })?;
        let g = self.turns.remove(turn)?;
        let keys = self.groups.get_mut(&g)?;
        let key = keys.remove(i)?;
        if keys.is_empty() {
            self.groups.remove(&g);
        } else {
            self.turns.push_back(g);
        }
        Some(key)
    }

    fn give_back(&mut self, room: usize) {
        if self.groups.capacity() > room {
            self.groups.shrink_to(room);
        }
        if self.turns.capacity() > room {
            self.turns.shrink_to(room);
        }
    }

    #[cfg(test)]
    fn room(&self) -> usize {
        self.groups.capacity()
            + self.turns.capacity()
            + self.groups.values().map(VecDeque::capacity).sum::<usize>()
    }
}

/// The patches waiting to be written, at most one per key, and the keys being written now.
pub struct Queue<K: Turns, V> {
    waiting: HashMap<K, Waiting<V>>,
    urgent: Line<K>,
    normal: Line<K>,
    busy: HashSet<K>,
    /// Urgent patches popped since the last other one.
    run: u32,
}

impl<K: Turns + Clone + Eq + Hash, V> Default for Queue<K, V> {
    fn default() -> Self {
        Queue {
            waiting: HashMap::new(),
            urgent: Line::default(),
            normal: Line::default(),
            busy: HashSet::new(),
            run: 0,
        }
    }
}

impl<K: Turns + Clone + Eq + Hash, V> Queue<K, V> {
    /// Takes the newest patch for `key`. An urgent patch, or one replacing an urgent one, is
    /// urgent (what made the older one urgent is in the newer one too: counters never go back).
    pub fn push(&mut self, key: K, body: V, urgent: bool, now: Instant) -> Pushed {
        match self.waiting.get_mut(&key) {
            Some(w) => {
                w.body = body;
                if urgent && !w.urgent {
                    w.urgent = true;
                    self.normal.remove(&key);
                    self.urgent.push_back(key);
                }
                Pushed::Coalesced
            }
            None => {
                self.waiting.insert(
                    key.clone(),
                    Waiting {
                        body,
                        urgent,
                        since: now,
                    },
                );
                if urgent {
                    self.urgent.push_back(key);
                } else {
                    self.normal.push_back(key);
                }
                Pushed::Queued
            }
        }
    }

    /// Whether a patch could start now (one waits whose key is not being written).
    pub fn ready(&self) -> bool {
        self.urgent.any(&self.busy) || self.normal.any(&self.busy)
    }

    /// The next patch to write: an urgent one, else another one, whose key is not being
    /// written (one write at a time per Subscription, so an older patch is never applied after a
    /// newer one), of the namespace whose turn it is in its class; after [`URGENT_RUN`] urgent
    /// ones in a row, another one if one waits. Its key is busy until [`Queue::done`]. Returns
    /// the key, the patch, whether it was urgent and when its Subscription started waiting.
    pub fn pop(&mut self) -> Option<(K, V, bool, Instant)> {
        let (urgent, normal) = (self.urgent.any(&self.busy), self.normal.any(&self.busy));
        let key = match (urgent, normal) {
            (true, false) => {
                self.run = self.run.saturating_add(1);
                self.urgent.pop(&self.busy)?
            }
            (true, true) if self.run < URGENT_RUN => {
                self.run += 1;
                self.urgent.pop(&self.busy)?
            }
            (_, true) => {
                self.run = 0;
                self.normal.pop(&self.busy)?
            }
            (false, false) => return None,
        };
        let w = self.waiting.remove(&key)?;
        self.busy.insert(key.clone());
        if self.waiting.is_empty() {
            self.give_back();
        }
        Some((key, w.body, w.urgent, w.since))
    }

    /// The write of `key` ended: its next patch may start.
    pub fn done(&mut self, key: &K) {
        self.busy.remove(key);
    }

    /// Room for the queue at rest. A mass apply queues every Subscription at once, and a map
    /// or line keeps the room it grew to: at 3,000 Subscriptions, 420 KiB of heap held at rest
    /// for nothing. Once the backlog is gone (the `pop` that empties it), room past this is
    /// given back; every map and line grows only by `push` or `pop`, so none is missed.
    const ROOM_AT_REST: usize = 64;

    fn give_back(&mut self) {
        if self.waiting.capacity() > Self::ROOM_AT_REST {
            self.waiting.shrink_to(Self::ROOM_AT_REST);
        }
        for line in [&mut self.urgent, &mut self.normal] {
            line.give_back(Self::ROOM_AT_REST);
        }
        if self.busy.capacity() > Self::ROOM_AT_REST {
            self.busy.shrink_to(Self::ROOM_AT_REST);
        }
    }

    /// The room the queue holds now, in entries (its maps' and lines' capacities).
    #[cfg(test)]
    fn room(&self) -> usize {
        self.waiting.capacity() + self.urgent.room() + self.normal.room() + self.busy.capacity()
    }

    /// Subscriptions whose patch waits (`settle_account_status_backlog`).
    pub fn backlog(&self) -> usize {
        self.waiting.len()
    }
}

/// A token bucket: `rate` tokens a second, at most `burst` saved up.
#[derive(Debug)]
pub struct Bucket {
    rate: f64,
    burst: f64,
    tokens: f64,
    at: Instant,
}

impl Bucket {
    /// A full bucket for `per_second` writes a second (at least 1), with a burst of a fifth of
    /// a second's worth, between 1 and 10: enough for a few urgent writes at once, small enough
    /// that no second writes much past the rate.
    pub fn new(per_second: u32, now: Instant) -> Bucket {
        let rate = f64::from(per_second.max(1));
        let burst = (rate / 5.0).clamp(1.0, 10.0).floor();
        Bucket {
            rate,
            burst,
            tokens: burst,
            at: now,
        }
    }

    /// The burst: how many writes may go at once after a quiet time.
    pub fn burst(&self) -> u32 {
        // At most 10 (see `new`).
        self.burst as u32
    }

    /// Takes a token if there is one; else says how long until there is.
    pub fn take(&mut self, now: Instant) -> Result<(), Duration> {
        let elapsed = now.saturating_duration_since(self.at).as_secs_f64();
        self.tokens = (self.tokens + elapsed * self.rate).min(self.burst);
        self.at = now;
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            Ok(())
        } else {
            // Rounded up to the millisecond, so the wake-up finds the token there.
            let ms = ((1.0 - self.tokens) / self.rate * 1000.0).ceil().max(1.0);
            Err(Duration::from_millis(ms as u64))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drain(q: &mut Queue<&'static str, u32>) -> Vec<(&'static str, u32)> {
        let mut out = Vec::new();
        while let Some((k, v, _, _)) = q.pop() {
            q.done(&k);
            out.push((k, v));
        }
        out
    }

    #[tokio::test(start_paused = true)]
    async fn urgent_patches_go_before_every_other_waiting_one() {
        let now = Instant::now();
        let mut q = Queue::default();
        for (k, v) in [("a", 1), ("b", 1), ("c", 1)] {
            q.push(k, v, false, now);
        }
        q.push("loss", 1, true, now);
        q.push("d", 1, false, now);
        q.push("flip", 1, true, now);
        assert_eq!(q.backlog(), 6);
        assert_eq!(
            drain(&mut q),
            [
                ("loss", 1),
                ("flip", 1),
                ("a", 1),
                ("b", 1),
                ("c", 1),
                ("d", 1)
            ]
        );
        assert_eq!(q.backlog(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn namespaces_take_turns_so_one_namespaces_many_urgent_patches_hold_no_other_back() {
        let now = Instant::now();
        let mut q = Queue::default();
        let big: Vec<&'static str> = (0..100)
            .map(|i| &*Box::leak(format!("big/{i}").into_boxed_str()))
            .collect();
        for k in &big {
            q.push(*k, 1, true, now);
        }
        q.push("small/x", 1, true, now);
        q.push("other/y", 1, true, now);
        q.push("small/z", 1, false, now);
        let order: Vec<&str> = drain(&mut q).into_iter().map(|(k, _)| k).collect();
        // Urgent: big, small, other in turn (each in the order it first waited), then big's
        // others; after three urgent ones in a row the waiting normal one goes.
        assert_eq!(
            &order[..5],
            ["big/0", "small/x", "other/y", "small/z", "big/1"]
        );
        assert_eq!(order.len(), 103);
        // Within a namespace, the order they first waited.
        let bigs: Vec<&str> = order
            .iter()
            .copied()
            .filter(|k| k.starts_with("big/"))
            .collect();
        assert_eq!(bigs, big);
    }

    #[tokio::test(start_paused = true)]
    async fn a_newer_patch_replaces_the_waiting_one_and_keeps_its_place() {
        let now = Instant::now();
        let mut q = Queue::default();
        assert_eq!(q.push("a", 1, false, now), Pushed::Queued);
        assert_eq!(q.push("b", 1, false, now), Pushed::Queued);
        assert_eq!(q.push("a", 2, false, now), Pushed::Coalesced);
        assert_eq!(q.push("a", 3, false, now), Pushed::Coalesced);
        assert_eq!(q.backlog(), 2);
        // FIFO by first wait: coalescing does not send a busy Subscription to the back, nor
        // let it overtake the ones that waited before it.
        assert_eq!(drain(&mut q), [("a", 3), ("b", 1)]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_patch_replacing_an_urgent_one_stays_urgent_and_an_upgrade_moves_ahead() {
        let now = Instant::now();
        let mut q = Queue::default();
        q.push("a", 1, false, now);
        q.push("b", 1, true, now);
        q.push("c", 1, false, now);
        // b's newer patch is not urgent by itself, but carries b's loss: still first.
        q.push("b", 2, false, now);
        // c became urgent: ahead of a, after b (urgent first, in the order they became so).
        q.push("c", 2, true, now);
        let popped: Vec<_> = std::iter::from_fn(|| {
            let p = q.pop();
            if let Some((k, ..)) = &p {
                q.done(k);
            }
            p.map(|(k, v, urgent, _)| (k, v, urgent))
        })
        .collect();
        assert_eq!(popped, [("b", 2, true), ("c", 2, true), ("a", 1, false)]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_subscription_being_written_waits_and_its_newer_patch_is_never_overtaken() {
        let now = Instant::now();
        let mut q = Queue::default();
        q.push("a", 1, true, now);
        q.push("b", 1, false, now);
        let (k, v, ..) = q.pop().expect("a");
        assert_eq!((k, v), ("a", 1));
        // While a's first patch is in flight, a newer urgent one for a waits; b goes first.
        q.push("a", 2, true, now);
        assert!(q.ready());
        let (k, ..) = q.pop().expect("b");
        assert_eq!(k, "b");
        assert!(!q.ready(), "a is still being written");
        assert!(q.pop().is_none());
        q.done(&"a");
        assert_eq!(q.pop().map(|(k, v, ..)| (k, v)), Some(("a", 2)));
    }

    #[tokio::test(start_paused = true)]
    async fn the_waiting_time_is_from_the_first_patch_not_the_newest() {
        let t0 = Instant::now();
        let mut q = Queue::default();
        q.push("a", 1, false, t0);
        tokio::time::advance(Duration::from_secs(3)).await;
        q.push("a", 2, false, Instant::now());
        let (_, v, _, since) = q.pop().expect("a");
        assert_eq!((v, since), (2, t0));
    }

    #[tokio::test(start_paused = true)]
    async fn the_room_a_mass_apply_grew_is_given_back_once_the_backlog_is_written() {
        let now = Instant::now();
        let mut q: Queue<usize, u32> = Queue::default();
        for i in 0..5_000 {
            q.push(i, 1, i % 7 == 0, now);
        }
        assert!(q.room() >= 3 * 5_000, "grown to the backlog: {}", q.room());
        // Two writes in flight when the last patch leaves the line: the room for them stays.
        let (a, ..) = q.pop().expect("first");
        for _ in 1..4_999 {
            let (k, ..) = q.pop().expect("next");
            q.done(&k);
        }
        let (b, ..) = q.pop().expect("last");
        assert_eq!(q.backlog(), 0);
        assert!(
            q.room() <= 4 * 64,
            "given back when the line emptied: {}",
            q.room()
        );
        q.done(&a);
        q.done(&b);
        assert!(q.room() <= 4 * 64, "{}", q.room());
        // And the queue works as before.
        q.push(1, 2, false, now);
        assert_eq!(q.pop().map(|(k, v, ..)| (k, v)), Some((1, 2)));
    }

    #[tokio::test(start_paused = true)]
    async fn the_bucket_gives_its_burst_then_its_rate() {
        let mut b = Bucket::new(20, Instant::now());
        assert_eq!(b.burst(), 4);
        for _ in 0..4 {
            assert_eq!(b.take(Instant::now()), Ok(()));
        }
        assert_eq!(b.take(Instant::now()), Err(Duration::from_millis(50)));
        tokio::time::advance(Duration::from_millis(50)).await;
        assert_eq!(b.take(Instant::now()), Ok(()));
        // A quiet minute saves only the burst.
        tokio::time::advance(Duration::from_secs(60)).await;
        let now = Instant::now();
        let taken = (0..100).filter(|_| b.take(now).is_ok()).count();
        assert_eq!(taken, 4);
        // Small rates have a burst of one.
        assert_eq!(Bucket::new(2, now).burst(), 1);
        assert_eq!(Bucket::new(1000, now).burst(), 10);
    }

    /// The whole schedule on the paused clock: 200 Subscriptions waiting, 5 writes a second,
    /// one loss arriving in the middle. Writes never pass the rate (plus the burst), the loss
    /// goes out at the next token, and every Subscription is written once with its newest patch.
    #[tokio::test(start_paused = true)]
    async fn the_rate_is_honoured_and_a_loss_jumps_a_long_backlog() {
        let start = Instant::now();
        let rate = 5;
        let mut bucket = Bucket::new(rate, start);
        let mut q: Queue<usize, u32> = Queue::default();
        for i in 0..200 {
            q.push(i, 1, false, start);
        }
        let mut sent: Vec<(usize, u32, Instant)> = Vec::new();
        let mut loss_sent = None;
        while q.ready() {
            let now = Instant::now();
            if now.duration_since(start) >= Duration::from_secs(10) && loss_sent.is_none() {
                // Subscription 150 loses a message and 199 moves again while they wait.
                q.push(150, 2, true, now);
                q.push(199, 2, false, now);
                loss_sent = Some(now);
            }
            match bucket.take(now) {
                Ok(()) => {
                    let (k, v, ..) = q.pop().expect("ready");
                    q.done(&k);
                    sent.push((k, v, now));
                }
                Err(wait) => tokio::time::advance(wait).await,
            }
        }
        assert_eq!(sent.len(), 200, "each Subscription written once");
        let mut keys: Vec<_> = sent.iter().map(|(k, ..)| *k).collect();
        keys.sort_unstable();
        assert_eq!(keys, (0..200).collect::<Vec<_>>());
        assert!(sent.iter().any(|s| (s.0, s.1) == (199, 2)));
        // The rate: in any window of w seconds, at most rate * w + burst writes.
        for (i, (_, _, at)) in sent.iter().enumerate() {
            for w in [1u64, 5, 20] {
                let end = *at + Duration::from_secs(w);
                let n = sent[i..].iter().take_while(|s| s.2 < end).count();
                assert!(
                    n as u64 <= u64::from(rate) * w + u64::from(bucket.burst()),
                    "{n} writes in {w} s from write {i}"
                );
            }
        }
        // The whole backlog took about 200 / 5 = 40 s; the loss went out at the next token.
        let last = sent.last().expect("sent").2;
        assert!(last.duration_since(start) >= Duration::from_secs(39));
        let (_, v, at) = sent.iter().find(|s| s.0 == 150).expect("the loss");
        assert_eq!(*v, 2);
        let queued = loss_sent.expect("pushed");
        assert!(at.duration_since(queued) <= Duration::from_millis(200));
    }

    /// 200 Subscriptions losing messages all the time (each urgent again as soon as written)
    /// and 100 others changed once: every other one is written within four turns of its place
    /// in line, as it would be within one with nothing urgent.
    #[tokio::test(start_paused = true)]
    async fn urgent_patches_never_starve_the_others() {
        let now = Instant::now();
        let mut q: Queue<String, u32> = Queue::default();
        for i in 0..200 {
            q.push(format!("losing-{i}"), 0, true, now);
        }
        for i in 0..100 {
            q.push(format!("other-{i:03}"), 0, false, now);
        }
        let mut written = Vec::new();
        for turn in 1..=1_000u32 {
            let (key, _, urgent, _) = q.pop().expect("something waits");
            q.done(&key);
            if urgent {
                // Losing again at once: urgent again.
                q.push(key, turn, true, now);
            } else {
                written.push((key, turn));
            }
        }
        assert_eq!(written.len(), 100, "every other one was written");
        let worst = written
            .iter()
            .enumerate()
            .map(|(place, (_, turn))| f64::from(*turn) / (place + 1) as f64)
            .fold(0.0, f64::max);
        println!("worst turns per place in line while 200 are urgent: {worst}");
        for (place, (key, turn)) in written.iter().enumerate() {
            assert_eq!(
                *key,
                format!("other-{place:03}"),
                "in the order they waited"
            );
            let bound = (URGENT_RUN + 1) * (u32::try_from(place).expect("small") + 1);
            assert!(*turn <= bound, "{key} written at turn {turn}, past {bound}");
        }
    }
}
