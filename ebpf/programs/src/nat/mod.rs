//! Masquerade: source NAT of local endpoints' traffic leaving through the
//! uplink (`to_native`) and the reverse translation of what comes back
//! (`from_native`), with the state in NAT_FWD_* / NAT_REV_* (see
//! `lockstep_common::nat` and docs/masquerade.md).
//!
//! Translated: TCP, UDP, ICMP echo request (its identifier plays the port)
//! and ICMPv6 echo request; replies to them; and ICMP / ICMPv6 errors
//! (destination unreachable incl. fragmentation needed, packet too big, time
//! exceeded) that quote a translated packet. Not translated (passed as they
//! are): IPv4 packets with options or fragments, IPv6 packets whose first
//! next header is not TCP, UDP or ICMPv6, and every other protocol.
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

pub(crate) use v4::ingress_v4;

use aya_ebpf::{
    bindings::{BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR},
    helpers::{bpf_get_prandom_u32, bpf_jiffies64, bpf_ktime_get_ns},
    programs::TcContext,
};
use lockstep_common::{
    IpcacheValue, LAST_SEEN_GRANULARITY_NS, MasqConfig, PORT_TRIES, V4Addr, V6Addr, ipcache_flags,
    nat_state,
};

use crate::{ETH_HLEN, MASQ_CONFIG, NAT_CLOCK, read};

/// Internal verdicts (never returned to the kernel): `egress_*` found no
/// forward entry; `new_flow_*` made one.
pub(super) const NEW_FLOW: i32 = -1000;
pub(super) const CLAIMED: i32 = -1001;
/// `admit_v6`: a new flow to translate.
pub(super) const ADMITTED: i32 = -1002;
/// `ingress_v6`: an ICMPv6 packet that may be an error to translate.
pub(super) const ICMP_ERROR: i32 = -1003;

/// `from_native` for IPv6: replies, then ICMPv6 errors, each in a frame of
/// its own (see [`to_native_v4`]).
#[inline(always)]
pub(crate) fn from_native_v6(ctx: &TcContext) -> i32 {
    match v6::ingress_v6(ctx) {
        ICMP_ERROR => v6::icmp_error_v6(ctx),
        verdict => verdict,
    }
}

/// `to_native` for IPv4: the established flow's translation inline; a new
/// flow's checks and port claim in a function of its own (the verifier
/// allows 512 bytes of stack over a whole call chain, and the two would
/// not fit in one frame), after which the established path runs again.
#[inline(always)]
pub(crate) fn to_native_v4(ctx: &TcContext) -> i32 {
    match v4::egress_v4(ctx) {
        NEW_FLOW => {}
        verdict => return verdict,
    }
    match v4::new_flow_v4(ctx) {
        CLAIMED => {}
        verdict => return verdict,
    }
    match v4::egress_v4(ctx) {
        // Gone already (a collector raced): never let it out untranslated.
        NEW_FLOW => crate::DROP,
        verdict => verdict,
    }
}

/// [`to_native_v4`] for IPv6, whose established path has a function of its
/// own too (IPv6 keys and addresses are larger).
#[inline(always)]
pub(crate) fn to_native_v6(ctx: &TcContext) -> i32 {
    match v6::egress_v6(ctx) {
        NEW_FLOW => {}
        verdict => return verdict,
    }
    match v6::admit_v6(ctx) {
        ADMITTED => {}
        verdict => return verdict,
    }
    match v6::claim_v6(ctx) {
        CLAIMED => {}
        verdict => return verdict,
    }
    match v6::egress_v6(ctx) {
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
pub(super) const TCP_RST: u8 = 0x04;

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
            })
        }
        UDP => {
            let h = read::<[u8; 4]>(ctx, l4)?;
            Some(Flow {
                proto,
                sport: u16::from_be_bytes([h[0], h[1]]),
                dport: u16::from_be_bytes([h[2], h[3]]),
                tcp_flags: 0,
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
            })
        }
        _ => None,
    }
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

/// The agent's masquerade settings; all zero (off) when unset.
#[inline(always)]
pub(super) fn config() -> MasqConfig {
    MASQ_CONFIG.get(0).copied().unwrap_or_default()
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
    let csum = L4_V4 + flow.csum_off();
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
    let csum = L4_V6 + flow.csum_off();
    l4_fix(
        ctx,
        csum,
        csum_diff16(old, new),
        ne16(old_port),
        ne16(new_port),
        flow.mangled() | BPF_F_IPV6,
    )
}
