//! Where the Kubernetes door sends what it reads: the LB state `lockstep lb
//! apply` changes, through the same public paths. Single-node mode: the
//! agent's own LB IPAM (`lb apply`'s path on the agent, committed and
//! programmed), through [`NodeAgent`], which the server implements for the
//! agent (this door names no agent type). In cluster mode: etcd through [`LbHandle::apply`] (the same checks as the
//! API's `lb apply`, the elected assigner assigning), and only on the agent
//! that is the assigner, so Kubernetes has one writer, as etcd has.
//!
//! [`LbBackend`] is the seam: the sync loop's unit tests run it on an
//! in-memory LB IPAM.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use lockstep_core::lb::{LbPoolSpec, PoolStatus, ServiceSpec, ServiceStatus};

use std::future::Future;
use std::net::IpAddr;
use std::pin::Pin;

use lockstep_core::pods::PodRef;

use super::KubeError;
use crate::cluster::LbHandle;

/// The LB state as the door needs it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LbState {
    /// Whether this agent writes to the LB state and to Kubernetes now
    /// (single-node: once ready; cluster mode: while it is the assigner).
    pub writer: bool,
    /// Service statuses by `namespace/name`.
    pub services: BTreeMap<String, ServiceStatus>,
    /// Services stored but not yet in the assigner's state (cluster mode).
    pub pending: BTreeSet<String>,
    /// Pools by name.
    pub pools: BTreeMap<String, PoolStatus>,
}

impl LbState {
    /// Every service the state holds or has stored.
    pub fn stored_services(&self) -> BTreeSet<String> {
        self.services
            .keys()
            .cloned()
            .chain(self.pending.iter().cloned())
            .collect()
    }
}

/// The LB state's door, as the sync loop uses it.
pub trait LbBackend: Send + Sync + 'static {
    /// The state now.
    fn state(&self) -> impl Future<Output = Result<LbState, KubeError>> + Send;
    /// Applies pools and services, as `lockstep lb apply` does.
    fn apply(
        &self,
        pools: Vec<LbPoolSpec>,
        services: Vec<ServiceSpec>,
    ) -> impl Future<Output = Result<(), KubeError>> + Send;
    /// Deletes services (`namespace/name`) and pools, as `lockstep lb
    /// delete` does.
    fn delete(
        &self,
        services: Vec<String>,
        pools: Vec<String>,
    ) -> impl Future<Output = Result<(), KubeError>> + Send;
    /// Whether `apply` assigns before it returns (single-node); in cluster
    /// mode the assigner does it later, so reading the state right after
    /// storing new services tells nothing new about them.
    fn assigns_on_apply(&self) -> bool;
    /// How often the loop reads the state without a Kubernetes change:
    /// cluster mode learns of elections so, and of the assigner's work
    /// should `changes` not tell.
    fn poll_every(&self, pending: bool) -> Duration;
    /// Changes whenever the state changed without the loop's doing (cluster
    /// mode: this node's assigner stored a state), so the loop reads it at
    /// once. `None`: it changes only through the loop's own calls.
    fn changes(&self) -> Option<tokio::sync::watch::Receiver<i64>> {
        None
    }
    /// Whether, while not the writer, the loop mirrors the writer's
    /// decisions into this state (`sync::follow`): without `[cluster]`,
    /// under the Kubernetes election. Cluster mode's state is etcd's, one
    /// for all agents: nothing to mirror.
    fn follows(&self) -> bool {
        false
    }
}

/// Why the node's agent said no to an LB change.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// The request is wrong (a bad pool, a conflict): refused as given.
    Refused(String),
    /// It could not be carried out (the store, the maps).
    Failed(String),
}

/// The node's agent as the Kubernetes door uses it (in one job, nothing
/// else in between). The Kubernetes door names no agent type: the
/// server, which composes the two, implements this for the agent.
pub trait NodeAgent {
    /// Whether the agent is ready, its LB pools with their status, and its
    /// Services' statuses by `namespace/name`.
    fn lb_state(&self) -> (bool, Vec<PoolStatus>, BTreeMap<String, ServiceStatus>);
    /// `lb apply`'s path: pools and Services stored, assigned, programmed.
    ///
    /// # Errors
    /// Why not.
    fn lb_apply(
        &mut self,
        pools: Vec<LbPoolSpec>,
        services: Vec<ServiceSpec>,
    ) -> Result<(), Refusal>;
    /// `lb delete`'s path.
    ///
    /// # Errors
    /// Why not.
    fn lb_delete(&mut self, services: Vec<String>, pools: Vec<String>) -> Result<(), Refusal>;
    /// Whether `pools` may be stored next to the node's own pools.
    ///
    /// # Errors
    /// Why not.
    fn lb_check_node_pools(&self, pools: &[LbPoolSpec]) -> Result<(), Refusal>;
    /// The LB addresses the agent holds, to announce.
    fn lb_announced(&self) -> BTreeSet<IpAddr>;
    /// Releases endpoint attachment `key` as leaked by `pod`; whether it
    /// was released.
    ///
    /// # Errors
    /// Why it could not be.
    fn release_leaked(&mut self, key: &str, pod: &PodRef) -> Result<bool, String>;
}

/// A job on the node's agent.
pub type Job = Box<dyn FnOnce(&mut dyn NodeAgent) + Send>;

/// A future an [`AgentDoor`] returns.
pub type DoorFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// The way to the node's agent.
pub trait AgentDoor: std::fmt::Debug + Send + Sync + 'static {
    /// Runs `job`; `Ok(false)` when there is no agent (yet).
    ///
    /// # Errors
    /// The agent has stopped.
    fn run(&self, job: Job) -> DoorFuture<'_, Result<bool, KubeError>>;
    /// Endpoint attachments made for a pod (record key, pod), as last
    /// published: never waits. `None` while there is no agent.
    fn pod_endpoints(&self) -> Option<Vec<(String, PodRef)>>;
}

/// The node's agent, shared by the Kubernetes loops.
pub type Slot = Arc<dyn AgentDoor>;

/// Runs `f` on the agent (the worker is free while it waits). `None`: the
/// agent is not there (yet).
pub(crate) async fn on_agent<T: Send + 'static>(
    slot: &Slot,
    f: impl FnOnce(&mut dyn NodeAgent) -> T + Send + 'static,
) -> Result<Option<T>, KubeError> {
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    let ran = slot
        .run(Box::new(move |a| {
            let _ = tx.send(f(a));
        }))
        .await?;
    Ok(if ran { rx.try_recv().ok() } else { None })
}

fn refused_or_failed(e: &Refusal) -> KubeError {
    match e {
        Refusal::Refused(reason) => KubeError::Refused {
            reason: reason.clone(),
        },
        Refusal::Failed(reason) => KubeError::Lb {
            reason: reason.clone(),
        },
    }
}

/// Without `[cluster]`: the agent's own LB IPAM.
#[derive(Clone, Debug)]
pub struct LocalLb {
    slot: Slot,
    /// The election: the agent writes only while it is the writer, and
    /// mirrors otherwise. `None`: it always writes (once ready).
    election: Option<super::election::Election>,
    /// Notified after every change of the LB state (the announcer reads
    /// the addresses again).
    changed: Arc<tokio::sync::Notify>,
}

impl LocalLb {
    /// The agent in `slot`, the writer whenever it is ready.
    pub fn new(slot: Slot) -> Self {
        Self {
            slot,
            election: None,
            changed: Arc::new(tokio::sync::Notify::new()),
        }
    }

    /// The agent in `slot`, the writer while `election` says so.
    pub fn elected(slot: Slot, election: super::election::Election) -> Self {
        Self {
            election: Some(election),
            ..Self::new(slot)
        }
    }

    /// Notified after every change this backend makes to the LB state.
    pub fn changed(&self) -> Arc<tokio::sync::Notify> {
        self.changed.clone()
    }
}

/// An LB change on the local agent (`lb apply` / `lb delete`'s paths).
async fn lb_change(
    slot: &Slot,
    f: impl FnOnce(&mut dyn NodeAgent) -> Result<(), Refusal> + Send + 'static,
) -> Result<(), KubeError> {
    match on_agent(slot, f).await? {
        Some(Ok(())) => Ok(()),
        Some(Err(e)) => Err(refused_or_failed(&e)),
        None => Err(KubeError::Lb {
            reason: "the agent is not started".into(),
        }),
    }
}

impl LbBackend for LocalLb {
    async fn state(&self) -> Result<LbState, KubeError> {
        let view = on_agent(&self.slot, |a| a.lb_state()).await?;
        let elected = self
            .election
            .as_ref()
            .is_none_or(|e| e.leadership.borrow().acting_now());
        Ok(match view {
            Some((ready, pools, services)) => LbState {
                writer: ready && elected,
                services,
                pending: BTreeSet::new(),
                pools: pools
                    .into_iter()
                    .map(|p| (p.spec.name.clone(), p))
                    .collect(),
            },
            None => LbState::default(),
        })
    }

    async fn apply(
        &self,
        pools: Vec<LbPoolSpec>,
        services: Vec<ServiceSpec>,
    ) -> Result<(), KubeError> {
        let done = lb_change(&self.slot, move |a| a.lb_apply(pools, services)).await;
        self.changed.notify_one();
        done
    }

    async fn delete(&self, services: Vec<String>, pools: Vec<String>) -> Result<(), KubeError> {
        let done = lb_change(&self.slot, move |a| a.lb_delete(services, pools)).await;
        self.changed.notify_one();
        done
    }

    fn assigns_on_apply(&self) -> bool {
        true
    }

    fn changes(&self) -> Option<tokio::sync::watch::Receiver<i64>> {
        // A new term: the loop starts writing (or mirroring) at once.
        self.election.as_ref().map(|e| e.terms.clone())
    }

    fn follows(&self) -> bool {
        self.election.is_some()
    }

    fn poll_every(&self, _pending: bool) -> Duration {
        // Everything is assigned inside `apply`: nothing to learn by
        // reading again, but a slow read still repairs a missed change.
        Duration::from_secs(5)
    }
}

/// Cluster mode: etcd through the LB agent's handle.
#[derive(Clone, Debug)]
pub struct ClusterLb {
    handle: Arc<LbHandle>,
    node: String,
    slot: Slot,
}

impl ClusterLb {
    /// Node `node`'s view through `handle`; `slot` checks pools against
    /// the node's own pools, as the API's `lb apply` does.
    pub fn new(handle: Arc<LbHandle>, node: String, slot: Slot) -> Self {
        Self { handle, node, slot }
    }
}

impl LbBackend for ClusterLb {
    async fn state(&self) -> Result<LbState, KubeError> {
        let a = self
            .handle
            .assignments()
            .await
            .map_err(super::writer::store_err)?;
        Ok(LbState {
            writer: a.assigner.as_deref() == Some(self.node.as_str()),
            services: a.lb.services,
            pending: a.pending.into_iter().collect(),
            pools: a
                .lb
                .pools
                .into_iter()
                .map(|p| (p.spec.name.clone(), p))
                .collect(),
        })
    }

    async fn apply(
        &self,
        pools: Vec<LbPoolSpec>,
        services: Vec<ServiceSpec>,
    ) -> Result<(), KubeError> {
        if !pools.is_empty() {
            let check = pools.clone();
            if let Some(Err(e)) =
                on_agent(&self.slot, move |a| a.lb_check_node_pools(&check)).await?
            {
                return Err(refused_or_failed(&e));
            }
        }
        // No wait: the loop reads the assigner's state when it stored
        // one (`changes`).
        self.handle
            .store(pools, services)
            .await
            .map_err(super::writer::store_err)
    }

    async fn delete(&self, services: Vec<String>, pools: Vec<String>) -> Result<(), KubeError> {
        self.handle
            .remove(services, pools)
            .await
            .map_err(super::writer::store_err)
    }

    fn changes(&self) -> Option<tokio::sync::watch::Receiver<i64>> {
        Some(self.handle.stored())
    }

    fn assigns_on_apply(&self) -> bool {
        false
    }

    fn poll_every(&self, pending: bool) -> Duration {
        if pending {
            Duration::from_millis(100)
        } else {
            Duration::from_secs(1)
        }
    }
}
