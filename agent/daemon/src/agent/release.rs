//! Releases the store has not accepted yet.
//!
//! A rollback (an ADD or an allocation whose programming failed after its
//! commit) removes the allocation from the store, then releases it in the
//! core. The store keeps a failure and refuses commits until it recovers
//! ([`Store::health`]), so that removal can fail. Releasing in the core
//! anyway would let the address be handed out again while the store still
//! holds it for the old owner, and the next restore would find two owners.
//! So a release the store refuses is parked here: the core keeps the
//! allocations (no one else gets the addresses), the planner leaves them out
//! of the maps, `verify` names them, and the agent retries the removal
//! before its next change; once the store accepts it, the core lets go.
//!
//! The store is reached through [`ReleaseStore`], so the decision is
//! unit-tested with a store that refuses.

use std::collections::BTreeMap;

use lockstep_core::manager::{Allocation, PoolManager, PoolSource};

use crate::store::{Store, StoreError};

/// The one store operation a release needs.
pub trait ReleaseStore {
    /// Removes `allocations` and the endpoint record `record` (if any) in one
    /// commit.
    ///
    /// # Errors
    /// The store refused the commit.
    fn remove_endpoint(
        &self,
        record: Option<&str>,
        allocations: &[Allocation],
    ) -> Result<(), StoreError>;
}

impl ReleaseStore for Store {
    fn remove_endpoint(
        &self,
        record: Option<&str>,
        allocations: &[Allocation],
    ) -> Result<(), StoreError> {
        Store::remove_endpoint(self, record, allocations)
    }
}

#[derive(Debug)]
struct Parked {
    record: Option<String>,
    allocations: Vec<Allocation>,
    cause: String,
}

/// Releases waiting for the store, by key (an endpoint key, or an
/// allocation's store key).
#[derive(Debug, Default)]
pub struct ParkedReleases {
    parked: BTreeMap<String, Parked>,
}

impl ParkedReleases {
    /// Removes `allocations` (and the endpoint record `record`) from the
    /// store, then releases them in the core. If the store refuses, the core
    /// keeps them and the release is parked under `key`.
    ///
    /// # Errors
    /// The store's refusal (the release is then parked).
    pub fn release<S: PoolSource>(
        &mut self,
        key: String,
        record: Option<String>,
        allocations: Vec<Allocation>,
        store: &impl ReleaseStore,
        core: &mut PoolManager<S>,
    ) -> Result<(), StoreError> {
        match store.remove_endpoint(record.as_deref(), &allocations) {
            Ok(()) => {
                self.parked.remove(&key);
                for a in &allocations {
                    if let Err(e) = core.release(&a.pool, a.family(), &a.owner, a.generation) {
                        // Not held (any more): core and store agree.
                        tracing::warn!(address = %a.address, owner = %a.owner, error = %e, "a released allocation was not held");
                    }
                }
                Ok(())
            }
            Err(e) => {
                let cause = crate::error_chain(&e);
                tracing::error!(%key, error = %cause, "the store refused a release; the addresses stay held until it accepts it");
                self.parked.insert(
                    key,
                    Parked {
                        record,
                        allocations,
                        cause,
                    },
                );
                Err(e)
            }
        }
    }

    /// Tries every parked release again.
    ///
    /// # Errors
    /// Those the store still refuses, by key; they stay parked.
    pub fn retry<S: PoolSource>(
        &mut self,
        store: &impl ReleaseStore,
        core: &mut PoolManager<S>,
    ) -> Result<(), Vec<(String, StoreError)>> {
        let keys: Vec<String> = self.parked.keys().cloned().collect();
        let mut refused = Vec::new();
        for key in keys {
            let Some(p) = self.parked.remove(&key) else {
                continue;
            };
            if let Err(e) = self.release(key.clone(), p.record, p.allocations, store, core) {
                refused.push((key, e));
            }
        }
        if refused.is_empty() {
            Ok(())
        } else {
            Err(refused)
        }
    }

    /// Nothing is parked.
    pub fn is_empty(&self) -> bool {
        self.parked.is_empty()
    }

    /// Whether `a` is held only because its release is parked.
    pub fn holds(&self, a: &Allocation) -> bool {
        self.parked.values().any(|p| p.allocations.contains(a))
    }

    /// Why the release parked under `key` waits, if one is.
    pub fn cause(&self, key: &str) -> Option<&str> {
        self.parked.get(key).map(|p| p.cause.as_str())
    }

    /// One line per parked allocation, for `verify`.
    pub fn describe(&self) -> Vec<String> {
        self.parked
            .values()
            .flat_map(|p| {
                p.allocations.iter().map(move |a| {
                    format!(
                        "{} {} was released by a rollback; the store has not accepted the removal yet ({}); held until it does",
                        a.address, a.owner, p.cause
                    )
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use std::cell::{Cell, RefCell};

    use lockstep_core::cidr::Family;
    use lockstep_core::manager::{ManagerConfig, ManagerError, StaticPools};
    use lockstep_core::owner::Owner;
    use lockstep_core::pool::PoolSpec;

    use super::*;

    /// A store that refuses removals while `refuse` is set, and records
    /// what it accepted.
    #[derive(Default)]
    struct Double {
        refuse: Cell<bool>,
        removed: RefCell<Vec<(Option<String>, Vec<Allocation>)>>,
    }

    impl ReleaseStore for Double {
        fn remove_endpoint(
            &self,
            record: Option<&str>,
            allocations: &[Allocation],
        ) -> Result<(), StoreError> {
            if self.refuse.get() {
                return Err(StoreError::Dir {
                    path: "/state".into(),
                    source: std::io::Error::from_raw_os_error(libc::ENOSPC),
                });
            }
            self.removed
                .borrow_mut()
                .push((record.map(str::to_string), allocations.to_vec()));
            Ok(())
        }
    }

    /// A /30 with first and last usable: four addresses.
    fn core() -> PoolManager<StaticPools> {
        let spec = PoolSpec {
            name: "p".into(),
            ipv4: vec!["10.9.0.0/30".parse().expect("cidr")],
            ipv6: Vec::new(),
            reserved: Vec::new(),
            allow_first_last: true,
            skip_masquerade: false,
            allow_link_local: false,
            families: Vec::new(),
        };
        let mut m =
            PoolManager::new(StaticPools(vec![spec]), ManagerConfig::default()).expect("manager");
        assert!(m.sync().errors.is_empty());
        m
    }

    #[test]
    fn a_release_the_store_refuses_keeps_the_address_held_until_it_accepts() {
        let mut core = core();
        let store = Double::default();
        let mut parked = ParkedReleases::default();
        let a = core
            .allocate_next("p", Family::V4, Owner::endpoint("c1", "eth0"))
            .expect("allocate");
        store.refuse.set(true);
        let refused = parked.release(
            "c1/eth0".into(),
            Some("c1/eth0".into()),
            vec![a.clone()],
            &store,
            &mut core,
        );
        assert!(refused.is_err(), "the store's refusal is reported");
        assert!(parked.holds(&a));
        assert_eq!(parked.describe().len(), 1);
        // The core still holds it: the other three addresses go, then the
        // pool is exhausted; the rolled-back address is never handed out.
        for i in 0..3 {
            let b = core
                .allocate_next("p", Family::V4, Owner::endpoint(format!("o{i}"), "eth0"))
                .expect("a free address");
            assert_ne!(b.address, a.address);
        }
        assert!(matches!(
            core.allocate_next("p", Family::V4, Owner::endpoint("o4", "eth0")),
            Err(ManagerError::PoolExhausted { .. })
        ));
        // Still refusing: still held.
        assert!(parked.retry(&store, &mut core).is_err());
        assert!(parked.holds(&a));
        // The store recovers: the removal goes in, then the core lets go.
        store.refuse.set(false);
        assert!(parked.retry(&store, &mut core).is_ok());
        assert!(parked.is_empty());
        assert_eq!(
            *store.removed.borrow(),
            vec![(Some("c1/eth0".to_string()), vec![a.clone()])]
        );
        let again = core
            .allocate_next("p", Family::V4, Owner::endpoint("o4", "eth0"))
            .expect("the released address is free again");
        assert_eq!(again.address, a.address);
    }

    #[test]
    fn an_accepted_release_frees_the_address_at_once() {
        let mut core = core();
        let store = Double::default();
        let mut parked = ParkedReleases::default();
        let a = core
            .allocate_next("p", Family::V4, Owner::endpoint("c1", "eth0"))
            .expect("allocate");
        parked
            .release("k".into(), None, vec![a.clone()], &store, &mut core)
            .expect("accepted");
        assert!(parked.is_empty());
        assert!(core.get("p", Family::V4, &a.owner).is_none());
    }
}
