//! What both drivers do with outbox rows besides sending the statements:
//! the parameters they bind and the rows they read back, decoded once.
//!
//! A driver reads the columns of [`crate::sql::LOOKUP_OUTGOING`] and
//! [`crate::sql::TAKE_PENDING`] into an [`OutboxRow`] (plain values, no
//! driver types), and this module turns rows into the vocabulary of
//! `inbox-api`, checking every stored message as a new one is checked.

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{DateTime, TimeDelta, Utc};
use inbox_api::{
    EnqueueOutcome, InboxError, LeaseId, MessageId, OutboxLease, OutboxRecord, OutgoingMessage,
    PublishRetry, Refused,
};

/// One outgoing row as the statements return it (see
/// [`crate::sql::LOOKUP_OUTGOING`] for the columns, in this order).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutboxRow {
    /// `message_id`.
    pub message_id: uuid::Uuid,
    /// `position`: enqueue order.
    pub position: i64,
    /// `exchange`.
    pub exchange: String,
    /// `routing_key`.
    pub routing_key: String,
    /// `message_type`.
    pub message_type: String,
    /// The header names, sorted.
    pub header_names: Vec<String>,
    /// The header values, in the order of the names.
    pub header_values: Vec<String>,
    /// `body`.
    pub body: Vec<u8>,
    /// `created_at`.
    pub created_at: DateTime<Utc>,
    /// `published_at`.
    pub published_at: Option<DateTime<Utc>>,
    /// `locked_until`.
    pub locked_until: Option<DateTime<Utc>>,
    /// `attempts`.
    pub attempts: i32,
    /// `failures`.
    pub failures: i32,
    /// `last_error`.
    pub last_error: Option<String>,
    /// `next_attempt_at`.
    pub next_attempt_at: Option<DateTime<Utc>>,
    /// `dead_at`.
    pub dead_at: Option<DateTime<Utc>>,
}

/// An outgoing row's columns as a tuple, in the order of [`OutboxRow`]'s
/// fields: what a driver loads (sqlx's `query_as`, diesel's `load`) before
/// [`OutboxRow::from`].
pub type OutboxColumns = (
    uuid::Uuid,
    i64,
    String,
    String,
    String,
    Vec<String>,
    Vec<String>,
    Vec<u8>,
    DateTime<Utc>,
    Option<DateTime<Utc>>,
    Option<DateTime<Utc>>,
    i32,
    i32,
    Option<String>,
    Option<DateTime<Utc>>,
    Option<DateTime<Utc>>,
);

impl From<OutboxColumns> for OutboxRow {
    fn from(c: OutboxColumns) -> Self {
        Self {
            message_id: c.0,
            position: c.1,
            exchange: c.2,
            routing_key: c.3,
            message_type: c.4,
            header_names: c.5,
            header_values: c.6,
            body: c.7,
            created_at: c.8,
            published_at: c.9,
            locked_until: c.10,
            attempts: c.11,
            failures: c.12,
            last_error: c.13,
            next_attempt_at: c.14,
            dead_at: c.15,
        }
    }
}

impl OutboxRow {
    /// The message the row holds.
    ///
    /// # Errors
    /// [`InboxError::Schema`] (permanent) when the row breaks a rule no
    /// enqueue could have written: the table is not what this code expects.
    pub fn into_message(self) -> Result<OutgoingMessage, InboxError> {
        self.split().map(|(message, _)| message)
    }

    /// The row for diagnostics.
    ///
    /// # Errors
    /// As [`OutboxRow::into_message`].
    pub fn into_record(self) -> Result<OutboxRecord, InboxError> {
        self.split().map(|(message, rest)| OutboxRecord {
            message,
            created_at: rest.created_at,
            published_at: rest.published_at,
            attempts: u32::try_from(rest.attempts).unwrap_or(0),
            failures: u32::try_from(rest.failures).unwrap_or(0),
            last_error: rest.last_error,
            next_attempt_at: rest.next_attempt_at,
            dead_at: rest.dead_at,
        })
    }

    fn split(self) -> Result<(OutgoingMessage, Self), InboxError> {
        if self.header_names.len() != self.header_values.len() {
            return Err(schema("header names and values differ in number"));
        }
        let headers: BTreeMap<String, String> = self
            .header_names
            .iter()
            .cloned()
            .zip(self.header_values.iter().cloned())
            .collect();
        let message = OutgoingMessage::from_parts(
            MessageId::from_uuid(self.message_id),
            self.exchange.clone(),
            self.routing_key.clone(),
            self.message_type.clone(),
            headers,
            self.body.clone(),
        )
        .map_err(|error| InboxError::Schema {
            source: Box::new(error),
        })?;
        Ok((message, self))
    }
}

fn schema(message: &str) -> InboxError {
    InboxError::Schema {
        source: format!("outbox row: {message}").into(),
    }
}

/// The headers as the two parallel arrays [`crate::sql::ENQUEUE`] binds as
/// `$5` and `$6`.
pub fn header_columns(message: &OutgoingMessage) -> (Vec<String>, Vec<String>) {
    message
        .headers()
        .iter()
        .map(|(name, value)| (name.clone(), value.clone()))
        .unzip()
}

/// The enqueue's outcome from the rows its INSERT affected.
///
/// # Errors
/// [`InboxError::Store`] (permanent) for more than one row: not the
/// statement this code sent.
pub fn enqueued(rows: u64) -> Result<EnqueueOutcome, InboxError> {
    match rows {
        0 => Ok(EnqueueOutcome::AlreadyEnqueued),
        1 => Ok(EnqueueOutcome::Enqueued),
        n => Err(InboxError::Store {
            retryable: false,
            source: format!("enqueue inserted {n} rows for one message").into(),
        }),
    }
}

/// The lease length as [`crate::sql::TAKE_PENDING`]'s `$1`: whole
/// milliseconds, at least one (a zero lease would hand the rows to the next
/// relay at once), saturating.
pub fn lease_millis(lease: Duration) -> i64 {
    i64::try_from(lease.as_millis()).unwrap_or(i64::MAX).max(1)
}

/// The parameters of [`crate::sql::RECORD_REFUSALS`] after the lease id:
/// base and longest delay in milliseconds (`$4`, `$5`) and the retry limit
/// (`$6`), saturating.
pub fn retry_columns(retry: &PublishRetry) -> (f64, f64, i32) {
    // Milliseconds as float8: the statement multiplies by powers of two.
    #[allow(clippy::cast_precision_loss)]
    let millis = |d: Duration| d.as_millis() as f64;
    (
        millis(retry.base_delay),
        millis(retry.max_delay),
        i32::try_from(retry.max_attempts.get()).unwrap_or(i32::MAX),
    )
}

/// The refusals as the two parallel arrays of
/// [`crate::sql::RECORD_REFUSALS`] (`$1` ids, `$2` the broker's answers).
pub fn refusal_columns(refusals: &[(MessageId, String)]) -> (Vec<uuid::Uuid>, Vec<String>) {
    refusals
        .iter()
        .map(|(id, error)| (*id.as_uuid(), error.clone()))
        .unzip()
}

/// What [`crate::sql::RECORD_REFUSALS`]'s rows (id, dead) say.
pub fn refused(rows: Vec<(uuid::Uuid, bool)>) -> Refused {
    Refused {
        recorded: rows.len() as u64,
        dead: rows
            .into_iter()
            .filter(|(_, dead)| *dead)
            .map(|(id, _)| MessageId::from_uuid(id))
            .collect(),
    }
}

/// Dead rows for [`inbox_api::OutboxStore::dead_outgoing`].
///
/// # Errors
/// As [`OutboxRow::into_message`].
pub fn records(rows: Vec<OutboxColumns>) -> Result<Vec<OutboxRecord>, InboxError> {
    rows.into_iter()
        .map(|columns| OutboxRow::from(columns).into_record())
        .collect()
}

/// The message ids as the `uuid[]` parameter of
/// [`crate::sql::MARK_PUBLISHED`] and [`crate::sql::RELEASE`].
pub fn id_column(ids: &[MessageId]) -> Vec<uuid::Uuid> {
    ids.iter().map(|id| *id.as_uuid()).collect()
}

/// The lease the rows of [`crate::sql::TAKE_PENDING`] make: sorted into
/// enqueue order, expiring when the rows say (or `lease` after now when
/// there were none).
///
/// # Errors
/// As [`OutboxRow::into_message`].
pub fn lease_from_rows(
    id: LeaseId,
    lease: Duration,
    rows: Vec<OutboxColumns>,
) -> Result<OutboxLease, InboxError> {
    let mut rows: Vec<OutboxRow> = rows.into_iter().map(OutboxRow::from).collect();
    rows.sort_unstable_by_key(|row| row.position);
    let expires_at = rows
        .iter()
        .filter_map(|row| row.locked_until)
        .max()
        .unwrap_or_else(|| Utc::now() + TimeDelta::from_std(lease).unwrap_or(TimeDelta::MAX));
    let messages = rows
        .into_iter()
        .map(OutboxRow::into_message)
        .collect::<Result<_, _>>()?;
    Ok(OutboxLease {
        id,
        expires_at,
        messages,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(position: i64) -> OutboxRow {
        OutboxRow {
            message_id: uuid::Uuid::now_v7(),
            position,
            exchange: "parcels".into(),
            routing_key: "parcel.created".into(),
            message_type: "ParcelCreatedEvent".into(),
            header_names: vec!["a".into(), "b".into()],
            header_values: vec!["1".into(), "2".into()],
            body: b"{}".to_vec(),
            created_at: Utc::now(),
            published_at: None,
            locked_until: Some(Utc::now()),
            attempts: 2,
            failures: 1,
            last_error: Some("nack".into()),
            next_attempt_at: None,
            dead_at: None,
        }
    }

    fn columns(row: &OutboxRow) -> OutboxColumns {
        let r = row.clone();
        (
            r.message_id,
            r.position,
            r.exchange,
            r.routing_key,
            r.message_type,
            r.header_names,
            r.header_values,
            r.body,
            r.created_at,
            r.published_at,
            r.locked_until,
            r.attempts,
            r.failures,
            r.last_error,
            r.next_attempt_at,
            r.dead_at,
        )
    }

    #[test]
    fn rows_decode_and_leases_sort() {
        assert_eq!(OutboxRow::from(columns(&row(4))).position, 4);
        let (late, early) = (row(9), row(3));
        let lease = lease_from_rows(
            LeaseId::new(),
            Duration::from_secs(30),
            vec![columns(&late), columns(&early)],
        )
        .expect("valid rows");
        assert_eq!(
            lease.ids(),
            vec![
                MessageId::from_uuid(early.message_id),
                MessageId::from_uuid(late.message_id)
            ]
        );
        let message = &lease.messages[0];
        assert_eq!(message.headers().get("b").map(String::as_str), Some("2"));
        assert_eq!(
            header_columns(message),
            (early.header_names.clone(), early.header_values.clone())
        );
        let record = early.clone().into_record().expect("valid row");
        assert_eq!(record.attempts, 2);
        assert_eq!(record.created_at, early.created_at);

        let empty =
            lease_from_rows(LeaseId::new(), Duration::from_secs(30), Vec::new()).expect("no rows");
        assert!(empty.is_empty() && empty.expires_at > Utc::now());
    }

    #[test]
    fn a_row_no_enqueue_could_write_is_a_schema_error() {
        let mut bad = row(1);
        bad.header_values.pop();
        assert!(matches!(bad.into_message(), Err(InboxError::Schema { .. })));
        let mut bad = row(1);
        bad.message_type = String::new();
        let error = bad.into_record().expect_err("empty type");
        assert!(matches!(error, InboxError::Schema { .. }) && !error.is_retryable());
    }

    #[test]
    fn parameters() {
        assert_eq!(enqueued(1).expect("one"), EnqueueOutcome::Enqueued);
        assert_eq!(enqueued(0).expect("none"), EnqueueOutcome::AlreadyEnqueued);
        assert!(enqueued(2).is_err());
        assert_eq!(lease_millis(Duration::from_secs(2)), 2000);
        assert_eq!(lease_millis(Duration::ZERO), 1);
        assert_eq!(lease_millis(Duration::MAX), i64::MAX);
        let id = MessageId::new_v7();
        assert_eq!(id_column(&[id]), vec![*id.as_uuid()]);
    }
}
