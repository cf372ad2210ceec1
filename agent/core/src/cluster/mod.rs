//! Cluster mode decisions: cluster pools cut into blocks that nodes claim
//! through a shared store (etcd), with no I/O here.
//!
//! - [`spec`]: [`ClusterPoolSpec`] (serde, validated) and the checks an
//!   apply must pass against the blocks already claimed.
//! - [`default`]: which pool serves requests that name none.
//! - [`layout`]: block `i` of a CIDR and back.
//! - [`decide`]: which block a node claims next, when to claim, when to give
//!   an empty block back, fencing.
//! - [`reclaim`]: when a node's blocks may be taken (its lease recorded
//!   gone for `reclaim_after`, or `--force`) and which addresses the next
//!   holder must not hand out.
//! - [`names`]: names that become one segment of an etcd key.
//! - [`local`]: the cluster pools as local pools of the blocks a node holds.
//! - [`cover`]: addresses a node holds inside blocks etcd gives other
//!   nodes (what a block fenced while the node ran may have doubled).
//! - [`overlap`]: the node's configured pools against the cluster's
//!   addresses (refused at start, withheld while running).
//! - [`restore`]: etcd restored from a backup: telling that it went back
//!   in time, the blocks a node claims back, the grace before new claims.
//! - [`remote`]: what a node programs for the other nodes' blocks (IPCACHE,
//!   routes, MASQ_SKIP) and the diff against what is there.
//! - [`routing`]: the routing mode (native, tunnel, cross-subnet) and the
//!   path to each remote node's blocks; the endpoint MTU rule.
//! - [`window`]: the reservation window a node publishes before it hands
//!   out an address of it (#43).
//! - [`round`]: one claim round's decisions: claims, give-backs, fenced
//!   blocks forgotten, what the node publishes, the gates on claims.
//!
//! Time is passed in as milliseconds; the daemon's etcd door performs what
//! these functions decide (`agent/daemon/src/cluster/node/`).

pub mod cover;
pub mod decide;
pub mod default;
pub mod kube_nodes;
pub mod kube_pools;
pub mod layout;
pub mod local;
pub mod names;
pub mod overlap;
pub mod prune;
pub mod reclaim;
pub mod remote;
pub mod remote_apply;
pub mod remote_index;
pub mod restore;
pub mod round;
pub mod routing;
pub mod spec;
pub mod window;

#[cfg(test)]
mod tests;

pub use cover::{Covered, covered_by_others};
pub use decide::{BlockUse, Fence, blocks_to_claim, blocks_to_release, fence, next_block, spread};
pub use default::{default_for_apply, default_pool};
pub use layout::{block_at, block_count, block_index};
pub use local::{block_size, blocks_wanted, local_pools, low_water, reserve, usable_in_block};
pub use names::{check_key_name, key_name_problem};
pub use overlap::{
    ClaimedBlock, LocalOverlap, OverlapWith, check_configured, local_overlaps, withhold,
};
pub use reclaim::{
    GoneMark, GoneStep, NodeLease, Removal, check_node_removal, gone_keeper, gone_keeper_after,
    gone_step, own_mark_stale, reclaimable, reservations_to_keep, reserved_for, reserved_in_block,
};
pub use remote::{NodeDirectory, node_addresses_problem};
pub use restore::{Rollback, StoreMark, advance, may_claim_new, rolled_back, to_reclaim};
pub use round::{BlockClaim, Gate, RoundBlock, RoundInput, RoundPlan, plan_round};
pub use spec::{ClusterPoolSpec, check_apply, plan_apply, validate_pools};
pub use window::{GroupView, WindowSizing, WindowStep};

use ipnet::IpNet;

/// Errors in cluster pool definitions and cluster decisions.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ClusterError {
    /// The pool definition fails a single-node pool rule (name, canonical
    /// CIDR, special range, overlap).
    #[error(transparent)]
    Pool(#[from] crate::pool::PoolError),
    /// A block size that cannot cut the CIDR.
    #[error("block size /{block} for cidr {cidr} of cluster pool {pool}: {reason}")]
    BadBlockSize {
        /// The pool.
        pool: String,
        /// The CIDR.
        cidr: IpNet,
        /// The block prefix length given.
        block: u8,
        /// What is wrong.
        reason: &'static str,
    },
    /// An apply would take away (or re-cut) a CIDR that still has claimed
    /// blocks.
    #[error("cidr {cidr} of cluster pool {pool} still has claimed blocks: {}", list(.blocks))]
    CidrInUse {
        /// The pool.
        pool: String,
        /// The CIDR the apply removes or re-cuts.
        cidr: IpNet,
        /// Each claimed block and the node holding it.
        blocks: Vec<(IpNet, String)>,
    },
    /// A pools file sets `draining`, which only lockstep sets (when an
    /// apply removes a pool that still has claimed blocks).
    #[error(
        "cluster pool {pool}: draining is set by lockstep when a pool with claimed blocks is removed; leave it out of the pools file"
    )]
    DrainingGiven {
        /// The pool.
        pool: String,
    },
    /// A name that cannot be one segment of an etcd key (a `/`, a control
    /// character): the key it makes could not be read back.
    #[error("{what} name {name:?} is not usable in cluster mode: {reason}")]
    BadName {
        /// What carries the name (`cluster pool`, `node`).
        what: &'static str,
        /// The name as given.
        name: String,
        /// What is wrong.
        reason: &'static str,
    },
    /// Several cluster pools and none recorded as the default.
    #[error("cluster pools {} and none is the default: apply them with default_pool = NAME (or set default_pool in the agent's configuration)", .pools.join(", "))]
    NoDefault {
        /// The pools.
        pools: Vec<String>,
    },
    /// The default named is not one of the pools.
    #[error("default_pool {pool} is not a cluster pool")]
    DefaultUnknown {
        /// The name given or recorded.
        pool: String,
    },
    /// An apply that drops the default pool without naming another.
    #[error("the apply removes cluster pool {pool}, the default; name another with default_pool")]
    DefaultRemoved {
        /// The default the apply drops.
        pool: String,
    },
    /// A node whose lease is alive cannot be removed without force.
    #[error("node {node} is alive (its lease is held); stop it first or use --force")]
    NodeAlive {
        /// The node.
        node: String,
    },
    /// The node's lease is gone, but not yet for `reclaim_after`: it may
    /// be cut off from etcd and still serve its blocks.
    #[error(
        "node {node}'s lease is gone{}, but its blocks are freed only once it has been gone for reclaim_after{}: it may be cut off from etcd and still serve them; wait, or use --force",
        .gone_s.map(|s| format!(" (recorded {s} s ago)")).unwrap_or_else(|| " (not recorded yet: no live node has seen it gone)".into()),
        .left_s.map(|s| format!(" ({s} s left)")).unwrap_or_default()
    )]
    ReclaimNotDue {
        /// The node.
        node: String,
        /// Seconds since its lease was recorded gone (`None`: not
        /// recorded yet).
        gone_s: Option<u64>,
        /// Seconds left until its blocks may be taken.
        left_s: Option<u64>,
    },
    /// etcd has no key of the node at all: nothing to remove.
    #[error(
        "no node {node} in etcd (no node key, no block, no routing key): check the name with `lockstep cluster nodes`"
    )]
    UnknownNode {
        /// The node.
        node: String,
    },
    /// The node's configured pools share addresses with the cluster's
    /// pools or blocks (`overlap`): refused at start.
    #[error("{}: a configured pool may not share addresses with the cluster's (two nodes would hand out the same address); change or remove the configured pool", .overlaps.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))]
    ConfiguredPoolOverlaps {
        /// Every overlap, both sides named.
        overlaps: Vec<LocalOverlap>,
    },
}

fn list(blocks: &[(IpNet, String)]) -> String {
    blocks
        .iter()
        .map(|(b, n)| format!("{b} (node {n})"))
        .collect::<Vec<_>>()
        .join(", ")
}
