//! LoadBalancer IPAM across a cluster (#13): what the one elected assigner
//! decides, and which node announces an address.
//!
//! In cluster mode pools and services live in the shared store (etcd) and
//! one agent at a time — the assigner, elected under a lease — runs the
//! same [`LbIpam`] the single-node agent runs, from the last state it (or
//! its predecessor) stored. [`reconcile`] brings that state to the pools
//! and services the store holds and says which addresses became, or
//! stopped being, assigned: the daemon writes the new state and creates the
//! keys of new addresses only if absent, in one transaction fenced by the
//! assigner's election, so an address is never assigned twice even by a
//! deposed assigner.
//!
//! Why one assigner rather than every agent assigning with compare-and-swap:
//! the assignment is a function of the whole state (pool order, conflicts,
//! sharing keys, stickiness); every agent assigning would mean every agent
//! computing on the whole state and racing to swap all of it, so writes
//! serialise anyway and losers recompute. One assigner computes once; a
//! failover delays only *new* assignments, never an announced address.
//!
//! [`announcer`] picks, for each address, the node that answers ARP/NDP for
//! it: rendezvous hashing over the live nodes the pool's node selector
//! admits, so a node joining or leaving moves only the addresses it gains
//! or held.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

mod stored;
pub use stored::{LbMeta, SplitError, StoredDiff, StoredService, StoredState, diff, join, split};

use super::{LbError, LbIpam, LbPoolSpec, LbSnapshot, ServiceSpec};
use crate::lb::LabelSelector;

/// The outcome of [`reconcile`].
#[derive(Clone, Debug, PartialEq)]
pub struct LbChange {
    /// The state to store.
    pub state: LbSnapshot,
    /// Addresses assigned now that were not before, with their services.
    pub added: BTreeMap<IpAddr, BTreeSet<String>>,
    /// Addresses assigned before and after whose services changed (a
    /// sharing key's second service joining, one of two leaving).
    pub updated: BTreeMap<IpAddr, BTreeSet<String>>,
    /// Addresses no longer assigned to anyone.
    pub removed: BTreeSet<IpAddr>,
    /// Whether anything changed (the state to store differs).
    pub changed: bool,
}

/// Every assigned address and its services.
pub fn assigned(lb: &LbIpam) -> BTreeMap<IpAddr, BTreeSet<String>> {
    let mut out: BTreeMap<IpAddr, BTreeSet<String>> = BTreeMap::new();
    for (id, status) in lb.services() {
        for a in status.addresses() {
            out.entry(*a).or_default().insert(id.to_string());
        }
    }
    out
}

/// Brings the stored state (`None`: nothing stored yet) to exactly `pools`
/// and `services`: pools and services gone are deleted, the others
/// applied (unchanged ones change nothing, so assignments are sticky).
///
/// # Errors
/// The stored state does not restore, or a pool or service is invalid
/// (the caller reports it and stores nothing).
pub fn reconcile(
    state: Option<&LbSnapshot>,
    pools: Vec<LbPoolSpec>,
    services: Vec<ServiceSpec>,
) -> Result<LbChange, LbError> {
    let mut lb = match state {
        Some(s) => LbIpam::restore(s)?,
        None => LbIpam::new(),
    };
    let before = assigned(&lb);
    let keep_pools: BTreeSet<&str> = pools.iter().map(|p| p.name.as_str()).collect();
    let gone: Vec<String> = lb
        .pools()
        .map(|p| p.spec.name.clone())
        .filter(|n| !keep_pools.contains(n.as_str()))
        .collect();
    for name in gone {
        lb.delete_pool(&name)?;
    }
    let keep_services: BTreeSet<String> = services.iter().map(ServiceSpec::id).collect();
    let gone: Vec<String> = lb
        .services()
        .map(|(id, _)| id.to_string())
        .filter(|id| !keep_services.contains(id))
        .collect();
    for id in gone {
        lb.delete_service(&id)?;
    }
    lb.apply_pools(pools)?;
    for s in services {
        lb.apply_service(s)?;
    }
    let after = assigned(&lb);
    let added = after
        .iter()
        .filter(|(a, _)| !before.contains_key(*a))
        .map(|(a, s)| (*a, s.clone()))
        .collect();
    let updated = after
        .iter()
        .filter(|(a, s)| before.get(*a).is_some_and(|b| b != *s))
        .map(|(a, s)| (*a, s.clone()))
        .collect();
    let removed = before
        .keys()
        .filter(|a| !after.contains_key(*a))
        .copied()
        .collect();
    let new = lb.snapshot();
    let changed = state != Some(&new);
    Ok(LbChange {
        state: new,
        added,
        updated,
        removed,
        changed,
    })
}

/// A live node as the announcer choice sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Candidate {
    /// Its name.
    pub name: String,
    /// Its labels (for a pool's node selector).
    pub labels: BTreeMap<String, String>,
    /// Whether it can answer for an address at all: it has an uplink with
    /// the responder attached. A node without one still runs for assigner
    /// but never holds an announcement (nobody would answer).
    pub answers: bool,
}

/// The node that announces `address`: among the `nodes` that can answer
/// and the selector admits (an empty selector admits all), the one with
/// the highest rendezvous weight for the address. `None` when no node is
/// admitted.
pub fn announcer<'a>(
    address: IpAddr,
    selector: &LabelSelector,
    nodes: &'a [Candidate],
) -> Option<&'a Candidate> {
    nodes
        .iter()
        .filter(|n| n.answers)
        .filter(|n| selector.is_empty() || selector.matches(&n.labels))
        .max_by_key(|n| (weight(address, &n.name), n.name.as_str()))
}

/// An address to announce, as the announcer choice needs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ToAnnounce {
    /// The pool it was assigned from.
    pub pool: String,
    /// That pool's node selector: the nodes that may announce it.
    pub node_selector: LabelSelector,
}

/// The addresses `lb` announces (those of its `announce = "l2"` pools),
/// each with its pool and that pool's node selector.
pub fn to_announce(lb: &LbIpam) -> BTreeMap<IpAddr, ToAnnounce> {
    let selectors: BTreeMap<String, LabelSelector> = lb
        .pools()
        .map(|p| (p.spec.name.clone(), p.spec.node_selector.clone()))
        .collect();
    let plan = lb.plan();
    let v4 = plan
        .l2_announce_v4
        .into_iter()
        .map(|(a, p)| (IpAddr::V4(a), p));
    let v6 = plan
        .l2_announce_v6
        .into_iter()
        .map(|(a, p)| (IpAddr::V6(a), p));
    v4.chain(v6)
        .map(|(a, pool)| {
            let node_selector = selectors.get(&pool).cloned().unwrap_or_default();
            (
                a,
                ToAnnounce {
                    pool,
                    node_selector,
                },
            )
        })
        .collect()
}

/// The addresses of `addresses` that no node of `nodes` is admitted to
/// announce, with their pools: nobody answers for them until a node that
/// can answer, with labels that match the pool's node selector, joins.
/// Each address stops at the first node admitted (usually the first).
pub fn unannounced<'a>(
    addresses: &BTreeMap<IpAddr, ToAnnounce>,
    nodes: impl Iterator<Item = &'a Candidate> + Clone,
) -> BTreeMap<IpAddr, String> {
    addresses
        .iter()
        .filter(|(_, t)| {
            !nodes.clone().any(|n| {
                n.answers && (t.node_selector.is_empty() || t.node_selector.matches(&n.labels))
            })
        })
        .map(|(a, t)| (*a, t.pool.clone()))
        .collect()
}

/// What one node does about announcements, from the addresses to announce
/// (each with its pool's node selector), the live nodes, and who holds
/// each announcement key now ([`announce_plan`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AnnouncePlan {
    /// Chosen and free: create the key, then program the responder and
    /// send a gratuitous ARP / unsolicited NA.
    pub take: Vec<IpAddr>,
    /// Chosen, but another node's key still stands: wait for it to be
    /// withdrawn or for that node's lease to end (its datapath entry
    /// expires before its lease can), never answer meanwhile.
    pub wait: Vec<IpAddr>,
    /// Held but no longer this node's (another node chosen, or the address
    /// gone): stop answering first, then withdraw the key.
    pub drop: Vec<IpAddr>,
    /// Held and still this node's: keep renewing.
    pub keep: Vec<IpAddr>,
}

/// Plans `me`'s announcements. An address's node is [`announcer`]'s
/// choice; `held` maps each announcement key to its node.
pub fn announce_plan(
    addresses: &BTreeMap<IpAddr, LabelSelector>,
    nodes: &[Candidate],
    me: &str,
    held: &BTreeMap<IpAddr, String>,
) -> AnnouncePlan {
    let mut plan = AnnouncePlan::default();
    for (a, selector) in addresses {
        let chosen = announcer(*a, selector, nodes).is_some_and(|n| n.name == me);
        match (chosen, held.get(a).map(String::as_str)) {
            (true, None) => plan.take.push(*a),
            (true, Some(h)) if h == me => plan.keep.push(*a),
            (true, Some(_)) => plan.wait.push(*a),
            (false, Some(h)) if h == me => plan.drop.push(*a),
            (false, _) => {}
        }
    }
    for (a, h) in held {
        if h == me && !addresses.contains_key(a) {
            plan.drop.push(*a);
        }
    }
    plan
}

/// The rendezvous weight of (`address`, `node`): FNV-1a over both, then
/// splitmix64's finaliser.
pub(crate) fn weight(address: IpAddr, node: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let (v4, v6);
    let bytes: &[u8] = match address {
        IpAddr::V4(a) => {
            v4 = a.octets();
            &v4
        }
        IpAddr::V6(a) => {
            v6 = a.octets();
            &v6
        }
    };
    for b in bytes.iter().chain([0xffu8].iter()).chain(node.as_bytes()) {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h ^= h >> 30;
    h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h ^= h >> 27;
    h = h.wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 31)
}

#[cfg(test)]
mod tests;
