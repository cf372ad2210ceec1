//! The whole desired contents of the maps the agent owns, from the agent's
//! state alone: allocations, local endpoints, LoadBalancer entries, the
//! announced addresses and the masquerade-skip sources.
//!
//! It exists so that what verify compares and reconcile writes is decided
//! here, purely and under test, while the daemon only gathers the inputs
//! ([`DesiredInput`]), reads the maps and applies the difference.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use lockstep_common::{
    EndpointSlot, EndpointValue, IpcacheValue, L2RespSlot, L2RespSlotV6, L2RespValue,
    MasqSkipValue, V4Addr, V6Addr, endpoint_flags, masq_reason, slots,
};

use super::{EntryExtra, HostEntries, PlanBuilder, PlanError, direct_mapped, host_entries};
use crate::manager::Allocation;

/// The contents of every map the agent owns, split the way the datapath
/// stores them (host entries in hashes, prefixes in tries). The same type
/// holds what should be there ([`desired`]) and what is (read by the
/// daemon), so the two compare field by field.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct MapContents {
    /// L2_RESP_V4, sorted by address.
    pub l2: Vec<(V4Addr, L2RespValue)>,
    /// L2_RESP_V6, sorted by address.
    pub l2_v6: Vec<(V6Addr, L2RespValue)>,
    /// ENDPOINTS, sorted by ifindex.
    pub endpoints: Vec<(u32, EndpointValue)>,
    /// ENDPOINT_SLOTS that hold something, sorted by slot.
    pub endpoint_slots: Vec<(u32, EndpointSlot)>,
    /// L2_RESP_SLOTS that hold something, sorted by slot.
    pub l2_slots: Vec<(u32, L2RespSlot)>,
    /// L2_RESP6_SLOTS that hold something, sorted by slot.
    pub l2_v6_slots: Vec<(u32, L2RespSlotV6)>,
    /// IPCACHE_HOST_V4: sorted by address, unique.
    pub host_v4: Vec<(V4Addr, IpcacheValue)>,
    /// IPCACHE_HOST_V6: sorted by address, unique.
    pub host_v6: Vec<(V6Addr, IpcacheValue)>,
    /// IPCACHE_V4 (prefixes).
    pub prefix_v4: BTreeMap<Ipv4Net, IpcacheValue>,
    /// IPCACHE_V6 (prefixes).
    pub prefix_v6: BTreeMap<Ipv6Net, IpcacheValue>,
    /// MASQ_SKIP_V4.
    pub masq_v4: BTreeMap<Ipv4Net, MasqSkipValue>,
    /// MASQ_SKIP_V6.
    pub masq_v6: BTreeMap<Ipv6Net, MasqSkipValue>,
}

/// A full-mode endpoint as the datapath sees it.
#[derive(Clone, Copy, Debug)]
pub struct LocalEndpoint<'a> {
    /// `CNI_CONTAINERID`.
    pub container_id: &'a str,
    /// `CNI_IFNAME`.
    pub ifname: &'a str,
    /// The host-side interface index (the ENDPOINTS key).
    pub host_ifindex: u32,
    /// The MAC inside the container.
    pub mac: [u8; 6],
    /// Its addresses.
    pub addresses: &'a [IpAddr],
    /// The generation of its newest allocation.
    pub generation: u64,
}

/// The interface that answers ARP and NDP for announced addresses.
#[derive(Clone, Copy, Debug)]
pub struct Uplink {
    /// Its interface index.
    pub ifindex: u32,
    /// Its MAC.
    pub mac: [u8; 6],
    /// When its announcements end unless renewed
    /// ([`L2RespValue::expires_ns`]: kernel monotonic nanoseconds, 0 never).
    pub expires_ns: u64,
}

/// Everything [`desired`] reads.
#[derive(Clone, Debug)]
pub struct DesiredInput<'a, A> {
    /// Committed and delegated allocations (host entries).
    pub allocations: A,
    /// Full-mode endpoints.
    pub endpoints: Vec<LocalEndpoint<'a>>,
    /// LoadBalancer host entries (the LB plan's IPCACHE part).
    pub lb_hosts: Vec<(IpAddr, IpcacheValue)>,
    /// IPv4 addresses the uplink answers ARP for.
    pub announce_v4: Vec<Ipv4Addr>,
    /// IPv6 addresses the uplink answers Neighbor Solicitations for.
    pub announce_v6: Vec<Ipv6Addr>,
    /// The uplink, if the agent has one; without it nothing is announced.
    pub uplink: Option<Uplink>,
    /// Pool CIDRs with `skip_masquerade`, and their pool ids.
    pub masq_skip_pools: Vec<(IpNet, u32)>,
    /// The config's non-masquerade CIDRs.
    pub non_masquerade: &'a [IpNet],
}

/// The desired map contents, and the LoadBalancer addresses left out
/// because a node allocation holds them too (the caller reports them).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Desired {
    /// What the maps should hold.
    pub maps: MapContents,
    /// LB addresses also allocated on the node: the allocation's entry wins.
    pub lb_conflicts: Vec<IpAddr>,
}

/// The ENDPOINTS value of a local endpoint.
pub fn endpoint_value(mac: [u8; 6], addresses: &[IpAddr], generation: u64) -> EndpointValue {
    let mut v = EndpointValue {
        generation,
        mac,
        ..Default::default()
    };
    for a in addresses {
        match a {
            IpAddr::V4(v4) => {
                v.ipv4 = v4.octets();
                v.flags |= endpoint_flags::HAS_V4;
            }
            IpAddr::V6(v6) => {
                v.ipv6 = v6.octets();
                v.flags |= endpoint_flags::HAS_V6;
            }
        }
    }
    v
}

/// Derives every map's desired contents. Hash values are sealed
/// (`lockstep_common::seal`), so a value whose seal fails — which the
/// programs read as absent — is drift, and reconcile writes seals.
///
/// # Errors
/// [`PlanError::DuplicateAddress`] if two owners hold one address.
pub fn desired<'a, A>(input: DesiredInput<'_, A>) -> Result<Desired, PlanError>
where
    A: IntoIterator<Item = &'a Allocation>,
{
    let ifindex: BTreeMap<(&str, &str), u32> = input
        .endpoints
        .iter()
        .map(|e| ((e.container_id, e.ifname), e.host_ifindex))
        .collect();
    let hosts = host_entries(input.allocations, |a| match a.owner.attachment() {
        Some(at) => EntryExtra {
            ifindex: ifindex.get(&at).copied().unwrap_or(0),
            ..EntryExtra::default()
        },
        None => EntryExtra::default(),
    })?;
    let (hosts, lb_conflicts) = merge_hosts(hosts, input.lb_hosts);

    let announced = announcements(&input.announce_v4, &input.announce_v6, input.uplink);
    let mut endpoints: Vec<(u32, EndpointValue)> = input
        .endpoints
        .iter()
        .map(|e| {
            let v = endpoint_value(e.mac, e.addresses, e.generation);
            (e.host_ifindex, v)
        })
        .collect();
    endpoints.sort_unstable_by_key(|e| e.0);
    for (ifindex, v) in &mut endpoints {
        *v = v.sealed(*ifindex);
    }

    let mut b = PlanBuilder::default();
    for (cidr, pool_id) in input.masq_skip_pools {
        b.masq_skip([cidr], masq_reason::POOL, pool_id);
    }
    b.masq_skip(input.non_masquerade.iter().copied(), masq_reason::CONFIG, 0);
    let plan = b.finish();
    let endpoint_slots = direct_mapped(&endpoints, |k| slots::endpoint(*k))
        .into_iter()
        .map(|(slot, k, v)| (slot, EndpointSlot::new(k, &v)))
        .collect();
    Ok(Desired {
        maps: MapContents {
            endpoints,
            endpoint_slots,
            host_v4: hosts.v4,
            host_v6: hosts.v6,
            prefix_v4: plan.ipcache_v4,
            prefix_v6: plan.ipcache_v6,
            masq_v4: plan.masq_skip_v4,
            masq_v6: plan.masq_skip_v6,
            ..announced
        },
        lb_conflicts,
    })
}

/// The announcement maps' contents alone (L2_RESP_V4, L2_RESP_V6 and their
/// slots; every other part empty): `v4` and `v6` answered on `uplink`
/// until its expiry, nothing without an uplink. [`desired`] takes its
/// announcement part from here, and the daemon's renewal, which rewrites
/// only these maps, too.
#[must_use]
pub fn announcements(v4: &[Ipv4Addr], v6: &[Ipv6Addr], uplink: Option<Uplink>) -> MapContents {
    let announcement = uplink.map(|up| L2RespValue {
        ifindex: up.ifindex,
        mac: up.mac,
        expires_ns: up.expires_ns,
        ..Default::default()
    });
    let mut l2: Vec<(V4Addr, L2RespValue)> = match announcement {
        Some(v) => v4.iter().map(|a| (a.octets(), v)).collect(),
        None => Vec::new(),
    };
    l2.sort_unstable_by_key(|e| e.0);
    l2.dedup_by_key(|e| e.0);
    let mut l2_v6: Vec<(V6Addr, L2RespValue)> = match announcement {
        Some(v) => v6
            .iter()
            .map(|a| (a.octets(), v.sealed_v6(a.octets())))
            .collect(),
        None => Vec::new(),
    };
    l2_v6.sort_unstable_by_key(|e| e.0);
    l2_v6.dedup_by_key(|e| e.0);
    for (addr, v) in &mut l2 {
        *v = v.sealed(*addr);
    }
    let l2_slots = direct_mapped(&l2, |k| slots::l2_resp(*k))
        .into_iter()
        .map(|(slot, k, v)| (slot, L2RespSlot::new(k, &v)))
        .collect();
    let l2_v6_slots = direct_mapped(&l2_v6, |k| slots::l2_resp_v6(*k))
        .into_iter()
        .map(|(slot, k, v)| (slot, L2RespSlotV6::new(k, &v)))
        .collect();
    MapContents {
        l2,
        l2_v6,
        l2_slots,
        l2_v6_slots,
        ..MapContents::default()
    }
}

/// Adds LB host entries to the allocations' entries; an address both hold
/// keeps the allocation's entry and is returned as a conflict.
fn merge_hosts(
    mut hosts: HostEntries,
    lb: Vec<(IpAddr, IpcacheValue)>,
) -> (HostEntries, Vec<IpAddr>) {
    let mut conflicts = Vec::new();
    let (n4, n6) = (hosts.v4.len(), hosts.v6.len());
    for (addr, value) in lb {
        let clash = match addr {
            IpAddr::V4(a) => insert_new(&mut hosts.v4, n4, a.octets(), value),
            IpAddr::V6(a) => insert_new(&mut hosts.v6, n6, a.octets(), value),
        };
        if clash {
            conflicts.push(addr);
        }
    }
    hosts.v4.sort_unstable_by_key(|e| e.0);
    hosts.v6.sort_unstable_by_key(|e| e.0);
    (hosts, conflicts)
}

/// Pushes `(key, value)` unless the sorted prefix `entries[..sorted]`
/// holds `key`; true when it does.
fn insert_new<K: Ord + Copy, V>(
    entries: &mut Vec<(K, V)>,
    sorted: usize,
    key: K,
    value: V,
) -> bool {
    if entries[..sorted]
        .binary_search_by_key(&key, |e| e.0)
        .is_ok()
    {
        return true;
    }
    entries.push((key, value));
    false
}

#[cfg(test)]
mod tests;
