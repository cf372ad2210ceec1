//! LB apply and delete: every rollback path of [`lb_transaction`], with the
//! doors' doubles (maps in memory, a real store in a temporary directory)
//! told to fail at a given call.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;

use ipnet::IpNet;
use lockstep_common::{IpcacheValue, L2RespValue};
use lockstep_core::lb::{LbIpam, LbPoolSpec, LbSnapshot, ServiceSpec};

use super::{LbHost, lb_err, lb_transaction};
use crate::agent::AgentError;
use crate::agent::doors::MapDoor;
use crate::agent::doors::StoreDoor;
use crate::agent::doors::doubles::{FlakyStore, MapDouble};

/// The LB state, the store and the maps, with what was announced.
struct Rig {
    lb: LbIpam,
    store: FlakyStore,
    maps: MapDouble,
    unsaved: bool,
    announced: Vec<std::net::IpAddr>,
}

/// The L2_RESP_V4 value the rig writes for an announced address.
const L2: L2RespValue = L2RespValue {
    ifindex: 2,
    mac: [2, 0, 0, 0, 0, 1],
    _pad: [0; 2],
    check: 0,
    expires_ns: 0,
};

impl LbHost for Rig {
    fn lb_state(&mut self) -> &mut LbIpam {
        &mut self.lb
    }

    fn put_lb(&mut self, state: &LbSnapshot) -> Result<(), AgentError> {
        Ok(StoreDoor::put_lb(&self.store, state)?)
    }

    /// A reconcile of the maps to the plan through the map door: removals
    /// first, then what is missing or different.
    fn program(&mut self) -> Result<(), AgentError> {
        let plan = self.lb.plan();
        let want: BTreeMap<IpNet, IpcacheValue> = plan
            .ipcache_v4
            .into_iter()
            .map(|(n, v)| (IpNet::V4(n), v))
            .chain(plan.ipcache_v6.into_iter().map(|(n, v)| (IpNet::V6(n), v)))
            .collect();
        let want_l2: Vec<[u8; 4]> = plan.l2_announce_v4.keys().map(|a| a.octets()).collect();
        let stale: Vec<IpNet> = self
            .maps
            .ipcache
            .keys()
            .filter(|k| !want.contains_key(k))
            .copied()
            .collect();
        for k in stale {
            self.maps.ipcache_remove(k)?;
        }
        let stale_l2: Vec<[u8; 4]> = self
            .maps
            .l2
            .keys()
            .filter(|k| !want_l2.contains(k))
            .copied()
            .collect();
        for k in stale_l2 {
            self.maps.l2_remove(k)?;
        }
        for (k, v) in want {
            if self.maps.ipcache.get(&k) != Some(&v) {
                self.maps.ipcache_insert(k, v)?;
            }
        }
        for k in want_l2 {
            if !self.maps.l2.contains_key(&k) {
                self.maps.l2_insert(k, &L2)?;
            }
        }
        Ok(())
    }

    fn set_unsaved(&mut self) {
        self.unsaved = true;
    }

    fn announce(&mut self, addr: std::net::IpAddr) {
        self.announced.push(addr);
    }
}

fn pool() -> LbPoolSpec {
    let mut p = LbPoolSpec::new("public").cidr("192.0.2.0/29");
    p.announce = Some(lockstep_core::lb::Announce::L2);
    p
}

fn svc(name: &str) -> ServiceSpec {
    ServiceSpec::new("ns", name)
}

fn apply_svc(name: &str) -> impl FnOnce(&mut LbIpam) -> Result<(), AgentError> {
    let s = svc(name);
    move |lb| lb.apply_service(s).map(drop).map_err(lb_err)
}

impl Rig {
    /// Pool `public` (192.0.2.0/29, announced) and service `ns/a`,
    /// committed and programmed.
    fn new() -> Rig {
        let mut rig = Rig {
            lb: LbIpam::new(),
            store: FlakyStore::new(),
            maps: MapDouble::default(),
            unsaved: false,
            announced: Vec::new(),
        };
        lb_transaction(&mut rig, |lb| {
            lb.apply_pools(vec![pool()]).map_err(lb_err)?;
            lb.apply_service(svc("a")).map_err(lb_err)?;
            Ok(())
        })
        .expect("the first change goes in");
        rig.announced.clear();
        rig
    }

    /// The address of service `ns/<name>`, if it has one.
    fn addr(&self, name: &str) -> Option<Ipv4Addr> {
        let id = format!("ns/{name}");
        let (_, st) = self.lb.services().find(|(s, _)| *s == id)?;
        st.addresses().iter().find_map(|a| match a {
            std::net::IpAddr::V4(v4) => Some(*v4),
            std::net::IpAddr::V6(_) => None,
        })
    }

    fn stored(&self) -> Option<LbSnapshot> {
        self.store.load().lb
    }

    /// The maps hold exactly what `snapshot`'s plan asks for.
    fn assert_maps_hold(&self, snapshot: &LbSnapshot) {
        let plan = LbIpam::restore(snapshot).expect("restores").plan();
        let want: BTreeMap<IpNet, IpcacheValue> = plan
            .ipcache_v4
            .into_iter()
            .map(|(n, v)| (IpNet::V4(n), v))
            .collect();
        assert_eq!(self.maps.ipcache, want, "IPCACHE");
        let l2: Vec<[u8; 4]> = plan.l2_announce_v4.keys().map(|a| a.octets()).collect();
        assert_eq!(self.maps.l2.keys().copied().collect::<Vec<_>>(), l2, "L2");
    }
}

fn host(addr: Ipv4Addr) -> IpNet {
    IpNet::from(std::net::IpAddr::V4(addr))
}

#[test]
fn a_change_commits_programs_and_announces_the_new_address() {
    let mut rig = Rig::new();
    lb_transaction(&mut rig, apply_svc("b")).expect("applied");
    let b = rig.addr("b").expect("b has an address");
    assert_eq!(rig.stored(), Some(rig.lb.snapshot()));
    assert!(rig.maps.ipcache.contains_key(&host(b)));
    assert!(rig.maps.l2.contains_key(&b.octets()));
    assert_eq!(
        rig.announced,
        vec![std::net::IpAddr::V4(b)],
        "only the new address is announced"
    );
}

#[test]
fn a_refused_change_leaves_memory_store_and_maps_as_they_were() {
    let mut rig = Rig::new();
    let before = rig.lb.snapshot();
    let puts = rig.store.faults.calls("put_lb");
    let e = lb_transaction(&mut rig, |lb| {
        // Half done, then refused: the half is undone too.
        lb.apply_service(svc("b")).map_err(lb_err)?;
        lb.delete_service("ns/nope").map_err(lb_err)?;
        Ok(())
    })
    .expect_err("unknown service");
    assert_eq!(e.to_string(), "invalid request: unknown service ns/nope");
    assert_eq!(rig.lb.snapshot(), before);
    assert_eq!(rig.addr("b"), None);
    assert_eq!(rig.store.faults.calls("put_lb"), puts, "nothing committed");
    assert_eq!(rig.stored(), Some(before.clone()));
    rig.assert_maps_hold(&before);
    assert!(rig.announced.is_empty());
}

#[test]
fn a_refused_commit_restores_memory_and_programs_nothing() {
    let mut rig = Rig::new();
    let before = rig.lb.snapshot();
    rig.store.faults.fail_next("put_lb");
    let inserts = rig.maps.faults.calls("ipcache_insert");
    let e = lb_transaction(&mut rig, apply_svc("b")).expect_err("store refuses");
    assert!(matches!(e, AgentError::Store(_)), "{e:?}");
    assert!(
        crate::error_chain(&e).contains("No space left on device"),
        "{e}"
    );
    assert_eq!(rig.lb.snapshot(), before);
    assert_eq!(rig.stored(), Some(before.clone()));
    assert_eq!(rig.maps.faults.calls("ipcache_insert"), inserts);
    rig.assert_maps_hold(&before);
    assert!(rig.announced.is_empty());
    assert!(!rig.unsaved);
}

#[test]
fn a_failed_ipcache_write_rolls_back_memory_store_and_maps() {
    let mut rig = Rig::new();
    let before = rig.lb.snapshot();
    rig.maps.faults.fail_next("ipcache_insert");
    let e = lb_transaction(&mut rig, apply_svc("b")).expect_err("programming fails");
    assert_eq!(
        crate::error_chain(&e),
        "cannot write IPCACHE_HOST_V4: Operation not permitted (os error 1)"
    );
    assert_eq!(rig.lb.snapshot(), before, "memory has the old state");
    assert_eq!(rig.stored(), Some(before.clone()), "so has the store");
    rig.assert_maps_hold(&before);
    assert!(rig.announced.is_empty());
    assert!(!rig.unsaved);
}

#[test]
fn a_full_ipcache_is_named_and_rolled_back() {
    let mut rig = Rig::new();
    let before = rig.lb.snapshot();
    rig.maps.capacity = rig.maps.ipcache.len();
    let e = lb_transaction(&mut rig, apply_svc("b")).expect_err("full");
    assert!(
        matches!(
            e,
            AgentError::Datapath(crate::datapath::DatapathError::MapFull {
                map: "IPCACHE_HOST_V4"
            })
        ),
        "{e:?}"
    );
    assert_eq!(rig.lb.snapshot(), before);
    assert_eq!(rig.stored(), Some(before.clone()));
    rig.assert_maps_hold(&before);
}

#[test]
fn a_failed_l2_write_takes_the_ipcache_entry_back_out() {
    let mut rig = Rig::new();
    let before = rig.lb.snapshot();
    rig.maps.faults.fail_next("l2_insert");
    let e = lb_transaction(&mut rig, apply_svc("b")).expect_err("l2 fails");
    assert!(
        crate::error_chain(&e).starts_with("cannot write L2_RESP_V4"),
        "{e}"
    );
    // The IPCACHE entry of b went in before L2 failed; the undo removed it.
    rig.assert_maps_hold(&before);
    assert_eq!(rig.stored(), Some(before));
    assert!(rig.announced.is_empty(), "nothing announced for a rollback");
}

#[test]
fn a_store_refusing_the_old_state_is_marked_unsaved_and_both_errors_reported() {
    let mut rig = Rig::new();
    let before = rig.lb.snapshot();
    rig.maps.faults.fail_next("ipcache_insert");
    // The commit of the new state goes in; the undo's commit is refused.
    let next = rig.store.faults.calls("put_lb") + 2;
    rig.store.faults.fail_at("put_lb", next);
    let e = lb_transaction(&mut rig, apply_svc("b")).expect_err("fails");
    let AgentError::Several { errors } = &e else {
        panic!("every failure is reported: {e:?}");
    };
    assert_eq!(errors.len(), 2, "{e}");
    assert!(matches!(errors[0], AgentError::Datapath(_)));
    assert!(matches!(errors[1], AgentError::Store(_)));
    assert_eq!(
        rig.lb.snapshot(),
        before,
        "memory is what the caller was told"
    );
    // Store and memory are apart, and that is recorded, not silent.
    assert_ne!(rig.stored(), Some(before.clone()));
    assert!(rig.unsaved);
    rig.assert_maps_hold(&before);
}

#[test]
fn a_second_programming_failure_is_reported_after_the_first() {
    let mut rig = Rig::new();
    let before = rig.lb.snapshot();
    // b's IPCACHE entry goes in, its L2 entry fails; the undo's reconcile
    // cannot take the IPCACHE entry back out.
    rig.maps.faults.fail_next("l2_insert");
    rig.maps.faults.fail_always("ipcache_remove");
    let e = lb_transaction(&mut rig, apply_svc("b")).expect_err("fails");
    let AgentError::Several { errors } = &e else {
        panic!("both failures reported: {e:?}");
    };
    assert_eq!(errors.len(), 2, "{e}");
    assert!(crate::error_chain(&errors[0]).starts_with("cannot write L2_RESP_V4"));
    assert!(crate::error_chain(&errors[1]).starts_with("cannot write IPCACHE_HOST_V4"));
    assert_eq!(rig.lb.snapshot(), before);
    assert_eq!(rig.stored(), Some(before.clone()), "store and memory agree");
    assert!(!rig.unsaved);
    // What the undo could not remove is still there (the next reconcile
    // repairs it); nothing else is.
    assert_eq!(rig.maps.ipcache.len(), 2, "a's entry and the stale one");
    rig.maps.faults.heal();
    rig.program().expect("a reconcile repairs");
    rig.assert_maps_hold(&before);
}

#[test]
fn a_failed_delete_keeps_the_service_its_address_and_its_announcement() {
    let mut rig = Rig::new();
    let before = rig.lb.snapshot();
    let a = rig.addr("a").expect("address");
    // IPCACHE removal goes through, L2 removal fails: the undo puts the
    // IPCACHE entry back.
    rig.maps.faults.fail_next("l2_remove");
    let e = lb_transaction(&mut rig, |lb| {
        lb.delete_service("ns/a").map(drop).map_err(lb_err)
    })
    .expect_err("fails");
    assert!(
        crate::error_chain(&e).starts_with("cannot write L2_RESP_V4"),
        "{e}"
    );
    assert_eq!(rig.addr("a"), Some(a));
    assert_eq!(rig.stored(), Some(before.clone()));
    rig.assert_maps_hold(&before);
    assert!(rig.maps.l2.contains_key(&a.octets()));
}

#[test]
fn a_delete_that_goes_through_stops_serving_and_frees_the_address() {
    let mut rig = Rig::new();
    let a = rig.addr("a").expect("address");
    lb_transaction(&mut rig, |lb| {
        lb.delete_service("ns/a").map(drop).map_err(lb_err)
    })
    .expect("deleted");
    assert!(!rig.maps.ipcache.contains_key(&host(a)));
    assert!(!rig.maps.l2.contains_key(&a.octets()));
    assert_eq!(rig.stored(), Some(rig.lb.snapshot()));
    // The address is free: a service asking for it gets it.
    let mut c = svc("c");
    c.load_balancer_ips.push(a.into());
    lb_transaction(&mut rig, move |lb| {
        lb.apply_service(c).map(drop).map_err(lb_err)
    })
    .expect("applied");
    assert_eq!(rig.addr("c"), Some(a));
}

#[test]
fn after_a_rollback_the_same_change_goes_through() {
    let mut rig = Rig::new();
    rig.maps.faults.fail_next("ipcache_insert");
    lb_transaction(&mut rig, apply_svc("b")).expect_err("first try fails");
    lb_transaction(&mut rig, apply_svc("b")).expect("second try");
    let b = rig.addr("b").expect("b has an address");
    assert_eq!(rig.stored(), Some(rig.lb.snapshot()));
    assert!(rig.maps.ipcache.contains_key(&host(b)));
    assert_eq!(rig.announced, vec![b], "announced once, when it went in");
}

#[test]
fn a_pool_change_that_fails_to_program_keeps_the_old_pools() {
    let mut rig = Rig::new();
    let before = rig.lb.snapshot();
    let a = rig.addr("a").expect("address");
    rig.maps.faults.fail_next("ipcache_remove");
    // Deleting the pool takes ns/a's address away; programming that fails.
    let e = lb_transaction(&mut rig, |lb| {
        lb.delete_pool("public").map(drop).map_err(lb_err)
    })
    .expect_err("fails");
    assert!(matches!(e, AgentError::Datapath(_)), "{e:?}");
    assert_eq!(rig.lb.snapshot(), before);
    assert_eq!(rig.addr("a"), Some(a));
    assert_eq!(rig.stored(), Some(before.clone()));
    rig.assert_maps_hold(&before);
}
