//! `PodIPPool` objects as cluster pools (#29 item 1): what the Kubernetes
//! door's one elected writer applies, and what each object's status says.
//!
//! Why here: which objects are taken, which are refused and in what words,
//! is a decision. The objects feed the same checks as `lockstep cluster
//! pools apply` ([`plan_apply`], [`default_for_apply`]); this module only
//! decides how a *set* of independently written objects becomes one apply
//! without one bad object holding back the others:
//! - objects are taken one at a time (the one marked `default` first, then
//!   by name); each is checked together with everything taken before it and
//!   the stored pools of the objects not yet looked at;
//! - an object that does not convert or fails the checks is refused with
//!   the reason `cluster pools apply` would print, and its pool stays as
//!   stored (absent when it never was);
//! - a stored pool no object names is left out of the apply, so it drains
//!   exactly as when a pools file leaves it out;
//! - no object at all changes nothing: an empty list (the CRD not
//!   installed yet, a wrong context) must never drain every pool.

use std::collections::{BTreeMap, BTreeSet};

use ipnet::IpNet;

use super::default::default_for_apply;
use super::spec::{ClusterPoolSpec, DEFAULT_BLOCK_V4, DEFAULT_BLOCK_V6, plan_apply};

/// A `PodIPPool` as the API holds it (strings unparsed).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodPool {
    /// `metadata.name`: the pool's name.
    pub name: String,
    /// IPv4 CIDRs.
    pub ipv4: Vec<String>,
    /// IPv6 CIDRs.
    pub ipv6: Vec<String>,
    /// IPv4 block prefix length (absent: 26).
    pub block_v4: Option<u8>,
    /// IPv6 block prefix length (absent: 122).
    pub block_v6: Option<u8>,
    /// Hand out the first and last address of each CIDR.
    pub allow_first_last: bool,
    /// Traffic from the pool is not masqueraded.
    pub skip_masquerade: bool,
    /// The pool serves requests that name none.
    pub default: bool,
}

/// Why an object was not taken: `reason` is the condition's CamelCase
/// reason, `message` the words for humans.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    /// `InvalidSpec` (the object alone is wrong) or `Refused` (it conflicts
    /// with the other pools or with claimed blocks).
    pub reason: &'static str,
    /// What is wrong, as `cluster pools apply` says it.
    pub message: String,
}

/// What the writer applies and reports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodPoolsPlan {
    /// The pools to apply (as a pools file would list them).
    pub pools: Vec<ClusterPoolSpec>,
    /// The default to name: the object marked `default`, else the one
    /// recorded, else (no default recorded yet) the first pool taken, as
    /// the CLI's first apply of a single pool records it.
    pub default: Option<String>,
    /// Objects refused, by name.
    pub refused: BTreeMap<String, Refusal>,
}

/// Reads one object into a cluster pool.
///
/// # Errors
/// The first field that does not parse, named (`spec.ipv4[1]: ...`).
pub fn pod_pool_spec(p: &PodPool) -> Result<ClusterPoolSpec, String> {
    let parse = |field: &str, list: &[String]| -> Result<Vec<IpNet>, String> {
        list.iter()
            .enumerate()
            .map(|(i, s)| {
                s.trim()
                    .parse::<IpNet>()
                    .map_err(|e| format!("spec.{field}[{i}]: {s:?} is not a CIDR ({e})"))
            })
            .collect()
    };
    let mut spec = ClusterPoolSpec::new(p.name.clone());
    spec.ipv4 = parse("ipv4", &p.ipv4)?;
    spec.ipv6 = parse("ipv6", &p.ipv6)?;
    if spec.ipv4.is_empty() && spec.ipv6.is_empty() {
        return Err("spec: no CIDR in ipv4 nor ipv6".into());
    }
    spec.block_v4 = p.block_v4.unwrap_or(DEFAULT_BLOCK_V4);
    spec.block_v6 = p.block_v6.unwrap_or(DEFAULT_BLOCK_V6);
    spec.allow_first_last = p.allow_first_last;
    spec.skip_masquerade = p.skip_masquerade;
    super::spec::validate_pools(std::slice::from_ref(&spec)).map_err(|e| e.to_string())?;
    Ok(spec)
}

/// The apply the objects ask for, given the stored pools, the recorded
/// default and the claimed blocks (block → `(pool, node)`). `None` when
/// there is no object (nothing is changed then).
pub fn plan_pod_pools(
    objects: &[PodPool],
    stored: &[ClusterPoolSpec],
    stored_default: Option<&str>,
    claimed: &BTreeMap<IpNet, (String, String)>,
) -> Option<PodPoolsPlan> {
    if objects.is_empty() {
        return None;
    }
    let mut refused = BTreeMap::new();
    // The one marked default first (the first by name when several are),
    // then by name.
    let mut order: Vec<&PodPool> = objects.iter().collect();
    order.sort_by(|a, b| (!a.default, &a.name).cmp(&(!b.default, &b.name)));
    let named: BTreeSet<&str> = objects.iter().map(|o| o.name.as_str()).collect();
    // Each object's pool as it stands: stored (and not draining) until the
    // object is taken.
    let mut current: BTreeMap<String, ClusterPoolSpec> = stored
        .iter()
        .filter(|p| !p.draining && named.contains(p.name.as_str()))
        .map(|p| (p.name.clone(), p.clone()))
        .collect();
    let mut recorded: Option<String> = stored_default.map(str::to_owned);
    let mut asked: Option<String> = None;
    for object in order {
        if object.default && asked.is_some() {
            refused.insert(
                object.name.clone(),
                Refusal {
                    reason: "Refused",
                    message: format!(
                        "pool {} is the default already; only one PodIPPool may set spec.default",
                        asked.as_deref().unwrap_or_default()
                    ),
                },
            );
            continue;
        }
        let spec = match pod_pool_spec(object) {
            Ok(spec) => spec,
            Err(message) => {
                refused.insert(
                    object.name.clone(),
                    Refusal {
                        reason: "InvalidSpec",
                        message,
                    },
                );
                continue;
            }
        };
        let mut candidate = current.clone();
        candidate.insert(spec.name.clone(), spec);
        let list: Vec<ClusterPoolSpec> = candidate.values().cloned().collect();
        let ask = if object.default {
            Some(object.name.clone())
        } else {
            asked.clone()
        };
        let checked = plan_apply(stored, &list, claimed)
            .and_then(|_| default_for_apply(&list, recorded.as_deref(), ask.as_deref()));
        match checked {
            Ok(default) => {
                current = candidate;
                recorded = default;
                asked = ask;
            }
            Err(e) => {
                refused.insert(
                    object.name.clone(),
                    Refusal {
                        reason: "Refused",
                        message: e.to_string(),
                    },
                );
            }
        }
    }
    Some(PodPoolsPlan {
        pools: current.into_values().collect(),
        default: recorded,
        refused,
    })
}

/// Whether the stored pools already are what `plan` asks (nothing to
/// write): the same pools, none draining that the plan names, and the
/// default it names recorded.
pub fn plan_is_stored(
    plan: &PodPoolsPlan,
    stored: &[ClusterPoolSpec],
    stored_default: Option<&str>,
    claimed: &BTreeMap<IpNet, (String, String)>,
) -> bool {
    let Ok(written) = plan_apply(stored, &plan.pools, claimed) else {
        return false;
    };
    let mut a = written;
    let mut b = stored.to_vec();
    a.sort_by(|x, y| x.name.cmp(&y.name));
    b.sort_by(|x, y| x.name.cmp(&y.name));
    a == b
        && plan
            .default
            .as_deref()
            .is_none_or(|d| Some(d) == stored_default)
}

/// The counts a `PodIPPool`'s status shows.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodPoolCounts {
    /// Addresses in its CIDRs (decimal: IPv6 counts exceed 64 bits).
    pub total: String,
    /// Blocks nodes have claimed from it.
    pub blocks: u64,
    /// Nodes holding blocks of it.
    pub nodes: u64,
    /// The stored pool is draining (its object is gone or it was left out).
    pub draining: bool,
}

/// The counts of pool `name` as stored (`None`: not stored).
pub fn pod_pool_counts(
    name: &str,
    stored: &[ClusterPoolSpec],
    claimed: &BTreeMap<IpNet, (String, String)>,
) -> Option<PodPoolCounts> {
    let spec = stored.iter().find(|p| p.name == name)?;
    let total: u128 = spec
        .cidrs()
        .map(|c| 1u128 << (u32::from(c.max_prefix_len() - c.prefix_len())).min(127))
        .fold(0u128, u128::saturating_add);
    let held: Vec<&String> = claimed
        .values()
        .filter(|(pool, _)| pool == name)
        .map(|(_, node)| node)
        .collect();
    let nodes: BTreeSet<&String> = held.iter().copied().collect();
    Some(PodPoolCounts {
        total: total.to_string(),
        blocks: held.len() as u64,
        nodes: nodes.len() as u64,
        draining: spec.draining,
    })
}

/// An object's `Accepted` condition: (status, reason, message).
pub fn accepted_condition(
    refusal: Option<&Refusal>,
    counts: Option<&PodPoolCounts>,
) -> (&'static str, &'static str, String) {
    match (refusal, counts) {
        (Some(r), Some(_)) => (
            "False",
            r.reason,
            format!("{}; the stored pool is kept as it was", r.message),
        ),
        (Some(r), None) => ("False", r.reason, format!("{}; nothing stored", r.message)),
        (None, Some(_)) => ("True", "Applied", "stored as a cluster pool".into()),
        (None, None) => ("Unknown", "Pending", "not stored yet".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obj(name: &str, v4: &[&str]) -> PodPool {
        PodPool {
            name: name.into(),
            ipv4: v4.iter().map(|s| (*s).to_string()).collect(),
            ..PodPool::default()
        }
    }

    fn spec(name: &str, v4: &str) -> ClusterPoolSpec {
        ClusterPoolSpec::new(name).with_cidr(v4.parse().unwrap())
    }

    #[test]
    fn no_object_changes_nothing() {
        let stored = vec![spec("pods", "10.1.0.0/16")];
        assert_eq!(
            plan_pod_pools(&[], &stored, Some("pods"), &BTreeMap::new()),
            None
        );
    }

    #[test]
    fn objects_become_pools_and_the_single_one_is_the_default() {
        let mut o = obj("pods", &["10.1.0.0/16"]);
        o.block_v4 = Some(28);
        o.skip_masquerade = true;
        let plan = plan_pod_pools(&[o], &[], None, &BTreeMap::new()).unwrap();
        assert!(plan.refused.is_empty());
        assert_eq!(plan.pools.len(), 1);
        assert_eq!(plan.pools[0].block_v4, 28);
        assert!(plan.pools[0].skip_masquerade);
        // Not named: the single pool is the default, as the CLI's first
        // apply records it.
        assert_eq!(plan.default.as_deref(), Some("pods"));
    }

    #[test]
    fn a_bad_object_is_refused_naming_the_field_and_its_stored_pool_kept() {
        let stored = vec![spec("a", "10.1.0.0/16"), spec("b", "10.2.0.0/16")];
        let objects = [
            obj("a", &["10.1.0.0/16"]),
            obj("b", &["10.2.0.0/33"]), // not a CIDR
        ];
        let plan = plan_pod_pools(&objects, &stored, Some("a"), &BTreeMap::new()).unwrap();
        let r = &plan.refused["b"];
        assert_eq!(r.reason, "InvalidSpec");
        assert!(r.message.contains("spec.ipv4[0]"), "{}", r.message);
        // b as stored, unchanged.
        assert_eq!(plan.pools, stored);
        let (status, _, message) = accepted_condition(Some(r), Some(&PodPoolCounts::default()));
        assert_eq!(status, "False");
        assert!(message.contains("kept as it was"));
    }

    #[test]
    fn an_overlap_refuses_the_later_object_only() {
        let objects = [obj("a", &["10.1.0.0/16"]), obj("b", &["10.1.128.0/17"])];
        let plan = plan_pod_pools(&objects, &[], None, &BTreeMap::new()).unwrap();
        assert_eq!(plan.pools.len(), 1);
        assert_eq!(plan.pools[0].name, "a");
        assert_eq!(plan.refused["b"].reason, "Refused");
        assert!(
            plan.refused["b"].message.contains("overlap"),
            "{:?}",
            plan.refused
        );
    }

    #[test]
    fn removing_a_cidr_in_use_is_refused_naming_the_blocks_and_a_free_one_goes() {
        let stored = vec![spec("a", "10.1.0.0/24").with_cidr("10.9.0.0/24".parse().unwrap())];
        let claimed: BTreeMap<IpNet, (String, String)> =
            [("10.9.0.0/26".parse().unwrap(), ("a".into(), "n1".into()))].into();
        let plan =
            plan_pod_pools(&[obj("a", &["10.1.0.0/24"])], &stored, Some("a"), &claimed).unwrap();
        assert!(
            plan.refused["a"].message.contains("10.9.0.0/26"),
            "{:?}",
            plan.refused
        );
        assert_eq!(plan.pools, stored);
        // Nothing claimed in it: the CIDR goes.
        let plan = plan_pod_pools(
            &[obj("a", &["10.1.0.0/24"])],
            &stored,
            Some("a"),
            &BTreeMap::new(),
        )
        .unwrap();
        assert!(plan.refused.is_empty());
        assert_eq!(
            plan.pools[0].ipv4,
            vec!["10.1.0.0/24".parse::<IpNet>().unwrap()]
        );
    }

    #[test]
    fn a_pool_without_object_drains_while_its_blocks_are_held() {
        let stored = vec![spec("a", "10.1.0.0/24"), spec("old", "10.9.0.0/24")];
        let claimed: BTreeMap<IpNet, (String, String)> =
            [("10.9.0.0/26".parse().unwrap(), ("old".into(), "n1".into()))].into();
        let plan =
            plan_pod_pools(&[obj("a", &["10.1.0.0/24"])], &stored, Some("a"), &claimed).unwrap();
        assert_eq!(plan.pools, vec![stored[0].clone()]);
        // What the apply writes: old kept, draining.
        let written = plan_apply(&stored, &plan.pools, &claimed).unwrap();
        assert!(written.iter().any(|p| p.name == "old" && p.draining));
        assert!(!plan_is_stored(&plan, &stored, Some("a"), &claimed));
        let c = pod_pool_counts("old", &written, &claimed).unwrap();
        assert_eq!((c.blocks, c.nodes, c.draining), (1, 1, true));
        assert!(plan_is_stored(&plan, &written, Some("a"), &claimed));
    }

    #[test]
    fn the_default_is_the_marked_object_and_a_second_mark_is_refused() {
        let mut a = obj("a", &["10.1.0.0/24"]);
        let mut z = obj("z", &["10.2.0.0/24"]);
        z.default = true;
        a.default = true;
        let plan = plan_pod_pools(&[z.clone(), a], &[], None, &BTreeMap::new()).unwrap();
        assert_eq!(plan.default.as_deref(), Some("a"));
        assert!(plan.refused["z"].message.contains("default already"));
        // None marked, none recorded: the first taken is recorded, and
        // adding pools never moves it (the CLI's rule).
        z.default = false;
        let plan = plan_pod_pools(
            &[obj("a", &["10.1.0.0/24"]), z.clone()],
            &[],
            None,
            &BTreeMap::new(),
        )
        .unwrap();
        assert_eq!(plan.pools.len(), 2);
        assert_eq!(plan.default.as_deref(), Some("a"));
        let stored = vec![spec("z", "10.2.0.0/24")];
        let plan = plan_pod_pools(
            &[obj("a", &["10.1.0.0/24"]), z],
            &stored,
            Some("z"),
            &BTreeMap::new(),
        )
        .unwrap();
        assert_eq!(plan.default.as_deref(), Some("z"));
    }

    #[test]
    fn counts_add_the_cidrs_and_the_held_blocks() {
        let stored = vec![spec("a", "10.1.0.0/24").with_cidr("2001:db8::/64".parse().unwrap())];
        let claimed: BTreeMap<IpNet, (String, String)> = [
            ("10.1.0.0/26".parse().unwrap(), ("a".into(), "n1".into())),
            ("10.1.0.64/26".parse().unwrap(), ("a".into(), "n1".into())),
            ("10.1.0.128/26".parse().unwrap(), ("a".into(), "n2".into())),
        ]
        .into();
        let c = pod_pool_counts("a", &stored, &claimed).unwrap();
        assert_eq!(c.total, (256u128 + (1u128 << 64)).to_string());
        assert_eq!((c.blocks, c.nodes), (3, 2));
        assert_eq!(pod_pool_counts("b", &stored, &claimed), None);
    }
}
