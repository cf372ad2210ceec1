use super::*;
use proptest::prelude::*;

fn pool(name: &str, cidr: &str) -> LbPoolSpec {
    LbPoolSpec::new(name).cidr(cidr)
}

fn svc(name: &str) -> ServiceSpec {
    ServiceSpec::new("default", name)
}

fn nodes(n: usize) -> Vec<Candidate> {
    (0..n)
        .map(|i| Candidate {
            name: format!("node-{i}"),
            labels: BTreeMap::from([("zone".to_string(), format!("z{}", i % 2))]),
            answers: true,
        })
        .collect()
}

#[test]
fn from_nothing_every_service_gets_its_own_address_and_all_are_added() {
    let services: Vec<ServiceSpec> = (0..10).map(|i| svc(&format!("s{i}"))).collect();
    let c = reconcile(None, vec![pool("p", "192.0.2.0/28")], services).unwrap();
    assert!(c.changed);
    assert_eq!(c.added.len(), 10);
    assert!(c.added.values().all(|s| s.len() == 1));
    assert!(c.removed.is_empty());
}

#[test]
fn applying_the_same_again_changes_nothing_and_assignments_stick() {
    let services: Vec<ServiceSpec> = (0..5).map(|i| svc(&format!("s{i}"))).collect();
    let first = reconcile(None, vec![pool("p", "192.0.2.0/28")], services.clone()).unwrap();
    let again = reconcile(
        Some(&first.state),
        vec![pool("p", "192.0.2.0/28")],
        services,
    )
    .unwrap();
    assert!(!again.changed, "a repeat stores nothing");
    assert!(again.added.is_empty() && again.removed.is_empty());
    // One more service: the others keep theirs.
    let mut more: Vec<ServiceSpec> = (0..6).map(|i| svc(&format!("s{i}"))).collect();
    more.rotate_left(3);
    let grown = reconcile(Some(&first.state), vec![pool("p", "192.0.2.0/28")], more).unwrap();
    assert_eq!(grown.added.len(), 1);
    assert_eq!(
        grown.added.values().next().unwrap(),
        &BTreeSet::from(["default/s5".to_string()])
    );
    let before = assigned(&LbIpam::restore(&first.state).unwrap());
    let after = assigned(&LbIpam::restore(&grown.state).unwrap());
    for (a, s) in before {
        assert_eq!(after.get(&a), Some(&s), "{a} moved");
    }
}

#[test]
fn a_service_gone_from_the_store_frees_its_address() {
    let c = reconcile(
        None,
        vec![pool("p", "192.0.2.0/30")],
        vec![svc("a"), svc("b")],
    )
    .unwrap();
    let b_addr = *c
        .added
        .iter()
        .find(|(_, s)| s.contains("default/b"))
        .unwrap()
        .0;
    let d = reconcile(
        Some(&c.state),
        vec![pool("p", "192.0.2.0/30")],
        vec![svc("a")],
    )
    .unwrap();
    assert_eq!(d.removed, BTreeSet::from([b_addr]));
    assert!(d.added.is_empty());
}

#[test]
fn a_pool_gone_leaves_its_services_pending_and_frees_their_addresses() {
    let c = reconcile(None, vec![pool("p", "192.0.2.0/30")], vec![svc("a")]).unwrap();
    let d = reconcile(Some(&c.state), vec![], vec![svc("a")]).unwrap();
    assert_eq!(d.removed.len(), 1);
    let lb = LbIpam::restore(&d.state).unwrap();
    assert!(lb.service_status("default/a").unwrap().pending().is_some());
}

#[test]
fn an_invalid_service_is_an_error_and_nothing_is_decided() {
    let mut bad = svc("x");
    bad.load_balancer_ips = vec!["192.0.2.1".parse().unwrap(), "192.0.2.2".parse().unwrap()];
    assert!(reconcile(None, vec![pool("p", "192.0.2.0/30")], vec![bad]).is_err());
}

#[test]
fn the_announcer_is_one_admitted_node_and_stable() {
    let ns = nodes(5);
    let a: IpAddr = "192.0.2.7".parse().unwrap();
    let all = LabelSelector::default();
    let chosen = announcer(a, &all, &ns).unwrap().name.clone();
    assert_eq!(
        announcer(a, &all, &ns).unwrap().name,
        chosen,
        "deterministic"
    );
    // Order of the list does not matter.
    let mut rev = ns.clone();
    rev.reverse();
    assert_eq!(announcer(a, &all, &rev).unwrap().name, chosen);
    // A selector admits only matching nodes.
    let z1: LabelSelector =
        serde_json::from_value(serde_json::json!({"matchLabels": {"zone": "z1"}})).unwrap();
    let n = announcer(a, &z1, &ns).unwrap();
    assert_eq!(n.labels["zone"], "z1");
    let none: LabelSelector =
        serde_json::from_value(serde_json::json!({"matchLabels": {"zone": "z9"}})).unwrap();
    assert!(announcer(a, &none, &ns).is_none());
    assert!(announcer(a, &all, &[]).is_none());
}

#[test]
fn the_announce_plan_takes_keeps_waits_and_drops() {
    let ns = nodes(3);
    let all = LabelSelector::default();
    let addrs: BTreeMap<IpAddr, LabelSelector> = (0..64u32)
        .map(|i| {
            (
                IpAddr::from(std::net::Ipv4Addr::from(0xC000_0200 + i)),
                all.clone(),
            )
        })
        .collect();
    // Nobody holds anything: each address is taken by exactly one node.
    let plans: Vec<AnnouncePlan> = ns
        .iter()
        .map(|n| announce_plan(&addrs, &ns, &n.name, &BTreeMap::new()))
        .collect();
    let mut taken: Vec<IpAddr> = plans.iter().flat_map(|p| p.take.clone()).collect();
    taken.sort();
    assert_eq!(taken, addrs.keys().copied().collect::<Vec<_>>());
    assert!(plans.iter().all(|p| p.wait.is_empty() && p.drop.is_empty()));
    // Everything held as planned: all keep.
    let held: BTreeMap<IpAddr, String> = ns
        .iter()
        .zip(&plans)
        .flat_map(|(n, p)| p.take.iter().map(|a| (*a, n.name.clone())))
        .collect();
    for n in &ns {
        let p = announce_plan(&addrs, &ns, &n.name, &held);
        assert!(p.take.is_empty() && p.wait.is_empty() && p.drop.is_empty());
    }
    // node-0 leaves the live set while its keys still stand: the others
    // wait for them; node-0 (if it still runs) drops them.
    let rest: Vec<Candidate> = ns[1..].to_vec();
    let of0: BTreeSet<IpAddr> = held
        .iter()
        .filter(|(_, n)| *n == "node-0")
        .map(|(a, _)| *a)
        .collect();
    let waits: BTreeSet<IpAddr> = rest
        .iter()
        .flat_map(|n| announce_plan(&addrs, &rest, &n.name, &held).wait)
        .collect();
    assert_eq!(waits, of0);
    let p0 = announce_plan(&addrs, &rest, "node-0", &held);
    assert_eq!(p0.drop.iter().copied().collect::<BTreeSet<_>>(), of0);
    // An address gone from the state is dropped by its holder.
    let mut fewer = addrs.clone();
    let gone = *addrs.keys().next().unwrap();
    fewer.remove(&gone);
    let holder = &held[&gone];
    assert!(
        announce_plan(&fewer, &ns, holder, &held)
            .drop
            .contains(&gone)
    );
}

fn zone(z: &str) -> LabelSelector {
    serde_json::from_value(serde_json::json!({"matchLabels": {"zone": z}})).unwrap()
}

#[test]
fn each_announced_address_carries_its_pools_node_selector() {
    let mut a = pool("a", "192.0.2.0/30").node_selector(zone("z1"));
    a.announce = Some(crate::lb::Announce::L2);
    let mut b = pool("b", "198.51.100.0/30");
    b.announce = Some(crate::lb::Announce::L2);
    // Not announced at all (routed by other means): not in the map.
    let c = pool("c", "203.0.113.0/30");
    let s = |n: &str, p: &str| {
        let mut s = svc(n);
        s.labels.insert("pool".into(), p.into());
        s
    };
    let sel = |p: &str| {
        serde_json::from_value::<LabelSelector>(serde_json::json!({"matchLabels": {"pool": p}}))
            .unwrap()
    };
    let pools = vec![
        a.selector(sel("a")),
        b.selector(sel("b")),
        c.selector(sel("c")),
    ];
    let ch = reconcile(None, pools, vec![s("x", "a"), s("y", "b"), s("z", "c")]).unwrap();
    let lb = LbIpam::restore(&ch.state).unwrap();
    let t = to_announce(&lb);
    assert_eq!(t.len(), 2, "{t:?}");
    let of = |pool: &str| t.values().find(|v| v.pool == pool).unwrap().clone();
    assert_eq!(of("a").node_selector, zone("z1"));
    assert!(of("b").node_selector.is_empty());
    // With nodes of zone z0 only, pool a's address is announced by nobody
    // and named; pool b's is announced.
    let only_z0: Vec<Candidate> = nodes(4)
        .into_iter()
        .filter(|n| n.labels["zone"] == "z0")
        .collect();
    let un = unannounced(&t, only_z0.iter());
    assert_eq!(
        un.values().cloned().collect::<Vec<_>>(),
        vec!["a".to_string()]
    );
    assert!(unannounced(&t, nodes(4).iter()).is_empty());
    let selectors: BTreeMap<IpAddr, LabelSelector> = t
        .iter()
        .map(|(a, v)| (*a, v.node_selector.clone()))
        .collect();
    let plans: Vec<AnnouncePlan> = only_z0
        .iter()
        .map(|n| announce_plan(&selectors, &only_z0, &n.name, &BTreeMap::new()))
        .collect();
    let taken: BTreeSet<IpAddr> = plans.iter().flat_map(|p| p.take.clone()).collect();
    assert_eq!(taken.len(), 1, "only pool b's address is taken");
    assert!(!un.contains_key(taken.iter().next().unwrap()));
}

#[test]
fn a_bad_node_selector_is_refused_naming_the_field() {
    let bad: LabelSelector = serde_json::from_value(
        serde_json::json!({"matchExpressions": [{"key": "zone", "operator": "In", "values": []}]}),
    )
    .unwrap();
    let e = pool("p", "192.0.2.0/30")
        .node_selector(bad)
        .validate()
        .unwrap_err()
        .to_string();
    assert!(e.contains("node_selector.match_expressions[0]"), "{e}");
    // JSON takes either spelling, and a pool without one reads as before.
    let p: LbPoolSpec = serde_json::from_value(
        serde_json::json!({"name": "p", "cidrs": ["192.0.2.0/30"], "nodeSelector": {"matchLabels": {"zone": "b"}}}),
    )
    .unwrap();
    assert_eq!(p.node_selector, zone("b"));
    let back = serde_json::to_value(&p).unwrap();
    assert_eq!(back["node_selector"]["match_labels"]["zone"], "b");
    let old: LbPoolSpec =
        serde_json::from_value(serde_json::json!({"name": "p", "cidrs": ["192.0.2.0/30"]}))
            .unwrap();
    assert!(old.node_selector.is_empty());
    assert!(
        serde_json::to_value(&old)
            .unwrap()
            .get("node_selector")
            .is_none()
    );
}

proptest! {
    /// The announcer, when there is one, is admitted by the selector; there
    /// is none exactly when no node is admitted.
    #[test]
    fn the_announcer_is_admitted_or_there_is_none(n in 0usize..6, z in 0usize..3, i in 0u32..256) {
        let ns = nodes(n);
        let sel = zone(&format!("z{z}"));
        let a = IpAddr::from(std::net::Ipv4Addr::from(0xC000_0200 + i));
        let admitted = ns.iter().any(|c| sel.matches(&c.labels));
        match announcer(a, &sel, &ns) {
            Some(c) => prop_assert!(sel.matches(&c.labels)),
            None => prop_assert!(!admitted),
        }
    }


    /// A node that cannot answer (no uplink) is never the announcer, and
    /// takes nothing from the others: the announcer among all nodes is the
    /// announcer among those that answer. With none that answers, the
    /// address is unannounced.
    #[test]
    fn a_node_that_cannot_answer_never_announces(n in 1usize..6, silent in 0u32..64, i in 0u32..256) {
        let mut ns = nodes(n);
        for (k, c) in ns.iter_mut().enumerate() {
            c.answers = silent & (1 << k) == 0;
        }
        let answering: Vec<Candidate> = ns.iter().filter(|c| c.answers).cloned().collect();
        let all = LabelSelector::default();
        let a = IpAddr::from(std::net::Ipv4Addr::from(0xC000_0200 + i));
        let chosen = announcer(a, &all, &ns);
        prop_assert!(chosen.is_none_or(|c| c.answers));
        prop_assert_eq!(chosen, announcer(a, &all, &answering));
        let to = BTreeMap::from([(a, ToAnnounce { pool: "p".into(), node_selector: all.clone() })]);
        prop_assert_eq!(unannounced(&to, ns.iter()).is_empty(), !answering.is_empty());
        // The plan of a node that cannot answer takes nothing and gives up
        // what it holds.
        for c in ns.iter().filter(|c| !c.answers) {
            let held = BTreeMap::from([(a, c.name.clone())]);
            let plan = announce_plan(&BTreeMap::from([(a, all.clone())]), &ns, &c.name, &held);
            prop_assert!(plan.take.is_empty() && plan.keep.is_empty());
            prop_assert_eq!(plan.drop, vec![a]);
        }
    }

    /// Removing a node moves only the addresses it announced; adding one
    /// moves addresses only to the new node. Across many addresses every
    /// node gets some.
    #[test]
    fn rendezvous_moves_only_what_it_must(n in 2usize..8, gone in 0usize..8) {
        let ns = nodes(n);
        let gone = gone % n;
        let fewer: Vec<Candidate> = ns.iter().enumerate().filter(|(i, _)| *i != gone).map(|(_, c)| c.clone()).collect();
        let all = LabelSelector::default();
        let mut per_node: BTreeMap<String, usize> = BTreeMap::new();
        for i in 0..512u32 {
            let a = IpAddr::from(std::net::Ipv4Addr::from(0xC000_0200 + i));
            let before = announcer(a, &all, &ns).unwrap().name.clone();
            let after = announcer(a, &all, &fewer).unwrap().name.clone();
            if before != ns[gone].name {
                prop_assert_eq!(&before, &after, "{} moved without cause", a);
            }
            *per_node.entry(before).or_default() += 1;
        }
        prop_assert_eq!(per_node.len(), n, "some node announces nothing: {:?}", per_node);
    }
}
