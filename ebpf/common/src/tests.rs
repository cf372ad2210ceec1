//! Unit tests of the shared types: the layouts the programs and the agent
//! both rely on, and the slot and flag tables.

use super::*;
use core::mem::{align_of, offset_of};

#[test]
fn ipcache_value_layout() {
    assert_eq!(offset_of!(IpcacheValue, identity), 0);
    assert_eq!(offset_of!(IpcacheValue, flags), 4);
    assert_eq!(offset_of!(IpcacheValue, ifindex), 8);
    assert_eq!(offset_of!(IpcacheValue, _pad), 12);
    assert_eq!(offset_of!(IpcacheValue, node_addr), 16);
    assert_eq!(size_of::<IpcacheValue>(), 32);
    assert_eq!(align_of::<IpcacheValue>(), 4);
}

#[test]
fn tunnel_config_layout() {
    assert_eq!(offset_of!(TunnelConfig, ifindex), 0);
    assert_eq!(offset_of!(TunnelConfig, vni), 4);
    assert_eq!(offset_of!(TunnelConfig, local_v4), 8);
    assert_eq!(offset_of!(TunnelConfig, _pad), 12);
    assert_eq!(offset_of!(TunnelConfig, local_v6), 16);
    assert_eq!(size_of::<TunnelConfig>(), 32);
}

/// The decapsulation check: an entry names its node by family, and only
/// remote entries name any.
#[test]
fn held_by_compares_the_outer_source_in_the_right_family() {
    let mut v4node = [0u8; 16];
    v4node[..4].copy_from_slice(&[192, 0, 2, 1]);
    let v6node: V6Addr = [0x20, 1, 0xd, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1];
    let native = IpcacheValue {
        identity: identity::ENDPOINT,
        flags: ipcache_flags::REMOTE,
        node_addr: v4node,
        ..Default::default()
    };
    assert!(native.held_by(false, &v4node, false));
    assert!(!native.held_by(false, &v4node, true));
    let mut other = v4node;
    other[3] = 2;
    assert!(!native.held_by(false, &other, false));
    // A v6 prefix without ENCAP: node_addr is IPv6.
    let native6 = IpcacheValue {
        node_addr: v6node,
        ..native
    };
    assert!(native6.held_by(true, &v6node, true));
    assert!(!native6.held_by(true, &v6node, false));
    // ENCAP over an IPv4 underlay for an IPv6 prefix.
    let enc = IpcacheValue {
        flags: ipcache_flags::REMOTE | ipcache_flags::ENCAP,
        ..native
    };
    assert!(enc.held_by(true, &v4node, false));
    assert!(!enc.held_by(true, &v4node, true));
    let enc6 = IpcacheValue {
        flags: ipcache_flags::REMOTE | ipcache_flags::ENCAP | ipcache_flags::TUNNEL_V6,
        node_addr: v6node,
        ..native
    };
    assert!(enc6.held_by(false, &v6node, true));
    // A local entry is held by no node.
    let local = IpcacheValue {
        flags: ipcache_flags::ENDPOINT,
        node_addr: v4node,
        ..native
    };
    assert!(!local.held_by(false, &v4node, false));
}

#[test]
fn masq_skip_value_layout() {
    assert_eq!(offset_of!(MasqSkipValue, reason), 0);
    assert_eq!(offset_of!(MasqSkipValue, pool_id), 4);
    assert_eq!(size_of::<MasqSkipValue>(), 8);
}

#[test]
fn endpoint_value_layout() {
    assert_eq!(offset_of!(EndpointValue, generation), 0);
    assert_eq!(offset_of!(EndpointValue, ipv4), 8);
    assert_eq!(offset_of!(EndpointValue, flags), 12);
    assert_eq!(offset_of!(EndpointValue, ipv6), 16);
    assert_eq!(offset_of!(EndpointValue, mac), 32);
    assert_eq!(offset_of!(EndpointValue, _pad), 38);
    assert_eq!(offset_of!(EndpointValue, check), 40);
    assert_eq!(offset_of!(EndpointValue, _pad2), 44);
    assert_eq!(size_of::<EndpointValue>(), 48);
    assert_eq!(align_of::<EndpointValue>(), 8);
}

#[test]
fn l2_resp_value_layout() {
    assert_eq!(offset_of!(L2RespValue, ifindex), 0);
    assert_eq!(offset_of!(L2RespValue, mac), 4);
    assert_eq!(offset_of!(L2RespValue, _pad), 10);
    assert_eq!(offset_of!(L2RespValue, check), 12);
    assert_eq!(offset_of!(L2RespValue, expires_ns), 16);
    assert_eq!(size_of::<L2RespValue>(), 24);
}

#[test]
fn slot_layouts() {
    assert_eq!(offset_of!(EndpointSlot, ifindex), 0);
    assert_eq!(offset_of!(EndpointSlot, ifindex_check), 4);
    assert_eq!(offset_of!(EndpointSlot, flags), 8);
    assert_eq!(offset_of!(EndpointSlot, flags_check), 12);
    assert_eq!(offset_of!(EndpointSlot, ipv4), 16);
    assert_eq!(offset_of!(EndpointSlot, ipv4_check), 20);
    assert_eq!(offset_of!(EndpointSlot, mac), 24);
    assert_eq!(offset_of!(EndpointSlot, _pad), 30);
    assert_eq!(offset_of!(EndpointSlot, mac_check), 32);
    assert_eq!(offset_of!(EndpointSlot, ipv6), 40);
    assert_eq!(offset_of!(EndpointSlot, ipv6_check), 56);
    assert_eq!(size_of::<EndpointSlot>(), 72);
    assert_eq!(align_of::<EndpointSlot>(), 4);
    assert_eq!(offset_of!(L2RespSlot, addr), 0);
    assert_eq!(offset_of!(L2RespSlot, addr_check), 4);
    assert_eq!(offset_of!(L2RespSlot, ifindex), 8);
    assert_eq!(offset_of!(L2RespSlot, ifindex_check), 12);
    assert_eq!(offset_of!(L2RespSlot, mac), 16);
    assert_eq!(offset_of!(L2RespSlot, _pad), 22);
    assert_eq!(offset_of!(L2RespSlot, mac_check), 24);
    assert_eq!(offset_of!(L2RespSlot, expires_ns), 32);
    assert_eq!(offset_of!(L2RespSlot, expires_check), 40);
    assert_eq!(size_of::<L2RespSlot>(), 48);
    assert_eq!(align_of::<L2RespSlot>(), 8);
}

fn bytes<T: Copy, const N: usize>(v: &T) -> [u8; N] {
    assert_eq!(size_of::<T>(), N);
    // SAFETY: T is a repr(C) slot without padding, N its exact size.
    unsafe { core::ptr::read_unaligned((v as *const T).cast::<[u8; N]>()) }
}

fn words<const B: usize, const W: usize>(b: &[u8; B]) -> [u32; W] {
    let mut w = [0u32; W];
    for (i, c) in b.chunks_exact(4).enumerate() {
        w[i] = u32::from_ne_bytes([c[0], c[1], c[2], c[3]]);
    }
    w
}

fn endpoint() -> (u32, EndpointValue) {
    (
        70_001,
        EndpointValue {
            generation: 3,
            ipv4: [10, 0, 1, 5],
            flags: endpoint_flags::HAS_V4 | endpoint_flags::HAS_V6,
            ipv6: [0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 5],
            mac: [2, 0, 0, 0, 0, 1],
            ..Default::default()
        },
    )
}

#[test]
fn intact_slots_check_out_and_empty_or_other_keys_do_not() {
    let (ifindex, v) = endpoint();
    let slot = EndpointSlot::new(ifindex, &v);
    let w = words::<72, 18>(&bytes::<_, 72>(&slot));
    assert_eq!(
        EndpointSlot::check(&w, ifindex),
        Some((v.flags, v.ipv4, v.ipv6, v.mac))
    );
    assert_eq!(EndpointSlot::check(&w, ifindex + 1), None);
    let w4: [u32; EndpointSlot::V4_WORDS] = core::array::from_fn(|i| w[i]);
    assert_eq!(
        EndpointSlot::check_v4(&w4, ifindex),
        Some((v.flags, v.ipv4, v.mac))
    );
    assert_eq!(EndpointSlot::check(&[0; 18], 0), None);

    let l2 = L2RespValue {
        ifindex: 4,
        mac: [2, 0, 0, 0, 0, 0x50],
        expires_ns: 0x0000_0012_3456_789a,
        ..Default::default()
    };
    let addr = [10, 0, 0, 50];
    let slot = L2RespSlot::new(addr, &l2);
    let w = words::<48, 12>(&bytes::<_, 48>(&slot));
    assert_eq!(
        L2RespSlot::check(&w, addr),
        Some((4, l2.mac, l2.expires_ns))
    );
    assert_eq!(L2RespSlot::check(&w, [10, 0, 0, 51]), None);
    assert_eq!(L2RespSlot::check(&[0; 12], [0; 4]), None);
}

/// The property the datapath relies on: a slot read while it goes from
/// empty to a value (or back) mixes, byte by byte, the value with zeros;
/// such a copy checks out only when it equals the value in every byte.
/// Masks: every single byte missing, every prefix and suffix (forward and
/// backward copies), and 100k pseudo-random mixes.
#[test]
fn a_slot_half_written_over_zeros_never_checks_out() {
    let (ifindex, v) = endpoint();
    let full = bytes::<_, 72>(&EndpointSlot::new(ifindex, &v));
    let l2 = L2RespSlot::new(
        [10, 0, 0, 50],
        &L2RespValue {
            ifindex: 4,
            mac: [2, 0, 0, 0, 0, 0x50],
            expires_ns: 0x0000_0012_3456_789a,
            ..Default::default()
        },
    );
    let l2full = bytes::<_, 48>(&l2);
    let mut masks: [u64; 3] = [0; 3];
    let mut seed = 0x1234_5678_9abc_def0u64;
    let mut check = |mask: u64| {
        // Bytes 64.. (the IPv6 address's complement's last two words)
        // follow bit 63: torn together with it.
        let torn: [u8; 72] = core::array::from_fn(|i| {
            if mask >> i.min(63) & 1 == 1 {
                full[i]
            } else {
                0
            }
        });
        let w = words::<72, 18>(&torn);
        if EndpointSlot::check(&w, ifindex).is_some() {
            assert_eq!(torn, full, "mask {mask:#x} checked out torn");
            masks[0] += 1;
        }
        let w4: [u32; EndpointSlot::V4_WORDS] = core::array::from_fn(|i| w[i]);
        if EndpointSlot::check_v4(&w4, ifindex).is_some() {
            assert_eq!(torn[..40], full[..40], "mask {mask:#x}: v4 words torn");
        }
        let torn: [u8; 48] =
            core::array::from_fn(|i| if mask >> i & 1 == 1 { l2full[i] } else { 0 });
        if L2RespSlot::check(&words::<48, 12>(&torn), [10, 0, 0, 50]).is_some() {
            assert_eq!(torn, l2full, "mask {mask:#x} checked out torn (L2)");
            masks[1] += 1;
        }
        masks[2] += 1;
    };
    let all = u64::MAX;
    for i in 0..64 {
        check(all & !(1 << i));
        check(all >> i);
        check((all << i) & all);
    }
    for _ in 0..100_000 {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        check(seed & all);
    }
    check(all);
    assert!(masks[0] >= 1 && masks[1] >= 1, "the intact slots check out");
    assert!(masks[2] > 100_000);
}

/// The IPv6 slot: intact copies check out for their own address only,
/// and a copy torn over zeros (every single byte missing, every prefix
/// and suffix, 100k pseudo-random byte masks) only when whole.
#[test]
fn v6_slots_check_out_only_whole_and_for_their_address() {
    assert_eq!(size_of::<L2RespSlotV6>(), 72);
    assert_eq!(align_of::<L2RespSlotV6>(), 8);
    assert_eq!(offset_of!(L2RespSlotV6, addr_check), 16);
    assert_eq!(offset_of!(L2RespSlotV6, ifindex), 32);
    assert_eq!(offset_of!(L2RespSlotV6, mac), 40);
    assert_eq!(offset_of!(L2RespSlotV6, mac_check), 48);
    assert_eq!(offset_of!(L2RespSlotV6, expires_ns), 56);
    assert_eq!(offset_of!(L2RespSlotV6, expires_check), 64);
    let addr: V6Addr = [0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x50];
    let l2 = L2RespValue {
        ifindex: 4,
        mac: [2, 0, 0, 0, 0, 0x50],
        expires_ns: 0x0000_0012_3456_789a,
        ..Default::default()
    };
    let full = bytes::<_, 72>(&L2RespSlotV6::new(addr, &l2));
    let w = words::<72, 18>(&full);
    assert_eq!(
        L2RespSlotV6::check(&w, addr),
        Some((4, l2.mac, l2.expires_ns))
    );
    let mut other = addr;
    other[3] = 1;
    assert_eq!(L2RespSlotV6::check(&w, other), None);
    assert_eq!(L2RespSlotV6::check(&[0; 18], [0; 16]), None);
    let mut whole = 0;
    let mut check = |mask: u128| {
        let torn: [u8; 72] = core::array::from_fn(|i| if mask >> i & 1 == 1 { full[i] } else { 0 });
        if L2RespSlotV6::check(&words::<72, 18>(&torn), addr).is_some() {
            assert_eq!(torn, full, "mask {mask:#x} checked out torn");
            whole += 1;
        }
    };
    let all = (1u128 << 72) - 1;
    for i in 0..72 {
        check(all & !(1 << i));
        check(all >> i);
        check((all << i) & all);
    }
    let mut seed = 0x1234_5678_9abc_def0u64;
    for _ in 0..100_000 {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let hi = seed.rotate_left(17);
        check((u128::from(hi) << 64 | u128::from(seed)) & all);
    }
    check(all);
    assert!(whole >= 2, "the intact slot checks out");
}

#[test]
fn slot_functions_stay_in_range_and_spread_a_range() {
    for i in 0..100_000u32 {
        assert!(slots::endpoint(i) < max_entries::ENDPOINT_SLOTS);
        assert!(slots::l2_resp(i.to_be_bytes()) < max_entries::L2_RESP_SLOTS);
    }
    // Consecutive interface indexes never collide within the array size.
    assert_ne!(slots::endpoint(5), slots::endpoint(6));
    // A /22 of announced addresses lands on many distinct slots.
    let mut used = [false; max_entries::L2_RESP_SLOTS as usize];
    let base = u32::from_be_bytes([192, 0, 2, 0]);
    for i in 0..1024 {
        used[slots::l2_resp((base + i).to_be_bytes()) as usize] = true;
    }
    assert!(used.iter().filter(|u| **u).count() > 900);
    // The same for IPv6: a range differing in the last word, and one
    // differing only in an upper word, each spread over the array.
    for (at, shift) in [(12, 0), (4, 0)] {
        let mut used = [false; max_entries::L2_RESP6_SLOTS as usize];
        for i in 0..1024u32 {
            let mut a: V6Addr = [0x20, 1, 0xd, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
            a[at..at + 4].copy_from_slice(&(i << shift).to_be_bytes());
            let s = slots::l2_resp_v6(a);
            assert!(s < max_entries::L2_RESP6_SLOTS);
            used[s as usize] = true;
        }
        assert!(used.iter().filter(|u| **u).count() > 900, "word at {at}");
    }
}

#[test]
fn map_names_fit_the_kernel_limit() {
    for name in map_names::ALL {
        assert!(name.len() <= 15, "{name} is longer than 15 characters");
    }
    for name in program_names::ALL {
        assert!(name.len() <= 15, "{name} is longer than 15 characters");
    }
}

#[test]
fn counters_are_dense_and_named_uniquely() {
    for (i, c) in Counter::ALL.iter().enumerate() {
        assert_eq!(*c as u32, i as u32, "{c:?} is out of order");
        for other in &Counter::ALL[i + 1..] {
            assert_ne!(c.name(), other.name());
        }
    }
}

#[test]
fn ipcache_flags_are_distinct_bits() {
    let bits = [
        ipcache_flags::ENDPOINT,
        ipcache_flags::INGRESS,
        ipcache_flags::HEALTH,
        ipcache_flags::ROUTER,
        ipcache_flags::LOADBALANCER,
        ipcache_flags::HOST,
        ipcache_flags::REMOTE,
        ipcache_flags::ENCAP,
        ipcache_flags::TUNNEL_V6,
    ];
    let mut seen = 0;
    for b in bits {
        assert_eq!(b.count_ones(), 1);
        assert_eq!(seen & b, 0);
        seen |= b;
    }
    assert_eq!(seen, ipcache_flags::ALL);
}
