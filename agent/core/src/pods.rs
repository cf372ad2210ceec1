//! What the Kubernetes API says about the pods on this node, turned into
//! IPAM decisions (#29): which pool an endpoint's pod asks for, and which
//! endpoint allocations have outlived their pod.
//!
//! Why here and not in the daemon's Kubernetes door: both are decisions a
//! user relies on (an address from the wrong pool, or a live pod's address
//! released as a "leak", are outages), so they are pure and tested; the door
//! only reads the API into [`PodFacts`] and namespace annotations.
//!
//! **The pool rule** is Cilium's multi-pool rule: the pod's annotation
//! [`POOL_ANNOTATION`], else its namespace's, else the default pool. An
//! annotation that cannot name a pool (empty, white space) is an error
//! naming the object, never silently the default.
//!
//! **The leak rule** follows Calico's IPAM garbage collection: an endpoint
//! allocation whose pod is gone (absent from the API, replaced by a pod of
//! the same name with another UID, or finished) for longer than a grace
//! period is a leak. The grace period absorbs the moments the API and the
//! runtime disagree (a pod just created and not yet listed, a DEL still on
//! its way); only endpoint attachments that carry the pod they were made
//! for are judged, so agent-owned, LoadBalancer and delegated addresses
//! never are.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

/// The annotation, on a pod or its namespace, naming the pool its
/// addresses come from.
pub const POOL_ANNOTATION: &str = "lockstep.io/ip-pool";

/// The pod an attachment was made for, as the runtime names it in
/// `CNI_ARGS` (`K8S_POD_NAMESPACE`, `K8S_POD_NAME`, `K8S_POD_UID`).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PodRef {
    /// Its namespace.
    pub namespace: String,
    /// Its name.
    pub name: String,
    /// Its UID, when the runtime passed one: tells a pod from a later pod
    /// of the same name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<String>,
}

impl std::fmt::Display for PodRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// What the API says of one pod.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodFacts {
    /// Its UID.
    pub uid: Option<String>,
    /// Its annotations.
    pub annotations: BTreeMap<String, String>,
    /// `Succeeded` or `Failed`: its containers are done and its sandbox
    /// goes.
    pub finished: bool,
}

/// Errors of the pod rules.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PodsError {
    /// An annotation that cannot name a pool.
    #[error("{object} annotation {POOL_ANNOTATION}={value:?} does not name a pool: {reason}")]
    BadAnnotation {
        /// `pod ns/name` or `namespace ns`.
        object: String,
        /// The value.
        value: String,
        /// Why.
        reason: String,
    },
    /// The pod has not reached the agent's view of the API: its pool is
    /// unknown, and guessing (its namespace's, the default) could put it
    /// in a pool it is not meant for. The runtime retries the ADD.
    #[error(
        "pod {pod} is not in the agent's view of the Kubernetes API yet, so its pool is unknown; \
         try again (a pod kubelet runs appears within seconds; if it stays unknown, check the \
         agent's connection to the API)"
    )]
    PodNotSeen {
        /// `ns/name`.
        pod: String,
    },
}

/// Where a pick came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PickedBy {
    /// The pod's annotation.
    Pod,
    /// The namespace's annotation.
    Namespace,
    /// Neither has one: the default pool.
    Default,
}

/// The pool a pod's endpoint gets.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolPick {
    /// The pool; `None`: the default pool.
    pub pool: Option<String>,
    /// Why.
    pub by: PickedBy,
}

/// The pool for `pod` (its annotations, `None` when the API has not
/// shown the pod) in namespace `namespace` (its annotations, `None` when
/// unknown): the pod's annotation, else the namespace's, else the default.
/// A pod not shown is never given a pool: its own annotation, unseen,
/// might name another.
///
/// # Errors
/// [`PodsError::BadAnnotation`] for the annotation that decides, when it
/// cannot name a pool; [`PodsError::PodNotSeen`] when `pod_annotations`
/// is `None`.
pub fn pick_pool(
    pod: &PodRef,
    pod_annotations: Option<&BTreeMap<String, String>>,
    namespace_annotations: Option<&BTreeMap<String, String>>,
) -> Result<PoolPick, PodsError> {
    if pod_annotations.is_none() {
        return Err(PodsError::PodNotSeen {
            pod: pod.to_string(),
        });
    }
    let candidates = [
        (pod_annotations, PickedBy::Pod, format!("pod {pod}")),
        (
            namespace_annotations,
            PickedBy::Namespace,
            format!("namespace {}", pod.namespace),
        ),
    ];
    for (annotations, by, object) in candidates {
        if let Some(value) = annotations.and_then(|a| a.get(POOL_ANNOTATION)) {
            return crate::pool::check_name(value)
                .map(|()| PoolPick {
                    pool: Some(value.clone()),
                    by,
                })
                .map_err(|e| PodsError::BadAnnotation {
                    object,
                    value: value.clone(),
                    reason: e.to_string(),
                });
        }
    }
    Ok(PoolPick {
        pool: None,
        by: PickedBy::Default,
    })
}

/// The annotation a static pod's mirror pod carries: the static pod's own
/// UID (its config hash), which is what kubelet passes the CNI plugin.
pub const MIRROR_ANNOTATION: &str = "kubernetes.io/config.mirror";

/// Whether the API shows `wanted` running: a pod of its namespace and name
/// exists, with its UID when both sides know one, and has not finished.
/// A static pod (kubelet runs it from a file) is shown by its mirror pod,
/// whose UID is the API's own: it is matched by the static pod's UID in
/// [`MIRROR_ANNOTATION`], never judged gone (#44 item 6).
pub fn pod_alive(wanted: &PodRef, seen: Option<&PodFacts>) -> bool {
    let Some(seen) = seen else {
        return false;
    };
    let same = match (&wanted.uid, &seen.uid) {
        (Some(a), Some(b)) => {
            a == b
                || seen
                    .annotations
                    .get(MIRROR_ANNOTATION)
                    .is_some_and(|m| m == a)
        }
        _ => true,
    };
    same && !seen.finished
}

/// An endpoint allocation whose pod is gone.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Leak {
    /// The attachment's record key.
    pub key: String,
    /// The pod it was made for.
    pub pod: PodRef,
    /// Since when (ms, the caller's clock) the pod has been seen gone.
    pub gone_since_ms: u64,
}

/// Remembers since when each endpoint's pod has been gone, across checks.
#[derive(Clone, Debug, Default)]
pub struct LeakTracker {
    gone_since: BTreeMap<String, u64>,
}

impl LeakTracker {
    /// One check at `now_ms`: `endpoints` are this node's endpoint
    /// attachments (record key, the pod it was made for), `alive` says
    /// whether the API shows a pod running. Returns the attachments whose
    /// pod has been gone for at least `grace_ms`, by key. Only call it with
    /// a complete view of the node's pods (the cache listed once): an empty
    /// cache would make every pod look gone.
    pub fn check<'a>(
        &mut self,
        now_ms: u64,
        grace_ms: u64,
        endpoints: impl IntoIterator<Item = (&'a str, &'a PodRef)>,
        mut alive: impl FnMut(&PodRef) -> bool,
    ) -> Vec<Leak> {
        let mut seen = BTreeSet::new();
        let mut leaks = Vec::new();
        for (key, pod) in endpoints {
            seen.insert(key.to_owned());
            if alive(pod) {
                self.gone_since.remove(key);
                continue;
            }
            let since = *self.gone_since.entry(key.to_owned()).or_insert(now_ms);
            if now_ms.saturating_sub(since) >= grace_ms {
                leaks.push(Leak {
                    key: key.to_owned(),
                    pod: pod.clone(),
                    gone_since_ms: since,
                });
            }
        }
        self.gone_since.retain(|k, _| seen.contains(k));
        leaks
    }
}

#[cfg(test)]
mod tests;
