//! One allocation's effects in lockstep, through the doors: commit then
//! program, unprogram then commit, and the undo of each step. The agent's
//! `allocate`, `release` and role reservation run these; unit tests run them
//! against the doors' doubles.
//!
//! Every undo step is tried and every failure reported after the cause
//! ([`AgentError::with_more`]); the core lets an address go only once the
//! store has (a refused removal parks the release, see `release`), so core
//! and store never disagree silently.

use lockstep_common::IpcacheValue;
use lockstep_core::manager::{Allocation, PoolManager, PoolSource};
use lockstep_core::plan::classify;
use lockstep_core::roles::RolePlan;

use super::AgentError;
use super::doors::{MapDoor, StoreDoor};
use super::release::ParkedReleases;
use crate::datapath::DatapathError;

/// The IPCACHE value of `a`, if its owner is programmed at all.
pub fn value_for(a: &Allocation) -> Option<IpcacheValue> {
    classify(&a.owner).map(|(identity, flags)| IpcacheValue {
        identity,
        flags,
        ..Default::default()
    })
}

/// A datapath error as the agent reports it: a full map with its capacity.
pub fn datapath_error(e: DatapathError, capacity: u32) -> AgentError {
    match e {
        DatapathError::MapFull { map } => AgentError::MapFull { map, capacity },
        e => AgentError::Datapath(e),
    }
}

/// Writes `a`'s IPCACHE host entry (`capacity`: the map's, for the error).
///
/// # Errors
/// The write failed ([`AgentError::MapFull`] when the map is full).
pub fn program(maps: &mut impl MapDoor, a: &Allocation, capacity: u32) -> Result<(), AgentError> {
    let Some(value) = value_for(a) else {
        return Ok(());
    };
    maps.ipcache_insert(a.address.into(), value)
        .map_err(|e| datapath_error(e, capacity))
}

/// Removes `a`'s IPCACHE host entry; a missing one is fine.
///
/// # Errors
/// The delete failed.
pub fn unprogram(maps: &mut impl MapDoor, a: &Allocation) -> Result<(), AgentError> {
    if value_for(a).is_none() {
        return Ok(());
    }
    maps.ipcache_remove(a.address.into())
        .map(drop)
        .map_err(AgentError::Datapath)
}

/// The doors and state one allocation's effects go through.
pub struct Effects<'a, P: PoolSource, S: StoreDoor, M: MapDoor> {
    /// The core.
    pub core: &'a mut PoolManager<P>,
    /// The store.
    pub store: &'a S,
    /// The maps.
    pub maps: &'a mut M,
    /// Releases the store has refused.
    pub parked: &'a mut ParkedReleases,
    /// IPCACHE capacity, for a full map's error.
    pub capacity: u32,
}

impl<P: PoolSource, S: StoreDoor, M: MapDoor> Effects<'_, P, S, M> {
    /// `a`, just allocated in the core: commits it, then programs it. A
    /// failed commit releases it in the core; a failed programming removes
    /// the entry and the store's record, then releases it in the core (or
    /// parks the release if the store refuses).
    ///
    /// # Errors
    /// The failing step first, then every undo step's failure.
    pub fn commit_and_program(&mut self, a: Allocation) -> Result<Allocation, AgentError> {
        if let Err(e) = self.store.put(&a, self.core.generation()) {
            // Not in the store: the core lets go at once.
            let more = match self
                .core
                .release(&a.pool, a.family(), &a.owner, a.generation)
            {
                Ok(_) => Vec::new(),
                Err(r) => vec![r.into()],
            };
            return Err(AgentError::with_more(e.into(), more));
        }
        if let Err(e) = program(self.maps, &a, self.capacity) {
            let mut more = Vec::new();
            if let Err(u) = unprogram(self.maps, &a) {
                more.push(u);
            }
            if let Err(s) = self.parked.release(
                crate::store::key_of(&a),
                None,
                vec![a],
                self.store,
                self.core,
            ) {
                more.push(s.into());
            }
            return Err(AgentError::with_more(e, more));
        }
        Ok(a)
    }

    /// Releases `current`: unprograms, removes it from the store, then
    /// from the core. A refused removal programs it again (it stays held
    /// and served), and a failure to do so is reported too.
    ///
    /// # Errors
    /// The failing step first, then every undo step's failure.
    pub fn unprogram_and_release(
        &mut self,
        current: &Allocation,
    ) -> Result<Allocation, AgentError> {
        unprogram(self.maps, current)?;
        if let Err(e) = self
            .store
            .remove_endpoint(None, std::slice::from_ref(current))
        {
            let more = match program(self.maps, current, self.capacity) {
                Ok(()) => Vec::new(),
                Err(p) => vec![p],
            };
            return Err(AgentError::with_more(e.into(), more));
        }
        Ok(self.core.release(
            &current.pool,
            current.family(),
            &current.owner,
            current.generation,
        )?)
    }

    /// Makes role holdings follow `plan`: each release goes to the store
    /// first, then the core; each reservation to the core, then the store
    /// (released again if the store refuses). Every step is tried.
    ///
    /// # Errors
    /// Every failed step, the first one first.
    pub fn apply_roles(&mut self, plan: RolePlan) -> Result<(), AgentError> {
        let mut errors = Vec::new();
        for a in plan.release {
            tracing::info!(role = %a.owner, address = %a.address, "role disabled or moved; releasing its address");
            if let Err(e) = self.store.remove_endpoint(None, std::slice::from_ref(&a)) {
                // Still stored: the core keeps it too.
                errors.push(e.into());
                continue;
            }
            if let Err(e) = self
                .core
                .release(&a.pool, a.family(), &a.owner, a.generation)
            {
                errors.push(e.into());
            }
        }
        for w in plan.reserve {
            let a = match self.core.allocate_next(
                &w.pool,
                w.family,
                lockstep_core::owner::Owner::agent(w.role),
            ) {
                Ok(a) => a,
                Err(e) => {
                    errors.push(e.into());
                    continue;
                }
            };
            if let Err(e) = self.store.put(&a, self.core.generation()) {
                errors.push(e.into());
                if let Err(r) = self
                    .core
                    .release(&a.pool, a.family(), &a.owner, a.generation)
                {
                    errors.push(r.into());
                }
                continue;
            }
            tracing::info!(role = %w.role, address = %a.address, "reserved a role address");
        }
        AgentError::all(errors)
    }
}

#[cfg(test)]
mod tests;
