//! Exponential backoff with jitter, the one timing rule of every retry here:
//! in-process attempts, requeue pauses, reconnects and store probes.
//!
//! The schedule and the randomness come from `backon` (already in the tree
//! through lapin, so it costs no build). Every delay is "equal jitter": the
//! nominal delay `d` (`base` doubled per attempt, capped at `max`) is the
//! ceiling, and the sleep is uniform in `[d/2, d)`. Without jitter every
//! consumer of a fleet reconnects in the same instant after a broker
//! restart; with full jitter (`[0, d)`) a retry could come at once, hammering
//! a store that just failed. `max` stays a true upper bound.
//!
//! The nominal delay is a pure function ([`Backoff::nominal`]), so that
//! [`crate::settle::SettlePolicy::decide`] stays a table-testable
//! value; the jitter is applied where the delay is slept ([`jittered`]).

use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBuilder};

/// Reconnecting to the broker or the store, and probing a store that is
/// away: 0.2 s doubled up to 10 s.
pub const RECONNECT: Backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(10));

/// An exponential schedule: `base` doubled per attempt, capped at `max`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Backoff {
    base: Duration,
    max: Duration,
}

impl Backoff {
    /// `base` for the first attempt, doubled per attempt, never above `max`.
    pub const fn new(base: Duration, max: Duration) -> Self {
        Self { base, max }
    }

    /// The ceiling of attempt `attempt` (0-based): `base × 2^attempt`, at
    /// most `max`. Rounded to whole milliseconds: backon multiplies in `f32`
    /// seconds, a sleep needs no nanoseconds, and whole milliseconds keep
    /// the schedule exact for the settle table.
    pub fn nominal(&self, attempt: u32) -> Duration {
        // Past 64 doublings any base has reached any cap (2^64 ns is 584
        // years); stopping there keeps `nth` short for absurd counts.
        let steps = usize::try_from(attempt.min(64)).unwrap_or(64);
        let delay = ExponentialBuilder::new()
            .with_min_delay(self.base)
            .with_max_delay(self.max)
            .without_max_times()
            .build()
            .nth(steps)
            .unwrap_or(self.max)
            .min(self.max);
        round_to_millis(delay)
    }

    /// The jittered delay of attempt `attempt` (0-based), in
    /// `[nominal / 2, nominal)`: what a retry loop sleeps.
    pub fn delay(&self, attempt: u32) -> Duration {
        jittered(self.nominal(attempt))
    }
}

/// `nominal` with equal jitter: uniform in `[nominal / 2, nominal)`.
///
/// It is backon's jitter (a delay plus up to itself again, from `fastrand`
/// seeded per process) applied to half the delay.
pub fn jittered(nominal: Duration) -> Duration {
    let half = nominal / 2;
    ExponentialBuilder::new()
        .with_min_delay(half)
        .with_max_delay(half)
        .with_jitter()
        .build()
        .next()
        .unwrap_or(half)
        .min(nominal)
}

fn round_to_millis(delay: Duration) -> Duration {
    let millis = delay.as_nanos().saturating_add(500_000) / 1_000_000;
    Duration::from_millis(u64::try_from(millis).unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: fn(u64) -> Duration = Duration::from_millis;

    #[test]
    fn nominal_doubles_then_caps() {
        let backoff = Backoff::new(MS(100), MS(5000));
        assert_eq!(backoff.nominal(0), MS(100));
        assert_eq!(backoff.nominal(1), MS(200));
        assert_eq!(backoff.nominal(3), MS(800));
        assert_eq!(backoff.nominal(5), MS(3200));
        assert_eq!(backoff.nominal(6), MS(5000));
        assert_eq!(backoff.nominal(10), MS(5000));
        assert_eq!(backoff.nominal(u32::MAX), MS(5000));
        assert_eq!(RECONNECT.nominal(0), MS(200));
        assert_eq!(RECONNECT.nominal(20), Duration::from_secs(10));
    }

    #[test]
    fn jitter_stays_between_half_and_the_whole_and_spreads() {
        let nominal = MS(1000);
        let delays: Vec<Duration> = (0..200).map(|_| jittered(nominal)).collect();
        for delay in &delays {
            assert!(
                (MS(500)..=nominal).contains(delay),
                "{delay:?} outside [500 ms, 1 s]"
            );
        }
        let lowest = delays.iter().min().copied().unwrap_or_default();
        let highest = delays.iter().max().copied().unwrap_or_default();
        // 200 uniform draws over 500 ms: a spread under 250 ms has a
        // probability far below 1e-50.
        assert!(
            highest - lowest > MS(250),
            "not spread: {lowest:?}..{highest:?}"
        );
        assert_eq!(jittered(Duration::ZERO), Duration::ZERO);
    }

    #[test]
    fn a_retry_delay_is_jittered_below_its_nominal() {
        let backoff = Backoff::new(MS(100), MS(5000));
        for attempt in [0, 2, 9] {
            let delay = backoff.delay(attempt);
            let nominal = backoff.nominal(attempt);
            assert!(
                nominal / 2 <= delay && delay <= nominal,
                "{delay:?} vs {nominal:?}"
            );
        }
    }
}
