//! A node's configured pools against the cluster's addresses (#26 item 6).
//!
//! A pool of the agent's own configuration is allocated from without etcd:
//! if it shares an address with a cluster pool, a node holding a block
//! there and this node can both hand the address out. The rule: at start
//! such an overlap is a configuration error ([`ClusterError::ConfiguredPoolOverlaps`]);
//! one that appears while the node runs (a cluster pool applied later)
//! withholds each configured CIDR concerned from the allocator
//! ([`withhold`]): its holders stay, nothing new comes from it, as from a
//! fenced block.

use std::collections::BTreeSet;
use std::fmt;

use ipnet::IpNet;

use super::{ClusterError, ClusterPoolSpec};
use crate::cidr::Family;
use crate::pool::{PoolSpec, overlaps};

/// What a configured CIDR overlaps.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum OverlapWith {
    /// A CIDR of a cluster pool.
    ClusterPool {
        /// The cluster pool.
        pool: String,
        /// Its CIDR.
        cidr: IpNet,
    },
    /// A claimed block.
    Block {
        /// The block's cluster pool.
        pool: String,
        /// The block.
        block: IpNet,
        /// The node holding it.
        node: String,
    },
}

/// A CIDR of a configured pool sharing addresses with the cluster's.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct LocalOverlap {
    /// The configured pool.
    pub pool: String,
    /// Its CIDR.
    pub cidr: IpNet,
    /// What it overlaps.
    pub with: OverlapWith,
}

impl fmt::Display for LocalOverlap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "cidr {} of configured pool {} overlaps ",
            self.cidr, self.pool
        )?;
        match &self.with {
            OverlapWith::ClusterPool { pool, cidr } => {
                write!(f, "cidr {cidr} of cluster pool {pool}")
            }
            OverlapWith::Block { pool, block, node } => {
                write!(
                    f,
                    "block {block} of cluster pool {pool} held by node {node}"
                )
            }
        }
    }
}

/// A claimed block as [`local_overlaps`] needs it.
#[derive(Clone, Copy, Debug)]
pub struct ClaimedBlock<'a> {
    /// The block's cluster pool.
    pub pool: &'a str,
    /// The block.
    pub block: IpNet,
    /// The node holding it.
    pub node: &'a str,
}

/// Every overlap of a CIDR of `configured` with a CIDR of `cluster` or a
/// block of `blocks` (any node's), sorted. A block is named too, not only
/// its pool: its holder is the node that hands out the same addresses.
pub fn local_overlaps(
    configured: &[PoolSpec],
    cluster: &[ClusterPoolSpec],
    blocks: &[ClaimedBlock<'_>],
) -> Vec<LocalOverlap> {
    let mut out = BTreeSet::new();
    for p in configured {
        for cidr in p.cidrs() {
            let found = |with| LocalOverlap {
                pool: p.name.clone(),
                cidr,
                with,
            };
            for c in cluster {
                for other in c.cidrs().filter(|o| overlaps(cidr, *o)) {
                    out.insert(found(OverlapWith::ClusterPool {
                        pool: c.name.clone(),
                        cidr: other,
                    }));
                }
            }
            for b in blocks.iter().filter(|b| overlaps(cidr, b.block)) {
                out.insert(found(OverlapWith::Block {
                    pool: b.pool.to_string(),
                    block: b.block,
                    node: b.node.to_string(),
                }));
            }
        }
    }
    out.into_iter().collect()
}

/// Refuses `overlaps` at start: the configuration is wrong, and serving it
/// could hand out an address another node hands out too.
///
/// # Errors
/// [`ClusterError::ConfiguredPoolOverlaps`] naming every overlap.
pub fn check_configured(overlaps: Vec<LocalOverlap>) -> Result<(), ClusterError> {
    if overlaps.is_empty() {
        Ok(())
    } else {
        Err(ClusterError::ConfiguredPoolOverlaps { overlaps })
    }
}

/// `configured` without the CIDRs `overlaps` names: what the allocator may
/// serve. A pool keeps its families, so a request for one whose CIDRs are
/// all withheld finds no free address rather than no such family.
pub fn withhold(configured: &[PoolSpec], overlaps: &[LocalOverlap]) -> Vec<PoolSpec> {
    let out: BTreeSet<(&str, IpNet)> = overlaps.iter().map(|o| (o.pool.as_str(), o.cidr)).collect();
    configured
        .iter()
        .map(|p| {
            let kept = |c: IpNet| !out.contains(&(p.name.as_str(), c));
            let mut spec = p.clone();
            if spec.families.is_empty() {
                spec.families = p.cidrs().map(Family::of_net).collect();
                spec.families.dedup();
            }
            spec.ipv4.retain(|c| kept(IpNet::V4(*c)));
            spec.ipv6.retain(|c| kept(IpNet::V6(*c)));
            spec
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn net(s: &str) -> IpNet {
        s.parse().expect("cidr")
    }

    fn local(name: &str, cidrs: &[&str]) -> PoolSpec {
        cidrs
            .iter()
            .fold(PoolSpec::new(name), |p, c| p.with_cidr(net(c)))
    }

    fn cluster(name: &str, cidrs: &[&str]) -> ClusterPoolSpec {
        cidrs
            .iter()
            .fold(ClusterPoolSpec::new(name), |p, c| p.with_cidr(net(c)))
    }

    #[test]
    fn disjoint_pools_have_no_overlap() {
        let conf = [local("mine", &["10.1.0.0/24", "fd00:1::/64"])];
        let pools = [cluster("pods", &["10.2.0.0/16", "fd00:2::/64"])];
        let blocks = [ClaimedBlock {
            pool: "pods",
            block: net("10.2.0.0/26"),
            node: "b",
        }];
        assert!(local_overlaps(&conf, &pools, &blocks).is_empty());
        assert_eq!(check_configured(Vec::new()), Ok(()));
        assert_eq!(withhold(&conf, &[])[0].ipv4, conf[0].ipv4);
    }

    #[test]
    fn an_overlap_names_both_pools_and_the_block_and_its_node() {
        let conf = [local("mine", &["10.1.0.0/24", "10.9.0.0/24"])];
        let pools = [cluster("pods", &["10.0.0.0/15"])];
        let blocks = [
            ClaimedBlock {
                pool: "pods",
                block: net("10.1.0.64/26"),
                node: "node-1",
            },
            ClaimedBlock {
                pool: "pods",
                block: net("10.0.0.0/26"),
                node: "node-2",
            },
        ];
        let found = local_overlaps(&conf, &pools, &blocks);
        let text: Vec<String> = found.iter().map(ToString::to_string).collect();
        assert_eq!(
            text,
            [
                "cidr 10.1.0.0/24 of configured pool mine overlaps cidr 10.0.0.0/15 of cluster pool pods",
                "cidr 10.1.0.0/24 of configured pool mine overlaps block 10.1.0.64/26 of cluster pool pods held by node node-1",
            ]
        );
        let e = check_configured(found.clone()).unwrap_err();
        assert_eq!(
            e.to_string(),
            format!(
                "{}; {}: a configured pool may not share addresses with the cluster's (two nodes would hand out the same address); change or remove the configured pool",
                text[0], text[1]
            )
        );
        // Only the overlapping CIDR is withheld; the other still serves.
        let served = withhold(&conf, &found);
        assert_eq!(served[0].cidrs().collect::<Vec<_>>(), [net("10.9.0.0/24")]);
    }

    #[test]
    fn a_block_outside_every_pool_cidr_is_found_too() {
        // A block whose pool the read did not return (unreadable key).
        let conf = [local("mine", &["fd00:5::/120"])];
        let blocks = [ClaimedBlock {
            pool: "gone",
            block: net("fd00:5::40/122"),
            node: "n",
        }];
        let found = local_overlaps(&conf, &[], &blocks);
        assert_eq!(found.len(), 1);
        let served = withhold(&conf, &found);
        assert_eq!(served[0].cidrs().count(), 0);
        // Its family still served: an ADD finds no free address.
        assert_eq!(served[0].families, [Family::V6]);
    }

    #[test]
    fn a_cidr_inside_a_configured_one_and_one_around_it_both_overlap() {
        let conf = [local("a", &["10.5.0.0/24"]), local("b", &["10.6.7.0/24"])];
        let pools = [cluster("p", &["10.5.0.128/25", "10.6.0.0/16"])];
        let found = local_overlaps(&conf, &pools, &[]);
        assert_eq!(
            found.iter().map(|o| o.pool.as_str()).collect::<Vec<_>>(),
            ["a", "b"]
        );
        let served = withhold(&conf, &found);
        assert!(served.iter().all(|p| p.cidrs().count() == 0));
    }

    #[test]
    fn families_never_overlap_each_other() {
        let conf = [local("a", &["10.0.0.0/8"])];
        let pools = [cluster("p", &["fd00::/8"])];
        assert!(local_overlaps(&conf, &pools, &[]).is_empty());
    }
}
