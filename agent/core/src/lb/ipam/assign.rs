//! Assignment: how a service gets (or joins) an address, honouring requested
//! addresses, sharing keys and port clashes, and how it lets one go.

use super::*;

impl LbIpam {
    pub(super) fn try_assign(
        &mut self,
        id: &str,
        spec: &ServiceSpec,
        family: Family,
    ) -> Result<Holding, PendingReason> {
        if let Some(address) = spec.requested(family) {
            return self.try_requested(id, spec, address);
        }
        if let Some(key) = &spec.sharing_key {
            let mut clash_reason = None;
            let mut join = None;
            for &a in self.by_key.get(key).into_iter().flatten() {
                let u = &self.addrs[&a];
                let pool = &self.pools[&u.pool];
                if Family::of_addr(a) != family || !pool.is_usable() || !pool.selects(spec) {
                    continue;
                }
                match self.clash_with(spec, &u.users) {
                    Some(r) => {
                        clash_reason.get_or_insert(PendingReason::SharingPortClash {
                            address: a,
                            with: r.0,
                            port: r.1,
                        });
                    }
                    None => {
                        join = Some(a);
                        break;
                    }
                }
            }
            if let Some(a) = join {
                return Ok(self.join(id, a));
            }
            if let Some(r) = clash_reason {
                return Err(r);
            }
        }
        let owner = Owner::load_balancer(id);
        let mut exhausted = Vec::new();
        let mut unusable = None;
        let mut got = None;
        for name in self.order.values() {
            let pool = &self.pools[name];
            if !pool.has_family(family) || !pool.selects(spec) {
                continue;
            }
            if let Some(c) = &pool.conflict {
                unusable.get_or_insert_with(|| PendingReason::PoolConflicting {
                    pool: name.clone(),
                    conflict: c.clone(),
                });
                continue;
            }
            if pool.spec.disabled {
                unusable.get_or_insert_with(|| PendingReason::PoolDisabled { pool: name.clone() });
                continue;
            }
            match self.manager.allocate_next(name, family, owner.clone()) {
                Ok(a) => {
                    got = Some((name.clone(), a.address));
                    break;
                }
                Err(e) => {
                    if !matches!(e, crate::manager::ManagerError::PoolExhausted { .. }) {
                        self.faults
                            .push(format!("allocating in pool {name} for {owner}: {e}"));
                    }
                    exhausted.push(name.clone());
                }
            }
        }
        if let Some((pool, address)) = got {
            return Ok(self.attach_fresh(id, pool, address, spec.sharing_key.clone()));
        }
        Err(if !exhausted.is_empty() {
            PendingReason::Exhausted {
                family,
                pools: exhausted,
            }
        } else {
            unusable.unwrap_or(PendingReason::NoPoolSelects { family })
        })
    }

    pub(super) fn try_requested(
        &mut self,
        id: &str,
        spec: &ServiceSpec,
        address: IpAddr,
    ) -> Result<Holding, PendingReason> {
        let family = Family::of_addr(address);
        let Some(name) = self.index.owner_of(family, addr_bits(address)) else {
            let conflicting = self
                .order
                .values()
                .map(|n| &self.pools[n])
                .find(|p| p.conflict.is_some() && p.in_blocks(address));
            return Err(match conflicting {
                Some(p) => PendingReason::PoolConflicting {
                    pool: p.spec.name.clone(),
                    conflict: p.conflict.clone().expect("filtered"),
                },
                None => PendingReason::RequestedOutsidePools { address },
            });
        };
        let pool = &self.pools[name];
        let name = name.to_owned();
        if !pool.selects(spec) {
            return Err(PendingReason::RequestedNotSelected {
                address,
                pool: name,
            });
        }
        if pool.spec.disabled {
            return Err(PendingReason::PoolDisabled { pool: name });
        }
        if !pool.contains(address) {
            return Err(PendingReason::AddressUnusable {
                address,
                pool: name,
            });
        }
        if let Some(u) = self.addrs.get(&address) {
            if u.key.is_some() && u.key == spec.sharing_key {
                if let Some((with, port)) = self.clash_with(spec, &u.users) {
                    return Err(PendingReason::SharingPortClash {
                        address,
                        with,
                        port,
                    });
                }
                return Ok(self.join(id, address));
            }
            let by = match self.manager.by_address(address).map(|a| &a.owner) {
                Some(Owner::LoadBalancer { service }) => service.clone(),
                _ => u.users.iter().next().cloned().unwrap_or_default(),
            };
            return Err(PendingReason::AddressTaken { address, by });
        }
        match self
            .manager
            .allocate(&name, address, Owner::load_balancer(id))
        {
            Ok(_) => Ok(self.attach_fresh(id, name, address, spec.sharing_key.clone())),
            Err(_) => Err(PendingReason::AddressUnusable {
                address,
                pool: name,
            }),
        }
    }

    /// The first user of an address whose ports clash with `spec`'s.
    pub(super) fn clash_with(
        &self,
        spec: &ServiceSpec,
        users: &BTreeSet<String>,
    ) -> Option<(String, ServicePort)> {
        users
            .iter()
            .find_map(|u| clash(&spec.ports, &self.services[u].spec.ports).map(|p| (u.clone(), p)))
    }

    pub(super) fn attach_fresh(
        &mut self,
        id: &str,
        pool: String,
        address: IpAddr,
        key: Option<String>,
    ) -> Holding {
        if let Some(k) = &key {
            self.by_key.entry(k.clone()).or_default().insert(address);
        }
        self.addrs.insert(
            address,
            AddrUse {
                pool: pool.clone(),
                key,
                users: BTreeSet::from([id.to_owned()]),
            },
        );
        Holding { address, pool }
    }

    pub(super) fn join(&mut self, id: &str, address: IpAddr) -> Holding {
        let u = self
            .addrs
            .get_mut(&address)
            .expect("joined address is in use");
        u.users.insert(id.to_owned());
        Holding {
            address,
            pool: u.pool.clone(),
        }
    }

    /// Stops `id` using `h`. The last user releases the address; if the
    /// manager's owner leaves first, ownership moves to the next user.
    /// Returns whether the address went back to its pool.
    pub(super) fn detach(&mut self, id: &str, h: &Holding) -> bool {
        let Some(u) = self.addrs.get_mut(&h.address) else {
            return false;
        };
        u.users.remove(id);
        let family = Family::of_addr(h.address);
        let owner = Owner::load_balancer(id);
        let generation = self
            .manager
            .get(&h.pool, family, &owner)
            .filter(|a| a.address == h.address)
            .map(|a| a.generation);
        let next = u.users.iter().next().cloned();
        if next.is_none() {
            let key = u.key.clone();
            self.addrs.remove(&h.address);
            if let Some(k) = key
                && let Some(set) = self.by_key.get_mut(&k)
            {
                set.remove(&h.address);
                if set.is_empty() {
                    self.by_key.remove(&k);
                }
            }
        }
        let Some(generation) = generation else {
            return false;
        };
        if let Err(e) = self.manager.release(&h.pool, family, &owner, generation) {
            self.faults
                .push(format!("releasing {} of {owner}: {e}", h.address));
        }
        match next {
            None => true,
            Some(next) => {
                if let Err(e) =
                    self.manager
                        .allocate(&h.pool, h.address, Owner::load_balancer(next.clone()))
                {
                    self.faults
                        .push(format!("moving {} to the next user {next}: {e}", h.address));
                }
                false
            }
        }
    }
}
