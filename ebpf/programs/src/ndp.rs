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
use lockstep_common::{Counter, L2Resp, L2RespValue, V6Addr};

use crate::{ETH_HLEN, L2_RESP_V6, NEXT, SEAL_TRIES, count, events_on, ifindex, nat, read};

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

/// The L2_RESP_V6 entry of `addr` whose seal holds (see `endpoint_hash`).
#[inline(always)]
fn l2_resp_v6(addr: V6Addr) -> Option<L2Resp> {
    let key = L2RespValue::v6_key(addr);
    for _ in 0..SEAL_TRIES {
        let p = L2_RESP_V6
            .get_ptr(addr)?
            .cast::<[u32; L2RespValue::WORDS]>();
        // SAFETY: `p` points at a value of the map for this run; copied once
        // and judged by its seal.
        let copy = unsafe { core::ptr::read_volatile(p) };
        if let Some(found) = L2RespValue::open_keyed(&copy, key) {
            return Some(found);
        }
        count(Counter::SealRetried);
    }
    None
}

/// One's-complement sum of 16 bytes as big-endian 16-bit words.
#[inline(always)]
fn sum16(b: &[u8; 16]) -> u32 {
    let mut s = 0u32;
    let mut i = 0;
    while i < 16 {
        s += u32::from(u16::from_be_bytes([b[i], b[i + 1]]));
        i += 2;
    }
    s
}

/// The ICMPv6 checksum of the advertisement this module sends: from
/// `target` (the announced address, also the IPv6 source) to `dst`, with
/// `mac` in the target link-layer option.
#[inline(always)]
pub(crate) fn na_checksum(target: &V6Addr, dst: &V6Addr, mac: &[u8; 6]) -> u16 {
    // Pseudo-header: source, destination, upper-layer length 32, next header.
    let mut s = sum16(target) + sum16(dst) + 32 + u32::from(ICMPV6);
    // Type/code, flags, reserved, target, option type/length, MAC.
    s += u32::from(u16::from_be_bytes([NA, 0]));
    s += u32::from(u16::from_be_bytes([SOLICITED_OVERRIDE, 0]));
    s += sum16(target);
    s += 0x0201;
    s += u32::from(u16::from_be_bytes([mac[0], mac[1]]))
        + u32::from(u16::from_be_bytes([mac[2], mac[3]]))
        + u32::from(u16::from_be_bytes([mac[4], mac[5]]));
    s = (s & 0xffff) + (s >> 16);
    s = (s & 0xffff) + (s >> 16);
    !(s as u16)
}

/// Answers a Neighbor Solicitation for an announced address; "next" for
/// anything it does not answer.
// Not inlined: a frame of its own, apart from the masquerade's.
#[inline(never)]
pub(crate) fn ndp_reply(ctx: &TcContext) -> i32 {
    let (Some(eth_src), Some(ip), Some(icmp)) = (
        read::<[u8; 6]>(ctx, 6),
        read::<[u8; 40]>(ctx, IP),
        read::<[u8; 24]>(ctx, ICMP),
    ) else {
        count(Counter::NdpMalformed);
        return NEXT;
    };
    let payload = usize::from(u16::from_be_bytes([ip[4], ip[5]]));
    let src: V6Addr = core::array::from_fn(|i| ip[8 + i]);
    let target: V6Addr = core::array::from_fn(|i| icmp[8 + i]);
    let well_formed = ip[7] == 255
        && icmp[1] == 0
        && payload >= 24
        && ICMP + payload <= ctx.len() as usize
        && target[0] != 0xff
        && src != [0; 16];
    if !well_formed {
        count(Counter::NdpMalformed);
        return NEXT;
    }
    let here = ifindex(ctx);
    let mac = match l2_resp_v6(target) {
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
    let csum = na_checksum(&target, &src, &mac).to_be_bytes();
    if ctx.data() + NA_FRAME_LEN > ctx.data_end() && ctx.pull_data(NA_FRAME_LEN as u32).is_err() {
        count(Counter::Malformed);
        return NEXT;
    }
    // The check the verifier sees, right before the writes.
    let (start, end) = (ctx.data(), ctx.data_end());
    if start + NA_FRAME_LEN > end {
        count(Counter::Malformed);
        return NEXT;
    }
    // SAFETY: bounds checked just above; TC programs may write packet data.
    let out = unsafe { &mut *(start as *mut [u8; NA_FRAME_LEN]) };
    out[0..6].copy_from_slice(&eth_src);
    out[6..12].copy_from_slice(&mac);
    // IPv6: version 6, no traffic class or flow label, payload 32, ICMPv6,
    // hop limit 255, from the target to the solicitation's source.
    out[14..22].copy_from_slice(&[0x60, 0, 0, 0, 0, 32, ICMPV6, 255]);
    out[22..38].copy_from_slice(&target);
    out[38..54].copy_from_slice(&src);
    out[54..62].copy_from_slice(&[NA, 0, csum[0], csum[1], SOLICITED_OVERRIDE, 0, 0, 0]);
    out[62..78].copy_from_slice(&target);
    out[78..80].copy_from_slice(&[2, 1]);
    out[80..86].copy_from_slice(&mac);
    count(Counter::NdpReplied);
    if events_on() {
        info!(
            ctx,
            "from_native: answered NDP for {:i} to {:i} ({:mac}) on ifindex {}",
            target,
            src,
            eth_src,
            here
        );
    }
    // SAFETY: plain helper call; egress of the interface the request came in on.
    unsafe { bpf_redirect(here, 0) as i32 }
}
