//! The node's reservation window (#43; the decisions are the core's
//! `cluster::window`): published in etcd before the allocator hands out
//! any address of it, extended ahead of need, shed when the pods go.
//!
//! The order every step keeps, so that at any crash point etcd's window
//! covers every address the node may have handed out:
//! - **grow**: etcd first (a put compared on the key's revision, answered),
//!   then the local record (`cluster-window.json`), then the allocator;
//! - **shrink**: the allocator first, in one command on the agent's owner with the
//!   addresses in use read in the same hold (an ADD between the plan and
//!   the narrowing keeps its address in the window), then the local
//!   record, then etcd.
//!
//! A put whose answer never came is taken as not made (the allocator is
//! not widened): etcd then holds this window or the one before, both
//! covering what is handed out. After etcd went back in time (a restore
//! from a backup) the window in etcd is unknown: it is read and written
//! again at the next round, with the blocks the node claims back.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::net::IpAddr;
use std::time::{Duration, Instant};

use ipnet::IpNet;
use lockstep_core::cidr::Family;
use lockstep_core::cluster::{GroupView, WindowSizing, WindowStep, block_size, window};

use super::{AgentSlot, ClusterNode, no_agent, on_agent};
use crate::cluster::Held;

/// How far back new allocations count for a window's size.
const DEMAND_PERIOD: Duration = Duration::from_secs(10);

/// The window as the node knows it.
#[derive(Debug, Default)]
pub(super) struct WindowState {
    /// What the allocator serves, as `cluster-window.json` records it:
    /// never more than etcd holds.
    pub(super) served: BTreeSet<IpAddr>,
    /// etcd's window as last written or read, with its key's mod revision;
    /// `None`: not known (read before the next write).
    published: Option<(BTreeSet<IpAddr>, i64)>,
    /// New allocations per pool and family, with when they were seen.
    demand: BTreeMap<(String, Family), VecDeque<(Instant, u64)>>,
    /// The addresses in use at the last round.
    last_in_use: BTreeSet<IpAddr>,
    /// Windows published since start (for metrics and the bench).
    pub(super) publications: u64,
}

impl WindowState {
    /// The recorded window (`None` in a record older than windows: then
    /// nothing of a cluster block is handed out until one is published).
    pub(super) fn load(state_dir: &std::path::Path) -> Result<Self, String> {
        let served = Held::load_window(state_dir)
            .map_err(|e| crate::error_chain(&e))?
            .unwrap_or_default();
        Ok(Self {
            served,
            ..Self::default()
        })
    }

    /// etcd may have lost what it held (a restore): read it again.
    pub(super) fn forget_published(&mut self) {
        self.published = None;
    }

    /// The window of each block of `held` (every one listed: an empty
    /// window hands out nothing).
    pub(super) fn per_block(&self, held: &Held) -> BTreeMap<IpNet, BTreeSet<IpAddr>> {
        held.blocks
            .iter()
            .map(|b| {
                (
                    b.cidr,
                    self.served
                        .iter()
                        .filter(|a| b.cidr.contains(*a))
                        .copied()
                        .collect(),
                )
            })
            .collect()
    }
}

impl ClusterNode {
    /// One round of the window: sized from demand, planned by the core,
    /// carried out in the order the module docs give. `in_use`: every
    /// address held in the node's blocks, as the round read it.
    pub(super) async fn window_round(
        &mut self,
        slot: &AgentSlot,
        in_use: &[IpAddr],
        reachable: bool,
    ) {
        if no_agent(slot) {
            return;
        }
        let in_use: BTreeSet<IpAddr> = in_use.iter().copied().collect();
        let groups = self.window_groups();
        let sizing = WindowSizing {
            min_spare: self.cluster.window_min_spare,
            max_spare: self.cluster.window_max_spare,
        };
        let now = Instant::now();
        let fresh: Vec<IpAddr> = in_use
            .difference(&self.window.last_in_use)
            .copied()
            .collect();
        // ADDs waiting on a pool found its window used up: a burst, which
        // widens it to the most at once (it sheds back within the demand
        // period once the burst is over).
        let waiting = self.handle.lock().wanted.clone();
        let mut spares = Vec::new();
        for (pool, family, blocks) in &groups {
            let seen = self
                .window
                .demand
                .entry((pool.clone(), *family))
                .or_default();
            let new = fresh
                .iter()
                .filter(|a| blocks.iter().any(|b| b.contains(*a)))
                .count() as u64;
            if new > 0 {
                seen.push_back((now, new));
            }
            while seen
                .front()
                .is_some_and(|(t, _)| now.duration_since(*t) > DEMAND_PERIOD)
            {
                seen.pop_front();
            }
            let recent = if waiting.contains(pool) {
                sizing.max_spare
            } else {
                seen.iter().map(|(_, n)| n).sum()
            };
            spares.push(sizing.spare(recent));
        }
        self.window.last_in_use = in_use.clone();
        let asked: Vec<(String, Family)> = groups.iter().map(|(p, f, _)| (p.clone(), *f)).collect();
        let most = usize::try_from(spares.iter().copied().max().unwrap_or(0)).unwrap_or(usize::MAX);
        let views = on_agent(slot, move |a| a.window_views(&asked, most)).await;
        let Some(views) = views else { return };
        let views: Vec<GroupView> = views
            .into_iter()
            .zip(spares)
            .map(|((free_in_window, candidates), spare)| GroupView {
                spare,
                free_in_window,
                candidates,
            })
            .collect();
        let held: Vec<IpNet> = self.held.blocks.iter().map(|b| b.cidr).collect();
        // etcd's window not known (start, a restore): read first, and
        // written again when it is not what the allocator serves.
        if reachable && self.window.published.is_none() {
            self.read_published().await;
        }
        let step = window::plan(&self.window.served, &in_use, &held, &views);
        let republish = self
            .window
            .published
            .as_ref()
            .is_some_and(|(p, _)| !self.window.served.is_subset(p));
        match step {
            WindowStep::Grow(w) => {
                if reachable && self.publish(&w).await {
                    self.serve_window(slot, w, &groups).await;
                }
            }
            WindowStep::Shrink(w) => {
                if let Some(w) = self.narrow(slot, w).await
                    && reachable
                {
                    self.publish(&w).await;
                }
            }
            WindowStep::Keep => {
                if reachable && republish {
                    let w = self.window.served.clone();
                    self.publish(&w).await;
                }
            }
        }
        let mut s = self.handle.lock();
        s.window_addresses = self.window.served.len();
        s.window_publications = self.window.publications;
    }

    /// The pools and families this node serves from blocks, with their
    /// blocks.
    fn window_groups(&self) -> Vec<(String, Family, Vec<IpNet>)> {
        let mut out = Vec::new();
        for pool in &self.held.pools {
            for family in [Family::V4, Family::V6] {
                if block_size(pool, family) == 0 {
                    continue;
                }
                let blocks: Vec<IpNet> = self
                    .held
                    .serving()
                    .filter(|b| b.pool == pool.name && Family::of_net(b.cidr) == family)
                    .map(|b| b.cidr)
                    .collect();
                if !blocks.is_empty() {
                    out.push((pool.name.clone(), family, blocks));
                }
            }
        }
        out
    }

    /// Reads etcd's window.
    async fn read_published(&mut self) {
        let Some(door) = self.door.as_ref() else {
            return;
        };
        match door.window(&self.name).await {
            Ok(Some((w, rev))) => self.window.published = Some((w, rev)),
            Ok(None) => self.window.published = Some((BTreeSet::new(), 0)),
            Err(e) => {
                tracing::warn!(error = %crate::error_chain(&e), "reservation window not read")
            }
        }
    }

    /// Puts `w` in etcd; whether etcd holds it now (answered).
    async fn publish(&mut self, w: &BTreeSet<IpAddr>) -> bool {
        for _ in 0..2 {
            let Some(door) = self.door.as_ref() else {
                return false;
            };
            let expected = self.window.published.as_ref().map_or(0, |(_, r)| *r);
            match door.put_window(&self.name, w, expected).await {
                Ok(Some(rev)) => {
                    self.window.published = Some((w.clone(), rev));
                    self.window.publications += 1;
                    return true;
                }
                // Changed elsewhere (a reclaimer deleted it, a restore):
                // read, then write ours over it.
                Ok(None) => self.read_published().await,
                Err(e) => {
                    tracing::warn!(error = %crate::error_chain(&e), "reservation window not published; nothing new is handed out of it until it is");
                    self.window.published = None;
                    return false;
                }
            }
        }
        false
    }

    /// After etcd holds `w` (a superset of what is served): recorded, then
    /// given to the allocator; the ADDs waiting on a pool that grew are
    /// told.
    async fn serve_window(
        &mut self,
        slot: &AgentSlot,
        w: BTreeSet<IpAddr>,
        groups: &[(String, Family, Vec<IpNet>)],
    ) {
        if let Err(e) = Held::save_window(&self.config.state_dir, &w) {
            tracing::error!(error = %crate::error_chain(&e), "the reservation window is not recorded; not served");
            return;
        }
        let grown: BTreeSet<String> = groups
            .iter()
            .filter(|(_, _, blocks)| {
                w.difference(&self.window.served)
                    .any(|a| blocks.iter().any(|b| b.contains(a)))
            })
            .map(|(p, _, _)| p.clone())
            .collect();
        self.window.served = w;
        let per_block = self.window.per_block(&self.held);
        on_agent(slot, move |a| a.set_cluster_windows(per_block)).await;
        if let Some(served) = self.served.as_mut() {
            served.windows = self.window.per_block(&self.held);
        }
        if !grown.is_empty() {
            let mut s = self.handle.lock();
            for p in grown {
                *s.room.entry(p).or_default() += 1;
            }
            drop(s);
            self.handle.changed.notify_waiters();
        }
    }

    /// Narrows the allocator to `w` plus whatever is in use now (read in
    /// the same command), then records it. Returns the window to
    /// publish, `None` when it could not be recorded (etcd keeps the
    /// larger one: safe).
    async fn narrow(&mut self, slot: &AgentSlot, w: BTreeSet<IpAddr>) -> Option<BTreeSet<IpAddr>> {
        let held = self.held.clone();
        let blocks: Vec<IpNet> = held.blocks.iter().map(|b| b.cidr).collect();
        let narrowed = on_agent(slot, move |a| {
            let mut w = w;
            w.extend(a.addresses_in(&blocks));
            let state = WindowState {
                served: w.clone(),
                ..WindowState::default()
            };
            a.set_cluster_windows(state.per_block(&held));
            w
        })
        .await?;
        self.window.served = narrowed.clone();
        if let Some(served) = self.served.as_mut() {
            served.windows = self.window.per_block(&self.held);
        }
        if let Err(e) = Held::save_window(&self.config.state_dir, &narrowed) {
            tracing::error!(error = %crate::error_chain(&e), "the narrowed reservation window is not recorded; etcd keeps the larger one");
            return None;
        }
        Some(narrowed)
    }
}
