//! etcd restored from a backup, in the claim loop (#26 item 3).
//!
//! Why: a restore deletes every block claimed after the backup while their
//! holders still hand out addresses from them. Fenced as "absent", such a
//! block stayed with no one in etcd and another node claimed it: 6
//! addresses with two holders in `cluster_restore`. Here the node tells
//! that etcd went back in time (every read's cluster ID and store revision
//! against the highest it recorded, durably in `cluster-etcd.json`), claims
//! back (create-if-absent) every block of its record etcd lost before it
//! claims anything new, and claims nothing new for [`GRACE`] after the
//! rollback so the other holders re-assert theirs first. The decisions are
//! the core's (`lockstep_core::cluster::restore`).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ipnet::IpNet;
use lockstep_core::cluster::{StoreMark, advance, may_claim_new, rolled_back, to_reclaim};

use super::super::held::Held;
use super::super::{Block, Claim, ClusterStoreError};
use super::{ClusterNode, READ_EVERY};

/// How long after a rollback a node claims no new block: three reads of a
/// node on its slowest cadence ([`READ_EVERY`]). Every running holder of
/// a lost block reads etcd within one such interval of its return (sooner
/// when its watch of the other nodes' blocks reports the rollback first)
/// and claims the block back at that read, well within the grace.
pub(super) const GRACE: Duration = Duration::from_secs(3 * READ_EVERY.as_secs());

/// What the node knows of etcd's history.
#[derive(Debug, Default)]
pub(super) struct History {
    /// Where etcd was last seen (also in `cluster-etcd.json`).
    pub(super) mark: Option<StoreMark>,
    /// When the node last saw etcd go back in time.
    pub(super) rolled_back_at: Option<Instant>,
    /// Blocks etcd lost are still to be claimed back (a claim failed).
    pub(super) reclaim_pending: bool,
}

impl History {
    /// The recorded mark, raised to the revisions the node's own blocks
    /// were claimed at (a record from before `cluster-etcd.json` existed,
    /// or one that lags behind the last claims).
    pub(super) fn load(state_dir: &std::path::Path, held: &Held) -> Result<Self, String> {
        let mark = Held::load_mark(state_dir).map_err(|e| crate::error_chain(&e))?;
        let claimed = held.blocks.iter().map(|b| b.revision).max();
        let mark = match (mark, claimed) {
            (Some(m), Some(r)) => Some(StoreMark {
                revision: m.revision.max(r),
                ..m
            }),
            (Some(m), None) => Some(m),
            (None, Some(r)) if r > 0 => Some(StoreMark {
                cluster_id: 0,
                revision: r,
            }),
            (None, _) => None,
        };
        Ok(Self {
            mark,
            ..Self::default()
        })
    }
}

impl ClusterNode {
    /// Compares the answer of a read (`now`) with where etcd was last seen:
    /// a rollback starts the grace and asks for the lost blocks to be
    /// claimed back. Records the new mark.
    pub(super) fn note_store(&mut self, now: Option<StoreMark>) {
        let Some(now) = now else {
            return;
        };
        if let Some(why) = rolled_back(self.history.mark, now) {
            tracing::error!(%why, grace = ?GRACE, "etcd went back in time (restored from a backup?): claiming back this node's blocks etcd lost, and no new block for the grace");
            self.history.rolled_back_at = Some(Instant::now());
            self.history.reclaim_pending = true;
            // The reservation window etcd holds may be the backup's (or
            // none): read and written again at this round (#43).
            self.window.forget_published();
        }
        let next = advance(self.history.mark, now);
        if self.history.mark != Some(next) {
            self.history.mark = Some(next);
            if let Err(e) = Held::save_mark(&self.config.state_dir, next) {
                tracing::error!(error = %crate::error_chain(&e), "where etcd was last seen is not recorded");
            }
        }
    }

    /// The remote task's watch had seen revision `seen` of this cluster
    /// before etcd's revision dropped: the mark is raised to it, so the
    /// next read tells a rollback even if this loop never read that far.
    /// A rollback this loop already saw within the grace is the same one
    /// (its mark is etcd's new history already).
    pub(super) fn watch_saw(&mut self, seen: i64) {
        if self
            .history
            .rolled_back_at
            .is_some_and(|t| t.elapsed() < GRACE)
        {
            return;
        }
        let mark = self.history.mark.get_or_insert_default();
        mark.revision = mark.revision.max(seen);
    }

    /// Whether the claim loop may claim new blocks now (the core's
    /// `may_claim_new`).
    pub(super) fn may_claim_new(&self) -> bool {
        let since = self
            .history
            .rolled_back_at
            .map(|t| u64::try_from(t.elapsed().as_millis()).unwrap_or(u64::MAX));
        let grace = u64::try_from(GRACE.as_millis()).unwrap_or(u64::MAX);
        may_claim_new(since, grace, self.history.reclaim_pending)
    }

    /// After a rollback, claims back (create-if-absent) each block of the
    /// record etcd no longer has (the core's `to_reclaim`; a block being
    /// given back is not claimed back). Each claim is recorded as unsettled
    /// before it is sent and the block recorded before it serves, as every
    /// claim (#26 item 7); an answer that never came is settled by the
    /// read's `settle`, which follows. `blocks` (etcd's, as just read) gets
    /// the outcome (read again when another node took a block first), so the fence that follows sees the block this node's
    /// again, or another node's (then it stays fenced and `verify` names
    /// it). Pending again when a claim fails.
    pub(super) async fn reclaim_lost(&mut self, blocks: &mut Arc<Vec<Block>>) {
        if !self.history.reclaim_pending {
            return;
        }
        let local: Vec<(String, IpNet)> = self
            .held
            .blocks
            .iter()
            .filter(|b| !b.releasing)
            .map(|b| (b.pool.clone(), b.cidr))
            .collect();
        let owners: BTreeMap<IpNet, String> =
            blocks.iter().map(|b| (b.cidr, b.node.clone())).collect();
        let mut pending = false;
        let mut reread = false;
        for (pool, cidr) in to_reclaim(&local, &owners, &self.held.pools) {
            if self.door.is_none() {
                pending = true;
                break;
            }
            self.held.record_unsettled(&pool, cidr);
            if let Err(e) = self.held.save(&self.config.state_dir) {
                tracing::error!(error = %crate::error_chain(&e), %cidr, "a claim cannot be recorded before it is sent; not claiming back");
                self.held.settle_unsettled(cidr);
                pending = true;
                continue;
            }
            let door = self.door.as_mut().expect("checked above");
            match door.claim_block(&pool, cidr, &self.name).await {
                Ok(Claim::Claimed { revision }) => {
                    let replaced = self.held.record_claim(&pool, cidr, revision);
                    if let Err(e) = self.held.save(&self.config.state_dir) {
                        tracing::error!(error = %crate::error_chain(&e), %cidr, "a block claimed back is not recorded; not serving it");
                        self.held.unrecord_claim(&pool, cidr, replaced);
                        pending = true;
                        continue;
                    }
                    tracing::warn!(%cidr, %pool, revision, "claimed back a block etcd lost when it went back in time; it serves again");
                    Arc::make_mut(blocks).push(Block {
                        pool,
                        cidr,
                        node: self.name.clone(),
                        instance: Some(self.instance.clone()),
                        revision,
                    });
                }
                Ok(Claim::Taken { by }) => {
                    self.held.settle_unsettled(cidr);
                    tracing::error!(%cidr, %pool, holder = %by, "a block etcd lost when it went back in time was claimed by another node first; fenced, its addresses here stay held");
                    // Its record (holder, instance) as etcd has it now.
                    reread = true;
                }
                Ok(Claim::Unreadable { reason }) => {
                    self.held.settle_unsettled(cidr);
                    tracing::error!(%cidr, %pool, %reason, "a block etcd lost when it went back in time has an unreadable key now; fenced");
                }
                Err(e) => {
                    // Maybe written: unsettled, settled by `settle` (the
                    // read's next step) or a later read, as any claim.
                    if !matches!(
                        e,
                        ClusterStoreError::Unavailable {
                            maybe_written: true,
                            ..
                        }
                    ) {
                        self.held.settle_unsettled(cidr);
                    }
                    self.set_problem(Some(&e));
                    pending = true;
                    break;
                }
            }
        }
        if reread && let Some(door) = self.door.as_mut() {
            match door.blocks().await {
                Ok((now, _)) => *blocks = now,
                Err(e) => {
                    self.set_problem(Some(&e));
                    pending = true;
                }
            }
        }
        self.history.reclaim_pending = pending;
    }
}
