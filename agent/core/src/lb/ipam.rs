//! The LB IPAM state machine: pools, services, shared addresses, and the
//! [`PoolManager`] that hands the addresses out.
//!
//! This file holds the state and the changes (apply and delete pools and
//! services, conflicts, re-evaluation); `assign` decides how a service gets,
//! joins or gives up an address; `query` answers statuses, metrics and the
//! datapath plan; `snapshot` persists and restores the state and checks its
//! invariants. The reported types live in `super::status`.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Arc;

use ipnet::{Ipv4Net, Ipv6Net};
use lockstep_common::IpcacheValue;

use super::LbError;
use super::index::{Conflict, ConflictIndex};
use super::range::{addr_bits, excluded_addresses, range_to_cidrs, usable_interval};
use super::spec::{Announce, Block, IpFamilyPolicy, LbPoolSpec, ServicePort, ServiceSpec};
pub use super::status::*;
use crate::cidr::Family;
use crate::manager::{ManagerConfig, MasqueradeRule, PoolManager, PoolSource};
use crate::owner::Owner;
use crate::plan::classify;
use crate::pool::PoolSpec;

mod assign;
mod query;
mod snapshot;

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

    /// The allocator, writable: tests put it at odds with the holdings.
    #[cfg(test)]
    pub(crate) fn manager_mut(&mut self) -> &mut PoolManager<LbPoolSource> {
        &mut self.manager
    }
}
