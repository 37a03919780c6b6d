//! What an open transaction holds, and which savepoint statement to send.
//!
//! Batched mode runs each message's work inside a savepoint and gives a
//! failed message's claim back (`unclaim`). Both need bookkeeping that has
//! nothing to do with the driver: which keys this transaction claimed (only
//! those may be unclaimed, never a row someone else committed), how to undo
//! that set when rolling back to a savepoint, and a deferred `RELEASE`. It
//! lives here as a pure state machine; the driver sends the statement a
//! method returns and reports success with the matching `…_done` call.

use std::collections::HashSet;

use async_trait::async_trait;
use inbox_api::{Claim, ConsumerName, Fingerprint, InboxError, InboxKey, MessageId};

/// The claim and savepoint state of one open transaction.
#[derive(Debug, Default)]
pub struct Claims {
    /// Keys this transaction claimed `Fresh` and has not unclaimed.
    claimed: HashSet<InboxKey>,
    /// Changes to `claimed` made while a savepoint is open, oldest first,
    /// so that rolling back to a savepoint can undo them.
    changes: Vec<Change>,
    /// One entry per open savepoint, newest last: the length of `changes`
    /// when it was taken.
    savepoints: Vec<usize>,
    /// A savepoint released by the caller but not yet on the server (its
    /// depth): the RELEASE rides along with the next SAVEPOINT, and COMMIT
    /// makes it unnecessary, so batched mode pays one round trip per
    /// message for its savepoints instead of two.
    release_pending: Option<usize>,
}

/// One change to the set of keys a transaction holds.
#[derive(Debug)]
enum Change {
    Claimed(InboxKey),
    Unclaimed(InboxKey),
}

impl Claims {
    /// Nothing held, no savepoint open.
    pub fn new() -> Self {
        Self::default()
    }

    /// How many keys the transaction holds.
    pub fn held(&self) -> usize {
        self.claimed.len()
    }

    /// How many savepoints are open.
    pub fn savepoint_depth(&self) -> usize {
        self.savepoints.len()
    }

    /// Whether the transaction holds `key`.
    pub fn holds(&self, key: &InboxKey) -> bool {
        self.claimed.contains(key)
    }

    /// Records that `key` was claimed fresh, undoably while a savepoint is
    /// open.
    pub fn hold(&mut self, key: &InboxKey) {
        if self.claimed.insert(key.clone()) && !self.savepoints.is_empty() {
            self.changes.push(Change::Claimed(key.clone()));
        }
    }

    /// The single claim's outcome from the rows its INSERT affected.
    ///
    /// # Errors
    /// [`InboxError::Store`] (permanent) for more than one row: not the
    /// statement this code sent.
    pub fn claimed(&mut self, key: &InboxKey, rows: u64) -> Result<Claim, InboxError> {
        match rows {
            0 => Ok(Claim::Duplicate),
            1 => {
                self.hold(key);
                Ok(Claim::Fresh)
            }
            n => Err(InboxError::Store {
                retryable: false,
                source: format!("claim inserted {n} rows for one key").into(),
            }),
        }
    }

    /// The batch claim's outcomes, one per key of `keys` in order, from the
    /// `(id, consumer)` rows its INSERT returned. A key repeated in the
    /// batch is `Fresh` at its first occurrence only.
    ///
    /// # Errors
    /// [`InboxError::InvalidConsumerName`] for a returned consumer name
    /// that is not one (not a row this code wrote).
    pub fn claimed_batch(
        &mut self,
        keys: &[InboxKey],
        inserted: impl IntoIterator<Item = (uuid::Uuid, String)>,
    ) -> Result<Vec<Claim>, InboxError> {
        let mut fresh = HashSet::new();
        for (id, consumer) in inserted {
            fresh.insert(InboxKey::new(
                MessageId::from_uuid(id),
                ConsumerName::new(consumer)?,
            ));
        }
        let mut claims = Vec::with_capacity(keys.len());
        for key in keys {
            if fresh.remove(key) {
                self.hold(key);
                claims.push(Claim::Fresh);
            } else {
                claims.push(Claim::Duplicate);
            }
        }
        Ok(claims)
    }

    /// Checks that `key` may be unclaimed: only a key this transaction
    /// holds, so that no row someone else committed is ever deleted. Send
    /// [`crate::sql::UNCLAIM`] next, then call [`Claims::unclaimed`].
    ///
    /// # Errors
    /// [`InboxError::InvalidArgument`] for a key not held.
    pub fn may_unclaim(&self, key: &InboxKey) -> Result<(), InboxError> {
        if self.claimed.contains(key) {
            Ok(())
        } else {
            Err(InboxError::InvalidArgument {
                message: format!("unclaim({key}): the key is not held by this transaction"),
            })
        }
    }

    /// Whether a response may be kept with `key`: only with a key this
    /// transaction holds (claimed `Fresh`, not given back), so that a
    /// response never lands on another transaction's committed row.
    ///
    /// # Errors
    /// [`InboxError::InvalidArgument`] when it does not hold `key`.
    pub fn may_keep_response(&self, key: &InboxKey) -> Result<(), InboxError> {
        if self.claimed.contains(key) {
            Ok(())
        } else {
            Err(InboxError::InvalidArgument {
                message: format!("keep_response({key}): the key is not held by this transaction"),
            })
        }
    }

    /// Records that `key`'s row was deleted, undoably.
    pub fn unclaimed(&mut self, key: &InboxKey) {
        if self.claimed.remove(key) && !self.savepoints.is_empty() {
            self.changes.push(Change::Unclaimed(key.clone()));
        }
    }

    /// The statement(s) that open a new savepoint, with a deferred RELEASE
    /// in front when one is pending: parameterless, for the simple query
    /// protocol. Then call [`Claims::savepoint_done`].
    pub fn savepoint_sql(&self) -> String {
        // Named by depth only: nothing from outside reaches the SQL.
        let name = savepoint_name(self.savepoints.len());
        match self.release_pending {
            Some(released) => format!(
                "RELEASE SAVEPOINT {}; SAVEPOINT {name}",
                savepoint_name(released)
            ),
            None => format!("SAVEPOINT {name}"),
        }
    }

    /// Records that [`Claims::savepoint_sql`] succeeded.
    pub fn savepoint_done(&mut self) {
        self.release_pending = None;
        self.savepoints.push(self.changes.len());
    }

    /// The statements that undo everything since the newest savepoint and
    /// drop it, in one round trip. Then call [`Claims::rollback_done`].
    ///
    /// # Errors
    /// [`InboxError::InvalidArgument`] when no savepoint is open.
    pub fn rollback_to_savepoint_sql(&self) -> Result<String, InboxError> {
        let depth = self
            .savepoints
            .len()
            .checked_sub(1)
            .ok_or_else(no_savepoint)?;
        let name = savepoint_name(depth);
        // Rolling back to it also drops a released-but-pending newer one.
        Ok(format!(
            "ROLLBACK TO SAVEPOINT {name}; RELEASE SAVEPOINT {name}"
        ))
    }

    /// Records that [`Claims::rollback_to_savepoint_sql`] succeeded: the
    /// keys claimed since the savepoint are no longer held, and those
    /// unclaimed since are held again.
    pub fn rollback_done(&mut self) {
        self.release_pending = None;
        let mark = self.savepoints.pop().unwrap_or_default();
        for change in self.changes.drain(mark..).rev() {
            match change {
                Change::Claimed(key) => self.claimed.remove(&key),
                Change::Unclaimed(key) => self.claimed.insert(key),
            };
        }
    }

    /// Releases the newest savepoint. Nothing is sent: the RELEASE is
    /// deferred to the next [`Claims::savepoint_sql`] or made unnecessary by
    /// COMMIT. Writes inside a savepoint that is released later, or never
    /// (COMMIT releases every savepoint), end up exactly where they would
    /// after an immediate RELEASE; releasing an outer savepoint also
    /// releases the inner pending one.
    ///
    /// # Errors
    /// [`InboxError::InvalidArgument`] when no savepoint is open.
    pub fn release_savepoint(&mut self) -> Result<(), InboxError> {
        let depth = self
            .savepoints
            .len()
            .checked_sub(1)
            .ok_or_else(no_savepoint)?;
        self.release_pending = Some(depth);
        self.savepoints.pop();
        if self.savepoints.is_empty() {
            // Nothing left to roll back to: the changes need no undoing.
            self.changes.clear();
        }
        Ok(())
    }
}

/// A driver's transaction, as the savepoint steps see it: its [`Claims`],
/// and a way to send the parameterless statements they return.
#[async_trait]
pub trait SavepointDriver: Send {
    /// The transaction's bookkeeping.
    fn claims(&mut self) -> &mut Claims;

    /// Sends parameterless SQL (possibly two statements) in one round trip
    /// over the simple query protocol.
    async fn send_simple(&mut self, sql: String) -> Result<(), InboxError>;
}

/// Opens a savepoint (with a deferred RELEASE in front when one is
/// pending): `BatchTransaction::savepoint` for every driver.
///
/// # Errors
/// The driver's, for the statement.
pub async fn savepoint<D: SavepointDriver>(tx: &mut D) -> Result<(), InboxError> {
    let sql = tx.claims().savepoint_sql();
    tx.send_simple(sql).await?;
    tx.claims().savepoint_done();
    Ok(())
}

/// Undoes everything since the newest savepoint and drops it:
/// `BatchTransaction::rollback_to_savepoint` for every driver.
///
/// # Errors
/// [`InboxError::InvalidArgument`] when no savepoint is open; the
/// driver's, for the statement.
pub async fn rollback_to_savepoint<D: SavepointDriver>(tx: &mut D) -> Result<(), InboxError> {
    let sql = tx.claims().rollback_to_savepoint_sql()?;
    tx.send_simple(sql).await?;
    tx.claims().rollback_done();
    Ok(())
}

/// The three savepoint methods of [`inbox_api::BatchTransaction`] for a
/// driver transaction that implements [`SavepointDriver`], written inside its
/// `#[async_trait] impl BatchTransaction` block.
///
/// A blanket `impl<T: SavepointDriver> BatchTransaction for T` would say it
/// once without a macro, but the orphan rule forbids it here (neither the
/// trait nor `T` is this crate's), and each driver would otherwise repeat the
/// same three delegations. The methods are spelled in the form
/// `#[async_trait]` gives trait methods, because an attribute macro does not
/// expand macro calls inside the block it rewrites.
#[macro_export]
macro_rules! savepoint_methods {
    () => {
        fn savepoint<'life0, 'async_trait>(
            &'life0 mut self,
        ) -> ::core::pin::Pin<
            ::std::boxed::Box<
                dyn ::core::future::Future<Output = ::core::result::Result<(), $crate::InboxError>>
                    + ::core::marker::Send
                    + 'async_trait,
            >,
        >
        where
            'life0: 'async_trait,
            Self: 'async_trait,
        {
            ::std::boxed::Box::pin($crate::savepoint(self))
        }

        fn rollback_to_savepoint<'life0, 'async_trait>(
            &'life0 mut self,
        ) -> ::core::pin::Pin<
            ::std::boxed::Box<
                dyn ::core::future::Future<Output = ::core::result::Result<(), $crate::InboxError>>
                    + ::core::marker::Send
                    + 'async_trait,
            >,
        >
        where
            'life0: 'async_trait,
            Self: 'async_trait,
        {
            ::std::boxed::Box::pin($crate::rollback_to_savepoint(self))
        }

        fn release_savepoint<'life0, 'async_trait>(
            &'life0 mut self,
        ) -> ::core::pin::Pin<
            ::std::boxed::Box<
                dyn ::core::future::Future<Output = ::core::result::Result<(), $crate::InboxError>>
                    + ::core::marker::Send
                    + 'async_trait,
            >,
        >
        where
            'life0: 'async_trait,
            Self: 'async_trait,
        {
            ::std::boxed::Box::pin(::core::future::ready(
                $crate::SavepointDriver::claims(self).release_savepoint(),
            ))
        }
    };
}

/// The keys as the parallel arrays [`crate::sql::CLAIM_BATCH`] unnests:
/// ids, consumers, fingerprints.
pub fn key_columns(keys: &[InboxKey]) -> KeyColumns {
    let mut columns = KeyColumns {
        ids: Vec::with_capacity(keys.len()),
        consumers: Vec::with_capacity(keys.len()),
        fingerprints: Vec::with_capacity(keys.len()),
    };
    for key in keys {
        columns.ids.push(*key.message_id.as_uuid());
        columns.consumers.push(key.consumer.as_str().to_owned());
        columns.fingerprints.push(fingerprint_column(key));
    }
    columns
}

/// [`key_columns`]' answer, one array per parameter of the batch claim.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KeyColumns {
    /// `$1`: the message ids.
    pub ids: Vec<uuid::Uuid>,
    /// `$2`: the consumer names.
    pub consumers: Vec<String>,
    /// `$3`: the payload fingerprints, `None` (NULL) where a key has none.
    pub fingerprints: Vec<Option<Vec<u8>>>,
}

/// The claim's `$3`: the key's payload fingerprint as the column stores it
/// (32 bytes), or NULL.
pub fn fingerprint_column(key: &InboxKey) -> Option<Vec<u8>> {
    key.fingerprint().map(|f| f.as_bytes().to_vec())
}

/// The fingerprint a row's `payload_fingerprint` holds, read back.
///
/// # Errors
/// [`InboxError::InvalidArgument`] when the column holds something other
/// than 32 bytes.
pub fn stored_fingerprint(column: Option<Vec<u8>>) -> Result<Option<Fingerprint>, InboxError> {
    column
        .map(|bytes| Fingerprint::from_bytes(&bytes))
        .transpose()
}

fn savepoint_name(depth: usize) -> String {
    format!("inbox_savepoint_{depth}")
}

fn no_savepoint() -> InboxError {
    InboxError::InvalidArgument {
        message: "no open savepoint in this transaction".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(n: u128) -> InboxKey {
        InboxKey::new(
            MessageId::from_uuid(uuid::Uuid::from_u128(n)),
            ConsumerName::new("c").expect("valid"),
        )
    }

    #[test]
    fn single_claims() {
        let mut claims = Claims::new();
        assert_eq!(claims.claimed(&key(1), 1).expect("fresh"), Claim::Fresh);
        assert_eq!(claims.claimed(&key(2), 0).expect("dup"), Claim::Duplicate);
        assert!(claims.holds(&key(1)) && !claims.holds(&key(2)));
        assert!(claims.claimed(&key(3), 2).is_err());
        assert_eq!(claims.held(), 1);
    }

    #[test]
    fn batch_outcomes_follow_the_keys() {
        let mut claims = Claims::new();
        let printed = Fingerprint::of(b"body");
        let keys = [key(2).with_fingerprint(printed), key(1), key(2), key(3)];
        let columns = key_columns(&keys);
        assert_eq!(columns.ids.len(), 4);
        assert_eq!(columns.consumers, vec!["c"; 4]);
        assert_eq!(
            columns.fingerprints,
            vec![Some(printed.as_bytes().to_vec()), None, None, None]
        );
        assert_eq!(
            stored_fingerprint(columns.fingerprints[0].clone()).expect("32 bytes"),
            Some(printed)
        );
        assert!(stored_fingerprint(Some(vec![1, 2])).is_err());
        let returned = vec![
            (uuid::Uuid::from_u128(1), "c".to_owned()),
            (uuid::Uuid::from_u128(2), "c".to_owned()),
        ];
        let outcome = claims.claimed_batch(&keys, returned).expect("valid rows");
        assert_eq!(
            outcome,
            vec![
                Claim::Fresh,
                Claim::Fresh,
                Claim::Duplicate,
                Claim::Duplicate
            ]
        );
        assert_eq!(claims.held(), 2);
        let bad = claims.claimed_batch(&keys, vec![(uuid::Uuid::from_u128(9), String::new())]);
        assert!(bad.is_err());
    }

    #[test]
    fn only_held_keys_may_be_unclaimed() {
        let mut claims = Claims::new();
        assert!(matches!(
            claims.may_unclaim(&key(1)),
            Err(InboxError::InvalidArgument { .. })
        ));
        claims.hold(&key(1));
        claims.may_unclaim(&key(1)).expect("held");
        claims.unclaimed(&key(1));
        assert!(claims.may_unclaim(&key(1)).is_err());
    }

    #[test]
    fn savepoints_defer_release_and_undo_the_held_set() {
        let mut claims = Claims::new();
        claims.hold(&key(1));
        assert_eq!(claims.savepoint_sql(), "SAVEPOINT inbox_savepoint_0");
        claims.savepoint_done();
        claims.hold(&key(2));
        claims.unclaimed(&key(1));
        assert_eq!(
            claims.rollback_to_savepoint_sql().expect("open"),
            "ROLLBACK TO SAVEPOINT inbox_savepoint_0; RELEASE SAVEPOINT inbox_savepoint_0"
        );
        claims.rollback_done();
        assert!(claims.holds(&key(1)) && !claims.holds(&key(2)));
        assert_eq!(claims.savepoint_depth(), 0);

        // A released savepoint rides along with the next one.
        claims.savepoint_done();
        claims.hold(&key(3));
        claims.release_savepoint().expect("open");
        assert!(claims.holds(&key(3)));
        assert_eq!(
            claims.savepoint_sql(),
            "RELEASE SAVEPOINT inbox_savepoint_0; SAVEPOINT inbox_savepoint_0"
        );
        claims.savepoint_done();
        assert_eq!(claims.savepoint_sql(), "SAVEPOINT inbox_savepoint_1");

        // Nested: rolling back the inner savepoint keeps the outer's claims.
        claims.savepoint_done();
        claims.hold(&key(4));
        claims.rollback_done();
        assert!(!claims.holds(&key(4)));
        claims.release_savepoint().expect("outer open");
        assert!(matches!(
            claims.release_savepoint(),
            Err(InboxError::InvalidArgument { .. })
        ));
        assert!(claims.rollback_to_savepoint_sql().is_err());
    }
}
