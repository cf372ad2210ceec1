//! The pass of an agent that is not the elected writer (#44 item 1): its
//! LB state mirrors the writer's decisions, read back from the Services'
//! status ([`ownership::follow`]), and it writes nothing to the API.
//!
//! Why mirror at all: the follower that takes over must hold the same
//! addresses before it answers for them, so a takeover is a Lease write
//! and a gratuitous ARP, not a renumbering. A follower never assigns: a
//! Service the writer has not given an address is not in its state.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::Service;
use kube::runtime::reflector::Store;
use lockstep_core::lb::kubernetes::ownership::{self, Serving};
use lockstep_core::lb::kubernetes::pool_spec;
use lockstep_core::lb::{LbPoolSpec, ServiceSpec};

use super::super::KubeError;
use super::super::backend::{LbBackend, LbState};
use super::super::crd::LoadBalancerIPPool;
use super::super::objects::service;
use super::{BATCH, LbSync};

impl<B: LbBackend> LbSync<B> {
    /// One follower's pass: pools as defined, services as the writer
    /// gave them addresses; nothing written to the API.
    ///
    /// # Errors
    /// The LB state could not be written (the pass is tried again).
    pub(super) async fn follow(
        &mut self,
        services: &Store<Service>,
        pools: &Store<LoadBalancerIPPool>,
        state: &LbState,
    ) -> Result<(), KubeError> {
        let defined: Vec<LbPoolSpec> = pools
            .state()
            .iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
            .filter_map(|p| pool_spec(&p.to_core()).ok())
            .collect();
        for spec in &defined {
            if self.applied_pools.get(&spec.name) == Some(spec) {
                continue;
            }
            match self.backend.apply(vec![spec.clone()], Vec::new()).await {
                Ok(()) => {
                    self.applied_pools.insert(spec.name.clone(), spec.clone());
                }
                Err(KubeError::Refused { reason }) => {
                    tracing::debug!(pool = %spec.name, %reason, "kubernetes: follower: lb pool refused");
                }
                Err(e) => return Err(e),
            }
        }
        let serving = Serving {
            class: &self.classes.class,
            classless: self.classes.classless,
            pools: &defined,
        };
        let want: BTreeMap<String, ServiceSpec> = services
            .state()
            .iter()
            .filter_map(|s| ownership::follow(&service(s), &serving))
            .map(|s| (s.id(), s))
            .collect();
        // Gone first: an address the writer moved to another Service is
        // free here before that one takes it.
        let gone: Vec<String> = state
            .stored_services()
            .into_iter()
            .filter(|id| !want.contains_key(id))
            .collect();
        for chunk in gone.chunks(BATCH) {
            self.backend.delete(chunk.to_vec(), Vec::new()).await?;
        }
        let apply: Vec<ServiceSpec> = want
            .values()
            .filter(|s| self.applied_services.get(&s.id()) != Some(*s))
            .cloned()
            .collect();
        for chunk in apply.chunks(BATCH) {
            let one_by_one = match self.backend.apply(Vec::new(), chunk.to_vec()).await {
                Ok(()) => {
                    for s in chunk {
                        self.applied_services.insert(s.id(), s.clone());
                    }
                    false
                }
                Err(KubeError::Refused { .. }) => true,
                Err(e) => return Err(e),
            };
            if one_by_one {
                // Not recorded when refused: tried again next pass, once
                // the writer's status for the other Service arrived.
                for s in chunk {
                    match self.backend.apply(Vec::new(), vec![s.clone()]).await {
                        Ok(()) => {
                            self.applied_services.insert(s.id(), s.clone());
                        }
                        Err(KubeError::Refused { reason }) => {
                            tracing::debug!(service = %s.id(), %reason, "kubernetes: follower: the writer's address not held yet");
                        }
                        Err(e) => return Err(e),
                    }
                }
            }
        }
        let names: BTreeSet<&String> = defined.iter().map(|p| &p.name).collect();
        let gone_pools: Vec<String> = state
            .pools
            .keys()
            .filter(|n| !names.contains(n))
            .cloned()
            .collect();
        if !gone_pools.is_empty() {
            self.backend.delete(Vec::new(), gone_pools).await?;
        }
        self.applied_pools.retain(|n, _| names.contains(n));
        self.applied_services.retain(|id, _| want.contains_key(id));
        Ok(())
    }
}
