//! Rendezvous ranks of an address among the members, without sorting
//! them (#47 item 2).
//!
//! Why a module: the announcer asks two things of an address's ranking,
//! this node's place in it and its first choice, once per held address
//! and per view (every membership change). Sorting every admitted
//! member for that cost O(M log M) and an allocation per address: at
//! 5,000 members and a few hundred addresses, a membership change cost
//! every holder milliseconds. Both answers come from one pass over the
//! members with no allocation: the place is how many distinct admitted
//! members outrank this node, the first choice the highest-weighted one.
//! The whole sort stays, in the tests, as the definition they are held
//! to. The announcer keeps these answers from one read to the next
//! (`standing`), and uses the passes here for what it must work out
//! whole: a new address, a first choice that left.

use std::net::IpAddr;

use super::super::LabelSelector;
use super::super::cluster::{Candidate, weight};
use super::super::members::Members;

/// Whether membership `c` may announce an address whose pool selects
/// nodes with `sel`: it answers, and the selector (empty: every node)
/// admits its labels.
pub(super) fn admits(c: &Candidate, sel: &LabelSelector) -> bool {
    c.answers && (sel.is_empty() || sel.matches(&c.labels))
}

/// The distinct admitted members of `a`, each once (a node may be a
/// member under two leases while one replaces the other: it counts if
/// either membership is admitted). Members are ordered by name, so a
/// node's memberships come together.
fn admitted<'m>(
    members: &'m Members,
    sel: &'m LabelSelector,
) -> impl Iterator<Item = &'m str> + 'm {
    let mut last: Option<&str> = None;
    members
        .iter()
        .map(|(c, _)| c)
        .filter(move |c| admits(c, sel))
        .filter_map(move |c| {
            let name = c.name.as_str();
            (last != Some(name)).then(|| {
                last = Some(name);
                name
            })
        })
}

/// `me`'s place in `a`'s ranking (0: the first choice) and the ranking's
/// length; `None` when `me` is not an admitted member. One pass, no
/// allocation. (The announcer keeps places from read to read, `standing`;
/// this is what that is held to.)
#[cfg(test)]
pub(super) fn place(
    members: &Members,
    a: IpAddr,
    sel: &LabelSelector,
    me: &str,
) -> Option<(usize, usize)> {
    let c = counts(members, a, sel, me);
    c.me_in.then_some((c.above, c.len))
}

/// What one pass over the members says of `me` in `a`'s ranking.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Counts {
    /// Whether `me` is an admitted member.
    pub me_in: bool,
    /// How many other admitted members outrank `me`.
    pub above: usize,
    /// How many distinct admitted members there are.
    pub len: usize,
}

/// [`Counts`] of `me` in `a`'s ranking: one pass, no allocation.
pub(super) fn counts(members: &Members, a: IpAddr, sel: &LabelSelector, me: &str) -> Counts {
    let mine = (weight(a, me), me);
    let mut c = Counts {
        me_in: false,
        above: 0,
        len: 0,
    };
    for name in admitted(members, sel) {
        c.len += 1;
        if name == me {
            c.me_in = true;
        } else if (weight(a, name), name) > mine {
            c.above += 1;
        }
    }
    c
}

/// `a`'s first choice: the admitted member of the highest rendezvous
/// weight (ties to the greater name, as the ranking orders them).
pub(super) fn top<'m>(members: &'m Members, a: IpAddr, sel: &'m LabelSelector) -> Option<&'m str> {
    admitted(members, sel)
        .map(|name| (weight(a, name), name))
        .max()
        .map(|(_, name)| name)
}

/// Whether `node` is an admitted member (under any of its memberships).
pub(super) fn is_admitted(members: &Members, node: &str, sel: &LabelSelector) -> bool {
    members.of(node).any(|(c, _)| admits(c, sel))
}

/// The whole ranking of `a`: every distinct admitted member, best
/// rendezvous weight first. The definition [`place`] and [`top`] are
/// held to.
#[cfg(test)]
pub(super) fn ranking<'m>(members: &'m Members, a: IpAddr, sel: &LabelSelector) -> Vec<&'m str> {
    let mut r: Vec<(u64, &str)> = members
        .iter()
        .map(|(c, _)| c)
        .filter(|c| admits(c, sel))
        .map(|c| (weight(a, &c.name), c.name.as_str()))
        .collect();
    r.sort_unstable_by(|x, y| y.cmp(x));
    r.dedup_by(|x, y| x.1 == y.1);
    r.into_iter().map(|(_, n)| n).collect()
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::net::Ipv4Addr;

    use proptest::prelude::*;

    use super::*;

    /// Members drawn from `picks`: (node 0..8, lease 0..3, label 0..3,
    /// answers).
    fn members(picks: &[(u8, u8, u8, bool)]) -> Members {
        let mut m = Members::new();
        for &(node, lease, label, answers) in picks {
            m.insert(
                Candidate {
                    name: format!("node-{node}"),
                    labels: BTreeMap::from([("zone".to_string(), format!("z{label}"))]),
                    answers,
                },
                i64::from(lease),
            );
        }
        m
    }

    fn selector(zone: Option<u8>) -> LabelSelector {
        let mut s = LabelSelector::default();
        if let Some(z) = zone {
            s.match_labels.insert("zone".into(), format!("z{z}"));
        }
        s
    }

    proptest! {
        #![proptest_config(crate::testing::cases(512))]

        /// The one-pass place and first choice are what the whole ranking
        /// says, for every node, with nodes under two leases, some not
        /// answering and selectors admitting some.
        #[test]
        fn place_and_top_are_the_whole_rankings(
            picks in proptest::collection::vec((0u8..8, 0u8..3, 0u8..3, any::<bool>()), 0..24),
            zone in proptest::option::of(0u8..3),
            last in any::<u8>(),
        ) {
            let m = members(&picks);
            let sel = selector(zone);
            let a = IpAddr::V4(Ipv4Addr::new(192, 0, 2, last));
            let rank = ranking(&m, a, &sel);
            prop_assert_eq!(top(&m, a, &sel), rank.first().copied());
            for node in 0..9u8 {
                let me = format!("node-{node}");
                let fresh = rank.iter().position(|n| *n == me).map(|p| (p, rank.len()));
                prop_assert_eq!(place(&m, a, &sel, &me), fresh);
                prop_assert_eq!(is_admitted(&m, &me, &sel), rank.contains(&me.as_str()));
            }
        }
    }
}
