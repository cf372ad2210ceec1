//! The loop of a door part that only the elected writer runs (deleted
//! Nodes' removal, PodIPPools as the cluster pools): it keeps one kind in
//! memory and runs a pass over it, and keeps nothing while another agent
//! is the writer.
//!
//! Why apart from the passes: both parts are the same loop around a
//! different pass, and why a non-writer holds no watch (#47 item 4) is
//! said once, here.

use std::sync::Arc;
use std::time::Duration;

use kube::Api;
use kube::runtime::reflector::Store;
use tokio::sync::Notify;

use super::reflectors::{AbortOnDrop, Watched, drive};

/// One pass of a door part over the objects of one kind in memory.
pub(super) trait Pass<K: Watched>: Send {
    /// Runs once over `store`; errors are the pass's to log.
    fn pass(&mut self, store: &Store<K>) -> impl Future<Output = ()> + Send;

    /// Whether this agent is the elected writer now (`None`: unknown,
    /// etcd did not answer). Only the writer keeps the kind in memory.
    fn writer(&mut self) -> impl Future<Output = Option<bool>> + Send;
}

/// The loop of a door part that keeps one kind in memory and runs a pass
/// over it, only while this agent is the elected writer (#47 item 4: at
/// thousands of nodes, a watch of every Node on every agent is thousands
/// of copies of each Node change, for one agent that acts on them).
///
/// Not the writer: no reflector; whether it became the writer is asked
/// every `poll` (a read of the mirror, not of etcd). The writer: a
/// reflector on `api`; once it listed, `pass` runs at once, on every
/// change (after 10 ms, so a burst lands in one pass) and every `poll`,
/// until `stop`, or until the writer is another agent (the reflector is
/// dropped, its watch closed). An unknown answer changes nothing.
pub(super) async fn passes<K: Watched, P: Pass<K>>(
    api: Api<K>,
    poll: Duration,
    mut stop: tokio::sync::watch::Receiver<bool>,
    pass: &mut P,
) {
    let wake = Arc::new(Notify::new());
    let what = K::plural(&());
    loop {
        while pass.writer().await != Some(true) {
            tokio::select! {
                () = tokio::time::sleep(poll) => {}
                _ = stop.wait_for(|s| *s) => return,
            }
        }
        tracing::info!(resource = %what, "kubernetes: the elected writer; watching");
        let (store, task) = drive(api.clone(), wake.clone());
        let _task = AbortOnDrop(task);
        tokio::select! {
            _ = store.wait_until_ready() => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        loop {
            pass.pass(&store).await;
            let woke = tokio::select! {
                () = wake.notified() => Some(true),
                () = tokio::time::sleep(poll) => Some(false),
                _ = stop.wait_for(|s| *s) => None,
            };
            match woke {
                None => return,
                Some(true) => tokio::time::sleep(Duration::from_millis(10)).await,
                Some(false) => {}
            }
            if pass.writer().await == Some(false) {
                tracing::info!(resource = %what, "kubernetes: no longer the elected writer; watch closed");
                break;
            }
        }
    }
}
