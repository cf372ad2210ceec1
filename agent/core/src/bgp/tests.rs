use super::*;
use proptest::prelude::*;

fn peer(name: &str, address: &str, asn: u32) -> PeerSpec {
    PeerSpec {
        name: name.into(),
        address: address.parse().unwrap(),
        asn,
        source: None,
        bfd: true,
        hold_time_s: 9,
    }
}

fn spec() -> BgpSpec {
    BgpSpec {
        asn: 64512,
        router_id: Ipv4Addr::new(192, 0, 2, 1),
        peers: vec![
            peer("tor-a", "192.0.2.254", 64513),
            peer("tor-b", "2001:db8::fe", 64513),
        ],
        bfd: BfdSpec::default(),
        graceful_restart_s: 120,
    }
}

/// The text of the block that starts with `head`, through its closing
/// line.
fn block<'a>(text: &'a str, head: &str) -> &'a str {
    let start = text
        .find(head)
        .unwrap_or_else(|| panic!("{head} not in\n{text}"));
    let end = text[start..].find("\n}\n").unwrap() + start + 3;
    &text[start..end]
}

#[test]
fn announcements_are_blackholes_of_their_familys_static_protocol_with_their_attributes() {
    let mut routes = Announcements::new();
    routes.insert("198.51.100.7/32".parse().unwrap(), RouteAttrs::default());
    routes.insert(
        "2001:db8:5::7/128".parse().unwrap(),
        RouteAttrs {
            communities: [(64512, 100)].into(),
            large_communities: [(64512, 1, 2)].into(),
            local_pref: Some(200),
        },
    );
    let blocks: Announcements = [("10.64.0.0/24".parse().unwrap(), RouteAttrs::default())].into();
    let text = render_bird(&spec(), &routes, &blocks).unwrap();
    assert_eq!(
        block(&text, "protocol static lockstep_ipv4"),
        "protocol static lockstep_ipv4 {\n  ipv4;\n  route 198.51.100.7/32 blackhole;\n}\n"
    );
    assert_eq!(
        block(&text, "protocol static lockstep_ipv6"),
        "protocol static lockstep_ipv6 {\n  ipv6;\n  route 2001:db8:5::7/128 blackhole { bgp_community.add((64512, 100)); bgp_large_community.add((64512, 1, 2)); bgp_local_pref = 200; };\n}\n"
    );
    // Pod blocks in protocols of their own (the keeper leaves them up),
    // exported by the same filter.
    assert_eq!(
        block(&text, "protocol static lockstep_blocks_ipv4"),
        "protocol static lockstep_blocks_ipv4 {\n  ipv4;\n  route 10.64.0.0/24 blackhole;\n}\n"
    );
    let filter = block(&text, "filter lockstep_export");
    for p in LB_PROTOCOLS.iter().chain(&BLOCK_PROTOCOLS) {
        assert!(filter.contains(&format!("proto = \"{p}\"")), "{filter}");
    }
    // No kernel protocol: nothing reaches the kernel's tables.
    assert!(!text.contains("protocol kernel"), "{text}");
    // Each peer imports nothing and has the family of its address.
    let a = block(&text, "protocol bgp peer_tor_a");
    assert!(a.contains("  ipv4 {\n    import none;"), "{a}");
    assert!(
        a.contains("bfd on;") && a.contains("graceful restart time 120;"),
        "{a}"
    );
    let b = block(&text, "protocol bgp peer_tor_b");
    assert!(b.contains("  ipv6 {\n    import none;"), "{b}");
    assert!(text.contains("min rx interval 100 ms;") && text.contains("multiplier 3;"));
}

#[test]
fn without_a_bfd_peer_there_is_no_bfd_protocol() {
    let mut s = spec();
    for p in &mut s.peers {
        p.bfd = false;
    }
    let text = render_bird(&s, &Announcements::new(), &Announcements::new()).unwrap();
    assert!(
        !text.contains("protocol bfd") && !text.contains("bfd on"),
        "{text}"
    );
}

#[test]
fn every_bad_field_is_named() {
    type Break = Box<dyn Fn(&mut BgpSpec)>;
    let cases: Vec<(Break, &str)> = vec![
        (Box::new(|s| s.asn = 0), "bgp.asn:"),
        (
            Box::new(|s| s.router_id = Ipv4Addr::UNSPECIFIED),
            "bgp.router_id:",
        ),
        (Box::new(|s| s.bfd.interval_ms = 5), "bgp.bfd.interval_ms:"),
        (Box::new(|s| s.bfd.multiplier = 0), "bgp.bfd.multiplier:"),
        (
            Box::new(|s| s.graceful_restart_s = 0),
            "bgp.graceful_restart_s:",
        ),
        (
            Box::new(|s| s.graceful_restart_s = 4096),
            "bgp.graceful_restart_s:",
        ),
        (
            Box::new(|s| s.peers[0].name = "1st".into()),
            "bgp.peers[0].name:",
        ),
        (
            Box::new(|s| s.peers[0].name = "a b".into()),
            "bgp.peers[0].name:",
        ),
        (
            Box::new(|s| s.peers[1].name = "tor_a".into()),
            "bgp.peers[1].name:",
        ),
        (
            Box::new(|s| s.peers[1].address = s.peers[0].address),
            "bgp.peers[1].address:",
        ),
        (
            Box::new(|s| s.peers[0].address = "0.0.0.0".parse().unwrap()),
            "bgp.peers[0].address:",
        ),
        (Box::new(|s| s.peers[0].asn = 0), "bgp.peers[0].asn:"),
        (
            Box::new(|s| s.peers[0].source = Some("2001:db8::1".parse().unwrap())),
            "bgp.peers[0].source:",
        ),
        (
            Box::new(|s| s.peers[0].hold_time_s = 2),
            "bgp.peers[0].hold_time_s:",
        ),
    ];
    for (break_it, named) in cases {
        let mut s = spec();
        break_it(&mut s);
        let e = render_bird(&s, &Announcements::new(), &Announcements::new())
            .unwrap_err()
            .to_string();
        assert!(e.starts_with(named), "{e} does not start with {named}");
    }
    let mut routes = Announcements::new();
    routes.insert("198.51.100.7/24".parse().unwrap(), RouteAttrs::default());
    let e = render_bird(&spec(), &routes, &Announcements::new())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("198.51.100.7/24 has host bits set (the network is 198.51.100.0/24)"),
        "{e}"
    );
}

fn routes() -> impl Strategy<Value = Announcements> {
    let net = prop_oneof![
        (any::<u32>(), 24u8..=32)
            .prop_map(|(a, l)| IpNet::new(IpAddr::V4(a.into()), l).unwrap().trunc()),
        (any::<u128>(), 64u8..=128)
            .prop_map(|(a, l)| IpNet::new(IpAddr::V6(a.into()), l).unwrap().trunc()),
    ];
    let attrs = (
        proptest::collection::btree_set((any::<u16>(), any::<u16>()), 0..3),
        proptest::option::of(any::<u32>()),
    )
        .prop_map(|(communities, local_pref)| RouteAttrs {
            communities,
            large_communities: BTreeSet::new(),
            local_pref,
        });
    proptest::collection::btree_map(net, attrs, 0..20)
}

proptest! {
    /// Whatever is announced, each peer's block is the same text (a
    /// configure leaves its session alone), and every prefix is one
    /// route of its family's static protocol: the LoadBalancer ones',
    /// or the pod blocks' ones.
    #[test]
    fn announcements_never_touch_a_peers_block(
        a in routes(), b in routes(), blocks_a in routes(), blocks_b in routes(),
    ) {
        let ta = render_bird(&spec(), &a, &blocks_a).unwrap();
        let tb = render_bird(&spec(), &b, &blocks_b).unwrap();
        for head in ["protocol bgp peer_tor_a", "protocol bgp peer_tor_b", "protocol bfd", "filter lockstep_export"] {
            prop_assert_eq!(block(&ta, head), block(&tb, head));
        }
        for (announced, kind) in [(&a, ""), (&blocks_a, "blocks_")] {
            for net in announced.keys() {
                let family = if net.addr().is_ipv4() { "ipv4" } else { "ipv6" };
                let stat = block(&ta, &format!("protocol static lockstep_{kind}{family} "));
                prop_assert_eq!(stat.matches(&format!("  route {net} blackhole")).count(), 1);
            }
        }
        prop_assert_eq!(ta.matches(" blackhole").count(), a.len() + blocks_a.len());
    }

    /// A change to one peer changes no other peer's block, whatever the
    /// order the peers come in.
    #[test]
    fn one_peers_change_leaves_the_others(hold in 3u16..600, swap in any::<bool>()) {
        let before = render_bird(&spec(), &Announcements::new(), &Announcements::new()).unwrap();
        let mut s = spec();
        s.peers[1].hold_time_s = hold;
        if swap {
            s.peers.reverse();
        }
        let after = render_bird(&s, &Announcements::new(), &Announcements::new()).unwrap();
        prop_assert_eq!(block(&before, "protocol bgp peer_tor_a"), block(&after, "protocol bgp peer_tor_a"));
    }
}
