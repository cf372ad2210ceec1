//! What a node does with blocks: which to claim, when to claim, when to give
//! one back; fencing (at start and at every read). Node removal and reclaim
//! are [`super::reclaim`]'s.

use super::layout::{block_at, block_count, block_index};
use super::spec::ClusterPoolSpec;
use crate::cidr::Family;
use ipnet::IpNet;
use std::collections::{BTreeMap, BTreeSet};

/// The next block of `pool` (one family) that `node_blocks` (the blocks the
/// node already holds) should be extended with, skipping every block in
/// `claimed` (held by anyone). Deterministic: the free block right after the
/// node's highest held block in the same CIDR first (blocks of one node stay
/// near each other, so routes aggregate). A node holding none of the pool's
/// blocks starts at a place its name spreads over the pool ([`spread`]) and
/// takes the first free block from there, wrapping round: nodes starting
/// together then seldom race for one block (they all would, started at the
/// first free block: measured 95% of claims lost with 32 new nodes at once).
/// `None` when the family is full.
pub fn next_block(
    pool: &ClusterPoolSpec,
    family: Family,
    claimed: &BTreeSet<IpNet>,
    node_blocks: &BTreeSet<IpNet>,
    node: &str,
) -> Option<IpNet> {
    let block = pool.block_len(family);
    let cidrs = match family {
        Family::V4 => &pool.ipv4,
        Family::V6 => &pool.ipv6,
    };
    // The first free block of `cidr` at or after `start`, wrapping round.
    let first_free = |cidr: IpNet, start: u128| {
        let count = block_count(cidr, block);
        (0..count)
            .map(|i| block_at(cidr, block, (start + i) % count))
            .find_map(|b| b.filter(|b| !claimed.contains(b)))
    };
    for &cidr in cidrs {
        if let Some(highest) = node_blocks
            .iter()
            .filter_map(|b| block_index(cidr, block, *b))
            .max()
            && let Some(found) = first_free(cidr, highest + 1)
        {
            return Some(found);
        }
    }
    let total: u128 = cidrs.iter().map(|&c| block_count(c, block)).sum();
    if total == 0 {
        return None;
    }
    // The spread start, as a CIDR and an index in it; then every CIDR in
    // turn from there.
    let mut start = spread(node) % total;
    let first = cidrs.iter().position(|&c| {
        let n = block_count(c, block);
        if start < n {
            true
        } else {
            start -= n;
            false
        }
    })?;
    (0..cidrs.len()).find_map(|k| {
        let cidr = cidrs[(first + k) % cidrs.len()];
        first_free(cidr, if k == 0 { start } else { 0 })
    })
}

/// A stable, well-mixed number from a node's name (FNV-1a, then a
/// finaliser): where a node with no block starts looking.
pub fn spread(node: &str) -> u128 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in node.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    // splitmix64's finaliser: FNV's low bits alone mix poorly.
    h ^= h >> 30;
    h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h ^= h >> 27;
    h = h.wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^= h >> 31;
    u128::from(h)
}

/// How many blocks to claim now so the node holds enough addresses: the
/// addresses wanted (`in_use` + `pending` + `low_water` kept ready) less
/// `held`, in blocks of `block_addrs`, rounded up. `held` is the usable
/// capacity of the blocks the node serves (in use and free together, less
/// reserved addresses: [`super::usable_in_block`]), not the free count.
///
/// For blocks whose every address is usable this is the demand logic of
/// [`crate::demand`] in ceil mode (target rounded up to whole blocks, less
/// what is held). That rounding compared a multiple of the block size
/// with the capacity: with reserved addresses in a block (a /30 block of a
/// /30 CIDR holds 2) it claimed a spare block, and with capacity counted
/// as whole blocks it never claimed at all; the difference itself is
/// correct for both.
pub fn blocks_to_claim(
    in_use: u64,
    pending: u64,
    held: u64,
    low_water: u64,
    block_addrs: u64,
) -> u64 {
    in_use
        .saturating_add(pending)
        .saturating_add(low_water)
        .saturating_sub(held)
        .div_ceil(block_addrs.max(1))
}

/// One block a node holds, as the release decision sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockUse {
    /// The block.
    pub block: IpNet,
    /// Addresses allocated from it.
    pub used: u64,
    /// Addresses it can hand out ([`super::usable_in_block`]): the free
    /// count is this less `used`.
    pub usable: u64,
    /// Since when it has been empty (`None` while in use).
    pub empty_since_ms: Option<u64>,
    /// Fenced blocks are never given back by the node (they are no longer
    /// its own) and never counted as free.
    pub fenced: bool,
}

/// The empty blocks to give back at `now_ms`: each empty for at least
/// `hysteresis_ms`, and only while the free addresses left in the other
/// blocks stay at or above `low_water` (giving one back must not force a
/// claim). Highest blocks first, so the node's blocks stay packed low.
pub fn blocks_to_release(
    blocks: &[BlockUse],
    now_ms: u64,
    hysteresis_ms: u64,
    low_water: u64,
) -> Vec<IpNet> {
    let size = |b: &BlockUse| b.usable;
    let mut free: u64 = blocks
        .iter()
        .filter(|b| !b.fenced)
        .map(|b| size(b).saturating_sub(b.used))
        .fold(0, u64::saturating_add);
    let mut due: Vec<&BlockUse> = blocks
        .iter()
        .filter(|b| !b.fenced && b.used == 0)
        .filter(|b| {
            b.empty_since_ms
                .is_some_and(|t| now_ms.saturating_sub(t) >= hysteresis_ms)
        })
        .collect();
    due.sort_by_key(|b| std::cmp::Reverse(b.block));
    let mut out = Vec::new();
    for b in due {
        let left = free.saturating_sub(size(b));
        if left < low_water {
            break;
        }
        free = left;
        out.push(b.block);
    }
    out
}

/// Why a block in the local store may no longer be allocated from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Fence {
    /// etcd records another node as its owner.
    OwnedBy(String),
    /// etcd has no record of it: it was given back or reclaimed meanwhile.
    Absent,
}

/// The fencing decision, before a node serves and at every read of etcd
/// while it runs: each block of its local store (`local`) whose owner in
/// etcd (`owners`: block → node) is not `node`. A fenced block is left out
/// of the allocator's pools at once ([`super::local_pools`]).
/// Blocks absent from etcd are fenced too: the node cannot know whether
/// another node claimed and released it meanwhile; claiming it again (a
/// create-if-absent) is the only way back.
pub fn fence(
    node: &str,
    local: &BTreeSet<IpNet>,
    owners: &BTreeMap<IpNet, String>,
) -> BTreeMap<IpNet, Fence> {
    local
        .iter()
        .filter_map(|b| match owners.get(b) {
            Some(owner) if owner == node => None,
            Some(owner) => Some((*b, Fence::OwnedBy(owner.clone()))),
            None => Some((*b, Fence::Absent)),
        })
        .collect()
}
