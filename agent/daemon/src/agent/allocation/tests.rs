//! Allocate, release and role reservation against the doors' doubles:
//! every rollback path, asserting what the core, the store and the maps
//! hold afterwards.

use std::collections::BTreeMap;

use ipnet::IpNet;
use lockstep_core::cidr::Family;
use lockstep_core::manager::{Allocation, ManagerConfig, PoolManager, StaticPools};
use lockstep_core::owner::{AgentRole, Owner};
use lockstep_core::pool::PoolSpec;
use lockstep_core::roles::{RolePlan, RoleWant};

use super::{Effects, value_for};
use crate::agent::AgentError;
use crate::agent::doors::doubles::{FlakyStore, MapDouble};
use crate::agent::release::ParkedReleases;

const CAPACITY: u32 = 4;

/// The core (pool `p`: 10.9.0.0/30 and fd00:9::/126, every address usable),
/// the store, the maps and the parked releases.
struct Rig {
    core: PoolManager<StaticPools>,
    store: FlakyStore,
    maps: MapDouble,
    parked: ParkedReleases,
}

impl Rig {
    fn new() -> Rig {
        let spec = PoolSpec {
            name: "p".into(),
            ipv4: vec!["10.9.0.0/30".parse().expect("cidr")],
            ipv6: vec!["fd00:9::/126".parse().expect("cidr")],
            reserved: Vec::new(),
            allow_first_last: true,
            skip_masquerade: false,
            allow_link_local: false,
            families: Vec::new(),
        };
        let mut core =
            PoolManager::new(StaticPools(vec![spec]), ManagerConfig::default()).expect("manager");
        assert!(core.sync().errors.is_empty());
        Rig {
            core,
            store: FlakyStore::new(),
            maps: MapDouble::default(),
            parked: ParkedReleases::default(),
        }
    }

    fn effects(&mut self) -> Effects<'_, StaticPools, FlakyStore, MapDouble> {
        Effects {
            core: &mut self.core,
            store: &self.store,
            maps: &mut self.maps,
            parked: &mut self.parked,
            capacity: CAPACITY,
        }
    }

    /// Allocates the next address of `family` for `id` in the core and
    /// runs commit → program.
    fn allocate(&mut self, id: &str, family: Family) -> Result<Allocation, AgentError> {
        let a = self
            .core
            .allocate_next("p", family, Owner::endpoint(id, "eth0"))
            .expect("the core has room");
        self.effects().commit_and_program(a)
    }

    fn held(&self, a: &Allocation) -> bool {
        self.core.get(&a.pool, a.family(), &a.owner) == Some(a)
    }

    fn stored(&self) -> Vec<Allocation> {
        self.store.load().allocations
    }

    /// The maps hold exactly the host entries of `all`.
    fn assert_programmed(&self, all: &[&Allocation]) {
        let want: BTreeMap<IpNet, _> = all
            .iter()
            .map(|a| {
                (
                    IpNet::from(a.address),
                    value_for(a).expect("programmed owner"),
                )
            })
            .collect();
        assert_eq!(self.maps.ipcache, want);
    }
}

// --- allocate: commit → program ---------------------------------------

#[test]
fn an_allocation_is_stored_then_programmed() {
    let mut rig = Rig::new();
    let a = rig.allocate("c1", Family::V4).expect("allocated");
    assert!(rig.held(&a));
    assert_eq!(rig.stored(), vec![a.clone()]);
    rig.assert_programmed(&[&a]);
}

#[test]
fn a_refused_commit_lets_the_core_go_and_programs_nothing() {
    let mut rig = Rig::new();
    let addr: std::net::IpAddr = "10.9.0.2".parse().expect("addr");
    let a = rig
        .core
        .allocate("p", addr, Owner::endpoint("c1", "eth0"))
        .expect("free");
    rig.store.faults.fail_next("put");
    let e = rig.effects().commit_and_program(a).expect_err("refused");
    assert!(matches!(e, AgentError::Store(_)), "{e:?}");
    assert_eq!(e.code(), "store_error");
    assert!(
        crate::error_chain(&e).contains("No space left on device"),
        "{e}"
    );
    assert!(rig.core.allocations().next().is_none(), "the core let go");
    assert!(rig.stored().is_empty());
    assert_eq!(rig.maps.faults.calls("ipcache_insert"), 0);
    // The address is free again: another owner gets exactly it.
    let b = rig
        .core
        .allocate("p", addr, Owner::endpoint("c2", "eth0"))
        .expect("free again");
    rig.effects()
        .commit_and_program(b.clone())
        .expect("allocated");
    assert_eq!(rig.stored(), vec![b]);
}

#[test]
fn a_refused_map_write_removes_the_record_and_frees_the_address() {
    let mut rig = Rig::new();
    rig.maps.faults.fail_next("ipcache_insert");
    let e = rig.allocate("c1", Family::V4).expect_err("refused");
    assert_eq!(e.code(), "datapath_error");
    assert_eq!(
        crate::error_chain(&e),
        "cannot write IPCACHE_HOST_V4: Operation not permitted (os error 1)"
    );
    assert!(rig.core.allocations().next().is_none());
    assert!(rig.stored().is_empty());
    assert!(rig.parked.is_empty());
    rig.assert_programmed(&[]);
}

#[test]
fn a_full_ipcache_is_map_full_with_its_capacity_and_rolled_back() {
    let mut rig = Rig::new();
    let a = rig.allocate("c1", Family::V4).expect("allocated");
    rig.maps.capacity = 1;
    let e = rig.allocate("c2", Family::V4).expect_err("full");
    assert_eq!(e.code(), "map_full");
    assert_eq!(
        e.to_string(),
        "map IPCACHE_HOST_V4 is full (4 entries); the allocation was rolled back"
    );
    assert_eq!(rig.stored(), vec![a.clone()], "only the first is stored");
    assert_eq!(rig.core.allocations().count(), 1);
    rig.assert_programmed(&[&a]);
}

#[test]
fn an_ipv6_allocation_rolls_back_from_the_v6_host_map() {
    let mut rig = Rig::new();
    rig.maps.capacity = 0;
    let e = rig.allocate("c1", Family::V6).expect_err("full");
    assert!(
        matches!(
            e,
            AgentError::MapFull {
                map: "IPCACHE_HOST_V6",
                capacity: CAPACITY
            }
        ),
        "{e:?}"
    );
    assert!(rig.stored().is_empty());
    assert!(rig.core.allocations().next().is_none());
}

#[test]
fn a_refused_removal_during_rollback_is_reported_and_keeps_the_address_held() {
    let mut rig = Rig::new();
    rig.maps.faults.fail_next("ipcache_insert");
    rig.store.faults.fail_next("remove_endpoint");
    let e = rig.allocate("c1", Family::V4).expect_err("refused");
    let AgentError::Several { errors } = &e else {
        panic!("both failures reported: {e:?}");
    };
    assert_eq!(errors.len(), 2);
    assert!(matches!(errors[0], AgentError::Datapath(_)));
    assert!(matches!(errors[1], AgentError::Store(_)));
    assert_eq!(e.code(), "datapath_error", "the cause decides the code");
    // Core and store agree: both still hold it; the release is parked.
    let stored = rig.stored();
    assert_eq!(stored.len(), 1);
    let a = stored[0].clone();
    assert!(rig.held(&a));
    assert!(rig.parked.holds(&a));
    assert_eq!(rig.parked.describe().len(), 1);
    rig.assert_programmed(&[]);
    // Nobody else gets that address meanwhile.
    let b = rig.allocate("c2", Family::V4).expect("allocated");
    assert_ne!(b.address, a.address);
    // The store recovers: the parked release goes through.
    let Rig {
        parked,
        store,
        core,
        ..
    } = &mut rig;
    parked.retry(store, core).expect("accepted");
    assert!(!rig.held(&a));
    assert_eq!(rig.stored(), vec![b]);
}

#[test]
fn a_failed_unprogram_during_rollback_is_reported_too() {
    let mut rig = Rig::new();
    // The entry goes in... then the map refuses? No: the write fails and
    // the undo's delete fails as well; both are named.
    rig.maps.faults.fail_next("ipcache_insert");
    rig.maps.faults.fail_next("ipcache_remove");
    let e = rig.allocate("c1", Family::V4).expect_err("refused");
    let AgentError::Several { errors } = &e else {
        panic!("both failures reported: {e:?}");
    };
    assert_eq!(errors.len(), 2);
    assert!(errors.iter().all(|x| matches!(x, AgentError::Datapath(_))));
    // The store accepted the removal: the core let go.
    assert!(rig.stored().is_empty());
    assert!(rig.core.allocations().next().is_none());
}

// --- release: unprogram → commit --------------------------------------

#[test]
fn a_release_unprograms_removes_and_frees() {
    let mut rig = Rig::new();
    let a = rig.allocate("c1", Family::V4).expect("allocated");
    let released = rig.effects().unprogram_and_release(&a).expect("released");
    assert_eq!(released, a);
    assert!(!rig.held(&a));
    assert!(rig.stored().is_empty());
    rig.assert_programmed(&[]);
}

#[test]
fn a_refused_unprogram_changes_nothing() {
    let mut rig = Rig::new();
    let a = rig.allocate("c1", Family::V4).expect("allocated");
    rig.maps.faults.fail_next("ipcache_remove");
    let e = rig
        .effects()
        .unprogram_and_release(&a)
        .expect_err("refused");
    assert_eq!(e.code(), "datapath_error");
    assert!(rig.held(&a));
    assert_eq!(rig.stored(), vec![a.clone()]);
    rig.assert_programmed(&[&a]);
}

#[test]
fn a_refused_removal_programs_the_entry_again() {
    let mut rig = Rig::new();
    let a = rig.allocate("c1", Family::V4).expect("allocated");
    rig.store.faults.fail_next("remove_endpoint");
    let e = rig
        .effects()
        .unprogram_and_release(&a)
        .expect_err("refused");
    assert!(matches!(e, AgentError::Store(_)), "{e:?}");
    assert!(rig.held(&a));
    assert_eq!(rig.stored(), vec![a.clone()]);
    rig.assert_programmed(&[&a]);
}

#[test]
fn a_refused_removal_whose_reprogramming_fails_reports_both() {
    let mut rig = Rig::new();
    let a = rig.allocate("c1", Family::V4).expect("allocated");
    rig.store.faults.fail_next("remove_endpoint");
    rig.maps.faults.fail_next("ipcache_insert");
    let e = rig
        .effects()
        .unprogram_and_release(&a)
        .expect_err("refused");
    let AgentError::Several { errors } = &e else {
        panic!("both failures reported: {e:?}");
    };
    assert!(matches!(errors[0], AgentError::Store(_)));
    assert!(matches!(errors[1], AgentError::Datapath(_)));
    // Still held and stored (the next reconcile programs it again).
    assert!(rig.held(&a));
    assert_eq!(rig.stored(), vec![a]);
    rig.assert_programmed(&[]);
}

// --- role addresses ----------------------------------------------------

fn want(role: AgentRole, family: Family) -> RoleWant {
    RoleWant {
        role,
        family,
        pool: "p".into(),
    }
}

fn roles_held(rig: &Rig) -> Vec<(Owner, Family)> {
    rig.core
        .allocations()
        .map(|a| (a.owner.clone(), a.family()))
        .collect()
}

#[test]
fn wanted_roles_are_reserved_and_stored() {
    let mut rig = Rig::new();
    let plan = RolePlan {
        reserve: vec![
            want(AgentRole::Router, Family::V4),
            want(AgentRole::Health, Family::V6),
        ],
        release: Vec::new(),
    };
    rig.effects().apply_roles(plan).expect("reserved");
    let held: Vec<Allocation> = rig.core.allocations().cloned().collect();
    assert_eq!(held.len(), 2);
    let mut stored = rig.stored();
    stored.sort_by_key(|a| a.address);
    let mut held_sorted = held.clone();
    held_sorted.sort_by_key(|a| a.address);
    assert_eq!(stored, held_sorted, "core and store agree");
}

#[test]
fn a_refused_reservation_is_let_go_and_the_next_role_still_reserved() {
    let mut rig = Rig::new();
    rig.store.faults.fail_next("put");
    let plan = RolePlan {
        reserve: vec![
            want(AgentRole::Router, Family::V4),
            want(AgentRole::Health, Family::V4),
        ],
        release: Vec::new(),
    };
    let e = rig.effects().apply_roles(plan).expect_err("one refused");
    assert!(matches!(e, AgentError::Store(_)), "{e:?}");
    assert_eq!(
        roles_held(&rig),
        vec![(Owner::agent(AgentRole::Health), Family::V4)]
    );
    assert_eq!(rig.stored().len(), 1);
    assert_eq!(rig.stored()[0].owner, Owner::agent(AgentRole::Health));
}

#[test]
fn a_role_release_the_store_refuses_stays_held_and_the_others_go() {
    let mut rig = Rig::new();
    let reserve = RolePlan {
        reserve: vec![
            want(AgentRole::Router, Family::V4),
            want(AgentRole::Ingress, Family::V4),
        ],
        release: Vec::new(),
    };
    rig.effects().apply_roles(reserve).expect("reserved");
    let all: Vec<Allocation> = rig.core.allocations().cloned().collect();
    rig.store.faults.fail_next("remove_endpoint");
    let release = RolePlan {
        reserve: Vec::new(),
        release: all.clone(),
    };
    let e = rig.effects().apply_roles(release).expect_err("one refused");
    assert!(matches!(e, AgentError::Store(_)), "{e:?}");
    // The first (refused) is held and stored; the second is gone from both.
    assert!(rig.held(&all[0]));
    assert!(!rig.held(&all[1]));
    assert_eq!(rig.stored(), vec![all[0].clone()]);
}

#[test]
fn an_exhausted_pool_refuses_one_role_and_reserves_the_rest() {
    let mut rig = Rig::new();
    // Take three of the four IPv4 addresses.
    for i in 0..3 {
        rig.allocate(&format!("c{i}"), Family::V4)
            .expect("allocated");
    }
    let plan = RolePlan {
        reserve: vec![
            want(AgentRole::Router, Family::V4),
            want(AgentRole::Health, Family::V4),
            want(AgentRole::Ingress, Family::V6),
        ],
        release: Vec::new(),
    };
    let e = rig.effects().apply_roles(plan).expect_err("exhausted");
    assert_eq!(e.code(), "pool_exhausted");
    let roles: Vec<Owner> = rig
        .core
        .allocations()
        .filter(|a| matches!(a.owner, Owner::Agent { .. }))
        .map(|a| a.owner.clone())
        .collect();
    assert_eq!(roles.len(), 2, "router (the last v4) and ingress (v6)");
    assert!(roles.contains(&Owner::agent(AgentRole::Ingress)));
    assert_eq!(rig.stored().len(), 5);
}

#[test]
fn every_role_failure_is_collected_first_one_first() {
    let mut rig = Rig::new();
    rig.store.faults.fail_always("put");
    let plan = RolePlan {
        reserve: vec![
            want(AgentRole::Router, Family::V4),
            want(AgentRole::Health, Family::V6),
        ],
        release: Vec::new(),
    };
    let e = rig.effects().apply_roles(plan).expect_err("all refused");
    let AgentError::Several { errors } = &e else {
        panic!("every failure reported: {e:?}");
    };
    assert_eq!(errors.len(), 2);
    assert!(rig.core.allocations().next().is_none());
    assert!(rig.stored().is_empty());
}
