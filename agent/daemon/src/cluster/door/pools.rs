//! Cluster pools in etcd: read, applied (checked by the core, one guarded
//! transaction) and the keys lockstep cannot read.

use std::collections::BTreeMap;

use etcd_client::{Compare, CompareOp, Txn, TxnOp};
use ipnet::IpNet;
use lockstep_core::cluster::default_for_apply;
use lockstep_core::cluster::{ClusterPoolSpec, plan_apply};

use super::super::{ClusterStoreError, Unreadable};
use super::parse::*;
use super::*;

/// How many times a pools apply is read, checked and written before a
/// concurrent change (a block claimed meanwhile) is reported.
const APPLY_ATTEMPTS: u64 = 5;

impl Door {
    /// Every cluster pool, with each key's mod revision, and the store
    /// revision of the read. A key whose name or value this build cannot
    /// read is skipped and kept in [`Door::unreadable`].
    ///
    /// # Errors
    /// etcd unavailable.
    pub async fn pools(
        &mut self,
    ) -> Result<(Vec<ClusterPoolSpec>, BTreeMap<String, i64>, i64), ClusterStoreError> {
        // Pools are few: copied out for the callers that change them.
        let (parsed, revision) = self
            .parsed("read pools", "pools/", |area, kvs| {
                let mut specs = Vec::new();
                let mut revisions = BTreeMap::new();
                let mut bad = Vec::new();
                for kv in kvs {
                    match parse_pool(area, &kv.key, &kv.value) {
                        Ok(spec) => {
                            revisions.insert(spec.name.clone(), kv.mod_revision);
                            specs.push(spec);
                        }
                        Err(reason) => bad.push(Unreadable {
                            key: kv.key.clone(),
                            reason,
                            block: None,
                        }),
                    }
                }
                ((specs, revisions), bad)
            })
            .await?;
        let (specs, revisions) = parsed.as_ref().clone();
        Ok((specs, revisions, revision))
    }

    /// The default pool etcd records (`default_pool`, a JSON string), and
    /// the key's mod revision (0: absent). An unreadable value counts as
    /// absent and is kept in [`Door::unreadable`].
    ///
    /// # Errors
    /// etcd unavailable.
    pub async fn stored_default(&mut self) -> Result<(Option<String>, i64), ClusterStoreError> {
        let key = self.key(DEFAULT_KEY);
        // A listing (from the mirror when it is live) of the one key.
        let (kvs, _) = self.list("read the default pool", DEFAULT_KEY).await?;
        let Some(kv) = kvs.into_iter().find(|kv| kv.key == key) else {
            self.note_unreadable(&key, Vec::new());
            return Ok((None, 0));
        };
        match parse_default(&kv.value) {
            Ok(name) => {
                self.note_unreadable(&key, Vec::new());
                Ok((Some(name), kv.mod_revision))
            }
            Err(reason) => {
                let u = Unreadable {
                    key: key.clone(),
                    reason,
                    block: None,
                };
                self.note_unreadable(&key, vec![u]);
                Ok((None, kv.mod_revision))
            }
        }
    }

    /// The keys the last reads skipped (pools, blocks and nodes read by
    /// this door), each with why.
    pub fn unreadable(&self) -> Vec<Unreadable> {
        self.unreadable.values().cloned().collect()
    }

    /// Replaces what is known unreadable under `area` by `found`; logs the
    /// keys not seen before.
    pub(super) fn note_unreadable(&mut self, area: &str, found: Vec<Unreadable>) {
        let before: BTreeMap<String, Unreadable> = self
            .unreadable
            .extract_if(.., |k, _| k.starts_with(area))
            .collect();
        for u in found {
            if !before.contains_key(&u.key) {
                tracing::warn!(key = %u.key, reason = %u.reason, "etcd key unreadable; skipped (remove it with `lockstep cluster unreadable delete KEY`)");
            }
            self.unreadable.insert(u.key.clone(), u);
        }
    }

    /// Every key under `pools/`, `blocks/`, `nodes/`, `node_addrs/` and
    /// `reserved/`, and `default_pool`, this build cannot read (six reads).
    ///
    /// # Errors
    /// etcd unavailable.
    pub async fn read_unreadable(&mut self) -> Result<Vec<Unreadable>, ClusterStoreError> {
        self.pools().await?;
        self.blocks().await?;
        self.nodes().await?;
        self.routing_keys().await?;
        self.reservations().await?;
        self.stored_default().await?;
        Ok(self.unreadable())
    }

    /// Deletes `key`, one this build cannot read (`pools/`, `blocks/`,
    /// `nodes/` or `node_addrs/` under the prefix, or `default_pool`), compared on the revision it was read
    /// at: the operator's way out of a key an older version or a hand
    /// wrote. A key that reads fine is refused (pools, blocks and nodes
    /// have commands of their own, which keep their rules).
    ///
    /// # Errors
    /// [`ClusterStoreError::Invalid`] (not such a key, absent, or
    /// readable), [`ClusterStoreError::Conflict`] (changed meanwhile), or
    /// etcd unavailable.
    pub async fn delete_unreadable(&mut self, key: &str) -> Result<(), ClusterStoreError> {
        let resp = self
            .retrying("read the key to delete", false, |mut c| {
                let key = key.to_string();
                async move { c.get(key, None).await }
            })
            .await?;
        let Some(kv) = resp.kvs().first() else {
            return Err(ClusterStoreError::Invalid(format!(
                "etcd key {key:?} does not exist"
            )));
        };
        let problem = if key.starts_with(&self.key("pools/")) {
            parse_pool(&self.key("pools/"), key, kv.value()).err()
        } else if key.starts_with(&self.key("blocks/")) {
            parse_block(&self.key("blocks/"), key, kv.value(), 0)
                .err()
                .map(|u| u.reason)
        } else if key.starts_with(&self.key("nodes/")) {
            parse_node(&self.key("nodes/"), key, kv.value()).err()
        } else if key.starts_with(&self.key(NODE_ADDRS)) {
            parse_node_addr(&self.key(NODE_ADDRS), key, kv.value()).err()
        } else if key.starts_with(&self.key(reclaim::RESERVED)) {
            parse_reserved(&self.key(reclaim::RESERVED), key, kv.value()).err()
        } else if key == self.key(DEFAULT_KEY) {
            parse_default(kv.value()).err()
        } else {
            return Err(ClusterStoreError::Invalid(format!(
                "etcd key {key:?} is not under {0}pools/, {0}blocks/, {0}nodes/, {0}{NODE_ADDRS} or {0}{1}, nor {0}{DEFAULT_KEY}",
                self.opts.prefix,
                reclaim::RESERVED
            )));
        };
        let Some(reason) = problem else {
            return Err(ClusterStoreError::Invalid(format!(
                "etcd key {key:?} is readable; change it with the command that owns it"
            )));
        };
        let txn = Txn::new()
            .when([Compare::mod_revision(
                key,
                CompareOp::Equal,
                kv.mod_revision(),
            )])
            .and_then([TxnOp::delete(key, None)]);
        let what = format!("delete the unreadable key {key}");
        let resp = self.txn_idempotent(&what, &txn).await?;
        if !resp.succeeded() {
            return Err(ClusterStoreError::Conflict { what });
        }
        tracing::info!(%key, %reason, "deleted an unreadable key");
        self.unreadable.remove(key);
        Ok(())
    }

    /// Replaces the cluster pools by `new`: validated and checked against
    /// the claimed blocks by the core ([`check_apply`](lockstep_core::cluster::check_apply)) and against the LB
    /// pools, then written in
    /// one transaction that holds only if no pool and no block changed since
    /// they were read. Returns the new store revision.
    ///
    /// # Errors
    /// [`ClusterStoreError::Refused`] (invalid pools, overlap, a CIDR with
    /// claimed blocks removed or re-cut: named with its blocks and nodes),
    /// [`ClusterStoreError::Invalid`] (a pool overlapping an LB pool, both
    /// named),
    /// [`ClusterStoreError::Conflict`] (a concurrent change at each of
    /// `APPLY_ATTEMPTS` tries: nothing written), or etcd unavailable.
    pub async fn apply_pools(&mut self, new: &[ClusterPoolSpec]) -> Result<i64, ClusterStoreError> {
        self.apply_pools_default(new, None).await
    }

    /// As [`Door::apply_pools`], naming the default pool (`default`) or
    /// keeping the one recorded (the core's [`default_for_apply`]: the
    /// first apply of a single pool records it; adding pools never moves
    /// it). The default key is written in the same transaction, compared
    /// on its revision.
    ///
    /// # Errors
    /// As [`Door::apply_pools`]; [`ClusterStoreError::Refused`] for a
    /// default that is not among `new`, an apply that drops the default
    /// without naming another, or several pools with none named or
    /// recorded.
    pub async fn apply_pools_default(
        &mut self,
        new: &[ClusterPoolSpec],
        default: Option<&str>,
    ) -> Result<i64, ClusterStoreError> {
        // A block claimed between the read and the write (nodes claim all
        // the time) fails the guard with nothing written: read, check and
        // try again, a few times, before telling the caller.
        let mut attempt = 1;
        let mut backoff = Backoff::new(Duration::from_millis(20), Duration::from_millis(160));
        loop {
            match self.apply_pools_once(new, default).await {
                Err(ClusterStoreError::Conflict { .. }) if attempt < APPLY_ATTEMPTS => {
                    attempt += 1;
                    tokio::time::sleep(backoff.next_delay()).await;
                }
                r => return r,
            }
        }
    }

    /// One read, check and guarded write of [`Door::apply_pools_default`].
    async fn apply_pools_once(
        &mut self,
        new: &[ClusterPoolSpec],
        default: Option<&str>,
    ) -> Result<i64, ClusterStoreError> {
        let (stored_default, default_rev) = self.stored_default().await?;
        let (old, revisions, read_at) = self.pools().await?;
        // A pool whose key holds something unreadable: the guard
        // (create-if-absent) would fail as a conflict for ever; name it.
        for spec in new {
            let key = self.key(&format!("pools/{}", spec.name));
            if let Some(u) = self.unreadable.get(&key) {
                return Err(ClusterStoreError::Invalid(format!(
                    "etcd key {key} of pool {} is unreadable ({}); remove it first with `lockstep cluster unreadable delete {key}`",
                    spec.name, u.reason
                )));
            }
        }
        let (blocks, blocks_at) = self.blocks().await?;
        let claimed: BTreeMap<IpNet, (String, String)> = blocks
            .iter()
            .map(|b| (b.cidr, (b.pool.clone(), b.node.clone())))
            .collect();
        // The default first: an apply dropping it is refused for that,
        // whatever else it would take away.
        let recorded = default_for_apply(new, stored_default.as_deref(), default)?;
        // A pool left out while nodes hold blocks of it is kept, draining
        // (#26 item 12).
        let written = plan_apply(&old, new, &claimed)?;
        // No endpoint pool may share an address with an LB pool.
        let (lb_pools, lb_pools_at) = self.list("read lb pools", "lb/pools/").await?;
        for kv in lb_pools {
            let lb: lockstep_core::lb::LbPoolSpec =
                serde_json::from_slice(&kv.value).map_err(|e| ClusterStoreError::Corrupt {
                    key: kv.key.clone(),
                    reason: e.to_string(),
                })?;
            lockstep_core::lb::check_against_cluster_pools(&lb, &written)
                .map_err(|e| ClusterStoreError::Invalid(e.to_string()))?;
        }
        let mut guards = Vec::new();
        let mut ops = Vec::new();
        for spec in &written {
            let key = self.key(&format!("pools/{}", spec.name));
            guards.push(match revisions.get(&spec.name) {
                Some(&rev) => Compare::mod_revision(key.clone(), CompareOp::Equal, rev),
                None => Compare::create_revision(key.clone(), CompareOp::Equal, 0),
            });
            let value = serde_json::to_vec(spec).map_err(|e| ClusterStoreError::Corrupt {
                key: key.clone(),
                reason: e.to_string(),
            })?;
            ops.push(TxnOp::put(key, value, None));
        }
        for (name, &rev) in &revisions {
            if !written.iter().any(|p| &p.name == name) {
                let key = self.key(&format!("pools/{name}"));
                guards.push(Compare::mod_revision(key.clone(), CompareOp::Equal, rev));
                ops.push(TxnOp::delete(key, None));
            }
        }
        // The default, compared on the revision read (a concurrent apply
        // naming another fails this one).
        let default_key = self.key(DEFAULT_KEY);
        guards.push(if default_rev == 0 {
            Compare::create_revision(default_key.clone(), CompareOp::Equal, 0)
        } else {
            Compare::mod_revision(default_key.clone(), CompareOp::Equal, default_rev)
        });
        if recorded != stored_default || (default_rev != 0 && stored_default.is_none()) {
            match &recorded {
                Some(name) => {
                    let value =
                        serde_json::to_vec(name).map_err(|e| ClusterStoreError::Corrupt {
                            key: default_key.clone(),
                            reason: e.to_string(),
                        })?;
                    ops.push(TxnOp::put(default_key, value, None));
                }
                None => ops.push(TxnOp::delete(default_key, None)),
            }
        }
        // No pool written since the read (a pool this apply does not name
        // but another apply created meanwhile would otherwise survive it),
        // no LB pool since they were checked, and no block claimed or
        // changed since the blocks were read.
        guards.push(
            Compare::mod_revision(self.key("pools/"), CompareOp::Less, read_at + 1).with_prefix(),
        );
        guards.push(
            Compare::mod_revision(self.key("lb/pools/"), CompareOp::Less, lb_pools_at + 1)
                .with_prefix(),
        );
        guards.push(
            Compare::mod_revision(
                self.key("blocks/"),
                CompareOp::Less,
                blocks_at.max(read_at) + 1,
            )
            .with_prefix(),
        );
        let what = format!(
            "apply pools ({} pools: {} writes and deletes, {} compares in one transaction)",
            written.len(),
            ops.len(),
            guards.len()
        );
        let txn = Txn::new().when(guards).and_then(ops);
        let resp = self.txn_write(&what, &txn).await?;
        if !resp.succeeded() {
            return Err(ClusterStoreError::Conflict {
                what: "the cluster pools".into(),
            });
        }
        Ok(resp.header().map_or(0, |h| h.revision()))
    }

    /// Ends the removal of draining pool `pool`: its key is deleted if it
    /// is still at `revision` (not named again since) and no block of it
    /// is left in etcd (every key under `blocks/<pool>/` gone; etcd
    /// compares an empty range as version 0). Any node may try; one
    /// deletes, the others find the compare false. Returns whether it was
    /// deleted.
    ///
    /// # Errors
    /// etcd unavailable.
    pub async fn finish_drain(
        &mut self,
        pool: &str,
        revision: i64,
    ) -> Result<bool, ClusterStoreError> {
        let key = self.key(&format!("pools/{pool}"));
        let blocks = self.key(&format!("blocks/{pool}/"));
        let txn = Txn::new()
            .when([
                Compare::mod_revision(key.clone(), CompareOp::Equal, revision),
                Compare::version(blocks, CompareOp::Equal, 0).with_prefix(),
            ])
            .and_then([TxnOp::delete(key, None)]);
        let what = format!("remove drained pool {pool}");
        // Run twice, the revision compare fails on the deleted key.
        Ok(self.txn_idempotent(&what, &txn).await?.succeeded())
    }
}
