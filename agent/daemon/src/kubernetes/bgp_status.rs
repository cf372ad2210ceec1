//! `BGPNodeState` (`lockstep.io/v1alpha1`, cluster-scoped, #48 item 4):
//! one object per node, named after it, saying what the node's BGP
//! speaker does: each session's state, the Services it announces (with
//! their addresses), the addresses it withholds and why, its pod blocks,
//! and the settings it refused.
//!
//! Why an object per node: which nodes announce a Service is a question
//! about every node at once (`kubectl get bgpnodestate`), but each node
//! alone knows its own answer. One object per node keeps one writer per
//! object (this node's agent), so no two agents ever race on a write, and
//! a node writes only when its own state changed. The object has an
//! owner reference to its Node, so Kubernetes' garbage collector removes
//! it with the Node.
//!
//! The task reads the speaker's status (`wire::BgpStatus`), waits
//! [`SETTLE`] after a change so a burst becomes one write, and writes the
//! whole status with a merge patch when it differs from the last written.
//! A failed write is tried again every [`RETRY`]; it never holds up the
//! speaker.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, Patch, PostParams};
use kube::{Client, CustomResource, ResourceExt};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::wire::BgpStatus;

/// How long after a change the state is written (a burst of changes is
/// one write).
pub const SETTLE: Duration = Duration::from_millis(500);
/// How long after a failed write it is tried again.
pub const RETRY: Duration = Duration::from_secs(5);

/// What one node's BGP speaker does.
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "lockstep.io",
    version = "v1alpha1",
    kind = "BGPNodeState",
    plural = "bgpnodestates",
    shortname = "bgpstate",
    status = "BGPNodeStateStatus",
    printcolumn = r#"{"name":"Sessions up","type":"string","jsonPath":".status.sessionsUp"}"#,
    printcolumn = r#"{"name":"Announced","type":"integer","jsonPath":".status.announced"}"#,
    printcolumn = r#"{"name":"Problem","type":"string","jsonPath":".status.problem"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct BGPNodeStateSpec {
    /// The node (the object's name too).
    pub node: String,
}

/// One BGP session.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SessionState {
    /// The peer's name (the config's, or its BGPPeer's).
    pub peer: String,
    /// Established.
    pub up: bool,
    /// `up`, or BIRD's words for why not.
    pub state: String,
    /// Times it went down since the agent started (a flapping link).
    #[serde(default)]
    pub downs: u64,
    /// BIRD's words when it was last seen down.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_down: Option<String>,
}

/// One Service this node announces.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ServiceState {
    /// `namespace/name`.
    pub service: String,
    /// Its addresses announced from this node.
    pub addresses: Vec<String>,
}

/// What the node's speaker does, as its agent last wrote it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct BGPNodeStateStatus {
    /// Every session.
    #[serde(default)]
    pub sessions: Vec<SessionState>,
    /// Sessions up, of all (`2/2`).
    #[serde(default)]
    pub sessions_up: String,
    /// Prefixes in the configuration BIRD took last.
    #[serde(default)]
    pub announced: u64,
    /// The Services announced from this node.
    #[serde(default)]
    pub services: Vec<ServiceState>,
    /// Addresses this node does not announce, each with why.
    #[serde(default)]
    pub withheld: BTreeMap<String, String>,
    /// The pod blocks announced from this node.
    #[serde(default)]
    pub blocks: Vec<String>,
    /// BGPPeer objects or Node annotations left out, each with why.
    #[serde(default)]
    pub refused: BTreeMap<String, String>,
    /// Why BIRD's configuration is not what the node should have, while
    /// it is not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub problem: Option<String>,
}

/// The CRD as YAML, as `deploy/crds/` holds it.
///
/// # Errors
/// The CRD does not serialise (never with these types).
pub fn crd_yaml() -> Result<String, String> {
    super::crd::crd_yaml_of::<BGPNodeState>("agent/daemon/src/kubernetes/bgp_status.rs")
}

/// The object's status for what the speaker reports.
#[must_use]
pub fn status_of(s: &BgpStatus) -> BGPNodeStateStatus {
    let up = s.sessions.iter().filter(|x| x.up).count();
    let text = |a: &[IpAddr]| a.iter().map(ToString::to_string).collect();
    BGPNodeStateStatus {
        sessions: s
            .sessions
            .iter()
            .map(|x| SessionState {
                peer: x.peer.clone(),
                up: x.up,
                state: x.state.clone(),
                downs: x.downs,
                last_down: x.last_down.clone(),
            })
            .collect(),
        sessions_up: format!("{up}/{}", s.sessions.len()),
        announced: s.announced as u64,
        services: s
            .services
            .iter()
            .map(|(service, addresses)| ServiceState {
                service: service.clone(),
                addresses: text(addresses),
            })
            .collect(),
        withheld: s
            .withheld
            .iter()
            .map(|(a, why)| (a.to_string(), why.clone()))
            .collect(),
        blocks: s.blocks.iter().map(ToString::to_string).collect(),
        refused: s.refused.clone(),
        problem: s.problem.clone(),
    }
}

/// Keeps Node `node`'s `BGPNodeState` what `status` says, until `stop`.
pub fn spawn(
    client: Client,
    node: String,
    mut status: tokio::sync::watch::Receiver<BgpStatus>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let api = Api::<BGPNodeState>::all(client.clone());
        let nodes = Api::<Node>::all(client);
        let mut written: Option<BGPNodeStateStatus> = None;
        let mut exists = false;
        let mut failing: Option<String> = None;
        loop {
            let want = status_of(&status.borrow_and_update());
            if written.as_ref() != Some(&want) {
                match write(&api, &nodes, &node, &want, &mut exists).await {
                    Ok(()) => {
                        written = Some(want);
                        failing = None;
                    }
                    Err(why) => {
                        if failing.as_deref() != Some(why.as_str()) {
                            tracing::warn!(%node, error = %why, "kubernetes: this node's BGPNodeState is not written; trying again");
                        }
                        failing = Some(why);
                        exists = false;
                        tokio::select! {
                            () = tokio::time::sleep(RETRY) => continue,
                            _ = stop.wait_for(|s| *s) => break,
                        }
                    }
                }
            }
            let changed = tokio::select! {
                r = status.changed() => r.is_ok(),
                _ = stop.wait_for(|s| *s) => false,
            };
            if !changed {
                break;
            }
            tokio::time::sleep(SETTLE).await;
        }
    })
}

/// Creates the object when it is not known to exist (owned by its Node),
/// then writes its status.
async fn write(
    api: &Api<BGPNodeState>,
    nodes: &Api<Node>,
    node: &str,
    want: &BGPNodeStateStatus,
    exists: &mut bool,
) -> Result<(), String> {
    if !*exists {
        let owner = nodes
            .get(node)
            .await
            .map_err(|e| format!("reading Node {node}: {e}"))?;
        let mut obj = BGPNodeState::new(
            node,
            BGPNodeStateSpec {
                node: node.to_string(),
            },
        );
        obj.metadata.owner_references = Some(vec![
            k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference {
                api_version: "v1".into(),
                kind: "Node".into(),
                name: node.to_string(),
                uid: owner.uid().unwrap_or_default(),
                ..Default::default()
            },
        ]);
        match api.create(&PostParams::default(), &obj).await {
            Ok(_) => {}
            Err(kube::Error::Api(e)) if e.code == 409 => {}
            Err(e) => return Err(format!("creating it: {e}")),
        }
        *exists = true;
    }
    let patch = json!({"status": want});
    api.patch_status(node, &super::patch_params(), &Patch::Merge(&patch))
        .await
        .map_err(|e| format!("writing its status: {e}"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::BgpSession;

    #[test]
    fn the_committed_crd_is_the_one_the_types_make() {
        crate::kubernetes::crd::assert_committed("bgpnodestates.lockstep.io.yaml", crd_yaml());
    }

    #[test]
    fn the_status_says_what_the_speaker_reports() {
        let s = BgpStatus {
            announced: 3,
            sessions: vec![
                BgpSession {
                    peer: "tor-a".into(),
                    up: true,
                    state: "up".into(),
                    ..BgpSession::default()
                },
                BgpSession {
                    peer: "tor-b".into(),
                    up: false,
                    state: "Connect: Connection refused".into(),
                    downs: 2,
                    last_down: Some("Connect: Connection refused".into()),
                },
            ],
            services: [(
                "shop/web".to_string(),
                vec!["198.51.100.7".parse().unwrap()],
            )]
            .into(),
            withheld: [(
                "198.51.100.8".parse().unwrap(),
                "externalTrafficPolicy is Local and no ready endpoint on this node".to_string(),
            )]
            .into(),
            blocks: vec!["10.244.0.0/24".parse().unwrap()],
            ..BgpStatus::default()
        };
        let st = status_of(&s);
        assert_eq!(st.sessions_up, "1/2");
        assert_eq!(st.announced, 3);
        assert_eq!(
            st.services,
            [ServiceState {
                service: "shop/web".into(),
                addresses: vec!["198.51.100.7".into()],
            }]
        );
        assert!(st.withheld["198.51.100.8"].contains("Local"));
        assert_eq!(st.blocks, ["10.244.0.0/24"]);
        assert_eq!(st.sessions[1].state, "Connect: Connection refused");
        assert_eq!((st.sessions[0].downs, st.sessions[1].downs), (0, 2));
    }
}
