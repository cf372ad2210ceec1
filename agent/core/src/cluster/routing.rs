//! How another node's blocks are reached (#30): routed natively `via` the
//! node's address, which needs every node on one L2 segment (or routers
//! that know the pod blocks), or encapsulated to the node's underlay
//! address through the tunnel device (VXLAN or Geneve), which needs only
//! that the nodes reach each other.
//!
//! The mode is the cluster's (`[cluster] routing`); the path is decided
//! per remote node and block family from the node's published addresses
//! and this node's own underlay prefixes:
//!
//! - `native`: the peer's first address of the block's family, as before.
//! - `tunnel`: always encapsulated, to the peer's address of the block's
//!   family when both nodes have that family, else of the other family
//!   when both have it (an IPv6 block over an IPv4-only underlay).
//! - `cross-subnet`: native when the peer has an address of the block's
//!   family inside one of this node's prefixes (on-link: no router between
//!   them), encapsulated otherwise.
//!
//! The endpoint's family depends only on which families both nodes have,
//! so two nodes pick the same underlay family for each other: what one
//! node sends from its address is what the other expects as the outer
//! source of that block's packets (the decapsulation check).

use std::net::IpAddr;

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

/// The cluster's routing mode.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "kebab-case")]
pub enum RoutingMode {
    /// Kernel routes `block via node_ip`: every node on one segment.
    #[default]
    Native,
    /// Every other node's blocks through the tunnel.
    Tunnel,
    /// Native to nodes on one of this node's subnets, the tunnel to others.
    CrossSubnet,
}

impl RoutingMode {
    /// Whether any path may be encapsulated (endpoint MTUs leave room).
    pub fn may_encapsulate(self) -> bool {
        self != RoutingMode::Native
    }
}

/// The encapsulation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "kebab-case")]
pub enum TunnelProtocol {
    /// VXLAN (RFC 7348), UDP 8472 by default (the Linux port; IANA's 4789
    /// may be configured).
    #[default]
    Vxlan,
    /// Geneve (RFC 8926), UDP 6081, no options.
    Geneve,
}

impl TunnelProtocol {
    /// The default UDP port.
    pub fn default_port(self) -> u16 {
        match self {
            TunnelProtocol::Vxlan => 8472,
            TunnelProtocol::Geneve => 6081,
        }
    }

    /// Bytes the encapsulation adds around an endpoint's IP packet: the
    /// outer IP header (20 for IPv4, 40 for IPv6), UDP (8), the VXLAN or
    /// Geneve header without options (8) and the inner Ethernet header (14).
    pub fn overhead(self, underlay_v6: bool) -> u32 {
        let ip = if underlay_v6 { 40 } else { 20 };
        match self {
            TunnelProtocol::Vxlan | TunnelProtocol::Geneve => ip + 8 + 8 + 14,
        }
    }

    /// Its name in the configuration and the logs.
    pub fn name(self) -> &'static str {
        match self {
            TunnelProtocol::Vxlan => "vxlan",
            TunnelProtocol::Geneve => "geneve",
        }
    }
}

/// The largest VNI (24 bits in both VXLAN and Geneve).
pub const MAX_VNI: u32 = (1 << 24) - 1;

/// How this node reaches other nodes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Routing {
    /// The cluster's mode.
    pub mode: RoutingMode,
    /// This node's underlay addresses with their prefix lengths (a
    /// configured node address the interfaces do not hold counts as a
    /// host prefix).
    pub own: Vec<IpNet>,
}

/// How one remote block is reached.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Path {
    /// A kernel route via this address (the block's family).
    Native(IpAddr),
    /// Encapsulated to this tunnel endpoint (either family).
    Tunnel(IpAddr),
}

/// Why no path exists.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NoPath {
    /// Native routing needs an address of the block's family.
    NoAddressOfFamily,
    /// The two nodes share no underlay family.
    NoCommonFamily,
}

impl Routing {
    /// Native routing, as before routing modes existed.
    pub fn native() -> Self {
        Routing::default()
    }

    fn has_family(&self, v4: bool) -> bool {
        self.own.iter().any(|n| n.addr().is_ipv4() == v4)
    }

    /// The tunnel endpoint for a block of family `v4` on a node with
    /// addresses `peer`.
    fn endpoint(&self, v4: bool, peer: &[IpAddr]) -> Result<IpAddr, NoPath> {
        [v4, !v4]
            .into_iter()
            .filter(|f| self.has_family(*f))
            .find_map(|f| peer.iter().find(|a| a.is_ipv4() == f).copied())
            .ok_or(NoPath::NoCommonFamily)
    }

    /// How a block of family `block_v4` held by a node with addresses
    /// `peer` (in its published order) is reached.
    ///
    /// # Errors
    /// No address to route or tunnel to.
    pub fn path(&self, block_v4: bool, peer: &[IpAddr]) -> Result<Path, NoPath> {
        let same = || peer.iter().find(|a| a.is_ipv4() == block_v4).copied();
        match self.mode {
            RoutingMode::Native => same().map(Path::Native).ok_or(NoPath::NoAddressOfFamily),
            RoutingMode::Tunnel => self.endpoint(block_v4, peer).map(Path::Tunnel),
            RoutingMode::CrossSubnet => {
                let on_link = peer
                    .iter()
                    .find(|a| a.is_ipv4() == block_v4 && self.own.iter().any(|n| n.contains(*a)));
                match on_link {
                    Some(a) => Ok(Path::Native(*a)),
                    None => self.endpoint(block_v4, peer).map(Path::Tunnel),
                }
            }
        }
    }

    /// The MTU endpoint interfaces get when none is configured: the
    /// underlay's `underlay_mtu` less the largest overhead among the
    /// underlay families this node has; `underlay_mtu` itself in native
    /// mode (nothing is encapsulated).
    pub fn endpoint_mtu(&self, protocol: TunnelProtocol, underlay_mtu: u32) -> u32 {
        if !self.mode.may_encapsulate() {
            return underlay_mtu;
        }
        let overhead = protocol.overhead(self.has_family(false));
        underlay_mtu.saturating_sub(overhead)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("ip")
    }
    fn net(s: &str) -> IpNet {
        s.parse().expect("net")
    }
    fn routing(mode: RoutingMode, own: &[&str]) -> Routing {
        Routing {
            mode,
            own: own.iter().map(|s| net(s)).collect(),
        }
    }

    #[test]
    fn cross_subnet_is_native_on_link_and_tunnelled_beyond() {
        let r = routing(RoutingMode::CrossSubnet, &["10.251.1.1/24", "fd51:1::1/64"]);
        let same = [ip("10.251.1.2"), ip("fd51:1::2")];
        let other = [ip("10.251.2.1"), ip("fd51:2::1")];
        assert_eq!(r.path(true, &same), Ok(Path::Native(ip("10.251.1.2"))));
        assert_eq!(r.path(false, &same), Ok(Path::Native(ip("fd51:1::2"))));
        assert_eq!(r.path(true, &other), Ok(Path::Tunnel(ip("10.251.2.1"))));
        assert_eq!(r.path(false, &other), Ok(Path::Tunnel(ip("fd51:2::1"))));
        // Same IPv4 subnet, IPv6 elsewhere: per family.
        let mixed = [ip("10.251.1.3"), ip("fd51:9::3")];
        assert_eq!(r.path(true, &mixed), Ok(Path::Native(ip("10.251.1.3"))));
        assert_eq!(r.path(false, &mixed), Ok(Path::Tunnel(ip("fd51:9::3"))));
    }

    #[test]
    fn tunnel_crosses_families_only_when_both_nodes_lack_the_blocks() {
        let v4only = routing(RoutingMode::Tunnel, &["10.0.0.1/24"]);
        // An IPv6 block of a dual-stack node over the IPv4 underlay.
        let dual = [ip("fd00::2"), ip("10.0.0.2")];
        assert_eq!(v4only.path(false, &dual), Ok(Path::Tunnel(ip("10.0.0.2"))));
        assert_eq!(v4only.path(true, &dual), Ok(Path::Tunnel(ip("10.0.0.2"))));
        // No family in common.
        assert_eq!(
            v4only.path(true, &[ip("fd00::2")]),
            Err(NoPath::NoCommonFamily)
        );
        // Native keeps today's rule.
        let native = Routing::native();
        assert_eq!(native.path(false, &dual), Ok(Path::Native(ip("fd00::2"))));
        assert_eq!(
            native.path(false, &[ip("10.0.0.2")]),
            Err(NoPath::NoAddressOfFamily)
        );
    }

    #[test]
    fn the_endpoint_mtu_leaves_room_for_the_largest_outer_header() {
        let v4 = routing(RoutingMode::Tunnel, &["10.0.0.1/24"]);
        let dual = routing(RoutingMode::CrossSubnet, &["10.0.0.1/24", "fd00::1/64"]);
        assert_eq!(v4.endpoint_mtu(TunnelProtocol::Vxlan, 1500), 1450);
        assert_eq!(dual.endpoint_mtu(TunnelProtocol::Geneve, 1500), 1430);
        assert_eq!(
            Routing::native().endpoint_mtu(TunnelProtocol::Vxlan, 1500),
            1500
        );
        assert_eq!(TunnelProtocol::Vxlan.default_port(), 8472);
        assert_eq!(TunnelProtocol::Geneve.default_port(), 6081);
    }

    fn a_v4(hosts: std::ops::Range<u8>) -> impl Strategy<Value = IpAddr> {
        (0u8..3, hosts).prop_map(|(s, h)| IpAddr::from([10, 0, s, h]))
    }

    fn a_v6(hosts: std::ops::Range<u8>) -> impl Strategy<Value = IpAddr> {
        (0u16..3, hosts).prop_map(|(s, h)| IpAddr::from([0xfd00, 0, s, 0, 0, 0, 0, u16::from(h)]))
    }

    /// A node: its addresses (at most one per family, at least one), each
    /// in a /24 or /64 of a few subnets.
    fn a_node() -> impl Strategy<Value = Vec<IpNet>> {
        a_node_with(1..5)
    }

    /// As [`a_node`], its host parts in `hosts`: two nodes drawn with
    /// disjoint ranges never share an address but may share subnets. Drawn
    /// as such, not filtered: filters rejected a quarter of the cases, too
    /// many for a long run.
    fn a_node_with(hosts: std::ops::Range<u8>) -> impl Strategy<Value = Vec<IpNet>> {
        prop_oneof![
            (
                a_v4(hosts.clone()),
                proptest::option::of(a_v6(hosts.clone()))
            )
                .prop_map(|(a, b)| (Some(a), b)),
            a_v6(hosts).prop_map(|b| (None, Some(b))),
        ]
        .prop_map(|(a, b)| {
            a.into_iter()
                .chain(b)
                .map(|ip| IpNet::new(ip, if ip.is_ipv4() { 24 } else { 64 }).expect("len"))
                .collect()
        })
    }

    fn a_mode() -> impl Strategy<Value = RoutingMode> {
        prop_oneof![
            Just(RoutingMode::Native),
            Just(RoutingMode::Tunnel),
            Just(RoutingMode::CrossSubnet)
        ]
    }

    proptest! {
        /// Every path goes to one of the peer's addresses; native ones in
        /// the block's family (cross-subnet: on one of this node's
        /// subnets), tunnel ones in a family this node has; tunnel mode
        /// never routes natively, native mode never encapsulates.
        #[test]
        fn paths_respect_the_mode(mode in a_mode(), me in a_node(), peer in a_node(), v4 in any::<bool>()) {
            let r = Routing { mode, own: me.clone() };
            let addrs: Vec<IpAddr> = peer.iter().map(IpNet::addr).collect();
            match r.path(v4, &addrs) {
                Ok(Path::Native(a)) => {
                    prop_assert!(addrs.contains(&a));
                    prop_assert_eq!(a.is_ipv4(), v4);
                    prop_assert_ne!(mode, RoutingMode::Tunnel);
                    if mode == RoutingMode::CrossSubnet {
                        prop_assert!(me.iter().any(|n| n.contains(&a)));
                    }
                }
                Ok(Path::Tunnel(a)) => {
                    prop_assert!(addrs.contains(&a));
                    prop_assert!(me.iter().any(|n| n.addr().is_ipv4() == a.is_ipv4()));
                    prop_assert_ne!(mode, RoutingMode::Native);
                    if mode == RoutingMode::CrossSubnet {
                        prop_assert!(!addrs.iter().any(|p| p.is_ipv4() == v4 && me.iter().any(|n| n.contains(p))));
                    }
                }
                Err(NoPath::NoAddressOfFamily) => {
                    prop_assert_eq!(mode, RoutingMode::Native);
                    prop_assert!(!addrs.iter().any(|a| a.is_ipv4() == v4));
                }
                Err(NoPath::NoCommonFamily) => {
                    prop_assert!(!addrs.iter().any(|a| me.iter().any(|n| n.addr().is_ipv4() == a.is_ipv4())));
                }
            }
        }

        /// Two nodes encapsulating to each other pick the same underlay
        /// family for a block family, so each one's outer source is the
        /// address the other's IPCACHE names (the decapsulation check);
        /// in cross-subnet mode they agree on whether they are on-link
        /// (both use the same prefix lengths here).
        #[test]
        fn two_nodes_agree_on_the_path_to_each_other(
            mode in prop_oneof![Just(RoutingMode::Tunnel), Just(RoutingMode::CrossSubnet)],
            a in a_node_with(1..5), b in a_node_with(5..9), v4 in any::<bool>()
        ) {
            let ra = Routing { mode, own: a.clone() };
            let rb = Routing { mode, own: b.clone() };
            let addrs = |n: &[IpNet]| n.iter().map(IpNet::addr).collect::<Vec<_>>();
            let ab = ra.path(v4, &addrs(&b));
            let ba = rb.path(v4, &addrs(&a));
            match (ab, ba) {
                (Ok(Path::Tunnel(x)), Ok(Path::Tunnel(y))) => {
                    prop_assert_eq!(x.is_ipv4(), y.is_ipv4());
                    prop_assert!(a.iter().any(|n| n.addr() == y));
                    prop_assert!(b.iter().any(|n| n.addr() == x));
                }
                (Ok(Path::Native(_)), Ok(Path::Native(_))) => {}
                (Err(_), Err(_)) => {}
                (x, y) => prop_assert!(false, "disagree: {:?} vs {:?}", x, y),
            }
        }
    }
}
