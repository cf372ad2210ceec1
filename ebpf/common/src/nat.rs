//! Masquerade (source NAT) state: the translation maps' keys and values and
//! the MASQ_CONFIG switch.
//!
//! A translated flow is one entry in each of two hashes per family:
//!
//! - NAT_FWD_V4 / NAT_FWD_V6, looked up by `to_native` (uplink egress): the
//!   endpoint's tuple as it left the endpoint → the node address and
//!   translated port it leaves with.
//! - NAT_REV_V4 / NAT_REV_V6, looked up by `from_native` (uplink ingress):
//!   the reply's tuple as it arrives (remote → node address, translated port)
//!   → the endpoint's address and port. Its key is also what makes a
//!   translated port taken: `to_native` claims a port by inserting the
//!   reverse entry with `BPF_NOEXIST` and never overwrites one.
//!
//! Ports are stored in host byte order (so `bpftool map dump` prints them as
//! numbers); addresses as network-order byte arrays like everywhere else.
//! For ICMP echo (and ICMPv6 echo) the identifier plays the endpoint's port:
//! a request's key is (endpoint, remote, identifier, 0); the reply's reverse
//! key is (remote, node, 0, translated identifier).
//!
//! Each direction keeps its own `last_seen_ns` and `state` in the entry it
//! looks up (one hash lookup per packet and no write to the other direction's
//! entry): a flow's last activity is the later of its two entries'
//! `last_seen_ns`, and its state is the union of their `state` bits. Programs
//! refresh `last_seen_ns` only when it is more than
//! [`LAST_SEEN_GRANULARITY_NS`] old, so an entry's age is exact to about a
//! second and a busy flow does not write its entry on every packet.

/// Bits of [`NatValueV4::state`] / [`NatValueV6::state`].
pub mod nat_state {
    /// A TCP FIN went from the endpoint to the remote (set in NAT_FWD).
    pub const FIN_OUT: u8 = 1 << 0;
    /// A TCP FIN came from the remote to the endpoint (set in NAT_REV).
    pub const FIN_IN: u8 = 1 << 1;
    /// A TCP RST went either way (set in the entry of its direction). A
    /// RST from the remote counts only inside the endpoint's receive
    /// window (see [`NatValueV4::ack`](crate::NatValueV4::ack)).
    pub const RST: u8 = 1 << 2;
    /// A packet came back from the remote (set in NAT_REV by the first
    /// reply): the flow is established. Flows without it (a SYN or a
    /// datagram nobody answered) end after the short unreplied timeout.
    pub const REPLIED: u8 = 1 << 3;
    /// TCP, NAT_FWD: the endpoint has sent a segment with ACK since its
    /// latest SYN, so [`NatValueV4::ack`](crate::NatValueV4::ack) is its receive point (before, it
    /// is what a RST answering the SYN must acknowledge).
    pub const ACKED: u8 = 1 << 4;
    /// Every defined bit.
    pub const ALL: u8 = FIN_OUT | FIN_IN | RST | REPLIED | ACKED;
    /// The bits that end a TCP connection: a new SYN on the tuple clears
    /// them (with every other bit), so the new connection starts fresh.
    pub const CLOSING: u8 = FIN_OUT | FIN_IN | RST;
}

/// Bits of [`MasqConfig::flags`].
pub mod masq_flags {
    /// IPv4 traffic of local endpoints is masqueraded to
    /// [`MasqConfig::node_v4`](crate::MasqConfig::node_v4).
    pub const ENABLED_V4: u32 = 1 << 0;
    /// IPv6 traffic of local endpoints is masqueraded to
    /// [`MasqConfig::node_v6`](crate::MasqConfig::node_v6).
    pub const ENABLED_V6: u32 = 1 << 1;
    /// Every defined bit.
    pub const ALL: u32 = ENABLED_V4 | ENABLED_V6;
}

/// How stale `last_seen_ns` may get before a packet of the flow rewrites it.
pub const LAST_SEEN_GRANULARITY_NS: u64 = 1_000_000_000;

/// How many candidate ports `to_native` tries (claiming each with
/// `BPF_NOEXIST` in NAT_REV) before it drops a new flow as exhausted; fewer
/// when the configured range is smaller.
pub const PORT_TRIES: u32 = 16;

/// Key of NAT_FWD_V4 (the endpoint's tuple) and of NAT_REV_V4 (the reply's
/// tuple as it arrives: remote → node).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct NatKeyV4 {
    /// Source address (NAT_FWD: the endpoint; NAT_REV: the remote).
    pub src_addr: crate::V4Addr,
    /// Destination address (NAT_FWD: the remote; NAT_REV: the node address).
    pub dst_addr: crate::V4Addr,
    /// Source port, host byte order (ICMP echo: the identifier in NAT_FWD,
    /// 0 in NAT_REV).
    pub src_port: u16,
    /// Destination port, host byte order (ICMP echo: 0 in NAT_FWD, the
    /// translated identifier in NAT_REV).
    pub dst_port: u16,
    /// IP protocol number: 6 TCP, 17 UDP, 1 ICMP.
    pub proto: u8,
    /// Explicit padding; always zero (it is part of the hashed key).
    pub _pad: [u8; 3],
}

/// Key of NAT_FWD_V6 and NAT_REV_V6; see [`NatKeyV4`].
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct NatKeyV6 {
    /// Source address (NAT_FWD: the endpoint; NAT_REV: the remote).
    pub src_addr: crate::V6Addr,
    /// Destination address (NAT_FWD: the remote; NAT_REV: the node address).
    pub dst_addr: crate::V6Addr,
    /// Source port, host byte order (ICMPv6 echo: see [`NatKeyV4::src_port`]).
    pub src_port: u16,
    /// Destination port, host byte order.
    pub dst_port: u16,
    /// IP protocol number: 6 TCP, 17 UDP, 58 ICMPv6.
    pub proto: u8,
    /// Explicit padding; always zero (it is part of the hashed key).
    pub _pad: [u8; 3],
}

/// Value of NAT_FWD_V4 (the translated source: node address and port) and
/// of NAT_REV_V4 (the original endpoint address and port).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct NatValueV4 {
    /// `bpf_ktime_get_ns` (CLOCK_MONOTONIC) of this direction's latest packet,
    /// to within [`LAST_SEEN_GRANULARITY_NS`].
    pub last_seen_ns: u64,
    /// NAT_FWD: the node address; NAT_REV: the endpoint's address.
    pub addr: crate::V4Addr,
    /// NAT_FWD: the translated port; NAT_REV: the endpoint's port (host
    /// byte order; ICMP: the identifier).
    pub port: u16,
    /// [`nat_state`] bits seen in this direction.
    pub state: u8,
    /// NAT_FWD, TCP: the window scale the endpoint announced in its SYN
    /// (0 when it announced none, or the SYN was not seen); 0 elsewhere.
    pub wscale: u8,
    /// NAT_FWD, TCP (host order): once [`nat_state::ACKED`] is set, the
    /// acknowledgment number of the endpoint's latest segment (where its
    /// receive window starts); before, its SYN's sequence number + 1 (what
    /// a RST refusing the SYN acknowledges). A RST from the remote is
    /// honoured only against it. 0 elsewhere.
    pub ack: u32,
    /// NAT_FWD, TCP: the endpoint's latest advertised window, unscaled.
    pub win: u16,
    /// Explicit padding; always zero.
    pub _pad: u16,
}

/// Value of NAT_FWD_V6 and NAT_REV_V6; see [`NatValueV4`].
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct NatValueV6 {
    /// See [`NatValueV4::last_seen_ns`].
    pub last_seen_ns: u64,
    /// NAT_FWD: the node address; NAT_REV: the endpoint's address.
    pub addr: crate::V6Addr,
    /// See [`NatValueV4::port`].
    pub port: u16,
    /// [`nat_state`] bits seen in this direction.
    pub state: u8,
    /// See [`NatValueV4::wscale`].
    pub wscale: u8,
    /// See [`NatValueV4::ack`].
    pub ack: u32,
    /// See [`NatValueV4::win`].
    pub win: u16,
    /// Explicit padding; always zero.
    pub _pad: u16,
    /// Explicit padding; always zero.
    pub _pad2: u32,
}

/// Value of NAT_CLOCK, a per-CPU array of one: each CPU's cache of
/// `bpf_ktime_get_ns()` as of a jiffy, so the programs read the clock once
/// per jiffy rather than once per packet. Internal to the programs.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct NatClock {
    /// `bpf_jiffies64()` when `now_ns` was read.
    pub jiffies: u64,
    /// `bpf_ktime_get_ns()` at that jiffy.
    pub now_ns: u64,
}

/// The one value of MASQ_CONFIG (key 0), written by the agent. All zero (the
/// array's initial state) means masquerade is off for both families and
/// `to_native` only counts.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct MasqConfig {
    /// Address IPv4 flows are translated to.
    pub node_v4: crate::V4Addr,
    /// Address IPv6 flows are translated to.
    pub node_v6: crate::V6Addr,
    /// Lowest translated port (and ICMP identifier), inclusive.
    pub port_min: u16,
    /// Highest translated port, inclusive; `port_min <= port_max`.
    pub port_max: u16,
    /// [`masq_flags`] bits.
    pub flags: u32,
    /// Lowest port whose replies `from_native` looks up, inclusive: the
    /// range's and that of every translation still live, which may hold
    /// ports of an earlier range (a changed `ports` spares established
    /// flows). 0 in both `reply_min` and `reply_max` (a value written by a
    /// build that had padding here): `port_min`..`port_max`.
    pub reply_min: u16,
    /// Highest port whose replies are looked up, inclusive.
    pub reply_max: u16,
    /// The most translations (forward entries) one endpoint address may
    /// hold in its family's table: a new flow beyond it is dropped
    /// (`masq_endpoint_limit`). 0: no bound.
    pub endpoint_max: u32,
    /// Explicit padding; always zero.
    pub _pad: u32,
}

impl MasqConfig {
    /// The ports whose replies are looked up in NAT_REV (see
    /// [`MasqConfig::reply_min`]).
    #[inline(always)]
    #[must_use]
    pub const fn reply_ports(&self) -> (u16, u16) {
        if self.reply_max == 0 {
            (self.port_min, self.port_max)
        } else {
            (self.reply_min, self.reply_max)
        }
    }
}

const _: () = assert!(size_of::<NatKeyV4>() == 16);
const _: () = assert!(size_of::<NatKeyV6>() == 40);
const _: () = assert!(size_of::<NatValueV4>() == 24);
const _: () = assert!(size_of::<NatValueV6>() == 40);
const _: () = assert!(size_of::<MasqConfig>() == 40);
const _: () = assert!(size_of::<NatFragKeyV4>() == 12);
const _: () = assert!(size_of::<NatFragKeyV6>() == 40);
const _: () = assert!(size_of::<NatClock>() == 16);

/// Key of NAT_FRAG_V4: an IPv4 datagram's fragments as they arrive at the
/// node (remote → node address), by the fields that make them one datagram.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct NatFragKeyV4 {
    /// The remote (the fragments' source).
    pub src_addr: crate::V4Addr,
    /// The node address (their destination).
    pub dst_addr: crate::V4Addr,
    /// The IPv4 identification, as loaded (network order).
    pub id: u16,
    /// IP protocol number.
    pub proto: u8,
    /// Explicit padding; always zero.
    pub _pad: u8,
}

/// Key of NAT_FRAG_V6; see [`NatFragKeyV4`].
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct NatFragKeyV6 {
    /// The remote.
    pub src_addr: crate::V6Addr,
    /// The node address.
    pub dst_addr: crate::V6Addr,
    /// The fragment header's identification, as loaded (network order).
    pub id: u32,
    /// The upper-layer protocol (the fragment header's next header).
    pub proto: u8,
    /// Explicit padding; always zero.
    pub _pad: [u8; 3],
}

/// Value of NAT_FRAG_V4 and NAT_FRAG_V6: where the datagram's first
/// fragment was reverse-translated to (the endpoint's address, IPv4 in the
/// first four bytes). The later fragments carry no ports; they follow it.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct NatFragValue {
    /// The endpoint's address (IPv4: the first four bytes, the rest zero).
    pub addr: crate::V6Addr,
}

/// Key of NAT_EP_OPENED / NAT_EP_CLOSED: an endpoint address, IPv4 mapped
/// into IPv6 (`::ffff:a.b.c.d`), as [`endpoint_key_v4`] and
/// [`endpoint_key_v6`] make it.
pub type NatEndpointKey = crate::V6Addr;

/// The NAT_EP_* key of an IPv4 endpoint address.
#[inline(always)]
#[must_use]
pub const fn endpoint_key_v4(a: crate::V4Addr) -> NatEndpointKey {
    [
        0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, a[0], a[1], a[2], a[3],
    ]
}

/// The NAT_EP_* key of an IPv6 endpoint address.
#[inline(always)]
#[must_use]
pub const fn endpoint_key_v6(a: crate::V6Addr) -> NatEndpointKey {
    a
}

#[cfg(feature = "user")]
mod pod {
    // SAFETY: all nine are `#[repr(C)]`, made only of integers and byte
    // arrays, with every padding byte spelled out as a field (the size
    // assertions above prove there is no implicit padding), so any bit
    // pattern is a valid value and no byte is uninitialised.
    unsafe impl aya::Pod for super::NatKeyV4 {}
    unsafe impl aya::Pod for super::NatKeyV6 {}
    unsafe impl aya::Pod for super::NatValueV4 {}
    unsafe impl aya::Pod for super::NatValueV6 {}
    unsafe impl aya::Pod for super::MasqConfig {}
    unsafe impl aya::Pod for super::NatClock {}
    unsafe impl aya::Pod for super::NatFragKeyV4 {}
    unsafe impl aya::Pod for super::NatFragKeyV6 {}
    unsafe impl aya::Pod for super::NatFragValue {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use core::mem::{align_of, offset_of};

    #[test]
    fn key_layouts() {
        assert_eq!(offset_of!(NatKeyV4, src_addr), 0);
        assert_eq!(offset_of!(NatKeyV4, dst_addr), 4);
        assert_eq!(offset_of!(NatKeyV4, src_port), 8);
        assert_eq!(offset_of!(NatKeyV4, dst_port), 10);
        assert_eq!(offset_of!(NatKeyV4, proto), 12);
        assert_eq!(offset_of!(NatKeyV4, _pad), 13);
        assert_eq!(size_of::<NatKeyV4>(), 16);
        assert_eq!(align_of::<NatKeyV4>(), 2);
        assert_eq!(offset_of!(NatKeyV6, src_addr), 0);
        assert_eq!(offset_of!(NatKeyV6, dst_addr), 16);
        assert_eq!(offset_of!(NatKeyV6, src_port), 32);
        assert_eq!(offset_of!(NatKeyV6, dst_port), 34);
        assert_eq!(offset_of!(NatKeyV6, proto), 36);
        assert_eq!(offset_of!(NatKeyV6, _pad), 37);
        assert_eq!(size_of::<NatKeyV6>(), 40);
    }

    #[test]
    fn value_layouts() {
        assert_eq!(offset_of!(NatValueV4, last_seen_ns), 0);
        assert_eq!(offset_of!(NatValueV4, addr), 8);
        assert_eq!(offset_of!(NatValueV4, port), 12);
        assert_eq!(offset_of!(NatValueV4, state), 14);
        assert_eq!(offset_of!(NatValueV4, wscale), 15);
        assert_eq!(offset_of!(NatValueV4, ack), 16);
        assert_eq!(offset_of!(NatValueV4, win), 20);
        assert_eq!(offset_of!(NatValueV4, _pad), 22);
        assert_eq!(size_of::<NatValueV4>(), 24);
        assert_eq!(align_of::<NatValueV4>(), 8);
        assert_eq!(offset_of!(NatValueV6, last_seen_ns), 0);
        assert_eq!(offset_of!(NatValueV6, addr), 8);
        assert_eq!(offset_of!(NatValueV6, port), 24);
        assert_eq!(offset_of!(NatValueV6, state), 26);
        assert_eq!(offset_of!(NatValueV6, wscale), 27);
        assert_eq!(offset_of!(NatValueV6, ack), 28);
        assert_eq!(offset_of!(NatValueV6, win), 32);
        assert_eq!(offset_of!(NatValueV6, _pad), 34);
        assert_eq!(offset_of!(NatValueV6, _pad2), 36);
        assert_eq!(size_of::<NatValueV6>(), 40);
        assert_eq!(align_of::<NatValueV6>(), 8);
    }

    #[test]
    fn masq_config_layout() {
        assert_eq!(offset_of!(MasqConfig, node_v4), 0);
        assert_eq!(offset_of!(MasqConfig, node_v6), 4);
        assert_eq!(offset_of!(MasqConfig, port_min), 20);
        assert_eq!(offset_of!(MasqConfig, port_max), 22);
        assert_eq!(offset_of!(MasqConfig, flags), 24);
        assert_eq!(offset_of!(MasqConfig, reply_min), 28);
        assert_eq!(offset_of!(MasqConfig, reply_max), 30);
        assert_eq!(offset_of!(MasqConfig, endpoint_max), 32);
        assert_eq!(offset_of!(MasqConfig, _pad), 36);
        assert_eq!(size_of::<MasqConfig>(), 40);
        assert_eq!(align_of::<MasqConfig>(), 4);
        assert_eq!(MasqConfig::default().flags & masq_flags::ALL, 0);
    }

    #[test]
    fn a_reply_range_of_zeros_means_the_port_range() {
        let old = MasqConfig {
            port_min: 61000,
            port_max: 65535,
            ..MasqConfig::default()
        };
        assert_eq!(old.reply_ports(), (61000, 65535));
        let wider = MasqConfig {
            reply_min: 60000,
            reply_max: 65535,
            ..old
        };
        assert_eq!(wider.reply_ports(), (60000, 65535));
    }

    #[test]
    fn flag_bits_are_distinct() {
        assert_eq!(nat_state::FIN_OUT & nat_state::FIN_IN, 0);
        assert_eq!((nat_state::FIN_OUT | nat_state::FIN_IN) & nat_state::RST, 0);
        assert_eq!(nat_state::ALL.count_ones(), 5);
        assert_eq!(
            nat_state::CLOSING & (nat_state::REPLIED | nat_state::ACKED),
            0
        );
        assert_eq!(masq_flags::ENABLED_V4 & masq_flags::ENABLED_V6, 0);
        assert_eq!(masq_flags::ALL.count_ones(), 2);
    }
}
