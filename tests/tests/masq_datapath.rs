//! The masquerade programs on their own (no agent): an endpoint namespace,
//! the node (programs installed with `lockstep datapath`, MASQ_CONFIG
//! written by the test) and a "world" namespace with no route back to the
//! endpoint. What the world sees and what comes back is checked with real
//! sockets. The agent-driven matrix is tests/tests/masquerade.rs.

use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::time::Duration;

use anyhow::{Context, ensure};
use lockstep::datapath::PinnedMaps;
use lockstep_common::{MasqConfig, masq_flags};
use lockstep_tests::recv_from_retrying;
use lockstep_tests::{Netns, PinRoot, counter, lockstep_in, privileged, veth};

const EP_V4: &str = "10.200.7.1";
const EP_V6: &str = "fd00:207::1";
const NODE_V4: [u8; 4] = [192, 0, 2, 1];
const NODE_V6: [u8; 16] = [0x20, 1, 0x0d, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1];
const WORLD_V4: &str = "192.0.2.2";
const WORLD_V6: &str = "2001:db8::2";
const PORTS: (u16, u16) = (61_000, 65_535);

struct World {
    node: Netns,
    ep: Netns,
    world: Netns,
    pins: PinRoot,
}

impl World {
    fn new() -> anyhow::Result<Self> {
        let node = Netns::new("mnode")?;
        let ep = Netns::new("mep")?;
        let world = Netns::new("mworld")?;
        for (key, value) in [
            ("net.ipv4.ip_forward", "1"),
            ("net.ipv6.conf.all.forwarding", "1"),
            ("net.ipv4.conf.all.rp_filter", "0"),
            ("net.ipv4.conf.default.rp_filter", "0"),
        ] {
            node.sysctl(key, value)?;
        }
        veth(&node, "h1", &ep, "e1")?;
        veth(&node, "u0", &world, "w0")?;
        let host_mac = node.mac("h1")?;
        ep.ip(["addr", "add", &format!("{EP_V4}/32"), "dev", "e1"])?;
        ep.ip([
            "-6",
            "addr",
            "add",
            &format!("{EP_V6}/128"),
            "dev",
            "e1",
            "nodad",
        ])?;
        for (family, gw) in [("-4", "169.254.1.1"), ("-6", "fe80::1")] {
            ep.ip([
                family,
                "neigh",
                "add",
                gw,
                "lladdr",
                &host_mac,
                "dev",
                "e1",
                "nud",
                "permanent",
            ])?;
        }
        ep.ip([
            "route",
            "add",
            "169.254.1.1/32",
            "dev",
            "e1",
            "scope",
            "link",
        ])?;
        ep.ip(["route", "add", "default", "via", "169.254.1.1", "dev", "e1"])?;
        ep.ip([
            "-6", "route", "add", "default", "via", "fe80::1", "dev", "e1",
        ])?;
        node.ip(["route", "add", &format!("{EP_V4}/32"), "dev", "h1"])?;
        node.ip(["-6", "route", "add", &format!("{EP_V6}/128"), "dev", "h1"])?;
        node.ip(["addr", "add", "192.0.2.1/24", "dev", "u0"])?;
        node.ip(["-6", "addr", "add", "2001:db8::1/64", "dev", "u0", "nodad"])?;
        // The world knows only its own link: no route to the endpoint.
        world.ip(["addr", "add", &format!("{WORLD_V4}/24"), "dev", "w0"])?;
        world.ip([
            "-6",
            "addr",
            "add",
            &format!("{WORLD_V6}/64"),
            "dev",
            "w0",
            "nodad",
        ])?;
        // Static neighbours: the test is about the programs, not about
        // ARP/NDP timing on fresh links (link-local addresses still in DAD).
        let (u_mac, w_mac, e_mac) = (node.mac("u0")?, world.mac("w0")?, ep.mac("e1")?);
        for (ns, addr, mac, dev) in [
            (&node, EP_V4, &e_mac, "h1"),
            (&node, EP_V6, &e_mac, "h1"),
            (&node, WORLD_V4, &w_mac, "u0"),
            (&node, WORLD_V6, &w_mac, "u0"),
            (&world, "192.0.2.1", &u_mac, "w0"),
            (&world, "2001:db8::1", &u_mac, "w0"),
        ] {
            ns.ip([
                "neigh",
                "add",
                addr,
                "lladdr",
                mac,
                "dev",
                dev,
                "nud",
                "permanent",
            ])?;
        }
        let w = Self {
            node,
            ep,
            world,
            pins: PinRoot::new(),
        };
        w.cli(&["datapath", "install", "--uplink", "u0"])?;
        w.cli(&[
            "datapath", "endpoint", "--iface", "h1", "--ipv4", EP_V4, "--ipv6", EP_V6,
        ])?;
        Ok(w)
    }

    fn cli(&self, args: &[&str]) -> anyhow::Result<String> {
        let mut all: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        all.extend(self.pins.arg());
        lockstep_in(&self.node, all)
    }

    /// Writes MASQ_CONFIG the way the agent does: both families on, or off.
    fn masquerade(&self, on: bool, ports: (u16, u16)) -> anyhow::Result<()> {
        let mut maps = PinnedMaps::open(self.pins.path())?;
        let cfg = MasqConfig {
            node_v4: NODE_V4,
            node_v6: NODE_V6,
            port_min: ports.0,
            port_max: ports.1,
            flags: if on {
                masq_flags::ENABLED_V4 | masq_flags::ENABLED_V6
            } else {
                0
            },
            reply_min: 0,
            reply_max: 0,
            endpoint_max: 0,
            _pad: 0,
        };
        maps.masq_config_mut().set(0, cfg, 0)?;
        Ok(())
    }

    /// One UDP datagram from the endpoint (source port `sport`) to the
    /// world: where the world saw it come from, and whether the world's
    /// answer came back to the endpoint.
    fn udp_exchange(&self, world: &str, sport: u16) -> anyhow::Result<(SocketAddr, bool)> {
        let world_ip: IpAddr = world.parse()?;
        let srv = self
            .world
            .run(|| Ok(UdpSocket::bind(SocketAddr::new(world_ip, 0))?))?;
        srv.set_read_timeout(Some(Duration::from_secs(2)))?;
        let to = srv.local_addr()?;
        let ep_ip: IpAddr = if world_ip.is_ipv4() { EP_V4 } else { EP_V6 }.parse()?;
        let cli = self
            .ep
            .run(|| Ok(UdpSocket::bind(SocketAddr::new(ep_ip, sport))?))?;
        cli.set_read_timeout(Some(Duration::from_secs(2)))?;
        cli.send_to(b"ping", to)?;
        let mut buf = [0u8; 16];
        let (_, from) = recv_from_retrying(&srv, &mut buf)
            .with_context(|| format!("the world ({world}) got nothing from port {sport}"))?;
        // Without translation the world has no route for its answer.
        let back = srv.send_to(b"pong", from).is_ok()
            && matches!(recv_from_retrying(&cli, &mut buf), Ok((4, _)));
        Ok((from, back))
    }
}

fn node_addr(family_v4: bool) -> IpAddr {
    if family_v4 {
        IpAddr::from(NODE_V4)
    } else {
        IpAddr::from(NODE_V6)
    }
}

#[test]
fn endpoint_traffic_leaves_as_the_node_and_replies_come_back() -> anyhow::Result<()> {
    privileged!();
    let w = World::new()?;
    w.masquerade(true, PORTS)?;
    for world in [WORLD_V4, WORLD_V6] {
        let v4 = world.contains('.');
        // UDP: the world sees the node address and a port of the range, and
        // its answer reaches the endpoint (the world has no route to it).
        let (from, back) = w.udp_exchange(world, 40_001)?;
        ensure!(from.ip() == node_addr(v4), "{world}: the world saw {from}");
        ensure!(
            (PORTS.0..=PORTS.1).contains(&from.port()),
            "{world}: translated port {} outside the range",
            from.port()
        );
        ensure!(back, "{world}: the UDP answer did not come back");

        // TCP: 8 MB each way is checked byte for byte (sum and length).
        let world_ip: IpAddr = world.parse()?;
        let listener = w
            .world
            .run(|| Ok(TcpListener::bind(SocketAddr::new(world_ip, 0))?))?;
        let to = listener.local_addr()?;
        let server = std::thread::spawn(move || -> anyhow::Result<(SocketAddr, u64, u64)> {
            let (mut s, peer) = listener.accept()?;
            let (mut n, mut sum) = (0u64, 0u64);
            let mut buf = vec![0u8; 1 << 16];
            loop {
                let got = s.read(&mut buf)?;
                if got == 0 {
                    break;
                }
                n += got as u64;
                sum = buf[..got]
                    .iter()
                    .fold(sum, |a, b| a.wrapping_mul(31).wrapping_add(u64::from(*b)));
            }
            s.write_all(format!("{n} {sum}").as_bytes())?;
            Ok((peer, n, sum))
        });
        let mut c =
            w.ep.run(|| Ok(TcpStream::connect_timeout(&to, Duration::from_secs(3))?))?;
        c.set_read_timeout(Some(Duration::from_secs(20)))?;
        let mut sum = 0u64;
        let block: Vec<u8> = (0..1 << 20).map(|i: u32| (i * 7 % 251) as u8).collect();
        for _ in 0..8 {
            c.write_all(&block)?;
            sum = block
                .iter()
                .fold(sum, |a, b| a.wrapping_mul(31).wrapping_add(u64::from(*b)));
        }
        c.shutdown(std::net::Shutdown::Write)?;
        let mut answer = String::new();
        c.read_to_string(&mut answer)?;
        let (peer, n, got) = server.join().expect("server thread")?;
        ensure!(
            peer.ip() == node_addr(v4),
            "{world}: TCP peer seen as {peer}"
        );
        ensure!(
            n == 8 << 20 && got == sum,
            "{world}: {n} bytes, sum {got} != {sum}"
        );
        ensure!(answer == format!("{n} {sum}"), "{world}: answer {answer:?}");

        // An ICMP error quoting the translated packet (port unreachable)
        // reaches the endpoint's socket.
        let closed = SocketAddr::new(world_ip, 9);
        let ep_ip: IpAddr = if v4 { EP_V4 } else { EP_V6 }.parse()?;
        let u =
            w.ep.run(|| Ok(UdpSocket::bind(SocketAddr::new(ep_ip, 0))?))?;
        u.connect(closed)?;
        u.set_read_timeout(Some(Duration::from_secs(2)))?;
        u.send(b"x")?;
        let err = u
            .recv(&mut [0u8; 4])
            .expect_err("nothing listens on port 9");
        ensure!(
            err.kind() == ErrorKind::ConnectionRefused,
            "{world}: expected the port unreachable to reach the endpoint, got {err}"
        );
    }
    ensure!(counter(&w.pins, "masq_translated")? > 0);
    ensure!(counter(&w.pins, "masq_reversed")? > 0);
    ensure!(counter(&w.pins, "masq_icmp_error_reversed")? >= 2);
    ensure!(counter(&w.pins, "malformed")? == 0);

    // The flows are in the maps, decoded by `lockstep maps dump`.
    let dump: serde_json::Value = serde_json::from_str(&w.cli(&["maps", "dump", "-o", "json"])?)?;
    for (map, src) in [("NAT_FWD_V4", EP_V4), ("NAT_FWD_V6", EP_V6)] {
        let entries = dump[map].as_array().context("no NAT map in the dump")?;
        ensure!(
            entries.iter().any(|e| e["src"] == src && e["proto"] == 6),
            "{map} has no TCP flow of the endpoint: {entries:?}"
        );
    }
    Ok(())
}

#[test]
fn masquerade_off_skip_sets_and_an_exhausted_range() -> anyhow::Result<()> {
    privileged!();
    let w = World::new()?;
    // MASQ_CONFIG all zero (never written): counted, not translated.
    let before = counter(&w.pins, "masq_would_translate")?;
    let (from, _) = w.udp_exchange(WORLD_V4, 40_010)?;
    ensure!(
        from.ip().to_string() == EP_V4,
        "masquerade off, the world saw {from}"
    );
    ensure!(counter(&w.pins, "masq_would_translate")? > before);

    // A skip CIDR covering the world: the endpoint's own address arrives.
    w.masquerade(true, PORTS)?;
    w.cli(&["datapath", "masq-skip-add", "--cidr", "192.0.2.0/24"])?;
    let (from, _) = w.udp_exchange(WORLD_V4, 40_011)?;
    ensure!(from.ip().to_string() == EP_V4, "skip set ignored: {from}");
    ensure!(w.udp_exchange(WORLD_V6, 40_011)?.0.ip() == node_addr(false));

    // Two ports for IPv6: two flows to one world socket get them; a third
    // is dropped and counted; the first two keep working.
    w.masquerade(true, (62_000, 62_001))?;
    let world_ip: IpAddr = WORLD_V6.parse()?;
    let srv = w
        .world
        .run(|| Ok(UdpSocket::bind(SocketAddr::new(world_ip, 0))?))?;
    srv.set_read_timeout(Some(Duration::from_millis(500)))?;
    let to = srv.local_addr()?;
    let ep_ip: IpAddr = EP_V6.parse()?;
    let socks: Vec<UdpSocket> = (0..3)
        .map(|i| {
            w.ep.run(|| Ok(UdpSocket::bind(SocketAddr::new(ep_ip, 40_020 + i))?))
        })
        .collect::<anyhow::Result<_>>()?;
    let exhausted = counter(&w.pins, "masq_exhausted")?;
    let mut seen = Vec::new();
    for round in 0..2 {
        for s in &socks {
            s.send_to(b"x", to)?;
            if let Ok((_, from)) = recv_from_retrying(&srv, &mut [0u8; 4]) {
                seen.push((round, from));
            }
        }
    }
    let ports: std::collections::BTreeSet<u16> = seen.iter().map(|(_, f)| f.port()).collect();
    ensure!(
        ports == [62_000, 62_001].into(),
        "the two flows did not get the two ports: {seen:?}"
    );
    ensure!(
        seen.len() == 4,
        "the two translated flows must keep working: {seen:?}"
    );
    ensure!(
        counter(&w.pins, "masq_exhausted")? >= exhausted + 2,
        "the third flow's packets were not counted as exhausted"
    );
    Ok(())
}
