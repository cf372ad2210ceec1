//! Which election answers (ARP, NDP) for each LoadBalancer address
//! without cluster mode, and whether this node stands in it (#44 items 3
//! and 4).
//!
//! Why: the elected writer answers for every address no rule keeps from
//! it, but two rules need a node the writer may not be:
//! - an `externalTrafficPolicy: Local` Service must be answered from a
//!   node with a ready endpoint of it (`local`): one Lease per Service;
//! - a pool with a `nodeSelector` must be answered from a node its
//!   selector admits, read from the node's labels as they are now: one
//!   Lease per pool, `lockstep-lbpool.<pool>`, among the admitted nodes.
//!
//! A `Local` Service in a pool with a selector needs both: its own Lease,
//! among the admitted nodes with a ready endpoint. Every address a seat
//! answers is left out of the writer's part, so no address is answered
//! by two nodes.

use std::collections::BTreeMap;
use std::net::IpAddr;

use ipnet::IpNet;

use super::KubeService;
use super::local::{Endpoint, candidate, lease_name, local_addresses};
use super::ownership::{ingress_addrs, ingress_is_ours};
use crate::lb::{AddrRange, LabelSelector, LbPoolSpec};

/// The prefix of a pool's announcing Lease's name.
pub const POOL_LEASE_PREFIX: &str = "lockstep-lbpool.";
/// The longest object name the API accepts (a DNS subdomain).
const MAX_NAME: usize = 253;

/// A pool whose addresses only the nodes its selector admits may answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SelectorPool {
    /// The pool's name.
    pub name: String,
    /// Its `nodeSelector` (never empty).
    pub selector: LabelSelector,
    cidrs: Vec<IpNet>,
    ranges: Vec<AddrRange>,
}

impl SelectorPool {
    /// `spec` when it has a node selector; `None` when every node may
    /// answer for it.
    #[must_use]
    pub fn of(spec: &LbPoolSpec) -> Option<Self> {
        (!spec.node_selector.is_empty()).then(|| Self {
            name: spec.name.clone(),
            selector: spec.node_selector.clone(),
            cidrs: spec.cidrs.clone(),
            ranges: spec.ranges.clone(),
        })
    }

    /// Whether `addr` is one of the pool's.
    #[must_use]
    pub fn contains(&self, addr: IpAddr) -> bool {
        self.cidrs.iter().any(|c| c.contains(&addr))
            || self.ranges.iter().any(|r| match (r.start, r.stop, addr) {
                (IpAddr::V4(s), IpAddr::V4(e), IpAddr::V4(a)) => s <= a && a <= e,
                (IpAddr::V6(s), IpAddr::V6(e), IpAddr::V6(a)) => s <= a && a <= e,
                _ => false,
            })
    }

    /// Whether a node with `labels` (`None`: not read yet) may answer.
    #[must_use]
    pub fn admits(&self, labels: Option<&BTreeMap<String, String>>) -> bool {
        labels.is_some_and(|l| self.selector.matches(l))
    }
}

/// The name of the Lease that decides which node answers for pool
/// `pool`'s addresses: `lockstep-lbpool.<pool>` (never a Service's, whose
/// prefix is `lockstep-lb.`), cut to the API's 253 characters.
#[must_use]
pub fn pool_lease_name(pool: &str) -> String {
    let mut n = format!("{POOL_LEASE_PREFIX}{pool}");
    n.truncate(MAX_NAME);
    n
}

/// One election a Service's addresses go to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placement {
    /// What identifies the election among this node's: `namespace/name`
    /// for a Service's own, `pool:<name>` for a pool's.
    pub key: String,
    /// The Lease's name.
    pub lease: String,
    /// The addresses it answers for.
    pub addrs: Vec<IpAddr>,
    /// Whether this node stands in it now, else why not.
    pub here: Result<(), String>,
}

/// Where `svc`'s addresses are answered, when not by the writer: one
/// placement for a `Local` Service, one per selector pool its addresses
/// lie in otherwise, none for a Service the writer answers alone (or not
/// lockstep's). `endpoints`: the Service's; `labels`: this node's (`None`
/// until read); `may`: whether this node may answer at all (not excluded,
/// cordoned, NotReady or deleting).
#[must_use]
pub fn placements(
    svc: &KubeService,
    endpoints: &[Endpoint],
    pools: &[SelectorPool],
    node: &str,
    labels: Option<&BTreeMap<String, String>>,
    may: bool,
) -> Vec<Placement> {
    let admitted = |addrs: &[IpAddr]| -> Result<(), String> {
        for a in addrs {
            if let Some(p) = pools.iter().find(|p| p.contains(*a))
                && !p.admits(labels)
            {
                return Err(format!(
                    "pool {}'s nodeSelector does not admit this node",
                    p.name
                ));
            }
        }
        Ok(())
    };
    let gate = |r: Result<(), String>| {
        if may {
            r
        } else {
            Err("this node may not answer".into())
        }
    };
    if let Some(addrs) = local_addresses(svc) {
        let here = gate(candidate(endpoints, node).and_then(|()| admitted(&addrs)));
        return vec![Placement {
            key: format!("{}/{}", svc.namespace, svc.name),
            lease: lease_name(&svc.namespace, &svc.name),
            addrs,
            here,
        }];
    }
    if svc.type_.as_deref() != Some("LoadBalancer") || !ingress_is_ours(svc) {
        return Vec::new();
    }
    let mut by_pool: BTreeMap<&str, Placement> = BTreeMap::new();
    for a in ingress_addrs(svc).unwrap_or_default() {
        let Some(p) = pools.iter().find(|p| p.contains(a)) else {
            continue;
        };
        by_pool
            .entry(&p.name)
            .or_insert_with(|| Placement {
                key: format!("pool:{}", p.name),
                lease: pool_lease_name(&p.name),
                addrs: Vec::new(),
                here: gate(admitted(&[a])),
            })
            .addrs
            .push(a);
    }
    by_pool.into_values().collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lb::kubernetes::{Condition, SERVICE_CONDITION};

    fn pool(name: &str, cidr: &str, zone: &str) -> SelectorPool {
        let mut spec = LbPoolSpec::new(name);
        spec.cidrs.push(cidr.parse().unwrap());
        spec.node_selector
            .match_labels
            .insert("zone".into(), zone.into());
        SelectorPool::of(&spec).unwrap()
    }

    fn svc(name: &str, policy: &str, ingress: &[&str]) -> KubeService {
        KubeService {
            namespace: "default".into(),
            name: name.into(),
            type_: Some("LoadBalancer".into()),
            external_traffic_policy: Some(policy.into()),
            ingress: ingress.iter().map(ToString::to_string).collect(),
            condition: Some(Condition {
                type_: SERVICE_CONDITION.into(),
                status: "True".into(),
                reason: "Assigned".into(),
                message: String::new(),
            }),
            ..KubeService::default()
        }
    }

    fn labels(zone: &str) -> BTreeMap<String, String> {
        BTreeMap::from([("zone".to_string(), zone.to_string())])
    }

    fn ready(node: &str) -> Endpoint {
        Endpoint {
            node: Some(node.into()),
            ..Endpoint::default()
        }
    }

    #[test]
    fn a_pool_without_a_selector_is_the_writers() {
        let mut spec = LbPoolSpec::new("open");
        spec.cidrs.push("10.0.0.0/24".parse().unwrap());
        assert_eq!(SelectorPool::of(&spec), None);
        let s = svc("web", "Cluster", &["10.0.0.5"]);
        assert!(placements(&s, &[], &[], "a", Some(&labels("x")), true).is_empty());
    }

    #[test]
    fn a_selector_pools_addresses_go_to_its_lease_among_admitted_nodes() {
        let pools = [
            pool("east", "10.1.0.0/24", "east"),
            pool("west", "10.2.0.0/24", "west"),
        ];
        let s = svc("web", "Cluster", &["10.1.0.5", "10.2.0.5", "10.3.0.5"]);
        let p = placements(&s, &[], &pools, "a", Some(&labels("east")), true);
        assert_eq!(p.len(), 2, "{p:?}");
        assert_eq!(p[0].key, "pool:east");
        assert_eq!(p[0].lease, "lockstep-lbpool.east");
        assert_eq!(p[0].addrs, vec!["10.1.0.5".parse::<IpAddr>().unwrap()]);
        assert_eq!(p[0].here, Ok(()));
        assert!(p[1].here.as_ref().unwrap_err().contains("pool west"));
        // Labels not read yet, or the node may not answer: no seat here.
        let p = placements(&s, &[], &pools, "a", None, true);
        assert!(p.iter().all(|p| p.here.is_err()));
        let p = placements(&s, &[], &pools, "a", Some(&labels("east")), false);
        assert!(p.iter().all(|p| p.here.is_err()));
    }

    #[test]
    fn a_local_service_in_a_selector_pool_needs_both() {
        let pools = [pool("east", "10.1.0.0/24", "east")];
        let s = svc("web", "Local", &["10.1.0.5"]);
        let eps = [ready("a"), ready("b")];
        let here = |node, zone| {
            let p = placements(&s, &eps, &pools, node, Some(&labels(zone)), true);
            assert_eq!(p.len(), 1);
            assert_eq!(p[0].lease, "lockstep-lb.default.web");
            p[0].here.clone()
        };
        assert_eq!(here("a", "east"), Ok(()));
        assert!(here("b", "west").unwrap_err().contains("nodeSelector"));
        assert!(here("c", "east").unwrap_err().contains("no ready endpoint"));
    }

    #[test]
    fn ranges_count_and_a_pool_lease_never_names_a_service_lease() {
        let mut spec = LbPoolSpec::new("r");
        spec.ranges.push(AddrRange {
            start: "10.9.0.10".parse().unwrap(),
            stop: "10.9.0.20".parse().unwrap(),
        });
        spec.node_selector
            .match_labels
            .insert("zone".into(), "a".into());
        let p = SelectorPool::of(&spec).unwrap();
        assert!(p.contains("10.9.0.20".parse().unwrap()));
        assert!(!p.contains("10.9.0.21".parse().unwrap()));
        assert!(!p.contains("fd00::1".parse().unwrap()));
        assert!(!pool_lease_name("lb").starts_with(super::super::local::LEASE_PREFIX));
        assert!(pool_lease_name(&"p".repeat(300)).len() <= 253);
    }
}
