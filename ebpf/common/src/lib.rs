//! Types shared by lockstep's eBPF programs and its agent.
//!
//! Every map key, map value, flag bit, counter index and map name that crosses
//! the kernel boundary is defined here and only here. The eBPF programs
//! (`ebpf/programs`, `no_std`, bpfel) and the agent (`agent/daemon`, with the
//! `user` feature, which adds [`aya::Pod`] impls) both compile this crate, so the
//! two sides cannot drift apart the way hand-copied C structs do.
//!
//! The IPCACHE is one logical longest-prefix-match table split over two maps
//! per family: host entries (/32, /128) in a hash (`IPCACHE_HOST_*`), shorter
//! prefixes in an LPM trie (`IPCACHE_V4`/`_V6`). A host entry is always the
//! longest match, so "hash, then trie" returns exactly what one trie would, but
//! the common case (a pod or service address) costs one hash probe instead of a
//! walk of a trie that is ~20 levels deep at 64k entries. Every entry lives in
//! exactly one of the two maps.
//!
//! Layout rules, enforced by `const` assertions below and by unit tests:
//! `#[repr(C)]`, no `bool`, no implicit padding (explicit `_pad` fields instead),
//! addresses as byte arrays in network order so `bpftool map dump` prints
//! `[10,0,1,2]`.
#![no_std]

use core::mem::size_of;

mod counter;
pub mod nat;
pub mod seal;
pub mod slots;

pub use counter::Counter;
pub use slots::{EndpointAddrs, EndpointSlot, L2Resp, L2RespSlot, L2RespSlotV6};

pub use nat::{
    LAST_SEEN_GRANULARITY_NS, MasqConfig, NatClock, NatEndpointKey, NatFragKeyV4, NatFragKeyV6,
    NatFragValue, NatKeyV4, NatKeyV6, NatValueV4, NatValueV6, PORT_TRIES, endpoint_key_v4,
    endpoint_key_v6, masq_flags, nat_state,
};

/// An IPv4 address in network byte order, as stored in every map.
pub type V4Addr = [u8; 4];
/// An IPv6 address in network byte order, as stored in every map.
pub type V6Addr = [u8; 16];

/// Names of the maps, as they appear in the object, in `bpftool map` and as pin
/// file names. The kernel limits map names to 15 characters.
pub mod map_names {
    /// LPM trie: IPv4 prefix shorter than /32 → [`IpcacheValue`](crate::IpcacheValue).
    /// Host entries (/32) live in [`IPCACHE_HOST_V4`]; see the crate docs.
    pub const IPCACHE_V4: &str = "IPCACHE_V4";
    /// Hash: IPv4 address (a /32 IPCACHE entry) → [`IpcacheValue`](crate::IpcacheValue).
    pub const IPCACHE_HOST_V4: &str = "IPCACHE_HOST_V4";
    /// Hash: IPv6 address (a /128 IPCACHE entry) → [`IpcacheValue`](crate::IpcacheValue).
    pub const IPCACHE_HOST_V6: &str = "IPCACHE_HOST_V6";
    /// LPM trie: IPv6 prefix shorter than /128 → [`IpcacheValue`](crate::IpcacheValue).
    pub const IPCACHE_V6: &str = "IPCACHE_V6";
    /// LPM trie: IPv4 CIDR → [`MasqSkipValue`](crate::MasqSkipValue).
    pub const MASQ_SKIP_V4: &str = "MASQ_SKIP_V4";
    /// LPM trie: IPv6 CIDR → [`MasqSkipValue`](crate::MasqSkipValue).
    pub const MASQ_SKIP_V6: &str = "MASQ_SKIP_V6";
    /// Hash: host-side ifindex → [`EndpointValue`](crate::EndpointValue).
    pub const ENDPOINTS: &str = "ENDPOINTS";
    /// Hash: IPv4 address → [`L2RespValue`](crate::L2RespValue).
    pub const L2_RESP_V4: &str = "L2_RESP_V4";
    /// Hash: IPv6 address → [`L2RespValue`](crate::L2RespValue) (sealed
    /// with [`L2RespValue::sealed_v6`](crate::L2RespValue::sealed_v6)); the
    /// addresses `from_native` answers Neighbor Solicitations for.
    pub const L2_RESP_V6: &str = "L2_RESP_V6";
    /// Per-CPU array: [`Counter`](crate::Counter) index → packets.
    pub const COUNTERS: &str = "COUNTERS";
    /// Array: [`slots::endpoint`](crate::slots::endpoint) of an ifindex →
    /// [`EndpointSlot`](crate::EndpointSlot), a direct-mapped copy of
    /// [`ENDPOINTS`] in front of it (see [`slots`](crate::slots)).
    pub const ENDPOINT_SLOTS: &str = "ENDPOINT_SLOTS";
    /// Array: [`slots::l2_resp`](crate::slots::l2_resp) of an address →
    /// [`L2RespSlot`](crate::L2RespSlot), a direct-mapped copy of
    /// [`L2_RESP_V4`] in front of it.
    pub const L2_RESP_SLOTS: &str = "L2_RESP_SLOTS";
    /// Array: [`slots::l2_resp_v6`](crate::slots::l2_resp_v6) of an IPv6
    /// address → [`L2RespSlotV6`](crate::L2RespSlotV6), a direct-mapped copy
    /// of [`L2_RESP_V6`] in front of it (the NDP responder's).
    pub const L2_RESP6_SLOTS: &str = "L2_RESP6_SLOTS";
    /// Array of one `u32`: whether the programs report rare events (a
    /// spoofed packet dropped, an ARP request answered) through aya-log; see
    /// [`debug`](crate::debug). Pinned, so the switch outlives the agent.
    pub const DATAPATH_DEBUG: &str = "DATAPATH_DEBUG";
    /// Hash: endpoint's tuple [`NatKeyV4`](crate::NatKeyV4) → translated
    /// source [`NatValueV4`](crate::NatValueV4); see [`nat`](crate::nat).
    pub const NAT_FWD_V4: &str = "NAT_FWD_V4";
    /// Hash: [`NatKeyV6`](crate::NatKeyV6) → [`NatValueV6`](crate::NatValueV6),
    /// like [`NAT_FWD_V4`].
    pub const NAT_FWD_V6: &str = "NAT_FWD_V6";
    /// Hash: reply's tuple [`NatKeyV4`](crate::NatKeyV4) → endpoint address
    /// and port [`NatValueV4`](crate::NatValueV4); its keys are the claimed
    /// translated ports.
    pub const NAT_REV_V4: &str = "NAT_REV_V4";
    /// Hash: [`NatKeyV6`](crate::NatKeyV6) → [`NatValueV6`](crate::NatValueV6),
    /// like [`NAT_REV_V4`].
    pub const NAT_REV_V6: &str = "NAT_REV_V6";
    /// Array of one [`MasqConfig`](crate::MasqConfig), written by the agent.
    pub const MASQ_CONFIG: &str = "MASQ_CONFIG";
    /// Per-CPU array of one [`NatClock`](crate::NatClock): the programs'
    /// clock cache (internal, no state worth keeping).
    pub const NAT_CLOCK: &str = "NAT_CLOCK";
    /// Array of one [`TunnelConfig`](crate::TunnelConfig), written by the
    /// agent: the tunnel device remote blocks flagged
    /// [`ENCAP`](crate::ipcache_flags::ENCAP) are sent through.
    pub const TUNNEL_CONFIG: &str = "TUNNEL_CONFIG";
    /// LRU hash: [`NatFragKeyV4`](crate::NatFragKeyV4) →
    /// [`NatFragValue`](crate::NatFragValue): where the later fragments of a
    /// reverse-translated IPv4 datagram go (set by its first fragment).
    pub const NAT_FRAG_V4: &str = "NAT_FRAG_V4";
    /// LRU hash: [`NatFragKeyV6`](crate::NatFragKeyV6) →
    /// [`NatFragValue`](crate::NatFragValue), like [`NAT_FRAG_V4`].
    pub const NAT_FRAG_V6: &str = "NAT_FRAG_V6";
    /// Hash: [`NatEndpointKey`](crate::NatEndpointKey) → `u64`, the
    /// translations the programs opened for the endpoint address (only
    /// the programs write it, with atomic adds).
    pub const NAT_EP_OPENED: &str = "NAT_EP_OPENED";
    /// Hash: [`NatEndpointKey`](crate::NatEndpointKey) → `u64`, the
    /// translations of the endpoint address that ended (only the agent
    /// writes it). Opened − ended is what the address holds, against
    /// [`MasqConfig::endpoint_max`](crate::MasqConfig::endpoint_max).
    pub const NAT_EP_CLOSED: &str = "NAT_EP_CLOSED";
    /// Every map, in a fixed order.
    pub const ALL: [&str; 25] = [
        IPCACHE_V4,
        IPCACHE_V6,
        IPCACHE_HOST_V4,
        IPCACHE_HOST_V6,
        MASQ_SKIP_V4,
        MASQ_SKIP_V6,
        ENDPOINTS,
        L2_RESP_V4,
        COUNTERS,
        ENDPOINT_SLOTS,
        L2_RESP_SLOTS,
        DATAPATH_DEBUG,
        NAT_FWD_V4,
        NAT_FWD_V6,
        NAT_REV_V4,
        NAT_REV_V6,
        MASQ_CONFIG,
        NAT_CLOCK,
        L2_RESP_V6,
        L2_RESP6_SLOTS,
        TUNNEL_CONFIG,
        NAT_FRAG_V4,
        NAT_FRAG_V6,
        NAT_EP_OPENED,
        NAT_EP_CLOSED,
    ];
}

/// Values of the DATAPATH_DEBUG switch.
///
/// Why a map and not aya-log's own level: `AYA_LOG_LEVEL` is patched before
/// load, and switching it would mean reloading the programs; a one-entry
/// array is read with an inlined lookup (about a nanosecond, and only on the
/// rare paths that report), and flipped at run time by `lockstep datapath
/// debug on|off` or `bpftool map update`.
pub mod debug {
    /// Events off (the default).
    pub const OFF: u32 = 0;
    /// Rare datapath events reach the agent's log.
    pub const EVENTS: u32 = 1;
}

/// Names of the programs in the object.
pub mod program_names {
    /// TC ingress on an endpoint's host-side veth: anti-spoofing and
    /// destination classification.
    pub const FROM_ENDPOINT: &str = "from_endpoint";
    /// TC egress on the node's uplink: masquerade decision.
    pub const TO_NATIVE: &str = "to_native";
    /// TC ingress on the node's uplink: ARP responder.
    pub const FROM_NATIVE: &str = "from_native";
    /// A program that only returns "pass"; the baseline of the datapath bench.
    pub const NOOP: &str = "noop";
    /// TC ingress on the tunnel device: decapsulated packets checked
    /// against the outer source and delivered to local endpoints.
    pub const FROM_TUNNEL: &str = "from_tunnel";
    /// Parses an IPv4 TCP/UDP tuple and looks it up in NAT_FWD_V4, nothing
    /// else; the masquerade bench's reference (never attached).
    pub const NAT_LOOKUP: &str = "nat_lookup";
    /// Sets a fixed tunnel key and redirects to the tunnel device, nothing
    /// else; the encapsulation bench's floor (never attached).
    pub const ENCAP_FLOOR: &str = "encap_floor";
    /// Every program, in a fixed order: a program's position is its TC
    /// filter priority, so new programs go last.
    pub const ALL: [&str; 7] = [
        FROM_ENDPOINT,
        TO_NATIVE,
        FROM_NATIVE,
        NOOP,
        FROM_TUNNEL,
        NAT_LOOKUP,
        ENCAP_FLOOR,
    ];
}

/// Default capacities. The agent may override them at load time; whatever is
/// used is checked against existing pins.
pub mod max_entries {
    /// Each of IPCACHE_V4, IPCACHE_V6, IPCACHE_HOST_V4 and IPCACHE_HOST_V6.
    /// None of them preallocates, so capacity costs nothing until used.
    pub const IPCACHE: u32 = 262_144;
    /// MASQ_SKIP_V4 and MASQ_SKIP_V6.
    pub const MASQ_SKIP: u32 = 1_024;
    /// ENDPOINTS.
    pub const ENDPOINTS: u32 = 16_384;
    /// L2_RESP_V4 and L2_RESP_V6.
    pub const L2_RESP: u32 = 4_096;
    /// ENDPOINT_SLOTS. Fixed (the slot function depends on it); a power of two.
    pub const ENDPOINT_SLOTS: u32 = 16_384;
    /// L2_RESP_SLOTS. Fixed (the slot function depends on it); a power of two.
    pub const L2_RESP_SLOTS: u32 = 16_384;
    /// L2_RESP6_SLOTS. Fixed (the slot function depends on it); a power of two.
    pub const L2_RESP6_SLOTS: u32 = 16_384;
    /// Each of NAT_FWD_V4, NAT_FWD_V6, NAT_REV_V4 and NAT_REV_V6: one entry
    /// per translated flow in each. 65,536 flows is 14 translated-port ranges
    /// of the default 4,536 ports (61000-65535) towards one remote address and
    /// port, or about 500 flows for each of 128 endpoints. The maps are
    /// preallocated (a new flow's insert takes an element from a per-CPU free
    /// list instead of allocating in the packet path and cannot fail for lack
    /// of memory), which costs about 5 MiB (IPv4) and 8 MiB (IPv6) per map.
    pub const NAT: u32 = 65_536;
    /// NAT_FRAG_V4 and NAT_FRAG_V6: datagrams in reassembly at once (LRU:
    /// the oldest make room, and a fragment whose entry went is not
    /// translated).
    pub const NAT_FRAG: u32 = 8_192;
    /// NAT_EP_OPENED and NAT_EP_CLOSED: endpoint addresses with
    /// translations (two per dual-stack endpoint).
    pub const NAT_EP: u32 = 32_768;
    /// COUNTERS: room for [`Counter::COUNT`](crate::Counter::COUNT) and for
    /// counters later builds add, so adding one needs no `migrate` of the
    /// pin (an array's size is part of its definition). 64 per-CPU `u64`s
    /// cost 512 bytes a CPU.
    pub const COUNTERS: u32 = 64;
}

/// Bits of [`IpcacheValue::flags`]: what kind of owner holds the prefix.
pub mod ipcache_flags {
    /// A local endpoint (pod).
    pub const ENDPOINT: u32 = 1 << 0;
    /// The agent's ingress address.
    pub const INGRESS: u32 = 1 << 1;
    /// The agent's health address.
    pub const HEALTH: u32 = 1 << 2;
    /// The agent's router address.
    pub const ROUTER: u32 = 1 << 3;
    /// A LoadBalancer service address.
    pub const LOADBALANCER: u32 = 1 << 4;
    /// An address of the node itself.
    pub const HOST: u32 = 1 << 5;
    /// An address that lives on another node.
    pub const REMOTE: u32 = 1 << 6;
    /// With [`REMOTE`]: reached through the tunnel; `node_addr` is the
    /// tunnel endpoint (the holder's underlay address), not a next hop.
    pub const ENCAP: u32 = 1 << 7;
    /// With [`ENCAP`]: `node_addr` is an IPv6 address (else IPv4, in its
    /// first four bytes). Without `ENCAP`, `node_addr` has the family of
    /// the prefix.
    pub const TUNNEL_V6: u32 = 1 << 8;
    /// Every defined bit.
    pub const ALL: u32 =
        ENDPOINT | INGRESS | HEALTH | ROUTER | LOADBALANCER | HOST | REMOTE | ENCAP | TUNNEL_V6;
}

/// Reserved security identities stored in [`IpcacheValue::identity`].
pub mod identity {
    /// The node itself.
    pub const HOST: u32 = 1;
    /// Anything outside the cluster.
    pub const WORLD: u32 = 2;
    /// The agent's health address.
    pub const HEALTH: u32 = 4;
    /// The agent's ingress address.
    pub const INGRESS: u32 = 8;
    /// The agent's router address.
    pub const ROUTER: u32 = 9;
    /// LoadBalancer service addresses.
    pub const LOADBALANCER: u32 = 10;
    /// Local endpoints; identities at or above this value are endpoints.
    pub const ENDPOINT: u32 = 256;
}

/// Value of IPCACHE_V4 and IPCACHE_V6.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct IpcacheValue {
    /// Security identity (see [`identity`]).
    pub identity: u32,
    /// Owner kind bits (see [`ipcache_flags`]).
    pub flags: u32,
    /// Host-side interface of a local endpoint, 0 otherwise.
    pub ifindex: u32,
    /// Explicit padding; always zero.
    pub _pad: u32,
    /// Address of the node that hosts a remote prefix (IPv4 in the first four
    /// bytes), zero for local prefixes.
    pub node_addr: V6Addr,
}

impl IpcacheValue {
    /// Whether this entry names `outer` (an IPv4 address when `outer_v6`
    /// is false, in its first four bytes) as the node holding the prefix:
    /// what a decapsulated packet's outer source must be for an inner
    /// source in this prefix. `prefix_v6`: the entry is an IPv6 prefix's
    /// (its `node_addr` has that family unless [`ipcache_flags::ENCAP`]
    /// says otherwise).
    #[inline(always)]
    #[must_use]
    pub fn held_by(&self, prefix_v6: bool, outer: &V6Addr, outer_v6: bool) -> bool {
        if self.flags & ipcache_flags::REMOTE == 0 {
            return false;
        }
        let node_v6 = if self.flags & ipcache_flags::ENCAP != 0 {
            self.flags & ipcache_flags::TUNNEL_V6 != 0
        } else {
            prefix_v6
        };
        if node_v6 != outer_v6 {
            return false;
        }
        if node_v6 {
            self.node_addr == *outer
        } else {
            self.node_addr[..4] == outer[..4]
        }
    }
}

/// Value of the one TUNNEL_CONFIG entry: how `from_endpoint` encapsulates
/// and what `from_tunnel` accepts. All zero: no tunnel (a remote block
/// flagged [`ipcache_flags::ENCAP`] is then dropped and counted).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct TunnelConfig {
    /// The collect-metadata tunnel device (VXLAN or Geneve); 0: none.
    pub ifindex: u32,
    /// The VNI sent, and the only one accepted.
    pub vni: u32,
    /// The node's IPv4 underlay address, the outer source of IPv4
    /// tunnels (zero: the kernel's route lookup picks it).
    pub local_v4: V4Addr,
    /// Explicit padding; always zero.
    pub _pad: u32,
    /// The node's IPv6 underlay address, the outer source of IPv6 tunnels.
    pub local_v6: V6Addr,
}

/// Why a CIDR is in MASQ_SKIP_V4 / MASQ_SKIP_V6.
pub mod masq_reason {
    /// A pool with `skip_masquerade`.
    pub const POOL: u32 = 1;
    /// A configured non-masquerade CIDR.
    pub const CONFIG: u32 = 2;
    /// The cluster CIDR.
    pub const CLUSTER: u32 = 3;
}

/// Value of MASQ_SKIP_V4 and MASQ_SKIP_V6.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct MasqSkipValue {
    /// One of [`masq_reason`].
    pub reason: u32,
    /// Index of the pool that asked for it (reason [`masq_reason::POOL`]), else 0.
    pub pool_id: u32,
}

/// Bits of [`EndpointValue::flags`].
pub mod endpoint_flags {
    /// [`EndpointValue::ipv4`](crate::EndpointValue::ipv4) is set.
    pub const HAS_V4: u32 = 1 << 0;
    /// [`EndpointValue::ipv6`](crate::EndpointValue::ipv6) is set.
    pub const HAS_V6: u32 = 1 << 1;
}

/// Value of ENDPOINTS, keyed by the host-side ifindex (`u32`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct EndpointValue {
    /// Generation of the allocation this entry was programmed from.
    pub generation: u64,
    /// The endpoint's IPv4 address, when [`endpoint_flags::HAS_V4`] is set.
    pub ipv4: V4Addr,
    /// [`endpoint_flags`] bits.
    pub flags: u32,
    /// The endpoint's IPv6 address, when [`endpoint_flags::HAS_V6`] is set.
    pub ipv6: V6Addr,
    /// MAC address of the endpoint's interface inside its namespace.
    pub mac: [u8; 6],
    /// Explicit padding; always zero.
    pub _pad: [u8; 2],
    /// Seal over the key and every other word (see [`seal`]); 0 in values
    /// the agent compares, set only as the value is written.
    pub check: u32,
    /// Explicit padding; always zero.
    pub _pad2: u32,
}

/// Value of L2_RESP_V4 (keyed by the announced IPv4 address) and of
/// L2_RESP_V6 (keyed by the announced IPv6 address).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct L2RespValue {
    /// Interface on which the address is announced; requests arriving on any
    /// other interface are not answered.
    pub ifindex: u32,
    /// MAC address to answer with (the announcing interface's).
    pub mac: [u8; 6],
    /// Explicit padding; always zero.
    pub _pad: [u8; 2],
    /// Seal over the key and every other word (see [`seal`]); 0 in values
    /// the agent compares, set only as the value is written.
    pub check: u32,
    /// When the announcement ends: kernel `CLOCK_MONOTONIC` nanoseconds (what
    /// `bpf_ktime_get_ns` returns). The programs stop answering once the
    /// clock has reached it; the agent renews it while it runs. 0: never.
    pub expires_ns: u64,
}

impl L2RespValue {
    /// Whether an announcement expiring at `expires_ns` is over at `now_ns`
    /// (both `CLOCK_MONOTONIC` nanoseconds; 0 never expires).
    #[inline(always)]
    #[must_use]
    pub const fn expired(expires_ns: u64, now_ns: u64) -> bool {
        expires_ns != 0 && now_ns >= expires_ns
    }
}

/// Size in bytes of an IPv4 LPM key (`prefix_len: u32` + 4 address bytes).
pub const LPM_V4_KEY_SIZE: usize = 4 + 4;
/// Size in bytes of an IPv6 LPM key (`prefix_len: u32` + 16 address bytes).
pub const LPM_V6_KEY_SIZE: usize = 4 + 16;

// Layout guarantees: a change here is a change of map definition and must be
// caught by the pin-compatibility check, never silently reinterpreted.
const _: () = assert!(size_of::<IpcacheValue>() == 32);
const _: () = assert!(size_of::<MasqSkipValue>() == 8);
const _: () = assert!(size_of::<TunnelConfig>() == 32);
const _: () = assert!(size_of::<EndpointValue>() == 48);
const _: () = assert!(size_of::<L2RespValue>() == 24);
const _: () = assert!(size_of::<EndpointSlot>() == 72);
const _: () = assert!(size_of::<L2RespSlot>() == 48);
const _: () = assert!(size_of::<L2RespSlotV6>() == 72);
const _: () = assert!(max_entries::L2_RESP6_SLOTS.is_power_of_two());
const _: () = assert!(max_entries::ENDPOINT_SLOTS.is_power_of_two());
const _: () = assert!(max_entries::L2_RESP_SLOTS.is_power_of_two());
const _: () = assert!(Counter::ALL.len() == Counter::COUNT as usize);
const _: () = assert!(Counter::COUNT <= max_entries::COUNTERS);

#[cfg(feature = "user")]
mod pod {
    // SAFETY: all seven are `#[repr(C)]`, made only of integers and byte arrays,
    // with every padding byte spelled out as a field, so any bit pattern is a
    // valid value and no byte is uninitialised.
    unsafe impl aya::Pod for super::IpcacheValue {}
    unsafe impl aya::Pod for super::MasqSkipValue {}
    unsafe impl aya::Pod for super::EndpointValue {}
    unsafe impl aya::Pod for super::L2RespValue {}
    unsafe impl aya::Pod for super::EndpointSlot {}
    unsafe impl aya::Pod for super::L2RespSlot {}
    unsafe impl aya::Pod for super::L2RespSlotV6 {}
    unsafe impl aya::Pod for super::TunnelConfig {}

    const _: () = assert!(
        core::mem::size_of::<aya::maps::lpm_trie::Key<super::V4Addr>>() == super::LPM_V4_KEY_SIZE
    );
    const _: () = assert!(
        core::mem::size_of::<aya::maps::lpm_trie::Key<super::V6Addr>>() == super::LPM_V6_KEY_SIZE
    );
}

#[cfg(test)]
mod tests;
