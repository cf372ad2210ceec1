//! The Kubernetes door's one writer into etcd: the agent that is the
//! elected LB assigner (#28's election) is the one that applies PodIPPools
//! (`pod_pools`) and removes deleted Nodes (`node_removal`). No second
//! election: each write is one guarded transaction, so a writer changing
//! mid-pass can only make a stale write fail its compare, never write a
//! mix.

use std::sync::Arc;
use std::time::Duration;

use super::KubeError;
use crate::cluster::{ClusterStoreError, Door, DoorOptions, LbHandle};

/// How long one etcd request of the writer may take.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);

/// This node's connection to etcd, and whether it is the writer.
#[derive(Debug)]
pub struct ClusterWriter {
    opts: DoorOptions,
    door: tokio::sync::Mutex<Option<Door>>,
    lb: Arc<LbHandle>,
    node: String,
}

impl ClusterWriter {
    /// Node `node`'s writer through etcd at `opts`; `lb` says who the
    /// assigner is.
    pub fn new(opts: DoorOptions, lb: Arc<LbHandle>, node: String) -> Self {
        Self {
            opts,
            door: tokio::sync::Mutex::new(None),
            lb,
            node,
        }
    }

    /// Whether this node is the elected writer now.
    ///
    /// # Errors
    /// etcd unavailable.
    pub async fn is_writer(&self) -> Result<bool, KubeError> {
        let a = self.lb.assignments().await.map_err(store_err)?;
        Ok(a.assigner.as_deref() == Some(self.node.as_str()))
    }

    /// Runs `f` on the (lazily connected) door.
    ///
    /// # Errors
    /// What `f` or the connection failed with, as the door's error.
    pub async fn with_door<T>(
        &self,
        f: impl AsyncFnOnce(&mut Door) -> Result<T, ClusterStoreError>,
    ) -> Result<T, KubeError> {
        let mut guard = self.door.lock().await;
        if guard.is_none() {
            *guard = Some(Door::connect(self.opts.clone()).await.map_err(store_err)?);
        }
        let door = guard.as_mut().expect("connected above");
        f(door).await.map_err(store_err)
    }
}

/// A store error as the Kubernetes door reports it: a refusal stays one.
pub fn store_err(e: ClusterStoreError) -> KubeError {
    use ClusterStoreError as E;
    match e {
        E::Invalid(reason) => KubeError::Refused { reason },
        E::Refused(e) => KubeError::Refused {
            reason: e.to_string(),
        },
        e => KubeError::Lb {
            reason: crate::error_chain(&e),
        },
    }
}
