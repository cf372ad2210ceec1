//! `externalTrafficPolicy: Local` (#44 item 3): which node may answer
//! (ARP, NDP) for a Service's addresses, read from its EndpointSlices.
//!
//! Why: with `Local`, kube-proxy (or any Service proxy) forwards traffic
//! that reaches a node only to endpoints on that node, and drops it when
//! there is none. A LoadBalancer address answered from a node without a
//! local endpoint is a black hole, so only a node with one may announce.
//!
//! Each such Service is announced by one node, the holder of the Service's
//! own Lease (the daemon runs the core's `election::Elector` per
//! Service): this module says which nodes are candidates for it.
//!
//! The rules, as the EndpointSlice API defines its conditions:
//! - `ready` unset means ready; `serving` unset means what `ready` says;
//!   `terminating` unset means not terminating.
//! - A node with a **ready** endpoint is a candidate.
//! - A node whose endpoints are only **serving while terminating** (a pod
//!   in its grace period during a rolling update) stays a candidate only
//!   while no other node has a ready one: proxies send traffic to
//!   terminating endpoints only then, and it hands over to a node with a
//!   ready endpoint as soon as one exists, while its own pod still serves
//!   the neighbours that have not moved yet.
//! - With no serving endpoint anywhere no node answers, and the Service's
//!   status says why ([`NO_ENDPOINT_REASON`]).

use std::collections::BTreeSet;
use std::net::IpAddr;

use super::ownership::{ingress_addrs, ingress_is_ours};
use super::{Condition, KubeService};

/// The label that ties an EndpointSlice to its Service.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";
/// The condition reason lockstep writes while a `Local` Service has no
/// serving endpoint on any node (its addresses are not announced).
pub const NO_ENDPOINT_REASON: &str = "NoServingEndpoint";
/// The condition on a `Local` Service that no node answers for: present
/// (`False`) only while that is so.
pub const ANNOUNCED_CONDITION: &str = "lockstep.io/Announced";
/// The prefix of a Service's announcing Lease's name.
pub const LEASE_PREFIX: &str = "lockstep-lb.";
/// The longest object name the API accepts (a DNS subdomain).
const MAX_NAME: usize = 253;

/// One endpoint of an EndpointSlice, as the door reads it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Endpoint {
    /// `nodeName` (unset: the endpoint is on no known node).
    pub node: Option<String>,
    /// `conditions.ready`.
    pub ready: Option<bool>,
    /// `conditions.serving`.
    pub serving: Option<bool>,
    /// `conditions.terminating`.
    pub terminating: Option<bool>,
}

impl Endpoint {
    fn is_ready(&self) -> bool {
        self.ready != Some(false) && self.terminating != Some(true)
    }

    fn is_serving(&self) -> bool {
        self.serving.or(self.ready) != Some(false)
    }

    fn on(&self, node: &str) -> bool {
        self.node.as_deref() == Some(node)
    }
}

/// The addresses lockstep gave `svc` (its ingress, with lockstep's
/// condition `True`) when it is a LoadBalancer Service with
/// `externalTrafficPolicy: Local`; `None` for any other Service.
#[must_use]
pub fn local_addresses(svc: &KubeService) -> Option<Vec<IpAddr>> {
    let local = svc.type_.as_deref() == Some("LoadBalancer")
        && svc.external_traffic_policy.as_deref() == Some("Local");
    if !local || !ingress_is_ours(svc) {
        return None;
    }
    ingress_addrs(svc)
}

/// The condition a `Local` Service with no serving endpoint carries.
#[must_use]
pub fn unserved_condition() -> Condition {
    Condition {
        type_: ANNOUNCED_CONDITION.into(),
        status: "False".into(),
        reason: NO_ENDPOINT_REASON.into(),
        message: "externalTrafficPolicy is Local and no node has a ready or serving endpoint: \
                  no node answers for its addresses"
            .into(),
    }
}

/// Whether `node` may answer for a `Local` Service with `endpoints` (all
/// its slices' endpoints); otherwise why not.
///
/// # Errors
/// Why not, as the agent logs it.
pub fn candidate(endpoints: &[Endpoint], node: &str) -> Result<(), String> {
    if endpoints.iter().any(|e| e.on(node) && e.is_ready()) {
        return Ok(());
    }
    let serving_here = endpoints.iter().any(|e| e.on(node) && e.is_serving());
    if !serving_here {
        return Err("no ready endpoint on this node".into());
    }
    if endpoints.iter().any(|e| !e.on(node) && e.is_ready()) {
        return Err("its endpoints here are terminating and another node has a ready one".into());
    }
    Ok(())
}

/// The nodes that may answer for a `Local` Service with `endpoints`.
#[must_use]
pub fn candidates(endpoints: &[Endpoint]) -> BTreeSet<String> {
    endpoints
        .iter()
        .filter_map(|e| e.node.clone())
        .filter(|n| candidate(endpoints, n).is_ok())
        .collect()
}

/// The name of the Lease that decides which node answers for Service
/// `namespace/name`: `lockstep-lb.<namespace>.<name>`. Namespace and
/// Service names are DNS labels (no dots, at most 63 characters), so no
/// two Services share a name; it is cut to the API's 253 characters all
/// the same.
#[must_use]
pub fn lease_name(namespace: &str, name: &str) -> String {
    let mut n = format!("{LEASE_PREFIX}{namespace}.{name}");
    n.truncate(MAX_NAME);
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ep(node: &str, ready: Option<bool>, serving: Option<bool>, term: Option<bool>) -> Endpoint {
        Endpoint {
            node: Some(node.into()),
            ready,
            serving,
            terminating: term,
        }
    }

    #[test]
    fn a_ready_endpoint_makes_its_node_a_candidate_and_no_other() {
        let eps = [ep("a", Some(true), Some(true), Some(false))];
        assert_eq!(candidate(&eps, "a"), Ok(()));
        assert!(
            candidate(&eps, "b")
                .unwrap_err()
                .contains("no ready endpoint")
        );
        assert_eq!(candidates(&eps), BTreeSet::from(["a".to_string()]));
    }

    #[test]
    fn unset_conditions_read_as_the_api_defines_them() {
        // ready unset: ready; serving unset: as ready.
        assert_eq!(candidate(&[ep("a", None, None, None)], "a"), Ok(()));
        assert!(candidate(&[ep("a", Some(false), None, None)], "a").is_err());
        let no_node = Endpoint::default();
        assert!(candidates(&[no_node]).is_empty());
    }

    #[test]
    fn a_terminating_endpoint_serves_until_another_node_is_ready() {
        let old = ep("a", Some(false), Some(true), Some(true));
        assert_eq!(candidate(std::slice::from_ref(&old), "a"), Ok(()));
        let new = ep("b", Some(true), Some(true), Some(false));
        let both = [old, new];
        assert!(candidate(&both, "a").unwrap_err().contains("terminating"));
        assert_eq!(candidates(&both), BTreeSet::from(["b".to_string()]));
    }

    #[test]
    fn nothing_serving_anywhere_makes_no_candidate() {
        let eps = [
            ep("a", Some(false), Some(false), Some(true)),
            ep("b", Some(false), Some(false), Some(false)),
        ];
        assert!(candidates(&eps).is_empty());
        assert!(candidates(&[]).is_empty());
    }

    #[test]
    fn only_lockstep_addresses_of_local_load_balancers_are_answered_locally() {
        let mut svc = KubeService {
            type_: Some("LoadBalancer".into()),
            external_traffic_policy: Some("Local".into()),
            ingress: vec!["10.250.0.5".into()],
            condition: Some(Condition {
                type_: super::super::SERVICE_CONDITION.into(),
                status: "True".into(),
                reason: "Assigned".into(),
                message: String::new(),
            }),
            ..KubeService::default()
        };
        assert_eq!(
            local_addresses(&svc),
            Some(vec!["10.250.0.5".parse().unwrap()])
        );
        svc.external_traffic_policy = Some("Cluster".into());
        assert_eq!(local_addresses(&svc), None);
        svc.external_traffic_policy = Some("Local".into());
        svc.condition = None;
        assert_eq!(local_addresses(&svc), None, "another controller's ingress");
    }

    #[test]
    fn lease_names_are_per_service_and_never_too_long() {
        assert_eq!(lease_name("shop", "web"), "lockstep-lb.shop.web");
        assert_ne!(lease_name("a-b", "c"), lease_name("a", "b-c-x"));
        assert_eq!(lease_name(&"n".repeat(200), &"s".repeat(200)).len(), 253);
    }
}
