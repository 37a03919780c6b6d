//! The one way the runtime's loops wait for shutdown, so the service, its
//! workers and the relay stop on the same signal in the same way; and the
//! one bound on a teardown step, so that no close can hang a stop.

use std::future::Future;
use std::time::Duration;

use tokio::sync::watch;

/// How long a teardown step (an AMQP close, a topology delete, a database
/// connection's close) may take before it is given up with a log line.
pub const TEARDOWN_LIMIT: Duration = Duration::from_secs(10);

/// Runs teardown step `what` for at most [`TEARDOWN_LIMIT`]: its output,
/// or `None` (logged at warn) when it gave up. A close can wait for ever
/// for an answer that never comes once the socket is gone; a caller that
/// is only tidying up must go on.
pub async fn bounded<T>(what: &str, step: impl Future<Output = T>) -> Option<T> {
    bounded_by(TEARDOWN_LIMIT, what, step).await
}

/// [`bounded`] with a limit of the caller's.
pub async fn bounded_by<T>(
    limit: Duration,
    what: &str,
    step: impl Future<Output = T>,
) -> Option<T> {
    match tokio::time::timeout(limit, step).await {
        Ok(output) => Some(output),
        Err(_) => {
            tracing::warn!(what, ?limit, "teardown step not done in time; going on");
            None
        }
    }
}

/// Resolves when `shutdown` turns true or its sender is gone (a dropped
/// handle means nobody can ask to keep running).
pub async fn stopped(shutdown: &mut watch::Receiver<bool>) {
    let _ = shutdown.wait_for(|stop| *stop).await;
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;

    #[tokio::test]
    async fn a_teardown_step_that_never_answers_is_given_up_on() {
        let started = Instant::now();
        let limit = Duration::from_millis(50);
        let gave_up = bounded_by(limit, "a step that hangs", std::future::pending::<()>()).await;
        assert_eq!(gave_up, None);
        assert!(started.elapsed() < Duration::from_secs(5));
        assert_eq!(bounded("a step that answers", async { 7 }).await, Some(7));
    }
}
