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
//! Operations here are synchronous and run under one mutex held by the server;
//! each is short (a commit is one fsync, programming a few syscalls).

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::time::Instant;

use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use lockstep_common::{
    EndpointSlot, EndpointValue, IpcacheValue, L2RespSlot, L2RespValue, MasqSkipValue, V4Addr,
    V6Addr, map_names, masq_reason, max_entries, slots,
};
use lockstep_core::cidr::Family;
use lockstep_core::manager::{Allocation, ManagerConfig, ManagerError, PoolManager, StaticPools};
use lockstep_core::owner::{Generation, Owner};
use lockstep_core::plan::{
    EntryExtra, MapDiff, PlanBuilder, diff, diff_sorted, direct_mapped, host_entries,
};
use serde::{Deserialize, Serialize};

use crate::config::{AttachModeConfig, Config};
use crate::datapath::{
    AttachMode, Datapath, DatapathError, DatapathOptions, MapCapacities, PinnedMaps, sys,
};
use crate::netlink::{Netlink, NetlinkError};
use crate::store::{EndpointMode, EndpointRecord, Store, StoreError};

pub mod allocation;
pub mod delegated;
pub mod doors;
pub mod draining;
pub mod endpoint_effects;
pub mod endpoints;
pub mod lb;
mod pins;
pub mod reaper;
pub mod release;

/// Errors of agent operations. Each has a stable API code ([`AgentError::code`]).
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// The agent is still restoring.
    #[error("not ready: {reason}")]
    NotReady {
        /// Why.
        reason: String,
    },
    /// The core refused (exhausted, unknown pool, taken, stale generation...).
    #[error(transparent)]
    Allocation(Box<ManagerError>),
    /// The request is not acceptable as such.
    #[error("invalid request: {reason}")]
    Invalid {
        /// What is wrong.
        reason: String,
    },
    /// No allocation matches the release.
    #[error("no allocation in pool {pool} ({family}) for {owner}")]
    NotFound {
        /// The pool.
        pool: String,
        /// The family.
        family: Family,
        /// The owner.
        owner: Owner,
    },
    /// A map is full; the allocation was rolled back.
    #[error("map {map} is full ({capacity} entries); the allocation was rolled back")]
    MapFull {
        /// The map.
        map: &'static str,
        /// Its capacity.
        capacity: u32,
    },
    /// Programming a map failed; the allocation was rolled back.
    #[error("programming map {map} failed; the allocation was rolled back")]
    Program {
        /// The map.
        map: &'static str,
        /// The error.
        #[source]
        source: Box<aya::maps::MapError>,
    },
    /// A batch syscall failed during reconcile.
    #[error("reconciling map {map} failed")]
    Reconcile {
        /// The map.
        map: &'static str,
        /// The syscall error.
        #[source]
        source: sys::SysError,
    },
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// An interface operation failed.
    #[error(transparent)]
    Netlink(#[from] NetlinkError),
    /// Another ADD or DEL of the same attachment is in progress.
    #[error("attachment {attachment} is busy with another request; try again")]
    Busy {
        /// container id/ifname.
        attachment: String,
    },
    /// CHECK found the attachment not as ADD made it.
    #[error("check failed: {}", problems.join("; "))]
    CheckFailed {
        /// Every problem found.
        problems: Vec<String>,
    },
    /// The datapath failed.
    #[error(transparent)]
    Datapath(#[from] DatapathError),
    /// The delegated IPAM plugin failed, or delegated mode is refused.
    #[error(transparent)]
    Delegate(Box<crate::delegate::DelegateError>),
    /// LoadBalancer IPAM's allocator disagreed with its holdings during a
    /// change; the change was refused and the previous state kept.
    #[error("the LoadBalancer change was refused, its allocator disagreed: {}", faults.join("; "))]
    LbInconsistent {
        /// What failed where it cannot.
        faults: Vec<String>,
    },
    /// An earlier attempt's rollback released this attachment and the
    /// store has not accepted the removal yet; its addresses stay held.
    #[error(
        "{attachment}: the release of an earlier attempt waits for the store ({cause}); try again"
    )]
    ReleasePending {
        /// container id/ifname.
        attachment: String,
        /// Why the store refuses.
        cause: String,
    },
    /// Several steps failed (a DEL, a GC, or a request and its rollback):
    /// every error, the first one first; it decides the code.
    #[error("{}", errors.iter().map(|e| crate::error_chain(e)).collect::<Vec<_>>().join("; and "))]
    Several {
        /// The errors, in the order they happened.
        errors: Vec<AgentError>,
    },
}

impl AgentError {
    /// `first`, or every error when more followed it (a rollback's, or the
    /// next steps' of a DEL or GC that carried on).
    pub fn with_more(first: AgentError, more: Vec<AgentError>) -> AgentError {
        if more.is_empty() {
            return first;
        }
        let mut errors = vec![first];
        errors.extend(more);
        AgentError::Several { errors }
    }

    /// Every error as one, or `Ok` when there is none.
    ///
    /// # Errors
    /// The errors given, if any.
    pub fn all(mut errors: Vec<AgentError>) -> Result<(), AgentError> {
        match errors.len() {
            0 => Ok(()),
            1 => Err(errors.remove(0)),
            _ => Err(AgentError::Several { errors }),
        }
    }
}

impl From<crate::delegate::DelegateError> for AgentError {
    fn from(e: crate::delegate::DelegateError) -> Self {
        AgentError::Delegate(Box::new(e))
    }
}

impl From<ManagerError> for AgentError {
    fn from(e: ManagerError) -> Self {
        AgentError::Allocation(Box::new(e))
    }
}

impl AgentError {
    /// A stable, machine-readable code for the API.
    pub fn code(&self) -> &'static str {
        match self {
            AgentError::NotReady { .. } => "not_ready",
            AgentError::Allocation(e) => match e.as_ref() {
                ManagerError::UnknownPool { .. } => "unknown_pool",
                ManagerError::PoolExhausted { .. } => "pool_exhausted",
                ManagerError::AddressTaken { .. } => "address_taken",
                ManagerError::AddressOutsidePool { .. } => "address_outside_pool",
                ManagerError::AddressUnusable { .. } => "address_unusable",
                ManagerError::OwnerHoldsOther { .. } => "owner_holds_other",
                ManagerError::CidrDraining { .. } => "cidr_draining",
                ManagerError::NotAllocated { .. } => "not_found",
                ManagerError::StaleGeneration { .. } => "stale_generation",
                _ => "allocation_refused",
            },
            AgentError::Invalid { .. } => "invalid_request",
            AgentError::NotFound { .. } => "not_found",
            AgentError::MapFull { .. } => "map_full",
            AgentError::Program { .. } => "datapath_error",
            AgentError::Reconcile { .. } => "datapath_error",
            AgentError::Store(_) => "store_error",
            AgentError::Netlink(_) => "interface_error",
            AgentError::CheckFailed { .. } => "check_failed",
            AgentError::Busy { .. } => "busy",
            AgentError::Datapath(_) => "datapath_error",
            AgentError::Delegate(_) => "ipam_plugin_error",
            AgentError::ReleasePending { .. } => "store_error",
            AgentError::LbInconsistent { .. } => "internal",
            AgentError::Several { errors } => errors.first().map_or("internal", AgentError::code),
        }
    }
}

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

/// One difference between what should be in a map and what is.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Drift {
    /// The map.
    pub map: String,
    /// The key, printed.
    pub key: String,
    /// `missing`, `unexpected` or `different`.
    pub kind: String,
}

/// What a reconcile did.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReconcileReport {
    /// Entries written that were missing.
    pub added: usize,
    /// Entries rewritten because their value differed.
    pub updated: usize,
    /// Entries removed that nothing owns.
    pub removed: usize,
    /// Changes per map.
    pub per_map: BTreeMap<String, usize>,
    /// Wall time of the whole reconcile (plan, read, diff, write), µs.
    pub micros: u64,
}

impl ReconcileReport {
    /// Total changes.
    pub fn total(&self) -> usize {
        self.added + self.updated + self.removed
    }
}

/// Result of `verify`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct VerifyReport {
    /// No drift anywhere.
    pub ok: bool,
    /// Allocations in memory that the store lacks, or the other way round.
    pub store: Vec<String>,
    /// Map entries that differ from the store.
    pub maps: Vec<Drift>,
    /// Ranges the configuration dropped that still have holders
    /// (informational: stored and programmed on purpose, not drift).
    #[serde(default)]
    pub draining: Vec<lockstep_core::manager::DrainingRange>,
    /// Map pins that do not name the maps the programs use, and a pin root
    /// this agent lost to another store.
    #[serde(default)]
    pub pins: Vec<String>,
}

/// Pool usage for the API and metrics.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolStatus {
    /// Name.
    pub name: String,
    /// CIDRs (draining ones included).
    pub cidrs: Vec<IpNet>,
    /// CIDRs being drained.
    pub draining: Vec<IpNet>,
    /// The configuration no longer lists the pool; it lives on while its
    /// draining ranges have holders.
    #[serde(default)]
    pub retired: bool,
    /// Each draining range with its holders.
    #[serde(default)]
    pub draining_ranges: Vec<lockstep_core::manager::DrainingRange>,
    /// Skip masquerade.
    pub skip_masquerade: bool,
    /// Per family: (allocated, free).
    pub v4: (u128, u128),
    /// Per family: (allocated, free).
    pub v6: (u128, u128),
}

/// Agent status.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Status {
    /// The agent's version ([`crate::version::version`]): which build
    /// answers, for example after an image upgrade or rollback.
    #[serde(default)]
    pub version: String,
    /// Ready to serve.
    pub ready: bool,
    /// Why not, when not.
    pub reason: Option<String>,
    /// Node name.
    pub node: String,
    /// The pool a request that names none uses (`default_pool`, else the
    /// first pool).
    #[serde(default)]
    pub default_pool: Option<String>,
    /// Number of allocations.
    pub allocations: usize,
    /// Agent-owned addresses by role.
    pub roles: BTreeMap<String, Vec<IpAddr>>,
    /// Highest generation.
    pub generation: Generation,
    /// Changes applied by the start-up reconcile.
    pub restored: ReconcileReport,
    /// Repairs made by periodic reconciles since start.
    pub repairs: u64,
    /// Map pins put back (removed or replaced) since start.
    #[serde(default)]
    pub pin_repairs: u64,
    /// Delegated IPAM: how often each CNI command was run on the plugin
    /// (and `compensating_del`).
    #[serde(default)]
    pub ipam_commands: BTreeMap<String, u64>,
}

/// Counters the metrics module reads.
#[derive(Clone, Debug, Default)]
pub struct Stats {
    /// Repairs per map by periodic reconciles.
    pub repairs: BTreeMap<String, u64>,
    /// Map pins put back per map (removed or replaced).
    pub pin_repairs: BTreeMap<String, u64>,
    /// Errors per code.
    pub errors: BTreeMap<&'static str, u64>,
    /// Entries per map at the last reconcile.
    pub entries: BTreeMap<&'static str, usize>,
    /// Delegated IPAM plugin runs per CNI command.
    pub ipam_commands: BTreeMap<&'static str, u64>,
}

/// The node's uplink: where to_native/from_native run and LoadBalancer
/// addresses are announced.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Uplink {
    /// Interface name.
    pub name: String,
    /// Interface index.
    pub index: u32,
    /// Its MAC: what the ARP responder answers with.
    pub mac: [u8; 6],
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
    /// `from_endpoint`, pinned for attaching outside the lock.
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

/// Raw bytes of a plain-data map value.
fn pod_bytes<T: aya::Pod>(v: &T) -> &[u8] {
    // SAFETY: `Pod` types are plain data with no padding bytes.
    unsafe { std::slice::from_raw_parts((v as *const T).cast::<u8>(), size_of::<T>()) }
}

fn lpm_key_bytes(prefix_len: u8, addr: &[u8]) -> Vec<u8> {
    let mut k = u32::from(prefix_len).to_ne_bytes().to_vec();
    k.extend_from_slice(addr);
    k
}

/// The desired contents of every map the agent owns, split the way the
/// datapath stores them (host entries in hashes, prefixes in tries).
#[derive(Debug, Default, PartialEq)]
struct MapContents {
    /// L2_RESP_V4, sorted by address.
    l2: Vec<(V4Addr, L2RespValue)>,
    /// ENDPOINTS, sorted by ifindex.
    endpoints: Vec<(u32, EndpointValue)>,
    /// ENDPOINT_SLOTS that hold something, sorted by slot.
    endpoint_slots: Vec<(u32, EndpointSlot)>,
    /// L2_RESP_SLOTS that hold something, sorted by slot.
    l2_slots: Vec<(u32, L2RespSlot)>,
    /// Sorted by address, unique.
    host_v4: Vec<(V4Addr, IpcacheValue)>,
    /// Sorted by address, unique.
    host_v6: Vec<(V6Addr, IpcacheValue)>,
    prefix_v4: BTreeMap<Ipv4Net, IpcacheValue>,
    prefix_v6: BTreeMap<Ipv6Net, IpcacheValue>,
    masq_v4: BTreeMap<Ipv4Net, MasqSkipValue>,
    masq_v6: BTreeMap<Ipv6Net, MasqSkipValue>,
}

impl MapContents {
    fn observe(maps: &PinnedMaps) -> Result<Self, AgentError> {
        let mut c = MapContents {
            l2: read_hash(maps, map_names::L2_RESP_V4)?,
            endpoints: read_hash(maps, map_names::ENDPOINTS)?,
            endpoint_slots: read_slots(
                maps,
                map_names::ENDPOINT_SLOTS,
                max_entries::ENDPOINT_SLOTS,
            )?,
            l2_slots: read_slots(maps, map_names::L2_RESP_SLOTS, max_entries::L2_RESP_SLOTS)?,
            host_v4: read_hash(maps, map_names::IPCACHE_HOST_V4)?,
            host_v6: read_hash(maps, map_names::IPCACHE_HOST_V6)?,
            ..MapContents::default()
        };
        let map_err = |e| AgentError::Program {
            map: "IPCACHE",
            source: Box::new(e),
        };
        Self::observe_tries(maps, &mut c).map_err(map_err)?;
        Ok(c)
    }

    fn observe_tries(maps: &PinnedMaps, c: &mut MapContents) -> Result<(), aya::maps::MapError> {
        for item in maps.ipcache_v4().iter() {
            let (k, v) = item?;
            if let Ok(n) = Ipv4Net::new(k.data().into(), k.prefix_len() as u8) {
                c.prefix_v4.insert(n, v);
            }
        }
        for item in maps.ipcache_v6().iter() {
            let (k, v) = item?;
            if let Ok(n) = Ipv6Net::new(k.data().into(), k.prefix_len() as u8) {
                c.prefix_v6.insert(n, v);
            }
        }
        for item in maps.masq_skip_v4().iter() {
            let (k, v) = item?;
            if let Ok(n) = Ipv4Net::new(k.data().into(), k.prefix_len() as u8) {
                c.masq_v4.insert(n, v);
            }
        }
        for item in maps.masq_skip_v6().iter() {
            let (k, v) = item?;
            if let Ok(n) = Ipv6Net::new(k.data().into(), k.prefix_len() as u8) {
                c.masq_v6.insert(n, v);
            }
        }
        Ok(())
    }
}

/// A map key readable from raw bytes.
/// Reads a map in bulk and returns it sorted by key.
fn read_hash<K: sys::RawKey, V: aya::Pod>(
    maps: &PinnedMaps,
    map: &'static str,
) -> Result<Vec<(K, V)>, AgentError> {
    let raw = maps.raw(map)?;
    sys::read_entries(raw.fd(), K::SIZE).map_err(|source| AgentError::Reconcile { map, source })
}

/// The slots of a slot array that hold something, sorted by slot.
fn read_slots<V: aya::Pod + Default + PartialEq>(
    maps: &PinnedMaps,
    map: &'static str,
    slots: u32,
) -> Result<Vec<(u32, V)>, AgentError> {
    let raw = maps.raw(map)?;
    let mut all: Vec<(u32, V)> =
        sys::read_array(raw.fd(), slots).map_err(|source| AgentError::Reconcile { map, source })?;
    all.retain(|(_, v)| *v != V::default());
    Ok(all)
}

/// Applies one map's diff with batch syscalls: deletes first (frees room),
/// then adds and updates.
fn apply<K: Ord + Clone, V: aya::Pod + Clone>(
    maps: &PinnedMaps,
    map: &'static str,
    d: &MapDiff<K, V>,
    key_bytes: impl Fn(&K) -> Vec<u8>,
    report: &mut ReconcileReport,
) -> Result<(), AgentError> {
    if d.is_empty() {
        return Ok(());
    }
    let raw = maps.raw(map)?;
    let mut key_size = 0;
    if !d.delete.is_empty() {
        let mut keys = Vec::new();
        for k in &d.delete {
            let b = key_bytes(k);
            key_size = b.len();
            keys.extend_from_slice(&b);
        }
        sys::delete_batch(raw.fd(), key_size, &keys)
            .map_err(|source| AgentError::Reconcile { map, source })?;
    }
    let writes: Vec<&(K, V)> = d.add.iter().chain(d.update.iter()).collect();
    if !writes.is_empty() {
        let mut keys = Vec::new();
        let mut values = Vec::with_capacity(writes.len() * size_of::<V>());
        for (k, v) in writes {
            let b = key_bytes(k);
            key_size = b.len();
            keys.extend_from_slice(&b);
            values.extend_from_slice(pod_bytes(v));
        }
        sys::update_batch(raw.fd(), key_size, size_of::<V>(), &keys, &values)
            .map_err(|source| AgentError::Reconcile { map, source })?;
    }
    report.added += d.add.len();
    report.updated += d.update.len();
    report.removed += d.delete.len();
    *report.per_map.entry(map.to_string()).or_default() += d.len();
    Ok(())
}

/// First half of a slot array's diff: every slot that must lose what it
/// holds (to nothing or to another entry) is zeroed.
fn clear_slots<V: aya::Pod + Default>(
    maps: &PinnedMaps,
    map: &'static str,
    d: &MapDiff<u32, V>,
) -> Result<(), AgentError> {
    let slots: Vec<u32> = d
        .delete
        .iter()
        .copied()
        .chain(d.update.iter().map(|(k, _)| *k))
        .collect();
    if slots.is_empty() {
        return Ok(());
    }
    let raw = maps.raw(map)?;
    let keys: Vec<u8> = slots.iter().flat_map(|k| k.to_ne_bytes()).collect();
    let zero = V::default();
    let values: Vec<u8> = slots
        .iter()
        .flat_map(|_| pod_bytes(&zero).to_vec())
        .collect();
    sys::update_batch(raw.fd(), 4, size_of::<V>(), &keys, &values)
        .map_err(|source| AgentError::Reconcile { map, source })
}

/// Second half: the slots that must hold an entry get it (all of them empty
/// by now), and the whole diff is counted.
fn fill_slots<V: aya::Pod + Default + Clone>(
    maps: &PinnedMaps,
    map: &'static str,
    d: &MapDiff<u32, V>,
    report: &mut ReconcileReport,
) -> Result<(), AgentError> {
    let writes = MapDiff {
        add: d.add.iter().chain(&d.update).cloned().collect(),
        update: Vec::new(),
        delete: Vec::new(),
    };
    apply(
        maps,
        map,
        &writes,
        |k| k.to_ne_bytes().to_vec(),
        &mut ReconcileReport::default(),
    )?;
    report.added += d.add.len();
    report.updated += d.update.len();
    report.removed += d.delete.len();
    if !d.is_empty() {
        *report.per_map.entry(map.to_string()).or_default() += d.len();
    }
    Ok(())
}

fn drift<K, V>(map: &str, d: &MapDiff<K, V>, show: impl Fn(&K) -> String, out: &mut Vec<Drift>) {
    let mut push = |k: &K, kind: &str| {
        out.push(Drift {
            map: map.to_string(),
            key: show(k),
            kind: kind.to_string(),
        })
    };
    for (k, _) in &d.add {
        push(k, "missing");
    }
    for (k, _) in &d.update {
        push(k, "different");
    }
    for k in &d.delete {
        push(k, "unexpected");
    }
}

impl Agent {
    /// Starts the agent: opens the datapath and the store, restores every
    /// allocation into the core, reconciles the maps, and becomes ready.
    ///
    /// # Errors
    /// Any of those steps failed; the agent must not serve.
    pub fn start(config: Config) -> Result<Self, AgentError> {
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
        let mut manager =
            PoolManager::new(StaticPools(config.pools.clone()), ManagerConfig::default())?;
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
            stats: Stats::default(),
        };
        agent.attach_uplink()?;
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
            && !p.cidrs().any(|c| Family::of_net(c.cidr) == family)
        {
            // Not "exhausted": no amount of releasing will ever satisfy it.
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

    fn desired(&self) -> Result<MapContents, AgentError> {
        let invalid = |e: lockstep_core::plan::PlanError| AgentError::Invalid {
            reason: e.to_string(),
        };
        // Allocations are host entries (the flat, sorted form); the tries
        // carry pools' and config's prefixes.
        let ifindex: BTreeMap<(&str, &str), u32> = self
            .endpoints
            .values()
            .filter(|e| e.mode == EndpointMode::Full)
            .map(|e| ((e.container_id.as_str(), e.ifname.as_str()), e.host_ifindex))
            .collect();
        let delegated = self.delegated_allocations();
        let all = self.committed_allocations().chain(delegated.iter());
        let hosts = host_entries(all, |a| match &a.owner {
            Owner::Endpoint {
                container_id,
                ifname,
            }
            | Owner::Delegated {
                container_id,
                ifname,
            } => EntryExtra {
                ifindex: ifindex
                    .get(&(container_id.as_str(), ifname.as_str()))
                    .copied()
                    .unwrap_or(0),
                ..EntryExtra::default()
            },
            _ => EntryExtra::default(),
        })
        .map_err(invalid)?;
        let hosts = self.merge_lb(hosts);
        let announced_ingress = self
            .config
            .roles
            .ingress
            .announce
            .then(|| {
                self.manager
                    .allocations()
                    .find_map(|a| match (&a.owner, a.address) {
                        (
                            Owner::Agent {
                                role: lockstep_core::owner::AgentRole::Ingress,
                            },
                            IpAddr::V4(v4),
                        ) => Some(v4),
                        _ => None,
                    })
            })
            .flatten();
        let mut l2: Vec<(V4Addr, L2RespValue)> = match &self.uplink {
            Some(up) => self
                .lb
                .plan()
                .l2_announce_v4
                .into_keys()
                .chain(announced_ingress)
                .map(|a| {
                    (
                        a.octets(),
                        L2RespValue {
                            ifindex: up.index,
                            mac: up.mac,
                            ..Default::default()
                        },
                    )
                })
                .collect(),
            None => Vec::new(),
        };
        l2.sort_unstable_by_key(|e| e.0);
        let mut endpoint_entries: Vec<(u32, EndpointValue)> = self
            .endpoints
            .values()
            .filter(|e| e.mode == EndpointMode::Full)
            .map(|e| {
                let owner = Owner::endpoint(&e.container_id, &e.ifname);
                let generation = self
                    .manager
                    .owned_by(&owner)
                    .map(|a| a.generation.0)
                    .max()
                    .or_else(|| self.delegated.get(&e.key()).map(|d| d.generation.0))
                    .unwrap_or(0);
                (e.host_ifindex, endpoints::endpoint_value(e, generation))
            })
            .collect();
        endpoint_entries.sort_unstable_by_key(|e| e.0);
        // The hashes hold sealed values (`lockstep_common::seal`): desired
        // values are sealed too, so a value whose seal fails (which the
        // programs read as absent) is drift, and reconcile writes seals.
        for (ifindex, v) in &mut endpoint_entries {
            *v = v.sealed(*ifindex);
        }
        for (addr, v) in &mut l2 {
            *v = v.sealed(*addr);
        }
        let mut b = PlanBuilder::default();
        for (cidr, pool_id) in self.manager.masq_skip_cidrs() {
            b.masq_skip([cidr], masq_reason::POOL, pool_id);
        }
        b.masq_skip(
            self.config.non_masquerade_cidrs.iter().copied(),
            masq_reason::CONFIG,
            0,
        );
        let plan = b.finish();
        let endpoint_slots = direct_mapped(&endpoint_entries, |k| slots::endpoint(*k))
            .into_iter()
            .map(|(slot, k, v)| (slot, EndpointSlot::new(k, &v)))
            .collect();
        let l2_slots = direct_mapped(&l2, |k| slots::l2_resp(*k))
            .into_iter()
            .map(|(slot, k, v)| (slot, L2RespSlot::new(k, &v)))
            .collect();
        Ok(MapContents {
            l2,
            endpoints: endpoint_entries,
            endpoint_slots,
            l2_slots,
            host_v4: hosts.v4,
            host_v6: hosts.v6,
            prefix_v4: plan.ipcache_v4,
            prefix_v6: plan.ipcache_v6,
            masq_v4: plan.masq_skip_v4,
            masq_v6: plan.masq_skip_v6,
        })
    }

    fn observed(&self) -> Result<MapContents, AgentError> {
        MapContents::observe(&self.maps)
    }

    fn reconcile_inner(&mut self) -> Result<ReconcileReport, AgentError> {
        let started = Instant::now();
        let want = self.desired()?;
        let have = self.observed()?;
        // The maps the programs use, by descriptor: never a pin's path.
        let root = &self.maps;
        let mut report = ReconcileReport::default();
        // Slots are cleared before and filled after their hashes change, so
        // a slot never holds what its hash does not (see
        // `lockstep_common::slots`).
        let endpoint_slots = diff_sorted(&want.endpoint_slots, &have.endpoint_slots);
        let l2_slots = diff_sorted(&want.l2_slots, &have.l2_slots);
        clear_slots::<EndpointSlot>(root, map_names::ENDPOINT_SLOTS, &endpoint_slots)?;
        clear_slots::<L2RespSlot>(root, map_names::L2_RESP_SLOTS, &l2_slots)?;
        apply(
            root,
            map_names::L2_RESP_V4,
            &diff_sorted(&want.l2, &have.l2),
            |k| k.to_vec(),
            &mut report,
        )?;
        apply(
            root,
            map_names::ENDPOINTS,
            &diff_sorted(&want.endpoints, &have.endpoints),
            |k| k.to_ne_bytes().to_vec(),
            &mut report,
        )?;
        apply(
            root,
            map_names::IPCACHE_HOST_V4,
            &diff_sorted(&want.host_v4, &have.host_v4),
            |k| k.to_vec(),
            &mut report,
        )?;
        apply(
            root,
            map_names::IPCACHE_HOST_V6,
            &diff_sorted(&want.host_v6, &have.host_v6),
            |k| k.to_vec(),
            &mut report,
        )?;
        apply(
            root,
            map_names::IPCACHE_V4,
            &diff(&want.prefix_v4, &have.prefix_v4),
            |n| lpm_key_bytes(n.prefix_len(), &n.network().octets()),
            &mut report,
        )?;
        apply(
            root,
            map_names::IPCACHE_V6,
            &diff(&want.prefix_v6, &have.prefix_v6),
            |n| lpm_key_bytes(n.prefix_len(), &n.network().octets()),
            &mut report,
        )?;
        apply(
            root,
            map_names::MASQ_SKIP_V4,
            &diff(&want.masq_v4, &have.masq_v4),
            |n| lpm_key_bytes(n.prefix_len(), &n.network().octets()),
            &mut report,
        )?;
        apply(
            root,
            map_names::MASQ_SKIP_V6,
            &diff(&want.masq_v6, &have.masq_v6),
            |n| lpm_key_bytes(n.prefix_len(), &n.network().octets()),
            &mut report,
        )?;
        fill_slots(
            root,
            map_names::ENDPOINT_SLOTS,
            &endpoint_slots,
            &mut report,
        )?;
        fill_slots(root, map_names::L2_RESP_SLOTS, &l2_slots, &mut report)?;
        self.stats.entries = BTreeMap::from([
            (map_names::IPCACHE_HOST_V4, want.host_v4.len()),
            (map_names::IPCACHE_HOST_V6, want.host_v6.len()),
            (map_names::IPCACHE_V4, want.prefix_v4.len()),
            (map_names::IPCACHE_V6, want.prefix_v6.len()),
            (map_names::MASQ_SKIP_V4, want.masq_v4.len()),
            (map_names::MASQ_SKIP_V6, want.masq_v6.len()),
        ]);
        report.micros = started.elapsed().as_micros() as u64;
        Ok(report)
    }

    /// Compares the maps with the store-derived plan and applies the
    /// difference (batch syscalls). Counts the changes as repairs.
    ///
    /// # Errors
    /// A map could not be read or written.
    pub fn reconcile(&mut self) -> Result<ReconcileReport, AgentError> {
        // A store that failed (a full disk) recovers here too, so the agent
        // becomes ready again without waiting for a request.
        if let Err(e) = self.store.recover() {
            tracing::warn!(error = %e, "the store is still failing");
        }
        self.settle();
        self.guard_pins()?;
        let report = self.reconcile_inner()?;
        for (map, n) in &report.per_map {
            *self.stats.repairs.entry(map.clone()).or_default() += *n as u64;
        }
        if report.total() > 0 {
            tracing::warn!(?report, "reconcile repaired drift");
        }
        Ok(report)
    }

    /// Compares store, core and maps without changing anything.
    ///
    /// # Errors
    /// The store or a map could not be read.
    pub fn verify(&self) -> Result<VerifyReport, AgentError> {
        let mut report = VerifyReport::default();
        let stored = self.store.load()?;
        // A parked release is held in memory and stored, on purpose, until
        // the store accepts its removal: named, never silent.
        report.store.extend(self.parked.describe());
        let mut in_store: Vec<&Allocation> = stored
            .allocations
            .iter()
            // A pending release (`reaper`) is held and stored, unmapped,
            // for the moments its veth takes to go.
            .filter(|a| !self.parked.holds(a) && !self.reaper.holds(a))
            .collect();
        let mut in_memory: Vec<&Allocation> = self.committed_allocations().collect();
        in_store.sort();
        in_memory.sort();
        for a in &in_memory {
            if in_store.binary_search(a).is_err() {
                report.store.push(format!(
                    "{} {} held in memory but not stored",
                    a.address, a.owner
                ));
            }
        }
        for a in &in_store {
            if in_memory.binary_search(a).is_err() {
                report
                    .store
                    .push(format!("{} {} stored but not held", a.address, a.owner));
            }
        }
        let want = self.desired()?;
        let have = self.observed()?;
        let show4 = |k: &V4Addr| std::net::Ipv4Addr::from(*k).to_string();
        let show6 = |k: &V6Addr| std::net::Ipv6Addr::from(*k).to_string();
        drift(
            map_names::L2_RESP_V4,
            &diff_sorted(&want.l2, &have.l2),
            |k| std::net::Ipv4Addr::from(*k).to_string(),
            &mut report.maps,
        );
        drift(
            map_names::ENDPOINTS,
            &diff_sorted(&want.endpoints, &have.endpoints),
            |k| format!("ifindex {k}"),
            &mut report.maps,
        );
        drift(
            map_names::ENDPOINT_SLOTS,
            &diff_sorted(&want.endpoint_slots, &have.endpoint_slots),
            |k| format!("slot {k}"),
            &mut report.maps,
        );
        drift(
            map_names::L2_RESP_SLOTS,
            &diff_sorted(&want.l2_slots, &have.l2_slots),
            |k| format!("slot {k}"),
            &mut report.maps,
        );
        if let Some(host) = self.netlink.as_ref() {
            for e in self
                .endpoints
                .values()
                .filter(|e| e.mode == EndpointMode::Full)
            {
                let name = e.host_ifname.clone().unwrap_or_default();
                match host.link(&name) {
                    Ok(Some(l)) if l.index == e.host_ifindex => {}
                    _ => report.store.push(format!(
                        "interface {name} of {}/{} is missing",
                        e.container_id, e.ifname
                    )),
                }
            }
        }
        drift(
            map_names::IPCACHE_HOST_V4,
            &diff_sorted(&want.host_v4, &have.host_v4),
            show4,
            &mut report.maps,
        );
        drift(
            map_names::IPCACHE_HOST_V6,
            &diff_sorted(&want.host_v6, &have.host_v6),
            show6,
            &mut report.maps,
        );
        drift(
            map_names::IPCACHE_V4,
            &diff(&want.prefix_v4, &have.prefix_v4),
            |n| n.to_string(),
            &mut report.maps,
        );
        drift(
            map_names::IPCACHE_V6,
            &diff(&want.prefix_v6, &have.prefix_v6),
            |n| n.to_string(),
            &mut report.maps,
        );
        drift(
            map_names::MASQ_SKIP_V4,
            &diff(&want.masq_v4, &have.masq_v4),
            |n| n.to_string(),
            &mut report.maps,
        );
        drift(
            map_names::MASQ_SKIP_V6,
            &diff(&want.masq_v6, &have.masq_v6),
            |n| n.to_string(),
            &mut report.maps,
        );
        report.pins = self.verify_pins();
        report.draining = self.draining();
        report.ok = report.store.is_empty() && report.maps.is_empty() && report.pins.is_empty();
        Ok(report)
    }

    /// Every allocation.
    pub fn allocations(&self) -> Vec<Allocation> {
        let mut all: Vec<Allocation> = self.manager.allocations().cloned().collect();
        all.extend(self.delegated_allocations());
        all.sort();
        all
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
                    p.cidrs()
                        .filter(|c| Family::of_net(c.cidr) == fam)
                        .fold((0u128, 0u128), |(u, f), c| {
                            (u + c.used, f + (c.capacity - c.used))
                        })
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
        let pool = match &self.config.roles.pool {
            Some(p) => p.clone(),
            None => self.default_pool()?,
        };
        let r = &self.config.roles;
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
        Ok(())
    }

    /// Adds LoadBalancer addresses to the node's host entries. An address
    /// held by both (impossible while LB pools are refused when they overlap
    /// node pools) keeps the node's entry and is logged.
    fn merge_lb(
        &self,
        mut hosts: lockstep_core::plan::HostEntries,
    ) -> lockstep_core::plan::HostEntries {
        let mut extra = false;
        for (addr, value) in self.lb_host_entries() {
            match addr {
                IpAddr::V4(a) => match hosts.v4.binary_search_by_key(&a.octets(), |e| e.0) {
                    Ok(_) => tracing::error!(%a, "an LB address is also a node allocation"),
                    Err(_) => {
                        hosts.v4.push((a.octets(), value));
                        extra = true;
                    }
                },
                IpAddr::V6(a) => match hosts.v6.binary_search_by_key(&a.octets(), |e| e.0) {
                    Ok(_) => tracing::error!(%a, "an LB address is also a node allocation"),
                    Err(_) => {
                        hosts.v6.push((a.octets(), value));
                        extra = true;
                    }
                },
            }
        }
        if extra {
            hosts.v4.sort_unstable_by_key(|e| e.0);
            hosts.v6.sort_unstable_by_key(|e| e.0);
        }
        hosts
    }

    /// Allocations that are committed: all but those of attachments between
    /// ADD's phases.
    fn committed_allocations(&self) -> impl Iterator<Item = &Allocation> + '_ {
        self.manager
            .allocations()
            .filter(|a| !self.parked.holds(a) && !self.reaper.holds(a))
            .filter(|a| match &a.owner {
                Owner::Endpoint {
                    container_id,
                    ifname,
                } => !self
                    .pending
                    .contains(&crate::store::endpoint_key(container_id, ifname)),
                _ => true,
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

    /// Status.
    pub fn status(&self) -> Status {
        let store = self.store.health();
        let pins = self.pin_problem();
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
