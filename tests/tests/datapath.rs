//! Datapath integration tests: real kernel, real bpffs, real veths in network
//! namespaces that each test creates and removes.

use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::time::Duration;

use anyhow::{Context, ensure};
use lockstep_common::{
    EndpointSlot, EndpointValue, NatKeyV4, NatKeyV6, NatValueV4, NatValueV6, endpoint_flags,
    map_names, slots,
};
use lockstep_tests::recv_from_retrying;
use lockstep_tests::{Netns, PinRoot, counter, lockstep_in, lockstep_output, privileged, sh, veth};

/// A node namespace with two endpoint namespaces behind veths, routed the way
/// production CNIs do it: each endpoint has a /32 (/128), a default route to a
/// link-local gateway, and the node has a host route per endpoint.
struct Topology {
    node: Netns,
    ep1: Netns,
    ep2: Netns,
    pins: PinRoot,
}

const EP1_V4: &str = "10.200.0.1";
const EP2_V4: &str = "10.200.0.2";
const SPOOF_V4: &str = "10.200.0.99";
const EP1_V6: &str = "fd00:200::1";
const EP2_V6: &str = "fd00:200::2";
const SPOOF_V6: &str = "fd00:200::99";

/// Routes an endpoint's IPv4 address the way production CNIs do: a /32 on
/// the endpoint, a default route to a link-local gateway whose neighbour entry
/// is static (the tests are about the programs, not ARP), and a host route on
/// the node. `rp_filter` is off on the host side.
fn route_endpoint_v4(
    node: &Netns,
    host_if: &str,
    ep: &Netns,
    ep_if: &str,
    v4: &str,
) -> anyhow::Result<()> {
    node.sysctl(&format!("net.ipv4.conf.{host_if}.rp_filter"), "0")?;
    ep.ip(["addr", "add", &format!("{v4}/32"), "dev", ep_if])?;
    let host_mac = node.mac(host_if)?;
    ep.ip([
        "neigh",
        "add",
        "169.254.1.1",
        "lladdr",
        &host_mac,
        "dev",
        ep_if,
        "nud",
        "permanent",
    ])?;
    ep.ip([
        "route",
        "add",
        "169.254.1.1/32",
        "dev",
        ep_if,
        "scope",
        "link",
    ])?;
    ep.ip([
        "route",
        "add",
        "default",
        "via",
        "169.254.1.1",
        "dev",
        ep_if,
    ])?;
    node.ip(["route", "add", &format!("{v4}/32"), "dev", host_if])?;
    Ok(())
}

impl Topology {
    fn new() -> anyhow::Result<Self> {
        Self::with_indexes(None)
    }

    /// As [`Topology::new`], the host-side veths getting the given interface
    /// indexes when asked.
    fn with_indexes(indexes: Option<(u32, u32)>) -> anyhow::Result<Self> {
        let node = Netns::new("node")?;
        let ep1 = Netns::new("ep")?;
        let ep2 = Netns::new("ep")?;
        for (key, value) in [
            ("net.ipv4.ip_forward", "1"),
            ("net.ipv6.conf.all.forwarding", "1"),
            ("net.ipv4.conf.all.rp_filter", "0"),
            ("net.ipv4.conf.default.rp_filter", "0"),
        ] {
            node.sysctl(key, value)?;
        }
        for (ep, host_if, ep_if, v4, v6, index) in [
            (&ep1, "h1", "e1", EP1_V4, EP1_V6, indexes.map(|i| i.0)),
            (&ep2, "h2", "e2", EP2_V4, EP2_V6, indexes.map(|i| i.1)),
        ] {
            match index {
                None => veth(&node, host_if, ep, ep_if)?,
                Some(index) => {
                    node.ip([
                        "link",
                        "add",
                        host_if,
                        "index",
                        &index.to_string(),
                        "type",
                        "veth",
                        "peer",
                        "name",
                        ep_if,
                        "netns",
                        ep.name(),
                    ])?;
                    node.ip(["link", "set", host_if, "up"])?;
                    ep.ip(["link", "set", ep_if, "up"])?;
                }
            }
            route_endpoint_v4(&node, host_if, ep, ep_if, v4)?;
            ep.ip([
                "-6",
                "addr",
                "add",
                &format!("{v6}/128"),
                "dev",
                ep_if,
                "nodad",
            ])?;
            let host_mac = node.mac(host_if)?;
            let ep_mac = ep.mac(ep_if)?;
            // Static neighbours: the test is about the programs, not ARP/NDP.
            ep.ip([
                "-6",
                "neigh",
                "add",
                "fe80::1",
                "lladdr",
                &host_mac,
                "dev",
                ep_if,
                "nud",
                "permanent",
            ])?;
            ep.ip([
                "-6", "route", "add", "default", "via", "fe80::1", "dev", ep_if,
            ])?;
            node.ip(["-6", "route", "add", &format!("{v6}/128"), "dev", host_if])?;
            node.ip([
                "neigh",
                "add",
                v4,
                "lladdr",
                &ep_mac,
                "dev",
                host_if,
                "nud",
                "permanent",
            ])?;
            node.ip([
                "-6",
                "neigh",
                "add",
                v6,
                "lladdr",
                &ep_mac,
                "dev",
                host_if,
                "nud",
                "permanent",
            ])?;
        }
        Ok(Self {
            node,
            ep1,
            ep2,
            pins: PinRoot::new(),
        })
    }

    fn lockstep(&self, args: &[&str]) -> anyhow::Result<String> {
        let mut all: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        all.extend(self.pins.arg());
        lockstep_in(&self.node, all)
    }

    fn program_endpoints(&self) -> anyhow::Result<()> {
        self.lockstep(&["datapath", "install"])?;
        self.lockstep(&[
            "datapath", "endpoint", "--iface", "h1", "--ipv4", EP1_V4, "--ipv6", EP1_V6,
        ])?;
        self.lockstep(&[
            "datapath", "endpoint", "--iface", "h2", "--ipv4", EP2_V4, "--ipv6", EP2_V6,
        ])?;
        Ok(())
    }
}

/// Sends one UDP datagram per (source, payload) from `ep1` and returns what a
/// socket bound in `ep2` received.
fn send_and_receive(
    topo: &Topology,
    dst: &str,
    sends: &[(&str, &str)],
) -> anyhow::Result<BTreeSet<String>> {
    send_between(&topo.ep1, &topo.ep2, dst, sends)
}

/// Sends one UDP datagram per (source, payload) from `from` and returns what
/// a socket bound to `dst` in `to` received.
fn send_between(
    from: &Netns,
    to: &Netns,
    dst: &str,
    sends: &[(&str, &str)],
) -> anyhow::Result<BTreeSet<String>> {
    let dst_ip: IpAddr = dst.parse()?;
    let receiver = to.run(|| {
        let sock = UdpSocket::bind(SocketAddr::new(dst_ip, 0))?;
        sock.set_read_timeout(Some(Duration::from_millis(700)))?;
        Ok(sock)
    })?;
    let port = receiver.local_addr()?.port();
    for (src, payload) in sends {
        let src_ip: IpAddr = src.parse()?;
        from.run(|| {
            let sock = UdpSocket::bind(SocketAddr::new(src_ip, 0))
                .with_context(|| format!("binding {src_ip}"))?;
            sock.send_to(payload.as_bytes(), SocketAddr::new(dst_ip, port))?;
            Ok(())
        })?;
    }
    let mut got = BTreeSet::new();
    let mut buf = [0u8; 256];
    while let Ok((n, _)) = recv_from_retrying(&receiver, &mut buf) {
        got.insert(String::from_utf8_lossy(&buf[..n]).into_owned());
    }
    Ok(got)
}

fn set(items: &[&str]) -> BTreeSet<String> {
    items.iter().map(|s| s.to_string()).collect()
}

#[test]
fn spoofed_sources_are_dropped_and_genuine_traffic_arrives() -> anyhow::Result<()> {
    privileged!();
    let topo = Topology::new()?;
    // The spoofing endpoint holds the foreign addresses too, so its kernel
    // sends from them.
    topo.ep1
        .ip(["addr", "add", &format!("{SPOOF_V4}/32"), "dev", "e1"])?;
    topo.ep1.ip([
        "-6",
        "addr",
        "add",
        &format!("{SPOOF_V6}/128"),
        "dev",
        "e1",
        "nodad",
    ])?;

    // Control: without lockstep the node forwards spoofed packets.
    let before = send_and_receive(&topo, EP2_V4, &[(SPOOF_V4, "spoof-v4-control")])?;
    ensure!(
        before == set(&["spoof-v4-control"]),
        "control run: {before:?}"
    );

    topo.program_endpoints()?;
    let got_v4 = send_and_receive(
        &topo,
        EP2_V4,
        &[(SPOOF_V4, "spoof-v4"), (EP1_V4, "genuine-v4")],
    )?;
    let got_v6 = send_and_receive(
        &topo,
        EP2_V6,
        &[(SPOOF_V6, "spoof-v6"), (EP1_V6, "genuine-v6")],
    )?;
    assert_eq!(got_v4, set(&["genuine-v4"]));
    assert_eq!(got_v6, set(&["genuine-v6"]));
    assert!(counter(&topo.pins, "spoof_dropped_v4")? >= 1);
    assert!(counter(&topo.pins, "spoof_dropped_v6")? >= 1);
    assert!(counter(&topo.pins, "from_endpoint_passed")? >= 2);
    // The destination was classified through IPCACHE as a local endpoint.
    assert!(counter(&topo.pins, "dst_endpoint")? >= 2);
    Ok(())
}

/// The ENDPOINT_SLOTS slots that hold something, as (slot, ifindex, IPv4),
/// from `lockstep maps dump`.
fn endpoint_slots(topo: &Topology) -> anyhow::Result<Vec<(u64, u64, String)>> {
    let dump: serde_json::Value =
        serde_json::from_str(&topo.lockstep(&["maps", "dump", "-o", "json"])?)?;
    Ok(dump["ENDPOINT_SLOTS"]
        .as_array()
        .context("ENDPOINT_SLOTS in the dump")?
        .iter()
        .map(|s| {
            (
                s["slot"].as_u64().unwrap_or(u64::MAX),
                s["ifindex"].as_u64().unwrap_or(0),
                s["ipv4"].as_str().unwrap_or_default().to_string(),
            )
        })
        .collect())
}

/// Writes raw bytes over one ENDPOINT_SLOTS slot with bpftool, as a torn
/// read or a corruption would present it to the program.
fn plant_slot(topo: &Topology, slot: u32, slot_value: &EndpointSlot) -> anyhow::Result<()> {
    // SAFETY: EndpointSlot is repr(C) plain data without padding.
    let bytes = unsafe {
        std::slice::from_raw_parts(
            (slot_value as *const EndpointSlot).cast::<u8>(),
            size_of::<EndpointSlot>(),
        )
    };
    let hex = |b: &[u8]| b.iter().map(|x| format!("{x}")).collect::<Vec<_>>();
    let pin = topo
        .pins
        .path()
        .join("maps")
        .join(map_names::ENDPOINT_SLOTS);
    let mut args = vec![
        "map".to_string(),
        "update".into(),
        "pinned".into(),
        pin.display().to_string(),
        "key".into(),
    ];
    args.extend(hex(&slot.to_ne_bytes()));
    args.push("value".into());
    args.extend(hex(bytes));
    sh("bpftool", &args)?;
    Ok(())
}

/// Two endpoints whose interface indexes share a slot: the smaller one holds
/// the slot, the other is served by the ENDPOINTS hash, and anti-spoofing
/// holds for both; a slot whose fields do not match their complements (a torn
/// read) is ignored; removing the holder hands the slot to the other one.
#[test]
fn endpoints_sharing_a_slot_and_torn_slots_keep_anti_spoofing() -> anyhow::Result<()> {
    privileged!();
    let slots_n = lockstep_common::max_entries::ENDPOINT_SLOTS;
    let low = 1000 + std::process::id() % 1000;
    let high = low + slots_n;
    assert_eq!(slots::endpoint(low), slots::endpoint(high));
    let topo = Topology::with_indexes(Some((low, high)))?;
    for (ep, iface) in [(&topo.ep1, "e1"), (&topo.ep2, "e2")] {
        ep.ip(["addr", "add", &format!("{SPOOF_V4}/32"), "dev", iface])?;
    }
    topo.program_endpoints()?;
    let slot = slots::endpoint(low);
    assert_eq!(
        endpoint_slots(&topo)?,
        vec![(u64::from(slot), u64::from(low), EP1_V4.to_string())],
        "the smaller ifindex holds the shared slot"
    );

    let both_ways = |tag: &str| -> anyhow::Result<(BTreeSet<String>, BTreeSet<String>)> {
        let g1 = format!("{tag}-genuine-1");
        let s1 = format!("{tag}-spoof-1");
        let g2 = format!("{tag}-genuine-2");
        let s2 = format!("{tag}-spoof-2");
        let to2 = send_between(
            &topo.ep1,
            &topo.ep2,
            EP2_V4,
            &[(SPOOF_V4, &s1), (EP1_V4, &g1)],
        )?;
        let to1 = send_between(
            &topo.ep2,
            &topo.ep1,
            EP1_V4,
            &[(SPOOF_V4, &s2), (EP2_V4, &g2)],
        )?;
        Ok((to2, to1))
    };
    // ep1 through its slot, ep2 through the hash.
    let (to2, to1) = both_ways("shared")?;
    assert_eq!(to2, set(&["shared-genuine-1"]));
    assert_eq!(to1, set(&["shared-genuine-2"]));

    // A torn slot claiming ep1 with the spoofed address (its complement
    // still that of the genuine one) is ignored: the hash decides.
    let genuine = EndpointSlot::new(
        low,
        &EndpointValue {
            ipv4: EP1_V4.parse::<std::net::Ipv4Addr>()?.octets(),
            flags: endpoint_flags::HAS_V4,
            ..Default::default()
        },
    );
    let torn = EndpointSlot {
        ipv4: SPOOF_V4.parse::<std::net::Ipv4Addr>()?.octets(),
        ..genuine
    };
    plant_slot(&topo, slot, &torn)?;
    let (to2, _) = both_ways("torn")?;
    assert_eq!(to2, set(&["torn-genuine-1"]), "a torn slot was believed");

    // Removing the holder hands the slot to ep2, which keeps working.
    topo.lockstep(&["datapath", "endpoint-del", "--iface", "h1"])?;
    assert_eq!(
        endpoint_slots(&topo)?,
        vec![(u64::from(slot), u64::from(high), EP2_V4.to_string())],
        "the slot passes to the remaining endpoint"
    );
    let before = counter(&topo.pins, "unknown_endpoint")?;
    let (to2, to1) = both_ways("handover")?;
    assert_eq!(to1, set(&["handover-genuine-2"]));
    assert!(to2.is_empty(), "ep1 has no entry any more: {to2:?}");
    assert!(counter(&topo.pins, "unknown_endpoint")? >= before + 2);
    Ok(())
}

/// to_native on the node's uplink decides per packet: an endpoint's packet to
/// an address outside MASQ_SKIP would be masqueraded, one to an address inside
/// it would not, and the node's own packets are not endpoint traffic. Each
/// decision is counted and every packet still leaves (nothing is translated
/// yet).
#[test]
fn to_native_counts_the_masquerade_decision_per_packet() -> anyhow::Result<()> {
    privileged!();
    let node = Netns::new("node")?;
    let ep = Netns::new("ep")?;
    let world = Netns::new("world")?;
    let pins = PinRoot::new();
    node.sysctl("net.ipv4.ip_forward", "1")?;
    node.sysctl("net.ipv4.conf.all.rp_filter", "0")?;
    world.sysctl("net.ipv4.conf.all.rp_filter", "0")?;
    veth(&node, "h1", &ep, "e1")?;
    veth(&node, "u0", &world, "w0")?;
    route_endpoint_v4(&node, "h1", &ep, "e1", EP1_V4)?;
    node.ip(["addr", "add", "192.0.2.1/24", "dev", "u0"])?;
    world.ip(["addr", "add", "192.0.2.2/24", "dev", "w0"])?;
    world.ip(["addr", "add", "198.51.100.2/32", "dev", "w0"])?;
    node.ip(["route", "add", "198.51.100.2/32", "via", "192.0.2.2"])?;
    world.ip(["route", "add", "10.200.0.0/16", "via", "192.0.2.1"])?;
    let cli = |args: &[&str]| -> anyhow::Result<String> {
        let mut all: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        all.extend(pins.arg());
        lockstep_in(&node, all)
    };
    cli(&["datapath", "install", "--uplink", "u0"])?;
    cli(&["datapath", "endpoint", "--iface", "h1", "--ipv4", EP1_V4])?;
    cli(&["datapath", "masq-skip-add", "--cidr", "198.51.100.0/24"])?;

    let decisions = || -> anyhow::Result<[u64; 3]> {
        Ok([
            counter(&pins, "masq_would_translate")?,
            counter(&pins, "masq_skipped")?,
            counter(&pins, "masq_not_endpoint")?,
        ])
    };
    let phases: [(&Netns, &str, &str, usize); 3] = [
        (&ep, EP1_V4, "192.0.2.2", 0),
        (&ep, EP1_V4, "198.51.100.2", 1),
        (&node, "192.0.2.1", "192.0.2.2", 2),
    ];
    for (i, (from, src, dst, moves)) in phases.into_iter().enumerate() {
        let before = decisions()?;
        let payloads: Vec<String> = (0..3).map(|n| format!("phase{i}-{n}")).collect();
        let sends: Vec<(&str, &str)> = payloads.iter().map(|p| (src, p.as_str())).collect();
        let got = send_between(from, &world, dst, &sends)?;
        let want: BTreeSet<String> = payloads.iter().cloned().collect();
        assert_eq!(got, want, "phase {i}: every packet leaves the node");
        let after = decisions()?;
        assert!(
            after[moves] >= before[moves] + 3,
            "phase {i}: counter {moves} did not move: {before:?} -> {after:?}"
        );
        for other in (0..2).filter(|o| *o != moves) {
            assert_eq!(
                after[other], before[other],
                "phase {i}: endpoint counter {other} moved: {before:?} -> {after:?}"
            );
        }
    }
    Ok(())
}

/// Parses the replying MACs out of iputils arping output.
fn arping_macs(out: &str) -> BTreeSet<String> {
    out.lines()
        .filter(|l| l.contains("reply from"))
        .filter_map(|l| {
            let start = l.find('[')? + 1;
            let end = l.find(']')?;
            Some(l[start..end].to_ascii_lowercase())
        })
        .collect()
}

#[test]
fn arp_for_announced_addresses_is_answered_by_the_program() -> anyhow::Result<()> {
    privileged!();
    let node = Netns::new("node")?;
    let nb = Netns::new("nb")?;
    let pins = PinRoot::new();
    veth(&node, "u0", &nb, "n0")?;
    nb.ip(["addr", "add", "10.201.0.2/24", "dev", "n0"])?;
    let node_mac = node.mac("u0")?;
    let pin = |args: &[&str]| -> anyhow::Result<String> {
        let mut all: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        all.extend(pins.arg());
        lockstep_in(&node, all)
    };
    pin(&["datapath", "install", "--uplink", "u0"])?;
    let arping = || {
        nb.command("arping")
            .args(["-c", "2", "-w", "2", "-I", "n0", "10.201.0.50"])
            .output()
    };
    // No kernel address holds 10.201.0.50 and nothing is announced yet.
    let silent = arping()?;
    assert!(
        !silent.status.success(),
        "unexpected ARP answer before announcing"
    );

    pin(&["datapath", "l2-add", "--ip", "10.201.0.50", "--iface", "u0"])?;
    let answered = arping()?;
    let text = String::from_utf8_lossy(&answered.stdout);
    assert!(answered.status.success(), "no ARP answer: {text}");
    assert_eq!(arping_macs(&text), set(&[node_mac.as_str()]), "{text}");
    assert!(counter(&pins, "arp_replied")? >= 1);
    let addrs = node.ip(["-j", "addr", "show", "dev", "u0"])?;
    assert!(
        !addrs.contains("10.201.0.50"),
        "the kernel must not hold the address"
    );

    pin(&["datapath", "l2-del", "--ip", "10.201.0.50"])?;
    let after = arping()?;
    let text = String::from_utf8_lossy(&after.stdout);
    assert!(!after.status.success(), "answered after removal: {text}");
    assert!(arping_macs(&text).is_empty());
    Ok(())
}

#[test]
fn bpftool_dumps_every_pinned_map_as_structured_json() -> anyhow::Result<()> {
    privileged!();
    let topo = Topology::new()?;
    topo.program_endpoints()?;
    topo.lockstep(&["datapath", "l2-add", "--ip", "10.200.0.50", "--iface", "h1"])?;
    topo.lockstep(&["datapath", "masq-skip-add", "--cidr", "10.0.0.0/8"])?;
    topo.lockstep(&[
        "datapath",
        "ipcache-add",
        "--prefix",
        "10.96.0.0/12",
        "--remote",
    ])?;
    topo.lockstep(&[
        "datapath",
        "ipcache-add",
        "--prefix",
        "fd00:96::/64",
        "--remote",
    ])?;
    topo.lockstep(&["datapath", "masq-skip-add", "--cidr", "fd00::/8"])?;
    // Traffic so COUNTERS holds something other than zeros.
    send_and_receive(&topo, EP2_V4, &[(EP1_V4, "x")])?;
    // One flow in each masquerade map (no uplink here to make them).
    let mut pinned = lockstep::datapath::PinnedMaps::open(topo.pins.path())?;
    let k4 = NatKeyV4 {
        src_addr: [10, 200, 0, 1],
        dst_addr: [192, 0, 2, 9],
        src_port: 40_000,
        dst_port: 443,
        proto: 6,
        _pad: [0; 3],
    };
    let v4 = NatValueV4 {
        addr: [192, 0, 2, 1],
        port: 61_000,
        ..Default::default()
    };
    pinned.nat_fwd_v4_mut().insert(k4, v4, 0)?;
    pinned.nat_rev_v4_mut().insert(k4, v4, 0)?;
    let k6 = NatKeyV6 {
        src_port: 40_000,
        dst_port: 443,
        proto: 6,
        ..Default::default()
    };
    let v6 = NatValueV6 {
        port: 61_000,
        ..Default::default()
    };
    pinned.nat_fwd_v6_mut().insert(k6, v6, 0)?;
    pinned.nat_rev_v6_mut().insert(k6, v6, 0)?;
    // One endpoint count each, one fragment record each (#31).
    let ep = lockstep_common::endpoint_key_v4([10, 200, 0, 1]);
    pinned.nat_ep_opened_mut().insert(ep, 3, 0)?;
    pinned.nat_ep_closed_mut().insert(ep, 1, 0)?;
    let lru = |name: &str| -> anyhow::Result<aya::maps::Map> {
        let data = aya::maps::MapData::from_pin(topo.pins.path().join("maps").join(name))?;
        Ok(aya::maps::Map::from_map_data(data)?)
    };
    let mut frag4: aya::maps::HashMap<
        _,
        lockstep_common::NatFragKeyV4,
        lockstep_common::NatFragValue,
    > = aya::maps::HashMap::try_from(lru("NAT_FRAG_V4")?)?;
    frag4.insert(
        lockstep_common::NatFragKeyV4 {
            src_addr: [192, 0, 2, 9],
            dst_addr: [192, 0, 2, 1],
            id: 7,
            proto: 17,
            _pad: 0,
        },
        lockstep_common::NatFragValue::default(),
        0,
    )?;
    let mut frag6: aya::maps::HashMap<
        _,
        lockstep_common::NatFragKeyV6,
        lockstep_common::NatFragValue,
    > = aya::maps::HashMap::try_from(lru("NAT_FRAG_V6")?)?;
    frag6.insert(
        lockstep_common::NatFragKeyV6 {
            id: 7,
            proto: 17,
            ..Default::default()
        },
        lockstep_common::NatFragValue::default(),
        0,
    )?;
    // One IPv6 announcement (no agent here to make one).
    let a6: [u8; 16] = "fd00:96::50".parse::<std::net::Ipv6Addr>()?.octets();
    let l2 = lockstep_common::L2RespValue {
        ifindex: 1,
        mac: [2, 0, 0, 0, 0, 0x50],
        ..Default::default()
    };
    pinned.l2_insert_v6(a6, &l2)?;
    let maps = topo.pins.path().join("maps");
    for name in map_names::ALL {
        let pin = maps.join(name);
        let show: serde_json::Value = serde_json::from_str(&sh(
            "bpftool",
            [
                "-j",
                "map",
                "show",
                "pinned",
                pin.to_str().context("utf-8")?,
            ],
        )?)?;
        assert!(
            show["btf_id"].as_u64().unwrap_or(0) > 0,
            "{name} has no BTF: {show}"
        );
        let dump: serde_json::Value = serde_json::from_str(&sh(
            "bpftool",
            [
                "-j",
                "map",
                "dump",
                "pinned",
                pin.to_str().context("utf-8")?,
            ],
        )?)?;
        let entries = dump
            .as_array()
            .with_context(|| format!("{name}: not an array"))?;
        assert!(!entries.is_empty(), "{name} is empty");
        for e in entries {
            // bpftool prints raw bytes always and, when the map has BTF, a
            // "formatted" object with typed fields.
            let formatted = e
                .get("formatted")
                .with_context(|| format!("{name} has no BTF-formatted entries: {e}"))?;
            assert!(formatted.get("key").is_some(), "{name}: {e}");
            let value = formatted
                .get("value")
                .or_else(|| formatted.get("values"))
                .with_context(|| format!("{name}: {e}"))?;
            assert!(
                !value.to_string().contains("\"0x"),
                "{name} value not typed: {e}"
            );
        }
        if name == "IPCACHE_V4" {
            assert!(dump.to_string().contains("\"prefix_len\":12"), "{dump}");
        }
        if name == "NAT_FWD_V4" {
            assert!(dump.to_string().contains("\"src_port\":40000"), "{dump}");
            assert!(dump.to_string().contains("\"port\":61000"), "{dump}");
        }
        if name == "IPCACHE_HOST_V4" {
            assert!(dump.to_string().contains("[10,200,0,1]"), "{dump}");
            assert!(dump.to_string().contains("\"identity\":256"), "{dump}");
        }
    }
    Ok(())
}

fn map_id(pins: &PinRoot, name: &str) -> anyhow::Result<u64> {
    let pin = pins.path().join("maps").join(name);
    let show: serde_json::Value = serde_json::from_str(&sh(
        "bpftool",
        [
            "-j",
            "map",
            "show",
            "pinned",
            pin.to_str().context("utf-8")?,
        ],
    )?)?;
    show["id"].as_u64().context("no map id")
}

fn tcx_prog_ids(node: &Netns, iface: &str) -> anyhow::Result<Vec<u32>> {
    // Debian's bpftool 7.1 predates TCX (no ifindex in `link show`); aya asks
    // the kernel directly.
    node.run(|| {
        let (_, progs) =
            aya::programs::SchedClassifier::query_tcx(iface, aya::programs::TcAttachType::Ingress)?;
        Ok(progs.iter().map(|p| p.id()).collect())
    })
}

#[test]
fn pins_survive_the_agent_and_incompatible_pins_are_refused() -> anyhow::Result<()> {
    privileged!();
    let topo = Topology::new()?;
    topo.program_endpoints()?;
    // The agent process has exited: maps and links are still there and work.
    let links = topo.pins.path().join("links");
    let pinned: Vec<_> = std::fs::read_dir(&links)?.collect();
    assert_eq!(pinned.len(), 2, "one from_endpoint link per endpoint");
    let got = send_and_receive(&topo, EP2_V4, &[(EP1_V4, "after-exit")])?;
    assert_eq!(got, set(&["after-exit"]));
    let id_before = map_id(&topo.pins, "IPCACHE_V4")?;
    let progs_before = tcx_prog_ids(&topo.node, "h1")?;
    assert_eq!(progs_before.len(), 1, "{progs_before:?}");

    // A restarted agent reuses the maps (same id, entries kept) and replaces the
    // program in place.
    let out = topo.lockstep(&[
        "datapath", "endpoint", "--iface", "h1", "--ipv4", EP1_V4, "--ipv6", EP1_V6,
    ])?;
    assert!(out.contains("TcxReplaced"), "{out}");
    assert_eq!(map_id(&topo.pins, "IPCACHE_V4")?, id_before);
    let dump = topo.lockstep(&["maps", "dump", "-o", "json"])?;
    let dump: serde_json::Value = serde_json::from_str(&dump)?;
    let prefixes: BTreeSet<String> = dump["IPCACHE_V4"]
        .as_array()
        .context("IPCACHE_V4")?
        .iter()
        .filter_map(|e| e["prefix"].as_str().map(str::to_string))
        .collect();
    assert_eq!(prefixes, set(&["10.200.0.1/32", "10.200.0.2/32"]));
    let progs_after = tcx_prog_ids(&topo.node, "h1")?;
    assert_eq!(
        progs_after.len(),
        1,
        "still one program on h1: {progs_after:?}"
    );
    assert_ne!(progs_after, progs_before, "the program was replaced");

    // A pin with a different definition is refused, naming pin and definitions.
    let mut args: Vec<String> = ["datapath", "install", "--ipcache-max-entries", "1024"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    args.extend(topo.pins.arg());
    let refused = lockstep_output(&topo.node, &args)?;
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success());
    // Maps are checked in name order; the first incompatible one is named.
    let pin = topo.pins.path().join("maps/IPCACHE_HOST_V4");
    assert!(err.contains(&pin.display().to_string()), "{err}");
    assert!(err.contains("max_entries 262144"), "{err}");
    assert!(err.contains("max_entries 1024"), "{err}");
    assert_eq!(
        map_id(&topo.pins, "IPCACHE_V4")?,
        id_before,
        "refusal changed nothing"
    );

    // The explicit migration replaces the map and carries the entries over.
    args.push("--migrate".into());
    let migrated = lockstep_output(&topo.node, &args)?;
    assert!(
        migrated.status.success(),
        "{}",
        String::from_utf8_lossy(&migrated.stderr)
    );
    assert_ne!(map_id(&topo.pins, "IPCACHE_V4")?, id_before);
    let show: serde_json::Value = serde_json::from_str(&sh(
        "bpftool",
        [
            "-j",
            "map",
            "show",
            "pinned",
            pin.to_str().context("utf-8")?,
        ],
    )?)?;
    assert_eq!(show["max_entries"].as_u64(), Some(1024));
    let dump: serde_json::Value =
        serde_json::from_str(&topo.lockstep(&["maps", "dump", "-o", "json"])?)?;
    assert_eq!(
        dump["IPCACHE_V4"].as_array().map(Vec::len),
        Some(2),
        "{dump}"
    );
    Ok(())
}

#[test]
fn program_upgrade_under_a_ping_flood_loses_no_packet() -> anyhow::Result<()> {
    privileged!();
    let topo = Topology::new()?;
    topo.program_endpoints()?;
    let count = 3000;
    let ping = topo
        .ep1
        .command("ping")
        .args([
            "-q",
            "-i",
            "0.002",
            "-W",
            "1",
            "-c",
            &count.to_string(),
            "-I",
            EP1_V4,
            EP2_V4,
        ])
        .stdout(std::process::Stdio::piped())
        .spawn()?;
    let mut upgrades = 0;
    let started = std::time::Instant::now();
    while started.elapsed() < Duration::from_secs(4) && upgrades < 20 {
        for (iface, v4, v6) in [("h1", EP1_V4, EP1_V6), ("h2", EP2_V4, EP2_V6)] {
            let out = topo.lockstep(&[
                "datapath", "endpoint", "--iface", iface, "--ipv4", v4, "--ipv6", v6,
            ])?;
            assert!(out.contains("TcxReplaced"), "{out}");
        }
        upgrades += 1;
    }
    let out = ping.wait_with_output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    eprintln!("{upgrades} upgrades of both endpoints' programs during: {text}");
    assert!(upgrades >= 3, "too few upgrades happened during the flood");
    assert!(
        text.contains(&format!("{count} packets transmitted, {count} received")),
        "packets lost across program upgrades: {text}"
    );
    Ok(())
}

#[test]
fn netlink_fallback_attaches_and_replaces_in_place() -> anyhow::Result<()> {
    privileged!();
    let topo = Topology::new()?;
    topo.lockstep(&["datapath", "install", "--attach-mode", "netlink"])?;
    for round in 0..2 {
        for (iface, v4, v6) in [("h1", EP1_V4, EP1_V6), ("h2", EP2_V4, EP2_V6)] {
            let out = topo.lockstep(&[
                "datapath",
                "endpoint",
                "--attach-mode",
                "netlink",
                "--iface",
                iface,
                "--ipv4",
                v4,
                "--ipv6",
                v6,
            ])?;
            let want = if round == 0 {
                "NetlinkNew"
            } else {
                "NetlinkReplaced"
            };
            assert!(out.contains(want), "round {round}: {out}");
        }
    }
    let filters = topo
        .node
        .exec("tc", ["filter", "show", "dev", "h1", "ingress"])?;
    let ours = filters
        .lines()
        .filter(|l| l.contains("from_endpoint"))
        .count();
    assert_eq!(ours, 1, "exactly one filter after a replace: {filters}");
    let got = send_and_receive(&topo, EP2_V4, &[(EP1_V4, "via-netlink")])?;
    assert_eq!(got, set(&["via-netlink"]));
    assert!(counter(&topo.pins, "from_endpoint_passed")? >= 1);
    let mut args: Vec<String> = vec![
        "datapath".into(),
        "uninstall".into(),
        "--iface".into(),
        "h1".into(),
        "--iface".into(),
        "h2".into(),
    ];
    args.extend(topo.pins.arg());
    lockstep_in(&topo.node, args)?;
    let filters = topo
        .node
        .exec("tc", ["filter", "show", "dev", "h1", "ingress"])?;
    assert!(!filters.contains("from_endpoint"), "{filters}");
    Ok(())
}
