//! Who owns the cluster pools (#29 item 1): `pools_source` in etcd says
//! `kubernetes` once the Kubernetes door's writer applied PodIPPools, and
//! `lockstep cluster pools apply` then refuses, naming why, rather than
//! fight the writer (which would apply its objects again on its next
//! pass). Absent: the CLI owns them, as before.

use etcd_client::{Compare, CompareOp, Txn, TxnOp};

use super::super::ClusterStoreError;
use super::*;

/// The key, under the prefix.
const SOURCE_KEY: &str = "pools_source";
/// Its value when PodIPPools are the source of record.
pub const POOLS_SOURCE_KUBERNETES: &str = "kubernetes";

impl Door {
    /// Who owns the cluster pools: `None` (the CLI) or
    /// [`POOLS_SOURCE_KUBERNETES`].
    ///
    /// # Errors
    /// etcd unavailable.
    pub async fn pools_source(&mut self) -> Result<Option<String>, ClusterStoreError> {
        let key = self.key(SOURCE_KEY);
        let resp = self
            .retrying("read the pools source", false, |mut c| {
                let key = key.clone();
                async move { c.get(key, None).await }
            })
            .await?;
        Ok(resp
            .kvs()
            .first()
            .map(|kv| String::from_utf8_lossy(kv.value()).into_owned()))
    }

    /// Records `source` as the owner of the cluster pools (written only
    /// when it differs).
    ///
    /// # Errors
    /// etcd unavailable.
    pub async fn mark_pools_source(&mut self, source: &str) -> Result<(), ClusterStoreError> {
        let key = self.key(SOURCE_KEY);
        let txn = Txn::new()
            .when([Compare::value(key.clone(), CompareOp::Equal, source)])
            .or_else([TxnOp::put(key, source, None)]);
        self.txn_idempotent("record the pools source", &txn).await?;
        Ok(())
    }
}
