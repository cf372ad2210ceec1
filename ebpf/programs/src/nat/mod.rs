//! Masquerade: source NAT of local endpoints' traffic leaving through the
//! uplink (`to_native`) and the reverse translation of what comes back
//! (`from_native`), with the state in NAT_FWD_* / NAT_REV_* (see
//! `lockstep_common::nat` and docs/masquerade.md).
//!
//! Translated: TCP, UDP, ICMP echo request (its identifier plays the port)
//! and ICMPv6 echo request, fragmented or not (a later fragment, which
//! carries no ports, follows its datagram: going out by the endpoint's
//! address alone, coming back by NAT_FRAG_*, which the first fragment
//! fills); replies to them; and ICMP / ICMPv6 errors (destination
//! unreachable incl. fragmentation needed, packet too big, time exceeded)
//! that quote at least the ports of a translated packet.
//!
//! Nothing else of a local endpoint leaves with its address towards a
//! translated destination: IPv4 with options, IPv6 with an extension
//! header other than one fragment header, other protocols and the
//! endpoint's own ICMP errors are dropped and counted
//! (`masq_untranslatable`). Other traffic (the node's own, forwarded) is
//! not touched.
//!
//! TCP state is kept per connection: a SYN on a tuple whose connection
//! closed starts the translation afresh, and a RST from the remote ends the
//! flow only inside the endpoint's receive window (as conntrack does). A
//! flow's first reply marks it established (`nat_state::REPLIED`); the
//! collector ends unreplied flows sooner, and one endpoint address may
//! hold at most `MasqConfig::endpoint_max` translations (NAT_EP_OPENED,
//! counted here, against NAT_EP_CLOSED, counted by the collector).
//!
//! Checksums are updated incrementally: the IPv4 header checksum here (it is
//! always complete in the header); L4 checksums through
//! `bpf_l4_csum_replace` with `BPF_F_PSEUDO_HDR` for the address, which does
//! the right thing under `CHECKSUM_PARTIAL` (veth offload, GSO),
//! `CHECKSUM_COMPLETE` and a complete checksum alike. See [`l4_fix`] for how
//! the port's share costs no second helper call.
//!
//! Packets are written by direct packet access: a helper call costs ~30 ns
//! on the project's machines (every kernel return pays the SRSO
//! mitigation), a direct store nothing. The price is the verifier's
//! "unclone" prologue, which for a cloned skb makes its header writable; the
//! node's own TCP clones have private headers (`nohdr`), so it copies
//! nothing for them.
//!
//! Time (`last_seen_ns`) comes from a per-CPU cache, NAT_CLOCK, refreshed by
//! `bpf_ktime_get_ns` once per jiffy and read against `bpf_jiffies64` (which
//! the verifier inlines): the clock helper would cost ~35 ns per packet.

mod v4;
mod v6;

pub(crate) use v4::{ingress_v4, lookup_only_v4};

use aya_ebpf::{
    bindings::{BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR, BPF_NOEXIST},
    helpers::{bpf_get_prandom_u32, bpf_jiffies64, bpf_ktime_get_ns},
    programs::TcContext,
};
use lockstep_common::{
    IpcacheValue, LAST_SEEN_GRANULARITY_NS, MasqConfig, NatEndpointKey, PORT_TRIES, V4Addr, V6Addr,
    ipcache_flags, nat_state,
};

use crate::{ETH_HLEN, MASQ_CONFIG, NAT_CLOCK, NAT_EP_CLOSED, NAT_EP_OPENED, read};

/// Internal verdicts (never returned to the kernel): `egress_*` found no
/// forward entry; `new_flow_*` made one.
pub(super) const NEW_FLOW: i32 = -1000;
pub(super) const CLAIMED: i32 = -1001;
/// `admit_v6`: a new flow to translate.
pub(super) const ADMITTED: i32 = -1002;
/// `ingress_v6`: an ICMPv6 packet that may be an error to translate.
pub(super) const ICMP_ERROR: i32 = -1003;
/// `egress_*`: a SYN on a tuple with a translation; `syn_out_*` first.
pub(super) const SYN_SEEN: i32 = -1004;
/// `egress_v6`: the L4 header is not where this copy expects it.
pub(super) const FRAGMENT: i32 = -1005;
/// `outgoing_v6`: masquerade is off for IPv6 (count only).
pub(super) const COUNT_ONLY: i32 = -1006;
/// `outgoing_v6`: not of a kind the masquerade translates.
pub(super) const UNTRANSLATABLE: i32 = -1007;
/// `outgoing_v6`: a later fragment (no ports).
pub(super) const LATER_FRAGMENT: i32 = -1008;

/// `ingress_v6`: a TCP RST, to be judged against the endpoint's window.
pub(super) const RST_SEEN: i32 = -1009;
/// `ingress_v6`: the first fragment of a datagram, translated; its later
/// fragments are to follow it.
pub(super) const FIRST_FRAGMENT: i32 = -1010;

/// How `ingress_v6` treats a TCP RST: judge it first ([`RST_SEEN`]), or as
/// judged.
pub(super) mod rst {
    /// Not judged yet: come back as `RST_SEEN`.
    pub(crate) const ASK: u8 = 0;
    /// Inside the window: it ends the flow.
    pub(crate) const ACCEPTED: u8 = 1;
    /// Outside the window: translated, but the flow goes on.
    pub(crate) const IGNORED: u8 = 2;
}

/// `from_native` for IPv6: replies, then ICMPv6 errors, a RST's judgement,
/// a later fragment and a first fragment's record, each in a frame of its
/// own (the verifier allows 512 bytes of stack over a call chain, and
/// `from_native`'s own frame is large).
#[inline(always)]
pub(crate) fn from_native_v6(ctx: &TcContext) -> i32 {
    let verdict = match v6::ingress_v6(ctx, rst::ASK) {
        RST_SEEN => {
            let judged = if v6::rst_in_window_v6(ctx) {
                rst::ACCEPTED
            } else {
                rst::IGNORED
            };
            v6::ingress_v6(ctx, judged)
        }
        verdict => verdict,
    };
    match verdict {
        ICMP_ERROR => v6::icmp_error_v6(ctx),
        LATER_FRAGMENT => v6::later_fragment_in_v6(ctx),
        FIRST_FRAGMENT => {
            v6::first_fragment_in_v6(ctx);
            crate::NEXT
        }
        verdict => verdict,
    }
}

/// `to_native` for IPv4: the established flow's translation inline; a new
/// flow's checks and port claim in a function of its own (the verifier
/// allows 512 bytes of stack over a whole call chain, and the two would
/// not fit in one frame), after which the established path runs again. A
/// SYN on a translated tuple restarts its state first, in a frame of its
/// own too.
#[inline(always)]
pub(crate) fn to_native_v4(ctx: &TcContext) -> i32 {
    match v4::egress_v4(ctx, false) {
        NEW_FLOW => {}
        SYN_SEEN => {
            v4::syn_out_v4(ctx);
            return match v4::egress_v4(ctx, true) {
                NEW_FLOW => crate::DROP,
                verdict => verdict,
            };
        }
        verdict => return verdict,
    }
    match v4::new_flow_v4(ctx) {
        CLAIMED => {}
        verdict => return verdict,
    }
    match v4::egress_v4(ctx, true) {
        // Gone already (a collector raced): never let it out untranslated.
        NEW_FLOW => crate::DROP,
        verdict => verdict,
    }
}

/// [`to_native_v4`] for IPv6, whose established path has a function of its
/// own too (IPv6 keys and addresses are larger).
/// `to_native` for IPv6: [`to_native_v4`]'s steps, the established
/// path's frame specialised for where the L4 header is (after the IPv6
/// header, or after a fragment header too): with the offset a constant
/// the frame stays within what the verifier allows beside `to_native`'s.
#[inline(always)]
pub(crate) fn to_native_v6(ctx: &TcContext) -> i32 {
    let verdict = match to_native_v6_at::<L4_V6>(ctx) {
        FRAGMENT => match to_native_v6_at::<{ L4_V6 + 8 }>(ctx) {
            FRAGMENT => crate::DROP,
            verdict => verdict,
        },
        verdict => verdict,
    };
    match verdict {
        COUNT_ONLY | UNTRANSLATABLE | LATER_FRAGMENT => v6::aside_v6(ctx, verdict),
        verdict => verdict,
    }
}

/// [`to_native_v6`] for packets whose L4 header is at `L4`; others come
/// back as [`FRAGMENT`]. A SYN on a tuple that has a translation restarts
/// its state (`syn_out_v6`) in a frame of its own, and so does reading a
/// new flow's TCP options (`tcp_start_v6`).
#[inline(always)]
fn to_native_v6_at<const L4: usize>(ctx: &TcContext) -> i32 {
    match v6::egress_v6::<L4>(ctx, false) {
        NEW_FLOW => {}
        SYN_SEEN => {
            v6::syn_out_v6(ctx);
            return match v6::egress_v6::<L4>(ctx, true) {
                NEW_FLOW => crate::DROP,
                verdict => verdict,
            };
        }
        verdict => return verdict,
    }
    match v6::admit_v6(ctx) {
        ADMITTED => {}
        verdict => return verdict,
    }
    let tcp = v6::tcp_start_v6(ctx);
    match v6::claim_v6(ctx, tcp) {
        CLAIMED => {}
        verdict => return verdict,
    }
    match v6::egress_v6::<L4>(ctx, true) {
        NEW_FLOW => crate::DROP,
        verdict => verdict,
    }
}

/// `BPF_F_IPV6` for `bpf_l4_csum_replace` (Linux 6.16+; not in the
/// bindings of aya-ebpf 0.2): the packet is IPv6, so a pseudo-header change
/// leaves `skb->csum` of a `CHECKSUM_COMPLETE` packet alone.
pub(super) const BPF_F_IPV6: u64 = 1 << 7;
pub(super) const EEXIST: i32 = 17;

pub(super) const TCP: u8 = 6;
pub(super) const UDP: u8 = 17;
pub(super) const ICMP: u8 = 1;
pub(super) const ICMPV6: u8 = 58;
pub(super) const TCP_FIN: u8 = 0x01;
pub(super) const TCP_SYN: u8 = 0x02;
pub(super) const TCP_RST: u8 = 0x04;
pub(super) const TCP_ACK: u8 = 0x10;
/// The IPv6 fragment header's next-header number.
pub(super) const IPV6_FRAGMENT: u8 = 44;

/// Start of the IP header; L4 header of IPv4 without options, of IPv6
/// without extension headers.
pub(super) const IP: usize = ETH_HLEN;
pub(super) const L4_V4: usize = IP + 20;
pub(super) const L4_V6: usize = IP + 40;
/// Field offsets inside the IPv4 header.
pub(super) const V4_CSUM: usize = 10;
pub(super) const V4_SRC: usize = 12;
pub(super) const V4_DST: usize = 16;
/// Field offsets inside the IPv6 header.
pub(super) const V6_SRC: usize = 8;
pub(super) const V6_DST: usize = 24;

/// What a packet's L4 header says, as the NAT maps key it.
#[derive(Clone, Copy)]
pub(super) struct Flow {
    pub(super) proto: u8,
    /// Host order. ICMP echo request: the identifier; echo reply: 0.
    pub(super) sport: u16,
    /// Host order. ICMP echo request: 0; echo reply: the identifier.
    pub(super) dport: u16,
    /// TCP flags, 0 for other protocols.
    pub(super) tcp_flags: u8,
    /// Offset of the L4 header from the start of the frame (IPv6: after
    /// a fragment header when there is one).
    pub(super) l4: usize,
}

impl Flow {
    /// Offset (from the L4 header) of the checksum.
    #[inline(always)]
    pub(super) fn csum_off(&self) -> usize {
        match self.proto {
            TCP => 16,
            UDP => 6,
            _ => 2,
        }
    }

    /// Extra `bpf_l4_csum_replace` flags: a zero UDP checksum (IPv4: none)
    /// stays zero, a computed zero becomes 0xffff.
    #[inline(always)]
    pub(super) fn mangled(&self) -> u64 {
        if self.proto == UDP {
            u64::from(BPF_F_MARK_MANGLED_0)
        } else {
            0
        }
    }

    /// [`nat_state`] bits this packet sets; `fin` is the direction's FIN bit.
    #[inline(always)]
    pub(super) fn state_bits(&self, fin: u8) -> u8 {
        let mut bits = 0;
        if self.tcp_flags & TCP_FIN != 0 {
            bits |= fin;
        }
        if self.tcp_flags & TCP_RST != 0 {
            bits |= nat_state::RST;
        }
        bits
    }

    /// A TCP SYN without ACK: a connection's first segment.
    #[inline(always)]
    pub(super) fn is_syn(&self) -> bool {
        self.proto == TCP && self.tcp_flags & (TCP_SYN | TCP_ACK) == TCP_SYN
    }

    /// Offset of the port this direction rewrites: the source port going
    /// out (`dst` false), the destination port coming back; ICMP echo: the
    /// identifier.
    #[inline(always)]
    pub(super) fn port_at(&self, dst: bool) -> usize {
        if self.proto == ICMP || self.proto == ICMPV6 {
            self.l4 + 4
        } else if dst {
            self.l4 + 2
        } else {
            self.l4
        }
    }
}

/// A TCP segment's sequence number, acknowledgment number (host order)
/// and window, its header at `l4`; read only where they are needed, so
/// [`Flow`] (copied in every frame of the packet path) stays small.
#[inline(always)]
pub(super) fn tcp_numbers(ctx: &TcContext, l4: usize) -> Option<(u32, u32, u16)> {
    let h = read::<[u8; 12]>(ctx, l4 + 4)?;
    Some((
        u32::from_be_bytes([h[0], h[1], h[2], h[3]]),
        u32::from_be_bytes([h[4], h[5], h[6], h[7]]),
        u16::from_be_bytes([h[10], h[11]]),
    ))
}

/// The TCP tracking a forward entry starts with for the endpoint's packet
/// `flow` ([`NatValueV4::ack`](lockstep_common::NatValueV4::ack)): a SYN
/// expects its sequence number + 1 acknowledged by a refusing RST; a
/// segment with ACK records where the endpoint's receive window starts.
/// Returns (ack, win, wscale, state bits).
#[inline(always)]
pub(super) fn tcp_start(ctx: &TcContext, flow: &Flow) -> (u32, u16, u8, u8) {
    if flow.proto != TCP {
        return (0, 0, 0, 0);
    }
    let Some((seq, ack, win)) = tcp_numbers(ctx, flow.l4) else {
        return (0, 0, 0, 0);
    };
    if flow.is_syn() {
        return (seq.wrapping_add(1), win, wscale(ctx, flow.l4), 0);
    }
    if flow.tcp_flags & TCP_ACK != 0 {
        return (ack, win, 0, nat_state::ACKED);
    }
    (0, 0, 0, 0)
}

/// The window scale option of the TCP SYN whose header is at `l4`, where
/// the common stacks put it: 5 bytes into the options (MSS, NOP, WS: BSD,
/// macOS, Windows), 9 (MSS, NOP, NOP, SACK-permitted, NOP, WS: Linux
/// without timestamps) or 17 (MSS, SACK-permitted, timestamps, NOP, WS:
/// Linux). Anywhere else (or none): 0, the window taken unscaled — a RST
/// then counts only in the first 64 KiB of the window, and a genuine one
/// further in lets the flow idle out instead of closing it early. A loop
/// over the options, kind by kind, is what the verifier cannot afford
/// (its paths multiply with every option).
// Not inlined: only SYNs read their options.
#[inline(never)]
pub(super) fn wscale(ctx: &TcContext, l4: usize) -> u8 {
    let Ok(doff) = ctx.load::<u8>(l4 + 12) else {
        return 0;
    };
    let len = usize::from(doff >> 4) * 4;
    for at in [5usize, 9, 17] {
        if 20 + at + 3 > len {
            break;
        }
        if let Ok([3, 3, shift]) = ctx.load::<[u8; 3]>(l4 + 20 + at) {
            return shift.min(14);
        }
    }
    0
}

/// Whether a RST from the remote (`flow`) may end a flow whose forward
/// entry tracks the endpoint's side as `ack`, `win`, `wscale`, `state`: once
/// the endpoint has acknowledged anything, its sequence number must lie in
/// the endpoint's receive window (RFC 793; conntrack's rule); before, it
/// must acknowledge the endpoint's SYN.
#[inline(always)]
pub(super) fn rst_acceptable(
    ctx: &TcContext,
    flow: &Flow,
    (ack, win, wscale, state): (u32, u16, u8, u8),
) -> bool {
    let Some((rst_seq, rst_ack, _)) = tcp_numbers(ctx, flow.l4) else {
        return false;
    };
    if state & nat_state::ACKED != 0 {
        let shift = u32::from(wscale.min(14));
        let window = (u32::from(win) << shift).max(1);
        rst_seq.wrapping_sub(ack) < window
    } else {
        flow.tcp_flags & TCP_ACK != 0 && rst_ack == ack
    }
}

/// How many translations the endpoint address `key` holds: opened by the
/// programs less ended by the collector.
#[inline(always)]
pub(super) fn endpoint_held(key: &NatEndpointKey) -> u64 {
    // SAFETY: copied out at once.
    let opened = unsafe { NAT_EP_OPENED.get(key) }.copied().unwrap_or(0);
    // SAFETY: as above.
    let closed = unsafe { NAT_EP_CLOSED.get(key) }.copied().unwrap_or(0);
    opened.saturating_sub(closed)
}

/// Counts a translation opened for the endpoint address `key` (an atomic
/// add: every CPU opens flows).
#[inline(always)]
pub(super) fn endpoint_opened(key: &NatEndpointKey) {
    let p = match NAT_EP_OPENED.get_ptr_mut(key) {
        Some(p) => p,
        None => match NAT_EP_OPENED.insert(key, 1u64, u64::from(BPF_NOEXIST)) {
            Ok(()) => return,
            Err(_) => match NAT_EP_OPENED.get_ptr_mut(key) {
                Some(p) => p,
                None => return,
            },
        },
    };
    // An atomic add (BPF_ATOMIC | BPF_ADD): core's atomics have no
    // read-modify-write for this target.
    // SAFETY: `p` points at the map value (8-aligned) for this run.
    unsafe {
        core::arch::asm!(
            "lock *(u64 *)({p} + 0) += {v}",
            p = in(reg) p,
            v = in(reg) 1u64,
            options(nostack, preserves_flags)
        );
    }
}

/// Parses the L4 header at `l4` of protocol `proto`. `echo` is the ICMP type
/// that is translated in this direction (request going out, reply coming
/// in); its identifier becomes the source port of a request and the
/// destination port of a reply.
#[inline(always)]
pub(super) fn parse_l4(
    ctx: &TcContext,
    l4: usize,
    proto: u8,
    echo: u8,
    reply: bool,
) -> Option<Flow> {
    match proto {
        TCP => {
            let h = read::<[u8; 14]>(ctx, l4)?;
            Some(Flow {
                proto,
                sport: u16::from_be_bytes([h[0], h[1]]),
                dport: u16::from_be_bytes([h[2], h[3]]),
                tcp_flags: h[13],
                l4,
            })
        }
        UDP => {
            let h = read::<[u8; 4]>(ctx, l4)?;
            Some(Flow {
                proto,
                sport: u16::from_be_bytes([h[0], h[1]]),
                dport: u16::from_be_bytes([h[2], h[3]]),
                tcp_flags: 0,
                l4,
            })
        }
        ICMP | ICMPV6 => {
            let h = read::<[u8; 8]>(ctx, l4)?;
            if h[0] != echo {
                return None;
            }
            let id = u16::from_be_bytes([h[4], h[5]]);
            let (sport, dport) = if reply { (0, id) } else { (id, 0) };
            Some(Flow {
                proto,
                sport,
                dport,
                tcp_flags: 0,
                l4,
            })
        }
        _ => None,
    }
}

/// The ports of a packet quoted in an ICMP error, from the first 8 bytes of
/// its L4 header at `l4` (all RFC 792 promises): TCP and UDP ports, the
/// identifier of an echo request (`echo`). The quoted packet went out, so
/// its source port is the translated one.
#[inline(always)]
pub(super) fn parse_quoted(ctx: &TcContext, l4: usize, proto: u8, echo: u8) -> Option<Flow> {
    let h = read::<[u8; 8]>(ctx, l4)?;
    let (sport, dport) = match proto {
        TCP | UDP => (
            u16::from_be_bytes([h[0], h[1]]),
            u16::from_be_bytes([h[2], h[3]]),
        ),
        ICMP | ICMPV6 if h[0] == echo => (u16::from_be_bytes([h[4], h[5]]), 0),
        _ => return None,
    };
    Some(Flow {
        proto,
        sport,
        dport,
        tcp_flags: 0,
        l4,
    })
}

/// One's-complement addition of 32-bit partial sums (the kernel's `csum_add`).
#[inline(always)]
pub(super) fn csum_add(a: u32, b: u32) -> u32 {
    let (s, carry) = a.overflowing_add(b);
    s.wrapping_add(u32::from(carry))
}

#[inline(always)]
pub(super) fn csum_fold(s: u32) -> u16 {
    let s = (s & 0xffff) + (s >> 16);
    ((s & 0xffff) + (s >> 16)) as u16
}

/// The checksum field after 4 bytes it covers changed from `from` to `to`
/// (RFC 1624, eqn. 3; all three as loaded from the packet).
#[inline(always)]
pub(super) fn csum_replace4(check: u16, from: u32, to: u32) -> u16 {
    !csum_fold(csum_add(csum_add(u32::from(!check), !from), to))
}

/// The checksum field after 2 bytes it covers changed from `from` to `to`.
#[inline(always)]
pub(super) fn csum_replace2(check: u16, from: u16, to: u16) -> u16 {
    !csum_fold(u32::from(!check) + u32::from(!from) + u32::from(to))
}

/// The partial sum that turns a checksum over `from` into one over `to`
/// (the kernel's `csum_diff` for two 4-byte buffers).
#[inline(always)]
pub(super) fn csum_diff4(from: V4Addr, to: V4Addr) -> u32 {
    csum_add(!u32::from_ne_bytes(from), u32::from_ne_bytes(to))
}

/// The partial sum that turns a checksum over `from` into one over `to`
/// (the kernel's `csum_diff` for two 16-byte buffers).
#[inline(always)]
pub(super) fn csum_diff16(from: &V6Addr, to: &V6Addr) -> u32 {
    let mut s = 0u32;
    let mut i = 0;
    while i < 16 {
        let f = u32::from_ne_bytes([from[i], from[i + 1], from[i + 2], from[i + 3]]);
        let t = u32::from_ne_bytes([to[i], to[i + 1], to[i + 2], to[i + 3]]);
        s = csum_add(csum_add(s, !f), t);
        i += 4;
    }
    s
}

/// `bpf_l4_csum_replace`; with `BPF_F_IPV6` in `flags`, again without it
/// on a kernel that does not know the flag.
#[inline(always)]
pub(super) fn l4_csum(
    ctx: &TcContext,
    off: usize,
    from: u64,
    to: u64,
    flags: u64,
) -> Result<(), i64> {
    match ctx.l4_csum_replace(off, from, to, flags) {
        Err(-22) if flags & BPF_F_IPV6 != 0 => {
            ctx.l4_csum_replace(off, from, to, flags & !BPF_F_IPV6)
        }
        other => other,
    }
}

/// `a ≡ b` in one's-complement arithmetic (0 and 0xffff are both zero).
#[inline(always)]
fn same16(a: u16, b: u16) -> bool {
    a == b || (a | b == 0xffff && (a == 0 || b == 0))
}

/// Brings the L4 checksum at `off` up to date after the packet's address
/// (`diff`, a partial sum as from [`csum_diff4`] / [`csum_diff16`]; part of
/// the pseudo-header) and port (`from` → `to`, as loaded, not part of it)
/// were rewritten, with one helper call where two would be the obvious way.
///
/// The address's share must go through `bpf_l4_csum_replace` with
/// `BPF_F_PSEUDO_HDR`: only the kernel knows whether the skb is
/// `CHECKSUM_PARTIAL` (the field then holds the pseudo-header sum and the
/// port is summed later, by the NIC or the stack) or carries a complete
/// checksum (the port's change must enter it too). The helper applies
/// `old + diff` in the first case and `old - diff` in the second, so the
/// field it leaves behind says which case it was whenever `diff ≢ 0`; the
/// port's share is then added here, or not at all. When it cannot tell
/// (`diff ≡ 0`, a UDP checksum of 0 left alone) a second helper call adds
/// the port's share the kernel's way.
#[inline(always)]
pub(super) fn l4_fix(
    ctx: &TcContext,
    off: usize,
    diff: u32,
    from: u16,
    to: u16,
    flags: u64,
) -> Option<()> {
    let old = u16::from_ne_bytes(read::<[u8; 2]>(ctx, off)?);
    l4_csum(
        ctx,
        off,
        0,
        u64::from(diff),
        u64::from(BPF_F_PSEUDO_HDR) | flags,
    )
    .ok()?;
    let new = u16::from_ne_bytes(read::<[u8; 2]>(ctx, off)?);
    let d = csum_fold(diff);
    if !same16(d, 0) {
        if same16(new, csum_fold(u32::from(old) + u32::from(d))) {
            // CHECKSUM_PARTIAL: the port is summed when the checksum is.
            return Some(());
        }
        if same16(new, csum_fold(u32::from(old) + u32::from(!d))) {
            let mut check = csum_replace2(new, from, to);
            if check == 0 && flags & u64::from(BPF_F_MARK_MANGLED_0) != 0 {
                check = 0xffff;
            }
            return write(ctx, off, check.to_ne_bytes());
        }
    }
    l4_csum(ctx, off, u64::from(from), u64::from(to), 2 | flags).ok()
}

/// Writes `v` at `offset` by direct packet access.
#[inline(always)]
pub(super) fn write<T: Copy>(ctx: &TcContext, offset: usize, v: T) -> Option<()> {
    if ctx.data() + offset + size_of::<T>() > ctx.data_end() {
        return None;
    }
    // SAFETY: bounds checked just above; TC programs may write packet data.
    unsafe { ((ctx.data() + offset) as *mut T).write_unaligned(v) };
    Some(())
}

/// A port (host order) as `bpf_l4_csum_replace` wants it: as loaded.
#[inline(always)]
pub(super) fn ne16(port: u16) -> u16 {
    u16::from_ne_bytes(port.to_be_bytes())
}

/// An address as `bpf_l4_csum_replace` wants it: as loaded.
#[inline(always)]
pub(super) fn ne32(addr: V4Addr) -> u64 {
    u64::from(u32::from_ne_bytes(addr))
}

/// Masquerade off: what [`config`] reads when MASQ_CONFIG has no value.
static OFF: MasqConfig = MasqConfig {
    node_v4: [0; 4],
    node_v6: [0; 16],
    port_min: 0,
    port_max: 0,
    flags: 0,
    reply_min: 0,
    reply_max: 0,
    endpoint_max: 0,
    _pad: 0,
};

/// The agent's masquerade settings; all zero (off) when unset. A reference
/// into the map value, not a copy: every frame of the packet path holds
/// it, and the verifier allows 512 bytes of stack over a call chain.
#[inline(always)]
pub(super) fn config() -> &'static MasqConfig {
    MASQ_CONFIG.get(0).unwrap_or(&OFF)
}

/// `bpf_ktime_get_ns()` as of this CPU's latest jiffy (see the module
/// doc): behind the clock by at most one jiffy, never ahead of it.
#[inline(always)]
pub(crate) fn now_ns() -> u64 {
    // SAFETY: plain helper calls (the verifier inlines bpf_jiffies64).
    let jiffies = unsafe { bpf_jiffies64() };
    let Some(clock) = NAT_CLOCK.get_ptr_mut(0) else {
        // SAFETY: as above.
        return unsafe { bpf_ktime_get_ns() };
    };
    // SAFETY: this CPU's slot of a per-CPU array, for this run; nothing
    // else on this CPU runs a program meanwhile.
    unsafe {
        if (*clock).jiffies != jiffies {
            (*clock).now_ns = bpf_ktime_get_ns();
            (*clock).jiffies = jiffies;
        }
        (*clock).now_ns
    }
}

/// Refreshes a NAT entry's `last_seen_ns` when it is more than a second
/// old, and adds `bits` to its state; writes nothing otherwise.
#[inline(always)]
pub(super) fn touch(last_seen: *mut u64, state: *mut u8, bits: u8) {
    let now = now_ns();
    // SAFETY: both point into a map value for this run; a racing writer can
    // at worst lose a state bit set at the same instant by another CPU.
    // Another CPU's clock may be a jiffy ahead of this one's: "older" is
    // judged with a saturating difference, so time never goes back.
    unsafe {
        if now.saturating_sub(*last_seen) > LAST_SEEN_GRANULARITY_NS {
            *last_seen = now;
        }
        if *state & bits != bits {
            *state |= bits;
        }
    }
}

/// Records the endpoint's side of a TCP connection in its forward entry
/// from a segment with ACK going out: where its receive window starts and
/// how large it is (see [`rst_acceptable`]). Writes only what changed.
#[inline(always)]
pub(super) fn track_out(ctx: &TcContext, ack: *mut u32, win: *mut u16, flow: &Flow) {
    if flow.proto != TCP || flow.tcp_flags & TCP_ACK == 0 {
        return;
    }
    // Acknowledgment number, offset and flags, window: one 8-byte load,
    // kept in a register (the packet path's frame is near its limit).
    let Some(w) = read::<u64>(ctx, flow.l4 + 8) else {
        return;
    };
    let b = w.to_ne_bytes();
    let now_ack = u32::from_be_bytes([b[0], b[1], b[2], b[3]]);
    let now_win = u16::from_be_bytes([b[6], b[7]]);
    // SAFETY: both point into a map value for this run.
    unsafe {
        if *ack != now_ack {
            *ack = now_ack;
        }
        if *win != now_win {
            *win = now_win;
        }
    }
}

/// [`nat_state`] bits a packet going out sets in its forward entry.
#[inline(always)]
pub(super) fn out_bits(flow: &Flow) -> u8 {
    let mut bits = flow.state_bits(nat_state::FIN_OUT);
    if flow.proto == TCP && flow.tcp_flags & TCP_ACK != 0 {
        bits |= nat_state::ACKED;
    }
    bits
}

#[inline(always)]
pub(super) fn is_local_endpoint(entry: Option<&IpcacheValue>) -> bool {
    matches!(entry, Some(v) if v.flags & ipcache_flags::ENDPOINT != 0)
}

/// A destination inside the cluster: never masqueraded.
#[inline(always)]
pub(super) fn is_cluster(entry: Option<IpcacheValue>) -> bool {
    const CLUSTER: u32 = ipcache_flags::ENDPOINT | ipcache_flags::HOST | ipcache_flags::REMOTE;
    matches!(entry, Some(v) if v.flags & CLUSTER != 0)
}

/// Candidate translated ports: `tries` consecutive ports of the range from a
/// random start. Returns (first, range size, tries); range 0 when the
/// configured range is empty.
#[inline(always)]
pub(super) fn candidates(cfg: &MasqConfig) -> (u32, u32, u32) {
    if cfg.port_max < cfg.port_min {
        return (0, 0, 0);
    }
    let range = u32::from(cfg.port_max - cfg.port_min) + 1;
    // SAFETY: plain helper call.
    let start = unsafe { bpf_get_prandom_u32() }
        .checked_rem(range)
        .unwrap_or(0);
    (
        start,
        range,
        if range < PORT_TRIES {
            range
        } else {
            PORT_TRIES
        },
    )
}

/// Rewrites an IPv4 packet's address at `addr_at` (`IP + V4_SRC` or
/// `IP + V4_DST`) from `old` to `new` and its port (or ICMP identifier) at
/// `port_at` from `old_port` to `new_port`, with the IPv4 header checksum
/// (`ip_check`, as loaded) and the L4 checksum.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(super) fn rewrite_v4(
    ctx: &TcContext,
    flow: &Flow,
    ip_check: u16,
    addr_at: usize,
    (old, new): (V4Addr, V4Addr),
    port_at: usize,
    (old_port, new_port): (u16, u16),
) -> Option<()> {
    let check = csum_replace4(ip_check, u32::from_ne_bytes(old), u32::from_ne_bytes(new));
    write(ctx, addr_at, new)?;
    write(ctx, IP + V4_CSUM, check.to_ne_bytes())?;
    write(ctx, port_at, new_port.to_be_bytes())?;
    let csum = flow.l4 + flow.csum_off();
    let (from, to) = (ne16(old_port), ne16(new_port));
    if flow.proto == ICMP {
        // No pseudo-header: the identifier is the only change it sees.
        return ctx
            .l4_csum_replace(csum, u64::from(from), u64::from(to), 2)
            .ok();
    }
    l4_fix(ctx, csum, csum_diff4(old, new), from, to, flow.mangled())
}

/// [`rewrite_v4`] for IPv6 (no header checksum; ICMPv6 has a pseudo-header).
#[inline(always)]
pub(super) fn rewrite_v6(
    ctx: &TcContext,
    flow: &Flow,
    addr_at: usize,
    (old, new): (&V6Addr, &V6Addr),
    port_at: usize,
    (old_port, new_port): (u16, u16),
) -> Option<()> {
    write(ctx, addr_at, *new)?;
    write(ctx, port_at, new_port.to_be_bytes())?;
    let csum = flow.l4 + flow.csum_off();
    l4_fix(
        ctx,
        csum,
        csum_diff16(old, new),
        ne16(old_port),
        ne16(new_port),
        flow.mangled() | BPF_F_IPV6,
    )
}
