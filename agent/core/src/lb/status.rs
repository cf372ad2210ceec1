//! What LB IPAM reports and persists: service and pool status, metrics, the
//! datapath plan and the snapshot. Kept apart from the state machine
//! (`ipam`) so that readers of the API types need not read the engine.

use std::collections::BTreeMap;
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::{Ipv4Net, Ipv6Net};
use lockstep_common::IpcacheValue;
use serde::{Deserialize, Serialize};

use super::index::Conflict;
use super::spec::{LbPoolSpec, ServicePort, ServiceSpec};
use crate::cidr::Family;
use crate::manager::ManagerSnapshot;

/// One address a service holds.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Holding {
    /// The address.
    pub address: IpAddr,
    /// The pool it belongs to.
    pub pool: String,
}

/// Why a service (or one of its families) has no address.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum PendingReason {
    /// No pool with addresses of the family selects the service.
    NoPoolSelects {
        /// The family.
        family: Family,
    },
    /// Every usable pool selecting the service is full in that family.
    Exhausted {
        /// The family.
        family: Family,
        /// The pools tried, in order.
        pools: Vec<String>,
    },
    /// The requested address is in no pool.
    RequestedOutsidePools {
        /// The requested address.
        address: IpAddr,
    },
    /// The requested address is in a pool that does not select the service.
    RequestedNotSelected {
        /// The requested address.
        address: IpAddr,
        /// Its pool.
        pool: String,
    },
    /// The requested address is a first or last address its pool excludes.
    AddressUnusable {
        /// The requested address.
        address: IpAddr,
        /// Its pool.
        pool: String,
    },
    /// The requested address is held by a service it cannot be shared with.
    AddressTaken {
        /// The requested address.
        address: IpAddr,
        /// The service holding it (`namespace/name`).
        by: String,
    },
    /// The only pools that would serve the service are conflicting.
    PoolConflicting {
        /// The conflicting pool.
        pool: String,
        /// What it conflicts with.
        conflict: Conflict,
    },
    /// The only pools that would serve the service are disabled.
    PoolDisabled {
        /// The disabled pool.
        pool: String,
    },
    /// The address of the sharing key is used by a service with a common
    /// port.
    SharingPortClash {
        /// The shared address.
        address: IpAddr,
        /// The service using the port there.
        with: String,
        /// The port both use.
        port: ServicePort,
    },
}

impl PendingReason {
    /// Stable snake_case name of the reason, for metrics labels.
    pub fn kind(&self) -> &'static str {
        match self {
            PendingReason::NoPoolSelects { .. } => "no_pool_selects",
            PendingReason::Exhausted { .. } => "exhausted",
            PendingReason::RequestedOutsidePools { .. } => "requested_outside_pools",
            PendingReason::RequestedNotSelected { .. } => "requested_not_selected",
            PendingReason::AddressUnusable { .. } => "address_unusable",
            PendingReason::AddressTaken { .. } => "address_taken",
            PendingReason::PoolConflicting { .. } => "pool_conflicting",
            PendingReason::PoolDisabled { .. } => "pool_disabled",
            PendingReason::SharingPortClash { .. } => "sharing_port_clash",
        }
    }
}

impl fmt::Display for PendingReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PendingReason::NoPoolSelects { family } => {
                write!(
                    f,
                    "no usable pool with {family} addresses selects the service"
                )
            }
            PendingReason::Exhausted { family, pools } => {
                write!(f, "no free {family} address in pools {}", pools.join(", "))
            }
            PendingReason::RequestedOutsidePools { address } => {
                write!(f, "requested address {address} is outside every pool")
            }
            PendingReason::RequestedNotSelected { address, pool } => write!(
                f,
                "requested address {address} is in pool {pool}, which does not select the service"
            ),
            PendingReason::AddressUnusable { address, pool } => write!(
                f,
                "requested address {address} is a first or last address pool {pool} excludes"
            ),
            PendingReason::AddressTaken { address, by } => {
                write!(f, "address {address} is taken by {by}")
            }
            PendingReason::PoolConflicting { pool, conflict } => write!(
                f,
                "pool {pool} is conflicting: {} overlaps {} of pool {}",
                conflict.block, conflict.other_block, conflict.pool
            ),
            PendingReason::PoolDisabled { pool } => write!(f, "pool {pool} is disabled"),
            PendingReason::SharingPortClash {
                address,
                with,
                port,
            } => write!(f, "sharing {address}: port {port} is used by {with}"),
        }
    }
}

/// Why a service lost an address it held.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ChangeCause {
    /// The pool was deleted.
    PoolDeleted,
    /// The pool no longer contains the address (blocks edited, or the
    /// address became an excluded first/last address).
    OutsidePool,
    /// The pool was disabled.
    PoolDisabled,
    /// The pool became conflicting.
    PoolConflicting,
    /// The pool's selector no longer selects the service (or its labels
    /// changed).
    NotSelected,
    /// The service now requests another address.
    RequestChanged,
    /// The service no longer uses that family.
    FamilyDropped,
    /// The service's sharing key no longer matches the address's other users.
    SharingChanged,
    /// The service's ports now clash with another user of the address.
    SharingPortClash,
    /// RequireDualStack: the other family could not be served.
    DualStackIncomplete,
}

impl fmt::Display for ChangeCause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ChangeCause::PoolDeleted => "the pool was deleted",
            ChangeCause::OutsidePool => "the pool no longer contains it",
            ChangeCause::PoolDisabled => "the pool was disabled",
            ChangeCause::PoolConflicting => "the pool became conflicting",
            ChangeCause::NotSelected => "the pool no longer selects the service",
            ChangeCause::RequestChanged => "the service requests another address",
            ChangeCause::FamilyDropped => "the service no longer uses this family",
            ChangeCause::SharingChanged => "the sharing key changed",
            ChangeCause::SharingPortClash => "its ports clash with a sharing service",
            ChangeCause::DualStackIncomplete => "the other family could not be served",
        })
    }
}

/// The last time a service lost an address, and why.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChangeReason {
    /// The address it lost.
    pub address: IpAddr,
    /// The pool the address was in.
    pub pool: String,
    /// Why.
    pub cause: ChangeCause,
}

impl fmt::Display for ChangeReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "released {} of pool {}: {}",
            self.address, self.pool, self.cause
        )
    }
}

/// A service's addresses, or why it has none.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "snake_case", deny_unknown_fields)]
pub enum Assignment {
    /// Addresses held, in the service's family order.
    Assigned {
        /// The addresses.
        addresses: Vec<IpAddr>,
    },
    /// Nothing held.
    Pending {
        /// Why (for dual stack: the first family that failed).
        reason: PendingReason,
    },
}

/// Status of one service, as `lockstep lb` and the Service status show it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServiceStatus {
    /// Addresses or the pending reason.
    pub assignment: Assignment,
    /// PreferDualStack with one family served: why the other is not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub missing_family: Option<PendingReason>,
    /// The last time the service lost an address, and why.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_change_reason: Option<ChangeReason>,
}

impl ServiceStatus {
    /// The assigned addresses (empty when pending).
    pub fn addresses(&self) -> &[IpAddr] {
        match &self.assignment {
            Assignment::Assigned { addresses } => addresses,
            Assignment::Pending { .. } => &[],
        }
    }

    /// The pending reason, if pending.
    pub fn pending(&self) -> Option<&PendingReason> {
        match &self.assignment {
            Assignment::Pending { reason } => Some(reason),
            Assignment::Assigned { .. } => None,
        }
    }
}

/// Usage figures of one pool, for metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolMetrics {
    /// Addresses the pool hands out (both families).
    pub capacity: u128,
    /// Addresses in use.
    pub used: u128,
    /// Addresses free for allocation (0 for a disabled or conflicting pool).
    pub free: u128,
    /// Whether the pool is conflicting.
    pub conflicting: bool,
    /// Whether the pool is disabled.
    pub disabled: bool,
}

/// Metrics of the whole LB IPAM.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LbMetrics {
    /// Per pool.
    pub pools: BTreeMap<String, PoolMetrics>,
    /// Services with at least one address.
    pub assigned: usize,
    /// Pending services by [`PendingReason::kind`].
    pub pending_by_reason: BTreeMap<String, usize>,
}

/// A pool as the API shows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PoolStatus {
    /// The definition.
    pub spec: LbPoolSpec,
    /// First-apply order (lower wins conflicts and is tried first).
    pub seq: u64,
    /// Why the pool is not used, if it conflicts.
    pub conflict: Option<Conflict>,
    /// Usage.
    pub metrics: PoolMetrics,
}

/// Desired LB datapath contents, for [`crate::plan::diff`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LbPlan {
    /// IPCACHE_V4 host entries of assigned addresses.
    pub ipcache_v4: BTreeMap<Ipv4Net, IpcacheValue>,
    /// IPCACHE_V6 host entries of assigned addresses.
    pub ipcache_v6: BTreeMap<Ipv6Net, IpcacheValue>,
    /// IPv4 addresses of `announce = "l2"` pools → pool name; the daemon
    /// turns each into an L2_RESP_V4 entry with its interface and MAC.
    pub l2_announce_v4: BTreeMap<Ipv4Addr, String>,
    /// IPv6 addresses of `announce = "l2"` pools → pool name; the daemon
    /// turns each into an L2_RESP_V6 entry (the NDP responder's).
    pub l2_announce_v6: BTreeMap<Ipv6Addr, String>,
}

/// A pool in an [`LbSnapshot`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolRecord {
    /// First-apply order.
    pub seq: u64,
    /// The definition.
    pub spec: LbPoolSpec,
}

/// A service in an [`LbSnapshot`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServiceRecord {
    /// First-apply order.
    pub seq: u64,
    /// The definition.
    pub spec: ServiceSpec,
    /// What it holds.
    pub held: Vec<Holding>,
    /// Its status.
    pub status: ServiceStatus,
}

/// Everything needed to rebuild an [`LbIpam`](crate::lb::LbIpam) exactly. Serialisable.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LbSnapshot {
    /// The next pool sequence number.
    pub next_pool_seq: u64,
    /// Pools in first-apply order.
    pub pools: Vec<PoolRecord>,
    /// The next service sequence number.
    pub next_service_seq: u64,
    /// Services by `namespace/name`.
    pub services: Vec<ServiceRecord>,
    /// The allocator (allocations, generations, cursors).
    pub manager: ManagerSnapshot,
}
