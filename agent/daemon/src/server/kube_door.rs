//! The agent as the Kubernetes door's node agent (`kubernetes::backend`'s
//! `NodeAgent`, NodeIPAM's `Allocator`, leak detection's
//! `NodeEndpoints`): the server composes the two, so neither names the
//! other.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Arc;

use ipnet::IpNet;
use lockstep_core::lb::{LbPoolSpec, PoolStatus, ServiceSpec, ServiceStatus};
use lockstep_core::pods::PodRef;
use lockstep_core::pool::PoolSpec;

use crate::agent::lb::{LbApply, LbDelete};
use crate::agent::{Agent, AgentError, AgentHandle};
use crate::kubernetes::KubeError;
use crate::kubernetes::backend::{AgentDoor, DoorFuture, Job, NodeAgent, Refusal, Slot, on_agent};
use crate::kubernetes::leaks::NodeEndpoints;
use crate::kubernetes::nodeipam::{AgentSlot, Allocator};

/// A refusal of the agent's, as the Kubernetes door reports it.
fn refusal(e: &AgentError) -> Refusal {
    match e {
        AgentError::Invalid { reason } => Refusal::Refused(reason.clone()),
        e => Refusal::Failed(crate::error_chain(e)),
    }
}

impl NodeAgent for Agent {
    fn lb_state(&self) -> (bool, Vec<PoolStatus>, BTreeMap<String, ServiceStatus>) {
        let view = self.lb_view();
        (self.status().ready, view.pools, view.services)
    }

    fn lb_apply(
        &mut self,
        pools: Vec<LbPoolSpec>,
        services: Vec<ServiceSpec>,
    ) -> Result<(), Refusal> {
        Agent::lb_apply(self, LbApply { pools, services })
            .map(drop)
            .map_err(|e| refusal(&e))
    }

    fn lb_delete(&mut self, services: Vec<String>, pools: Vec<String>) -> Result<(), Refusal> {
        Agent::lb_delete(self, LbDelete { pools, services })
            .map(drop)
            .map_err(|e| refusal(&e))
    }

    fn lb_check_node_pools(&self, pools: &[LbPoolSpec]) -> Result<(), Refusal> {
        Agent::lb_check_node_pools(self, pools).map_err(|e| refusal(&e))
    }

    fn lb_announced(&self) -> BTreeSet<IpAddr> {
        Agent::lb_announced(self)
    }

    fn release_leaked(&mut self, key: &str, pod: &PodRef) -> Result<bool, String> {
        Agent::release_leaked(self, key, pod).map_err(|e| crate::error_chain(&e))
    }
}

impl Allocator for Agent {
    fn usage(&self, cidrs: &[IpNet]) -> Vec<u64> {
        self.block_usage(cidrs)
    }

    fn configured(&self) -> Vec<PoolSpec> {
        self.config().pools.clone()
    }

    fn set_pools(&mut self, specs: Vec<PoolSpec>) -> Result<(), String> {
        self.set_cluster_pools(specs, BTreeMap::new(), BTreeSet::new())
            .map_err(|e| crate::error_chain(&e))
    }
}

/// The agent's owner as the door.
#[derive(Debug)]
struct OwnerDoor(AgentHandle);

fn task_err(e: &AgentError) -> KubeError {
    KubeError::Task {
        reason: crate::error_chain(e),
    }
}

impl AgentDoor for OwnerDoor {
    fn run(&self, job: Job) -> DoorFuture<'_, Result<bool, KubeError>> {
        Box::pin(async move {
            self.0
                .ask(move |a| a.as_mut().map(|agent| job(agent)).is_some())
                .await
                .map_err(|e| task_err(&e))
        })
    }

    fn pod_endpoints(&self) -> Option<Vec<(String, PodRef)>> {
        // The owner's published view: listing never waits for a command.
        let view = self.0.view();
        view.present.then(|| view.pod_endpoints.clone())
    }
}

impl AgentSlot for AgentHandle {
    async fn run<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut dyn Allocator) -> T + Send + 'static,
    ) -> Result<T, KubeError> {
        self.ask(move |a| a.as_mut().map(|agent| f(agent)))
            .await
            .map_err(|e| task_err(&e))?
            .ok_or_else(|| KubeError::Task {
                reason: "the agent is not started".into(),
            })
    }
}

/// Leak detection's endpoints: the agent's.
pub(super) struct AgentEndpoints(pub(super) Slot);

impl NodeEndpoints for AgentEndpoints {
    async fn list(&self) -> Result<Option<Vec<(String, PodRef)>>, KubeError> {
        Ok(self.0.pod_endpoints())
    }

    async fn release(&self, key: String, pod: PodRef) -> Result<bool, KubeError> {
        match on_agent(&self.0, move |a| a.release_leaked(&key, &pod)).await? {
            Some(r) => r.map_err(|reason| KubeError::Lb { reason }),
            None => Ok(false),
        }
    }
}

/// The Kubernetes door's way to the agent behind `handle`.
pub(super) fn slot(handle: &AgentHandle) -> Slot {
    Arc::new(OwnerDoor(handle.clone()))
}
