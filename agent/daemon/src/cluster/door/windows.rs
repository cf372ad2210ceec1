//! Reservation windows in etcd (#43): one key per node,
//! `<prefix>.windows/<node>` (for the default prefix
//! `/lockstep/v1.windows/<node>`), holding every address the node may hand
//! out without asking etcd ([`WindowRecord`]).
//!
//! Why beside the prefix, not under it: every node's mirror watches the
//! whole prefix (`mirror`), so a key under it reaches every node at every
//! change. Only a reclaimer needs a window, and reads it when it reclaims;
//! the node extends it ahead of need, a few times a minute under churn.
//! (`.` sorts before `/`: the key is outside the prefix's range.)

use std::collections::BTreeSet;
use std::net::IpAddr;

use etcd_client::{Compare, CompareOp, Txn, TxnOp};

use super::super::{ClusterStoreError, WindowRecord};
use super::Door;

impl Door {
    /// The key of `node`'s reservation window.
    pub(super) fn window_key(&self, node: &str) -> String {
        format!(
            "{}.windows/{node}",
            self.options().prefix.trim_end_matches('/')
        )
    }

    /// `node`'s published window and its key's mod revision; `None` when
    /// it has none.
    ///
    /// # Errors
    /// etcd unavailable, or a value this build cannot read.
    pub async fn window(
        &self,
        node: &str,
    ) -> Result<Option<(BTreeSet<IpAddr>, i64)>, ClusterStoreError> {
        let key = self.window_key(node);
        let resp = self
            .retrying("read a reservation window", false, |mut c| {
                let key = key.clone();
                async move { c.get(key, None).await }
            })
            .await?;
        let Some(kv) = resp.kvs().first() else {
            return Ok(None);
        };
        let record: WindowRecord =
            serde_json::from_slice(kv.value()).map_err(|e| ClusterStoreError::Corrupt {
                key: key.clone(),
                reason: e.to_string(),
            })?;
        Ok(Some((record.addresses, kv.mod_revision())))
    }

    /// Writes `node`'s window if its key is still at `expected` (its mod
    /// revision as last written or read; 0: absent). Returns the key's new
    /// revision, or `None` when it was at another (read it and try again).
    /// Only then may the node hand out an address the window adds.
    ///
    /// # Errors
    /// etcd unavailable (the write may have been applied: the window in
    /// etcd is then this one or the one before, both covering what the
    /// node hands out).
    pub async fn put_window(
        &self,
        node: &str,
        addresses: &BTreeSet<IpAddr>,
        expected: i64,
    ) -> Result<Option<i64>, ClusterStoreError> {
        let key = self.window_key(node);
        let value = serde_json::to_vec(&WindowRecord {
            name: node.to_string(),
            addresses: addresses.clone(),
        })
        .map_err(|e| ClusterStoreError::Corrupt {
            key: key.clone(),
            reason: e.to_string(),
        })?;
        let txn = Txn::new()
            .when([Compare::mod_revision(
                key.clone(),
                CompareOp::Equal,
                expected,
            )])
            .and_then([TxnOp::put(key, value, None)]);
        // Not through `txn_write`: that makes this door's next reads wait
        // until the mirror has seen the write's revision, and the mirror
        // never sees a key outside the prefix. Made again on any transient
        // failure (a member gone mid-request): when the first run was
        // applied, the second's compare fails, and the caller reads the
        // window (its own) and writes it once more.
        let resp = self
            .retrying_idempotent("publish the reservation window", |mut c| {
                let txn = txn.clone();
                async move { c.txn(txn).await }
            })
            .await?;
        if resp.succeeded() {
            Ok(resp.header().map(|h| h.revision()))
        } else {
            Ok(None)
        }
    }
}
