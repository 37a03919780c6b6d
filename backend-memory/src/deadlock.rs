//! Deadlock detection between waiting claims, as Postgres does it.
//!
//! A transaction that claims several keys can end up waiting for a key held
//! by a transaction that waits, directly or through others, for one of its
//! own keys. Postgres finds such a cycle and aborts one transaction with
//! `40P01 deadlock_detected`; without that the memory store would hang both
//! forever. Every waiting claim records "I wait for the holder" here, and
//! refuses to wait when that edge would close a cycle.
//!
//! This map is global, but only claims that already have to wait touch it:
//! the uncontended path (a fresh key, a duplicate) never does.

use std::collections::HashMap;
use std::fmt;
use std::sync::Mutex;

use crate::store::lock;

/// Identifies one transaction for the lifetime of its store.
pub(crate) type TxId = u64;

/// Who waits for whom. Each transaction waits for at most one other at a
/// time (a claim borrows its transaction mutably), so the graph is a map
/// from waiter to holder; it is kept acyclic by [`WaitGraph::wait_for`].
#[derive(Debug, Default)]
pub(crate) struct WaitGraph {
    edges: Mutex<HashMap<TxId, TxId>>,
}

impl WaitGraph {
    /// Records that `waiter` is about to wait for `holder`, or reports the
    /// deadlock that waiting would create.
    ///
    /// The check and the insertion happen under one lock, so of two
    /// transactions closing a cycle at the same moment the second one always
    /// sees the first one's edge. An edge to a transaction that has already
    /// ended is harmless: that transaction waits for nobody, so no cycle can
    /// run through it.
    pub(crate) fn wait_for(&self, waiter: TxId, holder: TxId) -> Result<WaitEdge<'_>, Deadlock> {
        let mut edges = lock(&self.edges);
        let mut current = holder;
        // The graph is acyclic, so the chain ends; the bound only guards
        // against a bug turning into an endless loop under a lock.
        for _ in 0..=edges.len() {
            if current == waiter {
                return Err(Deadlock);
            }
            match edges.get(&current) {
                Some(&next) => current = next,
                None => break,
            }
        }
        edges.insert(waiter, holder);
        Ok(WaitEdge {
            graph: self,
            waiter,
        })
    }
}

/// A recorded wait; dropping it (the wait ended, or the waiting future was
/// cancelled) removes the edge.
#[derive(Debug)]
pub(crate) struct WaitEdge<'g> {
    graph: &'g WaitGraph,
    waiter: TxId,
}

impl Drop for WaitEdge<'_> {
    fn drop(&mut self) {
        lock(&self.graph.edges).remove(&self.waiter);
    }
}

/// The error behind [`inbox_api::InboxError::Conflict`] when a claim would
/// wait in a cycle; Postgres reports the same situation as SQLSTATE 40P01.
#[derive(Debug)]
pub(crate) struct Deadlock;

impl fmt::Display for Deadlock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(
            "deadlock detected: this transaction would wait for a key held by a transaction \
             that waits for this one; it was aborted and its claims released",
        )
    }
}

impl std::error::Error for Deadlock {}

/// The error for any use of a transaction after it was aborted by a
/// deadlock (Postgres: 25P02 `in_failed_sql_transaction`). Redelivery
/// starts a new transaction, so it is reported as a retryable conflict.
#[derive(Debug)]
pub(crate) struct Aborted;

impl fmt::Display for Aborted {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("transaction was aborted by a deadlock; roll it back and retry")
    }
}

impl std::error::Error for Aborted {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn direct_cycle_is_refused() {
        let graph = WaitGraph::default();
        let _a_waits_b = graph.wait_for(1, 2).unwrap();
        assert!(graph.wait_for(2, 1).is_err());
    }

    #[test]
    fn long_cycle_is_refused_and_chain_is_not() {
        let graph = WaitGraph::default();
        let _ab = graph.wait_for(1, 2).unwrap();
        let _bc = graph.wait_for(2, 3).unwrap();
        assert!(graph.wait_for(3, 1).is_err());
        let _dc = graph.wait_for(4, 3).unwrap();
    }

    #[test]
    fn ended_wait_removes_its_edge() {
        let graph = WaitGraph::default();
        let edge = graph.wait_for(1, 2).unwrap();
        drop(edge);
        let _ba = graph.wait_for(2, 1).unwrap();
    }
}
