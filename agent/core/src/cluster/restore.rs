//! etcd restored from a backup (#26 item 3): how a node tells that etcd
//! went back in time, which of its blocks it then claims back, and when it
//! may claim new blocks again.
//!
//! Why a module of its own: a restore deletes every block claimed after
//! the backup, while their holders still hand out addresses from them.
//! Fencing them as "absent" (what [`super::fence`] decides for a block
//! etcd does not record) keeps the holders but lets another node claim the
//! block and hand the same addresses out again. After a rollback the
//! holder instead claims such a block back (create-if-absent), and every
//! node that saw the rollback claims nothing new for a grace period, so
//! the holders re-assert before anyone can take their blocks.

use std::collections::BTreeMap;

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

use super::layout::block_index;
use super::spec::ClusterPoolSpec;
use crate::cidr::Family;

/// Where a node last saw etcd: which cluster answered (its cluster ID, 0
/// when unknown) and the highest store revision it answered with.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StoreMark {
    /// etcd's cluster ID (every answer's header); 0: not known.
    pub cluster_id: u64,
    /// The highest store revision seen.
    pub revision: i64,
}

/// Why a node holds that etcd went back in time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Rollback {
    /// etcd answered with a store revision below one it answered before:
    /// revisions only grow, unless the store was restored from a backup.
    #[error("etcd's revision went back from {seen} to {now}")]
    Revision {
        /// The highest revision seen before.
        seen: i64,
        /// The revision etcd answers with now.
        now: i64,
    },
    /// Another etcd cluster answers (a restore with a new cluster token,
    /// or a new cluster altogether): what it holds need not be what the
    /// node wrote.
    #[error("etcd's cluster ID changed from {seen:x} to {now:x}")]
    Cluster {
        /// The cluster ID seen before.
        seen: u64,
        /// The cluster ID answering now.
        now: u64,
    },
}

/// Whether etcd went back in time between what the node recorded (`seen`,
/// `None` before its first answer) and the answer it got (`now`). A cluster
/// ID of 0 on either side is not compared.
pub fn rolled_back(seen: Option<StoreMark>, now: StoreMark) -> Option<Rollback> {
    let seen = seen?;
    if seen.cluster_id != 0 && now.cluster_id != 0 && seen.cluster_id != now.cluster_id {
        return Some(Rollback::Cluster {
            seen: seen.cluster_id,
            now: now.cluster_id,
        });
    }
    (now.revision < seen.revision).then_some(Rollback::Revision {
        seen: seen.revision,
        now: now.revision,
    })
}

/// What the node records after an answer `now`: after a rollback, etcd's
/// new history (its revision, its cluster); otherwise the higher revision
/// and the cluster ID once known.
pub fn advance(seen: Option<StoreMark>, now: StoreMark) -> StoreMark {
    let Some(seen) = seen else {
        return now;
    };
    if rolled_back(Some(seen), now).is_some() {
        return now;
    }
    StoreMark {
        cluster_id: if now.cluster_id != 0 {
            now.cluster_id
        } else {
            seen.cluster_id
        },
        revision: seen.revision.max(now.revision),
    }
}

/// The blocks of the node's local record (`local`: pool and block, fenced
/// or not) to claim back after a rollback, before anything new: each one
/// etcd does not record (`owners`: block → node) that is still a block of
/// its cluster pool (`pools`: one of its CIDRs cut at the pool's block
/// length; a pool applied anew meanwhile may have dropped or re-cut it).
/// A block etcd gives any node is never among them: one another node
/// holds stays fenced ([`super::fence`]).
pub fn to_reclaim(
    local: &[(String, IpNet)],
    owners: &BTreeMap<IpNet, String>,
    pools: &[ClusterPoolSpec],
) -> Vec<(String, IpNet)> {
    local
        .iter()
        .filter(|(_, b)| !owners.contains_key(b))
        .filter(|(pool, b)| {
            pools.iter().filter(|p| p.name == *pool).any(|p| {
                let len = p.block_len(Family::of_net(*b));
                p.cidrs().any(|c| {
                    Family::of_net(c) == Family::of_net(*b) && block_index(c, len, *b).is_some()
                })
            })
        })
        .cloned()
        .collect()
}

/// Whether a node may claim new blocks: not while blocks it must claim
/// back are still pending (`reclaim_pending`), nor within `grace_ms` of the
/// rollback it saw (`since_rollback_ms`, `None` when it saw none), so that
/// every holder of a block etcd lost reads etcd and claims it back first.
pub fn may_claim_new(since_rollback_ms: Option<u64>, grace_ms: u64, reclaim_pending: bool) -> bool {
    !reclaim_pending && since_rollback_ms.is_none_or(|t| t >= grace_ms)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::layout::block_at;
    use proptest::prelude::*;
    use std::collections::BTreeSet;

    fn net(s: &str) -> IpNet {
        s.parse().expect("net")
    }

    fn mark(cluster_id: u64, revision: i64) -> StoreMark {
        StoreMark {
            cluster_id,
            revision,
        }
    }

    #[test]
    fn a_lower_revision_or_another_cluster_is_a_rollback() {
        assert_eq!(rolled_back(None, mark(7, 3)), None);
        assert_eq!(rolled_back(Some(mark(7, 10)), mark(7, 10)), None);
        assert_eq!(rolled_back(Some(mark(7, 10)), mark(7, 11)), None);
        assert_eq!(
            rolled_back(Some(mark(7, 10)), mark(7, 9)),
            Some(Rollback::Revision { seen: 10, now: 9 })
        );
        assert_eq!(
            rolled_back(Some(mark(7, 10)), mark(8, 50)),
            Some(Rollback::Cluster { seen: 7, now: 8 })
        );
        // An unknown cluster ID (a record from block revisions only) is
        // not compared.
        assert_eq!(rolled_back(Some(mark(0, 10)), mark(8, 50)), None);
        assert_eq!(
            rolled_back(Some(mark(0, 10)), mark(8, 5)),
            Some(Rollback::Revision { seen: 10, now: 5 })
        );
        let why = rolled_back(Some(mark(7, 70)), mark(7, 10)).expect("rollback");
        assert_eq!(why.to_string(), "etcd's revision went back from 70 to 10");
    }

    #[test]
    fn the_mark_keeps_the_highest_revision_until_a_rollback_starts_anew() {
        assert_eq!(advance(None, mark(7, 3)), mark(7, 3));
        assert_eq!(advance(Some(mark(7, 10)), mark(7, 12)), mark(7, 12));
        assert_eq!(advance(Some(mark(0, 10)), mark(7, 4)), mark(7, 4));
        assert_eq!(advance(Some(mark(7, 10)), mark(0, 12)), mark(7, 12));
        assert_eq!(advance(Some(mark(7, 70)), mark(7, 10)), mark(7, 10));
        assert_eq!(advance(Some(mark(7, 10)), mark(8, 50)), mark(8, 50));
    }

    #[test]
    fn absent_blocks_of_a_current_pool_are_claimed_back_and_others_not() {
        let pool = ClusterPoolSpec::new("pods")
            .with_cidr(net("10.1.0.0/24"))
            .with_cidr(net("fd00::/120"));
        let local = vec![
            ("pods".to_string(), net("10.1.0.0/26")),   // etcd: ours
            ("pods".to_string(), net("10.1.0.64/26")),  // etcd: another node's
            ("pods".to_string(), net("10.1.0.128/26")), // absent
            ("pods".to_string(), net("10.1.1.0/26")),   // absent, outside the pool
            ("pods".to_string(), net("10.1.0.192/27")), // absent, re-cut
            ("gone".to_string(), net("10.1.0.192/26")), // absent, pool removed
            ("pods".to_string(), net("fd00::40/122")),  // absent, IPv6
        ];
        let owners = BTreeMap::from([
            (net("10.1.0.0/26"), "a".to_string()),
            (net("10.1.0.64/26"), "b".to_string()),
        ]);
        assert_eq!(
            to_reclaim(&local, &owners, &[pool]),
            vec![
                ("pods".to_string(), net("10.1.0.128/26")),
                ("pods".to_string(), net("fd00::40/122")),
            ]
        );
    }

    #[test]
    fn nothing_new_is_claimed_within_the_grace_or_while_blocks_are_pending() {
        assert!(may_claim_new(None, 15_000, false));
        assert!(!may_claim_new(None, 15_000, true));
        assert!(!may_claim_new(Some(14_999), 15_000, false));
        assert!(may_claim_new(Some(15_000), 15_000, false));
        assert!(!may_claim_new(Some(60_000), 15_000, true));
    }

    proptest! {
        /// Whatever the record and etcd hold, the blocks claimed back are
        /// exactly the record's blocks etcd does not record: never one
        /// etcd gives any node, so a claim back cannot take another
        /// node's block even if create-if-absent were not there.
        #[test]
        fn only_blocks_etcd_lost_are_claimed_back(
            local in proptest::collection::btree_set(0u128..16, 0..=16),
            etcd in proptest::collection::btree_map(0u128..16, 0u8..3, 0..=16),
        ) {
            let cidr = net("10.7.0.0/24");
            let mut pool = ClusterPoolSpec::new("p").with_cidr(cidr);
            pool.block_v4 = 28;
            let block = |i: u128| block_at(cidr, 28, i).expect("block");
            let local: Vec<(String, IpNet)> =
                local.iter().map(|i| ("p".to_string(), block(*i))).collect();
            let owners: BTreeMap<IpNet, String> =
                etcd.iter().map(|(i, n)| (block(*i), format!("n{n}"))).collect();
            let got: BTreeSet<IpNet> =
                to_reclaim(&local, &owners, &[pool]).into_iter().map(|(_, b)| b).collect();
            let want: BTreeSet<IpNet> = local
                .iter()
                .map(|(_, b)| *b)
                .filter(|b| !owners.contains_key(b))
                .collect();
            prop_assert_eq!(got, want);
        }

        /// The recorded revision never goes down except at a rollback,
        /// and a rollback is told exactly when the revision went down
        /// (same cluster).
        #[test]
        fn the_mark_only_goes_back_at_a_rollback(
            revisions in proptest::collection::vec(0i64..100, 1..20),
        ) {
            let mut seen: Option<StoreMark> = None;
            for r in revisions {
                let now = mark(1, r);
                let back = rolled_back(seen, now);
                let next = advance(seen, now);
                match seen {
                    Some(s) if r < s.revision => {
                        prop_assert!(back.is_some());
                        prop_assert_eq!(next, now);
                    }
                    Some(s) => {
                        prop_assert!(back.is_none());
                        prop_assert_eq!(next.revision, s.revision.max(r));
                    }
                    None => prop_assert!(back.is_none()),
                }
                seen = Some(next);
            }
        }
    }
}
