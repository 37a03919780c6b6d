//! The settle policy: what happens to a delivery after an attempt, as one
//! pure function.
//!
//! Per-message and batched mode ask the same [`SettlePolicy::decide`], so
//! that "retry, requeue or dead-letter" is written (and tested) once, apart
//! from the broker and the store: the decision depends only on the attempt's
//! outcome, which attempt it was, how often the message failed before (by
//! the broker's count and the attempt ledger's), and what the error says
//! about itself. A small `Copy` value that
//! decides from the outcome, so that a table test can cover it case by case.
//!
//! ```text
//! Processed / Duplicate                          ─► Ack
//! Conflict (a processed id, another payload)     ─► Ack, or DeadLetter(conflicting_duplicate) by the consumer's ConflictPolicy
//! failed, Retry, attempts left                   ─► Retry after a backoff, in process
//! failed, Retry, no attempts left, below the cap ─► Requeue (reject: charged) after a pause that grows per failure
//! failed, Retry, no attempts left, at the cap    ─► DeadLetter(retries_exhausted)
//! failed, Requeue (not the message's fault)      ─► Requeue at once (nack: not charged)
//! failed, StoreUnavailable (the store is away)   ─► Release: handed back uncharged, consumption pauses
//! failed, DeadLetter (fails the same every time) ─► DeadLetter(the error's reason)
//! ```
//!
//! **Nothing loops forever.** In-process retries are bounded
//! (`retry_attempts`, exponential backoff); a requeue waits longer with each
//! failed delivery (10 × the retry delay, doubled, at most 30 s); and once
//! the message has failed `max_deliveries` times it is dead-lettered as
//! `retries_exhausted`.
//!
//! **Whose count.** The cap counts the message's own failures
//! ([`Deliveries::failed`]). The store's attempt ledger
//! ([`inbox_api::AttemptLedger`]), which the worker writes when a delivery
//! fails for good ([`SettlePolicy::charges`]), holds exactly those; the
//! broker's `x-delivery-count` is only the fallback for a store whose ledger
//! could not be written. The broker's count is not dependable either way:
//! RabbitMQ 4.3 stopped counting `basic.nack` in a quorum queue's
//! `x-delivery-count` (so the runtime hands a failed message back with
//! `basic.reject`, which every version counts), earlier versions count
//! every hand-back, the uncharged ones too, and classic queues and other
//! brokers count nothing. A requeue that is not the message's fault (an
//! abandoned attempt, a held key, a shutdown, an outage) is a `nack`,
//! recorded nowhere, and spends none of the budget, whatever the broker
//! counts.
//!
//! **An outage is not the message's fault.** A failure of the store itself
//! (unreachable, or its schema unusable: [`crate::AppError::is_store_unavailable`])
//! is released: no in-process retry is spent and no requeue pause held, the
//! delivery goes back with `basic.nack(requeue)` (which RabbitMQ 4.3 and
//! later do not count as a delivery), and the runtime's store circuit
//! pauses consumption until the store answers again (see
//! [`crate::availability`]). Its length therefore never decides a
//! message's fate.

use std::time::Duration;

use crate::backoff::Backoff;

/// The longest in-process retry backoff.
pub(crate) const MAX_RETRY_DELAY: Duration = Duration::from_secs(5);
/// The longest pause before a requeue.
pub(crate) const MAX_REQUEUE_PAUSE: Duration = Duration::from_secs(30);

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

/// What a consumer does with a delivery whose message id it processed
/// before for another payload ([`inbox_api::Handled::Conflict`]): the
/// producer reused an id for a different message. Either way the work does
/// not run (the id is taken) and the inbox logs both fingerprints and
/// counts it in `inbox_conflicting_duplicates_total`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum ConflictPolicy {
    /// Acknowledge and drop it, as a duplicate would be: the default, so
    /// that a producer's harmless edits (a re-serialised body, a new
    /// timestamp field) cost nothing but the log line and the counter.
    #[default]
    Acknowledge,
    /// Dead-letter it with reason `conflicting_duplicate`, for a person to
    /// look at: where a second message under a used id may be a lost
    /// order rather than a re-serialised one.
    DeadLetter,
}

/// How one attempt at a delivery ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// The work committed with its claim.
    Processed,
    /// The message was already processed by this consumer.
    Duplicate,
    /// The message id was processed before for another payload; the
    /// consumer's policy says what follows.
    Conflict(ConflictPolicy),
    /// The attempt failed (rolled back), and its error says this.
    Failed(ErrorDisposition),
}

/// Why a delivery is dead-lettered.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DeadLetterReason {
    /// The error's own reason ([`crate::AppError::reason`]).
    Permanent,
    /// Retryable failures until the delivery cap: `retries_exhausted`.
    RetriesExhausted,
    /// A processed id with another payload, under
    /// [`ConflictPolicy::DeadLetter`]: `conflicting_duplicate`.
    ConflictingDuplicate,
}

/// How often a message failed before and during this delivery, by each
/// count the runtime has.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Deliveries {
    /// The broker's count of earlier deliveries (`x-delivery-count`; 0 on a
    /// queue that keeps none).
    pub broker_earlier: u64,
    /// Failed deliveries the attempt ledger counts, this one included once
    /// it was recorded; 0 when nothing was recorded (not charged, or the
    /// ledger could not be written).
    pub ledger_failures: u32,
}

impl Deliveries {
    /// Failed deliveries of the message, this one included: the ledger's
    /// count when it has one, which counts the message's own failures only;
    /// otherwise the broker's (plus this delivery). Not the larger of the
    /// two: a broker before RabbitMQ 4.3 counts the uncharged hand-backs of
    /// an outage too, and a message is charged only for its own failures.
    pub fn failed(&self) -> u64 {
        if self.ledger_failures > 0 {
            u64::from(self.ledger_failures)
        } else {
            self.broker_earlier.saturating_add(1)
        }
    }
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
    /// Requeue after `pause`: the broker delivers it again.
    Requeue {
        /// How long to wait first (holding the worker's slot; a ceiling,
        /// slept jittered).
        pause: Duration,
        /// Whether in-process retries ran out: the message's own failure,
        /// handed back with `basic.reject` (which every broker version
        /// counts) and recorded in the ledger. Otherwise the delivery goes
        /// back at once with `basic.nack`, not charged.
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

    /// Whether attempt number `attempt` (1-based) ending with `outcome`
    /// charges the message one failed delivery: a retryable failure of its
    /// own with no in-process attempt left. The worker records exactly
    /// these in the attempt ledger before it asks [`SettlePolicy::decide`].
    pub fn charges(&self, outcome: Outcome, attempt: u32) -> bool {
        outcome == Outcome::Failed(ErrorDisposition::Retry) && attempt >= self.attempts()
    }

    /// Decides what happens after attempt number `attempt` (1-based) at a
    /// delivery of a message with the failure counts `deliveries`.
    pub fn decide(&self, outcome: Outcome, attempt: u32, deliveries: Deliveries) -> Settle {
        match outcome {
            Outcome::Processed
            | Outcome::Duplicate
            | Outcome::Conflict(ConflictPolicy::Acknowledge) => Settle::Ack,
            Outcome::Conflict(ConflictPolicy::DeadLetter) => {
                Settle::DeadLetter(DeadLetterReason::ConflictingDuplicate)
            }
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
                let failed = deliveries.failed();
                if failed >= u64::from(self.max_deliveries) {
                    Settle::DeadLetter(DeadLetterReason::RetriesExhausted)
                } else {
                    Settle::Requeue {
                        pause: Backoff::new(
                            self.retry_base_delay.saturating_mul(10),
                            MAX_REQUEUE_PAUSE,
                        )
                        .nominal(u32::try_from(failed - 1).unwrap_or(u32::MAX)),
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

    const OUTCOMES: [Outcome; 8] = [
        Outcome::Processed,
        Outcome::Duplicate,
        Outcome::Conflict(ConflictPolicy::Acknowledge),
        Outcome::Conflict(ConflictPolicy::DeadLetter),
        Outcome::Failed(ErrorDisposition::Retry),
        Outcome::Failed(ErrorDisposition::Requeue),
        Outcome::Failed(ErrorDisposition::StoreUnavailable),
        Outcome::Failed(ErrorDisposition::DeadLetter),
    ];
    /// First, middle, last, and (defensively) past the last attempt.
    const ATTEMPTS: [u32; 4] = [1, 2, 3, 4];
    /// The broker's count: a first delivery, a redelivery, the one before
    /// the cap, the cap.
    const EARLIER: [u64; 4] = [0, 1, 8, 9];
    /// The ledger's count: nothing recorded, a first failure, the one
    /// before the cap, the cap, beyond it (a broker that never counts, a
    /// classic queue).
    const LEDGER: [u32; 5] = [0, 1, 9, 10, 11];

    /// What the table says, case by case, written out as the rules read:
    /// the cap counts the ledger's count, or the broker's (plus this
    /// delivery) when the ledger recorded nothing.
    fn expected(outcome: Outcome, attempt: u32, earlier: u64, ledger: u32) -> Settle {
        use ErrorDisposition as D;
        let failed = if ledger > 0 {
            u64::from(ledger)
        } else {
            earlier + 1
        };
        match (outcome, attempt, failed) {
            (
                Outcome::Processed
                | Outcome::Duplicate
                | Outcome::Conflict(ConflictPolicy::Acknowledge),
                _,
                _,
            ) => Settle::Ack,
            (Outcome::Conflict(ConflictPolicy::DeadLetter), _, _) => {
                Settle::DeadLetter(DeadLetterReason::ConflictingDuplicate)
            }
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
            (Outcome::Failed(D::Retry), _, 10..) => {
                Settle::DeadLetter(DeadLetterReason::RetriesExhausted)
            }
            (Outcome::Failed(D::Retry), _, 1) => Settle::Requeue {
                pause: Duration::from_secs(1),
                exhausted: true,
            },
            (Outcome::Failed(D::Retry), _, 2) => Settle::Requeue {
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
                    for ledger in LEDGER {
                        let deliveries = Deliveries {
                            broker_earlier: earlier,
                            ledger_failures: ledger,
                        };
                        assert_eq!(
                            POLICY.decide(outcome, attempt, deliveries),
                            expected(outcome, attempt, earlier, ledger),
                            "{outcome:?}, attempt {attempt}, {earlier} earlier deliveries, \
                             {ledger} in the ledger"
                        );
                        cases += 1;
                    }
                }
            }
        }
        assert_eq!(cases, 640);
    }

    /// Exactly the decisions that can requeue a message for its own failure
    /// or dead-letter it for exhausted retries are charged; an outage, an
    /// abandoned attempt or a permanent error never.
    #[test]
    fn only_a_final_retryable_failure_is_charged() {
        for outcome in OUTCOMES {
            for attempt in ATTEMPTS {
                let charged = POLICY.charges(outcome, attempt);
                let exhausts = matches!(
                    POLICY.decide(outcome, attempt, Deliveries::default()),
                    Settle::Requeue {
                        exhausted: true,
                        ..
                    } | Settle::DeadLetter(DeadLetterReason::RetriesExhausted)
                );
                assert_eq!(charged, exhausts, "{outcome:?}, attempt {attempt}");
            }
        }
    }

    /// A classic queue never counts: the ledger alone brings the message to
    /// the cap, one failed delivery at a time.
    #[test]
    fn without_a_broker_count_the_ledger_caps() {
        let verdicts: Vec<Settle> = (1..=10)
            .map(|ledger| {
                POLICY.decide(
                    Outcome::Failed(ErrorDisposition::Retry),
                    3,
                    Deliveries {
                        broker_earlier: 0,
                        ledger_failures: ledger,
                    },
                )
            })
            .collect();
        assert!(
            verdicts[..9].iter().all(|v| matches!(
                v,
                Settle::Requeue {
                    exhausted: true,
                    ..
                }
            )),
            "{verdicts:?}"
        );
        assert_eq!(
            verdicts[9],
            Settle::DeadLetter(DeadLetterReason::RetriesExhausted)
        );
    }

    /// RabbitMQ before 4.3 counts every hand-back, the uncharged releases
    /// of an outage too: with the ledger's count at hand, a message
    /// released nine times and failed once is one failure from its start,
    /// not at the cap.
    #[test]
    fn uncharged_redeliveries_the_broker_counted_spend_no_budget() {
        let released_often = Deliveries {
            broker_earlier: 9,
            ledger_failures: 1,
        };
        assert_eq!(released_often.failed(), 1);
        assert!(matches!(
            POLICY.decide(Outcome::Failed(ErrorDisposition::Retry), 3, released_often),
            Settle::Requeue {
                exhausted: true,
                ..
            }
        ));
        // Without a ledger entry (it could not be written) the broker's
        // count is all there is, and it caps.
        let no_ledger = Deliveries {
            broker_earlier: 9,
            ledger_failures: 0,
        };
        assert_eq!(
            POLICY.decide(Outcome::Failed(ErrorDisposition::Retry), 3, no_ledger),
            Settle::DeadLetter(DeadLetterReason::RetriesExhausted)
        );
    }

    #[test]
    fn one_attempt_means_no_in_process_retry() {
        let policy = SettlePolicy {
            retry_attempts: 0,
            ..POLICY
        };
        assert_eq!(policy.attempts(), 1);
        assert!(policy.charges(Outcome::Failed(ErrorDisposition::Retry), 1));
        assert!(matches!(
            policy.decide(
                Outcome::Failed(ErrorDisposition::Retry),
                1,
                Deliveries::default()
            ),
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
            policy.decide(
                Outcome::Failed(ErrorDisposition::Retry),
                3,
                Deliveries::default()
            ),
            Settle::DeadLetter(DeadLetterReason::RetriesExhausted)
        );
        // Counts beyond the cap (the broker's limit is higher) too.
        let beyond = Deliveries {
            broker_earlier: u64::MAX,
            ledger_failures: u32::MAX,
        };
        assert_eq!(beyond.failed(), u64::from(u32::MAX));
        assert_eq!(
            policy.decide(Outcome::Failed(ErrorDisposition::Retry), 3, beyond),
            Settle::DeadLetter(DeadLetterReason::RetriesExhausted)
        );
    }
}
