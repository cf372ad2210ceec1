use super::*;
use crate::owner::{AgentRole, Generation, Owner};
use lockstep_common::{identity, ipcache_flags};
use proptest::prelude::*;

fn alloc(address: &str, owner: Owner) -> Allocation {
    Allocation {
        pool: "pods".into(),
        address: address.parse().unwrap(),
        owner,
        generation: Generation(7),
    }
}

fn input<'a>(
    allocations: &'a [Allocation],
    endpoints: Vec<LocalEndpoint<'a>>,
) -> DesiredInput<'a, &'a [Allocation]> {
    DesiredInput {
        allocations,
        endpoints,
        lb_hosts: Vec::new(),
        announce_v4: Vec::new(),
        announce_v6: Vec::new(),
        uplink: None,
        masq_skip_pools: Vec::new(),
        non_masquerade: &[],
    }
}

const UPLINK: Uplink = Uplink {
    ifindex: 3,
    mac: [2, 0, 0, 0, 0, 3],
    expires_ns: 5_000_000_000,
};

#[test]
fn an_endpoint_gets_its_host_entries_its_endpoint_value_and_its_slot() {
    let addrs: Vec<IpAddr> = vec!["10.0.0.5".parse().unwrap(), "fd00::5".parse().unwrap()];
    let allocs = [
        alloc("10.0.0.5", Owner::endpoint("c1", "eth0")),
        alloc("fd00::5", Owner::endpoint("c1", "eth0")),
    ];
    let ep = LocalEndpoint {
        container_id: "c1",
        ifname: "eth0",
        host_ifindex: 42,
        mac: [2, 1, 2, 3, 4, 5],
        addresses: &addrs,
        generation: 7,
    };
    let d = desired(input(&allocs, vec![ep])).unwrap();
    assert!(d.lb_conflicts.is_empty());
    let m = &d.maps;
    assert_eq!(m.host_v4.len(), 1);
    assert_eq!(m.host_v4[0].0, [10, 0, 0, 5]);
    assert_eq!(m.host_v4[0].1.ifindex, 42, "the host entry names the veth");
    assert_eq!(m.host_v4[0].1.identity, identity::ENDPOINT);
    assert_eq!(m.host_v6[0].1.ifindex, 42);
    assert_eq!(m.endpoints.len(), 1);
    let (k, v) = m.endpoints[0];
    assert_eq!(k, 42);
    assert_eq!(v.mac, [2, 1, 2, 3, 4, 5]);
    assert_eq!(v.ipv4, [10, 0, 0, 5]);
    assert_eq!(
        v.flags & (endpoint_flags::HAS_V4 | endpoint_flags::HAS_V6),
        endpoint_flags::HAS_V4 | endpoint_flags::HAS_V6
    );
    assert_eq!(v.generation, 7);
    assert_eq!(v, v.sealed(42), "stored sealed");
    assert_eq!(m.endpoint_slots.len(), 1);
    assert_eq!(m.endpoint_slots[0].0, slots::endpoint(42));
}

#[test]
fn an_allocation_without_a_local_endpoint_has_no_ifindex() {
    let allocs = [
        alloc("10.0.0.6", Owner::endpoint("ipam-only", "eth0")),
        alloc("10.0.0.1", Owner::agent(AgentRole::Router)),
    ];
    let d = desired(input(&allocs, Vec::new())).unwrap();
    assert_eq!(d.maps.host_v4.len(), 2);
    assert!(d.maps.host_v4.iter().all(|(_, v)| v.ifindex == 0));
    let router = d
        .maps
        .host_v4
        .iter()
        .find(|e| e.0 == [10, 0, 0, 1])
        .unwrap();
    assert_eq!(router.1.flags, ipcache_flags::ROUTER);
    assert!(d.maps.endpoints.is_empty() && d.maps.endpoint_slots.is_empty());
}

#[test]
fn two_owners_of_one_address_are_refused() {
    let allocs = [
        alloc("10.0.0.7", Owner::endpoint("a", "eth0")),
        alloc("10.0.0.7", Owner::endpoint("b", "eth0")),
    ];
    assert!(matches!(
        desired(input(&allocs, Vec::new())),
        Err(PlanError::DuplicateAddress { .. })
    ));
}

#[test]
fn an_lb_address_held_by_an_allocation_keeps_the_allocation_and_is_reported() {
    let allocs = [alloc("10.0.0.8", Owner::endpoint("a", "eth0"))];
    let mut i = input(&allocs, Vec::new());
    let lb_value = IpcacheValue {
        identity: identity::LOADBALANCER,
        flags: ipcache_flags::LOADBALANCER,
        ..Default::default()
    };
    i.lb_hosts = vec![
        ("10.0.0.8".parse().unwrap(), lb_value),
        ("192.0.2.1".parse().unwrap(), lb_value),
        ("2001:db8::1".parse().unwrap(), lb_value),
    ];
    let d = desired(i).unwrap();
    assert_eq!(d.lb_conflicts, vec!["10.0.0.8".parse::<IpAddr>().unwrap()]);
    let keys: Vec<V4Addr> = d.maps.host_v4.iter().map(|e| e.0).collect();
    assert_eq!(keys, vec![[10, 0, 0, 8], [192, 0, 2, 1]], "sorted, unique");
    assert_eq!(d.maps.host_v4[0].1.identity, identity::ENDPOINT);
    assert_eq!(d.maps.host_v6.len(), 1);
}

#[test]
fn announcements_need_an_uplink_and_are_sealed_with_slots() {
    let a: Ipv4Addr = "192.0.2.10".parse().unwrap();
    let mut i = input(&[], Vec::new());
    i.announce_v4 = vec![a, a];
    assert!(desired(i.clone()).unwrap().maps.l2.is_empty(), "no uplink");
    i.uplink = Some(UPLINK);
    let m = desired(i).unwrap().maps;
    assert_eq!(m.l2.len(), 1, "one entry per address");
    let (k, v) = m.l2[0];
    assert_eq!(k, a.octets());
    assert_eq!((v.ifindex, v.mac), (UPLINK.ifindex, UPLINK.mac));
    assert_eq!(v.expires_ns, UPLINK.expires_ns, "the uplink's expiry");
    assert_eq!(v, v.sealed(k));
    assert_eq!(m.l2_slots[0].0, slots::l2_resp(k));
    assert_eq!(m.l2_slots[0].1.expires_ns, UPLINK.expires_ns);
    assert!(m.l2_v6.is_empty());
}

#[test]
fn ipv6_announcements_are_sealed_under_their_address_and_expire_alike() {
    let a: Ipv6Addr = "fd00:5::10".parse().unwrap();
    let b: Ipv6Addr = "fd00:5::9".parse().unwrap();
    let mut i = input(&[], Vec::new());
    i.announce_v6 = vec![a, b, a];
    assert!(
        desired(i.clone()).unwrap().maps.l2_v6.is_empty(),
        "no uplink"
    );
    i.uplink = Some(UPLINK);
    let m = desired(i).unwrap().maps;
    let keys: Vec<V6Addr> = m.l2_v6.iter().map(|e| e.0).collect();
    assert_eq!(keys, vec![b.octets(), a.octets()], "sorted, unique");
    for (k, v) in &m.l2_v6 {
        assert_eq!((v.ifindex, v.mac), (UPLINK.ifindex, UPLINK.mac));
        assert_eq!(v.expires_ns, UPLINK.expires_ns);
        assert!(v.is_sealed_v6(*k));
    }
    assert!(m.l2.is_empty() && m.l2_slots.is_empty());
    // Each address has the slot the NDP responder looks in first, holding
    // a copy of its entry that checks out for it alone.
    assert_eq!(m.l2_v6_slots.len(), 2);
    for (k, v) in &m.l2_v6 {
        let (slot, s) = m
            .l2_v6_slots
            .iter()
            .find(|(slot, _)| *slot == slots::l2_resp_v6(*k))
            .expect("a slot per address");
        assert_eq!(*s, L2RespSlotV6::new(*k, v), "slot {slot}");
    }
}

#[test]
fn masquerade_skip_sets_come_from_pools_and_config() {
    let non_masq: Vec<IpNet> = vec!["172.16.0.0/12".parse().unwrap()];
    let mut i = input(&[], Vec::new());
    i.masq_skip_pools = vec![
        ("10.0.0.0/24".parse().unwrap(), 9),
        ("fd00::/64".parse().unwrap(), 9),
    ];
    i.non_masquerade = &non_masq;
    let m = desired(i).unwrap().maps;
    let pool = m.masq_v4[&"10.0.0.0/24".parse().unwrap()];
    assert_eq!((pool.reason, pool.pool_id), (masq_reason::POOL, 9));
    let config = m.masq_v4[&"172.16.0.0/12".parse().unwrap()];
    assert_eq!(config.reason, masq_reason::CONFIG);
    assert_eq!(m.masq_v6.len(), 1);
}

proptest! {
    /// Whatever the endpoints, every map's keys come out sorted and unique,
    /// every hash value sealed under its key, and each slot holds the
    /// smallest key mapped to it.
    #[test]
    fn desired_maps_are_sorted_unique_and_sealed(
        ifindexes in proptest::collection::btree_set(1u32..100_000, 0..60),
        announce in proptest::collection::vec(any::<u32>(), 0..60),
    ) {
        let addrs: Vec<Vec<IpAddr>> = ifindexes
            .iter()
            .map(|i| vec![IpAddr::V4(Ipv4Addr::from(0x0a00_0000 | i))])
            .collect();
        let ids: Vec<String> = ifindexes.iter().map(|i| format!("c{i}")).collect();
        let allocs: Vec<Allocation> = ids
            .iter()
            .zip(&addrs)
            .map(|(id, a)| alloc(&a[0].to_string(), Owner::endpoint(id, "eth0")))
            .collect();
        let endpoints = ifindexes
            .iter()
            .zip(&ids)
            .zip(&addrs)
            .map(|((&host_ifindex, id), a)| LocalEndpoint {
                container_id: id,
                ifname: "eth0",
                host_ifindex,
                mac: [2, 0, 0, 0, 0, 1],
                addresses: a,
                generation: 7,
            })
            .collect();
        let mut i = input(&allocs, endpoints);
        i.uplink = Some(UPLINK);
        i.announce_v4 = announce.into_iter().map(Ipv4Addr::from).collect();
        let m = desired(i).unwrap().maps;
        prop_assert!(m.endpoints.windows(2).all(|w| w[0].0 < w[1].0));
        prop_assert!(m.l2.windows(2).all(|w| w[0].0 < w[1].0));
        prop_assert!(m.host_v4.windows(2).all(|w| w[0].0 < w[1].0));
        prop_assert_eq!(m.host_v4.len(), ifindexes.len());
        for (k, v) in &m.endpoints {
            prop_assert_eq!(*v, v.sealed(*k));
        }
        for (k, v) in &m.l2 {
            prop_assert_eq!(*v, v.sealed(*k));
        }
        for (slot, s) in &m.endpoint_slots {
            let smallest = m.endpoints.iter().map(|e| e.0).find(|k| slots::endpoint(*k) == *slot);
            prop_assert_eq!(Some(s.ifindex), smallest);
            prop_assert_eq!(s.ifindex_check, !s.ifindex);
        }
    }
}
