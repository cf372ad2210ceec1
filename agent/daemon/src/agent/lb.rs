//! LoadBalancer IPAM in the agent: the core's [`LbIpam`] decides; this
//! module persists its state, programs IPCACHE and L2_RESP_V4, and sends a
//! gratuitous ARP when an address is newly announced.
//!
//! Order, as everywhere: decide → commit (the whole LB state, fsync) →
//! program → acknowledge; if programming fails, the previous state is put
//! back in memory and in the store, and the maps reconciled to it. Addresses
//! survive restarts because the state is restored, not rebuilt from service
//! status (the race peers have).

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr};

use lockstep_core::lb::{LbIpam, LbPoolSpec, PoolStatus, ServiceSpec, ServiceStatus};
use serde::{Deserialize, Serialize};

use super::{Agent, AgentError};

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

/// The LB state as the API shows it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LbView {
    /// Pools, with conflicts and usage.
    pub pools: Vec<PoolStatus>,
    /// Service statuses by `namespace/name`.
    pub services: BTreeMap<String, ServiceStatus>,
}

fn lb_err(e: lockstep_core::lb::LbError) -> AgentError {
    AgentError::Invalid {
        reason: e.to_string(),
    }
}

impl Agent {
    /// The LB state.
    pub fn lb_view(&self) -> LbView {
        LbView {
            pools: self.lb.pools().collect(),
            services: self
                .lb
                .services()
                .map(|(id, st)| (id.to_string(), st.clone()))
                .collect(),
        }
    }

    /// LB metrics (per-pool usage and conflicts, pending by reason).
    pub fn lb_metrics(&self) -> lockstep_core::lb::LbMetrics {
        self.lb.metrics()
    }

    /// The announced IPv4 addresses right now.
    fn announced(&self) -> BTreeSet<Ipv4Addr> {
        self.lb.plan().l2_announce_v4.into_keys().collect()
    }

    /// Applies pools and services, then commits, programs and announces.
    ///
    /// # Errors
    /// Invalid specs (nothing changes), or a failed commit or programming
    /// (the previous state is restored).
    pub fn lb_apply(&mut self, req: LbApply) -> Result<LbView, AgentError> {
        self.check_ready()?;
        for p in &req.pools {
            lockstep_core::lb::check_against_node_pools(p, &self.config.pools).map_err(lb_err)?;
        }
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
    /// succeeds, commits, programs and announces.
    fn lb_change(
        &mut self,
        change: impl FnOnce(&mut LbIpam) -> Result<(), AgentError>,
    ) -> Result<LbView, AgentError> {
        self.settle();
        let before = self.lb.snapshot();
        let announced_before = self.announced();
        if let Err(e) = change(&mut self.lb) {
            self.lb = LbIpam::restore(&before).map_err(lb_err)?;
            return Err(e);
        }
        // Holdings and allocator apart: never committed, never programmed.
        let faults = self.lb.take_faults();
        if !faults.is_empty() {
            tracing::error!(
                ?faults,
                "LB IPAM's allocator disagreed with its holdings; change refused"
            );
            self.lb = LbIpam::restore(&before).map_err(lb_err)?;
            return Err(AgentError::LbInconsistent { faults });
        }
        self.lb_commit(before, announced_before)?;
        Ok(self.lb_view())
    }

    fn lb_commit(
        &mut self,
        before: lockstep_core::lb::LbSnapshot,
        announced_before: BTreeSet<Ipv4Addr>,
    ) -> Result<(), AgentError> {
        let after = self.lb.snapshot();
        if let Err(e) = self.store.put_lb(&after) {
            self.lb = LbIpam::restore(&before).map_err(lb_err)?;
            return Err(e.into());
        }
        // Removals first inside reconcile: a released address stops being
        // answered as soon as this returns.
        if let Err(e) = self.reconcile_inner() {
            // Every undo step is tried and every failure reported. A store
            // that refuses the old state leaves memory (the old state, what
            // the caller was told) and store apart: `lb_unsaved` has the
            // store written again before the next change.
            let mut more = Vec::new();
            self.lb = LbIpam::restore(&before).map_err(lb_err)?;
            if let Err(s) = self.store.put_lb(&before) {
                self.lb_unsaved = true;
                more.push(s.into());
            }
            if let Err(r) = self.reconcile_inner() {
                more.push(r);
            }
            return Err(AgentError::with_more(e, more));
        }
        if let Some(up) = self.uplink.clone() {
            for addr in self.announced().difference(&announced_before) {
                if let Err(e) = crate::arp::announce(up.index, up.mac, *addr) {
                    tracing::warn!(error = %e, %addr, "gratuitous ARP failed");
                }
            }
        }
        Ok(())
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
