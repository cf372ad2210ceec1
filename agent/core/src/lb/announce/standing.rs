//! Each address's ranking, as this node's announcer needs it, kept from
//! one read of `lb/` to the next by the memberships that changed (#47
//! item 2).
//!
//! Why: the announcer asks of every address its first choice (to find a
//! misplaced one to rebalance) and this node's place (to time a take).
//! Worked out from the members ([`rank`](super::rank)), each answer is a
//! pass over every member, so each read after a membership change cost a
//! holder O(addresses × members): at 5,000 members and 1,000 addresses,
//! millions of hashes on every node holding an address, for one node
//! come or gone. Kept here, a read costs O(addresses × changed nodes),
//! plus one pass for an address whose first choice left. The one-pass
//! functions of [`rank`](super::rank) are what the property test holds
//! this to.

use std::collections::BTreeMap;
use std::net::IpAddr;

use super::super::LabelSelector;
use super::super::cluster::{Candidate, weight};
use super::super::members::Members;
use super::Observation;
use super::rank;

/// One address's ranking, for this node.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Standing {
    /// The pool's node selector the standing was made under.
    sel: LabelSelector,
    /// This node's rendezvous weight for the address.
    mine: u64,
    /// Whether this node is an admitted member.
    me_in: bool,
    /// How many other admitted members outrank this node.
    above: usize,
    /// How many distinct admitted members there are.
    len: usize,
    /// The first choice: the admitted member of the highest weight (ties
    /// to the greater name).
    top: Option<(u64, String)>,
}

impl Standing {
    /// Worked out whole from `members` (one pass).
    fn whole(members: &Members, a: IpAddr, sel: &LabelSelector, me: &str) -> Self {
        let c = rank::counts(members, a, sel, me);
        Standing {
            sel: sel.clone(),
            mine: weight(a, me),
            me_in: c.me_in,
            above: c.above,
            len: c.len,
            top: rank::top(members, a, sel).map(|n| (weight(a, n), n.to_owned())),
        }
    }

    /// `node` admitted now (`came`) or no longer: the counts and the first
    /// choice follow; `false` when the first choice left (a pass finds
    /// the next).
    fn moved(&mut self, a: IpAddr, node: &str, me: &str, came: bool) -> bool {
        let w = weight(a, node);
        if node == me {
            self.me_in = came;
        } else if (w, node) > (self.mine, me) {
            if came {
                self.above += 1;
            } else {
                self.above -= 1;
            }
        }
        if came {
            self.len += 1;
            if self
                .top
                .as_ref()
                .is_none_or(|(tw, tn)| (w, node) > (*tw, tn.as_str()))
            {
                self.top = Some((w, node.to_owned()));
            }
            true
        } else {
            self.len -= 1;
            self.top.as_ref().is_none_or(|(_, tn)| tn != node)
        }
    }
}

/// A node whose memberships changed between two reads, with them.
struct Changed<'m> {
    node: &'m str,
    before: Vec<&'m Candidate>,
    after: Vec<&'m Candidate>,
}

/// Every address's standing for one node, kept across reads.
#[derive(Clone, Debug, Default)]
pub(super) struct Standings {
    of: BTreeMap<IpAddr, Standing>,
}

impl Standings {
    /// Brought from the read `old` (`None`: the first) to `new`, for node
    /// `me`: an address new, or under another selector, is worked out
    /// whole; the others follow the nodes whose memberships changed.
    pub(super) fn update(&mut self, old: Option<&Observation>, new: &Observation, me: &str) {
        self.of.retain(|a, _| new.addresses.contains_key(a));
        // Each changed node's memberships before and after, looked up
        // once for every address.
        let changed: Vec<Changed<'_>> = match old {
            Some(o) => o
                .members
                .changed_nodes(&new.members)
                .into_iter()
                .map(|node| Changed {
                    node,
                    before: o.members.of(node).map(|(c, _)| c).collect(),
                    after: new.members.of(node).map(|(c, _)| c).collect(),
                })
                .collect(),
            None => {
                self.of.clear();
                Vec::new()
            }
        };
        // Past a quarter of the members changed, a pass is cheaper.
        let whole = old.is_none() || changed.len().saturating_mul(4) > new.members.len();
        for (a, sel) in &new.addresses {
            let Some(st) = self.of.get_mut(a).filter(|st| !whole && st.sel == *sel) else {
                self.of
                    .insert(*a, Standing::whole(&new.members, *a, sel, me));
                continue;
            };
            let mut top_kept = true;
            for c in &changed {
                let was = c.before.iter().any(|m| rank::admits(m, sel));
                let is = c.after.iter().any(|m| rank::admits(m, sel));
                if was != is {
                    top_kept &= st.moved(*a, c.node, me, is);
                }
            }
            if !top_kept {
                st.top = rank::top(&new.members, *a, sel).map(|n| (weight(*a, n), n.to_owned()));
            }
        }
    }

    /// This node's place in `a`'s ranking (0: the first choice) and the
    /// ranking's length; `None` when it is not an admitted member or `a`
    /// is not announced.
    pub(super) fn place(&self, a: IpAddr) -> Option<(usize, usize)> {
        self.of
            .get(&a)
            .filter(|st| st.me_in)
            .map(|st| (st.above, st.len))
    }

    /// `a`'s first choice.
    pub(super) fn top(&self, a: IpAddr) -> Option<&str> {
        self.of.get(&a)?.top.as_ref().map(|(_, n)| n.as_str())
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::net::Ipv4Addr;

    use proptest::prelude::*;

    use super::*;

    /// One change of a read: (node 0..10, lease 0..2, label 0..3,
    /// answers, gone).
    type Pick = (u8, u8, u8, bool, bool);

    fn apply(m: &mut Members, &(node, lease, label, answers, gone): &Pick) {
        let name = format!("node-{node}");
        if gone {
            m.remove_node(&name);
        } else {
            m.insert(
                Candidate {
                    name,
                    labels: BTreeMap::from([("zone".to_string(), format!("z{label}"))]),
                    answers,
                },
                i64::from(lease),
            );
        }
    }

    fn selector(zone: u8) -> LabelSelector {
        let mut s = LabelSelector::default();
        if zone < 3 {
            s.match_labels.insert("zone".into(), format!("z{zone}"));
        }
        s
    }

    proptest! {
        #![proptest_config(crate::testing::cases(256))]

        /// After any sequence of reads, each a few membership changes
        /// (nodes come, gone, relabelled, answering or not, under two
        /// leases) and addresses come, gone or reselected, every
        /// address's kept place and first choice are what a pass over the
        /// members says, for every node.
        #[test]
        fn kept_standings_are_the_whole_rankings(
            first in proptest::collection::vec((0u8..10, 0u8..2, 0u8..3, any::<bool>(), Just(false)), 0..12),
            reads in proptest::collection::vec(
                (
                    proptest::collection::vec((0u8..10, 0u8..2, 0u8..3, any::<bool>(), any::<bool>()), 0..4),
                    proptest::collection::vec((0u8..6, 0u8..4, any::<bool>()), 0..3),
                ),
                1..8,
            ),
            me in 0u8..11,
        ) {
            let me = format!("node-{me}");
            let mut view = Observation::default();
            for p in &first {
                apply(&mut view.members, p);
            }
            for i in 0..6u8 {
                view.addresses.insert(IpAddr::V4(Ipv4Addr::new(192, 0, 2, i)), selector(i % 4));
            }
            let mut kept = Standings::default();
            kept.update(None, &view, &me);
            for (changes, addresses) in &reads {
                let old = view.clone();
                for p in changes {
                    apply(&mut view.members, p);
                }
                for &(i, zone, gone) in addresses {
                    let a = IpAddr::V4(Ipv4Addr::new(192, 0, 2, i));
                    if gone {
                        view.addresses.remove(&a);
                    } else {
                        view.addresses.insert(a, selector(zone));
                    }
                }
                kept.update(Some(&old), &view, &me);
                for i in 0..6u8 {
                    let a = IpAddr::V4(Ipv4Addr::new(192, 0, 2, i));
                    let (want_place, want_top) = match view.addresses.get(&a) {
                        Some(sel) => (
                            rank::place(&view.members, a, sel, &me),
                            rank::top(&view.members, a, sel),
                        ),
                        None => (None, None),
                    };
                    prop_assert_eq!(kept.place(a), want_place, "place of {}", a);
                    prop_assert_eq!(kept.top(a), want_top, "top of {}", a);
                }
            }
        }
    }
}
