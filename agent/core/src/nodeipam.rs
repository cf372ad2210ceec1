//! NodeIPAM (#29 item 5, the seed's ENI model): an external operator (a
//! cloud's prefix delegation, say /28 prefixes on an ENI) offers this node
//! CIDRs per pool; the node allocates from them locally and reports back
//! only its aggregate demand per pool and the CIDRs it still holds, never
//! per-address usage.
//!
//! Every decision of that exchange lives here, pure:
//! - [`accept`]: whether an offer can be used at all. An offer with any bad
//!   CIDR (unparsable, host bits set, the wrong family, special-purpose,
//!   overlapping another offered CIDR, a configured pool, or a CIDR another
//!   pool still holds) is refused whole, naming every problem, and nothing
//!   held changes: half an offer applied would drain CIDRs the operator
//!   meant to keep.
//! - [`step`]: what the node holds after an accepted offer. Offered CIDRs
//!   serve; a held CIDR the offer no longer lists drains while any address
//!   in it is held (its endpoints keep their addresses, nothing new comes
//!   from it) and is released (dropped from the record and from the
//!   object's spec) once empty.
//! - [`local_specs`]: the allocator's pools (the serving CIDRs only; a
//!   draining CIDR is left out, so the manager drains it as it drains any
//!   CIDR its source dropped).
//! - [`requested`]: the demand written into the spec, by the core's demand
//!   modes ([`DemandMode`]): `linear` is `in_use + pre_allocate`, so the
//!   operator recovers usage exactly as `requested - preAllocate`; `ceil`
//!   rounds that up to whole blocks, so usage is only known to within a
//!   block ([`usage_bounds`]).

use std::collections::{BTreeMap, BTreeSet};

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

use crate::cidr::Family;
use crate::demand::{DemandConfig, DemandError, DemandMode, DemandTracker};
use crate::pool::{PoolError, PoolSpec, check_cidr, overlaps};

/// A NodeIPAM pool as the node defines it (the agent's configuration).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodePool {
    /// The pool's name (as CNI requests and the object name it).
    pub name: String,
    /// Hand out the first and last address of each CIDR (cloud prefixes
    /// are fully usable).
    pub allow_first_last: bool,
    /// Traffic from the pool's addresses to its CIDRs is not masqueraded.
    pub skip_masquerade: bool,
    /// How `requested` is computed.
    pub mode: DemandMode,
    /// Free addresses to keep ready, added to what is in use.
    pub pre_allocate: u64,
}

/// The CIDRs the operator offers one pool, as written in the object's
/// status (strings: a bad one is reported, not dropped by a parser).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Offer {
    /// The pool.
    pub pool: String,
    /// IPv4 CIDRs.
    pub ipv4: Vec<String>,
    /// IPv6 CIDRs.
    pub ipv6: Vec<String>,
}

/// CIDRs per pool.
pub type Cidrs = BTreeMap<String, BTreeSet<IpNet>>;

/// Why an offer is refused. Every problem of an offer is listed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum NodeIpamError {
    /// The offer names a pool the node does not define.
    #[error("pool {pool} is not a NodeIPAM pool of this node")]
    UnknownPool {
        /// The pool named.
        pool: String,
    },
    /// The offer lists one pool twice.
    #[error("pool {pool} is listed more than once")]
    DuplicatePool {
        /// The pool.
        pool: String,
    },
    /// Not a CIDR.
    #[error("pool {pool}: {cidr:?} is not a CIDR")]
    Unparsable {
        /// The pool.
        pool: String,
        /// What was written.
        cidr: String,
    },
    /// An IPv6 CIDR listed as IPv4 or the other way round.
    #[error("pool {pool}: {cidr} is listed as {listed}")]
    WrongFamily {
        /// The pool.
        pool: String,
        /// The CIDR.
        cidr: IpNet,
        /// The list it is in.
        listed: Family,
    },
    /// Host bits set, or a special-purpose range.
    #[error("pool {pool}: {cidr} is not usable")]
    Invalid {
        /// The pool.
        pool: String,
        /// The CIDR.
        cidr: IpNet,
        /// Why.
        #[source]
        source: PoolError,
    },
    /// Two offered CIDRs share addresses.
    #[error("pool {pool}: {cidr} overlaps {other} of pool {other_pool}, also offered")]
    Overlap {
        /// The pool.
        pool: String,
        /// The CIDR.
        cidr: IpNet,
        /// The other pool.
        other_pool: String,
        /// The other CIDR.
        other: IpNet,
    },
    /// An offered CIDR shares addresses with a configured pool.
    #[error("pool {pool}: {cidr} overlaps {other} of the configured pool {other_pool}")]
    OverlapsConfigured {
        /// The pool.
        pool: String,
        /// The CIDR.
        cidr: IpNet,
        /// The configured pool.
        other_pool: String,
        /// Its CIDR.
        other: IpNet,
    },
    /// An offered CIDR shares addresses with one another pool still holds
    /// (draining): offered there again, or once it is empty.
    #[error(
        "pool {pool}: {cidr} overlaps {other}, which pool {other_pool} still holds ({used} address(es) in use)"
    )]
    OverlapsHeld {
        /// The pool.
        pool: String,
        /// The CIDR.
        cidr: IpNet,
        /// The pool holding the other CIDR.
        other_pool: String,
        /// The held CIDR.
        other: IpNet,
        /// Addresses held in it.
        used: u64,
    },
}

/// What the node holds: per pool, the CIDRs it serves from and the ones it
/// drains. Kept durably by the daemon, so a restart serves (and restores
/// into) them before the API answers.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Held {
    /// Offered CIDRs: new addresses come from them.
    #[serde(default)]
    pub serving: Cidrs,
    /// CIDRs the offer no longer lists that still hold addresses.
    #[serde(default)]
    pub draining: Cidrs,
}

impl Held {
    /// Every CIDR held (serving and draining), with its pool.
    pub fn all(&self) -> impl Iterator<Item = (&str, IpNet)> + '_ {
        self.serving
            .iter()
            .chain(&self.draining)
            .flat_map(|(p, cs)| cs.iter().map(move |c| (p.as_str(), *c)))
    }

    /// The CIDRs of `pool` (serving, then draining), sorted each.
    pub fn of(&self, pool: &str) -> Vec<IpNet> {
        let mut out: Vec<IpNet> = self
            .serving
            .get(pool)
            .into_iter()
            .flatten()
            .copied()
            .collect();
        out.extend(self.draining.get(pool).into_iter().flatten().copied());
        out
    }
}

/// Checks an offer against the node's pools, its configured pools and
/// what it holds now (`used`: addresses held in a CIDR).
///
/// # Errors
/// Every problem found; then nothing of the offer may be used.
pub fn accept(
    pools: &[NodePool],
    configured: &[PoolSpec],
    held: &Held,
    offers: &[Offer],
    used: impl Fn(IpNet) -> u64,
) -> Result<Cidrs, Vec<NodeIpamError>> {
    let mut errors = Vec::new();
    let mut out: Cidrs = pools
        .iter()
        .map(|p| (p.name.clone(), BTreeSet::new()))
        .collect();
    let mut seen = BTreeSet::new();
    let mut placed: Vec<(String, IpNet)> = Vec::new();
    for offer in offers {
        if !seen.insert(offer.pool.clone()) {
            errors.push(NodeIpamError::DuplicatePool {
                pool: offer.pool.clone(),
            });
            continue;
        }
        if !pools.iter().any(|p| p.name == offer.pool) {
            errors.push(NodeIpamError::UnknownPool {
                pool: offer.pool.clone(),
            });
            continue;
        }
        let listed = offer
            .ipv4
            .iter()
            .map(|c| (Family::V4, c))
            .chain(offer.ipv6.iter().map(|c| (Family::V6, c)));
        for (family, text) in listed {
            let pool = offer.pool.clone();
            let Ok(cidr) = text.trim().parse::<IpNet>() else {
                errors.push(NodeIpamError::Unparsable {
                    pool,
                    cidr: text.clone(),
                });
                continue;
            };
            if Family::of_net(cidr) != family {
                errors.push(NodeIpamError::WrongFamily {
                    pool,
                    cidr,
                    listed: family,
                });
                continue;
            }
            if let Err(source) = check_cidr(&pool, cidr, false) {
                errors.push(NodeIpamError::Invalid { pool, cidr, source });
                continue;
            }
            if let Some((other_pool, other)) = placed.iter().find(|(_, o)| overlaps(cidr, *o)) {
                errors.push(NodeIpamError::Overlap {
                    pool,
                    cidr,
                    other_pool: other_pool.clone(),
                    other: *other,
                });
                continue;
            }
            if let Some((other_pool, other)) = configured
                .iter()
                .flat_map(|s| s.cidrs().map(move |c| (&s.name, c)))
                .find(|(_, o)| overlaps(cidr, *o))
            {
                errors.push(NodeIpamError::OverlapsConfigured {
                    pool,
                    cidr,
                    other_pool: other_pool.clone(),
                    other,
                });
                continue;
            }
            placed.push((pool.clone(), cidr));
            out.entry(pool).or_default().insert(cidr);
        }
    }
    // A CIDR another pool holds, still in use and not offered to it again,
    // cannot move yet: the manager would refuse the overlap anyway.
    for (pool, cidr) in &placed {
        for (other_pool, other) in held.all() {
            if other_pool == pool || !overlaps(*cidr, other) {
                continue;
            }
            let re_offered = out.get(other_pool).is_some_and(|s| s.contains(&other));
            let n = used(other);
            if !re_offered && n > 0 {
                errors.push(NodeIpamError::OverlapsHeld {
                    pool: pool.clone(),
                    cidr: *cidr,
                    other_pool: other_pool.to_owned(),
                    other,
                    used: n,
                });
            }
        }
    }
    if errors.is_empty() {
        Ok(out)
    } else {
        Err(errors)
    }
}

/// Every CIDR of `held` that shares addresses with a configured pool (the
/// configuration changed under the record): serving it could give one
/// address twice.
pub fn held_overlaps(configured: &[PoolSpec], held: &Held) -> Vec<NodeIpamError> {
    let mut out = Vec::new();
    for (pool, cidr) in held.all() {
        for spec in configured {
            if let Some(other) = spec.cidrs().find(|o| overlaps(cidr, *o)) {
                out.push(NodeIpamError::OverlapsConfigured {
                    pool: pool.to_owned(),
                    cidr,
                    other_pool: spec.name.clone(),
                    other,
                });
            }
        }
    }
    out
}

/// What [`step`] decided.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Step {
    /// What the node holds now.
    pub held: Held,
    /// CIDRs newly served, as (pool, CIDR).
    pub added: Vec<(String, IpNet)>,
    /// CIDRs that started draining, with the addresses held in each.
    pub drained: Vec<(String, IpNet, u64)>,
    /// CIDRs released: no longer held, gone from the record and the spec.
    pub released: Vec<(String, IpNet)>,
}

/// The node's holdings after the accepted `offered` CIDRs (`used`:
/// addresses held in a CIDR now). Offered CIDRs serve (a draining one
/// offered again serves again); a held CIDR no longer offered drains while
/// it holds an address and is released once empty.
pub fn step(held: &Held, offered: &Cidrs, used: impl Fn(IpNet) -> u64) -> Step {
    let mut out = Step::default();
    for (pool, cidrs) in offered {
        if cidrs.is_empty() {
            continue;
        }
        for c in cidrs {
            let was = held.serving.get(pool).is_some_and(|s| s.contains(c));
            if !was {
                out.added.push((pool.clone(), *c));
            }
        }
        out.held.serving.insert(pool.clone(), cidrs.clone());
    }
    for (pool, cidr) in held.all() {
        if offered.get(pool).is_some_and(|s| s.contains(&cidr)) {
            continue;
        }
        let n = used(cidr);
        if n == 0 {
            out.released.push((pool.to_owned(), cidr));
            continue;
        }
        let was = held.draining.get(pool).is_some_and(|s| s.contains(&cidr));
        if !was {
            out.drained.push((pool.to_owned(), cidr, n));
        }
        out.held
            .draining
            .entry(pool.to_owned())
            .or_default()
            .insert(cidr);
    }
    out
}

/// The allocator's pools: one per NodeIPAM pool, with its serving CIDRs
/// (draining ones left out, so the manager drains them). A pool serves the
/// families of every CIDR it holds, so an endpoint whose pool's last IPv4
/// CIDR drains is told IPv4 is exhausted, not given IPv6 alone.
pub fn local_specs(pools: &[NodePool], held: &Held) -> Vec<PoolSpec> {
    pools
        .iter()
        .map(|p| {
            let mut spec = PoolSpec::new(p.name.clone())
                .allow_first_last(p.allow_first_last)
                .skip_masquerade(p.skip_masquerade);
            for c in held.serving.get(&p.name).into_iter().flatten() {
                spec = spec.with_cidr(*c);
            }
            let families: BTreeSet<Family> =
                held.of(&p.name).into_iter().map(Family::of_net).collect();
            spec.families = families.into_iter().collect();
            spec
        })
        .collect()
}

/// The pools the node reports in the object's spec: its configured
/// NodeIPAM pools, then every pool the configuration dropped that still
/// holds CIDRs (draining), as `linear` with no pre-allocation: it asks for
/// exactly what it still holds, and its CIDRs stay listed until released,
/// so the operator never hands them to another node too early.
pub fn reported_pools(pools: &[NodePool], held: &Held) -> Vec<NodePool> {
    let mut out = pools.to_vec();
    for (name, _) in held.all() {
        if !out.iter().any(|p| p.name == name) {
            out.push(NodePool {
                name: name.to_owned(),
                allow_first_last: false,
                skip_masquerade: false,
                mode: DemandMode::Linear,
                pre_allocate: 0,
            });
        }
    }
    out
}

/// Checks a pool's demand settings.
///
/// # Errors
/// [`DemandError::ZeroBlockSize`] for a ceil block of 0.
pub fn check_pool(pool: &NodePool) -> Result<(), DemandError> {
    tracker(pool).map(drop)
}

fn tracker(pool: &NodePool) -> Result<DemandTracker, DemandError> {
    DemandTracker::new(DemandConfig {
        mode: pool.mode,
        pre_allocate: pool.pre_allocate,
        ..DemandConfig::default()
    })
}

/// The demand the node writes for `pool` with `in_use` addresses held in
/// it: the core's demand target ([`DemandTracker::target`]) — `linear`:
/// `in_use + pre_allocate`; `ceil`: that rounded up to whole blocks.
/// A pool whose settings [`check_pool`] refuses asks for `in_use`.
pub fn requested(pool: &NodePool, in_use: u64) -> u64 {
    tracker(pool).map_or(in_use, |t| t.target(in_use, 0))
}

/// What an operator can tell of a pool's usage from `requested` alone: the
/// inclusive range of `in_use` values that give it. Linear: exactly one
/// value. Ceil: a block's width (clamped at 0).
pub fn usage_bounds(pool: &NodePool, requested: u64) -> (u64, u64) {
    match pool.mode {
        DemandMode::Linear => {
            let u = requested.saturating_sub(pool.pre_allocate);
            (u, u)
        }
        DemandMode::Ceil { block_size } => {
            let block = block_size.max(1);
            let hi = requested.saturating_sub(pool.pre_allocate);
            let lo = requested
                .saturating_sub(block - 1)
                .saturating_sub(pool.pre_allocate);
            (lo, hi)
        }
    }
}

pub mod operator;

#[cfg(test)]
mod tests;
