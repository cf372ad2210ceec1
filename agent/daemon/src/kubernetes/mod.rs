//! The Kubernetes door (#28): the only module that talks to the Kubernetes
//! API, on kube-rs (watchers and reflectors, `k8s-openapi` types, the
//! `LoadBalancerIPPool` CRD derived from Rust types).
//!
//! Why a door of its own, like `cluster/` for etcd: the API is a *source*
//! here, never a store of record. Services and pools are read into the
//! same LB inputs `lockstep lb apply` sends and go through the same public
//! paths (`backend`): the agent's LB IPAM in single-node mode, etcd's one
//! elected assigner in cluster mode. What the LB state decided is written
//! back where Kubernetes users look: `status.loadBalancer.ingress` and a
//! condition on each Service, conditions and counts on each pool, Events.
//! The decisions (which Services are lockstep's, what they ask, what a
//! condition says) are the core's (`lockstep_core::lb::kubernetes`).
//!
//! Without `[cluster]`, one agent is the writer, elected on a Lease
//! (`election`, #44 item 1): it alone assigns, writes status and answers
//! for the addresses (`announcer`); the others mirror its decisions
//! (`sync::follow`).
//!
//! NodeIPAM (`nodeipam`, #29 item 5): this node's `NodeIPAM` object gives
//! its CIDRs (status, the operator's) and takes its demand (spec).
//!
//! Node facts are read once at start ([`node_facts`]): the Node's labels
//! (matched by pools' node selectors) and its InternalIPs (the node's
//! addresses in cluster mode when the config names none).

pub mod announcer;
pub mod backend;
pub mod bgp_peers;
pub mod bgp_services;
pub mod bgp_status;
pub mod candidacy;
pub mod crd;
pub mod election;
pub mod leaks;
mod local_answers;
pub mod local_traffic;
pub mod node_removal;
pub mod nodeipam;
mod objects;
mod passes;
pub mod pod_cidrs;
pub mod pod_pools;
pub mod pods;
pub mod reflectors;
mod seat;
pub mod sync;
pub mod writer;

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use kube::Client;
use kube::api::Api;

use crate::config::KubernetesConfig;

pub use backend::{ClusterLb, LbBackend, LbState, LocalLb};
pub use sync::{Classes, LbSync};

/// Logs the fields of `kind` `name`'s spec this version does not know
/// (#44 item 7: a newer CRD added them; they are ignored), once per kind and
/// field for the life of the agent, remembered in `seen`.
pub(crate) fn note_unknown(
    seen: &mut std::collections::BTreeSet<String>,
    kind: &str,
    name: &str,
    unknown: &BTreeMap<String, serde_json::Value>,
) {
    for field in unknown.keys() {
        if seen.insert(format!("{kind}.spec.{field}")) {
            tracing::warn!(
                kind,
                object = name,
                field = %format!("spec.{field}"),
                "kubernetes: a field this version of lockstep does not know is ignored (a newer CRD?); logged once per field"
            );
        }
    }
}

/// Errors of the Kubernetes door.
#[derive(Debug, thiserror::Error)]
pub enum KubeError {
    /// The kubeconfig or the in-cluster service account is unusable.
    #[error("kubernetes client configuration: {what}")]
    Config {
        /// Where it came from.
        what: String,
        /// Why it is unusable.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The API refused or did not answer a request.
    #[error("kubernetes API: {what}")]
    Api {
        /// What was asked.
        what: String,
        /// kube's error (the API's Status when it answered).
        #[source]
        source: Box<kube::Error>,
    },
    /// The LB state refused a definition (named by the reason): not
    /// applied, reported on the object.
    #[error("refused by lb ipam: {reason}")]
    Refused {
        /// Why, as `lb apply` would say it.
        reason: String,
    },
    /// The LB state could not be read or written (store, datapath, etcd).
    #[error("lb state unavailable: {reason}")]
    Lb {
        /// Why.
        reason: String,
    },
    /// The API answers, and has no Node of this agent's node name: the
    /// name is wrong (a DaemonSet's pod runs only on a registered Node).
    #[error(
        "the API has no Node named {name:?} (the name came from {source_of_name}): set NODE_NAME from the downward API's spec.nodeName (the generated DaemonSet does), or [kubernetes] node_name"
    )]
    NoNode {
        /// The name asked for.
        name: String,
        /// Where the name came from.
        source_of_name: String,
    },
    /// A blocking task of the door failed.
    #[error("kubernetes door task failed: {reason}")]
    Task {
        /// Why.
        reason: String,
    },
}

/// A client for the API `config` names: its kubeconfig, else the pod's
/// service account.
///
/// # Errors
/// [`KubeError::Config`] naming the source.
pub async fn client(config: &KubernetesConfig) -> Result<Client, KubeError> {
    let conf = match &config.kubeconfig {
        Some(path) => {
            let what = format!("kubeconfig {}", path.display());
            let kc = kube::config::Kubeconfig::read_from(path).map_err(|e| KubeError::Config {
                what: what.clone(),
                source: Box::new(e),
            })?;
            kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
                .await
                .map_err(|e| KubeError::Config {
                    what,
                    source: Box::new(e),
                })?
        }
        None => kube::Config::incluster().map_err(|e| KubeError::Config {
            what: "in-cluster service account".into(),
            source: Box::new(e),
        })?,
    };
    let mut conf = conf;
    // Every request names lockstep: the API server records writes that
    // name no field manager (kube-runtime's event recorder's) under the
    // User-Agent up to its first '/'.
    if let Ok(agent) =
        axum::http::HeaderValue::from_str(&format!("{FIELD_MANAGER}/{}", env!("CARGO_PKG_VERSION")))
    {
        conf.headers.push((axum::http::header::USER_AGENT, agent));
    }
    Client::try_from(conf).map_err(|e| KubeError::Config {
        what: "kubernetes client".into(),
        source: Box::new(e),
    })
}

/// The field manager of every write lockstep sends.
pub const FIELD_MANAGER: &str = "lockstep";

/// Parameters of a patch, under lockstep's field manager.
#[must_use]
pub fn patch_params() -> kube::api::PatchParams {
    kube::api::PatchParams {
        field_manager: Some(FIELD_MANAGER.into()),
        ..kube::api::PatchParams::default()
    }
}

/// Parameters of a create or replace, under lockstep's field manager.
#[must_use]
pub fn post_params() -> kube::api::PostParams {
    kube::api::PostParams {
        field_manager: Some(FIELD_MANAGER.into()),
        ..kube::api::PostParams::default()
    }
}

/// What start-up takes from this node's Node object.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeFacts {
    /// Its labels.
    pub labels: BTreeMap<String, String>,
    /// Its first IPv4 InternalIP.
    pub internal_v4: Option<IpAddr>,
    /// Its first IPv6 InternalIP.
    pub internal_v6: Option<IpAddr>,
    /// Its `spec.podCIDRs` (`pod_cidrs::of_node`).
    pub pod_cidrs: Vec<String>,
}

/// Reads Node `name` (named by `source`), trying again for at most
/// `within`.
///
/// # Errors
/// [`KubeError::NoNode`] when the API still says there is no such Node;
/// else the last failure when no answer came in time.
pub async fn node_facts(
    client: &Client,
    name: &str,
    source: &str,
    within: Duration,
) -> Result<NodeFacts, KubeError> {
    let api: Api<Node> = Api::all(client.clone());
    let deadline = tokio::time::Instant::now() + within;
    loop {
        match api.get(name).await {
            Ok(node) => {
                let (labels, addresses) = objects::node_facts(&node);
                let (internal_v4, internal_v6) =
                    lockstep_core::lb::kubernetes::internal_ips(&addresses);
                return Ok(NodeFacts {
                    labels,
                    internal_v4,
                    internal_v6,
                    pod_cidrs: pod_cidrs::of_node(&node),
                });
            }
            Err(kube::Error::Api(s))
                if s.code == 404 && tokio::time::Instant::now() >= deadline =>
            {
                return Err(KubeError::NoNode {
                    name: name.to_owned(),
                    source_of_name: source.to_owned(),
                });
            }
            Err(e) if tokio::time::Instant::now() >= deadline => {
                return Err(KubeError::Api {
                    what: format!("get node {name}"),
                    source: Box::new(e),
                });
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(250)).await,
        }
    }
}

/// Puts the Node's facts into the config before cluster mode starts: its
/// labels under the configured `[cluster] node_labels` (which win), its
/// InternalIPs as the node addresses the config leaves unset, its IPv4
/// InternalIP as the BGP router ID when `[bgp]` names none.
pub fn apply_node_facts(config: &mut crate::config::Config, facts: &NodeFacts) {
    if let Some(bgp) = config.bgp.as_mut()
        && bgp.router_id.is_none()
        && let Some(IpAddr::V4(a)) = facts.internal_v4
    {
        bgp.router_id = Some(a);
    }
    let Some(cluster) = config.cluster.as_mut() else {
        return;
    };
    cluster.node_labels =
        lockstep_core::lb::kubernetes::node_labels(&facts.labels, &cluster.node_labels);
    if cluster.node_ip_v4.is_none()
        && let Some(IpAddr::V4(a)) = facts.internal_v4
    {
        cluster.node_ip_v4 = Some(a);
    }
    if cluster.node_ip_v6.is_none()
        && let Some(IpAddr::V6(a)) = facts.internal_v6
    {
        cluster.node_ip_v6 = Some(a);
    }
}

#[cfg(test)]
mod tests;
