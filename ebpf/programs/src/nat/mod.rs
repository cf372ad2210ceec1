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
//! always complete in the header), L4 checksums through
//! `bpf_l4_csum_replace` (with `BPF_F_PSEUDO_HDR` for addresses), which does
//! the right thing under `CHECKSUM_PARTIAL` (veth offload, GSO) and
//! `CHECKSUM_COMPLETE`.
//!
//! `to_native` writes packets with `bpf_skb_store_bytes`, never directly: a
//! direct write makes the verifier unclone every skb the program sees, and
//! the node's own TCP traffic (clones kept for retransmission) would pay a
//! header copy per packet without being translated. `from_native` already
//! writes directly (the ARP responder), so it does here too.

mod v4;
mod v6;

pub(crate) use v4::{egress_v4, ingress_v4};
pub(crate) use v6::{egress_v6, ingress_v6};

use aya_ebpf::{
    bindings::BPF_F_MARK_MANGLED_0,
    helpers::{bpf_get_prandom_u32, bpf_ktime_get_ns},
    programs::TcContext,
};
use lockstep_common::{
    IpcacheValue, LAST_SEEN_GRANULARITY_NS, MasqConfig, PORT_TRIES, V4Addr, V6Addr, ipcache_flags,
    nat_state,
};

use crate::{ETH_HLEN, MASQ_CONFIG, read};

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

/// `bpf_l4_csum_replace` for IPv6, falling back to no `BPF_F_IPV6` on a
/// kernel that does not know the flag.
#[inline(always)]
pub(super) fn l4_csum_v6(
    ctx: &TcContext,
    off: usize,
    from: u64,
    to: u64,
    flags: u64,
) -> Result<(), i64> {
    match ctx.l4_csum_replace(off, from, to, flags | BPF_F_IPV6) {
        Ok(()) => Ok(()),
        Err(-22) => ctx.l4_csum_replace(off, from, to, flags),
        Err(e) => Err(e),
    }
}

/// Writes `v` at `offset` by direct packet access (from_native only).
#[inline(always)]
pub(super) fn write<T: Copy>(ctx: &TcContext, offset: usize, v: T) -> Option<()> {
    if ctx.data() + offset + size_of::<T>() > ctx.data_end() {
        return None;
    }
    // SAFETY: bounds checked just above; TC programs may write packet data.
    unsafe { ((ctx.data() + offset) as *mut T).write_unaligned(v) };
    Some(())
}

#[inline(always)]
pub(super) fn ne16(port: u16) -> u64 {
    u64::from(u16::from_ne_bytes(port.to_be_bytes()))
}

#[inline(always)]
pub(super) fn ne32(addr: V4Addr) -> u64 {
    u64::from(u32::from_ne_bytes(addr))
}

/// The agent's masquerade settings; all zero (off) when unset.
#[inline(always)]
pub(super) fn config() -> MasqConfig {
    MASQ_CONFIG.get(0).copied().unwrap_or_default()
}

/// Refreshes a NAT entry's `last_seen_ns` when it is more than a second
/// old, and adds `bits` to its state; writes nothing otherwise.
#[inline(always)]
pub(super) fn touch(last_seen: *mut u64, state: *mut u8, bits: u8) {
    // SAFETY: plain helper call.
    let now = unsafe { bpf_ktime_get_ns() };
    // SAFETY: both point into a map value for this run; a racing writer can
    // at worst lose a state bit set at the same instant by another CPU.
    unsafe {
        if now.wrapping_sub(*last_seen) > LAST_SEEN_GRANULARITY_NS {
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
