//! When a node's blocks may be taken from it, and what the next holder
//! must not hand out (#26 item 2).
//!
//! A lease ends when a node loses etcd, not when it stops serving: a node
//! cut off by a partition keeps handing out its blocks. So a lease gone is
//! only the start of a wait. The first live node that sees a node's lease
//! gone records since when, durably and guarded ([`GoneMark`], in the
//! node's routing key); the node's blocks are freed once that mark is
//! `reclaim_after` old — by any live node, automatically, or by an operator
//! (`cluster node remove`, refused before unless `--force`). The addresses
//! the node last published as in use stay reserved (`PoolManager::set_excluded`) in the
//! next holder's allocator until the node (back, its pods gone) or an
//! operator releases them ([`reservations_to_keep`]).

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

use super::ClusterError;

/// Since when a node's lease is gone, as the first live node (or the
/// operator's CLI) that saw it recorded, and the wait it applied.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GoneMark {
    /// Wall-clock milliseconds since the epoch, on the recording node.
    pub since_ms: u64,
    /// `reclaim_after` of the recording node, in milliseconds: the
    /// blocks may be taken from `since_ms + reclaim_after_ms` on.
    pub reclaim_after_ms: u64,
}

impl GoneMark {
    /// When the node's blocks may be taken.
    pub fn due_ms(&self) -> u64 {
        self.since_ms.saturating_add(self.reclaim_after_ms)
    }
}

/// A node's lease as etcd shows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NodeLease {
    /// The node's key exists (its lease is alive).
    Alive,
    /// The key is gone; since when, if a live node recorded it.
    Gone(Option<GoneMark>),
    /// etcd has nothing of the node: no node key, no block, no routing
    /// key (a name mistyped, or a node removed already).
    Unknown,
}

/// What an operator's removal may do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Removal {
    /// The lease has been gone for `reclaim_after`: the blocks are free to
    /// take.
    Due,
    /// `--force` before that: the node may still serve its blocks.
    Forced,
}

/// Whether an operator may remove a node (and free its blocks) at
/// `now_ms`.
///
/// # Errors
/// [`ClusterError::UnknownNode`] when etcd has nothing of it, force or
/// not (a mistyped name must not read as done); without `force`,
/// [`ClusterError::NodeAlive`] while its lease is alive and
/// [`ClusterError::ReclaimNotDue`] until it has been gone for
/// `reclaim_after` (or while no one recorded since when).
pub fn check_node_removal(
    node: &str,
    lease: NodeLease,
    force: bool,
    now_ms: u64,
) -> Result<Removal, ClusterError> {
    match lease {
        NodeLease::Unknown => Err(ClusterError::UnknownNode {
            node: node.to_owned(),
        }),
        _ if reclaimable(lease, now_ms) => Ok(Removal::Due),
        _ if force => Ok(Removal::Forced),
        NodeLease::Alive => Err(ClusterError::NodeAlive {
            node: node.to_owned(),
        }),
        NodeLease::Gone(mark) => Err(ClusterError::ReclaimNotDue {
            node: node.to_owned(),
            gone_s: mark.map(|m| now_ms.saturating_sub(m.since_ms) / 1000),
            left_s: mark.map(|m| m.due_ms().saturating_sub(now_ms).div_ceil(1000)),
        }),
    }
}

/// Whether a node's blocks may be taken without `--force` at `now_ms`:
/// its lease gone, and recorded gone for its mark's `reclaim_after`.
pub fn reclaimable(lease: NodeLease, now_ms: u64) -> bool {
    matches!(lease, NodeLease::Gone(Some(m)) if now_ms >= m.due_ms())
}

/// What a live node does about another node's lease at one read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GoneStep {
    /// Nothing: alive, or gone and not yet due.
    Wait,
    /// Record the lease gone since now (guarded: the first writer wins).
    Mark(GoneMark),
    /// Free its blocks (guarded: one reclaim, the node still gone).
    Reclaim,
}

/// The step for another node whose routing key carries `mark`, `alive`
/// telling whether its node key exists, at `now_ms`, with this node's
/// `reclaim_after_ms`. A mark on a live node is left for that node to
/// clear ([`own_mark_stale`]).
pub fn gone_step(
    alive: bool,
    mark: Option<GoneMark>,
    now_ms: u64,
    reclaim_after_ms: u64,
) -> GoneStep {
    match (alive, mark) {
        (true, _) => GoneStep::Wait,
        (false, None) => GoneStep::Mark(GoneMark {
            since_ms: now_ms,
            reclaim_after_ms,
        }),
        (false, Some(m)) if reclaimable(NodeLease::Gone(Some(m)), now_ms) => GoneStep::Reclaim,
        (false, Some(_)) => GoneStep::Wait,
    }
}

/// The live node that looks after `gone`'s lease (marks it gone, later
/// reclaims its blocks): the first live node whose name comes after
/// `gone`'s, wrapping around (`None` with no live node).
///
/// Every live node reads the same keys, so each gone node has one
/// keeper: when a zone of a thousand nodes drops, each of the others
/// writes for its share of them, not for all of them (every live node
/// trying every gone node's guarded write was a thousand transactions per
/// node, a million for etcd). Views that differ for a moment make two
/// keepers at most, whose writes are guarded anyway; a keeper that is
/// itself gone leaves the duty to the next live name once its own lease
/// ends.
pub fn gone_keeper<'a>(alive: &'a BTreeSet<String>, gone: &str) -> Option<&'a str> {
    use std::ops::Bound::{Excluded, Unbounded};
    alive
        .range::<str, _>((Excluded(gone), Unbounded))
        .next()
        .or_else(|| alive.iter().next())
        .map(String::as_str)
}

/// [`gone_keeper`] over `alive` with the nodes `came` added and those
/// `left` taken out, without a copy of the set: a claim loop following
/// nodes come and gone in place asks who keeps each gone node once they
/// have joined or left the live set, before it moves them. `came` holds
/// names not in `alive`, `left` names in it.
pub fn gone_keeper_after<'a>(
    alive: &'a BTreeSet<String>,
    gone: &str,
    came: &BTreeSet<&'a str>,
    left: &BTreeSet<&str>,
) -> Option<&'a str> {
    use std::ops::Bound::{Excluded, Unbounded};
    let staying = alive
        .range::<str, _>((Excluded(gone), Unbounded))
        .chain(alive.iter())
        .map(String::as_str)
        .find(|n| !left.contains(n));
    // `came` is a batch's few names: looked through.
    let coming = came
        .iter()
        .find(|n| **n > gone)
        .or_else(|| came.iter().next())
        .copied();
    // The first of the two round the ring from `gone`: names after it
    // come before names at or before it.
    match (staying, coming) {
        (Some(a), Some(b)) => Some(match (a > gone, b > gone) {
            (true, false) => a,
            (false, true) => b,
            _ => a.min(b),
        }),
        (a, b) => a.or(b),
    }
}

/// Whether a live node must publish its routing key again to clear a
/// gone mark another node wrote (a lease renewed after a slow refresh):
/// while it stands, its blocks would be taken at the mark's deadline.
pub fn own_mark_stale(mark: Option<GoneMark>) -> bool {
    mark.is_some()
}

/// The addresses reserved against the allocator of `node`: every
/// reservation of another node (address → the node that last published
/// it as in use). Its own are its own addresses.
pub fn reserved_for(node: &str, reservations: &BTreeMap<IpAddr, String>) -> BTreeSet<IpAddr> {
    reservations
        .iter()
        .filter(|(_, n)| n.as_str() != node)
        .map(|(a, _)| *a)
        .collect()
}

/// Addresses of `reserved` inside `block`: not usable by its holder.
pub fn reserved_in_block(block: IpNet, reserved: &BTreeSet<IpAddr>) -> u64 {
    reserved.iter().filter(|a| block.contains(*a)).count() as u64
}

/// Of the reservations naming this node (`mine`), the ones to keep: an
/// address it still holds, in a block that is no longer its own (not in
/// `serving`). An address it no longer holds is released (its pod went);
/// one inside a block it serves again is its own.
pub fn reservations_to_keep(
    mine: &BTreeSet<IpAddr>,
    held: &BTreeSet<IpAddr>,
    serving: &BTreeSet<IpNet>,
) -> BTreeSet<IpAddr> {
    mine.iter()
        .filter(|a| held.contains(*a))
        .filter(|a| !serving.iter().any(|b| b.contains(*a)))
        .copied()
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const HOUR: u64 = 3_600_000;

    fn mark(since_ms: u64) -> Option<GoneMark> {
        Some(GoneMark {
            since_ms,
            reclaim_after_ms: HOUR,
        })
    }

    #[test]
    fn removal_waits_for_reclaim_after_unless_forced() {
        let gone = NodeLease::Gone(mark(1_000));
        let e = check_node_removal("n", gone, false, 6_000).unwrap_err();
        assert!(
            matches!(
                e,
                ClusterError::ReclaimNotDue {
                    gone_s: Some(5),
                    left_s: Some(3595),
                    ..
                }
            ),
            "{e:?}"
        );
        assert!(e.to_string().contains("3595 s left"), "{e}");
        assert_eq!(
            check_node_removal("n", gone, true, 6_000),
            Ok(Removal::Forced)
        );
        assert_eq!(
            check_node_removal("n", gone, false, HOUR + 1_000),
            Ok(Removal::Due)
        );
        let unmarked = check_node_removal("n", NodeLease::Gone(None), false, HOUR).unwrap_err();
        assert!(unmarked.to_string().contains("not recorded"), "{unmarked}");
        assert!(matches!(
            check_node_removal("n", NodeLease::Alive, false, 0),
            Err(ClusterError::NodeAlive { .. })
        ));
        assert_eq!(
            check_node_removal("n", NodeLease::Alive, true, 0),
            Ok(Removal::Forced)
        );
        for force in [false, true] {
            let e = check_node_removal("ndoe-1", NodeLease::Unknown, force, 0).unwrap_err();
            assert!(matches!(e, ClusterError::UnknownNode { .. }), "{e}");
            assert!(e.to_string().contains("ndoe-1"), "{e}");
        }
    }

    #[test]
    fn live_nodes_mark_then_reclaim() {
        assert_eq!(gone_step(true, None, 5, HOUR), GoneStep::Wait);
        assert_eq!(gone_step(true, mark(0), 2 * HOUR, HOUR), GoneStep::Wait);
        assert_eq!(
            gone_step(false, None, 5, 7),
            GoneStep::Mark(GoneMark {
                since_ms: 5,
                reclaim_after_ms: 7
            })
        );
        assert_eq!(gone_step(false, mark(10), HOUR, 1), GoneStep::Wait);
        assert_eq!(gone_step(false, mark(10), HOUR + 10, 1), GoneStep::Reclaim);
        assert!(!reclaimable(NodeLease::Unknown, u64::MAX));
        assert!(!reclaimable(NodeLease::Alive, u64::MAX));
        assert!(!reclaimable(NodeLease::Gone(None), u64::MAX));
    }

    #[test]
    fn reserved_addresses_are_the_others_and_released_when_free() {
        let a: IpAddr = "10.0.0.5".parse().unwrap();
        let b: IpAddr = "10.0.1.5".parse().unwrap();
        let reservations: BTreeMap<IpAddr, String> =
            [(a, "old".to_string()), (b, "me".to_string())].into();
        let others = reserved_for("me", &reservations);
        assert_eq!(others, [a].into());
        assert_eq!(
            reserved_in_block("10.0.0.0/28".parse().unwrap(), &[a, b].into()),
            1
        );

        let mine: BTreeSet<IpAddr> = [a, b].into();
        let block: IpNet = "10.0.1.0/28".parse().unwrap();
        // Still held, block taken: kept; no longer held: released.
        assert_eq!(
            reservations_to_keep(&mine, &[a].into(), &BTreeSet::new()),
            [a].into()
        );
        // Held in a block served again: its own.
        assert_eq!(
            reservations_to_keep(&mine, &[a, b].into(), &[block].into()),
            [a].into()
        );
    }

    #[test]
    fn the_keeper_is_the_next_live_name_wrapping_around() {
        let alive: BTreeSet<String> = ["b", "d", "f"].iter().map(|s| (*s).to_string()).collect();
        assert_eq!(gone_keeper(&alive, "a"), Some("b"));
        assert_eq!(gone_keeper(&alive, "c"), Some("d"));
        assert_eq!(gone_keeper(&alive, "e"), Some("f"));
        assert_eq!(gone_keeper(&alive, "g"), Some("b"));
        assert_eq!(gone_keeper(&BTreeSet::new(), "a"), None);
    }

    proptest! {
        /// With nodes come and gone, the keeper is the one of the live
        /// set with them added and taken out.
        #[test]
        fn the_keeper_after_nodes_come_and_go_is_the_keeper_of_the_set_after(
            names in proptest::collection::btree_set("[a-z]{1,3}", 0..12),
            gone in "[a-z]{1,3}",
            came in proptest::collection::btree_set("[a-z]{1,3}", 0..4),
            left in proptest::collection::btree_set("[a-z]{1,3}", 0..4),
        ) {
            let came: BTreeSet<&str> = came
                .iter()
                .map(String::as_str)
                .filter(|n| !names.contains(*n))
                .collect();
            let left: BTreeSet<&str> = left
                .iter()
                .map(String::as_str)
                .filter(|n| names.contains(*n))
                .collect();
            let mut after = names.clone();
            after.retain(|n| !left.contains(n.as_str()));
            after.extend(came.iter().map(|n| (*n).to_string()));
            prop_assert_eq!(
                gone_keeper_after(&names, &gone, &came, &left),
                gone_keeper(&after, &gone)
            );
        }

        /// Each gone node has exactly one keeper, a live node; when that
        /// keeper goes too, another live node takes the duty; and the
        /// duty is shared: no live node keeps more gone nodes than lie
        /// between it and the live name before it.
        #[test]
        fn every_gone_node_has_one_live_keeper(
            names in proptest::collection::btree_set("[a-z]{1,4}", 1..60),
            alive_bits in proptest::collection::vec(any::<bool>(), 60),
        ) {
            let names: Vec<String> = names.into_iter().collect();
            let alive: BTreeSet<String> = names
                .iter()
                .zip(&alive_bits)
                .filter(|(_, a)| **a)
                .map(|(n, _)| n.clone())
                .collect();
            for gone in names.iter().filter(|n| !alive.contains(*n)) {
                let keepers: Vec<&String> = alive
                    .iter()
                    .filter(|me| gone_keeper(&alive, gone) == Some(me.as_str()))
                    .collect();
                if alive.is_empty() {
                    prop_assert!(keepers.is_empty());
                    continue;
                }
                prop_assert_eq!(keepers.len(), 1);
                let keeper = keepers[0].clone();
                // Its keeper gone as well: another live node keeps it.
                let mut fewer = alive.clone();
                fewer.remove(&keeper);
                if let Some(next) = gone_keeper(&fewer, gone) {
                    prop_assert!(next != keeper.as_str() && fewer.contains(next));
                }
                // No live name lies strictly between the gone node and
                // its keeper (in ring order).
                let between = |x: &String| {
                    if keeper.as_str() > gone.as_str() {
                        x.as_str() > gone.as_str() && x.as_str() < keeper.as_str()
                    } else {
                        x.as_str() > gone.as_str() || x.as_str() < keeper.as_str()
                    }
                };
                prop_assert!(!alive.iter().any(between));
            }
        }
        /// No removal without force frees a node's blocks before its lease
        /// has been recorded gone for its reclaim_after.
        #[test]
        fn never_due_early(since in 0u64..1_000_000, after in 0u64..1_000_000, now in 0u64..3_000_000, alive: bool) {
            let lease = if alive { NodeLease::Alive } else { NodeLease::Gone(Some(GoneMark { since_ms: since, reclaim_after_ms: after })) };
            let ok = check_node_removal("n", lease, false, now).is_ok();
            prop_assert_eq!(ok, !alive && now >= since + after);
            let step = gone_step(alive, (!alive).then_some(GoneMark { since_ms: since, reclaim_after_ms: after }), now, after);
            prop_assert_eq!(step == GoneStep::Reclaim, ok);
        }
    }
}
