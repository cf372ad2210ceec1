//! What the agent reports: verify's drift, reconcile's counts, pools and
//! status as the API and CLI print them. Plain data, apart from the agent's
//! state and operations. A map's drift and a reconcile's counts are the map
//! table's own ([`crate::map_table`]), which finds and counts them.

use std::collections::BTreeMap;
use std::net::IpAddr;

use ipnet::IpNet;
use lockstep_core::owner::Generation;

use serde::{Deserialize, Serialize};

pub use crate::map_table::{Drift, ReconcileReport};

/// Result of `verify`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct VerifyReport {
    /// No drift anywhere.
    pub ok: bool,
    /// Allocations in memory that the store lacks, or the other way round.
    pub store: Vec<String>,
    /// Map entries that differ from the store.
    pub maps: Vec<Drift>,
    /// Ranges the configuration dropped that still have holders
    /// (informational: stored and programmed on purpose, not drift).
    #[serde(default)]
    pub draining: Vec<lockstep_core::manager::DrainingRange>,
    /// Map pins that do not name the maps the programs use, and a pin root
    /// this agent lost to another store.
    #[serde(default)]
    pub pins: Vec<String>,
    /// Cluster blocks this node may no longer allocate from (another node
    /// holds them, or etcd no longer records them).
    #[serde(default)]
    pub fenced: Vec<String>,
    /// Cluster mode: addresses held here that a block etcd gives another
    /// node also covers (each may have two holders).
    #[serde(default)]
    pub covered: Vec<String>,
    /// Cluster mode's routes to other nodes' blocks (protocol 213) that
    /// differ from etcd's state.
    #[serde(default)]
    pub routes: Vec<String>,
    /// Cluster mode: etcd keys this build cannot read, skipped by every
    /// read (`cluster::Unreadable`).
    #[serde(default)]
    pub unreadable: Vec<String>,
    /// Cluster mode: another agent instance runs under this node's name
    /// (#26 item 5).
    #[serde(default)]
    pub identity: Vec<String>,
    /// Kubernetes: endpoint allocations whose pod has been gone longer
    /// than the grace period (`kubernetes::leaks`).
    #[serde(default)]
    pub leaked: Vec<String>,
}

/// Pool usage for the API and metrics.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolStatus {
    /// Name.
    pub name: String,
    /// CIDRs (draining ones included).
    pub cidrs: Vec<IpNet>,
    /// CIDRs being drained.
    pub draining: Vec<IpNet>,
    /// The configuration no longer lists the pool; it lives on while its
    /// draining ranges have holders.
    #[serde(default)]
    pub retired: bool,
    /// Each draining range with its holders.
    #[serde(default)]
    pub draining_ranges: Vec<lockstep_core::manager::DrainingRange>,
    /// Skip masquerade.
    pub skip_masquerade: bool,
    /// Per family: (allocated, free).
    pub v4: (u128, u128),
    /// Per family: (allocated, free).
    pub v6: (u128, u128),
}

/// Agent status.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Status {
    /// The agent's version ([`crate::version::version`]): which build
    /// answers, for example after an image upgrade or rollback.
    #[serde(default)]
    pub version: String,
    /// Ready to serve.
    pub ready: bool,
    /// Why not, when not.
    pub reason: Option<String>,
    /// Node name.
    pub node: String,
    /// The pool a request that names none uses (`default_pool`, else the
    /// first pool).
    #[serde(default)]
    pub default_pool: Option<String>,
    /// Number of allocations.
    pub allocations: usize,
    /// Agent-owned addresses by role.
    pub roles: BTreeMap<String, Vec<IpAddr>>,
    /// Highest generation.
    pub generation: Generation,
    /// Changes applied by the start-up reconcile.
    pub restored: ReconcileReport,
    /// Repairs made by periodic reconciles since start.
    pub repairs: u64,
    /// Map pins put back (removed or replaced) since start.
    #[serde(default)]
    pub pin_repairs: u64,
    /// Delegated IPAM: how often each CNI command was run on the plugin
    /// (and `compensating_del`).
    #[serde(default)]
    pub ipam_commands: BTreeMap<String, u64>,
}

/// Counters the metrics module reads.
#[derive(Clone, Debug, Default)]
pub struct Stats {
    /// Repairs per map by periodic reconciles.
    pub repairs: BTreeMap<String, u64>,
    /// Map pins put back per map (removed or replaced).
    pub pin_repairs: BTreeMap<String, u64>,
    /// Errors per code.
    pub errors: BTreeMap<&'static str, u64>,
    /// Entries per map at the last reconcile.
    pub entries: BTreeMap<&'static str, usize>,
    /// Delegated IPAM plugin runs per CNI command.
    pub ipam_commands: BTreeMap<&'static str, u64>,
}

/// The node's uplink: where to_native/from_native run and LoadBalancer
/// addresses are announced.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Uplink {
    /// Interface name.
    pub name: String,
    /// Interface index.
    pub index: u32,
    /// Its MAC: what the ARP responder answers with.
    pub mac: [u8; 6],
}
