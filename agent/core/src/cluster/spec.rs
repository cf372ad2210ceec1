//! Cluster pool definitions, as stored in etcd, and the checks an apply
//! must pass.

use super::ClusterError;
use super::layout::{block_count, block_index};
use crate::cidr::Family;
use crate::pool::{PoolSpec, validate_specs};
use ipnet::IpNet;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Default IPv4 block prefix length (64 addresses).
pub const DEFAULT_BLOCK_V4: u8 = 26;
/// Default IPv6 block prefix length (64 addresses).
pub const DEFAULT_BLOCK_V6: u8 = 122;
/// Longest block prefix: a block holds at least 4 addresses.
const MAX_BLOCK_V4: u8 = 30;
const MAX_BLOCK_V6: u8 = 126;
/// Most blocks one CIDR may be cut into (keeps the key space and a scan for
/// a free block bounded).
pub const MAX_BLOCKS_PER_CIDR: u128 = 1 << 20;

fn default_v4() -> u8 {
    DEFAULT_BLOCK_V4
}
fn default_v6() -> u8 {
    DEFAULT_BLOCK_V6
}

/// One cluster pool: shared by every node, cut into blocks nodes claim.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterPoolSpec {
    /// Pool name (the single-node pool name rules apply).
    pub name: String,
    /// IPv4 CIDRs.
    #[serde(default)]
    pub ipv4: Vec<IpNet>,
    /// IPv6 CIDRs.
    #[serde(default)]
    pub ipv6: Vec<IpNet>,
    /// IPv4 block prefix length (default 26).
    #[serde(default = "default_v4")]
    pub block_v4: u8,
    /// IPv6 block prefix length (default 122).
    #[serde(default = "default_v6")]
    pub block_v6: u8,
    /// Hand out the first and last address of each CIDR.
    #[serde(default)]
    pub allow_first_last: bool,
    /// Traffic from this pool is not masqueraded.
    #[serde(default)]
    pub skip_masquerade: bool,
    /// Set by lockstep, never by a pools file: the pool was removed by an
    /// apply while nodes held blocks of it. Nodes claim nothing new from
    /// it, hand out nothing new, give its empty blocks back at once, and
    /// the pool key is deleted when no block is left ([`plan_apply`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub draining: bool,
}

impl ClusterPoolSpec {
    /// A pool with no CIDRs and default block sizes.
    pub fn new(name: impl Into<String>) -> Self {
        ClusterPoolSpec {
            name: name.into(),
            ipv4: Vec::new(),
            ipv6: Vec::new(),
            block_v4: DEFAULT_BLOCK_V4,
            block_v6: DEFAULT_BLOCK_V6,
            allow_first_last: false,
            skip_masquerade: false,
            draining: false,
        }
    }

    /// Adds a CIDR to the list of its family.
    #[must_use]
    pub fn with_cidr(mut self, cidr: IpNet) -> Self {
        match cidr {
            IpNet::V4(_) => self.ipv4.push(cidr),
            IpNet::V6(_) => self.ipv6.push(cidr),
        }
        self
    }

    /// Every CIDR, IPv4 first.
    pub fn cidrs(&self) -> impl Iterator<Item = IpNet> + '_ {
        self.ipv4.iter().chain(&self.ipv6).copied()
    }

    /// The block prefix length of a family.
    pub fn block_len(&self, family: Family) -> u8 {
        match family {
            Family::V4 => self.block_v4,
            Family::V6 => self.block_v6,
        }
    }

    /// The single-node pool the rules of [`crate::pool`] check.
    fn as_pool_spec(&self) -> PoolSpec {
        self.cidrs()
            .fold(PoolSpec::new(self.name.clone()), PoolSpec::with_cidr)
            .allow_first_last(self.allow_first_last)
            .skip_masquerade(self.skip_masquerade)
    }
}

/// Checks a whole set of cluster pools: names usable as one etcd key
/// segment ([`super::names`]), the single-node pool rules (names,
/// canonical CIDRs, special ranges, no overlap anywhere), CIDRs filed under
/// their family, and block sizes that cut every CIDR into at most
/// [`MAX_BLOCKS_PER_CIDR`] blocks of at least 4 addresses.
///
/// # Errors
/// The first problem found.
pub fn validate_pools(pools: &[ClusterPoolSpec]) -> Result<(), ClusterError> {
    // Key-name rules first: a `/` passes the single-node rules, and its
    // block keys could never be read back.
    for pool in pools {
        super::names::check_key_name("cluster pool", &pool.name)?;
    }
    let singles: Vec<PoolSpec> = pools.iter().map(ClusterPoolSpec::as_pool_spec).collect();
    validate_specs(&singles)?;
    for pool in pools {
        let misfiled = pool
            .ipv4
            .iter()
            .find(|c| matches!(c, IpNet::V6(_)))
            .or_else(|| pool.ipv6.iter().find(|c| matches!(c, IpNet::V4(_))));
        if let Some(&cidr) = misfiled {
            return Err(ClusterError::BadBlockSize {
                pool: pool.name.clone(),
                cidr,
                block: cidr.prefix_len(),
                reason: "the cidr is listed under the other family",
            });
        }
        for cidr in pool.cidrs() {
            let family = Family::of_net(cidr);
            let block = pool.block_len(family);
            let max = match family {
                Family::V4 => MAX_BLOCK_V4,
                Family::V6 => MAX_BLOCK_V6,
            };
            let bad = |reason| ClusterError::BadBlockSize {
                pool: pool.name.clone(),
                cidr,
                block,
                reason,
            };
            if block > max {
                return Err(bad("a block must hold at least 4 addresses"));
            }
            if block < cidr.prefix_len() {
                return Err(bad("the block is larger than the cidr"));
            }
            if block_count(cidr, block) > MAX_BLOCKS_PER_CIDR {
                return Err(bad("the cidr would hold more than 2^20 blocks"));
            }
        }
    }
    Ok(())
}

/// Checks that replacing the stored pools `old` by `new` takes away no
/// claimed block: every block in `claimed` (block → node) must still be a
/// block of the same pool in `new`, with the same block size. Validates
/// `new` first.
///
/// `claimed` maps each block to `(pool, node)`.
///
/// # Errors
/// [`ClusterError::CidrInUse`] naming the CIDR, its claimed blocks and their
/// nodes, or a validation error of `new`.
pub fn check_apply(
    old: &[ClusterPoolSpec],
    new: &[ClusterPoolSpec],
    claimed: &BTreeMap<IpNet, (String, String)>,
) -> Result<(), ClusterError> {
    validate_pools(new)?;
    let mut orphans: BTreeMap<(String, IpNet), Vec<(IpNet, String)>> = BTreeMap::new();
    for (&block, (pool, node)) in claimed {
        let kept = new.iter().filter(|p| &p.name == pool).any(|p| {
            p.cidrs()
                .any(|cidr| block_index(cidr, p.block_len(Family::of_net(cidr)), block).is_some())
        });
        if !kept {
            // Name the CIDR the block sits in: the stored pool's (the one
            // being removed or re-cut), else a new pool's, else the block.
            let in_pool = |specs: &[ClusterPoolSpec]| {
                specs
                    .iter()
                    .filter(|p| &p.name == pool)
                    .flat_map(ClusterPoolSpec::cidrs)
                    .find(|c| c.contains(&block.network()))
            };
            let cidr = in_pool(old)
                .or_else(|| {
                    new.iter()
                        .flat_map(ClusterPoolSpec::cidrs)
                        .find(|c| c.contains(&block.network()))
                })
                .unwrap_or(block);
            orphans
                .entry((pool.clone(), cidr))
                .or_default()
                .push((block, node.clone()));
        }
    }
    match orphans.into_iter().next() {
        None => Ok(()),
        Some(((pool, cidr), blocks)) => Err(ClusterError::CidrInUse { pool, cidr, blocks }),
    }
}

/// The pools an apply of `new` over the stored `old` writes (#26 item 12):
/// `new` as given, and every stored pool `new` leaves out that still has
/// claimed blocks (`claimed`: block → `(pool, node)`), kept with its CIDRs
/// and marked draining — a pool applied by mistake can be removed while
/// agents run; it is gone once its blocks are given back. A pool left out
/// with no claimed block is simply not written (deleted). Naming a draining
/// pool again cancels its removal. The result is checked as
/// [`check_apply`] checks (so a CIDR taken from a pool that stays, or
/// re-cut, is still refused while it has claimed blocks).
///
/// # Errors
/// [`ClusterError::DrainingGiven`] (a pool of `new` sets lockstep's own
/// field), or [`check_apply`]'s errors.
pub fn plan_apply(
    old: &[ClusterPoolSpec],
    new: &[ClusterPoolSpec],
    claimed: &BTreeMap<IpNet, (String, String)>,
) -> Result<Vec<ClusterPoolSpec>, ClusterError> {
    if let Some(p) = new.iter().find(|p| p.draining) {
        return Err(ClusterError::DrainingGiven {
            pool: p.name.clone(),
        });
    }
    let mut out = new.to_vec();
    for p in old {
        if new.iter().any(|n| n.name == p.name) {
            continue;
        }
        if claimed.values().any(|(pool, _)| *pool == p.name) {
            let mut kept = p.clone();
            kept.draining = true;
            out.push(kept);
        }
    }
    check_apply(old, &out, claimed)?;
    Ok(out)
}
