//! The agent's doors: the small traits through which the agent programs the
//! maps and commits to the store. The agent owns them; the datapath and the
//! store implement them, and unit tests put in-memory doubles behind them
//! (the `doubles` module, test builds only) that can be told to fail at a
//! given call, so every rollback path is exercised without root.
//!
//! Errors come back as the datapath's and the store's own types
//! ([`DatapathError::MapFull`] for a full map), never as aya or libc codes
//! for the agent to match.

use ipnet::IpNet;
use lockstep_common::{EndpointValue, IpcacheValue, L2RespValue, V4Addr};
use lockstep_core::lb::LbSnapshot;
use lockstep_core::manager::Allocation;
use lockstep_core::owner::Generation;

use super::release::ReleaseStore;
pub use crate::datapath::maps::ipcache_map;
use crate::datapath::{DatapathError, PinnedMaps};
use crate::store::{EndpointRecord, Store, StoreError};

#[cfg(test)]
pub(crate) mod doubles;

/// The maps the agent programs single entries through (reconcile works on
/// whole maps and stays with the datapath's batch calls).
pub trait MapDoor {
    /// Writes an IPCACHE entry: a host entry for a /32 or /128, a prefix
    /// otherwise.
    ///
    /// # Errors
    /// [`DatapathError::MapFull`], or another refused write.
    fn ipcache_insert(&mut self, prefix: IpNet, value: IpcacheValue) -> Result<(), DatapathError>;

    /// Removes an IPCACHE entry; returns whether it existed.
    ///
    /// # Errors
    /// A refused delete.
    fn ipcache_remove(&mut self, prefix: IpNet) -> Result<bool, DatapathError>;

    /// Writes the ENDPOINTS entry of `ifindex` (and its slot).
    ///
    /// # Errors
    /// [`DatapathError::MapFull`], or another refused write.
    fn endpoint_insert(&mut self, ifindex: u32, value: &EndpointValue)
    -> Result<(), DatapathError>;

    /// Removes the ENDPOINTS entry of `ifindex` (and its slot); returns
    /// whether it existed.
    ///
    /// # Errors
    /// A refused write.
    fn endpoint_remove(&mut self, ifindex: u32) -> Result<bool, DatapathError>;

    /// Writes the L2_RESP_V4 entry of `addr` (and its slot).
    ///
    /// # Errors
    /// [`DatapathError::MapFull`], or another refused write.
    fn l2_insert(&mut self, addr: V4Addr, value: &L2RespValue) -> Result<(), DatapathError>;

    /// Removes the L2_RESP_V4 entry of `addr` (and its slot); returns
    /// whether it existed.
    ///
    /// # Errors
    /// A refused write.
    fn l2_remove(&mut self, addr: V4Addr) -> Result<bool, DatapathError>;

    /// Removes every masquerade translation of the endpoint address `addr`
    /// (forward and reverse); returns how many entries went.
    ///
    /// # Errors
    /// A refused delete.
    fn nat_remove(&mut self, addr: std::net::IpAddr) -> Result<u64, DatapathError>;
}

impl MapDoor for PinnedMaps {
    fn ipcache_insert(&mut self, prefix: IpNet, value: IpcacheValue) -> Result<(), DatapathError> {
        PinnedMaps::ipcache_insert(self, prefix, value)
    }

    fn ipcache_remove(&mut self, prefix: IpNet) -> Result<bool, DatapathError> {
        PinnedMaps::ipcache_remove(self, prefix)
    }

    fn endpoint_insert(
        &mut self,
        ifindex: u32,
        value: &EndpointValue,
    ) -> Result<(), DatapathError> {
        PinnedMaps::endpoint_insert(self, ifindex, value)
    }

    fn endpoint_remove(&mut self, ifindex: u32) -> Result<bool, DatapathError> {
        PinnedMaps::endpoint_remove(self, ifindex)
    }

    fn l2_insert(&mut self, addr: V4Addr, value: &L2RespValue) -> Result<(), DatapathError> {
        PinnedMaps::l2_insert(self, addr, value)
    }

    fn l2_remove(&mut self, addr: V4Addr) -> Result<bool, DatapathError> {
        PinnedMaps::l2_remove(self, addr)
    }

    fn nat_remove(&mut self, addr: std::net::IpAddr) -> Result<u64, DatapathError> {
        PinnedMaps::remove_nat_of(self, addr)
    }
}

/// The host side of an endpoint's interfaces, as an ADD's undo needs it:
/// detach the endpoint program and delete the veth. (Making them stays with
/// `endpoints::build_interfaces`, off the agent's owner; the netlink,
/// ioctl and namespace work itself lives in `netlink`.)
pub trait LinkDoor {
    /// Detaches the endpoint program from, and deletes, host veth `name`
    /// (index `ifindex`); already gone is fine. Both steps are tried.
    ///
    /// # Errors
    /// Every step that failed.
    fn remove_host(&mut self, name: &str, ifindex: u32) -> Result<(), super::AgentError>;
}

/// The store's commits the agent makes (each one fsync'd transaction).
pub trait StoreDoor: ReleaseStore {
    /// Records one allocation and raises the generation high-water mark.
    ///
    /// # Errors
    /// The commit failed; nothing was written.
    fn put(&self, a: &Allocation, high_water: Generation) -> Result<(), StoreError>;

    /// Records an endpoint (if any) and its allocations in one commit.
    ///
    /// # Errors
    /// The commit failed; nothing was written.
    fn put_endpoint(
        &self,
        endpoint: Option<&EndpointRecord>,
        all: &[Allocation],
        high_water: Generation,
    ) -> Result<(), StoreError>;

    /// Replaces the LoadBalancer IPAM state.
    ///
    /// # Errors
    /// The commit failed; the old state stays.
    fn put_lb(&self, state: &LbSnapshot) -> Result<(), StoreError>;
}

impl StoreDoor for Store {
    fn put(&self, a: &Allocation, high_water: Generation) -> Result<(), StoreError> {
        Store::put(self, a, high_water)
    }

    fn put_endpoint(
        &self,
        endpoint: Option<&EndpointRecord>,
        all: &[Allocation],
        high_water: Generation,
    ) -> Result<(), StoreError> {
        Store::put_endpoint(self, endpoint, all, high_water)
    }

    fn put_lb(&self, state: &LbSnapshot) -> Result<(), StoreError> {
        Store::put_lb(self, state)
    }
}
