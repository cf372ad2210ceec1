//! The Kubernetes side of the agent's start: leak detection, the cluster
//! writer's loops (pod pools, node removal) and LoadBalancer Services, with
//! the LB writer elected on a Lease when there is no etcd. It lives apart
//! from `server` so the start-up reads as the order things start in, and
//! this (the largest branch) reads on its own.

use std::sync::Arc;

use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::supervisor::Supervisor;
use crate::agent::AgentHandle;
use crate::announce::Announcements;
use crate::api::AppState;
use crate::config::Config;

/// What the Kubernetes door starts with, read before the agent starts.
pub(super) struct KubeStart {
    pub(super) client: kube::Client,
    pub(super) classes: crate::kubernetes::Classes,
    pub(super) node: String,
    pub(super) informer: Arc<crate::kubernetes::pods::Informer>,
    pub(super) pods: crate::config::PodsConfig,
    pub(super) pod_pools: bool,
    pub(super) remove_deleted_nodes: bool,
}

/// What this node announces over BGP, as `local_traffic` (or in cluster
/// mode `bgp_services`) decides it.
pub(super) type BgpDecided = watch::Receiver<Option<Arc<lockstep_core::bgp::announce::Decision>>>;

/// Starts the Kubernetes loops of `k`, each watched or kept by `tasks`;
/// returns the LoadBalancer Services sync, which the server watches, and
/// with `[bgp]` what this node announces (`None` when no loop decides it:
/// no LB writer election).
pub(super) fn start(
    k: KubeStart,
    state: &AppState,
    cluster_config: &Config,
    slot: &AgentHandle,
    announcements: &Announcements,
    tasks: &mut Supervisor,
    stop: watch::Receiver<bool>,
) -> (JoinHandle<()>, Option<BgpDecided>) {
    let KubeStart {
        client,
        classes,
        node,
        informer,
        pods,
        pod_pools,
        remove_deleted_nodes,
    } = k;
    // Endpoint allocations whose pod is gone (`kubernetes::leaks`).
    let report = Arc::new(crate::kubernetes::leaks::LeakReport::default());
    let _ = state.leaks.set(report.clone());
    state.metrics.set_leaks(report.clone());
    // Kept: each start lists anew; its report carries over.
    let door = super::kube_door::slot(slot);
    let (slot_leaks, api, stop_leaks) = (door.clone(), client.clone(), stop.clone());
    tasks.keep("pod leaks", move || {
        tokio::spawn(
            crate::kubernetes::leaks::LeakLoop::new(
                informer.clone(),
                crate::kubernetes::leaks::ApiPods(api.clone()),
                super::kube_door::AgentEndpoints(slot_leaks.clone()),
                pods.clone(),
                report.clone(),
            )
            .run(stop_leaks.clone()),
        )
    });
    // The elected LB assigner is the one writer into etcd for
    // what the API says of the cluster: PodIPPools as the cluster
    // pools (#29 item 1), deleted Nodes removed (#29 item 4).
    if let (Some(handle), Some(c)) = (state.lb_cluster.get(), &cluster_config.cluster) {
        let writer = || {
            crate::kubernetes::writer::ClusterWriter::new(
                crate::cluster::DoorOptions::from_cluster_config(
                    c,
                    crate::kubernetes::writer::REQUEST_TIMEOUT,
                ),
                handle.clone(),
                c.node_name
                    .clone()
                    .unwrap_or_else(|| cluster_config.node_name()),
            )
        };
        if pod_pools {
            let backend = crate::kubernetes::pod_pools::ClusterPools(writer());
            tasks.watch(
                "pod pools",
                tokio::spawn(
                    crate::kubernetes::pod_pools::PodPoolSync::new(client.clone(), backend)
                        .run(stop.clone()),
                ),
            );
        }
        if remove_deleted_nodes {
            let backend = crate::kubernetes::node_removal::ClusterNodes(writer());
            tasks.watch(
                "node removal",
                tokio::spawn(
                    crate::kubernetes::node_removal::NodeRemoval::new(
                        client.clone(),
                        backend,
                        crate::kubernetes::node_removal::ApiBound(client.clone()),
                    )
                    .run(stop.clone()),
                ),
            );
        }
    }
    match state.lb_cluster.get() {
        Some(handle) => {
            let lb_node = cluster_config
                .cluster
                .as_ref()
                .and_then(|c| c.node_name.clone())
                .unwrap_or_else(|| cluster_config.node_name());
            let backend = crate::kubernetes::ClusterLb::new(handle.clone(), lb_node, door.clone());
            // `[bgp]`: what this node announces, from the Services, their
            // endpoints and this Node, while its LB lease is live.
            let decided = cluster_config
                .bgp
                .as_ref()
                .and_then(|b| b.attrs().ok())
                .map(|pools| {
                    let (candidacy, labels, node_task) =
                        crate::kubernetes::candidacy::follow(client.clone(), &node, stop.clone());
                    tasks.watch("node labels", node_task);
                    let follow = crate::kubernetes::bgp_services::Follow {
                        candidacy,
                        labels,
                        lease: handle.clone(),
                    };
                    let (tx, rx) = watch::channel(None);
                    let services = crate::kubernetes::reflectors::ServiceCache::start(&client);
                    tasks.watch(
                        "bgp services",
                        crate::kubernetes::bgp_services::spawn(
                            client.clone(),
                            node.clone(),
                            pools,
                            services.services.clone(),
                            follow,
                            tx,
                            stop.clone(),
                        ),
                    );
                    (services, rx)
                });
            // The LB loop reads the same Services cache.
            let sync = crate::kubernetes::LbSync::new(client, classes, node, backend);
            let (sync, rx) = match decided {
                Some((services, rx)) => (sync.with_services(services), Some(rx)),
                None => (sync, None),
            };
            (tokio::spawn(sync.run(stop)), rx)
        }
        // Without etcd: one writer elected on a Lease (#44 item
        // 1); the others mirror it.
        None => {
            let election = cluster_config
                .kubernetes
                .as_ref()
                .map(|k| k.election.clone())
                .unwrap_or_default();
            match crate::kubernetes::election::Keeper::new(client.clone(), &election, &node) {
                Ok((keeper, elected)) => {
                    let backend =
                        crate::kubernetes::LocalLb::elected(door.clone(), elected.clone());
                    // This Node followed live: excluded, cordoned,
                    // NotReady or deleting nodes never write (#44
                    // item 4).
                    let (candidacy, labels, node_task) =
                        crate::kubernetes::candidacy::follow(client.clone(), &node, stop.clone());
                    // externalTrafficPolicy: Local Services are
                    // answered from a node with a ready endpoint,
                    // one Lease each (#44 item 3).
                    let cache = crate::kubernetes::reflectors::ServiceCache::start(&client);
                    let (local, answers) = crate::kubernetes::local_traffic::LocalTraffic::new(
                        client.clone(),
                        &election,
                        &node,
                    );
                    // `[bgp]`: what this node announces, decided from the
                    // same stores (checked with the config).
                    let pools = cluster_config.bgp.as_ref().and_then(|b| b.attrs().ok());
                    let (local, decided) = match pools {
                        Some(pools) => {
                            let (local, rx) = local.with_bgp(pools);
                            (local, Some(rx))
                        }
                        None => (local, None),
                    };
                    let (applied, applied_rx) = watch::channel(0);
                    let local = tokio::spawn(local.run(
                        cache.services.clone(),
                        candidacy.clone(),
                        labels,
                        applied_rx,
                        stop.clone(),
                    ));
                    // `[kubernetes.nodeipam] operator`: the writer
                    // offers every node CIDRs of the PodIPPools
                    // (#44 item 5).
                    let operator = cluster_config
                        .kubernetes
                        .as_ref()
                        .and_then(|k| k.nodeipam.as_ref())
                        .is_some_and(|n| n.operator)
                        .then(|| {
                            tokio::spawn(crate::kubernetes::nodeipam::operator::run(
                                client.clone(),
                                elected.leadership.clone(),
                                stop.clone(),
                            ))
                        });
                    let keeper = tokio::spawn(keeper.run(candidacy, stop.clone()));
                    let announcer = tokio::spawn(crate::kubernetes::announcer::run(
                        elected.leadership,
                        answers.clone(),
                        applied,
                        backend.changed(),
                        door.clone(),
                        announcements.clone(),
                        stop.clone(),
                    ));
                    let sync = crate::kubernetes::LbSync::new(client, classes, node, backend)
                        .with_services(cache)
                        .with_local(answers);
                    tasks.watch("local traffic", local);
                    tasks.watch("lb announcer", announcer);
                    tasks.watch("writer lease keeper", keeper);
                    tasks.watch("node labels", node_task);
                    if let Some(o) = operator {
                        tasks.watch("nodeipam operator", o);
                    }
                    (tokio::spawn(sync.run(stop)), decided)
                }
                Err(e) => {
                    // The config check refuses such an election.
                    tracing::error!(error = %crate::error_chain(&e), "kubernetes: no LB writer election; LoadBalancer Services are not served");
                    (tokio::spawn(async {}), None)
                }
            }
        }
    }
}
