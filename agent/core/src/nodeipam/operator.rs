//! The operator side of NodeIPAM (#44 item 5): which CIDRs of the
//! cluster's PodIPPools each node is offered, from the demand its agent
//! writes into its NodeIPAM object. The elected writer runs it when
//! there is no external operator (multi-pool with only the API server, as
//! Cilium's operator does for its multi-pool mode).
//!
//! The rules ([`plan`]):
//! - **One CIDR, one node.** A CIDR offered to a node, or still listed in
//!   its spec (held, possibly draining), is never offered to another. It
//!   goes back to the pool only once the node neither is offered it nor
//!   lists it: taking back is the node's release, never the operator's
//!   guess.
//! - **As far as the demand asks.** Per pool and family (a pool with CIDRs
//!   of that family), a node is offered CIDRs until their addresses reach
//!   its `requested`: first its own held CIDRs of the pool it is no longer
//!   offered (re-offered, they serve again with no disturbance), then the
//!   lowest free block of the pool's block size. `requested` counts the
//!   node's addresses of both families, so a dual-stack node is offered
//!   enough of each for all of them: at most twice what it uses.
//! - **Withdrawn when not needed.** The last offered CIDR is withdrawn
//!   while the others still reach `requested`; the node drains it and
//!   releases it once empty. A CIDR no longer inside its PodIPPool, and
//!   every CIDR of a pool that is gone or that the node no longer asks
//!   for, is withdrawn.
//! - Nodes are planned in name order, so a plan is a function of the
//!   objects alone.

use std::collections::{BTreeMap, BTreeSet};

use ipnet::IpNet;

use crate::cidr::Family;
use crate::pool::overlaps;

/// A PodIPPool as the operator hands it out.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SourcePool {
    /// The pool's name (as the nodes' `[kubernetes.nodeipam]` names it).
    pub name: String,
    /// Its CIDRs, both families.
    pub cidrs: Vec<IpNet>,
    /// The prefix length of an IPv4 block offered.
    pub block_v4: u8,
    /// The prefix length of an IPv6 block offered.
    pub block_v6: u8,
}

impl SourcePool {
    fn block(&self, family: Family) -> u8 {
        match family {
            Family::V4 => self.block_v4,
            Family::V6 => self.block_v6,
        }
    }

    fn covers(&self, cidr: IpNet) -> bool {
        self.cidrs.iter().any(|c| c.contains(&cidr))
    }
}

/// One node's NodeIPAM object as the operator reads it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeState {
    /// The node (the object's name).
    pub node: String,
    /// Per pool, the addresses the node asks for (its spec).
    pub requested: BTreeMap<String, u64>,
    /// Per pool, the CIDRs the node lists as held (its spec).
    pub held: BTreeMap<String, BTreeSet<IpNet>>,
    /// Per pool, the CIDRs offered now (its status); `None`: nothing
    /// offered yet.
    pub offered: Option<BTreeMap<String, BTreeSet<IpNet>>>,
}

/// Addresses in `cidr` (saturating at `u64::MAX`).
fn size(cidr: IpNet) -> u64 {
    let bits = u32::from(cidr.max_prefix_len() - cidr.prefix_len());
    1u64.checked_shl(bits).unwrap_or(u64::MAX)
}

fn sum(cidrs: &[IpNet]) -> u64 {
    cidrs.iter().fold(0u64, |a, c| a.saturating_add(size(*c)))
}

/// The lowest block of `prefix` inside `pool`'s CIDRs of `family` that
/// shares no address with `taken`.
fn free_block(pool: &SourcePool, family: Family, taken: &[IpNet]) -> Option<IpNet> {
    let prefix = pool.block(family);
    for cidr in pool.cidrs.iter().filter(|c| Family::of_net(**c) == family) {
        let Ok(blocks) = cidr.subnets(prefix.max(cidr.prefix_len())) else {
            continue;
        };
        for b in blocks {
            // Skip past a taken CIDR wider than a block at once.
            if !taken.iter().any(|t| overlaps(*t, b)) {
                return Some(b);
            }
        }
    }
    None
}

/// The offer for each node whose offer changes: per pool, its CIDRs.
/// `pools` are the PodIPPools; `nodes` every NodeIPAM object.
#[must_use]
pub fn plan(
    pools: &[SourcePool],
    nodes: &[NodeState],
) -> BTreeMap<String, BTreeMap<String, BTreeSet<IpNet>>> {
    let mut taken: Vec<IpNet> = Vec::new();
    for n in nodes {
        taken.extend(n.held.values().flatten().copied());
        taken.extend(n.offered.iter().flat_map(|o| o.values().flatten().copied()));
    }
    let mut sorted: Vec<&NodeState> = nodes.iter().collect();
    sorted.sort_by(|a, b| a.node.cmp(&b.node));
    let mut out = BTreeMap::new();
    for n in sorted {
        let current = n.offered.clone().unwrap_or_default();
        let mut next: BTreeMap<String, BTreeSet<IpNet>> = BTreeMap::new();
        for (name, want) in &n.requested {
            let Some(pool) = pools.iter().find(|p| &p.name == name) else {
                continue;
            };
            let mut cidrs = BTreeSet::new();
            for family in [Family::V4, Family::V6] {
                if !pool.cidrs.iter().any(|c| Family::of_net(*c) == family) {
                    continue;
                }
                let of_family = |c: &&IpNet| Family::of_net(**c) == family && pool.covers(**c);
                let mut have: Vec<IpNet> = current
                    .get(name)
                    .into_iter()
                    .flatten()
                    .filter(of_family)
                    .copied()
                    .collect();
                let mut own: Vec<IpNet> = n
                    .held
                    .get(name)
                    .into_iter()
                    .flatten()
                    .filter(of_family)
                    .filter(|c| !have.contains(c))
                    .copied()
                    .collect();
                own.reverse();
                while sum(&have) < *want {
                    if let Some(c) = own.pop() {
                        have.push(c);
                    } else if let Some(b) = free_block(pool, family, &taken) {
                        taken.push(b);
                        have.push(b);
                    } else {
                        break;
                    }
                }
                while let Some(last) = have.last().copied() {
                    if sum(&have) - size(last) < *want || have.len() == 1 && *want > 0 {
                        break;
                    }
                    have.pop();
                }
                cidrs.extend(have);
            }
            if !cidrs.is_empty() || current.contains_key(name) {
                next.insert(name.clone(), cidrs);
            }
        }
        let unchanged = match &n.offered {
            Some(o) => {
                o.iter()
                    .filter(|(_, v)| !v.is_empty())
                    .collect::<BTreeMap<_, _>>()
                    == next
                        .iter()
                        .filter(|(_, v)| !v.is_empty())
                        .collect::<BTreeMap<_, _>>()
            }
            None => next.values().all(BTreeSet::is_empty),
        };
        if !unchanged {
            out.insert(n.node.clone(), next);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn net(s: &str) -> IpNet {
        s.parse().unwrap()
    }

    fn set(v: &[&str]) -> BTreeSet<IpNet> {
        v.iter().map(|s| net(s)).collect()
    }

    fn pool() -> SourcePool {
        SourcePool {
            name: "eni".into(),
            cidrs: vec![net("10.9.0.0/26"), net("fd09::/120")],
            block_v4: 28,
            block_v6: 124,
        }
    }

    fn node(name: &str, requested: u64) -> NodeState {
        NodeState {
            node: name.into(),
            requested: BTreeMap::from([("eni".into(), requested)]),
            ..NodeState::default()
        }
    }

    #[test]
    fn demand_is_met_block_by_block_and_never_twice() {
        let p = plan(&[pool()], &[node("a", 20), node("b", 5)]);
        assert_eq!(
            p["a"]["eni"],
            set(&["10.9.0.0/28", "10.9.0.16/28", "fd09::/124", "fd09::10/124"])
        );
        assert_eq!(p["b"]["eni"], set(&["10.9.0.32/28", "fd09::20/124"]));
    }

    #[test]
    fn a_met_demand_changes_nothing_and_held_cidrs_stay_taken() {
        let mut a = node("a", 10);
        a.offered = Some(BTreeMap::from([(
            "eni".to_string(),
            set(&["10.9.0.0/28", "fd09::/124"]),
        )]));
        // b still holds (drains) 10.9.0.16/28: nobody else gets it.
        let mut b = node("b", 10);
        b.held = BTreeMap::from([("eni".to_string(), set(&["10.9.0.16/28"]))]);
        b.offered = Some(BTreeMap::new());
        let c = node("c", 1);
        let p = plan(&[pool()], &[a, b, c]);
        assert!(!p.contains_key("a"), "{p:?}");
        // b gets its own held CIDR back first.
        assert_eq!(p["b"]["eni"], set(&["10.9.0.16/28", "fd09::10/124"]));
        assert_eq!(p["c"]["eni"], set(&["10.9.0.32/28", "fd09::20/124"]));
    }

    #[test]
    fn excess_is_withdrawn_from_the_last_and_a_released_cidr_is_free_again() {
        let mut a = node("a", 3);
        a.offered = Some(BTreeMap::from([(
            "eni".to_string(),
            set(&["10.9.0.0/28", "10.9.0.16/28", "fd09::/124"]),
        )]));
        a.held = a.offered.clone().unwrap();
        let p = plan(&[pool()], &[a.clone()]);
        assert_eq!(p["a"]["eni"], set(&["10.9.0.0/28", "fd09::/124"]));
        // While a lists it, b cannot have it; once released, it can.
        let mut a2 = a.clone();
        a2.offered = Some(p["a"].clone());
        let p = plan(&[pool()], &[a2.clone(), node("b", 40)]);
        assert!(!p["b"]["eni"].contains(&net("10.9.0.16/28")), "{p:?}");
        a2.held = a2.offered.clone().unwrap();
        let p = plan(&[pool()], &[a2, node("b", 16)]);
        assert_eq!(p["b"]["eni"], set(&["10.9.0.16/28", "fd09::10/124"]));
    }

    #[test]
    fn a_pool_gone_or_shrunk_or_no_longer_asked_for_is_withdrawn() {
        let mut a = node("a", 10);
        a.offered = Some(BTreeMap::from([
            ("eni".to_string(), set(&["10.9.0.0/28", "fd09::/124"])),
            ("old".to_string(), set(&["10.8.0.0/28"])),
        ]));
        let p = plan(&[pool()], &[a.clone()]);
        assert_eq!(p["a"].get("old"), None, "{p:?}");
        let mut shrunk = pool();
        shrunk.cidrs = vec![net("10.9.0.32/27"), net("fd09::/120")];
        let p = plan(&[shrunk], &[a]);
        assert_eq!(p["a"]["eni"], set(&["10.9.0.32/28", "fd09::/124"]));
    }

    #[test]
    fn an_exhausted_pool_gives_what_it_has() {
        let p = plan(&[pool()], &[node("a", 1000), node("b", 1)]);
        assert_eq!(p["a"]["eni"].len(), 4 + 16);
        assert!(!p.contains_key("b") || p["b"].values().all(BTreeSet::is_empty));
    }

    use proptest::prelude::*;

    proptest! {
        #![proptest_config(crate::testing::cases(256))]

        /// Whatever the nodes hold, are offered and ask for, and however
        /// often the plan is applied and the nodes release what they are
        /// no longer offered: no CIDR is ever offered to two nodes, nor
        /// to a node while another lists it as held.
        #[test]
        fn no_cidr_is_ever_offered_to_two_nodes(
            asks in proptest::collection::vec(proptest::collection::vec(0u64..70, 3), 1..6),
            releases in proptest::collection::vec(any::<bool>(), 6),
        ) {
            let mut nodes: Vec<NodeState> = (0..3).map(|i| node(&format!("n{i}"), 0)).collect();
            for (round, ask) in asks.iter().enumerate() {
                for (n, want) in nodes.iter_mut().zip(ask) {
                    n.requested.insert("eni".into(), *want);
                }
                let p = plan(&[pool()], &nodes);
                for (name, offer) in p {
                    let n = nodes.iter_mut().find(|n| n.node == name).unwrap();
                    n.offered = Some(offer);
                }
                // Each node holds what it is offered, and keeps a
                // withdrawn CIDR (draining) unless it releases it now.
                for (i, n) in nodes.iter_mut().enumerate() {
                    let offered: BTreeSet<IpNet> =
                        n.offered.iter().flat_map(|o| o.values().flatten().copied()).collect();
                    let held = n.held.entry("eni".into()).or_default();
                    if releases[(i + round) % releases.len()] {
                        held.retain(|c| offered.contains(c));
                    }
                    held.extend(offered);
                }
                let mut owner: Vec<(IpNet, &str)> = Vec::new();
                for n in &nodes {
                    for c in n.held.values().flatten() {
                        if let Some((_, other)) = owner.iter().find(|(o, w)| overlaps(*o, *c) && *w != n.node) {
                            prop_assert!(false, "{c} held by {} and {other}", n.node);
                        }
                        owner.push((*c, &n.node));
                    }
                }
            }
        }
    }
}
