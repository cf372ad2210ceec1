//! The Kubernetes LoadBalancer lab (#28): the LB lab of `lb_lab` (three
//! node namespaces on a bridge, a neighbour, a real 3-member etcd, agents
//! in cluster mode) with the Kubernetes API double on the test's loopback,
//! forwarded into each node namespace, a Node object per node and
//! `[kubernetes]` in every agent's config. Shared by `kubernetes_e2e` and
//! the `lb` bench.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::time::Duration;

use anyhow::Context;
use serde_json::{Value, json};

use crate::cluster::{forward_ports, node_ip};
use crate::etcd::EtcdCluster;
use crate::kubeapi::ApiDouble;
use crate::lb_lab::Lab;

/// The lab's L2 pool, as a `LoadBalancerIPPool` spec.
pub fn pool_spec() -> Value {
    json!({"cidrs": ["10.251.0.128/25", "fd00:251::100/120"], "announce": "l2"})
}

/// The double, the lab, and the kubeconfig's directory.
pub struct KubeLab {
    /// The LB lab (agents stop first: declared first).
    pub lab: Lab,
    /// The API double.
    pub api: ApiDouble,
    _dir: crate::TempDir,
}

/// A `type: LoadBalancer` Service `ns/name` with one TCP port, labels and
/// annotations.
pub fn lb_service(ns: &str, name: &str, port: u16, labels: Value, annotations: Value) -> Value {
    json!({
        "metadata": {"namespace": ns, "name": name, "labels": labels, "annotations": annotations},
        "spec": {"type": "LoadBalancer", "ports": [{"port": port, "protocol": "TCP"}]},
    })
}

impl KubeLab {
    /// Three nodes whose Node objects carry `node_labels[i]` (and the
    /// node's underlay address as InternalIP); no labels in the configs.
    pub fn build(
        cluster: &EtcdCluster,
        prefix: &str,
        node_labels: [Value; 3],
    ) -> anyhow::Result<Self> {
        let api = ApiDouble::start()?;
        for (i, labels) in node_labels.iter().enumerate() {
            api.create(
                "nodes",
                "",
                &json!({
                    "metadata": {"name": format!("node-{i}"), "labels": labels},
                    "status": {"addresses": [{"type": "InternalIP", "address": node_ip(i)}]},
                }),
            )?;
            // Status is the kubelet's to write, through the subresource.
            api.patch(
                "nodes",
                "",
                &format!("node-{i}"),
                &json!({"status": {"addresses": [
                    {"type": "InternalIP", "address": node_ip(i)},
                    {"type": "Hostname", "address": format!("node-{i}")},
                ]}}),
                true,
            )?;
        }
        let dir = crate::TempDir::new("kube")?;
        let kubeconfig = dir.path().join("kubeconfig");
        api.write_kubeconfig(&kubeconfig)?;
        let port = api.addr().port();
        let path = kubeconfig.display().to_string();
        let lab = Lab::build_extra(cluster, prefix, None, ["", "", ""], [true; 3], &|_, ns| {
            forward_ports(ns, &[port])?;
            Ok(format!("[kubernetes]\nkubeconfig = \"{path}\"\n"))
        })?;
        Ok(Self {
            lab,
            api,
            _dir: dir,
        })
    }

    /// Creates pool `name` with `spec`.
    pub fn pool(&self, name: &str, spec: Value) -> anyhow::Result<Value> {
        self.api.create(
            "loadbalancerippools",
            "",
            &json!({"metadata": {"name": name}, "spec": spec}),
        )
    }

    /// Every Service's `status.loadBalancer.ingress` addresses, by
    /// `namespace/name` (those without: empty).
    pub fn ingress(&self) -> BTreeMap<String, Vec<IpAddr>> {
        self.api
            .list("services")
            .iter()
            .map(|s| (id(s), ingress_of(s)))
            .collect()
    }

    /// Lockstep's condition on `ns/name`: (status, reason, message).
    pub fn condition(&self, ns: &str, name: &str) -> Option<(String, String, String)> {
        let s = self.api.get("services", ns, name).ok()?;
        condition_of(&s)
    }

    /// Waits until every Service of `ids` has `per` addresses in its
    /// status; returns them all.
    pub fn wait_assigned(
        &self,
        ids: &BTreeSet<String>,
        per: usize,
        within: Duration,
    ) -> anyhow::Result<BTreeMap<String, Vec<IpAddr>>> {
        crate::wait_for(
            &format!("{} services with addresses", ids.len()),
            within,
            || {
                let all = self.ingress();
                ids.iter()
                    .all(|id| all.get(id).is_some_and(|a| a.len() == per))
                    .then(|| all.into_iter().filter(|(id, _)| ids.contains(id)).collect())
            },
        )
        .with_context(|| format!("statuses: {:?}", self.ingress()))
    }

    /// Events about `ns/name` with `reason`.
    pub fn events(&self, ns: &str, name: &str, reason: &str) -> Vec<Value> {
        self.api
            .list("events")
            .into_iter()
            .filter(|e| {
                e["regarding"]["namespace"] == ns
                    && e["regarding"]["name"] == name
                    && e["reason"] == reason
            })
            .collect()
    }
}

/// `namespace/name` of an object.
pub fn id(v: &Value) -> String {
    format!(
        "{}/{}",
        v["metadata"]["namespace"].as_str().unwrap_or(""),
        v["metadata"]["name"].as_str().unwrap_or("")
    )
}

/// A Service's ingress addresses.
pub fn ingress_of(s: &Value) -> Vec<IpAddr> {
    s["status"]["loadBalancer"]["ingress"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|i| i["ip"].as_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// Lockstep's condition on a Service: (status, reason, message).
pub fn condition_of(s: &Value) -> Option<(String, String, String)> {
    s["status"]["conditions"].as_array()?.iter().find_map(|c| {
        (c["type"] == "lockstep.io/AddressAssigned").then(|| {
            (
                c["status"].as_str().unwrap_or("").to_string(),
                c["reason"].as_str().unwrap_or("").to_string(),
                c["message"].as_str().unwrap_or("").to_string(),
            )
        })
    })
}
