use std::net::IpAddr;

use proptest::prelude::*;

use super::super::{Condition, DEFAULT_CLASS, IPS_ANNOTATION, KubeService, Request};
use super::*;

fn lb_service() -> KubeService {
    KubeService {
        namespace: "ns".into(),
        name: "svc".into(),
        type_: Some("LoadBalancer".into()),
        ..KubeService::default()
    }
}

fn pools() -> Vec<LbPoolSpec> {
    vec![
        LbPoolSpec::new("v4").cidr("10.250.0.128/25"),
        LbPoolSpec::new("v6").range("fd00:250::10", "fd00:250::20"),
    ]
}

fn serving(pools: &[LbPoolSpec]) -> Serving<'_> {
    Serving {
        class: DEFAULT_CLASS,
        classless: true,
        pools,
    }
}

fn ip(s: &str) -> IpAddr {
    s.parse().expect("an address")
}

fn assigned(addrs: &str) -> Condition {
    Condition::new(
        SERVICE_CONDITION,
        true,
        "Assigned",
        format!("assigned {addrs}"),
    )
}

fn pending() -> Condition {
    Condition::new(SERVICE_CONDITION, false, "NoPool", "no pool selects it")
}

fn requested(r: Request) -> Vec<IpAddr> {
    match r {
        Request::Wanted(s) => s.load_balancer_ips,
        other => panic!("expected a request, got {other:?}"),
    }
}

#[test]
fn class_less_services_are_served_only_when_configured() {
    let pools = pools();
    let s = lb_service();
    assert!(matches!(request(&s, &serving(&pools)), Request::Wanted(_)));
    let off = Serving {
        classless: false,
        ..serving(&pools)
    };
    assert_eq!(request(&s, &off), Request::NotOurs);
    let mut classed = s.clone();
    classed.load_balancer_class = Some(DEFAULT_CLASS.into());
    assert!(matches!(request(&classed, &off), Request::Wanted(_)));
}

#[test]
fn another_controllers_address_outside_the_pools_is_left_alone() {
    let pools = pools();
    let mut s = lb_service();
    s.ingress = vec!["203.0.113.10".into()];
    assert_eq!(request(&s, &serving(&pools)), Request::NotOurs);
    // A cloud load balancer's host name, too.
    s.ingress = vec!["a1b2.elb.example.com".into()];
    assert_eq!(request(&s, &serving(&pools)), Request::NotOurs);
    // One address inside and one outside: still not wholly lockstep's.
    s.ingress = vec!["10.250.0.150".into(), "203.0.113.10".into()];
    assert_eq!(request(&s, &serving(&pools)), Request::NotOurs);
    // Before any pool exists, every address is outside.
    s.ingress = vec!["10.250.0.150".into()];
    assert_eq!(request(&s, &serving(&[])), Request::NotOurs);
}

#[test]
fn an_address_in_a_pool_is_adopted_until_lockstep_has_written_its_own() {
    let pools = pools();
    let mut s = lb_service();
    s.ingress = vec!["10.250.0.150".into()];
    assert_eq!(
        requested(request(&s, &serving(&pools))),
        [ip("10.250.0.150")]
    );
    // Lockstep's own pending condition does not make the address its own.
    s.condition = Some(pending());
    assert_eq!(
        requested(request(&s, &serving(&pools))),
        [ip("10.250.0.150")]
    );
    // Once lockstep wrote it, its state holds the assignment: no request.
    s.condition = Some(assigned("10.250.0.150"));
    assert!(requested(request(&s, &serving(&pools))).is_empty());
}

#[test]
fn the_users_request_wins_over_an_adopted_address() {
    let pools = pools();
    let mut s = lb_service();
    s.ingress = vec!["10.250.0.150".into()];
    s.annotations
        .insert(IPS_ANNOTATION.into(), "10.250.0.140".into());
    assert_eq!(
        requested(request(&s, &serving(&pools))),
        [ip("10.250.0.140")]
    );
}

#[test]
fn adoption_takes_only_the_families_the_service_asks_for() {
    let pools = pools();
    let mut s = lb_service();
    s.ingress = vec!["fd00:250::11".into(), "10.250.0.150".into()];
    // Single stack IPv4 (the default): the IPv6 address is not taken.
    assert_eq!(
        requested(request(&s, &serving(&pools))),
        [ip("10.250.0.150")]
    );
    s.ip_family_policy = Some("RequireDualStack".into());
    s.ip_families = vec!["IPv4".into(), "IPv6".into()];
    assert_eq!(
        requested(request(&s, &serving(&pools))),
        [ip("10.250.0.150"), ip("fd00:250::11")]
    );
}

#[test]
fn an_explicit_class_is_lockstep_s_whatever_its_status_holds() {
    let pools = pools();
    let mut s = lb_service();
    s.load_balancer_class = Some(DEFAULT_CLASS.into());
    s.ingress = vec!["203.0.113.10".into()];
    assert!(requested(request(&s, &serving(&pools))).is_empty());
}

fn outcome(ingress: &[&str], condition: Condition) -> ServiceOutcome {
    ServiceOutcome {
        ingress: ingress.iter().map(|a| ip(a)).collect(),
        condition,
    }
}

#[test]
fn nothing_is_written_on_a_service_before_a_pool_exists() {
    let s = lb_service();
    assert_eq!(
        status_change(&s, Some(&outcome(&[], pending())), false),
        None
    );
    // A Service lockstep wrote before its pools went is kept up to date.
    let mut had = lb_service();
    had.ingress = vec!["10.250.0.150".into()];
    had.condition = Some(assigned("10.250.0.150"));
    assert_eq!(
        status_change(&had, Some(&outcome(&[], pending())), false),
        Some(StatusChange {
            ingress: Some(Vec::new()),
            condition: Some(pending()),
        })
    );
}

#[test]
fn an_empty_ingress_never_replaces_an_address_lockstep_did_not_write() {
    let mut s = lb_service();
    s.ingress = vec!["10.250.0.150".into()];
    // Adopted but taken by another Service: the condition says so, the
    // address stays.
    let taken = Condition::new(SERVICE_CONDITION, false, "RequestedTaken", "taken");
    assert_eq!(
        status_change(&s, Some(&outcome(&[], taken.clone())), true),
        Some(StatusChange {
            ingress: None,
            condition: Some(taken.clone()),
        })
    );
    s.condition = Some(taken.clone());
    assert_eq!(status_change(&s, Some(&outcome(&[], taken)), true), None);
    // No longer lockstep's: its condition comes off, the address stays.
    assert_eq!(
        status_change(&s, None, true),
        Some(StatusChange {
            ingress: None,
            condition: None,
        })
    );
}

#[test]
fn lockstep_s_own_ingress_is_replaced_and_removed() {
    let mut s = lb_service();
    s.ingress = vec!["10.250.0.150".into()];
    s.condition = Some(assigned("10.250.0.150"));
    assert_eq!(
        status_change(
            &s,
            Some(&outcome(&["10.250.0.150"], assigned("10.250.0.150"))),
            true
        ),
        None
    );
    assert_eq!(
        status_change(
            &s,
            Some(&outcome(&["10.250.0.151"], assigned("10.250.0.151"))),
            true
        ),
        Some(StatusChange {
            ingress: Some(vec![ip("10.250.0.151")]),
            condition: Some(assigned("10.250.0.151")),
        })
    );
    assert_eq!(
        status_change(&s, None, true),
        Some(StatusChange {
            ingress: Some(Vec::new()),
            condition: None,
        })
    );
    // Nothing of lockstep's on it: nothing to remove.
    assert_eq!(status_change(&lb_service(), None, true), None);
}

fn ingress_entry() -> impl Strategy<Value = String> {
    prop::sample::select(vec![
        "10.250.0.150",
        "10.250.0.200",
        "203.0.113.10",
        "fd00:250::11",
        "fd00:99::1",
        "lb.example.com",
    ])
    .prop_map(String::from)
}

fn condition() -> impl Strategy<Value = Option<Condition>> {
    prop::option::of(prop::sample::select(vec![
        assigned("x"),
        pending(),
        Condition::new(SERVICE_CONDITION, false, "RequestedTaken", "taken"),
    ]))
}

proptest! {
    /// Whatever the status holds and whatever lockstep wants to say: an
    /// ingress lockstep did not write (its condition not `True`) is never
    /// emptied nor replaced by an empty one, and a Service lockstep never
    /// wrote gets nothing while no pool exists.
    #[test]
    fn another_controllers_ingress_is_never_emptied(
        ingress in prop::collection::vec(ingress_entry(), 0..3),
        had in condition(),
        want in prop::option::of((prop::collection::vec(prop::sample::select(vec!["10.250.0.150", "10.250.0.151"]), 0..2), condition())),
        pools_exist in any::<bool>(),
    ) {
        let mut s = lb_service();
        s.ingress = ingress;
        s.condition = had.clone();
        let want = want.and_then(|(addrs, c)| c.map(|c| outcome(&addrs, c)));
        let change = status_change(&s, want.as_ref(), pools_exist);
        let ours = had.as_ref().is_some_and(|c| c.status == "True");
        if let Some(change) = &change {
            if !ours && !s.ingress.is_empty() {
                prop_assert!(change.ingress.as_ref().is_none_or(|i| !i.is_empty()));
            }
            if had.is_none() {
                prop_assert!(pools_exist);
            }
        }
    }

    /// A class-less Service whose status holds an address lockstep did not
    /// write is lockstep's only when every entry lies in its pools, and
    /// then those addresses (of the families it asks for) are requested.
    #[test]
    fn a_foreign_ingress_is_taken_only_inside_the_pools(
        ingress in prop::collection::vec(ingress_entry(), 1..3),
        had in condition(),
    ) {
        let pools = pools();
        let mut s = lb_service();
        s.ingress = ingress.clone();
        s.condition = had.clone();
        let ours = had.as_ref().is_some_and(|c| c.status == "True");
        let inside = ingress
            .iter()
            .all(|e| e.parse::<IpAddr>().is_ok_and(|a| pools.iter().any(|p| p.holds(a))));
        match request(&s, &serving(&pools)) {
            Request::NotOurs => prop_assert!(!ours && !inside),
            Request::Wanted(spec) => {
                prop_assert!(ours || inside);
                for a in &spec.load_balancer_ips {
                    prop_assert!(!ours && ingress.contains(&a.to_string()));
                }
            }
            Request::Invalid(i) => prop_assert!(false, "invalid: {i}"),
        }
    }
}

#[test]
fn a_follower_holds_exactly_what_the_writer_wrote() {
    let pools = pools();
    let mut s = lb_service();
    // Nothing written yet: the follower holds nothing (it never assigns).
    assert_eq!(follow(&s, &serving(&pools)), None);
    s.ingress = vec!["10.250.0.150".into()];
    s.condition = Some(assigned("10.250.0.150"));
    let spec = follow(&s, &serving(&pools)).expect("written by the writer: followed");
    assert_eq!(spec.load_balancer_ips, vec![ip("10.250.0.150")]);
    // The user asked for another address: the writer's answer still wins
    // until the writer changes it.
    let mut asked = s.clone();
    asked
        .annotations
        .insert(IPS_ANNOTATION.into(), "10.250.0.200".into());
    let spec = follow(&asked, &serving(&pools)).expect("followed");
    assert_eq!(spec.load_balancer_ips, vec![ip("10.250.0.150")]);
    // Not lockstep's condition (another controller's ingress): nothing.
    s.condition = Some(pending());
    assert_eq!(follow(&s, &serving(&pools)), None);
    // No longer served (class turned off): nothing.
    s.condition = Some(assigned("10.250.0.150"));
    let off = Serving {
        classless: false,
        ..serving(&pools)
    };
    assert_eq!(follow(&s, &off), None);
    // An ingress outside every pool (the pool shrank): nothing to mirror.
    s.ingress = vec!["10.9.9.9".into()];
    assert_eq!(follow(&s, &serving(&pools)), None);
}
