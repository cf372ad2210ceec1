//! Cluster mode's door to etcd: the only module that talks to etcd.
//!
//! Why a door of its own: in cluster mode etcd is the cluster's source of
//! truth for pools, for which node owns which block of addresses and for
//! which nodes are alive, while every address inside a block is still
//! allocated, committed and programmed locally. Keeping every etcd request
//! in one module means one place decides how a request is bounded in time,
//! how an answer that never came is read back, and how each write is
//! guarded; the decisions themselves (which block to claim, when to give
//! one back, what to fence) are the core's (`lockstep_core::cluster`).
//!
//! Key layout under the prefix (default `/lockstep/v1/`; docs/cluster.md):
//!
//! ```text
//! pools/<name>                  → ClusterPoolSpec (JSON)
//! blocks/<pool>/<cidr-escaped>  → BlockRecord (JSON), no lease
//! nodes/<node>                  → NodeRecord (JSON), bound to the node's lease
//! node_addrs/<node>             → NodeAddrRecord (JSON), no lease: where the
//!                                 node's blocks are routed, its addresses in
//!                                 use, since when its lease is gone
//! reserved/<node>               → ReservedRecord (JSON), no lease: addresses
//!                                 a removed node's pods may still hold
//! lb/...                        → LoadBalancer pools, services, state (`lb`)
//! ```
//!
//! Every write is a transaction with a guard: a pool apply compares the
//! revision of every pool it read and that no block changed since; a claim is
//! create-if-absent; a give-back compares the block's revision. Every request
//! is bounded by the door's timeout; a write whose answer did not come in
//! time is read back, because without quorum the leader may still have
//! logged it and commit it later (docs/design/cluster.md, "A lesson from the
//! harness").

pub mod allocator;
mod backoff;
mod door;
mod handle;
mod held;
mod keeping;
mod lb;
pub mod lb_agent;
mod lb_announce;
mod lb_assigner;
pub mod lb_handle;
mod lb_keeper;
pub mod lb_timing;
mod mirror;
mod node;
mod remote;
mod watch;

pub use door::{Door, DoorOptions, POOLS_SOURCE_KUBERNETES, TlsFiles};
pub use handle::{ClusterFigures, ClusterHandle, Holding};
pub(crate) use held::write_json;
pub use held::{Held, HeldBlock, HeldError};
pub use lb::{LbView, NEW_SERVICES_PER_ROUND, Round};
pub use lb_agent::LbAgent;
pub use lb_handle::{Assignments, LbHandle};
pub use mirror::{Kv, Link, Mirror, Stamp};
pub(crate) use node::node_ips;
pub use node::{AgentSlot, ClusterNode, local_specs};
pub use remote::{RemoteError, RemoteTask, RemoteView, RouteSync, sync_routes};
pub use watch::{Change, Watch};

use std::net::IpAddr;

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

/// Errors of the cluster door.
#[derive(Debug, thiserror::Error)]
pub enum ClusterStoreError {
    /// etcd did not answer within the door's timeout, or could not be
    /// reached. `maybe_written`: a write was sent and its outcome is unknown.
    #[error("etcd at {endpoints} is unavailable ({what}){}", if *.maybe_written { "; the write may still commit" } else { "" })]
    Unavailable {
        /// The endpoints tried.
        endpoints: String,
        /// What was asked, and etcd's or the transport's answer.
        what: String,
        /// A write was sent and may still be applied.
        maybe_written: bool,
    },
    /// etcd checked the request and refused it (too many operations in a
    /// transaction, a request too large, no permission, its space quota
    /// exceeded): nothing was written, and the same request will be
    /// refused again. Not "unavailable": retrying does not help.
    #[error("etcd refused {what}: {reason}; nothing was written")]
    Rejected {
        /// What was asked.
        what: String,
        /// etcd's answer.
        reason: String,
    },
    /// A guarded write lost against a concurrent one: re-read and decide again.
    #[error("etcd changed under {what}; re-read and try again")]
    Conflict {
        /// What was being written.
        what: String,
    },
    /// The requested change breaks a cluster rule (the core's check).
    #[error(transparent)]
    Refused(#[from] lockstep_core::cluster::ClusterError),
    /// A stored value is not what this build writes.
    #[error("etcd key {key} holds an unreadable value: {reason}")]
    Corrupt {
        /// The key.
        key: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A watch asked for history etcd has compacted away: read the state
    /// again and watch from after that read (a resync by diff).
    #[error("etcd compacted its history up to revision {compacted}; resync")]
    Compacted {
        /// The compaction revision.
        compacted: i64,
    },
    /// etcd's store revision is below one this watch has already seen:
    /// etcd went back in time (restored from a backup), and a watch resumed
    /// from the old revision would wait for revisions that will be written
    /// anew and never report what was written below them. Read everything
    /// again.
    #[error(
        "etcd's revision went back from {seen} to {now} (restored from a backup?); reading everything again"
    )]
    RolledBack {
        /// The highest revision seen before.
        seen: i64,
        /// The revision etcd answers with now.
        now: i64,
    },
    /// The options are unusable (no endpoint, a bad prefix).
    #[error("invalid cluster option: {0}")]
    Invalid(String),
    /// A live node key of this node's name belongs to another agent
    /// instance: two hosts run under one name (a cloned host, a hostname
    /// reused). Nothing was written.
    #[error(
        "node name {name} is in use by another agent: its live node key holds instance {theirs}, this agent is instance {ours} (two hosts with one name? give each its own cluster.node_name)"
    )]
    NameTaken {
        /// The node name.
        name: String,
        /// The instance holding the live key.
        theirs: String,
        /// This agent's instance.
        ours: String,
    },
}

/// The value of a block key: who holds the block. Deliberately not bound to
/// a lease (see docs/design/cluster.md, "Why blocks are not bound to leases").
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BlockRecord {
    /// The node holding the block.
    pub node: String,
    /// Wall-clock time of the claim, milliseconds since the epoch (for
    /// operators; no decision reads it).
    pub claimed_at_ms: u64,
    /// The claiming agent's instance (#26 item 5): two hosts under one
    /// name are told apart by it. Absent in records of older builds (the
    /// name alone decides then).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instance: Option<String>,
}

/// A claimed block as read from etcd.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Block {
    /// Its pool.
    pub pool: String,
    /// The block's prefix.
    pub cidr: IpNet,
    /// Who holds it.
    pub node: String,
    /// The holding agent's instance, when the record names one.
    pub instance: Option<String>,
    /// The key's mod revision: a give-back compares it.
    pub revision: i64,
}

impl Block {
    /// Whether the block is held by node `name` running as `instance`: the
    /// name matches and the record names that instance or none (a record
    /// of an older build).
    pub fn held_by(&self, name: &str, instance: &str) -> bool {
        held_by(&self.node, self.instance.as_deref(), name, Some(instance))
    }

    /// Who holds it, for logs and fences: the node, and the instance when
    /// the record names one.
    pub fn holder(&self) -> String {
        holder(&self.node, self.instance.as_deref())
    }
}

impl BlockRecord {
    /// As [`Block::held_by`]; `instance` `None` (an operator's door)
    /// compares the name only.
    pub fn held_by(&self, name: &str, instance: Option<&str>) -> bool {
        held_by(&self.node, self.instance.as_deref(), name, instance)
    }

    /// As [`Block::holder`].
    pub fn holder(&self) -> String {
        holder(&self.node, self.instance.as_deref())
    }
}

/// A block recorded as `node` (instance `recorded`) is held by `name`
/// running as `instance` when the names match and, if both instances are
/// known, they match too.
fn held_by(node: &str, recorded: Option<&str>, name: &str, instance: Option<&str>) -> bool {
    node == name
        && match (recorded, instance) {
            (Some(r), Some(i)) => r == i,
            _ => true,
        }
}

fn holder(node: &str, instance: Option<&str>) -> String {
    match instance {
        Some(i) => format!("{node} (instance {i})"),
        None => node.to_string(),
    }
}

/// A key under `pools/`, `blocks/`, `nodes/` or `node_addrs/` this build
/// cannot read: a name with a `/` (an older version accepted `team/a`), a
/// value that is not what this build writes, a key written by hand. Readers skip it and
/// report it (log, `lockstep_cluster_unreadable_keys`, `verify`, `lockstep
/// cluster blocks`) instead of failing: one such key once stopped every
/// node's reads, and with them its lease refreshes and its claims.
/// `lockstep cluster unreadable delete KEY` removes it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Unreadable {
    /// The whole key.
    pub key: String,
    /// Why it cannot be read.
    pub reason: String,
    /// The block it names, when its key parses but its value does not: a
    /// claim must not pick that block (its holder is unknown).
    pub block: Option<IpNet>,
}

/// What a claim got.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Claim {
    /// The block is this node's, at this key revision.
    Claimed {
        /// The key's mod revision.
        revision: i64,
    },
    /// Another node holds it.
    Taken {
        /// The holder.
        by: String,
    },
    /// The key exists with a value this build cannot read: not ours, and
    /// its holder is unknown; pick another block.
    Unreadable {
        /// Why the value cannot be read.
        reason: String,
    },
}

/// The value of a node key: what a node tells the others about itself.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeRecord {
    /// The node's name.
    pub name: String,
    /// Underlay addresses other nodes route this node's blocks to.
    pub ips: Vec<IpAddr>,
    /// The agent's version.
    pub version: String,
    /// Blocks the node holds.
    pub blocks: Vec<IpNet>,
    /// Addresses in use.
    pub in_use: u64,
    /// Addresses wanted (in use + pending + pre-allocation).
    pub wanted: u64,
    /// The agent's instance (#26 item 5); absent in records of older
    /// builds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instance: Option<String>,
}

/// The value of a node's routing key (`node_addrs/<node>`): what the other
/// nodes need to route to its blocks. Bound to no lease, like the blocks:
/// blocks belong to nodes, not leases, so a node cut off from etcd (its
/// lease, and with it its node key, gone) keeps its routes on the others
/// while it holds blocks. Written with the node key at every registration;
/// deleted by `lockstep cluster node remove` with its blocks.
///
/// Unknown fields are ignored (unlike the other records): a later version
/// may add some, and an agent that could not read this key would drop the
/// routes of every node cut off from etcd.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeAddrRecord {
    /// The node's name (the key's last segment).
    pub name: String,
    /// Underlay addresses other nodes route this node's blocks to.
    pub ips: Vec<IpAddr>,
    /// The addresses the node last published as in use (its pods'): they
    /// stay reserved in the next holder's allocator when its blocks are
    /// taken (#26 item 2). Absent from records of older versions.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub in_use: Vec<IpAddr>,
    /// Since when its lease is gone, recorded by the first live node that
    /// saw it gone; cleared by the node's next registration.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gone: Option<lockstep_core::cluster::GoneMark>,
}

/// The value of a node's reservation window (`<prefix>.windows/<node>`,
/// #43): every address it may hand out without asking etcd, those in use
/// included. A reclaimer reserves all of them.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct WindowRecord {
    /// The node (the key's last segment).
    pub name: String,
    /// The addresses, ascending.
    pub addresses: std::collections::BTreeSet<IpAddr>,
}

/// The value of `reserved/<node>`: addresses a removed or reclaimed node
/// last published as in use. No node hands them out (its pods may still
/// hold them) until the node, back, no longer holds them, or an operator
/// releases them (`lockstep cluster addresses release ADDR...`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReservedRecord {
    /// The node that held them (the key's last segment).
    pub name: String,
    /// The addresses.
    pub addresses: Vec<IpAddr>,
}

/// What a node's removal (operator's or automatic) did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Removed {
    /// The blocks freed.
    pub freed: Vec<Block>,
    /// Due (gone for `reclaim_after`) or forced.
    pub removal: lockstep_core::cluster::Removal,
    /// The addresses it last published as in use, now reserved.
    pub reserved: Vec<IpAddr>,
}

/// A registered node as read from etcd: its record and its lease.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Node {
    /// What the node published.
    pub record: NodeRecord,
    /// The lease its key is bound to.
    pub lease: i64,
}

/// `/` in a CIDR becomes `-` in a key (`10.0.0.64/26` → `10.0.0.64-26`).
fn escape(cidr: IpNet) -> String {
    cidr.to_string().replace('/', "-")
}

/// The inverse of [`escape`]; `None` for anything [`escape`] never
/// writes (host bits set, a `/` left in it).
fn unescape(text: &str) -> Option<IpNet> {
    let (addr, len) = text.rsplit_once('-')?;
    let net: IpNet = format!("{addr}/{len}").parse().ok()?;
    (net.trunc() == net && escape(net) == text).then_some(net)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_keys_escape_and_come_back() {
        for c in ["10.0.0.64/26", "fd00::40/122", "0.0.0.0/0"] {
            let net: IpNet = c.parse().expect("net");
            assert!(!escape(net).contains('/'));
            assert_eq!(unescape(&escape(net)), Some(net));
        }
        assert_eq!(unescape("10.0.0.64"), None);
        assert_eq!(unescape("x-26"), None);
        assert_eq!(unescape("10.0.0.65-26"), None);
        assert_eq!(unescape("a/10.0.0.64-26"), None);
    }
}
