//! What the rest of the agent sees of cluster mode's claim loop
//! (`cluster::node`): whether etcd answers, the fenced blocks, the pools, and
//! a way for an allocation that found a cluster pool full to ask for a block
//! and wait for it. Kept apart from the loop so the API and metrics depend
//! on this narrow handle, not on the loop's state.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tokio::sync::Notify;

/// What the API and metrics read of cluster mode.
#[derive(Debug, Default)]
pub struct ClusterHandle {
    shared: Mutex<Shared>,
    pub(super) wake: Notify,
    pub(super) changed: Notify,
}

#[derive(Debug, Default)]
pub(super) struct Shared {
    /// Why etcd is unreachable (`None`: the last request succeeded).
    pub(super) problem: Option<String>,
    /// Fenced blocks.
    pub(super) fenced: usize,
    /// Cluster pools and their families.
    pub(super) pools: Vec<crate::wire::ClusterPoolFamilies>,
    /// Pools an ADD waits on a block for.
    pub(super) wanted: BTreeSet<String>,
    /// Blocks claimed per pool since start.
    pub(super) claims: BTreeMap<String, u64>,
    /// Room made per pool since start: reservation windows grown, so
    /// addresses served (what an ADD waiting on a pool waits for). A block
    /// claimed is not room until its window is published.
    pub(super) room: BTreeMap<String, u64>,
    /// The reservation window: addresses served, and windows published
    /// since start (#43).
    pub(super) window_addresses: usize,
    pub(super) window_publications: u64,
    /// Rounds done since start.
    pub(super) rounds: u64,
    /// Whole reads of the cluster, and batches of changes followed in
    /// place instead (`node/follow.rs`).
    pub(super) whole_reads: u64,
    pub(super) changes_followed: u64,
    /// Node lease refreshes the keeper sent and etcd answered since start,
    /// and the latest any of them was sent against its schedule.
    pub(super) lease_renewals: u64,
    pub(super) lease_late_max: Duration,
    /// etcd keys the last read skipped as unreadable: key → why.
    pub(super) unreadable: BTreeMap<String, String>,
    /// Configured CIDRs overlapping the cluster's, each naming both sides.
    pub(super) overlaps: Vec<String>,
    /// Another agent instance holds this node's name (#26 item 5).
    pub(super) identity: Option<String>,
    /// The highest store revision the remote task's watch had seen when
    /// it saw etcd go back in time; the claim loop has not taken it yet.
    pub(super) went_back_from: Option<i64>,
    /// When the node lease was last refreshed (or granted) and etcd
    /// answered: sent at this moment (`None`: not in this agent's life).
    pub(super) lease_refreshed: Option<Instant>,
    /// The blocks etcd gives this node and that serve (neither fenced
    /// nor being given back), by pool, as of the last round.
    pub(super) serving: Vec<(String, ipnet::IpNet)>,
}

impl Shared {
    /// Counts a node lease refresh sent at `sent`, `late` against its
    /// schedule, and answered.
    pub(super) fn lease_renewed(&mut self, sent: Instant, late: Duration) {
        self.lease_renewals += 1;
        self.lease_late_max = self.lease_late_max.max(late);
        self.refreshed_at(Some(sent));
    }

    /// Takes `at` as the lease's last refresh when it is newer.
    pub(super) fn refreshed_at(&mut self, at: Option<Instant>) {
        if at > self.lease_refreshed {
            self.lease_refreshed = at;
        }
    }
}

/// What the node may announce of its blocks (the BGP speaker reads it:
/// `bgp::speaker`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Holding {
    /// When the node lease was last refreshed with etcd's answer (`None`:
    /// not yet in this agent's life).
    pub refreshed: Option<Instant>,
    /// The blocks etcd gives this node that serve, by pool (fenced ones
    /// and those being given back left out).
    pub blocks: Vec<(String, ipnet::IpNet)>,
}

impl ClusterHandle {
    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, Shared> {
        self.shared
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Why etcd is unreachable, while it is.
    pub fn etcd_problem(&self) -> Option<String> {
        self.lock().problem.clone()
    }

    /// Tells the claim loop that the remote task's watch, which sees every
    /// write under the prefix, saw etcd's revision drop below `seen`, the
    /// highest it had seen: the claim loop raises its own mark to it and
    /// reads etcd at once, so its read tells the rollback (its reads come
    /// every 5 s and may never have seen the writes etcd lost). The read
    /// decides: a linearizable read is never behind, where a watch may be
    /// served by a member still catching up.
    pub fn etcd_went_back(&self, seen: i64) {
        {
            let mut s = self.lock();
            s.went_back_from = Some(s.went_back_from.map_or(seen, |r| r.max(seen)));
        }
        self.wake.notify_one();
    }

    /// The blocks this node holds and when its lease was last refreshed.
    pub fn holding(&self) -> Holding {
        let s = self.lock();
        Holding {
            refreshed: s.lease_refreshed,
            blocks: s.serving.clone(),
        }
    }

    /// How many blocks are fenced.
    pub fn fenced(&self) -> usize {
        self.lock().fenced
    }

    /// The etcd keys the last read skipped because this build cannot read
    /// them, each as `etcd key K is unreadable (why): ...`, for `verify`.
    pub fn unreadable(&self) -> Vec<String> {
        self.lock()
            .unreadable
            .iter()
            .map(|(k, why)| {
                format!(
                    "etcd key {k} is unreadable ({why}); skipped by every read, remove it with `lockstep cluster unreadable delete {k}`"
                )
            })
            .collect()
    }

    /// The configured CIDRs withheld because they overlap the cluster's
    /// pools or blocks, each naming both sides.
    pub fn overlaps(&self) -> Vec<String> {
        self.lock().overlaps.clone()
    }

    /// Why this agent may not act as its node (another instance holds
    /// its name), while that lasts: for `verify`.
    pub fn identity(&self) -> Option<String> {
        self.lock().identity.clone()
    }

    /// The cluster pools and their families.
    pub fn pools(&self) -> Vec<crate::wire::ClusterPoolFamilies> {
        self.lock().pools.clone()
    }

    /// How much room has been made so far, per pool (reservation windows
    /// grown, so addresses served): taken before an allocation attempt, it
    /// tells [`ClusterHandle::need_block`] whether room came after it.
    pub fn claims_seen(&self) -> BTreeMap<String, u64> {
        self.lock().room.clone()
    }

    /// Asks for a block of `pool` now and waits for it, at most `within`.
    /// `seen` is [`ClusterHandle::claims_seen`] from before the attempt
    /// that found the pool full: a block claimed since (even before this
    /// call) answers at once, so a claim landing between the attempt and
    /// this call is not waited for in vain.
    ///
    /// # Errors
    /// Why not: etcd unreachable (named), or no block came in time.
    pub async fn need_block(
        &self,
        pool: &str,
        within: Duration,
        seen: &BTreeMap<String, u64>,
    ) -> Result<(), String> {
        let deadline = tokio::time::Instant::now() + within;
        let claims = seen.get(pool).copied().unwrap_or(0);
        let (rounds, blocks) = {
            let mut s = self.lock();
            if s.pools.iter().any(|p| p.name == pool && p.draining) {
                return Err(format!(
                    "cluster pool {pool} is being removed (draining): no new block is claimed from it"
                ));
            }
            if s.room.get(pool).copied().unwrap_or(0) > claims {
                return Ok(());
            }
            s.wanted.insert(pool.to_string());
            (s.rounds, s.claims.get(pool).copied().unwrap_or(0))
        };
        self.wake.notify_one();
        loop {
            let changed = self.changed.notified();
            {
                let s = self.lock();
                if s.room.get(pool).copied().unwrap_or(0) > claims {
                    return Ok(());
                }
                // A whole round after the request, and etcd failed.
                if s.rounds > rounds + 1
                    && let Some(p) = &s.problem
                {
                    return Err(p.clone());
                }
                // Not wanted any more and no block claimed: none is left.
                // A block claimed is room once its window is published.
                if s.rounds > rounds + 1
                    && !s.wanted.contains(pool)
                    && s.claims.get(pool).copied().unwrap_or(0) == blocks
                {
                    return Err(format!(
                        "cluster pool {pool} has no free block left in etcd"
                    ));
                }
            }
            if tokio::time::timeout_at(deadline, changed).await.is_err() {
                let s = self.lock();
                return Err(s.problem.clone().unwrap_or_else(|| {
                    format!("etcd did not give a block of cluster pool {pool} within {within:?}")
                }));
            }
        }
    }
}

/// Cluster mode's figures for the metrics (`crate::metrics` makes the
/// families).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ClusterFigures {
    /// Blocks in the local record that etcd no longer gives this node.
    pub fenced_blocks: u64,
    /// Whether the last etcd request succeeded.
    pub etcd_reachable: bool,
    /// Blocks claimed since start.
    pub block_claims: u64,
    /// etcd keys this build cannot read.
    pub unreadable_keys: u64,
    /// Overlaps of a configured pool's cidr with a cluster pool or block.
    pub configured_pool_overlaps: u64,
    /// Addresses in this node's reservation window.
    pub window_addresses: u64,
    /// Reservation windows published since start.
    pub window_publications: u64,
    /// Node lease refreshes the keeper sent and etcd answered.
    pub lease_renewals: u64,
    /// The latest a node lease refresh was sent against its schedule.
    pub lease_late_max: Duration,
    /// Times the claim loop read the cluster whole again.
    pub whole_reads: u64,
    /// Batches of changes it followed in place instead.
    pub changes_followed: u64,
}

impl ClusterHandle {
    /// What the metrics report of cluster mode now.
    pub fn figures(&self) -> ClusterFigures {
        let s = self.lock();
        ClusterFigures {
            fenced_blocks: s.fenced as u64,
            etcd_reachable: s.problem.is_none(),
            block_claims: s.claims.values().sum(),
            unreadable_keys: s.unreadable.len() as u64,
            configured_pool_overlaps: s.overlaps.len() as u64,
            window_addresses: s.window_addresses as u64,
            window_publications: s.window_publications,
            lease_renewals: s.lease_renewals,
            lease_late_max: s.lease_late_max,
            whole_reads: s.whole_reads,
            changes_followed: s.changes_followed,
        }
    }
}
