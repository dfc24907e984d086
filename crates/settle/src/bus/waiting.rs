//! Waiting for what the operator makes: a broker binding a subscription to an operator-owned
//! consumer or queue looks for it until it is there, logging why it waits whenever the reason
//! changes, with a backoff from 250 ms to 5 s. The one wait loop every broker uses.
//!
//! It must not know a broker (the broker's lookup says what it found, or why not) nor make what
//! it waits for: the operator makes it, from the Subscription.

use std::future::Future;
use std::time::Duration;

/// The first pause between two looks; each pause doubles, up to [`MAX_WAIT`].
const FIRST_WAIT: Duration = Duration::from_millis(250);
const MAX_WAIT: Duration = Duration::from_secs(5);

/// Calls `look` until it finds what the operator made for `subscription` (`Ok`), and returns it.
/// Each `Err` is why it is not there yet (it does not exist yet, the broker does not answer),
/// logged at INFO as "waiting for the operator's `what`" when it differs from the last one.
/// Never gives up: the application waits while its Subscription is being made.
pub async fn await_operator<T, F, Fut>(subscription: &str, what: &str, mut look: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, String>>,
{
    let mut wait = FIRST_WAIT;
    let mut said = String::new();
    loop {
        let why = match look().await {
            Ok(found) => return found,
            Err(why) => why,
        };
        if why != said {
            tracing::info!(subscription = %subscription, reason = %why, "waiting for the operator's {what}");
            said = why;
        }
        tokio::time::sleep(wait).await;
        wait = (wait * 2).min(MAX_WAIT);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn it_looks_again_with_a_growing_pause_until_the_operator_made_it() {
        let start = tokio::time::Instant::now();
        let mut looks = 0;
        let found = await_operator("orders", "queue", || {
            looks += 1;
            let n = looks;
            async move {
                if n < 7 {
                    Err(format!("not there yet ({})", n % 2))
                } else {
                    Ok(n)
                }
            }
        })
        .await;
        assert_eq!(found, 7);
        // Paused 250, 500, 1000, 2000, 4000 ms, then 5 s (the cap).
        assert_eq!(start.elapsed(), Duration::from_millis(12_750));
    }
}
