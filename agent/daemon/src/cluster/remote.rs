//! Cluster mode's remote state: every other node's blocks as IPCACHE
//! entries and kernel routes, and the skip-masquerade cluster CIDRs as
//! MASQ_SKIP entries, kept in step with etcd.
//!
//! The task reads pools, blocks and nodes once, then follows the door's
//! watch from one past the first read's revision (the changes between the
//! reads are replayed; each says what a key now holds, so replay is
//! harmless). A watch that breaks is resumed from its last revision; a
//! watch refused because etcd compacted that history means a full re-read,
//! and the difference is applied like any change. The decisions (what
//! should exist, what differs) are the core's
//! ([`lockstep_core::cluster::remote`]).
//!
//! Routes are this task's: `block via node_ip proto 213`
//! ([`LOCKSTEP_ROUTE_PROTOCOL`]) in the agent's network namespace, checked
//! and repaired on every change and every `interval`; routes of any other
//! protocol are never listed for change, so never touched. Map entries are
//! the agent's: [`RemoteView::snapshot`] is read by the agent's desired
//! state, so reconcile writes them and deletes the stale ones, and verify
//! reports their drift.
//!
//! Blocks belong to nodes, not leases: a block is routed while etcd says
//! a node holds it, to the address of the node's live key or, once its
//! lease ended (a node cut off from etcd only, still forwarding), of its
//! routing key (`node_addrs/<name>`, no lease). Its routes go with its
//! blocks (`cluster node remove`), not with its lease.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use ipnet::IpNet;
use lockstep_core::cluster::ClusterPoolSpec;
use lockstep_core::cluster::remote::{
    NodeDirectory, RemoteBlock, RemoteState, diff, remote_state_routed,
};
use lockstep_core::cluster::routing::Routing;

use super::{Change, ClusterStoreError, Door, DoorOptions, Watch};
use crate::agent::Agent;
use crate::netlink::{LOCKSTEP_ROUTE_PROTOCOL, Netlink, NetlinkError};

/// Errors of the remote-state task.
#[derive(Debug, thiserror::Error)]
pub enum RemoteError {
    /// etcd could not be read or watched.
    #[error(transparent)]
    Store(#[from] ClusterStoreError),
    /// The routes could not be listed.
    #[error(transparent)]
    Netlink(#[from] NetlinkError),
    /// A blocking step did not finish.
    #[error("the route update task failed: {0}")]
    Join(#[from] tokio::task::JoinError),
}

/// A read-only handle on the current desired remote state.
#[derive(Clone, Debug, Default)]
pub struct RemoteView(Arc<RwLock<Arc<RemoteState>>>);

impl RemoteView {
    /// The current desired remote state (empty before the first read).
    pub fn snapshot(&self) -> Arc<RemoteState> {
        self.0
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// How lockstep's routes in the calling thread's namespace differ from
    /// the snapshot, one line each (for `verify`). Blocking.
    ///
    /// # Errors
    /// The routes could not be listed.
    pub fn route_drift(&self) -> Result<Vec<String>, NetlinkError> {
        let want = self.snapshot().routes.clone();
        let have = Netlink::current()?.routes_of_protocol(LOCKSTEP_ROUTE_PROTOCOL)?;
        let d = diff(&want, &have);
        let p = LOCKSTEP_ROUTE_PROTOCOL;
        let mut out: Vec<String> = d
            .adds
            .iter()
            .map(|(dst, via)| format!("route {dst} via {via} proto {p} is missing"))
            .collect();
        out.extend(d.changes.iter().map(|(dst, via)| {
            format!(
                "route {dst} proto {p} goes via {}, want via {via}",
                have[dst]
            )
        }));
        out.extend(
            d.removes
                .iter()
                .map(|dst| format!("route {dst} via {} proto {p} is not expected", have[dst])),
        );
        Ok(out)
    }

    fn set(&self, state: RemoteState) -> bool {
        let mut cur = self
            .0
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if **cur == state {
            return false;
        }
        *cur = Arc::new(state);
        true
    }
}

/// What one route pass did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RouteSync {
    /// Routes added.
    pub added: usize,
    /// Routes whose next hop changed.
    pub changed: usize,
    /// Routes removed.
    pub removed: usize,
    /// Changes the kernel refused (logged one by one).
    pub failed: usize,
}

/// Makes lockstep's routes (protocol [`LOCKSTEP_ROUTE_PROTOCOL`]) in the
/// calling thread's namespace equal `desired`. Blocking.
///
/// # Errors
/// The routes could not be listed; a refused change is counted and logged.
pub fn sync_routes(desired: &BTreeMap<IpNet, IpAddr>) -> Result<RouteSync, NetlinkError> {
    let nl = Netlink::current()?;
    let observed = nl.routes_of_protocol(LOCKSTEP_ROUTE_PROTOCOL)?;
    let d = diff(desired, &observed);
    let mut out = RouteSync::default();
    let mut count = |r: Result<(), NetlinkError>, n: &mut usize| match r {
        Ok(()) => *n += 1,
        Err(e) => {
            tracing::error!(error = %crate::error_chain(&e), "remote route not applied");
            out.failed += 1;
        }
    };
    let (mut added, mut changed, mut removed) = (0, 0, 0);
    for dst in &d.removes {
        count(
            nl.delete_route_via(*dst, observed[dst], LOCKSTEP_ROUTE_PROTOCOL),
            &mut removed,
        );
    }
    for (dst, via) in &d.adds {
        count(
            nl.add_route_via(*dst, *via, LOCKSTEP_ROUTE_PROTOCOL, false),
            &mut added,
        );
    }
    for (dst, via) in &d.changes {
        count(
            nl.add_route_via(*dst, *via, LOCKSTEP_ROUTE_PROTOCOL, true),
            &mut changed,
        );
    }
    out.added = added;
    out.changed = changed;
    out.removed = removed;
    Ok(out)
}

/// The remote-state task of node `me`.
#[derive(Debug)]
pub struct RemoteTask {
    me: String,
    opts: DoorOptions,
    interval: Duration,
    view: RemoteView,
    pools: BTreeMap<String, ClusterPoolSpec>,
    blocks: BTreeMap<(String, IpNet), String>,
    /// Where each node is reached: live node keys and routing keys.
    nodes: NodeDirectory,
    /// The claim loop's handle, told when the watch sees etcd go back in
    /// time.
    claims: Option<Arc<super::ClusterHandle>>,
    /// How each remote block is reached (native, or through the tunnel).
    routing: Routing,
}

/// Resolves once `stop` is true (no guard held: the task stays `Send`).
async fn stopped(stop: &mut tokio::sync::watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

/// Bound on each etcd request (as the node task's).
const REQUEST_TIMEOUT: Duration = Duration::from_millis(600);

/// How long to wait before reading or watching again after etcd failed.
const RETRY: Duration = Duration::from_secs(1);

impl RemoteTask {
    /// A task for node `me` reaching etcd with `opts`, repairing routes
    /// every `interval`.
    pub fn new(me: String, opts: DoorOptions, interval: Duration) -> Self {
        RemoteTask {
            me,
            opts,
            interval,
            view: RemoteView::default(),
            pools: BTreeMap::new(),
            blocks: BTreeMap::new(),
            nodes: NodeDirectory::default(),
            claims: None,
            routing: Routing::native(),
        }
    }

    /// Decides each block's path with `routing` (the agent's: the mode and
    /// this node's underlay prefixes) instead of native routing.
    pub fn with_routing(mut self, routing: Routing) -> Self {
        self.routing = routing;
        self
    }

    /// Tells `claims` (the claim loop's handle) whenever the watch sees
    /// etcd go back in time (#26 item 3).
    pub fn tell_rollbacks_to(mut self, claims: Arc<super::ClusterHandle>) -> Self {
        self.claims = Some(claims);
        self
    }

    /// The task of the agent configured by `config` (its `[cluster]`
    /// section: etcd, prefix, TLS, node name), or `None` outside cluster
    /// mode.
    pub fn from_config(config: &crate::config::Config, interval: Duration) -> Option<Self> {
        let c = config.cluster.as_ref()?;
        let me = c.node_name.clone().unwrap_or_else(|| config.node_name());
        let opts = DoorOptions::from_cluster_config(c, REQUEST_TIMEOUT);
        Some(Self::new(me, opts, interval))
    }

    /// The handle the agent's desired state reads.
    pub fn view(&self) -> RemoteView {
        self.view.clone()
    }

    /// Reads everything; returns the revision to watch from.
    async fn read_all(&mut self, door: &mut Door) -> Result<i64, ClusterStoreError> {
        let (pools, _, revision) = door.pools().await?;
        let (blocks, _) = door.blocks().await?;
        let nodes = door.nodes().await?;
        let routing = door.node_addrs().await?;
        self.pools = pools.into_iter().map(|p| (p.name.clone(), p)).collect();
        self.blocks = blocks
            .into_iter()
            .map(|b| ((b.pool, b.cidr), b.node))
            .collect();
        self.nodes = NodeDirectory {
            live: nodes
                .into_iter()
                .map(|n| (n.record.name, n.record.ips))
                .collect(),
            routing: routing.into_iter().map(|r| (r.name, r.ips)).collect(),
        };
        Ok(revision + 1)
    }

    fn absorb(&mut self, changes: Vec<Change>) {
        for c in changes {
            match c {
                Change::Pool {
                    name,
                    spec: Some(s),
                } => {
                    self.pools.insert(name, s);
                }
                Change::Pool { name, spec: None } => {
                    self.pools.remove(&name);
                }
                Change::Block {
                    pool,
                    cidr,
                    node: Some(n),
                    ..
                } => {
                    self.blocks.insert((pool, cidr), n);
                }
                Change::Block {
                    pool,
                    cidr,
                    node: None,
                    ..
                } => {
                    self.blocks.remove(&(pool, cidr));
                }
                Change::Node {
                    name,
                    record: Some(r),
                } => {
                    self.nodes.live.insert(name, r.ips);
                }
                Change::Node { name, record: None } => {
                    self.nodes.live.remove(&name);
                }
                Change::NodeAddr {
                    name,
                    record: Some(r),
                } => {
                    self.nodes.routing.insert(name, r.ips);
                }
                Change::NodeAddr { name, record: None } => {
                    self.nodes.routing.remove(&name);
                }
            }
        }
    }

    fn desired(&self) -> RemoteState {
        let blocks: Vec<RemoteBlock> = self
            .blocks
            .iter()
            .map(|((_, cidr), node)| RemoteBlock {
                cidr: *cidr,
                node: node.clone(),
            })
            .collect();
        let pools: Vec<ClusterPoolSpec> = self.pools.values().cloned().collect();
        remote_state_routed(&self.me, &blocks, &self.nodes, &pools, &self.routing)
    }

    /// Publishes the desired state; when it changed, logs what cannot be
    /// routed and has the agent reconcile its maps at once.
    async fn publish(&self, slot: &Arc<Mutex<Option<Agent>>>) {
        let state = self.desired();
        for u in &state.unroutable {
            tracing::warn!(reason = %u, "a remote block is not routed");
        }
        if self.view.set(state) {
            let slot = slot.clone();
            let r = tokio::task::spawn_blocking(move || {
                let mut guard = slot.lock().unwrap_or_else(|p| p.into_inner());
                guard.as_mut().map(Agent::reconcile)
            })
            .await;
            if let Ok(Some(Err(e))) = r {
                tracing::error!(error = %crate::error_chain(&e), "reconcile after a remote change failed");
            }
        }
        self.routes().await;
    }

    async fn routes(&self) {
        let routes = self.view.snapshot().routes.clone();
        match tokio::task::spawn_blocking(move || sync_routes(&routes)).await {
            Ok(Ok(s)) if s != RouteSync::default() => {
                tracing::info!(
                    added = s.added,
                    changed = s.changed,
                    removed = s.removed,
                    failed = s.failed,
                    "remote routes updated"
                );
            }
            Ok(Ok(_)) => {}
            Ok(Err(e)) => {
                tracing::error!(error = %crate::error_chain(&e), "remote routes not listed")
            }
            Err(e) => tracing::error!(error = %e, "remote route task failed"),
        }
    }

    /// Runs until `stop`: follows etcd, keeps the view and the routes.
    pub fn spawn(
        mut self,
        slot: Arc<Mutex<Option<Agent>>>,
        mut stop: tokio::sync::watch::Receiver<bool>,
    ) -> tokio::task::JoinHandle<()> {
        tokio::spawn(async move {
            let mut door: Option<Door> = None;
            let mut watch: Option<Watch> = None;
            let mut from: Option<i64> = None;
            let mut tick = tokio::time::interval(self.interval);
            loop {
                if let Err(e) = self.step(&mut door, &mut watch, &mut from, &slot).await {
                    tracing::warn!(error = %crate::error_chain(&e), "remote state: etcd not followed; retrying");
                    tokio::select! {
                        _ = tokio::time::sleep(RETRY) => {}
                        _ = stopped(&mut stop) => break,
                    }
                    continue;
                }
                let w = watch.as_mut().expect("set by step");
                tokio::select! {
                    r = w.next() => match r {
                        Ok(changes) => {
                            from = Some(w.resume_from());
                            if !changes.is_empty() {
                                self.absorb(changes);
                                self.publish(&slot).await;
                            }
                        }
                        Err(ClusterStoreError::Compacted { compacted }) => {
                            tracing::info!(compacted, "remote state: etcd compacted the watched history; reading everything again");
                            watch = None;
                            from = None;
                        }
                        Err(e @ ClusterStoreError::RolledBack { seen, .. }) => {
                            tracing::warn!(error = %e, "remote state: etcd went back in time; reading everything again");
                            if let Some(claims) = &self.claims {
                                claims.etcd_went_back(seen);
                            }
                            watch = None;
                            from = None;
                        }
                        Err(e @ ClusterStoreError::Unavailable { .. }) => {
                            tracing::warn!(error = %crate::error_chain(&e), "remote state: watch broke; resuming");
                            from = Some(w.resume_from());
                            watch = None;
                        }
                        Err(e) => {
                            tracing::error!(error = %crate::error_chain(&e), "remote state: unreadable change; reading everything again");
                            watch = None;
                            from = None;
                        }
                    },
                    _ = tick.tick() => self.routes().await,
                    _ = stopped(&mut stop) => break,
                }
            }
        })
    }

    /// Connects, reads everything when there is no revision to resume from,
    /// and watches when there is no watch.
    async fn step(
        &mut self,
        door: &mut Option<Door>,
        watch: &mut Option<Watch>,
        from: &mut Option<i64>,
        slot: &Arc<Mutex<Option<Agent>>>,
    ) -> Result<(), RemoteError> {
        if watch.is_some() {
            return Ok(());
        }
        if door.is_none() {
            *door = Some(Door::connect(self.opts.clone()).await?);
        }
        let d = door.as_mut().expect("connected above");
        let start = match *from {
            Some(r) => r,
            None => {
                let r = self.read_all(d).await?;
                self.publish(slot).await;
                *from = Some(r);
                r
            }
        };
        *watch = Some(d.watch(start).await?);
        tracing::info!(from = start, "remote state: watching etcd");
        Ok(())
    }
}
