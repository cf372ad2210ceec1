use super::*;
use crate::manager::{ManagerConfig, StaticPools};
use crate::owner::Owner;
use proptest::prelude::*;
use std::collections::BTreeSet;

fn net(s: &str) -> IpNet {
    s.parse().unwrap()
}

fn ep(id: &str) -> Owner {
    Owner::endpoint(id, "eth0")
}

fn manager(specs: Vec<PoolSpec>) -> PoolManager<StaticPools> {
    let mut m = PoolManager::new(StaticPools(specs), ManagerConfig::default()).unwrap();
    m.sync().into_result().unwrap();
    m
}

/// Pool a with two CIDRs and pool b with one, each with `n` holders per CIDR.
fn before(n: usize) -> (PoolManager<StaticPools>, Vec<Allocation>) {
    let a = PoolSpec::new("a")
        .with_cidr(net("10.1.0.0/29"))
        .with_cidr(net("10.1.1.0/24"));
    let b = PoolSpec::new("b")
        .with_cidr(net("10.2.0.0/24"))
        .with_cidr(net("fd02::/120"));
    let mut m = manager(vec![a, b]);
    for i in 0..n {
        m.allocate_next("a", Family::V4, ep(&format!("a{i}")))
            .unwrap();
        m.allocate_next("b", Family::V4, ep(&format!("b{i}")))
            .unwrap();
        m.allocate_next("b", Family::V6, ep(&format!("b{i}")))
            .unwrap();
    }
    for i in 0..n {
        m.allocate(
            "a",
            format!("10.1.1.{}", 10 + i).parse().unwrap(),
            ep(&format!("c{i}")),
        )
        .unwrap();
    }
    let all = m.allocations().cloned().collect();
    (m, all)
}

fn restart(
    specs: Vec<PoolSpec>,
    old: &PoolManager<StaticPools>,
) -> (PoolManager<StaticPools>, RestoreOutcome, KeptReport) {
    let mut m = manager(specs);
    let (outcome, kept) = m.restore_keeping(
        old.generation(),
        old.allocations().cloned().collect::<Vec<_>>(),
    );
    m.check_invariants();
    (m, outcome, kept)
}

#[test]
fn a_dropped_cidr_and_pool_drain_with_their_holders_and_go_with_the_last() {
    let (old, all) = before(3);
    // Config edit: pool a loses 10.1.1.0/24, pool b is gone.
    let edited = vec![PoolSpec::new("a").with_cidr(net("10.1.0.0/29"))];
    let (mut m, outcome, kept) = restart(edited, &old);
    assert!(outcome.rejected.is_empty(), "{:?}", outcome.rejected);
    assert_eq!(outcome.restored, all.len());
    assert_eq!(kept.kept, 9);
    assert_eq!(kept.retired_pools, vec!["b".to_string()]);
    let now: Vec<Allocation> = m.allocations().cloned().collect();
    assert_eq!(now, all, "nothing taken, nothing changed");
    assert_eq!(m.generation(), old.generation());

    let draining = m.draining();
    let ranges: Vec<(&str, IpNet, usize)> = draining
        .iter()
        .map(|r| (r.pool.as_str(), r.cidr, r.holders.len()))
        .collect();
    assert_eq!(
        ranges,
        vec![
            ("a", net("10.1.1.8/29"), 3),
            ("b", net("10.2.0.0/30"), 3),
            ("b", net("fd02::/126"), 3),
        ]
    );
    assert!(draining[1].pool_retired && !draining[0].pool_retired);

    // Nothing new comes from a draining range, even when the pool is full.
    let mut fresh = Vec::new();
    loop {
        match m.allocate_next("a", Family::V4, ep(&format!("new{}", fresh.len()))) {
            Ok(a) => fresh.push(a.address),
            Err(ManagerError::PoolExhausted { .. }) => break,
            Err(e) => panic!("{e}"),
        }
    }
    assert!(
        fresh.iter().all(|a| net("10.1.0.0/29").contains(a)),
        "{fresh:?}"
    );
    assert!(matches!(
        m.allocate("a", "10.1.1.9".parse().unwrap(), ep("x")),
        Err(ManagerError::CidrDraining { .. })
    ));
    assert!(matches!(
        m.allocate_next("b", Family::V4, ep("x")),
        Err(ManagerError::PoolExhausted { .. })
    ));

    // An owner's own release leaves the range draining with the rest.
    let first = draining[0].holders[0].clone();
    m.release("a", Family::V4, &first.owner, first.generation)
        .unwrap();
    assert_eq!(m.draining()[0].holders.len(), 2);
    // The operator's selection names exactly the rest; releasing it ends
    // the range, and the retired pool goes with its last range.
    let rest = m.draining_holders("a", Some(net("10.1.1.0/24"))).unwrap();
    assert_eq!(rest, draining[0].holders[1..].to_vec());
    for a in &rest {
        m.release(&a.pool, a.family(), &a.owner, a.generation)
            .unwrap();
    }
    for a in m.draining_holders("b", None).unwrap() {
        m.release(&a.pool, a.family(), &a.owner, a.generation)
            .unwrap();
    }
    assert!(m.draining().is_empty());
    assert!(m.pool("b").is_none());
    m.check_invariants();
}

#[test]
fn a_cidr_put_back_stops_draining() {
    let (old, all) = before(2);
    let (mid, _, _) = restart(vec![PoolSpec::new("a").with_cidr(net("10.1.0.0/29"))], &old);
    assert_eq!(mid.draining().len(), 3);
    let (back, outcome, kept) = restart(
        vec![
            PoolSpec::new("a")
                .with_cidr(net("10.1.0.0/29"))
                .with_cidr(net("10.1.1.0/24")),
            PoolSpec::new("b")
                .with_cidr(net("10.2.0.0/24"))
                .with_cidr(net("fd02::/120")),
        ],
        &mid,
    );
    assert!(outcome.rejected.is_empty());
    assert_eq!(kept, KeptReport::default());
    assert!(back.draining().is_empty());
    assert_eq!(back.allocations().cloned().collect::<Vec<_>>(), all);
}

#[test]
fn a_cidr_moved_to_another_pool_while_held_is_a_conflict_naming_both() {
    let (old, all) = before(2);
    let edited = vec![
        PoolSpec::new("a").with_cidr(net("10.1.0.0/29")),
        PoolSpec::new("b")
            .with_cidr(net("10.2.0.0/24"))
            .with_cidr(net("fd02::/120"))
            .with_cidr(net("10.1.1.0/25")),
    ];
    let (m, outcome, _) = restart(edited, &old);
    assert_eq!(outcome.rejected.len(), 2);
    for (a, e) in &outcome.rejected {
        assert!(net("10.1.1.0/25").contains(&a.address));
        assert!(matches!(
            e,
            ManagerError::Drain(e) if matches!(**e, DrainError::Conflict { .. })
        ));
        let msg = e.to_string();
        assert!(
            msg.contains("pool a") && msg.contains("10.1.1.0/25 of pool b"),
            "{msg}"
        );
    }
    assert_eq!(outcome.restored + outcome.rejected.len(), all.len());
    assert_eq!(m.allocations().count(), all.len() - 2);
}

#[test]
fn holders_far_apart_get_ranges_of_their_own_and_never_cover_configured_cidrs() {
    let a = PoolSpec::new("a").with_cidr(net("10.8.0.0/16"));
    let mut old = manager(vec![a]);
    for (i, addr) in ["10.8.0.5", "10.8.200.7", "10.8.3.1"].iter().enumerate() {
        old.allocate("a", addr.parse().unwrap(), ep(&i.to_string()))
            .unwrap();
    }
    // The new CIDR sits between the holders.
    let edited = vec![PoolSpec::new("a").with_cidr(net("10.8.1.0/24"))];
    let (m, outcome, _) = restart(edited, &old);
    assert!(outcome.rejected.is_empty());
    let ranges: Vec<IpNet> = m.draining().iter().map(|r| r.cidr).collect();
    assert_eq!(
        ranges,
        vec![net("10.8.0.5/32"), net("10.8.3.1/32"), net("10.8.200.7/32")]
    );
}

#[test]
fn an_operator_release_selects_draining_addresses_only() {
    let (old, _) = before(2);
    let (m, _, _) = restart(vec![PoolSpec::new("a").with_cidr(net("10.1.0.0/29"))], &old);
    let err = m
        .draining_holders("a", Some(net("10.1.0.0/29")))
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "pool a has no draining address in 10.1.0.0/29"
    );
    assert!(m.draining_holders("nope", None).is_err());
    assert_eq!(m.draining_holders("b", None).unwrap().len(), 4);
    assert_eq!(
        m.draining_holders("b", Some(net("fd02::/64")))
            .unwrap()
            .len(),
        2
    );
}

/// Every CIDR a test pool may have, by pool; an edit keeps any subset and
/// may move one to the other pool.
const LAYOUT: [(&str, &str); 5] = [
    ("a", "10.0.0.0/28"),
    ("a", "10.0.1.0/24"),
    ("a", "fd00::/120"),
    ("b", "10.0.2.0/28"),
    ("b", "fd00:1::/124"),
];

fn specs(kept: &[bool], moved: Option<usize>) -> Vec<PoolSpec> {
    let mut a = PoolSpec::new("a");
    let mut b = PoolSpec::new("b");
    for (i, (pool, cidr)) in LAYOUT.iter().enumerate() {
        let to_other = moved == Some(i);
        let in_a = (*pool == "a") != to_other;
        if kept[i] || to_other {
            if in_a {
                a = a.with_cidr(net(cidr));
            } else {
                b = b.with_cidr(net(cidr));
            }
        }
    }
    let mut out = vec![a];
    if kept[3] || kept[4] || moved.is_some() {
        out.push(b);
    }
    out
}

proptest! {
    #![proptest_config(crate::testing::cases(256))]

    /// Random holders, a random edit, a restart: no allocation is lost or
    /// changed unless it conflicts (a CIDR moved to the other pool while
    /// held), none has two owners, draining ranges hand nothing out, and
    /// releasing every draining holder leaves no draining range.
    #[test]
    fn no_edit_loses_or_doubles_an_allocation_and_draining_never_hands_out(
        holders in proptest::collection::vec((0usize..5, any::<bool>()), 0..60),
        kept in proptest::collection::vec(any::<bool>(), 5),
        moved in proptest::option::of(0usize..5),
        dense_limit in prop_oneof![Just(0u128), Just(crate::cidr::DEFAULT_DENSE_LIMIT)],
    ) {
        let config = ManagerConfig { dense_limit, ..ManagerConfig::default() };
        let mut old = PoolManager::new(StaticPools(specs(&[true; 5], None)), config).unwrap();
        old.sync().into_result().unwrap();
        for (n, (i, v6)) in holders.iter().enumerate() {
            let pool = LAYOUT[*i].0;
            let family = if *v6 { Family::V6 } else { Family::V4 };
            let _ = old.allocate_next(pool, family, ep(&n.to_string()));
        }
        let all: BTreeSet<Allocation> = old.allocations().cloned().collect();
        let moved = moved.filter(|i| !kept[*i]);
        let mut m = PoolManager::new(StaticPools(specs(&kept, moved)), config).unwrap();
        m.sync().into_result().unwrap();
        let (outcome, _) = m.restore_keeping(old.generation(), all.iter().cloned().collect::<Vec<_>>());
        m.check_invariants();
        let now: BTreeSet<Allocation> = m.allocations().cloned().collect();
        prop_assert_eq!(now.len() + outcome.rejected.len(), all.len());
        for (a, e) in &outcome.rejected {
            let Some(i) = moved else {
                return Err(TestCaseError::fail(format!("rejected without a move: {a:?} {e}")));
            };
            prop_assert!(net(LAYOUT[i].1).contains(&a.address), "{:?} {}", a, e);
            let conflict = matches!(e, ManagerError::Drain(e) if matches!(**e, DrainError::Conflict { .. }));
            prop_assert!(conflict, "{}", e);
        }
        prop_assert!(now.is_subset(&all), "an allocation changed");
        prop_assert!(m.generation() >= old.generation());
        // Draining ranges: inside a dropped CIDR of their pool, never a
        // configured one.
        let configured: Vec<(String, IpNet)> = specs(&kept, moved)
            .iter()
            .flat_map(|s| s.cidrs().map(|c| (s.name.clone(), c)))
            .collect();
        let draining = m.draining();
        for r in &draining {
            prop_assert!(configured.iter().all(|(_, c)| !overlaps(*c, r.cidr)));
            prop_assert!(LAYOUT.iter().any(|(p, c)| *p == r.pool && net(c).contains(&r.cidr.network())
                && net(c).contains(&r.cidr.broadcast())), "{:?}", r);
            prop_assert!(!r.holders.is_empty());
        }
        // Exhaust every pool: nothing from a draining range.
        for (n, (pool, family)) in [("a", Family::V4), ("a", Family::V6), ("b", Family::V4), ("b", Family::V6)]
            .into_iter()
            .cycle()
            .take(4 * 300)
            .enumerate()
        {
            if let Ok(a) = m.allocate_next(pool, family, ep(&format!("new{n}"))) {
                prop_assert!(configured.iter().any(|(p, c)| p == pool && c.contains(&a.address)));
                prop_assert!(draining.iter().all(|r| !r.cidr.contains(&a.address)));
            }
        }
        m.check_invariants();
        for pool in ["a", "b"] {
            if let Ok(rest) = m.draining_holders(pool, None) {
                for a in rest {
                    m.release(&a.pool, a.family(), &a.owner, a.generation).unwrap();
                }
            }
        }
        prop_assert!(m.draining().is_empty());
        m.check_invariants();
    }
}
