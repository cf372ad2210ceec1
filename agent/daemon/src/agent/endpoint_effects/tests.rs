//! ADD and DEL of an endpoint against the doors' doubles: every rollback
//! path, asserting what the core, the store, the maps and the host
//! interfaces hold afterwards.

use lockstep_common::endpoint_flags;
use lockstep_core::cidr::Family;
use lockstep_core::manager::{Allocation, ManagerConfig, PoolManager, StaticPools};
use lockstep_core::owner::Owner;
use lockstep_core::pool::PoolSpec;

use super::EndpointEffects;
use crate::agent::AgentError;
use crate::agent::doors::doubles::{FlakyStore, LinkDouble, MapDouble};
use crate::agent::release::ParkedReleases;
use crate::store::{EndpointMode, EndpointRecord};

const HOST: &str = "lxc0123456789ab";
const IFINDEX: u32 = 7;

struct Rig {
    core: PoolManager<StaticPools>,
    store: FlakyStore,
    maps: MapDouble,
    links: LinkDouble,
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
            links: LinkDouble::default(),
            parked: ParkedReleases::default(),
        }
    }

    fn fx(&mut self) -> EndpointEffects<'_, StaticPools, FlakyStore, MapDouble, LinkDouble> {
        EndpointEffects {
            core: &mut self.core,
            store: &self.store,
            maps: &mut self.maps,
            links: &mut self.links,
            parked: &mut self.parked,
            capacity: 16,
        }
    }

    /// An ADD up to its interfaces: both families held in the core, and
    /// (full mode) the host veth made.
    fn prepare(&mut self, id: &str, mode: EndpointMode) -> (EndpointRecord, Vec<Allocation>) {
        let owner = Owner::endpoint(id, "eth0");
        let allocated: Vec<Allocation> = [Family::V4, Family::V6]
            .into_iter()
            .map(|f| {
                self.core
                    .allocate_next("p", f, owner.clone())
                    .expect("room")
            })
            .collect();
        let full = mode == EndpointMode::Full;
        if full {
            self.links.hosts.insert(HOST.into(), IFINDEX);
        }
        let record = EndpointRecord {
            container_id: id.into(),
            ifname: "eth0".into(),
            netns: "/run/netns/test".into(),
            mode,
            pool: "p".into(),
            addresses: allocated.iter().map(|a| a.address).collect(),
            host_ifname: full.then(|| HOST.to_string()),
            host_ifindex: if full { IFINDEX } else { 0 },
            host_mac: [2, 0, 0, 0, 0, 1],
            mac: [2, 0, 0, 0, 0, 2],
            releasing: false,
            pod: None,
        };
        (record, allocated)
    }

    /// A full ADD that went through.
    fn added(&mut self, id: &str) -> (EndpointRecord, Vec<Allocation>) {
        let (record, allocated) = self.prepare(id, EndpointMode::Full);
        self.fx()
            .finish_add(&record, &allocated, Ok(()))
            .expect("added");
        (record, allocated)
    }

    fn nothing_held(&self) -> bool {
        self.core.allocations().next().is_none()
    }

    fn assert_all_undone(&self) {
        assert!(self.nothing_held(), "the core let go");
        let stored = self.store.load();
        assert!(stored.allocations.is_empty(), "{:?}", stored.allocations);
        assert!(stored.endpoints.is_empty());
        assert!(self.maps.ipcache.is_empty(), "{:?}", self.maps.ipcache);
        assert!(self.maps.endpoints.is_empty());
        assert!(self.links.hosts.is_empty(), "the veth was removed");
        assert!(self.parked.is_empty());
    }
}

fn interface_error() -> AgentError {
    AgentError::Invalid {
        reason: "interface eth0 already exists in /run/netns/test".into(),
    }
}

fn several(e: &AgentError) -> &[AgentError] {
    match e {
        AgentError::Several { errors } => errors,
        other => panic!("every failure should be reported: {other:?}"),
    }
}

// --- ADD ----------------------------------------------------------------

#[test]
fn a_full_add_commits_and_programs_both_families_and_the_endpoint() {
    let mut rig = Rig::new();
    let (record, allocated) = rig.added("c1");
    let stored = rig.store.load();
    assert_eq!(stored.endpoints, vec![record.clone()]);
    assert_eq!(stored.allocations.len(), 2);
    for a in &allocated {
        let v = rig.maps.ipcache[&a.address.into()];
        assert_eq!(
            v.ifindex, IFINDEX,
            "the host ifindex, as the planner has it"
        );
    }
    let ep = rig.maps.endpoints[&IFINDEX];
    assert_eq!(ep.flags, endpoint_flags::HAS_V4 | endpoint_flags::HAS_V6);
    assert_eq!(ep.mac, record.mac);
    assert_eq!(rig.links.hosts.get(HOST), Some(&IFINDEX));
}

#[test]
fn an_ipam_add_programs_ipcache_without_ifindex_and_no_endpoint() {
    let mut rig = Rig::new();
    let (record, allocated) = rig.prepare("c1", EndpointMode::Ipam);
    rig.fx()
        .finish_add(&record, &allocated, Ok(()))
        .expect("added");
    assert_eq!(rig.maps.ipcache.len(), 2);
    assert!(rig.maps.ipcache.values().all(|v| v.ifindex == 0));
    assert!(rig.maps.endpoints.is_empty());
    assert_eq!(rig.links.faults.calls("remove_host"), 0);
}

#[test]
fn failed_interfaces_remove_the_veth_made_and_release_the_core() {
    let mut rig = Rig::new();
    let (mut record, allocated) = rig.prepare("c1", EndpointMode::Full);
    // The interfaces failed: the record never learnt the veth's name.
    record.host_ifname = None;
    let e = rig
        .fx()
        .finish_add(
            &record,
            &allocated,
            Err((interface_error(), Some((HOST.into(), IFINDEX)))),
        )
        .expect_err("failed");
    assert_eq!(
        e.to_string(),
        "invalid request: interface eth0 already exists in /run/netns/test"
    );
    assert_eq!(
        rig.store.faults.calls("put_endpoint"),
        0,
        "nothing committed"
    );
    rig.assert_all_undone();
}

#[test]
fn failed_interfaces_whose_veth_cannot_be_removed_report_both() {
    let mut rig = Rig::new();
    let (mut record, allocated) = rig.prepare("c1", EndpointMode::Full);
    // The interfaces failed: the record never learnt the veth's name.
    record.host_ifname = None;
    rig.links.faults.fail_next("remove_host");
    let e = rig
        .fx()
        .finish_add(
            &record,
            &allocated,
            Err((interface_error(), Some((HOST.into(), IFINDEX)))),
        )
        .expect_err("failed");
    let errors = several(&e);
    assert_eq!(errors.len(), 2);
    assert!(crate::error_chain(&errors[1]).contains("link pin"), "{e}");
    assert!(rig.nothing_held(), "the core let go anyway");
    assert_eq!(
        rig.links.hosts.get(HOST),
        Some(&IFINDEX),
        "still there, reported"
    );
}

#[test]
fn a_refused_commit_removes_the_veth_and_releases_the_core() {
    let mut rig = Rig::new();
    let (record, allocated) = rig.prepare("c1", EndpointMode::Full);
    rig.store.faults.fail_next("put_endpoint");
    let e = rig
        .fx()
        .finish_add(&record, &allocated, Ok(()))
        .expect_err("refused");
    assert!(matches!(e, AgentError::Store(_)), "{e:?}");
    assert_eq!(
        rig.maps.faults.calls("ipcache_insert"),
        0,
        "nothing programmed"
    );
    rig.assert_all_undone();
}

#[test]
fn a_failed_ipcache_write_undoes_the_first_family_the_record_and_the_veth() {
    let mut rig = Rig::new();
    let (record, allocated) = rig.prepare("c1", EndpointMode::Full);
    // The IPv4 entry goes in, the IPv6 one fails.
    rig.maps.faults.fail_at("ipcache_insert", 2);
    let e = rig
        .fx()
        .finish_add(&record, &allocated, Ok(()))
        .expect_err("failed");
    assert_eq!(
        crate::error_chain(&e),
        "cannot write IPCACHE_HOST_V6: Operation not permitted (os error 1)"
    );
    rig.assert_all_undone();
}

#[test]
fn a_full_endpoints_map_is_map_full_and_everything_is_undone() {
    let mut rig = Rig::new();
    let (record, allocated) = rig.prepare("c1", EndpointMode::Full);
    rig.maps.capacity = 2;
    rig.maps.endpoints.insert(1, Default::default());
    rig.maps.endpoints.insert(2, Default::default());
    let e = rig
        .fx()
        .finish_add(&record, &allocated, Ok(()))
        .expect_err("full");
    assert_eq!(e.code(), "map_full");
    assert!(
        matches!(
            e,
            AgentError::MapFull {
                map: "ENDPOINTS",
                capacity: 16
            }
        ),
        "{e:?}"
    );
    rig.maps.endpoints.clear();
    rig.assert_all_undone();
}

#[test]
fn a_store_refusing_the_undo_keeps_the_addresses_held_and_says_so() {
    let mut rig = Rig::new();
    let (record, allocated) = rig.prepare("c1", EndpointMode::Full);
    rig.maps.faults.fail_next("endpoint_insert");
    rig.store.faults.fail_next("remove_endpoint");
    let e = rig
        .fx()
        .finish_add(&record, &allocated, Ok(()))
        .expect_err("failed");
    let errors = several(&e);
    assert_eq!(errors.len(), 2, "{e}");
    assert!(matches!(errors[1], AgentError::Store(_)));
    // Core and store agree: both keep the addresses, the release parked.
    let stored = rig.store.load();
    assert_eq!(stored.endpoints, vec![record.clone()]);
    assert_eq!(stored.allocations.len(), 2);
    assert!(allocated.iter().all(|a| rig.parked.holds(a)));
    assert_eq!(rig.core.allocations().count(), 2);
    assert_eq!(
        rig.parked
            .cause(&record.key())
            .map(|c| c.contains("No space")),
        Some(true)
    );
    // Nothing of it is served, and the veth is gone.
    assert!(rig.maps.ipcache.is_empty());
    assert!(rig.links.hosts.is_empty());
    // The store recovers: the parked release goes in, the core lets go.
    let Rig {
        parked,
        store,
        core,
        ..
    } = &mut rig;
    parked.retry(store, core).expect("accepted");
    rig.assert_all_undone();
}

#[test]
fn every_undo_failure_is_collected_after_the_cause() {
    let mut rig = Rig::new();
    let (record, allocated) = rig.prepare("c1", EndpointMode::Full);
    rig.maps.faults.fail_next("endpoint_insert");
    rig.maps.faults.fail_always("ipcache_remove");
    rig.links.faults.fail_next("remove_host");
    let e = rig
        .fx()
        .finish_add(&record, &allocated, Ok(()))
        .expect_err("failed");
    // The cause, two IPCACHE entries that stayed, the veth that stayed.
    let errors = several(&e);
    assert_eq!(errors.len(), 4, "{e}");
    assert!(crate::error_chain(&errors[0]).starts_with("cannot write ENDPOINTS"));
    assert!(crate::error_chain(&errors[1]).starts_with("cannot write IPCACHE_HOST_V4"));
    assert!(crate::error_chain(&errors[2]).starts_with("cannot write IPCACHE_HOST_V6"));
    assert!(crate::error_chain(&errors[3]).contains("link pin"));
    // The store took the removal: the core let go (the entries left are
    // the next reconcile's to remove).
    assert!(rig.nothing_held());
    assert!(rig.store.load().endpoints.is_empty());
}

// --- DEL ----------------------------------------------------------------

#[test]
fn a_del_unprograms_removes_and_releases() {
    let mut rig = Rig::new();
    let (record, allocated) = rig.added("c1");
    let faults = rig
        .fx()
        .del(&record.key(), Some(&record), &allocated)
        .expect("deleted");
    assert!(faults.is_empty());
    assert!(rig.nothing_held());
    assert!(rig.maps.ipcache.is_empty());
    assert!(rig.maps.endpoints.is_empty());
    let stored = rig.store.load();
    assert!(stored.endpoints.is_empty() && stored.allocations.is_empty());
}

#[test]
fn a_del_removes_the_translations_of_every_address_and_a_refusal_commits_nothing() {
    let mut rig = Rig::new();
    let (record, allocated) = rig.added("c1");
    for a in &allocated {
        rig.maps.nat.insert(a.address, 2);
    }
    rig.maps.nat.insert("10.9.0.3".parse().expect("ip"), 2);
    rig.maps.faults.fail_next("nat_remove");
    rig.fx()
        .del(&record.key(), Some(&record), &allocated)
        .expect_err("a translation stayed");
    // Nothing committed while a translation of the address may remain.
    assert_eq!(rig.store.load().endpoints, vec![record.clone()]);
    assert_eq!(rig.core.allocations().count(), 2);
    rig.fx()
        .del(&record.key(), Some(&record), &allocated)
        .expect("deleted");
    // Only the other address's translations are left.
    assert_eq!(
        rig.maps.nat.keys().copied().collect::<Vec<_>>(),
        vec!["10.9.0.3".parse::<std::net::IpAddr>().expect("ip")]
    );
    assert!(rig.nothing_held());
}

#[test]
fn a_del_tries_every_entry_and_commits_nothing_if_one_stays() {
    let mut rig = Rig::new();
    let (record, allocated) = rig.added("c1");
    rig.maps.faults.fail_next("endpoint_remove");
    let e = rig
        .fx()
        .del(&record.key(), Some(&record), &allocated)
        .expect_err("failed");
    assert!(
        crate::error_chain(&e).starts_with("cannot write ENDPOINTS"),
        "{e}"
    );
    // The IPCACHE entries were still removed (every entry is tried)...
    assert!(rig.maps.ipcache.is_empty());
    assert!(rig.maps.endpoints.contains_key(&IFINDEX));
    // ...and nothing was committed: store and core keep the endpoint.
    assert_eq!(rig.store.faults.calls("remove_endpoint"), 0);
    assert_eq!(rig.store.load().endpoints, vec![record]);
    assert_eq!(rig.core.allocations().count(), 2);
}

#[test]
fn a_del_reports_every_entry_that_stayed_not_only_the_first() {
    let mut rig = Rig::new();
    let (record, allocated) = rig.added("c1");
    rig.maps.faults.fail_always("ipcache_remove");
    let e = rig
        .fx()
        .del(&record.key(), Some(&record), &allocated)
        .expect_err("failed");
    let errors = several(&e);
    assert_eq!(errors.len(), 2, "{e}");
    assert!(crate::error_chain(&errors[0]).contains("IPCACHE_HOST_V4"));
    assert!(crate::error_chain(&errors[1]).contains("IPCACHE_HOST_V6"));
    assert_eq!(rig.core.allocations().count(), 2);
}

#[test]
fn a_del_the_store_refuses_keeps_the_endpoint_held_and_stored() {
    let mut rig = Rig::new();
    let (record, allocated) = rig.added("c1");
    rig.store.faults.fail_next("remove_endpoint");
    let e = rig
        .fx()
        .del(&record.key(), Some(&record), &allocated)
        .expect_err("refused");
    assert!(matches!(e, AgentError::Store(_)), "{e:?}");
    assert_eq!(rig.store.load().endpoints, vec![record]);
    assert_eq!(rig.core.allocations().count(), 2, "core and store agree");
}

#[test]
fn a_del_without_record_releases_the_owner_allocations() {
    let mut rig = Rig::new();
    let (record, allocated) = rig.added("c1");
    // A record lost (an older agent stored allocations only).
    let key = record.key();
    let faults = rig.fx().del(&key, None, &allocated).expect("deleted");
    assert!(faults.is_empty());
    assert!(rig.nothing_held());
    assert!(rig.maps.ipcache.is_empty());
    assert!(rig.store.load().allocations.is_empty());
}

#[test]
fn a_del_of_what_the_core_does_not_hold_reports_the_fault_and_goes_on() {
    let mut rig = Rig::new();
    let (record, allocated) = rig.added("c1");
    // The core lost them (a fault); the store and maps still had them.
    for a in &allocated {
        rig.core
            .release(&a.pool, a.family(), &a.owner, a.generation)
            .expect("held");
    }
    let faults = rig
        .fx()
        .del(&record.key(), Some(&record), &allocated)
        .expect("the DEL goes on");
    assert_eq!(faults.len(), 2, "{faults:?}");
    assert!(faults.iter().all(|f| f.code() == "not_found"));
    assert!(rig.store.load().endpoints.is_empty());
    assert!(rig.maps.ipcache.is_empty());
}
