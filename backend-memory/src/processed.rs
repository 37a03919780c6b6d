//! The per-shard index of processed rows by `processed_at`, for cleanup.

use std::collections::{BTreeSet, VecDeque};

use chrono::{DateTime, Utc};
use inbox_api::InboxKey;

/// One indexed row: when it was processed, and which row.
pub(crate) type Entry = (DateTime<Utc>, InboxKey);

/// Processed rows, oldest first: the memory twin of the SQL partial index on
/// `processed_at`, so cleanup finds its rows without scanning a shard.
///
/// Rows are indexed as they commit, and a clock moves forward, so nearly
/// every new entry is the newest: those are appended to a queue, which
/// costs a move where a B-tree insert (the previous index) cost a descent of
/// some forty comparisons and a tenth of a claim and commit. The others (a
/// commit that finishes after a later-marked one, a clock set back) go to a
/// B-tree beside it. Each part is sorted, so the oldest entry is the older
/// of their two first ones.
#[derive(Debug, Default)]
pub(crate) struct ProcessedIndex {
    /// Sorted by time: each entry is at least as new as the one before it.
    in_order: VecDeque<Entry>,
    /// Entries older than the queue's newest when they came.
    out_of_order: BTreeSet<Entry>,
}

impl ProcessedIndex {
    /// Indexes a row processed at `entry.0`.
    pub(crate) fn insert(&mut self, entry: Entry) {
        match self.in_order.back() {
            Some((newest, _)) if entry.0 < *newest => {
                self.out_of_order.insert(entry);
            }
            _ => self.in_order.push_back(entry),
        }
    }

    /// The oldest entry, if any.
    pub(crate) fn first(&self) -> Option<&Entry> {
        match (self.in_order.front(), self.out_of_order.first()) {
            (Some(queued), Some(sorted)) => Some(if sorted.0 < queued.0 { sorted } else { queued }),
            (queued, sorted) => queued.or(sorted),
        }
    }

    /// Removes and returns the oldest entry, if any.
    pub(crate) fn pop_first(&mut self) -> Option<Entry> {
        match (self.in_order.front(), self.out_of_order.first()) {
            (Some(queued), Some(sorted)) if sorted.0 < queued.0 => self.out_of_order.pop_first(),
            (Some(_), _) => self.in_order.pop_front(),
            (None, _) => self.out_of_order.pop_first(),
        }
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.in_order.len() + self.out_of_order.len()
    }
}

#[cfg(test)]
mod tests {
    use chrono::TimeDelta;
    use inbox_api::{ConsumerName, MessageId};

    use super::*;

    fn entry(second: i64, n: u64) -> Entry {
        let t0 = DateTime::<Utc>::from_timestamp(1_000, 0).unwrap();
        (
            t0 + TimeDelta::seconds(second),
            InboxKey::new(
                MessageId::from_uuid(uuid::Uuid::from_u64_pair(0, n)),
                ConsumerName::new("c").unwrap(),
            ),
        )
    }

    #[test]
    fn pops_oldest_first_whatever_the_insertion_order() {
        let seconds = [5, 3, 7, 7, 1, 9, 2, 8, 8, 0, 6, 4, 10, 3];
        let mut index = ProcessedIndex::default();
        for (n, second) in seconds.iter().enumerate() {
            index.insert(entry(*second, n as u64));
        }
        assert_eq!(index.len(), seconds.len());
        let mut popped = Vec::new();
        while let Some(first) = index.first().cloned() {
            let pop = index.pop_first().unwrap();
            assert_eq!(first, pop, "first() names what pop_first() removes");
            popped.push(pop.0);
        }
        let mut expected: Vec<_> = seconds.iter().map(|s| entry(*s, 0).0).collect();
        expected.sort();
        assert_eq!(popped, expected);
        assert!(index.pop_first().is_none());
    }

    #[test]
    fn a_tie_between_queue_and_tree_is_named_and_popped_alike() {
        let mut index = ProcessedIndex::default();
        index.insert(entry(5, 0));
        index.insert(entry(9, 1));
        index.insert(entry(5, 2)); // older than the newest queued: the tree
        assert_eq!(index.out_of_order.len(), 1);
        for _ in 0..3 {
            let first = index.first().cloned().unwrap();
            assert_eq!(Some(first), index.pop_first());
        }
        assert!(index.first().is_none());
    }

    #[test]
    fn in_order_inserts_stay_out_of_the_tree() {
        let mut index = ProcessedIndex::default();
        for n in 0..100 {
            index.insert(entry(n / 3, n as u64));
        }
        assert_eq!(index.in_order.len(), 100);
        assert!(index.out_of_order.is_empty());
    }
}
