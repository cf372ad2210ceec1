//! A set of used offsets stored as disjoint, non-adjacent inclusive runs: the
//! sparse store behind huge (IPv6) CIDRs.
//!
//! Memory grows with the number of runs, never with the size of the CIDR, so a
//! /64 holding a few allocations costs a few hundred bytes. Because runs are
//! kept merged, the first free offset at or after a position is either that
//! position or one past the end of the run covering it: one `O(log n)` lookup.

use std::collections::BTreeMap;

/// See the module documentation.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct RunSet {
    /// Run start → run end (inclusive). Runs never overlap or touch.
    runs: BTreeMap<u128, u128>,
}

impl RunSet {
    /// The run containing `x`, if any.
    fn run_of(&self, x: u128) -> Option<(u128, u128)> {
        let (&s, &e) = self.runs.range(..=x).next_back()?;
        (e >= x).then_some((s, e))
    }

    /// Whether `x` is in the set.
    pub(super) fn contains(&self, x: u128) -> bool {
        self.run_of(x).is_some()
    }

    /// Adds `x`, which must not be in the set.
    pub(super) fn insert(&mut self, x: u128) {
        debug_assert!(!self.contains(x));
        let left = x
            .checked_sub(1)
            .and_then(|p| self.run_of(p))
            .map(|(s, _)| s);
        let right_end = x.checked_add(1).and_then(|n| self.runs.remove(&n));
        let start = left.unwrap_or(x);
        self.runs.insert(start, right_end.unwrap_or(x));
    }

    /// Removes `x`, which must be in the set.
    pub(super) fn remove(&mut self, x: u128) {
        let (s, e) = self.run_of(x).expect("removed offset is in the set");
        if s < x {
            self.runs.insert(s, x - 1);
        } else {
            self.runs.remove(&s);
        }
        if x < e {
            self.runs.insert(x + 1, e);
        }
    }

    /// The first offset `>= from` and `<= limit` that is not in the set.
    pub(super) fn next_free(&self, from: u128, limit: u128) -> Option<u128> {
        let candidate = match self.run_of(from) {
            Some((_, e)) => e.checked_add(1)?,
            None => from,
        };
        (candidate <= limit).then_some(candidate)
    }

    /// Iterates over the members in increasing order.
    pub(super) fn iter(&self) -> impl Iterator<Item = u128> + '_ {
        self.runs.iter().flat_map(|(&s, &e)| s..=e)
    }

    /// Number of runs (for memory estimates and tests).
    pub(super) fn runs(&self) -> usize {
        self.runs.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeSet;

    proptest! {
        #[test]
        fn behaves_like_a_set(ops in proptest::collection::vec((any::<bool>(), 0u128..64), 0..300)) {
            let mut set = RunSet::default();
            let mut model = BTreeSet::new();
            for (ins, x) in ops {
                if ins && !model.contains(&x) {
                    set.insert(x);
                    model.insert(x);
                } else if !ins && model.contains(&x) {
                    set.remove(x);
                    model.remove(&x);
                }
                // Runs stay merged: no two runs touch.
                let runs: Vec<_> = set.runs.iter().map(|(&s, &e)| (s, e)).collect();
                for pair in runs.windows(2) {
                    prop_assert!(pair[0].1 + 1 < pair[1].0);
                }
            }
            prop_assert_eq!(set.iter().collect::<BTreeSet<_>>(), model.clone());
            for from in 0u128..66 {
                let expected = (from..=65).find(|x| !model.contains(x));
                prop_assert_eq!(set.next_free(from, 65), expected);
            }
        }
    }

    #[test]
    fn edges_of_the_offset_space() {
        let mut set = RunSet::default();
        set.insert(u128::MAX);
        set.insert(u128::MAX - 1);
        assert_eq!(set.runs(), 1);
        assert_eq!(set.next_free(u128::MAX - 1, u128::MAX), None);
        set.insert(0);
        assert_eq!(set.next_free(0, 10), Some(1));
        set.remove(u128::MAX);
        assert_eq!(set.next_free(u128::MAX - 1, u128::MAX), Some(u128::MAX));
    }
}
