//! What users and watchers write: LB pools, label selectors, services.
//!
//! These are plain serde types, checked by pure `validate` methods before
//! anything changes (two-phase configuration). Field names are the snake_case
//! ones of lockstep's config; the Kubernetes camelCase spellings are accepted
//! as aliases so a Service watcher can pass Kubernetes objects through
//! unchanged.

use std::collections::BTreeMap;
use std::fmt;
use std::net::IpAddr;

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

use super::LbError;
use super::range::{addr_bits, cidr_interval};
use crate::cidr::{Family, validate_cidr};

/// An inclusive start–stop address range of one family. Every address in
/// it is handed out (there is no network or broadcast address in a range).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AddrRange {
    /// First address.
    pub start: IpAddr,
    /// Last address (inclusive).
    pub stop: IpAddr,
}

impl fmt::Display for AddrRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{}", self.start, self.stop)
    }
}

/// How a pool's addresses are made reachable.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Announce {
    /// Answer ARP for the pool's IPv4 addresses on the node (L2_RESP_V4).
    #[serde(rename = "l2")]
    L2,
}

/// Operator of a [`LabelRequirement`], as in Kubernetes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum SelectorOperator {
    /// The label is present with one of the values.
    In,
    /// The label is absent, or present with none of the values.
    NotIn,
    /// The label is present (any value).
    Exists,
    /// The label is absent.
    DoesNotExist,
}

impl fmt::Display for SelectorOperator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            SelectorOperator::In => "In",
            SelectorOperator::NotIn => "NotIn",
            SelectorOperator::Exists => "Exists",
            SelectorOperator::DoesNotExist => "DoesNotExist",
        })
    }
}

/// One `match_expressions` entry.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LabelRequirement {
    /// The label key.
    pub key: String,
    /// How the label is tested.
    pub operator: SelectorOperator,
    /// Values for `In` and `NotIn`; must be empty for `Exists` and
    /// `DoesNotExist`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub values: Vec<String>,
}

impl LabelRequirement {
    /// Whether `labels` satisfy this requirement.
    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        let value = labels.get(&self.key);
        match self.operator {
            SelectorOperator::In => value.is_some_and(|v| self.values.contains(v)),
            SelectorOperator::NotIn => !value.is_some_and(|v| self.values.contains(v)),
            SelectorOperator::Exists => value.is_some(),
            SelectorOperator::DoesNotExist => value.is_none(),
        }
    }
}

/// A Kubernetes LabelSelector: every `match_labels` pair and every
/// expression must hold. An empty selector selects everything.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LabelSelector {
    /// Labels that must be present with exactly these values.
    #[serde(
        default,
        alias = "matchLabels",
        skip_serializing_if = "BTreeMap::is_empty"
    )]
    pub match_labels: BTreeMap<String, String>,
    /// Further requirements.
    #[serde(
        default,
        alias = "matchExpressions",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub match_expressions: Vec<LabelRequirement>,
}

impl LabelSelector {
    /// Whether the selector is empty (selects everything).
    pub fn is_empty(&self) -> bool {
        self.match_labels.is_empty() && self.match_expressions.is_empty()
    }

    /// Whether `labels` are selected.
    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        self.match_labels
            .iter()
            .all(|(k, v)| labels.get(k) == Some(v))
            && self.match_expressions.iter().all(|r| r.matches(labels))
    }

    /// Checks the expressions; `field` is the selector's path for messages
    /// (e.g. `service_selector`).
    ///
    /// # Errors
    /// [`LbError::InvalidSelector`] naming the expression's field.
    pub fn validate(&self, pool: &str, field: &str) -> Result<(), LbError> {
        for (i, r) in self.match_expressions.iter().enumerate() {
            let problem = if r.key.is_empty() {
                Some("key is empty")
            } else {
                match (r.operator, r.values.is_empty()) {
                    (SelectorOperator::In | SelectorOperator::NotIn, true) => {
                        Some("operator needs at least one value")
                    }
                    (SelectorOperator::Exists | SelectorOperator::DoesNotExist, false) => {
                        Some("operator takes no values")
                    }
                    _ => None,
                }
            };
            if let Some(problem) = problem {
                return Err(LbError::InvalidSelector {
                    pool: pool.to_owned(),
                    field: format!("{field}.match_expressions[{i}]"),
                    operator: r.operator,
                    problem,
                });
            }
        }
        for (i, k) in self.match_labels.keys().enumerate() {
            if k.is_empty() {
                return Err(LbError::InvalidSelector {
                    pool: pool.to_owned(),
                    field: format!("{field}.match_labels[{i}]"),
                    operator: SelectorOperator::In,
                    problem: "key is empty",
                });
            }
        }
        Ok(())
    }
}

/// Definition of a LoadBalancer address pool.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LbPoolSpec {
    /// Unique name.
    pub name: String,
    /// CIDR blocks, IPv4 and IPv6.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cidrs: Vec<IpNet>,
    /// Inclusive start–stop ranges, always fully usable.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ranges: Vec<AddrRange>,
    /// Hand out the first and last address of each CIDR block too.
    #[serde(default)]
    pub allow_first_last: bool,
    /// Keep the pool (and its claim on its addresses) but hand nothing out;
    /// services holding its addresses move elsewhere.
    #[serde(default)]
    pub disabled: bool,
    /// Which services the pool serves; empty selects every service.
    #[serde(
        default,
        alias = "serviceSelector",
        skip_serializing_if = "LabelSelector::is_empty"
    )]
    pub service_selector: LabelSelector,
    /// In cluster mode, which nodes may announce its addresses (matched
    /// against each node's `[cluster] node_labels`); empty admits every
    /// node. Single-node mode ignores it: the node announces its pools.
    #[serde(
        default,
        alias = "nodeSelector",
        skip_serializing_if = "LabelSelector::is_empty"
    )]
    pub node_selector: LabelSelector,
    /// How its addresses are announced (none: routed by other means).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub announce: Option<Announce>,
}

/// One block of a pool: where it was written and the addresses it spans.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Block {
    /// As written: `10.0.0.0/24` or `10.0.0.5-10.0.0.9`.
    pub(crate) text: String,
    pub(crate) family: Family,
    pub(crate) start: u128,
    pub(crate) end: u128,
}

impl LbPoolSpec {
    /// An empty, enabled pool selecting every service.
    pub fn new(name: impl Into<String>) -> LbPoolSpec {
        LbPoolSpec {
            name: name.into(),
            cidrs: Vec::new(),
            ranges: Vec::new(),
            allow_first_last: false,
            disabled: false,
            service_selector: LabelSelector::default(),
            node_selector: LabelSelector::default(),
            announce: None,
        }
    }

    /// Adds a CIDR block (builder style; panics on a malformed string, for
    /// tests and examples).
    pub fn cidr(mut self, cidr: &str) -> LbPoolSpec {
        self.cidrs.push(cidr.parse().expect("valid cidr"));
        self
    }

    /// Adds a start–stop range (builder style; panics on malformed strings).
    pub fn range(mut self, start: &str, stop: &str) -> LbPoolSpec {
        self.ranges.push(AddrRange {
            start: start.parse().expect("valid address"),
            stop: stop.parse().expect("valid address"),
        });
        self
    }

    /// Sets the selector (builder style).
    pub fn selector(mut self, selector: LabelSelector) -> LbPoolSpec {
        self.service_selector = selector;
        self
    }

    /// Sets the announcer node selector (builder style).
    pub fn node_selector(mut self, selector: LabelSelector) -> LbPoolSpec {
        self.node_selector = selector;
        self
    }

    /// Checks the pool on its own: name, canonical CIDRs, ordered
    /// single-family ranges, no overlap among its own blocks, a well-formed
    /// selector. Overlaps with other pools are not errors: the later pool is
    /// marked conflicting instead.
    ///
    /// # Errors
    /// The first problem, naming the field.
    pub fn validate(&self) -> Result<(), LbError> {
        if self.name.is_empty() {
            return Err(LbError::EmptyPoolName);
        }
        let pool = || self.name.clone();
        for (i, c) in self.cidrs.iter().enumerate() {
            validate_cidr(*c).map_err(|source| LbError::InvalidCidr {
                pool: pool(),
                field: format!("cidrs[{i}]"),
                cidr: *c,
                source,
            })?;
        }
        for (i, r) in self.ranges.iter().enumerate() {
            let field = format!("ranges[{i}]");
            if Family::of_addr(r.start) != Family::of_addr(r.stop) {
                return Err(LbError::RangeMixedFamilies {
                    pool: pool(),
                    field,
                    range: *r,
                });
            }
            if addr_bits(r.start) > addr_bits(r.stop) {
                return Err(LbError::RangeReversed {
                    pool: pool(),
                    field,
                    range: *r,
                });
            }
        }
        let mut blocks: Vec<(Block, String)> =
            self.blocks().into_iter().zip(self.block_fields()).collect();
        for (b, field) in &blocks {
            let addr = |bits: u128| match b.family {
                Family::V4 => IpAddr::V4((bits as u32).into()),
                Family::V6 => IpAddr::V6(bits.into()),
            };
            if let Some((range, what, _)) =
                crate::pool::special_range(addr(b.start), addr(b.end), false)
            {
                return Err(LbError::SpecialRange {
                    pool: pool(),
                    field: field.clone(),
                    block: b.text.clone(),
                    range,
                    what,
                });
            }
        }
        blocks.sort_by_key(|(b, _)| (b.family, b.start));
        for w in blocks.windows(2) {
            let ((a, af), (b, bf)) = (&w[0], &w[1]);
            if a.family == b.family && b.start <= a.end {
                return Err(LbError::OverlapWithinPool {
                    pool: pool(),
                    field: bf.clone(),
                    other_field: af.clone(),
                });
            }
        }
        self.service_selector
            .validate(&self.name, "service_selector")?;
        self.node_selector.validate(&self.name, "node_selector")
    }

    /// Blocks in written order: CIDRs first, then ranges.
    pub(crate) fn blocks(&self) -> Vec<Block> {
        let cidrs = self.cidrs.iter().map(|c| {
            let (start, end) = cidr_interval(*c);
            Block {
                text: c.to_string(),
                family: Family::of_net(*c),
                start,
                end,
            }
        });
        let ranges = self.ranges.iter().map(|r| Block {
            text: r.to_string(),
            family: Family::of_addr(r.start),
            start: addr_bits(r.start),
            end: addr_bits(r.stop),
        });
        cidrs.chain(ranges).collect()
    }

    /// Whether `addr` lies in one of the pool's CIDRs or ranges (first and
    /// last addresses included: whether they may be handed out is the
    /// assigner's question, not this one).
    pub fn holds(&self, addr: IpAddr) -> bool {
        let family = Family::of_addr(addr);
        let bits = addr_bits(addr);
        self.blocks()
            .iter()
            .any(|b| b.family == family && b.start <= bits && bits <= b.end)
    }

    fn block_fields(&self) -> impl Iterator<Item = String> {
        let c = (0..self.cidrs.len()).map(|i| format!("cidrs[{i}]"));
        c.chain((0..self.ranges.len()).map(|i| format!("ranges[{i}]")))
    }
}

/// `spec.ipFamilyPolicy` of a Kubernetes Service.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum IpFamilyPolicy {
    /// One address, of the first listed family (IPv4 if none is listed).
    #[default]
    SingleStack,
    /// One address per family where possible; at least one.
    PreferDualStack,
    /// One address per family, or none at all.
    RequireDualStack,
}

/// An entry of `spec.ipFamilies`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum IpFamily {
    /// IPv4.
    IPv4,
    /// IPv6.
    IPv6,
}

impl From<IpFamily> for Family {
    fn from(f: IpFamily) -> Family {
        match f {
            IpFamily::IPv4 => Family::V4,
            IpFamily::IPv6 => Family::V6,
        }
    }
}

/// L4 protocol of a service port.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
pub enum Protocol {
    /// TCP (the Kubernetes default).
    #[default]
    TCP,
    /// UDP.
    UDP,
    /// SCTP.
    SCTP,
}

/// One port of a service; two services sharing an address must not both use
/// the same protocol and port.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServicePort {
    /// Protocol.
    #[serde(default)]
    pub protocol: Protocol,
    /// Port number.
    pub port: u16,
}

impl fmt::Display for ServicePort {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}/{}", self.protocol, self.port)
    }
}

/// The parts of a Kubernetes `type: LoadBalancer` Service that LB IPAM uses.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServiceSpec {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// Labels, matched against pool selectors.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    /// Single or dual stack.
    #[serde(default, alias = "ipFamilyPolicy")]
    pub ip_family_policy: IpFamilyPolicy,
    /// Families in order of preference (default: IPv4, then IPv6).
    #[serde(default, alias = "ipFamilies", skip_serializing_if = "Vec::is_empty")]
    pub ip_families: Vec<IpFamily>,
    /// Requested addresses, at most one per family.
    #[serde(
        default,
        alias = "loadBalancerIPs",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub load_balancer_ips: Vec<IpAddr>,
    /// Services with the same key may share an address when their ports do
    /// not clash (MetalLB's `allow-shared-ip`).
    #[serde(default, alias = "sharingKey", skip_serializing_if = "Option::is_none")]
    pub sharing_key: Option<String>,
    /// Ports.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ports: Vec<ServicePort>,
}

impl ServiceSpec {
    /// A single-stack IPv4 service with no labels, ports or requests.
    pub fn new(namespace: impl Into<String>, name: impl Into<String>) -> ServiceSpec {
        ServiceSpec {
            namespace: namespace.into(),
            name: name.into(),
            labels: BTreeMap::new(),
            ip_family_policy: IpFamilyPolicy::SingleStack,
            ip_families: Vec::new(),
            load_balancer_ips: Vec::new(),
            sharing_key: None,
            ports: Vec::new(),
        }
    }

    /// `namespace/name`, the service's key everywhere (and its owner name).
    pub fn id(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }

    /// The families the service wants addresses of, in order.
    pub fn families(&self) -> Vec<Family> {
        let mut listed: Vec<Family> = Vec::with_capacity(2);
        for f in &self.ip_families {
            let f = Family::from(*f);
            if !listed.contains(&f) {
                listed.push(f);
            }
        }
        match self.ip_family_policy {
            IpFamilyPolicy::SingleStack => vec![listed.first().copied().unwrap_or(Family::V4)],
            IpFamilyPolicy::PreferDualStack | IpFamilyPolicy::RequireDualStack => {
                for f in [Family::V4, Family::V6] {
                    if !listed.contains(&f) {
                        listed.push(f);
                    }
                }
                listed
            }
        }
    }

    /// The requested address of a family, if any.
    pub fn requested(&self, family: Family) -> Option<IpAddr> {
        self.load_balancer_ips
            .iter()
            .copied()
            .find(|a| Family::of_addr(*a) == family)
    }

    /// Checks names, families and requested addresses.
    ///
    /// # Errors
    /// [`LbError::InvalidService`] naming the field.
    pub fn validate(&self) -> Result<(), LbError> {
        let bad = |field: String, problem: &'static str| LbError::InvalidService {
            service: self.id(),
            field,
            problem,
        };
        if self.namespace.is_empty() || self.namespace.contains('/') {
            return Err(bad("namespace".into(), "must be non-empty without '/'"));
        }
        if self.name.is_empty() || self.name.contains('/') {
            return Err(bad("name".into(), "must be non-empty without '/'"));
        }
        // Length and characters: the rule every door applies to owners.
        if let Err(e) = crate::owner::Owner::load_balancer(self.id()).validate() {
            return Err(bad(e.field.into(), e.problem));
        }
        if self.ip_families.len() > 2
            || (self.ip_families.len() == 2 && self.ip_families[0] == self.ip_families[1])
        {
            return Err(bad("ip_families".into(), "lists a family twice"));
        }
        if self.ip_family_policy == IpFamilyPolicy::SingleStack && self.ip_families.len() > 1 {
            return Err(bad("ip_families".into(), "single stack takes one family"));
        }
        let families = self.families();
        for (i, a) in self.load_balancer_ips.iter().enumerate() {
            let f = Family::of_addr(*a);
            if !families.contains(&f) {
                return Err(bad(
                    format!("load_balancer_ips[{i}]"),
                    "address family is not one of the service's families",
                ));
            }
            if self.requested(f) != Some(*a) {
                return Err(bad(
                    format!("load_balancer_ips[{i}]"),
                    "more than one address of a family",
                ));
            }
        }
        if self.sharing_key.as_deref() == Some("") {
            return Err(bad("sharing_key".into(), "is empty"));
        }
        Ok(())
    }
}
