//! A hierarchical free-bit map: the dense store behind small and medium CIDRs.
//!
//! Level 0 holds one bit per address, set while the address is free. Each
//! higher level holds one bit per word of the level below, set while that word
//! has any free bit. Finding the next free address from a position therefore
//! reads at most two words per level (a /8 has four levels) instead of scanning
//! the leaf words, which is what keeps a nearly full pool fast.
//!
//! Padding bits past the end of every level are kept clear, so a search can
//! never return a position outside the map.

/// Bits per word.
const W: usize = u64::BITS as usize;

/// See the module documentation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct FreeBitmap {
    /// Number of positions.
    len: usize,
    /// `levels[0]` is the leaf level; the last level is a single word.
    levels: Vec<Vec<u64>>,
}

impl FreeBitmap {
    /// A map of `len` positions, all free.
    pub(super) fn all_free(len: usize) -> Self {
        let mut levels = Vec::new();
        let mut bits = len;
        loop {
            let words = bits.div_ceil(W).max(1);
            let mut level = vec![u64::MAX; words];
            let tail = bits % W;
            if bits == 0 {
                level[0] = 0;
            } else if tail != 0 {
                level[words - 1] = (1u64 << tail) - 1;
            }
            levels.push(level);
            if words == 1 {
                break;
            }
            bits = words;
        }
        FreeBitmap { len, levels }
    }

    /// Number of positions.
    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// Whether position `i` is free. `i` must be `< len`.
    #[inline]
    pub(super) fn is_free(&self, i: usize) -> bool {
        debug_assert!(i < self.len);
        self.levels[0][i / W] & (1 << (i % W)) != 0
    }

    /// Marks position `i` used. `i` must be `< len` and free.
    #[inline]
    pub(super) fn take(&mut self, i: usize) {
        debug_assert!(self.is_free(i));
        let mut idx = i;
        for level in &mut self.levels {
            let word = &mut level[idx / W];
            *word &= !(1 << (idx % W));
            if *word != 0 {
                return;
            }
            // The word just became full: clear its bit one level up.
            idx /= W;
        }
    }

    /// Marks position `i` free. `i` must be `< len` and used.
    #[inline]
    pub(super) fn put(&mut self, i: usize) {
        debug_assert!(!self.is_free(i));
        let mut idx = i;
        for level in &mut self.levels {
            let word = &mut level[idx / W];
            let was_full = *word == 0;
            *word |= 1 << (idx % W);
            if !was_full {
                return;
            }
            // The word just gained its first free bit: set its bit one level up.
            idx /= W;
        }
    }

    /// The first free position `>= from`, if any.
    #[inline]
    pub(super) fn next_free(&self, from: usize) -> Option<usize> {
        if from >= self.len {
            return None;
        }
        let mut level = 0;
        let mut idx = from;
        // Climb until a word at some level has a candidate at or after `idx`.
        let (word_idx, bits) = loop {
            let words = &self.levels[level];
            let w = idx / W;
            let bits = words.get(w)? & (u64::MAX << (idx % W));
            if bits != 0 {
                break (w, bits);
            }
            level += 1;
            if level == self.levels.len() {
                return None;
            }
            idx = w + 1;
        };
        // Descend along the lowest set bits.
        let mut pos = word_idx * W + bits.trailing_zeros() as usize;
        while level > 0 {
            level -= 1;
            pos = pos * W + self.levels[level][pos].trailing_zeros() as usize;
        }
        Some(pos)
    }

    /// Iterates over the used positions in increasing order.
    pub(super) fn used(&self) -> impl Iterator<Item = usize> + '_ {
        self.levels[0]
            .iter()
            .enumerate()
            .flat_map(move |(w, &word)| {
                let valid = if (w + 1) * W <= self.len {
                    u64::MAX
                } else {
                    (1u64 << (self.len % W)) - 1
                };
                BitIter(!word & valid).map(move |b| w * W + b)
            })
    }

    /// Heap bytes held, for capacity planning and the bench.
    pub(super) fn heap_bytes(&self) -> usize {
        self.levels.iter().map(|l| l.capacity() * 8).sum::<usize>()
            + self.levels.capacity() * size_of::<Vec<u64>>()
    }
}

/// Iterates over the set bits of a word, lowest first.
struct BitIter(u64);

impl Iterator for BitIter {
    type Item = usize;

    fn next(&mut self) -> Option<usize> {
        if self.0 == 0 {
            return None;
        }
        let b = self.0.trailing_zeros() as usize;
        self.0 &= self.0 - 1;
        Some(b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn sizes_and_levels() {
        for len in [0, 1, 63, 64, 65, 4095, 4096, 4097, 1 << 18] {
            let m = FreeBitmap::all_free(len);
            assert_eq!(m.next_free(0), if len == 0 { None } else { Some(0) });
            if len > 0 {
                assert_eq!(m.next_free(len - 1), Some(len - 1));
            }
            assert_eq!(m.next_free(len), None);
            assert_eq!(m.used().count(), 0);
        }
    }

    #[test]
    fn full_map_has_no_free_position() {
        let mut m = FreeBitmap::all_free(4097);
        for i in 0..4097 {
            m.take(i);
        }
        assert_eq!(m.next_free(0), None);
        m.put(4000);
        assert_eq!(m.next_free(0), Some(4000));
        assert_eq!(m.next_free(4001), None);
    }

    proptest! {
        #[test]
        fn next_free_matches_a_linear_scan(
            len in 1usize..20_000,
            ops in proptest::collection::vec((any::<bool>(), any::<usize>()), 0..400),
            probes in proptest::collection::vec(any::<usize>(), 1..20),
        ) {
            let mut m = FreeBitmap::all_free(len);
            let mut model = vec![true; len];
            for (take, i) in ops {
                let i = i % len;
                if take && model[i] {
                    m.take(i);
                    model[i] = false;
                } else if !take && !model[i] {
                    m.put(i);
                    model[i] = true;
                }
            }
            for p in probes {
                let p = p % (len + 1);
                let expected = (p..len).find(|&i| model[i]);
                prop_assert_eq!(m.next_free(p), expected);
            }
            let used: Vec<usize> = m.used().collect();
            let expected: Vec<usize> = (0..len).filter(|&i| !model[i]).collect();
            prop_assert_eq!(used, expected);
        }
    }
}
