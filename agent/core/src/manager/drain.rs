//! Draining what the configuration no longer lists, across a restart.
//!
//! The store keeps allocations, not the pool layout they were made under. When
//! the agent starts with a configuration that no longer lists an allocation's
//! CIDR (or its whole pool), the allocation must not be taken from its running
//! owner: [`PoolManager::restore_keeping`] keeps it in a *draining range* of
//! its pool (a retired pool when the pool itself is gone). A draining range
//! hands out nothing, is counted by every overlap check, and disappears with
//! its last holder, who leaves by its own release or by an operator's
//! [`PoolManager::draining_holders`] + release.
//!
//! Since the removed CIDR itself is not stored, a draining range is rebuilt
//! from its holders: the smallest prefixes that cover them, each at most
//! [`MAX_DRAINING_ADDRESSES`] addresses, holding no other pool's holder and
//! overlapping no configured CIDR. So a draining range is always inside the
//! CIDR it came from, never wider, and an edit that moves a CIDR to another
//! pool while the first still has holders in it is a conflict
//! ([`DrainError::Conflict`]) the caller must refuse: one address, one pool.

use std::collections::BTreeMap;
use std::net::IpAddr;

use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use serde::{Deserialize, Serialize};

use super::{Allocation, ManagerError, PoolManager, PoolSource, RestoreOutcome};
use crate::cidr::{CidrAllocator, CidrOptions, Family};
use crate::owner::Generation;
use crate::pool::{CidrSlot, Pool, PoolSpec, overlaps};

/// Largest draining range rebuilt from holders, in addresses (a /24 or a
/// /120): holders further apart get ranges of their own, so a draining range
/// never stands for much address space nobody holds.
pub const MAX_DRAINING_ADDRESSES: u32 = 256;

/// Errors about draining ranges.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DrainError {
    /// A stored allocation whose pool no longer lists its CIDR lies inside a
    /// CIDR configured for another pool: keeping it would give one address
    /// to two pools, releasing it would take it from a running owner.
    #[error(
        "{} is held by {} in pool {}, whose configuration no longer has it, \
         but cidr {other_cidr} of pool {other_pool} now covers it: put the cidr back in pool \
         {} until its holders are released (`lockstep pools release-draining`), or remove \
         {other_cidr} from pool {other_pool}",
        held.address, held.owner, held.pool, held.pool
    )]
    Conflict {
        /// The stored allocation.
        held: Box<Allocation>,
        /// The pool whose configured CIDR covers it now.
        other_pool: String,
        /// That CIDR.
        other_cidr: IpNet,
    },
    /// An operator release named nothing that is draining.
    #[error("pool {pool} has no draining address{}", within.map(|c| format!(" in {c}")).unwrap_or_default())]
    NothingDraining {
        /// The pool named.
        pool: String,
        /// The range named, if any.
        within: Option<IpNet>,
    },
}

/// One draining range and who still holds addresses in it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DrainingRange {
    /// The pool.
    pub pool: String,
    /// The range (a CIDR dropped from the pool, or the part of it that
    /// still has holders after a restart).
    pub cidr: IpNet,
    /// Whether the whole pool is gone from the configuration.
    pub pool_retired: bool,
    /// The allocations still in it, by address.
    pub holders: Vec<Allocation>,
}

/// What [`PoolManager::restore_keeping`] put into draining ranges.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KeptReport {
    /// Draining ranges created, as (pool, range).
    pub ranges: Vec<(String, IpNet)>,
    /// Pools created retired (gone from the configuration, kept for their
    /// holders).
    pub retired_pools: Vec<String>,
    /// Allocations kept in them.
    pub kept: usize,
}

/// An address as an integer, with its family's width.
fn bits(addr: IpAddr) -> (u128, u8) {
    match addr {
        IpAddr::V4(a) => (u128::from(u32::from(a)), 32),
        IpAddr::V6(a) => (u128::from(a), 128),
    }
}

/// The prefix of `len` bits holding `value` (`width` 32 or 128).
fn prefix(value: u128, width: u8, len: u8) -> IpNet {
    let host = width - len;
    let network = if host >= 128 {
        0
    } else {
        value >> host << host
    };
    match width {
        32 => {
            let v = u32::try_from(network).expect("an IPv4 address");
            IpNet::V4(Ipv4Net::new(v.into(), len).expect("valid length"))
        }
        _ => IpNet::V6(Ipv6Net::new(network.into(), len).expect("valid length")),
    }
}

/// The longest prefix holding both `lo` and `hi`, and its length.
fn common(lo: u128, hi: u128, width: u8) -> u8 {
    let differing = (lo ^ hi).checked_ilog2().map_or(0, |b| b + 1);
    width - u8::try_from(differing).expect("at most 128 bits")
}

impl<S: PoolSource> PoolManager<S> {
    /// [`restore`](PoolManager::restore), keeping what the configuration
    /// dropped: an allocation whose pool is gone, or whose pool no longer
    /// lists a CIDR holding it, is kept in a draining range (see the module
    /// documentation) instead of being rejected. Allocations are never
    /// released here; [`RestoreOutcome::rejected`] lists those that conflict
    /// ([`DrainError::Conflict`], owner or address clashes, unusable
    /// addresses), for the caller to refuse or release as it decides.
    pub fn restore_keeping(
        &mut self,
        generation: Generation,
        allocations: impl IntoIterator<Item = Allocation>,
    ) -> (RestoreOutcome, KeptReport) {
        let mut outcome = self.restore(generation, allocations);
        let mut orphans = Vec::new();
        outcome.rejected.retain(|(a, e)| {
            let orphan = matches!(
                e,
                ManagerError::UnknownPool { .. } | ManagerError::AddressOutsidePool { .. }
            );
            if orphan {
                orphans.push(a.clone());
            }
            !orphan
        });
        let mut kept = KeptReport::default();
        orphans.sort_by_key(|a| (Family::of_addr(a.address), bits(a.address).0));
        for family in [Family::V4, Family::V6] {
            let group: Vec<&Allocation> = orphans.iter().filter(|a| a.family() == family).collect();
            self.cover(&group, &mut kept, &mut outcome);
        }
        for a in &orphans {
            if !self.holds_range_for(a) {
                continue;
            }
            match self.restore_one(a) {
                Ok(()) => {
                    outcome.restored += 1;
                    kept.kept += 1;
                    self.generation = self.generation.max(a.generation);
                }
                Err(e) => outcome.rejected.push((a.clone(), e)),
            }
        }
        // Ranges whose holders were all refused (owner clashes) hold nothing.
        for pool in self.pools.values_mut() {
            pool.reap();
        }
        self.pools.retain(|_, p| !(p.retired && p.cidrs.is_empty()));
        self.resume_next_fit();
        (outcome, kept)
    }

    /// Whether a draining range of the allocation's pool holds its address.
    fn holds_range_for(&self, a: &Allocation) -> bool {
        self.pools
            .get(&a.pool)
            .and_then(|p| p.slot_of(a.address))
            .is_some()
    }

    /// Creates draining ranges for `group` (one family, sorted by address):
    /// its smallest covering prefix when that holds at most
    /// [`MAX_DRAINING_ADDRESSES`], one pool's allocations only and overlaps
    /// no other range; else each half (split at the first bit where the
    /// group's addresses differ) on its own. A single address that overlaps
    /// a range is a conflict.
    fn cover(&mut self, group: &[&Allocation], kept: &mut KeptReport, out: &mut RestoreOutcome) {
        let (Some(first), Some(last)) = (group.first(), group.last()) else {
            return;
        };
        let (lo, width) = bits(first.address);
        let (hi, _) = bits(last.address);
        let len = common(lo, hi, width);
        let range = prefix(lo, width, len);
        if width - len <= 8 {
            let one_pool = group.iter().all(|a| a.pool == first.pool);
            let clash = self.overlapping(range);
            if one_pool && clash.is_none() {
                self.add_draining(&first.pool, range, kept);
                return;
            }
            if lo == hi {
                let (other_pool, other_cidr) = clash.unwrap_or((first.pool.clone(), range));
                for a in group {
                    out.rejected.push((
                        (*a).clone(),
                        DrainError::Conflict {
                            held: Box::new((*a).clone()),
                            other_pool: other_pool.clone(),
                            other_cidr,
                        }
                        .into(),
                    ));
                }
                return;
            }
        }
        let upper = prefix(hi, width, len + 1).network();
        let (left, right) = group.split_at(group.partition_point(|a| a.address < upper));
        self.cover(left, kept, out);
        self.cover(right, kept, out);
    }

    /// The first CIDR (of any pool, active or draining) overlapping `range`.
    fn overlapping(&self, range: IpNet) -> Option<(String, IpNet)> {
        self.pools.values().find_map(|p| {
            p.cidrs
                .iter()
                .map(|s| s.alloc.cidr())
                .find(|c| overlaps(*c, range))
                .map(|c| (p.name.clone(), c))
        })
    }

    fn add_draining(&mut self, pool: &str, range: IpNet, kept: &mut KeptReport) {
        let options = CidrOptions {
            // It hands out nothing; every address may have a holder.
            allow_first_last: true,
            dense_limit: self.config.dense_limit,
        };
        let alloc = CidrAllocator::new(range, options, []).expect("a canonical prefix");
        let p = self.pools.entry(pool.to_owned()).or_insert_with(|| {
            kept.retired_pools.push(pool.to_owned());
            let mut p = Pool::from_spec(&PoolSpec::new(pool));
            p.retired = true;
            p
        });
        p.cidrs.push(CidrSlot {
            alloc,
            draining: true,
        });
        kept.ranges.push((pool.to_owned(), range));
    }

    /// Every draining range with its holders, by pool then range.
    pub fn draining(&self) -> Vec<DrainingRange> {
        let mut out = Vec::new();
        for p in self.pools.values() {
            for s in p.cidrs.iter().filter(|s| s.draining) {
                let cidr = s.alloc.cidr();
                let holders = self
                    .by_addr
                    .range(cidr.network()..=cidr.broadcast())
                    .map(|(_, a)| a.clone())
                    .collect();
                out.push(DrainingRange {
                    pool: p.name.clone(),
                    cidr,
                    pool_retired: p.retired,
                    holders,
                });
            }
        }
        out
    }

    /// The allocations an operator release of `pool`'s draining addresses
    /// (those inside `within`, or all) would remove, by address. Addresses
    /// of active CIDRs are never included.
    ///
    /// # Errors
    /// [`DrainError::NothingDraining`] when that selects nothing (an unknown
    /// pool, an active CIDR, a range with no holder).
    pub fn draining_holders(
        &self,
        pool: &str,
        within: Option<IpNet>,
    ) -> Result<Vec<Allocation>, DrainError> {
        let mut holders: BTreeMap<IpAddr, Allocation> = BTreeMap::new();
        for range in self.draining().into_iter().filter(|r| r.pool == pool) {
            for a in range.holders {
                if within.is_none_or(|c| c.contains(&a.address)) {
                    holders.insert(a.address, a);
                }
            }
        }
        if holders.is_empty() {
            return Err(DrainError::NothingDraining {
                pool: pool.to_owned(),
                within,
            });
        }
        Ok(holders.into_values().collect())
    }
}

#[cfg(test)]
mod tests;
