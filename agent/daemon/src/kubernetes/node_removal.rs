//! Nodes deleted from the Kubernetes API (#29 item 4), in cluster mode: the
//! one elected writer ([`super::writer`]) removes the node from etcd by the
//! rule of `lockstep cluster node remove` without `--force`, and releases
//! the addresses reserved for it once the API binds no pod to it. The
//! decision is the core's (`lockstep_core::cluster::kube_nodes`); the
//! removal is the door's guarded `remove_node`, the CLI's own.
//!
//! Why a loop of its own: a deleted Node is otherwise noticed only through
//! its lease, and the addresses its pods last used stay reserved forever
//! once it never comes back (nothing but an operator's `cluster addresses
//! release` frees them).
//!
//! [`NodesBackend`] and [`BoundPods`] are the seams: the unit tests run the
//! pass on doubles in memory.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::time::Duration;

use ipnet::IpNet;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, ListParams};
use kube::runtime::reflector::Store;
use kube::{Client, ResourceExt};
use lockstep_core::cluster::kube_nodes::{DeletedNode, NodeStep, deleted_node_step, deleted_nodes};

use super::KubeError;
use super::passes::{Pass, passes};
use super::writer::ClusterWriter;
use crate::cluster::ClusterStoreError;

/// The cluster's nodes as the pass needs them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodesState {
    /// Whether this agent is the writer now.
    pub writer: bool,
    /// Nodes whose agent holds a lease.
    pub alive: BTreeSet<String>,
    /// Nodes holding blocks or a routing key.
    pub holders: BTreeSet<String>,
    /// Nodes with addresses reserved for them.
    pub reserved: BTreeSet<String>,
}

/// What a removal freed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Freed {
    /// Blocks freed.
    pub blocks: Vec<IpNet>,
    /// Addresses reserved (removal) or released (release).
    pub addresses: Vec<IpAddr>,
}

/// etcd's side, as the pass uses it.
pub trait NodesBackend: Send + Sync + 'static {
    /// The state now.
    fn state(&self) -> impl Future<Output = Result<NodesState, KubeError>> + Send;
    /// Whether this agent is the writer now (without reading the rest).
    fn is_writer(&self) -> impl Future<Output = Result<bool, KubeError>> + Send;
    /// `cluster node remove NAME` without `--force`:
    /// [`KubeError::Refused`] while not due.
    fn remove(&self, node: &str) -> impl Future<Output = Result<Freed, KubeError>> + Send;
    /// Releases every address reserved for `node` (guarded on what was
    /// read).
    fn release(&self, node: &str) -> impl Future<Output = Result<Freed, KubeError>> + Send;
}

/// The API's pods, as the pass asks about them.
pub trait BoundPods: Send + Sync + 'static {
    /// Whether the API binds any pod to `node` (`spec.nodeName`).
    fn any_bound(&self, node: &str) -> impl Future<Output = Result<bool, KubeError>> + Send;
}

/// [`BoundPods`] through the API: one list, at most one item.
#[derive(Clone)]
pub struct ApiBound(pub Client);

impl BoundPods for ApiBound {
    async fn any_bound(&self, node: &str) -> Result<bool, KubeError> {
        let api: Api<Pod> = Api::all(self.0.clone());
        let params = ListParams::default()
            .fields(&format!("spec.nodeName={node}"))
            .limit(1);
        let list = api.list(&params).await.map_err(|e| KubeError::Api {
            what: format!("list pods on node {node}"),
            source: Box::new(e),
        })?;
        Ok(!list.items.is_empty())
    }
}

/// Cluster mode: etcd, writing only while this node is the writer.
#[derive(Debug)]
pub struct ClusterNodes(pub ClusterWriter);

impl NodesBackend for ClusterNodes {
    async fn is_writer(&self) -> Result<bool, KubeError> {
        self.0.is_writer().await
    }

    async fn state(&self) -> Result<NodesState, KubeError> {
        // Every node runs the loop; only the writer reads etcd (the
        // election is read from the mirror), so etcd's load does not grow
        // with the nodes.
        if !self.0.is_writer().await? {
            return Ok(NodesState::default());
        }
        let writer = true;
        self.0
            .with_door(async |d| {
                let alive = d
                    .nodes()
                    .await?
                    .iter()
                    .map(|n| n.record.name.clone())
                    .collect();
                let (blocks, _) = d.blocks().await?;
                let mut holders: BTreeSet<String> = blocks.iter().map(|b| b.node.clone()).collect();
                let routing = d.routing_keys().await?;
                holders.extend(routing.iter().map(|(r, _)| r.name.clone()));
                let reserved = d
                    .reservations()
                    .await?
                    .iter()
                    .filter(|(r, _)| !r.addresses.is_empty())
                    .map(|(r, _)| r.name.clone())
                    .collect();
                Ok(NodesState {
                    writer,
                    alive,
                    holders,
                    reserved,
                })
            })
            .await
    }

    async fn remove(&self, node: &str) -> Result<Freed, KubeError> {
        self.0
            .with_door(async |d| {
                let removed = d.remove_node(node, false).await?;
                Ok(Freed {
                    blocks: removed.freed.iter().map(|b| b.cidr).collect(),
                    addresses: removed.reserved,
                })
            })
            .await
    }

    async fn release(&self, node: &str) -> Result<Freed, KubeError> {
        self.0
            .with_door(async |d| {
                let Some((record, revision)) = d
                    .reservations()
                    .await?
                    .iter()
                    .find(|(r, _)| r.name == node)
                    .cloned()
                else {
                    return Ok(Freed::default());
                };
                if !d.set_reservations(node, revision, &BTreeSet::new()).await? {
                    return Err(ClusterStoreError::Conflict {
                        what: format!("release addresses reserved for node {node}"),
                    });
                }
                Ok(Freed {
                    blocks: Vec::new(),
                    addresses: record.addresses,
                })
            })
            .await
    }
}

/// What one pass did to one deleted Node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Its agent holds a lease, or pods are still bound: nothing taken.
    Kept,
    /// Refused by the removal rule (not gone for `reclaim_after` yet).
    NotDue(String),
    /// Removed: blocks freed, addresses reserved.
    Removed(Freed),
    /// Its reserved addresses released.
    Released(Freed),
    /// Nothing of it is left.
    Done,
}

/// One pass over the Nodes deleted from the API (`deleted`): `None` when
/// this agent is not the writer, else what happened to each.
///
/// # Errors
/// etcd unreadable; a removal or release failing other than by refusal
/// (the next pass tries again).
pub async fn pass<B: NodesBackend, P: BoundPods>(
    backend: &B,
    pods: &P,
    deleted: &BTreeSet<String>,
) -> Result<Option<Vec<(String, Outcome)>>, KubeError> {
    let state = backend.state().await?;
    if !state.writer {
        return Ok(None);
    }
    let mut out = Vec::new();
    for name in deleted {
        let reserved = state.reserved.contains(name);
        let holds = state.holders.contains(name);
        let alive = state.alive.contains(name);
        // Asked only when it decides: a node with nothing reserved, or
        // still holding blocks, needs no list.
        let pods_bound = if reserved && !holds && !alive {
            match pods.any_bound(name).await {
                Ok(any) => Some(usize::from(any)),
                Err(e) => {
                    tracing::warn!(node = %name, error = %crate::error_chain(&e), "kubernetes: pods on a deleted node not listed; its reserved addresses are kept");
                    None
                }
            }
        } else {
            None
        };
        let step = deleted_node_step(DeletedNode {
            alive,
            holds,
            reserved,
            pods_bound,
        });
        let outcome = match step {
            NodeStep::Keep => Outcome::Kept,
            NodeStep::Done => Outcome::Done,
            NodeStep::Remove => match backend.remove(name).await {
                Ok(freed) => Outcome::Removed(freed),
                Err(KubeError::Refused { reason }) => Outcome::NotDue(reason),
                Err(e) => return Err(e),
            },
            NodeStep::ReleaseReserved => Outcome::Released(backend.release(name).await?),
        };
        out.push((name.clone(), outcome));
    }
    Ok(Some(out))
}

/// How often a pass runs without a Node change (leases run out and
/// `reclaim_after` passes without the API saying anything).
pub const POLL: Duration = Duration::from_secs(2);

/// The loop: a reflector keeps the Nodes in memory; a change, and a poll,
/// wake one pass.
pub struct NodeRemoval<B: NodesBackend, P: BoundPods> {
    client: Client,
    backend: B,
    pods: P,
    /// Every Node name the reflector has shown.
    seen: BTreeSet<String>,
    /// The last outcome logged per node (each logged once).
    logged: std::collections::BTreeMap<String, String>,
}

impl<B: NodesBackend, P: BoundPods> NodeRemoval<B, P> {
    /// A loop writing through `backend`, asking the API through `pods`.
    pub fn new(client: Client, backend: B, pods: P) -> Self {
        Self {
            client,
            backend,
            pods,
            seen: BTreeSet::new(),
            logged: std::collections::BTreeMap::new(),
        }
    }

    /// Runs until `stop`.
    pub async fn run(mut self, stop: tokio::sync::watch::Receiver<bool>) {
        let api = Api::<Node>::all(self.client.clone());
        passes(api, POLL, stop, &mut self).await;
    }

    async fn once(&mut self, store: &Store<Node>) -> Result<(), KubeError> {
        let now: BTreeSet<String> = store
            .state()
            .iter()
            .filter(|n| n.metadata.deletion_timestamp.is_none())
            .map(|n| n.name_any())
            .collect();
        let deleted = deleted_nodes(&mut self.seen, &now);
        if deleted.is_empty() {
            return Ok(());
        }
        let Some(outcomes) = pass(&self.backend, &self.pods, &deleted).await? else {
            return Ok(());
        };
        for (node, outcome) in outcomes {
            // "Not due" says how long is left: logged once, not each pass.
            let said = match &outcome {
                Outcome::NotDue(_) => "not due".to_string(),
                o => format!("{o:?}"),
            };
            if self.logged.get(&node) == Some(&said) {
                continue;
            }
            match &outcome {
                Outcome::Kept => {
                    tracing::warn!(%node, "kubernetes: Node deleted from the API, but its agent holds a lease or pods are bound to it; nothing taken");
                }
                Outcome::NotDue(reason) => {
                    tracing::info!(%node, %reason, "kubernetes: Node deleted from the API; removed once the removal rule allows");
                }
                Outcome::Removed(f) => {
                    tracing::warn!(%node, blocks = ?f.blocks, reserved = ?f.addresses, "kubernetes: Node deleted from the API: removed from the cluster, its blocks freed, the addresses it last published reserved");
                }
                Outcome::Released(f) => {
                    tracing::warn!(%node, addresses = ?f.addresses, "kubernetes: Node deleted from the API and no pod bound to it: its reserved addresses released");
                }
                Outcome::Done => {}
            }
            if outcome == Outcome::Done {
                // Nothing left in etcd: judged again only if it comes back
                // and goes again.
                self.seen.remove(&node);
                self.logged.remove(&node);
            } else {
                self.logged.insert(node, said);
            }
        }
        Ok(())
    }
}

impl<B: NodesBackend, P: BoundPods> Pass<Node> for NodeRemoval<B, P> {
    async fn pass(&mut self, store: &Store<Node>) {
        if let Err(e) = self.once(store).await {
            tracing::warn!(error = %crate::error_chain(&e), "kubernetes: deleted nodes pass failed; trying again");
        }
    }

    async fn writer(&mut self) -> Option<bool> {
        self.backend.is_writer().await.ok()
    }
}

#[cfg(test)]
mod tests;
