//! The masquerade topology (#14): endpoints → node (the agent, or the
//! programs installed by hand, runs here; uplink `u0`) → a LAN bridge with
//! the `world` (no route back to the endpoint pools), a `skip` namespace
//! that routes the pools back through the node, and a router in front of a
//! `far` address behind a reduced-MTU link (path-MTU discovery). IPv4 and
//! IPv6. Every namespace has a unique name; dropping the [`World`] deletes
//! them and with them every link.

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{Context, ensure};
use serde_json::{Value, json};

use crate::{AgentProc, Netns, lockstep_bin, sh, unique, veth};

/// The node's uplink address (its primary global one), IPv4.
pub const NODE_V4: &str = "192.0.2.1";
/// The node's uplink address, IPv6.
pub const NODE_V6: &str = "2001:db8::1";
/// The world, IPv4: it knows only its LAN, nothing of the pools.
pub const WORLD_V4: &str = "192.0.2.2";
/// The world, IPv6.
pub const WORLD_V6: &str = "2001:db8::2";
/// The skip destination, IPv4: it routes the pools back through the node.
pub const SKIP_V4: &str = "192.0.2.3";
/// The skip destination, IPv6.
pub const SKIP_V6: &str = "2001:db8::3";
/// The router in front of the far network, IPv4 (on the LAN).
pub const ROUTER_V4: &str = "192.0.2.4";
/// The router, IPv6.
pub const ROUTER_V6: &str = "2001:db8::4";
/// The far address behind the reduced-MTU link, IPv4.
pub const FAR_V4: &str = "198.51.100.2";
/// The far address, IPv6.
pub const FAR_V6: &str = "2001:db8:100::2";
/// The MTU of the router's side of the router → far link.
pub const NARROW_MTU: u32 = 1280;

/// The namespaces of the masquerade topology.
#[derive(Debug)]
pub struct World {
    /// The node: the agent runs here; uplink `u0`.
    pub node: Netns,
    /// Holds the LAN bridge the node, world, skip and router share.
    pub lan: Netns,
    /// `WORLD_V4` / `WORLD_V6` on `w0`; no route to the pools.
    pub world: Netns,
    /// `SKIP_V4` / `SKIP_V6` on `s0`; routes 10/8 and fd00::/8 via the node.
    pub skip: Netns,
    /// `ROUTER_V4` / `ROUTER_V6` on `r0`, the narrow link `r1` to `far`.
    pub router: Netns,
    /// `FAR_V4` / `FAR_V6` behind the router's narrow link.
    pub far: Netns,
}

fn addr(ns: &Netns, cidr: &str, dev: &str) -> anyhow::Result<()> {
    if cidr.contains(':') {
        ns.ip(["-6", "addr", "add", cidr, "dev", dev, "nodad"])?;
    } else {
        ns.ip(["addr", "add", cidr, "dev", dev])?;
    }
    Ok(())
}

fn route(ns: &Netns, dst: &str, via: &str) -> anyhow::Result<()> {
    let family = if via.contains(':') { "-6" } else { "-4" };
    ns.ip([family, "route", "add", dst, "via", via])?;
    Ok(())
}

impl World {
    /// Builds the topology (no agent, no programs yet).
    ///
    /// # Errors
    /// A namespace, link, address or route could not be made.
    pub fn new() -> anyhow::Result<Self> {
        let w = Self {
            node: Netns::new("mqnode")?,
            lan: Netns::new("mqlan")?,
            world: Netns::new("mqworld")?,
            skip: Netns::new("mqskip")?,
            router: Netns::new("mqrtr")?,
            far: Netns::new("mqfar")?,
        };
        for ns in [&w.node, &w.router] {
            for (key, value) in [
                ("net.ipv4.ip_forward", "1"),
                ("net.ipv6.conf.all.forwarding", "1"),
                ("net.ipv4.conf.all.rp_filter", "0"),
                ("net.ipv4.conf.default.rp_filter", "0"),
            ] {
                ns.sysctl(key, value)?;
            }
        }
        w.lan
            .ip(["link", "add", "br0", "type", "bridge", "stp_state", "0"])?;
        w.lan.ip(["link", "set", "br0", "up"])?;
        for (i, (ns, dev, v4, v6)) in [
            (&w.node, "u0", NODE_V4, NODE_V6),
            (&w.world, "w0", WORLD_V4, WORLD_V6),
            (&w.skip, "s0", SKIP_V4, SKIP_V6),
            (&w.router, "r0", ROUTER_V4, ROUTER_V6),
        ]
        .into_iter()
        .enumerate()
        {
            let port = format!("p{i}");
            veth(&w.lan, &port, ns, dev)?;
            w.lan.ip(["link", "set", &port, "master", "br0"])?;
            addr(ns, &format!("{v4}/24"), dev)?;
            addr(ns, &format!("{v6}/64"), dev)?;
        }
        // The skip destination routes the pools back through the node.
        route(&w.skip, "10.0.0.0/8", NODE_V4)?;
        route(&w.skip, "fd00::/8", NODE_V6)?;
        // The narrow hop: router r1 (MTU 1280) → far f0.
        veth(&w.router, "r1", &w.far, "f0")?;
        // Only the router's side is narrow: `far` announces a 1500-byte
        // path's MSS, so the endpoint's full-size segments meet the narrow
        // link at the router, which answers "fragmentation needed" /
        // "packet too big" to the node address.
        w.router
            .ip(["link", "set", "r1", "mtu", &NARROW_MTU.to_string()])?;
        addr(&w.router, "198.51.100.1/24", "r1")?;
        addr(&w.router, "2001:db8:100::1/64", "r1")?;
        addr(&w.far, &format!("{FAR_V4}/24"), "f0")?;
        addr(&w.far, &format!("{FAR_V6}/64"), "f0")?;
        route(&w.far, "default", "198.51.100.1")?;
        route(&w.far, "default", "2001:db8:100::1")?;
        route(&w.node, "198.51.100.0/24", ROUTER_V4)?;
        route(&w.node, "2001:db8:100::/64", ROUTER_V6)?;
        Ok(w)
    }

    /// The agent config for this topology: `pools` TOML, the uplink,
    /// the skip destination as non-masquerade CIDRs, then `extra`.
    pub fn agent_config(pools: &str, extra: &str) -> String {
        format!(
            "non_masquerade_cidrs = [\"{SKIP_V4}/32\", \"{SKIP_V6}/128\"]\n{pools}\n{extra}\n[datapath]\nuplink = \"u0\"\n"
        )
    }

    /// An endpoint made by hand (no agent): namespace, veth `iface` on the
    /// node, `/32` and `/128` addresses, default routes through a link-local
    /// gateway answered statically, host routes on the node. The programs
    /// are not attached: that is `lockstep datapath endpoint`'s job.
    ///
    /// # Errors
    /// A namespace, link, address or route could not be made.
    pub fn plain_endpoint(&self, iface: &str, v4: &str, v6: &str) -> anyhow::Result<Netns> {
        let ep = Netns::new("mqep")?;
        veth(&self.node, iface, &ep, "e0")?;
        let host_mac = self.node.mac(iface)?;
        addr(&ep, &format!("{v4}/32"), "e0")?;
        addr(&ep, &format!("{v6}/128"), "e0")?;
        for gw in ["169.254.1.1", "fe80::1"] {
            ep.ip([
                "neigh",
                "add",
                gw,
                "lladdr",
                &host_mac,
                "dev",
                "e0",
                "nud",
                "permanent",
            ])?;
        }
        ep.ip([
            "route",
            "add",
            "169.254.1.1/32",
            "dev",
            "e0",
            "scope",
            "link",
        ])?;
        ep.ip(["route", "add", "default", "via", "169.254.1.1", "dev", "e0"])?;
        ep.ip([
            "-6", "route", "add", "default", "via", "fe80::1", "dev", "e0",
        ])?;
        self.node
            .ip(["route", "add", &format!("{v4}/32"), "dev", iface])?;
        self.node
            .ip(["-6", "route", "add", &format!("{v6}/128"), "dev", iface])?;
        let ep_mac = ep.mac("e0")?;
        for a in [v4, v6] {
            self.node.ip([
                "neigh",
                "add",
                a,
                "lladdr",
                &ep_mac,
                "dev",
                iface,
                "nud",
                "permanent",
            ])?;
        }
        Ok(ep)
    }
}

/// A checksum of a byte stream (order-sensitive, cheap).
pub fn stream_sum(sum: u64, bytes: &[u8]) -> u64 {
    bytes
        .iter()
        .fold(sum, |a, b| a.wrapping_mul(31).wrapping_add(u64::from(*b)))
}

/// What a [`Sink`] received on one connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Received {
    /// The peer as the receiving side saw it.
    pub peer: SocketAddr,
    /// Bytes received.
    pub bytes: u64,
    /// [`stream_sum`] of them.
    pub sum: u64,
}

/// A TCP server in a namespace that accepts one connection, reads it to
/// the end, answers `"<bytes> <sum>"` and returns what it saw.
#[derive(Debug)]
pub struct Sink {
    /// Where it listens.
    pub addr: SocketAddr,
    thread: std::thread::JoinHandle<anyhow::Result<Received>>,
}

impl Sink {
    /// Listens on `ip` (port chosen by the kernel) inside `ns`; the socket
    /// listens before this returns, so a connect cannot race it.
    ///
    /// # Errors
    /// The bind failed.
    pub fn listen(ns: &Netns, ip: &str) -> anyhow::Result<Self> {
        let ip: IpAddr = ip.parse()?;
        let listener = ns.run(|| Ok(TcpListener::bind(SocketAddr::new(ip, 0))?))?;
        let addr = listener.local_addr()?;
        let thread = std::thread::spawn(move || -> anyhow::Result<Received> {
            let (mut s, peer) = listener.accept()?;
            s.set_read_timeout(Some(Duration::from_secs(60)))?;
            let (mut bytes, mut sum) = (0u64, 0u64);
            let mut buf = vec![0u8; 1 << 16];
            loop {
                let got = s.read(&mut buf)?;
                if got == 0 {
                    break;
                }
                bytes += got as u64;
                sum = stream_sum(sum, &buf[..got]);
            }
            s.write_all(format!("{bytes} {sum}").as_bytes())?;
            Ok(Received { peer, bytes, sum })
        });
        Ok(Self { addr, thread })
    }

    /// What the server saw, once the connection is done.
    ///
    /// # Errors
    /// The server failed (reset, timeout).
    pub fn join(self) -> anyhow::Result<Received> {
        self.thread
            .join()
            .map_err(|_| anyhow::anyhow!("sink thread panicked"))?
    }
}

/// Sends `megabytes` MiB from `from` (a connection opened inside it) to
/// `to`, calling `during(i)` after each MiB; checks that the receiver's
/// answer matches the bytes sent and returns what the receiver saw.
///
/// # Errors
/// The connection failed or was reset, or the sums differ.
pub fn transfer(
    from: &Netns,
    sink: Sink,
    megabytes: usize,
    mut during: impl FnMut(usize) -> anyhow::Result<()>,
) -> anyhow::Result<Received> {
    let to = sink.addr;
    let mut c = from.run(|| Ok(TcpStream::connect_timeout(&to, Duration::from_secs(5))?))?;
    c.set_read_timeout(Some(Duration::from_secs(60)))?;
    c.set_write_timeout(Some(Duration::from_secs(60)))?;
    let block: Vec<u8> = (0..1u32 << 20).map(|i| (i * 7 % 251) as u8).collect();
    let mut sum = 0u64;
    for i in 0..megabytes {
        c.write_all(&block)
            .with_context(|| format!("writing MiB {i} to {to}"))?;
        sum = stream_sum(sum, &block);
        during(i)?;
    }
    c.shutdown(std::net::Shutdown::Write)?;
    let mut answer = String::new();
    c.read_to_string(&mut answer)
        .with_context(|| format!("reading the answer of {to}"))?;
    let got = sink.join()?;
    let sent = (megabytes as u64) << 20;
    ensure!(
        got.bytes == sent && got.sum == sum,
        "{to}: received {} bytes sum {}, sent {sent} sum {sum}",
        got.bytes,
        got.sum
    );
    ensure!(
        answer == format!("{sent} {sum}"),
        "the sender got the answer {answer:?}"
    );
    Ok(got)
}

/// An endpoint the agent made through CNI ADD.
pub struct Endpoint {
    /// Its namespace.
    pub ns: Netns,
    /// Its IPv4 address.
    pub v4: IpAddr,
    /// Its IPv6 address.
    pub v6: IpAddr,
    /// The CNI container id it was added under (for its DEL).
    pub container: String,
}

impl Endpoint {
    /// Its address of the family (`v4`: IPv4, else IPv6).
    pub fn addr(&self, v4: bool) -> IpAddr {
        if v4 { self.v4 } else { self.v6 }
    }
}

/// CNI ADD as a runtime runs it (a plugin process, the config on stdin).
///
/// # Errors
/// The plugin failed or printed no IPv4 and IPv6 address.
pub fn add_endpoint(agent: &AgentProc) -> anyhow::Result<Endpoint> {
    let ns = Netns::new("mqep")?;
    let container = unique("mq");
    let out = cni(agent, "ADD", &container, &ns)?;
    let result: Value = serde_json::from_slice(&out)?;
    let mut v4 = None;
    let mut v6 = None;
    for ip in result["ips"].as_array().context("no ips")? {
        let a: IpAddr = ip["address"]
            .as_str()
            .and_then(|a| a.split('/').next())
            .context("ip without address")?
            .parse()?;
        if a.is_ipv4() {
            v4 = Some(a);
        } else {
            v6 = Some(a);
        }
    }
    Ok(Endpoint {
        ns,
        v4: v4.context("no IPv4 address")?,
        v6: v6.context("no IPv6 address")?,
        container,
    })
}

/// One CNI call through the plugin; its stdout.
///
/// # Errors
/// The plugin could not run or failed.
pub fn cni(
    agent: &AgentProc,
    command: &str,
    container: &str,
    ns: &Netns,
) -> anyhow::Result<Vec<u8>> {
    let conf = json!({
        "cniVersion": "1.0.0",
        "name": "lockstep-masq",
        "type": "lockstep",
        "agentSocket": agent.socket().display().to_string(),
    });
    let mut child = Command::new(lockstep_bin())
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("CNI_COMMAND", command)
        .env("CNI_CONTAINERID", container)
        .env("CNI_NETNS", ns.path())
        .env("CNI_IFNAME", "eth0")
        .env("CNI_PATH", "/opt/cni/bin")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    child
        .stdin
        .take()
        .context("stdin")?
        .write_all(conf.to_string().as_bytes())?;
    let out = child.wait_with_output()?;
    ensure!(
        out.status.success(),
        "CNI {command} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(out.stdout)
}

/// A pinned map of `agent` as bpftool's JSON entries.
///
/// # Errors
/// bpftool failed or printed no array.
pub fn bpftool_dump(agent: &AgentProc, map: &str) -> anyhow::Result<Vec<Value>> {
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
    Ok(dump.as_array().context("bpftool: not an array")?.clone())
}

/// The value of the metric `name` (its first series) on the agent's
/// metrics endpoint (the only TCP listener in the node namespace).
///
/// # Errors
/// The namespace's `sh`, `ss` or `curl` failed.
pub fn metric(node: &Netns, name: &str) -> anyhow::Result<Option<f64>> {
    let text = node.exec(
        "sh",
        [
            "-c",
            "curl -s http://$(ss -ltnH | awk '{print $4}' | head -1)/metrics",
        ],
    )?;
    Ok(text
        .lines()
        .find(|l| l.starts_with(name) && !l.starts_with('#'))
        .and_then(|l| l.split_whitespace().last()?.parse().ok()))
}
