//! Reservation windows (#43): what a node may hand out without asking
//! etcd, published before it hands anything out of it.
//!
//! Why: a node's blocks may be taken from it while it is cut off from etcd
//! (automatically, `reclaim_after` after its lease went; or by an
//! operator's `--force`), and the next holder must not hand out an address
//! the old one still serves. The addresses in use a node published after
//! the fact cannot protect an address acknowledged in the second before
//! the cut, nor one handed out while cut. Asking etcd on every ADD would
//! put a round trip on the pod's path, which cluster mode exists to avoid.
//! So a node publishes a window ahead of need: its addresses in use plus a
//! spare set it may hand out next, sized from demand, extended
//! asynchronously; its allocator hands out only addresses inside the
//! window it has published, cut off or not; a reclaimer reserves the whole
//! window. Once the window is used up while cut off, the node answers "try
//! again" rather than an address outside it.
//!
//! The order that keeps "published ⊇ what may be handed out" true at every
//! crash point (the daemon follows it): a window grows in etcd first, then
//! in the local record, then in the allocator; it shrinks in the allocator
//! and the local record first, then in etcd ([`plan`] never mixes the two
//! in one step).

use std::collections::BTreeSet;
use std::net::IpAddr;

use ipnet::IpNet;

/// How many spare addresses a node keeps in its window per pool and
/// family, beyond those in use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WindowSizing {
    /// At least this many (also with no demand).
    pub min_spare: u64,
    /// At most this many (a burst never reserves a whole pool).
    pub max_spare: u64,
}

impl WindowSizing {
    /// The spare wanted for a pool and family that saw `recent` new
    /// allocations over the demand period: as many, within the bounds.
    #[must_use]
    pub fn spare(&self, recent: u64) -> u64 {
        recent.clamp(self.min_spare, self.max_spare.max(self.min_spare))
    }
}

/// One pool and family of the node, as the allocator sees it now.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GroupView {
    /// The spare wanted ([`WindowSizing::spare`]).
    pub spare: u64,
    /// The free addresses of the window in its serving blocks, in the
    /// order the allocator hands them out.
    pub free_in_window: Vec<IpAddr>,
    /// Free addresses of its serving blocks outside the window, in the
    /// order the allocator would hand them out next (at least as many as
    /// the spare, when the blocks have them).
    pub candidates: Vec<IpAddr>,
}

/// What to do with the published window.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WindowStep {
    /// Nothing.
    Keep,
    /// Publish this larger window (a superset), then record and serve it.
    Grow(BTreeSet<IpAddr>),
    /// Serve and record this smaller window (a subset), then publish it.
    Shrink(BTreeSet<IpAddr>),
}

/// The next step for a node's window.
///
/// - Every address in use (inside a held block, by any holder) is in the
///   window: one missing (an allocation older than windows, or restored)
///   is added at once.
/// - A group whose free addresses in the window fall below half its spare
///   grows to its spare, with the next candidates.
/// - Otherwise the window sheds what it need not keep: addresses outside
///   every held block that are not in use (a block given back or
///   forgotten), and a group's free addresses beyond twice its spare (kept:
///   the first `spare` in allocation order).
#[must_use]
pub fn plan(
    published: &BTreeSet<IpAddr>,
    in_use: &BTreeSet<IpAddr>,
    held: &[IpNet],
    groups: &[GroupView],
) -> WindowStep {
    let mut add: BTreeSet<IpAddr> = in_use.difference(published).copied().collect();
    for g in groups {
        let have = g.free_in_window.len() as u64;
        if have < g.spare.div_ceil(2) {
            let want = usize::try_from(g.spare - have).unwrap_or(usize::MAX);
            add.extend(
                g.candidates
                    .iter()
                    .filter(|a| !published.contains(a))
                    .take(want),
            );
        }
    }
    if !add.is_empty() {
        let mut grown = published.clone();
        grown.extend(add);
        return WindowStep::Grow(grown);
    }
    let mut drop: BTreeSet<IpAddr> = published
        .iter()
        .filter(|a| !in_use.contains(a) && !held.iter().any(|b| b.contains(*a)))
        .copied()
        .collect();
    for g in groups {
        if g.free_in_window.len() as u64 > g.spare.saturating_mul(2) {
            let keep = usize::try_from(g.spare).unwrap_or(usize::MAX);
            drop.extend(g.free_in_window.iter().skip(keep).copied());
        }
    }
    drop.retain(|a| !in_use.contains(a));
    if drop.is_empty() {
        WindowStep::Keep
    } else {
        WindowStep::Shrink(published.difference(&drop).copied().collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn a(i: u8) -> IpAddr {
        IpAddr::from([10, 0, 0, i])
    }

    fn set(v: &[u8]) -> BTreeSet<IpAddr> {
        v.iter().map(|i| a(*i)).collect()
    }

    fn block() -> Vec<IpNet> {
        vec!["10.0.0.0/24".parse().unwrap()]
    }

    #[test]
    fn an_empty_window_grows_to_the_spare_with_the_next_candidates() {
        let g = GroupView {
            spare: 4,
            free_in_window: vec![],
            candidates: (1..=10).map(a).collect(),
        };
        assert_eq!(
            plan(&BTreeSet::new(), &BTreeSet::new(), &block(), &[g]),
            WindowStep::Grow(set(&[1, 2, 3, 4]))
        );
    }

    #[test]
    fn an_address_in_use_outside_the_window_is_added_at_once() {
        let g = GroupView {
            spare: 4,
            free_in_window: (1..=4).map(a).collect(),
            candidates: vec![],
        };
        assert_eq!(
            plan(&set(&[1, 2, 3, 4]), &set(&[9]), &block(), &[g]),
            WindowStep::Grow(set(&[1, 2, 3, 4, 9]))
        );
    }

    #[test]
    fn it_grows_below_half_its_spare_and_sheds_past_twice() {
        // Half the spare left: kept.
        let g = GroupView {
            spare: 4,
            free_in_window: vec![a(3), a(4)],
            candidates: (5..=10).map(a).collect(),
        };
        assert_eq!(
            plan(
                &set(&[1, 2, 3, 4]),
                &set(&[1, 2]),
                &block(),
                std::slice::from_ref(&g)
            ),
            WindowStep::Keep
        );
        // One left: grows by three (back to the spare).
        let g = GroupView {
            free_in_window: vec![a(4)],
            ..g
        };
        assert_eq!(
            plan(&set(&[1, 2, 3, 4]), &set(&[1, 2, 3]), &block(), &[g]),
            WindowStep::Grow(set(&[1, 2, 3, 4, 5, 6, 7]))
        );
        // Nine free (the pods went): shed to the spare, the first ones kept.
        let g = GroupView {
            spare: 4,
            free_in_window: (2..=10).map(a).collect(),
            candidates: vec![],
        };
        assert_eq!(
            plan(
                &set(&[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]),
                &set(&[1]),
                &block(),
                &[g]
            ),
            WindowStep::Shrink(set(&[1, 2, 3, 4, 5]))
        );
    }

    #[test]
    fn addresses_of_a_block_no_longer_held_go_unless_in_use() {
        let held: Vec<IpNet> = vec!["10.0.1.0/24".parse().unwrap()];
        let window = set(&[1, 2, 3]);
        assert_eq!(
            plan(&window, &set(&[2]), &held, &[]),
            WindowStep::Shrink(set(&[2]))
        );
    }

    proptest! {
        #![proptest_config(crate::testing::cases(256))]

        /// Whatever the state: a grown window contains the old one and
        /// every address in use; a shrunk one is inside the old one and
        /// still contains every address in use.
        #[test]
        fn a_window_never_loses_an_address_in_use_and_grows_or_shrinks_whole(
            published in proptest::collection::btree_set(0u8..40, 0..30),
            in_use in proptest::collection::btree_set(0u8..40, 0..20),
            spare in 0u64..12,
            candidates in proptest::collection::vec(0u8..60, 0..20),
        ) {
            let published: BTreeSet<IpAddr> = published.into_iter().map(a).collect();
            let in_use: BTreeSet<IpAddr> = in_use.into_iter().map(a).collect();
            let free_in_window: Vec<IpAddr> =
                published.iter().filter(|x| !in_use.contains(x)).copied().collect();
            let candidates: Vec<IpAddr> = candidates.into_iter().map(a).collect();
            let g = GroupView { spare, free_in_window, candidates };
            let held: Vec<IpNet> = vec!["10.0.0.0/27".parse().unwrap()];
            match plan(&published, &in_use, &held, &[g]) {
                WindowStep::Keep => prop_assert!(in_use.is_subset(&published)),
                WindowStep::Grow(w) => {
                    prop_assert!(published.is_subset(&w) && in_use.is_subset(&w));
                    prop_assert!(w != published);
                }
                WindowStep::Shrink(w) => {
                    prop_assert!(w.is_subset(&published) && in_use.is_subset(&w));
                    prop_assert!(w != published);
                }
            }
        }
    }
}
