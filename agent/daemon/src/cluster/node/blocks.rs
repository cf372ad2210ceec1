//! A block's life past the claim loop's round: claiming one
//! ([`ClusterNode::claim`]), settling what etcd did not answer
//! ([`ClusterNode::settle`], #26 item 7), giving an empty block back
//! ([`ClusterNode::give_back`]) and finishing a drained pool's removal
//! ([`ClusterNode::finish_drains`], #26 item 12). Kept apart from the round
//! so each step's order of writes (recorded before sent, out of the
//! allocator before given back) reads in one place.

use super::*;

impl ClusterNode {
    /// Settles, against `blocks` (a read that just answered), what this
    /// node asked of etcd without learning the outcome (#26 item 7):
    ///
    /// - an unsettled claim etcd gives this node is recorded (durably,
    ///   before the allocator is given it), one another node holds is
    ///   forgotten, and one etcd does not hold is claimed again
    ///   (create-if-absent: a late commit of the first try then fails, so
    ///   the block is ours once or not at all);
    /// - a block whose give-back went unanswered is forgotten once etcd no
    ///   longer gives it this node; still ours, it stays out of the
    ///   allocator and the round gives it back again.
    ///
    /// A block claimed again here is added to `blocks` as this node's, so
    /// the fence that follows sees it held (before, it was fenced as
    /// "absent" right after being claimed back).
    pub(super) async fn settle(&mut self, blocks: &mut Arc<Vec<Block>>) {
        let mut changed = false;
        for u in self.held.unsettled.clone() {
            let found = blocks.iter().find(|b| b.cidr == u.cidr);
            let revision = match found {
                Some(b) if b.held_by(&self.name, &self.instance) => Some(b.revision),
                Some(_) => None,
                None => match self.door.as_mut() {
                    Some(door) => match door.claim_block(&u.pool, u.cidr, &self.name).await {
                        Ok(Claim::Claimed { revision }) => {
                            Arc::make_mut(blocks).push(Block {
                                pool: u.pool.clone(),
                                cidr: u.cidr,
                                node: self.name.clone(),
                                instance: Some(self.instance.clone()),
                                revision,
                            });
                            Some(revision)
                        }
                        Ok(_) => None,
                        // Still unknown: the next read settles it.
                        Err(_) => continue,
                    },
                    None => continue,
                },
            };
            changed = true;
            let Some(revision) = revision else {
                tracing::info!(cidr = %u.cidr, pool = %u.pool, "a claim whose answer was lost is another node's");
                self.held.settle_unsettled(u.cidr);
                continue;
            };
            tracing::info!(cidr = %u.cidr, pool = %u.pool, "a claim whose answer was lost is ours");
            let replaced = self.held.record_claim(&u.pool, u.cidr, revision);
            if let Err(e) = self.held.save(&self.config.state_dir) {
                // Settled again by the next read.
                tracing::error!(error = %crate::error_chain(&e), cidr = %u.cidr, "a claimed block is not recorded; not serving it");
                self.held.unrecord_claim(&u.pool, u.cidr, replaced);
            } else {
                // A block claimed, as any other: an ADD waiting for one
                // is told once the allocator serves it (the round counts
                // it). Before, only claims of the round were counted, and
                // an ADD waiting while the block came this way timed out.
                *self.settled.entry(u.pool.clone()).or_default() += 1;
            }
        }
        let before = self.held.blocks.len();
        self.held.blocks.retain(|hb| {
            !hb.releasing
                || blocks
                    .iter()
                    .any(|b| b.cidr == hb.cidr && b.held_by(&self.name, &self.instance))
        });
        if self.held.blocks.len() != before {
            tracing::info!(
                count = before - self.held.blocks.len(),
                "blocks whose give-back went unanswered are gone from etcd: given back"
            );
            changed = true;
        }
        if changed && let Err(e) = self.held.save(&self.config.state_dir) {
            tracing::error!(error = %crate::error_chain(&e), "the held blocks are not recorded");
        }
    }

    /// Deletes the key of every draining pool of which the last read found
    /// no block left (guarded: named again, or a block claimed since, and
    /// nothing is deleted); a pool some node still holds blocks of is read
    /// again soon, so its removal follows its last give-back promptly.
    pub(super) async fn finish_drains(&mut self) {
        let draining: Vec<(String, Vec<IpNet>)> = self
            .held
            .pools
            .iter()
            .filter(|p| p.draining)
            .map(|p| (p.name.clone(), p.cidrs().collect()))
            .collect();
        for (name, cidrs) in draining {
            let left = self
                .claimed
                .iter()
                .any(|b| cidrs.iter().any(|c| c.contains(&b.network())));
            if left {
                continue;
            }
            let (Some(&revision), Some(door)) =
                (self.pool_revisions.get(&name), self.door.as_mut())
            else {
                continue;
            };
            match door.finish_drain(&name, revision).await {
                Ok(true) => {
                    tracing::info!(pool = %name, "a removed pool has drained: its key is deleted");
                    self.read_next = true;
                }
                Ok(false) => self.read_next = true,
                Err(e) => self.set_problem(Some(&e)),
            }
        }
    }

    /// Claims one block of `pool` in `family`: the core picks, etcd
    /// decides; a lost race re-reads and picks again. Returns whether a
    /// block was claimed and recorded.
    pub(super) async fn claim(&mut self, pool: &ClusterPoolSpec, family: Family) -> bool {
        for _ in 0..8 {
            let mine: BTreeSet<IpNet> = self
                .held
                .blocks
                .iter()
                .filter(|b| b.pool == pool.name)
                .map(|b| b.cidr)
                .collect();
            let Some(cidr) = next_block(pool, family, &self.claimed, &mine, &self.name) else {
                tracing::warn!(pool = %pool.name, ?family, "cluster pool has no free block");
                if self.asked_at_read.contains(&pool.name) {
                    self.handle.lock().wanted.remove(&pool.name);
                }
                return false;
            };
            if self.door.is_none() {
                return false;
            }
            // Recorded before it is sent: if the answer is lost and the
            // agent restarts, the claim is still settled by a read.
            self.held.record_unsettled(&pool.name, cidr);
            if let Err(e) = self.held.save(&self.config.state_dir) {
                tracing::error!(error = %crate::error_chain(&e), %cidr, "a claim cannot be recorded before it is sent; not claiming");
                self.held.settle_unsettled(cidr);
                return false;
            }
            let door = self.door.as_mut().expect("checked above");
            match door.claim_block(&pool.name, cidr, &self.name).await {
                Ok(Claim::Claimed { revision }) => {
                    self.claimed.insert(cidr);
                    // The node's own fenced block, claimed back, serves
                    // again.
                    let replaced = self.held.record_claim(&pool.name, cidr, revision);
                    // Recorded before it is served.
                    if let Err(e) = self.held.save(&self.config.state_dir) {
                        tracing::error!(error = %crate::error_chain(&e), %cidr, "a claimed block is not recorded; not serving it");
                        self.held.unrecord_claim(&pool.name, cidr, replaced);
                        return false;
                    }
                    tracing::info!(%cidr, pool = %pool.name, revision, "claimed a block");
                    return true;
                }
                Ok(taken @ (Claim::Taken { .. } | Claim::Unreadable { .. })) => {
                    tracing::debug!(%cidr, ?taken, "lost a claim race; re-reading and picking again");
                    // Not ours: forgotten (saved with the next change; a
                    // restart before that settles it by a read).
                    self.held.settle_unsettled(cidr);
                    self.claimed.insert(cidr);
                    // Others may have claimed more meanwhile: pick from
                    // what etcd holds now.
                    match door.blocks().await {
                        Ok((blocks, _)) => {
                            self.claimed.extend(blocks.iter().map(|b| b.cidr));
                            self.claimed
                                .extend(door.unreadable().iter().filter_map(|u| u.block));
                        }
                        Err(e) => {
                            self.set_problem(Some(&e));
                            return false;
                        }
                    }
                }
                Err(e) => {
                    if matches!(
                        e,
                        ClusterStoreError::Unavailable {
                            maybe_written: true,
                            ..
                        }
                    ) {
                        // Unsettled (recorded above): the next read settles it.
                        self.claimed.insert(cidr);
                    } else {
                        self.held.settle_unsettled(cidr);
                    }
                    self.set_problem(Some(&e));
                    return false;
                }
            }
        }
        false
    }

    /// Gives an empty block back: out of the allocator first (only if it
    /// still holds no address), then out of etcd, then out of the record.
    pub(super) async fn give_back(&mut self, slot: &AgentSlot, b: HeldBlock) {
        let mut without = self.held.clone();
        without.blocks.retain(|h| h.cidr != b.cidr);
        let want = self.wanted(&without);
        let (specs, fenced, excluded) = (
            want.specs.clone(),
            want.fenced.clone(),
            want.excluded.clone(),
        );
        let cidr = b.cidr;
        // `None`: still in use (or no agent), nothing changed; `Some(ok)`:
        // the allocator was given the pools without it.
        let taken_out = on_agent(slot, move |a| {
            if a.block_usage(&[cidr]) != [0] {
                return None;
            }
            Some(a.set_cluster_pools(specs, fenced, excluded).is_ok())
        })
        .await
        .flatten();
        let Some(ok) = taken_out else {
            return;
        };
        if let Some(s) = &mut self.served {
            s.specs = want.specs;
            s.fenced = want.fenced;
        }
        if !ok {
            return;
        }
        let block = Block {
            pool: b.pool.clone(),
            cidr,
            node: self.name.clone(),
            instance: Some(self.instance.clone()),
            revision: b.revision,
        };
        let Some(door) = self.door.as_mut() else {
            return;
        };
        match door.release_block(&block).await {
            Ok(deleted) => {
                if !deleted {
                    tracing::warn!(%cidr, "the block changed in etcd before its give-back; forgetting it");
                }
                tracing::info!(%cidr, pool = %b.pool, "gave a block back");
                // A pool being removed is gone once its last block is:
                // read again soon to finish it.
                if self
                    .held
                    .pools
                    .iter()
                    .any(|p| p.name == b.pool && p.draining)
                {
                    self.read_next = true;
                }
                self.held = without;
                self.empty_since.remove(&cidr);
                if let Err(e) = self.held.save(&self.config.state_dir) {
                    tracing::error!(error = %crate::error_chain(&e), "the held blocks are not recorded");
                }
            }
            Err(e) => {
                self.set_problem(Some(&e));
                let unknown = b.releasing
                    || matches!(
                        e,
                        ClusterStoreError::Unavailable {
                            maybe_written: true,
                            ..
                        }
                    );
                if unknown {
                    // It may be gone from etcd already, and claimed by
                    // another node: out of the allocator (as it is now)
                    // until a read or a give-back made again settles it.
                    if let Some(h) = self.held.blocks.iter_mut().find(|h| h.cidr == cidr)
                        && !h.releasing
                    {
                        tracing::warn!(%cidr, pool = %b.pool, "a give-back went unanswered; the block serves nothing until etcd settles it");
                        h.releasing = true;
                        if let Err(e) = self.held.save(&self.config.state_dir) {
                            tracing::error!(error = %crate::error_chain(&e), "the held blocks are not recorded");
                        }
                    }
                } else {
                    // Never sent, or refused: still ours, served again.
                    self.serve(slot).await;
                }
            }
        }
    }
}
