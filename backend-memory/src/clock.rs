//! Where the store reads the time, so tests can move it by hand.

use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use chrono::{DateTime, TimeDelta, Utc};

/// The store's source of `received_at` and `processed_at`.
///
/// Postgres reads its own clock; the memory store asks this trait instead,
/// so that retention and cleanup can be tested by moving time instead of
/// waiting for it ([`ManualClock`]).
pub trait Clock: Send + Sync + std::fmt::Debug {
    /// The current time.
    fn now(&self) -> DateTime<Utc>;
}

/// The machine's wall clock: what production and offline mode use.
#[derive(Clone, Copy, Debug, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> DateTime<Utc> {
        Utc::now()
    }
}

/// A clock that only moves when told to, for deterministic tests of
/// timestamps and cleanup.
///
/// Share it as an `Arc<ManualClock>`: keep one handle to move the time and
/// give a clone to [`crate::MemoryStore::with_clock`].
#[derive(Debug)]
pub struct ManualClock {
    now: Mutex<DateTime<Utc>>,
}

impl ManualClock {
    /// A clock standing still at `start`.
    pub fn new(start: DateTime<Utc>) -> Self {
        Self {
            now: Mutex::new(start),
        }
    }

    /// Moves the clock forward by `by`, saturating at the latest
    /// representable time rather than panicking.
    pub fn advance(&self, by: Duration) {
        let delta = TimeDelta::from_std(by).unwrap_or(TimeDelta::MAX);
        let mut now = self.lock();
        *now = now
            .checked_add_signed(delta)
            .unwrap_or(DateTime::<Utc>::MAX_UTC);
    }

    /// Sets the clock to `to` (backwards too, to test a clock that jumps).
    pub fn set(&self, to: DateTime<Utc>) {
        *self.lock() = to;
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, DateTime<Utc>> {
        // A poisoned lock still holds a valid timestamp: every critical
        // section is a single assignment, which cannot be left half done.
        self.now.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Clock for ManualClock {
    fn now(&self) -> DateTime<Utc> {
        *self.lock()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manual_clock_moves_only_when_told() {
        let start = DateTime::<Utc>::from_timestamp(1_000, 0).unwrap();
        let clock = ManualClock::new(start);
        assert_eq!(clock.now(), start);
        clock.advance(Duration::from_secs(60));
        assert_eq!(clock.now(), start + TimeDelta::seconds(60));
        clock.set(start);
        assert_eq!(clock.now(), start);
    }

    #[test]
    fn manual_clock_saturates_instead_of_panicking() {
        let clock = ManualClock::new(DateTime::<Utc>::MAX_UTC - TimeDelta::seconds(1));
        clock.advance(Duration::MAX);
        assert_eq!(clock.now(), DateTime::<Utc>::MAX_UTC);
    }

    #[test]
    fn system_clock_is_close_to_now() {
        let before = Utc::now();
        let now = SystemClock.now();
        assert!(now >= before);
    }
}
