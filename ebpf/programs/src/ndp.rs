//! The IPv6 counterpart of the ARP responder: `from_native` answers a
//! Neighbor Solicitation (RFC 4861 §4.3) for an address in L2_RESP_V6 with a
//! solicited Neighbor Advertisement (§4.4) carrying the announcing
//! interface's MAC, sent back out the interface the solicitation came in on.
//!
//! Only well-formed solicitations are considered (§7.1.1): hop limit 255,
//! ICMPv6 code 0, ICMPv6 length at least 24, a target that is not multicast,
//! and a specified source (a duplicate address detection probe, from `::`,
//! is left to the stack). Anything else goes on to the stack untouched. The
//! advertisement is written over the solicitation in place (the frame is
//! first trimmed or grown to the advertisement's 86 bytes) and its ICMPv6
//! checksum computed here over the pseudo-header.

use aya_ebpf::{
    helpers::{bpf_redirect, bpf_skb_change_tail},
    programs::TcContext,
};
use aya_log_ebpf::info;
use lockstep_common::{Counter, L2Resp, L2RespSlotV6, L2RespValue, V6Addr, slots};

use crate::pkt::{ld_addr, ld_addr64, ld16, ld32, mac_words, st_addr, st16, st32};
use crate::{
    ETH_HLEN, L2_RESP_V6, L2_RESP6_SLOTS, NEXT, SEAL_TRIES, count, events_on, ifindex, nat, read,
};

/// Offsets from the start of the frame.
const IP: usize = ETH_HLEN;
const NEXT_HEADER: usize = IP + 6;
const ICMP: usize = IP + 40;
/// ICMPv6 next header value.
const ICMPV6: u8 = 58;
/// ICMPv6 Neighbor Solicitation and Advertisement.
const NS: u8 = 135;
const NA: u8 = 136;
/// The advertisement: Ethernet + IPv6 + NA (24) + target link-layer option (8).
pub(crate) const NA_FRAME_LEN: usize = ICMP + 32;
/// Solicited and Override (RFC 4861 §4.4), in the first byte of the flags.
const SOLICITED_OVERRIDE: u8 = 0x60;

/// Whether the frame is an ICMPv6 Neighbor Solicitation: two byte reads, so
/// the IPv6 paths that are not pay next to nothing.
#[inline(always)]
pub(crate) fn is_solicitation(ctx: &TcContext) -> bool {
    read::<u8>(ctx, NEXT_HEADER) == Some(ICMPV6) && read::<u8>(ctx, ICMP) == Some(NS)
}

/// The L2_RESP_V6 entry of the address whose native words are `key` and
/// whose bytes `addr` points at (in the packet): through its slot first (an
/// inlined array lookup, read in place word by word; see
/// `lockstep_common::slots`), else the hash entry whose seal holds.
#[inline(always)]
fn l2_resp_v6(key: [u32; 4], key64: [u64; 2], addr: &V6Addr) -> Option<L2Resp> {
    if let Some(p) = L2_RESP6_SLOTS.get_ptr(slots::l2_resp_v6_words(key)) {
        let p = p.cast::<u64>();
        // SAFETY: `p` points into the array's value area (8-aligned) for
        // this run and every index is below `L2RespSlotV6::WORDS64`; each
        // word is read once, volatile, in order, then the key again.
        let read = |i: usize| unsafe { core::ptr::read_volatile(p.add(i)) };
        if let Some(found) = L2RespSlotV6::check_with(read, key64)
            && read(0) == key64[0]
            && read(1) == key64[1]
        {
            return Some(found);
        }
    }
    l2_resp_v6_hash(addr, L2RespValue::v6_key_words(key))
}

/// The L2_RESP_V6 hash entry of `addr` whose seal (under `seal`, the
/// address's seal key) holds; see `endpoint_hash`. Not inlined, and keyed
/// straight from the packet (a map key may live in packet memory), so the
/// slot path's frame stays small: the verifier's 512 bytes cover the chain.
#[inline(never)]
fn l2_resp_v6_hash(addr: &V6Addr, seal: u32) -> Option<L2Resp> {
    for _ in 0..SEAL_TRIES {
        let p = L2_RESP_V6
            .get_ptr(addr)?
            .cast::<[u32; L2RespValue::WORDS]>();
        // SAFETY: `p` points at a value of the map for this run; copied once
        // and judged by its seal.
        let copy = unsafe { core::ptr::read_volatile(p) };
        if let Some(found) = L2RespValue::open_keyed(&copy, seal) {
            return Some(found);
        }
        count(Counter::SealRetried);
    }
    None
}

/// The ICMPv6 checksum of the advertisement this module sends, from
/// `target` (the announced address, also the IPv6 source) to `dst`, with
/// `mac` in the target link-layer option, as it goes into the packet
/// (memory order). The one's-complement sum is taken over native 32-bit
/// words and folded: RFC 1071 §2(B), byte-order independence, so no byte is
/// swapped and the whole sum is a dozen additions.
#[inline(always)]
pub(crate) fn na_checksum(target: [u32; 4], dst: [u32; 4], mac: &[u8; 6]) -> u16 {
    let addr = |w: [u32; 4]| u64::from(w[0]) + u64::from(w[1]) + u64::from(w[2]) + u64::from(w[3]);
    let word = |b: [u8; 4]| u64::from(u32::from_ne_bytes(b));
    // Pseudo-header: source (the target), destination, upper-layer length
    // 32, next header; then type/code, flags, the target again and the
    // target link-layer option.
    let mut s = 2 * addr(target)
        + addr(dst)
        + word([0, 0, 0, 32])
        + word([0, 0, 0, ICMPV6])
        + word([NA, 0, 0, 0])
        + word([SOLICITED_OVERRIDE, 0, 0, 0])
        + word([2, 1, mac[0], mac[1]])
        + word([mac[2], mac[3], mac[4], mac[5]]);
    s = (s & 0xffff_ffff) + (s >> 32);
    s = (s & 0xffff) + (s >> 16);
    s = (s & 0xffff) + (s >> 16);
    s = (s & 0xffff) + (s >> 16);
    !(s as u16)
}

/// Answers a Neighbor Solicitation for an announced address; "next" for
/// anything it does not answer. The solicitation is turned into the
/// advertisement in place, a word at a time: its target stays where it is
/// (the NA carries it at the same offset), the rest is a handful of stores.
///
/// Inlined into `from_native` like the ARP reply: a BPF-to-BPF call's
/// return goes through the kernel's return thunk, which the SRSO
/// mitigation of this VM's CPU makes cost ~20 ns (measured: 61 ns over the
/// empty program as a function of its own, 40–44 inlined). The rare paths
/// (the hash fallback, the debug event) stay functions of their own, so
/// `from_native`'s frame stays within the verifier's 512 bytes for its
/// deepest chain (`from_native` 192 + `ingress_v6` 320 bytes today; a
/// program that grows past it is refused at load, which every datapath
/// test would show).
#[inline(always)]
pub(crate) fn ndp_reply(ctx: &TcContext) -> i32 {
    // The solicitation's fixed part: Ethernet, IPv6, the 24-byte NS.
    const NS_LEN: usize = ICMP + 24;
    if ctx.data() + NS_LEN > ctx.data_end()
        && (ctx.pull_data(NS_LEN as u32).is_err() || ctx.data() + NS_LEN > ctx.data_end())
    {
        count(Counter::NdpMalformed);
        return NEXT;
    }
    let (d, end) = (ctx.data(), ctx.data_end());
    if d + NS_LEN > end {
        count(Counter::NdpMalformed);
        return NEXT;
    }
    // SAFETY: every read below is inside the NS_LEN bytes checked above.
    let (hop, code, payload, src, target) = unsafe {
        (
            *((d + IP + 7) as *const u8),
            *((d + ICMP + 1) as *const u8),
            usize::from(u16::from_be(ld16::<{ IP + 4 }>(d))),
            ld_addr::<{ IP + 8 }>(d),
            ld_addr::<{ ICMP + 8 }>(d),
        )
    };
    let well_formed = hop == 255
        && code == 0
        && payload >= 24
        && ICMP + payload <= ctx.len() as usize
        // Not multicast (ff00::/8: the first byte, the low byte of the
        // first native word), and a specified source.
        && target[0].to_le() & 0xff != 0xff
        && (src[0] | src[1] | src[2] | src[3]) != 0;
    if !well_formed {
        count(Counter::NdpMalformed);
        return NEXT;
    }
    let here = ifindex(ctx);
    // SAFETY: the target's 16 bytes are inside the NS_LEN checked above;
    // a byte array needs no alignment.
    let target_bytes = unsafe { &*((d + ICMP + 8) as *const V6Addr) };
    // SAFETY: as above.
    let target64 = unsafe { ld_addr64::<{ ICMP + 8 }>(d) };
    let mac = match l2_resp_v6(target, target64, target_bytes) {
        Some((ifindex, mac, expires)) if ifindex == here => {
            if expires != 0 && L2RespValue::expired(expires, nat::now_ns()) {
                count(Counter::AnnounceExpired);
                count(Counter::NdpIgnored);
                return NEXT;
            }
            mac
        }
        _ => {
            count(Counter::NdpIgnored);
            return NEXT;
        }
    };
    if ctx.len() as usize != NA_FRAME_LEN {
        // SAFETY: plain helper call on this program's skb.
        if unsafe { bpf_skb_change_tail(ctx.skb.skb, NA_FRAME_LEN as u32, 0) } != 0 {
            count(Counter::Malformed);
            return NEXT;
        }
    }
    if ctx.data() + NA_FRAME_LEN > ctx.data_end() && ctx.pull_data(NA_FRAME_LEN as u32).is_err() {
        count(Counter::Malformed);
        return NEXT;
    }
    // The check the verifier sees, right before the writes.
    let (d, end) = (ctx.data(), ctx.data_end());
    if d + NA_FRAME_LEN > end {
        count(Counter::Malformed);
        return NEXT;
    }
    // SAFETY: bounds checked just above.
    let asker = unsafe { (ld32::<6>(d), ld16::<10>(d)) };
    let csum = na_checksum(target, src, &mac).to_ne_bytes();
    let (mac_lo, mac_hi) = mac_words(mac);
    // SAFETY: bounds checked just above.
    unsafe {
        // Ethernet: back to the asker, from the announcing interface.
        st32::<0>(d, asker.0);
        st16::<4>(d, asker.1);
        st32::<6>(d, mac_lo);
        st16::<10>(d, mac_hi);
        // IPv6: version 6, no traffic class or flow label, payload 32,
        // ICMPv6, hop limit 255, from the target to the asker. The target
        // field of the NS (offset 62) is the NA's target already.
        st32::<IP>(d, u32::from_ne_bytes([0x60, 0, 0, 0]));
        st32::<{ IP + 4 }>(d, u32::from_ne_bytes([0, 32, ICMPV6, 255]));
        st_addr::<{ IP + 8 }>(d, target);
        st_addr::<{ IP + 24 }>(d, src);
        st32::<ICMP>(d, u32::from_ne_bytes([NA, 0, csum[0], csum[1]]));
        st32::<{ ICMP + 4 }>(d, u32::from_ne_bytes([SOLICITED_OVERRIDE, 0, 0, 0]));
        st16::<{ ICMP + 24 }>(d, u16::from_ne_bytes([2, 1]));
        st32::<{ ICMP + 26 }>(d, mac_lo);
        st16::<{ ICMP + 30 }>(d, mac_hi);
    }
    count(Counter::NdpReplied);
    if events_on() {
        replied_event(ctx, here);
    }
    // SAFETY: plain helper call; egress of the interface the request came in on.
    unsafe { bpf_redirect(here, 0) as i32 }
}

/// The aya-log event of an answered solicitation, read back from the
/// advertisement just written, in a frame of its own so the reply's stack
/// stays small (the verifier's 512 bytes cover the whole call chain).
#[inline(never)]
fn replied_event(ctx: &TcContext, here: u32) {
    let (Some(asker), Some(target), Some(to)) = (
        read::<[u8; 6]>(ctx, 0),
        read::<V6Addr>(ctx, IP + 8),
        read::<V6Addr>(ctx, IP + 24),
    ) else {
        return;
    };
    info!(
        ctx,
        "from_native: answered NDP for {:i} to {:i} ({:mac}) on ifindex {}",
        target,
        to,
        asker,
        here
    );
}
