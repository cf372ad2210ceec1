//! Blocks in etcd: listed, claimed (create-if-absent, read back when the
//! answer is late) and given back (compared on revision).

use etcd_client::{Compare, CompareOp, Txn, TxnOp, TxnOpResponse};
use ipnet::IpNet;

use super::super::{Block, BlockRecord, Claim, ClusterStoreError};
use super::parse::*;
use super::*;

impl Door {
    /// Every claimed block, and the store revision of the read. A key
    /// whose name or value this build cannot read is skipped and kept in
    /// [`Door::unreadable`] (with its block when the key names one: no
    /// claim may pick it). Shared, not copied, while no block changes.
    ///
    /// # Errors
    /// etcd unavailable.
    pub async fn blocks(&mut self) -> Result<(Arc<Vec<Block>>, i64), ClusterStoreError> {
        self.parsed("read blocks", "blocks/", |prefix, kvs| {
            let mut out = Vec::with_capacity(kvs.len());
            let mut bad = Vec::new();
            for kv in kvs {
                let parse = |kv: &Kv| parse_block(prefix, &kv.key, &kv.value, kv.mod_revision);
                match kv.parse_once("blocks/", parse) {
                    Ok(b) => out.push(b),
                    Err(u) => bad.push(u),
                }
            }
            (out, bad)
        })
        .await
    }

    /// Claims `cidr` of `pool` for `node`: created only if no one holds it.
    /// An answer that does not come in time is read back: the claim may
    /// have been logged and committed (or may commit once quorum returns).
    ///
    /// # Errors
    /// etcd unavailable (with `maybe_written` when even the read-back
    /// failed: the caller must count the block as possibly its own), or a
    /// stored value unreadable.
    pub async fn claim_block(
        &mut self,
        pool: &str,
        cidr: IpNet,
        node: &str,
    ) -> Result<Claim, ClusterStoreError> {
        let key = self.block_key(pool, cidr);
        let record = BlockRecord {
            node: node.to_string(),
            claimed_at_ms: now_ms(),
            instance: self.opts.instance.clone(),
        };
        let value = serde_json::to_vec(&record).map_err(|e| ClusterStoreError::Corrupt {
            key: key.clone(),
            reason: e.to_string(),
        })?;
        let txn = Txn::new()
            .when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)])
            .and_then([TxnOp::put(key.clone(), value, None)])
            .or_else([TxnOp::get(key.clone(), None)]);
        let what = format!("claim block {cidr} of pool {pool}");
        // Run twice, the create-if-absent finds the key ours: claimed.
        let sent = self.txn_idempotent(&what, &txn);
        match sent.await {
            Ok(resp) if resp.succeeded() => Ok(Claim::Claimed {
                revision: resp.header().map_or(0, |h| h.revision()),
            }),
            Ok(resp) => {
                let holder = resp.op_responses().into_iter().find_map(|r| match r {
                    TxnOpResponse::Get(g) => g
                        .kvs()
                        .first()
                        .map(|kv| (kv.value().to_vec(), kv.mod_revision())),
                    _ => None,
                });
                match holder {
                    // Ours already (a restart re-claiming): claimed at its revision.
                    Some((v, rev)) => self.claim_of(&key, &v, node, rev),
                    // Given back between the compare and the get: try again.
                    None => Err(ClusterStoreError::Conflict { what }),
                }
            }
            Err(ClusterStoreError::Unavailable { .. }) => self.read_back_claim(&key, node).await,
            Err(e) => Err(e),
        }
    }

    async fn read_back_claim(&mut self, key: &str, node: &str) -> Result<Claim, ClusterStoreError> {
        let what = format!("read back the claim {key}");
        let resp = self
            .retrying(&what, false, |mut c| {
                let key = key.to_string();
                async move { c.get(key, None).await }
            })
            .await
            .map_err(|e| match e {
                ClusterStoreError::Unavailable {
                    endpoints, what, ..
                } => ClusterStoreError::Unavailable {
                    endpoints,
                    what,
                    maybe_written: true,
                },
                other => other,
            })?;
        match resp.kvs().first() {
            Some(kv) => self.claim_of(key, kv.value(), node, kv.mod_revision()),
            None => Err(unavailable(
                &self.opts,
                &format!("claim {key}"),
                "the claim timed out and is not stored (yet); it may still commit",
                true,
            )),
        }
    }

    fn claim_of(
        &self,
        key: &str,
        value: &[u8],
        node: &str,
        revision: i64,
    ) -> Result<Claim, ClusterStoreError> {
        let rec: BlockRecord = match serde_json::from_slice(value) {
            Ok(rec) => rec,
            Err(e) => {
                tracing::warn!(%key, reason = %e, "a claim found an unreadable block key; picking another block");
                return Ok(Claim::Unreadable {
                    reason: e.to_string(),
                });
            }
        };
        // Ours only if the record names this instance too (or none: an
        // older build's). A second host under this node's name finds the
        // name on a key it did not write: taken, not claimed (#26 item 5).
        Ok(if rec.held_by(node, self.opts.instance.as_deref()) {
            Claim::Claimed { revision }
        } else {
            Claim::Taken { by: rec.holder() }
        })
    }

    /// Gives `block` back: deleted only if its key is still at the revision
    /// the caller holds (an operator's reclaim and another node's claim
    /// meanwhile change it). Returns whether it was deleted.
    ///
    /// # Errors
    /// etcd unavailable.
    pub async fn release_block(&mut self, block: &Block) -> Result<bool, ClusterStoreError> {
        let key = self.block_key(&block.pool, block.cidr);
        let txn = Txn::new()
            .when([Compare::mod_revision(
                key.clone(),
                CompareOp::Equal,
                block.revision,
            )])
            .and_then([TxnOp::delete(key, None)]);
        let what = format!("give back block {} of pool {}", block.cidr, block.pool);
        // Run twice, the revision compare fails on the deleted key: the
        // caller forgets the block either way.
        Ok(self.txn_idempotent(&what, &txn).await?.succeeded())
    }
}
