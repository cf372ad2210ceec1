use std::collections::BTreeMap;
use std::net::IpAddr;

use proptest::prelude::*;

use super::*;
use crate::lb::{Assignment, LbIpam, PendingReason, ServiceStatus};

fn lb_service(ns: &str, name: &str) -> KubeService {
    KubeService {
        namespace: ns.into(),
        name: name.into(),
        type_: Some("LoadBalancer".into()),
        ..KubeService::default()
    }
}

fn wanted(r: Request) -> ServiceSpec {
    match r {
        Request::Wanted(s) => s,
        other => panic!("expected a request, got {other:?}"),
    }
}

fn invalid_field(r: Request) -> String {
    match r {
        Request::Invalid(i) => i.field,
        other => panic!("expected invalid, got {other:?}"),
    }
}

#[test]
fn only_load_balancers_of_our_class_or_none_are_ours() {
    let mut s = lb_service("a", "web");
    assert!(matches!(lb_request(&s, DEFAULT_CLASS), Request::Wanted(_)));
    s.load_balancer_class = Some(DEFAULT_CLASS.into());
    assert!(matches!(lb_request(&s, DEFAULT_CLASS), Request::Wanted(_)));
    s.load_balancer_class = Some("metallb.io/metallb".into());
    assert_eq!(lb_request(&s, DEFAULT_CLASS), Request::NotOurs);
    // A configured class: the default one is then someone else's.
    s.load_balancer_class = Some(DEFAULT_CLASS.into());
    assert_eq!(lb_request(&s, "example.com/lb"), Request::NotOurs);
    for t in [
        None,
        Some("ClusterIP"),
        Some("NodePort"),
        Some("ExternalName"),
    ] {
        let mut s = lb_service("a", "web");
        s.type_ = t.map(Into::into);
        assert_eq!(lb_request(&s, DEFAULT_CLASS), Request::NotOurs, "{t:?}");
    }
}

#[test]
fn the_annotation_wins_over_the_legacy_field_and_says_dual_stack() {
    let mut s = lb_service("a", "web");
    s.load_balancer_ip = Some("10.0.0.9".into());
    assert_eq!(
        wanted(lb_request(&s, DEFAULT_CLASS)).load_balancer_ips,
        vec!["10.0.0.9".parse::<IpAddr>().unwrap()]
    );
    s.annotations
        .insert(IPS_ANNOTATION.into(), "10.0.0.5, fd00::5".into());
    s.ip_family_policy = Some("RequireDualStack".into());
    s.ip_families = vec!["IPv4".into(), "IPv6".into()];
    let spec = wanted(lb_request(&s, DEFAULT_CLASS));
    assert_eq!(
        spec.load_balancer_ips,
        vec![
            "10.0.0.5".parse::<IpAddr>().unwrap(),
            "fd00::5".parse().unwrap()
        ]
    );
    assert_eq!(spec.ip_family_policy, IpFamilyPolicy::RequireDualStack);
    assert_eq!(spec.ip_families, vec![IpFamily::IPv4, IpFamily::IPv6]);
}

#[test]
fn unusable_fields_are_named_as_in_the_object() {
    let mut s = lb_service("a", "web");
    s.annotations
        .insert(IPS_ANNOTATION.into(), "10.0.0.5,nope".into());
    assert_eq!(
        invalid_field(lb_request(&s, DEFAULT_CLASS)),
        "metadata.annotations[lockstep.io/ips]"
    );
    let mut s = lb_service("a", "web");
    s.ip_families = vec!["IPv5".into()];
    assert_eq!(
        invalid_field(lb_request(&s, DEFAULT_CLASS)),
        "spec.ipFamilies[0]"
    );
    let mut s = lb_service("a", "web");
    s.ip_family_policy = Some("Sometimes".into());
    assert_eq!(
        invalid_field(lb_request(&s, DEFAULT_CLASS)),
        "spec.ipFamilyPolicy"
    );
    let mut s = lb_service("a", "web");
    s.ports = vec![(Some("ICMP".into()), 80)];
    assert_eq!(
        invalid_field(lb_request(&s, DEFAULT_CLASS)),
        "spec.ports[0].protocol"
    );
    let mut s = lb_service("a", "web");
    s.ports = vec![(None, 70000)];
    assert_eq!(
        invalid_field(lb_request(&s, DEFAULT_CLASS)),
        "spec.ports[0].port"
    );
    // Two IPv4 addresses for a single-stack service: the core's check,
    // named as the annotation.
    let mut s = lb_service("a", "web");
    s.annotations
        .insert(IPS_ANNOTATION.into(), "10.0.0.5,10.0.0.6".into());
    assert_eq!(
        invalid_field(lb_request(&s, DEFAULT_CLASS)),
        "metadata.annotations[lockstep.io/ips]"
    );
    let mut s = lb_service("a", "web");
    s.annotations
        .insert(SHARING_KEY_ANNOTATION.into(), "k".into());
    s.annotations
        .insert(SHARING_CROSS_NAMESPACE_ANNOTATION.into(), "yes".into());
    assert_eq!(
        invalid_field(lb_request(&s, DEFAULT_CLASS)),
        "metadata.annotations[lockstep.io/sharing-cross-namespace]"
    );
}

fn keyed(ns: &str, name: &str, key: &str, cross: bool, port: i32) -> ServiceSpec {
    let mut s = lb_service(ns, name);
    s.annotations
        .insert(SHARING_KEY_ANNOTATION.into(), key.into());
    if cross {
        s.annotations
            .insert(SHARING_CROSS_NAMESPACE_ANNOTATION.into(), "true".into());
    }
    s.ports = vec![(Some("TCP".into()), port)];
    wanted(lb_request(&s, DEFAULT_CLASS))
}

#[test]
fn sharing_keys_cross_namespaces_only_when_both_opt_in() {
    let pool = LbPoolSpec::new("p").cidr("192.0.2.0/29");
    let share = |a: ServiceSpec, b: ServiceSpec| {
        let mut lb = LbIpam::new();
        lb.apply_pools(vec![pool.clone()]).unwrap();
        let (ida, idb) = (a.id(), b.id());
        lb.apply_service(a).unwrap();
        lb.apply_service(b).unwrap();
        lb.service_status(&ida).unwrap().addresses() == lb.service_status(&idb).unwrap().addresses()
    };
    assert!(share(
        keyed("a", "x", "k", false, 80),
        keyed("a", "y", "k", false, 81)
    ));
    assert!(!share(
        keyed("a", "x", "k", false, 80),
        keyed("b", "y", "k", false, 81)
    ));
    assert!(!share(
        keyed("a", "x", "k", true, 80),
        keyed("b", "y", "k", false, 81)
    ));
    assert!(share(
        keyed("a", "x", "k", true, 80),
        keyed("b", "y", "k", true, 81)
    ));
}

#[test]
fn statuses_become_conditions_naming_why() {
    let assigned = ServiceStatus {
        assignment: Assignment::Assigned {
            addresses: vec!["192.0.2.1".parse().unwrap()],
        },
        missing_family: None,
        last_change_reason: None,
    };
    let o = service_outcome(Some(&assigned), None).unwrap();
    assert_eq!(o.ingress, vec!["192.0.2.1".parse::<IpAddr>().unwrap()]);
    assert_eq!(
        (o.condition.status.as_str(), o.condition.reason.as_str()),
        ("True", "Assigned")
    );
    assert!(!o.condition.is_failure());
    let cases = [
        (
            PendingReason::Exhausted {
                family: crate::cidr::Family::V4,
                pools: vec!["p".into()],
            },
            "PoolExhausted",
        ),
        (
            PendingReason::NoPoolSelects {
                family: crate::cidr::Family::V6,
            },
            "NoPool",
        ),
        (
            PendingReason::AddressTaken {
                address: "192.0.2.1".parse().unwrap(),
                by: "a/x".into(),
            },
            "RequestedTaken",
        ),
        (
            PendingReason::RequestedOutsidePools {
                address: "198.51.100.1".parse().unwrap(),
            },
            "RequestedOutsidePools",
        ),
    ];
    for (reason, want) in cases {
        let st = ServiceStatus {
            assignment: Assignment::Pending {
                reason: reason.clone(),
            },
            missing_family: None,
            last_change_reason: None,
        };
        let o = service_outcome(Some(&st), None).unwrap();
        assert!(o.ingress.is_empty());
        assert_eq!(o.condition.reason, want);
        assert_eq!(o.condition.message, reason.to_string());
        assert!(o.condition.is_failure());
    }
    assert_eq!(service_outcome(None, None), None);
    let bad = Invalid {
        field: "spec.ipFamilyPolicy".into(),
        problem: "x".into(),
    };
    let o = service_outcome(Some(&assigned), Some(&bad)).unwrap();
    assert_eq!(o.condition.reason, "InvalidRequest");
    assert!(o.condition.message.contains("spec.ipFamilyPolicy"));
}

#[test]
fn events_come_on_a_change_of_reason_only() {
    let a = Condition::new(SERVICE_CONDITION, false, "PoolExhausted", "full");
    let b = Condition::new(SERVICE_CONDITION, true, "Assigned", "assigned 192.0.2.1");
    assert_eq!(
        event_for(None, &a),
        Some((true, "PoolExhausted".into(), "full".into()))
    );
    assert_eq!(event_for(Some(&a), &a), None);
    assert_eq!(event_for(Some(&a), &b).map(|e| e.0), Some(false));
}

#[test]
fn pools_are_read_with_named_fields_and_the_same_validation() {
    let mut p = KubePool {
        name: "pub".into(),
        cidrs: vec!["192.0.2.0/24".into()],
        ranges: vec![("198.51.100.10".into(), "198.51.100.20".into())],
        announce: Some("l2".into()),
        ..KubePool::default()
    };
    let spec = pool_spec(&p).unwrap();
    assert_eq!(spec.cidrs.len(), 1);
    assert_eq!(spec.ranges.len(), 1);
    assert_eq!(spec.announce, Some(Announce::L2));
    p.cidrs.push("192.0.2.5/24".into());
    let e = pool_spec(&p).unwrap_err();
    assert_eq!(e.field, "spec");
    assert!(e.problem.contains("cidrs[1]"), "{e}");
    p.cidrs.pop();
    p.ranges[0].1 = "x".into();
    assert_eq!(pool_spec(&p).unwrap_err().field, "spec.ranges[0].stop");
    p.ranges.clear();
    p.announce = Some("bgp".into());
    assert_eq!(pool_spec(&p).unwrap_err().field, "spec.announce");
}

#[test]
fn a_conflicting_pool_names_the_pool_it_overlaps() {
    let mut lb = LbIpam::new();
    lb.apply_pools(vec![LbPoolSpec::new("first").cidr("192.0.2.0/24")])
        .unwrap();
    lb.apply_pools(vec![LbPoolSpec::new("second").cidr("192.0.2.128/25")])
        .unwrap();
    let second = lb.pools().find(|p| p.spec.name == "second").unwrap();
    let o = pool_outcome(Some(&second), None);
    let conflict = o
        .conditions
        .iter()
        .find(|c| c.type_ == POOL_CONFLICT)
        .unwrap();
    assert_eq!(conflict.status, "True");
    assert!(
        conflict.message.contains("pool first"),
        "{}",
        conflict.message
    );
    assert_eq!(o.available.as_deref(), Some("0"));
    let first = lb.pools().find(|p| p.spec.name == "first").unwrap();
    let o = pool_outcome(Some(&first), None);
    assert_eq!(o.total.as_deref(), Some("254"));
    assert_eq!(o.available.as_deref(), Some("254"));
    let o = pool_outcome(None, Some("bad cidr"));
    assert_eq!(o.conditions[0].status, "False");
}

#[test]
fn node_addresses_are_the_first_internal_ip_of_each_family() {
    let a = |k: &str, v: &str| (k.to_string(), v.to_string());
    let (v4, v6) = internal_ips(&[
        a("ExternalIP", "203.0.113.1"),
        a("InternalIP", "fd00::1"),
        a("InternalIP", "10.0.0.1"),
        a("InternalIP", "10.0.0.2"),
        a("Hostname", "n1"),
    ]);
    assert_eq!(v4, Some("10.0.0.1".parse().unwrap()));
    assert_eq!(v6, Some("fd00::1".parse().unwrap()));
    let node = BTreeMap::from([
        ("zone".to_string(), "a".to_string()),
        ("x".into(), "1".into()),
    ]);
    let conf = BTreeMap::from([("zone".to_string(), "b".to_string())]);
    let l = node_labels(&node, &conf);
    assert_eq!(l["zone"], "b");
    assert_eq!(l["x"], "1");
}

fn cond(t: &str, s: bool, r: &str) -> Condition {
    Condition::new(t, s, r, "m")
}

proptest! {
    /// Whatever a Service says, it is lockstep's exactly when it is a
    /// LoadBalancer of the class or none; and a request that is lockstep's
    /// either passes the core's validation or is refused with a field.
    #[test]
    fn class_filter_and_validation_hold(
        type_ in prop::option::of(prop::sample::select(vec!["LoadBalancer", "ClusterIP", "NodePort"])),
        class in prop::option::of(prop::sample::select(vec![DEFAULT_CLASS, "other.io/lb", ""])),
        ips in prop::collection::vec(prop::sample::select(vec!["10.0.0.1", "fd00::1", "x", " 10.0.0.2"]), 0..3),
        policy in prop::option::of(prop::sample::select(vec!["SingleStack", "PreferDualStack", "RequireDualStack", "Bad"])),
        families in prop::collection::vec(prop::sample::select(vec!["IPv4", "IPv6"]), 0..3),
    ) {
        let mut s = lb_service("ns", "svc");
        s.type_ = type_.map(Into::into);
        s.load_balancer_class = class.map(Into::into);
        if !ips.is_empty() {
            s.annotations.insert(IPS_ANNOTATION.into(), ips.join(","));
        }
        s.ip_family_policy = policy.map(Into::into);
        s.ip_families = families.into_iter().map(Into::into).collect();
        let ours = type_ == Some("LoadBalancer") && class.is_none_or(|c| c == DEFAULT_CLASS);
        match lb_request(&s, DEFAULT_CLASS) {
            Request::NotOurs => prop_assert!(!ours),
            Request::Wanted(spec) => {
                prop_assert!(ours);
                prop_assert!(spec.validate().is_ok());
                prop_assert_eq!(spec.id(), "ns/svc");
            }
            Request::Invalid(i) => {
                prop_assert!(ours);
                prop_assert!(i.field.starts_with("spec") || i.field.starts_with("metadata"));
            }
        }
    }

    /// Merging keeps every other writer's condition in place, holds one
    /// condition of the type, and moves its time only on a status change.
    #[test]
    fn merging_a_condition_keeps_the_rest(
        others in prop::collection::vec(prop::sample::select(vec!["Ready", "x.io/Y", "Z"]), 0..4),
        had in prop::option::of(any::<bool>()),
        now_ok in any::<bool>(),
    ) {
        let mut current: Vec<TimedCondition> = others
            .iter()
            .map(|t| TimedCondition {
                condition: cond(t, true, "R"),
                last_transition_time: "t0".into(),
                observed_generation: None,
            })
            .collect();
        if let Some(ok) = had {
            current.insert(current.len() / 2, TimedCondition {
                condition: cond(SERVICE_CONDITION, ok, "Old"),
                last_transition_time: "t0".into(),
                observed_generation: Some(1),
            });
        }
        let merged = merge_condition(&current, cond(SERVICE_CONDITION, now_ok, "New"), "t1", Some(2));
        let ours: Vec<&TimedCondition> = merged.iter().filter(|c| c.condition.type_ == SERVICE_CONDITION).collect();
        prop_assert_eq!(ours.len(), 1);
        prop_assert_eq!(&ours[0].condition.reason, "New");
        let moved = had != Some(now_ok);
        prop_assert_eq!(ours[0].last_transition_time == "t1", moved);
        let rest: Vec<&TimedCondition> = merged.iter().filter(|c| c.condition.type_ != SERVICE_CONDITION).collect();
        let before: Vec<&TimedCondition> = current.iter().filter(|c| c.condition.type_ != SERVICE_CONDITION).collect();
        prop_assert_eq!(rest, before);
        prop_assert_eq!(drop_condition(&merged, SERVICE_CONDITION).len(), others.len());
    }
}

proptest! {
    /// A note of any length and any characters fits the API's 1 KiB, keeps
    /// as much of the message as fits, and is never cut inside a
    /// character.
    #[test]
    fn an_event_note_fits_the_apis_limit(note in "\\PC{0,1500}") {
        let cut = cut_note(&note);
        prop_assert!(cut.len() <= EVENT_NOTE_MAX);
        if note.len() <= EVENT_NOTE_MAX {
            prop_assert_eq!(&cut, &note);
        } else {
            let kept = cut.strip_suffix('…').expect("a cut note ends with the mark");
            prop_assert!(note.starts_with(kept));
            prop_assert!(kept.len() + 4 > EVENT_NOTE_MAX - '…'.len_utf8());
        }
    }
}
