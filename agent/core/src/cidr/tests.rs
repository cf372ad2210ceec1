use super::*;
use proptest::prelude::*;
use std::collections::BTreeSet;

fn net(s: &str) -> IpNet {
    s.parse().unwrap()
}

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn alloc(cidr: &str) -> CidrAllocator {
    CidrAllocator::new(net(cidr), CidrOptions::default(), []).unwrap()
}

#[test]
fn host_bits_are_refused() {
    let err = CidrAllocator::new(net("10.0.0.1/24"), CidrOptions::default(), []).unwrap_err();
    assert_eq!(
        err,
        CidrError::HostBitsSet {
            cidr: net("10.0.0.1/24"),
            network: net("10.0.0.0/24"),
        }
    );
    assert_eq!(
        err.to_string(),
        "invalid cidr 10.0.0.1/24: host bits are set (the network is 10.0.0.0/24)"
    );
}

#[test]
fn v4_excludes_network_and_broadcast() {
    let mut a = alloc("10.0.0.0/30");
    assert_eq!(a.capacity(), 2);
    assert_eq!(a.allocate_next().unwrap(), ip("10.0.0.1"));
    assert_eq!(a.allocate_next().unwrap(), ip("10.0.0.2"));
    assert_eq!(
        a.allocate_next().unwrap_err(),
        CidrError::Exhausted {
            cidr: net("10.0.0.0/30"),
            capacity: 2
        }
    );
    for edge in ["10.0.0.0", "10.0.0.3"] {
        assert_eq!(
            a.allocate(ip(edge)).unwrap_err(),
            CidrError::FirstOrLast {
                address: ip(edge),
                cidr: net("10.0.0.0/30")
            }
        );
    }
}

#[test]
fn point_to_point_sizes_use_every_address() {
    assert_eq!(alloc("10.0.0.0/31").capacity(), 2);
    assert_eq!(alloc("10.0.0.7/32").capacity(), 1);
    assert_eq!(alloc("fd00::/127").capacity(), 2);
    assert_eq!(alloc("fd00::1/128").capacity(), 1);
    assert!(alloc("10.0.0.7/32").allows_first_last());
    assert!(!alloc("10.0.0.0/24").allows_first_last());
}

#[test]
fn whole_address_spaces_do_not_overflow() {
    let opts = CidrOptions {
        allow_first_last: true,
        ..CidrOptions::default()
    };
    let mut all6 = CidrAllocator::new(net("::/0"), opts, []).unwrap();
    assert_eq!(all6.capacity(), u128::MAX, "saturates");
    assert!(all6.allows_first_last());
    assert_eq!(all6.allocate_next().unwrap(), ip("::"));
    all6.allocate(ip("ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff"))
        .unwrap();
    let mut all4 = alloc("0.0.0.0/0");
    assert!(!all4.is_dense());
    assert_eq!(all4.capacity(), (1u128 << 32) - 2);
    assert_eq!(all4.allocate_next().unwrap(), ip("0.0.0.1"));
}

#[test]
fn v6_excludes_only_the_subnet_router_anycast_address() {
    let mut a = alloc("fd00::/126");
    assert_eq!(a.capacity(), 3);
    assert_eq!(a.allocate_next().unwrap(), ip("fd00::1"));
    assert!(a.allocate(ip("fd00::3")).is_ok());
    assert!(matches!(
        a.allocate(ip("fd00::")),
        Err(CidrError::FirstOrLast { .. })
    ));
}

#[test]
fn allow_first_last_makes_a_cloud_28_hold_16() {
    let opts = CidrOptions {
        allow_first_last: true,
        ..CidrOptions::default()
    };
    let mut a = CidrAllocator::new(net("10.1.2.16/28"), opts, []).unwrap();
    assert_eq!(a.capacity(), 16);
    let got: Vec<IpAddr> = (0..16).map(|_| a.allocate_next().unwrap()).collect();
    assert_eq!(got.first(), Some(&ip("10.1.2.16")));
    assert_eq!(got.last(), Some(&ip("10.1.2.31")));
    assert_eq!(a.free(), 0);
}

#[test]
fn reserved_addresses_are_skipped_and_not_counted() {
    let mut a = CidrAllocator::new(
        net("10.0.0.0/29"),
        CidrOptions::default(),
        [ip("10.0.0.1"), ip("10.0.0.0"), ip("192.0.2.1")],
    )
    .unwrap();
    assert_eq!(a.capacity(), 5);
    assert!(a.is_reserved(ip("10.0.0.1")));
    assert!(!a.has(ip("10.0.0.1")));
    assert_eq!(a.allocate_next().unwrap(), ip("10.0.0.2"));
    let reserved = CidrError::Reserved {
        address: ip("10.0.0.1"),
        cidr: net("10.0.0.0/29"),
    };
    assert_eq!(a.allocate(ip("10.0.0.1")).unwrap_err(), reserved);
    assert_eq!(a.release(ip("10.0.0.1")).unwrap_err(), reserved);
    assert_eq!(a.allocated().collect::<Vec<_>>(), vec![ip("10.0.0.2")]);
}

#[test]
fn errors_name_the_address_and_cidr() {
    let mut a = alloc("10.0.0.0/24");
    assert_eq!(
        a.allocate(ip("10.0.1.1")).unwrap_err().to_string(),
        "address 10.0.1.1 is outside 10.0.0.0/24"
    );
    assert!(matches!(
        a.allocate(ip("fd00::1")),
        Err(CidrError::Outside { .. })
    ));
    a.allocate(ip("10.0.0.5")).unwrap();
    assert_eq!(
        a.allocate(ip("10.0.0.5")).unwrap_err().to_string(),
        "address 10.0.0.5 in 10.0.0.0/24 is already allocated"
    );
    assert_eq!(
        a.release(ip("10.0.0.6")).unwrap_err().to_string(),
        "address 10.0.0.6 in 10.0.0.0/24 is not allocated"
    );
    let other = alloc("10.0.1.0/24").snapshot();
    assert_eq!(
        a.restore(&other).unwrap_err(),
        CidrError::SnapshotMismatch {
            cidr: net("10.0.0.0/24"),
            snapshot: net("10.0.1.0/24")
        }
    );
}

#[test]
fn next_fit_reuses_a_released_address_last() {
    for cidr in ["10.0.0.0/29", "fd00::/64"] {
        let mut a = CidrAllocator::new(
            net(cidr),
            CidrOptions {
                allow_first_last: false,
                dense_limit: 8,
            },
            [],
        )
        .unwrap();
        let first = a.allocate_next().unwrap();
        let second = a.allocate_next().unwrap();
        a.release(first).unwrap();
        let third = a.allocate_next().unwrap();
        assert_ne!(third, first, "{cidr}: released address came back first");
        assert!(third > second);
    }
}

#[test]
fn next_fit_wraps_around() {
    let mut a = alloc("10.0.0.0/29"); // .1 to .6
    let all: Vec<_> = (0..6).map(|_| a.allocate_next().unwrap()).collect();
    a.release(all[1]).unwrap();
    a.release(all[4]).unwrap();
    // The cursor is past .6, so the search wraps and finds .2 before .5.
    assert_eq!(a.allocate_next().unwrap(), ip("10.0.0.2"));
    assert_eq!(a.allocate_next().unwrap(), ip("10.0.0.5"));
}

#[test]
fn a_64_uses_the_sparse_store_and_a_16_the_dense_one() {
    assert!(!alloc("fd00::/64").is_dense());
    assert!(alloc("10.0.0.0/16").is_dense());
    assert!(alloc("10.0.0.0/8").is_dense());
    assert!(!alloc("10.0.0.0/7").is_dense());
    let mut big = alloc("fd00::/64");
    assert_eq!(big.capacity(), (1u128 << 64) - 1);
    assert_eq!(big.allocate_next().unwrap(), ip("fd00::1"));
    big.allocate(ip("fd00::ffff:ffff:ffff:ffff")).unwrap();
    assert_eq!(big.used(), 2);
}

#[test]
fn snapshot_round_trips_through_json() {
    let mut a = alloc("10.0.0.0/24");
    for _ in 0..5 {
        a.allocate_next().unwrap();
    }
    a.release(ip("10.0.0.2")).unwrap();
    let snap = a.snapshot();
    let json = serde_json::to_string(&snap).unwrap();
    let back: CidrSnapshot = serde_json::from_str(&json).unwrap();
    let mut b = alloc("10.0.0.0/24");
    b.restore(&back).unwrap();
    assert_eq!(a, b);
    assert_eq!(a.allocate_next(), b.allocate_next());
}

#[test]
fn failed_restore_changes_nothing() {
    let mut a = alloc("10.0.0.0/24");
    a.allocate_next().unwrap();
    let before = a.clone();
    let bad = CidrSnapshot {
        cidr: net("10.0.0.0/24"),
        cursor: ip("10.0.0.1"),
        allocated: vec![ip("10.0.0.3"), ip("10.0.0.3")],
    };
    assert!(matches!(a.restore(&bad), Err(CidrError::Taken { .. })));
    assert_eq!(a, before);
}

#[derive(Clone, Debug)]
enum Op {
    Next,
    Take(u32),
    Release(u32),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => Just(Op::Next),
        1 => any::<u32>().prop_map(Op::Take),
        2 => any::<u32>().prop_map(Op::Release),
    ]
}

proptest! {
    /// Dense and sparse stores give identical answers, and used + free =
    /// capacity holds after every step.
    #[test]
    fn dense_and_sparse_agree(
        prefix in 24u8..=30,
        allow_first_last in any::<bool>(),
        ops in proptest::collection::vec(op(), 0..200),
    ) {
        let cidr = IpNet::new(ip("10.9.0.0"), prefix).unwrap().trunc();
        let reserved = [ip("10.9.0.1")];
        let opts = |dense_limit| CidrOptions { allow_first_last, dense_limit };
        let mut dense = CidrAllocator::new(cidr, opts(DEFAULT_DENSE_LIMIT), reserved).unwrap();
        let mut sparse = CidrAllocator::new(cidr, opts(0), reserved).unwrap();
        prop_assert!(dense.is_dense() && !sparse.is_dense());
        let mut model = BTreeSet::new();
        let size = 1u32 << (32 - prefix);
        for op in ops {
            match op {
                Op::Next => {
                    let (d, s) = (dense.allocate_next(), sparse.allocate_next());
                    prop_assert_eq!(&d, &s);
                    if let Ok(a) = d {
                        prop_assert!(model.insert(a), "handed out twice: {}", a);
                    }
                }
                Op::Take(i) | Op::Release(i) => {
                    let a = IpAddr::V4((u32::from(ip_v4(cidr)) + i % size).into());
                    let (d, s) = if matches!(op, Op::Take(_)) {
                        (dense.allocate(a), sparse.allocate(a))
                    } else {
                        (dense.release(a), sparse.release(a))
                    };
                    prop_assert_eq!(&d, &s);
                    if d.is_ok() {
                        if matches!(op, Op::Take(_)) {
                            prop_assert!(model.insert(a));
                        } else {
                            prop_assert!(model.remove(&a));
                        }
                    }
                }
            }
            prop_assert_eq!(dense.used() + dense.free(), dense.capacity());
            prop_assert_eq!(dense.used(), model.len() as u128);
            prop_assert_eq!(sparse.used(), model.len() as u128);
            prop_assert_eq!(dense.cursor(), sparse.cursor());
        }
        prop_assert_eq!(dense.allocated().collect::<BTreeSet<_>>(), model.clone());
        prop_assert_eq!(sparse.allocated().collect::<BTreeSet<_>>(), model);
        // Snapshot and restore are exact: same state, same future.
        let mut restored = CidrAllocator::new(cidr, opts(DEFAULT_DENSE_LIMIT), reserved).unwrap();
        restored.restore(&dense.snapshot()).unwrap();
        prop_assert_eq!(&restored, &dense);
        prop_assert_eq!(restored.allocate_next(), dense.allocate_next());
    }
}

fn ip_v4(net: IpNet) -> Ipv4Addr {
    match net.network() {
        IpAddr::V4(a) => a,
        IpAddr::V6(_) => unreachable!("test uses IPv4"),
    }
}

#[test]
fn reserved_addresses_change_in_place() {
    let mut a = alloc("10.0.0.0/29");
    assert_eq!(a.allocate_next().unwrap(), ip("10.0.0.1"));
    // A free address is withheld, an allocated one stays with its holder.
    assert!(a.set_excluded([ip("10.0.0.1"), ip("10.0.0.2"), ip("10.1.0.0")]));
    assert!(a.has(ip("10.0.0.1")));
    assert!(a.is_reserved(ip("10.0.0.2")) && !a.is_reserved(ip("10.0.0.1")));
    assert_eq!(a.capacity(), 5);
    assert_eq!(a.allocate_next().unwrap(), ip("10.0.0.3"));
    assert!(!a.set_excluded([ip("10.0.0.1"), ip("10.0.0.2")]));
    // Released, then withheld by the next call.
    a.release(ip("10.0.0.1")).unwrap();
    assert!(a.set_excluded([ip("10.0.0.1"), ip("10.0.0.2")]));
    assert!(a.is_reserved(ip("10.0.0.1")));
    // No longer listed: free again.
    assert!(a.set_excluded([]));
    assert_eq!(a.capacity(), 6);
    assert_eq!(a.used(), 1);
    a.allocate(ip("10.0.0.2")).unwrap();
    a.allocate(ip("10.0.0.1")).unwrap();
}
