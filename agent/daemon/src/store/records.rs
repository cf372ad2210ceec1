//! The records the store keeps beside allocations: an endpoint's record (what
//! ADD made, for DEL and CHECK to find) and a delegated attachment's record.
//!
//! They live apart from the store so the persistence code is not mixed with
//! the shape of what it persists.

use super::*;

/// How an endpoint was set up.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EndpointMode {
    /// lockstep made the interfaces (plugin type `lockstep`).
    Full,
    /// Addresses only (`lockstep-ipam` under another plugin).
    Ipam,
}

/// An endpoint the CNI plugin attached: what DEL, CHECK, GC and reconcile
/// need to find its interfaces and program its map entries.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EndpointRecord {
    /// `CNI_CONTAINERID`.
    pub container_id: String,
    /// `CNI_IFNAME`.
    pub ifname: String,
    /// `CNI_NETNS` at ADD.
    pub netns: PathBuf,
    /// Full or IPAM-only.
    pub mode: EndpointMode,
    /// The pool its addresses came from.
    pub pool: String,
    /// Its addresses.
    pub addresses: Vec<std::net::IpAddr>,
    /// Host-side interface (full mode).
    pub host_ifname: Option<String>,
    /// Host-side interface index (full mode).
    pub host_ifindex: u32,
    /// MAC of the host-side interface.
    pub host_mac: [u8; 6],
    /// MAC of the interface inside the container.
    pub mac: [u8; 6],
    /// DEL was acknowledged (map entries removed) but the host veth is not
    /// yet confirmed gone: the addresses stay held until it is, and a start
    /// finishes the release (`agent::reaper`). Written only when true, so
    /// other records read as before.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub releasing: bool,
    /// The Kubernetes pod it was made for (from `CNI_ARGS`), so leaks can
    /// be judged against the API (`kubernetes::leaks`). Written only when
    /// known, so other records read as before.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod: Option<lockstep_core::pods::PodRef>,
}

impl EndpointRecord {
    /// The record key.
    pub fn key(&self) -> String {
        endpoint_key(&self.container_id, &self.ifname)
    }
}

/// The record key of an endpoint (or delegated attachment): the core's
/// [`attachment_key`](lockstep_core::owner::attachment_key), which no two
/// attachments share. Records stored under the ambiguous key of earlier
/// versions move on [`Store::load`].
pub fn endpoint_key(container_id: &str, ifname: &str) -> String {
    lockstep_core::owner::attachment_key(container_id, ifname)
}

/// An attachment whose addresses an external CNI IPAM plugin holds
/// (delegated mode): what CHECK, DEL and reconcile need, and the config it
/// was made under so a changed plugin config is noticed.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DelegatedRecord {
    /// Who holds it: an agent role or a delegated endpoint.
    pub owner: lockstep_core::owner::Owner,
    /// `CNI_CONTAINERID` given to the plugin.
    pub container_id: String,
    /// `CNI_IFNAME` given to the plugin.
    pub ifname: String,
    /// `CNI_NETNS` given to the plugin.
    pub netns: PathBuf,
    /// The plugin's `type`.
    pub plugin: String,
    /// Hash of the network config the plugin was run with.
    pub config_hash: String,
    /// The `cniVersion` it was run with.
    pub cni_version: String,
    /// The plugin's ADD result, as printed (the `prevResult` of CHECK/DEL).
    pub result: serde_json::Value,
    /// The addresses in that result.
    pub addresses: Vec<std::net::IpAddr>,
    /// Which holding this is (from the store's generation counter).
    pub generation: Generation,
}

impl DelegatedRecord {
    /// The record key.
    pub fn key(&self) -> String {
        endpoint_key(&self.container_id, &self.ifname)
    }
}
