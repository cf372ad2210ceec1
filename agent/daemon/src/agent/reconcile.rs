//! Verify and reconcile: the desired contents of the maps (decided by the
//! core's `plan::desired` from the agent's state), the observed contents (read from
//! the pins), and the diff between them, either reported (verify) or applied
//! (reconcile, at start-up and periodically).
//!
//! It exists apart from the operations in `mod.rs` because it is the one
//! place that compares the whole state against the datapath.

use super::*;
use crate::announce;
use crate::map_table::MAPS;
use std::net::{Ipv4Addr, Ipv6Addr};

use lockstep_common::map_names;
use lockstep_core::cluster::remote::RemoteState;
use lockstep_core::cluster::remote_apply::remote_writes;
use lockstep_core::plan::desired::{DesiredInput, LocalEndpoint, desired};

/// The maps cluster mode's remote state has entries in.
const REMOTE_MAPS: [&str; 4] = [
    map_names::IPCACHE_V4,
    map_names::IPCACHE_V6,
    map_names::MASQ_SKIP_V4,
    map_names::MASQ_SKIP_V6,
];

/// How many keys `want` has that `have` has not, less the other way.
fn grown<K: Ord, V>(want: &BTreeMap<K, V>, have: &BTreeMap<K, V>) -> isize {
    let added = want.keys().filter(|k| !have.contains_key(k)).count();
    let removed = have.keys().filter(|k| !want.contains_key(k)).count();
    added as isize - removed as isize
}

impl Agent {
    /// Gathers the agent's state for the core's [`desired`], which decides
    /// every map's contents; `have`, the maps as they are, for what cluster
    /// mode keeps before its first read of etcd.
    pub(super) fn desired(&self, have: &MapContents) -> Result<MapContents, AgentError> {
        let mut maps = self.desired_local()?;
        self.add_remote(&mut maps, have);
        Ok(maps)
    }

    /// [`Agent::desired`] without cluster mode's remote entries: what the
    /// node's own state puts in the maps.
    fn desired_local(&self) -> Result<MapContents, AgentError> {
        // Between a delegated DEL's two holds (pending): unprogrammed already.
        let mut delegated = self.delegated_allocations();
        if !self.pending.is_empty() {
            delegated.retain(|a| !self.is_pending(&a.owner));
        }
        let endpoints = self
            .endpoints
            .values()
            .filter(|e| e.mode == EndpointMode::Full && !self.pending.contains(&e.key()))
            .map(|e| {
                let owner = Owner::endpoint(&e.container_id, &e.ifname);
                let generation = self
                    .manager
                    .owned_by(&owner)
                    .map(|a| a.generation.0)
                    .max()
                    .or_else(|| self.delegated.get(&e.key()).map(|d| d.generation.0))
                    .unwrap_or(0);
                LocalEndpoint {
                    container_id: &e.container_id,
                    ifname: &e.ifname,
                    host_ifindex: e.host_ifindex,
                    mac: e.mac,
                    addresses: &e.addresses,
                    generation,
                }
            })
            .collect();
        let input = DesiredInput {
            allocations: self.committed_allocations().chain(delegated.iter()),
            endpoints,
            lb_hosts: self.lb_host_entries(),
            // The announcement maps are the announcements' own (their
            // lock, their writer): their part is taken from there below.
            announce_v4: Vec::new(),
            announce_v6: Vec::new(),
            uplink: None,
            masq_skip_pools: self.manager.masq_skip_cidrs(),
            non_masquerade: &self.config.non_masquerade_cidrs,
        };
        let d = desired(input).map_err(|e| AgentError::Invalid {
            reason: e.to_string(),
        })?;
        for a in &d.lb_conflicts {
            tracing::error!(%a, "an LB address is also a node allocation");
        }
        Ok(announce::with_announced(d.maps, self.announce.contents()))
    }

    /// Writes what changes in the maps when cluster mode's remote state
    /// moves from `old` to `new` (the core's `remote_writes`): only the
    /// changed entries, read from nothing, where a reconcile reads every
    /// map. These are changes asked for, not drift repaired: not counted
    /// as repairs. The periodic reconcile still repairs drift.
    ///
    /// # Errors
    /// A map could not be written (the caller reconciles whole).
    pub fn follow_remote(
        &mut self,
        old: &RemoteState,
        new: &RemoteState,
    ) -> Result<ReconcileReport, AgentError> {
        let started = Instant::now();
        let local = self.desired_local()?;
        let w = remote_writes(old, new, &local);
        let mut report = ReconcileReport::default();
        if w.is_empty() {
            return Ok(report);
        }
        for m in MAPS.iter().filter(|m| REMOTE_MAPS.contains(&m.name())) {
            m.apply(&self.maps, &w.want, &w.have, &mut report)?;
        }
        // The entry counts follow without a count of the whole maps.
        let moved = [
            (
                map_names::IPCACHE_V4,
                grown(&w.want.prefix_v4, &w.have.prefix_v4),
            ),
            (
                map_names::IPCACHE_V6,
                grown(&w.want.prefix_v6, &w.have.prefix_v6),
            ),
            (
                map_names::MASQ_SKIP_V4,
                grown(&w.want.masq_v4, &w.have.masq_v4),
            ),
            (
                map_names::MASQ_SKIP_V6,
                grown(&w.want.masq_v6, &w.have.masq_v6),
            ),
        ];
        for (name, by) in moved {
            if let Some(n) = self.stats.entries.get_mut(name) {
                *n = n.saturating_add_signed(by);
            }
        }
        report.micros = started.elapsed().as_micros() as u64;
        Ok(report)
    }

    /// The addresses the agent itself announces (not cluster mode's, not
    /// the elected writer's): its single-node LB pools' and, if announced,
    /// the ingress address.
    pub(super) fn local_announcements(&self) -> (Vec<Ipv4Addr>, Vec<Ipv6Addr>) {
        let announced_ingress = self
            .config
            .roles
            .ingress
            .announce
            .then(|| {
                self.manager
                    .allocations()
                    .find_map(|a| match (&a.owner, a.address) {
                        (
                            Owner::Agent {
                                role: lockstep_core::owner::AgentRole::Ingress,
                            },
                            IpAddr::V4(v4),
                        ) => Some(v4),
                        _ => None,
                    })
            })
            .flatten();
        // Elected (#44 item 1): the LB addresses are the announcer's,
        // answered only while this agent holds the Lease.
        if self.lb_elected() {
            return (announced_ingress.into_iter().collect(), Vec::new());
        }
        let plan = self.lb.plan();
        let v4 = plan
            .l2_announce_v4
            .into_keys()
            .chain(announced_ingress)
            .collect();
        let v6 = plan.l2_announce_v6.into_keys().collect();
        (v4, v6)
    }

    /// The maps the agent writes under its own lock, as they are. The
    /// announcement maps are left empty: they are the announcements'
    /// (written under their lock, read with what they should hold by
    /// `Announcements::snapshot`), and neither caller uses them from here.
    pub(super) fn observed(&self) -> Result<MapContents, AgentError> {
        let mut have = MapContents::default();
        for m in MAPS
            .iter()
            .filter(|m| !announce::announcement_map(m.name()))
        {
            m.observe(&self.maps, &mut have)?;
        }
        Ok(have)
    }

    pub(super) fn reconcile_inner(&mut self) -> Result<ReconcileReport, AgentError> {
        let started = Instant::now();
        let have = self.observed()?;
        let want = self.desired(&have)?;
        // The maps the programs use, by descriptor: never a pin's path.
        let root = &self.maps;
        let mut report = ReconcileReport::default();
        // Slots are cleared before and filled after their hashes change, so
        // a slot never holds what its hash does not (see
        // `lockstep_common::slots`).
        // The announcement maps are written under their own lock (their
        // renewer and cluster mode's LB agent write them too).
        let others: Vec<_> = MAPS
            .iter()
            .filter(|m| !announce::announcement_map(m.name()))
            .collect();
        for m in &others {
            m.clear(root, &want, &have)?;
        }
        for m in &others {
            m.apply(root, &want, &have, &mut report)?;
        }
        for m in &others {
            m.fill(root, &want, &have, &mut report)?;
        }
        let (v4, v6) = self.local_announcements();
        self.announce.reconcile(v4, v6, &mut report)?;
        self.stats.entries = MAPS
            .iter()
            .filter_map(|m| Some((m.name(), m.counted(&want)?)))
            .collect();
        report.micros = started.elapsed().as_micros() as u64;
        Ok(report)
    }

    /// Compares the maps with the store-derived plan and applies the
    /// difference (batch syscalls). Counts the changes as repairs.
    ///
    /// # Errors
    /// A map could not be read or written.
    pub fn reconcile(&mut self) -> Result<ReconcileReport, AgentError> {
        self.reconcile_counting(|_| true)
    }

    /// A whole reconcile for cluster mode's remote state, when there is no
    /// earlier state to write the difference from (the first state after a
    /// start, a remote write that failed): what it changes in the maps
    /// the remote state fills (IPCACHE, MASQ_SKIP) is that state's change
    /// (blocks claimed and given back while the agent was away), not drift,
    /// and is not counted as repairs; the other maps' differences are.
    ///
    /// # Errors
    /// A map could not be read or written.
    pub fn reconcile_remote(&mut self) -> Result<ReconcileReport, AgentError> {
        let report = self.reconcile_counting(|map| !REMOTE_MAPS.contains(&map))?;
        let applied: usize = report
            .per_map
            .iter()
            .filter(|(m, _)| REMOTE_MAPS.contains(&m.as_str()))
            .map(|(_, n)| *n)
            .sum();
        if applied > 0 {
            tracing::info!(entries = applied, "remote state applied whole");
        }
        Ok(report)
    }

    /// [`Agent::reconcile`], counting as repairs only the maps `counts`
    /// names.
    fn reconcile_counting(
        &mut self,
        counts: impl Fn(&str) -> bool,
    ) -> Result<ReconcileReport, AgentError> {
        // A store that failed (a full disk) recovers here too, so the agent
        // becomes ready again without waiting for a request.
        if let Err(e) = self.store.recover() {
            tracing::warn!(error = %e, "the store is still failing");
        }
        self.settle();
        self.guard_pins()?;
        let report = self.reconcile_inner()?;
        match self.sync_tunnel(false) {
            Ok(0) => {}
            Ok(n) => {
                *self.stats.repairs.entry("TUNNEL".into()).or_default() += n;
                tracing::warn!(repaired = n, "reconcile repaired the tunnel");
            }
            Err(e) => {
                tracing::error!(error = %crate::error_chain(&e), "the tunnel could not be repaired")
            }
        }
        let mut repaired = 0;
        for (map, n) in report.per_map.iter().filter(|(m, _)| counts(m)) {
            *self.stats.repairs.entry(map.clone()).or_default() += *n as u64;
            repaired += n;
        }
        if repaired > 0 {
            tracing::warn!(?report, "reconcile repaired drift");
        }
        Ok(report)
    }

    /// Compares store, core and maps without changing anything.
    ///
    /// # Errors
    /// The store or a map could not be read.
    pub fn verify(&self) -> Result<VerifyReport, AgentError> {
        let mut report = VerifyReport::default();
        let stored = self.store.load()?;
        // A parked release is held in memory and stored, on purpose, until
        // the store accepts its removal: named, never silent.
        report.store.extend(self.parked.describe());
        let mut in_store: Vec<&Allocation> = stored
            .allocations
            .iter()
            // A pending release (`reaper`) is held and stored, unmapped,
            // for the moments its veth takes to go.
            .filter(|a| !self.parked.holds(a) && !self.reaper.holds(a))
            .collect();
        let mut in_memory: Vec<&Allocation> = self.committed_allocations().collect();
        in_store.sort();
        in_memory.sort();
        for a in &in_memory {
            if in_store.binary_search(a).is_err() {
                report.store.push(format!(
                    "{} {} held in memory but not stored",
                    a.address, a.owner
                ));
            }
        }
        for a in &in_store {
            if in_memory.binary_search(a).is_err() {
                report
                    .store
                    .push(format!("{} {} stored but not held", a.address, a.owner));
            }
        }
        // The announcement maps' parts are read together under their own
        // lock (a renewal between two reads is not drift).
        let (announced_want, announced_have) = self.announce.snapshot()?;
        let have = announce::with_announced(self.observed()?, announced_have);
        let want = announce::with_announced(self.desired(&have)?, announced_want);
        if let Some(host) = self.netlink.as_ref() {
            for e in self
                .endpoints
                .values()
                .filter(|e| e.mode == EndpointMode::Full)
            {
                let name = e.host_ifname.clone().unwrap_or_default();
                match host.link(&name) {
                    Ok(Some(l)) if l.index == e.host_ifindex => {}
                    _ => report.store.push(format!(
                        "interface {name} of {}/{} is missing",
                        e.container_id, e.ifname
                    )),
                }
            }
        }
        for m in MAPS {
            m.drift(&want, &have, &mut report.maps);
        }
        report.pins = self.verify_pins();
        report.draining = self.draining();
        report.fenced = self.cluster_fenced();
        report.covered = self.cluster_covered();
        report.fenced.extend(self.cluster_overlaps());
        report.routes = self.remote_route_drift();
        report.routes.extend(self.tunnel_drift());
        report.ok = report.store.is_empty()
            && report.maps.is_empty()
            && report.pins.is_empty()
            && report.fenced.is_empty()
            && report.covered.is_empty()
            && report.routes.is_empty();
        Ok(report)
    }
}
