//! Masquerade end to end (#14), with the agent: endpoints made by the real
//! CNI ADD, the agent on the node with `[datapath] uplink = "u0"` writing
//! MASQ_CONFIG and collecting expired entries, the [`World`] topology beyond
//! the uplink (a world with no route back to the pools, a skip destination
//! listed in `non_masquerade_cidrs` that routes back, a router in front of
//! a reduced-MTU link).

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::sync::mpsc;
use std::time::Duration;

use anyhow::{Context, bail, ensure};
use lockstep_tests::recv_from_retrying;
use lockstep_tests::world::{
    Endpoint, FAR_V4, FAR_V6, NARROW_MTU, NODE_V4, NODE_V6, SKIP_V4, SKIP_V6, Sink, WORLD_V4,
    WORLD_V6, World, add_endpoint, bpftool_dump, cni, metric, transfer,
};
use lockstep_tests::{AgentProc, Netns, counter, privileged, sh, wait_for};
use serde_json::{Value, json};

const POOLS: &str = r#"
[[pools]]
name = "pods"
ipv4 = ["10.88.0.0/24"]
ipv6 = ["fd00:88::/120"]
"#;

fn start(w: &World, extra: &str) -> anyhow::Result<AgentProc> {
    AgentProc::start(&w.node, &World::agent_config(POOLS, extra))
}

fn node(v4: bool) -> IpAddr {
    if v4 { NODE_V4 } else { NODE_V6 }.parse().expect("literal")
}

/// One datagram from `ep` (bound to `sport`, 0: any) to a socket in `to_ns`
/// at `to`: the source the receiver saw, and whether its answer came back.
fn udp_exchange(
    ep: &Endpoint,
    v4: bool,
    sport: u16,
    to_ns: &Netns,
    to: &str,
) -> anyhow::Result<(SocketAddr, bool)> {
    let to_ip: IpAddr = to.parse()?;
    let srv = to_ns.run(|| Ok(UdpSocket::bind(SocketAddr::new(to_ip, 0))?))?;
    srv.set_read_timeout(Some(Duration::from_secs(3)))?;
    let dst = srv.local_addr()?;
    let src = SocketAddr::new(ep.addr(v4), sport);
    let cli = ep.ns.run(|| Ok(UdpSocket::bind(src)?))?;
    cli.set_read_timeout(Some(Duration::from_secs(3)))?;
    cli.send_to(b"ping", dst)?;
    let mut buf = [0u8; 8];
    let (_, from) = recv_from_retrying(&srv, &mut buf)
        .with_context(|| format!("{to} got nothing from {src}"))?;
    srv.send_to(b"pong", from)?;
    let back = matches!(recv_from_retrying(&cli, &mut buf), Ok((4, _)));
    Ok((from, back))
}

/// `ping` from the endpoint; the world has no route back, so an answer
/// means the echo was translated both ways.
fn ping(ep: &Endpoint, to: &str) -> anyhow::Result<()> {
    let out = ep
        .ns
        .command("ping")
        .args(["-c", "3", "-i", "0.2", "-W", "2", to])
        .output()?;
    ensure!(
        out.status.success(),
        "ping {to} from the endpoint: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    Ok(())
}

/// a. and f.: TCP (50 MB, checksum at both ends), UDP and ICMP echo, IPv4
/// and IPv6, to the world as the node's address; to the skip destination
/// as the endpoint's own. Then the translation maps as bpftool's JSON and
/// `lockstep maps dump`.
#[test]
fn endpoints_reach_the_world_as_the_node_and_skip_destinations_as_themselves() -> anyhow::Result<()>
{
    privileged!();
    let w = World::new()?;
    let agent = start(&w, "")?;
    let ep = add_endpoint(&agent)?;
    for (v4, world, skip) in [(true, WORLD_V4, SKIP_V4), (false, WORLD_V6, SKIP_V6)] {
        let got = transfer(&ep.ns, Sink::listen(&w.world, world)?, 50, |_| Ok(()))?;
        ensure!(
            got.peer.ip() == node(v4),
            "TCP to {world}: the world saw {}",
            got.peer
        );
        let (from, back) = udp_exchange(&ep, v4, 0, &w.world, world)?;
        ensure!(
            from.ip() == node(v4),
            "UDP to {world}: the world saw {from}"
        );
        ensure!(back, "UDP to {world}: the answer did not come back");
        ping(&ep, world)?;

        let got = transfer(&ep.ns, Sink::listen(&w.skip, skip)?, 1, |_| Ok(()))?;
        ensure!(
            got.peer.ip() == ep.addr(v4),
            "TCP to the skip destination {skip}: it saw {}",
            got.peer
        );
        let (from, back) = udp_exchange(&ep, v4, 0, &w.skip, skip)?;
        ensure!(
            from.ip() == ep.addr(v4) && back,
            "UDP to the skip destination {skip}: it saw {from}, answer back: {back}"
        );
    }
    ensure!(counter(&agent.pins, "masq_translated")? > 0);
    ensure!(counter(&agent.pins, "masq_reversed")? > 0);

    // f. bpftool prints the NAT maps as typed JSON (BTF) ...
    for (map, ep_addr) in [("NAT_FWD_V4", ep.v4), ("NAT_FWD_V6", ep.v6)] {
        let pin = agent.pins.path().join("maps").join(map);
        let dump: Value = serde_json::from_str(&sh(
            "bpftool",
            [
                "-j",
                "map",
                "dump",
                "pinned",
                pin.to_str().context("utf-8")?,
            ],
        )?)?;
        let entries = dump.as_array().context("bpftool: not an array")?;
        let protos: BTreeSet<u64> = entries
            .iter()
            .filter_map(|e| e["formatted"]["key"]["proto"].as_u64())
            .collect();
        ensure!(
            protos.is_superset(&[6, 17].into()),
            "{map}: bpftool shows no typed TCP and UDP keys: {dump}"
        );
        ensure!(
            entries
                .iter()
                .all(|e| e["formatted"]["value"]["port"].as_u64().is_some()),
            "{map}: values not typed: {dump}"
        );
        // ... and lockstep decodes them: addresses as text, ports, states.
        let decoded = agent.maps_dump()?;
        let flows = decoded[map].as_array().context("no map in the dump")?;
        for proto in [6, 17, if map.ends_with("V4") { 1 } else { 58 }] {
            ensure!(
                flows.iter().any(|f| f["proto"] == proto
                    && f["src"] == ep_addr.to_string()
                    && f["to_addr"] == node(ep_addr.is_ipv4()).to_string()),
                "{map}: no decoded flow of proto {proto} from {ep_addr}: {flows:?}"
            );
        }
    }
    Ok(())
}

/// b. Two endpoints with the same source port to one destination get
/// distinct translated ports; 2,000 concurrent connections all work.
#[test]
fn same_source_ports_get_distinct_translations_and_2000_connections_work() -> anyhow::Result<()> {
    privileged!();
    let w = World::new()?;
    let agent = start(&w, "")?;
    let a = add_endpoint(&agent)?;
    let b = add_endpoint(&agent)?;
    for (v4, world) in [(true, WORLD_V4), (false, WORLD_V6)] {
        let ip: IpAddr = world.parse()?;
        let srv = w
            .world
            .run(|| Ok(UdpSocket::bind(SocketAddr::new(ip, 0))?))?;
        srv.set_read_timeout(Some(Duration::from_secs(3)))?;
        let to = srv.local_addr()?;
        let mut seen = Vec::new();
        for ep in [&a, &b] {
            let src = SocketAddr::new(ep.addr(v4), 40_000);
            let s = ep.ns.run(|| Ok(UdpSocket::bind(src)?))?;
            s.send_to(b"x", to)?;
            let (_, from) = recv_from_retrying(&srv, &mut [0u8; 4])?;
            ensure!(from.ip() == node(v4), "{world} saw {from}");
            seen.push(from.port());
        }
        ensure!(
            seen[0] != seen[1],
            "{world}: both endpoints' port 40000 became {seen:?}"
        );
    }

    // 2,000 connections open at once, each echoing its own number.
    const N: usize = 2_000;
    let ip: IpAddr = WORLD_V4.parse()?;
    let listener = w
        .world
        .run(|| Ok(TcpListener::bind(SocketAddr::new(ip, 0))?))?;
    let to = listener.local_addr()?;
    let server = std::thread::spawn(move || -> anyhow::Result<Vec<TcpStream>> {
        (0..N)
            .map(|_| Ok(listener.accept()?.0))
            .collect::<anyhow::Result<_>>()
    });
    let clients: Vec<TcpStream> = a.ns.run(|| {
        (0..N)
            .map(|i| {
                TcpStream::connect_timeout(&to, Duration::from_secs(5))
                    .with_context(|| format!("connection {i}"))
            })
            .collect()
    })?;
    let accepted = server.join().map_err(|_| anyhow::anyhow!("server"))??;
    let echo = std::thread::spawn(move || -> anyhow::Result<BTreeSet<SocketAddr>> {
        let mut peers = BTreeSet::new();
        for mut s in accepted {
            s.set_read_timeout(Some(Duration::from_secs(10)))?;
            let mut buf = [0u8; 4];
            s.read_exact(&mut buf)?;
            s.write_all(&buf)?;
            peers.insert(s.peer_addr()?);
        }
        Ok(peers)
    });
    for (i, mut c) in clients.iter().enumerate() {
        c.write_all(&(i as u32).to_be_bytes())?;
    }
    for (i, mut c) in clients.iter().enumerate() {
        c.set_read_timeout(Some(Duration::from_secs(10)))?;
        let mut buf = [0u8; 4];
        c.read_exact(&mut buf)
            .with_context(|| format!("connection {i} got no echo"))?;
        ensure!(
            u32::from_be_bytes(buf) == i as u32,
            "connection {i}: {buf:?}"
        );
    }
    let peers = echo.join().map_err(|_| anyhow::anyhow!("echo"))??;
    ensure!(
        peers.len() == N && peers.iter().all(|p| p.ip() == node(true)),
        "{} distinct peers, all the node's address: {}",
        peers.len(),
        peers.iter().all(|p| p.ip() == node(true))
    );
    Ok(())
}

/// c. A four-port range: four flows take it, a fifth is dropped and counted
/// while the four keep working; once their entries expire (UDP timeout 2 s,
/// collected every 500 ms) a new flow works again.
#[test]
fn an_exhausted_port_range_drops_new_flows_until_entries_expire() -> anyhow::Result<()> {
    privileged!();
    let w = World::new()?;
    let agent = start(
        &w,
        "[masquerade]\nports = \"62000-62003\"\nudp_timeout = \"2s\"\ngc_interval = \"500ms\"\n",
    )?;
    let ep = add_endpoint(&agent)?;
    let ip: IpAddr = WORLD_V4.parse()?;
    let srv = w
        .world
        .run(|| Ok(UdpSocket::bind(SocketAddr::new(ip, 0))?))?;
    let to = srv.local_addr()?;
    let socks: Vec<UdpSocket> = (0..5)
        .map(|i| {
            ep.ns
                .run(|| Ok(UdpSocket::bind(SocketAddr::new(ep.v4, 41_000 + i))?))
        })
        .collect::<anyhow::Result<_>>()?;
    srv.set_read_timeout(Some(Duration::from_secs(3)))?;
    let mut ports = BTreeSet::new();
    for s in &socks[..4] {
        s.send_to(b"x", to)?;
        ports.insert(recv_from_retrying(&srv, &mut [0u8; 4])?.1.port());
    }
    ensure!(
        ports == (62_000..=62_003).collect(),
        "four flows, four ports of the range: {ports:?}"
    );
    let exhausted = counter(&agent.pins, "masq_exhausted")?;
    socks[4].send_to(b"5", to)?;
    // The drop is an event: the counter moves.
    wait_for(
        "masq_exhausted to count the fifth flow",
        Duration::from_secs(5),
        || (counter(&agent.pins, "masq_exhausted").ok()? > exhausted).then_some(()),
    )?;
    // The four still work and keep their ports; the fifth never arrived.
    srv.set_read_timeout(Some(Duration::from_secs(3)))?;
    let mut again = BTreeSet::new();
    for s in &socks[..4] {
        s.send_to(b"y", to)?;
        let mut buf = [0u8; 4];
        let (n, from) = recv_from_retrying(&srv, &mut buf)?;
        ensure!(
            &buf[..n] == b"y",
            "the fifth flow's datagram arrived: {:?}",
            &buf[..n]
        );
        again.insert(from.port());
    }
    ensure!(again == ports, "existing flows changed ports: {again:?}");
    wait_for(
        "lockstep_masq_exhausted_total to count the drop",
        Duration::from_secs(5),
        || (metric(&w.node, "lockstep_masq_exhausted_total").ok()?? >= 1.0).then_some(()),
    )?;
    // After the UDP timeout the collector frees the ports: the fifth works.
    srv.set_read_timeout(Some(Duration::from_millis(200)))?;
    let from = wait_for(
        "the fifth flow to get a port after expiry",
        Duration::from_secs(20),
        || {
            socks[4].send_to(b"z", to).ok()?;
            loop {
                let mut buf = [0u8; 4];
                let (n, from) = recv_from_retrying(&srv, &mut buf).ok()?;
                if &buf[..n] == b"z" {
                    return Some(from);
                }
            }
        },
    )?;
    ensure!(
        from.ip() == node(true) && (62_000..=62_003).contains(&from.port()),
        "after expiry the world saw {from}"
    );
    let deleted = metric(&w.node, "lockstep_masq_gc_deleted_total")?;
    ensure!(
        deleted.is_some_and(|d| d >= 4.0),
        "the collector's deletions are not counted: {deleted:?}"
    );
    Ok(())
}

/// d. The router in front of `far` has a 1280-byte link: the endpoint gets
/// "fragmentation needed" / "packet too big" (its route learns the MTU)
/// and a 20 MB transfer completes, IPv4 and IPv6.
#[test]
fn a_reduced_mtu_hop_reaches_the_endpoint_and_large_transfers_complete() -> anyhow::Result<()> {
    privileged!();
    let w = World::new()?;
    let agent = start(&w, "")?;
    let ep = add_endpoint(&agent)?;
    let before = counter(&agent.pins, "masq_icmp_error_reversed")?;
    for (v4, far) in [(true, FAR_V4), (false, FAR_V6)] {
        let got = transfer(&ep.ns, Sink::listen(&w.far, far)?, 20, |_| Ok(()))?;
        ensure!(got.peer.ip() == node(v4), "{far} saw {}", got.peer);
        let route = ep.ns.ip(["route", "get", far])?;
        ensure!(
            route.contains(&format!("mtu {NARROW_MTU}")),
            "the endpoint did not learn the path MTU to {far}: {route}"
        );
    }
    ensure!(
        counter(&agent.pins, "masq_icmp_error_reversed")? >= before + 2,
        "no ICMP error was reverse-translated"
    );
    Ok(())
}

/// e. A TCP transfer runs while the uplink programs are replaced and the
/// agent is SIGKILLed and restarted: it completes, intact, without reset.
#[test]
fn a_transfer_survives_a_program_upgrade_and_an_agent_kill() -> anyhow::Result<()> {
    privileged!();
    let w = World::new()?;
    let mut agent = start(&w, "")?;
    let ep = add_endpoint(&agent)?;
    const MIB: usize = 60;
    let (tx, rx) = mpsc::channel::<usize>();
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let sink = Sink::listen(&w.world, WORLD_V4)?;
    let mover = std::thread::scope(|s| -> anyhow::Result<_> {
        let ep_ns = &ep.ns;
        let mover = s.spawn(move || {
            transfer(ep_ns, sink, MIB, |i| {
                let _ = tx.send(i);
                // Paced, so the upgrade and the restart happen mid-stream;
                // at MiB 10 and 20 it waits for them to have begun.
                if i == 10 || i == 20 {
                    go_rx
                        .recv_timeout(Duration::from_secs(30))
                        .context("no go from the test")?;
                }
                std::thread::sleep(Duration::from_millis(20));
                Ok(())
            })
        });
        let progress = |at: usize| -> anyhow::Result<()> {
            loop {
                let i = rx.recv_timeout(Duration::from_secs(30))?;
                if i >= at {
                    return Ok(());
                }
            }
        };
        progress(10)?;
        let mut args = vec![
            "datapath".to_string(),
            "install".into(),
            "--uplink".into(),
            "u0".into(),
        ];
        args.extend(agent.pins.arg());
        let _ = go_tx.send(());
        let out = lockstep_tests::lockstep_in(&w.node, args)?;
        ensure!(
            out.contains("Replaced"),
            "the uplink programs were not replaced: {out}"
        );
        progress(20)?;
        agent.kill9();
        let _ = go_tx.send(());
        agent.restart()?;
        Ok(mover.join())
    })?;
    let got = mover.map_err(|_| anyhow::anyhow!("transfer thread panicked"))??;
    ensure!(got.peer.ip() == node(true), "the world saw {}", got.peer);
    ensure!(
        agent.json(["status", "-o", "json"]).is_ok(),
        "the restarted agent does not answer"
    );
    if counter(&agent.pins, "masq_exhausted")? != 0 {
        bail!("a flow was dropped for want of a port");
    }
    Ok(())
}

/// A TCP connection from `ep` to a listener in the world at `ip`: the
/// listener (for more flows), the endpoint's side, the world's side (both
/// reading with `timeout`) and the address the world saw.
fn world_tcp(
    w: &World,
    ep: &Endpoint,
    ip: IpAddr,
    timeout: Duration,
) -> anyhow::Result<(TcpListener, TcpStream, TcpStream, SocketAddr)> {
    let listener = w
        .world
        .run(|| Ok(TcpListener::bind(SocketAddr::new(ip, 0))?))?;
    let to = listener.local_addr()?;
    let c = ep
        .ns
        .run(|| Ok(TcpStream::connect_timeout(&to, Duration::from_secs(5))?))?;
    let (s, peer) = listener.accept()?;
    for stream in [&c, &s] {
        stream.set_read_timeout(Some(timeout))?;
    }
    Ok((listener, c, s, peer))
}

/// One byte from the endpoint's side, echoed back by the world's.
fn round_trip(c: &mut TcpStream, s: &mut TcpStream, b: u8) -> anyhow::Result<()> {
    c.write_all(&[b])?;
    let mut got = [0u8; 1];
    s.read_exact(&mut got)?;
    s.write_all(&got)?;
    c.read_exact(&mut got)?;
    ensure!(got == [b], "echo {got:?}");
    Ok(())
}

/// Issue item 6: a change of the skip sets applies to new flows at once,
/// while an established flow keeps its translation until it ends. The
/// world's address joins `non_masquerade_cidrs` (applied by a restart, as
/// config edits are): an open connection to it goes on as the node's
/// address; a new flow arrives with the endpoint's own.
#[test]
fn a_skip_set_change_applies_to_new_flows_and_spares_established_ones() -> anyhow::Result<()> {
    privileged!();
    let w = World::new()?;
    let mut agent = start(&w, "")?;
    let ep = add_endpoint(&agent)?;
    let ip: IpAddr = WORLD_V4.parse()?;
    let (_listener, mut c, mut s, peer) = world_tcp(&w, &ep, ip, Duration::from_secs(10))?;
    ensure!(
        peer.ip() == node(true),
        "before the change the world saw {peer}"
    );
    round_trip(&mut c, &mut s, 1)?;

    agent.rewrite_config(|text| {
        text.replace(
            &format!("\"{SKIP_V4}/32\""),
            &format!("\"{SKIP_V4}/32\", \"{WORLD_V4}/32\""),
        )
    })?;
    agent.restart()?;
    // The established flow keeps going, still as the node (the world has no
    // route to the endpoint: an untranslated segment would never be answered).
    round_trip(&mut c, &mut s, 2)
        .context("the established connection broke when the skip set changed")?;
    // A new flow to the world is not translated any more.
    let srv = w
        .world
        .run(|| Ok(UdpSocket::bind(SocketAddr::new(ip, 0))?))?;
    srv.set_read_timeout(Some(Duration::from_secs(3)))?;
    let u = ep
        .ns
        .run(|| Ok(UdpSocket::bind(SocketAddr::new(ep.v4, 0))?))?;
    u.send_to(b"new", srv.local_addr()?)?;
    let (_, from) = recv_from_retrying(&srv, &mut [0u8; 4])?;
    ensure!(
        from.ip() == ep.v4,
        "a new flow after the change still left as {from}"
    );
    Ok(())
}

/// #31 item 7: `enabled = false` turns translation off. MASQ_CONFIG is
/// pinned, so an agent restarted with masquerade off used to leave the last
/// configuration on: flows kept leaving as the node, with no collector to
/// end them. Now MASQ_CONFIG has no family enabled, the NAT maps are empty,
/// and the endpoint's next datagram reaches the world from its own address.
#[test]
fn disabling_masquerade_turns_translation_off_and_clears_the_translations() -> anyhow::Result<()> {
    privileged!();
    let w = World::new()?;
    let mut agent = start(&w, "")?;
    let ep = add_endpoint(&agent)?;
    for v4 in [true, false] {
        let to = if v4 { WORLD_V4 } else { WORLD_V6 };
        let (from, back) = udp_exchange(&ep, v4, 0, &w.world, to)?;
        ensure!(from.ip() == node(v4) && back, "on: {from}, answered {back}");
    }
    ensure!(!bpftool_dump(&agent, "NAT_FWD_V4")?.is_empty());

    agent.rewrite_config(|text| format!("{text}\n[masquerade]\nenabled = false\n"))?;
    agent.restart()?;
    let config = bpftool_dump(&agent, "MASQ_CONFIG")?;
    ensure!(
        config[0]["formatted"]["value"]["flags"] == 0,
        "MASQ_CONFIG after enabled = false: {config:?}"
    );
    for map in ["NAT_FWD_V4", "NAT_REV_V4", "NAT_FWD_V6", "NAT_REV_V6"] {
        let left = bpftool_dump(&agent, map)?;
        ensure!(left.is_empty(), "{map} after enabled = false: {left:?}");
    }
    // The world has no route back: only where the datagram came from is
    // looked at.
    for to in [WORLD_V4, WORLD_V6] {
        let to: IpAddr = to.parse()?;
        let srv = w
            .world
            .run(|| Ok(UdpSocket::bind(SocketAddr::new(to, 0))?))?;
        srv.set_read_timeout(Some(Duration::from_secs(3)))?;
        let cli = ep
            .ns
            .run(|| Ok(UdpSocket::bind(SocketAddr::new(ep.addr(to.is_ipv4()), 0))?))?;
        cli.send_to(b"off", srv.local_addr()?)?;
        let (_, from) = recv_from_retrying(&srv, &mut [0u8; 4])
            .context("the world got nothing with masquerade off")?;
        ensure!(
            from.ip() == ep.addr(to.is_ipv4()),
            "with masquerade off a new flow still left as {from}"
        );
    }
    Ok(())
}

/// The entries of the four NAT maps that belong to `addr`: forward keys
/// from it, reverse values leading to it.
fn translations_of(agent: &AgentProc, addr: IpAddr) -> anyhow::Result<Vec<Value>> {
    let want = match addr {
        IpAddr::V4(a) => json!(a.octets()),
        IpAddr::V6(a) => json!(a.octets()),
    };
    let mut found = Vec::new();
    for map in ["NAT_FWD_V4", "NAT_FWD_V6"] {
        for e in bpftool_dump(agent, map)? {
            if e["formatted"]["key"]["src_addr"] == want {
                found.push(e);
            }
        }
    }
    for map in ["NAT_REV_V4", "NAT_REV_V6"] {
        for e in bpftool_dump(agent, map)? {
            if e["formatted"]["value"]["addr"] == want {
                found.push(e);
            }
        }
    }
    Ok(found)
}

/// #31 item 7: a pod's DEL removes its translations. Before, they stayed
/// until they idled out, so a reply to the old pod's flow was still
/// reverse-translated to its address, and whoever got the address next
/// would receive it.
#[test]
fn a_del_removes_the_pods_translations_and_late_replies_are_not_reversed() -> anyhow::Result<()> {
    privileged!();
    let w = World::new()?;
    let agent = start(&w, "")?;
    let ep = add_endpoint(&agent)?;
    // One UDP flow per family; the world keeps its sockets to answer late.
    let mut late = Vec::new();
    for v4 in [true, false] {
        let to: IpAddr = if v4 { WORLD_V4 } else { WORLD_V6 }.parse()?;
        let srv = w
            .world
            .run(|| Ok(UdpSocket::bind(SocketAddr::new(to, 0))?))?;
        srv.set_read_timeout(Some(Duration::from_secs(3)))?;
        let cli = ep
            .ns
            .run(|| Ok(UdpSocket::bind(SocketAddr::new(ep.addr(v4), 0))?))?;
        cli.send_to(b"ping", srv.local_addr()?)?;
        let (_, from) = recv_from_retrying(&srv, &mut [0u8; 8])?;
        ensure!(from.ip() == node(v4), "not translated: {from}");
        late.push((srv, from));
    }
    for v4 in [true, false] {
        ensure!(
            translations_of(&agent, ep.addr(v4))?.len() >= 2,
            "no translations of {}",
            ep.addr(v4)
        );
    }

    cni(&agent, "DEL", &ep.container, &ep.ns)?;
    for v4 in [true, false] {
        let left = translations_of(&agent, ep.addr(v4))?;
        ensure!(
            left.is_empty(),
            "after DEL, translations of {}: {left:?}",
            ep.addr(v4)
        );
    }
    // The world answers the old flows: nothing is reverse-translated.
    let reversed = counter(&agent.pins, "masq_reversed")?;
    for (srv, from) in &late {
        srv.send_to(b"late", from)?;
    }
    std::thread::sleep(Duration::from_millis(300));
    ensure!(
        counter(&agent.pins, "masq_reversed")? == reversed,
        "a late reply was reverse-translated after DEL"
    );
    Ok(())
}

/// MASQ_CONFIG's reply range, "LOW-HIGH", from `lockstep maps dump`.
fn reply_ports(agent: &AgentProc) -> anyhow::Result<String> {
    let dump = agent.maps_dump()?;
    dump["MASQ_CONFIG"]["reply_ports"]
        .as_str()
        .map(str::to_string)
        .with_context(|| format!("no reply_ports in {}", dump["MASQ_CONFIG"]))
}

/// #31 item 7: a changed port range spares established flows. An open TCP
/// connection translated to a port of the old range keeps working after
/// the agent restarts with a disjoint range (its replies used to be
/// ignored, the old port being outside the range `from_native` looked up);
/// a new flow gets a port of the new range; once the old connection has
/// ended and been collected, the reply range is the new range alone.
#[test]
fn a_changed_port_range_keeps_established_flows_on_their_old_ports() -> anyhow::Result<()> {
    privileged!();
    let w = World::new()?;
    let mut agent = start(
        &w,
        "[masquerade]\nports = \"61100-61199\"\ntcp_closing_timeout = \"200ms\"\ngc_interval = \"100ms\"\n",
    )?;
    let ep = add_endpoint(&agent)?;
    let ip: IpAddr = WORLD_V4.parse()?;
    let (listener, mut c, mut s, peer) = world_tcp(&w, &ep, ip, Duration::from_secs(5))?;
    let to = listener.local_addr()?;
    ensure!(
        peer.ip() == node(true) && (61100..=61199).contains(&peer.port()),
        "before the change the world saw {peer}"
    );
    round_trip(&mut c, &mut s, 1)?;

    agent.rewrite_config(|text| text.replace("61100-61199", "62000-62099"))?;
    agent.restart()?;
    let during = reply_ports(&agent)?;
    println!("reply range with the old flow live: {during}");
    ensure!(
        during == format!("{}-62099", peer.port()),
        "reply range {during}"
    );
    round_trip(&mut c, &mut s, 2)
        .context("the established connection broke when the port range changed")?;
    // A new flow takes a port of the new range.
    let c2 = ep
        .ns
        .run(|| Ok(TcpStream::connect_timeout(&to, Duration::from_secs(5))?))?;
    let (_s2, peer2) = listener.accept()?;
    ensure!(
        (62000..=62099).contains(&peer2.port()),
        "a new flow left as {peer2}"
    );
    // The old connection ends (FIN both ways); once collected, the reply
    // range narrows to the new range.
    drop(c);
    drop(s);
    wait_for(
        "the reply range to narrow to 62000-62099",
        Duration::from_secs(10),
        || (reply_ports(&agent).ok()? == "62000-62099").then_some(()),
    )?;
    drop(c2);
    Ok(())
}

/// Item 5: the incremental checksums hold whatever the veths offload. With
/// transmit and receive checksumming switched off on every interface on the
/// way (the endpoint's, the node's, the LAN's, the world's), the kernel
/// computes and verifies every checksum in full: a 20 MB transfer each way
/// of family still arrives intact, from the node's address.
#[test]
fn checksums_hold_with_offload_switched_off_on_every_veth() -> anyhow::Result<()> {
    privileged!();
    let w = World::new()?;
    let agent = start(&w, "")?;
    let ep = add_endpoint(&agent)?;
    for ns in [&ep.ns, &w.node, &w.lan, &w.world] {
        let links: Value = serde_json::from_str(&ns.ip(["-j", "link", "show"])?)?;
        for name in links
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|l| l["ifname"].as_str())
            .filter(|n| *n != "lo")
        {
            ns.exec("ethtool", ["-K", name, "tx", "off", "rx", "off"])?;
        }
    }
    for (v4, world) in [(true, WORLD_V4), (false, WORLD_V6)] {
        let got = transfer(&ep.ns, Sink::listen(&w.world, world)?, 20, |_| Ok(()))?;
        ensure!(
            got.peer.ip() == node(v4),
            "offload off, TCP to {world}: the world saw {}",
            got.peer
        );
        let (from, back) = udp_exchange(&ep, v4, 0, &w.world, world)?;
        ensure!(
            from.ip() == node(v4) && back,
            "offload off, UDP to {world}: {from} {back}"
        );
        ping(&ep, world)?;
    }
    Ok(())
}
