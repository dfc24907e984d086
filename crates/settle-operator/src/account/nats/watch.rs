//! Whether a session's report watch keeps up with the report bucket. The watch is a push
//! consumer the broker feeds; made while a cluster node is down or paused, it can be left
//! sending its idle heartbeats and nothing else (seen on a three-node cluster after a server
//! was killed or paused: the client library then neither errors nor makes it again). Every
//! store check compares the newest revision the watch delivered with the bucket's last
//! sequence; a watch that delivered nothing for [`WATCH_STALL`] while the bucket held a newer
//! report (read back to be sure it is there) is stalled, and the session starts again with a
//! new watch (reports are cumulative: reading them again counts nothing twice). So does a
//! bucket that is not the one the watch was opened on (deleted on the broker and made again,
//! by the runtime or another keeper): its revisions start over below what the watch delivered,
//! so the watch would wait for revisions the new bucket may not reach for a long time, and
//! the new session finds what the deletion lost (semantics C17).
//!
//! [`Hearing`] looks, every quarter of `--fold-after`, whether the keeper could hear: its client
//! connected, the bucket answering (on a cluster its stream can be without a leader while the
//! keeper's own client stays connected, and no report can be written then), and the watch
//! having delivered every report the bucket held at the look before. While the last look says
//! it could not, the keeper is deaf (silence then is no sign that an instance died, semantics
//! C16) and folds nothing.
//!
//! It must not count reports nor read the bucket beyond its tail and the one revision it
//! confirms.

use std::time::{Duration, Instant};

use async_nats::jetstream::kv;
use async_nats::jetstream::stream::Stream;
use time::OffsetDateTime;

use super::{NatsKeeper, broken};
use settle::backend::nats::admin::NatsError;

impl NatsKeeper {
    /// One look at the bucket's tail, for `hearing` (see [`Hearing`]).
    pub(super) async fn look(&self, reports: &kv::Store, hearing: &mut Hearing) {
        let tail = match tokio::time::timeout(LOOK_TIMEOUT, reports.stream.get_info()).await {
            Ok(Ok(info)) => Some(info.state.last_sequence),
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "cannot read the report bucket's tail: deaf until it answers");
                None
            }
            Err(_) => None,
        };
        hearing.look(tail, Instant::now());
    }

    /// One check of the watch against the bucket's `stream` as just read: an error (the
    /// session starts again) when the bucket is not the one the watch was opened on (`made`
    /// then: deleted on the broker and made again, its revisions starting over below what the
    /// watch delivered), or when the watch delivered nothing past `watched` for
    /// [`WATCH_STALL`] while a newer report is stored.
    pub(super) async fn watch_keeps_up(
        &self,
        stream: Option<Stream>,
        (watched, made): (u64, OffsetDateTime),
        progress: &mut WatchProgress,
    ) -> Result<(), NatsError> {
        let Some(mut stream) = stream else {
            return Ok(());
        };
        if stream.cached_info().created != made {
            self.metrics.watch_stalls.inc();
            tracing::warn!(
                backend = %format!("{}/{}", self.backend.0, self.backend.1),
                watched,
                "the report bucket was made again since the watch was opened (deleted on the broker?): watching it afresh"
            );
            return Err(broken(
                "the report watch",
                "the report bucket was made again since it was opened",
            ));
        }
        let state = &stream.cached_info().state;
        let tail = (state.messages > 0).then_some(state.last_sequence);
        let Some(mut missed) = progress.check(watched, tail, Instant::now()) else {
            return Ok(());
        };
        // Read back: a busy key's report may have been replaced since the info was read, by a
        // newer one the watch owes as well.
        let mut stored = stream.get_raw_message(missed).await.is_ok();
        if !stored
            && let Ok(info) = stream.info().await
            && info.state.messages > 0
            && info.state.last_sequence > watched
        {
            missed = info.state.last_sequence;
            stored = stream.get_raw_message(missed).await.is_ok();
        }
        if !stored {
            progress.forget();
            return Ok(());
        }
        self.metrics.watch_stalls.inc();
        tracing::warn!(
            backend = %format!("{}/{}", self.backend.0, self.backend.1),
            watched,
            stored = missed,
            "the report watch delivered nothing for {}s while the bucket holds a newer report: watching again",
            WATCH_STALL.as_secs()
        );
        Err(broken(
            "the report watch",
            format!("stalled at revision {watched} while the bucket holds {missed}"),
        ))
    }
}

/// How long a look at the bucket's tail may take: one without an answer by then is deafness.
const LOOK_TIMEOUT: Duration = Duration::from_secs(1);
/// The longest time between two looks, whatever `--fold-after` is.
const LOOK_AT_MOST_EVERY: Duration = Duration::from_secs(30);

/// What the last look found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Heard {
    /// The watch had delivered everything the bucket held at the look before: folds may go on.
    All,
    /// No look before to compare with (the first, or the first after the bucket answered
    /// again): no fold until the next.
    NotYet,
    /// The bucket did not answer, the watch had not delivered what it held at the look before,
    /// or the client was not connected: the keeper was deaf.
    Deaf,
}

/// What a session's report watch has delivered, and the looks at the bucket's tail. A look is
/// taken every quarter of `--fold-after` (at most every 30 s): a deafness long enough to make
/// a live instance look silent for `--fold-after` lasts longer than that (the instance reported
/// within its interval before it), so a look lands in it, and the instance's silence is
/// counted from that look on.
#[derive(Debug, Default)]
pub(super) struct Hearing {
    /// The newest revision the watch delivered (0: none yet).
    pub(super) watched: u64,
    /// The bucket's history is replayed: the watch said it has seen the current values, or
    /// the bucket was empty.
    pub(super) replayed: bool,
    /// The bucket's last sequence (0: empty) at the last look that had an answer.
    tail: Option<u64>,
    /// What the last look found, and when.
    last: Option<(Heard, Instant)>,
}

impl Hearing {
    /// How long between looks, for `fold_after`.
    pub(super) fn every(fold_after: Duration) -> Duration {
        (fold_after / 4).min(LOOK_AT_MOST_EVERY)
    }

    /// Whether a look is due at `now`.
    pub(super) fn due(&self, now: Instant, every: Duration) -> bool {
        self.last
            .is_none_or(|(_, at)| now.saturating_duration_since(at) >= every)
    }

    /// What the last look found (`NotYet` before the first).
    pub(super) fn verdict(&self) -> Heard {
        self.last.map_or(Heard::NotYet, |(h, _)| h)
    }

    /// The client was found not connected at `now`: deaf, and the next look starts afresh.
    pub(super) fn disconnected(&mut self, now: Instant) {
        self.tail = None;
        self.last = Some((Heard::Deaf, now));
    }

    /// One look: the bucket's tail read at `now` (`None`: it did not answer).
    pub(super) fn look(&mut self, tail: Option<u64>, now: Instant) -> Heard {
        let heard = match (tail, self.tail) {
            (None, _) => Heard::Deaf,
            (Some(_), None) => Heard::NotYet,
            (Some(_), Some(held)) if self.watched >= held => Heard::All,
            (Some(_), Some(_)) => Heard::Deaf,
        };
        self.tail = tail;
        self.last = Some((heard, now));
        heard
    }
}

/// How long a watch may deliver nothing while the bucket holds a newer revision: longer than
/// the library's own recovery (a consumer made again after two missed heartbeats of 5 s), and
/// than a replay that is merely slow (it delivers, so the window starts again).
pub(super) const WATCH_STALL: Duration = Duration::from_secs(20);

/// The watch's progress at the first check that found it behind.
#[derive(Debug, Default)]
pub(super) struct WatchProgress {
    behind: Option<Behind>,
}

#[derive(Debug, Clone, Copy)]
struct Behind {
    since: Instant,
    watched: u64,
}

impl WatchProgress {
    /// One check: `watched` is the newest revision the watch delivered (0: none yet), `tail`
    /// the bucket's last sequence (None: the bucket holds nothing). When the watch delivered
    /// nothing for [`WATCH_STALL`] while the bucket held a newer revision, returns the newest
    /// (the session confirms it is stored), else None.
    pub(super) fn check(&mut self, watched: u64, tail: Option<u64>, now: Instant) -> Option<u64> {
        let Some(tail) = tail.filter(|&t| t > watched) else {
            self.behind = None;
            return None;
        };
        match self.behind {
            // The newest revision now, not the one of the window's start: a busy key's report
            // is replaced every interval, and any revision past `watched` is one it owes.
            Some(b) if b.watched == watched => {
                (now.duration_since(b.since) >= WATCH_STALL).then_some(tail)
            }
            // Behind for the first time, or it delivered since: the window starts now.
            _ => {
                self.behind = Some(Behind {
                    since: now,
                    watched,
                });
                None
            }
        }
    }

    /// The revision named by the last [`WatchProgress::check`] could not be read back (gone,
    /// or the broker did not answer): no judgement is made from it, the window starts again.
    pub(super) fn forget(&mut self) {
        self.behind = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_watch_that_delivers_nothing_past_a_stored_revision_is_stalled_after_the_window() {
        let t0 = Instant::now();
        let mut p = WatchProgress::default();
        assert_eq!(p.check(10, Some(12), t0), None, "first seen behind");
        assert_eq!(p.check(10, Some(14), t0 + Duration::from_secs(10)), None);
        assert_eq!(
            p.check(10, Some(15), t0 + WATCH_STALL),
            Some(15),
            "nothing delivered for the whole window: the newest revision it owes"
        );
    }

    #[test]
    fn a_watch_that_delivers_or_catches_up_is_never_stalled() {
        let t0 = Instant::now();
        let mut p = WatchProgress::default();
        assert_eq!(p.check(10, Some(40), t0), None);
        // A slow replay: it delivers, so the window starts again.
        assert_eq!(p.check(20, Some(40), t0 + WATCH_STALL), None);
        assert_eq!(p.check(30, Some(40), t0 + WATCH_STALL * 2), None);
        // Caught up, then an empty bucket, then behind again: a new window.
        assert_eq!(p.check(40, Some(40), t0 + WATCH_STALL * 3), None);
        assert_eq!(p.check(40, None, t0 + WATCH_STALL * 4), None);
        assert_eq!(p.check(40, Some(41), t0 + WATCH_STALL * 5), None);
        assert_eq!(
            p.check(40, Some(41), t0 + WATCH_STALL * 6),
            Some(41),
            "behind a whole window since it was last caught up"
        );
    }

    #[test]
    fn a_fold_waits_until_the_watch_delivered_what_the_bucket_held_at_the_look_before() {
        let t0 = Instant::now();
        let every = Hearing::every(Duration::from_secs(5));
        assert_eq!(every, Duration::from_millis(1250));
        assert_eq!(
            Hearing::every(Duration::from_secs(3600)),
            LOOK_AT_MOST_EVERY
        );
        let mut h = Hearing::default();
        assert!(h.due(t0, every));
        assert_eq!(h.verdict(), Heard::NotYet);
        assert_eq!(
            h.look(Some(10), t0),
            Heard::NotYet,
            "nothing to compare with"
        );
        assert!(!h.due(t0 + every / 2, every));
        assert!(h.due(t0 + every, every));
        h.watched = 10;
        // Reports keep coming (the tail moves on): what was held at the look before counts.
        assert_eq!(h.look(Some(12), t0 + every), Heard::All);
        assert_eq!(
            h.look(Some(15), t0 + every * 2),
            Heard::Deaf,
            "12 was stored a look ago and not delivered"
        );
        assert_eq!(h.verdict(), Heard::Deaf);
        h.watched = 15;
        assert_eq!(h.look(Some(15), t0 + every * 3), Heard::All);
        assert_eq!(h.look(None, t0 + every * 4), Heard::Deaf, "no answer");
        assert_eq!(
            h.look(Some(15), t0 + every * 5),
            Heard::NotYet,
            "answering again: compared from this look on"
        );
        assert_eq!(h.look(Some(15), t0 + every * 6), Heard::All);
        h.disconnected(t0 + every * 7);
        assert_eq!(h.verdict(), Heard::Deaf);
        assert_eq!(h.look(Some(15), t0 + every * 8), Heard::NotYet);
    }

    #[test]
    fn a_revision_gone_from_the_bucket_starts_the_window_again() {
        let t0 = Instant::now();
        let mut p = WatchProgress::default();
        p.check(5, Some(9), t0);
        assert_eq!(p.check(5, Some(9), t0 + WATCH_STALL), Some(9));
        p.forget();
        assert_eq!(p.check(5, Some(9), t0 + WATCH_STALL), None);
        assert_eq!(p.check(5, Some(9), t0 + WATCH_STALL * 2), Some(9));
    }
}
