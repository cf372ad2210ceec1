//! LoadBalancer IPAM: which address each `type: LoadBalancer` service gets.
//!
//! The daemon feeds [`LbIpam`] with pool definitions ([`LbPoolSpec`], from
//! config or the API) and services ([`ServiceSpec`], from a Service watcher),
//! persists [`LbIpam::snapshot`] and programs [`LbIpam::plan`]. Everything here
//! is a pure decision; nothing is read or written outside the value.
//!
//! Why it is shaped this way:
//! - **One allocator.** Addresses are handed out by the same generic
//!   [`PoolManager`](crate::manager::PoolManager) as endpoint addresses (the
//!   architecture asks for one implementation of generations, idempotency and
//!   snapshots). [`LbPoolSource`] is the LB view of it: only enabled,
//!   non-conflicting pools, each converted to fully usable CIDRs (start–stop
//!   ranges are split by [`range_to_cidrs`]; the first and last addresses of
//!   CIDR blocks are excluded as reserved addresses unless
//!   `allow_first_last`).
//! - **Conflicts, not refusals.** Pools arrive one at a time, so an overlap
//!   marks the *later* pool (by first-apply order, a sequence number kept per
//!   pool) conflicting instead of failing; deleting or shrinking the earlier
//!   one makes it usable again. Detection uses an ordered interval index
//!   (`index` module), `O(log n)` per block.
//! - **Sticky addresses.** A service keeps its address across restarts and
//!   unrelated edits; it moves only when its own pool stops containing,
//!   selecting or serving it, and the move is recorded in
//!   [`ServiceStatus::last_change_reason`] so `lockstep lb` can say why.
//! - **Sharing.** Services with the same sharing key and no common
//!   (protocol, port) share an address. The manager records one owner per
//!   address (the first service); the others are tracked here, and ownership
//!   moves to a remaining service when the owner leaves.
//! - **Deterministic.** Pools are tried in first-apply order and pending
//!   services are retried in first-apply order, so the same inputs give the
//!   same addresses on every node and every restart.

pub mod announce;
pub mod cluster;
mod index;
mod ipam;
pub mod kubernetes;
pub mod members;
mod node_pools;
mod range;
mod spec;
mod status;

#[cfg(test)]
mod tests;

use ipnet::IpNet;

use crate::cidr::CidrError;
use crate::manager::ManagerError;

pub use index::Conflict;
pub use ipam::{
    Assignment, ChangeCause, ChangeReason, Holding, LbIpam, LbMetrics, LbPlan, LbPoolSource,
    LbSnapshot, PendingReason, PoolMetrics, PoolRecord, PoolStatus, ServiceRecord, ServiceStatus,
};
pub use node_pools::{check_against_cluster_pools, check_against_node_pools};
pub use range::range_to_cidrs;
pub use spec::{
    AddrRange, Announce, IpFamily, IpFamilyPolicy, LabelRequirement, LabelSelector, LbPoolSpec,
    Protocol, SelectorOperator, ServicePort, ServiceSpec,
};

/// Errors of LB IPAM: invalid definitions (naming the field), unknown names,
/// and snapshots that do not fit together.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LbError {
    /// A pool without a name.
    #[error("lb pool name is empty")]
    EmptyPoolName,
    /// The same pool twice in one batch.
    #[error("lb pool {pool} is given more than once")]
    DuplicatePool {
        /// The repeated name.
        pool: String,
    },
    /// A CIDR with host bits set.
    #[error("lb pool {pool}: {field}: invalid cidr {cidr}")]
    InvalidCidr {
        /// The pool.
        pool: String,
        /// Which entry, e.g. `cidrs[1]`.
        field: String,
        /// The CIDR as written.
        cidr: IpNet,
        /// What is wrong with it.
        #[source]
        source: CidrError,
    },
    /// A block inside a special-purpose range (unspecified, loopback,
    /// link-local, multicast, reserved, IPv4 seen through IPv6): no service
    /// may be given such an address.
    #[error(
        "lb pool {pool}: {field}: {block} overlaps {range}, {what}; no service may be given such addresses"
    )]
    SpecialRange {
        /// The pool.
        pool: String,
        /// Which entry, e.g. `cidrs[0]`.
        field: String,
        /// The block as written.
        block: String,
        /// The special-purpose range.
        range: IpNet,
        /// What that range is.
        what: &'static str,
    },
    /// A range whose start comes after its stop.
    #[error("lb pool {pool}: {field}: range {range} starts after it stops")]
    RangeReversed {
        /// The pool.
        pool: String,
        /// Which entry, e.g. `ranges[0]`.
        field: String,
        /// The range as written.
        range: AddrRange,
    },
    /// A range whose start and stop are of different families.
    #[error("lb pool {pool}: {field}: range {range} mixes ipv4 and ipv6")]
    RangeMixedFamilies {
        /// The pool.
        pool: String,
        /// Which entry.
        field: String,
        /// The range as written.
        range: AddrRange,
    },
    /// Two blocks of one pool overlap.
    #[error("lb pool {pool}: {field} overlaps {other_field}")]
    OverlapWithinPool {
        /// The pool.
        pool: String,
        /// The later entry.
        field: String,
        /// The entry it overlaps.
        other_field: String,
    },
    /// A malformed selector expression.
    #[error("lb pool {pool}: {field}: {operator}: {problem}")]
    InvalidSelector {
        /// The pool.
        pool: String,
        /// Which expression, e.g. `service_selector.match_expressions[0]`.
        field: String,
        /// Its operator.
        operator: SelectorOperator,
        /// What is wrong.
        problem: &'static str,
    },
    /// A malformed service.
    #[error("service {service}: {field}: {problem}")]
    InvalidService {
        /// `namespace/name` as given.
        service: String,
        /// Which field.
        field: String,
        /// What is wrong.
        problem: &'static str,
    },
    /// No pool of that name.
    #[error("unknown lb pool {pool}")]
    UnknownPool {
        /// The name asked for.
        pool: String,
    },
    /// No service of that name.
    #[error("unknown service {service}")]
    UnknownService {
        /// The `namespace/name` asked for.
        service: String,
    },
    /// The snapshot's allocator state could not be rebuilt.
    #[error("lb snapshot does not restore")]
    Restore {
        /// Why (boxed: keeps every `Result` of this module small).
        #[source]
        source: Box<ManagerError>,
    },
    /// A block of the pool overlaps a CIDR of one of the node's endpoint
    /// pools: the two allocators would hand out the same address.
    #[error("lb pool {pool}: {block} overlaps {node_cidr} of node pool {node_pool}")]
    OverlapsNodePool {
        /// The LB pool.
        pool: String,
        /// Its block (a CIDR, or one CIDR of a range).
        block: IpNet,
        /// The node pool's CIDR it overlaps.
        node_cidr: IpNet,
        /// The node pool.
        node_pool: String,
    },
    /// A block of the pool overlaps a CIDR of one of the cluster's pools
    /// (cluster mode): the two allocators would hand out the same address.
    #[error("lb pool {pool}: {block} overlaps {cluster_cidr} of cluster pool {cluster_pool}")]
    OverlapsClusterPool {
        /// The LB pool.
        pool: String,
        /// Its block (a CIDR, or one CIDR of a range).
        block: IpNet,
        /// The cluster pool's CIDR it overlaps.
        cluster_cidr: IpNet,
        /// The cluster pool.
        cluster_pool: String,
    },
    /// The snapshot's pools, services and allocations disagree.
    #[error("lb snapshot is inconsistent at {item}: {problem}")]
    InconsistentSnapshot {
        /// The address, pool or service concerned.
        item: String,
        /// What does not match.
        problem: &'static str,
    },
}
