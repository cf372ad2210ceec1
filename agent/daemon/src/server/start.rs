//! What the agent starts from that only the cluster and Kubernetes sources
//! know: the pools recorded in the state directory (cluster blocks, NodeIPAM
//! CIDRs, the Node's podCIDRs) and cluster mode's node addresses.
//!
//! It lives in the server, which composes the agent with those sources, so
//! the agent names neither: it is handed a [`Start`] and a remote view.

use std::sync::Arc;

use lockstep_core::cluster::remote::RemoteState;
use lockstep_core::cluster::{ClaimedBlock, check_configured, local_overlaps};
use lockstep_core::pool::PoolSpec;

use crate::agent::{AgentError, RemoteSource, Start};
use crate::config::Config;

/// The agent's start inputs for `config`.
///
/// # Errors
/// A record cannot be read, a configured pool overlaps a recorded one, or
/// cluster mode's node addresses cannot be found.
pub(super) fn inputs(config: &Config) -> Result<Start, AgentError> {
    let node_ips = match &config.cluster {
        Some(cluster) => crate::cluster::node_ips(config, cluster)
            .map_err(|reason| AgentError::Invalid { reason })?,
        None => Vec::new(),
    };
    Ok(Start {
        pools: start_pools(config)?,
        node_ips,
    })
}

/// The pools the manager starts with: the configuration's, then the
/// cluster pools of the blocks recorded in the state directory (so stored
/// allocations in them restore into their blocks, not into draining
/// ranges). An unreadable record is an error: serving without it could
/// hand out what the node does not hold. So is a configured pool sharing
/// addresses with a recorded cluster pool or block (`cluster::overlap`).
/// NodeIPAM's pools come from its record the same way
/// (`kubernetes::nodeipam::start_specs`), and so does the pod-CIDR pool
/// (`kubernetes::pod_cidrs::start_spec`).
///
/// # Errors
/// [`AgentError::Invalid`] naming the file, or every overlap.
fn start_pools(config: &Config) -> Result<Vec<PoolSpec>, AgentError> {
    let mut pools = config.pools.clone();
    if config.cluster.is_some() {
        let held =
            crate::cluster::Held::load(&config.state_dir).map_err(|e| AgentError::Invalid {
                reason: crate::error_chain(&e),
            })?;
        let blocks: Vec<ClaimedBlock<'_>> = held
            .blocks
            .iter()
            .map(|b| ClaimedBlock {
                pool: &b.pool,
                block: b.cidr,
                node: &held.node,
            })
            .collect();
        check_configured(local_overlaps(&config.pools, &held.pools, &blocks)).map_err(|e| {
            AgentError::Invalid {
                reason: e.to_string(),
            }
        })?;
        pools.extend(crate::cluster::local_specs(config, &held));
    }
    // NodeIPAM (#29 item 5): the CIDRs the record says this node holds,
    // before the API answers.
    let nodeipam = config.nodeipam_pools();
    if !nodeipam.is_empty() {
        let specs =
            crate::kubernetes::nodeipam::start_specs(&config.state_dir, &nodeipam, &config.pools)
                .map_err(|reason| AgentError::Invalid { reason })?;
        pools.extend(specs);
    }
    // `[kubernetes] pod_cidr_pool`: the recorded podCIDRs (the server
    // recorded the Node's before the start); the follower changes them.
    if let Some(name) = config
        .kubernetes
        .as_ref()
        .and_then(|k| k.pod_cidr_pool.as_deref())
        && let Some(spec) = crate::kubernetes::pod_cidrs::start_spec(&config.state_dir, name)
            .map_err(|e| AgentError::Invalid {
                reason: crate::error_chain(&e),
            })?
    {
        pools.push(spec);
    }
    Ok(pools)
}

impl RemoteSource for crate::cluster::RemoteView {
    fn read(&self) -> Option<Arc<RemoteState>> {
        self.is_read().then(|| self.snapshot())
    }

    fn route_drift(&self) -> Vec<String> {
        crate::cluster::RemoteView::route_drift(self).unwrap_or_else(|e| {
            vec![format!(
                "remote routes not read: {}",
                crate::error_chain(&e)
            )]
        })
    }
}
