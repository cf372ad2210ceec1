//! What cluster mode needs of the node's allocator, as traits of its own.
//!
//! Why it exists: the claim loop, the remote task and the LB agent change
//! the allocator's pools, windows and datapath, but cluster mode must not
//! name the agent (nor the agent cluster mode): the server, which composes
//! them, hands each cluster task an [`AgentSlot`], a door to whatever
//! implements [`ClusterAllocator`] (the agent, run on its owner thread).
//! Each change is a job on that door, run whole; reads that must not wait
//! ([`AllocatorDoor::usage`]) come from what the allocator last published.

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::Arc;

use ipnet::IpNet;
use lockstep_core::cidr::Family;
use lockstep_core::cluster::LocalOverlap;
use lockstep_core::cluster::remote::RemoteState;
use lockstep_core::pool::PoolSpec;

use crate::announce::UplinkHealth;

/// The allocator as cluster mode changes it (in one job, nothing else in
/// between).
pub trait ClusterAllocator {
    /// Limits each block to its reservation window.
    fn set_cluster_windows(&mut self, windows: BTreeMap<IpNet, BTreeSet<IpAddr>>);
    /// Per pool and family: the free addresses inside the windows and up
    /// to `candidates` outside them, in the order they are handed out.
    fn window_views(
        &self,
        groups: &[(String, Family)],
        candidates: usize,
    ) -> Vec<(Vec<IpAddr>, Vec<IpAddr>)>;
    /// The configured CIDRs overlapping the cluster's (withheld by the
    /// next [`ClusterAllocator::set_cluster_pools`]).
    fn set_local_overlaps(&mut self, overlaps: Vec<LocalOverlap>);
    /// The cluster pools as local pools, the fenced blocks with why, and
    /// the addresses never to hand out.
    ///
    /// # Errors
    /// A block was refused (why); the rest is applied.
    fn set_cluster_pools(
        &mut self,
        pools: Vec<PoolSpec>,
        fenced: BTreeMap<IpNet, String>,
        excluded: BTreeSet<IpAddr>,
    ) -> Result<(), String>;
    /// The other nodes' blocks, for `verify`.
    fn set_cluster_others(&mut self, node: &str, others: imbl::OrdMap<IpNet, String>);
    /// The cluster pool serving requests that name none (`Err`: why none).
    fn set_cluster_default(&mut self, default: Result<Option<String>, String>);
    /// Addresses held in each of `blocks`.
    fn block_usage(&self, blocks: &[IpNet]) -> Vec<u64>;
    /// Every address held inside one of `blocks`, sorted.
    fn addresses_in(&self, blocks: &[IpNet]) -> Vec<IpAddr>;
    /// A full reconcile of the datapath (the remote entries changed, and
    /// no earlier state to tell which): its changes to the maps the remote
    /// state fills are that state's, not drift, and are not counted as
    /// repairs.
    ///
    /// # Errors
    /// Why it failed.
    fn reconcile(&mut self) -> Result<(), String>;
    /// Writes the datapath entries that change when the remote state
    /// moves from `old` to `new`, and only those.
    ///
    /// # Errors
    /// Why it failed (the caller reconciles whole).
    fn follow_remote(&mut self, old: &RemoteState, new: &RemoteState) -> Result<(), String>;
    /// The uplink's health, asked of the allocator's datapath (its own
    /// probe could not tell).
    fn uplink_health(&mut self) -> UplinkHealth;
}

/// A job on the allocator.
pub type Job = Box<dyn FnOnce(&mut dyn ClusterAllocator) + Send>;

/// A future a door returns.
pub type DoorFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// The way to the allocator.
pub trait AllocatorDoor: Send + Sync + 'static {
    /// Whether there is an allocator to ask (started, not stopped), as
    /// last published: never waits.
    fn present(&self) -> bool;
    /// Per block, the addresses in use, and every address in use inside
    /// them (sorted), as last published: never waits.
    fn usage(&self, blocks: &[IpNet]) -> (Vec<u64>, Vec<IpAddr>);
    /// Runs `job` on the allocator; whether it ran (false: there is none).
    fn run(&self, job: Job) -> DoorFuture<'_, bool>;
}

/// The node's allocator: `None` for a node run without one (the cluster
/// benchmark's simulated nodes).
pub type AgentSlot = Option<Arc<dyn AllocatorDoor>>;

/// Whether there is no allocator to ask (none, not installed yet, or
/// stopped), without waiting.
pub(crate) fn no_agent(slot: &AgentSlot) -> bool {
    slot.as_ref().is_none_or(|d| !d.present())
}

/// Runs `f` on the allocator; `None` when there is none.
pub(crate) async fn on_agent<T: Send + 'static>(
    slot: &AgentSlot,
    f: impl FnOnce(&mut dyn ClusterAllocator) -> T + Send + 'static,
) -> Option<T> {
    let door = slot.as_ref()?;
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    let ran = door
        .run(Box::new(move |a| {
            let _ = tx.send(f(a));
        }))
        .await;
    if ran { rx.try_recv().ok() } else { None }
}
