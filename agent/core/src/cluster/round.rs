//! The decisions of one claim round, as one pure function: from the
//! blocks a node holds, the addresses in use and reserved in them, the
//! pools waited on and the time, which blocks to claim, which to give
//! back, which fenced ones to forget, what to publish, and whether a gate
//! holds the claims back.
//!
//! Why in the core: these decisions were made inline in the daemon's
//! round, between an etcd read and the claims, where only the whole
//! agent against etcd could test them. Together they decide whether a
//! node hands out an address that is not its own or gives back a block
//! with an address in it; here they are property-tested against a
//! simple model (`round/tests.rs`). The daemon reads, calls [`plan_round`] and
//! carries out the [`RoundPlan`] (the claims in etcd, the give-backs, the
//! record, the counters).

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use ipnet::IpNet;

use super::decide::{BlockUse, blocks_to_release};
use super::default::default_pool;
use super::local::{block_size, blocks_wanted, reserve, usable_in_block};
use super::reclaim::reserved_in_block;
use super::spec::ClusterPoolSpec;
use crate::cidr::Family;

/// One block the node holds, as the round sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RoundBlock<'a> {
    /// The block.
    pub cidr: IpNet,
    /// Its cluster pool's name.
    pub pool: &'a str,
    /// etcd no longer gives it to this node: nothing new comes from it.
    pub fenced: bool,
    /// Its give-back was sent and not answered: given back again.
    pub releasing: bool,
    /// Addresses the allocator holds in it.
    pub used: u64,
}

/// What holds a round's claims back, in the order they are asked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gate {
    /// Another instance holds this node's name: no claim until it is this
    /// agent's again.
    NameTaken,
    /// etcd went back in time: the blocks it lost are claimed back first,
    /// and the other holders get the grace to do the same.
    Grace,
    /// The round did not read etcd (or could not): claims pick from a
    /// fresh read, so the next round reads.
    NotFresh,
}

/// Everything one round decides from.
#[derive(Clone, Copy, Debug)]
pub struct RoundInput<'a> {
    /// The cluster pools, as last read.
    pub pools: &'a [ClusterPoolSpec],
    /// The default pool etcd records (`None`: none recorded), as
    /// [`default_pool`] takes it.
    pub stored_default: Option<&'a str>,
    /// The blocks the node holds, fenced and being given back included.
    pub blocks: &'a [RoundBlock<'a>],
    /// Addresses reserved for another node: not free, and a block holding
    /// one is not empty.
    pub reserved: &'a BTreeSet<IpAddr>,
    /// The pools allocations wait on (an ADD found no free address).
    pub wanted: &'a BTreeSet<String>,
    /// Since when each block has been empty, as the last round left it.
    pub empty_since: &'a BTreeMap<IpNet, u64>,
    /// The time now, in milliseconds.
    pub now_ms: u64,
    /// How long a block stays empty before it is given back (a draining
    /// pool's go back at once).
    pub release_after_ms: u64,
    /// Another instance holds this node's name.
    pub name_taken: bool,
    /// Outside the grace after a rollback of etcd (the core's
    /// [`super::may_claim_new`]).
    pub may_claim_new: bool,
    /// The round read etcd and etcd answered.
    pub fresh: bool,
    /// etcd answered this round.
    pub reachable: bool,
}

/// One claim the round asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockClaim {
    /// The pool to claim from, as read (claims may read again meanwhile).
    pub pool: ClusterPoolSpec,
    /// The family.
    pub family: Family,
    /// How many blocks.
    pub count: u64,
}

/// What one round decided: the daemon carries it out.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RoundPlan {
    /// The empty-since map for the next round: each held block with
    /// nothing in use keeps its time (or starts at now), a block in use
    /// has none; blocks no longer held are left as they were.
    pub empty_since: BTreeMap<IpNet, u64>,
    /// Fenced blocks with nothing in use, to forget (indices into
    /// [`RoundInput::blocks`]): they are not this node's.
    pub forget: Vec<usize>,
    /// The blocks to claim, per pool and family; empty when a gate holds
    /// them back.
    pub claims: Vec<BlockClaim>,
    /// The blocks to give back (indices into [`RoundInput::blocks`]):
    /// empty ones past the hysteresis that leave the reserve free, then
    /// every block whose give-back is unanswered.
    pub releases: Vec<usize>,
    /// Draining pools waited on: no block comes for them, so they leave
    /// the wanted set.
    pub unwant: BTreeSet<String>,
    /// Addresses in use on the node (published in its record).
    pub in_use: u64,
    /// Addresses the node wants: in use, waited on and kept ready
    /// (published in its record).
    pub wanted_total: u64,
    /// The gate that held claims back, if any held some.
    pub held_back: Option<Gate>,
    /// The next round must read etcd (claims waited for a fresh read).
    pub read_next: bool,
    /// The next round should start now rather than at the next tick:
    /// claims wait for a read and etcd answers (waking against a dead
    /// etcd spun the loop).
    pub wake: bool,
}

/// The round's decisions from `input`: see [`RoundPlan`] for each.
///
/// Per pool and family, the serving blocks' usable room (reserved
/// addresses count as used) must cover what is in use, one address per
/// allocation waiting and the reserve kept ready ([`reserve`]); the
/// missing room is claimed in whole blocks ([`blocks_wanted`]). Empty
/// blocks go back only past `release_after_ms` and while the reserve
/// stays free ([`blocks_to_release`]). A draining pool claims nothing,
/// keeps no reserve and gives its empty blocks back at once.
pub fn plan_round(input: &RoundInput<'_>) -> RoundPlan {
    let blocks = input.blocks;
    let taken: Vec<u64> = blocks
        .iter()
        .map(|b| {
            b.used
                .saturating_add(reserved_in_block(b.cidr, input.reserved))
        })
        .collect();
    let mut empty_since = input.empty_since.clone();
    let mut forget = Vec::new();
    for (i, b) in blocks.iter().enumerate() {
        if b.used == 0 {
            empty_since.entry(b.cidr).or_insert(input.now_ms);
        } else {
            empty_since.remove(&b.cidr);
        }
        if b.fenced && b.used == 0 {
            forget.push(i);
        }
    }
    let in_use = blocks.iter().map(|b| b.used).fold(0, u64::saturating_add);
    let default = default_pool(input.pools, input.stored_default)
        .ok()
        .flatten();
    let mut wanted_total = in_use;
    let mut claims = Vec::new();
    let mut releases = Vec::new();
    let mut unwant = BTreeSet::new();
    for pool in input.pools {
        let waited = input.wanted.contains(&pool.name);
        for family in [Family::V4, Family::V6] {
            let size = block_size(pool, family);
            if size == 0 {
                continue;
            }
            // A block whose give-back went unanswered is neither room nor
            // a candidate: it is given back again below.
            let mine: Vec<usize> = (0..blocks.len())
                .filter(|&i| {
                    let b = &blocks[i];
                    b.pool == pool.name && Family::of_net(b.cidr) == family && !b.releasing
                })
                .collect();
            // The serving blocks and their use: capacity is counted in
            // usable addresses (a /30 block of a /30 CIDR holds 2; counted
            // as 4, a node stalled at 2 addresses).
            let serving: Vec<(IpNet, u64)> = mine
                .iter()
                .filter(|&&i| !blocks[i].fenced)
                .map(|&i| (blocks[i].cidr, taken[i]))
                .collect();
            let pending = u64::from(waited && !pool.draining);
            if pool.draining && waited {
                unwant.insert(pool.name.clone());
            }
            // Free addresses kept ready: for the default pool always, for
            // another only while used here or waited on; none for a pool
            // being removed (#26 item 12).
            let in_pool = mine
                .iter()
                .map(|&i| blocks[i].used)
                .fold(0, u64::saturating_add);
            let is_default = default.as_deref() == Some(pool.name.as_str());
            let low = reserve(pool, size, is_default, in_pool, pending);
            let n = blocks_wanted(pool, family, &serving, pending, low);
            wanted_total = wanted_total.saturating_add(pending + low);
            if n > 0 {
                claims.push(BlockClaim {
                    pool: pool.clone(),
                    family,
                    count: n,
                });
            }
            let uses: Vec<BlockUse> = mine
                .iter()
                .map(|&i| BlockUse {
                    block: blocks[i].cidr,
                    used: taken[i],
                    usable: usable_in_block(pool, blocks[i].cidr),
                    empty_since_ms: empty_since.get(&blocks[i].cidr).copied(),
                    fenced: blocks[i].fenced,
                })
                .collect();
            // A pool being removed gives its empty blocks back at once.
            let hysteresis = if pool.draining {
                0
            } else {
                input.release_after_ms
            };
            for cidr in blocks_to_release(&uses, input.now_ms, hysteresis, low) {
                if let Some(&i) = mine.iter().find(|&&i| blocks[i].cidr == cidr) {
                    releases.push(i);
                }
            }
        }
    }
    releases.extend((0..blocks.len()).filter(|&i| blocks[i].releasing));
    let held_back = if claims.is_empty() {
        None
    } else if input.name_taken {
        Some(Gate::NameTaken)
    } else if !input.may_claim_new {
        Some(Gate::Grace)
    } else if !input.fresh {
        Some(Gate::NotFresh)
    } else {
        None
    };
    if held_back.is_some() {
        claims.clear();
    }
    let read_next = held_back == Some(Gate::NotFresh);
    RoundPlan {
        empty_since,
        forget,
        claims,
        releases,
        unwant,
        in_use,
        wanted_total,
        held_back,
        read_next,
        wake: read_next && input.reachable,
    }
}

#[cfg(test)]
mod tests;
