//! An endpoint's ADD and DEL effects in lockstep, through the doors: after
//! the interfaces are made, commit → program → acknowledge, and the undo of
//! each step; DEL's unprogram → commit → release. The agent's
//! `endpoint_add_finish` and `endpoint_del` run these; unit tests run them
//! against the doors' doubles.
//!
//! Every undo step is tried and its failure reported after the cause; the
//! core releases an address only once the store has (a refused removal
//! parks the release), so core and store never disagree silently.

use lockstep_core::manager::{Allocation, PoolManager, PoolSource};

use super::AgentError;
use super::allocation::{datapath_error, value_for};
use super::doors::{LinkDoor, MapDoor, StoreDoor};
use super::release::ParkedReleases;
use crate::store::{EndpointMode, EndpointRecord};

/// The endpoint's ENDPOINTS value.
pub(super) fn endpoint_value(
    record: &EndpointRecord,
    generation: u64,
) -> lockstep_common::EndpointValue {
    lockstep_core::plan::desired::endpoint_value(record.mac, &record.addresses, generation)
}

/// The doors and state an endpoint's effects go through.
pub struct EndpointEffects<'a, P: PoolSource, S: StoreDoor, M: MapDoor, L: LinkDoor> {
    /// The core.
    pub core: &'a mut PoolManager<P>,
    /// The store.
    pub store: &'a S,
    /// The maps.
    pub maps: &'a mut M,
    /// Host interfaces.
    pub links: &'a mut L,
    /// Releases the store has refused.
    pub parked: &'a mut ParkedReleases,
    /// IPCACHE capacity, for a full map's error.
    pub capacity: u32,
}

/// Releases `allocated` in the core, every one tried; the failures.
pub fn release_core<P: PoolSource>(
    core: &mut PoolManager<P>,
    allocated: &[Allocation],
) -> Vec<AgentError> {
    allocated
        .iter()
        .filter_map(|a| {
            core.release(&a.pool, a.family(), &a.owner, a.generation)
                .err()
                .map(AgentError::from)
        })
        .collect()
}

impl<P: PoolSource, S: StoreDoor, M: MapDoor, L: LinkDoor> EndpointEffects<'_, P, S, M, L> {
    /// The host veth of `record`, if the ADD made one.
    fn host(record: &EndpointRecord) -> Option<(&str, u32)> {
        (record.mode == EndpointMode::Full)
            .then_some(
                record
                    .host_ifname
                    .as_deref()
                    .map(|n| (n, record.host_ifindex)),
            )
            .flatten()
    }

    fn remove_host(&mut self, host: Option<(&str, u32)>, errors: &mut Vec<AgentError>) {
        if let Some((name, index)) = host
            && let Err(e) = self.links.remove_host(name, index)
        {
            errors.push(e);
        }
    }

    /// ADD after its interfaces: `interfaces` is their outcome (on failure,
    /// the host veth made before it, by name and index, if any); `record` carries the
    /// interfaces' names and MACs. Commits the record with `allocated`
    /// (held in the core, not stored yet), then programs IPCACHE and
    /// ENDPOINTS.
    ///
    /// # Errors
    /// The failing step first, then every undo step's failure: interfaces
    /// removed, entries unprogrammed, the record and allocations removed
    /// from the store (parked if it refuses) and released in the core.
    pub fn finish_add(
        &mut self,
        record: &EndpointRecord,
        allocated: &[Allocation],
        interfaces: Result<(), (AgentError, Option<(String, u32)>)>,
    ) -> Result<(), AgentError> {
        if let Err((e, made)) = interfaces {
            let mut more = Vec::new();
            self.remove_host(made.as_ref().map(|(n, i)| (n.as_str(), *i)), &mut more);
            // Nothing was committed: the core alone held them.
            more.extend(release_core(self.core, allocated));
            return Err(AgentError::with_more(e, more));
        }
        let host = Self::host(record);
        if let Err(e) = self
            .store
            .put_endpoint(Some(record), allocated, self.core.generation())
        {
            let mut more = Vec::new();
            self.remove_host(host, &mut more);
            more.extend(release_core(self.core, allocated));
            return Err(AgentError::with_more(e.into(), more));
        }
        if let Err(e) = self.program(record, allocated) {
            let mut more = self.unprogram(record, allocated);
            self.remove_host(host, &mut more);
            let key = record.key();
            if let Err(s) = self.parked.release(
                key.clone(),
                Some(key),
                allocated.to_vec(),
                self.store,
                self.core,
            ) {
                more.push(s.into());
            }
            return Err(AgentError::with_more(e, more));
        }
        Ok(())
    }

    /// [`program`] through these doors.
    ///
    /// # Errors
    /// The first write that failed.
    pub fn program(
        &mut self,
        record: &EndpointRecord,
        allocated: &[Allocation],
    ) -> Result<(), AgentError> {
        program(self.maps, self.capacity, record, allocated)
    }

    /// [`unprogram`] through these doors.
    pub fn unprogram(
        &mut self,
        record: &EndpointRecord,
        allocated: &[Allocation],
    ) -> Vec<AgentError> {
        unprogram(self.maps, record, allocated)
    }

    /// DEL of an endpoint whose addresses go at once (IPAM mode, or no
    /// record): unprograms every entry, and only if all went, removes the
    /// record and allocations from the store, then releases them in the
    /// core. No map entry outlives its allocation. Returns the core's
    /// faults (it did not hold what the store let go): reported, not a
    /// reason to fail the DEL.
    ///
    /// # Errors
    /// Every entry that could not be removed (nothing is committed then, a
    /// reconcile puts back what went), or the store's refusal (the
    /// endpoint stays, whole).
    pub fn del(
        &mut self,
        key: &str,
        record: Option<&EndpointRecord>,
        allocated: &[Allocation],
    ) -> Result<Vec<AgentError>, AgentError> {
        let unprogrammed = match record {
            Some(r) => self.unprogram(r, allocated),
            None => allocated
                .iter()
                .filter_map(|a| super::allocation::unprogram(self.maps, a).err())
                .collect(),
        };
        AgentError::all(unprogrammed)?;
        self.store.remove_endpoint(record.map(|_| key), allocated)?;
        Ok(release_core(self.core, allocated))
    }
}

/// Writes an endpoint's IPCACHE host entries (a full endpoint's carry its
/// host ifindex, as the planner has them: written without it, `verify`
/// would report every new endpoint as drift) and its ENDPOINTS entry.
///
/// # Errors
/// The first write that failed ([`AgentError::MapFull`] for a full map).
pub fn program(
    maps: &mut impl MapDoor,
    capacity: u32,
    record: &EndpointRecord,
    allocated: &[Allocation],
) -> Result<(), AgentError> {
    let ifindex = match record.mode {
        EndpointMode::Full => record.host_ifindex,
        EndpointMode::Ipam => 0,
    };
    for a in allocated {
        let Some(mut value) = value_for(a) else {
            continue;
        };
        value.ifindex = ifindex;
        maps.ipcache_insert(a.address.into(), value)
            .map_err(|e| datapath_error(e, capacity))?;
    }
    if record.mode == EndpointMode::Full {
        let generation = allocated.iter().map(|a| a.generation.0).max().unwrap_or(0);
        maps.endpoint_insert(record.host_ifindex, &endpoint_value(record, generation))
            .map_err(|e| datapath_error(e, capacity))?;
    }
    Ok(())
}

/// Removes an endpoint's map entries, its masquerade translations included
/// (the program's link and the veth go with the interfaces); every entry is
/// tried. Returns what failed.
pub fn unprogram(
    maps: &mut impl MapDoor,
    record: &EndpointRecord,
    allocated: &[Allocation],
) -> Vec<AgentError> {
    let mut errors = Vec::new();
    if record.mode == EndpointMode::Full
        && let Err(e) = maps.endpoint_remove(record.host_ifindex)
    {
        errors.push(AgentError::Datapath(e));
    }
    for a in allocated {
        if let Err(e) = super::allocation::unprogram(maps, a) {
            errors.push(e);
        }
    }
    // After the IPCACHE entries: no new flow of the address is translated
    // now. Its translations go before the address can be handed out again,
    // or replies to the old pod's flows would reach the next holder.
    for a in allocated {
        if let Err(e) = maps.nat_remove(a.address) {
            errors.push(AgentError::Datapath(e));
        }
    }
    errors
}

#[cfg(test)]
mod tests;
