//! The pool manager: owners, generations and pools in one place.
//!
//! Every consumer (endpoint IPAM, agent addresses, LoadBalancer IPAM, cloud
//! prefixes) uses the same [`PoolManager`]; what differs is where its pools
//! come from (a [`PoolSource`] the consumer supplies), how it computes demand
//! ([`DemandConfig`]) and whether its pools may skip masquerading
//! ([`MasqueradeRule`]). Keeping one implementation means idempotency,
//! generation checks, draining and restore behave the same for all of them.
//!
//! The manager is plain state. It does no I/O: the daemon persists
//! [`Allocation`]s and the [`generation`](PoolManager::generation) counter in
//! its store, and calls [`restore`](PoolManager::restore) on start.
//!
//! This file holds the types, the [`PoolManager`] itself, queries and the
//! allocation paths (allocate, release). Child modules add to the same type:
//! `sync` (pool configuration from the source), `snapshot` (restore and the
//! exact snapshot round trip), `demand` (demand tracking and giving CIDRs
//! back) and `drain` (draining ranges kept for holders after a restart).
//!
//! Invariants (checked by the property tests):
//! - an address is held by at most one owner;
//! - an owner holds at most one address per pool and family, and asking again
//!   returns the same allocation;
//! - every allocation has a generation no other allocation ever had;
//! - a release with a wrong generation frees nothing.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

use crate::cidr::{CidrError, Family};
use crate::demand::{Demand, DemandConfig, DemandError, DemandTracker};
use crate::owner::{Generation, Owner};
use crate::pool::{Pool, PoolError, PoolSpec, pool_id};

mod demand;
mod drain;
mod snapshot;
mod sync;
pub use drain::{DrainError, DrainingRange, KeptReport, MAX_DRAINING_ADDRESSES};
pub use snapshot::{CidrState, ManagerSnapshot, PoolState};

/// Where a manager's pools come from. Implemented by the consumer: static
/// config, a cloud prefix list, LoadBalancer pool objects, etcd blocks.
pub trait PoolSource {
    /// The pools as they should be now. Called by [`PoolManager::sync`].
    fn pools(&self) -> Vec<PoolSpec>;
}

/// A fixed list of pools (from a config file, or for tests).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StaticPools(pub Vec<PoolSpec>);

impl PoolSource for StaticPools {
    fn pools(&self) -> Vec<PoolSpec> {
        self.0.clone()
    }
}

impl<F: Fn() -> Vec<PoolSpec>> PoolSource for F {
    fn pools(&self) -> Vec<PoolSpec> {
        self()
    }
}

/// Which of a manager's pools contribute their CIDRs to MASQ_SKIP.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MasqueradeRule {
    /// Pools whose `skip_masquerade` flag is set.
    #[default]
    PoolFlag,
    /// Every pool (e.g. routable cloud prefixes).
    Always,
    /// None (e.g. LoadBalancer pools, which are not sources of endpoint
    /// traffic).
    Never,
}

/// What a manager is parameterised with besides its pool source.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ManagerConfig {
    /// Demand computation (the same for both families).
    pub demand: DemandConfig,
    /// MASQ_SKIP contribution.
    pub masquerade: MasqueradeRule,
    /// Largest CIDR (in addresses) that gets a dense bitmap.
    pub dense_limit: u128,
}

impl Default for ManagerConfig {
    fn default() -> Self {
        ManagerConfig {
            demand: DemandConfig::default(),
            masquerade: MasqueradeRule::default(),
            dense_limit: crate::cidr::DEFAULT_DENSE_LIMIT,
        }
    }
}

/// One address held by one owner.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Allocation {
    /// The pool it came from.
    pub pool: String,
    /// The address.
    pub address: IpAddr,
    /// Who holds it.
    pub owner: Owner,
    /// Which holding this is; pass it back to [`PoolManager::release`].
    pub generation: Generation,
}

impl Allocation {
    /// The address family.
    pub fn family(&self) -> Family {
        Family::of_addr(self.address)
    }
}

/// Errors of allocation, release and restore.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ManagerError {
    /// No pool of that name.
    #[error("unknown pool {pool}")]
    UnknownPool {
        /// The name asked for.
        pool: String,
    },
    /// No free address in the pool's active CIDRs of that family.
    #[error("pool {pool} has no free {family} address (capacity {capacity})")]
    PoolExhausted {
        /// The pool.
        pool: String,
        /// The family asked for.
        family: Family,
        /// Capacity of the pool's active CIDRs of that family.
        capacity: u128,
    },
    /// The address is in a cluster block of the pool but outside the
    /// reservation window this node published (#43): handing it out could
    /// give it a second holder should the block be taken from the node.
    #[error(
        "address {address} of pool {pool} is outside this node's published reservation window; try again once the window covers it"
    )]
    OutsideWindow {
        /// The pool.
        pool: String,
        /// The address.
        address: IpAddr,
    },
    /// The address is in none of the pool's CIDRs.
    #[error("address {address} is outside pool {pool}")]
    AddressOutsidePool {
        /// The pool.
        pool: String,
        /// The address asked for.
        address: IpAddr,
    },
    /// The address is reserved, or a first/last address the pool excludes.
    #[error("address {address} of pool {pool} cannot be allocated")]
    AddressUnusable {
        /// The pool.
        pool: String,
        /// The address asked for.
        address: IpAddr,
        /// Why.
        #[source]
        source: CidrError,
    },
    /// Another owner holds the address.
    #[error("address {address} of pool {pool} is taken by {owner}")]
    AddressTaken {
        /// The pool.
        pool: String,
        /// The address asked for.
        address: IpAddr,
        /// Who holds it.
        owner: Owner,
    },
    /// The owner already holds a different address of that pool and family.
    #[error("{owner} already holds {held} in pool {pool}, not {requested}")]
    OwnerHoldsOther {
        /// The owner.
        owner: Owner,
        /// The pool.
        pool: String,
        /// The address it holds.
        held: IpAddr,
        /// The address asked for.
        requested: IpAddr,
    },
    /// The address's CIDR is draining: it takes no new allocations.
    #[error("cidr {cidr} of pool {pool} is draining; {address} cannot be allocated")]
    CidrDraining {
        /// The pool.
        pool: String,
        /// The draining CIDR.
        cidr: IpNet,
        /// The address asked for.
        address: IpAddr,
    },
    /// The owner holds nothing in that pool and family.
    #[error("{owner} holds no {family} address in pool {pool}")]
    NotAllocated {
        /// The pool.
        pool: String,
        /// The family.
        family: Family,
        /// The owner.
        owner: Owner,
    },
    /// A release named a generation other than the current holding's.
    #[error("stale generation {given} for {owner}: current is {current}")]
    StaleGeneration {
        /// The owner.
        owner: Owner,
        /// The generation passed in.
        given: Generation,
        /// The generation of what the owner holds now.
        current: Generation,
    },
    /// A pool definition or topology problem (invalid or overlapping CIDR, ...).
    #[error(transparent)]
    Pool(#[from] PoolError),
    /// The demand configuration is invalid.
    #[error(transparent)]
    Demand(#[from] DemandError),
    /// A draining range cannot be kept or released as asked.
    #[error(transparent)]
    Drain(Box<DrainError>),
}

impl From<DrainError> for ManagerError {
    fn from(e: DrainError) -> Self {
        ManagerError::Drain(Box::new(e))
    }
}

/// What [`PoolManager::sync`] changed, and what it refused.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SyncReport {
    /// CIDRs added (or taken back from draining), as (pool, CIDR).
    pub added: Vec<(String, IpNet)>,
    /// CIDRs now draining (still holding allocations).
    pub draining: Vec<(String, IpNet)>,
    /// CIDRs gone for good (were empty).
    pub removed: Vec<(String, IpNet)>,
    /// Everything refused; the rest of the sync was applied.
    pub errors: Vec<PoolError>,
}

impl SyncReport {
    /// `Err` with the first refusal, for callers that want all-or-nothing
    /// startup (the daemon refuses to start on a bad config).
    ///
    /// # Errors
    /// The first entry of [`SyncReport::errors`].
    pub fn into_result(self) -> Result<SyncReport, PoolError> {
        match self.errors.first() {
            Some(e) => Err(e.clone()),
            None => Ok(self),
        }
    }
}

/// What [`PoolManager::restore`] did with each allocation.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RestoreOutcome {
    /// Allocations now held (including ones that were already present).
    pub restored: usize,
    /// Allocations that could not be placed, with the reason. The daemon
    /// decides what to do with them (typically: delete from the store and let
    /// reconcile remove their map entries).
    pub rejected: Vec<(Allocation, ManagerError)>,
}

/// Demand for one family, plus the CIDRs to give back.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DemandDecision {
    /// The figures.
    pub demand: Demand,
    /// Empty CIDRs given back (total capacity at most
    /// [`Demand::release`]), as (pool, CIDR). They are already out of
    /// service; [`PoolManager::sync`] ignores them while the source still
    /// lists them.
    pub release: Vec<(String, IpNet)>,
}

/// Key of an owner's holding: one address per (owner, pool, family).
type HoldKey = (Owner, String, Family);

/// The pool manager. See the module documentation.
#[derive(Clone, Debug)]
pub struct PoolManager<S> {
    source: S,
    config: ManagerConfig,
    pools: BTreeMap<String, Pool>,
    by_addr: BTreeMap<IpAddr, Allocation>,
    by_owner: BTreeMap<HoldKey, IpAddr>,
    /// The last generation handed out.
    generation: Generation,
    demand_v4: DemandTracker,
    demand_v6: DemandTracker,
    /// CIDRs given back by demand; not re-added while the source lists them.
    released: BTreeSet<IpNet>,
    /// Addresses held elsewhere ([`PoolManager::set_excluded`]).
    excluded: BTreeSet<IpAddr>,
    /// The reservation windows of the CIDRs that have one
    /// ([`PoolManager::set_windows`]).
    windows: BTreeMap<IpNet, BTreeSet<IpAddr>>,
}

impl<S: PoolSource> PoolManager<S> {
    /// A manager with no pools yet: call [`PoolManager::sync`] to load them
    /// from the source, then [`PoolManager::restore`].
    ///
    /// # Errors
    /// [`ManagerError::Demand`] for an invalid demand configuration.
    pub fn new(source: S, config: ManagerConfig) -> Result<Self, ManagerError> {
        Ok(PoolManager {
            source,
            demand_v4: DemandTracker::new(config.demand)?,
            demand_v6: DemandTracker::new(config.demand)?,
            config,
            pools: BTreeMap::new(),
            by_addr: BTreeMap::new(),
            by_owner: BTreeMap::new(),
            generation: Generation(0),
            released: BTreeSet::new(),
            excluded: BTreeSet::new(),
            windows: BTreeMap::new(),
        })
    }

    /// Addresses no pool hands out although they are in its CIDRs: held
    /// elsewhere (in cluster mode, by the pods of a node whose block this
    /// node took over). Unlike a pool's `reserved` they are no gateway.
    /// Applied by the next [`PoolManager::sync`] to every CIDR: a free one
    /// is withheld at once, one no longer listed is free again.
    pub fn set_excluded(&mut self, excluded: BTreeSet<IpAddr>) {
        self.excluded = excluded;
    }

    /// Limits what each CIDR listed may hand out to its window (cluster
    /// mode's reservation windows, #43): applied at once, and to a listed
    /// CIDR added later. A CIDR not listed has no limit; one listed with an
    /// empty window hands out nothing. An allocation asking for a specific
    /// address outside its CIDR's window is refused
    /// ([`ManagerError::OutsideWindow`]); restored ones are not.
    pub fn set_windows(&mut self, windows: BTreeMap<IpNet, BTreeSet<IpAddr>>) {
        self.windows = windows;
        for pool in self.pools.values_mut() {
            for slot in &mut pool.cidrs {
                slot.alloc.set_window(self.windows.get(&slot.alloc.cidr()));
            }
        }
    }

    /// One pool and family as the window planner sees it
    /// ([`crate::cluster::window::GroupView`] without its spare): the free
    /// addresses inside the windows of its active CIDRs, and up to
    /// `candidates` free ones outside them, each in the order they would
    /// be handed out.
    pub fn window_view(
        &self,
        pool: &str,
        family: Family,
        candidates: usize,
    ) -> (Vec<IpAddr>, Vec<IpAddr>) {
        let Some(p) = self.pools.get(pool) else {
            return (Vec::new(), Vec::new());
        };
        let mut free = Vec::new();
        let mut next = Vec::new();
        for s in p
            .cidrs
            .iter()
            .filter(|s| !s.draining && s.alloc.family() == family && s.alloc.windowed())
        {
            free.extend(s.alloc.free_in_window());
            if next.len() < candidates {
                next.extend(s.alloc.next_free_outside_window(candidates - next.len()));
            }
        }
        (free, next)
    }

    /// The pool source.
    pub fn source(&self) -> &S {
        &self.source
    }

    /// The pool source, to change it before the next [`PoolManager::sync`].
    pub fn source_mut(&mut self) -> &mut S {
        &mut self.source
    }

    /// The configuration.
    pub fn config(&self) -> &ManagerConfig {
        &self.config
    }

    /// Every pool, by name.
    pub fn pools(&self) -> impl Iterator<Item = &Pool> + '_ {
        self.pools.values()
    }

    /// One pool.
    pub fn pool(&self, name: &str) -> Option<&Pool> {
        self.pools.get(name)
    }

    /// Every allocation, by address.
    pub fn allocations(&self) -> impl ExactSizeIterator<Item = &Allocation> + '_ {
        self.by_addr.values()
    }

    /// The allocation holding `address`, if any.
    pub fn by_address(&self, address: IpAddr) -> Option<&Allocation> {
        self.by_addr.get(&address)
    }

    /// What `owner` holds in `pool` for `family`, if anything.
    pub fn get(&self, pool: &str, family: Family, owner: &Owner) -> Option<&Allocation> {
        let addr = self
            .by_owner
            .get(&(owner.clone(), pool.to_owned(), family))?;
        self.by_addr.get(addr)
    }

    /// Everything `owner` holds, in any pool and family.
    pub fn owned_by<'a>(&'a self, owner: &'a Owner) -> impl Iterator<Item = &'a Allocation> + 'a {
        self.owner_keys(owner).map(|(_, addr)| &self.by_addr[addr])
    }

    /// The last generation handed out. Persist it (as a high-water mark)
    /// alongside the allocations and pass it back to
    /// [`PoolManager::restore`]: restoring only from the allocations' own
    /// generations would reuse the generations of released ones.
    pub fn generation(&self) -> Generation {
        self.generation
    }

    /// Allocates the next free address of `family` in `pool` for `owner`, or
    /// returns what the owner already holds there (idempotent). Active CIDRs
    /// are tried in the order they were added; within a CIDR, next-fit.
    ///
    /// # Errors
    /// [`ManagerError::UnknownPool`] or [`ManagerError::PoolExhausted`].
    pub fn allocate_next(
        &mut self,
        pool: &str,
        family: Family,
        owner: Owner,
    ) -> Result<Allocation, ManagerError> {
        if let Some(existing) = self.get(pool, family, &owner) {
            return Ok(existing.clone());
        }
        let p = self.pool_mut(pool)?;
        let slot = p
            .cidrs
            .iter_mut()
            .find(|s| !s.draining && s.alloc.family() == family && s.alloc.available() > 0);
        let Some(slot) = slot else {
            return Err(ManagerError::PoolExhausted {
                pool: pool.to_owned(),
                family,
                capacity: p.capacity(family),
            });
        };
        let address = slot
            .alloc
            .allocate_next()
            .expect("a CIDR with free addresses allocates");
        Ok(self.record(pool, address, owner))
    }

    /// Allocates a specific address for `owner`, or returns the owner's
    /// allocation if it already holds exactly that address (idempotent).
    ///
    /// # Errors
    /// [`ManagerError::UnknownPool`], [`ManagerError::OwnerHoldsOther`],
    /// [`ManagerError::AddressOutsidePool`], [`ManagerError::CidrDraining`],
    /// [`ManagerError::AddressTaken`] or [`ManagerError::AddressUnusable`].
    pub fn allocate(
        &mut self,
        pool: &str,
        address: IpAddr,
        owner: Owner,
    ) -> Result<Allocation, ManagerError> {
        let family = Family::of_addr(address);
        if let Some(existing) = self.get(pool, family, &owner) {
            if existing.address == address {
                return Ok(existing.clone());
            }
            return Err(ManagerError::OwnerHoldsOther {
                owner,
                pool: pool.to_owned(),
                held: existing.address,
                requested: address,
            });
        }
        self.place(pool, address, false)?;
        Ok(self.record(pool, address, owner))
    }

    /// Releases what `owner` holds in `pool` for `family`, if `generation` is
    /// the one it was given. Returns the released allocation.
    ///
    /// # Errors
    /// [`ManagerError::NotAllocated`] or [`ManagerError::StaleGeneration`]
    /// (nothing is freed).
    pub fn release(
        &mut self,
        pool: &str,
        family: Family,
        owner: &Owner,
        generation: Generation,
    ) -> Result<Allocation, ManagerError> {
        let current = self
            .get(pool, family, owner)
            .ok_or_else(|| ManagerError::NotAllocated {
                pool: pool.to_owned(),
                family,
                owner: owner.clone(),
            })?;
        if current.generation != generation {
            return Err(ManagerError::StaleGeneration {
                owner: owner.clone(),
                given: generation,
                current: current.generation,
            });
        }
        let address = current.address;
        Ok(self.free(address))
    }

    /// Releases everything `owner` holds, in every pool and family, without a
    /// generation check. For callers that hold no generation and whose request
    /// is authoritative for the owner *now* (a CNI DEL from the runtime, which
    /// names a live container ID); GC and other late or replayed requests must
    /// use [`PoolManager::release`]. Idempotent: an owner holding nothing
    /// gives an empty list.
    pub fn release_owner(&mut self, owner: &Owner) -> Vec<Allocation> {
        let addrs: Vec<IpAddr> = self.owner_keys(owner).map(|(_, &a)| a).collect();
        addrs.into_iter().map(|a| self.free(a)).collect()
    }

    /// CIDRs that skip masquerading under this manager's [`MasqueradeRule`],
    /// with the pool id, draining ones included (their endpoints still send
    /// traffic).
    pub fn masq_skip_cidrs(&self) -> Vec<(IpNet, u32)> {
        self.pools
            .values()
            .filter(|p| match self.config.masquerade {
                MasqueradeRule::PoolFlag => p.skip_masquerade,
                MasqueradeRule::Always => true,
                MasqueradeRule::Never => false,
            })
            .flat_map(|p| {
                let id = pool_id(&p.name);
                p.cidrs.iter().map(move |s| (s.alloc.cidr(), id))
            })
            .collect()
    }

    fn owner_keys<'a>(
        &'a self,
        owner: &'a Owner,
    ) -> impl Iterator<Item = (&'a HoldKey, &'a IpAddr)> + 'a {
        self.by_owner
            .range((owner.clone(), String::new(), Family::V4)..)
            .take_while(move |((o, _, _), _)| o == owner)
    }

    fn pool_mut(&mut self, pool: &str) -> Result<&mut Pool, ManagerError> {
        self.pools
            .get_mut(pool)
            .ok_or_else(|| ManagerError::UnknownPool {
                pool: pool.to_owned(),
            })
    }

    fn pool_entry(&mut self, pool: &str) -> Result<&mut Pool, PoolError> {
        self.pools
            .get_mut(pool)
            .ok_or_else(|| PoolError::UnknownPool {
                pool: pool.to_owned(),
            })
    }

    /// Marks `address` used in its CIDR, with the manager's error vocabulary.
    /// `restoring` accepts draining CIDRs.
    fn place(&mut self, pool: &str, address: IpAddr, restoring: bool) -> Result<(), ManagerError> {
        if let Some(holder) = self.by_addr.get(&address) {
            return Err(ManagerError::AddressTaken {
                pool: holder.pool.clone(),
                address,
                owner: holder.owner.clone(),
            });
        }
        let p = self.pool_mut(pool)?;
        let outside = || ManagerError::AddressOutsidePool {
            pool: pool.to_owned(),
            address,
        };
        let slot = p.slot_of(address).ok_or_else(outside)?;
        let slot = &mut p.cidrs[slot];
        if !restoring && !slot.alloc.in_window(address) {
            return Err(ManagerError::OutsideWindow {
                pool: pool.to_owned(),
                address,
            });
        }
        if slot.draining && !restoring {
            return Err(ManagerError::CidrDraining {
                pool: pool.to_owned(),
                cidr: slot.alloc.cidr(),
                address,
            });
        }
        slot.alloc
            .allocate(address)
            .map_err(|source| ManagerError::AddressUnusable {
                pool: pool.to_owned(),
                address,
                source,
            })
    }

    /// Indexes a freshly placed address under a new generation.
    fn record(&mut self, pool: &str, address: IpAddr, owner: Owner) -> Allocation {
        self.generation = self.generation.next();
        let family = Family::of_addr(address);
        self.demand_mut(family).complete_pending(&owner);
        let alloc = Allocation {
            pool: pool.to_owned(),
            address,
            owner: owner.clone(),
            generation: self.generation,
        };
        self.by_owner
            .insert((owner, pool.to_owned(), family), address);
        self.by_addr.insert(address, alloc.clone());
        alloc
    }

    /// Unindexes and frees an allocated address; drops an emptied draining
    /// CIDR and an emptied retired pool.
    fn free(&mut self, address: IpAddr) -> Allocation {
        let alloc = self.by_addr.remove(&address).expect("indexed address");
        self.by_owner
            .remove(&(alloc.owner.clone(), alloc.pool.clone(), alloc.family()));
        let pool = self.pools.get_mut(&alloc.pool).expect("pool of allocation");
        let slot = pool.slot_of(address).expect("cidr of allocation");
        pool.cidrs[slot]
            .alloc
            .release(address)
            .expect("indexed address is allocated");
        pool.reap();
        if pool.retired && pool.cidrs.is_empty() {
            self.pools.remove(&alloc.pool);
        }
        alloc
    }

    #[cfg(test)]
    pub(crate) fn check_invariants(&self) {
        assert_eq!(self.by_addr.len(), self.by_owner.len());
        for ((owner, pool, family), addr) in &self.by_owner {
            let a = &self.by_addr[addr];
            assert_eq!((&a.owner, &a.pool, a.family()), (owner, pool, *family));
            let p = &self.pools[pool];
            let slot = &p.cidrs[p.slot_of(*addr).expect("address in pool")];
            assert!(slot.alloc.has(*addr));
            assert!(a.generation <= self.generation);
        }
        for p in self.pools.values() {
            for s in &p.cidrs {
                assert_eq!(s.alloc.used() + s.alloc.free(), s.alloc.capacity());
                assert!(
                    !(s.draining && s.alloc.used() == 0),
                    "empty draining cidr kept"
                );
            }
        }
        let used: u128 = self
            .pools
            .values()
            .flat_map(|p| &p.cidrs)
            .map(|s| s.alloc.used())
            .sum();
        assert_eq!(used, self.by_addr.len() as u128);
    }
}

#[cfg(test)]
mod tests;
