//! Taking a node's blocks from it (#26 item 2): the gone mark (since when
//! its lease is gone, written once, guarded), the removal by an operator or
//! by a live node once the mark is `reclaim_after` old, and the addresses
//! its pods may still hold (`reserved/<node>`), kept out of every other
//! node's allocator until released. The decisions are the core's
//! (`lockstep_core::cluster::reclaim`); every write here compares what it
//! read, so of several nodes trying, one has the effect.

use std::collections::BTreeSet;
use std::net::IpAddr;

use etcd_client::{Compare, CompareOp, Txn, TxnOp};
use lockstep_core::cluster::{GoneMark, NodeLease, check_node_removal};

use super::super::{Block, ClusterStoreError, NodeAddrRecord, Removed, ReservedRecord};
use super::parse::parse_reserved;
use super::*;

/// The area (under the prefix) of the reserved addresses, one key per
/// node that held them.
pub(super) const RESERVED: &str = "reserved/";

impl Door {
    /// Records that `record`'s node's lease is gone since `mark`, if its
    /// routing key is still at `revision` and its node key absent (the
    /// node did not register meanwhile). Returns whether this write won.
    ///
    /// # Errors
    /// etcd unavailable.
    pub async fn mark_gone(
        &mut self,
        record: &NodeAddrRecord,
        revision: i64,
        mark: GoneMark,
    ) -> Result<bool, ClusterStoreError> {
        let key = self.key(&format!("{NODE_ADDRS}{}", record.name));
        let mut marked = record.clone();
        marked.gone = Some(mark);
        let value = serde_json::to_vec(&marked).map_err(|e| ClusterStoreError::Corrupt {
            key: key.clone(),
            reason: e.to_string(),
        })?;
        let node_key = self.key(&format!("nodes/{}", record.name));
        let txn = Txn::new()
            .when([
                Compare::mod_revision(key.clone(), CompareOp::Equal, revision),
                Compare::create_revision(node_key, CompareOp::Equal, 0),
            ])
            .and_then([TxnOp::put(key, value, None)]);
        let what = format!("record node {} gone", record.name);
        // Guarded on the revision: a second run finds it changed.
        let resp = self.txn_idempotent(&what, &txn).await?;
        Ok(resp.succeeded())
    }

    /// Every reservation: address → the node whose pods may hold it.
    /// Shared, not copied, while no reservation changes.
    ///
    /// # Errors
    /// etcd unavailable.
    pub async fn reservations(
        &mut self,
    ) -> Result<Arc<Vec<(ReservedRecord, i64)>>, ClusterStoreError> {
        self.read_area(
            "read reserved addresses",
            RESERVED,
            parse_reserved,
            |record, revision, _| (record, revision),
        )
        .await
    }

    /// Replaces `node`'s reservations, read at `revision`, by `keep`
    /// (deleting the key when empty). Returns whether the write won.
    ///
    /// # Errors
    /// etcd unavailable.
    pub async fn set_reservations(
        &mut self,
        node: &str,
        revision: i64,
        keep: &BTreeSet<IpAddr>,
    ) -> Result<bool, ClusterStoreError> {
        let key = self.key(&format!("{RESERVED}{node}"));
        let op = if keep.is_empty() {
            TxnOp::delete(key.clone(), None)
        } else {
            TxnOp::put(key.clone(), self.reserved_value(node, keep)?, None)
        };
        let txn = Txn::new()
            .when([Compare::mod_revision(key, CompareOp::Equal, revision)])
            .and_then([op]);
        let what = format!("release addresses reserved for node {node}");
        let resp = self.txn_idempotent(&what, &txn).await?;
        Ok(resp.succeeded())
    }

    /// An operator's release of reserved addresses (their pods are gone):
    /// each must be reserved; returns each with the node it was held for.
    ///
    /// # Errors
    /// [`ClusterStoreError::Invalid`] naming an address not reserved
    /// (nothing written), a conflict, or etcd unavailable.
    pub async fn release_reserved(
        &mut self,
        addresses: &[IpAddr],
    ) -> Result<Vec<(IpAddr, String)>, ClusterStoreError> {
        let all = self.reservations().await?;
        let mut out = Vec::new();
        for a in addresses {
            match all.iter().find(|(r, _)| r.addresses.contains(a)) {
                Some((r, _)) => out.push((*a, r.name.clone())),
                None => {
                    return Err(ClusterStoreError::Invalid(format!(
                        "address {a} is not reserved (`lockstep cluster addresses` lists them); nothing released"
                    )));
                }
            }
        }
        for (r, revision) in all.iter() {
            let keep: BTreeSet<IpAddr> = r
                .addresses
                .iter()
                .filter(|a| !addresses.contains(a))
                .copied()
                .collect();
            if keep.len() != r.addresses.len()
                && !self.set_reservations(&r.name, *revision, &keep).await?
            {
                return Err(ClusterStoreError::Conflict {
                    what: format!("release addresses reserved for node {}", r.name),
                });
            }
        }
        Ok(out)
    }

    fn reserved_value(
        &self,
        node: &str,
        addresses: &BTreeSet<IpAddr>,
    ) -> Result<Vec<u8>, ClusterStoreError> {
        let record = ReservedRecord {
            name: node.to_owned(),
            addresses: addresses.iter().copied().collect(),
        };
        serde_json::to_vec(&record).map_err(|e| ClusterStoreError::Corrupt {
            key: self.key(&format!("{RESERVED}{node}")),
            reason: e.to_string(),
        })
    }

    /// Removes node `name` as an operator asks: its blocks deleted (each
    /// compared on the revision read) so others can claim them, its
    /// routing key with them, and its reservation window (every address
    /// it may have handed out, #43) reserved (`reserved/<name>`), in one
    /// transaction. Without
    /// `force` only once its lease has been recorded gone for
    /// `reclaim_after` (the core's
    /// [`check_node_removal`](lockstep_core::cluster::check_node_removal));
    /// with it, its node key goes too.
    ///
    /// # Errors
    /// [`ClusterStoreError::Refused`] (alive, not yet due, unknown),
    /// [`ClusterStoreError::Conflict`] (changed meanwhile: nothing
    /// deleted), or etcd unavailable.
    pub async fn remove_node(
        &mut self,
        name: &str,
        force: bool,
    ) -> Result<Removed, ClusterStoreError> {
        self.take_node(name, force).await
    }

    /// A live node's automatic reclaim of node `name`, whose lease has been
    /// recorded gone for `reclaim_after`: as [`Door::remove_node`] without
    /// force; guarded, so of several nodes trying one frees the blocks.
    ///
    /// # Errors
    /// As [`Door::remove_node`]; a [`ClusterStoreError::Conflict`] means
    /// another node reclaimed it, or it came back.
    pub async fn reclaim_node(&mut self, name: &str) -> Result<Removed, ClusterStoreError> {
        self.take_node(name, false).await
    }

    async fn take_node(&mut self, name: &str, force: bool) -> Result<Removed, ClusterStoreError> {
        let alive = self.nodes().await?.iter().any(|n| n.record.name == name);
        let (blocks, _) = self.blocks().await?;
        let freed: Vec<Block> = blocks.iter().filter(|b| b.node == name).cloned().collect();
        let routing = self
            .routing_keys()
            .await?
            .iter()
            .find(|(r, _)| r.name == name)
            .cloned();
        let lease = if alive {
            NodeLease::Alive
        } else if freed.is_empty() && routing.is_none() {
            NodeLease::Unknown
        } else {
            NodeLease::Gone(routing.as_ref().and_then(|(r, _)| r.gone))
        };
        let removal = check_node_removal(name, lease, force, now_ms())?;
        let reserved_key = self.key(&format!("{RESERVED}{name}"));
        let (earlier, reserved_rev) = self
            .reservations()
            .await?
            .iter()
            .find(|(r, _)| r.name == name)
            .map_or((Vec::new(), 0), |(r, rev)| (r.addresses.clone(), *rev));
        let mut reserved: BTreeSet<IpAddr> = earlier.into_iter().collect();
        // Addresses in use a node before reservation windows published
        // with its routing key.
        if let Some((r, _)) = &routing {
            reserved.extend(r.in_use.iter().copied());
        }
        // Its reservation window (#43): everything it may have handed out
        // without asking etcd, in the second before a cut or during it.
        let window = self.window(name).await?;
        if let Some((w, _)) = &window {
            reserved.extend(w.iter().copied());
        }
        let window_key = self.window_key(name);
        let routing_key = self.key(&format!("{NODE_ADDRS}{name}"));
        let node_key = self.key(&format!("nodes/{name}"));
        let mut guards = vec![
            Compare::mod_revision(
                routing_key.clone(),
                CompareOp::Equal,
                routing.as_ref().map_or(0, |(_, rev)| *rev),
            ),
            Compare::mod_revision(reserved_key.clone(), CompareOp::Equal, reserved_rev),
            // A window extended in between (a node back) is read again.
            Compare::mod_revision(
                window_key.clone(),
                CompareOp::Equal,
                window.as_ref().map_or(0, |(_, rev)| *rev),
            ),
        ];
        if !force {
            // Still gone: a node back in between keeps its blocks.
            guards.push(Compare::create_revision(
                node_key.clone(),
                CompareOp::Equal,
                0,
            ));
        }
        let mut ops = Vec::new();
        for b in &freed {
            let key = self.block_key(&b.pool, b.cidr);
            guards.push(Compare::mod_revision(
                key.clone(),
                CompareOp::Equal,
                b.revision,
            ));
            ops.push(TxnOp::delete(key, None));
        }
        ops.push(TxnOp::delete(routing_key, None));
        if window.is_some() {
            ops.push(TxnOp::delete(window_key, None));
        }
        if !reserved.is_empty() {
            ops.push(TxnOp::put(
                reserved_key,
                self.reserved_value(name, &reserved)?,
                None,
            ));
        }
        if force {
            ops.push(TxnOp::delete(node_key, None));
        }
        let what = format!("remove node {name}");
        let txn = Txn::new().when(guards).and_then(ops);
        let resp = self.txn_write(&what, &txn).await?;
        if !resp.succeeded() {
            return Err(ClusterStoreError::Conflict { what });
        }
        Ok(Removed {
            freed,
            removal,
            reserved: reserved.into_iter().collect(),
        })
    }
}
