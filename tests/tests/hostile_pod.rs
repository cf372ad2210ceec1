//! A hostile pod against `from_endpoint` (issue #31 item 1): raw frames sent
//! from inside the pod's namespace with an `AF_PACKET` socket, received (or
//! not) by a UDP socket in a "world" namespace behind the node. Every VLAN
//! stacking a pod can send, and every ethertype, must be dropped and counted;
//! only untagged IPv4, IPv6 and ARP from the pod's own addresses pass.

use std::collections::BTreeSet;
use std::net::{Ipv4Addr, SocketAddr, UdpSocket};
use std::os::fd::{FromRawFd, OwnedFd};
use std::time::Duration;

use anyhow::{Context, bail, ensure};
use lockstep_tests::ndp::send_frame;
use lockstep_tests::recv_from_retrying;
use lockstep_tests::{Netns, PinRoot, counters, lockstep_in, privileged, veth};

const POD_V4: Ipv4Addr = Ipv4Addr::new(10, 201, 0, 1);
/// Another pod on the node (not created: only its address matters).
const OTHER_POD_V4: Ipv4Addr = Ipv4Addr::new(10, 201, 0, 2);
const NODE_UPLINK_V4: Ipv4Addr = Ipv4Addr::new(10, 202, 0, 1);
const WORLD_V4: Ipv4Addr = Ipv4Addr::new(10, 202, 0, 2);
/// Another node's address on the uplink's subnet.
const OTHER_NODE_V4: Ipv4Addr = Ipv4Addr::new(10, 202, 0, 9);
/// A LoadBalancer-like address.
const LB_V4: Ipv4Addr = Ipv4Addr::new(10, 203, 0, 10);

/// The sources a hostile pod wants to send from.
const SPOOFED: [Ipv4Addr; 3] = [OTHER_NODE_V4, OTHER_POD_V4, LB_V4];

/// node ── h1/e1 ── pod (10.201.0.1/32, default via a link-local gateway)
/// node ── u0/w0 ── world (10.202.0.2/24, route to the pods via the node)
struct Topology {
    node: Netns,
    pod: Netns,
    world: Netns,
    pins: PinRoot,
    pod_mac: [u8; 6],
    host_mac: [u8; 6],
}

fn parse_mac(s: &str) -> anyhow::Result<[u8; 6]> {
    let mut mac = [0u8; 6];
    let parts: Vec<&str> = s.split(':').collect();
    ensure!(parts.len() == 6, "not a MAC: {s}");
    for (b, p) in mac.iter_mut().zip(parts) {
        *b = u8::from_str_radix(p, 16)?;
    }
    Ok(mac)
}

impl Topology {
    fn new() -> anyhow::Result<Self> {
        let node = Netns::new("node")?;
        let pod = Netns::new("pod")?;
        let world = Netns::new("world")?;
        for (key, value) in [
            ("net.ipv4.ip_forward", "1"),
            ("net.ipv4.conf.all.rp_filter", "0"),
            ("net.ipv4.conf.default.rp_filter", "0"),
        ] {
            node.sysctl(key, value)?;
        }
        for key in [
            "net.ipv4.conf.all.rp_filter",
            "net.ipv4.conf.default.rp_filter",
        ] {
            world.sysctl(key, "0")?;
        }
        // The pod sends only what the test writes (no router solicitations).
        pod.sysctl("net.ipv6.conf.all.disable_ipv6", "1")?;
        veth(&node, "h1", &pod, "e1")?;
        veth(&node, "u0", &world, "w0")?;
        node.sysctl("net.ipv4.conf.h1.rp_filter", "0")?;
        node.sysctl("net.ipv4.conf.u0.rp_filter", "0")?;
        world.sysctl("net.ipv4.conf.w0.rp_filter", "0")?;
        pod.ip(["addr", "add", &format!("{POD_V4}/32"), "dev", "e1"])?;
        let host_mac = node.mac("h1")?;
        pod.ip([
            "neigh",
            "add",
            "169.254.1.1",
            "lladdr",
            &host_mac,
            "dev",
            "e1",
            "nud",
            "permanent",
        ])?;
        pod.ip([
            "route",
            "add",
            "169.254.1.1/32",
            "dev",
            "e1",
            "scope",
            "link",
        ])?;
        pod.ip(["route", "add", "default", "via", "169.254.1.1", "dev", "e1"])?;
        node.ip(["route", "add", &format!("{POD_V4}/32"), "dev", "h1"])?;
        node.ip(["addr", "add", &format!("{NODE_UPLINK_V4}/24"), "dev", "u0"])?;
        world.ip(["addr", "add", &format!("{WORLD_V4}/24"), "dev", "w0"])?;
        world.ip([
            "route",
            "add",
            "10.201.0.0/16",
            "via",
            &NODE_UPLINK_V4.to_string(),
        ])?;
        let world_mac = world.mac("w0")?;
        node.ip([
            "neigh",
            "add",
            &WORLD_V4.to_string(),
            "lladdr",
            &world_mac,
            "dev",
            "u0",
            "nud",
            "permanent",
        ])?;
        let pod_mac = parse_mac(&pod.mac("e1")?)?;
        Ok(Self {
            node,
            pod,
            world,
            pins: PinRoot::new(),
            pod_mac,
            host_mac: parse_mac(&host_mac)?,
        })
    }

    fn lockstep(&self, args: &[&str]) -> anyhow::Result<String> {
        let mut all: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        all.extend(self.pins.arg());
        lockstep_in(&self.node, all)
    }
}

/// A raw socket on the pod's interface (opened inside the pod's namespace).
struct RawSender {
    fd: OwnedFd,
    ifindex: u32,
}

impl RawSender {
    fn open(iface: &str) -> anyhow::Result<Self> {
        let name = std::ffi::CString::new(iface)?;
        // SAFETY: valid C string.
        let ifindex = unsafe { libc::if_nametoindex(name.as_ptr()) };
        ensure!(ifindex != 0, "no interface {iface}");
        // Protocol 0: the socket sends, and receives nothing.
        // SAFETY: plain socket(2).
        let raw = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW | libc::SOCK_CLOEXEC, 0) };
        if raw < 0 {
            return Err(std::io::Error::last_os_error()).context("AF_PACKET socket");
        }
        // SAFETY: just opened, owned here.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        Ok(Self { fd, ifindex })
    }

    fn send(&self, frame: &[u8]) -> anyhow::Result<()> {
        send_frame(&self.fd, self.ifindex, 0, frame)
    }
}

fn ip_checksum(header: &[u8]) -> u16 {
    let mut sum: u32 = header
        .chunks(2)
        .map(|c| u32::from(u16::from_be_bytes([c[0], c[1]])))
        .sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// An IPv4 UDP packet (no Ethernet header) from `src` to the world
/// receiver's `port`, carrying `payload` (UDP checksum 0: none).
fn udp4(src: Ipv4Addr, port: u16, payload: &[u8]) -> Vec<u8> {
    let mut p = vec![0u8; 20 + 8];
    p[0] = 0x45;
    let total = (28 + payload.len()) as u16;
    p[2..4].copy_from_slice(&total.to_be_bytes());
    p[8] = 64;
    p[9] = 17;
    p[12..16].copy_from_slice(&src.octets());
    p[16..20].copy_from_slice(&WORLD_V4.octets());
    let c = ip_checksum(&p[..20]);
    p[10..12].copy_from_slice(&c.to_be_bytes());
    p[20..22].copy_from_slice(&40000u16.to_be_bytes());
    p[22..24].copy_from_slice(&port.to_be_bytes());
    p[24..26].copy_from_slice(&((8 + payload.len()) as u16).to_be_bytes());
    p.extend_from_slice(payload);
    p
}

/// An ARP packet (no Ethernet header) for IPv4 over Ethernet.
fn arp(hlen: u8, sha: [u8; 6], spa: Ipv4Addr, tpa: Ipv4Addr) -> Vec<u8> {
    let mut p = vec![0, 1, 0x08, 0x00, hlen, 4, 0, 1];
    p.extend_from_slice(&sha);
    p.extend_from_slice(&spa.octets());
    p.extend_from_slice(&[0; 6]);
    p.extend_from_slice(&tpa.octets());
    p
}

/// A frame from `src_mac` to the host side: the tags (TPID, VLAN ID) in
/// order, then `ethertype` and `body`, padded to the Ethernet minimum.
fn frame(
    topo: &Topology,
    src_mac: [u8; 6],
    tags: &[(u16, u16)],
    ethertype: u16,
    body: &[u8],
) -> Vec<u8> {
    let mut f = Vec::with_capacity(64 + body.len());
    f.extend_from_slice(&topo.host_mac);
    f.extend_from_slice(&src_mac);
    for (tpid, vid) in tags {
        f.extend_from_slice(&tpid.to_be_bytes());
        f.extend_from_slice(&vid.to_be_bytes());
    }
    f.extend_from_slice(&ethertype.to_be_bytes());
    f.extend_from_slice(body);
    if f.len() < 60 {
        f.resize(60, 0);
    }
    f
}

/// Every tag stacking a pod can put in front of a packet: one tag of each
/// TPID (802.1Q, 802.1ad, the pre-standard QinQ ones), VLAN ID 0 (priority
/// tag) and not, two and three tags deep in every order of the two standard
/// TPIDs.
fn stackings() -> Vec<Vec<(u16, u16)>> {
    let mut all = Vec::new();
    for tpid in [0x8100, 0x88a8, 0x9100, 0x9200, 0x9300] {
        all.push(vec![(tpid, 0)]);
        all.push(vec![(tpid, 7)]);
        all.push(vec![(tpid, 0), (0x8100, 0)]);
    }
    for (a, b) in [
        (0x8100, 0x8100),
        (0x88a8, 0x8100),
        (0x8100, 0x88a8),
        (0x88a8, 0x88a8),
    ] {
        all.push(vec![(a, 0), (b, 0)]);
        all.push(vec![(a, 5), (b, 0)]);
        all.push(vec![(a, 0), (b, 0), (0x8100, 0)]);
    }
    all
}

/// The tagged frames: every stacking in front of spoofed and genuine UDP to
/// the world, ARP and IPv6. Payloads name the stacking, so what arrives says
/// which one got through.
fn tagged_frames(topo: &Topology, port: u16) -> Vec<Vec<u8>> {
    let mut frames = Vec::new();
    for (i, tags) in stackings().iter().enumerate() {
        for (j, src) in SPOOFED.iter().chain([&POD_V4]).enumerate() {
            let payload = format!("tagged-{i}-{j}");
            let body = udp4(*src, port, payload.as_bytes());
            frames.push(frame(topo, topo.pod_mac, tags, 0x0800, &body));
        }
        let body = arp(6, topo.pod_mac, POD_V4, NODE_UPLINK_V4);
        frames.push(frame(topo, topo.pod_mac, tags, 0x0806, &body));
        frames.push(frame(topo, topo.pod_mac, tags, 0x86dd, &[0x60; 40]));
    }
    frames
}

/// Sends `frames` from the pod and returns what the world received.
fn send_to_world(
    topo: &Topology,
    receiver: &UdpSocket,
    frames: &[Vec<u8>],
) -> anyhow::Result<BTreeSet<String>> {
    topo.pod.run(|| {
        let sender = RawSender::open("e1")?;
        for f in frames {
            sender.send(f)?;
        }
        Ok(())
    })?;
    let mut got = BTreeSet::new();
    let mut buf = [0u8; 256];
    while let Ok((n, from)) = recv_from_retrying(receiver, &mut buf) {
        got.insert(format!(
            "{} from {}",
            String::from_utf8_lossy(&buf[..n]),
            from.ip()
        ));
    }
    Ok(got)
}

fn world_receiver(topo: &Topology) -> anyhow::Result<(UdpSocket, u16)> {
    let sock = topo.world.run(|| {
        let sock = UdpSocket::bind(SocketAddr::new(WORLD_V4.into(), 0))?;
        sock.set_read_timeout(Some(Duration::from_millis(500)))?;
        Ok(sock)
    })?;
    let port = sock.local_addr()?.port();
    Ok((sock, port))
}

#[test]
fn vlan_tagged_frames_and_foreign_ethertypes_from_a_pod_are_dropped_and_counted()
-> anyhow::Result<()> {
    privileged!();
    let topo = Topology::new()?;
    let (receiver, port) = world_receiver(&topo)?;

    // Control, before lockstep: the kernel strips priority tags and routes
    // the inner packet, so a double-tagged spoofed packet reaches the world.
    let control = send_to_world(
        &topo,
        &receiver,
        &[frame(
            &topo,
            topo.pod_mac,
            &[(0x88a8, 0), (0x8100, 0)],
            0x0800,
            &udp4(OTHER_NODE_V4, port, b"control"),
        )],
    )?;
    ensure!(
        control == BTreeSet::from([format!("control from {OTHER_NODE_V4}")]),
        "control run (no lockstep): the double-tagged packet should get through, got {control:?}"
    );

    topo.lockstep(&["datapath", "install"])?;
    topo.lockstep(&[
        "datapath",
        "endpoint",
        "--iface",
        "h1",
        "--ipv4",
        &POD_V4.to_string(),
    ])?;
    let before = counters(&topo.pins)?;

    // Untagged: the genuine packet arrives, spoofed ones do not.
    let mut untagged = vec![frame(
        &topo,
        topo.pod_mac,
        &[],
        0x0800,
        &udp4(POD_V4, port, b"genuine"),
    )];
    for src in SPOOFED {
        untagged.push(frame(
            &topo,
            topo.pod_mac,
            &[],
            0x0800,
            &udp4(src, port, b"untagged-spoof"),
        ));
    }
    let got = send_to_world(&topo, &receiver, &untagged)?;
    assert_eq!(got, BTreeSet::from([format!("genuine from {POD_V4}")]));

    // Every stacking, of spoofed and genuine packets alike: nothing arrives.
    let tagged = tagged_frames(&topo, port);
    let got = send_to_world(&topo, &receiver, &tagged)?;
    assert!(got.is_empty(), "tagged frames got through: {got:?}");

    // Every other ethertype (802.3 length values included).
    let mut other = Vec::new();
    for ethertype in 0..=u16::MAX {
        if matches!(
            ethertype,
            0x0800 | 0x86dd | 0x0806 | 0x8100 | 0x88a8 | 0x9100 | 0x9200 | 0x9300
        ) {
            continue;
        }
        other.push(frame(
            &topo,
            topo.pod_mac,
            &[],
            ethertype,
            &udp4(OTHER_NODE_V4, port, b"ethertype"),
        ));
    }
    let got = send_to_world(&topo, &receiver, &other)?;
    assert!(got.is_empty(), "foreign ethertypes got through: {got:?}");

    // ARP: the pod's own, a probe, and three forgeries.
    let arps = [
        arp(6, topo.pod_mac, POD_V4, NODE_UPLINK_V4),
        arp(6, topo.pod_mac, Ipv4Addr::UNSPECIFIED, NODE_UPLINK_V4),
        arp(6, topo.pod_mac, OTHER_POD_V4, NODE_UPLINK_V4),
        arp(6, [0x02, 0, 0, 0, 0, 0x66], POD_V4, NODE_UPLINK_V4),
        arp(8, topo.pod_mac, POD_V4, NODE_UPLINK_V4),
    ];
    let arp_frames: Vec<Vec<u8>> = arps
        .iter()
        .map(|a| frame(&topo, topo.pod_mac, &[], 0x0806, a))
        .collect();
    send_to_world(&topo, &receiver, &arp_frames)?;

    let after = counters(&topo.pins)?;
    let delta = |name: &str| -> anyhow::Result<u64> {
        let (Some(a), Some(b)) = (after[name].as_u64(), before[name].as_u64()) else {
            bail!("no counter {name}");
        };
        Ok(a - b)
    };
    let figures = [
        ("vlan_dropped", tagged.len() as u64),
        ("ethertype_dropped", other.len() as u64),
        ("spoof_dropped_v4", SPOOFED.len() as u64),
        ("spoof_dropped_arp", 2),
        // The genuine packet, the pod's own ARP and the probe.
        ("from_endpoint_passed", 3),
        ("malformed", 1),
    ];
    for (name, want) in figures {
        let got = delta(name)?;
        println!("{name}: {got} (expected {want})");
        assert_eq!(got, want, "{name}");
    }
    Ok(())
}

/// The pod's IPv6 address (only the ENDPOINTS entry holds it; the pod's
/// own IPv6 is off, the frames are written by hand).
const POD_V6: std::net::Ipv6Addr = std::net::Ipv6Addr::new(0xfd00, 0x201, 0, 0, 0, 0, 0, 1);

/// An IPv6 UDP packet (no Ethernet header) from `src` to a documentation
/// address (UDP checksum left 0: nothing receives it).
fn udp6(src: std::net::Ipv6Addr, payload: &[u8]) -> Vec<u8> {
    let mut p = vec![0u8; 40 + 8];
    p[0] = 0x60;
    p[4..6].copy_from_slice(&((8 + payload.len()) as u16).to_be_bytes());
    p[6] = 17;
    p[7] = 64;
    p[8..24].copy_from_slice(&src.octets());
    p[24..40].copy_from_slice(
        &"2001:db8::2"
            .parse::<std::net::Ipv6Addr>()
            .unwrap()
            .octets(),
    );
    p[40..42].copy_from_slice(&40000u16.to_be_bytes());
    p[42..44].copy_from_slice(&9u16.to_be_bytes());
    p[44..46].copy_from_slice(&((8 + payload.len()) as u16).to_be_bytes());
    p.extend_from_slice(payload);
    p
}

/// #31 item 1: IPv4 and IPv6 from the pod's own addresses but another
/// Ethernet source (a pod posing as another on the node's L2) are dropped
/// and counted; with its own MAC they pass. Before the MAC was in
/// ENDPOINT_SLOTS the IPv4 frame with a forged MAC reached the world.
#[test]
fn frames_from_a_pods_address_with_another_mac_are_dropped_and_counted() -> anyhow::Result<()> {
    privileged!();
    let topo = Topology::new()?;
    let (receiver, port) = world_receiver(&topo)?;
    topo.lockstep(&["datapath", "install"])?;
    let mac = topo
        .pod_mac
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":");
    topo.lockstep(&[
        "datapath",
        "endpoint",
        "--iface",
        "h1",
        "--ipv4",
        &POD_V4.to_string(),
        "--ipv6",
        &POD_V6.to_string(),
        "--mac",
        &mac,
    ])?;
    let before = counters(&topo.pins)?;
    let forged = [0x02, 0x00, 0x5e, 0x10, 0x20, 0x30];
    let frames = [
        frame(
            &topo,
            forged,
            &[],
            0x0800,
            &udp4(POD_V4, port, b"forged-mac"),
        ),
        frame(
            &topo,
            topo.pod_mac,
            &[],
            0x0800,
            &udp4(POD_V4, port, b"own-mac"),
        ),
        frame(&topo, forged, &[], 0x86dd, &udp6(POD_V6, b"forged-mac")),
        frame(&topo, topo.pod_mac, &[], 0x86dd, &udp6(POD_V6, b"own-mac")),
    ];
    let got = send_to_world(&topo, &receiver, &frames)?;
    println!("world received {got:?}");
    assert_eq!(got, BTreeSet::from([format!("own-mac from {POD_V4}")]));
    let after = counters(&topo.pins)?;
    let delta = |name: &str| -> anyhow::Result<u64> {
        let (Some(a), Some(b)) = (after[name].as_u64(), before[name].as_u64()) else {
            bail!("no counter {name}");
        };
        Ok(a - b)
    };
    println!(
        "spoof_dropped_mac {}, from_endpoint_passed {}",
        delta("spoof_dropped_mac")?,
        delta("from_endpoint_passed")?
    );
    assert_eq!(delta("spoof_dropped_mac")?, 2);
    assert_eq!(delta("from_endpoint_passed")?, 2);
    Ok(())
}
