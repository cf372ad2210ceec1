//! Encapsulation for remote blocks the IPCACHE marks
//! [`ENCAP`](ipcache_flags::ENCAP) (cluster routing modes `tunnel` and
//! `cross-subnet`), and the decapsulated side: `from_tunnel` on the one
//! collect-metadata tunnel device (VXLAN or Geneve).
//!
//! Sending: the IPCACHE entry of the destination's block holds the tunnel
//! endpoint (the holder's underlay address); [`encap`] sets the tunnel key
//! (that address, the configured VNI, the node's own underlay address as
//! the outer source) and redirects the frame to the tunnel device, whose
//! driver adds the outer headers. No kernel route to the block is needed.
//!
//! Receiving: [`decap`] runs on the tunnel device's ingress after the
//! driver removed the outer headers. The inner source must lie in a block
//! the IPCACHE says the outer source address holds (one node cannot
//! inject packets claiming another node's pods, nor pods of blocks nobody
//! holds); the inner destination must be a local endpoint, to whose
//! interface the frame goes (its peer, inside the pod's namespace,
//! directly). Anything else is dropped and counted by reason.

mod pmtu;

use core::mem::{size_of, zeroed};

use aya_ebpf::{
    bindings::{BPF_F_TUNINFO_IPV6, BPF_F_ZERO_CSUM_TX, bpf_tunnel_key},
    helpers::{
        bpf_redirect,
        generated::{bpf_redirect_peer, bpf_skb_get_tunnel_key, bpf_skb_set_tunnel_key},
    },
    programs::TcContext,
};
use lockstep_common::{
    Counter, EndpointValue, IpcacheValue, TunnelConfig, V4Addr, V6Addr, ipcache_flags,
};

use crate::{
    DROP, ENDPOINTS, ETH_P_IP, ETH_P_IPV6, IP4_DST, IP4_SRC, IP6_DST, IP6_SRC, SEAL_TRIES,
    TUNNEL_CONFIG, count, ethertype, ipcache_v4, ipcache_v6, read,
};

/// The outer header's TTL (hop limit).
const OUTER_TTL: u8 = 64;

#[inline(always)]
fn config() -> Option<TunnelConfig> {
    TUNNEL_CONFIG.get(0).copied().filter(|c| c.ifindex != 0)
}

#[inline(always)]
pub(crate) fn words(a: &V6Addr) -> [u32; 4] {
    [
        u32::from_ne_bytes([a[0], a[1], a[2], a[3]]),
        u32::from_ne_bytes([a[4], a[5], a[6], a[7]]),
        u32::from_ne_bytes([a[8], a[9], a[10], a[11]]),
        u32::from_ne_bytes([a[12], a[13], a[14], a[15]]),
    ]
}

/// Sends the frame (IPv6 when `inner_v6`) to the node `entry` names
/// through the tunnel device; a frame too big for the path there is
/// answered instead (see [`pmtu`]).
#[inline(always)]
pub(crate) fn encap(ctx: &TcContext, entry: &IpcacheValue, inner_v6: bool) -> i32 {
    let Some(cfg) = config() else {
        count(Counter::TunnelDropNoDevice);
        return DROP;
    };
    if let Some(mtu) = pmtu::too_big(ctx, entry, &cfg, inner_v6) {
        let answered = if inner_v6 {
            pmtu::answer_v6(ctx, mtu)
        } else {
            pmtu::answer_v4(ctx, mtu)
        };
        if let Some(verdict) = answered {
            return verdict;
        }
    }
    let verdict = send(
        ctx,
        &cfg,
        &entry.node_addr,
        entry.flags & ipcache_flags::TUNNEL_V6 != 0,
    );
    if verdict == DROP {
        count(Counter::TunnelDropNoDevice);
    } else {
        count(Counter::TunnelEncap);
    }
    verdict
}

/// Sets the tunnel key to the node at `node` (an IPv6 underlay address
/// when `v6`, else IPv4 in the first four bytes) and redirects the frame
/// to the tunnel device; [`DROP`] when the key cannot be set.
#[inline(always)]
fn send(ctx: &TcContext, cfg: &TunnelConfig, node: &V6Addr, v6: bool) -> i32 {
    // SAFETY: plain data; every field the helper reads is set below.
    let mut key: bpf_tunnel_key = unsafe { zeroed() };
    key.tunnel_id = cfg.vni;
    key.tunnel_ttl = OUTER_TTL;
    let flags = if v6 {
        key.__bindgen_anon_1.remote_ipv6 = words(node);
        key.__bindgen_anon_3.local_ipv6 = words(&cfg.local_v6);
        u64::from(BPF_F_TUNINFO_IPV6)
    } else {
        // The helper takes IPv4 addresses in host order.
        key.__bindgen_anon_1.remote_ipv4 = u32::from_be_bytes([node[0], node[1], node[2], node[3]]);
        key.__bindgen_anon_3.local_ipv4 = u32::from_be_bytes(cfg.local_v4);
        // No outer UDP checksum over IPv4, as the kernel's own VXLAN device
        // and Cilium send it: the helper asks for one by default, and a
        // device without UDP-tunnel checksum offload (a veth, most NICs'
        // VXLAN paths) then segments and sums every GSO packet in software.
        // The inner packet keeps its own checksums; IPv6 needs the outer one.
        u64::from(BPF_F_ZERO_CSUM_TX)
    };
    // SAFETY: plain helper call on this program's skb with a key on the stack.
    let rc = unsafe {
        bpf_skb_set_tunnel_key(
            ctx.skb.skb,
            &mut key,
            size_of::<bpf_tunnel_key>() as u32,
            flags,
        )
    };
    if rc != 0 {
        return DROP;
    }
    // SAFETY: plain helper call; egress of the tunnel device.
    unsafe { bpf_redirect(cfg.ifindex, 0) as i32 }
}

/// The `encap_floor` program: what any collect-metadata encapsulation
/// costs and nothing else — the tunnel key set (to the node's own IPv4
/// address) and the redirect to the device. The datapath bench's floor
/// for the encapsulation rows; never attached.
#[inline(always)]
pub(crate) fn floor(ctx: &TcContext) -> i32 {
    let Some(cfg) = config() else {
        return DROP;
    };
    let mut node = [0; 16];
    node[..4].copy_from_slice(&cfg.local_v4);
    send(ctx, &cfg, &node, false)
}

/// The outer source of a decapsulated packet (IPv4 in the first four
/// bytes) and whether it is IPv6, with the VNI; `None` without a key.
#[inline(always)]
fn outer(ctx: &TcContext) -> Option<(V6Addr, bool, u32)> {
    // SAFETY: plain data, filled by the helper.
    let mut key: bpf_tunnel_key = unsafe { zeroed() };
    let size = size_of::<bpf_tunnel_key>() as u32;
    // SAFETY: plain helper calls on this program's skb with a key on the
    // stack; the union field read is the one the successful call filled.
    unsafe {
        if bpf_skb_get_tunnel_key(ctx.skb.skb, &mut key, size, 0) == 0 {
            let mut a = [0u8; 16];
            let b = key.__bindgen_anon_1.remote_ipv4.to_be_bytes();
            a[..4].copy_from_slice(&b);
            return Some((a, false, key.tunnel_id));
        }
        if bpf_skb_get_tunnel_key(ctx.skb.skb, &mut key, size, u64::from(BPF_F_TUNINFO_IPV6)) == 0 {
            let w = key.__bindgen_anon_1.remote_ipv6;
            let mut a = [0u8; 16];
            for (i, x) in w.iter().enumerate() {
                a[i * 4..i * 4 + 4].copy_from_slice(&x.to_ne_bytes());
            }
            return Some((a, true, key.tunnel_id));
        }
    }
    None
}

/// The MAC of the endpoint behind host-side interface `ifindex`, from its
/// sealed ENDPOINTS entry.
#[inline(always)]
fn endpoint_mac(ifindex: u32) -> Option<[u8; 6]> {
    for _ in 0..SEAL_TRIES {
        let p = ENDPOINTS
            .get_ptr(ifindex)?
            .cast::<[u32; EndpointValue::WORDS]>();
        // SAFETY: as in `endpoint_hash`.
        let copy = unsafe { core::ptr::read_volatile(p) };
        if let Some(mac) = EndpointValue::open_mac(&copy, ifindex) {
            return Some(mac);
        }
        count(Counter::SealRetried);
    }
    None
}

/// Checks a decapsulated frame and delivers it to its local endpoint.
#[inline(always)]
pub(crate) fn decap(ctx: &TcContext) -> i32 {
    let (Some(cfg), Some((outer, outer_v6, vni))) = (config(), outer(ctx)) else {
        count(Counter::TunnelDropMalformed);
        return DROP;
    };
    if vni != cfg.vni {
        count(Counter::TunnelDropMalformed);
        return DROP;
    }
    let (src, dst) = match ethertype(ctx) {
        Some(ETH_P_IP) => {
            let (Some(s), Some(d)) = (read::<V4Addr>(ctx, IP4_SRC), read::<V4Addr>(ctx, IP4_DST))
            else {
                count(Counter::TunnelDropMalformed);
                return DROP;
            };
            (
                ipcache_v4(s).is_some_and(|e| e.held_by(false, &outer, outer_v6)),
                ipcache_v4(d),
            )
        }
        Some(ETH_P_IPV6) => {
            let (Some(s), Some(d)) = (read::<V6Addr>(ctx, IP6_SRC), read::<V6Addr>(ctx, IP6_DST))
            else {
                count(Counter::TunnelDropMalformed);
                return DROP;
            };
            (
                ipcache_v6(s).is_some_and(|e| e.held_by(true, &outer, outer_v6)),
                ipcache_v6(d),
            )
        }
        _ => {
            count(Counter::TunnelDropMalformed);
            return DROP;
        }
    };
    if !src {
        count(Counter::TunnelDropForgedSource);
        return DROP;
    }
    let Some(ifindex) = dst
        .filter(|e| e.flags & ipcache_flags::ENDPOINT != 0 && e.ifindex != 0)
        .map(|e| e.ifindex)
    else {
        count(Counter::TunnelDropNotLocal);
        return DROP;
    };
    let Some(mac) = endpoint_mac(ifindex) else {
        count(Counter::TunnelDropNotLocal);
        return DROP;
    };
    if ctx.store(0, &mac, 0).is_err() {
        count(Counter::TunnelDropMalformed);
        return DROP;
    }
    count(Counter::TunnelDecap);
    // SAFETY: plain helper call; into the endpoint's namespace, on the
    // peer of its host-side interface.
    unsafe { bpf_redirect_peer(ifindex, 0) as i32 }
}
