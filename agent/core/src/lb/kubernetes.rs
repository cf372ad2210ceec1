//! Kubernetes as a source of LB IPAM inputs (#28): which Services are
//! lockstep's, what each asks for, what is written back to its status and
//! to a `LoadBalancerIPPool`'s, and when a condition's time moves.
//!
//! The daemon's Kubernetes door reads Services and pools into the plain
//! types here ([`KubeService`], [`KubePool`]); this module turns them into
//! the same [`ServiceSpec`] and [`LbPoolSpec`] `lockstep lb apply` sends, so
//! one validation and one assigner serve both, and turns the LB state's
//! statuses into what Kubernetes users read ([`service_outcome`],
//! [`pool_outcome`]). Nothing here talks to the API or reads a clock: the
//! time of a transition is passed in.
//!
//! Why the rules are these:
//! - **Class.** A Service with another `spec.loadBalancerClass` belongs to
//!   another implementation (the field exists so that several can share a
//!   cluster); lockstep leaves it alone and writes nothing on it. An unset
//!   class is the default implementation's, which lockstep is.
//! - **Requested addresses.** The `lockstep.io/ips` annotation (both
//!   families, comma-separated) wins over the legacy single-address
//!   `spec.loadBalancerIP`, which Kubernetes deprecated because it cannot
//!   say dual stack.
//! - **Sharing keys are per namespace** unless both services opt in with
//!   `lockstep.io/sharing-cross-namespace: "true"`: a tenant must not be
//!   able to join another namespace's address by guessing its key. The
//!   key given to the core carries the scope (`<namespace>/<key>` or
//!   `*/<key>`), so two services share only when both scopes match.

use std::collections::BTreeMap;
use std::fmt;
use std::net::IpAddr;

use super::spec::{AddrRange, Announce, IpFamily, IpFamilyPolicy, Protocol, ServicePort};
use super::{LabelSelector, LbPoolSpec, PendingReason, PoolStatus, ServiceSpec, ServiceStatus};

/// The `spec.loadBalancerClass` lockstep serves by default.
pub const DEFAULT_CLASS: &str = "lockstep.io/lb";
/// Requested addresses, comma-separated, at most one per family.
pub const IPS_ANNOTATION: &str = "lockstep.io/ips";
/// Services with the same key share an address when their ports differ.
pub const SHARING_KEY_ANNOTATION: &str = "lockstep.io/sharing-key";
/// `"true"` on both services: their sharing key is shared across namespaces.
pub const SHARING_CROSS_NAMESPACE_ANNOTATION: &str = "lockstep.io/sharing-cross-namespace";
/// The condition lockstep writes on Services it serves.
pub const SERVICE_CONDITION: &str = "lockstep.io/AddressAssigned";
/// The condition on a pool: its definition is accepted (valid).
pub const POOL_ACCEPTED: &str = "Accepted";
/// The condition on a pool: it overlaps an earlier pool and hands nothing out.
pub const POOL_CONFLICT: &str = "Conflict";

/// A Service as the door reads it: the API's strings, unchecked.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KubeService {
    /// `metadata.namespace`.
    pub namespace: String,
    /// `metadata.name`.
    pub name: String,
    /// `metadata.labels`.
    pub labels: BTreeMap<String, String>,
    /// `metadata.annotations`.
    pub annotations: BTreeMap<String, String>,
    /// `spec.type` (absent: ClusterIP).
    pub type_: Option<String>,
    /// `spec.loadBalancerClass`.
    pub load_balancer_class: Option<String>,
    /// `spec.loadBalancerIP` (deprecated by Kubernetes, still honoured).
    pub load_balancer_ip: Option<String>,
    /// `spec.ipFamilies`.
    pub ip_families: Vec<String>,
    /// `spec.ipFamilyPolicy`.
    pub ip_family_policy: Option<String>,
    /// `spec.ports`: (protocol, port).
    pub ports: Vec<(Option<String>, i32)>,
    /// `spec.externalTrafficPolicy` (absent: Cluster).
    pub external_traffic_policy: Option<String>,
    /// `status.loadBalancer.ingress`, each entry's `ip`, else its
    /// `hostname`, as written.
    pub ingress: Vec<String>,
    /// Lockstep's condition in `status.conditions`, if there is one.
    pub condition: Option<Condition>,
}

/// A field of a Kubernetes object that lockstep cannot use, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Invalid {
    /// The field, as a path in the object (e.g. `spec.ipFamilies[1]`).
    pub field: String,
    /// What is wrong.
    pub problem: String,
}

impl fmt::Display for Invalid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.field, self.problem)
    }
}

/// What a Service asks of lockstep.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Request {
    /// Not `type: LoadBalancer`, or another class's: left alone.
    NotOurs,
    /// Lockstep's, but unusable as written: nothing is assigned and the
    /// condition says why.
    Invalid(Invalid),
    /// Lockstep's: this is what `lb apply` would send for it.
    Wanted(ServiceSpec),
}

fn invalid(field: impl Into<String>, problem: impl Into<String>) -> Request {
    Request::Invalid(Invalid {
        field: field.into(),
        problem: problem.into(),
    })
}

/// Whether the Service is lockstep's: `type: LoadBalancer` and its class
/// unset or `class`.
pub fn is_ours(svc: &KubeService, class: &str) -> bool {
    svc.type_.as_deref() == Some("LoadBalancer")
        && svc
            .load_balancer_class
            .as_deref()
            .is_none_or(|c| c == class)
}

/// What `svc` asks for, given the class lockstep serves.
pub fn lb_request(svc: &KubeService, class: &str) -> Request {
    if !is_ours(svc, class) {
        return Request::NotOurs;
    }
    let mut spec = ServiceSpec::new(svc.namespace.clone(), svc.name.clone());
    spec.labels = svc.labels.clone();
    // Requested addresses: the annotation, else the legacy field.
    let (field, requested) = match svc.annotations.get(IPS_ANNOTATION) {
        Some(v) => (format!("metadata.annotations[{IPS_ANNOTATION}]"), v.clone()),
        None => (
            "spec.loadBalancerIP".to_string(),
            svc.load_balancer_ip.clone().unwrap_or_default(),
        ),
    };
    for (i, text) in requested
        .split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .enumerate()
    {
        match text.parse::<IpAddr>() {
            Ok(a) => spec.load_balancer_ips.push(a),
            Err(_) => {
                return invalid(field, format!("entry {i} ({text:?}) is not an IP address"));
            }
        }
    }
    for (i, f) in svc.ip_families.iter().enumerate() {
        spec.ip_families.push(match f.as_str() {
            "IPv4" => IpFamily::IPv4,
            "IPv6" => IpFamily::IPv6,
            other => {
                return invalid(
                    format!("spec.ipFamilies[{i}]"),
                    format!("{other:?} is neither IPv4 nor IPv6"),
                );
            }
        });
    }
    spec.ip_family_policy = match svc.ip_family_policy.as_deref() {
        None | Some("SingleStack") => IpFamilyPolicy::SingleStack,
        Some("PreferDualStack") => IpFamilyPolicy::PreferDualStack,
        Some("RequireDualStack") => IpFamilyPolicy::RequireDualStack,
        Some(other) => {
            return invalid(
                "spec.ipFamilyPolicy",
                format!("{other:?} is not SingleStack, PreferDualStack or RequireDualStack"),
            );
        }
    };
    for (i, (protocol, port)) in svc.ports.iter().enumerate() {
        let protocol = match protocol.as_deref() {
            None | Some("TCP") => Protocol::TCP,
            Some("UDP") => Protocol::UDP,
            Some("SCTP") => Protocol::SCTP,
            Some(other) => {
                return invalid(
                    format!("spec.ports[{i}].protocol"),
                    format!("{other:?} is not TCP, UDP or SCTP"),
                );
            }
        };
        let Ok(port) = u16::try_from(*port) else {
            return invalid(format!("spec.ports[{i}].port"), "out of range");
        };
        if port == 0 {
            return invalid(format!("spec.ports[{i}].port"), "out of range");
        }
        spec.ports.push(ServicePort { protocol, port });
    }
    if let Some(key) = svc.annotations.get(SHARING_KEY_ANNOTATION) {
        let field = format!("metadata.annotations[{SHARING_KEY_ANNOTATION}]");
        if key.is_empty() {
            return invalid(field, "is empty");
        }
        let cross = match svc
            .annotations
            .get(SHARING_CROSS_NAMESPACE_ANNOTATION)
            .map(String::as_str)
        {
            None | Some("false") => false,
            Some("true") => true,
            Some(other) => {
                return invalid(
                    format!("metadata.annotations[{SHARING_CROSS_NAMESPACE_ANNOTATION}]"),
                    format!("{other:?} is neither \"true\" nor \"false\""),
                );
            }
        };
        spec.sharing_key = Some(if cross {
            format!("*/{key}")
        } else {
            format!("{}/{key}", svc.namespace)
        });
    }
    match spec.validate() {
        Ok(()) => Request::Wanted(spec),
        Err(e) => invalid(kube_field(&e), e.to_string()),
    }
}

/// The Kubernetes field a core validation error is about.
fn kube_field(e: &super::LbError) -> String {
    match e {
        super::LbError::InvalidService { field, .. } => match field.as_str() {
            "ip_families" => "spec.ipFamilies".into(),
            "sharing_key" => format!("metadata.annotations[{SHARING_KEY_ANNOTATION}]"),
            f if f.starts_with("load_balancer_ips") => {
                format!("metadata.annotations[{IPS_ANNOTATION}]")
            }
            _ => "metadata".into(),
        },
        _ => "spec".into(),
    }
}

/// A condition without its time: what lockstep wants it to say.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Condition {
    /// `type`.
    pub type_: String,
    /// `"True"` or `"False"`.
    pub status: String,
    /// CamelCase reason.
    pub reason: String,
    /// A sentence for humans.
    pub message: String,
}

impl Condition {
    fn new(type_: &str, ok: bool, reason: &str, message: impl Into<String>) -> Condition {
        Condition {
            type_: type_.into(),
            status: if ok { "True" } else { "False" }.into(),
            reason: reason.into(),
            message: message.into(),
        }
    }

    /// Whether the condition reports a failure (lockstep's conditions are
    /// all positive except [`POOL_CONFLICT`]).
    pub fn is_failure(&self) -> bool {
        (self.type_ == POOL_CONFLICT) == (self.status == "True")
    }
}

/// A condition as stored on an object: [`Condition`] plus when its status
/// last changed and the generation it was computed for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TimedCondition {
    /// What it says.
    pub condition: Condition,
    /// RFC 3339 time of the last change of `status`.
    pub last_transition_time: String,
    /// `metadata.generation` it describes.
    pub observed_generation: Option<i64>,
}

/// `current` with `want` put in place of the condition of its type (other
/// writers' conditions are kept, in order): the transition time moves to
/// `now` only when the status changes, as the API conventions ask.
pub fn merge_condition(
    current: &[TimedCondition],
    want: Condition,
    now: &str,
    generation: Option<i64>,
) -> Vec<TimedCondition> {
    let mut out: Vec<TimedCondition> = Vec::with_capacity(current.len() + 1);
    let mut placed = false;
    for c in current {
        if c.condition.type_ != want.type_ {
            out.push(c.clone());
            continue;
        }
        if placed {
            continue;
        }
        placed = true;
        let last_transition_time = if c.condition.status == want.status {
            c.last_transition_time.clone()
        } else {
            now.to_string()
        };
        out.push(TimedCondition {
            condition: want.clone(),
            last_transition_time,
            observed_generation: generation,
        });
    }
    if !placed {
        out.push(TimedCondition {
            condition: want,
            last_transition_time: now.to_string(),
            observed_generation: generation,
        });
    }
    out
}

/// `current` without conditions of `type_`.
pub fn drop_condition(current: &[TimedCondition], type_: &str) -> Vec<TimedCondition> {
    current
        .iter()
        .filter(|c| c.condition.type_ != type_)
        .cloned()
        .collect()
}

/// What a Service's status should say.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceOutcome {
    /// `status.loadBalancer.ingress[*].ip`, in the service's family order.
    pub ingress: Vec<IpAddr>,
    /// Lockstep's condition.
    pub condition: Condition,
}

/// The CamelCase reason of a pending service.
pub fn pending_reason(reason: &PendingReason) -> &'static str {
    match reason {
        PendingReason::NoPoolSelects { .. } => "NoPool",
        PendingReason::Exhausted { .. } => "PoolExhausted",
        PendingReason::RequestedOutsidePools { .. } => "RequestedOutsidePools",
        PendingReason::RequestedNotSelected { .. } => "RequestedNotSelected",
        PendingReason::AddressUnusable { .. } => "RequestedUnusable",
        PendingReason::AddressTaken { .. } => "RequestedTaken",
        PendingReason::PoolConflicting { .. } => "PoolConflicting",
        PendingReason::PoolDisabled { .. } => "PoolDisabled",
        PendingReason::SharingPortClash { .. } => "SharingKeyConflict",
    }
}

/// A Service's status from its LB status (`None`: not in the LB state yet,
/// nothing to say) or from why its request is invalid.
pub fn service_outcome(
    status: Option<&ServiceStatus>,
    invalid: Option<&Invalid>,
) -> Option<ServiceOutcome> {
    if let Some(i) = invalid {
        return Some(ServiceOutcome {
            ingress: Vec::new(),
            condition: Condition::new(SERVICE_CONDITION, false, "InvalidRequest", i.to_string()),
        });
    }
    let status = status?;
    Some(match status.pending() {
        Some(reason) => ServiceOutcome {
            ingress: Vec::new(),
            condition: Condition::new(
                SERVICE_CONDITION,
                false,
                pending_reason(reason),
                reason.to_string(),
            ),
        },
        None => {
            let list: Vec<String> = status.addresses().iter().map(IpAddr::to_string).collect();
            let mut message = format!("assigned {}", list.join(", "));
            if let Some(m) = &status.missing_family {
                message.push_str(&format!("; not dual stack: {m}"));
            }
            ServiceOutcome {
                ingress: status.addresses().to_vec(),
                condition: Condition::new(SERVICE_CONDITION, true, "Assigned", message),
            }
        }
    })
}

/// The longest `note` the API server accepts on an `events.k8s.io/v1`
/// Event, in bytes: a longer one is refused and the Event lost.
pub const EVENT_NOTE_MAX: usize = 1024;

/// An Event to publish when lockstep's condition on an object changes
/// reason: `(warning, reason, note)`. Nothing when the reason is the one
/// already written (an Event per pass would flood the API). The note is the
/// condition's message cut to [`EVENT_NOTE_MAX`] bytes (the condition keeps
/// it whole).
pub fn event_for(before: Option<&Condition>, now: &Condition) -> Option<(bool, String, String)> {
    if before.is_some_and(|b| b.reason == now.reason && b.status == now.status) {
        return None;
    }
    Some((now.is_failure(), now.reason.clone(), cut_note(&now.message)))
}

/// `note` within [`EVENT_NOTE_MAX`] bytes, cut at a character boundary and
/// ended with `…` when cut.
pub fn cut_note(note: &str) -> String {
    if note.len() <= EVENT_NOTE_MAX {
        return note.to_string();
    }
    const MARK: &str = "…";
    let mut end = EVENT_NOTE_MAX - MARK.len();
    while !note.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}{MARK}", &note[..end])
}

/// A `LoadBalancerIPPool` as the door reads it: the API's strings.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KubePool {
    /// `metadata.name`: the pool's name.
    pub name: String,
    /// `spec.cidrs`.
    pub cidrs: Vec<String>,
    /// `spec.ranges`: (start, stop).
    pub ranges: Vec<(String, String)>,
    /// `spec.allowFirstLastIPs`.
    pub allow_first_last: bool,
    /// `spec.disabled`.
    pub disabled: bool,
    /// `spec.serviceSelector`.
    pub service_selector: LabelSelector,
    /// `spec.nodeSelector`.
    pub node_selector: LabelSelector,
    /// `spec.announce` (`"l2"` or absent).
    pub announce: Option<String>,
}

/// The [`LbPoolSpec`] of a pool object, checked by the same validation as
/// `lb apply`'s.
///
/// # Errors
/// The first unusable field, named as in the object.
pub fn pool_spec(pool: &KubePool) -> Result<LbPoolSpec, Invalid> {
    let mut spec = LbPoolSpec::new(pool.name.clone());
    for (i, c) in pool.cidrs.iter().enumerate() {
        spec.cidrs.push(c.trim().parse().map_err(|_| Invalid {
            field: format!("spec.cidrs[{i}]"),
            problem: format!("{c:?} is not a CIDR"),
        })?);
    }
    for (i, (start, stop)) in pool.ranges.iter().enumerate() {
        let addr = |text: &str, which: &str| {
            text.trim().parse::<IpAddr>().map_err(|_| Invalid {
                field: format!("spec.ranges[{i}].{which}"),
                problem: format!("{text:?} is not an IP address"),
            })
        };
        spec.ranges.push(AddrRange {
            start: addr(start, "start")?,
            stop: addr(stop, "stop")?,
        });
    }
    spec.allow_first_last = pool.allow_first_last;
    spec.disabled = pool.disabled;
    spec.service_selector = pool.service_selector.clone();
    spec.node_selector = pool.node_selector.clone();
    spec.announce = match pool.announce.as_deref() {
        None => None,
        Some("l2") => Some(Announce::L2),
        Some(other) => {
            return Err(Invalid {
                field: "spec.announce".into(),
                problem: format!("{other:?} is not \"l2\""),
            });
        }
    };
    spec.validate().map_err(|e| Invalid {
        field: "spec".into(),
        problem: e.to_string(),
    })?;
    Ok(spec)
}

/// What a pool's status should say.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolOutcome {
    /// [`POOL_ACCEPTED`] and, once the pool is in the LB state,
    /// [`POOL_CONFLICT`].
    pub conditions: Vec<Condition>,
    /// Addresses it hands out, both families (decimal: an IPv6 pool's
    /// count does not fit a 64-bit integer).
    pub total: Option<String>,
    /// Addresses in use.
    pub used: Option<String>,
    /// Addresses free for new services (0 while conflicting or disabled).
    pub available: Option<String>,
}

/// A pool's status from its LB status (`None`: not in the LB state yet) or
/// from why its definition is refused (`refused`: a validation or an
/// overlap with the node's or cluster's endpoint pools).
pub fn pool_outcome(status: Option<&PoolStatus>, refused: Option<&str>) -> PoolOutcome {
    if let Some(why) = refused {
        return PoolOutcome {
            conditions: vec![Condition::new(POOL_ACCEPTED, false, "Invalid", why)],
            total: None,
            used: None,
            available: None,
        };
    }
    let Some(status) = status else {
        return PoolOutcome {
            conditions: vec![Condition::new(
                POOL_ACCEPTED,
                true,
                "Accepted",
                "valid; waiting to be taken into the LB state",
            )],
            total: None,
            used: None,
            available: None,
        };
    };
    let conflict = match &status.conflict {
        Some(c) => Condition::new(
            POOL_CONFLICT,
            true,
            "Overlap",
            format!(
                "{} overlaps {} of pool {}, applied earlier: this pool assigns no new address",
                c.block, c.other_block, c.pool
            ),
        ),
        None => Condition::new(POOL_CONFLICT, false, "NoOverlap", "overlaps no other pool"),
    };
    let m = &status.metrics;
    PoolOutcome {
        conditions: vec![
            Condition::new(POOL_ACCEPTED, true, "Accepted", "valid"),
            conflict,
        ],
        total: Some(m.capacity.to_string()),
        used: Some(m.used.to_string()),
        available: Some(m.free.to_string()),
    }
}

/// A Node's `InternalIP` addresses (unparsable ones skipped): the first of
/// each family is the node's address in cluster mode unless the config
/// names one.
pub fn internal_ips(addresses: &[(String, String)]) -> (Option<IpAddr>, Option<IpAddr>) {
    let mut v4 = None;
    let mut v6 = None;
    for (kind, text) in addresses {
        if kind != "InternalIP" {
            continue;
        }
        match text.parse::<IpAddr>() {
            Ok(a @ IpAddr::V4(_)) if v4.is_none() => v4 = Some(a),
            Ok(a @ IpAddr::V6(_)) if v6.is_none() => v6 = Some(a),
            _ => {}
        }
    }
    (v4, v6)
}

/// The labels an agent publishes for pools' node selectors: its Node's,
/// with the config's `node_labels` put over them (an operator's override
/// wins).
pub fn node_labels(
    node: &BTreeMap<String, String>,
    configured: &BTreeMap<String, String>,
) -> BTreeMap<String, String> {
    let mut out = node.clone();
    out.extend(configured.iter().map(|(k, v)| (k.clone(), v.clone())));
    out
}

pub mod local;
pub mod nodes;
pub mod ownership;
pub mod seats;

#[cfg(test)]
mod tests;
