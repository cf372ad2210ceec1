//! Pool configuration: bringing the pools in line with the [`PoolSource`]
//! ([`PoolManager::sync`]) and adding or draining single CIDRs.
//!
//! Kept apart from allocation because it changes which address space exists,
//! not who holds what: overlap checks, draining on removal and reaping of
//! emptied CIDRs live here.

use std::collections::BTreeSet;

use ipnet::IpNet;

use super::{PoolManager, PoolSource, SyncReport};
use crate::pool::{Pool, PoolError, PoolSpec, check_cidr, overlaps};

impl<S: PoolSource> PoolManager<S> {
    /// Brings the pools in line with the source: new pools and CIDRs are
    /// added (overlaps refused), CIDRs and pools the source dropped start
    /// draining and disappear once empty, a draining CIDR listed again is
    /// active again, and flags are updated. `allow_first_last` and `reserved`
    /// apply to CIDRs added from then on; remove and re-add a CIDR to change
    /// them for it. The excluded addresses ([`PoolManager::set_excluded`])
    /// apply to every CIDR at once: a free one is withheld, one no longer
    /// listed is free again, an allocated one stays with its holder.
    /// Problems are collected in the report; everything else is applied.
    pub fn sync(&mut self) -> SyncReport {
        let mut report = SyncReport::default();
        let mut specs = self.source.pools();
        let mut names = BTreeSet::new();
        specs.retain(|spec| {
            if spec.name.is_empty() {
                report.errors.push(PoolError::EmptyName);
                false
            } else if !names.insert(spec.name.clone()) {
                report.errors.push(PoolError::DuplicatePool {
                    pool: spec.name.clone(),
                });
                false
            } else {
                true
            }
        });
        // Forget released CIDRs the source no longer lists.
        let listed: BTreeSet<IpNet> = specs.iter().flat_map(PoolSpec::cidrs).collect();
        self.released.retain(|c| listed.contains(c));

        // Drain first, so a CIDR moving between pools in one edit is refused
        // only while the old one still holds addresses.
        for pool in self.pools.values_mut() {
            let spec = specs.iter().find(|s| s.name == pool.name);
            pool.retired = spec.is_none();
            for slot in &mut pool.cidrs {
                let cidr = slot.alloc.cidr();
                let wanted = spec.is_some_and(|s| s.cidrs().any(|c| c == cidr))
                    && !self.released.contains(&cidr);
                if !wanted && !slot.draining {
                    slot.draining = true;
                    report.draining.push((pool.name.clone(), cidr));
                }
            }
        }
        self.reap(&mut report.removed);

        for spec in &specs {
            let pool = self
                .pools
                .entry(spec.name.clone())
                .or_insert_with(|| Pool::from_spec(spec));
            pool.retired = false;
            pool.skip_masquerade = spec.skip_masquerade;
            pool.allow_first_last = spec.allow_first_last;
            pool.allow_link_local = spec.allow_link_local;
            pool.reserved.clone_from(&spec.reserved);
            pool.declared.clone_from(&spec.families);
            for cidr in spec.cidrs() {
                if self.released.contains(&cidr) {
                    continue;
                }
                match self.add_cidr(&spec.name, cidr) {
                    Ok(true) => report.added.push((spec.name.clone(), cidr)),
                    Ok(false) => {}
                    Err(e) => report.errors.push(e),
                }
            }
        }
        for pool in self.pools.values_mut() {
            for slot in &mut pool.cidrs {
                slot.alloc.set_excluded(self.excluded.iter().copied());
                slot.alloc.set_window(self.windows.get(&slot.alloc.cidr()));
            }
        }
        // A pool listed with nothing valid stays (empty), so allocations name
        // a known pool; a retired empty pool is gone.
        self.pools.retain(|_, p| !(p.retired && p.cidrs.is_empty()));
        report
    }

    /// Adds a CIDR to a pool, or takes it back from draining. Returns whether
    /// anything changed.
    ///
    /// # Errors
    /// [`PoolError::UnknownPool`], [`PoolError::InvalidCidr`] (host bits set)
    /// or [`PoolError::OverlappingCidr`] naming both pools and both CIDRs.
    pub fn add_cidr(&mut self, pool: &str, cidr: IpNet) -> Result<bool, PoolError> {
        let allow_link_local = self.pools.get(pool).is_some_and(|p| p.allow_link_local);
        check_cidr(pool, cidr, allow_link_local)?;
        for (name, p) in &self.pools {
            for slot in &p.cidrs {
                let other = slot.alloc.cidr();
                if name == pool && other == cidr {
                    continue;
                }
                if overlaps(cidr, other) {
                    return Err(PoolError::OverlappingCidr {
                        pool: pool.to_owned(),
                        cidr,
                        other_pool: name.clone(),
                        other_cidr: other,
                    });
                }
            }
        }
        let dense_limit = self.config.dense_limit;
        let p = self.pool_entry(pool)?;
        if let Some(slot) = p.cidrs.iter_mut().find(|s| s.alloc.cidr() == cidr) {
            let changed = slot.draining;
            slot.draining = false;
            return Ok(changed);
        }
        let slot = p.new_slot(cidr, dense_limit)?;
        p.cidrs.push(slot);
        Ok(true)
    }

    /// Starts draining a CIDR: no new allocations; it disappears once its
    /// last allocation is released (at once if it is empty). Returns whether
    /// the CIDR is gone already.
    ///
    /// # Errors
    /// [`PoolError::UnknownPool`] or [`PoolError::UnknownCidr`].
    pub fn remove_cidr(&mut self, pool: &str, cidr: IpNet) -> Result<bool, PoolError> {
        let p = self.pool_entry(pool)?;
        let slot = p
            .cidrs
            .iter_mut()
            .find(|s| s.alloc.cidr() == cidr)
            .ok_or_else(|| PoolError::UnknownCidr {
                pool: pool.to_owned(),
                cidr,
            })?;
        slot.draining = true;
        let gone = slot.alloc.used() == 0;
        p.reap();
        Ok(gone)
    }

    pub(super) fn reap(&mut self, removed: &mut Vec<(String, IpNet)>) {
        for pool in self.pools.values_mut() {
            for slot in &pool.cidrs {
                if slot.draining && slot.alloc.used() == 0 {
                    removed.push((pool.name.clone(), slot.alloc.cidr()));
                }
            }
            pool.reap();
        }
    }
}
