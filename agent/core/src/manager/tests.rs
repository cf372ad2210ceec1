use super::*;
use crate::demand::DemandMode;
use crate::owner::AgentRole;
use proptest::prelude::*;
use std::cell::RefCell;
use std::rc::Rc;

fn net(s: &str) -> IpNet {
    s.parse().unwrap()
}

fn ip(s: &str) -> IpAddr {
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

fn default_pool() -> PoolSpec {
    PoolSpec::new("default")
        .with_cidr(net("10.0.0.0/29"))
        .with_cidr(net("fd00::/120"))
        .with_reserved(ip("10.0.0.1"))
}

#[test]
fn allocate_next_is_idempotent_per_owner_pool_and_family() {
    let mut m = manager(vec![default_pool()]);
    let a = m.allocate_next("default", Family::V4, ep("a")).unwrap();
    assert_eq!(a.address, ip("10.0.0.2"), "reserved gateway skipped");
    assert_eq!(a.generation, Generation(1));
    let again = m.allocate_next("default", Family::V4, ep("a")).unwrap();
    assert_eq!(again, a);
    let v6 = m.allocate_next("default", Family::V6, ep("a")).unwrap();
    assert_eq!(v6.address, ip("fd00::1"));
    assert_eq!(v6.generation, Generation(2));
    assert_eq!(m.owned_by(&ep("a")).count(), 2);
    assert_eq!(m.allocate("default", a.address, ep("a")).unwrap(), a);
    m.check_invariants();
}

#[test]
fn generations_only_grow_across_reuse() {
    let mut m = manager(vec![default_pool()]);
    let a = m.allocate_next("default", Family::V4, ep("a")).unwrap();
    m.release("default", Family::V4, &ep("a"), a.generation)
        .unwrap();
    let b = m.allocate_next("default", Family::V4, ep("a")).unwrap();
    assert!(b.generation > a.generation);
    assert_eq!(m.generation(), b.generation);
}

#[test]
fn stale_generation_is_refused_and_frees_nothing() {
    let mut m = manager(vec![default_pool()]);
    let old = m.allocate_next("default", Family::V4, ep("a")).unwrap();
    m.release("default", Family::V4, &ep("a"), old.generation)
        .unwrap();
    let new = m.allocate_next("default", Family::V4, ep("a")).unwrap();
    let before = m.snapshot();
    let err = m
        .release("default", Family::V4, &ep("a"), old.generation)
        .unwrap_err();
    assert_eq!(
        err,
        ManagerError::StaleGeneration {
            owner: ep("a"),
            given: old.generation,
            current: new.generation,
        }
    );
    assert_eq!(
        err.to_string(),
        "stale generation 1 for endpoint a/eth0: current is 2"
    );
    assert_eq!(m.snapshot(), before);
}

#[test]
fn every_allocation_error_names_what_is_wrong() {
    let mut m = manager(vec![default_pool()]);
    let cases: Vec<(Result<Allocation, ManagerError>, &str)> = vec![
        (
            m.allocate_next("nope", Family::V4, ep("a")),
            "unknown pool nope",
        ),
        (
            m.allocate("default", ip("10.0.1.1"), ep("a")),
            "address 10.0.1.1 is outside pool default",
        ),
        (
            m.allocate("default", ip("10.0.0.1"), ep("a")),
            "address 10.0.0.1 of pool default cannot be allocated",
        ),
        (
            m.allocate("default", ip("10.0.0.0"), ep("a")),
            "address 10.0.0.0 of pool default cannot be allocated",
        ),
    ];
    for (result, message) in cases {
        assert_eq!(result.unwrap_err().to_string(), message);
    }
    let reserved = m.allocate("default", ip("10.0.0.1"), ep("a")).unwrap_err();
    assert!(matches!(
        std::error::Error::source(&reserved)
            .unwrap()
            .downcast_ref::<CidrError>(),
        Some(CidrError::Reserved { .. })
    ));

    m.allocate("default", ip("10.0.0.4"), ep("a")).unwrap();
    assert_eq!(
        m.allocate("default", ip("10.0.0.4"), Owner::agent(AgentRole::Router))
            .unwrap_err(),
        ManagerError::AddressTaken {
            pool: "default".into(),
            address: ip("10.0.0.4"),
            owner: ep("a"),
        }
    );
    assert_eq!(
        m.allocate("default", ip("10.0.0.5"), ep("a"))
            .unwrap_err()
            .to_string(),
        "endpoint a/eth0 already holds 10.0.0.4 in pool default, not 10.0.0.5"
    );
    assert_eq!(
        m.release("default", Family::V6, &ep("a"), Generation(1))
            .unwrap_err()
            .to_string(),
        "endpoint a/eth0 holds no ipv6 address in pool default"
    );
    // 10.0.0.0/29 without network, broadcast and gateway holds 5.
    for i in 0..4 {
        m.allocate_next("default", Family::V4, ep(&format!("x{i}")))
            .unwrap();
    }
    let full = m
        .allocate_next("default", Family::V4, ep("late"))
        .unwrap_err();
    assert_eq!(
        full,
        ManagerError::PoolExhausted {
            pool: "default".into(),
            family: Family::V4,
            capacity: 5,
        }
    );
    assert_eq!(
        full.to_string(),
        "pool default has no free ipv4 address (capacity 5)"
    );
    m.check_invariants();
}

#[test]
fn overlapping_and_invalid_cidrs_are_refused() {
    let mut m = manager(vec![default_pool(), PoolSpec::new("lb")]);
    let err = m.add_cidr("lb", net("10.0.0.0/24")).unwrap_err();
    assert_eq!(
        err.to_string(),
        "cidr 10.0.0.0/24 of pool lb overlaps cidr 10.0.0.0/29 of pool default"
    );
    let err = m.add_cidr("default", net("fd00::80/121")).unwrap_err();
    assert_eq!(
        err,
        PoolError::OverlappingCidr {
            pool: "default".into(),
            cidr: net("fd00::80/121"),
            other_pool: "default".into(),
            other_cidr: net("fd00::/120"),
        }
    );
    assert!(matches!(
        m.add_cidr("lb", net("10.1.0.1/24")),
        Err(PoolError::InvalidCidr { .. })
    ));
    assert_eq!(
        m.add_cidr("nope", net("10.9.0.0/24")).unwrap_err(),
        PoolError::UnknownPool {
            pool: "nope".into()
        }
    );
    assert_eq!(
        m.remove_cidr("lb", net("10.9.0.0/24"))
            .unwrap_err()
            .to_string(),
        "pool lb has no cidr 10.9.0.0/24"
    );
    // Adding the same CIDR to the same pool again is a no-op.
    assert_eq!(m.add_cidr("default", net("10.0.0.0/29")), Ok(false));
    assert_eq!(m.add_cidr("lb", net("10.9.0.0/24")), Ok(true));
}

#[test]
fn sync_reports_overlaps_and_applies_the_rest() {
    let specs = vec![
        PoolSpec::new("a").with_cidr(net("10.0.0.0/24")),
        PoolSpec::new("b")
            .with_cidr(net("10.0.0.128/25"))
            .with_cidr(net("10.1.0.0/24")),
        PoolSpec::new("a"),
    ];
    let mut m = PoolManager::new(StaticPools(specs), ManagerConfig::default()).unwrap();
    let report = m.sync();
    assert_eq!(
        report.errors,
        vec![
            PoolError::DuplicatePool { pool: "a".into() },
            PoolError::OverlappingCidr {
                pool: "b".into(),
                cidr: net("10.0.0.128/25"),
                other_pool: "a".into(),
                other_cidr: net("10.0.0.0/24"),
            },
        ]
    );
    assert_eq!(
        report.added,
        vec![
            ("a".to_owned(), net("10.0.0.0/24")),
            ("b".to_owned(), net("10.1.0.0/24"))
        ]
    );
    assert!(report.into_result().is_err());
}

#[test]
fn removing_a_cidr_drains_it() {
    let mut m = manager(vec![
        PoolSpec::new("p")
            .with_cidr(net("10.0.0.0/30"))
            .with_cidr(net("10.0.1.0/30")),
    ]);
    let a = m.allocate_next("p", Family::V4, ep("a")).unwrap();
    assert_eq!(a.address, ip("10.0.0.1"));
    assert_eq!(m.remove_cidr("p", net("10.0.0.0/30")), Ok(false));
    // No new allocations from the draining CIDR...
    let b = m.allocate_next("p", Family::V4, ep("b")).unwrap();
    assert_eq!(b.address, ip("10.0.1.1"));
    assert_eq!(
        m.allocate("p", ip("10.0.0.2"), ep("c")).unwrap_err(),
        ManagerError::CidrDraining {
            pool: "p".into(),
            cidr: net("10.0.0.0/30"),
            address: ip("10.0.0.2"),
        }
    );
    assert_eq!(m.pool("p").unwrap().capacity(Family::V4), 2);
    assert_eq!(m.pool("p").unwrap().used(Family::V4), 2);
    // ...existing ones stay until released, then the CIDR is gone.
    assert_eq!(m.get("p", Family::V4, &ep("a")), Some(&a));
    m.release("p", Family::V4, &ep("a"), a.generation).unwrap();
    let cidrs: Vec<IpNet> = m.pool("p").unwrap().cidrs().map(|c| c.cidr).collect();
    assert_eq!(cidrs, vec![net("10.0.1.0/30")]);
    m.check_invariants();
}

#[test]
fn sync_drains_dropped_cidrs_and_pools_and_undrains_readded_ones() {
    let specs = Rc::new(RefCell::new(vec![
        PoolSpec::new("p")
            .with_cidr(net("10.0.0.0/30"))
            .with_cidr(net("10.0.1.0/30")),
        PoolSpec::new("q").with_cidr(net("10.0.2.0/30")),
    ]));
    let source = {
        let specs = Rc::clone(&specs);
        move || specs.borrow().clone()
    };
    let mut m = PoolManager::new(source, ManagerConfig::default()).unwrap();
    m.sync().into_result().unwrap();
    let a = m.allocate_next("p", Family::V4, ep("a")).unwrap();
    let q = m.allocate_next("q", Family::V4, ep("q")).unwrap();

    // Drop 10.0.0.0/30 (holds a) and 10.0.1.0/30 (empty), and pool q.
    *specs.borrow_mut() = vec![PoolSpec::new("p")];
    let report = m.sync();
    assert_eq!(
        report.draining,
        vec![
            ("p".to_owned(), net("10.0.0.0/30")),
            ("p".to_owned(), net("10.0.1.0/30")),
            ("q".to_owned(), net("10.0.2.0/30")),
        ]
    );
    assert_eq!(report.removed, vec![("p".to_owned(), net("10.0.1.0/30"))]);
    assert!(m.pool("q").unwrap().is_retired());

    // Listing the drained CIDR again puts it back in service.
    *specs.borrow_mut() = vec![PoolSpec::new("p").with_cidr(net("10.0.0.0/30"))];
    let report = m.sync();
    assert_eq!(report.added, vec![("p".to_owned(), net("10.0.0.0/30"))]);
    assert!(m.allocate_next("p", Family::V4, ep("b")).is_ok());

    // The retired pool disappears with its last allocation.
    m.release("q", Family::V4, &ep("q"), q.generation).unwrap();
    assert!(m.pool("q").is_none());
    assert_eq!(m.get("p", Family::V4, &ep("a")), Some(&a));
    m.check_invariants();
}

#[test]
fn release_owner_frees_everything_without_a_generation() {
    let mut m = manager(vec![
        default_pool(),
        PoolSpec::new("other").with_cidr(net("10.5.0.0/24")),
    ]);
    m.allocate_next("default", Family::V4, ep("a")).unwrap();
    m.allocate_next("default", Family::V6, ep("a")).unwrap();
    m.allocate_next("other", Family::V4, ep("a")).unwrap();
    let keep = m.allocate_next("default", Family::V4, ep("b")).unwrap();
    let released = m.release_owner(&ep("a"));
    assert_eq!(released.len(), 3);
    assert!(m.release_owner(&ep("a")).is_empty(), "idempotent");
    assert_eq!(m.allocations().cloned().collect::<Vec<_>>(), vec![keep]);
    m.check_invariants();
}

#[test]
fn restore_places_allocations_and_reports_misfits() {
    let mut m = manager(vec![default_pool()]);
    let allocs = vec![
        Allocation {
            pool: "default".into(),
            address: ip("10.0.0.3"),
            owner: ep("a"),
            generation: Generation(7),
        },
        Allocation {
            pool: "default".into(),
            address: ip("fd00::9"),
            owner: ep("a"),
            generation: Generation(8),
        },
        Allocation {
            pool: "gone".into(),
            address: ip("10.0.0.4"),
            owner: ep("b"),
            generation: Generation(9),
        },
        Allocation {
            pool: "default".into(),
            address: ip("10.0.0.3"),
            owner: ep("c"),
            generation: Generation(10),
        },
        Allocation {
            pool: "default".into(),
            address: ip("10.0.9.9"),
            owner: ep("d"),
            generation: Generation(11),
        },
    ];
    let outcome = m.restore(Generation(20), allocs.clone());
    assert_eq!(outcome.restored, 2);
    let reasons: Vec<String> = outcome
        .rejected
        .iter()
        .map(|(_, e)| e.to_string())
        .collect();
    assert_eq!(
        reasons,
        vec![
            "unknown pool gone",
            "address 10.0.0.3 of pool default is taken by endpoint a/eth0",
            "address 10.0.9.9 is outside pool default",
        ]
    );
    // The persisted high-water mark wins over the allocations' generations.
    assert_eq!(m.generation(), Generation(20));
    // Restoring again is idempotent.
    let again = m.restore(Generation(0), allocs[..2].to_vec());
    assert_eq!(again.restored, 2);
    assert!(again.rejected.is_empty());
    // Next-fit resumes after the newest restored allocation (10.0.0.3), not
    // at the start of the CIDR, where the free 10.0.0.2 may be an address
    // released just before the restart.
    let next = m.allocate_next("default", Family::V4, ep("e")).unwrap();
    assert_eq!(next.address, ip("10.0.0.4"));
    assert_eq!(next.generation, Generation(21));
    m.check_invariants();
}

#[test]
fn restore_handles_ten_thousand_allocations() {
    let mut m = manager(vec![PoolSpec::new("big").with_cidr(net("10.0.0.0/16"))]);
    let allocs: Vec<Allocation> = (0..20_000u32)
        .map(|i| Allocation {
            pool: "big".into(),
            address: IpAddr::V4((0x0a00_0001 + i).into()),
            owner: ep(&format!("c{i}")),
            generation: Generation(u64::from(i) + 1),
        })
        .collect();
    let outcome = m.restore(Generation(0), allocs);
    assert_eq!(outcome.restored, 20_000);
    assert_eq!(m.generation(), Generation(20_000));
    assert_eq!(m.usage(Family::V4).in_use, 20_000);
    m.check_invariants();
}

#[test]
fn snapshot_restores_exactly_through_json() {
    let mut m = manager(vec![default_pool().skip_masquerade(true)]);
    for id in ["a", "b", "c"] {
        m.allocate_next("default", Family::V4, ep(id)).unwrap();
        m.allocate_next("default", Family::V6, ep(id)).unwrap();
    }
    let b = m.get("default", Family::V4, &ep("b")).unwrap().clone();
    m.release("default", Family::V4, &ep("b"), b.generation)
        .unwrap();
    m.remove_cidr("default", net("fd00::/120")).unwrap();
    let snap = m.snapshot();
    let json = serde_json::to_string(&snap).unwrap();
    let snap2: ManagerSnapshot = serde_json::from_str(&json).unwrap();
    let mut r =
        PoolManager::from_snapshot(StaticPools(Vec::new()), ManagerConfig::default(), &snap2)
            .unwrap();
    assert_eq!(r.snapshot(), snap);
    assert_eq!(
        r.allocate_next("default", Family::V4, ep("d")),
        m.allocate_next("default", Family::V4, ep("d"))
    );
    r.check_invariants();
}

#[test]
fn flag_changes_apply_to_new_cidrs_and_snapshots_stay_exact() {
    let mut m = manager(vec![PoolSpec::new("p").with_cidr(net("10.0.0.0/30"))]);
    m.allocate_next("p", Family::V4, ep("a")).unwrap();
    m.source_mut().0 = vec![
        PoolSpec::new("p")
            .with_cidr(net("10.0.0.0/30"))
            .with_cidr(net("10.0.1.0/30"))
            .allow_first_last(true)
            .with_reserved(ip("10.0.0.2")),
    ];
    m.sync().into_result().unwrap();
    let caps: Vec<u128> = m.pool("p").unwrap().cidrs().map(|c| c.capacity).collect();
    assert_eq!(
        caps,
        vec![2, 4],
        "the old CIDR keeps the options it was added with"
    );
    let snap = m.snapshot();
    let r = PoolManager::from_snapshot(StaticPools(Vec::new()), ManagerConfig::default(), &snap)
        .unwrap();
    assert_eq!(r.snapshot(), snap);
    let caps: Vec<u128> = r.pool("p").unwrap().cidrs().map(|c| c.capacity).collect();
    assert_eq!(caps, vec![2, 4]);
}

#[test]
fn an_inconsistent_snapshot_is_refused() {
    let mut m = manager(vec![default_pool()]);
    m.allocate_next("default", Family::V4, ep("a")).unwrap();
    let mut snap = m.snapshot();
    let mut dup = snap.allocations[0].clone();
    dup.owner = ep("z");
    snap.allocations.push(dup);
    let err = PoolManager::from_snapshot(StaticPools(Vec::new()), ManagerConfig::default(), &snap)
        .unwrap_err();
    assert!(matches!(err, ManagerError::AddressTaken { .. }), "{err}");
}

/// The pool source the endpoint IPAM would use: a config file.
fn endpoint_manager() -> PoolManager<StaticPools> {
    manager(vec![PoolSpec::new("pods").with_cidr(net("10.0.0.0/24"))])
}

/// The pool source LB-IPAM would use: LoadBalancer pool objects, here a
/// closure over an in-memory list, with masquerade rules of its own.
fn lb_manager(defs: Rc<RefCell<Vec<(String, IpNet)>>>) -> PoolManager<impl PoolSource> {
    let source = move || {
        defs.borrow()
            .iter()
            .map(|(name, cidr)| {
                PoolSpec::new(name.clone())
                    .with_cidr(*cidr)
                    .allow_first_last(true)
            })
            .collect()
    };
    let config = ManagerConfig {
        masquerade: MasqueradeRule::Never,
        ..ManagerConfig::default()
    };
    let mut m = PoolManager::new(source, config).unwrap();
    m.sync().into_result().unwrap();
    m
}

#[test]
fn two_managers_with_different_sources_side_by_side() {
    let defs = Rc::new(RefCell::new(vec![(
        "public".to_owned(),
        net("192.0.2.0/30"),
    )]));
    let mut pods = endpoint_manager();
    let mut lbs = lb_manager(Rc::clone(&defs));

    let pod = pods.allocate_next("pods", Family::V4, ep("a")).unwrap();
    let lb = lbs
        .allocate_next("public", Family::V4, Owner::load_balancer("default/web"))
        .unwrap();
    assert_eq!(pod.address, ip("10.0.0.1"));
    assert_eq!(lb.address, ip("192.0.2.0"), "LB pool allows first/last");
    // Each manager knows only its own pools and counters.
    assert!(matches!(
        pods.allocate_next("public", Family::V4, ep("b")),
        Err(ManagerError::UnknownPool { .. })
    ));
    assert_eq!(pods.generation(), Generation(1));
    assert_eq!(lbs.generation(), Generation(1));

    // The LB source changes; only the LB manager follows.
    defs.borrow_mut()
        .push(("internal".to_owned(), net("198.51.100.0/30")));
    assert_eq!(lbs.sync().added.len(), 1);
    assert_eq!(lbs.pools().count(), 2);
    assert_eq!(pods.pools().count(), 1);
    assert!(lbs.masq_skip_cidrs().is_empty());
}

#[test]
fn masquerade_rule_selects_pools() {
    let specs = vec![
        PoolSpec::new("skip")
            .with_cidr(net("10.0.0.0/24"))
            .skip_masquerade(true),
        PoolSpec::new("masq").with_cidr(net("10.1.0.0/24")),
    ];
    let with = |rule| {
        let cfg = ManagerConfig {
            masquerade: rule,
            ..ManagerConfig::default()
        };
        let mut m = PoolManager::new(StaticPools(specs.clone()), cfg).unwrap();
        m.sync().into_result().unwrap();
        m.masq_skip_cidrs()
            .into_iter()
            .map(|(c, _)| c)
            .collect::<Vec<_>>()
    };
    assert_eq!(with(MasqueradeRule::PoolFlag), vec![net("10.0.0.0/24")]);
    assert_eq!(with(MasqueradeRule::Always).len(), 2);
    assert!(with(MasqueradeRule::Never).is_empty());
}

fn cloud_manager(prefixes: Rc<RefCell<Vec<IpNet>>>) -> PoolManager<impl PoolSource> {
    let source = move || {
        let mut spec = PoolSpec::new("eni").allow_first_last(true);
        for p in prefixes.borrow().iter() {
            spec = spec.with_cidr(*p);
        }
        vec![spec]
    };
    let config = ManagerConfig {
        demand: DemandConfig {
            mode: DemandMode::Linear,
            pre_allocate: 8,
            min_allocate: 0,
            max_above_watermark: 0,
            pending_timeout_ms: 10_000,
            release_after_evaluations: 2,
            release_after_ms: 60_000,
        },
        masquerade: MasqueradeRule::Always,
        ..ManagerConfig::default()
    };
    let mut m = PoolManager::new(source, config).unwrap();
    m.sync().into_result().unwrap();
    m
}

#[test]
fn cloud_28_prefixes_give_16_addresses_each_and_drive_linear_demand() {
    let prefixes = Rc::new(RefCell::new(vec![net("10.1.2.16/28")]));
    let mut m = cloud_manager(Rc::clone(&prefixes));
    assert_eq!(m.pool("eni").unwrap().capacity(Family::V4), 16);
    for i in 0..16 {
        m.allocate_next("eni", Family::V4, ep(&format!("p{i}")))
            .unwrap();
    }
    let err = m.allocate_next("eni", Family::V4, ep("p16")).unwrap_err();
    assert!(matches!(
        err,
        ManagerError::PoolExhausted { capacity: 16, .. }
    ));
    m.add_pending(Family::V4, ep("p16"), 0);

    // Linear: 16 in use + 8 = 24; pending is not added. One more /28.
    let d = m.evaluate_demand(Family::V4, 0);
    assert_eq!((d.demand.target, d.demand.request), (24, 8));
    prefixes.borrow_mut().push(net("10.1.2.32/28"));
    m.sync().into_result().unwrap();
    assert_eq!(m.usage(Family::V4).available, 32);
    let got = m.allocate_next("eni", Family::V4, ep("p16")).unwrap();
    assert_eq!(
        got.address,
        ip("10.1.2.32"),
        "first address of a /28 is usable"
    );
    assert_eq!(m.evaluate_demand(Family::V4, 1).demand.pending, 0, "served");
}

#[test]
fn surplus_prefixes_are_released_only_after_restore_and_hysteresis() {
    let prefixes = Rc::new(RefCell::new(vec![
        net("10.1.2.16/28"),
        net("10.1.2.32/28"),
        net("10.1.2.48/28"),
    ]));
    let mut m = cloud_manager(Rc::clone(&prefixes));
    m.allocate("eni", ip("10.1.2.20"), ep("a")).unwrap();
    // 1 in use + 8 = 9 wanted, 48 held: surplus 39, but restore is not done.
    for now in [0, 60_000, 120_000] {
        assert!(m.evaluate_demand(Family::V4, now).release.is_empty());
    }
    m.finish_restore();
    assert!(m.evaluate_demand(Family::V4, 130_000).release.is_empty());
    let d = m.evaluate_demand(Family::V4, 190_000);
    assert_eq!(d.demand.release, 39);
    // Two empty /28s fit in 39, most recently added first.
    assert_eq!(
        d.release,
        vec![
            ("eni".to_owned(), net("10.1.2.48/28")),
            ("eni".to_owned(), net("10.1.2.32/28"))
        ]
    );
    assert_eq!(m.usage(Family::V4).available, 16);
    // Until the cloud takes them back the source still lists them; sync must
    // not put them back in service.
    assert!(m.sync().added.is_empty());
    assert_eq!(m.usage(Family::V4).available, 16);
    // Once the source drops them they are forgotten and could come back.
    prefixes.borrow_mut().truncate(1);
    m.sync();
    prefixes.borrow_mut().push(net("10.1.2.32/28"));
    assert_eq!(
        m.sync().added,
        vec![("eni".to_owned(), net("10.1.2.32/28"))]
    );
    m.check_invariants();
}

#[test]
fn zero_block_size_is_refused_at_construction() {
    let config = ManagerConfig {
        demand: DemandConfig {
            mode: DemandMode::Ceil { block_size: 0 },
            ..DemandConfig::default()
        },
        ..ManagerConfig::default()
    };
    let err = PoolManager::new(StaticPools(Vec::new()), config).unwrap_err();
    assert_eq!(err, ManagerError::Demand(DemandError::ZeroBlockSize));
}

// ---- property tests ----

#[derive(Clone, Debug)]
enum Op {
    Next { owner: u8, v6: bool },
    Specific { owner: u8, host: u8, v6: bool },
    Release { owner: u8, v6: bool, stale: bool },
    ReleaseOwner { owner: u8 },
    Remove { cidr: u8 },
    Add { cidr: u8 },
    RoundTrip,
}

const CIDRS: [&str; 4] = ["10.0.0.0/29", "10.0.1.0/30", "fd00::/125", "fd00:1::/126"];

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u8..12, any::<bool>()).prop_map(|(owner, v6)| Op::Next { owner, v6 }),
        2 => (0u8..12, any::<u8>(), any::<bool>())
            .prop_map(|(owner, host, v6)| Op::Specific { owner, host, v6 }),
        3 => (0u8..12, any::<bool>(), any::<bool>())
            .prop_map(|(owner, v6, stale)| Op::Release { owner, v6, stale }),
        1 => (0u8..12).prop_map(|owner| Op::ReleaseOwner { owner }),
        1 => (0u8..4).prop_map(|cidr| Op::Remove { cidr }),
        1 => (0u8..4).prop_map(|cidr| Op::Add { cidr }),
        1 => Just(Op::RoundTrip),
    ]
}

fn owner(i: u8) -> Owner {
    match i % 4 {
        0 => Owner::endpoint(format!("c{i}"), "eth0"),
        1 => Owner::load_balancer(format!("ns/s{i}")),
        2 => Owner::Delegated {
            container_id: format!("d{i}"),
            ifname: "eth1".into(),
        },
        _ => Owner::Resource {
            kind: "test".into(),
            name: format!("r{i}"),
        },
    }
}

proptest! {
    #![proptest_config(crate::testing::cases(128))]

    #[test]
    fn random_operation_sequences_keep_the_invariants(
        ops in proptest::collection::vec(op(), 1..120),
        dense_limit in prop_oneof![Just(0u128), Just(crate::cidr::DEFAULT_DENSE_LIMIT)],
    ) {
        let spec = PoolSpec::new("p")
            .with_cidr(net(CIDRS[0]))
            .with_cidr(net(CIDRS[1]))
            .with_cidr(net(CIDRS[2]))
            .with_cidr(net(CIDRS[3]))
            .with_reserved(ip("10.0.0.1"));
        let config = ManagerConfig { dense_limit, ..ManagerConfig::default() };
        let mut m = PoolManager::new(StaticPools(vec![spec]), config).unwrap();
        m.sync().into_result().unwrap();
        let mut seen_generations = BTreeSet::new();

        for op in ops {
            match op {
                Op::Next { owner: o, v6 } => {
                    let family = if v6 { Family::V6 } else { Family::V4 };
                    let before = m.get("p", family, &owner(o)).cloned();
                    match m.allocate_next("p", family, owner(o)) {
                        Ok(a) => {
                            if let Some(b) = before {
                                prop_assert_eq!(a, b, "not idempotent");
                            } else {
                                prop_assert!(seen_generations.insert(a.generation));
                            }
                        }
                        Err(ManagerError::PoolExhausted { capacity, .. }) => {
                            prop_assert!(before.is_none());
                            prop_assert_eq!(capacity, m.pool("p").unwrap().capacity(family));
                        }
                        Err(e) => prop_assert!(false, "unexpected {e}"),
                    }
                }
                Op::Specific { owner: o, host, v6 } => {
                    let cidr = net(CIDRS[usize::from(host % 2) + if v6 { 2 } else { 0 }]);
                    let addr = cidr.hosts().nth(usize::from(host / 2) % 4).unwrap_or(cidr.network());
                    let holder = m.by_address(addr).cloned();
                    match m.allocate("p", addr, owner(o)) {
                        Ok(a) => {
                            prop_assert_eq!(a.address, addr);
                            if let Some(h) = holder {
                                prop_assert_eq!(h, a);
                            } else {
                                prop_assert!(seen_generations.insert(a.generation));
                            }
                        }
                        Err(ManagerError::AddressTaken { owner: by, .. }) => {
                            prop_assert_eq!(Some(by), holder.map(|h| h.owner));
                        }
                        Err(_) => {}
                    }
                }
                Op::Release { owner: o, v6, stale } => {
                    let family = if v6 { Family::V6 } else { Family::V4 };
                    let current = m.get("p", family, &owner(o)).cloned();
                    let given = match (&current, stale) {
                        (Some(a), false) => a.generation,
                        (Some(a), true) => Generation(a.generation.0 ^ 1),
                        (None, _) => Generation(1),
                    };
                    let before = m.snapshot();
                    let result = m.release("p", family, &owner(o), given);
                    match current {
                        Some(a) if !stale => {
                            prop_assert_eq!(result, Ok(a.clone()));
                            prop_assert!(m.by_address(a.address).is_none());
                        }
                        _ => {
                            prop_assert!(result.is_err());
                            prop_assert_eq!(m.snapshot(), before, "a failed release changed state");
                        }
                    }
                }
                Op::ReleaseOwner { owner: o } => {
                    let held = m.owned_by(&owner(o)).count();
                    prop_assert_eq!(m.release_owner(&owner(o)).len(), held);
                    prop_assert_eq!(m.owned_by(&owner(o)).count(), 0);
                }
                Op::Remove { cidr } => {
                    let _ = m.remove_cidr("p", net(CIDRS[usize::from(cidr)]));
                }
                Op::Add { cidr } => {
                    m.add_cidr("p", net(CIDRS[usize::from(cidr)])).unwrap();
                }
                Op::RoundTrip => {
                    let snap = m.snapshot();
                    let r = PoolManager::from_snapshot(StaticPools(Vec::new()), config, &snap)
                        .unwrap();
                    prop_assert_eq!(r.snapshot(), snap.clone());
                    // Restoring just the allocations into fresh pools places all of them.
                    let mut fresh = PoolManager::new(m.source().clone(), config).unwrap();
                    fresh.sync().into_result().unwrap();
                    let outcome = fresh.restore(m.generation(), snap.allocations.clone());
                    prop_assert!(outcome.rejected.is_empty(), "{:?}", outcome.rejected);
                    prop_assert_eq!(fresh.allocations().count(), snap.allocations.len());
                    prop_assert_eq!(fresh.generation(), m.generation());
                }
            }
            m.check_invariants();
            // No address is ever held by two owners.
            let mut addrs = BTreeSet::new();
            for a in m.allocations() {
                prop_assert!(addrs.insert(a.address));
            }
            // used + free = capacity, per pool and family.
            for family in [Family::V4, Family::V6] {
                let p = m.pool("p").unwrap();
                let (cap, used, free) = p.cidrs()
                    .filter(|c| !c.draining && Family::of_net(c.cidr) == family)
                    .fold((0, 0, 0), |(c, u, f), s| (c + s.capacity, u + s.used, f + s.capacity - s.used));
                prop_assert_eq!(used + free, cap);
                prop_assert_eq!(cap, p.capacity(family));
            }
        }
    }
}

#[test]
fn a_released_address_is_reused_last() {
    // Next-fit: after a release, every other free address of the CIDR is
    // handed out before the released one comes round again.
    let mut m = manager(vec![PoolSpec::new("p").with_cidr(net("10.9.0.0/28"))]);
    let first = m.allocate_next("p", Family::V4, ep("first")).unwrap();
    let second = m.allocate_next("p", Family::V4, ep("second")).unwrap();
    m.release("p", Family::V4, &ep("second"), second.generation)
        .unwrap();
    let mut handed = Vec::new();
    // 14 usable addresses, one held: 13 free, the released one last.
    for i in 0..13 {
        let a = m
            .allocate_next("p", Family::V4, ep(&format!("next-{i}")))
            .unwrap();
        handed.push(a.address);
    }
    assert_eq!(
        handed.last(),
        Some(&second.address),
        "the released address comes last: {handed:?}"
    );
    assert!(!handed.contains(&first.address));
    assert!(handed[..12].iter().all(|a| *a != second.address));
}

#[test]
fn after_a_restore_a_released_address_is_not_handed_out_first() {
    let spec = || vec![PoolSpec::new("p").with_cidr(net("10.9.1.0/28"))];
    let mut m = manager(spec());
    let held: Vec<Allocation> = (0..4)
        .map(|i| {
            m.allocate_next("p", Family::V4, ep(&format!("h{i}")))
                .unwrap()
        })
        .collect();
    m.release("p", Family::V4, &held[1].owner, held[1].generation)
        .unwrap();
    let kept: Vec<Allocation> = m.allocations().cloned().collect();
    // A restart: a new manager restored from the stored allocations.
    let mut r = manager(spec());
    r.restore(m.generation(), kept);
    r.finish_restore();
    let next = r.allocate_next("p", Family::V4, ep("new")).unwrap();
    assert_ne!(
        next.address, held[1].address,
        "a just-released address must not be handed out first after a restart"
    );
}

#[test]
fn a_pool_serves_its_declared_families_before_it_has_a_cidr() {
    let mut empty = PoolSpec::new("pods");
    empty.families = vec![Family::V4];
    let mut m =
        PoolManager::new(StaticPools(vec![empty.clone()]), ManagerConfig::default()).unwrap();
    m.sync().into_result().unwrap();
    let pool = m.pool("pods").unwrap();
    assert_eq!(pool.families(), BTreeSet::from([Family::V4]));
    // Asked for, the family is exhausted: never an answer with no address.
    assert_eq!(
        m.allocate_next("pods", Family::V4, ep("a")).unwrap_err(),
        ManagerError::PoolExhausted {
            pool: "pods".into(),
            family: Family::V4,
            capacity: 0,
        }
    );
    // A block arrives: its family joins, the declared one stays.
    m.source_mut().0 = vec![empty.with_cidr(net("fd00::/120"))];
    m.sync().into_result().unwrap();
    assert_eq!(
        m.pool("pods").unwrap().families(),
        BTreeSet::from([Family::V4, Family::V6])
    );
    // A pool declaring nothing and holding nothing serves no family.
    let m = manager(vec![PoolSpec::new("bare")]);
    assert!(m.pool("bare").unwrap().families().is_empty());
    m.check_invariants();
}

#[test]
fn excluded_addresses_are_never_handed_out_until_freed() {
    let mut m = manager(vec![PoolSpec::new("p").with_cidr(net("10.0.0.0/30"))]);
    m.set_excluded([ip("10.0.0.1")].into());
    m.sync().into_result().unwrap();
    let a = m.allocate_next("p", Family::V4, ep("a")).unwrap();
    assert_eq!(a.address, ip("10.0.0.2"));
    assert!(m.allocate_next("p", Family::V4, ep("b")).is_err());
    m.set_excluded(BTreeSet::new());
    m.sync().into_result().unwrap();
    let b = m.allocate_next("p", Family::V4, ep("b")).unwrap();
    assert_eq!(b.address, ip("10.0.0.1"));
}

#[test]
fn a_windowed_block_hands_out_only_its_window_and_a_new_block_starts_limited() {
    let block = net("10.0.0.0/28");
    let mut m = manager(vec![PoolSpec::new("p").with_cidr(block)]);
    m.set_windows([(block, BTreeSet::from([ip("10.0.0.3"), ip("10.0.0.5")]))].into());
    let a = m.allocate_next("p", Family::V4, ep("a")).unwrap();
    let b = m.allocate_next("p", Family::V4, ep("b")).unwrap();
    assert_eq!((a.address, b.address), (ip("10.0.0.3"), ip("10.0.0.5")));
    // The window used up: the block has room, but nothing is handed out.
    assert!(matches!(
        m.allocate_next("p", Family::V4, ep("c")),
        Err(ManagerError::PoolExhausted { .. })
    ));
    let st = m.pool("p").unwrap().cidrs().next().unwrap();
    assert_eq!((st.used, st.available), (2, 0));
    // Asking for an address outside the window is refused, naming it.
    let e = m.allocate("p", ip("10.0.0.9"), ep("c")).unwrap_err();
    assert!(matches!(e, ManagerError::OutsideWindow { .. }), "{e}");
    assert!(e.to_string().contains("10.0.0.9"), "{e}");
    // What the planner sees: nothing free inside, the next free outside in
    // allocation order (after the cursor, past 10.0.0.5).
    let (free, next) = m.window_view("p", Family::V4, 3);
    assert!(free.is_empty());
    assert_eq!(next, vec![ip("10.0.0.6"), ip("10.0.0.7"), ip("10.0.0.8")]);
    // A block added later with a window listed is limited from the start;
    // one with none listed is not.
    let second = net("10.0.1.0/28");
    let third = net("10.0.2.0/28");
    m.set_windows(
        [
            (block, BTreeSet::from([ip("10.0.0.3"), ip("10.0.0.5")])),
            (second, BTreeSet::new()),
        ]
        .into(),
    );
    m.source_mut().0 = vec![PoolSpec::new("p").with_cidr(block).with_cidr(second)];
    m.sync().into_result().unwrap();
    assert!(m.allocate_next("p", Family::V4, ep("c")).is_err());
    m.source_mut().0 = vec![
        PoolSpec::new("p")
            .with_cidr(block)
            .with_cidr(second)
            .with_cidr(third),
    ];
    m.sync().into_result().unwrap();
    let c = m.allocate_next("p", Family::V4, ep("c")).unwrap();
    assert!(third.contains(&c.address), "{c:?}");
    m.check_invariants();
}
