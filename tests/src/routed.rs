//! Nodes on two underlay subnets joined by two routers (#30): router 1
//! holds `10.252.1.0/24` + `fd52:1::/64` (bridge `br1`: nodes 0 and 1),
//! router 2 `10.252.2.0/24` + `fd52:2::/64` (bridge `br2`: node 2), and
//! the routers are linked by `mid` (`10.252.0.0/30`, `fd52::/126`), the
//! hop whose MTU a test may reduce. Neither router has a route to any pod
//! block, so native routing cannot cross them; each node's default routes
//! go via its subnet's router.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::cluster::{Cut, apply_pools, forward};
use crate::etcd::EtcdCluster;
use crate::{AgentProc, Netns};

/// The subnet (1 or 2) node `i` lies on.
pub fn subnet(i: usize) -> usize {
    if i < 2 { 1 } else { 2 }
}

/// Node `i`'s IPv4 underlay address.
pub fn node_v4(i: usize) -> String {
    format!("10.252.{}.{}", subnet(i), i + 1)
}

/// Node `i`'s IPv6 underlay address.
pub fn node_v6(i: usize) -> String {
    format!("fd52:{}::{}", subnet(i), i + 1)
}

/// Three nodes on two routed subnets, each running an agent in cluster
/// mode on one etcd.
pub struct RoutedNodes {
    /// Router 1 (bridge `br1`, `10.252.1.254`; node `i`'s underlay port
    /// is `p{i}` on its subnet's router).
    pub router: Netns,
    /// Router 2 (bridge `br2`, `10.252.2.254`).
    pub router2: Netns,
    /// The node namespaces (underlay interface `u0`).
    pub ns: Vec<Netns>,
    /// The agents, one per node.
    pub agents: Vec<AgentProc>,
    /// The etcd endpoints.
    pub eps: Vec<String>,
    /// The cluster key prefix.
    pub prefix: String,
    /// Each node's forwarder switch.
    pub cuts: Vec<Arc<Cut>>,
}

impl RoutedNodes {
    /// Applies `pools` under `prefix` and starts the three nodes, with
    /// `cluster_extra` (keys of `[cluster]`, e.g. `routing = "tunnel"`) in
    /// every agent's `[cluster]` section.
    ///
    /// # Errors
    /// A namespace, link, forwarder or agent could not be made.
    pub fn build(
        cluster: &EtcdCluster,
        prefix: &str,
        pools: &str,
        cluster_extra: &str,
    ) -> anyhow::Result<Self> {
        let eps = cluster.endpoints();
        apply_pools(&eps, prefix, pools)?;
        let router = Netns::new("rtr")?;
        let router2 = Netns::new("rtr2")?;
        let routers = [&router, &router2];
        for (k, r) in routers.iter().enumerate() {
            let s = k + 1;
            let br = format!("br{s}");
            r.ip(["link", "add", &br, "type", "bridge"])?;
            r.ip(["link", "set", &br, "up"])?;
            r.ip(["addr", "add", &format!("10.252.{s}.254/24"), "dev", &br])?;
            r.ip([
                "-6",
                "addr",
                "add",
                &format!("fd52:{s}::fe/64"),
                "dev",
                &br,
                "nodad",
            ])?;
            r.exec(
                "sysctl",
                [
                    "-qw",
                    "net.ipv4.ip_forward=1",
                    "net.ipv6.conf.all.forwarding=1",
                ],
            )?;
        }
        crate::veth(&router, "mid", &router2, "mid")?;
        for (k, r) in routers.iter().enumerate() {
            let (me, other) = (k + 1, 2 - k);
            r.ip(["addr", "add", &format!("10.252.0.{me}/30"), "dev", "mid"])?;
            r.ip([
                "-6",
                "addr",
                "add",
                &format!("fd52::{me}/126"),
                "dev",
                "mid",
                "nodad",
            ])?;
            r.ip([
                "route",
                "add",
                &format!("10.252.{other}.0/24"),
                "via",
                &format!("10.252.0.{other}"),
            ])?;
            r.ip([
                "-6",
                "route",
                "add",
                &format!("fd52:{other}::/64"),
                "via",
                &format!("fd52::{other}"),
            ])?;
        }
        let mut ns = Vec::new();
        let mut agents = Vec::new();
        let mut cuts = Vec::new();
        for i in 0..3 {
            let node = Netns::new(&format!("rn{i}"))?;
            let port = format!("p{i}");
            node.ip([
                "link",
                "add",
                "u0",
                "type",
                "veth",
                "peer",
                "name",
                &port,
                "netns",
                routers[subnet(i) - 1].name(),
            ])?;
            routers[subnet(i) - 1].ip([
                "link",
                "set",
                &port,
                "master",
                &format!("br{}", subnet(i)),
                "up",
            ])?;
            node.ip(["addr", "add", &format!("{}/24", node_v4(i)), "dev", "u0"])?;
            node.ip([
                "-6",
                "addr",
                "add",
                &format!("{}/64", node_v6(i)),
                "dev",
                "u0",
                "nodad",
            ])?;
            node.ip(["link", "set", "u0", "up"])?;
            let s = subnet(i);
            node.ip(["route", "add", "default", "via", &format!("10.252.{s}.254")])?;
            node.ip([
                "-6",
                "route",
                "add",
                "default",
                "via",
                &format!("fd52:{s}::fe"),
            ])?;
            node.exec(
                "sysctl",
                [
                    "-qw",
                    "net.ipv4.ip_forward=1",
                    "net.ipv6.conf.all.forwarding=1",
                    "net.ipv4.conf.all.rp_filter=0",
                ],
            )?;
            cuts.push(forward(&node, cluster)?);
            let eps_list = eps
                .iter()
                .map(|e| format!("\"{e}\""))
                .collect::<Vec<_>>()
                .join(", ");
            let config = format!(
                "reconcile_interval = \"1s\"\npools = []\n[cluster]\netcd = [{eps_list}]\nprefix = \"{prefix}\"\nnode_name = \"node-{i}\"\nnode_ip_v4 = \"{}\"\nnode_ip_v6 = \"{}\"\n{cluster_extra}[datapath]\nuplink = \"u0\"\n",
                node_v4(i),
                node_v6(i),
            );
            agents.push(AgentProc::start(&node, &config)?);
            ns.push(node);
        }
        Ok(Self {
            router,
            router2,
            ns,
            agents,
            eps,
            prefix: prefix.to_string(),
            cuts,
        })
    }

    /// The remote IPCACHE prefix entries of node `i` (both families):
    /// prefix → value, read through its pinned maps.
    ///
    /// # Errors
    /// The maps could not be opened or read.
    pub fn remote_entries(
        &self,
        i: usize,
    ) -> anyhow::Result<std::collections::BTreeMap<ipnet::IpNet, lockstep_common::IpcacheValue>>
    {
        let maps = lockstep::datapath::PinnedMaps::open(self.agents[i].pins.path())?;
        let mut out = std::collections::BTreeMap::new();
        for kv in maps.ipcache_v4().iter() {
            let (k, v) = kv?;
            let net = ipnet::Ipv4Net::new(k.data().into(), k.prefix_len() as u8)?;
            out.insert(ipnet::IpNet::V4(net), v);
        }
        for kv in maps.ipcache_v6().iter() {
            let (k, v) = kv?;
            let net = ipnet::Ipv6Net::new(k.data().into(), k.prefix_len() as u8)?;
            out.insert(ipnet::IpNet::V6(net), v);
        }
        out.retain(|_, v| v.flags & lockstep_common::ipcache_flags::REMOTE != 0);
        Ok(out)
    }

    /// Sets the MTU of the link between the routers (both ends).
    ///
    /// # Errors
    /// `ip link` failed.
    pub fn narrow_mid(&self, mtu: u32) -> anyhow::Result<()> {
        for r in [&self.router, &self.router2] {
            r.ip(["link", "set", "mid", "mtu", &mtu.to_string()])?;
        }
        Ok(())
    }

    /// Waits (at most `within`) until `ok(i, remote entries of node i)`
    /// holds for every node.
    ///
    /// # Errors
    /// Still not after `within`, with the last reason.
    pub fn wait_remote(
        &self,
        within: Duration,
        ok: impl Fn(
            usize,
            &std::collections::BTreeMap<ipnet::IpNet, lockstep_common::IpcacheValue>,
        ) -> Result<(), String>,
    ) -> anyhow::Result<()> {
        let started = Instant::now();
        loop {
            let mut last = Ok(());
            for i in 0..self.agents.len() {
                last = ok(i, &self.remote_entries(i)?);
                if last.is_err() {
                    break;
                }
            }
            match last {
                Ok(()) => return Ok(()),
                Err(why) => anyhow::ensure!(
                    started.elapsed() < within,
                    "remote IPCACHE not as expected after {within:?}: {why}"
                ),
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}
