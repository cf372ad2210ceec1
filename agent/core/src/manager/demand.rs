//! Demand: the manager's side of [`DemandTracker`] — pending requests,
//! usage figures, and giving back empty CIDRs when demand allows.
//!
//! Kept apart because it is the only part of the manager driven by a clock
//! (`now_ms` passed in) and the only one that takes CIDRs out of service on
//! its own initiative.

use super::{DemandDecision, PoolManager, PoolSource};
use crate::cidr::Family;
use crate::demand::{DemandTracker, Usage};
use crate::owner::Owner;

impl<S: PoolSource> PoolManager<S> {
    /// Records a request that could not be served (e.g. after
    /// [`ManagerError::PoolExhausted`](crate::manager::ManagerError::PoolExhausted)), so demand counts it until it expires
    /// or the owner gets an address of that family.
    pub fn add_pending(&mut self, family: Family, owner: Owner, now_ms: u64) {
        self.demand_mut(family).add_pending(owner, now_ms);
    }

    /// Allows demand to release surplus CIDRs; call once restore is done.
    pub fn finish_restore(&mut self) {
        self.demand_v4.finish_restore();
        self.demand_v6.finish_restore();
    }

    /// Usage of a family over all pools: allocated addresses and the capacity
    /// of active CIDRs.
    pub fn usage(&self, family: Family) -> Usage {
        let sat = |n: u128| u64::try_from(n).unwrap_or(u64::MAX);
        Usage {
            in_use: sat(self.pools.values().map(|p| p.used(family)).sum()),
            available: sat(self.pools.values().map(|p| p.capacity(family)).sum()),
        }
    }

    /// Evaluates demand for a family at `now_ms`. When the tracker allows a
    /// release, empty active CIDRs (most recently added first) whose total
    /// capacity fits the allowed surplus are taken out of service and listed
    /// in [`DemandDecision::release`], for the caller to hand back.
    pub fn evaluate_demand(&mut self, family: Family, now_ms: u64) -> DemandDecision {
        let usage = self.usage(family);
        let demand = self.demand_mut(family).evaluate(now_ms, usage);
        let mut budget = u128::from(demand.release);
        let mut release = Vec::new();
        for pool in self.pools.values_mut() {
            for slot in pool.cidrs.iter_mut().rev() {
                let cap = slot.alloc.capacity();
                if budget == 0 {
                    break;
                }
                if !slot.draining
                    && slot.alloc.family() == family
                    && slot.alloc.used() == 0
                    && cap <= budget
                {
                    budget -= cap;
                    slot.draining = true;
                    release.push((pool.name.clone(), slot.alloc.cidr()));
                }
            }
            pool.reap();
        }
        self.released.extend(release.iter().map(|(_, c)| *c));
        DemandDecision { demand, release }
    }

    pub(super) fn demand_mut(&mut self, family: Family) -> &mut DemandTracker {
        match family {
            Family::V4 => &mut self.demand_v4,
            Family::V6 => &mut self.demand_v6,
        }
    }
}
