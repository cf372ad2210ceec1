//! A node's view of the cluster pools as local pools: each cluster pool
//! becomes a local pool whose CIDRs are the blocks the node holds, so the
//! single-node allocator serves them unchanged (blocks added or dropped go
//! through the manager's sync: a dropped block drains until empty).

use std::collections::{BTreeMap, BTreeSet};

use ipnet::IpNet;

use super::layout::block_addresses;

use super::spec::ClusterPoolSpec;
use crate::cidr::Family;
use crate::pool::PoolSpec;

/// Free addresses a node keeps ready per cluster pool and family before it
/// claims another block (at most a quarter of a block).
pub fn low_water(block_addrs: u64) -> u64 {
    (block_addrs / 4).clamp(1, 16)
}

/// The local pools serving `pools` from the blocks in `held` (pool →
/// blocks), leaving out every block in `fenced`: a fenced block is not
/// listed, so the manager drains it (its holders stay, nothing new is handed
/// out). A cluster pool whose name a local pool in `taken` already uses is
/// left out (the config's pool wins) and named in the second list.
///
/// Blocks cut a CIDR, so a block's first and last addresses are ordinary
/// addresses: every block allows them, and unless the cluster pool sets
/// `allow_first_last` the first and last addresses of each of its CIDRs
/// are reserved instead.
pub fn local_pools(
    pools: &[ClusterPoolSpec],
    held: &BTreeMap<String, BTreeSet<IpNet>>,
    fenced: &BTreeSet<IpNet>,
    taken: &BTreeSet<String>,
) -> (Vec<PoolSpec>, Vec<String>) {
    let mut out = Vec::new();
    let mut clashes = Vec::new();
    for pool in pools {
        if taken.contains(&pool.name) {
            clashes.push(pool.name.clone());
            continue;
        }
        let mut spec = PoolSpec::new(pool.name.clone());
        spec.allow_first_last = true;
        spec.skip_masquerade = pool.skip_masquerade;
        // Before its first block the pool still serves its families: an
        // endpoint waits for a block instead of getting no address.
        spec.families = pool.cidrs().map(Family::of_net).collect();
        spec.families.dedup();
        let blocks = held.get(&pool.name).into_iter().flatten();
        for b in blocks.filter(|b| !fenced.contains(b)) {
            match b {
                IpNet::V4(n) => spec.ipv4.push(*n),
                IpNet::V6(n) => spec.ipv6.push(*n),
            }
        }
        if !pool.allow_first_last {
            for cidr in pool.cidrs() {
                spec.reserved.push(cidr.network());
                spec.reserved.push(cidr.broadcast());
            }
        }
        out.push(spec);
    }
    (out, clashes)
}

/// Addresses of `block` (a block of `pool`) the node can hand out: all of
/// them, less the first and last address of the pool's CIDR when they fall
/// in the block and the pool does not allow them ([`local_pools`]
/// reserves exactly those). A /30 block of a /30 CIDR holds 2, not 4:
/// counting 4 once made a node with two addresses in use believe it still
/// had room, so it never claimed again while free blocks existed.
pub fn usable_in_block(pool: &ClusterPoolSpec, block: IpNet) -> u64 {
    let all = u64::try_from(block_addresses(block, block.prefix_len())).unwrap_or(u64::MAX);
    if pool.allow_first_last {
        return all;
    }
    let reserved = pool
        .cidrs()
        .flat_map(|c| [c.network(), c.broadcast()])
        .filter(|a| block.contains(a))
        .collect::<BTreeSet<_>>()
        .len();
    all.saturating_sub(reserved as u64)
}

/// How many blocks of `pool` in `family` to claim now: `serving` lists
/// each block the node serves with the addresses in use in it, `pending`
/// the allocations waiting for an address. Capacity is counted in usable
/// addresses ([`usable_in_block`]), so a node whose blocks are full asks
/// for another whenever an allocation waits.
///
/// `reserve` is the number of free addresses kept ready ([`reserve`]).
/// A draining pool claims nothing.
pub fn blocks_wanted(
    pool: &ClusterPoolSpec,
    family: Family,
    serving: &[(IpNet, u64)],
    pending: u64,
    reserve: u64,
) -> u64 {
    let size = block_size(pool, family);
    if size == 0 || pool.draining {
        return 0;
    }
    let used: u64 = serving.iter().map(|(_, u)| *u).sum();
    let capacity: u64 = serving.iter().map(|(b, _)| usable_in_block(pool, *b)).sum();
    super::decide::blocks_to_claim(used, pending, capacity, reserve, size)
}

/// The free addresses a node keeps ready in `pool` (blocks of
/// `block_addrs`), claimed ahead of need and kept when giving blocks back
/// (#26 item 12): the low water mark for the default pool (it serves every
/// request that names no pool: the first pod needs no round trip to etcd),
/// and for any other pool only while this node uses it (`in_use`) or an
/// allocation waits on it (`pending`). A pool nobody asks for costs no
/// block: before, every node claimed a block of every pool at start, so a
/// pool applied by mistake held a block on every node. A draining pool
/// keeps nothing.
pub fn reserve(
    pool: &ClusterPoolSpec,
    block_addrs: u64,
    is_default: bool,
    in_use: u64,
    pending: u64,
) -> u64 {
    if pool.draining || !(is_default || in_use > 0 || pending > 0) {
        return 0;
    }
    low_water(block_addrs)
}

/// Addresses of a block of `pool` in `family`.
pub fn block_size(pool: &ClusterPoolSpec, family: Family) -> u64 {
    let len = pool.block_len(family);
    let any = match family {
        Family::V4 => pool.ipv4.first(),
        Family::V6 => pool.ipv6.first(),
    };
    any.map_or(0, |c| {
        u64::try_from(block_addresses(*c, len)).unwrap_or(u64::MAX)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn net(s: &str) -> IpNet {
        s.parse().expect("net")
    }

    fn pool() -> ClusterPoolSpec {
        ClusterPoolSpec::new("pods")
            .with_cidr(net("10.1.0.0/16"))
            .with_cidr(net("fd00:1::/112"))
    }

    #[test]
    fn held_blocks_become_the_local_pool_and_fenced_ones_are_left_out() {
        let held = BTreeMap::from([(
            "pods".to_string(),
            BTreeSet::from([net("10.1.0.0/26"), net("10.1.0.64/26"), net("fd00:1::/122")]),
        )]);
        let fenced = BTreeSet::from([net("10.1.0.64/26")]);
        let (specs, clashes) = local_pools(&[pool()], &held, &fenced, &BTreeSet::new());
        assert!(clashes.is_empty());
        assert_eq!(specs.len(), 1);
        let s = &specs[0];
        assert_eq!(s.name, "pods");
        assert_eq!(s.ipv4, vec!["10.1.0.0/26".parse().expect("v4")]);
        assert_eq!(s.ipv6, vec!["fd00:1::/122".parse().expect("v6")]);
        assert!(s.allow_first_last);
        // The cluster CIDR's own first and last stay out.
        assert!(s.reserved.contains(&"10.1.0.0".parse().expect("ip")));
        assert!(s.reserved.contains(&"10.1.255.255".parse().expect("ip")));
        assert!(s.validate().is_ok());
    }

    #[test]
    fn a_pool_with_no_block_is_listed_empty_and_a_name_clash_is_named() {
        let (specs, _) = local_pools(
            &[pool()],
            &BTreeMap::new(),
            &BTreeSet::new(),
            &BTreeSet::new(),
        );
        assert_eq!(specs.len(), 1);
        assert!(specs[0].ipv4.is_empty() && specs[0].ipv6.is_empty());
        // Still serving both families: an endpoint waits for a block
        // rather than being given no address.
        assert_eq!(specs[0].families, vec![Family::V4, Family::V6]);
        let taken = BTreeSet::from(["pods".to_string()]);
        let (specs, clashes) = local_pools(&[pool()], &BTreeMap::new(), &BTreeSet::new(), &taken);
        assert!(specs.is_empty());
        assert_eq!(clashes, vec!["pods".to_string()]);
    }

    #[test]
    fn block_sizes_and_low_water() {
        assert_eq!(block_size(&pool(), Family::V4), 64);
        assert_eq!(block_size(&pool(), Family::V6), 64);
        assert_eq!(block_size(&ClusterPoolSpec::new("x"), Family::V4), 0);
        assert_eq!(low_water(64), 16);
        assert_eq!(low_water(4), 1);
        assert_eq!(low_water(0), 1);
    }
}

#[cfg(test)]
mod props {
    use super::*;
    use crate::cluster::layout::block_at;
    use crate::manager::{ManagerConfig, PoolManager, StaticPools};
    use proptest::prelude::*;

    proptest! {
        /// Whatever is held and fenced, the local pool lists exactly the
        /// held blocks that are not fenced, is a valid pool, and a manager
        /// serving it never hands out an address outside those blocks or
        /// the cluster CIDR's first or last address.
        #[test]
        fn the_local_pool_is_the_unfenced_blocks(
            held in proptest::collection::btree_set(0u128..16, 0..=16),
            fenced in proptest::collection::btree_set(0u128..16, 0..=16),
            allow_first_last in any::<bool>(),
        ) {
            let cidr: IpNet = "10.7.0.0/24".parse().expect("net");
            let mut pool = ClusterPoolSpec::new("p").with_cidr(cidr);
            pool.block_v4 = 28;
            pool.allow_first_last = allow_first_last;
            let block = |i: u128| block_at(cidr, 28, i).expect("block");
            let held_set: BTreeSet<IpNet> = held.iter().map(|i| block(*i)).collect();
            let fenced_set: BTreeSet<IpNet> = fenced.iter().map(|i| block(*i)).collect();
            let map = BTreeMap::from([("p".to_string(), held_set.clone())]);
            let (specs, _) = local_pools(&[pool], &map, &fenced_set, &BTreeSet::new());
            prop_assert_eq!(specs.len(), 1);
            let listed: BTreeSet<IpNet> = specs[0].cidrs().collect();
            let want: BTreeSet<IpNet> = held_set.difference(&fenced_set).copied().collect();
            prop_assert_eq!(&listed, &want);
            prop_assert!(specs[0].validate().is_ok());
            let mut m = PoolManager::new(StaticPools(specs), ManagerConfig::default()).expect("manager");
            prop_assert!(m.sync().errors.is_empty());
            for n in 0..300u32 {
                let owner = crate::owner::Owner::endpoint(format!("c{n}"), "eth0");
                let Ok(a) = m.allocate_next("p", Family::V4, owner) else {
                    break;
                };
                prop_assert!(want.iter().any(|b| b.contains(&a.address)), "{} outside", a.address);
                if !allow_first_last {
                    prop_assert!(a.address != cidr.network() && a.address != cidr.broadcast());
                }
            }
        }
    }
}
