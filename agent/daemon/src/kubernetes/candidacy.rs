//! Whether this node may be the LB writer (#44 item 4), followed live
//! from its Node object: excluded from load balancers, cordoned, not Ready
//! or being deleted, it never takes the Lease, and the writer that becomes
//! so steps aside (the core's `lb::kubernetes::nodes` and
//! `election::Elector::set_candidate`).
//!
//! Why its own watch: the Node's labels and conditions change while the
//! agent runs (a drain cordons it, an operator labels it); read once at
//! start they would not count until a restart. The labels are published
//! too: pools' node selectors are matched against them as they are now
//! (`local_traffic`, the core's `lb::kubernetes::seats`).

use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::api::core::v1::Node;
use kube::Client;
use kube::api::Api;
use kube::runtime::watcher;
use lockstep_core::lb::kubernetes::nodes::{NodeState, may_answer};
use tokio::sync::Notify;

use super::reflectors::drive_with;

/// What of `n` the rules read.
fn state(n: &Node) -> NodeState {
    NodeState {
        labels: n.metadata.labels.clone().unwrap_or_default(),
        unschedulable: n.spec.as_ref().and_then(|s| s.unschedulable) == Some(true),
        ready: n
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .and_then(|cs| cs.iter().find(|c| c.type_ == "Ready"))
            .map(|c| c.status.clone()),
        deleting: n.metadata.deletion_timestamp.is_some(),
    }
}

/// This Node's labels as last read (`None` before the first read).
pub type Labels = tokio::sync::watch::Receiver<Option<BTreeMap<String, String>>>;

/// Follows Node `node` until `stop`: `Ok` while it may be the writer,
/// else why not. Before its Node is read it may (the agent had read it at
/// start); a Node that is gone may not. And its labels.
pub fn follow(
    client: Client,
    node: &str,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> (
    tokio::sync::watch::Receiver<Result<(), String>>,
    Labels,
    tokio::task::JoinHandle<()>,
) {
    let (tx, rx) = tokio::sync::watch::channel(Ok(()));
    let (labels_tx, labels_rx) = tokio::sync::watch::channel(None);
    let wake = Arc::new(Notify::new());
    let config = watcher::Config::default().fields(&format!("metadata.name={node}"));
    let (store, reflector) = drive_with(Api::<Node>::all(client), config, wake.clone());
    let name = node.to_owned();
    let task = tokio::spawn(async move {
        loop {
            tokio::select! {
                () = wake.notified() => {}
                _ = stop.wait_for(|s| *s) => break,
            }
            let now = match store
                .state()
                .iter()
                .find(|n| n.metadata.name.as_deref() == Some(&name))
            {
                Some(n) => {
                    let st = state(n);
                    let now = may_answer(&st);
                    labels_tx.send_if_modified(|cur| {
                        let changed = cur.as_ref() != Some(&st.labels);
                        if changed {
                            *cur = Some(st.labels);
                        }
                        changed
                    });
                    now
                }
                None if store.is_empty() => Err("the Node is gone".into()),
                None => continue,
            };
            if *tx.borrow() != now {
                match &now {
                    Ok(()) => {
                        tracing::info!(node = %name, "kubernetes: this node may be the LB writer again")
                    }
                    Err(why) => {
                        tracing::info!(node = %name, %why, "kubernetes: this node may not be the LB writer")
                    }
                }
                let _ = tx.send_replace(now);
            }
        }
        reflector.abort();
    });
    (rx, labels_rx, task)
}
