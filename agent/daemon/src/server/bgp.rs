//! `[bgp]`'s tasks, as the server starts them: the speaker
//! (`bgp::speaker`) and, under Kubernetes, the follower of the `BGPPeer`
//! objects and this Node (`kubernetes::bgp_peers`) and the writer of this
//! node's `BGPNodeState` (`kubernetes::bgp_status`). Apart from the
//! server so its start-up stays readable.

use std::sync::Arc;

use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::kube::{BgpDecided, KubeStart};
use super::supervisor::Supervisor;
use crate::agent::AgentHandle;
use crate::api::AppState;
use crate::config::Config;
use crate::kubernetes::bgp_peers::Peers;

/// What `[bgp]` under Kubernetes reads beyond the config.
pub(super) struct Kube {
    client: kube::Client,
    peers: Peers,
}

/// Under Kubernetes with `[bgp]`: starts following the `BGPPeer` objects
/// and this Node; the task is the server's to watch.
pub(super) fn follow_peers(
    kube: Option<&KubeStart>,
    config: &Config,
    stop: &watch::Receiver<bool>,
) -> (Option<Kube>, Option<JoinHandle<()>>) {
    let (Some(k), Some(bgp)) = (kube, &config.bgp) else {
        return (None, None);
    };
    // Checked at start; the router ID does not matter here.
    let config_peers = bgp
        .spec_with(std::net::Ipv4Addr::LOCALHOST)
        .map(|s| s.peers)
        .unwrap_or_default();
    let (peers, task) =
        crate::kubernetes::bgp_peers::follow(k.client.clone(), &k.node, config_peers, stop.clone());
    (
        Some(Kube {
            client: k.client.clone(),
            peers,
        }),
        Some(task),
    )
}

/// With `[bgp]`: the speaker, kept by `tasks`, announcing what `decided`
/// says under Kubernetes (else the agent's view), and under Kubernetes
/// the writer of this node's `BGPNodeState`.
pub(super) fn start(
    config: &Config,
    state: &AppState,
    slot: &AgentHandle,
    decided: Option<BgpDecided>,
    kube: Option<Kube>,
    tasks: &mut Supervisor,
    stop: &watch::Receiver<bool>,
) {
    let Some(bgp) = config.bgp.clone() else {
        return;
    };
    let (tx, rx) = watch::channel(crate::wire::BgpStatus::default());
    let _ = state.bgp.set(rx.clone());
    state.metrics.set_bgp(rx.clone());
    let decided = match (&config.kubernetes, decided) {
        // Cluster mode without Kubernetes: the addresses the assigner
        // stored in etcd, from every node their pool admits
        // (`bgp::stored`).
        (None, _) if config.cluster.is_some() => Some(stored(config, state, &bgp, tasks, stop)),
        (None, _) => None,
        (Some(_), Some(decided)) => Some(decided),
        // No loop decides (no LB writer election, logged): no
        // LoadBalancer address is announced, the pod blocks are.
        (Some(_), None) => Some(watch::channel(Some(Arc::default())).1),
    };
    let node = config.node_name();
    if let Some(k) = &kube {
        let (c, node, rx, stop) = (k.client.clone(), node.clone(), rx, stop.clone());
        tasks.keep("bgp node state", move || {
            crate::kubernetes::bgp_status::spawn(c.clone(), node.clone(), rx.clone(), stop.clone())
        });
    }
    let cluster = match (&config.cluster, state.cluster.get()) {
        (Some(c), Some(handle)) => Some(crate::bgp::speaker::ClusterBlocks {
            handle: handle.clone(),
            reclaim_after: c.reclaim_after,
        }),
        _ => None,
    };
    let source = crate::bgp::speaker::Source {
        agent: slot.clone(),
        decided,
        peers: kube.map(|k| k.peers),
        cluster,
    };
    let stop = stop.clone();
    tasks.keep("bgp speaker", move || {
        crate::bgp::speaker::spawn(
            bgp.clone(),
            node.clone(),
            source.clone(),
            tx.clone(),
            stop.clone(),
        )
    });
}

/// Cluster mode without Kubernetes: starts deciding what this node
/// announces of the stored LoadBalancer addresses, kept by `tasks`.
/// Announces none when the LB agent does not run.
fn stored(
    config: &Config,
    state: &AppState,
    bgp: &crate::config::BgpConfig,
    tasks: &mut Supervisor,
    stop: &watch::Receiver<bool>,
) -> BgpDecided {
    let (Some(c), Some(handle), Ok(attrs)) = (&config.cluster, state.lb_cluster.get(), bgp.attrs())
    else {
        return watch::channel(Some(Arc::default())).1;
    };
    let stored = crate::bgp::stored::Stored {
        handle: handle.clone(),
        node: c.node_name.clone().unwrap_or_else(|| config.node_name()),
        labels: c.node_labels.clone(),
        attrs,
    };
    let (tx, rx) = watch::channel(None);
    let stop = stop.clone();
    tasks.keep("bgp stored lb addresses", move || {
        crate::bgp::stored::spawn(stored.clone(), tx.clone(), stop.clone())
    });
    rx
}
