use std::collections::BTreeSet;
use std::net::IpAddr;

use proptest::prelude::*;

use super::*;
use crate::manager::{ManagerConfig, PoolManager, StaticPools};
use crate::owner::Owner;

fn net(s: &str) -> IpNet {
    s.parse().unwrap()
}

fn pool(name: &str, mode: DemandMode, pre: u64) -> NodePool {
    NodePool {
        name: name.into(),
        allow_first_last: true,
        skip_masquerade: false,
        mode,
        pre_allocate: pre,
    }
}

fn eni() -> Vec<NodePool> {
    vec![
        pool("eni", DemandMode::Linear, 2),
        pool("burst", DemandMode::Ceil { block_size: 16 }, 2),
    ]
}

fn offer(pool: &str, v4: &[&str], v6: &[&str]) -> Offer {
    Offer {
        pool: pool.into(),
        ipv4: v4.iter().map(|s| (*s).to_string()).collect(),
        ipv6: v6.iter().map(|s| (*s).to_string()).collect(),
    }
}

fn none(_: IpNet) -> u64 {
    0
}

#[test]
fn two_28s_are_accepted_and_served_first_and_last_included() {
    let offered = accept(
        &eni(),
        &[],
        &Held::default(),
        &[offer("eni", &["10.9.0.0/28", "10.9.0.16/28"], &[])],
        none,
    )
    .unwrap();
    assert_eq!(offered["eni"].len(), 2);
    assert!(offered["burst"].is_empty());
    let s = step(&Held::default(), &offered, none);
    assert_eq!(s.added.len(), 2);
    let mut m = PoolManager::new(
        StaticPools(local_specs(&eni(), &s.held)),
        ManagerConfig::default(),
    )
    .unwrap();
    assert!(m.sync().errors.is_empty());
    let mut got = BTreeSet::new();
    for i in 0..32 {
        let a = m
            .allocate_next("eni", Family::V4, Owner::endpoint(format!("c{i}"), "eth0"))
            .unwrap();
        got.insert(a.address);
    }
    assert_eq!(got.len(), 32);
    for a in ["10.9.0.0", "10.9.0.15", "10.9.0.16", "10.9.0.31"] {
        assert!(got.contains(&a.parse::<IpAddr>().unwrap()), "{a}");
    }
    assert!(
        m.allocate_next("eni", Family::V4, Owner::endpoint("c32", "eth0"))
            .is_err()
    );
}

#[test]
fn every_bad_cidr_is_named_and_nothing_is_accepted() {
    let configured = vec![PoolSpec::new("local").with_cidr(net("10.244.0.0/16"))];
    let errs = accept(
        &eni(),
        &configured,
        &Held::default(),
        &[
            offer(
                "eni",
                &[
                    "10.9.0.0/28",
                    "10.9.0.8/29",
                    "fd00::/120",
                    "nonsense",
                    "10.9.1.1/28",
                ],
                &["10.9.2.0/28"],
            ),
            offer("burst", &["10.244.1.0/28", "127.0.0.0/28"], &[]),
            offer("eni", &[], &[]),
            offer("other", &["10.9.3.0/28"], &[]),
        ],
        none,
    )
    .unwrap_err();
    let text: Vec<String> = errs.iter().map(ToString::to_string).collect();
    let expect = [
        "pool eni: 10.9.0.8/29 overlaps 10.9.0.0/28 of pool eni, also offered",
        "pool eni: fd00::/120 is listed as ipv4",
        "pool eni: \"nonsense\" is not a CIDR",
        "pool eni: 10.9.1.1/28 is not usable",
        "pool eni: 10.9.2.0/28 is listed as ipv6",
        "pool burst: 10.244.1.0/28 overlaps 10.244.0.0/16 of the configured pool local",
        "pool burst: 127.0.0.0/28 is not usable",
        "pool eni is listed more than once",
        "pool other is not a NodeIPAM pool of this node",
    ];
    assert_eq!(text, expect);
}

#[test]
fn a_record_overlapping_the_configuration_is_named() {
    let held = Held {
        serving: [("eni".to_string(), BTreeSet::from([net("10.9.0.0/28")]))].into(),
        draining: [("eni".to_string(), BTreeSet::from([net("10.9.0.16/28")]))].into(),
    };
    let conf = vec![PoolSpec::new("local").with_cidr(net("10.9.0.0/24"))];
    let errs: Vec<String> = held_overlaps(&conf, &held)
        .iter()
        .map(ToString::to_string)
        .collect();
    assert_eq!(
        errs,
        [
            "pool eni: 10.9.0.0/28 overlaps 10.9.0.0/24 of the configured pool local",
            "pool eni: 10.9.0.16/28 overlaps 10.9.0.0/24 of the configured pool local",
        ]
    );
    assert!(held_overlaps(&[PoolSpec::new("x").with_cidr(net("10.8.0.0/24"))], &held).is_empty());
}

#[test]
fn a_cidr_moving_between_pools_waits_until_empty() {
    let held = Held {
        serving: Cidrs::new(),
        draining: [("eni".to_string(), BTreeSet::from([net("10.9.0.0/28")]))].into(),
    };
    let moved = [offer("burst", &["10.9.0.0/28"], &[])];
    let errs = accept(&eni(), &[], &held, &moved, |_| 3).unwrap_err();
    assert_eq!(
        errs[0].to_string(),
        "pool burst: 10.9.0.0/28 overlaps 10.9.0.0/28, which pool eni still holds (3 address(es) in use)"
    );
    // Empty: it is released by this step, and may move.
    let offered = accept(&eni(), &[], &held, &moved, none).unwrap();
    let s = step(&held, &offered, none);
    assert_eq!(s.released, vec![("eni".to_string(), net("10.9.0.0/28"))]);
    assert_eq!(
        s.held.serving["burst"],
        BTreeSet::from([net("10.9.0.0/28")])
    );
}

#[test]
fn a_withdrawn_cidr_drains_while_used_and_is_released_once_empty() {
    let a = net("10.9.0.0/28");
    let b = net("10.9.0.16/28");
    let pools = eni();
    let both = accept(
        &pools,
        &[],
        &Held::default(),
        &[offer("eni", &["10.9.0.0/28", "10.9.0.16/28"], &[])],
        none,
    )
    .unwrap();
    let s = step(&Held::default(), &both, none);
    let mut m = PoolManager::new(
        StaticPools(local_specs(&pools, &s.held)),
        ManagerConfig::default(),
    )
    .unwrap();
    m.sync();
    let mut owners = Vec::new();
    for i in 0..20 {
        let o = Owner::endpoint(format!("c{i}"), "eth0");
        m.allocate_next("eni", Family::V4, o.clone()).unwrap();
        owners.push(o);
    }
    let used = |m: &PoolManager<StaticPools>, c: IpNet| {
        m.allocations().filter(|x| c.contains(&x.address)).count() as u64
    };
    assert_eq!((used(&m, a), used(&m, b)), (16, 4));
    // The operator withdraws b while 4 endpoints use it.
    let only_a = accept(
        &pools,
        &[],
        &s.held,
        &[offer("eni", &["10.9.0.0/28"], &[])],
        |c| used(&m, c),
    )
    .unwrap();
    let s2 = step(&s.held, &only_a, |c| used(&m, c));
    assert_eq!(s2.drained, vec![("eni".to_string(), b, 4)]);
    assert!(s2.released.is_empty());
    assert_eq!(s2.held.of("eni"), vec![a, b]);
    m.source_mut().0 = local_specs(&pools, &s2.held);
    let report = m.sync();
    assert_eq!(report.draining, vec![("eni".to_string(), b)]);
    // Nothing new from b: a is full, so the pool is exhausted.
    assert!(
        m.allocate_next("eni", Family::V4, Owner::endpoint("new", "eth0"))
            .is_err()
    );
    // Its endpoints keep their addresses until they go.
    let in_b: Vec<_> = m
        .allocations()
        .filter(|x| b.contains(&x.address))
        .cloned()
        .collect();
    assert_eq!(in_b.len(), 4);
    // A second step with it still used changes nothing.
    let again = step(&s2.held, &only_a, |c| used(&m, c));
    assert_eq!(again.held, s2.held);
    assert!(again.drained.is_empty() && again.added.is_empty());
    for x in in_b {
        m.release(&x.pool, Family::V4, &x.owner, x.generation)
            .unwrap();
    }
    let s3 = step(&s2.held, &only_a, |c| used(&m, c));
    assert_eq!(s3.released, vec![("eni".to_string(), b)]);
    assert_eq!(s3.held.of("eni"), vec![a]);
}

#[test]
fn a_pool_dropped_from_the_config_is_reported_until_released() {
    let held = Held {
        serving: Cidrs::new(),
        draining: [("gone".to_string(), BTreeSet::from([net("10.9.5.0/28")]))].into(),
    };
    let offered = accept(&eni(), &[], &held, &[], none).unwrap();
    // Still used: it drains, and the spec goes on listing it.
    let s = step(&held, &offered, |_| 3);
    assert_eq!(s.held, held);
    let reported = reported_pools(&eni(), &s.held);
    let gone = reported.iter().find(|p| p.name == "gone").unwrap();
    assert_eq!((gone.mode, requested(gone, 3)), (DemandMode::Linear, 3));
    assert!(
        !local_specs(&eni(), &s.held)
            .iter()
            .any(|p| p.name == "gone")
    );
    // Empty: released, no longer reported.
    let s = step(&held, &offered, none);
    assert_eq!(s.released, vec![("gone".to_string(), net("10.9.5.0/28"))]);
    assert_eq!(reported_pools(&eni(), &s.held), eni());
}

#[test]
fn requested_follows_both_modes() {
    let lin = pool("eni", DemandMode::Linear, 2);
    let ceil = pool("burst", DemandMode::Ceil { block_size: 16 }, 2);
    assert_eq!(requested(&lin, 0), 2);
    assert_eq!(requested(&lin, 17), 19);
    assert_eq!(usage_bounds(&lin, 19), (17, 17));
    assert_eq!(requested(&ceil, 0), 16);
    assert_eq!(requested(&ceil, 14), 16);
    assert_eq!(requested(&ceil, 15), 32);
    assert_eq!(usage_bounds(&ceil, 32), (15, 30));
    let zero = pool("z", DemandMode::Ceil { block_size: 0 }, 0);
    assert!(check_pool(&zero).is_err());
}

fn arb_cidr() -> impl Strategy<Value = IpNet> {
    (0u8..8, prop::sample::select(vec![27u8, 28, 29])).prop_map(|(i, len)| {
        let base = u32::from(std::net::Ipv4Addr::new(10, 9, 0, 0)) + u32::from(i) * 16;
        IpNet::new(IpAddr::V4(base.into()), len).unwrap().trunc()
    })
}

fn arb_held() -> impl Strategy<Value = Held> {
    (
        prop::collection::btree_set(arb_cidr(), 0..4),
        prop::collection::btree_set(arb_cidr(), 0..4),
    )
        .prop_map(|(s, d)| Held {
            serving: [("eni".to_string(), s)].into(),
            draining: [("eni".to_string(), d)].into(),
        })
}

proptest! {
    /// No CIDR holding an address is ever released; every offered CIDR
    /// serves; what is held is exactly the offer plus the used withdrawn.
    #[test]
    fn step_never_releases_a_used_cidr(
        held in arb_held(),
        offered in prop::collection::btree_set(arb_cidr(), 0..4),
        used in prop::collection::btree_map(arb_cidr(), 0u64..3, 0..8),
    ) {
        let use_of = |c: IpNet| used.get(&c).copied().unwrap_or(0);
        let offered: Cidrs = [("eni".to_string(), offered)].into();
        let s = step(&held, &offered, use_of);
        for (_, c) in &s.released {
            prop_assert_eq!(use_of(*c), 0);
            prop_assert!(!offered["eni"].contains(c));
        }
        let now: BTreeSet<IpNet> = s.held.all().map(|(_, c)| c).collect();
        let before: BTreeSet<IpNet> = held.all().map(|(_, c)| c).collect();
        let mut want: BTreeSet<IpNet> = offered["eni"].clone();
        want.extend(before.iter().filter(|c| use_of(**c) > 0));
        prop_assert_eq!(&now, &want);
        for c in &offered["eni"] {
            prop_assert!(s.held.serving["eni"].contains(c));
            prop_assert!(!s.held.draining.get("eni").is_some_and(|d| d.contains(c)));
        }
        let released: BTreeSet<IpNet> = s.released.iter().map(|(_, c)| *c).collect();
        prop_assert_eq!(released, before.difference(&now).copied().collect::<BTreeSet<_>>());
    }

    /// An accepted offer never overlaps itself or a configured pool; a
    /// refused one is refused whole.
    #[test]
    fn accepted_offers_never_overlap(
        cidrs in prop::collection::vec(arb_cidr(), 0..6),
        configured in prop::option::of(arb_cidr()),
    ) {
        let conf: Vec<PoolSpec> = configured.map(|c| PoolSpec::new("local").with_cidr(c)).into_iter().collect();
        let texts: Vec<String> = cidrs.iter().map(ToString::to_string).collect();
        let o = Offer { pool: "eni".into(), ipv4: texts, ipv6: Vec::new() };
        match accept(&eni(), &conf, &Held::default(), &[o], none) {
            Ok(got) => {
                let all: Vec<IpNet> = got.values().flatten().copied().collect();
                prop_assert_eq!(all.len(), cidrs.iter().collect::<BTreeSet<_>>().len());
                for (i, a) in all.iter().enumerate() {
                    for b in &all[i + 1..] {
                        prop_assert!(!overlaps(*a, *b));
                    }
                    for c in conf.iter().flat_map(PoolSpec::cidrs) {
                        prop_assert!(!overlaps(*a, c));
                    }
                }
            }
            Err(errs) => prop_assert!(!errs.is_empty()),
        }
    }

    /// Linear demand gives usage back exactly; ceil to within a block, and
    /// always covers usage plus the pre-allocation.
    #[test]
    fn usage_is_recoverable_from_requested(in_use in 0u64..10_000, pre in 0u64..64, block in 1u64..300) {
        let lin = pool("l", DemandMode::Linear, pre);
        prop_assert_eq!(usage_bounds(&lin, requested(&lin, in_use)), (in_use, in_use));
        let ceil = pool("c", DemandMode::Ceil { block_size: block }, pre);
        let r = requested(&ceil, in_use);
        prop_assert_eq!(r % block, 0);
        prop_assert!(r >= in_use + pre && r < in_use + pre + block);
        let (lo, hi) = usage_bounds(&ceil, r);
        prop_assert!(lo <= in_use && in_use <= hi);
        prop_assert!(hi - lo < block);
    }
}
