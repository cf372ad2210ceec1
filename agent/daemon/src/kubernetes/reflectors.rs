//! The reflectors the Kubernetes door keeps: how a watch of one kind is
//! driven into an in-memory store that wakes its reader, and the one
//! Services cache every Service reader shares.
//!
//! It exists apart from the loops that read those stores (`sync`,
//! `local_traffic`, `candidacy`, `pods`, ...) so they all stand on it and
//! none imports another to keep a store.

use std::sync::Arc;

use futures::TryStreamExt;
use k8s_openapi::api::core::v1::Service;
use kube::runtime::reflector::{self, Store, reflector};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, Resource};
use tokio::sync::Notify;

/// The Services in memory: one reflector, shared by the LB loop and the
/// `externalTrafficPolicy: Local` elections (`local_traffic`), so an
/// agent caches them once.
pub struct ServiceCache {
    /// The store, and when it listed.
    pub services: Services,
    /// Rung on every event, for the LB loop.
    pub(super) wake: Arc<Notify>,
    /// The forwarding task (it owns the reflector).
    pub(super) task: tokio::task::JoinHandle<()>,
}

/// A reader of the [`ServiceCache`]. Cloning shares it.
#[derive(Clone)]
pub struct Services {
    /// The reflector's store.
    pub store: Store<Service>,
    ready: tokio::sync::watch::Receiver<bool>,
    /// Counts the reflector's events: a reader other than the LB loop
    /// (which has the cache's `Notify`) learns of a change here.
    pub changes: tokio::sync::watch::Receiver<u64>,
}

impl Services {
    /// Waits until the reflector listed. Any number of readers may wait:
    /// the store's own `wait_until_ready` wakes only the last task that
    /// polled it, so one task waits there and tells the rest.
    pub async fn listed(&mut self) {
        let _ = self.ready.wait_for(|r| *r).await;
    }
}

impl ServiceCache {
    /// Starts the reflector.
    #[must_use]
    pub fn start(client: &Client) -> Self {
        let wake = Arc::new(Notify::new());
        let event = Arc::new(Notify::new());
        let (store, reflector) = drive(Api::<Service>::all(client.clone()), event.clone());
        let (tx, ready) = tokio::sync::watch::channel(false);
        let (count, changes) = tokio::sync::watch::channel(0u64);
        let waiter = store.clone();
        let loop_wake = wake.clone();
        // Each event wakes the LB loop and counts for the other readers.
        let task = tokio::spawn(async move {
            tokio::spawn(async move {
                if waiter.wait_until_ready().await.is_ok() {
                    let _ = tx.send(true);
                }
            });
            let _reflector = AbortOnDrop(reflector);
            loop {
                event.notified().await;
                loop_wake.notify_one();
                count.send_modify(|n| *n += 1);
            }
        });
        Self {
            services: Services {
                store,
                ready,
                changes,
            },
            wake,
            task,
        }
    }
}

/// Aborts a task when dropped: the reflector of a forwarding task that is
/// itself aborted, or of a loop whose agent is no longer the writer.
pub(super) struct AbortOnDrop(pub(super) tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// What a reflector can keep: the bounds kube-runtime's watcher and store
/// need, named once.
pub(super) trait Watched:
    Resource<DynamicType = ()>
    + Clone
    + std::fmt::Debug
    + serde::de::DeserializeOwned
    + Send
    + Sync
    + 'static
{
}

impl<K> Watched for K where
    K: Resource<DynamicType = ()>
        + Clone
        + std::fmt::Debug
        + serde::de::DeserializeOwned
        + Send
        + Sync
        + 'static
{
}

/// Drives a reflector's stream, waking `wake` on every change.
pub(super) fn drive<K: Watched>(
    api: Api<K>,
    wake: Arc<Notify>,
) -> (Store<K>, tokio::task::JoinHandle<()>) {
    drive_with(api, watcher::Config::default(), wake)
}

/// [`drive`] with a watcher configuration (selectors).
pub(super) fn drive_with<K: Watched>(
    api: Api<K>,
    config: watcher::Config,
    wake: Arc<Notify>,
) -> (Store<K>, tokio::task::JoinHandle<()>) {
    let (reader, writer) = reflector::store();
    let what = K::plural(&()).to_string();
    let stream = reflector(writer, watcher(api, config))
        .default_backoff()
        .touched_objects();
    let task = tokio::spawn(async move {
        let mut stream = std::pin::pin!(stream);
        loop {
            match stream.try_next().await {
                Ok(Some(_)) => wake.notify_one(),
                Ok(None) => break,
                Err(e) => {
                    tracing::warn!(resource = %what, error = %crate::error_chain(&e), "kubernetes watch failed; retrying with backoff");
                }
            }
        }
    });
    (reader, task)
}
