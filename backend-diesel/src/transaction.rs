//! One open transaction on one pooled connection.

use async_trait::async_trait;
use deadpool::managed::Object;

use std::sync::Arc;

use diesel::sql_types::{Text, Uuid};
use diesel_async::{
    AnsiTransactionManager, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection,
    TransactionManager,
};
use inbox_api::{BatchTransaction, Claim, FirstStep, InboxError, InboxKey, InboxTransaction};
use inbox_postgres::{Claims, Layout, SavepointDriver, Statements};

use crate::error::{classify, is_unrecognised};
use crate::statements::{ClaimBatch, ClaimOne};

pub(crate) use crate::store::PooledConnection as Pooled;

/// An open PostgreSQL transaction holding one pooled connection.
///
/// The consumer's business writes go through [`DieselTransaction::conn`], on
/// the same connection and inside the same transaction as the claim, so they
/// commit or vanish together with it.
///
/// # Dropped without commit
///
/// Drop cannot run async code, so it cannot send `ROLLBACK`. Handing the
/// connection back to the pool as it is would be wrong twice over:
/// diesel-async's deadpool manager only inspects a connection when it is
/// checked out again (its `recycle` then discards one whose transaction
/// manager is still inside a transaction), so until some later checkout
/// happens to pick it, the connection sits idle *in* the transaction and
/// keeps the claim's row lock. A redelivery of the same message on another
/// connection would wait on that lock indefinitely. So Drop detaches the
/// connection from the pool ([`deadpool::managed::Object::take`]) and closes
/// it: PostgreSQL rolls back a transaction whose client went away and
/// releases its locks at once, and the pool opens a new connection in the
/// freed slot on demand. A cancel request is sent too, in case a statement
/// was still running (see `Drop`). The connection is also closed when
/// commit or rollback fails, since its state is unknown then.
pub struct DieselTransaction {
    /// `Some` for the whole life of the value; `None` only inside
    /// commit/rollback/drop, after the connection was handed back or closed.
    conn: Option<Pooled>,
    /// The keys it holds and its savepoints.
    pub(crate) claims: Claims,
    /// The store's layout, for its claim statements.
    layout: Layout,
    /// The store's statements (its schema qualified).
    statements: Arc<Statements>,
}

impl std::fmt::Debug for DieselTransaction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DieselTransaction")
            .field("open", &self.conn.is_some())
            .field("claimed", &self.claims.held())
            .field("savepoints", &self.claims.savepoint_depth())
            .finish()
    }
}

impl DieselTransaction {
    /// Wraps a connection on which `BEGIN` succeeded.
    pub(crate) fn new(conn: Pooled, layout: Layout, statements: Arc<Statements>) -> Self {
        Self {
            conn: Some(conn),
            claims: Claims::new(),
            layout,
            statements,
        }
    }

    /// The store's statements.
    pub(crate) fn statements(&self) -> Arc<Statements> {
        Arc::clone(&self.statements)
    }

    /// The connection, inside the open transaction, for the consumer's
    /// business writes.
    ///
    /// Use diesel-async's `RunQueryDsl` with it. A nested
    /// `conn.transaction(..)` becomes a savepoint of this transaction. Do not
    /// commit or roll back the outer transaction through it: use
    /// [`InboxTransaction::commit`] / [`InboxTransaction::rollback`], which
    /// also decide what happens to the connection.
    pub fn conn(&mut self) -> &mut AsyncPgConnection {
        match self.conn.as_mut() {
            Some(conn) => conn,
            // commit/rollback consume `self`, so no caller can observe it.
            None => unreachable!("DieselTransaction used after it ended"),
        }
    }

    /// How deep the transaction manager thinks it is (1 = only ours).
    fn depth(&mut self) -> Option<u32> {
        AnsiTransactionManager::transaction_manager_status_mut(self.conn())
            .transaction_depth()
            .ok()
            .flatten()
            .map(std::num::NonZeroU32::get)
    }

    /// Hands the connection back to the pool once its transaction ended;
    /// closes it if the transaction manager disagrees.
    fn release(&mut self) {
        if self.depth().is_some() {
            self.discard();
        } else {
            drop(self.conn.take());
        }
    }

    /// Closes the connection instead of pooling it (see the type's docs).
    fn discard(&mut self) {
        if let Some(conn) = self.conn.take() {
            drop(Object::take(conn));
        }
    }

    /// Classifies an error of one of our own statements; when the error is
    /// not recognised, a probe tells a dead connection (retryable) from a
    /// real failure.
    pub(crate) async fn refine(&mut self, error: diesel::result::Error) -> InboxError {
        refine(self.conn(), error).await
    }
}

/// See [`DieselTransaction::refine`].
pub(crate) async fn refine(
    conn: &mut AsyncPgConnection,
    error: diesel::result::Error,
) -> InboxError {
    let classified = classify(error);
    if !is_unrecognised(&classified) {
        return classified;
    }
    match diesel::sql_query("SELECT 1")
        .execute(conn)
        .await
        .map_err(classify)
    {
        Err(InboxError::Connection { .. }) => InboxError::Connection {
            source: Box::new(classified),
        },
        _ => classified,
    }
}

impl Drop for DieselTransaction {
    fn drop(&mut self) {
        let Some(conn) = self.conn.take() else {
            return;
        };
        tracing::debug!(
            claimed = self.claims.held(),
            "inbox transaction dropped without commit: closing its connection"
        );
        // Dropped while the server may still be executing a statement (a
        // timeout around `Inbox::handle` fired during a slow query or a lock
        // wait): closing the socket alone is not enough, because PostgreSQL
        // only notices a vanished client when it next talks to it, and until
        // then the statement runs on and the claim's lock stays held. A
        // cancel request stops the statement at once; to a session that is
        // idle the server ignores it. It needs a task, hence a runtime.
        let cancel = conn.cancel_token();
        drop(Object::take(conn));
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                if let Err(error) = cancel.cancel_query(tokio_postgres::NoTls).await {
                    tracing::debug!(%error, "cancel request for a dropped transaction failed");
                }
            });
        }
    }
}

#[async_trait]
impl SavepointDriver for DieselTransaction {
    fn claims(&mut self) -> &mut Claims {
        &mut self.claims
    }

    /// These savepoints bypass diesel's transaction manager on purpose: its
    /// depth stays 1, so a `conn.transaction(..)` in the consumer's work
    /// still nests as `diesel_savepoint_1` inside them (the names differ,
    /// and SQL savepoints nest by time, not by name), and `commit` still
    /// finds the depth it expects. COMMIT releases whatever is still open.
    async fn send_simple(&mut self, sql: String) -> Result<(), InboxError> {
        match self.conn().batch_execute(&sql).await {
            Ok(()) => Ok(()),
            Err(error) => Err(self.refine(error).await),
        }
    }
}

impl DieselTransaction {
    /// Opens a transaction on `conn` and claims `key` in one round trip:
    /// [`inbox_postgres::sql::BEGIN_PIPELINED`] (with the bounds' `SET
    /// LOCAL`: `begin`) and the pipelined claim
    /// ([`inbox_postgres::sql::CLAIM_PIPELINED`]) go out together. tokio-postgres pipelines
    /// the queries of futures polled concurrently, in the order they are
    /// first polled, and `join` polls BEGIN first, so the server runs BEGIN,
    /// then the claim inside its transaction. Were BEGIN to fail, the claim
    /// would run alone and its guard would keep it from writing; BEGIN's
    /// error is what is reported then.
    ///
    /// Per message this saves the round trip that separates the inbox from
    /// a bare transaction (BEGIN, write, COMMIT); the claim itself (its
    /// lock wait, `Duplicate`, its crash points) is the same statement's.
    pub(crate) async fn begin_claim(
        conn: Pooled,
        layout: Layout,
        statements: Arc<Statements>,
        begin: &str,
        key: &InboxKey,
    ) -> Result<(Self, Claim), (FirstStep, InboxError)> {
        // Owned from the start: dropped midway (a timeout around the
        // handler), the transaction closes the connection like any other.
        let mut tx = Self::new(conn, layout, Arc::clone(&statements));
        let shared: &AsyncPgConnection = tx.conn();
        let begin = async move {
            let mut conn = shared;
            conn.batch_execute(begin).await
        };
        let claim = async move {
            let mut conn = shared;
            ClaimOne::new(&statements.claim_pipelined, key)
                .execute(&mut conn)
                .await
        };
        let (begun, claimed) = futures::future::join(begin, claim).await;
        if let Err(error) = begun {
            let error = tx.refine(error).await;
            tx.discard();
            return Err((FirstStep::Begin, error));
        }
        // BEGIN went around diesel's transaction manager: tell it, so that
        // commit, rollback and the work's nested transactions see depth 1.
        let entered = AnsiTransactionManager::transaction_manager_status_mut(tx.conn())
            .transaction_state()
            .and_then(|state| {
                state.change_transaction_depth(
                    diesel::connection::TransactionDepthChange::IncreaseDepth,
                )
            });
        if let Err(error) = entered {
            tx.discard();
            return Err((FirstStep::Begin, classify(error)));
        }
        match tx.claimed(key, claimed).await {
            Ok(claim) => Ok((tx, claim)),
            Err(error) => Err((FirstStep::Claim, error)),
        }
    }

    /// The claim's outcome from its statement's result.
    async fn claimed(
        &mut self,
        key: &InboxKey,
        result: diesel::QueryResult<usize>,
    ) -> Result<Claim, InboxError> {
        match result {
            Ok(rows) => self
                .claims
                .claimed(key, u64::try_from(rows).unwrap_or(u64::MAX)),
            Err(error) => {
                let sqlstate = crate::error::sqlstate(&error);
                match self
                    .layout
                    .claim_failure(sqlstate, &key.message_id, chrono::Utc::now())
                {
                    Some(mapped) => Err(mapped),
                    None => Err(self.refine(error).await),
                }
            }
        }
    }
}

#[async_trait]
impl InboxTransaction for DieselTransaction {
    /// `INSERT … ON CONFLICT DO NOTHING`: one statement, atomic. One row
    /// inserted → `Fresh` (and the row lock makes concurrent claims of the
    /// key wait for this transaction); none → a committed row (or this
    /// transaction's own) exists → `Duplicate`. A unique violation can never
    /// surface, so a duplicate is never an error.
    ///
    /// The row carries `processed_at = CURRENT_TIMESTAMP` (PostgreSQL's
    /// `now()`, the transaction's start): it becomes visible only at COMMIT,
    /// together with the work, so a committed row is a processed message.
    async fn claim(&mut self, key: &InboxKey) -> Result<Claim, InboxError> {
        let statements = self.statements();
        let claimed = ClaimOne::new(&statements.claim, key)
            .execute(self.conn())
            .await;
        self.claimed(key, claimed).await
    }

    async fn commit(mut self) -> Result<(), InboxError> {
        if self.depth() != Some(1) {
            // COMMIT would only release the consumer's savepoint and leave
            // the claim's transaction open.
            self.discard();
            return Err(InboxError::Store {
                retryable: false,
                source: "commit with an unbalanced nested transaction: the consumer's \
                         work began a savepoint by hand and did not end it"
                    .into(),
            });
        }
        // If this future is dropped mid-COMMIT, `self` drops with it and the
        // connection is closed: the outcome is then unknown, as it is for
        // any lost COMMIT, and redelivery resolves it.
        match AnsiTransactionManager::commit_transaction(self.conn()).await {
            Ok(()) => {
                self.release();
                Ok(())
            }
            Err(error) => {
                let error = classify(error);
                tracing::debug!(error = %error, "commit failed: closing the connection");
                self.discard();
                Err(error)
            }
        }
    }

    async fn rollback(mut self) -> Result<(), InboxError> {
        if self.depth() != Some(1) {
            // Rolling back one savepoint would leave the transaction open;
            // closing the connection rolls all of it back.
            self.discard();
            return Ok(());
        }
        match AnsiTransactionManager::rollback_transaction(self.conn()).await {
            Ok(()) => {
                self.release();
                Ok(())
            }
            Err(error) => {
                // The server rolls back when the connection closes.
                self.discard();
                Err(classify(error))
            }
        }
    }
}

#[async_trait]
impl BatchTransaction for DieselTransaction {
    /// One statement for the whole batch (`INSERT … SELECT unnest(…)`): the
    /// keys sorted in SQL, so overlapping batches lock in one order,
    /// whichever backend runs them.
    async fn claim_batch(&mut self, keys: &[InboxKey]) -> Result<Vec<Claim>, InboxError> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let statements = self.statements();
        let inserted = ClaimBatch::of(&statements.claim_batch, keys)
            .load::<(uuid::Uuid, String)>(self.conn())
            .await;
        match inserted {
            Ok(rows) => self.claims.claimed_batch(keys, rows),
            Err(error)
                if self
                    .layout
                    .batch_claim_refused_a_key(crate::error::sqlstate(&error)) =>
            {
                Err(InboxError::KeyRefusedInBatch {
                    source: Box::new(error),
                })
            }
            Err(error) => Err(self.refine(error).await),
        }
    }

    inbox_postgres::savepoint_methods!();

    async fn unclaim(&mut self, key: &InboxKey) -> Result<(), InboxError> {
        self.claims.may_unclaim(key)?;
        let statements = self.statements();
        let deleted = diesel::sql_query(&statements.unclaim)
            .bind::<Uuid, _>(key.message_id.as_uuid())
            .bind::<Text, _>(key.consumer.as_str())
            .execute(self.conn())
            .await;
        if let Err(error) = deleted {
            return Err(self.refine(error).await);
        }
        self.claims.unclaimed(key);
        Ok(())
    }
}
