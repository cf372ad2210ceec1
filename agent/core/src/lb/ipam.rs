//! The LB IPAM state machine: pools, services, shared addresses, and the
//! [`PoolManager`] that hands the addresses out.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;

use ipnet::{Ipv4Net, Ipv6Net};
use lockstep_common::IpcacheValue;
use serde::{Deserialize, Serialize};

use super::LbError;
use super::index::{Conflict, ConflictIndex};
use super::range::{addr_bits, excluded_addresses, range_to_cidrs, usable_interval};
use super::spec::{Announce, Block, IpFamilyPolicy, LbPoolSpec, ServicePort, ServiceSpec};
use crate::cidr::Family;
use crate::manager::{ManagerConfig, ManagerSnapshot, MasqueradeRule, PoolManager, PoolSource};
use crate::owner::Owner;
use crate::plan::classify;
use crate::pool::PoolSpec;

/// The LB pools as the [`PoolManager`] sees them: only usable (enabled,
/// non-conflicting) pools, each as fully usable CIDRs, with the first and
/// last addresses of CIDR blocks reserved unless the pool allows them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LbPoolSource {
    pools: BTreeMap<String, PoolSpec>,
}

impl LbPoolSource {
    /// The converted pools, by name.
    pub fn specs(&self) -> impl Iterator<Item = &PoolSpec> + '_ {
        self.pools.values()
    }
}

impl PoolSource for LbPoolSource {
    fn pools(&self) -> Vec<PoolSpec> {
        self.pools.values().cloned().collect()
    }
}

/// One address a service holds.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Holding {
    /// The address.
    pub address: IpAddr,
    /// The pool it belongs to.
    pub pool: String,
}

/// Why a service (or one of its families) has no address.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum PendingReason {
    /// No pool with addresses of the family selects the service.
    NoPoolSelects {
        /// The family.
        family: Family,
    },
    /// Every usable pool selecting the service is full in that family.
    Exhausted {
        /// The family.
        family: Family,
        /// The pools tried, in order.
        pools: Vec<String>,
    },
    /// The requested address is in no pool.
    RequestedOutsidePools {
        /// The requested address.
        address: IpAddr,
    },
    /// The requested address is in a pool that does not select the service.
    RequestedNotSelected {
        /// The requested address.
        address: IpAddr,
        /// Its pool.
        pool: String,
    },
    /// The requested address is a first or last address its pool excludes.
    AddressUnusable {
        /// The requested address.
        address: IpAddr,
        /// Its pool.
        pool: String,
    },
    /// The requested address is held by a service it cannot be shared with.
    AddressTaken {
        /// The requested address.
        address: IpAddr,
        /// The service holding it (`namespace/name`).
        by: String,
    },
    /// The only pools that would serve the service are conflicting.
    PoolConflicting {
        /// The conflicting pool.
        pool: String,
        /// What it conflicts with.
        conflict: Conflict,
    },
    /// The only pools that would serve the service are disabled.
    PoolDisabled {
        /// The disabled pool.
        pool: String,
    },
    /// The address of the sharing key is used by a service with a common
    /// port.
    SharingPortClash {
        /// The shared address.
        address: IpAddr,
        /// The service using the port there.
        with: String,
        /// The port both use.
        port: ServicePort,
    },
}

impl PendingReason {
    /// Stable snake_case name of the reason, for metrics labels.
    pub fn kind(&self) -> &'static str {
        match self {
            PendingReason::NoPoolSelects { .. } => "no_pool_selects",
            PendingReason::Exhausted { .. } => "exhausted",
            PendingReason::RequestedOutsidePools { .. } => "requested_outside_pools",
            PendingReason::RequestedNotSelected { .. } => "requested_not_selected",
            PendingReason::AddressUnusable { .. } => "address_unusable",
            PendingReason::AddressTaken { .. } => "address_taken",
            PendingReason::PoolConflicting { .. } => "pool_conflicting",
            PendingReason::PoolDisabled { .. } => "pool_disabled",
            PendingReason::SharingPortClash { .. } => "sharing_port_clash",
        }
    }
}

impl fmt::Display for PendingReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PendingReason::NoPoolSelects { family } => {
                write!(
                    f,
                    "no usable pool with {family} addresses selects the service"
                )
            }
            PendingReason::Exhausted { family, pools } => {
                write!(f, "no free {family} address in pools {}", pools.join(", "))
            }
            PendingReason::RequestedOutsidePools { address } => {
                write!(f, "requested address {address} is outside every pool")
            }
            PendingReason::RequestedNotSelected { address, pool } => write!(
                f,
                "requested address {address} is in pool {pool}, which does not select the service"
            ),
            PendingReason::AddressUnusable { address, pool } => write!(
                f,
                "requested address {address} is a first or last address pool {pool} excludes"
            ),
            PendingReason::AddressTaken { address, by } => {
                write!(f, "address {address} is taken by {by}")
            }
            PendingReason::PoolConflicting { pool, conflict } => write!(
                f,
                "pool {pool} is conflicting: {} overlaps {} of pool {}",
                conflict.block, conflict.other_block, conflict.pool
            ),
            PendingReason::PoolDisabled { pool } => write!(f, "pool {pool} is disabled"),
            PendingReason::SharingPortClash {
                address,
                with,
                port,
            } => write!(f, "sharing {address}: port {port} is used by {with}"),
        }
    }
}

/// Why a service lost an address it held.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ChangeCause {
    /// The pool was deleted.
    PoolDeleted,
    /// The pool no longer contains the address (blocks edited, or the
    /// address became an excluded first/last address).
    OutsidePool,
    /// The pool was disabled.
    PoolDisabled,
    /// The pool became conflicting.
    PoolConflicting,
    /// The pool's selector no longer selects the service (or its labels
    /// changed).
    NotSelected,
    /// The service now requests another address.
    RequestChanged,
    /// The service no longer uses that family.
    FamilyDropped,
    /// The service's sharing key no longer matches the address's other users.
    SharingChanged,
    /// The service's ports now clash with another user of the address.
    SharingPortClash,
    /// RequireDualStack: the other family could not be served.
    DualStackIncomplete,
}

impl fmt::Display for ChangeCause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ChangeCause::PoolDeleted => "the pool was deleted",
            ChangeCause::OutsidePool => "the pool no longer contains it",
            ChangeCause::PoolDisabled => "the pool was disabled",
            ChangeCause::PoolConflicting => "the pool became conflicting",
            ChangeCause::NotSelected => "the pool no longer selects the service",
            ChangeCause::RequestChanged => "the service requests another address",
            ChangeCause::FamilyDropped => "the service no longer uses this family",
            ChangeCause::SharingChanged => "the sharing key changed",
            ChangeCause::SharingPortClash => "its ports clash with a sharing service",
            ChangeCause::DualStackIncomplete => "the other family could not be served",
        })
    }
}

/// The last time a service lost an address, and why.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChangeReason {
    /// The address it lost.
    pub address: IpAddr,
    /// The pool the address was in.
    pub pool: String,
    /// Why.
    pub cause: ChangeCause,
}

impl fmt::Display for ChangeReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "released {} of pool {}: {}",
            self.address, self.pool, self.cause
        )
    }
}

/// A service's addresses, or why it has none.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "snake_case", deny_unknown_fields)]
pub enum Assignment {
    /// Addresses held, in the service's family order.
    Assigned {
        /// The addresses.
        addresses: Vec<IpAddr>,
    },
    /// Nothing held.
    Pending {
        /// Why (for dual stack: the first family that failed).
        reason: PendingReason,
    },
}

/// Status of one service, as `lockstep lb` and the Service status show it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServiceStatus {
    /// Addresses or the pending reason.
    pub assignment: Assignment,
    /// PreferDualStack with one family served: why the other is not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub missing_family: Option<PendingReason>,
    /// The last time the service lost an address, and why.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_change_reason: Option<ChangeReason>,
}

impl ServiceStatus {
    /// The assigned addresses (empty when pending).
    pub fn addresses(&self) -> &[IpAddr] {
        match &self.assignment {
            Assignment::Assigned { addresses } => addresses,
            Assignment::Pending { .. } => &[],
        }
    }

    /// The pending reason, if pending.
    pub fn pending(&self) -> Option<&PendingReason> {
        match &self.assignment {
            Assignment::Pending { reason } => Some(reason),
            Assignment::Assigned { .. } => None,
        }
    }
}

/// Usage figures of one pool, for metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolMetrics {
    /// Addresses the pool hands out (both families).
    pub capacity: u128,
    /// Addresses in use.
    pub used: u128,
    /// Addresses free for allocation (0 for a disabled or conflicting pool).
    pub free: u128,
    /// Whether the pool is conflicting.
    pub conflicting: bool,
    /// Whether the pool is disabled.
    pub disabled: bool,
}

/// Metrics of the whole LB IPAM.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LbMetrics {
    /// Per pool.
    pub pools: BTreeMap<String, PoolMetrics>,
    /// Services with at least one address.
    pub assigned: usize,
    /// Pending services by [`PendingReason::kind`].
    pub pending_by_reason: BTreeMap<String, usize>,
}

/// A pool as the API shows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PoolStatus {
    /// The definition.
    pub spec: LbPoolSpec,
    /// First-apply order (lower wins conflicts and is tried first).
    pub seq: u64,
    /// Why the pool is not used, if it conflicts.
    pub conflict: Option<Conflict>,
    /// Usage.
    pub metrics: PoolMetrics,
}

/// Desired LB datapath contents, for [`crate::plan::diff`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LbPlan {
    /// IPCACHE_V4 host entries of assigned addresses.
    pub ipcache_v4: BTreeMap<Ipv4Net, IpcacheValue>,
    /// IPCACHE_V6 host entries of assigned addresses.
    pub ipcache_v6: BTreeMap<Ipv6Net, IpcacheValue>,
    /// IPv4 addresses of `announce = "l2"` pools → pool name; the daemon
    /// turns each into an L2_RESP_V4 entry with its interface and MAC.
    pub l2_announce_v4: BTreeMap<Ipv4Addr, String>,
}

/// A pool in an [`LbSnapshot`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolRecord {
    /// First-apply order.
    pub seq: u64,
    /// The definition.
    pub spec: LbPoolSpec,
}

/// A service in an [`LbSnapshot`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServiceRecord {
    /// First-apply order.
    pub seq: u64,
    /// The definition.
    pub spec: ServiceSpec,
    /// What it holds.
    pub held: Vec<Holding>,
    /// Its status.
    pub status: ServiceStatus,
}

/// Everything needed to rebuild an [`LbIpam`] exactly. Serialisable.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LbSnapshot {
    /// The next pool sequence number.
    pub next_pool_seq: u64,
    /// Pools in first-apply order.
    pub pools: Vec<PoolRecord>,
    /// The next service sequence number.
    pub next_service_seq: u64,
    /// Services by `namespace/name`.
    pub services: Vec<ServiceRecord>,
    /// The allocator (allocations, generations, cursors).
    pub manager: ManagerSnapshot,
}

#[derive(Clone, Debug)]
struct PoolEntry {
    spec: LbPoolSpec,
    seq: u64,
    blocks: Vec<Block>,
    /// Addresses handed out, as inclusive intervals.
    usable: Vec<(Family, u128, u128)>,
    /// What the manager gets when the pool is usable.
    managed: PoolSpec,
    conflict: Option<Conflict>,
}

impl PoolEntry {
    fn new(spec: LbPoolSpec, seq: u64) -> PoolEntry {
        let mut managed = PoolSpec::new(spec.name.clone()).allow_first_last(true);
        let mut usable = Vec::new();
        for c in &spec.cidrs {
            managed = managed.with_cidr(*c);
            for a in excluded_addresses(*c, spec.allow_first_last) {
                managed = managed.with_reserved(a);
            }
            if let Some((s, e)) = usable_interval(*c, spec.allow_first_last) {
                usable.push((Family::of_net(*c), s, e));
            }
        }
        for r in &spec.ranges {
            for c in range_to_cidrs(r.start, r.stop) {
                managed = managed.with_cidr(c);
            }
            usable.push((
                Family::of_addr(r.start),
                addr_bits(r.start),
                addr_bits(r.stop),
            ));
        }
        PoolEntry {
            blocks: spec.blocks(),
            spec,
            seq,
            usable,
            managed,
            conflict: None,
        }
    }

    fn is_usable(&self) -> bool {
        !self.spec.disabled && self.conflict.is_none()
    }

    fn contains(&self, addr: IpAddr) -> bool {
        let (f, b) = (Family::of_addr(addr), addr_bits(addr));
        self.usable
            .iter()
            .any(|&(uf, s, e)| uf == f && s <= b && b <= e)
    }

    fn in_blocks(&self, addr: IpAddr) -> bool {
        let (f, b) = (Family::of_addr(addr), addr_bits(addr));
        self.blocks
            .iter()
            .any(|k| k.family == f && k.start <= b && b <= k.end)
    }

    fn has_family(&self, family: Family) -> bool {
        self.usable.iter().any(|&(f, _, _)| f == family)
    }

    fn selects(&self, spec: &ServiceSpec) -> bool {
        self.spec.service_selector.matches(&spec.labels)
    }

    fn capacity(&self) -> u128 {
        self.usable.iter().fold(0u128, |acc, &(_, s, e)| {
            acc.saturating_add((e - s).saturating_add(1))
        })
    }
}

#[derive(Clone, Debug)]
struct ServiceEntry {
    /// Shared so that evaluation can hold it while mutating the state.
    spec: Arc<ServiceSpec>,
    seq: u64,
    held: Vec<Holding>,
    status: ServiceStatus,
}

/// Users of one assigned address.
#[derive(Clone, Debug)]
struct AddrUse {
    pool: String,
    /// Sharing key of the users (all users have the same one).
    key: Option<String>,
    users: BTreeSet<String>,
}

/// LoadBalancer IPAM. See the [module documentation](super).
#[derive(Clone, Debug)]
pub struct LbIpam {
    pools: BTreeMap<String, PoolEntry>,
    /// seq → pool name: conflict precedence and allocation order.
    order: BTreeMap<u64, String>,
    next_pool_seq: u64,
    index: ConflictIndex,
    manager: PoolManager<LbPoolSource>,
    services: BTreeMap<String, ServiceEntry>,
    next_service_seq: u64,
    addrs: BTreeMap<IpAddr, AddrUse>,
    by_key: BTreeMap<String, BTreeSet<IpAddr>>,
    /// seq → service id of services missing at least one family.
    pending: BTreeMap<u64, String>,
    /// Changes of the allocator that failed where they cannot (holdings
    /// and allocator disagree): kept in every build, for the caller to
    /// refuse the change with ([`LbIpam::take_faults`]).
    faults: Vec<String>,
}

impl Default for LbIpam {
    fn default() -> Self {
        LbIpam::new()
    }
}

fn manager_config() -> ManagerConfig {
    ManagerConfig {
        masquerade: MasqueradeRule::Never,
        ..ManagerConfig::default()
    }
}

fn clash(a: &[ServicePort], b: &[ServicePort]) -> Option<ServicePort> {
    a.iter().find(|p| b.contains(p)).copied()
}

impl LbIpam {
    /// No pools, no services.
    pub fn new() -> LbIpam {
        LbIpam {
            pools: BTreeMap::new(),
            order: BTreeMap::new(),
            next_pool_seq: 0,
            index: ConflictIndex::default(),
            manager: PoolManager::new(LbPoolSource::default(), manager_config())
                .expect("the default demand configuration is valid"),
            services: BTreeMap::new(),
            next_service_seq: 0,
            addrs: BTreeMap::new(),
            by_key: BTreeMap::new(),
            pending: BTreeMap::new(),
            faults: Vec::new(),
        }
    }

    /// The allocator changes that failed since the last call, where the
    /// holdings say they cannot: each means holdings and allocator
    /// disagree. Empty in a consistent state. A caller that gets any must
    /// not keep the state (the agent puts the previous one back).
    pub fn take_faults(&mut self) -> Vec<String> {
        std::mem::take(&mut self.faults)
    }

    /// The allocator, for the daemon's combined [`crate::plan::PlanBuilder`]
    /// and for status output.
    pub fn manager(&self) -> &PoolManager<LbPoolSource> {
        &self.manager
    }

    /// Adds or replaces one pool. See [`LbIpam::apply_pools`].
    ///
    /// # Errors
    /// See [`LbIpam::apply_pools`].
    pub fn apply_pool(&mut self, spec: LbPoolSpec) -> Result<BTreeSet<String>, LbError> {
        self.apply_pools([spec])
    }

    /// Adds or replaces pools (one batch costs one allocator sync, so the
    /// daemon applies its config file in one call). A new pool gets the next
    /// sequence number; an edited one keeps its own. Conflicts are
    /// re-evaluated, services whose addresses became invalid are reassigned
    /// (with [`ServiceStatus::last_change_reason`]) and pending services are
    /// retried. Returns the services whose status changed.
    ///
    /// # Errors
    /// The first invalid spec, or [`LbError::DuplicatePool`]; nothing is
    /// changed then.
    pub fn apply_pools(
        &mut self,
        specs: impl IntoIterator<Item = LbPoolSpec>,
    ) -> Result<BTreeSet<String>, LbError> {
        let specs: Vec<LbPoolSpec> = specs.into_iter().collect();
        let mut names = BTreeSet::new();
        for s in &specs {
            s.validate()?;
            if !names.insert(s.name.as_str()) {
                return Err(LbError::DuplicatePool {
                    pool: s.name.clone(),
                });
            }
        }
        let usable_before = self.usable_pools();
        let mut touched = BTreeSet::new();
        let mut added = Vec::new();
        let mut rebuild_index = false;
        for spec in specs {
            match self.pools.get_mut(&spec.name) {
                Some(e) if e.spec == spec => {}
                Some(e) => {
                    rebuild_index |= e.spec.cidrs != spec.cidrs || e.spec.ranges != spec.ranges;
                    touched.insert(spec.name.clone());
                    *e = PoolEntry {
                        conflict: e.conflict.take(),
                        ..PoolEntry::new(spec, e.seq)
                    };
                }
                None => {
                    let seq = self.next_pool_seq;
                    self.next_pool_seq += 1;
                    touched.insert(spec.name.clone());
                    added.push(spec.name.clone());
                    self.order.insert(seq, spec.name.clone());
                    self.pools
                        .insert(spec.name.clone(), PoolEntry::new(spec, seq));
                }
            }
        }
        if touched.is_empty() {
            return Ok(BTreeSet::new());
        }
        if rebuild_index {
            self.recompute_conflicts();
        } else {
            // New pools have the highest sequence numbers: checking them
            // against the claims so far, in order, is the full answer.
            for name in &added {
                let e = self.pools.get_mut(name).expect("just added");
                e.conflict = self.index.check(&e.blocks);
                if e.conflict.is_none() {
                    self.index.insert(name, &e.blocks);
                }
            }
        }
        Ok(self.refresh(touched, &usable_before))
    }

    /// Deletes a pool: its services are reassigned (or pending) with cause
    /// [`ChangeCause::PoolDeleted`], and pools it conflicted with may become
    /// usable. Returns the services whose status changed.
    ///
    /// # Errors
    /// [`LbError::UnknownPool`].
    pub fn delete_pool(&mut self, name: &str) -> Result<BTreeSet<String>, LbError> {
        let usable_before = self.usable_pools();
        let e = self
            .pools
            .remove(name)
            .ok_or_else(|| LbError::UnknownPool {
                pool: name.to_owned(),
            })?;
        self.order.remove(&e.seq);
        if e.conflict.is_none() {
            self.recompute_conflicts();
        }
        Ok(self.refresh(BTreeSet::from([name.to_owned()]), &usable_before))
    }

    /// Adds or replaces a service and assigns it addresses; an edited
    /// service keeps what is still valid. Returns the services whose status
    /// changed (this one, and pending ones served by addresses it freed).
    ///
    /// # Errors
    /// [`LbError::InvalidService`]; nothing is changed then.
    pub fn apply_service(&mut self, spec: ServiceSpec) -> Result<BTreeSet<String>, LbError> {
        spec.validate()?;
        let id = spec.id();
        let mut changed = BTreeSet::new();
        if let Some(e) = self.services.get_mut(&id) {
            if *e.spec == spec {
                return Ok(changed);
            }
            e.spec = Arc::new(spec);
        } else {
            let seq = self.next_service_seq;
            self.next_service_seq += 1;
            self.services.insert(
                id.clone(),
                ServiceEntry {
                    spec: Arc::new(spec),
                    seq,
                    held: Vec::new(),
                    status: ServiceStatus {
                        assignment: Assignment::Pending {
                            reason: PendingReason::NoPoolSelects { family: Family::V4 },
                        },
                        missing_family: None,
                        last_change_reason: None,
                    },
                },
            );
            changed.insert(id.clone());
        }
        let freed = self.evaluate_tracked(&id, None, &mut changed);
        if freed {
            self.retry_pending(&mut changed);
        }
        Ok(changed)
    }

    /// Deletes a service. Its addresses go back to their pools unless
    /// another sharing service still uses them. Returns the other services
    /// whose status changed (pending ones served by the freed addresses).
    ///
    /// # Errors
    /// [`LbError::UnknownService`].
    pub fn delete_service(&mut self, id: &str) -> Result<BTreeSet<String>, LbError> {
        let e = self
            .services
            .remove(id)
            .ok_or_else(|| LbError::UnknownService {
                service: id.to_owned(),
            })?;
        self.pending.remove(&e.seq);
        let mut freed = false;
        for h in &e.held {
            freed |= self.detach(id, h);
        }
        let mut changed = BTreeSet::new();
        if freed {
            self.retry_pending(&mut changed);
        }
        Ok(changed)
    }

    /// A service's status.
    pub fn service_status(&self, id: &str) -> Option<&ServiceStatus> {
        self.services.get(id).map(|e| &e.status)
    }

    /// Every service's status, by `namespace/name`.
    pub fn services(&self) -> impl Iterator<Item = (&str, &ServiceStatus)> + '_ {
        self.services.iter().map(|(k, e)| (k.as_str(), &e.status))
    }

    /// What a service holds, with pools.
    pub fn holdings(&self, id: &str) -> &[Holding] {
        self.services.get(id).map_or(&[], |e| &e.held)
    }

    /// The services using an address (several when shared).
    pub fn users_of(&self, address: IpAddr) -> impl Iterator<Item = &str> + '_ {
        self.addrs
            .get(&address)
            .into_iter()
            .flat_map(|u| u.users.iter().map(String::as_str))
    }

    /// One pool's status.
    pub fn pool_status(&self, name: &str) -> Option<PoolStatus> {
        let e = self.pools.get(name)?;
        Some(PoolStatus {
            spec: e.spec.clone(),
            seq: e.seq,
            conflict: e.conflict.clone(),
            metrics: self.pool_metrics(e),
        })
    }

    /// Every pool's status, in first-apply order.
    pub fn pools(&self) -> impl Iterator<Item = PoolStatus> + '_ {
        self.order.values().filter_map(|n| self.pool_status(n))
    }

    /// Metrics: per-pool usage and conflict state, pending services by reason.
    pub fn metrics(&self) -> LbMetrics {
        let mut m = LbMetrics::default();
        for (name, e) in &self.pools {
            m.pools.insert(name.clone(), self.pool_metrics(e));
        }
        for e in self.services.values() {
            match e.status.pending() {
                Some(r) => *m.pending_by_reason.entry(r.kind().to_owned()).or_default() += 1,
                None => m.assigned += 1,
            }
        }
        m
    }

    /// Desired IPCACHE entries (identity and flags from
    /// [`classify`](crate::plan::classify), so LB addresses look the same as
    /// in the combined plan) and L2 announcements.
    pub fn plan(&self) -> LbPlan {
        let mut plan = LbPlan::default();
        for a in self.manager.allocations() {
            let Some((identity, flags)) = classify(&a.owner) else {
                continue;
            };
            let value = IpcacheValue {
                identity,
                flags,
                ..IpcacheValue::default()
            };
            match a.address {
                IpAddr::V4(v4) => {
                    plan.ipcache_v4.insert(Ipv4Net::from(v4), value);
                    let l2 = self
                        .pools
                        .get(&a.pool)
                        .is_some_and(|p| p.spec.announce == Some(Announce::L2));
                    if l2 {
                        plan.l2_announce_v4.insert(v4, a.pool.clone());
                    }
                }
                IpAddr::V6(v6) => {
                    plan.ipcache_v6.insert(Ipv6Net::from(v6), value);
                }
            }
        }
        plan
    }

    /// Plain-data copy of the whole state, for the store.
    pub fn snapshot(&self) -> LbSnapshot {
        LbSnapshot {
            next_pool_seq: self.next_pool_seq,
            pools: self
                .order
                .iter()
                .map(|(seq, n)| PoolRecord {
                    seq: *seq,
                    spec: self.pools[n].spec.clone(),
                })
                .collect(),
            next_service_seq: self.next_service_seq,
            services: self
                .services
                .values()
                .map(|e| ServiceRecord {
                    seq: e.seq,
                    spec: (*e.spec).clone(),
                    held: e.held.clone(),
                    status: e.status.clone(),
                })
                .collect(),
            manager: self.manager.snapshot(),
        }
    }

    /// Rebuilds the state exactly from a snapshot (conflicts are derived
    /// again from the pools and their sequence numbers). Nothing is
    /// re-evaluated: afterwards the daemon re-applies the pools and services
    /// it currently sees, and services keep their addresses unless their own
    /// pool changed.
    ///
    /// # Errors
    /// An invalid pool or service, [`LbError::Restore`] when the allocator
    /// state does not rebuild, [`LbError::InconsistentSnapshot`] when
    /// services and allocations disagree.
    pub fn restore(snapshot: &LbSnapshot) -> Result<LbIpam, LbError> {
        let mut lb = LbIpam::new();
        let bad =
            |item: String, problem: &'static str| LbError::InconsistentSnapshot { item, problem };
        for r in &snapshot.pools {
            r.spec.validate()?;
            if r.seq >= snapshot.next_pool_seq
                || lb.order.insert(r.seq, r.spec.name.clone()).is_some()
                || lb
                    .pools
                    .insert(r.spec.name.clone(), PoolEntry::new(r.spec.clone(), r.seq))
                    .is_some()
            {
                return Err(bad(
                    r.spec.name.clone(),
                    "duplicate pool or sequence number",
                ));
            }
        }
        lb.next_pool_seq = snapshot.next_pool_seq;
        lb.recompute_conflicts();
        let source = LbPoolSource {
            pools: lb.usable_specs(),
        };
        lb.manager = PoolManager::from_snapshot(source, manager_config(), &snapshot.manager)
            .map_err(|source| LbError::Restore {
                source: Box::new(source),
            })?;
        let managed: BTreeSet<&str> = lb.manager.pools().map(|p| p.name()).collect();
        if managed
            != lb
                .manager
                .source()
                .pools
                .keys()
                .map(String::as_str)
                .collect()
        {
            return Err(bad(
                "pools".into(),
                "allocator pools differ from usable pools",
            ));
        }
        let mut seqs = BTreeSet::new();
        for r in &snapshot.services {
            r.spec.validate()?;
            let id = r.spec.id();
            if r.seq >= snapshot.next_service_seq || !seqs.insert(r.seq) {
                return Err(bad(id, "duplicate service or sequence number"));
            }
            for h in &r.held {
                let pool = lb
                    .pools
                    .get(&h.pool)
                    .filter(|p| p.is_usable() && p.contains(h.address));
                let allocated = lb.manager.by_address(h.address);
                if pool.is_none() || allocated.is_none_or(|a| a.pool != h.pool) {
                    return Err(bad(h.address.to_string(), "held address is not allocated"));
                }
                let u = lb.addrs.entry(h.address).or_insert_with(|| AddrUse {
                    pool: h.pool.clone(),
                    key: r.spec.sharing_key.clone(),
                    users: BTreeSet::new(),
                });
                if u.key != r.spec.sharing_key || (u.key.is_none() && !u.users.is_empty()) {
                    return Err(bad(h.address.to_string(), "shared without a common key"));
                }
                u.users.insert(id.clone());
                if let Some(k) = &r.spec.sharing_key {
                    lb.by_key.entry(k.clone()).or_default().insert(h.address);
                }
            }
            let missing = r.status.pending().is_some() || r.status.missing_family.is_some();
            if missing {
                lb.pending.insert(r.seq, id.clone());
            }
            lb.services.insert(
                id,
                ServiceEntry {
                    spec: Arc::new(r.spec.clone()),
                    seq: r.seq,
                    held: r.held.clone(),
                    status: r.status.clone(),
                },
            );
        }
        lb.next_service_seq = snapshot.next_service_seq;
        for a in lb.manager.allocations() {
            let owner_is_user = match &a.owner {
                Owner::LoadBalancer { service } => lb
                    .addrs
                    .get(&a.address)
                    .is_some_and(|u| u.users.contains(service)),
                _ => false,
            };
            if !owner_is_user {
                return Err(bad(
                    a.address.to_string(),
                    "allocation has no holding service",
                ));
            }
        }
        Ok(lb)
    }

    fn usable_pools(&self) -> BTreeSet<String> {
        self.pools
            .iter()
            .filter(|(_, e)| e.is_usable())
            .map(|(n, _)| n.clone())
            .collect()
    }

    fn usable_specs(&self) -> BTreeMap<String, PoolSpec> {
        self.pools
            .iter()
            .filter(|(_, e)| e.is_usable())
            .map(|(n, e)| (n.clone(), e.managed.clone()))
            .collect()
    }

    fn pool_metrics(&self, e: &PoolEntry) -> PoolMetrics {
        let (capacity, used) = match self.manager.pool(&e.spec.name) {
            Some(p) if e.is_usable() => (
                p.capacity(Family::V4)
                    .saturating_add(p.capacity(Family::V6)),
                p.used(Family::V4) + p.used(Family::V6),
            ),
            _ => (e.capacity(), 0),
        };
        PoolMetrics {
            capacity,
            used,
            free: if e.is_usable() { capacity - used } else { 0 },
            conflicting: e.conflict.is_some(),
            disabled: e.spec.disabled,
        }
    }

    /// Greedy in first-apply order: a pool is accepted unless it overlaps a
    /// pool accepted before it.
    fn recompute_conflicts(&mut self) {
        self.index.clear();
        for name in self.order.values() {
            let e = self.pools.get_mut(name).expect("ordered pool exists");
            e.conflict = self.index.check(&e.blocks);
            if e.conflict.is_none() {
                self.index.insert(name, &e.blocks);
            }
        }
    }

    /// After pool changes: drop what became invalid, bring the manager in
    /// line, then (re)assign affected and pending services in order.
    fn refresh(
        &mut self,
        mut affected: BTreeSet<String>,
        usable_before: &BTreeSet<String>,
    ) -> BTreeSet<String> {
        let usable_now = self.usable_pools();
        affected.extend(usable_before.symmetric_difference(&usable_now).cloned());
        let mut todo: BTreeMap<u64, String> = self.pending.clone();
        for u in self.addrs.values() {
            if affected.contains(&u.pool) {
                for id in &u.users {
                    todo.insert(self.services[id].seq, id.clone());
                }
            }
        }
        let statuses: BTreeMap<String, ServiceStatus> = todo
            .values()
            .map(|id| (id.clone(), self.services[id].status.clone()))
            .collect();
        let mut reasons = BTreeMap::new();
        for id in todo.values() {
            let (reason, _) = self.drop_invalid(id);
            if let Some(r) = reason {
                reasons.insert(id.clone(), r);
            }
        }
        self.sync_manager();
        let mut changed = BTreeSet::new();
        for id in todo.values() {
            let _ = self.evaluate(id, reasons.remove(id));
        }
        // Addresses released above may serve services pending before them.
        self.retry_pending(&mut changed);
        for (id, old) in statuses {
            if self.services.get(&id).is_some_and(|e| e.status != old) {
                changed.insert(id);
            }
        }
        changed
    }

    /// Makes the manager's pools the usable pools. A pool whose converted
    /// spec changed is taken out and put back, because the manager applies
    /// reserved addresses only to CIDRs it adds; the still-valid addresses
    /// in it are re-placed for their owners.
    fn sync_manager(&mut self) {
        let desired = self.usable_specs();
        if desired == self.manager.source().pools {
            return;
        }
        let rebuild: BTreeSet<String> = desired
            .iter()
            .filter(|(n, s)| self.manager.source().pools.get(*n).is_some_and(|c| c != *s))
            .map(|(n, _)| n.clone())
            .collect();
        let mut saved = Vec::new();
        if !rebuild.is_empty() {
            saved = self
                .manager
                .allocations()
                .filter(|a| rebuild.contains(&a.pool))
                .cloned()
                .collect();
            for a in &saved {
                if let Err(e) = self
                    .manager
                    .release(&a.pool, a.family(), &a.owner, a.generation)
                {
                    self.faults.push(format!(
                        "releasing {} of {} to rebuild its pool: {e}",
                        a.address, a.owner
                    ));
                }
            }
            let mut interim = desired.clone();
            interim.retain(|n, _| !rebuild.contains(n));
            self.manager.source_mut().pools = interim;
            let report = self.manager.sync();
            if !report.errors.is_empty() {
                self.faults
                    .push(format!("taking rebuilt pools out: {:?}", report.errors));
            }
        }
        self.manager.source_mut().pools = desired;
        let report = self.manager.sync();
        if !report.errors.is_empty() {
            self.faults
                .push(format!("syncing the pools: {:?}", report.errors));
        }
        for a in saved {
            if let Err(e) = self.manager.allocate(&a.pool, a.address, a.owner.clone()) {
                self.faults
                    .push(format!("placing {} of {} back: {e}", a.address, a.owner));
            }
        }
    }

    fn retry_pending(&mut self, changed: &mut BTreeSet<String>) {
        let pending: Vec<String> = self.pending.values().cloned().collect();
        for id in pending {
            self.evaluate_tracked(&id, None, changed);
        }
    }

    /// [`LbIpam::evaluate`], noting a status change; returns whether an
    /// address went back to its pool.
    fn evaluate_tracked(
        &mut self,
        id: &str,
        carried: Option<ChangeReason>,
        changed: &mut BTreeSet<String>,
    ) -> bool {
        let (freed, status_changed) = self.evaluate(id, carried);
        if status_changed {
            changed.insert(id.to_owned());
        }
        freed
    }

    /// Drops invalid holdings, assigns missing families, applies the dual
    /// stack policy and records the status. Returns whether an address went
    /// back to its pool and whether the status changed. Looks the service
    /// up as few times as possible: with 10k services each lookup is a
    /// string-keyed tree walk.
    fn evaluate(&mut self, id: &str, carried: Option<ChangeReason>) -> (bool, bool) {
        let (dropped, mut freed) = self.drop_invalid(id);
        let Some(e) = self.services.get_mut(id) else {
            return (freed, false);
        };
        let spec = Arc::clone(&e.spec);
        let mut held = std::mem::take(&mut e.held);
        let mut last_change = dropped.or(carried);
        let held_before = held.clone();
        for h in &held_before {
            self.sync_key(id, h.address, spec.sharing_key.as_ref());
        }
        let families = spec.families();
        let require = spec.ip_family_policy == IpFamilyPolicy::RequireDualStack;
        let mut failures = Vec::new();
        for &family in &families {
            if held.iter().any(|h| Family::of_addr(h.address) == family) {
                continue;
            }
            match self.try_assign(id, &spec, family) {
                Ok(h) => held.push(h),
                Err(reason) => {
                    failures.push(reason);
                    if require {
                        break;
                    }
                }
            }
        }
        if require && !failures.is_empty() {
            for h in held.drain(..) {
                if held_before.contains(&h) {
                    last_change = Some(ChangeReason {
                        address: h.address,
                        pool: h.pool.clone(),
                        cause: ChangeCause::DualStackIncomplete,
                    });
                }
                freed |= self.detach(id, &h);
            }
        }
        if held.len() > 1 {
            held.sort_by_key(|h| {
                families
                    .iter()
                    .position(|f| *f == Family::of_addr(h.address))
            });
        }
        let mut failures = failures.into_iter();
        let (assignment, missing_family) = if held.is_empty() {
            let reason = failures.next().unwrap_or(PendingReason::NoPoolSelects {
                family: families[0],
            });
            (Assignment::Pending { reason }, None)
        } else {
            let addresses = held.iter().map(|h| h.address).collect();
            (Assignment::Assigned { addresses }, failures.next())
        };
        let incomplete =
            matches!(assignment, Assignment::Pending { .. }) || missing_family.is_some();
        let e = self.services.get_mut(id).expect("exists");
        e.held = held;
        let status = ServiceStatus {
            assignment,
            missing_family,
            last_change_reason: last_change.or_else(|| e.status.last_change_reason.clone()),
        };
        let status_changed = status != e.status;
        e.status = status;
        if incomplete {
            self.pending.insert(e.seq, id.to_owned());
        } else {
            self.pending.remove(&e.seq);
        }
        (freed, status_changed)
    }

    /// Releases holdings that are no longer valid; returns the last reason
    /// and whether an address went back to its pool.
    fn drop_invalid(&mut self, id: &str) -> (Option<ChangeReason>, bool) {
        let Some(e) = self.services.get(id) else {
            return (None, false);
        };
        if e.held.is_empty() {
            return (None, false);
        }
        let spec = Arc::clone(&e.spec);
        let held = e.held.clone();
        let mut reason = None;
        let mut freed = false;
        for h in held {
            if let Err(cause) = self.check_holding(id, &spec, &h) {
                freed |= self.detach(id, &h);
                self.services
                    .get_mut(id)
                    .expect("exists")
                    .held
                    .retain(|x| *x != h);
                reason = Some(ChangeReason {
                    address: h.address,
                    pool: h.pool,
                    cause,
                });
            }
        }
        (reason, freed)
    }

    fn check_holding(&self, id: &str, spec: &ServiceSpec, h: &Holding) -> Result<(), ChangeCause> {
        let family = Family::of_addr(h.address);
        if !spec.families().contains(&family) {
            return Err(ChangeCause::FamilyDropped);
        }
        let pool = self.pools.get(&h.pool).ok_or(ChangeCause::PoolDeleted)?;
        if pool.spec.disabled {
            return Err(ChangeCause::PoolDisabled);
        }
        if pool.conflict.is_some() {
            return Err(ChangeCause::PoolConflicting);
        }
        if !pool.contains(h.address) {
            return Err(ChangeCause::OutsidePool);
        }
        if !pool.selects(spec) {
            return Err(ChangeCause::NotSelected);
        }
        if spec.requested(family).is_some_and(|r| r != h.address) {
            return Err(ChangeCause::RequestChanged);
        }
        let u = &self.addrs[&h.address];
        let mut others = u.users.iter().filter(|o| *o != id).peekable();
        if others.peek().is_some() {
            if u.key != spec.sharing_key {
                return Err(ChangeCause::SharingChanged);
            }
            for o in others {
                if clash(&spec.ports, &self.services[o].spec.ports).is_some() {
                    return Err(ChangeCause::SharingPortClash);
                }
            }
        }
        Ok(())
    }

    /// A sole user's key change re-keys its address.
    fn sync_key(&mut self, id: &str, address: IpAddr, key: Option<&String>) {
        let Some(u) = self.addrs.get_mut(&address) else {
            return;
        };
        if u.key.as_ref() == key || u.users.len() != 1 || !u.users.contains(id) {
            return;
        }
        if let Some(old) = u.key.take()
            && let Some(set) = self.by_key.get_mut(&old)
        {
            set.remove(&address);
            if set.is_empty() {
                self.by_key.remove(&old);
            }
        }
        u.key = key.cloned();
        if let Some(k) = key {
            self.by_key.entry(k.clone()).or_default().insert(address);
        }
    }

    fn try_assign(
        &mut self,
        id: &str,
        spec: &ServiceSpec,
        family: Family,
    ) -> Result<Holding, PendingReason> {
        if let Some(address) = spec.requested(family) {
            return self.try_requested(id, spec, address);
        }
        if let Some(key) = &spec.sharing_key {
            let mut clash_reason = None;
            let mut join = None;
            for &a in self.by_key.get(key).into_iter().flatten() {
                let u = &self.addrs[&a];
                let pool = &self.pools[&u.pool];
                if Family::of_addr(a) != family || !pool.is_usable() || !pool.selects(spec) {
                    continue;
                }
                match self.clash_with(spec, &u.users) {
                    Some(r) => {
                        clash_reason.get_or_insert(PendingReason::SharingPortClash {
                            address: a,
                            with: r.0,
                            port: r.1,
                        });
                    }
                    None => {
                        join = Some(a);
                        break;
                    }
                }
            }
            if let Some(a) = join {
                return Ok(self.join(id, a));
            }
            if let Some(r) = clash_reason {
                return Err(r);
            }
        }
        let owner = Owner::load_balancer(id);
        let mut exhausted = Vec::new();
        let mut unusable = None;
        let mut got = None;
        for name in self.order.values() {
            let pool = &self.pools[name];
            if !pool.has_family(family) || !pool.selects(spec) {
                continue;
            }
            if let Some(c) = &pool.conflict {
                unusable.get_or_insert_with(|| PendingReason::PoolConflicting {
                    pool: name.clone(),
                    conflict: c.clone(),
                });
                continue;
            }
            if pool.spec.disabled {
                unusable.get_or_insert_with(|| PendingReason::PoolDisabled { pool: name.clone() });
                continue;
            }
            match self.manager.allocate_next(name, family, owner.clone()) {
                Ok(a) => {
                    got = Some((name.clone(), a.address));
                    break;
                }
                Err(e) => {
                    if !matches!(e, crate::manager::ManagerError::PoolExhausted { .. }) {
                        self.faults
                            .push(format!("allocating in pool {name} for {owner}: {e}"));
                    }
                    exhausted.push(name.clone());
                }
            }
        }
        if let Some((pool, address)) = got {
            return Ok(self.attach_fresh(id, pool, address, spec.sharing_key.clone()));
        }
        Err(if !exhausted.is_empty() {
            PendingReason::Exhausted {
                family,
                pools: exhausted,
            }
        } else {
            unusable.unwrap_or(PendingReason::NoPoolSelects { family })
        })
    }

    fn try_requested(
        &mut self,
        id: &str,
        spec: &ServiceSpec,
        address: IpAddr,
    ) -> Result<Holding, PendingReason> {
        let family = Family::of_addr(address);
        let Some(name) = self.index.owner_of(family, addr_bits(address)) else {
            let conflicting = self
                .order
                .values()
                .map(|n| &self.pools[n])
                .find(|p| p.conflict.is_some() && p.in_blocks(address));
            return Err(match conflicting {
                Some(p) => PendingReason::PoolConflicting {
                    pool: p.spec.name.clone(),
                    conflict: p.conflict.clone().expect("filtered"),
                },
                None => PendingReason::RequestedOutsidePools { address },
            });
        };
        let pool = &self.pools[name];
        let name = name.to_owned();
        if !pool.selects(spec) {
            return Err(PendingReason::RequestedNotSelected {
                address,
                pool: name,
            });
        }
        if pool.spec.disabled {
            return Err(PendingReason::PoolDisabled { pool: name });
        }
        if !pool.contains(address) {
            return Err(PendingReason::AddressUnusable {
                address,
                pool: name,
            });
        }
        if let Some(u) = self.addrs.get(&address) {
            if u.key.is_some() && u.key == spec.sharing_key {
                if let Some((with, port)) = self.clash_with(spec, &u.users) {
                    return Err(PendingReason::SharingPortClash {
                        address,
                        with,
                        port,
                    });
                }
                return Ok(self.join(id, address));
            }
            let by = match self.manager.by_address(address).map(|a| &a.owner) {
                Some(Owner::LoadBalancer { service }) => service.clone(),
                _ => u.users.iter().next().cloned().unwrap_or_default(),
            };
            return Err(PendingReason::AddressTaken { address, by });
        }
        match self
            .manager
            .allocate(&name, address, Owner::load_balancer(id))
        {
            Ok(_) => Ok(self.attach_fresh(id, name, address, spec.sharing_key.clone())),
            Err(_) => Err(PendingReason::AddressUnusable {
                address,
                pool: name,
            }),
        }
    }

    /// The first user of an address whose ports clash with `spec`'s.
    fn clash_with(
        &self,
        spec: &ServiceSpec,
        users: &BTreeSet<String>,
    ) -> Option<(String, ServicePort)> {
        users
            .iter()
            .find_map(|u| clash(&spec.ports, &self.services[u].spec.ports).map(|p| (u.clone(), p)))
    }

    fn attach_fresh(
        &mut self,
        id: &str,
        pool: String,
        address: IpAddr,
        key: Option<String>,
    ) -> Holding {
        if let Some(k) = &key {
            self.by_key.entry(k.clone()).or_default().insert(address);
        }
        self.addrs.insert(
            address,
            AddrUse {
                pool: pool.clone(),
                key,
                users: BTreeSet::from([id.to_owned()]),
            },
        );
        Holding { address, pool }
    }

    fn join(&mut self, id: &str, address: IpAddr) -> Holding {
        let u = self
            .addrs
            .get_mut(&address)
            .expect("joined address is in use");
        u.users.insert(id.to_owned());
        Holding {
            address,
            pool: u.pool.clone(),
        }
    }

    /// Stops `id` using `h`. The last user releases the address; if the
    /// manager's owner leaves first, ownership moves to the next user.
    /// Returns whether the address went back to its pool.
    fn detach(&mut self, id: &str, h: &Holding) -> bool {
        let Some(u) = self.addrs.get_mut(&h.address) else {
            return false;
        };
        u.users.remove(id);
        let family = Family::of_addr(h.address);
        let owner = Owner::load_balancer(id);
        let generation = self
            .manager
            .get(&h.pool, family, &owner)
            .filter(|a| a.address == h.address)
            .map(|a| a.generation);
        let next = u.users.iter().next().cloned();
        if next.is_none() {
            let key = u.key.clone();
            self.addrs.remove(&h.address);
            if let Some(k) = key
                && let Some(set) = self.by_key.get_mut(&k)
            {
                set.remove(&h.address);
                if set.is_empty() {
                    self.by_key.remove(&k);
                }
            }
        }
        let Some(generation) = generation else {
            return false;
        };
        if let Err(e) = self.manager.release(&h.pool, family, &owner, generation) {
            self.faults
                .push(format!("releasing {} of {owner}: {e}", h.address));
        }
        match next {
            None => true,
            Some(next) => {
                if let Err(e) =
                    self.manager
                        .allocate(&h.pool, h.address, Owner::load_balancer(next.clone()))
                {
                    self.faults
                        .push(format!("moving {} to the next user {next}: {e}", h.address));
                }
                false
            }
        }
    }

    /// The allocator, writable: tests put it at odds with the holdings.
    #[cfg(test)]
    pub(crate) fn manager_mut(&mut self) -> &mut PoolManager<LbPoolSource> {
        &mut self.manager
    }

    #[cfg(test)]
    pub(crate) fn check_invariants(&self) {
        self.manager.check_invariants();
        let mut seen = BTreeMap::new();
        for (id, e) in &self.services {
            let mut fams = BTreeSet::new();
            for h in &e.held {
                assert!(
                    fams.insert(Family::of_addr(h.address)),
                    "{id}: two of a family"
                );
                let u = &self.addrs[&h.address];
                assert!(u.users.contains(id));
                assert_eq!(u.pool, h.pool);
                seen.entry(h.address)
                    .or_insert_with(BTreeSet::new)
                    .insert(id.clone());
                let pool = &self.pools[&h.pool];
                assert!(pool.is_usable() && pool.contains(h.address) && pool.selects(&e.spec));
            }
            assert_eq!(
                e.status.addresses().len(),
                e.held.len(),
                "{id}: status matches holdings"
            );
            let incomplete = e.status.pending().is_some() || e.status.missing_family.is_some();
            assert_eq!(self.pending.get(&e.seq) == Some(id), incomplete, "{id}");
        }
        assert_eq!(seen.len(), self.addrs.len());
        for (a, u) in &self.addrs {
            assert_eq!(&u.users, &seen[a]);
            let alloc = self.manager.by_address(*a).expect("allocated");
            assert!(
                matches!(&alloc.owner, Owner::LoadBalancer { service } if u.users.contains(service))
            );
            if u.users.len() > 1 {
                assert!(u.key.is_some());
            }
            for id in &u.users {
                assert_eq!(self.services[id].spec.sharing_key, u.key, "{a}");
            }
        }
        assert_eq!(self.manager.allocations().len(), self.addrs.len());
    }
}
