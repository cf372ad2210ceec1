//! The assigner's state as etcd stores it (#27 item 6): one key per
//! service, and one small key for everything else.
//!
//! Why: the whole [`LbSnapshot`] in one key grew with every service and
//! passed etcd's request size limit (1.5 MiB by default) at a few thousand
//! services, and every change rewrote all of it. Split, a key holds one
//! service with the allocations it owns ([`StoredService`]), and the rest
//! ([`LbMeta`]: pools, sequence numbers, the allocator's cursors) grows
//! with the pools only. A round writes only the keys that changed
//! ([`diff`]), and the meta key with every change, so comparing its
//! revision fences a concurrent write of any part. [`join`] puts the
//! snapshot back together exactly.

use std::collections::{BTreeMap, BTreeSet};

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

use crate::manager::{Allocation, ManagerSnapshot, PoolState};
use crate::owner::{Generation, Owner};

use super::super::{LbSnapshot, PoolRecord, ServiceRecord};

/// Everything of an [`LbSnapshot`] but its services and their
/// allocations: grows with the pools, not with the services.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LbMeta {
    /// The next pool sequence number.
    pub next_pool_seq: u64,
    /// Pools in first-apply order.
    pub pools: Vec<PoolRecord>,
    /// The next service sequence number.
    pub next_service_seq: u64,
    /// The allocator's last generation.
    pub generation: Generation,
    /// The allocator's pools (CIDRs, cursors, draining).
    pub manager_pools: Vec<PoolState>,
    /// CIDRs given back by demand that the source still lists.
    pub released: Vec<IpNet>,
}

/// One service's part of the state: its record and the allocations it
/// owns (an address shared under a sharing key is owned by one of its
/// services and stored with that one).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StoredService {
    /// The service's record.
    pub record: ServiceRecord,
    /// The allocations it owns, by address.
    pub allocations: Vec<Allocation>,
}

/// An [`LbSnapshot`] split the way etcd stores it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredState {
    /// The meta key's value.
    pub meta: LbMeta,
    /// Each service's key's value, by `namespace/name`.
    pub services: BTreeMap<String, StoredService>,
}

/// Why a snapshot cannot be split.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SplitError {
    /// An allocation owned by no service of the state.
    #[error("lb state: address {address} is allocated to {owner:?}, not a service of the state")]
    Orphan {
        /// The address.
        address: std::net::IpAddr,
        /// Its owner.
        owner: Owner,
    },
}

/// Splits `state` into its meta and per-service parts.
///
/// # Errors
/// An allocation whose owner is not one of the state's services (a
/// snapshot [`super::super::LbIpam::restore`] refuses too).
pub fn split(state: &LbSnapshot) -> Result<StoredState, SplitError> {
    let mut services: BTreeMap<String, StoredService> = state
        .services
        .iter()
        .map(|r| {
            (
                r.spec.id(),
                StoredService {
                    record: r.clone(),
                    allocations: Vec::new(),
                },
            )
        })
        .collect();
    for a in &state.manager.allocations {
        let owner = match &a.owner {
            Owner::LoadBalancer { service } => services.get_mut(service),
            _ => None,
        };
        match owner {
            Some(s) => s.allocations.push(a.clone()),
            None => {
                return Err(SplitError::Orphan {
                    address: a.address,
                    owner: a.owner.clone(),
                });
            }
        }
    }
    Ok(StoredState {
        meta: LbMeta {
            next_pool_seq: state.next_pool_seq,
            pools: state.pools.clone(),
            next_service_seq: state.next_service_seq,
            generation: state.manager.generation,
            manager_pools: state.manager.pools.clone(),
            released: state.manager.released.clone(),
        },
        services,
    })
}

/// Puts a snapshot back together from its parts (the inverse of
/// [`split`]): services in `namespace/name` order, allocations by address.
pub fn join(stored: &StoredState) -> LbSnapshot {
    let mut allocations: Vec<Allocation> = stored
        .services
        .values()
        .flat_map(|s| s.allocations.iter().cloned())
        .collect();
    allocations.sort_by_key(|a| a.address);
    LbSnapshot {
        next_pool_seq: stored.meta.next_pool_seq,
        pools: stored.meta.pools.clone(),
        next_service_seq: stored.meta.next_service_seq,
        services: stored.services.values().map(|s| s.record.clone()).collect(),
        manager: ManagerSnapshot {
            generation: stored.meta.generation,
            pools: stored.meta.manager_pools.clone(),
            allocations,
            released: stored.meta.released.clone(),
        },
    }
}

/// The keys a round writes to go from `old` (`None`: nothing stored in
/// this layout) to `new`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StoredDiff {
    /// Service keys written: new, or whose value changed.
    pub put: BTreeMap<String, StoredService>,
    /// Service keys deleted.
    pub delete: BTreeSet<String>,
}

/// What differs between `old` and `new`, per service key (the meta key is
/// written with every change).
pub fn diff(old: Option<&StoredState>, new: &StoredState) -> StoredDiff {
    let empty = BTreeMap::new();
    let before = old.map_or(&empty, |o| &o.services);
    StoredDiff {
        put: new
            .services
            .iter()
            .filter(|(id, s)| before.get(*id) != Some(*s))
            .map(|(id, s)| (id.clone(), s.clone()))
            .collect(),
        delete: before
            .keys()
            .filter(|id| !new.services.contains_key(*id))
            .cloned()
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::super::reconcile;
    use super::*;
    use crate::lb::{LbPoolSpec, ServiceSpec};
    use proptest::prelude::*;

    fn state(services: usize, shared: usize, dual: bool) -> LbSnapshot {
        let mut pool = LbPoolSpec::new("p").cidr("10.9.0.0/16");
        if dual {
            pool = pool.cidr("fd09::/112");
        }
        let specs: Vec<ServiceSpec> = (0..services)
            .map(|i| {
                let mut s = ServiceSpec::new("ns", format!("s{i}"));
                if i < shared {
                    s.sharing_key = Some("k".into());
                }
                if dual {
                    s.ip_family_policy = crate::lb::IpFamilyPolicy::RequireDualStack;
                    s.ip_families = vec![crate::lb::IpFamily::IPv4, crate::lb::IpFamily::IPv6];
                }
                s
            })
            .collect();
        reconcile(None, vec![pool], specs).expect("valid").state
    }

    proptest! {
        #[test]
        fn split_then_join_gives_the_snapshot_back(
            services in 0usize..40,
            shared in 0usize..4,
            dual in any::<bool>(),
        ) {
            let s = state(services, shared, dual);
            let parts = split(&s).expect("splits");
            prop_assert_eq!(join(&parts), s);
            // No key grows with the services but its own.
            prop_assert!(parts.services.values().all(|p| p.allocations.len() <= 2));
        }

        #[test]
        fn applying_the_diff_to_the_old_parts_gives_the_new(
            before in 0usize..30,
            after in 0usize..30,
        ) {
            let old = split(&state(before, 0, false)).expect("splits");
            let new = split(&state(after, 0, false)).expect("splits");
            let d = diff(Some(&old), &new);
            let mut applied = old.services.clone();
            for id in &d.delete {
                applied.remove(id);
            }
            applied.extend(d.put.clone());
            prop_assert_eq!(applied, new.services.clone());
            // A key is written only when its value changed.
            for (id, s) in &d.put {
                prop_assert!(old.services.get(id) != Some(s));
            }
        }
    }

    #[test]
    fn an_allocation_of_no_service_is_refused() {
        let mut s = state(2, 0, false);
        s.services.pop();
        assert!(matches!(split(&s), Err(SplitError::Orphan { .. })));
    }
}
