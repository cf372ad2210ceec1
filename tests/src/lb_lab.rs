//! The LoadBalancer lab of the cluster LB end-to-end tests: three node
//! namespaces whose `u0` sit on a bridge underlay, a neighbour namespace
//! `n0` on the same bridge, agents in cluster mode reaching a real etcd
//! through forwarders the test can cut, and the neighbour's wire (ARP and
//! NDP probes out, every reply and announcement captured). Shared by
//! `cluster_lb_e2e` and `cluster_lb_uplink`.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};

use crate::cluster::{Cut, cluster_config, forward, node_ip};
use crate::etcd::EtcdCluster;
use crate::ndp::solicitation;
use crate::{AgentProc, Netns};

/// The LB lease under test (etcd's shortest with its default timing).
pub const LEASE: &str = "2s";
/// The neighbour's first address.
pub const NB_V4: Ipv4Addr = Ipv4Addr::new(10, 251, 0, 100);
/// A dual-stack L2 pool for the lab's services.
pub const POOL: &str = r#"{"pools": [{"name": "pub", "cidrs": ["10.251.0.128/25", "fd00:251::100/120"], "announce": "l2"}]}"#;

/// Three nodes on a bridge, a neighbour `n0` on it, agents in cluster mode.
/// Agents first: they stop before their namespaces go.
pub struct Lab {
    /// Node `i`'s agent.
    pub agents: Vec<AgentProc>,
    /// Node `i`'s switch to etcd.
    pub cuts: Vec<Arc<Cut>>,
    /// Node `i`'s uplink MAC.
    pub macs: Vec<[u8; 6]>,
    /// Node `i`'s namespace.
    pub ns: Vec<Netns>,
    /// The neighbour.
    pub nb: Netns,
    /// The neighbour's MAC.
    pub nb_mac: [u8; 6],
    /// The bridge's namespace.
    pub underlay: Netns,
}

/// `aa:bb:..` as bytes.
pub fn mac_bytes(mac: &str) -> anyhow::Result<[u8; 6]> {
    let v: Vec<u8> = mac
        .split(':')
        .map(|h| u8::from_str_radix(h, 16))
        .collect::<Result<_, _>>()?;
    v.try_into()
        .map_err(|_| anyhow::anyhow!("not a MAC: {mac}"))
}

/// Plugs `inner` in `ns` into the underlay's bridge through a veth whose
/// far end is `outer`; both ends up.
fn plug(underlay: &Netns, ns: &Netns, inner: &str, outer: &str) -> anyhow::Result<()> {
    ns.exec(
        "ip",
        [
            "link",
            "add",
            inner,
            "type",
            "veth",
            "peer",
            "name",
            outer,
            "netns",
            underlay.name(),
        ],
    )?;
    underlay.exec("ip", ["link", "set", outer, "master", "br0", "up"])?;
    ns.exec("ip", ["link", "set", inner, "up"])?;
    Ok(())
}

impl Lab {
    /// Three nodes, each agent with `[datapath] uplink = "u0"` and `lease`
    /// as its `[lb] announce_lease` (the default without).
    pub fn build(cluster: &EtcdCluster, prefix: &str, lease: Option<&str>) -> anyhow::Result<Self> {
        Self::build_labelled(cluster, prefix, lease, ["", "", ""])
    }

    /// As [`Lab::build`], node `i` with `[cluster] node_labels = { labels[i] }`.
    pub fn build_labelled(
        cluster: &EtcdCluster,
        prefix: &str,
        lease: Option<&str>,
        labels: [&str; 3],
    ) -> anyhow::Result<Self> {
        Self::build_with(cluster, prefix, lease, labels, [true; 3])
    }

    /// As [`Lab::build_labelled`], node `i`'s agent told of its uplink
    /// only if `uplinks[i]` (every node's `u0` is on the bridge either way).
    pub fn build_with(
        cluster: &EtcdCluster,
        prefix: &str,
        lease: Option<&str>,
        labels: [&str; 3],
        uplinks: [bool; 3],
    ) -> anyhow::Result<Self> {
        Self::build_extra(cluster, prefix, lease, labels, uplinks, "", &|_, _| {
            Ok(String::new())
        })
    }

    /// As [`Lab::build_with`], every node's `[cluster]` section ending with
    /// `cluster_keys` (e.g. `lease_ttl`), node `i`'s config ending with what
    /// `extra(i, namespace)` gives (e.g. a `[kubernetes]` section, with a
    /// forwarder made in the namespace).
    pub fn build_extra(
        cluster: &EtcdCluster,
        prefix: &str,
        lease: Option<&str>,
        labels: [&str; 3],
        uplinks: [bool; 3],
        cluster_keys: &str,
        extra: &dyn Fn(usize, &Netns) -> anyhow::Result<String>,
    ) -> anyhow::Result<Self> {
        Self::build_any(
            Some((cluster, prefix, cluster_keys)),
            lease,
            labels,
            uplinks,
            extra,
        )
    }

    /// Three nodes without `[cluster]` (no etcd, no cuts): node `i` is
    /// `node-i` by the top-level `node_name`, its config ending with what
    /// `extra(i, namespace)` gives (its `[kubernetes]` section).
    pub fn build_local(
        extra: &dyn Fn(usize, &Netns) -> anyhow::Result<String>,
    ) -> anyhow::Result<Self> {
        Self::build_any(None, None, ["", "", ""], [true; 3], extra)
    }

    fn build_any(
        cluster: Option<(&EtcdCluster, &str, &str)>,
        lease: Option<&str>,
        labels: [&str; 3],
        uplinks: [bool; 3],
        extra: &dyn Fn(usize, &Netns) -> anyhow::Result<String>,
    ) -> anyhow::Result<Self> {
        let underlay = Netns::new("lbul")?;
        underlay.exec("ip", ["link", "add", "br0", "type", "bridge"])?;
        // Unregistered multicast (solicited-node) flooded to every port.
        underlay.exec(
            "ip",
            [
                "link",
                "set",
                "br0",
                "type",
                "bridge",
                "mcast_snooping",
                "0",
            ],
        )?;
        underlay.exec("ip", ["link", "set", "br0", "up"])?;
        let nb = Netns::new("lbnb")?;
        plug(&underlay, &nb, "n0", "ulnb")?;
        nb.exec("ip", ["addr", "add", &format!("{NB_V4}/24"), "dev", "n0"])?;
        let nb_mac = mac_bytes(&nb.mac("n0")?)?;
        let mut lab = Self {
            underlay,
            nb,
            nb_mac,
            ns: vec![],
            cuts: vec![],
            macs: vec![],
            agents: vec![],
        };
        for (i, (labels, uplink)) in labels.iter().zip(uplinks).enumerate() {
            lab.ns.push(Netns::new(&format!("lbn{i}"))?);
            lab.macs.push([0; 6]);
            lab.plug_node(i)?;
            let lb = lease.map_or(String::new(), |l| {
                format!("[lb]\nannounce_lease = \"{l}\"\n")
            });
            let datapath = if uplink {
                "[datapath]\nuplink = \"u0\"\n"
            } else {
                ""
            };
            let node = match cluster {
                Some((etcd, prefix, cluster_keys)) => {
                    lab.cuts.push(forward(&lab.ns[i], etcd)?);
                    format!(
                        "{}node_labels = {{ {labels} }}\n{cluster_keys}",
                        cluster_config(
                            &etcd.endpoints(),
                            prefix,
                            &format!("node-{i}"),
                            &node_ip(i)
                        ),
                    )
                }
                None => format!("pools = []\nnode_name = \"node-{i}\"\n"),
            };
            let more = extra(i, &lab.ns[i])?;
            let config = format!("reconcile_interval = \"1s\"\n{node}{datapath}{lb}{more}");
            lab.agents.push(AgentProc::start(&lab.ns[i], &config)?);
        }
        Ok(lab)
    }

    /// Plugs node `i`'s `u0` into the bridge (as `ul<i>`) with its node
    /// address, and records its MAC: at build, and to create the uplink
    /// again after a test deleted it.
    pub fn plug_node(&mut self, i: usize) -> anyhow::Result<()> {
        let node = &self.ns[i];
        plug(&self.underlay, node, "u0", &format!("ul{i}"))?;
        node.exec(
            "ip",
            ["addr", "add", &format!("{}/24", node_ip(i)), "dev", "u0"],
        )?;
        self.macs[i] = mac_bytes(&node.mac("u0")?)?;
        Ok(())
    }

    /// `lockstep lb apply` of `doc` on node `i`.
    pub fn apply(&self, i: usize, doc: &str) -> anyhow::Result<serde_json::Value> {
        self.agents[i].lb_apply(&serde_json::from_str(doc)?)
    }

    /// `lockstep lb get` on node `i`.
    pub fn get(&self, i: usize) -> anyhow::Result<serde_json::Value> {
        self.agents[i].json(["lb", "get", "-o", "json"])
    }

    /// Address → announcing node index, as `lb get` on node `i` says.
    pub fn announcers(&self, i: usize) -> anyhow::Result<BTreeMap<IpAddr, usize>> {
        let v = self.get(i)?;
        let mut out = BTreeMap::new();
        for (a, x) in v["cluster"]["announcements"]
            .as_object()
            .context("announcements")?
        {
            let node = x["node"].as_str().context("node")?;
            out.insert(a.parse()?, node.trim_start_matches("node-").parse()?);
        }
        Ok(out)
    }

    /// Node `i`'s agent metrics.
    pub fn metrics(&self, i: usize) -> anyhow::Result<String> {
        self.ns[i].exec(
            "sh",
            [
                "-c",
                "curl -s http://$(ss -ltnpH | grep '\"lockstep\"' | awk '{print $4}' | head -1)/metrics",
            ],
        )
    }

    /// The node whose uplink has `mac`, or the MAC itself.
    pub fn node_of(&self, mac: [u8; 6]) -> String {
        self.macs
            .iter()
            .position(|m| *m == mac)
            .map_or_else(|| format!("{mac:02x?}"), |i| format!("node-{i}"))
    }
}

/// Every address a `lb get` answer assigns, by service.
pub fn addresses(view: &serde_json::Value) -> anyhow::Result<BTreeMap<String, Vec<IpAddr>>> {
    let mut out = BTreeMap::new();
    for (id, st) in view["services"].as_object().context("services")? {
        let a = st["assignment"]["addresses"]
            .as_array()
            .map(|a| {
                a.iter()
                    .map(|x| Ok(x.as_str().context("address")?.parse()?))
                    .collect::<anyhow::Result<Vec<IpAddr>>>()
            })
            .transpose()?
            .unwrap_or_default();
        out.insert(id.clone(), a);
    }
    Ok(out)
}

/// Service `shop/sNN`, dual-stack, as `lb apply` takes it.
pub fn service(i: usize) -> String {
    format!(
        r#"{{"namespace": "shop", "name": "s{i:02}", "ipFamilyPolicy": "RequireDualStack", "ports": [{{"protocol": "TCP", "port": 80}}]}}"#
    )
}

/// The services of `range` as one `lb apply` document.
pub fn services(range: std::ops::Range<usize>) -> String {
    let list: Vec<String> = range.map(service).collect();
    format!(r#"{{"services": [{}]}}"#, list.join(", "))
}

// ---- the neighbour's wire: probes out, every ARP reply and NA in ----

const ETH_P_ALL: u16 = 0x0003;

/// What the neighbour saw.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// An answer to a probe (ARP reply to the neighbour, solicited NA).
    Reply,
    /// A gratuitous ARP or an unsolicited NA.
    Announce,
}

/// Probe rounds are told apart by the neighbour's source address: round
/// `i` asks from the `i % TAGS`-th one, and an answer goes to it.
pub const TAGS: usize = 20;

/// The neighbour's IPv4 source for probe tag `tag`.
pub fn nb_v4(tag: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 251, 0, 100 + tag as u8)
}

/// The neighbour's IPv6 source for probe tag `tag`.
pub fn nb_v6(tag: usize) -> Ipv6Addr {
    Ipv6Addr::new(0xfd00, 0x251, 0, 0, 1, 0, 0, tag as u16)
}

#[derive(Clone, Copy, Debug)]
/// A frame the neighbour saw.
pub struct Seen {
    /// When.
    pub at: Instant,
    /// Answer or announcement.
    pub kind: Kind,
    /// The address it is about.
    pub addr: IpAddr,
    /// Its sender's MAC.
    pub mac: [u8; 6],
    /// The probe round's tag an answer went to.
    pub tag: Option<usize>,
}

/// A raw socket on the neighbour's interface.
pub struct Wire {
    fd: OwnedFd,
    ifindex: u32,
}

impl Wire {
    /// A raw socket on `ifname` (call inside its namespace).
    pub fn open(ifname: &str) -> anyhow::Result<Self> {
        let name = std::ffi::CString::new(ifname)?;
        // SAFETY: valid C string.
        let ifindex = unsafe { libc::if_nametoindex(name.as_ptr()) };
        ensure!(ifindex != 0, "no interface {ifname}");
        // SAFETY: plain socket(2).
        let raw = unsafe {
            libc::socket(
                libc::AF_PACKET,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                i32::from(ETH_P_ALL.to_be()),
            )
        };
        ensure!(raw >= 0, "AF_PACKET: {}", std::io::Error::last_os_error());
        // SAFETY: just opened, owned here.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: sockaddr_ll is plain data.
        let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        sll.sll_family = libc::AF_PACKET as u16;
        sll.sll_protocol = ETH_P_ALL.to_be();
        sll.sll_ifindex = ifindex as i32;
        // SAFETY: valid fd and address.
        let rc = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                (&sll as *const libc::sockaddr_ll).cast(),
                size_of::<libc::sockaddr_ll>() as u32,
            )
        };
        ensure!(rc == 0, "bind: {}", std::io::Error::last_os_error());
        let tv = libc::timeval {
            tv_sec: 0,
            tv_usec: 20_000,
        };
        // SAFETY: valid fd and option.
        unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                (&tv as *const libc::timeval).cast(),
                size_of::<libc::timeval>() as u32,
            )
        };
        Ok(Self { fd, ifindex })
    }

    /// Sends one frame.
    pub fn send(&self, frame: &[u8]) -> anyhow::Result<()> {
        // SAFETY: sockaddr_ll is plain data.
        let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        sll.sll_family = libc::AF_PACKET as u16;
        sll.sll_ifindex = self.ifindex as i32;
        sll.sll_halen = 6;
        sll.sll_addr[..6].copy_from_slice(&frame[0..6]);
        // SAFETY: valid fd, buffer and address.
        let sent = unsafe {
            libc::sendto(
                self.fd.as_raw_fd(),
                frame.as_ptr().cast(),
                frame.len(),
                0,
                (&sll as *const libc::sockaddr_ll).cast(),
                size_of::<libc::sockaddr_ll>() as u32,
            )
        };
        ensure!(sent >= 0, "sendto: {}", std::io::Error::last_os_error());
        Ok(())
    }

    /// The next incoming frame, or `None` after the receive timeout.
    pub fn recv(&self) -> Option<Vec<u8>> {
        let mut buf = [0u8; 2048];
        // SAFETY: sockaddr_ll is plain data.
        let mut from: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        let mut len = size_of::<libc::sockaddr_ll>() as u32;
        // SAFETY: valid fd, buffer and address storage.
        let got = unsafe {
            libc::recvfrom(
                self.fd.as_raw_fd(),
                buf.as_mut_ptr().cast(),
                buf.len(),
                0,
                (&mut from as *mut libc::sockaddr_ll).cast(),
                &mut len,
            )
        };
        (got > 0 && from.sll_pkttype != libc::PACKET_OUTGOING).then(|| buf[..got as usize].to_vec())
    }
}

/// An ARP request for `target` from `from`.
pub fn arp_request(mac: [u8; 6], from: Ipv4Addr, target: Ipv4Addr) -> Vec<u8> {
    let mut f = vec![0u8; 42];
    f[0..6].copy_from_slice(&[0xff; 6]);
    f[6..12].copy_from_slice(&mac);
    f[12..14].copy_from_slice(&0x0806u16.to_be_bytes());
    f[14..22].copy_from_slice(&[0, 1, 0x08, 0x00, 6, 4, 0, 1]);
    f[22..28].copy_from_slice(&mac);
    f[28..32].copy_from_slice(&from.octets());
    f[38..42].copy_from_slice(&target.octets());
    f
}

/// An ARP request or a Neighbor Solicitation for `target`, sent from tag `tag`'s source.
pub fn probe(mac: [u8; 6], target: IpAddr, tag: usize) -> Vec<u8> {
    match target {
        IpAddr::V4(a) => arp_request(mac, nb_v4(tag), a),
        IpAddr::V6(a) => solicitation(mac, nb_v6(tag), a, 255, 0),
    }
}

/// What a frame says, if it is an ARP reply, a gratuitous ARP or an NA.
pub fn parse(f: &[u8], at: Instant) -> Option<Seen> {
    let mac: [u8; 6] = f.get(6..12)?.try_into().ok()?;
    match u16::from_be_bytes([*f.get(12)?, *f.get(13)?]) {
        0x0806 if f.len() >= 42 => {
            let op = u16::from_be_bytes([f[20], f[21]]);
            let sender = Ipv4Addr::new(f[28], f[29], f[30], f[31]);
            let target = Ipv4Addr::new(f[38], f[39], f[40], f[41]);
            let sha: [u8; 6] = f[22..28].try_into().ok()?;
            let tag = (0..TAGS).find(|t| nb_v4(*t) == target);
            let kind = if sender == target {
                Kind::Announce
            } else if op == 2 && tag.is_some() {
                Kind::Reply
            } else {
                return None;
            };
            // The ARP sender hardware address must be the frame's source.
            let mac = if sha == mac { mac } else { [0xee; 6] };
            Some(Seen {
                at,
                kind,
                addr: IpAddr::V4(sender),
                mac,
                tag,
            })
        }
        0x86dd if f.len() >= 78 && f[20] == 58 && f[54] == 136 => {
            let target: [u8; 16] = f[62..78].try_into().ok()?;
            let dst: [u8; 16] = f[38..54].try_into().ok()?;
            let tag = (0..TAGS).find(|t| nb_v6(*t) == Ipv6Addr::from(dst));
            let kind = if f[58] & 0x40 != 0 {
                Kind::Reply
            } else {
                Kind::Announce
            };
            Some(Seen {
                at,
                kind,
                addr: IpAddr::V6(Ipv6Addr::from(target)),
                mac,
                tag,
            })
        }
        _ => None,
    }
}

/// Probes `targets` from the neighbour every `every` (0: once) and
/// captures every answer and announcement until stopped.
pub struct Capture {
    stop: Arc<AtomicBool>,
    seen: Arc<Mutex<Vec<Seen>>>,
    rounds: Arc<Mutex<Vec<Instant>>>,
    threads: Vec<std::thread::JoinHandle<anyhow::Result<()>>>,
}

fn enter(ns: &std::path::Path) -> anyhow::Result<()> {
    let file = std::fs::File::open(ns)?;
    // SAFETY: valid fd of a network namespace file; this thread only.
    let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
    ensure!(rc == 0, "setns: {}", std::io::Error::last_os_error());
    Ok(())
}

impl Capture {
    /// Starts probing `targets` every `every` (0: one round) and capturing.
    pub fn start(lab: &Lab, targets: Vec<IpAddr>, every: Duration) -> anyhow::Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let rounds = Arc::new(Mutex::new(Vec::new()));
        let path = lab.nb.path();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let listener = {
            let (stop, seen, path) = (stop.clone(), seen.clone(), path.clone());
            std::thread::spawn(move || -> anyhow::Result<()> {
                enter(&path)?;
                let wire = Wire::open("n0")?;
                ready_tx.send(()).ok();
                while !stop.load(Ordering::SeqCst) {
                    if let Some(f) = wire.recv()
                        && let Some(s) = parse(&f, Instant::now())
                    {
                        seen.lock().expect("lock").push(s);
                    }
                }
                Ok(())
            })
        };
        ready_rx
            .recv_timeout(Duration::from_secs(5))
            .context("capture did not start")?;
        let mac = lab.nb_mac;
        let prober = {
            let (stop, rounds) = (stop.clone(), rounds.clone());
            std::thread::spawn(move || -> anyhow::Result<()> {
                enter(&path)?;
                let wire = Wire::open("n0")?;
                let frames: Vec<Vec<Vec<u8>>> = (0..TAGS)
                    .map(|tag| targets.iter().map(|t| probe(mac, *t, tag)).collect())
                    .collect();
                loop {
                    let round = {
                        let mut r = rounds.lock().expect("lock");
                        r.push(Instant::now());
                        r.len() - 1
                    };
                    for f in &frames[round % TAGS] {
                        wire.send(f)?;
                    }
                    if every.is_zero() {
                        return Ok(());
                    }
                    let next = Instant::now() + every;
                    while Instant::now() < next {
                        if stop.load(Ordering::SeqCst) {
                            return Ok(());
                        }
                        std::thread::sleep(Duration::from_millis(5));
                    }
                }
            })
        };
        Ok(Self {
            stop,
            seen,
            rounds,
            threads: vec![listener, prober],
        })
    }

    /// What was captured so far.
    pub fn seen(&self) -> Vec<Seen> {
        self.seen.lock().expect("lock").clone()
    }

    /// Stops; everything captured and each probe round's time.
    pub fn finish(mut self) -> anyhow::Result<(Vec<Seen>, Vec<Instant>)> {
        self.stop.store(true, Ordering::SeqCst);
        for t in self.threads.drain(..) {
            t.join()
                .map_err(|_| anyhow::anyhow!("capture thread panicked"))??;
        }
        let seen = self.seen();
        let rounds = self.rounds.lock().expect("lock").clone();
        Ok((seen, rounds))
    }
}

impl Drop for Capture {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

/// Probes `targets` once and returns the answers within `wait`, by
/// address (replies only).
pub fn probe_once(
    lab: &Lab,
    targets: &[IpAddr],
    wait: Duration,
) -> anyhow::Result<BTreeMap<IpAddr, Vec<[u8; 6]>>> {
    let cap = Capture::start(lab, targets.to_vec(), Duration::ZERO)?;
    std::thread::sleep(wait);
    let (seen, _) = cap.finish()?;
    let mut out: BTreeMap<IpAddr, Vec<[u8; 6]>> = BTreeMap::new();
    for s in seen.iter().filter(|s| s.kind == Kind::Reply) {
        out.entry(s.addr).or_default().push(s.mac);
    }
    Ok(out)
}

/// One address's move from one node to another, as [`judge`] saw it.
#[derive(Debug)]
pub struct Handover {
    /// The address.
    pub addr: IpAddr,
    /// The node that answered before.
    pub from: String,
    /// The node that answered after.
    pub to: String,
    /// From the last answer of `from` to the first of `to`.
    pub gap: Duration,
    /// Whether `to` sent a gratuitous ARP / unsolicited NA for it.
    pub announced: bool,
}

/// Checks a capture: no probe round answered by two MACs (counted), and
/// for each address the first change of MAC away from `old`: the gap and
/// whether the new MAC announced the address (gratuitous ARP /
/// unsolicited NA).
pub fn judge(
    lab: &Lab,
    seen: &[Seen],
    rounds: &[Instant],
    targets: &[IpAddr],
    old: [u8; 6],
) -> (usize, Vec<Handover>, Vec<String>) {
    let mut overlaps = 0;
    let mut problems = Vec::new();
    let mut handovers = Vec::new();
    for a in targets {
        let replies: Vec<&Seen> = seen
            .iter()
            .filter(|s| s.addr == *a && s.kind == Kind::Reply)
            .collect();
        // Each answer belongs to the last round sent with its tag before
        // it was received (a late answer still counts for its own round).
        let mut by_round: BTreeMap<usize, BTreeSet<[u8; 6]>> = BTreeMap::new();
        for s in &replies {
            let Some(tag) = s.tag else { continue };
            if let Some(i) = (0..rounds.len())
                .rev()
                .find(|i| i % TAGS == tag && rounds[*i] <= s.at)
            {
                by_round.entry(i).or_default().insert(s.mac);
            }
        }
        for (i, macs) in &by_round {
            if macs.len() > 1 {
                overlaps += 1;
                problems.push(format!(
                    "{a}: probe round {i} answered by {:?}",
                    macs.iter().map(|m| lab.node_of(*m)).collect::<Vec<_>>()
                ));
            }
        }
        if replies.iter().any(|s| !lab.macs.contains(&s.mac)) {
            problems.push(format!("{a}: an answer from a MAC no node has"));
        }
        let Some(first_new) = replies.iter().position(|s| s.mac != old) else {
            problems.push(format!("{a}: no other node ever answered"));
            continue;
        };
        let new = replies[first_new].mac;
        let last_old = replies[..first_new].iter().rev().find(|s| s.mac == old);
        let Some(last_old) = last_old else {
            problems.push(format!("{a}: {} answered from the start", lab.node_of(new)));
            continue;
        };
        let at = replies[first_new].at;
        let announced = seen.iter().any(|s| {
            s.addr == *a
                && s.kind == Kind::Announce
                && s.mac == new
                && s.at + Duration::from_millis(500) >= at
        });
        handovers.push(Handover {
            addr: *a,
            from: lab.node_of(old),
            to: lab.node_of(new),
            gap: at - last_old.at,
            announced,
        });
    }
    (overlaps, handovers, problems)
}

/// Waits until every announced address is answered once, by the MAC of
/// the node `lb get` names, and `total` are announced.
pub fn settled(lab: &Lab, total: usize, what: &str) -> anyhow::Result<()> {
    let started = Instant::now();
    loop {
        let announcers = lab.announcers(0)?;
        let targets: Vec<IpAddr> = announcers.keys().copied().collect();
        let answers = probe_once(lab, &targets, Duration::from_millis(800))?;
        let mut wrong = Vec::new();
        for a in &targets {
            let got: BTreeSet<[u8; 6]> = answers.get(a).into_iter().flatten().copied().collect();
            ensure!(
                got.len() <= 1,
                "{what}: {a} answered by two MACs: {:?}",
                got.iter().map(|m| lab.node_of(*m)).collect::<Vec<_>>()
            );
            let n = announcers[a];
            if got.len() != 1 || !got.contains(&lab.macs[n]) {
                wrong.push(format!(
                    "{a}: {:?}, announcer node-{n}",
                    got.iter().map(|m| lab.node_of(*m)).collect::<Vec<_>>()
                ));
            }
        }
        if targets.len() == total && wrong.is_empty() {
            return Ok(());
        }
        ensure!(
            started.elapsed() < Duration::from_secs(30),
            "{what}: not settled in 30 s ({} of {total} announced): {wrong:?}",
            targets.len()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

impl Lab {
    /// The lab with [`POOL`] and `count` dual-stack services applied, once
    /// all their addresses are announced.
    ///
    /// # Errors
    /// As [`Lab::build`], or not all announced within 30 s.
    pub fn with_services(
        cluster: &EtcdCluster,
        prefix: &str,
        lease: Option<&str>,
        count: usize,
    ) -> anyhow::Result<Self> {
        let lab = Self::build(cluster, prefix, lease)?;
        lab.apply(0, POOL)?;
        lab.apply(0, &services(0..count))?;
        crate::wait_for("every address announced", Duration::from_secs(30), || {
            (lab.announcers(0).ok()?.len() == 2 * count).then_some(())
        })?;
        Ok(lab)
    }

    /// The node announcing the most addresses, and those addresses.
    ///
    /// # Errors
    /// `lb get` failed.
    pub fn busiest(&self) -> anyhow::Result<(usize, Vec<IpAddr>)> {
        let announcers = self.announcers(0)?;
        let mut count = [0usize; 3];
        for n in announcers.values() {
            count[*n] += 1;
        }
        let x = (0..3).max_by_key(|i| count[*i]).context("a node")?;
        let targets = announcers
            .iter()
            .filter(|(_, n)| **n == x)
            .map(|(a, _)| *a)
            .collect();
        Ok((x, targets))
    }
}

/// Waits until `cap` saw every one of `targets` answered, after `t0`, by a
/// MAC other than `old`.
///
/// # Errors
/// Not within `within`.
pub fn wait_answered_elsewhere(
    cap: &Capture,
    targets: &[IpAddr],
    old: [u8; 6],
    t0: Instant,
    within: Duration,
) -> anyhow::Result<()> {
    crate::wait_for("every address answered by another node", within, || {
        let seen = cap.seen();
        targets
            .iter()
            .all(|a| {
                seen.iter()
                    .any(|s| s.addr == *a && s.kind == Kind::Reply && s.mac != old && s.at > t0)
            })
            .then_some(())
    })
}

/// Sends `sig` (as `kill` takes it: `-STOP`, `-CONT`...) to `pid`.
///
/// # Errors
/// `kill` failed.
pub fn signal(pid: u32, sig: &str) -> anyhow::Result<()> {
    let out = std::process::Command::new("kill")
        .args([sig, &pid.to_string()])
        .output()?;
    ensure!(out.status.success(), "kill {sig} {pid} failed");
    Ok(())
}
