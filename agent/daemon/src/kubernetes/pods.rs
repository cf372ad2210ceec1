//! The pods on this node and every namespace, as the API shows them (#29
//! items 2 and 3), kept by two reflectors so a CNI ADD never waits on the
//! API server: it reads the cache, and waits (at most
//! `[kubernetes.pods] pool_wait`) only for a pod the cache has not shown
//! yet.
//!
//! Pods are watched with the field selector `spec.nodeName=<node>` (what
//! kubelet runs here, nothing else); namespaces whole (their annotations
//! pick pools). What the cache says is turned into the core's
//! [`PodFacts`]; the rules (which pool, which allocation leaked) are the
//! core's (`lockstep_core::pods`). [`PodView`] is the seam: the leak
//! loop's and the pool pick's unit tests run on an in-memory view.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::Client;
use kube::api::Api;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher;
use lockstep_core::pods::{PodFacts, PodRef, PodsError, PoolPick, pick_pool};
use tokio::sync::Notify;

use super::reflectors::drive_with;

/// The pods and namespaces as the door needs them.
pub trait PodView: Send + Sync + 'static {
    /// Whether both reflectors have listed once: before, a pod missing
    /// from the cache says nothing.
    fn listed(&self) -> bool;
    /// What the cache holds of `pod` (by namespace and name).
    fn pod(&self, pod: &PodRef) -> Option<PodFacts>;
    /// The annotations of namespace `name`, when the cache holds it.
    fn namespace(&self, name: &str) -> Option<BTreeMap<String, String>>;
}

/// The reflectors' caches.
pub struct Informer {
    pods: Store<Pod>,
    namespaces: Store<Namespace>,
    listed: Arc<AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for Informer {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl Informer {
    /// Starts watching the pods of `node` and every namespace.
    pub fn start(client: &Client, node: &str) -> Self {
        let wake = Arc::new(Notify::new());
        let pods_config = watcher::Config::default().fields(&format!("spec.nodeName={node}"));
        let (pods, pods_task) =
            drive_with(Api::<Pod>::all(client.clone()), pods_config, wake.clone());
        let (namespaces, ns_task) = drive_with(
            Api::<Namespace>::all(client.clone()),
            watcher::Config::default(),
            wake,
        );
        let listed = Arc::new(AtomicBool::new(false));
        let (p, n, flag) = (pods.clone(), namespaces.clone(), listed.clone());
        let ready = tokio::spawn(async move {
            if p.wait_until_ready().await.is_ok() && n.wait_until_ready().await.is_ok() {
                flag.store(true, Ordering::Release);
                tracing::info!(
                    pods = p.len(),
                    namespaces = n.len(),
                    "kubernetes: pods of this node listed"
                );
            }
        });
        Self {
            pods,
            namespaces,
            listed,
            tasks: vec![pods_task, ns_task, ready],
        }
    }
}

/// The core's facts of a pod object.
pub fn pod_facts(pod: &Pod) -> PodFacts {
    PodFacts {
        uid: pod.metadata.uid.clone(),
        annotations: pod.metadata.annotations.clone().unwrap_or_default(),
        finished: pod
            .status
            .as_ref()
            .and_then(|s| s.phase.as_deref())
            .is_some_and(|p| p == "Succeeded" || p == "Failed"),
    }
}

impl PodView for Informer {
    fn listed(&self) -> bool {
        self.listed.load(Ordering::Acquire)
    }

    fn pod(&self, pod: &PodRef) -> Option<PodFacts> {
        let key = ObjectRef::<Pod>::new(&pod.name).within(&pod.namespace);
        self.pods.get(&key).map(|p| pod_facts(&p))
    }

    fn namespace(&self, name: &str) -> Option<BTreeMap<String, String>> {
        self.namespaces
            .get(&ObjectRef::new(name))
            .map(|n| n.metadata.annotations.clone().unwrap_or_default())
    }
}

/// How often a pick looks at the cache again while it waits for a pod.
const PICK_POLL: Duration = Duration::from_millis(20);

/// The pool for `pod`'s endpoint: the core's rule on what the cache holds,
/// waiting at most `wait` for a pod the cache has not shown.
///
/// # Errors
/// [`PodsError::BadAnnotation`]: the annotation that decides cannot name a
/// pool; [`PodsError::PodNotSeen`]: the pod did not appear within `wait`
/// (logged; the ADD fails with "try again", never with a guessed pool).
pub async fn pick<V: PodView + ?Sized>(
    view: &V,
    pod: &PodRef,
    wait: Duration,
) -> Result<PoolPick, PodsError> {
    let deadline = tokio::time::Instant::now() + wait;
    let facts = loop {
        if let Some(f) = view.pod(pod) {
            break Some(f);
        }
        if tokio::time::Instant::now() >= deadline {
            tracing::warn!(
                pod = %pod,
                waited = ?wait,
                listed = view.listed(),
                "kubernetes: pod not in the cache; the ADD is refused with try again"
            );
            break None;
        }
        tokio::time::sleep(PICK_POLL).await;
    };
    let namespace = view.namespace(&pod.namespace);
    pick_pool(
        pod,
        facts.as_ref().map(|f| &f.annotations),
        namespace.as_ref(),
    )
}
