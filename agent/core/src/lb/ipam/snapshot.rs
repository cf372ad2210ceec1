//! Persistence: the snapshot the agent stores, restore from it, and the
//! invariant checks the tests run after every step.

use super::*;

impl LbIpam {
    /// Plain-data copy of the whole state, for the store.
    pub fn snapshot(&self) -> LbSnapshot {
        LbSnapshot {
            next_pool_seq: self.next_pool_seq,
            pools: self
                .order
                .iter()
                .map(|(seq, n)| PoolRecord {
                    seq: *seq,
                    spec: self.pools[n].spec.clone(),
                })
                .collect(),
            next_service_seq: self.next_service_seq,
            services: self
                .services
                .values()
                .map(|e| ServiceRecord {
                    seq: e.seq,
                    spec: (*e.spec).clone(),
                    held: e.held.clone(),
                    status: e.status.clone(),
                })
                .collect(),
            manager: self.manager.snapshot(),
        }
    }

    /// Rebuilds the state exactly from a snapshot (conflicts are derived
    /// again from the pools and their sequence numbers). Nothing is
    /// re-evaluated: afterwards the daemon re-applies the pools and services
    /// it currently sees, and services keep their addresses unless their own
    /// pool changed.
    ///
    /// # Errors
    /// An invalid pool or service, [`LbError::Restore`] when the allocator
    /// state does not rebuild, [`LbError::InconsistentSnapshot`] when
    /// services and allocations disagree.
    pub fn restore(snapshot: &LbSnapshot) -> Result<LbIpam, LbError> {
        let mut lb = LbIpam::new();
        let bad =
            |item: String, problem: &'static str| LbError::InconsistentSnapshot { item, problem };
        for r in &snapshot.pools {
            r.spec.validate()?;
            if r.seq >= snapshot.next_pool_seq
                || lb.order.insert(r.seq, r.spec.name.clone()).is_some()
                || lb
                    .pools
                    .insert(r.spec.name.clone(), PoolEntry::new(r.spec.clone(), r.seq))
                    .is_some()
            {
                return Err(bad(
                    r.spec.name.clone(),
                    "duplicate pool or sequence number",
                ));
            }
        }
        lb.next_pool_seq = snapshot.next_pool_seq;
        lb.recompute_conflicts();
        let source = LbPoolSource {
            pools: lb.usable_specs(),
        };
        lb.manager = PoolManager::from_snapshot(source, manager_config(), &snapshot.manager)
            .map_err(|source| LbError::Restore {
                source: Box::new(source),
            })?;
        let managed: BTreeSet<&str> = lb.manager.pools().map(|p| p.name()).collect();
        if managed
            != lb
                .manager
                .source()
                .pools
                .keys()
                .map(String::as_str)
                .collect()
        {
            return Err(bad(
                "pools".into(),
                "allocator pools differ from usable pools",
            ));
        }
        let mut seqs = BTreeSet::new();
        for r in &snapshot.services {
            r.spec.validate()?;
            let id = r.spec.id();
            if r.seq >= snapshot.next_service_seq || !seqs.insert(r.seq) {
                return Err(bad(id, "duplicate service or sequence number"));
            }
            for h in &r.held {
                let pool = lb
                    .pools
                    .get(&h.pool)
                    .filter(|p| p.is_usable() && p.contains(h.address));
                let allocated = lb.manager.by_address(h.address);
                if pool.is_none() || allocated.is_none_or(|a| a.pool != h.pool) {
                    return Err(bad(h.address.to_string(), "held address is not allocated"));
                }
                let u = lb.addrs.entry(h.address).or_insert_with(|| AddrUse {
                    pool: h.pool.clone(),
                    key: r.spec.sharing_key.clone(),
                    users: BTreeSet::new(),
                });
                if u.key != r.spec.sharing_key || (u.key.is_none() && !u.users.is_empty()) {
                    return Err(bad(h.address.to_string(), "shared without a common key"));
                }
                u.users.insert(id.clone());
                if let Some(k) = &r.spec.sharing_key {
                    lb.by_key.entry(k.clone()).or_default().insert(h.address);
                }
            }
            let missing = r.status.pending().is_some() || r.status.missing_family.is_some();
            if missing {
                lb.pending.insert(r.seq, id.clone());
            }
            lb.services.insert(
                id,
                ServiceEntry {
                    spec: Arc::new(r.spec.clone()),
                    seq: r.seq,
                    held: r.held.clone(),
                    status: r.status.clone(),
                },
            );
        }
        lb.next_service_seq = snapshot.next_service_seq;
        for a in lb.manager.allocations() {
            let owner_is_user = match &a.owner {
                Owner::LoadBalancer { service } => lb
                    .addrs
                    .get(&a.address)
                    .is_some_and(|u| u.users.contains(service)),
                _ => false,
            };
            if !owner_is_user {
                return Err(bad(
                    a.address.to_string(),
                    "allocation has no holding service",
                ));
            }
        }
        Ok(lb)
    }

    #[cfg(test)]
    pub(crate) fn check_invariants(&self) {
        self.manager.check_invariants();
        let mut seen = BTreeMap::new();
        for (id, e) in &self.services {
            let mut fams = BTreeSet::new();
            for h in &e.held {
                assert!(
                    fams.insert(Family::of_addr(h.address)),
                    "{id}: two of a family"
                );
                let u = &self.addrs[&h.address];
                assert!(u.users.contains(id));
                assert_eq!(u.pool, h.pool);
                seen.entry(h.address)
                    .or_insert_with(BTreeSet::new)
                    .insert(id.clone());
                let pool = &self.pools[&h.pool];
                assert!(pool.is_usable() && pool.contains(h.address) && pool.selects(&e.spec));
            }
            assert_eq!(
                e.status.addresses().len(),
                e.held.len(),
                "{id}: status matches holdings"
            );
            let incomplete = e.status.pending().is_some() || e.status.missing_family.is_some();
            assert_eq!(self.pending.get(&e.seq) == Some(id), incomplete, "{id}");
        }
        assert_eq!(seen.len(), self.addrs.len());
        for (a, u) in &self.addrs {
            assert_eq!(&u.users, &seen[a]);
            let alloc = self.manager.by_address(*a).expect("allocated");
            assert!(
                matches!(&alloc.owner, Owner::LoadBalancer { service } if u.users.contains(service))
            );
            if u.users.len() > 1 {
                assert!(u.key.is_some());
            }
            for id in &u.users {
                assert_eq!(self.services[id].spec.sharing_key, u.key, "{a}");
            }
        }
        assert_eq!(self.manager.allocations().len(), self.addrs.len());
    }
}
