//! `LoadBalancerIPPool` (`lockstep.io/v1alpha1`, cluster-scoped): LB pools
//! as Kubernetes objects. The Rust types are the definition; the CRD in
//! `deploy/crds/` is generated from them (`cargo run -p lockstep --example
//! crdgen`) and a test keeps the committed file equal to what they derive.
//!
//! The spec says what `lockstep lb apply` says of a pool, in the API's
//! camelCase; it is read into the same [`LbPoolSpec`](lockstep_core::lb::LbPoolSpec) and checked by the
//! same validation (`lockstep_core::lb::kubernetes::pool_spec`).

use std::collections::BTreeMap;

use kube::CustomResource;
use lockstep_core::lb::kubernetes::KubePool;
use lockstep_core::lb::{LabelRequirement, LabelSelector, SelectorOperator};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The finalizer lockstep puts on a pool it has applied: the pool is
/// removed from the LB state before the object goes, even when it is
/// deleted while no agent runs.
pub const POOL_FINALIZER: &str = "lockstep.io/lb-pool";

/// A pool of LoadBalancer addresses.
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "lockstep.io",
    version = "v1alpha1",
    kind = "LoadBalancerIPPool",
    plural = "loadbalancerippools",
    shortname = "lbpool",
    status = "LoadBalancerIPPoolStatus",
    printcolumn = r#"{"name":"Total","type":"string","jsonPath":".status.total"}"#,
    printcolumn = r#"{"name":"Used","type":"string","jsonPath":".status.used"}"#,
    printcolumn = r#"{"name":"Available","type":"string","jsonPath":".status.available"}"#,
    printcolumn = r#"{"name":"Conflict","type":"string","jsonPath":".status.conditions[?(@.type==\"Conflict\")].status"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct LoadBalancerIPPoolSpec {
    /// CIDR blocks, IPv4 and IPv6 (`192.0.2.0/24`, `2001:db8::/120`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "cidr_list")]
    pub cidrs: Vec<String>,
    /// Inclusive start–stop ranges, every address usable.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ranges: Vec<AddressRange>,
    /// Hand out the first and last address of each CIDR block too.
    #[serde(default, rename = "allowFirstLastIPs")]
    pub allow_first_last_ips: bool,
    /// Keep the pool but hand nothing out; its services move elsewhere.
    #[serde(default)]
    pub disabled: bool,
    /// Which Services the pool serves (their labels); absent: every one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_selector: Option<Selector>,
    /// Which Nodes may announce its addresses (their labels); absent:
    /// every node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_selector: Option<Selector>,
    /// How its addresses are made reachable: `l2` answers ARP (IPv4) and
    /// NDP (IPv6) from one node per address; absent: routed by other means.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub announce: Option<AnnounceMode>,
    /// Fields this version does not know (a newer CRD added them): kept
    /// out of the decision and logged once (`super::unknown`), never
    /// written back.
    #[serde(flatten, skip_serializing)]
    #[schemars(skip)]
    pub unknown: BTreeMap<String, serde_json::Value>,
}

/// An inclusive address range.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct AddressRange {
    /// First address.
    #[schemars(schema_with = "ip_string")]
    pub start: String,
    /// Last address (inclusive).
    #[schemars(schema_with = "ip_string")]
    pub stop: String,
}

/// How a pool's addresses are announced.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum AnnounceMode {
    /// ARP and NDP answers from one node per address.
    #[serde(rename = "l2")]
    L2,
}

/// A Kubernetes label selector.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Selector {
    /// Labels that must have exactly these values.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub match_labels: BTreeMap<String, String>,
    /// Further requirements, all of which must hold.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub match_expressions: Vec<Requirement>,
}

/// One `matchExpressions` entry.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Requirement {
    /// The label key.
    pub key: String,
    /// `In`, `NotIn`, `Exists` or `DoesNotExist`.
    pub operator: Operator,
    /// The values of `In` and `NotIn`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub values: Vec<String>,
}

/// A selector operator.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum Operator {
    /// The label has one of the values.
    In,
    /// The label is absent or has none of the values.
    NotIn,
    /// The label is present.
    Exists,
    /// The label is absent.
    DoesNotExist,
}

/// What lockstep reports on a pool.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct LoadBalancerIPPoolStatus {
    /// `Accepted` (the definition is valid) and `Conflict` (it overlaps a
    /// pool applied earlier, named in the message, and assigns nothing new).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<PoolCondition>,
    /// Addresses the pool hands out (decimal: IPv6 counts exceed 64 bits).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub total: Option<String>,
    /// Addresses assigned.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub used: Option<String>,
    /// Addresses free for new services.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub available: Option<String>,
}

/// A condition, as `metav1.Condition` has it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PoolCondition {
    /// `Accepted` or `Conflict`.
    #[serde(rename = "type")]
    pub type_: String,
    /// `True`, `False` or `Unknown`.
    pub status: String,
    /// CamelCase reason.
    pub reason: String,
    /// For humans.
    pub message: String,
    /// RFC 3339 time of the last change of `status`.
    pub last_transition_time: String,
    /// The `metadata.generation` it describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

impl From<&Selector> for LabelSelector {
    fn from(s: &Selector) -> LabelSelector {
        LabelSelector {
            match_labels: s.match_labels.clone(),
            match_expressions: s
                .match_expressions
                .iter()
                .map(|r| LabelRequirement {
                    key: r.key.clone(),
                    operator: match r.operator {
                        Operator::In => SelectorOperator::In,
                        Operator::NotIn => SelectorOperator::NotIn,
                        Operator::Exists => SelectorOperator::Exists,
                        Operator::DoesNotExist => SelectorOperator::DoesNotExist,
                    },
                    values: r.values.clone(),
                })
                .collect(),
        }
    }
}

impl LoadBalancerIPPool {
    /// The pool as the core reads it.
    pub fn to_core(&self) -> KubePool {
        let s = &self.spec;
        KubePool {
            name: self.metadata.name.clone().unwrap_or_default(),
            cidrs: s.cidrs.clone(),
            ranges: s
                .ranges
                .iter()
                .map(|r| (r.start.clone(), r.stop.clone()))
                .collect(),
            allow_first_last: s.allow_first_last_ips,
            disabled: s.disabled,
            service_selector: s
                .service_selector
                .as_ref()
                .map(Into::into)
                .unwrap_or_default(),
            node_selector: s.node_selector.as_ref().map(Into::into).unwrap_or_default(),
            announce: s.announce.map(|_| "l2".to_string()),
        }
    }
}

/// The shape of a CIDR (`192.0.2.0/24`, `2001:db8::/120`) the CRDs'
/// schemas hold CIDR fields to, before their CEL rule ([`CIDR_RULE`]) runs:
/// a cheap first refusal with the API server's pattern message.
pub const CIDR_PATTERN: &str =
    r"^([0-9]{1,3}(\.[0-9]{1,3}){3}/[0-9]{1,2}|[0-9a-fA-F:.]*:[0-9a-fA-F:.]*/[0-9]{1,3})$";
/// The shape of an address, as [`CIDR_PATTERN`] of a CIDR.
pub const IP_PATTERN: &str = r"^([0-9]{1,3}(\.[0-9]{1,3}){3}|[0-9a-fA-F:.]*:[0-9a-fA-F:.]*)$";

/// The CEL rule on every CIDR field (Kubernetes' IP and CIDR library,
/// 1.31 and later): a CIDR, in network form (no host bits set), so
/// `kubectl apply` refuses `10.0.0.300/24` or `10.0.0.1/24` before any
/// agent reads it.
pub const CIDR_RULE: &str = "isCIDR(self) && cidr(self) == cidr(self).masked()";
/// Its message.
pub const CIDR_MESSAGE: &str = "must be a CIDR in network form, an address and its prefix length with no host bits set (10.0.0.0/24, fd00::/64)";
/// The CEL rule on every address field.
pub const IP_RULE: &str = "isIP(self)";
/// Its message.
pub const IP_MESSAGE: &str = "must be an IPv4 or IPv6 address (192.0.2.1, 2001:db8::1)";
/// The longest CIDR or address text accepted (an IPv6 CIDR written in
/// full is 43 characters): bounds the rules' cost, as the API server
/// requires of CEL rules.
pub const MAX_ADDRESS_LEN: u64 = 64;
/// The most CIDRs one list holds (bounds the rules' cost too).
pub const MAX_CIDRS: u64 = 1024;

/// The schema of a list of CIDRs: shape, length and the CEL rule per
/// entry (`#[schemars(schema_with = "cidr_list")]`).
pub fn cidr_list(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "type": "array",
        "maxItems": MAX_CIDRS,
        "items": {
            "type": "string",
            "pattern": CIDR_PATTERN,
            "maxLength": MAX_ADDRESS_LEN,
            "x-kubernetes-validations": [{"rule": CIDR_RULE, "message": CIDR_MESSAGE}],
        },
    })
}

/// The schema of one address: shape, length and the CEL rule.
pub fn ip_string(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "type": "string",
        "pattern": IP_PATTERN,
        "maxLength": MAX_ADDRESS_LEN,
        "x-kubernetes-validations": [{"rule": IP_RULE, "message": IP_MESSAGE}],
    })
}

/// The CRD as YAML, as `deploy/crds/` holds it.
///
/// # Errors
/// The CRD does not serialise (never with these types).
pub fn crd_yaml() -> Result<String, String> {
    crd_yaml_of::<LoadBalancerIPPool>("agent/daemon/src/kubernetes/crd.rs")
}

/// `K`'s CRD as YAML, headed by a comment naming `source`, the file its
/// types are in (every CRD in `deploy/crds/` is written so).
///
/// # Errors
/// The CRD does not serialise.
pub fn crd_yaml_of<K: kube::CustomResourceExt>(source: &str) -> Result<String, String> {
    let body = serde_saphyr::to_string(&K::crd()).map_err(|e| e.to_string())?;
    Ok(format!(
        "# Generated from {source} by\n# `cargo run -p lockstep --example crdgen`; do not edit.\n{body}"
    ))
}

/// Fails while `deploy/crds/<file>` differs from `yaml` (the CRD the
/// types derive now).
#[cfg(test)]
pub(crate) fn assert_committed(file: &str, yaml: Result<String, String>) {
    let path = format!("{}/../../deploy/crds/{file}", env!("CARGO_MANIFEST_DIR"));
    let committed = std::fs::read_to_string(&path).expect("deploy/crds file");
    assert!(
        committed == yaml.expect("yaml"),
        "{path} is stale: run `cargo run -p lockstep --example crdgen`"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_committed_crd_is_the_one_the_types_derive() {
        assert_committed("loadbalancerippools.lockstep.io.yaml", crd_yaml());
    }

    #[test]
    fn a_pool_object_reads_into_the_core_pool() {
        let pool: LoadBalancerIPPool = serde_json::from_value(serde_json::json!({
            "apiVersion": "lockstep.io/v1alpha1",
            "kind": "LoadBalancerIPPool",
            "metadata": {"name": "pub"},
            "spec": {
                "cidrs": ["192.0.2.0/24"],
                "ranges": [{"start": "198.51.100.1", "stop": "198.51.100.9"}],
                "allowFirstLastIPs": true,
                "serviceSelector": {"matchLabels": {"tier": "web"}},
                "nodeSelector": {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]},
                "announce": "l2"
            }
        }))
        .unwrap();
        let spec = lockstep_core::lb::kubernetes::pool_spec(&pool.to_core()).unwrap();
        assert_eq!(spec.name, "pub");
        assert!(spec.allow_first_last);
        assert_eq!(spec.service_selector.match_labels["tier"], "web");
        assert_eq!(spec.node_selector.match_expressions[0].values, vec!["a"]);
        // A field a newer CRD added is read past (the API server's schema
        // refuses a misspelt one before it reaches the agent), kept aside
        // to be logged, and never written back.
        let newer = serde_json::from_value::<LoadBalancerIPPoolSpec>(
            serde_json::json!({"cidrs": ["192.0.2.0/24"], "avoidBuggyIPs": true}),
        )
        .expect("tolerated");
        assert_eq!(newer.cidrs, vec!["192.0.2.0/24"]);
        assert_eq!(
            newer.unknown.keys().collect::<Vec<_>>(),
            vec!["avoidBuggyIPs"]
        );
        let back = serde_json::to_value(&newer).unwrap();
        assert!(back.get("avoidBuggyIPs").is_none(), "{back}");
    }
}
