//! The agent as cluster mode's allocator (`cluster::allocator`): the
//! server composes the two, so neither names the other.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Arc;

use ipnet::IpNet;
use lockstep_core::cidr::Family;
use lockstep_core::cluster::LocalOverlap;
use lockstep_core::cluster::remote::RemoteState;
use lockstep_core::pool::PoolSpec;

use crate::agent::{Agent, AgentHandle};
use crate::announce::UplinkHealth;
use crate::cluster::allocator::{AgentSlot, AllocatorDoor, ClusterAllocator, DoorFuture, Job};

impl ClusterAllocator for Agent {
    fn set_cluster_windows(&mut self, windows: BTreeMap<IpNet, BTreeSet<IpAddr>>) {
        Agent::set_cluster_windows(self, windows);
    }

    fn window_views(
        &self,
        groups: &[(String, Family)],
        candidates: usize,
    ) -> Vec<(Vec<IpAddr>, Vec<IpAddr>)> {
        Agent::window_views(self, groups, candidates)
    }

    fn set_local_overlaps(&mut self, overlaps: Vec<LocalOverlap>) {
        Agent::set_local_overlaps(self, overlaps);
    }

    fn set_cluster_pools(
        &mut self,
        pools: Vec<PoolSpec>,
        fenced: BTreeMap<IpNet, String>,
        excluded: BTreeSet<IpAddr>,
    ) -> Result<(), String> {
        Agent::set_cluster_pools(self, pools, fenced, excluded).map_err(|e| crate::error_chain(&e))
    }

    fn set_cluster_others(&mut self, node: &str, others: imbl::OrdMap<IpNet, String>) {
        Agent::set_cluster_others(self, node, others);
    }

    fn set_cluster_default(&mut self, default: Result<Option<String>, String>) {
        Agent::set_cluster_default(self, default);
    }

    fn block_usage(&self, blocks: &[IpNet]) -> Vec<u64> {
        Agent::block_usage(self, blocks)
    }

    fn addresses_in(&self, blocks: &[IpNet]) -> Vec<IpAddr> {
        Agent::addresses_in(self, blocks)
    }

    fn reconcile(&mut self) -> Result<(), String> {
        Agent::reconcile_remote(self)
            .map(drop)
            .map_err(|e| crate::error_chain(&e))
    }

    fn follow_remote(&mut self, old: &RemoteState, new: &RemoteState) -> Result<(), String> {
        Agent::follow_remote(self, old, new)
            .map(drop)
            .map_err(|e| crate::error_chain(&e))
    }

    fn uplink_health(&mut self) -> UplinkHealth {
        Agent::uplink_health(self)
    }
}

/// The agent's owner as the door: jobs run as its commands, usage read
/// from its published view.
struct OwnerDoor(AgentHandle);

impl AllocatorDoor for OwnerDoor {
    fn present(&self) -> bool {
        self.0.view().present
    }

    fn usage(&self, blocks: &[IpNet]) -> (Vec<u64>, Vec<IpAddr>) {
        let v = self.0.view();
        (v.block_usage(blocks), v.addresses_in(blocks))
    }

    fn run(&self, job: Job) -> DoorFuture<'_, bool> {
        Box::pin(async move {
            self.0
                .ask(move |a| a.as_mut().map(|agent| job(agent)).is_some())
                .await
                .unwrap_or(false)
        })
    }
}

/// Cluster mode's way to the agent behind `slot`.
pub(super) fn slot(handle: &AgentHandle) -> AgentSlot {
    Some(Arc::new(OwnerDoor(handle.clone())))
}
