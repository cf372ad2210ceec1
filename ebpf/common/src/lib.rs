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
    /// Per-CPU array: [`Counter`](crate::Counter) index → packets.
    pub const COUNTERS: &str = "COUNTERS";
    /// Every map, in a fixed order.
    pub const ALL: [&str; 9] = [
        IPCACHE_V4,
        IPCACHE_V6,
        IPCACHE_HOST_V4,
        IPCACHE_HOST_V6,
        MASQ_SKIP_V4,
        MASQ_SKIP_V6,
        ENDPOINTS,
        L2_RESP_V4,
        COUNTERS,
    ];
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
    /// Every program, in a fixed order.
    pub const ALL: [&str; 4] = [FROM_ENDPOINT, TO_NATIVE, FROM_NATIVE, NOOP];
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
    /// L2_RESP_V4.
    pub const L2_RESP: u32 = 4_096;
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
    /// Every defined bit.
    pub const ALL: u32 = ENDPOINT | INGRESS | HEALTH | ROUTER | LOADBALANCER | HOST | REMOTE;
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
}

/// Value of L2_RESP_V4, keyed by the announced IPv4 address.
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
}

/// Indices into the COUNTERS per-CPU array.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Counter {
    /// from_endpoint: packet passed the source check.
    FromEndpointPassed = 0,
    /// from_endpoint: IPv4 packet dropped, source not the endpoint's.
    SpoofDroppedV4 = 1,
    /// from_endpoint: IPv6 packet dropped, source not the endpoint's.
    SpoofDroppedV6 = 2,
    /// from_endpoint: ARP packet dropped, sender address not the endpoint's.
    SpoofDroppedArp = 3,
    /// from_endpoint: interface has no ENDPOINTS entry; packet dropped.
    UnknownEndpoint = 4,
    /// from_endpoint: destination found in IPCACHE as a local endpoint.
    DstEndpoint = 5,
    /// from_endpoint: destination found in IPCACHE as an agent or LB address.
    DstService = 6,
    /// from_endpoint: destination found in IPCACHE as a host or remote prefix.
    DstCluster = 7,
    /// from_endpoint: destination not in IPCACHE (world).
    DstWorld = 8,
    /// to_native: endpoint traffic that would be masqueraded.
    MasqWouldTranslate = 9,
    /// to_native: endpoint traffic to a MASQ_SKIP destination.
    MasqSkipped = 10,
    /// to_native: traffic not from a local endpoint.
    MasqNotEndpoint = 11,
    /// from_native: ARP request answered from L2_RESP_V4.
    ArpReplied = 12,
    /// from_native: ARP request for an address not announced here.
    ArpIgnored = 13,
    /// Packets too short or malformed to parse.
    Malformed = 14,
}

impl Counter {
    /// Number of counters (the COUNTERS map's max entries).
    pub const COUNT: u32 = 15;
    /// Every counter, in index order.
    pub const ALL: [Counter; Self::COUNT as usize] = [
        Counter::FromEndpointPassed,
        Counter::SpoofDroppedV4,
        Counter::SpoofDroppedV6,
        Counter::SpoofDroppedArp,
        Counter::UnknownEndpoint,
        Counter::DstEndpoint,
        Counter::DstService,
        Counter::DstCluster,
        Counter::DstWorld,
        Counter::MasqWouldTranslate,
        Counter::MasqSkipped,
        Counter::MasqNotEndpoint,
        Counter::ArpReplied,
        Counter::ArpIgnored,
        Counter::Malformed,
    ];

    /// Stable snake_case name, used in metrics and the CLI.
    pub const fn name(self) -> &'static str {
        match self {
            Counter::FromEndpointPassed => "from_endpoint_passed",
            Counter::SpoofDroppedV4 => "spoof_dropped_v4",
            Counter::SpoofDroppedV6 => "spoof_dropped_v6",
            Counter::SpoofDroppedArp => "spoof_dropped_arp",
            Counter::UnknownEndpoint => "unknown_endpoint",
            Counter::DstEndpoint => "dst_endpoint",
            Counter::DstService => "dst_service",
            Counter::DstCluster => "dst_cluster",
            Counter::DstWorld => "dst_world",
            Counter::MasqWouldTranslate => "masq_would_translate",
            Counter::MasqSkipped => "masq_skipped",
            Counter::MasqNotEndpoint => "masq_not_endpoint",
            Counter::ArpReplied => "arp_replied",
            Counter::ArpIgnored => "arp_ignored",
            Counter::Malformed => "malformed",
        }
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
const _: () = assert!(size_of::<EndpointValue>() == 40);
const _: () = assert!(size_of::<L2RespValue>() == 12);
const _: () = assert!(Counter::ALL.len() == Counter::COUNT as usize);

#[cfg(feature = "user")]
mod pod {
    // SAFETY: all four are `#[repr(C)]`, made only of integers and byte arrays,
    // with every padding byte spelled out as a field, so any bit pattern is a
    // valid value and no byte is uninitialised.
    unsafe impl aya::Pod for super::IpcacheValue {}
    unsafe impl aya::Pod for super::MasqSkipValue {}
    unsafe impl aya::Pod for super::EndpointValue {}
    unsafe impl aya::Pod for super::L2RespValue {}

    const _: () = assert!(
        core::mem::size_of::<aya::maps::lpm_trie::Key<super::V4Addr>>() == super::LPM_V4_KEY_SIZE
    );
    const _: () = assert!(
        core::mem::size_of::<aya::maps::lpm_trie::Key<super::V6Addr>>() == super::LPM_V6_KEY_SIZE
    );
}

#[cfg(test)]
mod tests {
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
        assert_eq!(size_of::<EndpointValue>(), 40);
        assert_eq!(align_of::<EndpointValue>(), 8);
    }

    #[test]
    fn l2_resp_value_layout() {
        assert_eq!(offset_of!(L2RespValue, ifindex), 0);
        assert_eq!(offset_of!(L2RespValue, mac), 4);
        assert_eq!(offset_of!(L2RespValue, _pad), 10);
        assert_eq!(size_of::<L2RespValue>(), 12);
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
        ];
        let mut seen = 0;
        for b in bits {
            assert_eq!(b.count_ones(), 1);
            assert_eq!(seen & b, 0);
            seen |= b;
        }
        assert_eq!(seen, ipcache_flags::ALL);
    }
}
