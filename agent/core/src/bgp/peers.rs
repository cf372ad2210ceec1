//! Which BGP peers a node has, and with which of its own settings, under
//! Kubernetes (#48 item 2: peers as objects with node selectors, and
//! per-node overrides of the AS number, router ID and source address).
//!
//! One ConfigMap serves every node, so what differs from node to node
//! comes from the API server:
//! - **`BGPPeer` objects** (cluster-scoped): a router, its AS number and
//!   session settings, and the nodes that peer with it (a label
//!   selector; absent: every node). A router every node peers with can
//!   stay in the config (`[[bgp.peers]]`); both sets are used.
//! - **Annotations on the node's own Node** ([`ASN_ANNOTATION`],
//!   [`ROUTER_ID_ANNOTATION`], [`SOURCE_ANNOTATION`]): this node's AS
//!   number, router ID, and its source address per family. A node in
//!   another AS (a rack per AS), a router ID that is not the InternalIP,
//!   a session from another interface's address.
//!
//! A bad object or annotation never takes down the others: it is left
//! out, named in [`NodePeers::refused`], and the rest is used (a bad
//! annotation leaves the config's value in force).

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr};

use super::{BgpSpec, PeerSpec, check, peer_protocol};
use crate::lb::LabelSelector;

/// This node's AS number (`64600`), instead of `[bgp] asn`.
pub const ASN_ANNOTATION: &str = "bgp.lockstep.io/asn";
/// This node's router ID (an IPv4 address), instead of `[bgp]
/// router_id` and the InternalIP.
pub const ROUTER_ID_ANNOTATION: &str = "bgp.lockstep.io/router-id";
/// This node's source address for its sessions, one per family
/// (`192.0.2.11` or `192.0.2.11,2001:db8::11`): used for every peer of
/// that family that names none in the config.
pub const SOURCE_ANNOTATION: &str = "bgp.lockstep.io/source-address";

/// One `BGPPeer` object as the decision needs it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KubePeer {
    /// The object's name (the session's name: `lockstep status`, BIRD's
    /// protocol `peer_<name>`).
    pub name: String,
    /// When it was created (`metadata.creationTimestamp`, RFC 3339: its
    /// text sorts by time): of two objects that clash, the older stays.
    pub created: String,
    /// The router's address, as written.
    pub address: String,
    /// The router's AS number.
    pub asn: u32,
    /// Which nodes peer with it (`None`: every node).
    pub node_selector: Option<LabelSelector>,
    /// Whether BFD watches the session (`None`: yes).
    pub bfd: Option<bool>,
    /// The hold time in seconds (`None`: 90).
    pub hold_time_s: Option<u16>,
}

/// This node's Node, as the decision needs it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeFacts {
    /// Its labels (for the peers' node selectors).
    pub labels: BTreeMap<String, String>,
    /// Its annotations (for the overrides).
    pub annotations: BTreeMap<String, String>,
}

/// What the API server says of this node's BGP.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodePeers {
    /// The `BGPPeer` objects that select this node, as peers.
    pub peers: Vec<PeerSpec>,
    /// The AS number its annotation gives.
    pub asn: Option<u32>,
    /// The router ID its annotation gives.
    pub router_id: Option<Ipv4Addr>,
    /// The source address per family its annotation gives.
    pub sources: Vec<IpAddr>,
    /// Each object or annotation left out, with why (`BGPPeer tor-a`,
    /// `annotation bgp.lockstep.io/asn`).
    pub refused: BTreeMap<String, String>,
}

/// The hold time of a `BGPPeer` that names none, in seconds.
pub const DEFAULT_HOLD_TIME_S: u16 = 90;

/// What the API server says of this node's BGP: the `peers` whose node
/// selector admits `node`, and its annotations' overrides. `config`: the
/// config's own peers, whose names and addresses a `BGPPeer` must not
/// take again. Of two objects that clash (the same router for this
/// node), the older stays, so a new object never displaces a running
/// session.
#[must_use]
pub fn for_node(peers: &[KubePeer], node: &NodeFacts, config: &[PeerSpec]) -> NodePeers {
    let mut out = NodePeers::default();
    let a = &node.annotations;
    if let Some(text) = a.get(ASN_ANNOTATION) {
        match text.trim().parse::<u32>() {
            Ok(n) if n > 0 => out.asn = Some(n),
            _ => refuse(
                &mut out,
                format!("annotation {ASN_ANNOTATION}"),
                format!("{text:?} is not an AS number (1 to 4294967295)"),
            ),
        }
    }
    if let Some(text) = a.get(ROUTER_ID_ANNOTATION) {
        match text.trim().parse::<Ipv4Addr>() {
            Ok(id) if !id.is_unspecified() => out.router_id = Some(id),
            _ => refuse(
                &mut out,
                format!("annotation {ROUTER_ID_ANNOTATION}"),
                format!("{text:?} is not an IPv4 address other than 0.0.0.0"),
            ),
        }
    }
    if let Some(text) = a.get(SOURCE_ANNOTATION) {
        match sources(text) {
            Ok(s) => out.sources = s,
            Err(why) => refuse(&mut out, format!("annotation {SOURCE_ANNOTATION}"), why),
        }
    }
    let mut names: BTreeSet<String> = config.iter().map(|p| peer_protocol(&p.name)).collect();
    let mut addresses: BTreeSet<IpAddr> = config.iter().map(|p| p.address).collect();
    let mut sorted: Vec<&KubePeer> = peers.iter().collect();
    sorted.sort_by(|a, b| (&a.created, &a.name).cmp(&(&b.created, &b.name)));
    for p in sorted {
        if !p
            .node_selector
            .as_ref()
            .is_none_or(|s| s.matches(&node.labels))
        {
            continue;
        }
        let what = format!("BGPPeer {}", p.name);
        let Ok(address) = p.address.trim().parse::<IpAddr>() else {
            refuse(
                &mut out,
                what,
                format!("address {:?} is not an IP address", p.address),
            );
            continue;
        };
        let spec = PeerSpec {
            name: p.name.clone(),
            address,
            asn: p.asn,
            source: None,
            bfd: p.bfd.unwrap_or(true),
            hold_time_s: p.hold_time_s.unwrap_or(DEFAULT_HOLD_TIME_S),
        };
        // The peer's own fields, checked alone (the name's characters,
        // the address, the AS number, the hold time).
        let alone = BgpSpec {
            asn: 1,
            router_id: Ipv4Addr::new(192, 0, 2, 1),
            peers: vec![spec.clone()],
            bfd: super::BfdSpec::default(),
            graceful_restart_s: 120,
        };
        if let Err(e) = check(&alone) {
            let why = e.to_string();
            let why = why.strip_prefix("bgp.peers[0].").unwrap_or(&why);
            refuse(&mut out, what, why.to_string());
            continue;
        }
        if !names.insert(peer_protocol(&spec.name)) {
            refuse(
                &mut out,
                what,
                "its name is another peer's (the config's, or another BGPPeer's with '-' and '_' the same)".into(),
            );
            continue;
        }
        if !addresses.insert(address) {
            refuse(
                &mut out,
                what,
                format!(
                    "{address} is another peer's address too (the config's, or another BGPPeer's that selects this node)"
                ),
            );
            continue;
        }
        out.peers.push(spec);
    }
    out
}

/// `spec` (the config's) with `node`'s overrides: its AS number, router
/// ID and source addresses instead of the config's, and its `BGPPeer`s
/// beside the config's peers. `router_id` of `spec` stands when no
/// annotation gives one.
#[must_use]
pub fn apply(spec: &BgpSpec, node: &NodePeers) -> BgpSpec {
    let mut out = spec.clone();
    if let Some(asn) = node.asn {
        out.asn = asn;
    }
    if let Some(id) = node.router_id {
        out.router_id = id;
    }
    out.peers.extend(node.peers.iter().cloned());
    for p in &mut out.peers {
        if p.source.is_none() {
            p.source = node
                .sources
                .iter()
                .find(|s| s.is_ipv4() == p.address.is_ipv4())
                .copied();
        }
    }
    out
}

fn refuse(out: &mut NodePeers, what: String, why: String) {
    out.refused.insert(what, why);
}

/// The source addresses of [`SOURCE_ANNOTATION`]'s text: one or two,
/// comma-separated, at most one per family.
fn sources(text: &str) -> Result<Vec<IpAddr>, String> {
    let mut out: Vec<IpAddr> = Vec::new();
    for word in text.split(',').map(str::trim) {
        let ip: IpAddr = word
            .parse()
            .map_err(|_| format!("{word:?} is not an IP address"))?;
        if ip.is_unspecified() || ip.is_multicast() {
            return Err(format!("{ip} is not a source address"));
        }
        if out.iter().any(|o| o.is_ipv4() == ip.is_ipv4()) {
            return Err(format!(
                "{text:?} names two addresses of one family: one per family"
            ));
        }
        out.push(ip);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(name: &str, address: &str) -> KubePeer {
        KubePeer {
            name: name.into(),
            address: address.into(),
            asn: 64513,
            ..KubePeer::default()
        }
    }

    #[test]
    fn of_two_objects_for_one_router_the_older_stays() {
        let mut old = peer("zz-old", "192.0.2.1");
        old.created = "2026-01-01T00:00:00Z".into();
        let mut new = peer("aa-new", "192.0.2.1");
        new.created = "2026-06-01T00:00:00Z".into();
        let got = for_node(&[new, old], &NodeFacts::default(), &[]);
        assert_eq!(
            got.peers
                .iter()
                .map(|p| p.name.as_str())
                .collect::<Vec<_>>(),
            ["zz-old"]
        );
        assert!(
            got.refused["BGPPeer aa-new"].contains("another peer's address"),
            "{got:?}"
        );
    }

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_string(), (*v).to_string()))
            .collect()
    }

    fn rack(r: &str) -> Option<LabelSelector> {
        Some(LabelSelector {
            match_labels: labels(&[("rack", r)]),
            ..LabelSelector::default()
        })
    }

    fn config_peer() -> PeerSpec {
        PeerSpec {
            name: "spine".into(),
            address: "192.0.2.254".parse().unwrap(),
            asn: 64513,
            source: None,
            bfd: true,
            hold_time_s: 9,
        }
    }

    #[test]
    fn a_node_peers_with_the_objects_that_select_it_with_their_settings() {
        let mut r1 = peer("tor-r1", "192.0.2.1");
        r1.node_selector = rack("r1");
        r1.bfd = Some(false);
        r1.hold_time_s = Some(9);
        let mut r2 = peer("tor-r2", "192.0.2.2");
        r2.node_selector = rack("r2");
        let everyone = peer("route-server", "2001:db8::1");
        let node = NodeFacts {
            labels: labels(&[("rack", "r1")]),
            ..NodeFacts::default()
        };
        let got = for_node(&[r2, everyone, r1], &node, &[config_peer()]);
        assert!(got.refused.is_empty(), "{got:?}");
        let mut names: Vec<&str> = got.peers.iter().map(|p| p.name.as_str()).collect();
        names.sort_unstable();
        assert_eq!(names, ["route-server", "tor-r1"]);
        assert_eq!(
            (
                got.peers[1].bfd,
                got.peers[1].hold_time_s,
                got.peers[0].bfd,
                got.peers[0].hold_time_s
            ),
            (false, 9, true, DEFAULT_HOLD_TIME_S)
        );
    }

    #[test]
    fn annotations_override_the_node_s_asn_router_id_and_sources() {
        let node = NodeFacts {
            annotations: labels(&[
                (ASN_ANNOTATION, "64600"),
                (ROUTER_ID_ANNOTATION, "10.0.0.7"),
                (SOURCE_ANNOTATION, "192.0.2.11, 2001:db8::11"),
            ]),
            ..NodeFacts::default()
        };
        let got = for_node(&[peer("v6", "2001:db8::1")], &node, &[config_peer()]);
        assert!(got.refused.is_empty(), "{got:?}");
        let base = BgpSpec {
            asn: 64512,
            router_id: Ipv4Addr::new(192, 0, 2, 11),
            peers: vec![config_peer()],
            bfd: super::super::BfdSpec::default(),
            graceful_restart_s: 120,
        };
        let spec = apply(&base, &got);
        assert_eq!(
            (spec.asn, spec.router_id),
            (64600, Ipv4Addr::new(10, 0, 0, 7))
        );
        let sources: Vec<Option<IpAddr>> = spec.peers.iter().map(|p| p.source).collect();
        assert_eq!(
            sources,
            [
                Some("192.0.2.11".parse().unwrap()),
                Some("2001:db8::11".parse().unwrap())
            ]
        );
        // A source the config names stands.
        let mut named = base.clone();
        named.peers[0].source = Some("192.0.2.99".parse().unwrap());
        assert_eq!(
            apply(&named, &got).peers[0].source,
            Some("192.0.2.99".parse().unwrap())
        );
        // Without annotations the config's values stand.
        let plain = apply(&base, &for_node(&[], &NodeFacts::default(), &[]));
        assert_eq!(plain, base);
    }

    #[test]
    fn each_bad_object_or_annotation_is_named_and_the_rest_used() {
        let node = NodeFacts {
            annotations: labels(&[
                (ASN_ANNOTATION, "sixty"),
                (ROUTER_ID_ANNOTATION, "0.0.0.0"),
                (SOURCE_ANNOTATION, "192.0.2.1,192.0.2.2"),
            ]),
            ..NodeFacts::default()
        };
        let mut zero = peer("zero-as", "192.0.2.5");
        zero.asn = 0;
        let mut hold = peer("short-hold", "192.0.2.6");
        hold.hold_time_s = Some(2);
        let peers = [
            peer("good", "192.0.2.1"),
            peer("bad-address", "192.0.2.300"),
            peer("spine", "192.0.2.7"),
            peer("same-address", "192.0.2.254"),
            peer("dotted.name", "192.0.2.8"),
            zero,
            hold,
        ];
        let got = for_node(&peers, &node, &[config_peer()]);
        assert_eq!(
            got.peers
                .iter()
                .map(|p| p.name.as_str())
                .collect::<Vec<_>>(),
            ["good"]
        );
        assert_eq!((got.asn, got.router_id), (None, None));
        assert!(got.sources.is_empty());
        let want = [
            (format!("annotation {ASN_ANNOTATION}"), "\"sixty\""),
            (format!("annotation {ROUTER_ID_ANNOTATION}"), "0.0.0.0"),
            (format!("annotation {SOURCE_ANNOTATION}"), "one per family"),
            ("BGPPeer bad-address".into(), "192.0.2.300"),
            ("BGPPeer spine".into(), "another peer's"),
            (
                "BGPPeer same-address".into(),
                "192.0.2.254 is another peer's address",
            ),
            ("BGPPeer dotted.name".into(), "letters, digits"),
            ("BGPPeer zero-as".into(), "asn"),
            ("BGPPeer short-hold".into(), "hold_time_s"),
        ];
        for (what, says) in want {
            let why = got
                .refused
                .get(&what)
                .unwrap_or_else(|| panic!("{what} not refused: {got:?}"));
            assert!(why.contains(says), "{what}: {why}");
        }
        assert_eq!(got.refused.len(), 9, "{:?}", got.refused);
    }
}
