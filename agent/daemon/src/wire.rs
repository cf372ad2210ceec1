//! The typed contract between the CNI plugin and the agent: the request
//! bodies the API's `/v1/cni/*` handlers deserialize and the plugin
//! serializes, and the replies the handlers serialize and the plugin
//! parses. One definition for both sides, so they cannot drift.
//!
//! Compatibility rules (the wire format is unchanged by having them here):
//! - **Requests refuse unknown fields** (`deny_unknown_fields`): a field the
//!   agent does not know is a plugin it does not understand, and it says so
//!   (`bad_request` naming the field) instead of ignoring what was asked.
//! - **Replies tolerate unknown fields** at their top level: an agent newer
//!   than the plugin may add fields, and the plugin ignores them. The ADD
//!   reply's `record` is the store's [`EndpointRecord`], which stays strict
//!   (it is also the on-disk record); the plugin and the agent ship as one
//!   binary, so a record the plugin cannot read is a mismatched install and
//!   the ADD fails (code 101) and is given back, never a result without
//!   addresses.

use std::net::IpAddr;
use std::path::PathBuf;

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

use crate::store::{EndpointMode, EndpointRecord};

/// A CNI ADD (or CHECK) as the agent sees it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EndpointRequest {
    /// `CNI_CONTAINERID`.
    pub container_id: String,
    /// `CNI_IFNAME`.
    pub ifname: String,
    /// `CNI_NETNS`.
    pub netns: PathBuf,
    /// Full (interfaces) or IPAM only.
    pub mode: EndpointMode,
    /// The pool; `None` is the default pool.
    #[serde(default)]
    pub pool: Option<String>,
    /// Specific addresses asked for (`ips` capability / args).
    #[serde(default)]
    pub requested: Vec<IpAddr>,
    /// MTU of the veth pair.
    #[serde(default)]
    pub mtu: Option<u32>,
    /// The Kubernetes pod, when the runtime named it in `CNI_ARGS`: picks
    /// the pool by annotation when `pool` is `None`, and is recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod: Option<lockstep_core::pods::PodRef>,
}

/// One address of an ADD result.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EndpointAddress {
    /// Address with prefix: /32 or /128 in full mode, the pool CIDR's prefix
    /// in IPAM mode.
    pub address: IpNet,
    /// Gateway, if any.
    pub gateway: Option<IpAddr>,
}

/// What ADD returns.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EndpointReply {
    /// The record as stored.
    pub record: EndpointRecord,
    /// Addresses for the CNI result.
    pub addresses: Vec<EndpointAddress>,
    /// Routes for the CNI result: (destination, gateway).
    pub routes: Vec<(IpNet, Option<IpAddr>)>,
}

/// A DEL.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DelRequest {
    /// `CNI_CONTAINERID`.
    pub container_id: String,
    /// `CNI_IFNAME`.
    pub ifname: String,
}

/// A GC.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GcRequest {
    /// Attachments to keep: (container id, ifname).
    pub valid: Vec<(String, String)>,
}

/// What GC released.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GcReport {
    /// Attachments released.
    pub released: Vec<(String, String)>,
}

/// Every API error body: `{"error": {"code": ..., "message": ...}}`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorReply {
    /// The error.
    pub error: ErrorBody,
}

/// The error inside an [`ErrorReply`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    /// The stable code (`not_ready`, `pool_exhausted`, ...).
    pub code: String,
    /// What is wrong, with its causes.
    pub message: String,
}

/// What `GET /v1/status` answers, as far as readiness goes: the leading
/// fields of the agent's full status ([`crate::agent::Status`]), which is
/// all a not-ready agent answers with. The plugin's STATUS reads this; the
/// rest of a ready agent's status is ignored (unknown fields are).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Readiness {
    /// The agent's version.
    #[serde(default)]
    pub version: String,
    /// Ready to serve.
    pub ready: bool,
    /// Why not, when not.
    #[serde(default)]
    pub reason: Option<String>,
    /// The pool a request that names none uses (absent while not ready).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default_pool: Option<String>,
    /// Cluster mode's part of the status (absent in single-node mode).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster: Option<ClusterStatus>,
}

/// A cluster pool and the families it has CIDRs of.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterPoolFamilies {
    /// The pool.
    pub name: String,
    /// It has IPv4 CIDRs.
    pub ipv4: bool,
    /// It has IPv6 CIDRs.
    pub ipv6: bool,
    /// It is being removed: nothing new comes from it (#26 item 12).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub draining: bool,
}

/// Cluster mode in the status answer.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterStatus {
    /// Why etcd is unreachable, while it is.
    #[serde(default)]
    pub etcd_unreachable: Option<String>,
    /// The cluster pools (blocks are claimed for them on demand).
    #[serde(default)]
    pub pools: Vec<ClusterPoolFamilies>,
    /// Blocks fenced on this node.
    #[serde(default)]
    pub fenced: usize,
    /// Configured CIDRs withheld because they overlap the cluster's pools
    /// or blocks, each naming both sides.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub configured_overlaps: Vec<String>,
}

/// One BGP session in the status answer.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BgpSession {
    /// The peer's name in `[bgp.peers]`.
    pub peer: String,
    /// Whether the session is established.
    pub up: bool,
    /// BIRD's words for its state: `Established`, or why not.
    pub state: String,
    /// Times it went down since the agent started (a flapping link).
    #[serde(default)]
    pub downs: u64,
    /// BIRD's words when it was last seen down.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_down: Option<String>,
}

/// BGP in the status answer (`[bgp]`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BgpStatus {
    /// Prefixes in the configuration BIRD took last.
    pub announced: usize,
    /// Why BIRD's configuration is not the one the node should have,
    /// while it is not (BIRD unreachable, or refusing it).
    #[serde(default)]
    pub problem: Option<String>,
    /// Every session, as BIRD last reported it.
    #[serde(default)]
    pub sessions: Vec<BgpSession>,
    /// The LoadBalancer addresses this node does not announce, each with
    /// why (externalTrafficPolicy Local without a ready endpoint here,
    /// the node excluded, a pool's node selector).
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub withheld: std::collections::BTreeMap<IpAddr, String>,
    /// The pod blocks this node announces (its pools' CIDRs that
    /// `[bgp.pools]` names), kept announced when the agent dies.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub blocks: Vec<IpNet>,
    /// In cluster mode, why the node announces none of its cluster
    /// pools' blocks, while it does not (etcd not reached for
    /// `reclaim_after`, or not yet since the agent started).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub blocks_withdrawn: Option<String>,
    /// Under Kubernetes: each `BGPPeer` object or Node annotation left
    /// out, with why (the others are used).
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub refused: std::collections::BTreeMap<String, String>,
    /// Under Kubernetes: the Services this node announces, by
    /// `namespace/name`, each with its addresses announced from here.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub services: std::collections::BTreeMap<String, Vec<IpAddr>>,
}

/// The empty object DEL and CHECK answer with.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Empty {}

#[cfg(test)]
mod tests;
