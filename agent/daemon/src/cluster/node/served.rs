//! What the claim loop gives the allocator ([`Served`]), compared whole
//! with what it gave last so any difference reaches it, and the cluster
//! pools as local pools of the held blocks ([`local_specs`]).

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use imbl::OrdMap;
use ipnet::IpNet;
use lockstep_core::cluster::{LocalOverlap, local_pools};
use lockstep_core::pool::PoolSpec;

use crate::cluster::Held;
use crate::cluster::allocator::ClusterAllocator;
use crate::config::Config;

/// The cluster pools as the allocator's local pools, from what `held`
/// records (the configuration's pools win a name clash).
pub fn local_specs(config: &Config, held: &Held) -> Vec<PoolSpec> {
    let mut blocks: BTreeMap<String, BTreeSet<IpNet>> = BTreeMap::new();
    for b in &held.blocks {
        blocks.entry(b.pool.clone()).or_default().insert(b.cidr);
    }
    // Fenced blocks, blocks whose give-back may have happened and the
    // blocks of a pool being removed serve nothing new (their holders
    // keep their addresses).
    let draining: BTreeSet<&str> = held
        .pools
        .iter()
        .filter(|p| p.draining)
        .map(|p| p.name.as_str())
        .collect();
    let left_out: BTreeSet<IpNet> = held
        .blocks
        .iter()
        .filter(|b| !b.serves() || draining.contains(b.pool.as_str()))
        .map(|b| b.cidr)
        .collect();
    let taken = config.pools.iter().map(|p| p.name.clone()).collect();
    let (specs, clashes) = local_pools(&held.pools, &blocks, &left_out, &taken);
    for name in clashes {
        tracing::error!(pool = %name, "a cluster pool has the name of a configured pool; the configured pool is used");
    }
    specs
}

/// What cluster mode gives the allocator: the local pools of the blocks it
/// may use (the core's `local_pools`: held and not fenced), the fenced
/// blocks with why, the other nodes' blocks (for `verify`) and the default
/// pool. Compared whole, so any difference reaches the allocator.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Served {
    pub(super) specs: Vec<PoolSpec>,
    pub(super) fenced: BTreeMap<IpNet, String>,
    /// A persistent map shared with the claim loop and the allocator: a
    /// copy costs nothing, a block changed copies one path of it, and
    /// comparing two that share it skips what they share.
    pub(super) others: OrdMap<IpNet, String>,
    /// Configured CIDRs withheld for overlapping the cluster's.
    pub(super) overlaps: Vec<LocalOverlap>,
    /// Addresses other nodes' pods may hold (reserved for a removed or
    /// reclaimed node): never handed out (#26 item 2).
    pub(super) excluded: BTreeSet<IpAddr>,
    /// Each block's reservation window (#43): the allocator hands out
    /// nothing of a block outside it.
    pub(super) windows: BTreeMap<IpNet, BTreeSet<IpAddr>>,
    pub(super) default: Result<Option<String>, String>,
}

impl Served {
    /// Gives the agent what differs from `had` (everything when `None`).
    pub(super) fn give(&self, node: &str, agent: &mut dyn ClusterAllocator, had: Option<&Served>) {
        // Windows before pools: a block the pools add is limited from the
        // moment it exists.
        if had.is_none_or(|h| h.windows != self.windows) {
            agent.set_cluster_windows(self.windows.clone());
        }
        // Overlaps first: `set_cluster_pools` withholds them.
        let overlaps = had.is_none_or(|h| h.overlaps != self.overlaps);
        if overlaps {
            agent.set_local_overlaps(self.overlaps.clone());
        }
        if (overlaps
            || had.is_none_or(|h| {
                h.specs != self.specs || h.fenced != self.fenced || h.excluded != self.excluded
            }))
            && let Err(e) = agent.set_cluster_pools(
                self.specs.clone(),
                self.fenced.clone(),
                self.excluded.clone(),
            )
        {
            tracing::error!(error = %e, "cluster blocks not all served");
        }
        if had.is_none_or(|h| h.others != self.others) {
            agent.set_cluster_others(node, self.others.clone());
        }
        agent.set_cluster_default(self.default.clone());
    }
}
