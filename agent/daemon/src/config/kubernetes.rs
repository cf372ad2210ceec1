//! `[kubernetes]`: where the Kubernetes API is and which LoadBalancer class
//! lockstep serves (docs/kubernetes.md). Absent: lockstep never calls the
//! API, as before.

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// `[kubernetes]`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct KubernetesConfig {
    /// A kubeconfig file to reach the API with (its current context).
    /// Absent: the pod's service account (in-cluster: the token, CA and
    /// `KUBERNETES_SERVICE_HOST`/`_PORT` Kubernetes mounts and sets).
    pub kubeconfig: Option<PathBuf>,
    /// The `spec.loadBalancerClass` lockstep serves; Services of any other
    /// class never.
    pub lb_class: String,
    /// Services without a `spec.loadBalancerClass` are served too (as
    /// MetalLB and Cilium do by default). Set false where another
    /// implementation (a cloud provider's) serves them. Either way, a
    /// class-less Service whose status already holds an address outside
    /// lockstep's pools is left to whoever set it.
    pub serve_classless: bool,
    /// The Node object of this agent (default: `[cluster] node_name`, else
    /// the top-level `node_name`, else `NODE_NAME`, else the host name
    /// lowercased).
    pub node_name: Option<String>,
    /// How long start-up waits for the API to give this node's Node (its
    /// labels and InternalIPs) before going on with the config's values.
    #[schemars(with = "crate::config::reference::HumanDuration")]
    #[serde(with = "humantime_serde")]
    pub node_wait: Duration,
    /// `[kubernetes.pods]`: pools by annotation and leaks.
    pub pods: super::pods::PodsConfig,
    /// `[kubernetes.nodeipam]`: this node's CIDRs come from its NodeIPAM
    /// object (docs/kubernetes.md); absent: no NodeIPAM object is read or written.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nodeipam: Option<super::nodeipam::NodeIpamConfig>,
    /// The cluster's endpoint pools come from `PodIPPool` objects: the
    /// elected writer applies them through etcd as `lockstep
    /// cluster pools apply` would, and the CLI then refuses. Needs
    /// `[cluster]`.
    pub pod_pools: bool,
    /// The name of an endpoint pool made of this Node's `spec.podCIDRs`
    /// (set by the controller-manager's `--allocate-node-cidrs`, kubeadm,
    /// kind, k3s): pod IPAM with no etcd and no per-node config. Read at
    /// start and followed while the agent runs (a Node made again with
    /// other CIDRs, or given a second family's: what it no longer lists
    /// drains), and recorded in the state directory, so a restart while the
    /// API is away serves the same CIDRs. The default pool of endpoints
    /// that name none, unless `default_pool` says otherwise. Not with
    /// `[cluster]` or NodeIPAM.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pod_cidr_pool: Option<String>,
    /// In cluster mode, a Node deleted from the API is removed from etcd
    /// by the rule of `lockstep cluster node remove` without `--force`, and
    /// the addresses reserved for it are released once the API binds no
    /// pod to it.
    pub remove_deleted_nodes: bool,
    /// `[kubernetes.election]`: without `[cluster]`, the Lease electing the
    /// one agent that writes LoadBalancer state and answers for its
    /// addresses.
    pub election: super::election::ElectionConfig,
}

impl Default for KubernetesConfig {
    fn default() -> Self {
        Self {
            kubeconfig: None,
            lb_class: lockstep_core::lb::kubernetes::DEFAULT_CLASS.into(),
            serve_classless: true,
            node_name: None,
            node_wait: Duration::from_secs(10),
            pods: super::pods::PodsConfig::default(),
            nodeipam: None,
            pod_pools: false,
            pod_cidr_pool: None,
            remove_deleted_nodes: true,
            election: super::election::ElectionConfig::default(),
        }
    }
}

impl KubernetesConfig {
    /// Checks the section: (field, reason) of the first bad value.
    ///
    /// # Errors
    /// An empty class, an empty node name, or a wait beyond 10 minutes.
    pub fn validate(&self) -> Result<(), (String, String)> {
        if self.lb_class.is_empty() {
            return Err(("kubernetes.lb_class".into(), "is empty".into()));
        }
        if self.node_name.as_deref() == Some("") {
            return Err(("kubernetes.node_name".into(), "is empty".into()));
        }
        if self.pod_cidr_pool.as_deref() == Some("") {
            return Err(("kubernetes.pod_cidr_pool".into(), "is empty".into()));
        }
        if self.pod_cidr_pool.is_some() && self.nodeipam.is_some() {
            return Err((
                "kubernetes.pod_cidr_pool".into(),
                "the node's CIDRs come from either its podCIDRs or its NodeIPAM object, not both"
                    .into(),
            ));
        }
        if self.node_wait > Duration::from_secs(600) {
            return Err(("kubernetes.node_wait".into(), "must be at most 10m".into()));
        }
        self.election.validate()?;
        self.pods.validate()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_to_the_service_account_and_lockstep_class() {
        let c: KubernetesConfig = toml::from_str("").unwrap();
        assert_eq!(c.kubeconfig, None);
        assert_eq!(c.lb_class, "lockstep.io/lb");
        assert!(c.validate().is_ok());
        let e = toml::from_str::<KubernetesConfig>("lb_class = \"\"")
            .unwrap()
            .validate()
            .unwrap_err();
        assert_eq!(e.0, "kubernetes.lb_class");
        assert!(toml::from_str::<KubernetesConfig>("kube_config = \"/x\"").is_err());
    }
}
