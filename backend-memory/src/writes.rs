//! A transaction's buffered business writes.

use smallvec::SmallVec;

use crate::store::{Map, Write};

/// Up to this many distinct keys are kept in a vector searched linearly;
/// past it, in a map. A message's work writes a key or two, for which a
/// map's table is an allocation and a hash per access; a batch of hundreds
/// must not search a list.
const FEW: usize = 8;

/// What a transaction will write at commit: key → value, or `None` for a
/// delete. One entry per key, the last write winning.
#[derive(Clone, Debug)]
pub(crate) enum Writes {
    /// Up to [`FEW`] keys; the first two without any allocation.
    Few(SmallVec<[(String, Write); 2]>),
    /// More keys.
    Many(Map<String, Write>),
}

impl Default for Writes {
    fn default() -> Self {
        Self::Few(SmallVec::new())
    }
}

impl Writes {
    /// Buffers `value` under `key`, replacing an earlier write of `key`.
    pub(crate) fn insert(&mut self, key: String, value: Write) {
        match self {
            Self::Few(list) => {
                if let Some(slot) = list.iter_mut().find(|(k, _)| *k == key) {
                    slot.1 = value;
                } else if list.len() < FEW {
                    list.push((key, value));
                } else {
                    let mut map: Map<String, Write> = std::mem::take(list).into_iter().collect();
                    map.insert(key, value);
                    *self = Self::Many(map);
                }
            }
            Self::Many(map) => {
                map.insert(key, value);
            }
        }
    }

    /// The buffered write of `key`, if any.
    pub(crate) fn get(&self, key: &str) -> Option<&Write> {
        match self {
            Self::Few(list) => list.iter().find(|(k, _)| k == key).map(|(_, v)| v),
            Self::Many(map) => map.get(key),
        }
    }

    /// How many keys are written.
    pub(crate) fn len(&self) -> usize {
        match self {
            Self::Few(list) => list.len(),
            Self::Many(map) => map.len(),
        }
    }

    /// Forgets every write.
    pub(crate) fn clear(&mut self) {
        *self = Self::default();
    }
}

impl IntoIterator for Writes {
    type Item = (String, Write);
    type IntoIter = IntoIter;

    fn into_iter(self) -> IntoIter {
        match self {
            Self::Few(list) => IntoIter::Few(list.into_iter()),
            Self::Many(map) => IntoIter::Many(map.into_iter()),
        }
    }
}

/// The writes, consumed (in no particular order).
pub(crate) enum IntoIter {
    Few(smallvec::IntoIter<[(String, Write); 2]>),
    Many(std::collections::hash_map::IntoIter<String, Write>),
}

impl Iterator for IntoIter {
    type Item = (String, Write);

    fn next(&mut self) -> Option<Self::Item> {
        match self {
            Self::Few(iter) => iter.next(),
            Self::Many(iter) => iter.next(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn last_write_wins_below_and_above_the_switch_to_a_map() {
        for keys in [1, FEW, FEW + 1, 3 * FEW] {
            let mut writes = Writes::default();
            for round in 0..2_u8 {
                for k in 0..keys {
                    let value = (k % 3 != 0).then(|| vec![round]);
                    writes.insert(format!("k{k}"), value);
                }
            }
            assert_eq!(writes.len(), keys);
            assert_eq!(matches!(writes, Writes::Many(_)), keys > FEW);
            assert_eq!(writes.get("k0"), Some(&None), "a delete is a write");
            if keys > 1 {
                assert_eq!(writes.get("k1"), Some(&Some(vec![1])));
            }
            assert_eq!(writes.get("absent"), None);
            let mut all: Vec<_> = writes.clone().into_iter().collect();
            all.sort();
            assert_eq!(all.len(), keys);
            assert!(
                all.windows(2).all(|w| w[0].0 != w[1].0),
                "one entry per key"
            );
            writes.clear();
            assert_eq!(writes.len(), 0);
        }
    }
}
