//! The ClusterRole's rules per mode: the verbs the agent's Kubernetes door
//! sends in that mode and nothing more. `deploy/rbac.yaml` is the role of
//! every feature together (NodeIPAM included), against which the
//! end-to-end tests check every request the agents send; each mode's rules
//! here are a subset of it (a unit test checks).

use super::Mode;

/// One rule of the ClusterRole.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rule {
    /// The API group (`""`: the core group).
    pub group: &'static str,
    /// The resources.
    pub resources: &'static [&'static str],
    /// The verbs.
    pub verbs: &'static [&'static str],
    /// Why the agent needs them.
    pub why: &'static str,
}

const COMMON: &[Rule] = &[
    Rule {
        group: "",
        resources: &["services"],
        verbs: &["list", "watch"],
        why: "the Services reflector; lockstep never changes a Service's spec",
    },
    Rule {
        group: "",
        resources: &["services/status"],
        verbs: &["patch"],
        why: "status.loadBalancer.ingress and lockstep's condition",
    },
    Rule {
        group: "",
        resources: &["nodes"],
        verbs: &["get", "list", "watch"],
        why: "this node's labels and InternalIPs; in cluster mode the Nodes reflector",
    },
    Rule {
        group: "lockstep.io",
        resources: &["loadbalancerippools"],
        verbs: &["list", "watch", "patch"],
        why: "the pools reflector and the finalizer of a deleted pool",
    },
    Rule {
        group: "lockstep.io",
        resources: &["loadbalancerippools/status"],
        verbs: &["patch"],
        why: "the pools' conditions and counts",
    },
    Rule {
        group: "",
        resources: &["pods"],
        verbs: &["get", "list", "watch"],
        why: "this node's pods: their pool annotation, and whether a pod is gone before its address is called leaked",
    },
    Rule {
        group: "",
        resources: &["namespaces"],
        verbs: &["list", "watch"],
        why: "the pool annotation of pods that have none",
    },
    Rule {
        group: "events.k8s.io",
        resources: &["events"],
        verbs: &["create", "patch"],
        why: "Events on Services and pools, and their repeat counts",
    },
];

/// Without etcd (modes lb and podcidr): what the elections need beyond
/// the Lease (the Role's).
const ELECTED: &[Rule] = &[Rule {
    group: "discovery.k8s.io",
    resources: &["endpointslices"],
    verbs: &["list", "watch"],
    why: "which nodes have ready endpoints of externalTrafficPolicy: Local Services (they alone answer for them)",
}];

const CLUSTER: &[Rule] = &[
    Rule {
        group: "lockstep.io",
        resources: &["podippools"],
        verbs: &["list", "watch"],
        why: "the PodIPPools the elected writer applies as cluster pools",
    },
    Rule {
        group: "lockstep.io",
        resources: &["podippools/status"],
        verbs: &["patch"],
        why: "the PodIPPools' Accepted condition and counts",
    },
];

/// Mode multi-pool: the NodeIPAM objects (each node's own, and every one
/// for the writer as operator) and the PodIPPools the writer hands out.
const MULTI_POOL: &[Rule] = &[
    Rule {
        group: "lockstep.io",
        resources: &["podippools"],
        verbs: &["list", "watch"],
        why: "the PodIPPools the elected writer hands out",
    },
    Rule {
        group: "lockstep.io",
        resources: &["nodeipams"],
        verbs: &["list", "watch", "create", "patch"],
        why: "this node's NodeIPAM object (made when missing; its spec is the node's demand); the writer lists every one",
    },
    Rule {
        group: "lockstep.io",
        resources: &["nodeipams/status"],
        verbs: &["patch"],
        why: "the node's Accepted and Draining conditions; the writer's offers",
    },
];

/// With BGP (`--bgp-asn`): the routers as objects (only read), and each
/// node's own BGPNodeState.
const BGP: &[Rule] = &[
    Rule {
        group: "lockstep.io",
        resources: &["bgppeers"],
        verbs: &["list", "watch"],
        why: "the BGPPeer objects: which routers this node peers with",
    },
    Rule {
        group: "lockstep.io",
        resources: &["bgpnodestates"],
        verbs: &["create"],
        why: "this node's BGPNodeState, made when missing",
    },
    Rule {
        group: "lockstep.io",
        resources: &["bgpnodestates/status"],
        verbs: &["patch"],
        why: "this node's BGP sessions, the Services it announces, its pod blocks",
    },
];

/// In cluster mode with BGP: what deciding who announces an
/// `externalTrafficPolicy: Local` Service needs beyond the mode's rules
/// (without etcd, the elections already have it).
const BGP_CLUSTER: &[Rule] = &[Rule {
    group: "discovery.k8s.io",
    resources: &["endpointslices"],
    verbs: &["list", "watch"],
    why: "which nodes have ready endpoints of externalTrafficPolicy: Local Services (they alone announce them over BGP)",
}];

/// The rules BGP (`--bgp-asn`) adds to `mode`'s ClusterRole.
pub fn bgp_rules(mode: Mode) -> Vec<Rule> {
    let extra = match mode {
        Mode::Cluster => BGP_CLUSTER,
        _ => &[],
    };
    BGP.iter().chain(extra).copied().collect()
}

/// The rules of `mode`'s Role in the agent's own namespace: the Lease
/// electing the one LB writer, and each externalTrafficPolicy: Local
/// Service's announcer, when there is no etcd (modes lb and podcidr). Cluster mode elects its writer in etcd.
pub fn namespaced_rules(mode: Mode) -> Vec<Rule> {
    match mode {
        Mode::Lb | Mode::PodCidr | Mode::MultiPool => vec![Rule {
            group: "coordination.k8s.io",
            resources: &["leases"],
            verbs: &["get", "create", "update"],
            why: "the Leases electing the one agent that writes LoadBalancer state ([kubernetes.election]) and the node answering for each externalTrafficPolicy: Local Service",
        }],
        Mode::Local | Mode::Cluster => Vec::new(),
    }
}

/// The rules of `mode`'s ClusterRole (none: the mode never calls the API).
pub fn rules(mode: Mode) -> Vec<Rule> {
    match mode {
        Mode::Local => Vec::new(),
        Mode::Lb | Mode::PodCidr => COMMON.iter().chain(ELECTED).copied().collect(),
        Mode::Cluster => COMMON.iter().chain(CLUSTER).copied().collect(),
        Mode::MultiPool => COMMON
            .iter()
            .chain(ELECTED)
            .chain(MULTI_POOL)
            .copied()
            .collect(),
    }
}
