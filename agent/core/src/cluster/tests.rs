use super::*;
use crate::cidr::Family;
use proptest::prelude::*;
use std::collections::{BTreeMap, BTreeSet};

fn net(s: &str) -> IpNet {
    s.parse().unwrap()
}

#[test]
fn layout_round_trips() {
    let cidr = net("10.0.0.0/24");
    assert_eq!(block_count(cidr, 26), 4);
    assert_eq!(block_at(cidr, 26, 1), Some(net("10.0.0.64/26")));
    assert_eq!(block_at(cidr, 26, 4), None);
    assert_eq!(block_index(cidr, 26, net("10.0.0.192/26")), Some(3));
    assert_eq!(block_index(cidr, 26, net("10.0.1.0/26")), None);
    assert_eq!(block_index(cidr, 26, net("10.0.0.0/27")), None);
    let v6 = net("fd00::/120");
    assert_eq!(block_at(v6, 122, 2), Some(net("fd00::80/122")));
    assert_eq!(block_count(v6, 119), 0);
}

#[test]
fn validation_refuses_overlap_bad_blocks_and_special_ranges() {
    let a = ClusterPoolSpec::new("a").with_cidr(net("10.0.0.0/16"));
    let b = ClusterPoolSpec::new("b").with_cidr(net("10.0.128.0/24"));
    assert!(validate_pools(std::slice::from_ref(&a)).is_ok());
    let err = validate_pools(&[a.clone(), b]).unwrap_err();
    assert!(err.to_string().contains("overlaps"), "{err}");
    let mut tiny = a.clone();
    tiny.block_v4 = 31;
    assert!(matches!(
        validate_pools(&[tiny]),
        Err(ClusterError::BadBlockSize { .. })
    ));
    let mut big = ClusterPoolSpec::new("c").with_cidr(net("10.1.0.0/24"));
    big.block_v4 = 23;
    assert!(
        validate_pools(&[big])
            .unwrap_err()
            .to_string()
            .contains("larger than the cidr")
    );
    let lo = ClusterPoolSpec::new("lo").with_cidr(net("127.0.0.0/24"));
    assert!(
        validate_pools(&[lo])
            .unwrap_err()
            .to_string()
            .contains("loopback")
    );
    let mut huge = ClusterPoolSpec::new("h").with_cidr(net("fd00::/64"));
    huge.block_v6 = 122;
    assert!(
        validate_pools(&[huge])
            .unwrap_err()
            .to_string()
            .contains("2^20")
    );
}

#[test]
fn spec_parses_with_defaults() {
    let p: ClusterPoolSpec =
        serde_json::from_str(r#"{"name":"p","ipv4":["10.0.0.0/24"]}"#).unwrap();
    assert_eq!((p.block_v4, p.block_v6), (26, 122));
    assert!(serde_json::from_str::<ClusterPoolSpec>(r#"{"name":"p","bogus":1}"#).is_err());
}

#[test]
fn apply_refuses_removing_a_cidr_with_claimed_blocks_naming_them() {
    let old = ClusterPoolSpec::new("p")
        .with_cidr(net("10.0.0.0/24"))
        .with_cidr(net("10.0.1.0/24"));
    let claimed = BTreeMap::from([(net("10.0.1.64/26"), ("p".to_owned(), "node-b".to_owned()))]);
    let olds = std::slice::from_ref(&old);
    assert!(check_apply(olds, olds, &claimed).is_ok());
    let new = ClusterPoolSpec::new("p").with_cidr(net("10.0.0.0/24"));
    let err = check_apply(olds, &[new], &claimed).unwrap_err();
    // The removed CIDR is named, not only its block.
    assert!(
        matches!(&err, ClusterError::CidrInUse { cidr, .. } if *cidr == net("10.0.1.0/24")),
        "{err:?}"
    );
    let text = err.to_string();
    assert!(
        text.contains("10.0.1.0/24") && text.contains("10.0.1.64/26") && text.contains("node-b"),
        "{text}"
    );
    // Re-cutting a CIDR with claimed blocks is refused too.
    let mut recut = ClusterPoolSpec::new("p")
        .with_cidr(net("10.0.0.0/24"))
        .with_cidr(net("10.0.1.0/24"));
    recut.block_v4 = 27;
    assert!(matches!(
        check_apply(&[old], &[recut], &claimed),
        Err(ClusterError::CidrInUse { .. })
    ));
}

#[test]
fn next_block_prefers_the_nodes_neighbourhood() {
    let p = ClusterPoolSpec::new("p").with_cidr(net("10.0.0.0/24"));
    let claimed: BTreeSet<_> = [net("10.0.0.0/26"), net("10.0.0.64/26")].into();
    let mine: BTreeSet<_> = [net("10.0.0.64/26")].into();
    assert_eq!(
        next_block(&p, Family::V4, &claimed, &mine, "n1"),
        Some(net("10.0.0.128/26"))
    );
    // Without a block: a free one, wherever the name starts it.
    for node in ["n1", "n2", "n3", "a-much-longer-node-name"] {
        let b = next_block(&p, Family::V4, &claimed, &BTreeSet::new(), node).unwrap();
        assert!(!claimed.contains(&b), "{node}: {b}");
    }
    let all: BTreeSet<_> = (0..4)
        .map(|i| block_at(net("10.0.0.0/24"), 26, i).unwrap())
        .collect();
    assert_eq!(
        next_block(&p, Family::V4, &all, &BTreeSet::new(), "n1"),
        None
    );
    // The last free block is found from any start, wrapping round.
    let but_first: BTreeSet<_> = all.iter().skip(1).copied().collect();
    for node in ["n1", "n2", "n3", "n4", "n5"] {
        assert_eq!(
            next_block(&p, Family::V4, &but_first, &BTreeSet::new(), node),
            Some(net("10.0.0.0/26"))
        );
    }
    assert_eq!(
        next_block(&p, Family::V6, &BTreeSet::new(), &BTreeSet::new(), "n1"),
        None
    );
}

#[test]
fn new_nodes_start_spread_over_the_pool() {
    // 64 nodes with no block pick among 1024 blocks: few pick the same one
    // (all 64 would, starting at the first free block).
    let p = ClusterPoolSpec::new("p").with_cidr(net("10.0.0.0/16"));
    let picks: BTreeSet<IpNet> = (0..64)
        .map(|i| {
            next_block(
                &p,
                Family::V4,
                &BTreeSet::new(),
                &BTreeSet::new(),
                &format!("node-{i:05}"),
            )
            .unwrap()
        })
        .collect();
    assert!(picks.len() >= 56, "{} distinct starts of 64", picks.len());
    // Across several CIDRs, starts land in each.
    let q = ClusterPoolSpec::new("q")
        .with_cidr(net("10.1.0.0/24"))
        .with_cidr(net("10.2.0.0/24"));
    let in_second = (0..64)
        .filter_map(|i| {
            next_block(
                &q,
                Family::V4,
                &BTreeSet::new(),
                &BTreeSet::new(),
                &format!("n{i}"),
            )
        })
        .filter(|b| net("10.2.0.0/24").contains(&b.network()))
        .count();
    assert!(
        (8..=56).contains(&in_second),
        "{in_second} of 64 in the second cidr"
    );
}

proptest! {
    /// Whatever is claimed, the node and its blocks, the pick is a free
    /// block of the pool, and `None` only when every block is claimed.
    #[test]
    fn next_block_is_free_and_exists_unless_full(
        taken in proptest::collection::btree_set(0u128..16, 0..=16),
        mine in proptest::collection::btree_set(0u128..16, 0..3),
        node in "[a-z0-9-]{1,20}",
    ) {
        let mut p = ClusterPoolSpec::new("p")
            .with_cidr(net("10.0.0.0/26"))
            .with_cidr(net("10.0.1.0/27"));
        p.block_v4 = 28;
        let at = |i: u128| if i < 4 {
            block_at(net("10.0.0.0/26"), 28, i).unwrap()
        } else {
            block_at(net("10.0.1.0/27"), 28, (i - 4) % 2).unwrap()
        };
        let claimed: BTreeSet<IpNet> = taken.iter().chain(&mine).map(|&i| at(i)).collect();
        let held: BTreeSet<IpNet> = mine.iter().map(|&i| at(i)).collect();
        let got = next_block(&p, Family::V4, &claimed, &held, &node);
        match got {
            Some(b) => {
                prop_assert!(!claimed.contains(&b));
                prop_assert!(p.ipv4.iter().any(|c| c.contains(&b.network())));
            }
            None => prop_assert_eq!(claimed.len(), 6, "None with free blocks left"),
        }
    }
}

#[test]
fn claim_below_low_water_release_after_hysteresis() {
    // 64-address blocks, 8 free wanted: 60 in use of 64 → one more block.
    assert_eq!(blocks_to_claim(60, 0, 64, 8, 64), 1);
    assert_eq!(blocks_to_claim(50, 0, 64, 8, 64), 0);
    assert_eq!(blocks_to_claim(0, 100, 0, 0, 64), 2);
    // `held` is capacity: one block with one address in use is enough.
    assert_eq!(blocks_to_claim(1, 0, 64, 16, 64), 0);
    assert_eq!(blocks_to_claim(49, 0, 64, 16, 64), 1);
    let b = |s, used, since| BlockUse {
        block: net(s),
        used,
        usable: 64,
        empty_since_ms: since,
        fenced: false,
    };
    let blocks = [
        b("10.0.0.0/26", 10, None),
        b("10.0.0.64/26", 0, Some(1_000)),
        b("10.0.0.128/26", 0, Some(1_000)),
    ];
    assert!(blocks_to_release(&blocks, 5_000, 10_000, 8).is_empty());
    assert_eq!(
        blocks_to_release(&blocks, 11_000, 10_000, 8),
        vec![net("10.0.0.128/26"), net("10.0.0.64/26")]
    );
    // Keeping 60 free addresses forbids giving both back.
    assert_eq!(
        blocks_to_release(&blocks, 11_000, 10_000, 60),
        vec![net("10.0.0.128/26")]
    );
}

#[test]
fn fencing_at_start() {
    let local: BTreeSet<_> = [
        net("10.0.0.0/26"),
        net("10.0.0.64/26"),
        net("10.0.0.128/26"),
    ]
    .into();
    let owners = BTreeMap::from([
        (net("10.0.0.0/26"), "me".to_owned()),
        (net("10.0.0.64/26"), "other".to_owned()),
    ]);
    let fenced = fence("me", &local, &owners);
    assert_eq!(fenced.len(), 2);
    assert_eq!(fenced[&net("10.0.0.64/26")], Fence::OwnedBy("other".into()));
    assert_eq!(fenced[&net("10.0.0.128/26")], Fence::Absent);
}

#[derive(Clone, Debug)]
enum Op {
    Claim(usize),
    Release(usize),
    /// The node dies and, after reclaim_after, its blocks are reclaimed in
    /// etcd while its local store still lists them.
    DieAndReclaim(usize),
    /// The node starts again from its local store and fences.
    Restart(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..4usize).prop_map(Op::Claim),
        2 => (0..4usize).prop_map(Op::Release),
        1 => (0..4usize).prop_map(Op::DieAndReclaim),
        1 => (0..4usize).prop_map(Op::Restart),
    ]
}

proptest! {
    /// Random claims, releases, reclaims and restarts across 4 simulated
    /// nodes sharing one create-if-absent store: no block is ever usable
    /// (held and not fenced) by two running nodes, and fenced blocks never
    /// allocate.
    #[test]
    fn blocks_never_have_two_users(ops in proptest::collection::vec(op(), 1..200)) {
        let pool = ClusterPoolSpec::new("p").with_cidr(net("10.0.0.0/26")).with_cidr(net("10.0.1.0/27"));
        let mut pool = pool;
        pool.block_v4 = 29;
        let mut etcd: BTreeMap<IpNet, String> = BTreeMap::new();
        let mut local: Vec<BTreeSet<IpNet>> = vec![BTreeSet::new(); 4];
        let mut fenced: Vec<BTreeMap<IpNet, Fence>> = vec![BTreeMap::new(); 4];
        let mut up = [true; 4];
        for op in ops {
            match op {
                Op::Claim(n) if up[n] => {
                    let claimed: BTreeSet<_> = etcd.keys().copied().collect();
                    if let Some(b) = next_block(&pool, Family::V4, &claimed, &local[n], &format!("n{n}")) {
                        prop_assert!(!claimed.contains(&b));
                        prop_assert!(pool.ipv4.iter().any(|c| c.contains(&b.network())));
                        // create-if-absent
                        if let std::collections::btree_map::Entry::Vacant(slot) = etcd.entry(b) {
 slot.insert(format!("n{n}"));
                            local[n].insert(b);
                            fenced[n].remove(&b);
                        }
                    }
                }
                Op::Release(n) if up[n] => {
                    let mine = local[n].iter().find(|b| !fenced[n].contains_key(*b)).copied();
                    if let Some(b) = mine {
                        // compare on owner (stands for the mod revision)
                        if etcd.get(&b) == Some(&format!("n{n}")) {
                            etcd.remove(&b);
                        }
                        local[n].remove(&b);
                    }
                }
                Op::DieAndReclaim(n) => {
                    up[n] = false;
                    etcd.retain(|_, owner| *owner != format!("n{n}"));
                }
                Op::Restart(n) => {
                    up[n] = true;
                    fenced[n] = fence(&format!("n{n}"), &local[n], &etcd);
                }
                _ => {}
            }
            let mut users: BTreeMap<IpNet, usize> = BTreeMap::new();
            for n in (0..4).filter(|&n| up[n]) {
                for b in local[n].iter().filter(|b| !fenced[n].contains_key(*b)) {
                    prop_assert!(users.insert(*b, n).is_none(), "block {} usable by two nodes", b);
                    prop_assert_eq!(etcd.get(b), Some(&format!("n{n}")));
                }
            }
        }
    }

    /// Layout: block_at and block_index are inverse for every index.
    #[test]
    fn layout_inverse(prefix in 8u8..=28, extra in 0u8..=4, idx in 0u128..16) {
        let cidr = IpNet::new("10.0.0.0".parse().unwrap(), prefix).unwrap().trunc();
        let block = (prefix + extra).min(30);
        if let Some(b) = block_at(cidr, block, idx) {
            prop_assert_eq!(block_index(cidr, block, b), Some(idx));
        } else {
            prop_assert!(idx >= block_count(cidr, block));
        }
    }
}

#[test]
fn a_pool_name_with_a_slash_or_a_control_character_is_refused_naming_it() {
    for (name, why) in [
        ("team/a", "'/'"),
        ("a\u{7}b", "control"),
        ("a b", "white space"),
        ("", "empty"),
    ] {
        let pool = ClusterPoolSpec::new(name).with_cidr(net("10.0.0.0/24"));
        let err = validate_pools(&[pool]).unwrap_err();
        assert!(
            matches!(&err, ClusterError::BadName { name: n, .. } if n == name),
            "{err}"
        );
        assert!(err.to_string().contains(why), "{err}");
    }
    let long = "p".repeat(129);
    assert!(check_key_name("node", &long).is_err());
    assert!(check_key_name("node", &long[..128]).is_ok());
}

proptest! {
    /// Every name the rule accepts is exactly one key segment, printable
    /// and unchanged by trimming; every name holding a `/` or a control
    /// character is refused.
    #[test]
    fn accepted_names_are_one_printable_key_segment(name in "\\PC{0,40}|[a-z/\\x00-\\x1f]{0,8}") {
        match key_name_problem(&name) {
            None => {
                prop_assert!(!name.is_empty());
                prop_assert_eq!(format!("pools/{name}").split('/').count(), 2);
                prop_assert!(!name.chars().any(char::is_control));
                prop_assert_eq!(name.trim(), name.as_str());
            }
            Some(_) => prop_assert!(
                name.is_empty()
                    || name.contains('/')
                    || name.chars().any(|c| c.is_control() || c.is_whitespace())
                    || name.len() > 128
            ),
        }
    }
}

#[test]
fn capacity_counts_usable_addresses_so_full_30_blocks_claim_again() {
    // Four /30 CIDRs cut in /30 blocks: each block holds 2 usable
    // addresses (its CIDR's first and last are reserved).
    let mut pool = ClusterPoolSpec::new("p");
    pool.block_v4 = 30;
    for c in ["10.9.0.0/30", "10.9.0.4/30", "10.9.0.8/30", "10.9.0.12/30"] {
        pool = pool.with_cidr(net(c));
    }
    assert_eq!(usable_in_block(&pool, net("10.9.0.4/30")), 2);
    // One block, both addresses in use, one ADD waiting: claim.
    assert_eq!(
        blocks_wanted(&pool, Family::V4, &[(net("10.9.0.0/30"), 2)], 1, 1),
        1
    );
    // A /28 cut in /30 blocks: the first and last blocks hold 3.
    let mut wide = ClusterPoolSpec::new("w").with_cidr(net("10.9.1.0/28"));
    wide.block_v4 = 30;
    assert_eq!(usable_in_block(&wide, net("10.9.1.0/30")), 3);
    assert_eq!(usable_in_block(&wide, net("10.9.1.4/30")), 4);
    assert_eq!(usable_in_block(&wide, net("10.9.1.12/30")), 3);
    wide.allow_first_last = true;
    assert_eq!(usable_in_block(&wide, net("10.9.1.12/30")), 4);
}

proptest! {
    /// Whatever the pool's cut, a node whose served blocks are all full
    /// asks for a block while an allocation waits, and one with the
    /// waiting allocations and the low-water mark free asks for none.
    /// The usable addresses of all blocks are the pool's usable addresses.
    #[test]
    fn full_blocks_with_a_waiting_allocation_always_claim(
        // A block no wider than its CIDR, drawn as such (an assumption
        // rejected a quarter of the cases, too many for a long run).
        (cidr_len, block) in (24u8..=30).prop_flat_map(|c| (Just(c), c.max(26)..=30)),
        cidrs in 1usize..4,
        allow in any::<bool>(),
        take in 1usize..8,
        pending in 1u64..4,
    ) {
        let mut pool = ClusterPoolSpec::new("p");
        pool.block_v4 = block;
        pool.allow_first_last = allow;
        for i in 0..cidrs {
            let base = u32::from(std::net::Ipv4Addr::new(10, 20 + i as u8, 0, 0));
            pool = pool.with_cidr(IpNet::new(std::net::Ipv4Addr::from(base).into(), cidr_len).unwrap());
        }
        let all: Vec<IpNet> = pool
            .ipv4
            .iter()
            .flat_map(|&c| (0..block_count(c, block)).filter_map(move |i| block_at(c, block, i)))
            .collect();
        let usable: u64 = all.iter().map(|&b| usable_in_block(&pool, b)).sum();
        let per_cidr = 1u64 << (32 - cidr_len);
        let want = cidrs as u64 * if allow { per_cidr } else { per_cidr - 2 };
        prop_assert_eq!(usable, want);
        let held: Vec<(IpNet, u64)> = all
            .iter()
            .take(take)
            .map(|&b| (b, usable_in_block(&pool, b)))
            .collect();
        let size = block_size(&pool, Family::V4);
        let low = reserve(&pool, size, false, 0, pending);
        prop_assert_eq!(low, low_water(size));
        prop_assert!(blocks_wanted(&pool, Family::V4, &held, pending, low) >= 1);
        let roomy: Vec<(IpNet, u64)> = held.iter().map(|&(b, _)| (b, 0)).collect();
        let free: u64 = held.iter().map(|&(_, u)| u).sum();
        if free >= pending + low_water(size) {
            prop_assert_eq!(blocks_wanted(&pool, Family::V4, &roomy, pending, low), 0);
        }
    }
}

#[test]
fn the_default_pool_is_recorded_and_adding_a_pool_never_moves_it() {
    let pods = ClusterPoolSpec::new("pods").with_cidr(net("10.1.0.0/24"));
    let aaa = ClusterPoolSpec::new("aaa").with_cidr(net("10.2.0.0/24"));
    // A single-pool set stored by an older version: that pool.
    assert_eq!(
        default_pool(std::slice::from_ref(&pods), None),
        Ok(Some("pods".into()))
    );
    assert_eq!(default_pool(&[], None), Ok(None));
    // The first apply of one pool records it; adding `aaa` (before it in
    // key order) keeps it.
    let first = default_for_apply(std::slice::from_ref(&pods), None, None).unwrap();
    assert_eq!(first.as_deref(), Some("pods"));
    let both = [aaa.clone(), pods.clone()];
    assert_eq!(
        default_for_apply(&both, first.as_deref(), None),
        Ok(Some("pods".into()))
    );
    assert_eq!(default_pool(&both, Some("pods")), Ok(Some("pods".into())));
    // Several pools, nothing recorded: no guess.
    assert!(matches!(
        default_pool(&both, None),
        Err(ClusterError::NoDefault { .. })
    ));
    assert!(matches!(
        default_for_apply(&both, None, None),
        Err(ClusterError::NoDefault { .. })
    ));
    // Named: moved; unknown: refused; dropping it without another: refused.
    assert_eq!(
        default_for_apply(&both, Some("pods"), Some("aaa")),
        Ok(Some("aaa".into()))
    );
    assert!(matches!(
        default_for_apply(&both, Some("pods"), Some("nope")),
        Err(ClusterError::DefaultUnknown { .. })
    ));
    let bbb = ClusterPoolSpec::new("bbb").with_cidr(net("10.3.0.0/24"));
    assert!(matches!(
        default_for_apply(&[aaa.clone(), bbb], Some("pods"), None),
        Err(ClusterError::DefaultRemoved { .. })
    ));
    // Replaced by a single pool: that one, there is no other.
    assert_eq!(
        default_for_apply(std::slice::from_ref(&aaa), Some("pods"), None),
        Ok(Some("aaa".into()))
    );
    assert_eq!(default_for_apply(&[], Some("pods"), None), Ok(None));
}

proptest! {
    /// Whatever pools are added (in any key order), an apply that names no
    /// default keeps the recorded one.
    #[test]
    fn adding_pools_keeps_the_default(extra in proptest::collection::btree_set("[a-z]{1,6}", 0..6)) {
        let mut pools = vec![ClusterPoolSpec::new("pods").with_cidr(net("10.1.0.0/24"))];
        for (i, name) in extra.iter().filter(|n| n.as_str() != "pods").enumerate() {
            let cidr = IpNet::new(std::net::Ipv4Addr::new(10, 2, i as u8, 0).into(), 24).unwrap();
            pools.push(ClusterPoolSpec::new(name.clone()).with_cidr(cidr));
        }
        pools.sort_by(|a, b| a.name.cmp(&b.name));
        prop_assert_eq!(default_for_apply(&pools, Some("pods"), None), Ok(Some("pods".to_string())));
        prop_assert_eq!(default_pool(&pools, Some("pods")), Ok(Some("pods".to_string())));
    }
}

#[test]
fn a_pool_nobody_asks_for_costs_no_block_and_a_draining_one_claims_nothing() {
    let pool = ClusterPoolSpec::new("extra").with_cidr(net("10.30.0.0/24"));
    let size = block_size(&pool, Family::V4);
    // Not the default, nothing in use, nothing waiting: no reserve, no
    // claim (before, every node claimed one block of every pool).
    assert_eq!(reserve(&pool, size, false, 0, 0), 0);
    assert_eq!(blocks_wanted(&pool, Family::V4, &[], 0, 0), 0);
    // An allocation waits: a block; in use: the low water mark is kept.
    let low = reserve(&pool, size, false, 0, 1);
    assert_eq!(low, low_water(size));
    assert_eq!(blocks_wanted(&pool, Family::V4, &[], 1, low), 1);
    assert_eq!(reserve(&pool, size, false, 3, 0), low_water(size));
    // The default pool keeps its reserve from the start.
    assert_eq!(reserve(&pool, size, true, 0, 0), low_water(size));
    assert_eq!(blocks_wanted(&pool, Family::V4, &[], 0, low_water(size)), 1);
    // Draining: nothing kept, nothing claimed, even with a waiting ADD.
    let mut draining = pool.clone();
    draining.draining = true;
    assert_eq!(reserve(&draining, size, true, 5, 1), 0);
    assert_eq!(blocks_wanted(&draining, Family::V4, &[], 1, 4), 0);
}

#[test]
fn removing_a_pool_with_claimed_blocks_drains_it_and_naming_it_again_cancels() {
    let pods = ClusterPoolSpec::new("pods").with_cidr(net("10.1.0.0/24"));
    let oops = ClusterPoolSpec::new("oops").with_cidr(net("10.2.0.0/24"));
    let old = vec![pods.clone(), oops.clone()];
    let mut claimed = BTreeMap::new();
    claimed.insert(net("10.2.0.64/26"), ("oops".to_string(), "n1".to_string()));
    // Removed while n1 holds a block: kept, draining.
    let written = plan_apply(&old, std::slice::from_ref(&pods), &claimed).expect("drains");
    assert_eq!(written.len(), 2);
    let kept = written.iter().find(|p| p.name == "oops").expect("kept");
    assert!(kept.draining && kept.ipv4 == oops.ipv4);
    // Named again: no longer draining.
    let again = plan_apply(&written, &[pods.clone(), oops.clone()], &claimed).expect("named");
    assert!(again.iter().all(|p| !p.draining));
    // No block left: removed outright.
    let gone = plan_apply(&written, std::slice::from_ref(&pods), &BTreeMap::new()).expect("gone");
    assert_eq!(gone, vec![pods.clone()]);
    // A pools file may not set the field.
    let mut given = oops.clone();
    given.draining = true;
    assert!(matches!(
        plan_apply(&old, &[pods.clone(), given], &claimed),
        Err(ClusterError::DrainingGiven { .. })
    ));
    // Taking a CIDR away from a pool that stays is still refused.
    let shrunk = ClusterPoolSpec::new("oops").with_cidr(net("10.3.0.0/24"));
    assert!(matches!(
        plan_apply(&old, &[pods, shrunk], &claimed),
        Err(ClusterError::CidrInUse { .. })
    ));
}
