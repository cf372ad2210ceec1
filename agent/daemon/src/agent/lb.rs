//! LoadBalancer IPAM in the agent: the core's [`LbIpam`] decides; this
//! module persists its state, programs IPCACHE, L2_RESP_V4 and L2_RESP_V6,
//! and sends a gratuitous ARP (IPv4) or an unsolicited Neighbor
//! Advertisement (IPv6) when an address is newly announced.
//!
//! Order, as everywhere: decide → commit (the whole LB state, fsync) →
//! program → acknowledge; if programming fails, the previous state is put
//! back in memory and in the store, and the maps reconciled to it. Addresses
//! survive restarts because the state is restored, not rebuilt from service
//! status (the race peers have).

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use lockstep_core::lb::{LbIpam, LbPoolSpec, LbSnapshot, ServiceSpec};
use serde::{Deserialize, Serialize};

use super::{Agent, AgentError};
use crate::lb_view::LbView;

/// What `lb apply` sends: pools and services, either list may be empty.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LbApply {
    /// Pools to create or replace.
    #[serde(default)]
    pub pools: Vec<LbPoolSpec>,
    /// Services to create or replace.
    #[serde(default)]
    pub services: Vec<ServiceSpec>,
}

/// What `lb delete` sends.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LbDelete {
    /// Pools by name.
    #[serde(default)]
    pub pools: Vec<String>,
    /// Services as `namespace/name`.
    #[serde(default)]
    pub services: Vec<String>,
}

fn lb_err(e: lockstep_core::lb::LbError) -> AgentError {
    AgentError::Invalid {
        reason: e.to_string(),
    }
}

impl Agent {
    /// The LB state.
    pub fn lb_view(&self) -> LbView {
        LbView::of(&self.lb)
    }

    /// LB metrics (per-pool usage and conflicts, pending by reason).
    pub fn lb_metrics(&self) -> lockstep_core::lb::LbMetrics {
        self.lb.metrics()
    }

    /// Refuses LB pools that overlap one of this node's configured pools
    /// (in cluster mode too, before the check against the cluster's).
    ///
    /// # Errors
    /// The first overlap, both pools named.
    pub fn lb_check_node_pools(&self, pools: &[LbPoolSpec]) -> Result<(), AgentError> {
        for p in pools {
            lockstep_core::lb::check_against_node_pools(p, &self.config.pools).map_err(lb_err)?;
        }
        Ok(())
    }

    /// Applies pools and services, then commits, programs and announces.
    ///
    /// # Errors
    /// Invalid specs (nothing changes), or a failed commit or programming
    /// (the previous state is restored).
    pub fn lb_apply(&mut self, req: LbApply) -> Result<LbView, AgentError> {
        self.check_ready()?;
        self.lb_check_node_pools(&req.pools)?;
        self.lb_change(|lb| {
            if !req.pools.is_empty() {
                lb.apply_pools(req.pools).map_err(lb_err)?;
            }
            for s in req.services {
                lb.apply_service(s).map_err(lb_err)?;
            }
            Ok(())
        })
    }

    /// Deletes services (their addresses return to the pool unless shared)
    /// and pools.
    ///
    /// # Errors
    /// An unknown name (nothing changes), or a failed commit or programming.
    pub fn lb_delete(&mut self, req: LbDelete) -> Result<LbView, AgentError> {
        self.check_ready()?;
        self.lb_change(|lb| {
            for s in &req.services {
                lb.delete_service(s).map_err(lb_err)?;
            }
            for p in &req.pools {
                lb.delete_pool(p).map_err(lb_err)?;
            }
            Ok(())
        })
    }

    /// Runs `change` on the LB state; if it fails, nothing changes; if it
    /// succeeds, commits, programs and announces ([`lb_transaction`]).
    fn lb_change(
        &mut self,
        change: impl FnOnce(&mut LbIpam) -> Result<(), AgentError>,
    ) -> Result<LbView, AgentError> {
        self.settle();
        lb_transaction(self, change)?;
        Ok(self.lb_view())
    }

    /// Whether the LB addresses are answered only while this agent is the
    /// elected writer (`[kubernetes]` without `[cluster]`, #44 item 1): the
    /// election's announcer hands them to the announcements, capped at the
    /// Lease's deadline, and the agent itself never announces them.
    #[must_use]
    pub fn lb_elected(&self) -> bool {
        self.config.kubernetes.is_some() && self.config.cluster.is_none()
    }

    /// The addresses the LB state announces (L2 pools), both families.
    #[must_use]
    pub fn lb_announced(&self) -> BTreeSet<IpAddr> {
        announced(&self.lb)
    }

    /// Every LB address assigned, with its pool.
    #[must_use]
    pub fn lb_addresses(&self) -> BTreeMap<IpAddr, String> {
        self.lb.addresses()
    }

    /// LB addresses, for the planner: (address, value) host entries.
    pub(super) fn lb_host_entries(&self) -> Vec<(IpAddr, lockstep_common::IpcacheValue)> {
        let plan = self.lb.plan();
        plan.ipcache_v4
            .into_iter()
            .map(|(n, v)| (IpAddr::V4(n.addr()), v))
            .chain(
                plan.ipcache_v6
                    .into_iter()
                    .map(|(n, v)| (IpAddr::V6(n.addr()), v)),
            )
            .collect()
    }
}

/// What an LB change needs besides the LB state itself: the store, the maps
/// and the uplink. The agent is one; unit tests put the doors' doubles
/// behind another.
pub(crate) trait LbHost {
    /// The LB state.
    fn lb_state(&mut self) -> &mut LbIpam;
    /// Commits the whole LB state.
    fn put_lb(&mut self, state: &LbSnapshot) -> Result<(), AgentError>;
    /// Brings the maps to the current state (a reconcile).
    fn program(&mut self) -> Result<(), AgentError>;
    /// Notes that the store holds another LB state than memory: it is
    /// written again before the next change.
    fn set_unsaved(&mut self);
    /// Announces a newly served address (gratuitous ARP, unsolicited
    /// NA), best effort.
    fn announce(&mut self, addr: IpAddr);
}

/// The addresses the state announces, both families.
fn announced(lb: &LbIpam) -> BTreeSet<IpAddr> {
    let plan = lb.plan();
    plan.l2_announce_v4
        .into_keys()
        .map(IpAddr::V4)
        .chain(plan.l2_announce_v6.into_keys().map(IpAddr::V6))
        .collect()
}

/// Runs `change` on the LB state, then commits, programs and announces.
///
/// Order, and what each failure leaves:
/// - `change` fails, or leaves the allocator apart from its holdings: the
///   previous state is put back; nothing was committed or programmed.
/// - the commit fails: the previous state is put back in memory; the store
///   kept it.
/// - programming fails: the previous state is put back in memory and in the
///   store, and the maps are programmed to it again. Every undo step is
///   tried and every failure reported; a store that refuses the old state
///   is marked unsaved ([`LbHost::set_unsaved`]), never silently apart.
///
/// # Errors
/// The first failure, with every undo step's failure after it.
pub(crate) fn lb_transaction(
    host: &mut impl LbHost,
    change: impl FnOnce(&mut LbIpam) -> Result<(), AgentError>,
) -> Result<(), AgentError> {
    let before = host.lb_state().snapshot();
    let announced_before = announced(host.lb_state());
    // Putting the previous state back in memory; a failure to (a snapshot
    // that does not restore) is reported after the cause.
    let undo = |host: &mut dyn LbHost, e: AgentError| -> AgentError {
        match LbIpam::restore(&before) {
            Ok(lb) => {
                *host.lb_state() = lb;
                e
            }
            Err(r) => AgentError::with_more(e, vec![lb_err(r)]),
        }
    };
    if let Err(e) = change(host.lb_state()) {
        return Err(undo(host, e));
    }
    // Holdings and allocator apart: never committed, never programmed.
    let faults = host.lb_state().take_faults();
    if !faults.is_empty() {
        tracing::error!(
            ?faults,
            "LB IPAM's allocator disagreed with its holdings; change refused"
        );
        return Err(undo(host, AgentError::LbInconsistent { faults }));
    }
    let after = host.lb_state().snapshot();
    if let Err(e) = host.put_lb(&after) {
        return Err(undo(host, e));
    }
    // Removals first inside a reconcile: a released address stops being
    // answered as soon as this returns.
    if let Err(e) = host.program() {
        let e = undo(host, e);
        let mut more = Vec::new();
        if let Err(s) = host.put_lb(&before) {
            host.set_unsaved();
            more.push(s);
        }
        if let Err(r) = host.program() {
            more.push(r);
        }
        return Err(AgentError::with_more(e, more));
    }
    let now = announced(host.lb_state());
    for addr in now.difference(&announced_before) {
        host.announce(*addr);
    }
    Ok(())
}

impl LbHost for Agent {
    fn lb_state(&mut self) -> &mut LbIpam {
        &mut self.lb
    }

    fn put_lb(&mut self, state: &LbSnapshot) -> Result<(), AgentError> {
        Ok(self.store.put_lb(state)?)
    }

    fn program(&mut self) -> Result<(), AgentError> {
        self.reconcile_inner().map(drop)
    }

    fn set_unsaved(&mut self) {
        self.lb_unsaved = true;
    }

    fn announce(&mut self, addr: IpAddr) {
        // Elected: the writer's announcer announces, and only while the
        // Lease is held.
        if !self.lb_elected() {
            self.send_announcement(addr);
        }
    }
}

#[cfg(test)]
mod tests;
