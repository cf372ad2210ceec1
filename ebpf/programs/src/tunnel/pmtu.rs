//! Path MTU for encapsulated traffic: the endpoint is told, by an ICMP
//! "fragmentation needed" (IPv4) or "packet too big" (IPv6) from its
//! gateway's side, when its packet would not fit the path to the tunnel
//! endpoint once encapsulated.
//!
//! Only IPv6 underlays need this: the outer IPv4 header leaves DF unset
//! (the kernel's VXLAN and Geneve default), so routers fragment it and
//! the far node reassembles. An IPv6 router cannot fragment: it answers
//! the node with "packet too big", the kernel records the path MTU to the
//! tunnel endpoint (the UDP tunnel socket's error handler), and
//! `bpf_fib_lookup` with the packet's outer length reports it; the inner
//! MTU told to the endpoint is that path MTU less the outer headers. A
//! packet that fits no smaller than 1,280 bytes outside is never checked
//! (no IPv6 path is narrower), and a GSO packet is judged by the size of
//! its segments.

use core::mem::{size_of, zeroed};

use aya_ebpf::{
    bindings::{
        BPF_FIB_LOOKUP_SKIP_NEIGH, bpf_adj_room_mode::BPF_ADJ_ROOM_MAC, bpf_fib_lookup as FibParams,
    },
    helpers::{
        bpf_redirect,
        generated::{bpf_csum_diff, bpf_fib_lookup, bpf_skb_adjust_room, bpf_skb_change_tail},
    },
    programs::TcContext,
};
use lockstep_common::{Counter, IpcacheValue, TunnelConfig, ipcache_flags};

use super::words;
use crate::{ETH_HLEN, count, ifindex};

/// UDP (8), the VXLAN or Geneve header (8) and the inner Ethernet header
/// (14): what encapsulation adds besides the outer IP header.
const TUNNEL_HDRS: u32 = 30;
/// The outer IPv6 header.
const IP6_HDR: u32 = 40;
/// No IPv6 path is narrower.
const IPV6_MIN_MTU: u32 = 1280;
const AF_INET6: u8 = 10;
/// `BPF_FIB_LKUP_RET_FRAG_NEEDED`.
const FRAG_NEEDED: i64 = 8;
const IPPROTO_TCP: u8 = 6;

/// Bytes of the offending packet an answer quotes, from its IP header:
/// the header (with options, up to 60 bytes) and the first 8 bytes of its
/// transport header (ports), which is what the endpoint's stack matches.
const QUOTE_V4: usize = 68;
/// For IPv6: the 40-byte header and 24 bytes of what follows.
const QUOTE_V6: usize = 64;

/// The length of the largest IP packet this frame puts on the wire: the
/// frame's, or for a GSO frame its segments' (headers and `gso_size`).
#[inline(always)]
fn segment_len(ctx: &TcContext, inner_v6: bool) -> Option<u32> {
    let skb = ctx.skb.skb;
    // SAFETY: the context pointer is valid for the program's run.
    let gso = unsafe { (*skb).gso_size };
    if gso == 0 {
        return Some(ctx.len().saturating_sub(ETH_HLEN as u32));
    }
    let (l4, proto) = if inner_v6 {
        (40usize, ctx.load::<u8>(ETH_HLEN + 6).ok()?)
    } else {
        let vihl = ctx.load::<u8>(ETH_HLEN).ok()?;
        (
            usize::from(vihl & 0x0f) * 4,
            ctx.load::<u8>(ETH_HLEN + 9).ok()?,
        )
    };
    let l4_hdr = if proto == IPPROTO_TCP {
        u32::from(ctx.load::<u8>(ETH_HLEN + (l4 & 0x3f) + 12).ok()? >> 4) * 4
    } else {
        8
    };
    Some(l4 as u32 + l4_hdr + gso)
}

/// The MTU to tell the endpoint when this frame, encapsulated to `entry`'s
/// IPv6 tunnel endpoint, does not fit the path; `None` when it fits (or
/// cannot be told).
#[inline(always)]
pub(super) fn too_big(
    ctx: &TcContext,
    entry: &IpcacheValue,
    cfg: &TunnelConfig,
    inner_v6: bool,
) -> Option<u32> {
    if entry.flags & ipcache_flags::TUNNEL_V6 == 0 {
        return None;
    }
    let outer = segment_len(ctx, inner_v6)? + IP6_HDR + TUNNEL_HDRS;
    if outer <= IPV6_MIN_MTU {
        return None;
    }
    // SAFETY: plain data, every field the helper reads is set below.
    let mut p: FibParams = unsafe { zeroed() };
    p.family = AF_INET6;
    p.ifindex = ifindex(ctx);
    p.__bindgen_anon_1.tot_len = outer.min(0xffff) as u16;
    p.__bindgen_anon_3.ipv6_src = words(&cfg.local_v6);
    p.__bindgen_anon_4.ipv6_dst = words(&entry.node_addr);
    // SAFETY: plain helper call with parameters on the stack.
    let rc = unsafe {
        bpf_fib_lookup(
            ctx.skb.skb.cast(),
            &mut p,
            size_of::<FibParams>() as i32,
            BPF_FIB_LOOKUP_SKIP_NEIGH,
        )
    };
    if rc != FRAG_NEEDED {
        return None;
    }
    // SAFETY: the helper wrote the path MTU in the union's other field.
    let path = u32::from(unsafe { p.__bindgen_anon_1.mtu_result });
    Some(path.saturating_sub(IP6_HDR + TUNNEL_HDRS))
}

/// Folds a `bpf_csum_diff` sum into the checksum field's bytes.
#[inline(always)]
fn fold(sum: i64) -> [u8; 2] {
    let mut s = sum as u64 & 0xffff_ffff;
    s = (s & 0xffff) + (s >> 16);
    s = (s & 0xffff) + (s >> 16);
    (!(s as u16)).to_ne_bytes()
}

/// The ones' complement sum of `len` packet bytes at `offset` (a multiple
/// of 4), on top of `seed`.
#[inline(always)]
fn sum_packet<const LEN: usize>(ctx: &TcContext, offset: usize, seed: u32) -> Option<i64> {
    if ctx.data() + offset + LEN > ctx.data_end() {
        return None;
    }
    // SAFETY: the range was checked against data_end just above.
    let sum = unsafe {
        bpf_csum_diff(
            core::ptr::null_mut(),
            0,
            (ctx.data() + offset) as *mut u32,
            LEN as u32,
            seed,
        )
    };
    (sum >= 0).then_some(sum)
}

/// Cuts the frame to its Ethernet header and the first `quote` bytes of
/// its IP packet, opens `room` bytes after the Ethernet header (where the
/// answer's IP and ICMP headers go) and writes `eth` (the original's
/// addresses swapped) there.
#[inline(always)]
fn make_room(ctx: &TcContext, quote: usize, room: usize, ethertype: [u8; 2]) -> Option<()> {
    let macs = crate::read::<[u8; 12]>(ctx, 0)?;
    // SAFETY: plain helper calls on this program's skb.
    unsafe {
        if bpf_skb_change_tail(ctx.skb.skb, (ETH_HLEN + quote) as u32, 0) != 0 {
            return None;
        }
        if bpf_skb_adjust_room(ctx.skb.skb, room as i32, BPF_ADJ_ROOM_MAC, 0) != 0 {
            return None;
        }
    }
    let mut eth = [0u8; ETH_HLEN];
    eth[0..6].copy_from_slice(&macs[6..12]);
    eth[6..12].copy_from_slice(&macs[0..6]);
    eth[12..14].copy_from_slice(&ethertype);
    ctx.store(0, &eth, 0).ok()
}

/// Sends the answer back to the endpoint it came from.
#[inline(always)]
fn send_back(ctx: &TcContext) -> i32 {
    count(Counter::TunnelPmtuAnswered);
    // SAFETY: plain helper call; egress of the endpoint's own interface.
    unsafe { bpf_redirect(ifindex(ctx), 0) as i32 }
}

/// Answers an IPv4 packet with "fragmentation needed" and next-hop MTU
/// `mtu`; `None` (send it as it is) when it may be fragmented (DF unset).
/// A failure after the frame was changed drops it.
#[inline(always)]
pub(super) fn answer_v4(ctx: &TcContext, mtu: u32) -> Option<i32> {
    let head = crate::read::<[u8; 20]>(ctx, ETH_HLEN)?;
    if head[6] & 0x40 == 0 || ctx.len() < (ETH_HLEN + QUOTE_V4) as u32 {
        return None;
    }
    let mut hdr = [0u8; 28];
    hdr[0] = 0x45;
    hdr[2..4].copy_from_slice(&((20 + 8 + QUOTE_V4) as u16).to_be_bytes());
    hdr[8] = 64;
    hdr[9] = 1;
    // From the destination, to the source.
    hdr[12..16].copy_from_slice(&head[16..20]);
    hdr[16..20].copy_from_slice(&head[12..16]);
    let mut ip_sum = [0u32; 5];
    for (i, w) in ip_sum.iter_mut().enumerate() {
        *w = u32::from_ne_bytes([hdr[i * 4], hdr[i * 4 + 1], hdr[i * 4 + 2], hdr[i * 4 + 3]]);
    }
    // SAFETY: plain helper call over a stack array.
    let c = fold(unsafe { bpf_csum_diff(core::ptr::null_mut(), 0, ip_sum.as_mut_ptr(), 20, 0) });
    hdr[10..12].copy_from_slice(&c);
    hdr[20] = 3;
    hdr[21] = 4;
    hdr[26..28].copy_from_slice(&(mtu.min(0xffff) as u16).to_be_bytes());
    if make_room(ctx, QUOTE_V4, 28, [0x08, 0x00]).is_none() || ctx.store(ETH_HLEN, &hdr, 0).is_err()
    {
        return Some(crate::DROP);
    }
    let icmp = ETH_HLEN + 20;
    let Some(sum) = sum_packet::<{ 8 + QUOTE_V4 }>(ctx, icmp, 0) else {
        return Some(crate::DROP);
    };
    if ctx.store(icmp + 2, &fold(sum), 0).is_err() {
        return Some(crate::DROP);
    }
    Some(send_back(ctx))
}

/// Answers an IPv6 packet with "packet too big" and MTU `mtu` (at least
/// 1,280). A failure after the frame was changed drops it.
#[inline(always)]
pub(super) fn answer_v6(ctx: &TcContext, mtu: u32) -> Option<i32> {
    if ctx.len() < (ETH_HLEN + QUOTE_V6) as u32 {
        return None;
    }
    let addrs = crate::read::<[u8; 32]>(ctx, ETH_HLEN + 8)?;
    let len = (8 + QUOTE_V6) as u16;
    let mut hdr = [0u8; 48];
    hdr[0] = 0x60;
    hdr[4..6].copy_from_slice(&len.to_be_bytes());
    hdr[6] = 58;
    hdr[7] = 64;
    hdr[8..24].copy_from_slice(&addrs[16..32]);
    hdr[24..40].copy_from_slice(&addrs[0..16]);
    hdr[40] = 2;
    hdr[44..48].copy_from_slice(&mtu.max(IPV6_MIN_MTU).to_be_bytes());
    // The pseudo-header: source, destination, length, next header.
    let mut pseudo = [0u32; 10];
    for (i, w) in pseudo.iter_mut().take(8).enumerate() {
        let b = 8 + i * 4;
        *w = u32::from_ne_bytes([hdr[b], hdr[b + 1], hdr[b + 2], hdr[b + 3]]);
    }
    pseudo[8] = u32::from(len).to_be();
    pseudo[9] = 58u32.to_be();
    // SAFETY: plain helper call over a stack array.
    let seed = unsafe { bpf_csum_diff(core::ptr::null_mut(), 0, pseudo.as_mut_ptr(), 40, 0) };
    if make_room(ctx, QUOTE_V6, 48, [0x86, 0xdd]).is_none() || ctx.store(ETH_HLEN, &hdr, 0).is_err()
    {
        return Some(crate::DROP);
    }
    let icmp = ETH_HLEN + 40;
    let Some(sum) = sum_packet::<{ 8 + QUOTE_V6 }>(ctx, icmp, seed as u32) else {
        return Some(crate::DROP);
    };
    if ctx.store(icmp + 2, &fold(sum), 0).is_err() {
        return Some(crate::DROP);
    }
    Some(send_back(ctx))
}
