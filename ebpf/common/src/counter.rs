//! The COUNTERS per-CPU array's indices: one per event the programs count,
//! read by `lockstep counters` and the agent's metrics.

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
    /// from_endpoint: ARP packet dropped: sender protocol address not the
    /// endpoint's (nor 0.0.0.0, a probe), or sender hardware address not the
    /// frame's Ethernet source.
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
    /// to_native: endpoint traffic to be masqueraded while MASQ_CONFIG
    /// leaves masquerade off for its family (counted, not translated).
    MasqWouldTranslate = 9,
    /// to_native: endpoint traffic to a MASQ_SKIP destination.
    MasqSkipped = 10,
    /// to_native: traffic not from a local endpoint.
    MasqNotEndpoint = 11,
    /// from_native: ARP request answered from L2_RESP_V4.
    ArpReplied = 12,
    /// from_native: ARP request for an address not announced here (or whose
    /// announcement has expired, see [`Counter::AnnounceExpired`]).
    ArpIgnored = 13,
    /// Packets too short or malformed to parse.
    Malformed = 14,
    /// from_endpoint / from_native: a copy of an ENDPOINTS or L2_RESP_V4
    /// value failed its [`seal`](crate::seal) (torn by a concurrent rewrite, or damaged)
    /// and was looked up again.
    SealRetried = 15,
    /// to_native: packet of a local endpoint source-translated (masqueraded).
    MasqTranslated = 16,
    /// from_native: reply reverse-translated to the endpoint.
    MasqReversed = 17,
    /// to_native: new flow dropped, no free translated port.
    MasqExhausted = 18,
    /// to_native: new flow dropped, a NAT map insert failed (full or no memory).
    MasqTableFull = 19,
    /// from_native: ICMP or ICMPv6 error quoting a translated packet
    /// reverse-translated (outer and inner headers).
    MasqIcmpErrorReversed = 20,
    /// from_native: Neighbor Solicitation answered from L2_RESP_V6.
    NdpReplied = 21,
    /// from_native: well-formed Neighbor Solicitation for an address not
    /// announced here (or expired).
    NdpIgnored = 22,
    /// from_native: Neighbor Solicitation dropped from the responder's
    /// consideration as malformed (hop limit not 255, code not 0, too short,
    /// multicast target, unspecified source); left to the stack.
    NdpMalformed = 23,
    /// from_native: ARP or NDP request for an address whose announcement
    /// expired (the agent stopped renewing it); not answered.
    AnnounceExpired = 24,
    /// from_endpoint: frame dropped because it carries a VLAN tag (802.1Q,
    /// 802.1ad or pre-standard QinQ), whether the kernel already moved the
    /// outer tag into the skb's metadata or the tag is still in the frame.
    /// Any tag, ID 0 included: the stack strips priority tags after TC and
    /// routes the inner packet, whose source was never checked.
    VlanDropped = 25,
    /// from_endpoint: untagged frame dropped because its ethertype is none
    /// of IPv4, IPv6 and ARP (or disagrees with the skb's protocol).
    EthertypeDropped = 26,
    /// from_endpoint: packet to a remote block reached through the tunnel
    /// (IPCACHE flag `ENCAP`), given its tunnel key and redirected to the
    /// tunnel device.
    TunnelEncap = 27,
    /// from_tunnel: decapsulated packet delivered to a local endpoint.
    TunnelDecap = 28,
    /// from_tunnel: dropped, the inner source is not in a block held by the
    /// node the outer source address is (a node forging another node's, or
    /// its own nonexistent, pods).
    TunnelDropForgedSource = 29,
    /// from_tunnel: dropped, the inner destination is no local endpoint.
    TunnelDropNotLocal = 30,
    /// from_tunnel: dropped, no tunnel key, a VNI other than the
    /// configured one, or an inner frame that is neither IPv4 nor IPv6
    /// (or too short).
    TunnelDropMalformed = 31,
    /// from_endpoint: dropped, a remote block needs the tunnel and no
    /// tunnel device is configured (TUNNEL_CONFIG empty) or the tunnel key
    /// could not be set.
    TunnelDropNoDevice = 32,
    /// from_endpoint: a packet too big for the path to its tunnel endpoint
    /// (IPv6 underlay) answered with ICMP "fragmentation needed" or
    /// "packet too big" instead of being sent.
    TunnelPmtuAnswered = 33,
    /// from_endpoint: IPv4 or IPv6 frame dropped because its Ethernet
    /// source is not the endpoint's MAC (the one recorded at ADD).
    SpoofDroppedMac = 34,
    /// to_native: a local endpoint's packet to a translated destination
    /// that the masquerade does not translate (IPv4 options, IPv6
    /// extension headers other than a fragment header, protocols other
    /// than TCP, UDP and ICMP / ICMPv6 echo, the endpoint's own ICMP
    /// errors): dropped, so it never leaves with the endpoint's address.
    MasqUntranslatable = 35,
    /// to_native: new flow dropped, its endpoint address already holds
    /// `MasqConfig::endpoint_max` translations.
    MasqEndpointLimit = 36,
    /// from_native: TCP RST from the remote outside the endpoint's receive
    /// window: translated and passed, but it does not end the flow.
    MasqRstIgnored = 37,
    /// to_native / from_native: a later fragment (no ports) of a
    /// translated datagram translated.
    MasqFragTranslated = 38,
    /// from_native: a later fragment to the node address whose datagram's
    /// first fragment was not seen (or was forgotten): left untranslated.
    MasqFragUnknown = 39,
    /// to_native: a SYN on a tuple whose connection had closed (FIN or
    /// RST): the translation starts fresh for the new connection.
    MasqTcpRestarted = 40,
}

impl Counter {
    /// Number of counters defined (the COUNTERS map has room for
    /// [`max_entries::COUNTERS`](crate::max_entries::COUNTERS)).
    pub const COUNT: u32 = 41;
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
        Counter::SealRetried,
        Counter::MasqTranslated,
        Counter::MasqReversed,
        Counter::MasqExhausted,
        Counter::MasqTableFull,
        Counter::MasqIcmpErrorReversed,
        Counter::NdpReplied,
        Counter::NdpIgnored,
        Counter::NdpMalformed,
        Counter::AnnounceExpired,
        Counter::VlanDropped,
        Counter::EthertypeDropped,
        Counter::TunnelEncap,
        Counter::TunnelDecap,
        Counter::TunnelDropForgedSource,
        Counter::TunnelDropNotLocal,
        Counter::TunnelDropMalformed,
        Counter::TunnelDropNoDevice,
        Counter::TunnelPmtuAnswered,
        Counter::SpoofDroppedMac,
        Counter::MasqUntranslatable,
        Counter::MasqEndpointLimit,
        Counter::MasqRstIgnored,
        Counter::MasqFragTranslated,
        Counter::MasqFragUnknown,
        Counter::MasqTcpRestarted,
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
            Counter::SealRetried => "seal_retried",
            Counter::MasqTranslated => "masq_translated",
            Counter::MasqReversed => "masq_reversed",
            Counter::MasqExhausted => "masq_exhausted",
            Counter::MasqTableFull => "masq_table_full",
            Counter::MasqIcmpErrorReversed => "masq_icmp_error_reversed",
            Counter::NdpReplied => "ndp_replied",
            Counter::NdpIgnored => "ndp_ignored",
            Counter::NdpMalformed => "ndp_malformed",
            Counter::AnnounceExpired => "announce_expired",
            Counter::VlanDropped => "vlan_dropped",
            Counter::EthertypeDropped => "ethertype_dropped",
            Counter::TunnelEncap => "tunnel_encap",
            Counter::TunnelDecap => "tunnel_decap",
            Counter::TunnelDropForgedSource => "tunnel_drop_forged_source",
            Counter::TunnelDropNotLocal => "tunnel_drop_not_local",
            Counter::TunnelDropMalformed => "tunnel_drop_malformed",
            Counter::TunnelDropNoDevice => "tunnel_drop_no_device",
            Counter::TunnelPmtuAnswered => "tunnel_pmtu_answered",
            Counter::SpoofDroppedMac => "spoof_dropped_mac",
            Counter::MasqUntranslatable => "masq_untranslatable",
            Counter::MasqEndpointLimit => "masq_endpoint_limit",
            Counter::MasqRstIgnored => "masq_rst_ignored",
            Counter::MasqFragTranslated => "masq_frag_translated",
            Counter::MasqFragUnknown => "masq_frag_unknown",
            Counter::MasqTcpRestarted => "masq_tcp_restarted",
        }
    }

    /// Why a packet this counter counts was dropped, for the agent's drops
    /// metric (`lockstep_datapath_drops_total{reason}`); `None` for a
    /// counter of packets that went on.
    pub const fn drop_reason(self) -> Option<&'static str> {
        match self {
            Counter::SpoofDroppedV4 => Some("spoofed_ipv4_source"),
            Counter::SpoofDroppedV6 => Some("spoofed_ipv6_source"),
            Counter::SpoofDroppedArp => Some("spoofed_arp_sender"),
            Counter::SpoofDroppedMac => Some("spoofed_mac"),
            Counter::UnknownEndpoint => Some("unknown_endpoint"),
            Counter::VlanDropped => Some("vlan_tagged"),
            Counter::EthertypeDropped => Some("ethertype"),
            Counter::MasqExhausted => Some("nat_no_free_port"),
            Counter::MasqTableFull => Some("nat_table_full"),
            Counter::MasqEndpointLimit => Some("nat_endpoint_limit"),
            Counter::MasqUntranslatable => Some("nat_untranslatable"),
            Counter::TunnelDropForgedSource => Some("tunnel_forged_source"),
            Counter::TunnelDropNotLocal => Some("tunnel_not_local"),
            Counter::TunnelDropMalformed => Some("tunnel_malformed"),
            Counter::TunnelDropNoDevice => Some("tunnel_no_device"),
            _ => None,
        }
    }
}
