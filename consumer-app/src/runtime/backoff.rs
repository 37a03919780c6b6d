//! Exponential backoff, the one timing rule of every retry here: in-process
//! attempts, requeue pauses, reconnects and store probes.

use std::time::Duration;

/// `base`, doubled per attempt, capped at `max` (never overflowing: the
/// exponent stops at 16).
pub fn backoff(base: Duration, max: Duration, attempt: u32) -> Duration {
    base.saturating_mul(2_u32.saturating_pow(attempt.min(16)))
        .min(max)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_then_caps() {
        let ms = Duration::from_millis;
        assert_eq!(backoff(ms(100), ms(5000), 0), ms(100));
        assert_eq!(backoff(ms(100), ms(5000), 3), ms(800));
        assert_eq!(backoff(ms(100), ms(5000), 10), ms(5000));
        assert_eq!(backoff(ms(100), ms(5000), u32::MAX), ms(5000));
    }
}
