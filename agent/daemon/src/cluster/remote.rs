//! Cluster mode's remote state: every other node's blocks as IPCACHE
//! entries and kernel routes, and the skip-masquerade cluster CIDRs as
//! MASQ_SKIP entries, kept in step with etcd.
//!
//! The task follows pools, blocks and nodes in the agent's mirror
//! ([`super::Mirror`], kept by one etcd watch, read again in full after a
//! compaction or a rollback) one changed key at a time: each step applies
//! the keys changed since the last one to a [`RemoteIndex`], which
//! recomputes only the prefixes they touch, and programs only the routes
//! that changed. A full read happens at start, after a full read of the
//! mirror, and when more changed than the mirror remembers. While the mirror is not live (etcd
//! unreachable) the last state stays programmed. The decisions (what
//! should exist, what differs) are the core's
//! ([`lockstep_core::cluster::remote`]). Routes are programmed only for a
//! node with a datapath (an agent in the slot).
//!
//! Routes are this task's: `block via node_ip proto 213`
//! ([`LOCKSTEP_ROUTE_PROTOCOL`]) in the agent's network namespace,
//! changed per changed block, and listed and repaired after every full
//! read and every `interval`; routes of any other
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
use std::sync::{Arc, RwLock};
use std::time::Duration;

use ipnet::IpNet;
use lockstep_core::cluster::remote::{NodeDirectory, RemoteState, diff};
use lockstep_core::cluster::remote_index::{NodeKey, RemoteIndex, RouteChange};
use lockstep_core::cluster::routing::Routing;

use super::door::ChangedKey;
use super::mirror::{Changes, Cursor};
use super::{ClusterStoreError, Door, DoorOptions, Link, Stamp};
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

/// A read-only handle on the current desired remote state: unknown
/// until the task has read etcd once since the agent started. Until then
/// the node keeps the remote entries and routes it has
/// (`RemoteState::carried_over`): a restart, above all one while etcd
/// cannot be reached, withdraws nothing.
#[derive(Clone, Debug, Default)]
pub struct RemoteView(Arc<RwLock<Option<Arc<RemoteState>>>>);

impl RemoteView {
    /// The current desired remote state (empty before the first read:
    /// see [`RemoteView::is_read`]).
    pub fn snapshot(&self) -> Arc<RemoteState> {
        self.0
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
            .unwrap_or_default()
    }

    /// Whether etcd has been read since the agent started: before, the
    /// snapshot says nothing and what the node has stays.
    pub fn is_read(&self) -> bool {
        self.0
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .is_some()
    }

    /// How lockstep's routes in the calling thread's namespace differ from
    /// the snapshot, one line each (for `verify`). Blocking.
    ///
    /// # Errors
    /// The routes could not be listed.
    pub fn route_drift(&self) -> Result<Vec<String>, NetlinkError> {
        // Before the first read the routes the node has are the ones kept.
        if !self.is_read() {
            return Ok(Vec::new());
        }
        let want: BTreeMap<IpNet, IpAddr> = self
            .snapshot()
            .routes
            .iter()
            .map(|(k, v)| (*k, *v))
            .collect();
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

    /// Makes `state` (changed, or the first read) the desired one.
    fn set(&self, state: RemoteState) {
        *self
            .0
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(Arc::new(state));
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
    let change = |dst: IpNet, now: Option<IpAddr>| RouteChange {
        dst,
        was: observed.get(&dst).copied(),
        now,
    };
    let changes: Vec<RouteChange> = d
        .removes
        .iter()
        .map(|dst| change(*dst, None))
        .chain(d.adds.iter().map(|(dst, via)| change(*dst, Some(*via))))
        .chain(d.changes.iter().map(|(dst, via)| change(*dst, Some(*via))))
        .collect();
    Ok(apply_with(&nl, &changes))
}

/// Makes the kernel's routes follow `changes` (the index's, since the
/// last pass): a route added where lockstep had none, replaced where it
/// had one, deleted where it has none now. Blocking. A change the kernel
/// refuses is counted and logged; the periodic [`sync_routes`] repairs it.
///
/// # Errors
/// The route socket could not be opened.
pub fn apply_route_changes(changes: &[RouteChange]) -> Result<RouteSync, NetlinkError> {
    Ok(apply_with(&Netlink::current()?, changes))
}

/// [`apply_route_changes`] through `nl`.
fn apply_with(nl: &Netlink, changes: &[RouteChange]) -> RouteSync {
    let p = LOCKSTEP_ROUTE_PROTOCOL;
    let mut out = RouteSync::default();
    for c in changes {
        let (r, n) = match (c.was, c.now) {
            (None, Some(via)) => (nl.add_route_via(c.dst, via, p, false), &mut out.added),
            (Some(_), Some(via)) => (nl.add_route_via(c.dst, via, p, true), &mut out.changed),
            (Some(was), None) => (nl.delete_route_via(c.dst, was, p), &mut out.removed),
            (None, None) => continue,
        };
        match r {
            Ok(()) => *n += 1,
            Err(e) => {
                tracing::error!(error = %crate::error_chain(&e), "remote route not applied");
                out.failed += 1;
            }
        }
    }
    out
}

/// The remote-state task of node `me`.
#[derive(Debug)]
pub struct RemoteTask {
    me: String,
    opts: DoorOptions,
    interval: Duration,
    /// The least time between two steps (`[cluster] remote_settle`).
    settle: Duration,
    view: RemoteView,
    /// The remote state, kept per changed key.
    index: RemoteIndex,
    /// How far the index has followed the mirror (`None`: read
    /// everything next).
    cursor: Option<Cursor>,
    /// Whether the next route pass lists and repairs every route (after a
    /// full read) rather than applying the index's changes.
    full_route_pass: bool,
    /// Whether the maps were last brought to the view's state (by a
    /// reconcile or a followed change): only then does the next change
    /// write just its own entries; otherwise the maps are reconciled
    /// whole.
    maps_follow: bool,
    /// The agent's connection and mirror.
    link: Link,
}

/// The areas the remote state is made of.
const AREAS: [&str; 4] = ["pools/", "blocks/", "nodes/", "node_addrs/"];

/// Resolves once `stop` is true (no guard held: the task stays `Send`).
async fn stopped(stop: &mut tokio::sync::watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

/// Bound on each etcd request (as the node task's).
const REQUEST_TIMEOUT: Duration = Duration::from_millis(600);

impl RemoteTask {
    /// A task for node `me` following `link`'s mirror (reaching etcd with
    /// `opts` when it is not live), repairing routes every `interval`.
    pub fn new(me: String, mut opts: DoorOptions, interval: Duration, link: Link) -> Self {
        opts.link = Some(link.clone());
        RemoteTask {
            index: RemoteIndex::new(&me, Routing::native()),
            me,
            opts,
            interval,
            settle: Duration::ZERO,
            view: RemoteView::default(),
            cursor: None,
            full_route_pass: true,
            maps_follow: false,
            link,
        }
    }

    /// Decides each block's path with `routing` (the agent's: the mode and
    /// this node's underlay prefixes) instead of native routing.
    pub fn with_routing(mut self, routing: Routing) -> Self {
        self.index = RemoteIndex::new(&self.me, routing);
        self.cursor = None;
        self
    }

    /// Steps at most once per `settle`: the first change after a quiet
    /// spell is applied at once, the rest of a burst together when
    /// `settle` has passed (a cluster of thousands starting, or a zone
    /// coming back, is then taken in a few steps rather than one per key).
    pub fn with_settle(mut self, settle: Duration) -> Self {
        self.settle = settle;
        self
    }

    /// The task of the agent configured by `config` (its `[cluster]`
    /// section: etcd, prefix, TLS, node name), or `None` outside cluster
    /// mode (or without the agent's `link`).
    pub fn from_config(
        config: &crate::config::Config,
        interval: Duration,
        link: Option<Link>,
    ) -> Option<Self> {
        let c = config.cluster.as_ref()?;
        let me = c.node_name.clone().unwrap_or_else(|| config.node_name());
        let opts = DoorOptions::from_cluster_config(c, REQUEST_TIMEOUT);
        Some(Self::new(me, opts, interval, link?).with_settle(c.remote_settle))
    }

    /// The handle the agent's desired state reads.
    pub fn view(&self) -> RemoteView {
        self.view.clone()
    }

    /// Reads the pools, blocks and nodes whole (from the mirror while it
    /// is live) into the index, which changes only where they differ.
    async fn read_all(&mut self, door: &mut Door) -> Result<(), ClusterStoreError> {
        let (pools, _, _) = door.pools().await?;
        let (blocks, _) = door.blocks().await?;
        let nodes = door.nodes().await?;
        let routing = door.routing_keys().await?;
        let blocks = blocks
            .iter()
            .map(|b| ((b.pool.clone(), b.cidr), b.node.clone()))
            .collect();
        let directory = NodeDirectory {
            live: nodes
                .iter()
                .map(|n| (n.record.name.clone(), n.record.ips.clone()))
                .collect(),
            routing: routing
                .iter()
                .map(|(r, _)| (r.name.clone(), r.ips.clone()))
                .collect(),
        };
        self.index.replace_all(blocks, &directory, &pools);
        Ok(())
    }

    /// Applies the keys the mirror says changed; the pools (few, and an
    /// operator's) are read whole when one of them changed.
    async fn read_changed(
        &mut self,
        door: &mut Door,
        keys: Vec<(String, Option<Arc<super::Kv>>)>,
    ) -> Result<(), ClusterStoreError> {
        let mut pools = false;
        for (key, now) in keys {
            match door.read_changed(&key, now.as_deref()) {
                ChangedKey::Block { at, now } => self.index.set_block(at, now.map(|b| b.node)),
                ChangedKey::Node { name, now } => {
                    self.index
                        .set_node(NodeKey::Live, &name, now.map(|r| r.ips));
                }
                ChangedKey::Routing { name, now } => {
                    self.index
                        .set_node(NodeKey::Routing, &name, now.map(|r| r.ips));
                }
                ChangedKey::Pool => pools = true,
                ChangedKey::Reserved { .. } | ChangedKey::Other => {}
            }
        }
        if pools {
            let (pools, _, _) = door.pools().await?;
            self.index.set_pools(&pools);
        }
        Ok(())
    }

    /// Publishes the index's state when it changed, logging what became
    /// unroutable, and brings the maps and routes along. With an agent,
    /// the new state becomes the view, the maps follow and the changed
    /// routes are applied in one job on the agent: nothing it answers
    /// meanwhile (`verify`) sees the view without the datapath that
    /// follows it. The maps follow by the changed entries alone when they
    /// were last brought to the view's state, else by a whole reconcile.
    async fn publish(&mut self, slot: &super::node::AgentSlot) {
        let changed = self.index.take_changed() || !self.view.is_read();
        let state = changed.then(|| {
            let state = self.index.state().clone();
            // Said once, when a block becomes unroutable: every node's
            // every step repeating all of them was, at a thousand nodes, a
            // log line per node per gone block per change.
            let before = self.view.snapshot();
            for u in state
                .unroutable
                .iter()
                .filter(|u| !before.unroutable.contains(u))
            {
                tracing::warn!(reason = %u, "a remote block is not routed");
            }
            state
        });
        let changes = self.index.take_route_changes();
        let full = std::mem::take(&mut self.full_route_pass);
        let ran = if super::node::no_agent(slot) {
            None
        } else {
            let (view, job_state) = (self.view.clone(), state.clone());
            // A full pass lists every route after the job instead.
            let job_changes = if full { Vec::new() } else { changes };
            let follow = self.maps_follow && self.view.is_read();
            super::node::on_agent(slot, move |a| {
                let reconciled = job_state.map(|s| {
                    let old = view.snapshot();
                    view.set(s);
                    let new = view.snapshot();
                    match follow.then(|| a.follow_remote(&old, &new)) {
                        Some(Ok(())) => Ok(()),
                        Some(Err(e)) => {
                            tracing::warn!(error = %e, "writing a remote change failed; reconciling whole");
                            a.reconcile()
                        }
                        None => a.reconcile(),
                    }
                });
                let routes = (!job_changes.is_empty()).then(|| apply_route_changes(&job_changes));
                (reconciled, routes)
            })
            .await
        };
        let Some((reconciled, routes)) = ran else {
            // No datapath now: once there is one, its routes are listed
            // whole (the changes since are not kept).
            if let Some(s) = state {
                self.view.set(s);
                self.maps_follow = false;
            }
            self.full_route_pass = true;
            return;
        };
        match reconciled {
            Some(Err(e)) => {
                self.maps_follow = false;
                tracing::error!(error = %e, "reconcile after a remote change failed");
            }
            Some(Ok(())) => self.maps_follow = true,
            None => {}
        }
        if let Some(r) = routes {
            log_route_pass(Ok(r));
        }
        if full {
            self.routes(slot).await;
        }
    }

    /// Makes the kernel's routes the snapshot's, on a node with a
    /// datapath (an agent in `slot`), once etcd has been read: before,
    /// the routes the node has stay as they are. Lists every route: the
    /// periodic repair, and the pass after a full read.
    async fn routes(&self, slot: &super::node::AgentSlot) {
        if !self.view.is_read() {
            return;
        }
        if super::node::no_agent(slot) {
            return;
        }
        let routes: BTreeMap<IpNet, IpAddr> = self
            .view
            .snapshot()
            .routes
            .iter()
            .map(|(k, v)| (*k, *v))
            .collect();
        log_route_pass(tokio::task::spawn_blocking(move || sync_routes(&routes)).await);
    }

    /// Runs until `stop`: reads the mirror whenever what the remote state
    /// is made of changed there, keeps the view and the routes.
    pub fn spawn(
        mut self,
        slot: super::node::AgentSlot,
        mut stop: tokio::sync::watch::Receiver<bool>,
    ) -> tokio::task::JoinHandle<()> {
        tokio::spawn(async move {
            let mut door: Option<Door> = None;
            let mut bell = self.link.mirror().subscribe();
            let mut applied: Option<Stamp> = None;
            let mut tick = tokio::time::interval(self.interval);
            // When the last step began: the next waits until `settle`
            // has passed since.
            let mut stepped: Option<tokio::time::Instant> = None;
            loop {
                let mut failed = false;
                let stamp = self.link.mirror().stamp(&AREAS);
                let due = stamp.live && applied != Some(stamp);
                let next = stepped.map(|t| t + self.settle);
                if due && next.is_none_or(|t| t <= tokio::time::Instant::now()) {
                    stepped = Some(tokio::time::Instant::now());
                    match self.step(&mut door).await {
                        Ok(true) => {
                            applied = Some(stamp);
                            self.publish(&slot).await;
                            continue;
                        }
                        // The mirror stopped following etcd meanwhile:
                        // its bell rings when it follows again.
                        Ok(false) => failed = true,
                        // Tried again on the next change or tick.
                        Err(e) => {
                            tracing::warn!(error = %crate::error_chain(&e), "remote state: etcd not read; the last state stays");
                            failed = true;
                        }
                    }
                }
                // A change that came too soon is applied when the settle
                // time is up (with whatever else came meanwhile).
                let settled = async {
                    match next {
                        Some(t) if due && !failed => tokio::time::sleep_until(t).await,
                        _ => std::future::pending().await,
                    }
                };
                tokio::select! {
                    r = bell.changed() => if r.is_err() { break },
                    () = settled => {}
                    _ = tick.tick() => self.routes(&slot).await,
                    _ = stopped(&mut stop) => break,
                }
            }
        })
    }

    /// Connects when needed and follows the mirror: the keys changed
    /// since the last step, or everything (the first step, after a full
    /// read of the mirror, or when too much changed meanwhile). Whether
    /// it read: not while the mirror is not live.
    async fn step(&mut self, door: &mut Option<Door>) -> Result<bool, RemoteError> {
        if door.is_none() {
            *door = Some(Door::connect(self.opts.clone()).await?);
        }
        let d = door.as_mut().expect("connected above");
        let Some((changes, cursor)) = d.changes(&AREAS, self.cursor) else {
            return Ok(false);
        };
        // Forgotten until the read succeeds: a failed read starts over.
        self.cursor = None;
        match changes {
            Changes::Everything => {
                self.read_all(d).await?;
                self.full_route_pass = true;
            }
            Changes::Keys(keys) => self.read_changed(d, keys).await?,
        }
        self.cursor = Some(cursor);
        Ok(true)
    }
}

/// Logs what a route pass did (nothing when it changed nothing).
fn log_route_pass(r: Result<Result<RouteSync, NetlinkError>, tokio::task::JoinError>) {
    match r {
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
