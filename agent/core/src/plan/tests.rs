use super::*;
use crate::cidr::Family;
use crate::manager::{ManagerConfig, MasqueradeRule, StaticPools};
use crate::owner::Generation;
use crate::pool::{PoolSpec, pool_id};
use proptest::prelude::*;
use std::collections::BTreeSet;

fn net(s: &str) -> IpNet {
    s.parse().unwrap()
}

fn v4(s: &str) -> Ipv4Net {
    s.parse().unwrap()
}

fn manager(skip: bool) -> PoolManager<StaticPools> {
    let spec = PoolSpec::new("pods")
        .with_cidr(net("10.0.0.0/24"))
        .with_cidr(net("fd00::/64"))
        .skip_masquerade(skip);
    let mut m = PoolManager::new(StaticPools(vec![spec]), ManagerConfig::default()).unwrap();
    m.sync().into_result().unwrap();
    m
}

fn value(identity: u32, flags: u32, ifindex: u32) -> IpcacheValue {
    IpcacheValue {
        identity,
        flags,
        ifindex,
        _pad: 0,
        node_addr: [0; 16],
    }
}

#[test]
fn identity_and_flags_follow_the_owner_kind() {
    let mut m = manager(false);
    let owners = [
        Owner::endpoint("c1", "eth0"),
        Owner::agent(AgentRole::Ingress),
        Owner::agent(AgentRole::Health),
        Owner::agent(AgentRole::Router),
        Owner::load_balancer("ns/web"),
        Owner::Delegated {
            container_id: "d".into(),
            ifname: "eth0".into(),
        },
        Owner::Resource {
            kind: "test".into(),
            name: "x".into(),
        },
    ];
    for o in owners {
        m.allocate_next("pods", Family::V4, o).unwrap();
    }
    let ep6 = m
        .allocate_next("pods", Family::V6, Owner::endpoint("c1", "eth0"))
        .unwrap();
    let ifindex = |a: &Allocation| EntryExtra {
        ifindex: match &a.owner {
            Owner::Endpoint { .. } => 42,
            _ => 0,
        },
        ..EntryExtra::default()
    };
    let plan = DatapathPlan::from_manager(&m, [], ifindex).unwrap();
    let expected: BTreeMap<Ipv4Net, IpcacheValue> = [
        (
            "10.0.0.1/32",
            value(identity::ENDPOINT, ipcache_flags::ENDPOINT, 42),
        ),
        (
            "10.0.0.2/32",
            value(identity::INGRESS, ipcache_flags::INGRESS, 0),
        ),
        (
            "10.0.0.3/32",
            value(identity::HEALTH, ipcache_flags::HEALTH, 0),
        ),
        (
            "10.0.0.4/32",
            value(identity::ROUTER, ipcache_flags::ROUTER, 0),
        ),
        (
            "10.0.0.5/32",
            value(identity::LOADBALANCER, ipcache_flags::LOADBALANCER, 0),
        ),
        (
            "10.0.0.6/32",
            value(identity::ENDPOINT, ipcache_flags::ENDPOINT, 0),
        ),
    ]
    .into_iter()
    .map(|(k, v)| (v4(k), v))
    .collect();
    assert_eq!(plan.ipcache_v4, expected, "resource owners have no entry");
    let IpAddr::V6(a6) = ep6.address else {
        unreachable!()
    };
    assert_eq!(
        plan.ipcache_v6,
        BTreeMap::from([(
            Ipv6Net::from(a6),
            value(identity::ENDPOINT, ipcache_flags::ENDPOINT, 42)
        )])
    );
    assert!(plan.masq_skip_v4.is_empty());
}

#[test]
fn a_skip_masquerade_flag_change_applies_to_existing_endpoints() {
    let mut m = manager(false);
    m.allocate_next("pods", Family::V4, Owner::endpoint("c1", "eth0"))
        .unwrap();
    let before = DatapathPlan::from_manager(&m, [], |_| EntryExtra::default()).unwrap();
    assert!(before.masq_skip_v4.is_empty());

    m.source_mut().0[0].skip_masquerade = true;
    m.sync().into_result().unwrap();
    let after = DatapathPlan::from_manager(&m, [], |_| EntryExtra::default()).unwrap();
    let pool = MasqSkipValue {
        reason: masq_reason::POOL,
        pool_id: pool_id("pods"),
    };
    assert_eq!(
        after.masq_skip_v4,
        BTreeMap::from([(v4("10.0.0.0/24"), pool)])
    );
    assert_eq!(after.masq_skip_v6.len(), 1);
    assert_eq!(after.ipcache_v4, before.ipcache_v4);
    let d = diff(&after.masq_skip_v4, &before.masq_skip_v4);
    assert_eq!(d.add, vec![(v4("10.0.0.0/24"), pool)]);
}

#[test]
fn configured_non_masquerade_cidrs_are_canonical_and_pools_take_precedence() {
    let m = manager(true);
    let plan = DatapathPlan::from_manager(&m, [net("10.0.0.0/24"), net("192.168.7.9/16")], |_| {
        EntryExtra::default()
    })
    .unwrap();
    assert_eq!(
        plan.masq_skip_v4,
        BTreeMap::from([
            (
                v4("10.0.0.0/24"),
                MasqSkipValue {
                    reason: masq_reason::POOL,
                    pool_id: pool_id("pods"),
                }
            ),
            (
                v4("192.168.0.0/16"),
                MasqSkipValue {
                    reason: masq_reason::CONFIG,
                    pool_id: 0,
                }
            ),
        ])
    );
    // Order of contributions does not matter.
    let mut b = PlanBuilder::default();
    b.masq_skip([net("10.0.0.0/24")], masq_reason::CONFIG, 0);
    b.manager(&m, |_| EntryExtra::default()).unwrap();
    assert_eq!(
        b.finish().masq_skip_v4[&v4("10.0.0.0/24")].reason,
        masq_reason::POOL
    );
}

#[test]
fn the_masquerade_rule_of_the_manager_applies() {
    let spec = PoolSpec::new("lb")
        .with_cidr(net("192.0.2.0/24"))
        .skip_masquerade(true);
    let config = ManagerConfig {
        masquerade: MasqueradeRule::Never,
        ..ManagerConfig::default()
    };
    let mut m = PoolManager::new(StaticPools(vec![spec]), config).unwrap();
    m.sync().into_result().unwrap();
    let plan = DatapathPlan::from_manager(&m, [], |_| EntryExtra::default()).unwrap();
    assert!(plan.masq_skip_v4.is_empty());
}

#[test]
fn one_address_from_two_managers_is_an_error() {
    let mut a = manager(false);
    let mut b = manager(false);
    a.allocate_next("pods", Family::V4, Owner::endpoint("x", "eth0"))
        .unwrap();
    b.allocate_next("pods", Family::V4, Owner::load_balancer("ns/y"))
        .unwrap();
    let mut builder = PlanBuilder::default();
    builder.manager(&a, |_| EntryExtra::default()).unwrap();
    let err = builder.manager(&b, |_| EntryExtra::default()).unwrap_err();
    assert_eq!(
        err.to_string(),
        "address 10.0.0.1 is allocated to both endpoint x/eth0 and loadbalancer ns/y"
    );
}

#[test]
fn observed_keys_with_host_bits_are_canonicalised_before_diffing() {
    let desired = BTreeMap::from([(v4("10.0.0.0/24"), 1u32)]);
    let observed = canonicalize([("10.0.0.7/24".parse::<Ipv4Net>().unwrap(), 1u32)]);
    assert!(diff(&desired, &observed).is_empty());
    let raw = BTreeMap::from([("10.0.0.7/24".parse::<Ipv4Net>().unwrap(), 1u32)]);
    assert_eq!(diff(&desired, &raw).len(), 2, "without canonicalising");
}

#[test]
fn diff_of_a_restored_plan_against_itself_is_empty() {
    let mut m = manager(true);
    for i in 0..50 {
        m.allocate_next("pods", Family::V4, Owner::endpoint(format!("c{i}"), "eth0"))
            .unwrap();
    }
    let plan = DatapathPlan::from_manager(&m, [], |_| EntryExtra::default()).unwrap();
    let mut r = manager(true);
    let outcome = r.restore(Generation(0), m.allocations().cloned());
    assert!(outcome.rejected.is_empty());
    let replan = DatapathPlan::from_manager(&r, [], |_| EntryExtra::default()).unwrap();
    assert!(diff(&replan.ipcache_v4, &plan.ipcache_v4).is_empty());
    assert!(diff(&replan.masq_skip_v4, &plan.masq_skip_v4).is_empty());
}

proptest! {
    /// Applying the diff to the observed map yields the desired map, and the
    /// diff is minimal: each key at most once, adds only for missing keys,
    /// updates only for changed values, deletes only for undesired keys.
    #[test]
    fn diff_applied_to_observed_yields_desired(
        desired in proptest::collection::btree_map(0u16..200, 0u8..4, 0..100),
        observed in proptest::collection::btree_map(0u16..200, 0u8..4, 0..100),
    ) {
        let d = diff(&desired, &observed);
        let mut applied = observed.clone();
        d.apply(&mut applied);
        prop_assert_eq!(&applied, &desired);

        let mut keys = BTreeSet::new();
        for (k, v) in &d.add {
            prop_assert!(!observed.contains_key(k));
            prop_assert_eq!(desired.get(k), Some(v));
            prop_assert!(keys.insert(*k));
        }
        for (k, v) in &d.update {
            prop_assert!(observed.contains_key(k) && observed[k] != *v);
            prop_assert_eq!(desired.get(k), Some(v));
            prop_assert!(keys.insert(*k));
        }
        for k in &d.delete {
            prop_assert!(observed.contains_key(k) && !desired.contains_key(k));
            prop_assert!(keys.insert(*k));
        }
        let changed = desired.iter().filter(|(k, v)| observed.get(k) != Some(v)).count()
            + observed.keys().filter(|k| !desired.contains_key(k)).count();
        prop_assert_eq!(d.len(), changed);
        prop_assert!(diff(&desired, &applied).is_empty());
    }

    /// The same holds for LPM maps after canonicalising observed keys.
    #[test]
    fn lpm_diff_converges(
        desired in proptest::collection::vec((any::<u32>(), 8u8..=32), 0..40),
        observed in proptest::collection::vec((any::<u32>(), 8u8..=32), 0..40),
    ) {
        let mk = |v: &Vec<(u32, u8)>| -> Vec<(Ipv4Net, u8)> {
            v.iter().map(|&(a, p)| (Ipv4Net::new(a.into(), p).unwrap(), p)).collect()
        };
        let desired = canonicalize(mk(&desired));
        let observed = canonicalize(mk(&observed));
        for k in desired.keys().chain(observed.keys()) {
            prop_assert_eq!(*k, k.trunc());
        }
        let mut applied = observed.clone();
        diff(&desired, &observed).apply(&mut applied);
        prop_assert_eq!(applied, desired);
    }
}

mod flat {
    use super::super::*;
    use crate::manager::Allocation;
    use crate::owner::{Generation, Owner};
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    proptest! {
        #[test]
        fn sorted_diff_equals_tree_diff(
            desired in proptest::collection::btree_map(0u16..300, 0u8..4, 0..120),
            observed in proptest::collection::btree_map(0u16..300, 0u8..4, 0..120),
        ) {
            let d: Vec<(u16, u8)> = desired.iter().map(|(k, v)| (*k, *v)).collect();
            let o: Vec<(u16, u8)> = observed.iter().map(|(k, v)| (*k, *v)).collect();
            let flat = diff_sorted(&d, &o);
            prop_assert_eq!(&flat, &diff(&desired, &observed));
            let mut applied = observed.clone();
            flat.apply(&mut applied);
            prop_assert_eq!(applied, desired);
        }

        #[test]
        fn host_entries_equal_the_plan(addrs in proptest::collection::btree_set(0u32..5000, 0..200)) {
            let allocations: Vec<Allocation> = addrs
                .iter()
                .enumerate()
                .map(|(i, a)| Allocation {
                    pool: "p".into(),
                    address: if a % 3 == 0 {
                        IpAddr::V6(std::net::Ipv6Addr::from(u128::from(*a)))
                    } else {
                        IpAddr::V4(std::net::Ipv4Addr::from(*a))
                    },
                    owner: if a % 5 == 0 { Owner::load_balancer(format!("ns/s{i}")) } else { Owner::endpoint(format!("c{i}"), "eth0") },
                    generation: Generation(i as u64 + 1),
                })
                .collect();
            let flat = host_entries(&allocations, |a| EntryExtra { ifindex: a.generation.0 as u32, ..Default::default() }).expect("no duplicates");
            let mut b = PlanBuilder::default();
            b.allocations(&allocations, |a| EntryExtra { ifindex: a.generation.0 as u32, ..Default::default() }).expect("no duplicates");
            let plan = b.finish();
            let tree_v4: BTreeMap<_, _> = plan.ipcache_v4.iter().map(|(n, v)| (n.addr().octets(), *v)).collect();
            let tree_v6: BTreeMap<_, _> = plan.ipcache_v6.iter().map(|(n, v)| (n.addr().octets(), *v)).collect();
            prop_assert_eq!(flat.v4, tree_v4.into_iter().collect::<Vec<_>>());
            prop_assert_eq!(flat.v6, tree_v6.into_iter().collect::<Vec<_>>());
        }
    }

    #[test]
    fn host_entries_refuse_two_owners_of_one_address() {
        let a = Allocation {
            pool: "p".into(),
            address: "10.0.0.1".parse().expect("literal"),
            owner: Owner::endpoint("c1", "eth0"),
            generation: Generation(1),
        };
        let mut b = a.clone();
        b.owner = Owner::endpoint("c2", "eth0");
        let err = host_entries([&a, &b], |_| EntryExtra::default()).expect_err("duplicate");
        assert!(err.to_string().contains("10.0.0.1"), "{err}");
    }
}

proptest! {
    /// A lookup that tries the slot first and falls back to the full map
    /// finds exactly what the full map holds; every slot holds the smallest
    /// key mapped to it; the incremental [`slot_holder`] agrees with the
    /// bulk [`direct_mapped`] for every slot.
    #[test]
    fn direct_mapped_slots_are_a_faithful_front_cache(
        map in proptest::collection::btree_map(0u32..5_000, 0u8..255, 0..200),
        slot_bits in 1u32..6,
        probes in proptest::collection::vec(0u32..5_000, 50),
    ) {
        let mask = (1u32 << slot_bits) - 1;
        let slot_of = |k: &u32| k & mask;
        let entries: Vec<(u32, u8)> = map.iter().map(|(k, v)| (*k, *v)).collect();
        let slots = direct_mapped(&entries, slot_of);
        let by_slot: BTreeMap<u32, (u32, u8)> =
            slots.iter().map(|&(s, k, v)| (s, (k, v))).collect();
        prop_assert_eq!(by_slot.len(), slots.len(), "one entry per slot");
        for (&s, &(k, v)) in &by_slot {
            prop_assert_eq!(slot_of(&k), s);
            prop_assert_eq!(map.get(&k), Some(&v));
            let smallest = map.keys().find(|key| slot_of(key) == s).copied();
            prop_assert_eq!(Some(k), smallest);
        }
        for s in 0..=mask {
            prop_assert_eq!(
                slot_holder(entries.iter().copied(), s, slot_of),
                by_slot.get(&s).copied()
            );
        }
        for k in probes.iter().chain(map.keys()) {
            let through_slot = match by_slot.get(&slot_of(k)) {
                Some(&(held, v)) if held == *k => Some(v),
                _ => map.get(k).copied(),
            };
            prop_assert_eq!(through_slot, map.get(k).copied());
        }
    }
}

#[test]
fn direct_mapped_keeps_the_smallest_key_and_leaves_unused_slots_out() {
    let entries = [(3u32, 'a'), (5, 'b'), (11, 'c'), (12, 'd')];
    // Slots of 8: 3 and 11 collide in slot 3; 3 wins.
    let slots = direct_mapped(&entries, |k| k % 8);
    assert_eq!(slots, vec![(3, 3, 'a'), (4, 12, 'd'), (5, 5, 'b')]);
    assert_eq!(slot_holder(entries, 3, |k| k % 8), Some((3, 'a')));
    assert_eq!(
        slot_holder(entries[1..].iter().copied(), 3, |k| k % 8),
        Some((11, 'c'))
    );
    assert_eq!(slot_holder(entries, 0, |k| k % 8), None);
}
