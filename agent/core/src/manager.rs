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

use crate::cidr::{CidrAllocator, CidrError, CidrOptions, Family};
use crate::demand::{Demand, DemandConfig, DemandError, DemandTracker, Usage};
use crate::owner::{Generation, Owner};
use crate::pool::{Pool, PoolError, PoolSpec, check_cidr, overlaps, pool_id};

mod drain;
pub use drain::{DrainError, DrainingRange, KeptReport, MAX_DRAINING_ADDRESSES};

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
        })
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

    /// Brings the pools in line with the source: new pools and CIDRs are
    /// added (overlaps refused), CIDRs and pools the source dropped start
    /// draining and disappear once empty, a draining CIDR listed again is
    /// active again, and flags are updated. `allow_first_last` and `reserved`
    /// apply to CIDRs added from then on; remove and re-add a CIDR to change
    /// them for it. Problems are collected in the report; everything else is
    /// applied.
    pub fn sync(&mut self) -> SyncReport {
        let mut report = SyncReport::default();
        let mut specs = self.source.pools();
        let mut names = BTreeSet::new();
        specs.retain(|spec| {
            if spec.name.is_empty() {
                report.errors.push(PoolError::EmptyName);
                false
            } else if !names.insert(spec.name.clone()) {
                report.errors.push(PoolError::DuplicatePool {
                    pool: spec.name.clone(),
                });
                false
            } else {
                true
            }
        });
        // Forget released CIDRs the source no longer lists.
        let listed: BTreeSet<IpNet> = specs.iter().flat_map(PoolSpec::cidrs).collect();
        self.released.retain(|c| listed.contains(c));

        // Drain first, so a CIDR moving between pools in one edit is refused
        // only while the old one still holds addresses.
        for pool in self.pools.values_mut() {
            let spec = specs.iter().find(|s| s.name == pool.name);
            pool.retired = spec.is_none();
            for slot in &mut pool.cidrs {
                let cidr = slot.alloc.cidr();
                let wanted = spec.is_some_and(|s| s.cidrs().any(|c| c == cidr))
                    && !self.released.contains(&cidr);
                if !wanted && !slot.draining {
                    slot.draining = true;
                    report.draining.push((pool.name.clone(), cidr));
                }
            }
        }
        self.reap(&mut report.removed);

        for spec in &specs {
            let pool = self
                .pools
                .entry(spec.name.clone())
                .or_insert_with(|| Pool::from_spec(spec));
            pool.retired = false;
            pool.skip_masquerade = spec.skip_masquerade;
            pool.allow_first_last = spec.allow_first_last;
            pool.allow_link_local = spec.allow_link_local;
            pool.reserved.clone_from(&spec.reserved);
            for cidr in spec.cidrs() {
                if self.released.contains(&cidr) {
                    continue;
                }
                match self.add_cidr(&spec.name, cidr) {
                    Ok(true) => report.added.push((spec.name.clone(), cidr)),
                    Ok(false) => {}
                    Err(e) => report.errors.push(e),
                }
            }
        }
        // A pool listed with nothing valid stays (empty), so allocations name
        // a known pool; a retired empty pool is gone.
        self.pools.retain(|_, p| !(p.retired && p.cidrs.is_empty()));
        report
    }

    /// Adds a CIDR to a pool, or takes it back from draining. Returns whether
    /// anything changed.
    ///
    /// # Errors
    /// [`PoolError::UnknownPool`], [`PoolError::InvalidCidr`] (host bits set)
    /// or [`PoolError::OverlappingCidr`] naming both pools and both CIDRs.
    pub fn add_cidr(&mut self, pool: &str, cidr: IpNet) -> Result<bool, PoolError> {
        let allow_link_local = self.pools.get(pool).is_some_and(|p| p.allow_link_local);
        check_cidr(pool, cidr, allow_link_local)?;
        for (name, p) in &self.pools {
            for slot in &p.cidrs {
                let other = slot.alloc.cidr();
                if name == pool && other == cidr {
                    continue;
                }
                if overlaps(cidr, other) {
                    return Err(PoolError::OverlappingCidr {
                        pool: pool.to_owned(),
                        cidr,
                        other_pool: name.clone(),
                        other_cidr: other,
                    });
                }
            }
        }
        let dense_limit = self.config.dense_limit;
        let p = self.pool_entry(pool)?;
        if let Some(slot) = p.cidrs.iter_mut().find(|s| s.alloc.cidr() == cidr) {
            let changed = slot.draining;
            slot.draining = false;
            return Ok(changed);
        }
        let slot = p.new_slot(cidr, dense_limit)?;
        p.cidrs.push(slot);
        Ok(true)
    }

    /// Starts draining a CIDR: no new allocations; it disappears once its
    /// last allocation is released (at once if it is empty). Returns whether
    /// the CIDR is gone already.
    ///
    /// # Errors
    /// [`PoolError::UnknownPool`] or [`PoolError::UnknownCidr`].
    pub fn remove_cidr(&mut self, pool: &str, cidr: IpNet) -> Result<bool, PoolError> {
        let p = self.pool_entry(pool)?;
        let slot = p
            .cidrs
            .iter_mut()
            .find(|s| s.alloc.cidr() == cidr)
            .ok_or_else(|| PoolError::UnknownCidr {
                pool: pool.to_owned(),
                cidr,
            })?;
        slot.draining = true;
        let gone = slot.alloc.used() == 0;
        p.reap();
        Ok(gone)
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
            .find(|s| !s.draining && s.alloc.family() == family && s.alloc.free() > 0);
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
    fn resume_next_fit(&mut self) {
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

    /// Records a request that could not be served (e.g. after
    /// [`ManagerError::PoolExhausted`]), so demand counts it until it expires
    /// or the owner gets an address of that family.
    pub fn add_pending(&mut self, family: Family, owner: Owner, now_ms: u64) {
        self.demand_mut(family).add_pending(owner, now_ms);
    }

    /// Allows demand to release surplus CIDRs; call once restore is done.
    pub fn finish_restore(&mut self) {
        self.demand_v4.finish_restore();
        self.demand_v6.finish_restore();
    }

    /// Usage of a family over all pools: allocated addresses and the capacity
    /// of active CIDRs.
    pub fn usage(&self, family: Family) -> Usage {
        let sat = |n: u128| u64::try_from(n).unwrap_or(u64::MAX);
        Usage {
            in_use: sat(self.pools.values().map(|p| p.used(family)).sum()),
            available: sat(self.pools.values().map(|p| p.capacity(family)).sum()),
        }
    }

    /// Evaluates demand for a family at `now_ms`. When the tracker allows a
    /// release, empty active CIDRs (most recently added first) whose total
    /// capacity fits the allowed surplus are taken out of service and listed
    /// in [`DemandDecision::release`], for the caller to hand back.
    pub fn evaluate_demand(&mut self, family: Family, now_ms: u64) -> DemandDecision {
        let usage = self.usage(family);
        let demand = self.demand_mut(family).evaluate(now_ms, usage);
        let mut budget = u128::from(demand.release);
        let mut release = Vec::new();
        for pool in self.pools.values_mut() {
            for slot in pool.cidrs.iter_mut().rev() {
                let cap = slot.alloc.capacity();
                if budget == 0 {
                    break;
                }
                if !slot.draining
                    && slot.alloc.family() == family
                    && slot.alloc.used() == 0
                    && cap <= budget
                {
                    budget -= cap;
                    slot.draining = true;
                    release.push((pool.name.clone(), slot.alloc.cidr()));
                }
            }
            pool.reap();
        }
        self.released.extend(release.iter().map(|(_, c)| *c));
        DemandDecision { demand, release }
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

    fn demand_mut(&mut self, family: Family) -> &mut DemandTracker {
        match family {
            Family::V4 => &mut self.demand_v4,
            Family::V6 => &mut self.demand_v6,
        }
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

    fn restore_one(&mut self, a: &Allocation) -> Result<(), ManagerError> {
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

    fn reap(&mut self, removed: &mut Vec<(String, IpNet)>) {
        for pool in self.pools.values_mut() {
            for slot in &pool.cidrs {
                if slot.draining && slot.alloc.used() == 0 {
                    removed.push((pool.name.clone(), slot.alloc.cidr()));
                }
            }
            pool.reap();
        }
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
