//! [`plan_round`] against a model: a second, deliberately plain account
//! of the round's rules (addresses counted one by one, claims found by
//! adding blocks until the room suffices, give-backs as the longest run
//! of due blocks that leaves the reserve), compared on random nodes; and
//! the invariants the round must keep whatever the model says.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use ipnet::IpNet;
use proptest::prelude::*;

use super::*;
use crate::cluster::layout::block_at;

fn net(s: &str) -> IpNet {
    s.parse().expect("net")
}

/// A node's state as random numbers: owned, so an input can borrow it.
#[derive(Clone, Debug)]
struct World {
    pools: Vec<ClusterPoolSpec>,
    stored_default: Option<String>,
    /// Block, pool name, fenced, releasing, used.
    blocks: Vec<(IpNet, String, bool, bool, u64)>,
    reserved: BTreeSet<IpAddr>,
    wanted: BTreeSet<String>,
    empty_since: BTreeMap<IpNet, u64>,
    now_ms: u64,
    release_after_ms: u64,
}

/// The gates: name taken, may claim new, fresh, reachable.
type Gates = (bool, bool, bool, bool);

const OPEN: Gates = (false, true, true, true);

impl World {
    fn blocks(&self) -> Vec<RoundBlock<'_>> {
        self.blocks
            .iter()
            .map(|(cidr, pool, fenced, releasing, used)| RoundBlock {
                cidr: *cidr,
                pool,
                fenced: *fenced,
                releasing: *releasing,
                used: *used,
            })
            .collect()
    }

    fn plan(&self, gates: Gates) -> RoundPlan {
        let blocks = self.blocks();
        plan_round(&RoundInput {
            pools: &self.pools,
            stored_default: self.stored_default.as_deref(),
            blocks: &blocks,
            reserved: &self.reserved,
            wanted: &self.wanted,
            empty_since: &self.empty_since,
            now_ms: self.now_ms,
            release_after_ms: self.release_after_ms,
            name_taken: gates.0,
            may_claim_new: gates.1,
            fresh: gates.2,
            reachable: gates.3,
        })
    }

    fn pool(&self, name: &str) -> Option<&ClusterPoolSpec> {
        self.pools.iter().find(|p| p.name == name)
    }
}

/// The model's verdict, with every gate open.
#[derive(Debug, PartialEq, Eq)]
struct Verdict {
    empty_since: BTreeMap<IpNet, u64>,
    forget: BTreeSet<IpNet>,
    claims: BTreeMap<(String, bool), u64>,
    releases: Vec<IpNet>,
    unwant: BTreeSet<String>,
    in_use: u64,
    wanted_total: u64,
}

fn is_v4(b: IpNet) -> bool {
    matches!(b, IpNet::V4(_))
}

/// Every address of `b`, one by one (blocks here are small).
fn addresses(b: IpNet) -> Vec<IpAddr> {
    match b {
        IpNet::V4(n) => {
            let first = u32::from(n.network());
            let count = 1u32 << (32 - n.prefix_len());
            (0..count)
                .map(|k| IpAddr::from(std::net::Ipv4Addr::from(first + k)))
                .collect()
        }
        IpNet::V6(n) => {
            let first = u128::from(n.network());
            let count = 1u128 << (128 - n.prefix_len());
            (0..count)
                .map(|k| IpAddr::from(std::net::Ipv6Addr::from(first + k)))
                .collect()
        }
    }
}

/// Addresses of `b` a node may hand out: every one, but the first and
/// last of each of the pool's CIDRs unless the pool allows them.
fn usable(pool: &ClusterPoolSpec, b: IpNet) -> u64 {
    let edge = |a: &IpAddr| {
        pool.ipv4
            .iter()
            .chain(&pool.ipv6)
            .any(|c| *a == c.network() || *a == c.broadcast())
    };
    addresses(b)
        .iter()
        .filter(|a| pool.allow_first_last || !edge(a))
        .count() as u64
}

/// Addresses in a new block of `pool` in the family: 0 without a CIDR.
fn new_block(pool: &ClusterPoolSpec, v4: bool) -> u64 {
    let (cidrs, len, bits) = if v4 {
        (&pool.ipv4, pool.block_v4, 32)
    } else {
        (&pool.ipv6, pool.block_v6, 128)
    };
    if cidrs.is_empty() {
        0
    } else {
        1u64 << (bits - len)
    }
}

/// The free addresses kept ready: a quarter of a block, at least one and
/// at most 16, for the default pool or one used or waited on; none for a
/// draining pool.
fn kept_ready(pool: &ClusterPoolSpec, size: u64, default: bool, used: u64, pending: u64) -> u64 {
    if pool.draining || !(default || used > 0 || pending > 0) {
        0
    } else {
        (size / 4).clamp(1, 16)
    }
}

fn model(w: &World) -> Verdict {
    let reserved_in = |b: IpNet| w.reserved.iter().filter(|a| b.contains(*a)).count() as u64;
    let mut empty_since = w.empty_since.clone();
    for (b, _, _, _, used) in &w.blocks {
        if *used == 0 {
            empty_since.insert(*b, *w.empty_since.get(b).unwrap_or(&w.now_ms));
        } else {
            empty_since.remove(b);
        }
    }
    let forget = w
        .blocks
        .iter()
        .filter(|(_, _, fenced, _, used)| *fenced && *used == 0)
        .map(|(b, ..)| *b)
        .collect();
    let in_use: u64 = w.blocks.iter().map(|(.., used)| used).sum();
    let default = match &w.stored_default {
        Some(name) => w.pool(name).map(|p| p.name.clone()),
        None if w.pools.len() == 1 => Some(w.pools[0].name.clone()),
        None => None,
    };
    let mut claims = BTreeMap::new();
    let mut releases = Vec::new();
    let mut unwant = BTreeSet::new();
    let mut wanted_total = in_use;
    for pool in &w.pools {
        for v4 in [true, false] {
            let size = new_block(pool, v4);
            if size == 0 {
                continue;
            }
            let waited = w.wanted.contains(&pool.name);
            if waited && pool.draining {
                unwant.insert(pool.name.clone());
            }
            let pending = u64::from(waited && !pool.draining);
            let ours: Vec<_> = w
                .blocks
                .iter()
                .filter(|(b, p, _, releasing, _)| *p == pool.name && is_v4(*b) == v4 && !releasing)
                .collect();
            let used_here: u64 = ours.iter().map(|(.., u)| u).sum();
            let is_default = default.as_deref() == Some(pool.name.as_str());
            let low = kept_ready(pool, size, is_default, used_here, pending);
            wanted_total += pending + low;
            // Serving blocks: their room, and what takes it.
            let serving: Vec<_> = ours.iter().filter(|(_, _, fenced, ..)| !fenced).collect();
            let room: u64 = serving.iter().map(|(b, ..)| usable(pool, *b)).sum();
            let taken: u64 = serving.iter().map(|(b, .., u)| u + reserved_in(*b)).sum();
            if !pool.draining {
                let mut n = 0;
                while room + n * size < taken + pending + low {
                    n += 1;
                }
                if n > 0 {
                    claims.insert((pool.name.clone(), v4), n);
                }
            }
            // Give-backs: the due blocks, highest first; as many as leave
            // the reserve free.
            let hysteresis = if pool.draining { 0 } else { w.release_after_ms };
            let free: u64 = serving
                .iter()
                .map(|(b, .., u)| usable(pool, *b).saturating_sub(u + reserved_in(*b)))
                .sum();
            let mut due: Vec<IpNet> = serving
                .iter()
                .filter(|(b, .., u)| *u == 0 && reserved_in(*b) == 0)
                .filter(|(b, ..)| w.now_ms.saturating_sub(empty_since[b]) >= hysteresis)
                .map(|(b, ..)| *b)
                .collect();
            due.sort();
            due.reverse();
            let keep = (0..=due.len())
                .rev()
                .find(|k| {
                    let gone: u64 = due[..*k].iter().map(|b| usable(pool, *b)).sum();
                    free >= gone && free - gone >= low
                })
                .unwrap_or(0);
            releases.extend(&due[..keep]);
        }
    }
    releases.extend(
        w.blocks
            .iter()
            .filter(|(_, _, _, releasing, _)| *releasing)
            .map(|(b, ..)| *b),
    );
    releases.sort();
    Verdict {
        empty_since,
        forget,
        claims,
        releases,
        unwant,
        in_use,
        wanted_total,
    }
}

/// The plan in the model's terms.
fn verdict(w: &World, p: &RoundPlan) -> Verdict {
    let mut releases: Vec<IpNet> = p.releases.iter().map(|&i| w.blocks[i].0).collect();
    releases.sort();
    Verdict {
        empty_since: p.empty_since.clone(),
        forget: p.forget.iter().map(|&i| w.blocks[i].0).collect(),
        claims: p
            .claims
            .iter()
            .map(|c| ((c.pool.name.clone(), c.family == Family::V4), c.count))
            .collect(),
        releases,
        unwant: p.unwant.clone(),
        in_use: p.in_use,
        wanted_total: p.wanted_total,
    }
}

/// One pool: v4 block length (none: no v4), a second v4 CIDR, v6 block
/// length (none: no v6), `allow_first_last`, draining.
type PoolDraw = (Option<u8>, bool, Option<u8>, bool, bool);
/// One held block: pool (one past the pools: a pool no longer listed),
/// v4, index, use (per mille of the block; low values: empty), fenced,
/// releasing.
type BlockDraw = (usize, bool, u8, u16, u8, u8);

fn pool_draw() -> impl Strategy<Value = PoolDraw> {
    (
        proptest::option::weighted(0.8, 26u8..=30),
        any::<bool>(),
        proptest::option::weighted(0.6, 122u8..=126),
        any::<bool>(),
        proptest::bool::weighted(0.2),
    )
}

fn block_draw() -> impl Strategy<Value = BlockDraw> {
    (
        0usize..4,
        any::<bool>(),
        any::<u8>(),
        0u16..1400,
        0u8..10,
        0u8..10,
    )
}

#[expect(
    clippy::too_many_arguments,
    reason = "one argument per random draw, as proptest hands them over"
)]
fn world(
    pools: &[PoolDraw],
    blocks: &[BlockDraw],
    reserved: &[(usize, u8)],
    wanted: &BTreeSet<usize>,
    stored_default: Option<usize>,
    ages: &[Option<u64>],
    now_ms: u64,
    release_after_ms: u64,
) -> World {
    let pools: Vec<ClusterPoolSpec> = pools
        .iter()
        .enumerate()
        .map(|(i, (b4, two, b6, allow, draining))| {
            let mut p = ClusterPoolSpec::new(format!("p{i}"));
            if let Some(len) = b4 {
                p = p.with_cidr(net(&format!("10.{i}.0.0/24")));
                if *two {
                    p = p.with_cidr(net(&format!("10.{i}.1.0/24")));
                }
                p.block_v4 = *len;
            }
            if let Some(len) = b6 {
                p = p.with_cidr(net(&format!("fd00:{i}::/120")));
                p.block_v6 = *len;
            }
            p.allow_first_last = *allow;
            p.draining = *draining;
            p
        })
        .collect();
    // Held blocks, one per address range: of a listed pool's CIDRs (or
    // where they would be), or of a pool etcd no longer lists.
    let mut held: BTreeMap<IpNet, (String, bool, bool, u64)> = BTreeMap::new();
    for (pool, v4, index, per_mille, fenced, releasing) in blocks {
        let i = pool % (pools.len() + 1);
        let name = pools
            .get(i)
            .map_or_else(|| "gone".to_owned(), |p| p.name.clone());
        let (cidr, len) = match pools.get(i) {
            Some(p) if *v4 && !p.ipv4.is_empty() => {
                (p.ipv4[usize::from(*index) % p.ipv4.len()], p.block_v4)
            }
            Some(p) if !v4 && !p.ipv6.is_empty() => (p.ipv6[0], p.block_v6),
            _ if *v4 => (net("10.9.0.0/28"), 30),
            _ => (net("fd00:9::/124"), 126),
        };
        let count = 1u128 << (len - cidr.prefix_len());
        let Some(b) = block_at(cidr, len, u128::from(*index / 2) % count) else {
            continue;
        };
        if held.contains_key(&b) {
            continue;
        }
        let all = addresses(b).len() as u64;
        // A third of the blocks empty; the others with some use, at
        // times more than the block holds once reserved addresses count.
        let used = u64::from(per_mille.saturating_sub(400)) * all / 1000;
        held.insert(b, (name, *fenced < 2, *releasing < 1, used));
    }
    let blocks: Vec<(IpNet, String, bool, bool, u64)> = held
        .into_iter()
        .map(|(b, (p, f, r, u))| (b, p, f, r, u))
        .collect();
    // Reserved addresses: inside held blocks mostly, some elsewhere.
    let reserved = reserved
        .iter()
        .filter_map(|(k, offset)| {
            let b = blocks
                .get(k % (blocks.len() + 1))
                .map_or(net("10.8.0.0/28"), |b| b.0);
            let all = addresses(b);
            all.get(usize::from(*offset) % all.len()).copied()
        })
        .collect();
    let wanted = wanted
        .iter()
        .map(|i| {
            pools
                .get(*i)
                .map_or_else(|| "nowhere".to_owned(), |p| p.name.clone())
        })
        .collect();
    let stored_default = stored_default.map(|i| {
        pools
            .get(i)
            .map_or_else(|| "nowhere".to_owned(), |p| p.name.clone())
    });
    // Since when each block was empty, as a previous round left it (an
    // age before now), also for blocks no longer held.
    let mut empty_since = BTreeMap::new();
    let known: Vec<IpNet> = blocks
        .iter()
        .map(|b| b.0)
        .chain([net("10.7.0.0/30")])
        .collect();
    for (b, age) in known.iter().zip(ages) {
        if let Some(age) = age {
            empty_since.insert(*b, now_ms.saturating_sub(*age));
        }
    }
    World {
        pools,
        stored_default,
        blocks,
        reserved,
        wanted,
        empty_since,
        now_ms,
        release_after_ms,
    }
}

prop_compose! {
    fn worlds()(
        pools in proptest::collection::vec(pool_draw(), 0..=3),
        blocks in proptest::collection::vec(block_draw(), 0..14),
        reserved in proptest::collection::vec((0usize..16, any::<u8>()), 0..6),
        wanted in proptest::collection::btree_set(0usize..4, 0..3),
        stored_default in proptest::option::of(0usize..4),
        ages in proptest::collection::vec(proptest::option::of(0u64..60_000), 0..16),
        now_ms in 0u64..200_000,
        release_after_ms in prop_oneof![Just(0u64), 1u64..40_000],
    ) -> World {
        world(&pools, &blocks, &reserved, &wanted, stored_default, &ages, now_ms, release_after_ms)
    }
}

fn gates() -> impl Strategy<Value = Gates> {
    (
        proptest::bool::weighted(0.3),
        proptest::bool::weighted(0.7),
        proptest::bool::weighted(0.7),
        any::<bool>(),
    )
}

proptest! {
    #![proptest_config(crate::testing::cases(512))]

    /// With every gate open, the plan says what the model says: the
    /// empty-since map, the fenced blocks forgotten, the claims per pool
    /// and family, the give-backs, the pools dropped from the wanted set,
    /// the addresses in use and wanted.
    #[test]
    fn the_plan_is_the_models(w in worlds()) {
        let p = w.plan(OPEN);
        prop_assert_eq!(p.held_back, None);
        prop_assert!(!p.read_next && !p.wake);
        prop_assert_eq!(verdict(&w, &p), model(&w));
        // Each claim carries its pool as read.
        for c in &p.claims {
            prop_assert_eq!(Some(&c.pool), w.pool(&c.pool.name));
        }
    }

    /// Whatever the gates: no block is given back with an address in use
    /// or reserved in it, or fenced, or before it was empty long enough
    /// (unless its give-back is being made again); none twice; a draining
    /// pool and a family with no CIDR claim nothing; a pool and family
    /// never both claim and give back; in-use is the sum of the use; the
    /// forgotten blocks are exactly the fenced ones with nothing in use;
    /// every empty block has an empty-since time and no used one has.
    #[test]
    fn the_round_keeps_its_invariants(w in worlds(), g in gates()) {
        let p = w.plan(g);
        let mut seen = BTreeSet::new();
        for &i in &p.releases {
            prop_assert!(seen.insert(i), "block {} given back twice", w.blocks[i].0);
            let (b, pool, fenced, releasing, used) = &w.blocks[i];
            if *releasing {
                continue;
            }
            prop_assert_eq!(*used, 0, "{} given back in use", b);
            prop_assert!(!w.reserved.iter().any(|a| b.contains(a)), "{} given back with a reserved address", b);
            prop_assert!(!fenced, "{} given back fenced", b);
            let pool = w.pool(pool).expect("a listed pool");
            let hysteresis = if pool.draining { 0 } else { w.release_after_ms };
            prop_assert!(w.now_ms - p.empty_since[b] >= hysteresis, "{} given back early", b);
            // Giving back never forces a claim, as long as no block
            // counts more taken than it holds (counts the allocator and
            // etcd never give together).
            let consistent = w.blocks.iter().all(|(c, q, _, _, u)| {
                q != &pool.name
                    || u + w.reserved.iter().filter(|a| c.contains(*a)).count() as u64 <= usable(pool, *c)
            });
            prop_assert!(
                !consistent
                    || !p.claims.iter().any(|c| c.pool.name == pool.name && (c.family == Family::V4) == is_v4(*b)),
                "{} given back while its pool claims", b
            );
        }
        for c in &p.claims {
            prop_assert!(!c.pool.draining, "claim for draining pool {}", c.pool.name);
            prop_assert!(c.count > 0);
            prop_assert!(new_block(&c.pool, c.family == Family::V4) > 0);
        }
        prop_assert_eq!(p.in_use, w.blocks.iter().map(|b| b.4).sum::<u64>());
        let fenced_empty: Vec<usize> = (0..w.blocks.len())
            .filter(|&i| w.blocks[i].2 && w.blocks[i].4 == 0)
            .collect();
        prop_assert_eq!(&p.forget, &fenced_empty);
        for (b, .., used) in &w.blocks {
            prop_assert_eq!(p.empty_since.contains_key(b), *used == 0);
            if let Some(t) = p.empty_since.get(b) {
                prop_assert!(*t <= w.now_ms);
            }
        }
        prop_assert!(p.wanted_total >= p.in_use);
    }

    /// The gates hold back claims and nothing else: no claim when the
    /// name is taken, in the grace after a rollback or without a fresh
    /// read; the first gate that holds is named; only a stale read asks
    /// for the next round to read, and a wake only when etcd answers.
    #[test]
    fn the_gates_hold_back_claims_only(w in worlds(), g in gates()) {
        let open = w.plan(OPEN);
        let p = w.plan(g);
        let (name_taken, may_claim_new, fresh, reachable) = g;
        let gate = if name_taken {
            Some(Gate::NameTaken)
        } else if !may_claim_new {
            Some(Gate::Grace)
        } else if !fresh {
            Some(Gate::NotFresh)
        } else {
            None
        };
        if gate.is_some() {
            prop_assert!(p.claims.is_empty(), "claims under {:?}", gate);
        }
        let expect = if open.claims.is_empty() { None } else { gate };
        prop_assert_eq!(p.held_back, expect);
        if expect.is_none() {
            prop_assert_eq!(&p.claims, &open.claims);
        }
        prop_assert_eq!(p.read_next, expect == Some(Gate::NotFresh));
        prop_assert_eq!(p.wake, p.read_next && reachable);
        prop_assert_eq!(&p.releases, &open.releases);
        prop_assert_eq!(&p.forget, &open.forget);
        prop_assert_eq!(&p.empty_since, &open.empty_since);
        prop_assert_eq!(&p.unwant, &open.unwant);
        prop_assert_eq!((p.in_use, p.wanted_total), (open.in_use, open.wanted_total));
    }
}

/// A node of one pool, 10.1.0.0/24 in /26 blocks.
fn one_pool(blocks: &[(&str, u64)]) -> World {
    let mut pool = ClusterPoolSpec::new("pods").with_cidr(net("10.1.0.0/24"));
    pool.allow_first_last = true;
    World {
        pools: vec![pool],
        stored_default: None,
        blocks: blocks
            .iter()
            .map(|(b, used)| (net(b), "pods".to_owned(), false, false, *used))
            .collect(),
        reserved: BTreeSet::new(),
        wanted: BTreeSet::new(),
        empty_since: BTreeMap::new(),
        now_ms: 100_000,
        release_after_ms: 30_000,
    }
}

#[test]
fn the_default_pool_claims_its_reserve_and_a_waited_pool_one_more_address() {
    // No block: the default pool (the only one) keeps 16 ready: one block.
    let w = one_pool(&[]);
    let p = w.plan(OPEN);
    assert_eq!(p.claims.len(), 1);
    assert_eq!((p.claims[0].family, p.claims[0].count), (Family::V4, 1));
    assert_eq!(p.wanted_total, 16);
    // 48 used of 64: exactly the reserve left, no claim; one waiting
    // allocation more and a block is claimed.
    let mut w = one_pool(&[("10.1.0.0/26", 48)]);
    assert!(w.plan(OPEN).claims.is_empty());
    w.wanted.insert("pods".into());
    assert_eq!(w.plan(OPEN).claims[0].count, 1);
    assert_eq!(w.plan(OPEN).wanted_total, 48 + 1 + 16);
}

#[test]
fn an_empty_block_goes_back_after_the_hysteresis_unless_reserved_in() {
    let mut w = one_pool(&[("10.1.0.0/26", 1), ("10.1.0.64/26", 0)]);
    // Just emptied: kept for now, the time recorded.
    let p = w.plan(OPEN);
    assert!(p.releases.is_empty());
    assert_eq!(p.empty_since.get(&net("10.1.0.64/26")), Some(&100_000));
    w.empty_since = p.empty_since;
    w.now_ms += 30_000;
    assert_eq!(w.plan(OPEN).releases, vec![1]);
    // An address reserved for another node keeps it.
    w.reserved.insert("10.1.0.70".parse().expect("addr"));
    assert!(w.plan(OPEN).releases.is_empty());
}

#[test]
fn a_draining_pool_gives_back_at_once_and_leaves_the_wanted_set() {
    let mut w = one_pool(&[("10.1.0.0/26", 0), ("10.1.0.64/26", 3)]);
    w.pools[0].draining = true;
    w.wanted.insert("pods".into());
    let p = w.plan(OPEN);
    assert!(p.claims.is_empty());
    assert_eq!(p.releases, vec![0]);
    assert_eq!(p.unwant, BTreeSet::from(["pods".to_owned()]));
    assert_eq!(p.wanted_total, 3);
}

#[test]
fn a_fenced_block_is_forgotten_once_empty_and_never_given_back() {
    let mut w = one_pool(&[("10.1.0.0/26", 0), ("10.1.0.64/26", 2)]);
    w.blocks[0].2 = true;
    w.blocks[1].2 = true;
    w.now_ms = 1_000_000;
    let p = w.plan(OPEN);
    assert_eq!(p.forget, vec![0]);
    assert!(p.releases.is_empty());
    // Neither serves: the reserve is claimed anew.
    assert_eq!(p.claims[0].count, 1);
}

#[test]
fn a_stale_read_asks_for_a_read_and_wakes_only_when_etcd_answers() {
    let w = one_pool(&[]);
    let p = w.plan((false, true, false, true));
    assert_eq!(p.held_back, Some(Gate::NotFresh));
    assert!(p.claims.is_empty() && p.read_next && p.wake);
    let p = w.plan((false, true, false, false));
    assert!(p.read_next && !p.wake);
    // The name taken comes first, and asks for no read.
    let p = w.plan((true, false, false, true));
    assert_eq!(p.held_back, Some(Gate::NameTaken));
    assert!(!p.read_next && !p.wake);
    // Nothing to claim: no gate held anything back.
    let w = one_pool(&[("10.1.0.0/26", 0)]);
    let p = w.plan((true, false, false, true));
    assert_eq!(p.held_back, None);
    assert!(!p.read_next);
}
