//! Cluster-mode test plumbing: etcd listens on the test's loopback, and
//! each node namespace reaches it through a forwarder the test runs (a
//! listener made inside the namespace on the member's port, relayed to the
//! member's real socket).

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::net::{IpAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use ipnet::IpNet;

use crate::etcd::EtcdCluster;
use crate::{AgentProc, Netns};

/// A forwarder's switch ([`forward`]): while on, every relayed connection
/// is shut and new ones are refused (the node loses etcd; etcd itself runs
/// on).
///
/// It can also lose etcd's answers at a chosen moment ([`Cut::mute_on`]):
/// the request that carries a pattern reaches etcd, and from then on no
/// answer reaches the node (a reply lost after the write committed).
#[derive(Debug, Default)]
pub struct Cut {
    on: AtomicBool,
    conns: Mutex<Vec<TcpStream>>,
    /// Answers are dropped while set.
    muted: AtomicBool,
    /// Bytes whose passage towards etcd sets `muted`.
    trigger: Mutex<Option<Vec<u8>>>,
}

impl Cut {
    /// Cuts the node from etcd (`on`) or lets it reach etcd again.
    pub fn set(&self, on: bool) {
        self.on.store(on, Ordering::SeqCst);
        if on {
            self.shut_all();
        }
    }

    /// Arms the switch: the first request towards etcd carrying `pattern`
    /// is relayed whole, and every answer after it is dropped (on every
    /// connection) until [`Cut::unmute`]. Requests still reach etcd: a
    /// write committed, its answer (and the answers of any read-back)
    /// lost.
    pub fn mute_on(&self, pattern: &[u8]) {
        *self.trigger.lock().expect("lock") = Some(pattern.to_vec());
    }

    /// Drops every answer from now on, on every connection, until
    /// [`Cut::unmute`]: requests still reach etcd (and are counted there),
    /// nothing comes back. etcd as a node sees it when it stops answering
    /// (a lost quorum, a leader election that drags on).
    pub fn silence(&self) {
        self.muted.store(true, Ordering::SeqCst);
    }

    /// Whether an armed pattern has passed and answers are being dropped.
    pub fn muted(&self) -> bool {
        self.muted.load(Ordering::SeqCst)
    }

    /// Ends [`Cut::mute_on`]: the connections whose answers were dropped
    /// are shut (their streams lost bytes), new ones relay both ways.
    pub fn unmute(&self) {
        *self.trigger.lock().expect("lock") = None;
        self.muted.store(false, Ordering::SeqCst);
        self.shut_all();
    }

    fn shut_all(&self) {
        for c in self.conns.lock().expect("lock").drain(..) {
            let _ = c.shutdown(std::net::Shutdown::Both);
        }
    }

    /// Whether `chunk`, on its way to etcd, fires the armed pattern.
    fn fires(&self, chunk: &[u8]) -> bool {
        let trigger = self.trigger.lock().expect("lock");
        trigger
            .as_deref()
            .is_some_and(|p| !p.is_empty() && chunk.windows(p.len()).any(|w| w == p))
    }
}

/// Which way a relay thread copies.
#[derive(Clone, Copy)]
enum Way {
    /// Node → etcd: may fire the armed pattern.
    Request,
    /// etcd → node: dropped while muted.
    Answer,
}

/// Relays every member's port inside `node` to the member itself, for as
/// long as the test runs (the threads end with the process); the switch
/// that cuts the node from etcd.
///
/// # Errors
/// A listener cannot be made inside `node`.
pub fn forward(node: &Netns, cluster: &EtcdCluster) -> anyhow::Result<Arc<Cut>> {
    let ports = cluster
        .endpoints()
        .iter()
        .map(|ep| Ok(ep.rsplit(':').next().context("port")?.parse()?))
        .collect::<anyhow::Result<Vec<u16>>>()?;
    forward_ports(node, &ports)
}

/// Relays each of `ports` on loopback inside `node` to the same port on
/// the test's loopback (etcd members, the Kubernetes API double), for as
/// long as the test runs; the switch that cuts the node from them.
///
/// # Errors
/// A listener cannot be made inside `node`.
pub fn forward_ports(node: &Netns, ports: &[u16]) -> anyhow::Result<Arc<Cut>> {
    let cut = Arc::new(Cut::default());
    for &port in ports {
        let listener = node.run(move || {
            let _ = std::process::Command::new("ip")
                .args(["link", "set", "lo", "up"])
                .status();
            Ok(TcpListener::bind(("127.0.0.1", port))?)
        })?;
        let cut = cut.clone();
        std::thread::spawn(move || {
            for inner in listener.incoming().flatten() {
                if cut.on.load(Ordering::SeqCst) {
                    continue;
                }
                let Ok(outer) = TcpStream::connect(("127.0.0.1", port)) else {
                    continue;
                };
                {
                    let mut conns = cut.conns.lock().expect("lock");
                    conns.extend(inner.try_clone().ok());
                    conns.extend(outer.try_clone().ok());
                }
                let (Ok(mut a), Ok(mut b)) = (inner.try_clone(), outer.try_clone()) else {
                    continue;
                };
                let (mut c, mut d) = (outer, inner);
                let cut2 = cut.clone();
                let cut3 = cut.clone();
                std::thread::spawn(move || pipe(&mut a, &mut b, &cut2, Way::Request));
                std::thread::spawn(move || pipe(&mut c, &mut d, &cut3, Way::Answer));
            }
        });
    }
    Ok(cut)
}

fn pipe(from: &mut TcpStream, to: &mut TcpStream, cut: &Cut, way: Way) {
    let mut buf = [0u8; 16384];
    while let Ok(n) = from.read(&mut buf) {
        if n == 0 {
            break;
        }
        let chunk = &buf[..n];
        match way {
            Way::Answer if cut.muted.load(Ordering::SeqCst) => continue,
            Way::Request if cut.fires(chunk) => {
                // Relayed first: the request reaches etcd, its answer not.
                cut.muted.store(true, Ordering::SeqCst);
                *cut.trigger.lock().expect("lock") = None;
            }
            _ => {}
        }
        if to.write_all(chunk).is_err() {
            break;
        }
    }
    let _ = to.shutdown(std::net::Shutdown::Both);
}

/// The `[cluster]` config of an agent named `node` under `prefix`, with
/// `node_ip_v4` as its underlay address.
pub fn cluster_config(eps: &[String], prefix: &str, node: &str, node_ip_v4: &str) -> String {
    format!(
        "pools = []\n[cluster]\netcd = [{}]\nprefix = \"{prefix}\"\nnode_name = \"{node}\"\nnode_ip_v4 = \"{node_ip_v4}\"\n",
        eps.iter()
            .map(|e| format!("\"{e}\""))
            .collect::<Vec<_>>()
            .join(", ")
    )
}

/// One call of the CNI plugin (`command` ADD, CHECK or DEL) against the
/// agent at `socket` for container `id` in `netns`, as a runtime makes it:
/// the time it took and its answer (stdout as JSON, `Null` when empty).
///
/// # Errors
/// The plugin did not run, or exited non-zero (the error carries its
/// answer).
pub fn cni(
    socket: &std::path::Path,
    command: &str,
    id: &str,
    netns: &std::path::Path,
) -> anyhow::Result<(Duration, serde_json::Value)> {
    let (code, v, took) = cni_raw(socket, command, Some((id, netns)))?;
    anyhow::ensure!(code == 0, "{command} {id}: {v}");
    Ok((took, v))
}

/// One call of the CNI plugin, whatever its outcome: its exit code, its
/// answer (stdout as JSON, `Null` when empty; stderr as a string when
/// stdout is empty and the call failed) and the time it took. `attachment`
/// (container ID, netns) is left out for STATUS.
///
/// # Errors
/// The plugin did not run, or printed something that is not JSON.
pub fn cni_raw(
    socket: &std::path::Path,
    command: &str,
    attachment: Option<(&str, &std::path::Path)>,
) -> anyhow::Result<(i32, serde_json::Value, Duration)> {
    cni_with_args(socket, command, attachment, None)
}

/// As [`cni_raw`], with `CNI_ARGS` set to `args` (kubelet's
/// `K8S_POD_NAMESPACE=..;K8S_POD_NAME=..`) when given.
///
/// # Errors
/// As [`cni_raw`].
pub fn cni_with_args(
    socket: &std::path::Path,
    command: &str,
    attachment: Option<(&str, &std::path::Path)>,
    args: Option<&str>,
) -> anyhow::Result<(i32, serde_json::Value, Duration)> {
    let conf = serde_json::json!({
        "cniVersion": "1.1.0",
        "name": "cluster",
        "type": "lockstep",
        "agentSocket": socket.display().to_string(),
    });
    let started = Instant::now();
    let mut cmd = std::process::Command::new(crate::lockstep_bin());
    cmd.env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("CNI_COMMAND", command)
        .env("CNI_PATH", "/opt/cni/bin")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    if let Some((id, netns)) = attachment {
        cmd.env("CNI_CONTAINERID", id)
            .env("CNI_IFNAME", "eth0")
            .env("CNI_NETNS", netns);
    }
    if let Some(args) = args {
        cmd.env("CNI_ARGS", args);
    }
    let mut child = cmd.spawn()?;
    child
        .stdin
        .take()
        .context("stdin")?
        .write_all(conf.to_string().as_bytes())?;
    let out = child.wait_with_output()?;
    let took = started.elapsed();
    let text = String::from_utf8_lossy(&out.stdout);
    let v = if !text.trim().is_empty() {
        serde_json::from_str(&text).with_context(|| format!("plugin stdout {text:?}"))?
    } else if out.status.success() {
        serde_json::Value::Null
    } else {
        serde_json::Value::String(String::from_utf8_lossy(&out.stderr).into_owned())
    };
    Ok((out.status.code().unwrap_or(-1), v, took))
}

/// A node namespace of its own, with an underlay address (so other nodes'
/// IPs are on link: a veth pair inside it stands in for the uplink) and
/// the etcd forwarder: one agent in cluster mode, no other node's datapath.
///
/// # Errors
/// A link, address, sysctl or the forwarder could not be made.
pub fn lone_node(tag: &str, ip: &str, cluster: &EtcdCluster) -> anyhow::Result<Netns> {
    let ns = Netns::new(tag)?;
    ns.exec(
        "ip",
        ["link", "add", "u0", "type", "veth", "peer", "name", "u1"],
    )?;
    ns.exec("ip", ["link", "set", "u1", "up"])?;
    ns.exec("ip", ["addr", "add", &format!("{ip}/24"), "dev", "u0"])?;
    ns.exec("ip", ["link", "set", "u0", "up"])?;
    ns.exec("sysctl", ["-qw", "net.ipv4.ip_forward=1"])?;
    forward(&ns, cluster)?;
    Ok(ns)
}

/// Polls `done` every 200 ms until it holds, for at most `within`;
/// returns how long it took.
///
/// # Errors
/// `done` failed, or did not hold within `within` (named by `what`).
pub fn poll(
    within: Duration,
    what: &str,
    mut done: impl FnMut() -> anyhow::Result<bool>,
) -> anyhow::Result<Duration> {
    crate::until(within, what, || Ok((!done()?).then(String::new)))
}

/// The node address of node `i` on the underlay of [`ClusterNodes`].
pub fn node_ip(i: usize) -> String {
    format!("10.251.0.{}", i + 1)
}

/// Runs `lockstep cluster --etcd EPS --prefix PREFIX ARGS` and gives its
/// stdout.
///
/// # Errors
/// The command failed (its stderr named).
pub fn cluster_cli(eps: &[String], prefix: &str, args: &[&str]) -> anyhow::Result<String> {
    let out = std::process::Command::new(crate::lockstep_bin())
        .args(["cluster", "--etcd", &eps.join(","), "--prefix", prefix])
        .args(args)
        .output()?;
    anyhow::ensure!(
        out.status.success(),
        "lockstep cluster {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Applies `pools` (a cluster pools file, TOML) under `prefix` with
/// `lockstep cluster pools apply`.
///
/// # Errors
/// The file could not be written or the CLI refused it.
pub fn apply_pools(eps: &[String], prefix: &str, pools: &str) -> anyhow::Result<()> {
    let dir = crate::TempDir::new("cluster-pools")?;
    let file = dir.path().join("pools.toml");
    std::fs::write(&file, pools)?;
    cluster_cli(
        eps,
        prefix,
        &["pools", "apply", "-f", file.to_str().context("path")?],
    )?;
    Ok(())
}

/// The IPv4 address a CNI ADD answered with.
///
/// # Errors
/// The answer holds no address.
pub fn address_of(answer: &serde_json::Value) -> anyhow::Result<IpAddr> {
    let a = answer["ips"][0]["address"]
        .as_str()
        .context("no address in the answer")?;
    Ok(a.parse::<IpNet>()?.addr())
}

/// The metrics of the agent running in `ns` (its default loopback
/// listener there).
///
/// # Errors
/// curl failed.
pub fn metrics_in(ns: &Netns) -> anyhow::Result<String> {
    ns.exec(
        "sh",
        [
            "-c",
            "curl -s http://$(ss -ltnpH | grep '\"lockstep\"' | awk '{print $4}' | head -1)/metrics",
        ],
    )
}

/// The value of the unlabelled metric `name` on the agent in `ns` (see
/// [`metrics_in`]); `None` when it cannot be read or is not there.
pub fn metric_in(ns: &Netns, name: &str) -> Option<f64> {
    sample(&metrics_in(ns).ok()?, name)
}

/// The value of the sample `name` (its whole name, labels included) in a
/// text-format scrape; `None` when it is not there.
pub fn sample(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))?
        .trim()
        .parse()
        .ok()
}

/// Three node namespaces (`node-0`..`node-2`, underlay address
/// [`node_ip`]) whose `u0` sits on the bridge `br0` of an underlay
/// namespace, each running an agent in cluster mode on one etcd.
pub struct ClusterNodes {
    /// The underlay namespace holding the bridge `br0` (attach a
    /// neighbour's veth to it).
    pub underlay: Netns,
    /// The node namespaces.
    pub ns: Vec<Netns>,
    /// The agents, one per node.
    pub agents: Vec<AgentProc>,
    /// The etcd endpoints.
    pub eps: Vec<String>,
    /// The cluster key prefix.
    pub prefix: String,
    /// Each node's forwarder switch (lose etcd's answers at a moment:
    /// [`Cut::mute_on`]).
    pub cuts: Vec<Arc<Cut>>,
}

/// The addresses `agent` holds (every allocation it lists).
///
/// # Errors
/// The allocation list could not be read.
pub fn held_by(agent: &AgentProc) -> anyhow::Result<BTreeSet<IpAddr>> {
    agent
        .json(["allocations", "-o", "json"])?
        .as_array()
        .context("allocations")?
        .iter()
        .map(|x| Ok(x["address"].as_str().context("address")?.parse()?))
        .collect()
}

impl ClusterNodes {
    /// The blocks etcd gives `node`.
    ///
    /// # Errors
    /// As [`ClusterNodes::blocks`].
    pub fn blocks_of(&self, node: &str) -> anyhow::Result<BTreeSet<IpNet>> {
        Ok(self
            .blocks()?
            .into_iter()
            .filter(|(_, o)| o == node)
            .map(|(b, _)| b)
            .collect())
    }

    /// Allocates `count` IPAM-only endpoint addresses on node `i` through
    /// the CLI; returns how many were given (the error that stopped it
    /// printed).
    ///
    /// # Errors
    /// The CLI could not be run.
    pub fn fill(&self, i: usize, tag: &str, count: usize) -> anyhow::Result<usize> {
        for k in 0..count {
            let out = self.agents[i].cli([
                "allocate",
                "--kind",
                "endpoint",
                "--name",
                &format!("{tag}{k}"),
                "--family",
                "ipv4",
            ])?;
            if !out.status.success() {
                eprintln!(
                    "allocate {tag}{k} on node-{i}: {}",
                    String::from_utf8_lossy(&out.stderr)
                );
                return Ok(k);
            }
        }
        Ok(count)
    }

    /// As [`ClusterNodes::build_full`] (no `extra`), then one pod per node
    /// through the CNI plugin (`p-<i>` in a namespace of its own, named
    /// from `tag`): the nodes and the pods' namespaces.
    ///
    /// # Errors
    /// As [`ClusterNodes::build`], or an ADD failed.
    pub fn with_pods(
        cluster: &EtcdCluster,
        prefix: &str,
        pools: &str,
        cluster_extra: &str,
        tag: &str,
    ) -> anyhow::Result<(Self, Vec<Netns>)> {
        let n = Self::build_full(cluster, prefix, pools, cluster_extra, "")?;
        let pods: Vec<Netns> = (0..3)
            .map(|i| Netns::new(&format!("{tag}{i}")))
            .collect::<anyhow::Result<_>>()?;
        for (i, ns) in pods.iter().enumerate() {
            let (_, answer) = cni(&n.agents[i].socket(), "ADD", &format!("p-{i}"), &ns.path())?;
            address_of(&answer)?;
        }
        Ok((n, pods))
    }

    /// Applies `pools` (a cluster pools file) and starts the three nodes.
    ///
    /// # Errors
    /// A namespace, link, forwarder or agent could not be made.
    pub fn build(cluster: &EtcdCluster, prefix: &str, pools: &str) -> anyhow::Result<Self> {
        Self::build_with(cluster, prefix, pools, "")
    }

    /// As [`ClusterNodes::build`], with `extra` (TOML sections, e.g.
    /// `[lb]`) appended to every agent's configuration.
    ///
    /// # Errors
    /// As [`ClusterNodes::build`].
    pub fn build_with(
        cluster: &EtcdCluster,
        prefix: &str,
        pools: &str,
        extra: &str,
    ) -> anyhow::Result<Self> {
        Self::build_full(cluster, prefix, pools, "", extra)
    }

    /// As [`ClusterNodes::build_with`], with `cluster_extra` (keys of the
    /// `[cluster]` section, e.g. `lease_ttl = "3s"`) in every agent's
    /// `[cluster]` section.
    ///
    /// # Errors
    /// As [`ClusterNodes::build`].
    pub fn build_full(
        cluster: &EtcdCluster,
        prefix: &str,
        pools: &str,
        cluster_extra: &str,
        extra: &str,
    ) -> anyhow::Result<Self> {
        Self::build_each(
            cluster,
            prefix,
            pools,
            cluster_extra,
            &|_| extra.to_string(),
            &|_| String::new(),
        )
    }

    /// As [`ClusterNodes::build_full`], with `extra(i)` appended to node
    /// `i`'s configuration and `local_pools(i)` (`[[pools]]` tables; empty
    /// for none) as its own configured pools.
    ///
    /// # Errors
    /// As [`ClusterNodes::build`].
    pub fn build_each(
        cluster: &EtcdCluster,
        prefix: &str,
        pools: &str,
        cluster_extra: &str,
        extra: &dyn Fn(usize) -> String,
        local_pools: &dyn Fn(usize) -> String,
    ) -> anyhow::Result<Self> {
        let eps = cluster.endpoints();
        apply_pools(&eps, prefix, pools)?;
        let underlay = Netns::new("ceul")?;
        underlay.exec("ip", ["link", "add", "br0", "type", "bridge"])?;
        underlay.exec("ip", ["link", "set", "br0", "up"])?;
        let mut ns = Vec::new();
        let mut agents = Vec::new();
        let mut cuts = Vec::new();
        for i in 0..3 {
            let node = Netns::new(&format!("cen{i}"))?;
            let peer = format!("ul{i}");
            node.exec(
                "ip",
                [
                    "link",
                    "add",
                    "u0",
                    "type",
                    "veth",
                    "peer",
                    "name",
                    &peer,
                    "netns",
                    underlay.name(),
                ],
            )?;
            underlay.exec("ip", ["link", "set", &peer, "master", "br0", "up"])?;
            node.exec(
                "ip",
                ["addr", "add", &format!("{}/24", node_ip(i)), "dev", "u0"],
            )?;
            node.exec("ip", ["link", "set", "u0", "up"])?;
            node.exec(
                "sysctl",
                [
                    "-qw",
                    "net.ipv4.ip_forward=1",
                    "net.ipv4.conf.all.rp_filter=0",
                ],
            )?;
            cuts.push(forward(&node, cluster)?);
            let mut base = cluster_config(&eps, prefix, &format!("node-{i}"), &node_ip(i));
            let own = local_pools(i);
            if !own.is_empty() {
                base = base.replacen("pools = []\n", &own, 1);
            }
            let config = format!(
                "reconcile_interval = \"1s\"\n{base}{cluster_extra}[datapath]\nuplink = \"u0\"\n{}",
                extra(i)
            );
            agents.push(AgentProc::start(&node, &config)?);
            ns.push(node);
        }
        Ok(Self {
            underlay,
            ns,
            agents,
            eps,
            prefix: prefix.to_string(),
            cuts,
        })
    }

    /// Runs `lockstep cluster ARGS` against this cluster's etcd and prefix.
    ///
    /// # Errors
    /// As [`cluster_cli`].
    pub fn cli(&self, args: &[&str]) -> anyhow::Result<String> {
        cluster_cli(&self.eps, &self.prefix, args)
    }

    /// Cuts node `i` off from etcd as a network partition does: its
    /// namespace drops every packet to and from the members' ports (the
    /// forwarders listen there on loopback), so the agent's requests time
    /// out, established connections included; the other nodes and the
    /// test still reach etcd. Undone by [`ClusterNodes::heal`] (the table
    /// goes with the namespace otherwise).
    ///
    /// # Errors
    /// nft refused the rules.
    pub fn cut_from_etcd(&self, i: usize) -> anyhow::Result<()> {
        let ports = self
            .eps
            .iter()
            .map(|e| e.rsplit(':').next().unwrap_or_default().to_string())
            .collect::<Vec<_>>()
            .join(", ");
        let rules = format!(
            "table inet lockstep_test_cut {{\n chain out {{\n  type filter hook output priority 0; policy accept;\n  tcp dport {{ {ports} }} drop\n  tcp sport {{ {ports} }} drop\n }}\n}}\n"
        );
        let dir = crate::TempDir::new("cut")?;
        let file = dir.path().join("cut.nft");
        std::fs::write(&file, rules)?;
        self.ns[i].exec("nft", ["-f", file.to_str().context("path")?])?;
        Ok(())
    }

    /// Ends [`ClusterNodes::cut_from_etcd`] for node `i`.
    ///
    /// # Errors
    /// nft refused (the node was not cut).
    pub fn heal(&self, i: usize) -> anyhow::Result<()> {
        self.ns[i].exec("nft", ["delete", "table", "inet", "lockstep_test_cut"])?;
        Ok(())
    }

    /// Every address held by more than one node, with its holders.
    ///
    /// # Errors
    /// A node's allocations could not be read.
    pub fn doubles(&self) -> anyhow::Result<Vec<(IpAddr, Vec<String>)>> {
        Ok(self
            .holders()?
            .into_iter()
            .filter(|(_, o)| o.len() > 1)
            .collect())
    }

    /// Blocks as etcd has them: block → node.
    ///
    /// # Errors
    /// The CLI failed or its JSON was not a block list.
    pub fn blocks(&self) -> anyhow::Result<BTreeMap<IpNet, String>> {
        let v: serde_json::Value = serde_json::from_str(&self.cli(&["blocks", "-o", "json"])?)?;
        v.as_array()
            .context("blocks")?
            .iter()
            .map(|b| {
                Ok((
                    b["cidr"].as_str().context("cidr")?.parse()?,
                    b["node"].as_str().context("node")?.to_string(),
                ))
            })
            .collect()
    }

    /// Node `i`'s agent metrics (the default loopback listener in its
    /// namespace).
    ///
    /// # Errors
    /// curl failed.
    pub fn metrics(&self, i: usize) -> anyhow::Result<String> {
        metrics_in(&self.ns[i])
    }

    /// Every allocation of every running agent: address → owners (to find
    /// doubles).
    ///
    /// # Errors
    /// An agent's allocation list could not be read.
    pub fn holders(&self) -> anyhow::Result<BTreeMap<IpAddr, Vec<String>>> {
        let mut out: BTreeMap<IpAddr, Vec<String>> = BTreeMap::new();
        for (i, a) in self.agents.iter().enumerate() {
            if a.pid().is_none() {
                continue;
            }
            let v = a.json(["allocations", "-o", "json"])?;
            for x in v.as_array().context("allocations")? {
                let addr: IpAddr = x["address"].as_str().context("address")?.parse()?;
                out.entry(addr)
                    .or_default()
                    .push(format!("node-{i}: {}", x["owner"]));
            }
        }
        Ok(out)
    }

    /// Waits (at most `within`) until every running node's routes (protocol
    /// 213, `ip route`) and remote IPCACHE entries (bpftool on the pinned
    /// map) hold exactly the blocks etcd gives the other nodes, each via /
    /// with its node's address, and nothing etcd no longer lists.
    ///
    /// # Errors
    /// Still incomplete after `within`, naming what is missing or extra.
    pub fn wait_remote_within(&self, within: Duration) -> anyhow::Result<()> {
        let started = Instant::now();
        loop {
            let problems = self.remote_problems()?;
            if problems.is_empty() {
                return Ok(());
            }
            anyhow::ensure!(
                started.elapsed() < within,
                "remote state not converged after {within:?}: {problems:?}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// [`ClusterNodes::wait_remote_within`] 15 s.
    ///
    /// # Errors
    /// As [`ClusterNodes::wait_remote_within`].
    pub fn wait_remote(&self) -> anyhow::Result<()> {
        self.wait_remote_within(Duration::from_secs(15))
    }

    fn remote_problems(&self) -> anyhow::Result<Vec<String>> {
        let all = self.blocks()?;
        let mut problems = Vec::new();
        for (i, ns) in self.ns.iter().enumerate() {
            if self.agents[i].pid().is_none() {
                continue;
            }
            let routes = ns.exec("ip", ["-4", "route", "show", "proto", "213"])?;
            let remote = remote_entries(&lpm_v4(&self.agents[i], "IPCACHE_V4")?);
            let mut want_routes = BTreeSet::new();
            for (b, owner) in &all {
                if *owner == format!("node-{i}") {
                    continue;
                }
                let k: usize = owner.trim_start_matches("node-").parse()?;
                let want = format!("{b} via {} dev u0", node_ip(k));
                if !routes.lines().any(|l| l.trim().starts_with(&want)) {
                    problems.push(format!("node-{i} route {want} missing"));
                }
                if remote.get(&b.to_string()) != Some(&node_ip(k)) {
                    problems.push(format!(
                        "node-{i} IPCACHE {b}: {:?}, want remote via {}",
                        remote.get(&b.to_string()),
                        node_ip(k)
                    ));
                }
                want_routes.insert(b.to_string());
            }
            for l in routes.lines() {
                let dst = l.split_whitespace().next().unwrap_or_default();
                if !want_routes.contains(dst) {
                    problems.push(format!("node-{i} route {l:?} not in etcd"));
                }
            }
            for prefix in remote.keys() {
                if !want_routes.contains(prefix) {
                    problems.push(format!("node-{i} remote IPCACHE {prefix} not in etcd"));
                }
            }
        }
        Ok(problems)
    }
}

fn hex_bytes(v: &serde_json::Value) -> Option<Vec<u8>> {
    v.as_array()?
        .iter()
        .map(|b| u8::from_str_radix(b.as_str()?.trim_start_matches("0x"), 16).ok())
        .collect()
}

/// A pinned IPv4 LPM trie of `agent`, read with bpftool: "a.b.c.d/len" →
/// value bytes.
///
/// # Errors
/// bpftool failed or printed something else than a key/value dump.
pub fn lpm_v4(agent: &AgentProc, map: &str) -> anyhow::Result<BTreeMap<String, Vec<u8>>> {
    lpm_v4_at(&agent.pins.path().join("maps").join(map))
}

/// As [`lpm_v4`], the map pinned at `pin` (read while its agent is
/// restarted).
///
/// # Errors
/// As [`lpm_v4`].
pub fn lpm_v4_at(pin: &std::path::Path) -> anyhow::Result<BTreeMap<String, Vec<u8>>> {
    let text = crate::sh(
        "bpftool",
        [
            "-j",
            "map",
            "dump",
            "pinned",
            pin.to_str().context("utf-8")?,
        ],
    )?;
    let v: serde_json::Value = serde_json::from_str(&text)?;
    let mut out = BTreeMap::new();
    for e in v.as_array().context("dump")? {
        let k = hex_bytes(&e["key"]).context("key")?;
        let val = hex_bytes(&e["value"]).context("value")?;
        let len = u32::from_le_bytes(k[..4].try_into()?);
        out.insert(format!("{}.{}.{}.{}/{len}", k[4], k[5], k[6], k[7]), val);
    }
    Ok(out)
}

/// The IPCACHE_V4 entries (from [`lpm_v4`]) flagged remote (bit 6 of the
/// flags word), each with its `node_addr`: prefix → node address.
pub fn remote_entries(ipcache: &BTreeMap<String, Vec<u8>>) -> BTreeMap<String, String> {
    ipcache
        .iter()
        .filter(|(_, v)| {
            v.len() >= 20 && u32::from_le_bytes([v[4], v[5], v[6], v[7]]) & (1 << 6) != 0
        })
        .map(|(k, v)| {
            (
                k.clone(),
                format!("{}.{}.{}.{}", v[16], v[17], v[18], v[19]),
            )
        })
        .collect()
}

/// What [`churn_endpoints`] did.
#[derive(Clone, Copy, Debug)]
pub struct Churned {
    /// IPAM ADDs answered.
    pub adds: u32,
    /// Releases answered.
    pub releases: u32,
    /// How long the churn ran, in seconds.
    pub secs: f64,
    /// ADDs whose answer took over 100 ms.
    pub slow: u32,
}

impl Churned {
    /// Pod events (ADDs and releases) per second.
    pub fn events_per_s(&self) -> f64 {
        f64::from(self.adds + self.releases) / self.secs
    }
}

/// Churns endpoints on `agent` for `window` as short-lived pods do: one
/// IPAM ADD (`lockstep allocate`) every `every`, each released a second
/// after its answer. Endpoints still live at the end are left allocated.
///
/// # Errors
/// An ADD or a release failed (named, with the agent's answer).
pub fn churn_endpoints(
    agent: &AgentProc,
    tag: &str,
    every: Duration,
    window: Duration,
) -> anyhow::Result<Churned> {
    let started = Instant::now();
    let mut live: std::collections::VecDeque<(Instant, String)> = std::collections::VecDeque::new();
    let mut done = Churned {
        adds: 0,
        releases: 0,
        secs: 0.0,
        slow: 0,
    };
    while started.elapsed() < window {
        let due = started + every * done.adds;
        if let Some(wait) = due.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
        let name = format!("{tag}-{}", done.adds);
        let t = Instant::now();
        let out = agent.cli([
            "allocate", "--kind", "endpoint", "--name", &name, "--family", "ipv4",
        ])?;
        anyhow::ensure!(
            out.status.success(),
            "allocate {name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        if t.elapsed() > Duration::from_millis(100) {
            done.slow += 1;
        }
        done.adds += 1;
        live.push_back((Instant::now(), name));
        while live
            .front()
            .is_some_and(|(at, _)| at.elapsed() >= Duration::from_secs(1))
        {
            let (_, old) = live.pop_front().context("front")?;
            let out = agent.cli([
                "release", "--kind", "endpoint", "--name", &old, "--family", "ipv4",
            ])?;
            anyhow::ensure!(
                out.status.success(),
                "release {old}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            done.releases += 1;
        }
    }
    done.secs = started.elapsed().as_secs_f64();
    Ok(done)
}
