//! `[kubernetes] pod_cidr_pool`: this node's endpoint pool made of its
//! Node's `spec.podCIDRs`, for pod IPAM with only the API server (no etcd,
//! no per-node ConfigMap), as host-local does under kubelet's podCIDR.
//!
//! The choice between the Node's CIDRs and the record of an earlier start
//! is the core's (`lockstep_core::pod_cidrs`); this module reads the Node's
//! field and keeps the record (`<state_dir>/pod-cidrs.json`, written
//! durably before the agent serves from the CIDRs), so a restart while the
//! API is away serves the same CIDRs.
//!
//! The Node is followed while the agent runs ([`Follower`]): a Node made
//! again with other CIDRs, or given a second family's, is served at once
//! (recorded first); what it no longer lists drains through the same
//! manager sync as NodeIPAM's pools (its holders keep their addresses,
//! nothing new comes from it, it is gone with its last holder, and across
//! a restart it is kept as a draining range).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use ipnet::IpNet;
use k8s_openapi::api::core::v1::Node;
use kube::Client;
use kube::api::Api;
use kube::runtime::watcher;
use lockstep_core::pod_cidrs::{Source, choose, follow, pool};
use lockstep_core::pool::PoolSpec;
use tokio::sync::Notify;

use super::nodeipam::{AgentSlot, Allocator};

/// The record's name in the state directory.
pub const RECORD: &str = "pod-cidrs.json";

/// Errors of the pod-CIDR pool.
#[derive(Debug, thiserror::Error)]
pub enum PodCidrsError {
    /// The record could not be read or written.
    #[error("pod-CIDR record {path}: {reason}")]
    Record {
        /// The file.
        path: String,
        /// What failed.
        reason: String,
    },
    /// Nothing to serve, or a bad CIDR.
    #[error(transparent)]
    Choose(#[from] lockstep_core::pod_cidrs::PodCidrError),
    /// The allocator did not take the CIDRs (the record is put back).
    #[error("the allocator refused the Node's podCIDRs: {reason}")]
    Agent {
        /// Why.
        reason: String,
    },
}

/// The Node's `spec.podCIDRs` (or the older single `spec.podCIDR`).
pub fn of_node(node: &Node) -> Vec<String> {
    let spec = node.spec.as_ref();
    match spec.and_then(|s| s.pod_cidrs.clone()) {
        Some(cidrs) if !cidrs.is_empty() => cidrs,
        _ => spec.and_then(|s| s.pod_cidr.clone()).into_iter().collect(),
    }
}

fn record_error(state_dir: &Path, reason: impl ToString) -> PodCidrsError {
    PodCidrsError::Record {
        path: state_dir.join(RECORD).display().to_string(),
        reason: reason.to_string(),
    }
}

/// The recorded CIDRs (none when there is no record).
///
/// # Errors
/// The record is unreadable.
pub fn load_record(state_dir: &Path) -> Result<Vec<IpNet>, PodCidrsError> {
    match std::fs::read(state_dir.join(RECORD)) {
        Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| record_error(state_dir, e)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
        Err(e) => Err(record_error(state_dir, e)),
    }
}

fn save_record(state_dir: &Path, cidrs: &[IpNet]) -> Result<(), PodCidrsError> {
    std::fs::create_dir_all(state_dir).map_err(|e| record_error(state_dir, e))?;
    crate::cluster::write_json(state_dir, RECORD, &cidrs)
        .map_err(|e| record_error(state_dir, crate::error_chain(&e)))
}

/// The pool `name` as the allocator starts with it: the recorded CIDRs
/// ([`start_pool`] has recorded the Node's by then), none when there is
/// no record.
///
/// # Errors
/// The record is unreadable.
pub fn start_spec(state_dir: &Path, name: &str) -> Result<Option<PoolSpec>, PodCidrsError> {
    let record = load_record(state_dir)?;
    Ok((!record.is_empty()).then(|| pool(name, &record)))
}

/// The pool to serve at start: `name` made of the Node's CIDRs (`node`:
/// what the API gave, `None` when it did not answer), recorded before it
/// is returned; else of the record's.
///
/// # Errors
/// Nothing to serve (named: the Node, and whether the API answered), a
/// bad CIDR, or the record cannot be read or written.
pub fn start_pool(
    state_dir: &Path,
    node_name: &str,
    name: &str,
    node: Option<&[String]>,
) -> Result<PoolSpec, PodCidrsError> {
    let record = load_record(state_dir)?;
    let (cidrs, source) = choose(node_name, node, &record)?;
    match source {
        Source::Node if cidrs != record => {
            save_record(state_dir, &cidrs)?;
            tracing::info!(node = node_name, pool = name, cidrs = ?cidrs, "kubernetes: serving the Node's podCIDRs");
        }
        Source::Node => {
            tracing::info!(node = node_name, pool = name, cidrs = ?cidrs, "kubernetes: serving the Node's podCIDRs");
        }
        Source::Record => {
            tracing::warn!(node = node_name, pool = name, cidrs = ?cidrs, "kubernetes: the Node gave no podCIDRs; serving the recorded ones");
        }
    }
    Ok(pool(name, &cidrs))
}

/// Follows this node's Node while the agent runs: its podCIDRs become the
/// pool's CIDRs, recorded before the allocator serves them.
#[derive(Debug)]
pub struct Follower<S> {
    slot: S,
    state_dir: PathBuf,
    node: String,
    pool: String,
    serving: Vec<IpNet>,
    /// The last refusal logged, so a Node that stays wrong is named once.
    refused: Option<String>,
}

impl<S: AgentSlot> Follower<S> {
    /// Pool `pool` of node `node`, serving what the record in `state_dir`
    /// holds.
    ///
    /// # Errors
    /// The record is unreadable.
    pub fn new(
        slot: S,
        state_dir: PathBuf,
        node: String,
        pool: String,
    ) -> Result<Self, PodCidrsError> {
        let serving = load_record(&state_dir)?;
        Ok(Self {
            slot,
            state_dir,
            node,
            pool,
            serving,
            refused: None,
        })
    }

    /// The CIDRs served now.
    pub fn serving(&self) -> &[IpNet] {
        &self.serving
    }

    /// Takes the Node's podCIDRs `listed`: `Ok(true)` when the pool
    /// changed. A refusal changes nothing (served, recorded).
    ///
    /// # Errors
    /// The CIDRs are bad or overlap another pool, the record cannot be
    /// written, or the allocator refused them.
    pub async fn apply(&mut self, listed: &[String]) -> Result<bool, PodCidrsError> {
        let others = self
            .slot
            .run(|a: &mut dyn Allocator| a.configured())
            .await
            .map_err(|e| PodCidrsError::Agent {
                reason: crate::error_chain(&e),
            })?;
        let Some(cidrs) = follow(&self.node, listed, &self.serving, &others)? else {
            return Ok(false);
        };
        save_record(&self.state_dir, &cidrs)?;
        let spec = pool(&self.pool, &cidrs);
        let taken = self
            .slot
            .run(move |a: &mut dyn Allocator| a.set_pools(vec![spec]))
            .await
            .map_err(|e| crate::error_chain(&e))
            .and_then(|r| r);
        if let Err(reason) = taken {
            // Put the record back: a restart must serve what is served.
            save_record(&self.state_dir, &self.serving)?;
            return Err(PodCidrsError::Agent { reason });
        }
        let dropped: Vec<IpNet> = self
            .serving
            .iter()
            .filter(|c| !cidrs.contains(c))
            .copied()
            .collect();
        tracing::info!(node = %self.node, pool = %self.pool, cidrs = ?cidrs, draining = ?dropped, "kubernetes: the Node's podCIDRs changed; serving them");
        self.serving = cidrs;
        Ok(true)
    }

    /// Follows the Node until `stop`.
    pub async fn run(mut self, client: Client, mut stop: tokio::sync::watch::Receiver<bool>) {
        let wake = Arc::new(Notify::new());
        let config = watcher::Config::default().fields(&format!("metadata.name={}", self.node));
        let (store, reflector) =
            super::reflectors::drive_with(Api::<Node>::all(client), config, wake.clone());
        loop {
            tokio::select! {
                () = wake.notified() => {}
                _ = stop.wait_for(|s| *s) => break,
            }
            let listed = store
                .state()
                .iter()
                .find(|n| n.metadata.name.as_deref() == Some(self.node.as_str()))
                .map(|n| of_node(n))
                .unwrap_or_default();
            match self.apply(&listed).await {
                Ok(_) => self.refused = None,
                Err(e) => {
                    let why = crate::error_chain(&e);
                    if self.refused.as_ref() != Some(&why) {
                        tracing::warn!(node = %self.node, pool = %self.pool, serving = ?self.serving, error = %why, "kubernetes: the Node's podCIDRs are not served; serving the earlier ones");
                        self.refused = Some(why);
                    }
                }
            }
        }
        reflector.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_nodes_cidrs_are_recorded_and_serve_a_start_without_the_api() {
        let dir = tempfile::tempdir().unwrap();
        let cidrs = vec!["10.244.3.0/24".to_string()];
        let p = start_pool(dir.path(), "n", "pods", Some(&cidrs)).unwrap();
        assert_eq!(p.ipv4, vec!["10.244.3.0/24".parse().unwrap()]);
        let again = start_pool(dir.path(), "n", "pods", None).unwrap();
        assert_eq!(again, p);
        let none = tempfile::tempdir().unwrap();
        let e = start_pool(none.path(), "n", "pods", None).unwrap_err();
        assert!(e.to_string().contains("Node n has no spec.podCIDRs"), "{e}");
        std::fs::write(dir.path().join(RECORD), b"{").unwrap();
        let e = start_pool(dir.path(), "n", "pods", Some(&cidrs)).unwrap_err();
        assert!(e.to_string().contains(RECORD), "{e}");
    }

    /// An allocator that records what it was given, or refuses it.
    #[derive(Default)]
    struct Pools {
        configured: Vec<PoolSpec>,
        given: Vec<Vec<PoolSpec>>,
        refuse: bool,
    }

    impl Allocator for Pools {
        fn usage(&self, cidrs: &[IpNet]) -> Vec<u64> {
            vec![0; cidrs.len()]
        }
        fn configured(&self) -> Vec<PoolSpec> {
            self.configured.clone()
        }
        fn set_pools(&mut self, specs: Vec<PoolSpec>) -> Result<(), String> {
            if self.refuse {
                return Err("refused".into());
            }
            self.given.push(specs);
            Ok(())
        }
    }

    impl AgentSlot for Arc<std::sync::Mutex<Pools>> {
        async fn run<T: Send + 'static>(
            &self,
            f: impl FnOnce(&mut dyn Allocator) -> T + Send + 'static,
        ) -> Result<T, super::super::KubeError> {
            Ok(f(&mut *self.lock().unwrap()))
        }
    }

    fn strings(v: &[&str]) -> Vec<String> {
        v.iter().map(ToString::to_string).collect()
    }

    #[tokio::test]
    async fn a_change_is_recorded_and_served_and_a_refusal_changes_neither() {
        let dir = tempfile::tempdir().unwrap();
        start_pool(dir.path(), "n", "pods", Some(&strings(&["10.244.3.0/24"]))).unwrap();
        let slot = Arc::new(std::sync::Mutex::new(Pools {
            configured: vec![PoolSpec::new("lb").with_cidr("10.9.0.0/16".parse().unwrap())],
            ..Pools::default()
        }));
        let mut f =
            Follower::new(slot.clone(), dir.path().into(), "n".into(), "pods".into()).unwrap();
        assert!(!f.apply(&strings(&["10.244.3.0/24"])).await.unwrap());
        assert!(
            !f.apply(&[]).await.unwrap(),
            "a Node with none changes nothing"
        );
        assert!(f.apply(&strings(&["10.244.7.0/24"])).await.unwrap());
        let seven: Vec<IpNet> = vec!["10.244.7.0/24".parse().unwrap()];
        assert_eq!(load_record(dir.path()).unwrap(), seven);
        assert_eq!(slot.lock().unwrap().given, vec![vec![pool("pods", &seven)]]);

        // Overlapping another pool: named, nothing changes.
        let e = f.apply(&strings(&["10.9.1.0/24"])).await.unwrap_err();
        assert!(e.to_string().contains("pool lb"), "{e}");
        // Refused by the allocator: the record is put back.
        slot.lock().unwrap().refuse = true;
        let e = f.apply(&strings(&["10.244.8.0/24"])).await.unwrap_err();
        assert!(e.to_string().contains("refused"), "{e}");
        assert_eq!(load_record(dir.path()).unwrap(), seven);
        assert_eq!(f.serving(), seven.as_slice());
        assert_eq!(slot.lock().unwrap().given.len(), 1);
    }

    #[test]
    fn the_single_pod_cidr_field_is_read_when_the_list_is_absent() {
        let node: Node = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "n"},
            "spec": {"podCIDR": "10.244.1.0/24"},
        }))
        .unwrap();
        assert_eq!(of_node(&node), vec!["10.244.1.0/24".to_string()]);
        let node: Node = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "n"},
            "spec": {"podCIDR": "10.244.1.0/24", "podCIDRs": ["10.244.1.0/24", "fd00:1::/64"]},
        }))
        .unwrap();
        assert_eq!(of_node(&node).len(), 2);
    }
}
