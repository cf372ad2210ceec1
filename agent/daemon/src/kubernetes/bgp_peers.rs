//! `BGPPeer` (`lockstep.io/v1alpha1`, cluster-scoped, #48 item 2): the
//! routers nodes peer with as Kubernetes objects, each with a node
//! selector, and this node's own overrides from annotations on its Node
//! (AS number, router ID, source address).
//!
//! Why objects: one ConfigMap serves every node, but racks peer with
//! their own top-of-rack routers, and some nodes sit in another AS. What
//! a node takes from the objects and its annotations is the core's
//! (`lockstep_core::bgp::peers`); this module follows the objects and
//! this node's Node, and sends what they say on a watch channel the BGP
//! speaker reads. The speaker writes nothing to BIRD before the first
//! read (an agent starting again must not drop a peer the objects give).
//!
//! Only reads: nothing here writes to the API server.

use std::sync::Arc;

use k8s_openapi::api::core::v1::Node;
use kube::api::Api;
use kube::runtime::watcher;
use kube::{Client, CustomResource, ResourceExt};
use lockstep_core::bgp::PeerSpec;
use lockstep_core::bgp::peers::{KubePeer, NodeFacts, NodePeers, for_node};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use tokio::sync::Notify;

use super::crd::Selector;
use super::reflectors::{drive, drive_with};

/// A router that nodes peer with.
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "lockstep.io",
    version = "v1alpha1",
    kind = "BGPPeer",
    plural = "bgppeers",
    shortname = "bgppeer",
    printcolumn = r#"{"name":"Address","type":"string","jsonPath":".spec.address"}"#,
    printcolumn = r#"{"name":"ASN","type":"integer","jsonPath":".spec.asn"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct BGPPeerSpec {
    /// The router's address (IPv4 or IPv6): the session's family, and
    /// the family of what is announced to it.
    #[schemars(schema_with = "crate::kubernetes::crd::ip_string")]
    pub address: String,
    /// The router's AS number (1 to 4294967295).
    #[schemars(range(min = 1))]
    pub asn: u32,
    /// Which Nodes peer with it (their labels); absent: every node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_selector: Option<Selector>,
    /// Whether BFD watches the session (default true).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bfd: Option<bool>,
    /// The hold time in seconds: 0 (none), or 3 to 65535 (default 90).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hold_time_seconds: Option<u16>,
}

impl BGPPeer {
    /// The object as the core reads it.
    pub fn to_core(&self) -> KubePeer {
        let s = &self.spec;
        KubePeer {
            name: self.name_any(),
            created: self
                .metadata
                .creation_timestamp
                .as_ref()
                .map(|t| t.0.to_string())
                .unwrap_or_default(),
            address: s.address.clone(),
            asn: s.asn,
            node_selector: s.node_selector.as_ref().map(Into::into),
            bfd: s.bfd,
            hold_time_s: s.hold_time_seconds,
        }
    }
}

/// The CRD as YAML, as `deploy/crds/` holds it.
///
/// # Errors
/// The CRD does not serialise (never with these types).
pub fn crd_yaml() -> Result<String, String> {
    super::crd::crd_yaml_of::<BGPPeer>("agent/daemon/src/kubernetes/bgp_peers.rs")
}

/// What the objects and this Node say, as the speaker reads it (`None`
/// until both were first read).
pub type Peers = tokio::sync::watch::Receiver<Option<Arc<NodePeers>>>;

/// Follows the `BGPPeer` objects and Node `node` until `stop`: what they
/// give this node beside `config` (the config's own peers). Each refused
/// object or annotation is logged once per reason.
pub fn follow(
    client: Client,
    node: &str,
    config: Vec<PeerSpec>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> (Peers, tokio::task::JoinHandle<()>) {
    let (tx, rx) = tokio::sync::watch::channel(None);
    let wake = Arc::new(Notify::new());
    let (peers, peers_task) = drive(Api::<BGPPeer>::all(client.clone()), wake.clone());
    let fields = watcher::Config::default().fields(&format!("metadata.name={node}"));
    let (nodes, node_task) = drive_with(Api::<Node>::all(client), fields, wake.clone());
    let name = node.to_owned();
    let task = tokio::spawn(async move {
        let ready = async {
            let _ = peers.wait_until_ready().await;
            let _ = nodes.wait_until_ready().await;
        };
        let stopped = tokio::select! {
            () = ready => false,
            _ = stop.wait_for(|s| *s) => true,
        };
        if stopped {
            peers_task.abort();
            node_task.abort();
            return;
        }
        loop {
            let facts = nodes
                .state()
                .iter()
                .find(|n| n.metadata.name.as_deref() == Some(&name))
                .map(|n| NodeFacts {
                    labels: n.labels().clone(),
                    annotations: n.annotations().clone(),
                })
                .unwrap_or_default();
            let objects: Vec<KubePeer> = peers.state().iter().map(|p| p.to_core()).collect();
            let now = for_node(&objects, &facts, &config);
            tx.send_if_modified(|cur| {
                if cur.as_deref() == Some(&now) {
                    return false;
                }
                for (what, why) in &now.refused {
                    if cur.as_ref().and_then(|c: &Arc<NodePeers>| c.refused.get(what)) != Some(why) {
                        tracing::warn!(%what, %why, "kubernetes: BGP setting refused; the others are used");
                    }
                }
                *cur = Some(Arc::new(now));
                true
            });
            tokio::select! {
                () = wake.notified() => {}
                _ = stop.wait_for(|s| *s) => break,
            }
        }
        peers_task.abort();
        node_task.abort();
    });
    (rx, task)
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_committed_crd_is_the_one_the_types_make() {
        crate::kubernetes::crd::assert_committed("bgppeers.lockstep.io.yaml", super::crd_yaml());
    }
}
