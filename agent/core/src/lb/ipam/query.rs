//! Read-only views of the LB IPAM state: statuses, metrics and the plan the
//! agent programs into the datapath.

use super::*;

impl LbIpam {
    /// A service's status.
    pub fn service_status(&self, id: &str) -> Option<&ServiceStatus> {
        self.services.get(id).map(|e| &e.status)
    }

    /// Every service's status, by `namespace/name`.
    pub fn services(&self) -> impl Iterator<Item = (&str, &ServiceStatus)> + '_ {
        self.services.iter().map(|(k, e)| (k.as_str(), &e.status))
    }

    /// What a service holds, with pools.
    pub fn holdings(&self, id: &str) -> &[Holding] {
        self.services.get(id).map_or(&[], |e| &e.held)
    }

    /// Every address assigned to a service, with its pool: what a BGP
    /// speaker may announce (`bgp::announce` decides which).
    pub fn addresses(&self) -> BTreeMap<IpAddr, String> {
        self.manager
            .allocations()
            .filter(|a| classify(&a.owner).is_some())
            .map(|a| (a.address, a.pool.clone()))
            .collect()
    }

    /// The services using an address (several when shared).
    pub fn users_of(&self, address: IpAddr) -> impl Iterator<Item = &str> + '_ {
        self.addrs
            .get(&address)
            .into_iter()
            .flat_map(|u| u.users.iter().map(String::as_str))
    }

    /// One pool's status.
    pub fn pool_status(&self, name: &str) -> Option<PoolStatus> {
        let e = self.pools.get(name)?;
        Some(PoolStatus {
            spec: e.spec.clone(),
            seq: e.seq,
            conflict: e.conflict.clone(),
            metrics: self.pool_metrics(e),
        })
    }

    /// Every pool's status, in first-apply order.
    pub fn pools(&self) -> impl Iterator<Item = PoolStatus> + '_ {
        self.order.values().filter_map(|n| self.pool_status(n))
    }

    /// Metrics: per-pool usage and conflict state, pending services by reason.
    pub fn metrics(&self) -> LbMetrics {
        let mut m = LbMetrics::default();
        for (name, e) in &self.pools {
            m.pools.insert(name.clone(), self.pool_metrics(e));
        }
        for e in self.services.values() {
            match e.status.pending() {
                Some(r) => *m.pending_by_reason.entry(r.kind().to_owned()).or_default() += 1,
                None => m.assigned += 1,
            }
        }
        m
    }

    /// Desired IPCACHE entries (identity and flags from
    /// [`classify`](crate::plan::classify), so LB addresses look the same as
    /// in the combined plan) and L2 announcements.
    pub fn plan(&self) -> LbPlan {
        let mut plan = LbPlan::default();
        for a in self.manager.allocations() {
            let Some((identity, flags)) = classify(&a.owner) else {
                continue;
            };
            let value = IpcacheValue {
                identity,
                flags,
                ..IpcacheValue::default()
            };
            let l2 = self
                .pools
                .get(&a.pool)
                .is_some_and(|p| p.spec.announce == Some(Announce::L2));
            match a.address {
                IpAddr::V4(v4) => {
                    plan.ipcache_v4.insert(Ipv4Net::from(v4), value);
                    if l2 {
                        plan.l2_announce_v4.insert(v4, a.pool.clone());
                    }
                }
                IpAddr::V6(v6) => {
                    plan.ipcache_v6.insert(Ipv6Net::from(v6), value);
                    if l2 {
                        plan.l2_announce_v6.insert(v6, a.pool.clone());
                    }
                }
            }
        }
        plan
    }

    pub(super) fn usable_pools(&self) -> BTreeSet<String> {
        self.pools
            .iter()
            .filter(|(_, e)| e.is_usable())
            .map(|(n, _)| n.clone())
            .collect()
    }

    pub(super) fn usable_specs(&self) -> BTreeMap<String, PoolSpec> {
        self.pools
            .iter()
            .filter(|(_, e)| e.is_usable())
            .map(|(n, e)| (n.clone(), e.managed.clone()))
            .collect()
    }

    pub(super) fn pool_metrics(&self, e: &PoolEntry) -> PoolMetrics {
        let (capacity, used) = match self.manager.pool(&e.spec.name) {
            Some(p) if e.is_usable() => (
                p.capacity(Family::V4)
                    .saturating_add(p.capacity(Family::V6)),
                p.used(Family::V4) + p.used(Family::V6),
            ),
            _ => (e.capacity(), 0),
        };
        PoolMetrics {
            capacity,
            used,
            free: if e.is_usable() { capacity - used } else { 0 },
            conflicting: e.conflict.is_some(),
            disabled: e.spec.disabled,
        }
    }
}
