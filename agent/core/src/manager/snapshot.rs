//! Putting a manager's state back: [`PoolManager::restore`] of persisted
//! allocations on start, and the exact [`ManagerSnapshot`] round trip.
//!
//! Kept apart from the allocation paths because it is the one place that
//! places allocations *as they were* (draining CIDRs accepted, generations
//! kept, cursors resumed) rather than handing out new ones, and because the
//! snapshot types are a serialised format whose shape must not drift with the
//! manager's internals.

use std::collections::BTreeMap;
use std::net::IpAddr;

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

use super::{Allocation, ManagerConfig, ManagerError, PoolManager, PoolSource, RestoreOutcome};
use crate::cidr::{CidrAllocator, CidrOptions};
use crate::owner::Generation;
use crate::pool::{Pool, PoolError, PoolSpec};

/// Plain-data state of one CIDR in a [`ManagerSnapshot`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CidrState {
    /// The CIDR.
    pub cidr: IpNet,
    /// Whether it is draining.
    pub draining: bool,
    /// Next-fit cursor.
    pub cursor: IpAddr,
    /// Whether first and last addresses are handed out. Per CIDR because a
    /// pool flag change applies only to CIDRs added afterwards.
    pub allow_first_last: bool,
    /// Reserved addresses inside this CIDR (same reason).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub reserved: Vec<IpAddr>,
}

/// Plain-data state of one pool in a [`ManagerSnapshot`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolState {
    /// Name.
    pub name: String,
    /// Flag.
    pub allow_first_last: bool,
    /// Flag.
    #[serde(default)]
    pub allow_link_local: bool,
    /// Flag.
    pub skip_masquerade: bool,
    /// Reserved addresses.
    pub reserved: Vec<IpAddr>,
    /// Dropped by the source, draining.
    pub retired: bool,
    /// CIDRs in allocation order.
    pub cidrs: Vec<CidrState>,
}

/// Everything needed to rebuild a manager exactly: pools (with draining state
/// and cursors), allocations and the generation counter. Serialisable.
/// Pending requests and demand hysteresis are transient and not included.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ManagerSnapshot {
    /// The last generation handed out.
    pub generation: Generation,
    /// Pools, by name.
    pub pools: Vec<PoolState>,
    /// Allocations, by address.
    pub allocations: Vec<Allocation>,
    /// CIDRs given back by demand that the source still lists.
    pub released: Vec<IpNet>,
}

impl<S: PoolSource> PoolManager<S> {
    /// Puts persisted allocations back, e.g. on start after [`sync`]. Each is
    /// placed as it was (draining CIDRs accepted); already present identical
    /// allocations count as restored. Those that no longer fit (unknown pool,
    /// CIDR gone, conflicting owner or address) are returned in
    /// [`RestoreOutcome::rejected`]; the rest are restored regardless. The
    /// generation counter becomes the largest of `generation` and every
    /// restored allocation's. `O(n log n)`: 10k allocations take
    /// milliseconds.
    ///
    /// [`sync`]: PoolManager::sync
    pub fn restore(
        &mut self,
        generation: Generation,
        allocations: impl IntoIterator<Item = Allocation>,
    ) -> RestoreOutcome {
        let mut outcome = RestoreOutcome::default();
        self.generation = self.generation.max(generation);
        for a in allocations {
            match self.restore_one(&a) {
                Ok(()) => {
                    outcome.restored += 1;
                    self.generation = self.generation.max(a.generation);
                }
                Err(e) => outcome.rejected.push((a, e)),
            }
        }
        self.resume_next_fit();
        outcome
    }

    /// After a restore (the store keeps allocations, not cursors): each
    /// CIDR's next-fit search resumes at its most recently handed-out
    /// allocation (the highest generation), so an address released before
    /// the restart is not the first one handed out after it. Only a release
    /// of the very newest allocation of a CIDR right before a restart can
    /// still come round early.
    pub(super) fn resume_next_fit(&mut self) {
        let mut newest: BTreeMap<(String, IpNet), (Generation, IpAddr)> = BTreeMap::new();
        for a in self.by_addr.values() {
            let Some(pool) = self.pools.get(&a.pool) else {
                continue;
            };
            let Some(i) = pool.slot_of(a.address) else {
                continue;
            };
            let key = (a.pool.clone(), pool.cidrs[i].alloc.cidr());
            let entry = newest.entry(key).or_insert((a.generation, a.address));
            if a.generation > entry.0 {
                *entry = (a.generation, a.address);
            }
        }
        for ((pool, cidr), (_, address)) in newest {
            if let Some(slot) = self
                .pools
                .get_mut(&pool)
                .and_then(|p| p.cidrs.iter_mut().find(|s| s.alloc.cidr() == cidr))
            {
                // An allocated address is a valid position: the search
                // starts there and moves past it.
                let _ = slot.alloc.set_cursor(address);
            }
        }
    }

    /// Plain-data copy of the whole state; see [`ManagerSnapshot`].
    pub fn snapshot(&self) -> ManagerSnapshot {
        ManagerSnapshot {
            generation: self.generation,
            pools: self
                .pools
                .values()
                .map(|p| PoolState {
                    name: p.name.clone(),
                    allow_first_last: p.allow_first_last,
                    allow_link_local: p.allow_link_local,
                    skip_masquerade: p.skip_masquerade,
                    reserved: p.reserved.clone(),
                    retired: p.retired,
                    cidrs: p
                        .cidrs
                        .iter()
                        .map(|s| CidrState {
                            cidr: s.alloc.cidr(),
                            draining: s.draining,
                            cursor: s.alloc.cursor(),
                            allow_first_last: s.alloc.allows_first_last(),
                            reserved: s.alloc.reserved().collect(),
                        })
                        .collect(),
                })
                .collect(),
            allocations: self.by_addr.values().cloned().collect(),
            released: self.released.iter().copied().collect(),
        }
    }

    /// Rebuilds a manager exactly from a snapshot (the source is not read;
    /// call [`PoolManager::sync`] afterwards to pick up changes).
    ///
    /// # Errors
    /// The first pool or allocation that does not fit: an inconsistent
    /// snapshot is refused whole.
    pub fn from_snapshot(
        source: S,
        config: ManagerConfig,
        snapshot: &ManagerSnapshot,
    ) -> Result<Self, ManagerError> {
        let mut m = PoolManager::new(source, config)?;
        for ps in &snapshot.pools {
            let spec = PoolSpec {
                name: ps.name.clone(),
                ipv4: Vec::new(),
                ipv6: Vec::new(),
                reserved: ps.reserved.clone(),
                allow_first_last: ps.allow_first_last,
                skip_masquerade: ps.skip_masquerade,
                allow_link_local: ps.allow_link_local,
                families: Vec::new(),
            };
            if m.pools.contains_key(&ps.name) {
                return Err(PoolError::DuplicatePool {
                    pool: ps.name.clone(),
                }
                .into());
            }
            let mut pool = Pool::from_spec(&spec);
            pool.retired = ps.retired;
            m.pools.insert(ps.name.clone(), pool);
            for cs in &ps.cidrs {
                if !m.add_cidr(&ps.name, cs.cidr)? {
                    return Err(PoolError::OverlappingCidr {
                        pool: ps.name.clone(),
                        cidr: cs.cidr,
                        other_pool: ps.name.clone(),
                        other_cidr: cs.cidr,
                    }
                    .into());
                }
                // Rebuild the CIDR with the options it was created with.
                let p = m.pools.get_mut(&ps.name).expect("inserted above");
                let slot = p.cidrs.last_mut().expect("just added");
                let options = CidrOptions {
                    allow_first_last: cs.allow_first_last,
                    dense_limit: config.dense_limit,
                };
                slot.alloc = CidrAllocator::new(cs.cidr, options, cs.reserved.iter().copied())
                    .map_err(|source| PoolError::InvalidCidr {
                        pool: ps.name.clone(),
                        cidr: cs.cidr,
                        source,
                    })?;
            }
        }
        m.generation = snapshot.generation;
        for a in &snapshot.allocations {
            m.restore_one(a)?;
        }
        // Cursors and draining flags last: restoring allocations must not
        // move cursors, and draining CIDRs accept restored allocations anyway.
        for ps in &snapshot.pools {
            let pool = m.pools.get_mut(&ps.name).expect("inserted above");
            for (slot, cs) in pool.cidrs.iter_mut().zip(&ps.cidrs) {
                slot.draining = cs.draining;
                slot.alloc.set_cursor(cs.cursor).map_err(|source| {
                    ManagerError::AddressUnusable {
                        pool: ps.name.clone(),
                        address: cs.cursor,
                        source,
                    }
                })?;
            }
        }
        m.released = snapshot.released.iter().copied().collect();
        Ok(m)
    }

    pub(super) fn restore_one(&mut self, a: &Allocation) -> Result<(), ManagerError> {
        let key = (a.owner.clone(), a.pool.clone(), a.family());
        if let Some(&held) = self.by_owner.get(&key) {
            if self.by_addr.get(&held) == Some(a) {
                return Ok(());
            }
            return Err(ManagerError::OwnerHoldsOther {
                owner: a.owner.clone(),
                pool: a.pool.clone(),
                held,
                requested: a.address,
            });
        }
        self.place(&a.pool, a.address, true)?;
        self.by_owner.insert(key, a.address);
        self.by_addr.insert(a.address, a.clone());
        Ok(())
    }
}
