//! `NodeIPAM` (`lockstep.io/v1alpha1`, cluster-scoped, one per node, named
//! as the Node): the CIDRs an external operator gives a node, and the
//! demand the node writes back. The Rust types are the definition; the CRD
//! in `deploy/crds/` is generated from them (`cargo run -p lockstep
//! --example crdgen`) and a test keeps the committed file equal.
//!
//! Who writes what: the **status** `pools` is the operator's (the CIDRs
//! this node may use, per pool); the status `conditions` and the whole
//! **spec** are the agent's (per pool: `requested`, the demand settings
//! that let the operator read usage from it, and the CIDRs the node still
//! holds — one the operator withdrew stays listed while it drains and goes
//! once released).

use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::kubernetes::crd::PoolCondition;

/// This node's NodeIPAM pools and what it asks of them.
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "lockstep.io",
    version = "v1alpha1",
    kind = "NodeIPAM",
    plural = "nodeipams",
    shortname = "nipam",
    status = "NodeIPAMStatus",
    printcolumn = r#"{"name":"Accepted","type":"string","jsonPath":".status.conditions[?(@.type==\"Accepted\")].status"}"#,
    printcolumn = r#"{"name":"Draining","type":"string","jsonPath":".status.conditions[?(@.type==\"Draining\")].status"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct NodeIPAMSpec {
    /// Per pool, written by the agent.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pools: Vec<PoolDemand>,
}

/// What the node asks of one pool (written by the agent).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PoolDemand {
    /// The pool.
    pub name: String,
    /// Addresses the node wants to hold. `linear`: in use +
    /// `preAllocate`; `ceil`: that rounded up to whole `blockSize` blocks.
    pub requested: u64,
    /// `linear` or `ceil`.
    pub demand: String,
    /// Addresses per block (`ceil` only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_size: Option<u64>,
    /// Free addresses counted in `requested` beyond those in use.
    pub pre_allocate: u64,
    /// The CIDRs the node holds: those offered, and those withdrawn that
    /// still hold addresses (draining). A CIDR not listed is not used.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "crate::kubernetes::crd::cidr_list")]
    pub cidrs: Vec<String>,
}

/// The operator's offer, and the agent's conditions.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodeIPAMStatus {
    /// Per pool, written by the operator: the CIDRs this node may use.
    /// Absent: the operator has said nothing yet (the node keeps what it
    /// holds); present and empty: nothing (everything held drains).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pools: Option<Vec<PoolOffer>>,
    /// Written by the agent: `Accepted` (the offer is used, or why not:
    /// every bad CIDR named) and `Draining` (withdrawn CIDRs still in use).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<PoolCondition>,
}

/// The CIDRs one pool may use (written by the operator).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PoolOffer {
    /// The pool (as the node's `[kubernetes.nodeipam]` names it).
    pub name: String,
    /// IPv4 CIDRs (`10.0.0.16/28`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "crate::kubernetes::crd::cidr_list")]
    pub ipv4: Vec<String>,
    /// IPv6 CIDRs (`2001:db8::/80`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "crate::kubernetes::crd::cidr_list")]
    pub ipv6: Vec<String>,
}

/// The CRD as YAML, as `deploy/crds/` holds it.
///
/// # Errors
/// The CRD does not serialise (never with these types).
pub fn crd_yaml() -> Result<String, String> {
    crate::kubernetes::crd::crd_yaml_of::<NodeIPAM>("agent/daemon/src/kubernetes/nodeipam/crd.rs")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_committed_crd_is_the_one_the_types_derive() {
        crate::kubernetes::crd::assert_committed("nodeipams.lockstep.io.yaml", crd_yaml());
    }

    #[test]
    fn an_object_reads_and_a_newer_operators_field_is_read_past() {
        let o: NodeIPAM = serde_json::from_value(serde_json::json!({
            "apiVersion": "lockstep.io/v1alpha1", "kind": "NodeIPAM",
            "metadata": {"name": "node-1"},
            "spec": {"pools": [{"name": "eni", "requested": 18, "demand": "linear",
                                "preAllocate": 2, "cidrs": ["10.9.0.0/28"]}]},
            "status": {"pools": [{"name": "eni", "ipv4": ["10.9.0.0/28", "10.9.0.16/28"]}]}
        }))
        .unwrap();
        assert_eq!(o.spec.pools[0].requested, 18);
        assert_eq!(o.status.unwrap().pools.unwrap()[0].ipv4.len(), 2);
        // A field a newer CRD added (the API server's schema refuses a
        // misspelt one before it reaches the agent) does not stall the read.
        let newer = serde_json::from_value::<NodeIPAMStatus>(serde_json::json!(
            {"pools": [{"name": "eni", "ipv4": ["10.9.0.0/28"], "subnetId": "subnet-1"}]}
        ))
        .expect("tolerated");
        assert_eq!(newer.pools.unwrap()[0].ipv4, vec!["10.9.0.0/28"]);
    }
}
