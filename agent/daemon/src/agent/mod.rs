//! The agent's state and its operations, in lockstep.
//!
//! Every change follows one order: decide in the core → commit to the store
//! (fsync) → program the maps → acknowledge. A failure after the commit rolls
//! the store and the core back, so the caller's error means "nothing changed".
//! A release goes the other way: unprogram → commit → acknowledge, so no map
//! entry ever outlives its allocation, even across a crash between two steps.
//!
//! On start the agent loads the store, rebuilds the core, and reconciles the
//! pinned maps by diff (never flushing), before it reports ready. The same
//! reconcile runs periodically and repairs drift.
//!
//! Operations here are synchronous and run one at a time on the agent's owner
//! thread ([`handle`]): every other task sends them there through an
//! [`AgentHandle`]. What waits on something slow (a plugin, interfaces, a
//! veth's deletion) runs between two operations, off the owner.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::time::Instant;

use ipnet::IpNet;
use lockstep_core::cidr::Family;
use lockstep_core::manager::{Allocation, ManagerConfig, ManagerError, PoolManager, StaticPools};
use lockstep_core::owner::{Generation, Owner};
use serde::{Deserialize, Serialize};

use crate::announce::Announcements;
use crate::config::{AttachModeConfig, Config};
use crate::datapath::{
    AttachMode, Datapath, DatapathError, DatapathOptions, MapCapacities, PinnedMaps, sys,
};
use crate::map_table::MapContents;
use crate::netlink::{Netlink, NetlinkError};
use crate::store::{EndpointMode, EndpointRecord, Store, StoreError};

pub mod allocation;
pub mod cluster_pools;
pub mod delegated;
pub mod doors;
pub mod draining;
pub mod endpoint_effects;
pub mod endpoints;
mod error;
pub mod handle;
pub mod lb;
mod leaked;
mod pins;
pub mod reaper;
mod reconcile;
pub mod release;
mod report;
mod tunnel;
mod uplink;

pub use cluster_pools::RemoteSource;
pub use error::AgentError;
pub use handle::{AfterBatch, AgentHandle, AgentThread, AgentView};
pub use report::{Drift, PoolStatus, ReconcileReport, Stats, Status, Uplink, VerifyReport};

/// A request for an address.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AllocateRequest {
    /// The pool; the configured `default_pool` (or the first pool) when
    /// absent.
    #[serde(default)]
    pub pool: Option<String>,
    /// The family, when any address will do.
    #[serde(default)]
    pub family: Option<Family>,
    /// A specific address.
    #[serde(default)]
    pub address: Option<IpAddr>,
    /// Who asks.
    pub owner: Owner,
}

/// A release.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReleaseRequest {
    /// The pool; the configured `default_pool` (or the first pool) when
    /// absent.
    #[serde(default)]
    pub pool: Option<String>,
    /// The family.
    pub family: Family,
    /// The holder.
    pub owner: Owner,
    /// The generation the caller was given; a stale one frees nothing.
    #[serde(default)]
    pub generation: Option<Generation>,
}

/// The running agent's state.
pub struct Agent {
    config: Config,
    node: String,
    manager: PoolManager<StaticPools>,
    store: Store,
    datapath: Datapath,
    maps: PinnedMaps,
    ready: bool,
    restored: ReconcileReport,
    endpoints: BTreeMap<String, EndpointRecord>,
    netlink: Option<Netlink>,
    lb: lockstep_core::lb::LbIpam,
    uplink: Option<Uplink>,
    /// Attachments between ADD's phases: their addresses are held but not
    /// committed, so the planner and verify leave them out.
    pending: std::collections::BTreeSet<String>,
    /// `from_endpoint`, pinned for attaching off the agent's owner.
    from_endpoint: Option<crate::datapath::ProgramPin>,
    /// Delegated attachments by key (delegated mode).
    delegated: BTreeMap<String, crate::store::DelegatedRecord>,
    /// The delegated plugin, once found.
    delegate: Option<crate::delegate::Runner>,
    /// Why the agent is not ready (delegated set-up).
    not_ready: Option<String>,
    /// When a failed delegated set-up is tried again.
    retry_at: Option<Instant>,
    /// Releases the store refused during a rollback: held in the core and
    /// out of the maps until the store accepts them.
    parked: release::ParkedReleases,
    /// Full endpoints DEL'd whose veths are being deleted: held, unmapped.
    reaper: reaper::Reaper,
    /// The LB state in the store is not the one in memory (a rollback's
    /// write was refused); written again before the next change.
    lb_unsaved: bool,
    /// The L2 announcements (their expiry, renewed periodically, and cluster
    /// mode's addresses), behind their own lock.
    announce: Announcements,
    /// Cluster mode's fenced blocks (`cluster_pools`).
    cluster: cluster_pools::ClusterView,
    /// Cluster routing: mode, tunnel device, endpoint MTU (`tunnel`).
    routing: tunnel::RoutingState,
    /// Counters for metrics.
    pub stats: Stats,
}

impl std::fmt::Debug for Agent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Agent")
            .field("node", &self.node)
            .field("ready", &self.ready)
            .finish_non_exhaustive()
    }
}

fn attach_mode(m: AttachModeConfig) -> AttachMode {
    match m {
        AttachModeConfig::Auto => AttachMode::Auto,
        AttachModeConfig::Tcx => AttachMode::Tcx,
        AttachModeConfig::Netlink => AttachMode::Netlink,
    }
}

fn datapath_options(config: &Config) -> DatapathOptions {
    let mut opts = DatapathOptions::new(&config.datapath.pin_root);
    opts.migrate = config.datapath.migrate;
    opts.attach_mode = attach_mode(config.datapath.attach_mode);
    opts.capacities = MapCapacities {
        ipcache: config.datapath.ipcache_max_entries,
        endpoints: config.datapath.endpoints_max_entries,
        ..MapCapacities::default()
    };
    opts
}

/// What the agent starts from beyond its configuration, found by the
/// sources that compose it (the server): the pools recorded in the state
/// directory and cluster mode's node addresses.
#[derive(Clone, Debug, Default)]
pub struct Start {
    /// Every pool the allocator starts with: the configuration's, and the
    /// recorded ones (cluster blocks, NodeIPAM CIDRs, the Node's podCIDRs).
    pub pools: Vec<lockstep_core::pool::PoolSpec>,
    /// Cluster mode's node addresses (empty outside cluster mode).
    pub node_ips: Vec<IpAddr>,
}

impl Start {
    /// Only the configuration's pools: an agent outside cluster mode and
    /// without recorded pools.
    pub fn configured(config: &Config) -> Self {
        Self {
            pools: config.pools.clone(),
            node_ips: Vec::new(),
        }
    }
}

impl Agent {
    /// Starts the agent: opens the datapath and the store, restores every
    /// allocation into the core, reconciles the maps, and becomes ready.
    ///
    /// # Errors
    /// Any of those steps failed; the agent must not serve.
    pub fn start(config: Config, start: Start) -> Result<Self, AgentError> {
        let started = Instant::now();
        // The store first: its lock refuses a second agent on this state
        // directory before `Datapath::open` may migrate (replace) pins the
        // running agent uses.
        let store = Store::open(&config.state_dir)?;
        // The pin root is claimed for this store before anything under it
        // is touched (`datapath::owner`).
        let mut opts = datapath_options(&config);
        opts.owner = Some(crate::datapath::PinOwner {
            store_id: store.id(),
            state_dir: config.state_dir.clone(),
        });
        opts.take_over_pin_root = config.datapath.take_over_pin_root;
        let datapath = Datapath::open(opts)?;
        let maps = datapath.maps()?;
        let stored = store.load()?;
        let mut manager = PoolManager::new(StaticPools(start.pools), ManagerConfig::default())?;
        let report = manager.sync();
        if !report.errors.is_empty() {
            return Err(AgentError::Invalid {
                reason: format!("pool configuration refused: {:?}", report.errors),
            });
        }
        let count = stored.allocations.len();
        let lb = match &stored.lb {
            Some(snapshot) => {
                lockstep_core::lb::LbIpam::restore(snapshot).map_err(|e| AgentError::Invalid {
                    reason: format!("stored LoadBalancer state does not restore: {e}"),
                })?
            }
            None => lockstep_core::lb::LbIpam::new(),
        };
        let mut lb = lb;
        let faults = lb.take_faults();
        if !faults.is_empty() {
            // As a snapshot that does not restore: refused, not served.
            return Err(AgentError::LbInconsistent { faults });
        }
        // What the configuration dropped drains; an edit that would take a
        // held address is refused before anything changes.
        let (outcome, kept) = manager.restore_keeping(stored.generation, stored.allocations);
        draining::refuse_taking(&outcome)?;
        draining::log_kept(&kept);
        for (a, why) in &outcome.rejected {
            // Clashes inside the store itself (two owners, one address):
            // the loser is released; reconcile removes its map entries.
            tracing::warn!(address = %a.address, owner = %a.owner, pool = %a.pool, reason = %why, "releasing an allocation that conflicts with another");
            store.remove(a)?;
        }
        manager.finish_restore();
        let node = config.node_name();
        let announce = Announcements::new(config.lb.announce_lease, datapath.maps()?);
        let mut agent = Self {
            config,
            node,
            manager,
            store,
            datapath,
            maps,
            ready: false,
            restored: ReconcileReport::default(),
            endpoints: stored.endpoints.into_iter().map(|e| (e.key(), e)).collect(),
            netlink: None,
            lb,
            uplink: None,
            pending: std::collections::BTreeSet::new(),
            from_endpoint: None,
            delegated: stored.delegated.into_iter().map(|d| (d.key(), d)).collect(),
            delegate: None,
            not_ready: None,
            retry_at: None,
            parked: release::ParkedReleases::default(),
            reaper: reaper::Reaper::default(),
            lb_unsaved: false,
            announce,
            cluster: cluster_pools::ClusterView::default(),
            routing: tunnel::RoutingState::default(),
            stats: Stats::default(),
        };
        agent.attach_uplink()?;
        agent.start_routing(start.node_ips)?;
        agent.from_endpoint = Some(agent.datapath.pin_program(
            lockstep_common::program_names::FROM_ENDPOINT,
            attach_mode(agent.config.datapath.endpoint_attach_mode),
        )?);
        // DELs acknowledged before a crash or stop whose veths were not
        // confirmed gone: finished before anything is programmed.
        agent.finish_stored_releases();
        // Role addresses before anything is served: the API answers "not
        // ready" until start() returns, so no endpoint can be handed one.
        agent.reserve_roles()?;
        agent.restored = agent.reconcile_inner()?;
        agent.reattach_endpoints();
        agent.sweep_leftovers();
        // Delegated mode: the roles come from the plugin; until that works
        // the agent serves status only ("not ready" with the reason).
        agent.poll_setup()?;
        tracing::info!(
            allocations = count - outcome.rejected.len(),
            released = outcome.rejected.len(),
            map_changes = agent.restored.total(),
            elapsed_ms = started.elapsed().as_millis() as u64,
            "restored; ready"
        );
        Ok(agent)
    }

    /// The configuration in use.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The datapath (for attaching programs).
    pub fn datapath_mut(&mut self) -> &mut Datapath {
        &mut self.datapath
    }

    /// The doors one allocation's effects go through (static dispatch: the
    /// real store and maps).
    fn effects(&mut self) -> allocation::Effects<'_, StaticPools, Store, PinnedMaps> {
        allocation::Effects {
            core: &mut self.manager,
            store: &self.store,
            maps: &mut self.maps,
            parked: &mut self.parked,
            capacity: self.config.datapath.ipcache_max_entries,
        }
    }

    fn program(&mut self, a: &Allocation) -> Result<(), AgentError> {
        allocation::program(&mut self.maps, a, self.config.datapath.ipcache_max_entries)
    }

    fn unprogram(&mut self, a: &Allocation) -> Result<(), AgentError> {
        allocation::unprogram(&mut self.maps, a)
    }

    fn check_ready(&self) -> Result<(), AgentError> {
        if let Some(reason) = self.ownership_problem() {
            return Err(AgentError::NotReady { reason });
        }
        if self.ready {
            Ok(())
        } else {
            Err(AgentError::NotReady {
                reason: self
                    .not_ready
                    .clone()
                    .unwrap_or_else(|| "restoring allocations and maps".into()),
            })
        }
    }

    fn note_error(&mut self, e: &AgentError) {
        *self.stats.errors.entry(e.code()).or_default() += 1;
    }

    /// Retries what a rollback could not finish: parked releases and an LB
    /// state the store did not take. Before every change, and on each
    /// reconcile tick; what the store still refuses stays as it is (held,
    /// named by `verify`) and is logged.
    fn settle(&mut self) {
        if let Err(refused) = self.parked.retry(&self.store, &mut self.manager) {
            for (key, e) in refused {
                tracing::warn!(%key, error = %crate::error_chain(&e), "a parked release is still refused");
            }
        }
        if self.lb_unsaved {
            match self.store.put_lb(&self.lb.snapshot()) {
                Ok(()) => self.lb_unsaved = false,
                Err(e) => {
                    tracing::warn!(error = %crate::error_chain(&e), "the LB state is still not stored")
                }
            }
        }
    }

    /// The error for a request on an attachment whose release is still
    /// parked (after [`Agent::settle`]).
    fn parked_error(&self, key: &str) -> Option<AgentError> {
        self.parked
            .cause(key)
            .map(|cause| AgentError::ReleasePending {
                attachment: key.replace('\u{1f}', "/"),
                cause: cause.to_string(),
            })
    }

    /// Allocates: core → commit → program → acknowledge. Asking again for the
    /// same owner returns the same allocation.
    ///
    /// # Errors
    /// The core refused, or a later step failed and everything was rolled back.
    pub fn allocate(&mut self, req: AllocateRequest) -> Result<Allocation, AgentError> {
        let r = self.allocate_inner(req);
        if let Err(e) = &r {
            self.note_error(e);
        }
        r
    }

    fn allocate_inner(&mut self, req: AllocateRequest) -> Result<Allocation, AgentError> {
        self.check_ready()?;
        self.settle();
        let pool = match &req.pool {
            Some(p) => p.clone(),
            None => self.default_pool()?,
        };
        if matches!(req.owner, Owner::Agent { .. }) {
            return Err(AgentError::Invalid {
                reason: "agent-role addresses are reserved by the agent itself".into(),
            });
        }
        let family = match (req.family, req.address) {
            (Some(f), Some(a)) if f != Family::of_addr(a) => {
                return Err(AgentError::Invalid {
                    reason: format!("address {a} is not of family {f}"),
                });
            }
            (_, Some(a)) => Family::of_addr(a),
            (Some(f), None) => f,
            (None, None) => {
                return Err(AgentError::Invalid {
                    reason: "give a family or an address".into(),
                });
            }
        };
        if let Some(p) = self.manager.pool(&pool)
            && !p.families().contains(&family)
        {
            // Not "exhausted": no amount of releasing will ever satisfy it.
            // A family the pool declares without a CIDR yet (a cluster pool
            // before its first block) is: a block brings one.
            return Err(AgentError::Invalid {
                reason: format!("pool {pool} has no {family} CIDR"),
            });
        }
        if let Some(existing) = self.manager.get(&pool, family, &req.owner)
            && req.address.is_none_or(|a| a == existing.address)
        {
            // Idempotent: it was committed and programmed when first made.
            // Asking for a different address is refused by the core below
            // (owner_holds_other), never answered with the held one.
            return Ok(existing.clone());
        }
        let a = match req.address {
            Some(addr) => self.manager.allocate(&pool, addr, req.owner)?,
            None => self.manager.allocate_next(&pool, family, req.owner)?,
        };
        // Commit → program; every undo step tried and reported.
        self.effects().commit_and_program(a)
    }

    /// Releases: unprogram → commit → acknowledge. A stale generation frees
    /// nothing.
    ///
    /// # Errors
    /// No such allocation, stale generation, or a failed step (the allocation
    /// then stays, programmed).
    pub fn release(&mut self, req: ReleaseRequest) -> Result<Allocation, AgentError> {
        let r = self.release_inner(req);
        if let Err(e) = &r {
            self.note_error(e);
        }
        r
    }

    fn release_inner(&mut self, req: ReleaseRequest) -> Result<Allocation, AgentError> {
        self.check_ready()?;
        self.settle();
        let pool = match &req.pool {
            Some(p) => p.clone(),
            None => self.default_pool()?,
        };
        let Some(current) = self.manager.get(&pool, req.family, &req.owner).cloned() else {
            return Err(AgentError::NotFound {
                pool,
                family: req.family,
                owner: req.owner,
            });
        };
        if let Some(g) = req.generation
            && g != current.generation
        {
            return Err(ManagerError::StaleGeneration {
                owner: req.owner,
                given: g,
                current: current.generation,
            }
            .into());
        }
        // Unprogram → commit → release; a refused removal programs the
        // entry again, and a failure to is reported too.
        self.effects().unprogram_and_release(&current)
    }

    /// Every allocation.
    pub fn allocations(&self) -> Vec<Allocation> {
        let mut all: Vec<Allocation> = self.manager.allocations().cloned().collect();
        all.extend(self.delegated_allocations());
        all.sort();
        all
    }

    /// Whether `seen` is still every pool's CIDRs ([`Agent::pool_cidrs`]),
    /// told without allocating: the owner asks after every batch.
    pub fn pool_cidrs_are(&self, seen: &BTreeMap<String, Vec<IpNet>>) -> bool {
        let mut pools = 0;
        self.manager.pools().all(|p| {
            pools += 1;
            seen.get(p.name())
                .is_some_and(|c| c.iter().copied().eq(p.cidrs().map(|c| c.cidr)))
        }) && pools == seen.len()
    }

    /// Every pool's CIDRs by name, draining ones included.
    pub fn pool_cidrs(&self) -> BTreeMap<String, Vec<IpNet>> {
        self.manager
            .pools()
            .map(|p| (p.name().to_string(), p.cidrs().map(|c| c.cidr).collect()))
            .collect()
    }

    /// Pool usage.
    pub fn pools(&self) -> Vec<PoolStatus> {
        self.manager
            .pools()
            .map(|p| {
                let cidrs: Vec<IpNet> = p.cidrs().map(|c| c.cidr).collect();
                let draining: Vec<IpNet> =
                    p.cidrs().filter(|c| c.draining).map(|c| c.cidr).collect();
                let usage = |fam: Family| {
                    p.cidrs().filter(|c| Family::of_net(c.cidr) == fam).fold(
                        (0u128, 0u128),
                        |(u, f), c| {
                            // Free: what can still be handed out (inside a
                            // block's reservation window in cluster mode).
                            (u + c.used, f + c.available)
                        },
                    )
                };
                PoolStatus {
                    name: p.name().to_string(),
                    cidrs,
                    draining,
                    retired: p.is_retired(),
                    draining_ranges: self
                        .draining()
                        .into_iter()
                        .filter(|r| r.pool == p.name())
                        .collect(),
                    skip_masquerade: p.skips_masquerade(),
                    v4: usage(Family::V4),
                    v6: usage(Family::V6),
                }
            })
            .collect()
    }

    /// The role addresses the configuration asks for.
    fn wanted_roles(&self) -> Result<Vec<lockstep_core::roles::RoleWant>, AgentError> {
        use lockstep_core::owner::AgentRole;
        if self.delegated_mode() {
            // The plugin holds them (see `delegated`); local role addresses
            // from an earlier local-mode run are released.
            return Ok(Vec::new());
        }
        let r = &self.config.roles;
        let any = [&r.router, &r.health, &r.ingress]
            .iter()
            .any(|c| c.ipv4 || c.ipv6);
        if !any {
            // No pool is needed (cluster mode may have none before etcd
            // answers).
            return Ok(Vec::new());
        }
        let pool = match &self.config.roles.pool {
            Some(p) => p.clone(),
            None => self.default_pool()?,
        };
        let mut out = Vec::new();
        for (role, cfg) in [
            (AgentRole::Router, &r.router),
            (AgentRole::Health, &r.health),
            (AgentRole::Ingress, &r.ingress),
        ] {
            for (on, family) in [(cfg.ipv4, Family::V4), (cfg.ipv6, Family::V6)] {
                if on {
                    out.push(lockstep_core::roles::RoleWant {
                        role,
                        family,
                        pool: pool.clone(),
                    });
                }
            }
        }
        Ok(out)
    }

    /// Makes role holdings match the configuration: reserves what is wanted
    /// and not held, releases what is held and no longer wanted (the store
    /// remembers it, so a disabled role leaks nothing).
    fn reserve_roles(&mut self) -> Result<(), AgentError> {
        let wanted = self.wanted_roles()?;
        let plan = lockstep_core::roles::plan(wanted, self.manager.allocations());
        // Every step tried, every failure reported; the maps follow in the
        // start-up reconcile.
        self.effects().apply_roles(plan)
    }

    /// The role addresses held: role → addresses.
    pub fn roles(&self) -> BTreeMap<String, Vec<IpAddr>> {
        let mut out: BTreeMap<String, Vec<IpAddr>> = BTreeMap::new();
        for a in self
            .manager
            .allocations()
            .chain(&self.delegated_allocations())
        {
            if let Owner::Agent { role } = a.owner {
                out.entry(role.name().to_string())
                    .or_default()
                    .push(a.address);
            }
        }
        out
    }

    /// Resolves the configured uplink and attaches `to_native` (egress) and
    /// `from_native` (ingress) to it, in place if already attached.
    fn attach_uplink(&mut self) -> Result<(), AgentError> {
        let Some(name) = self.config.datapath.uplink.clone() else {
            return Ok(());
        };
        let link = Netlink::current()?
            .link(&name)?
            .ok_or_else(|| AgentError::Invalid {
                reason: format!("uplink {name} (datapath.uplink) does not exist"),
            })?;
        self.datapath.attach(
            lockstep_common::program_names::TO_NATIVE,
            &name,
            crate::datapath::Hook::Egress,
        )?;
        self.datapath.attach(
            lockstep_common::program_names::FROM_NATIVE,
            &name,
            crate::datapath::Hook::Ingress,
        )?;
        self.uplink = Some(Uplink {
            name,
            index: link.index,
            mac: link.mac,
        });
        self.announce.set_uplink(Some((link.index, link.mac)));
        Ok(())
    }

    /// Allocations that are committed: all but those of attachments between
    /// ADD's phases.
    fn committed_allocations(&self) -> impl Iterator<Item = &Allocation> + '_ {
        // Asked per allocation (100k at a restart's reconcile): the checks
        // are skipped outright when nothing is parked, released or pending,
        // rather than each building an endpoint key.
        let (parked, reaped, pending) = (
            !self.parked.is_empty(),
            self.reaper.is_busy(),
            !self.pending.is_empty(),
        );
        self.manager
            .allocations()
            .filter(move |a| !(parked && self.parked.holds(a) || reaped && self.reaper.holds(a)))
            .filter(move |a| !pending || !self.is_pending(&a.owner))
    }

    /// Whether `owner`'s attachment is between two holds of a CNI call
    /// (an ADD's or a delegated DEL's): its allocations are not committed,
    /// or are unprogrammed already.
    fn is_pending(&self, owner: &Owner) -> bool {
        owner.attachment().is_some_and(|(container_id, ifname)| {
            self.pending
                .contains(&crate::store::endpoint_key(container_id, ifname))
        })
    }

    /// The datapath's event ring, for the server to drain (see
    /// [`crate::datapath::events`]).
    ///
    /// # Errors
    /// Taken already, or the programs have none.
    pub fn event_log(
        &mut self,
    ) -> Result<crate::datapath::events::EventLog, crate::datapath::events::EventsError> {
        self.datapath.event_log()
    }

    /// What the start-up reconcile did.
    pub fn restored(&self) -> &ReconcileReport {
        &self.restored
    }

    /// Every datapath counter (summed over CPUs), for metrics; none when
    /// COUNTERS cannot be read.
    pub fn datapath_counters(&self) -> Vec<(lockstep_common::Counter, u64)> {
        self.maps.counters().unwrap_or_default()
    }

    /// Each map's capacity (`max_entries`) as this agent creates it, for
    /// the metrics' fill of every map the agent keeps entries in.
    pub fn map_capacities(&self) -> BTreeMap<&'static str, u32> {
        crate::datapath::expected_definitions(&datapath_options(&self.config).capacities)
            .into_iter()
            .map(|(name, d)| (name, d.max_entries))
            .collect()
    }

    /// Status, the pin root checked now.
    pub fn status(&self) -> Status {
        self.status_with(self.datapath.pin_probe().problem())
    }

    /// Status as the agent's state stands, the pin root not checked: what
    /// its owner publishes after every batch of commands; a reader applies
    /// [`Agent::pin_probe`] (`AgentView::status`).
    pub fn status_unprobed(&self) -> Status {
        self.status_with(None)
    }

    /// The pin root's check, runnable from any thread.
    pub fn pin_probe(&self) -> std::sync::Arc<crate::datapath::pins::PinProbe> {
        self.datapath.pin_probe()
    }

    /// Status with `pins`, the pin root's problem if any.
    fn status_with(&self, pins: Option<String>) -> Status {
        let store = self.store.health();
        Status {
            version: crate::version::version(),
            ready: self.ready && store.is_none() && pins.is_none(),
            reason: if self.ready {
                store
                    .map(|cause| format!("the store cannot commit: {cause}"))
                    .or(pins)
            } else {
                Some(
                    self.not_ready
                        .clone()
                        .unwrap_or_else(|| "restoring".to_string()),
                )
            },
            node: self.node.clone(),
            default_pool: self.default_pool().ok(),
            allocations: self.manager.allocations().len() + self.delegated_allocations().len(),
            roles: self.roles(),
            generation: self.manager.generation(),
            restored: self.restored.clone(),
            repairs: self.stats.repairs.values().sum(),
            pin_repairs: self.stats.pin_repairs.values().sum(),
            ipam_commands: self
                .stats
                .ipam_commands
                .iter()
                .map(|(k, v)| ((*k).to_string(), *v))
                .collect(),
        }
    }
}
