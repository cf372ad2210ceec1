//! `[kubernetes] pod_cidr_pool`: this node's endpoint pool made of its
//! Node's `spec.podCIDRs`, for pod IPAM with only the API server (no etcd,
//! no per-node ConfigMap), as host-local does under kubelet's podCIDR.
//!
//! The choice between the Node's CIDRs and the record of an earlier start
//! is the core's (`lockstep_core::pod_cidrs`); this module reads the Node's
//! field and keeps the record (`<state_dir>/pod-cidrs.json`, written
//! durably before the agent serves from the CIDRs), so a restart while the
//! API is away serves the same CIDRs.

use std::path::Path;

use ipnet::IpNet;
use k8s_openapi::api::core::v1::Node;
use lockstep_core::pod_cidrs::{Source, choose, pool};
use lockstep_core::pool::PoolSpec;

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
            std::fs::create_dir_all(state_dir).map_err(|e| record_error(state_dir, e))?;
            crate::cluster::write_json(state_dir, RECORD, &cidrs)
                .map_err(|e| record_error(state_dir, crate::error_chain(&e)))?;
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
