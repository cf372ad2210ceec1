//! The agent's error type: one enum for every operation, each variant with a
//! stable API code, and the helpers that report several failures as one.
//!
//! It lives apart from the operations so that every module of the agent (and
//! the API server mapping codes to HTTP statuses) shares one definition.

use super::*;
use crate::map_table::MapTableError;

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
    /// A pool had no free address but pending releases (pods DEL'd, their
    /// interfaces not yet gone) hold some, and they did not come free
    /// within the ADD's wait.
    #[error(
        "pool {pool} has no free {family} address yet: {pending} held by pods being torn down (their interfaces not yet gone)"
    )]
    AddressesReleasing {
        /// The pool.
        pool: String,
        /// The family asked for.
        family: Family,
        /// How many of its addresses pending releases hold.
        pending: usize,
    },
    /// A DEL's interface was not gone within its wait (the kernel has not
    /// deleted the veth yet); the release stays pending and a repeated DEL
    /// waits again.
    #[error("{attachment}: its interface is still being deleted after {waited:?}; try again")]
    InterfaceLingering {
        /// container id/ifname.
        attachment: String,
        /// How long the DEL waited.
        waited: std::time::Duration,
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

/// A map of the table that could not be read or written, as the agent's
/// own variants for it: a pin not opened ([`AgentError::Datapath`]), a
/// trie not read ([`AgentError::Program`]), a batch syscall refused
/// ([`AgentError::Reconcile`]).
impl From<MapTableError> for AgentError {
    fn from(e: MapTableError) -> Self {
        match e {
            MapTableError::Datapath(e) => AgentError::Datapath(e),
            MapTableError::Read { map, source } => AgentError::Program { map, source },
            MapTableError::Reconcile { map, source } => AgentError::Reconcile { map, source },
        }
    }
}

impl From<ManagerError> for AgentError {
    fn from(e: ManagerError) -> Self {
        AgentError::Allocation(Box::new(e))
    }
}

impl AgentError {
    /// The pool and family an allocation found without a free address, if
    /// that is what this is.
    pub fn exhausted(&self) -> Option<(&str, Family)> {
        match self {
            AgentError::Allocation(e) => match e.as_ref() {
                ManagerError::PoolExhausted { pool, family, .. } => Some((pool, *family)),
                _ => None,
            },
            _ => None,
        }
    }

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
            AgentError::Busy { .. }
            | AgentError::AddressesReleasing { .. }
            | AgentError::InterfaceLingering { .. } => "busy",
            AgentError::Datapath(_) => "datapath_error",
            AgentError::Delegate(_) => "ipam_plugin_error",
            AgentError::ReleasePending { .. } => "store_error",
            AgentError::LbInconsistent { .. } => "internal",
            AgentError::Several { errors } => errors.first().map_or("internal", AgentError::code),
        }
    }
}
