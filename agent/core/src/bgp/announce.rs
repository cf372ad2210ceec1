//! What one node announces over BGP (#48 item 2): its share of the
//! LoadBalancer addresses, and the pod blocks it holds.
//!
//! Where L2 announcement has one node answer for an address, BGP lets
//! every node that may serve it announce it, and the routers spread the
//! traffic over them (ECMP). So the question is per node, not per
//! address: may this node serve this address? The rules are the ones the
//! L2 path already keeps, applied to every node at once:
//! - a node kept out of load balancing ([`may_answer`](crate::lb::kubernetes::nodes::may_answer): labelled
//!   excluded, cordoned, not ready, being deleted) announces no
//!   LoadBalancer address, whatever its endpoints;
//! - an address of a pool whose node selector does not admit the node is
//!   not announced by it;
//! - under `externalTrafficPolicy: Local`, a node announces only while it
//!   is a [`candidate`]: it has a ready endpoint, or its endpoints are
//!   serving while terminating and no other node has a ready one. So a
//!   rolling update hands the address from node to node without a moment
//!   where no node announces it (the new pod is ready before the old one
//!   terminates), and a node whose pod went away stops at once;
//! - under `Cluster`, every node that may serve announces.
//!
//! In cluster mode without Kubernetes ([`decide_stored`]) the addresses
//! are those the assigner stored in etcd, with no endpoints to follow:
//! every node the pool's node selector admits announces, while its LB
//! lease is live ([`LEASE_NOT_LIVE`] says why not).
//!
//! Pod blocks are announced by the node that holds them, exclusion from
//! load balancing or not: they route to pods, not to Services.
//!
//! Each prefix carries its pool's attributes (communities, local
//! preference); an address is a host route (/32, /128).

use std::collections::BTreeMap;
use std::net::IpAddr;

use ipnet::IpNet;

use super::{Announcements, RouteAttrs};
use crate::lb::kubernetes::KubeService;
use crate::lb::kubernetes::local::{Endpoint, candidate};
use crate::lb::kubernetes::ownership::lockstep_ingress;
use crate::lb::{LbPoolSpec, PoolStatus, ServiceStatus};

/// One LoadBalancer address as the decision needs it.
#[derive(Clone, Copy, Debug)]
pub struct LbAddress<'a> {
    /// The address.
    pub address: IpAddr,
    /// Its pool (for the route's attributes).
    pub pool: &'a str,
    /// With `externalTrafficPolicy: Local`: the Service's endpoints (all
    /// its slices'); `None` for `Cluster`.
    pub local: Option<&'a [Endpoint]>,
    /// Whether the pool's node selector admits this node (`true` for a
    /// pool without one).
    pub admitted: bool,
}

/// One pod block this node holds.
#[derive(Clone, Copy, Debug)]
pub struct PodBlock<'a> {
    /// The block.
    pub cidr: IpNet,
    /// Its pool (for the route's attributes).
    pub pool: &'a str,
}

/// What a node announces, and why it announces no more.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Decision {
    /// The LoadBalancer addresses to announce, with their attributes.
    pub routes: Announcements,
    /// The pod blocks to announce, with their attributes (kept announced
    /// when the agent dies: `keeper`).
    pub blocks: Announcements,
    /// The LoadBalancer addresses it does not announce, each with why
    /// (for its status and logs).
    pub withheld: BTreeMap<IpAddr, String>,
    /// Under Kubernetes, the Service (`namespace/name`) of each address
    /// in [`Decision::routes`] (for the node's status object).
    pub services: BTreeMap<IpAddr, String>,
}

/// What `node` announces of `addresses` and `blocks`, each prefix with
/// `attrs` of its pool (none for a pool not there). `may`: whether the
/// node may serve LoadBalancer addresses at all, else why not (the L2
/// path's rule on its Node, `nodes::may_answer`; `Ok` without
/// Kubernetes).
#[must_use]
pub fn decide(
    node: &str,
    may: &Result<(), String>,
    addresses: &[LbAddress<'_>],
    blocks: &[PodBlock<'_>],
    attrs: &BTreeMap<String, RouteAttrs>,
) -> Decision {
    let of = |pool: &str| attrs.get(pool).cloned().unwrap_or_default();
    let mut d = Decision::default();
    let kept_out = may.as_ref().err();
    for a in addresses {
        let why = if let Some(why) = &kept_out {
            Some((*why).clone())
        } else if !a.admitted {
            Some(format!(
                "pool {}'s node selector does not admit this node",
                a.pool
            ))
        } else {
            a.local.and_then(|endpoints| {
                candidate(endpoints, node)
                    .err()
                    .map(|why| format!("externalTrafficPolicy is Local and {why}"))
            })
        };
        match why {
            Some(why) => {
                d.withheld.insert(a.address, why);
            }
            None => {
                d.routes.insert(IpNet::from(a.address), of(a.pool));
            }
        }
    }
    for b in blocks {
        d.blocks.insert(b.cidr.trunc(), of(b.pool));
    }
    d
}

/// In cluster mode, why a node withholds every LoadBalancer address while
/// its LB lease in etcd is not live: past the lease's term, another node
/// may act on its absence.
pub const LEASE_NOT_LIVE: &str = "this node's LB lease in etcd is not live (etcd unreachable, or the uplink down): the addresses may be another's";

/// Cluster mode without Kubernetes: what `node`, with `labels` (its
/// `[cluster] node_labels`), announces of the LoadBalancer addresses the
/// assigner stored (`pools`, `services`), for the pools `attrs` names.
/// There are no endpoints to follow, so every node whose labels the
/// address's pool selector admits announces it, and the routers spread
/// traffic over them (ECMP). `may`: whether the node may announce
/// LoadBalancer addresses at all (its LB lease in etcd is live), else
/// why not. Each address's pool is the one that holds it (a pool in
/// conflict holds none); [`Decision::services`] names each announced
/// address's Service.
#[must_use]
pub fn decide_stored(
    node: &str,
    may: &Result<(), String>,
    pools: &[PoolStatus],
    services: &BTreeMap<String, ServiceStatus>,
    labels: &BTreeMap<String, String>,
    attrs: &BTreeMap<String, RouteAttrs>,
) -> Decision {
    let pool_of = |address: IpAddr| {
        pools
            .iter()
            .filter(|p| p.conflict.is_none())
            .map(|p| &p.spec)
            .find(|p| p.holds(address) && attrs.contains_key(&p.name))
    };
    let mut of = BTreeMap::new();
    let mut addresses = Vec::new();
    for (id, status) in services {
        for &address in status.addresses() {
            if let Some(pool) = pool_of(address) {
                of.insert(address, id.clone());
                addresses.push(LbAddress {
                    address,
                    pool: &pool.name,
                    local: None,
                    admitted: pool.node_selector.is_empty() || pool.node_selector.matches(labels),
                });
            }
        }
    }
    let mut d = decide(node, may, &addresses, &[], attrs);
    d.services = of
        .into_iter()
        .filter(|(a, _)| d.routes.contains_key(&IpNet::from(*a)))
        .collect();
    d
}

/// The LoadBalancer addresses lockstep gave `svc`, as [`decide`] reads
/// them, for a node with `labels` (`None`: its Node not read yet): each
/// with the pool among `pools` that holds it, whether that pool's node
/// selector admits the node, and `endpoints` (the Service's) when its
/// `externalTrafficPolicy` is `Local`. Only the addresses of the pools
/// `announced` names: the others are not BGP's to announce. Nothing for a
/// Service that is not a LoadBalancer lockstep serves.
#[must_use]
pub fn service_addresses<'a>(
    svc: &KubeService,
    endpoints: &'a [Endpoint],
    pools: &'a [LbPoolSpec],
    labels: Option<&BTreeMap<String, String>>,
    announced: &BTreeMap<String, RouteAttrs>,
) -> Vec<LbAddress<'a>> {
    let Some(addresses) = lockstep_ingress(svc) else {
        return Vec::new();
    };
    let local = svc.external_traffic_policy.as_deref() == Some("Local");
    addresses
        .into_iter()
        .filter_map(|address| {
            let pool = pools
                .iter()
                .find(|p| p.holds(address) && announced.contains_key(&p.name))?;
            Some(LbAddress {
                address,
                pool: &pool.name,
                local: local.then_some(endpoints),
                admitted: pool.node_selector.is_empty()
                    || labels.is_some_and(|l| pool.node_selector.matches(l)),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use proptest::prelude::*;

    use super::*;
    use crate::lb::kubernetes::local::candidates;
    use crate::lb::kubernetes::nodes::{EXCLUDE_LABEL, NodeState, may_answer};

    const NODES: [&str; 3] = ["n0", "n1", "n2"];

    fn ep(node: &str, ready: bool, terminating: bool) -> Endpoint {
        Endpoint {
            node: Some(node.into()),
            ready: Some(ready),
            serving: Some(ready || terminating),
            terminating: Some(terminating),
        }
    }

    fn addr(endpoints: Option<&[Endpoint]>) -> LbAddress<'_> {
        LbAddress {
            address: "198.51.100.7".parse().unwrap(),
            pool: "public",
            local: endpoints,
            admitted: true,
        }
    }

    /// The nodes that announce `a`, each deciding for itself.
    fn announcing(a: LbAddress<'_>) -> BTreeSet<String> {
        NODES
            .iter()
            .filter(|n| {
                let d = decide(n, &Ok(()), &[a], &[], &BTreeMap::new());
                d.routes.contains_key(&IpNet::from(a.address))
            })
            .map(|n| (*n).to_string())
            .collect()
    }

    #[test]
    fn stored_addresses_from_every_node_the_pool_admits_and_only_bgp_pools() {
        use crate::lb::{LbIpam, LbPoolSpec, ServiceSpec};
        let mut lb = LbIpam::new();
        let mut zoned = LbPoolSpec::new("zoned").cidr("198.51.100.0/30");
        zoned
            .node_selector
            .match_labels
            .insert("zone".into(), "a".into());
        lb.apply_pool(zoned).unwrap();
        lb.apply_pool(LbPoolSpec::new("open").cidr("203.0.113.0/30"))
            .unwrap();
        lb.apply_pool(LbPoolSpec::new("l2only").cidr("192.0.2.0/30"))
            .unwrap();
        for name in ["a", "b", "c", "d", "e", "f"] {
            lb.apply_service(ServiceSpec::new("ns", name)).unwrap();
        }
        let pools: Vec<_> = lb.pools().collect();
        let services: BTreeMap<String, _> = lb
            .services()
            .map(|(id, st)| (id.to_string(), st.clone()))
            .collect();
        let attrs: BTreeMap<String, RouteAttrs> = [
            ("zoned".to_string(), RouteAttrs::default()),
            ("open".to_string(), RouteAttrs::default()),
        ]
        .into();
        let by_pool = lb.addresses();
        let of_pool = |pool: &str| -> BTreeSet<IpNet> {
            by_pool
                .iter()
                .filter(|(_, p)| *p == pool)
                .map(|(a, _)| IpNet::from(*a))
                .collect()
        };
        assert!(!of_pool("zoned").is_empty() && !of_pool("open").is_empty());
        assert!(!of_pool("l2only").is_empty());
        let zone = |z: &str| -> BTreeMap<String, String> { [("zone".into(), z.into())].into() };
        // In zone a: both BGP pools' addresses, never the L2-only pool's.
        let a = decide_stored("n0", &Ok(()), &pools, &services, &zone("a"), &attrs);
        let routes: BTreeSet<IpNet> = a.routes.keys().copied().collect();
        assert_eq!(
            routes,
            of_pool("zoned").union(&of_pool("open")).copied().collect()
        );
        assert!(a.withheld.is_empty());
        // Each announced address names its Service.
        for net in &routes {
            let id = &a.services[&net.addr()];
            assert!(services[id].addresses().contains(&net.addr()));
        }
        // In zone b: the zoned pool's addresses withheld, naming it.
        let b = decide_stored("n1", &Ok(()), &pools, &services, &zone("b"), &attrs);
        assert_eq!(
            b.routes.keys().copied().collect::<BTreeSet<_>>(),
            of_pool("open")
        );
        for net in of_pool("zoned") {
            assert!(b.withheld[&net.addr()].contains("pool zoned's node selector"));
        }
        // A node whose lease is not live announces none, and says why.
        let why = "this node's LB lease is not live".to_string();
        let off = decide_stored(
            "n0",
            &Err(why.clone()),
            &pools,
            &services,
            &zone("a"),
            &attrs,
        );
        assert!(off.routes.is_empty() && off.services.is_empty());
        assert_eq!(off.withheld.len(), routes.len());
        assert!(off.withheld.values().all(|w| *w == why));
    }

    #[test]
    fn cluster_addresses_from_every_node_that_may_serve_and_blocks_from_any() {
        let block = PodBlock {
            cidr: "10.64.0.0/26".parse().unwrap(),
            pool: "pods",
        };
        let attrs: BTreeMap<String, RouteAttrs> = [(
            "public".to_string(),
            RouteAttrs {
                communities: [(64512, 100)].into(),
                ..RouteAttrs::default()
            },
        )]
        .into();
        let d = decide("n0", &Ok(()), &[addr(None)], &[block], &attrs);
        assert_eq!(
            d.routes,
            [("198.51.100.7/32".parse().unwrap(), attrs["public"].clone())].into()
        );
        assert_eq!(
            d.blocks,
            [("10.64.0.0/26".parse().unwrap(), RouteAttrs::default())].into()
        );
        assert!(d.withheld.is_empty());
        // Excluded: the address is withheld, naming the label; the block
        // is still announced.
        let excluded = NodeState {
            labels: [(EXCLUDE_LABEL.to_string(), String::new())].into(),
            ..NodeState::default()
        };
        let d = decide(
            "n0",
            &may_answer(&excluded),
            &[addr(None)],
            &[block],
            &attrs,
        );
        assert!(d.routes.is_empty(), "{d:?}");
        assert_eq!(d.blocks.keys().collect::<Vec<_>>(), [&block.cidr]);
        assert!(
            d.withheld.values().all(|w| w.contains(EXCLUDE_LABEL)),
            "{d:?}"
        );
        // Not admitted by the pool's selector.
        let mut a = addr(None);
        a.admitted = false;
        let d = decide("n0", &Ok(()), &[a], &[], &attrs);
        assert!(d.routes.is_empty());
        assert!(
            d.withheld.values().all(|w| w.contains("node selector")),
            "{d:?}"
        );
    }

    #[test]
    fn local_addresses_from_the_nodes_with_an_endpoint_and_why_not_elsewhere() {
        let endpoints = [ep("n1", true, false)];
        assert_eq!(
            announcing(addr(Some(&endpoints))),
            ["n1".to_string()].into()
        );
        let d = decide(
            "n0",
            &Ok(()),
            &[addr(Some(&endpoints))],
            &[],
            &BTreeMap::new(),
        );
        assert_eq!(
            d.withheld.values().next().map(String::as_str),
            Some("externalTrafficPolicy is Local and no ready endpoint on this node")
        );
        assert_eq!(announcing(addr(None)).len(), NODES.len());
    }

    #[test]
    fn a_service_s_addresses_carry_their_pool_its_selector_and_local_endpoints() {
        use crate::lb::kubernetes::Condition;
        let mut public = LbPoolSpec::new("public");
        public.cidrs.push("198.51.100.0/24".parse().unwrap());
        let mut rack = LbPoolSpec::new("rack");
        rack.cidrs.push("203.0.113.0/24".parse().unwrap());
        rack.node_selector
            .match_labels
            .insert("rack".into(), "r1".into());
        let mut quiet = LbPoolSpec::new("quiet");
        quiet.cidrs.push("192.0.2.0/24".parse().unwrap());
        let pools = [public, rack, quiet];
        let announced: BTreeMap<String, RouteAttrs> = ["public", "rack"]
            .iter()
            .map(|p| ((*p).to_string(), RouteAttrs::default()))
            .collect();
        let mut svc = KubeService {
            namespace: "shop".into(),
            name: "web".into(),
            type_: Some("LoadBalancer".into()),
            external_traffic_policy: Some("Local".into()),
            ingress: vec![
                "198.51.100.7".into(),
                "203.0.113.9".into(),
                "192.0.2.5".into(),
            ],
            condition: Some(Condition {
                type_: "lockstep.io/Assigned".into(),
                status: "True".into(),
                reason: "Assigned".into(),
                message: String::new(),
            }),
            ..KubeService::default()
        };
        let endpoints = [ep("n1", true, false)];
        let r1: BTreeMap<String, String> = [("rack".to_string(), "r1".to_string())].into();
        let got = service_addresses(&svc, &endpoints, &pools, Some(&r1), &announced);
        let seen: Vec<(IpAddr, &str, bool, bool)> = got
            .iter()
            .map(|a| (a.address, a.pool, a.admitted, a.local.is_some()))
            .collect();
        // The quiet pool is not BGP's: its address is left out.
        assert_eq!(
            seen,
            [
                ("198.51.100.7".parse().unwrap(), "public", true, true),
                ("203.0.113.9".parse().unwrap(), "rack", true, true),
            ]
        );
        // Labels not read yet, or another rack: the selector pool's
        // address is not admitted; the other still is.
        for labels in [None, Some(&BTreeMap::new())] {
            let got = service_addresses(&svc, &endpoints, &pools, labels, &announced);
            let admitted: Vec<bool> = got.iter().map(|a| a.admitted).collect();
            assert_eq!(admitted, [true, false]);
        }
        // Cluster policy: no endpoints read.
        svc.external_traffic_policy = Some("Cluster".into());
        let got = service_addresses(&svc, &endpoints, &pools, Some(&r1), &announced);
        assert!(got.iter().all(|a| a.local.is_none()), "{got:?}");
        // Not lockstep's ingress (its condition not True), or not a
        // LoadBalancer: nothing.
        let mut theirs = svc.clone();
        theirs.condition = None;
        assert!(service_addresses(&theirs, &endpoints, &pools, None, &announced).is_empty());
        svc.type_ = Some("ClusterIP".into());
        assert!(service_addresses(&svc, &endpoints, &pools, None, &announced).is_empty());
    }

    fn endpoint() -> impl Strategy<Value = Endpoint> {
        (0..NODES.len(), any::<bool>(), any::<bool>()).prop_map(|(n, r, t)| ep(NODES[n], r, t))
    }

    proptest! {
        /// Under `Local`, the nodes that announce are the L2 path's
        /// candidates, exactly.
        #[test]
        fn local_announcers_are_the_candidates(
            endpoints in proptest::collection::vec(endpoint(), 0..6),
        ) {
            prop_assert_eq!(announcing(addr(Some(&endpoints))), candidates(&endpoints));
        }

        /// A rolling update, one pod at a time: with a surge of one, a
        /// new pod on a random node becomes ready before an old one
        /// terminates (serving through its grace period) and goes; with
        /// none (`maxSurge: 0`), the old one terminates first. At every
        /// step some node announces the address, and every node that
        /// announces has a pod that serves.
        #[test]
        fn a_rolling_update_never_leaves_the_address_unannounced(
            start in proptest::collection::vec(0..NODES.len(), 1..4),
            moves in proptest::collection::vec(0..NODES.len(), 1..8),
            surge in any::<bool>(),
        ) {
            let mut pods: Vec<Endpoint> = start.iter().map(|&n| ep(NODES[n], true, false)).collect();
            let check = |pods: &[Endpoint]| -> Result<(), TestCaseError> {
                let by = announcing(addr(Some(pods)));
                prop_assert!(!by.is_empty(), "no node announces with {:?}", pods);
                for n in &by {
                    prop_assert!(pods.iter().any(|p| p.node.as_deref() == Some(n.as_str()) && p.serving == Some(true)));
                }
                Ok(())
            };
            for &to in &moves {
                let old = pods[0].node.clone().unwrap_or_default();
                if !surge {
                    pods[0] = ep(&old, false, true);
                    check(&pods)?;
                }
                pods.push(ep(NODES[to], false, false));
                check(&pods)?;
                let last = pods.len() - 1;
                pods[last] = ep(NODES[to], true, false);
                check(&pods)?;
                if surge {
                    pods[0] = ep(&old, false, true);
                    check(&pods)?;
                }
                pods.remove(0);
                check(&pods)?;
            }
        }
    }
}
