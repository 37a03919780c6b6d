//! The settle policy: what happens to a delivery after an attempt, as one
//! pure function.
//!
//! Per-message and batched mode ask the same [`SettlePolicy::decide`], so
//! that "retry, requeue or dead-letter" is written (and tested) once, apart
//! from the broker and the store: the decision depends only on the attempt's
//! outcome, which attempt it was, how often the broker delivered the message
//! before, and what the error says about itself. A small `Copy` value that
//! decides from the outcome, so that a table test can cover it case by case.
//!
//! ```text
//! Processed / Duplicate                          ─► Ack
//! failed, Retry, attempts left                   ─► Retry after a backoff, in process
//! failed, Retry, no attempts left, below the cap ─► Requeue after a pause that grows per delivery
//! failed, Retry, no attempts left, at the cap    ─► DeadLetter(retries_exhausted)
//! failed, Requeue (not the message's fault)      ─► Requeue at once
//! failed, StoreUnavailable (the store is away)   ─► Release: handed back uncharged, consumption pauses
//! failed, DeadLetter (fails the same every time) ─► DeadLetter(the error's reason)
//! ```
//!
//! **Nothing loops forever.** In-process retries are bounded
//! (`retry_attempts`, exponential backoff); a requeue waits longer with each
//! delivery (10 × the retry delay, doubled, at most 30 s: in an outage this
//! slows the consumer down rather than spinning through the cap); and once
//! the broker's count (`x-delivery-count`) reaches `max_deliveries` the
//! message is dead-lettered as `retries_exhausted`. A requeue for a reason
//! that is not the message's (an abandoned attempt) spends none of that
//! budget's pauses.
//!
//! **An outage is not the message's fault.** A failure of the store itself
//! (unreachable, or its schema unusable: [`crate::runtime::AppError::is_store_unavailable`])
//! is released: no in-process retry is spent and no requeue pause held, the
//! delivery goes back with `basic.nack(requeue)` (which RabbitMQ 4.3 and
//! later do not count as a delivery), and the runtime's store circuit
//! pauses consumption until the store answers again (see
//! [`crate::runtime::availability`]). Its length therefore never decides a
//! message's fate.

use std::time::Duration;

use crate::runtime::backoff::Backoff;

/// The longest in-process retry backoff.
const MAX_RETRY_DELAY: Duration = Duration::from_secs(5);
/// The longest pause before a requeue.
const MAX_REQUEUE_PAUSE: Duration = Duration::from_secs(30);

/// What a failed attempt's error says should happen to its delivery.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ErrorDisposition {
    /// Transient (a lost connection, a serialization failure, a timeout):
    /// try again, in process and then through the broker.
    Retry,
    /// Not the message's fault and not worth retrying here (an abandoned
    /// attempt): hand it back to the broker at once.
    Requeue,
    /// The store failed, not the message (unreachable, schema unusable):
    /// hand it back uncharged and pause until the store answers.
    StoreUnavailable,
    /// It will fail the same way every time: dead-letter it.
    DeadLetter,
}

/// How one attempt at a delivery ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// The work committed with its claim.
    Processed,
    /// The message was already processed by this consumer.
    Duplicate,
    /// The attempt failed (rolled back), and its error says this.
    Failed(ErrorDisposition),
}

/// Why a delivery is dead-lettered.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DeadLetterReason {
    /// The error's own reason ([`crate::runtime::AppError::reason`]).
    Permanent,
    /// Retryable failures until the delivery cap: `retries_exhausted`.
    RetriesExhausted,
}

/// What to do with a delivery.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Settle {
    /// `basic.ack`: done.
    Ack,
    /// Try again in process after `delay`.
    Retry {
        /// The backoff before the next attempt (its ceiling: the worker
        /// sleeps it jittered).
        delay: Duration,
    },
    /// `basic.nack` with requeue after `pause`: the broker delivers it again.
    Requeue {
        /// How long to wait first (holding the worker's slot; a ceiling,
        /// slept jittered).
        pause: Duration,
        /// Whether in-process retries ran out (counted as a requeue), as
        /// opposed to handing the delivery back at once.
        exhausted: bool,
    },
    /// Publish to the dead-letter exchange with a reason, then ack.
    DeadLetter(DeadLetterReason),
    /// `basic.nack` with requeue at once, charged nothing (no retry, no
    /// requeue counted): the store is away, which is not the message's
    /// fault.
    Release,
}

/// The settings the decision depends on: a small `Copy` value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SettlePolicy {
    /// In-process attempts per delivery (at least one counts).
    pub retry_attempts: u32,
    /// Deliveries of one message before it is dead-lettered.
    pub max_deliveries: u32,
    /// Backoff before the second attempt; doubled each time.
    pub retry_base_delay: Duration,
}

impl SettlePolicy {
    /// In-process attempts, at least one.
    pub fn attempts(&self) -> u32 {
        self.retry_attempts.max(1)
    }

    /// Decides what happens after attempt number `attempt` (1-based) at a
    /// delivery the broker delivered `earlier_deliveries` times before.
    pub fn decide(&self, outcome: Outcome, attempt: u32, earlier_deliveries: u64) -> Settle {
        match outcome {
            Outcome::Processed | Outcome::Duplicate => Settle::Ack,
            Outcome::Failed(ErrorDisposition::DeadLetter) => {
                Settle::DeadLetter(DeadLetterReason::Permanent)
            }
            Outcome::Failed(ErrorDisposition::Requeue) => Settle::Requeue {
                pause: Duration::ZERO,
                exhausted: false,
            },
            Outcome::Failed(ErrorDisposition::StoreUnavailable) => Settle::Release,
            Outcome::Failed(ErrorDisposition::Retry) if attempt < self.attempts() => {
                Settle::Retry {
                    delay: Backoff::new(self.retry_base_delay, MAX_RETRY_DELAY)
                        .nominal(attempt.saturating_sub(1)),
                }
            }
            Outcome::Failed(ErrorDisposition::Retry) => {
                if earlier_deliveries.saturating_add(1) >= u64::from(self.max_deliveries) {
                    Settle::DeadLetter(DeadLetterReason::RetriesExhausted)
                } else {
                    Settle::Requeue {
                        pause: Backoff::new(
                            self.retry_base_delay.saturating_mul(10),
                            MAX_REQUEUE_PAUSE,
                        )
                        .nominal(u32::try_from(earlier_deliveries).unwrap_or(u32::MAX)),
                        exhausted: true,
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const POLICY: SettlePolicy = SettlePolicy {
        retry_attempts: 3,
        max_deliveries: 10,
        retry_base_delay: Duration::from_millis(100),
    };

    const OUTCOMES: [Outcome; 6] = [
        Outcome::Processed,
        Outcome::Duplicate,
        Outcome::Failed(ErrorDisposition::Retry),
        Outcome::Failed(ErrorDisposition::Requeue),
        Outcome::Failed(ErrorDisposition::StoreUnavailable),
        Outcome::Failed(ErrorDisposition::DeadLetter),
    ];
    /// First, middle, last, and (defensively) past the last attempt.
    const ATTEMPTS: [u32; 4] = [1, 2, 3, 4];
    /// A first delivery, a redelivery, the one before the cap, the cap.
    const EARLIER: [u64; 4] = [0, 1, 8, 9];

    /// What the table says, case by case, written out as the rules read.
    fn expected(outcome: Outcome, attempt: u32, earlier: u64) -> Settle {
        use ErrorDisposition as D;
        match (outcome, attempt, earlier) {
            (Outcome::Processed | Outcome::Duplicate, _, _) => Settle::Ack,
            (Outcome::Failed(D::DeadLetter), _, _) => {
                Settle::DeadLetter(DeadLetterReason::Permanent)
            }
            (Outcome::Failed(D::Requeue), _, _) => Settle::Requeue {
                pause: Duration::ZERO,
                exhausted: false,
            },
            // Whatever the attempt and however often delivered before: an
            // outage neither retries nor dead-letters.
            (Outcome::Failed(D::StoreUnavailable), _, _) => Settle::Release,
            (Outcome::Failed(D::Retry), 1, _) => Settle::Retry {
                delay: Duration::from_millis(100),
            },
            (Outcome::Failed(D::Retry), 2, _) => Settle::Retry {
                delay: Duration::from_millis(200),
            },
            (Outcome::Failed(D::Retry), _, 9) => {
                Settle::DeadLetter(DeadLetterReason::RetriesExhausted)
            }
            (Outcome::Failed(D::Retry), _, 0) => Settle::Requeue {
                pause: Duration::from_secs(1),
                exhausted: true,
            },
            (Outcome::Failed(D::Retry), _, 1) => Settle::Requeue {
                pause: Duration::from_secs(2),
                exhausted: true,
            },
            // 1 s × 2⁸, capped at 30 s.
            (Outcome::Failed(D::Retry), _, _) => Settle::Requeue {
                pause: Duration::from_secs(30),
                exhausted: true,
            },
        }
    }

    #[test]
    fn every_combination_is_decided_as_the_table_says() {
        let mut cases = 0;
        for outcome in OUTCOMES {
            for attempt in ATTEMPTS {
                for earlier in EARLIER {
                    assert_eq!(
                        POLICY.decide(outcome, attempt, earlier),
                        expected(outcome, attempt, earlier),
                        "{outcome:?}, attempt {attempt}, {earlier} earlier deliveries"
                    );
                    cases += 1;
                }
            }
        }
        assert_eq!(cases, 96);
    }

    #[test]
    fn one_attempt_means_no_in_process_retry() {
        let policy = SettlePolicy {
            retry_attempts: 0,
            ..POLICY
        };
        assert_eq!(policy.attempts(), 1);
        assert!(matches!(
            policy.decide(Outcome::Failed(ErrorDisposition::Retry), 1, 0),
            Settle::Requeue {
                exhausted: true,
                ..
            }
        ));
    }

    #[test]
    fn a_cap_of_one_dead_letters_the_first_exhausted_delivery() {
        let policy = SettlePolicy {
            max_deliveries: 1,
            ..POLICY
        };
        assert_eq!(
            policy.decide(Outcome::Failed(ErrorDisposition::Retry), 3, 0),
            Settle::DeadLetter(DeadLetterReason::RetriesExhausted)
        );
        // Counts beyond the cap (the broker's limit is higher) too.
        assert_eq!(
            policy.decide(Outcome::Failed(ErrorDisposition::Retry), 3, u64::MAX),
            Settle::DeadLetter(DeadLetterReason::RetriesExhausted)
        );
    }
}
