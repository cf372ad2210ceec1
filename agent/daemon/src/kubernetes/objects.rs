//! Kubernetes objects to the core's plain types and back: a Service read
//! into a [`KubeService`], EndpointSlices into each Service's endpoints,
//! lockstep's condition read off an object, and the
//! merge patches that write a status. The decisions are the core's
//! (`lockstep_core::lb::kubernetes`); this file only spells them in the
//! API's JSON.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition as KubeCondition;
use lockstep_core::lb::kubernetes::local::{
    ANNOUNCED_CONDITION, Endpoint, SERVICE_NAME_LABEL, unserved_condition,
};
use lockstep_core::lb::kubernetes::ownership::status_change;
use lockstep_core::lb::kubernetes::{
    Condition, KubeService, PoolOutcome, SERVICE_CONDITION, ServiceOutcome, TimedCondition,
    drop_condition, merge_condition,
};
use serde_json::{Value, json};

use super::crd::{LoadBalancerIPPool, PoolCondition};

/// The endpoints of each Service (`namespace/name`) in `slices`.
pub fn endpoints(
    slices: &kube::runtime::reflector::Store<EndpointSlice>,
) -> BTreeMap<String, Vec<Endpoint>> {
    let mut out: BTreeMap<String, Vec<Endpoint>> = BTreeMap::new();
    for s in slices.state() {
        let Some(svc) = s
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(SERVICE_NAME_LABEL))
        else {
            continue;
        };
        let ns = s.metadata.namespace.clone().unwrap_or_default();
        let eps = out.entry(format!("{ns}/{svc}")).or_default();
        eps.extend(s.endpoints.iter().flatten().map(|e| {
            let c = e.conditions.as_ref();
            Endpoint {
                node: e.node_name.clone(),
                ready: c.and_then(|c| c.ready),
                serving: c.and_then(|c| c.serving),
                terminating: c.and_then(|c| c.terminating),
            }
        }));
    }
    out
}

/// A Service as the core reads it.
pub fn service(svc: &Service) -> KubeService {
    let m = &svc.metadata;
    let spec = svc.spec.as_ref();
    KubeService {
        namespace: m.namespace.clone().unwrap_or_default(),
        name: m.name.clone().unwrap_or_default(),
        labels: m.labels.clone().unwrap_or_default(),
        annotations: m.annotations.clone().unwrap_or_default(),
        type_: spec.and_then(|s| s.type_.clone()),
        load_balancer_class: spec.and_then(|s| s.load_balancer_class.clone()),
        load_balancer_ip: spec.and_then(|s| s.load_balancer_ip.clone()),
        ip_families: spec.and_then(|s| s.ip_families.clone()).unwrap_or_default(),
        ip_family_policy: spec.and_then(|s| s.ip_family_policy.clone()),
        ports: spec
            .and_then(|s| s.ports.as_ref())
            .map(|ports| ports.iter().map(|p| (p.protocol.clone(), p.port)).collect())
            .unwrap_or_default(),
        external_traffic_policy: spec.and_then(|s| s.external_traffic_policy.clone()),
        ingress: service_ingress(svc),
        condition: service_condition(svc),
    }
}

fn timed(c: &KubeCondition) -> TimedCondition {
    TimedCondition {
        condition: Condition {
            type_: c.type_.clone(),
            status: c.status.clone(),
            reason: c.reason.clone(),
            message: c.message.clone(),
        },
        last_transition_time: c.last_transition_time.0.to_string(),
        observed_generation: c.observed_generation,
    }
}

fn service_conditions(svc: &Service) -> Vec<TimedCondition> {
    svc.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .map(|cs| cs.iter().map(timed).collect())
        .unwrap_or_default()
}

/// Lockstep's condition on a Service, if it has one.
pub fn service_condition(svc: &Service) -> Option<Condition> {
    service_conditions(svc)
        .into_iter()
        .find(|c| c.condition.type_ == SERVICE_CONDITION)
        .map(|c| c.condition)
}

/// `status.loadBalancer.ingress`: each entry's `ip`, else its `hostname`.
fn service_ingress(svc: &Service) -> Vec<String> {
    svc.status
        .as_ref()
        .and_then(|s| s.load_balancer.as_ref())
        .and_then(|lb| lb.ingress.as_ref())
        .map(|ing| {
            ing.iter()
                .filter_map(|i| i.ip.clone().or_else(|| i.hostname.clone()))
                .collect()
        })
        .unwrap_or_default()
}

fn condition_json(c: &TimedCondition) -> Value {
    let mut v = json!({
        "type": c.condition.type_,
        "status": c.condition.status,
        "reason": c.condition.reason,
        "message": c.condition.message,
        "lastTransitionTime": c.last_transition_time,
    });
    if let Some(g) = c.observed_generation {
        v["observedGeneration"] = json!(g);
    }
    v
}

/// The merge patch that brings a Service's status to `want` (`None`: the
/// Service is not, or no longer, lockstep's), as the core's
/// [`status_change`] allows (`pools_exist`: some lockstep pool is defined),
/// or `None` when nothing is to be written. An ingress the change leaves
/// alone is not in the patch, so the API keeps it. The patch carries the
/// object's `resourceVersion`, so a status written meanwhile by anyone
/// makes it fail (409) rather than overwrite. `unserved`: an
/// `externalTrafficPolicy: Local` Service with no serving endpoint, which
/// no node answers for, says so in its own condition.
pub fn service_status_patch(
    svc: &Service,
    want: Option<&ServiceOutcome>,
    pools_exist: bool,
    unserved: bool,
    now: &str,
) -> Option<Value> {
    let change = status_change(&service(svc), want, pools_exist);
    let mut conditions = service_conditions(svc);
    let announced = unserved.then(unserved_condition);
    let has = conditions
        .iter()
        .find(|c| c.condition.type_ == ANNOUNCED_CONDITION)
        .map(|c| &c.condition);
    if change.is_none() && has == announced.as_ref() {
        return None;
    }
    let generation = svc.metadata.generation;
    if let Some(change) = &change {
        conditions = match change.condition.clone() {
            Some(c) => merge_condition(&conditions, c, now, generation),
            None => drop_condition(&conditions, SERVICE_CONDITION),
        };
    }
    conditions = match announced {
        Some(c) => merge_condition(&conditions, c, now, generation),
        None => drop_condition(&conditions, ANNOUNCED_CONDITION),
    };
    let mut status = json!({
        "conditions": conditions.iter().map(condition_json).collect::<Vec<_>>(),
    });
    if let Some(ingress) = change.and_then(|c| c.ingress) {
        status["loadBalancer"] = json!({
            "ingress": ingress.iter().map(|a| json!({"ip": a.to_string()})).collect::<Vec<_>>(),
        });
    }
    Some(json!({
        "metadata": {"resourceVersion": svc.metadata.resource_version},
        "status": status,
    }))
}

fn pool_timed(c: &PoolCondition) -> TimedCondition {
    TimedCondition {
        condition: Condition {
            type_: c.type_.clone(),
            status: c.status.clone(),
            reason: c.reason.clone(),
            message: c.message.clone(),
        },
        last_transition_time: c.last_transition_time.clone(),
        observed_generation: c.observed_generation,
    }
}

/// Lockstep's conditions on a pool.
pub fn pool_conditions(pool: &LoadBalancerIPPool) -> Vec<Condition> {
    pool.status
        .as_ref()
        .map(|s| {
            s.conditions
                .iter()
                .map(|c| pool_timed(c).condition)
                .collect()
        })
        .unwrap_or_default()
}

/// The merge patch that brings a pool's status to `want`, or `None` when
/// it already says so (guarded by the object's `resourceVersion`).
pub fn pool_status_patch(
    pool: &LoadBalancerIPPool,
    want: &PoolOutcome,
    now: &str,
) -> Option<Value> {
    let status = pool.status.clone().unwrap_or_default();
    if pool_conditions(pool) == want.conditions
        && status.total == want.total
        && status.used == want.used
        && status.available == want.available
    {
        return None;
    }
    let mut conditions: Vec<TimedCondition> = status.conditions.iter().map(pool_timed).collect();
    for c in &want.conditions {
        conditions = merge_condition(&conditions, c.clone(), now, pool.metadata.generation);
    }
    conditions.retain(|c| want.conditions.iter().any(|w| w.type_ == c.condition.type_));
    Some(json!({
        "metadata": {"resourceVersion": pool.metadata.resource_version},
        "status": {
            "conditions": conditions.iter().map(condition_json).collect::<Vec<_>>(),
            "total": want.total,
            "used": want.used,
            "available": want.available,
        }
    }))
}

/// A Node's labels and `(type, address)` pairs.
pub fn node_facts(node: &Node) -> (BTreeMap<String, String>, Vec<(String, String)>) {
    let labels = node.metadata.labels.clone().unwrap_or_default();
    let addresses = node
        .status
        .as_ref()
        .and_then(|s| s.addresses.as_ref())
        .map(|a| {
            a.iter()
                .map(|a| (a.type_.clone(), a.address.clone()))
                .collect()
        })
        .unwrap_or_default();
    (labels, addresses)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::IpAddr;

    use lockstep_core::lb::kubernetes::{DEFAULT_CLASS, Request, lb_request};

    fn svc(v: Value) -> Service {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn a_service_reads_into_the_core_request() {
        let s = svc(json!({
            "metadata": {"namespace": "a", "name": "web", "labels": {"tier": "web"},
                          "annotations": {"lockstep.io/ips": "10.0.0.5"}},
            "spec": {"type": "LoadBalancer", "ipFamilies": ["IPv4"], "ipFamilyPolicy": "SingleStack",
                     "ports": [{"port": 80, "protocol": "TCP"}, {"port": 53, "protocol": "UDP"}]}
        }));
        let Request::Wanted(spec) = lb_request(&service(&s), DEFAULT_CLASS) else {
            panic!("not wanted");
        };
        assert_eq!(spec.id(), "a/web");
        assert_eq!(spec.ports.len(), 2);
        assert_eq!(
            spec.load_balancer_ips,
            vec!["10.0.0.5".parse::<IpAddr>().unwrap()]
        );
    }

    fn assigned_10_0_0_5() -> ServiceOutcome {
        ServiceOutcome {
            ingress: vec!["10.0.0.5".parse().unwrap()],
            condition: Condition {
                type_: SERVICE_CONDITION.into(),
                status: "True".into(),
                reason: "Assigned".into(),
                message: "assigned 10.0.0.5".into(),
            },
        }
    }

    #[test]
    fn a_status_is_patched_only_when_it_differs_and_keeps_other_conditions() {
        let s = svc(json!({
            "metadata": {"namespace": "a", "name": "web", "resourceVersion": "7", "generation": 2},
            "spec": {"type": "LoadBalancer"},
            "status": {"conditions": [{"type": "Other", "status": "True", "reason": "X", "message": "m",
                                        "lastTransitionTime": "2026-01-01T00:00:00Z"}]}
        }));
        let want = assigned_10_0_0_5();
        let p = service_status_patch(&s, Some(&want), true, false, "2026-11-27T20:00:00Z").unwrap();
        assert_eq!(p["metadata"]["resourceVersion"], "7");
        assert_eq!(p["status"]["loadBalancer"]["ingress"][0]["ip"], "10.0.0.5");
        let conds = p["status"]["conditions"].as_array().unwrap();
        assert_eq!(conds.len(), 2);
        assert_eq!(conds[0]["type"], "Other");
        assert_eq!(conds[1]["observedGeneration"], 2);
        // The patched object needs no further patch; a service that is no
        // longer ours loses lockstep's condition and its addresses.
        let mut patched = serde_json::to_value(&s).unwrap();
        patched["status"] = p["status"].clone();
        let patched: Service = serde_json::from_value(patched).unwrap();
        assert_eq!(
            service_status_patch(&patched, Some(&want), true, false, "later"),
            None
        );
        let cleared = service_status_patch(&patched, None, true, false, "later").unwrap();
        assert_eq!(cleared["status"]["conditions"].as_array().unwrap().len(), 1);
        assert!(
            cleared["status"]["loadBalancer"]["ingress"]
                .as_array()
                .unwrap()
                .is_empty()
        );
        // Never ours: nothing written.
        assert_eq!(service_status_patch(&s, None, true, false, "later"), None);
    }

    #[test]
    fn a_local_service_without_endpoints_says_so_and_the_condition_goes_with_them() {
        let s = svc(json!({
            "metadata": {"namespace": "a", "name": "web", "resourceVersion": "3"},
            "spec": {"type": "LoadBalancer", "externalTrafficPolicy": "Local"},
            "status": {"loadBalancer": {"ingress": [{"ip": "10.0.0.5"}]},
                       "conditions": [{"type": SERVICE_CONDITION, "status": "True", "reason": "Assigned",
                                       "message": "assigned 10.0.0.5", "lastTransitionTime": "2026-01-01T00:00:00Z"}]}
        }));
        let want = assigned_10_0_0_5();
        assert_eq!(
            service_status_patch(&s, Some(&want), true, false, "2026-11-29T19:00:00Z"),
            None
        );
        let p = service_status_patch(&s, Some(&want), true, true, "2026-11-29T19:00:00Z").unwrap();
        let conds = p["status"]["conditions"].as_array().unwrap();
        let announced = conds
            .iter()
            .find(|c| c["type"] == ANNOUNCED_CONDITION)
            .unwrap();
        assert_eq!(announced["status"], "False");
        assert_eq!(announced["reason"], "NoServingEndpoint");
        assert!(
            p["status"].get("loadBalancer").is_none(),
            "the ingress is kept as is"
        );
        let mut patched = serde_json::to_value(&s).unwrap();
        patched["status"]["conditions"] = p["status"]["conditions"].clone();
        let patched: Service = serde_json::from_value(patched).unwrap();
        assert_eq!(
            service_status_patch(&patched, Some(&want), true, true, "2026-11-29T19:00:00Z"),
            None
        );
        let back = service_status_patch(&patched, Some(&want), true, false, "2026-11-29T19:00:00Z")
            .unwrap();
        assert_eq!(back["status"]["conditions"].as_array().unwrap().len(), 1);
    }
}
