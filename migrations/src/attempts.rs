//! What both drivers do with attempt-ledger rows besides sending the
//! statements: the row they read back, decoded once.

use chrono::{DateTime, Utc};
use inbox_api::{AttemptRecord, ConsumerName, DeadMark, InboxError, InboxKey, MessageId};

/// A ledger row's columns, in the order of [`crate::sql::LOOKUP_ATTEMPTS`]
/// and [`crate::sql::DEAD_MESSAGES`]: message id, consumer, attempts, last
/// error, first and last failure, dead mark's time and reason. What a
/// driver loads before [`attempt_record`].
pub type AttemptColumns = (
    uuid::Uuid,
    String,
    i32,
    String,
    DateTime<Utc>,
    DateTime<Utc>,
    Option<DateTime<Utc>>,
    Option<String>,
);

/// The record a ledger row holds.
///
/// # Errors
/// [`InboxError::Schema`] (permanent) for a row no statement of this crate
/// writes (a consumer name the inbox refuses): the table is not what this
/// code expects.
pub fn attempt_record(columns: AttemptColumns) -> Result<AttemptRecord, InboxError> {
    let (id, consumer, attempts, last_error, first, last, dead_at, dead_reason) = columns;
    let consumer = ConsumerName::new(consumer).map_err(|error| InboxError::Schema {
        source: Box::new(error),
    })?;
    Ok(AttemptRecord {
        key: InboxKey::new(MessageId::from_uuid(id), consumer),
        attempts: attempt_count(attempts),
        last_error,
        first_failed_at: first,
        last_failed_at: last,
        dead: dead_at.map(|at| DeadMark {
            at,
            reason: dead_reason.unwrap_or_default(),
        }),
    })
}

/// The count [`crate::sql::RECORD_FAILURE`] returns, as the trait's `u32`
/// (the column's CHECK keeps it positive).
pub fn attempt_count(attempts: i32) -> u32 {
    u32::try_from(attempts).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_decode() {
        let id = uuid::Uuid::now_v7();
        let now = Utc::now();
        let record = attempt_record((
            id,
            "carrier".into(),
            3,
            "boom".into(),
            now,
            now,
            Some(now),
            Some("retries_exhausted".into()),
        ))
        .expect("a valid row");
        assert_eq!(record.key.message_id.as_uuid(), &id);
        assert_eq!(record.attempts, 3);
        assert_eq!(
            record.dead.map(|d| d.reason),
            Some("retries_exhausted".to_owned())
        );
        let bad = attempt_record((id, String::new(), 1, "x".into(), now, now, None, None));
        assert!(matches!(bad, Err(InboxError::Schema { .. })));
        assert_eq!(attempt_count(-1), 0);
    }
}
