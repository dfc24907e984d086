//! Whether a session's report watch keeps up with the report bucket. The watch is a push
//! consumer the broker feeds; made while a cluster node is down or paused, it can be left
//! sending its idle heartbeats and nothing else (seen on a three-node cluster after a server
//! was killed or paused: the client library then neither errors nor makes it again). Every
//! store check compares the newest revision the watch delivered with the bucket's last
//! sequence; a watch that delivered nothing for [`WATCH_STALL`] while the bucket held a newer
//! report (read back to be sure it is there) is stalled, and the session starts again with a
//! new watch (reports are cumulative: reading them again counts nothing twice).
//!
//! It must not count reports nor read the bucket beyond the one revision it confirms.

use std::time::{Duration, Instant};

use async_nats::jetstream::stream::Stream;

use super::{NatsKeeper, broken};
use settle::backend::nats::admin::NatsError;

impl NatsKeeper {
    /// One check of the watch against the bucket's `stream` as just read: an error (the
    /// session starts again) when the watch delivered nothing past `watched` for
    /// [`WATCH_STALL`] while a newer report is stored.
    pub(super) async fn watch_keeps_up(
        &self,
        stream: Option<Stream>,
        watched: u64,
        progress: &mut WatchProgress,
    ) -> Result<(), NatsError> {
        let Some(mut stream) = stream else {
            return Ok(());
        };
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
