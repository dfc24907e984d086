//! Waiting until a Subscription's counters in status show what a test wants, and until they
//! stay.

use std::time::{Duration, Instant};

use settle::api::ConsumerStats;

use super::base::AccountScene;
use crate::operator::poll;

/// Waits until a scene's status shows `want(stats)`; returns it.
pub async fn wait_for<S: AccountScene>(
    scene: &S,
    what: &str,
    want: impl Fn(&ConsumerStats) -> bool,
) -> ConsumerStats {
    wait_until(what, Duration::from_secs(90), || scene.stats(), want).await
}

/// Waits until `stats()` (a Subscription's counters in status, read anew each time) shows
/// `want`, and returns what it showed.
pub async fn wait_until<F, Fut>(
    what: &str,
    limit: Duration,
    stats: F,
    want: impl Fn(&ConsumerStats) -> bool,
) -> ConsumerStats
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = ConsumerStats>,
{
    poll(what, limit, || async {
        let s = stats().await;
        if want(&s) {
            Ok(s)
        } else {
            Err(format!("{s:?}"))
        }
    })
    .await
}

/// Waits until `stats()` shows `want`, then until two reads 3 s apart agree (nothing more
/// arrives), all within `limit`, and returns what they showed.
///
/// A read can catch the account between two reports of one attempt: a handler settles before it
/// returns, so status may show it acked and not yet delivered (C2 counts on return). The next
/// read moves on from it; what the caller asserts is the value that stays, so a late count is
/// still seen (it makes the value that stays wrong), and one that keeps coming fails here.
pub async fn settled_at<F, Fut>(
    what: &str,
    limit: Duration,
    stats: F,
    want: impl Fn(&ConsumerStats) -> bool,
) -> ConsumerStats
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = ConsumerStats>,
{
    let deadline = Instant::now() + limit;
    let mut s = wait_until(what, limit, &stats, &want).await;
    loop {
        tokio::time::sleep(Duration::from_secs(3)).await;
        let again = stats().await;
        if again == s {
            return again;
        }
        assert!(
            Instant::now() < deadline,
            "the account kept moving after the work was done ({what}): {s:?}, then {again:?}"
        );
        s = again;
    }
}
