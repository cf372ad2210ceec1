//! Cluster mode's narrow door into the agent: the cluster pools (the blocks
//! this node holds, as local pools) go through the same manager sync as the
//! configuration's pools, so a block added disturbs no allocation and a
//! block dropped (given back or fenced) drains until empty, as a CIDR the
//! configuration dropped does (`draining`).

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use ipnet::IpNet;
use lockstep_core::cluster::LocalOverlap;
use lockstep_core::cluster::remote::RemoteState;
use lockstep_core::pool::PoolSpec;

use super::{Agent, AgentError};

/// Where the other nodes' blocks and the cluster's skip-masquerade CIDRs
/// come from (cluster mode's remote task). Defined here so the agent names
/// no cluster module: the server hands it the cluster's view.
pub trait RemoteSource: Send + Sync + std::fmt::Debug {
    /// The desired remote state, once etcd has been read since the agent
    /// started (`None` before: the node keeps what it has).
    fn read(&self) -> Option<std::sync::Arc<RemoteState>>;
    /// How lockstep's routes in the calling thread's namespace differ from
    /// the desired remote state, one line each (a failure to list them is
    /// a line too). Blocking.
    fn route_drift(&self) -> Vec<String>;
}

/// What the agent knows of cluster mode: the blocks fenced at start or
/// since (block → why) and the blocks etcd gives other nodes, both named by
/// `verify`.
#[derive(Clone, Debug, Default)]
pub struct ClusterView {
    fenced: BTreeMap<IpNet, String>,
    /// This node's name and every block etcd gives another node (block →
    /// node), as last read: an address held here inside one of them may
    /// have two holders.
    others: Option<(String, imbl::OrdMap<IpNet, String>)>,
    /// The other nodes' blocks and the cluster's skip-masquerade CIDRs
    /// (`cluster::remote`), part of the desired maps.
    remote: Option<std::sync::Arc<dyn RemoteSource>>,
    /// The cluster pool serving requests that name none, as etcd records
    /// it (`Err`: why there is none); `None` outside cluster mode.
    default: Option<Result<Option<String>, String>>,
    /// Configured CIDRs sharing addresses with the cluster's: withheld from
    /// the allocator, named by `verify` (`cluster::overlap`).
    overlaps: Vec<LocalOverlap>,
}

impl Agent {
    /// Makes the cluster pools `cluster` (on top of the configuration's
    /// pools) and records `fenced`. Blocks left out drain: their holders
    /// stay, nothing new comes from them. `excluded` (addresses another
    /// node's pods may hold) are never handed out.
    ///
    /// # Errors
    /// [`AgentError::Invalid`] when the manager refused a block (an
    /// overlap); the rest of the change is applied.
    pub fn set_cluster_pools(
        &mut self,
        cluster: Vec<PoolSpec>,
        fenced: BTreeMap<IpNet, String>,
        excluded: BTreeSet<IpAddr>,
    ) -> Result<(), AgentError> {
        let mut all = lockstep_core::cluster::withhold(&self.config.pools, &self.cluster.overlaps);
        all.extend(cluster);
        self.manager.source_mut().0 = all;
        self.manager.set_excluded(excluded);
        let report = self.manager.sync();
        self.cluster.fenced = fenced;
        if !(report.added.is_empty() && report.removed.is_empty() && report.draining.is_empty())
            && let Err(e) = self.reconcile()
        {
            tracing::warn!(error = %crate::error_chain(&e), "reconcile after a block change failed");
        }
        if report.errors.is_empty() {
            Ok(())
        } else {
            Err(AgentError::Invalid {
                reason: format!(
                    "cluster blocks refused: {}",
                    report
                        .errors
                        .iter()
                        .map(ToString::to_string)
                        .collect::<Vec<_>>()
                        .join("; ")
                ),
            })
        }
    }

    /// Limits each cluster block listed to its reservation window (#43):
    /// the allocator hands out no address of it outside the window. Every
    /// cluster block is to be listed (an empty window hands out nothing);
    /// given before the pools that add a block, so no block ever serves
    /// unlimited.
    pub fn set_cluster_windows(&mut self, windows: BTreeMap<IpNet, BTreeSet<IpAddr>>) {
        self.manager.set_windows(windows);
    }

    /// For the window planner: per pool and family asked, the free
    /// addresses inside the windows and up to `candidates` outside them,
    /// each in the order the allocator hands them out.
    pub fn window_views(
        &self,
        groups: &[(String, lockstep_core::cidr::Family)],
        candidates: usize,
    ) -> Vec<(Vec<IpAddr>, Vec<IpAddr>)> {
        groups
            .iter()
            .map(|(pool, family)| self.manager.window_view(pool, *family, candidates))
            .collect()
    }

    /// Records the configured CIDRs that overlap the cluster's: the next
    /// [`Agent::set_cluster_pools`] withholds them from the allocator.
    pub fn set_local_overlaps(&mut self, overlaps: Vec<LocalOverlap>) {
        self.cluster.overlaps = overlaps;
    }

    /// The configured CIDRs withheld, each with what it overlaps, for
    /// `verify`.
    pub fn cluster_overlaps(&self) -> Vec<String> {
        self.cluster
            .overlaps
            .iter()
            .map(|o| format!("{o}: withheld, nothing new is allocated from it"))
            .collect()
    }

    /// Addresses held in each of `blocks` (every holder: committed,
    /// pending, draining).
    pub fn block_usage(&self, blocks: &[IpNet]) -> Vec<u64> {
        let mut used = vec![0u64; blocks.len()];
        for a in self.manager.allocations() {
            if let Some(i) = blocks.iter().position(|b| b.contains(&a.address)) {
                used[i] += 1;
            }
        }
        used
    }

    /// Every allocated address, sorted (the published view's copy).
    pub fn allocated(&self) -> Vec<IpAddr> {
        self.manager.allocations().map(|a| a.address).collect()
    }

    /// Every address held inside one of `blocks` (every holder), sorted:
    /// what the node publishes as in use.
    pub fn addresses_in(&self, blocks: &[IpNet]) -> Vec<IpAddr> {
        let mut out: Vec<IpAddr> = self
            .manager
            .allocations()
            .map(|a| a.address)
            .filter(|a| blocks.iter().any(|b| b.contains(a)))
            .collect();
        out.sort_unstable();
        out.dedup();
        out
    }

    /// Records the cluster pool that serves requests naming none (the
    /// core's `cluster::default_pool` over what etcd records).
    pub fn set_cluster_default(&mut self, default: Result<Option<String>, String>) {
        if self.cluster.default.as_ref() != Some(&default) {
            tracing::info!(?default, "cluster default pool");
        }
        self.cluster.default = Some(default);
    }

    /// In cluster mode, the default pool etcd records, when the
    /// configuration has no pool of its own: `None` outside cluster mode
    /// (or before cluster mode told).
    ///
    /// # Errors
    /// Why there is no default (several cluster pools, none recorded).
    pub(super) fn cluster_default(&self) -> Option<Result<Option<String>, String>> {
        self.cluster.default.clone()
    }

    /// Records the blocks etcd gives nodes other than `node` (block →
    /// node), as the cluster task last read them.
    pub fn set_cluster_others(&mut self, node: &str, others: imbl::OrdMap<IpNet, String>) {
        self.cluster.others = Some((node.to_owned(), others));
    }

    /// The fenced blocks, each with why and the addresses still held in
    /// it, for `verify`.
    pub fn cluster_fenced(&self) -> Vec<String> {
        let blocks: Vec<IpNet> = self.cluster.fenced.keys().copied().collect();
        let used = self.block_usage(&blocks);
        self.cluster
            .fenced
            .iter()
            .zip(used)
            .map(|((b, why), n)| {
                format!("block {b} is fenced: {why}; nothing new comes from it, {n} address(es) still held here")
            })
            .collect()
    }

    /// Every address held here that a block of another node also covers
    /// (the core's `covered_by_others`), for `verify`: each may have a
    /// second holder on that node.
    pub fn cluster_covered(&self) -> Vec<String> {
        let Some((node, others)) = &self.cluster.others else {
            return Vec::new();
        };
        let held = self.manager.allocations().map(|a| (a.address, &a.owner));
        lockstep_core::cluster::covered_by_others(node, held, others)
            .into_iter()
            .map(|c| {
                format!(
                    "address {} ({}) is inside block {} held by {}",
                    c.address, c.holder, c.block, c.node
                )
            })
            .collect()
    }
}

impl Agent {
    /// Makes cluster mode's remote state (`cluster::remote`) part of the
    /// desired maps: reconcile writes its entries and verify reports them.
    pub fn set_remote_view(&mut self, view: std::sync::Arc<dyn RemoteSource>) {
        self.cluster.remote = Some(view);
    }

    /// Adds the remote entries to `maps` (the agent's own entries win).
    /// In cluster mode, until etcd has been read since the agent started,
    /// they are the ones the maps hold (`have`): a restart withdraws none.
    pub(super) fn add_remote(
        &self,
        maps: &mut lockstep_core::plan::desired::MapContents,
        have: &lockstep_core::plan::desired::MapContents,
    ) {
        match self.cluster.remote.as_ref().map(|v| v.read()) {
            Some(Some(state)) => state.merge_into(maps),
            None if self.config.cluster.is_none() => {}
            Some(None) | None => {
                RemoteState::carried_over(have, BTreeMap::new()).merge_into(maps);
            }
        }
    }

    /// Drift of cluster mode's remote routes (none outside cluster mode).
    pub(super) fn remote_route_drift(&self) -> Vec<String> {
        self.cluster
            .remote
            .as_ref()
            .map(|v| v.route_drift())
            .unwrap_or_default()
    }
}
